// RMSNorm: hand-computed values, scale invariance, finite-difference gradients, float vs double.
#include "megatrain/kernels/cpu/rmsnorm.h"

#include "test_util.h"

namespace megatrain::cpu {
namespace {

using testing::expect_gradient_matches;
using testing::random_vec;

TEST(RmsNorm, ForwardOfAKnownVector) {
  CpuContext ctx;
  // mean(x^2) = 30 / 4 = 7.5, rstd = 1 / sqrt(7.5) = 0.365148371670110...
  const std::vector<double> x = {1, 2, 3, 4}, w = {0.5, 1, 2, -1};
  std::vector<double> y(4), rstd(1);
  rmsnorm_forward(ctx, x.data(), w.data(), 1, 4, 0.0, y.data(), rstd.data());
  EXPECT_NEAR(rstd[0], 0.36514837167011072, 1e-16);
  const double expect[4] = {0.18257418583505536, 0.73029674334022143, 2.1908902300206643, -1.4605934866804429};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[i], expect[i], 1e-15) << i;

  // eps enters under the square root: rstd = 1 / sqrt(7.5 + 0.5) = 1/sqrt(8).
  rmsnorm_forward(ctx, x.data(), w.data(), 1, 4, 0.5, y.data(), rstd.data());
  EXPECT_NEAR(rstd[0], 0.35355339059327373, 1e-16);

  std::vector<float> xf = {1, 2, 3, 4}, wf = {0.5f, 1, 2, -1}, yf(4), rf(1);
  rmsnorm_forward(ctx, xf.data(), wf.data(), 1, 4, 0.0, yf.data(), rf.data());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(yf[i], expect[i], 3e-7) << i;
}

TEST(RmsNorm, RowsAreIndependentAndScaleInvariant) {
  CpuContext ctx;
  const int64_t dim = 37;
  std::vector<double> x = random_vec(2 * dim, 1), w = random_vec(dim, 2);
  for (int64_t i = 0; i < dim; ++i) x[dim + i] = 3.5 * x[i];  // row 1 = 3.5 * row 0
  std::vector<double> y(2 * dim), rstd(2);
  rmsnorm_forward(ctx, x.data(), w.data(), 2, dim, 0.0, y.data(), rstd.data());
  for (int64_t i = 0; i < dim; ++i) EXPECT_NEAR(y[dim + i], y[i], 1e-14) << i;
  EXPECT_NEAR(rstd[0], 3.5 * rstd[1], 1e-14);
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  CpuContext ctx;
  const int64_t n = 3, dim = 21;  // 21: one full lane block and a tail
  const double eps = 1e-5;
  std::vector<double> x = random_vec(n * dim, 11), w = random_vec(dim, 12, 0.5, 1.5), g = random_vec(n * dim, 13);
  std::vector<double> y(n * dim), rstd(n);
  auto loss = [&] {
    rmsnorm_forward(ctx, x.data(), w.data(), n, dim, eps, y.data(), rstd.data());
    return testing::inner(y, g);
  };
  loss();
  std::vector<double> dx(n * dim), dw_before = random_vec(dim, 14), dw = dw_before;
  rmsnorm_backward(ctx, g.data(), x.data(), w.data(), rstd.data(), n, dim, dx.data(), dw.data());
  std::vector<double> dw_added(dim);
  for (int64_t i = 0; i < dim; ++i) dw_added[i] = dw[i] - dw_before[i];  // dw is accumulated
  expect_gradient_matches("rmsnorm dx", x, dx, loss);
  expect_gradient_matches("rmsnorm dw", w, dw_added, loss);
}

TEST(RmsNorm, BackwardInPlaceEqualsOutOfPlace) {
  CpuContext ctx;
  const int64_t n = 4, dim = 19;
  std::vector<double> x = random_vec(n * dim, 21), w = random_vec(dim, 22), g = random_vec(n * dim, 23);
  std::vector<double> y(n * dim), rstd(n);
  rmsnorm_forward(ctx, x.data(), w.data(), n, dim, 1e-6, y.data(), rstd.data());
  std::vector<double> dx(n * dim), dw1(dim), dw2(dim), g2 = g;
  rmsnorm_backward(ctx, g.data(), x.data(), w.data(), rstd.data(), n, dim, dx.data(), dw1.data());
  rmsnorm_backward(ctx, g2.data(), x.data(), w.data(), rstd.data(), n, dim, g2.data(), dw2.data());
  EXPECT_EQ(dx, g2);
  EXPECT_EQ(dw1, dw2);
}

TEST(RmsNorm, FloatAgreesWithDouble) {
  CpuContext ctx;
  const int64_t n = 5, dim = 256;
  const std::vector<double> x = random_vec(n * dim, 31), w = random_vec(dim, 32), g = random_vec(n * dim, 33);
  std::vector<double> y(n * dim), r(n), dx(n * dim), dw(dim);
  rmsnorm_forward(ctx, x.data(), w.data(), n, dim, 1e-5, y.data(), r.data());
  rmsnorm_backward(ctx, g.data(), x.data(), w.data(), r.data(), n, dim, dx.data(), dw.data());
  const auto xf = testing::to_float(x), wf = testing::to_float(w), gf = testing::to_float(g);
  std::vector<float> yf(n * dim), rf(n), dxf(n * dim), dwf(dim);
  rmsnorm_forward(ctx, xf.data(), wf.data(), n, dim, 1e-5, yf.data(), rf.data());
  rmsnorm_backward(ctx, gf.data(), xf.data(), wf.data(), rf.data(), n, dim, dxf.data(), dwf.data());
  // fp32 rounding of O(dim) operations: a few 1e-7, bounded at 1e-5.
  EXPECT_LT(testing::max_rel_error(yf, y), 1e-5);
  EXPECT_LT(testing::max_rel_error(dxf, dx), 1e-5);
  EXPECT_LT(testing::max_rel_error(dwf, dw), 1e-5);
}

}  // namespace
}  // namespace megatrain::cpu

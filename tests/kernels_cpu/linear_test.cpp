// Linear and gemm: hand values, a naive triple loop for every transpose case, finite differences.
#include "megatrain/kernels/cpu/linear.h"

#include <cmath>
#include <limits>

#include "test_util.h"

namespace megatrain::cpu {
namespace {

using testing::random_vec;

TEST(Linear, ForwardHandValues) {
  CpuContext ctx;
  // y = b + x W^T with x = [[1,2,3],[4,5,6]], W = [[1,0,-1],[2,1,0]], b = [0.5, -1]
  const std::vector<double> x = {1, 2, 3, 4, 5, 6}, w = {1, 0, -1, 2, 1, 0}, b = {0.5, -1};
  std::vector<double> y(4);
  linear_forward(ctx, x.data(), w.data(), b.data(), 2, 3, 2, y.data());
  EXPECT_EQ(y, (std::vector<double>{-1.5, 3, -1.5, 12}));
  linear_forward(ctx, x.data(), w.data(), static_cast<const double*>(nullptr), 2, 3, 2, y.data());
  EXPECT_EQ(y, (std::vector<double>{-2, 4, -2, 13}));
  std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end()), bf(b.begin(), b.end()), yf(4);
  linear_forward(ctx, xf.data(), wf.data(), bf.data(), 2, 3, 2, yf.data());
  EXPECT_EQ(yf, (std::vector<float>{-1.5f, 3, -1.5f, 12}));
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  CpuContext ctx;
  const int64_t n = 5, in = 7, out = 6;
  std::vector<double> x = random_vec(n * in, 1), w = random_vec(out * in, 2), b = random_vec(out, 3),
                      g = random_vec(n * out, 4), y(n * out);
  auto loss = [&] {
    linear_forward(ctx, x.data(), w.data(), b.data(), n, in, out, y.data());
    return testing::inner(y, g);
  };
  std::vector<double> dx(n * in, std::nan("")), dw0 = random_vec(out * in, 5), db0 = random_vec(out, 6);
  std::vector<double> dw = dw0, db = db0;
  linear_backward(ctx, g.data(), x.data(), w.data(), n, in, out, dx.data(), false, dw.data(), db.data());
  for (size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0[i];  // dw and db are accumulated
  for (size_t i = 0; i < db.size(); ++i) db[i] -= db0[i];
  testing::expect_gradient_matches("linear dx", x, dx, loss);
  testing::expect_gradient_matches("linear dW", w, dw, loss);
  testing::expect_gradient_matches("linear db", b, db, loss);

  // accumulate_dx adds dy W to what is there.
  std::vector<double> acc = random_vec(n * in, 7), base = acc;
  linear_backward(ctx, g.data(), x.data(), w.data(), n, in, out, acc.data(), true, static_cast<double*>(nullptr),
                  static_cast<double*>(nullptr));
  for (size_t i = 0; i < acc.size(); ++i) EXPECT_NEAR(acc[i], base[i] + dx[i], 1e-14);
}

// C = alpha op(A) op(B) + beta C, by the definition.
void naive_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const std::vector<double>& a,
                int64_t lda, const std::vector<double>& b, int64_t ldb, double beta, std::vector<double>& c,
                int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += (ta ? a[l * lda + i] : a[i * lda + l]) * (tb ? b[j * ldb + l] : b[l * ldb + j]);
      c[i * ldc + j] = alpha * s + (beta == 0 ? 0 : beta * c[i * ldc + j]);
    }
}

TEST(Gemm, EveryTransposeAndStrideMatchesTheDefinition) {
  for (int threads : {1, 2}) {
    CpuContext ctx(threads);
    for (auto [m, n, k] : {std::tuple{50, 37, 29}, std::tuple{200, 101, 64}, std::tuple{3, 130, 5}}) {
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
        const auto a = random_vec(static_cast<size_t>((ta ? k : m) * lda), 10 + t);
        const auto b = random_vec(static_cast<size_t>((tb ? n : k) * ldb), 20 + t);
        for (double beta : {0.0, 1.0, -0.5}) {
          std::vector<double> c = random_vec(static_cast<size_t>(m * ldc), 30 + t);
          if (beta == 0) std::fill(c.begin(), c.end(), std::numeric_limits<double>::quiet_NaN());
          std::vector<double> expect = c;
          naive_gemm(ta, tb, m, n, k, 0.75, a, lda, b, ldb, beta, expect, ldc);
          gemm(ctx, ta, tb, m, n, k, 0.75, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              ASSERT_NEAR(c[i * ldc + j], expect[i * ldc + j], 1e-12)
                  << "threads " << threads << " m " << m << " n " << n << " k " << k << " ta " << ta << " tb "
                  << tb << " beta " << beta << " at " << i << "," << j;
          // Padding columns of C are never written.
          if (beta != 0) {
            for (int64_t i = 0; i < m; ++i) EXPECT_EQ(c[i * ldc + n], expect[i * ldc + n]);
          }
        }
      }
    }
  }
}

TEST(Gemm, EmptyDepthScalesC) {
  CpuContext ctx;
  std::vector<double> c = {1, 2, 3, 4};
  gemm(ctx, false, false, 2, 2, 0, 1.0, static_cast<const double*>(nullptr), 0,
       static_cast<const double*>(nullptr), 2, 2.0, c.data(), 2);
  EXPECT_EQ(c, (std::vector<double>{2, 4, 6, 8}));
}

TEST(Linear, FloatAgreesWithDoubleAtModelShapes) {
  CpuContext ctx(2);
  const int64_t n = 130, in = 96, out = 200;
  const auto x = random_vec(n * in, 51), w = random_vec(out * in, 52), g = random_vec(n * out, 53);
  std::vector<double> y(n * out), dx(n * in), dw(out * in);
  linear_forward(ctx, x.data(), w.data(), static_cast<const double*>(nullptr), n, in, out, y.data());
  linear_backward(ctx, g.data(), x.data(), w.data(), n, in, out, dx.data(), false, dw.data(),
                  static_cast<double*>(nullptr));
  const auto xf = testing::to_float(x), wf = testing::to_float(w), gf = testing::to_float(g);
  std::vector<float> yf(n * out), dxf(n * in), dwf(out * in);
  linear_forward(ctx, xf.data(), wf.data(), static_cast<const float*>(nullptr), n, in, out, yf.data());
  linear_backward(ctx, gf.data(), xf.data(), wf.data(), n, in, out, dxf.data(), false, dwf.data(),
                  static_cast<float*>(nullptr));
  EXPECT_LT(testing::max_rel_error(yf, y), 1e-5);
  EXPECT_LT(testing::max_rel_error(dxf, dx), 1e-5);
  EXPECT_LT(testing::max_rel_error(dwf, dw), 1e-5);
}

}  // namespace
}  // namespace megatrain::cpu

// SwiGLU: hand values of silu, finite differences, float vs double, extreme inputs.
#include "megatrain/kernels/cpu/swiglu.h"

#include <cmath>

#include "test_util.h"

namespace megatrain::cpu {
namespace {

TEST(SwiGlu, HandValues) {
  CpuContext ctx;
  // silu(0) = 0, silu(1) = 1 / (1 + e^-1) = 0.7310585786300049, silu(-2) = -2 / (1 + e^2)
  const std::vector<double> g = {0, 1, -2, 1}, u = {5, 2, 1, -1};
  std::vector<double> out(4);
  swiglu_forward(ctx, g.data(), u.data(), 4, out.data());
  EXPECT_EQ(out[0], 0.0);
  EXPECT_NEAR(out[1], 2 * 0.7310585786300049, 1e-15);
  EXPECT_NEAR(out[2], -2 / (1 + std::exp(2.0)), 1e-16);
  EXPECT_NEAR(out[3], -0.7310585786300049, 1e-16);
}

TEST(SwiGlu, SaturatesWithoutNaN) {
  CpuContext ctx;
  const std::vector<float> g = {-1000, 1000, -90, 90}, u = {1, 1, 1, 1}, d = {1, 1, 1, 1};
  std::vector<float> out(4), dg(4), du(4);
  swiglu_forward(ctx, g.data(), u.data(), 4, out.data());
  swiglu_backward(ctx, g.data(), u.data(), d.data(), 4, dg.data(), du.data());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 1000.0f);
  EXPECT_EQ(dg[0], 0.0f);
  EXPECT_EQ(dg[1], 1.0f);
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(std::isnan(dg[i]) || std::isnan(du[i])) << i;
}

TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  CpuContext ctx;
  const int64_t n = 40;
  std::vector<double> g = testing::random_vec(n, 1, -4, 4), u = testing::random_vec(n, 2),
                      d = testing::random_vec(n, 3), out(n), dg(n), du(n);
  swiglu_backward(ctx, g.data(), u.data(), d.data(), n, dg.data(), du.data());
  auto loss = [&] {
    swiglu_forward(ctx, g.data(), u.data(), n, out.data());
    return testing::inner(out, d);
  };
  testing::expect_gradient_matches("swiglu dgate", g, dg, loss);
  testing::expect_gradient_matches("swiglu dup", u, du, loss);
}

TEST(SwiGlu, FloatAgreesWithDoubleAndInPlaceWorks) {
  CpuContext ctx(2);
  const int64_t n = 70000;  // several chunks
  const auto g = testing::random_vec(n, 4, -6, 6), u = testing::random_vec(n, 5), d = testing::random_vec(n, 6);
  std::vector<double> out(n), dg(n), du(n);
  swiglu_forward(ctx, g.data(), u.data(), n, out.data());
  swiglu_backward(ctx, g.data(), u.data(), d.data(), n, dg.data(), du.data());
  auto gf = testing::to_float(g), uf = testing::to_float(u), df = testing::to_float(d);
  std::vector<float> of(n), dgf(n), duf(n);
  swiglu_forward(ctx, gf.data(), uf.data(), n, of.data());
  swiglu_backward(ctx, gf.data(), uf.data(), df.data(), n, dgf.data(), duf.data());
  EXPECT_LT(testing::max_rel_error(of, out), 1e-6);
  EXPECT_LT(testing::max_rel_error(dgf, dg), 1e-6);
  EXPECT_LT(testing::max_rel_error(duf, du), 1e-6);
  swiglu_backward(ctx, gf.data(), uf.data(), df.data(), n, gf.data(), uf.data());  // in place
  EXPECT_EQ(gf, dgf);
  EXPECT_EQ(uf, duf);
}

}  // namespace
}  // namespace megatrain::cpu

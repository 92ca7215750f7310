// SwiGLU: hand values of silu, finite differences, float vs double, extreme inputs.
#include "megatrain/kernels/cpu/swiglu.h"

#include <cmath>
#include <cstdio>
#include <limits>

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

// The float path's exp is the kernels' own (detail::exp_fast: vectorised, the same bits on every
// instruction set): silu in float over [-100, 100] against the double path, every 1/4096, within
// 3 float ulps of the value (measured: 2.19 ulps at most, the exp's error plus two roundings); NaN
// stays NaN and infinities saturate as std::exp's would.
TEST(SwiGlu, FloatSiluIsWithinThreeUlpsOverTheWholeRange) {
  CpuContext ctx(2);
  const int64_t n = 200 * 4096 + 1;
  std::vector<float> g(n), u(n, 1.0f), out(n);
  for (int64_t i = 0; i < n; ++i) g[i] = -100.0f + static_cast<float>(i) / 4096.0f;
  swiglu_forward(ctx, g.data(), u.data(), n, out.data());
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i], ref = x / (1 + std::exp(-x));
    const double ulp = std::max(std::abs(ref), 1e-30) * 0x1p-23;
    worst = std::max(worst, std::abs(out[i] - ref) / ulp);
  }
  std::printf("silu in float: at most %.2f ulps from the double path\n", worst);
  EXPECT_LE(worst, 3.0);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> gs = {nan, inf, -inf, 88.5f, -88.5f}, us(5, 1.0f);
  std::vector<float> os(5);
  swiglu_forward(ctx, gs.data(), us.data(), 5, os.data());
  EXPECT_TRUE(std::isnan(os[0]));
  EXPECT_EQ(os[1], inf);
  EXPECT_TRUE(std::isnan(os[2]) || os[2] == 0.0f);  // -inf / (1 + inf)
  EXPECT_EQ(os[3], 88.5f);
  EXPECT_NEAR(os[4], -88.5 / (1 + std::exp(88.5)), 1e-40);
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

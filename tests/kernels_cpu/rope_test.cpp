// RoPE: inv_freq rules (default, linear, llama3) against hand values, identity at position 0, a hand
// rotation, relative-position property, inverse, finite differences, unsupported configs.
#include "megatrain/kernels/cpu/rope.h"

#include <cmath>

#include "test_util.h"

namespace megatrain::cpu {
namespace {

using testing::random_vec;

std::vector<double> inv_freq(const RopeConfig& c) {
  auto r = rope_inv_freq<double>(c);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : std::vector<double>{};
}

TEST(Rope, DefaultInverseFrequencies) {
  RopeConfig c;
  c.head_dim = 8;
  c.theta = 10000;
  const auto inv = inv_freq(c);  // 10000^(-0/8, -2/8, -4/8, -6/8)
  ASSERT_EQ(inv.size(), 4u);
  EXPECT_DOUBLE_EQ(inv[0], 1.0);
  EXPECT_NEAR(inv[1], 0.1, 1e-16);
  EXPECT_NEAR(inv[2], 0.01, 1e-17);
  EXPECT_NEAR(inv[3], 0.001, 1e-18);
}

TEST(Rope, LinearScalingDividesTheFrequencies) {
  RopeConfig c;
  c.head_dim = 8;
  c.scaling = RopeScaling::kLinear;
  c.factor = 4;
  const auto inv = inv_freq(c);
  EXPECT_NEAR(inv[0], 0.25, 1e-17);
  EXPECT_NEAR(inv[2], 0.0025, 1e-18);
}

TEST(Rope, Llama3ScalingMatchesHandValues) {
  // Llama 3.1: theta 500000, head_dim 128, factor 8, low 1, high 4, original context 8192, so
  // wavelengths below 2048 stay, above 8192 are divided by 8, in between are interpolated.
  RopeConfig c;
  c.head_dim = 128;
  c.theta = 500000;
  c.scaling = RopeScaling::kLlama3;
  c.factor = 8;
  c.low_freq_factor = 1;
  c.high_freq_factor = 4;
  c.original_max_position_embeddings = 8192;
  const auto inv = inv_freq(c);
  ASSERT_EQ(inv.size(), 64u);
  EXPECT_DOUBLE_EQ(inv[0], 1.0);                                 // high frequency, kept
  EXPECT_NEAR(inv[28], 0.003211445994752591, 1e-17);             // wavelength 1956 < 2048: kept
  EXPECT_NEAR(inv[29], 0.002166570763503359, 1e-17);             // 2402: interpolated
  EXPECT_NEAR(inv[34], 0.0001785078127679964, 1e-18);            // 6695: interpolated
  EXPECT_NEAR(inv[35], 0.0007644969883171747 / 8, 1e-18);        // 8219 > 8192: divided by 8
  EXPECT_NEAR(inv[63], 2.455140791131609e-06 / 8, 1e-20);
  // The fp32 path follows the same rules, rounded to fp32.
  auto f = rope_inv_freq<float>(c);
  ASSERT_TRUE(f.ok());
  for (size_t i = 0; i < 64; ++i) EXPECT_NEAR(f.value()[i], inv[i], 2e-6 * inv[i]) << i;
}

// gpt-oss-120b's yarn (head_dim 64, theta 150000, factor 32, original context 4096, beta 32/1,
// truncate false): the correction range is [8.0928, 17.3980]; below it the frequencies stay, above
// it they are divided by the factor, in between they blend. Expected values computed by hand from
// HF's _compute_yarn_parameters formulas in Python doubles.
TEST(Rope, YarnAsGptOssConfiguresIt) {
  RopeConfig c;
  c.head_dim = 64;
  c.theta = 150000;
  c.scaling = RopeScaling::kYarn;
  c.factor = 32;
  c.original_max_position_embeddings = 4096;
  c.beta_fast = 32;
  c.beta_slow = 1;
  c.truncate = false;
  auto inv = rope_inv_freq<double>(c);
  ASSERT_TRUE(inv.ok()) << inv.status().to_string();
  const std::pair<int, double> expected[] = {{0, 1.0}, {5, 0.15532298948448497}, {10, 0.019335001126540362},
                                             {16, 0.00045648391922324086}, {20, 1.818833668168956e-05},
                                             {31, 3.0235114281192144e-07}};
  for (const auto& [i, v] : expected) EXPECT_NEAR(inv.value()[static_cast<size_t>(i)], v, 1e-14 * v) << i;
  EXPECT_DOUBLE_EQ(rope_attention_scaling(c), 0.1 * std::log(32.0) + 1);  // 1.34657...
  c.attention_factor = 1.25;
  EXPECT_DOUBLE_EQ(rope_attention_scaling(c), 1.25);
  // truncate rounds the range out to [8, 18]: index 17 blends instead of being divided fully.
  c.truncate = true;
  auto t = rope_inv_freq<double>(c);
  ASSERT_TRUE(t.ok());
  const double pf17 = std::pow(150000.0, 34.0 / 64), ramp = (17 - 8.0) / (18 - 8.0);
  EXPECT_NEAR(t.value()[17], 1 / (32 * pf17) * ramp + 1 / pf17 * (1 - ramp), 1e-14 / pf17);
  auto f = rope_inv_freq<float>(c);
  ASSERT_TRUE(f.ok());
  for (size_t i = 0; i < 32; ++i) EXPECT_NEAR(f.value()[i], t.value()[i], 2e-6 * t.value()[i]) << i;
  EXPECT_DOUBLE_EQ(rope_attention_scaling(RopeConfig{}), 1.0);
}

TEST(Rope, RefusesUnsupportedAndInvalidConfigs) {
  EXPECT_EQ(parse_rope_scaling_type("yarn").value(), RopeScaling::kYarn);
  for (const char* t : {"dynamic", "longrope", "su"}) {
    auto r = parse_rope_scaling_type(t);
    ASSERT_FALSE(r.ok()) << t;
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(r.status().message().find(t), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(parse_rope_scaling_type("").value(), RopeScaling::kNone);
  EXPECT_EQ(parse_rope_scaling_type("default").value(), RopeScaling::kNone);
  EXPECT_EQ(parse_rope_scaling_type("linear").value(), RopeScaling::kLinear);
  EXPECT_EQ(parse_rope_scaling_type("llama3").value(), RopeScaling::kLlama3);

  RopeConfig odd;
  odd.head_dim = 7;
  EXPECT_EQ(rope_inv_freq<double>(odd).status().code(), StatusCode::kInvalidArgument);
  RopeConfig bad_llama3;
  bad_llama3.head_dim = 8;
  bad_llama3.scaling = RopeScaling::kLlama3;
  bad_llama3.factor = 8;
  bad_llama3.low_freq_factor = 4;
  bad_llama3.high_freq_factor = 4;  // would divide by zero
  EXPECT_EQ(rope_inv_freq<float>(bad_llama3).status().code(), StatusCode::kInvalidArgument);
}

TEST(Rope, PositionZeroIsTheIdentity) {
  CpuContext ctx;
  RopeConfig c;
  c.head_dim = 16;
  const auto inv = inv_freq(c);
  const std::vector<double> x = random_vec(3 * 16, 5);
  std::vector<double> y(x.size());
  const std::vector<int32_t> pos = {0};
  rope_forward(ctx, x.data(), y.data(), pos.data(), 1, 3, 16, inv.data());
  EXPECT_EQ(y, x);  // cos 0 = 1, sin 0 = 0: bit-exact
}

TEST(Rope, KnownAngleIsAHandRotation) {
  // head_dim 4, theta 10000: inv_freq = [1, 0.01]; position 1 rotates the pair (x0, x2) by 1 rad and
  // (x1, x3) by 0.01 rad (HF pairs i with i + d/2):
  //   out0 = 1 cos 1 - 3 sin 1,  out2 = 3 cos 1 + 1 sin 1, and likewise with 0.01 for (2, 4).
  CpuContext ctx;
  RopeConfig c;
  c.head_dim = 4;
  const auto inv = inv_freq(c);
  const std::vector<double> x = {9, 9, 9, 9, 1, 2, 3, 4};  // token 0 at position 0, token 1 at position 1
  const std::vector<int32_t> pos = {0, 1};
  std::vector<double> y(8);
  rope_forward(ctx, x.data(), y.data(), pos.data(), 2, 1, 4, inv.data());
  EXPECT_NEAR(y[4], -1.9841106485555495, 1e-15);
  EXPECT_NEAR(y[5], 1.959900667496664, 1e-15);
  EXPECT_NEAR(y[6], 2.4623779024123156, 1e-15);
  EXPECT_NEAR(y[7], 4.019799668334994, 1e-15);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y[i], 9.0);

  std::vector<float> xf(x.begin(), x.end()), yf(8);
  auto invf = rope_inv_freq<float>(c);
  rope_forward(ctx, xf.data(), yf.data(), pos.data(), 2, 1, 4, invf.value().data());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(yf[i], y[i], 1e-6) << i;
}

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  CpuContext ctx;
  RopeConfig c;
  c.head_dim = 32;
  const auto inv = inv_freq(c);
  const std::vector<double> q = random_vec(32, 7), k = random_vec(32, 8);
  auto score = [&](int32_t pq, int32_t pk) {
    std::vector<double> qr(32), kr(32);
    rope_forward(ctx, q.data(), qr.data(), &pq, 1, 1, 32, inv.data());
    rope_forward(ctx, k.data(), kr.data(), &pk, 1, 1, 32, inv.data());
    return testing::inner(qr, kr);
  };
  EXPECT_NEAR(score(5, 2), score(13, 10), 1e-12);
  EXPECT_NEAR(score(100, 0), score(1100, 1000), 1e-11);
}

TEST(Rope, BackwardInvertsForwardAndMatchesFiniteDifferences) {
  CpuContext ctx(2);
  RopeConfig c;
  c.head_dim = 8;
  c.theta = 100;
  const auto inv = inv_freq(c);
  const int64_t n = 5, heads = 3, hd = 8;
  std::vector<double> x = random_vec(n * heads * hd, 41), g = random_vec(n * heads * hd, 42);
  const std::vector<int32_t> pos = {0, 1, 2, 7, 31};
  std::vector<double> y(x.size()), back(x.size());
  rope_forward(ctx, x.data(), y.data(), pos.data(), n, heads, hd, inv.data());
  rope_backward(ctx, y.data(), back.data(), pos.data(), n, heads, hd, inv.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 1e-15) << i;  // orthogonal: R^T R = I

  std::vector<double> dx(x.size());
  rope_backward(ctx, g.data(), dx.data(), pos.data(), n, heads, hd, inv.data());
  testing::expect_gradient_matches("rope dx", x, dx, [&] {
    rope_forward(ctx, x.data(), y.data(), pos.data(), n, heads, hd, inv.data());
    return testing::inner(y, g);
  });

  // In place equals out of place.
  std::vector<double> inplace = x;
  rope_forward(ctx, inplace.data(), inplace.data(), pos.data(), n, heads, hd, inv.data());
  rope_forward(ctx, x.data(), y.data(), pos.data(), n, heads, hd, inv.data());
  EXPECT_EQ(inplace, y);
}

}  // namespace
}  // namespace megatrain::cpu

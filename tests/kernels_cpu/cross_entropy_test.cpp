// Cross-entropy: uniform logits give log V, a hand two-class case, ignored rows, huge logits,
// finite differences, in-place backward, bad targets.
#include "megatrain/kernels/cpu/cross_entropy.h"

#include <cmath>

#include "test_util.h"

namespace megatrain::cpu {
namespace {

TEST(CrossEntropy, UniformLogitsGiveLogV) {
  CpuContext ctx;
  const int64_t n = 3, vocab = 50;
  const std::vector<double> logits(n * vocab, 0.7);
  const std::vector<int32_t> t = {0, 17, 49};
  std::vector<double> lse(n), loss(n);
  CrossEntropyStats st;
  ASSERT_TRUE(cross_entropy_forward(ctx, logits.data(), t.data(), n, vocab, lse.data(), loss.data(), &st).ok());
  for (int64_t r = 0; r < n; ++r) EXPECT_NEAR(loss[r], std::log(50.0), 1e-14);
  EXPECT_EQ(st.count, 3);
  EXPECT_NEAR(st.mean(), std::log(50.0), 1e-14);
  EXPECT_NEAR(lse[0], 0.7 + std::log(50.0), 1e-14);
}

TEST(CrossEntropy, HandTwoClassCaseAndIgnoredRows) {
  // logits [0, ln 3]: softmax [1/4, 3/4]; target 1 -> loss -ln(3/4); target 0 -> ln 4.
  CpuContext ctx;
  const std::vector<double> logits = {0, std::log(3.0), 0, std::log(3.0), 5, -5};
  const std::vector<int32_t> t = {1, 0, kIgnoreIndex};
  std::vector<double> lse(3), loss(3);
  CrossEntropyStats st;
  ASSERT_TRUE(cross_entropy_forward(ctx, logits.data(), t.data(), 3, 2, lse.data(), loss.data(), &st).ok());
  EXPECT_NEAR(loss[0], -std::log(0.75), 1e-15);
  EXPECT_NEAR(loss[1], std::log(4.0), 1e-15);
  EXPECT_EQ(loss[2], 0.0);
  EXPECT_EQ(st.count, 2);
  EXPECT_NEAR(st.mean(), (std::log(4.0) - std::log(0.75)) / 2, 1e-15);

  // d(mean)/dlogits = (softmax - onehot) / count; 0 for the ignored row.
  std::vector<double> d(6);
  ASSERT_TRUE(cross_entropy_backward(ctx, logits.data(), t.data(), lse.data(), 3, 2, 0.5, d.data()).ok());
  EXPECT_NEAR(d[0], 0.25 / 2, 1e-15);
  EXPECT_NEAR(d[1], -0.25 / 2, 1e-15);
  EXPECT_NEAR(d[2], -0.75 / 2, 1e-15);
  EXPECT_NEAR(d[3], 0.75 / 2, 1e-15);
  EXPECT_EQ(d[4], 0.0);
  EXPECT_EQ(d[5], 0.0);

  // Every row ignored: count 0 and a NaN mean, as torch.
  const std::vector<int32_t> none = {kIgnoreIndex, kIgnoreIndex, kIgnoreIndex};
  ASSERT_TRUE(cross_entropy_forward(ctx, logits.data(), none.data(), 3, 2, lse.data(), loss.data(), &st).ok());
  EXPECT_EQ(st.count, 0);
  EXPECT_TRUE(std::isnan(st.mean()));
}

TEST(CrossEntropy, LargeLogitsDoNotOverflow) {
  CpuContext ctx;
  const std::vector<float> logits = {1000, 1000 + std::log(3.0f), -1e30f};
  const std::vector<int32_t> t = {1};
  std::vector<float> lse(1), loss(1), d(3);
  CrossEntropyStats st;
  ASSERT_TRUE(cross_entropy_forward(ctx, logits.data(), t.data(), 1, 3, lse.data(), loss.data(), &st).ok());
  EXPECT_NEAR(loss[0], -std::log(0.75), 1e-4);  // fp32 of 1000 + ln 3 carries 3e-5 of rounding
  ASSERT_TRUE(cross_entropy_backward(ctx, logits.data(), t.data(), lse.data(), 1, 3, 1.0f, d.data()).ok());
  EXPECT_NEAR(d[0], 0.25, 1e-4);
  EXPECT_EQ(d[2], 0.0f);
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  CpuContext ctx(2);
  const int64_t n = 6, vocab = 37;
  std::vector<double> x = testing::random_vec(n * vocab, 1, -3, 3), lse(n);
  const std::vector<int32_t> t = {3, kIgnoreIndex, 0, 36, 12, 3};
  CrossEntropyStats st;
  auto loss = [&] {
    EXPECT_TRUE(cross_entropy_forward(ctx, x.data(), t.data(), n, vocab, lse.data(),
                                      static_cast<double*>(nullptr), &st).ok());
    return 3.0 * st.mean();  // dloss = 3
  };
  loss();
  std::vector<double> d(x.size());
  ASSERT_TRUE(cross_entropy_backward(ctx, x.data(), t.data(), lse.data(), n, vocab, 3.0 / st.count, d.data()).ok());
  testing::expect_gradient_matches("cross_entropy dlogits", x, d, loss);

  // In place (dlogits aliasing logits) gives the same gradient.
  loss();
  std::vector<double> inplace = x;
  ASSERT_TRUE(
      cross_entropy_backward(ctx, inplace.data(), t.data(), lse.data(), n, vocab, 3.0 / st.count, inplace.data()).ok());
  EXPECT_EQ(inplace, d);
}

TEST(CrossEntropy, FloatAgreesWithDouble) {
  CpuContext ctx;
  const int64_t n = 8, vocab = 1000;
  const auto x = testing::random_vec(n * vocab, 7, -8, 8);
  std::vector<int32_t> t(n);
  for (int64_t r = 0; r < n; ++r) t[r] = static_cast<int32_t>((r * 131) % vocab);
  std::vector<double> lse(n), d(x.size());
  CrossEntropyStats st;
  ASSERT_TRUE(cross_entropy_forward(ctx, x.data(), t.data(), n, vocab, lse.data(), static_cast<double*>(nullptr), &st).ok());
  ASSERT_TRUE(cross_entropy_backward(ctx, x.data(), t.data(), lse.data(), n, vocab, 1.0 / n, d.data()).ok());
  const auto xf = testing::to_float(x);
  std::vector<float> lsef(n), df(x.size());
  CrossEntropyStats stf;
  ASSERT_TRUE(cross_entropy_forward(ctx, xf.data(), t.data(), n, vocab, lsef.data(), static_cast<float*>(nullptr), &stf).ok());
  ASSERT_TRUE(cross_entropy_backward(ctx, xf.data(), t.data(), lsef.data(), n, vocab, 1.0f / n, df.data()).ok());
  EXPECT_NEAR(stf.mean(), st.mean(), 1e-5 * st.mean());
  EXPECT_LT(testing::max_rel_error(df, d), 1e-5);
}

TEST(CrossEntropy, RefusesTargetsOutsideTheVocabulary) {
  CpuContext ctx;
  const std::vector<double> x(6, 0);
  std::vector<double> lse(2), d(6, 42);
  for (int32_t bad : {3, -2, -100}) {
    const std::vector<int32_t> t = {0, bad};
    Status s = cross_entropy_forward(ctx, x.data(), t.data(), 2, 3, lse.data(), static_cast<double*>(nullptr),
                                     static_cast<CrossEntropyStats*>(nullptr));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("targets[1] = " + std::to_string(bad)), std::string::npos) << s.message();
    EXPECT_FALSE(cross_entropy_backward(ctx, x.data(), t.data(), lse.data(), 2, 3, 1.0, d.data()).ok());
    EXPECT_EQ(d, std::vector<double>(6, 42));  // nothing written
  }
  // A different ignore index (HF's -100) is accepted when passed.
  const std::vector<int32_t> t = {0, -100};
  CrossEntropyStats st;
  EXPECT_TRUE(cross_entropy_forward(ctx, x.data(), t.data(), 2, 3, lse.data(), static_cast<double*>(nullptr), &st, -100).ok());
  EXPECT_EQ(st.count, 1);
}

}  // namespace
}  // namespace megatrain::cpu

// AdamW against the update written out by hand in double precision, learning-rate schedules at
// hand-computed points, bf16 rounding, and thread-count independence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "megatrain/executor/optimizer.h"

namespace megatrain::exec {
namespace {

TEST(AdamW, ThreeStepsMatchTheUpdateWrittenOutInDouble) {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  std::vector<float> w = {0.5f, -1.25f, 2.0f}, m(3, 0.0f), v(3, 0.0f);
  std::vector<double> wd_ref = {0.5, -1.25, 2.0}, md(3, 0.0), vd(3, 0.0);
  const std::vector<std::vector<float>> grads = {{0.1f, -0.2f, 0.3f}, {0.05f, 0.4f, -0.1f}, {-0.3f, 0.0f, 0.2f}};
  for (int t = 1; t <= 3; ++t) {
    AdamWStep s{lr, b1, b2, eps, wd, t, 1.0f};
    adamw_update(w.data(), grads[t - 1].data(), m.data(), v.data(), 3, s, nullptr, nullptr, 1);
    for (int i = 0; i < 3; ++i) {
      const double g = grads[t - 1][i];
      wd_ref[i] *= 1 - lr * wd;
      md[i] = b1 * md[i] + (1 - b1) * g;
      vd[i] = b2 * vd[i] + (1 - b2) * g * g;
      const double mhat = md[i] / (1 - std::pow(b1, t)), denom = std::sqrt(vd[i]) / std::sqrt(1 - std::pow(b2, t)) + eps;
      wd_ref[i] -= lr * mhat / denom;
      EXPECT_NEAR(w[i], wd_ref[i], 2e-7 * std::max(1.0, std::fabs(wd_ref[i]))) << "t=" << t << " i=" << i;
      EXPECT_NEAR(m[i], md[i], 1e-7);
      EXPECT_NEAR(v[i], vd[i], 1e-8);
    }
  }
}

TEST(AdamW, GradScaleClipsTheGradientAsItIsRead) {
  std::vector<float> w1 = {1.0f}, w2 = {1.0f}, m1(1), v1(1), m2(1), v2(1);
  const float g_big = 8.0f, g_small = 2.0f;
  adamw_update(w1.data(), &g_big, m1.data(), v1.data(), 1, AdamWStep{1e-3, 0.9, 0.95, 1e-8, 0, 1, 0.25f}, nullptr, nullptr, 1);
  adamw_update(w2.data(), &g_small, m2.data(), v2.data(), 1, AdamWStep{1e-3, 0.9, 0.95, 1e-8, 0, 1, 1.0f}, nullptr, nullptr, 1);
  EXPECT_EQ(w1[0], w2[0]);
  EXPECT_EQ(m1[0], m2[0]);
  EXPECT_EQ(v1[0], v2[0]);
}

TEST(AdamW, ResultDoesNotDependOnTheThreadCountAndStreamsTheNewWeights) {
  const int64_t n = 300001;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> w(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) w[i] = d(rng), g[i] = d(rng), m[i] = 0.1f * d(rng), v[i] = std::fabs(d(rng));
  auto w2 = w, m2 = m, v2 = v;
  std::vector<float> s32(n);
  std::vector<uint16_t> s16(n);
  const AdamWStep s{3e-4, 0.9, 0.95, 1e-8, 0.1, 5, 0.7f};
  adamw_update(w.data(), g.data(), m.data(), v.data(), n, s, s32.data(), s16.data(), 1);
  adamw_update(w2.data(), g.data(), m2.data(), v2.data(), n, s, nullptr, nullptr, 3);
  EXPECT_EQ(w, w2);
  EXPECT_EQ(m, m2);
  EXPECT_EQ(v, v2);
  EXPECT_EQ(s32, w);
  for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(s16[i], fp32_to_bf16(w[i]));
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_fp32(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(fp32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(fp32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(fp32_to_bf16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(NAN))));
}

TEST(LearningRate, WarmupThenEachScheduleAtHandComputedPoints) {
  TrainingConfig t;
  t.lr = 1e-3;
  t.min_lr = 1e-4;
  t.steps = 11;
  t.warmup_steps = 2;
  t.lr_schedule = LrSchedule::kCosine;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.5e-3);  // (0+1)/2
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(t, 2), 1e-3);    // decay starts at lr
  EXPECT_NEAR(learning_rate(t, 6), 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(3.14159265358979 * 4 / 8)), 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1e-4);   // the last step reaches min_lr
  t.lr_schedule = LrSchedule::kLinear;
  EXPECT_NEAR(learning_rate(t, 6), 1e-3 - 0.9e-3 * 0.5, 1e-15);
  t.lr_schedule = LrSchedule::kConstant;
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3);
}

// Hugging Face's schedules (transformers.optimization.get_*_schedule_with_warmup), by their
// documented lambdas: warmup s / W from a rate of 0, then decay over T - W steps to 0 at step T.
TEST(LearningRate, HuggingFaceSchedulesAtHandComputedPoints) {
  TrainingConfig t;
  t.lr = 1e-3;
  t.steps = 10;
  t.warmup_steps = 3;
  const double kPi = 3.14159265358979323846;
  for (LrSchedule s : {LrSchedule::kLinearHf, LrSchedule::kCosineHf, LrSchedule::kConstantHf}) {
    t.lr_schedule = s;
    EXPECT_EQ(learning_rate(t, 0), 0.0);  // the first step's rate is 0
    EXPECT_DOUBLE_EQ(learning_rate(t, 1), 1e-3 / 3);
    EXPECT_DOUBLE_EQ(learning_rate(t, 2), 2e-3 / 3);
    EXPECT_DOUBLE_EQ(learning_rate(t, 3), 1e-3);
  }
  t.lr_schedule = LrSchedule::kLinearHf;
  EXPECT_DOUBLE_EQ(learning_rate(t, 6), 1e-3 * 4 / 7);
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3 / 7);  // the last step: not yet 0
  t.lr_schedule = LrSchedule::kCosineHf;
  EXPECT_NEAR(learning_rate(t, 6), 1e-3 * 0.5 * (1 + std::cos(kPi * 3 / 7)), 1e-18);
  EXPECT_NEAR(learning_rate(t, 9), 1e-3 * 0.5 * (1 + std::cos(kPi * 6 / 7)), 1e-18);
  t.lr_schedule = LrSchedule::kConstantHf;
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3);
  t.warmup_steps = 0;
  t.lr_schedule = LrSchedule::kLinearHf;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 1e-3);
}

TEST(GradNorm, SumOfSquaresInDouble) {
  std::vector<float> g(10000, 0.5f);
  g[9999] = 3.0f;
  EXPECT_DOUBLE_EQ(sum_of_squares(g.data(), 10000), 9999 * 0.25 + 9.0);
}

// The order sum_of_squares documents, written out plainly (chunks, blocks of 4096, 16 running sums
// added pairwise), against the function; the threaded form against both for several thread counts;
// and the value against a long-double sum.
TEST(GradNorm, SumOfSquaresHasItsDocumentedOrderForEveryThreadCount) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  const int64_t n = 2 * kSumOfSquaresChunk + 123457;  // three chunks, the last partial, a partial block and lanes
  std::vector<float> g(static_cast<size_t>(n));
  for (float& x : g) x = normal(rng);
  auto by_hand = [](const float* p, int64_t len) {
    double total = 0;
    for (int64_t c = 0; c < len; c += kSumOfSquaresChunk) {
      double chunk = 0;
      for (int64_t b = c; b < std::min(len, c + kSumOfSquaresChunk); b += 4096) {
        double lane[16] = {};
        for (int64_t i = b; i < std::min({len, c + kSumOfSquaresChunk, b + 4096}); ++i)
          lane[(i - b) % 16] += static_cast<double>(p[i]) * static_cast<double>(p[i]);
        for (int w = 8; w >= 1; w /= 2)
          for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
        chunk += lane[0];
      }
      total += chunk;
    }
    return total;
  };
  const double expect = by_hand(g.data(), n);
  EXPECT_EQ(sum_of_squares(g.data(), n), expect);
  long double exact = 0;
  for (float x : g) exact += static_cast<long double>(x) * x;
  EXPECT_NEAR(sum_of_squares(g.data(), n), static_cast<double>(exact), 1e-12 * static_cast<double>(exact));
  // Ranges of several sizes (empty, one element, under a block, several chunks), threaded.
  const std::vector<SquaresRange> ranges = {{g.data(), 0}, {g.data() + 7, 1}, {g.data() + 100, 4000},
                                            {g.data() + 9, n - 9}, {g.data() + 3, kSumOfSquaresChunk + 17}};
  for (int threads : {1, 2, 3, 8}) {
    std::vector<double> out(ranges.size(), -1);
    sums_of_squares(ranges, out.data(), threads);
    for (size_t r = 0; r < ranges.size(); ++r) {
      EXPECT_EQ(out[r], by_hand(ranges[r].g, ranges[r].n)) << "range " << r << ", " << threads << " threads";
      EXPECT_EQ(out[r], sum_of_squares(ranges[r].g, ranges[r].n)) << "range " << r << ", " << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace megatrain::exec

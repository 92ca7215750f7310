// main's cpu::moe_* ops one by one against hand values and their definitions: routing (softmax then
// top-k, renormalised or not, ties to the lower expert), the stable counting sort, gather / combine /
// scatter, the grouped linear (and that an expert with no rows is never touched), the aux statistics.
#include <algorithm>
#include <cmath>
#include <vector>

#include "megatrain/kernels/cpu/moe.h"
#include "test_util.h"

namespace megatrain::cpu {
namespace {

TEST(MoeRoute, SoftmaxTopKHandValues) {
  CpuContext ctx(1);
  // p = [0.1, 0.2, 0.3, 0.4]: logits log(1..4) shifted by 2 (softmax ignores a shift).
  const std::vector<double> logits = {std::log(1.0) + 2, std::log(2.0) + 2, std::log(3.0) + 2, std::log(4.0) + 2};
  for (bool renorm : {false, true}) {
    std::vector<int32_t> ex(2);
    std::vector<double> w(2), p(4);
    moe_route_forward<double>(ctx, logits.data(), 1, 4, 2, renorm, ex.data(), w.data(), p.data());
    EXPECT_EQ(ex, (std::vector<int32_t>{3, 2}));
    for (int x = 0; x < 4; ++x) EXPECT_NEAR(p[x], 0.1 * (x + 1), 1e-15);
    EXPECT_NEAR(w[0], renorm ? 4.0 / 7 : 0.4, 1e-15);
    EXPECT_NEAR(w[1], renorm ? 3.0 / 7 : 0.3, 1e-15);
  }
}

TEST(MoeRoute, TiesGoToTheLowerExpert) {
  CpuContext ctx(1);
  {  // all equal: the first k experts, equal weights
    const std::vector<float> logits(6, 0.5f);
    std::vector<int32_t> ex(3);
    std::vector<float> w(3), p(6);
    moe_route_forward<float>(ctx, logits.data(), 1, 6, 3, true, ex.data(), w.data(), p.data());
    EXPECT_EQ(ex, (std::vector<int32_t>{0, 1, 2}));
    for (float v : w) EXPECT_FLOAT_EQ(v, 1.0f / 3);
  }
  {  // a three-way tie for the top: lower indices first
    const std::vector<float> logits = {1, 3, 3, 0, 3};
    const std::vector<int32_t> want = {1, 2, 4, 0};
    for (int64_t k : {1, 2, 3, 4}) {
      std::vector<int32_t> ex(static_cast<size_t>(k));
      std::vector<float> w(static_cast<size_t>(k)), p(5);
      moe_route_forward<float>(ctx, logits.data(), 1, 5, k, false, ex.data(), w.data(), p.data());
      EXPECT_EQ(ex, std::vector<int32_t>(want.begin(), want.begin() + k)) << "k " << k;
    }
  }
}

TEST(MoeRoute, BackwardOfTheRenormalisationAgainstItsDefinition) {
  // renorm: w_j = p_j / S; d p_j = (dw_j - sum_i dw_i w_i) / S on the chosen, then the softmax.
  CpuContext ctx(1);
  const std::vector<double> logits = {0.3, -1.0, 2.0, 0.7, 1.1};
  const std::vector<double> dw = {0.25, -0.75};
  for (bool renorm : {false, true}) {
    std::vector<int32_t> ex(2);
    std::vector<double> w(2), p(5), dl(5);
    moe_route_forward<double>(ctx, logits.data(), 1, 5, 2, renorm, ex.data(), w.data(), p.data());
    moe_route_backward<double>(ctx, p.data(), ex.data(), w.data(), dw.data(), nullptr, 1, 5, 2, renorm, dl.data());
    std::vector<double> dp(5, 0.0);
    const double S = p[ex[0]] + p[ex[1]];
    const double dot = dw[0] * w[0] + dw[1] * w[1];
    for (int j = 0; j < 2; ++j) dp[ex[j]] += renorm ? (dw[j] - dot) / S : dw[j];
    double s = 0;
    for (int x = 0; x < 5; ++x) s += p[x] * dp[x];
    for (int x = 0; x < 5; ++x) EXPECT_NEAR(dl[x], p[x] * (dp[x] - s), 1e-15) << x;
  }
}

TEST(MoePermute, StableCountingSortByExpert) {
  // 4 tokens, k = 2, 5 experts; expert 3 unchosen.
  const std::vector<int32_t> expert = {2, 0, 1, 2, 2, 0, 4, 1};
  std::vector<int32_t> offsets(6), perm(8);
  moe_permute(expert.data(), 4, 2, 5, offsets.data(), perm.data());
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 2, 4, 7, 7, 8}));
  EXPECT_EQ(perm, (std::vector<int32_t>{1, 5, 2, 7, 0, 3, 4, 6}));
}

TEST(MoePermute, GatherCombineScatterAgainstDefinitions) {
  CpuContext ctx(2);
  const int64_t n = 5, k = 3, e = 4, h = 7;
  const std::vector<int32_t> expert = {0, 1, 2, 3, 2, 1, 1, 0, 3, 2, 3, 0, 0, 2, 1};
  const auto x = testing::random_vec(n * h, 1), w = testing::random_vec(n * k, 2), g = testing::random_vec(n * h, 3);
  std::vector<int32_t> offsets(e + 1), perm(n * k), ros(n * k);
  moe_permute(expert.data(), n, k, e, offsets.data(), perm.data());
  for (int64_t r = 0; r < n * k; ++r) ros[perm[r]] = static_cast<int32_t>(r);
  std::vector<double> xp(n * k * h);
  moe_gather<double>(ctx, x.data(), perm.data(), n * k, k, h, xp.data());
  for (int64_t r = 0; r < n * k; ++r) {
    EXPECT_EQ(expert[perm[r]], std::upper_bound(offsets.begin(), offsets.end(), r) - offsets.begin() - 1);
    for (int64_t c = 0; c < h; ++c) EXPECT_EQ(xp[r * h + c], x[(perm[r] / k) * h + c]);
  }
  const auto yp = testing::random_vec(n * k * h, 4);
  std::vector<double> out(n * h), dyp(n * k * h), dw(n * k), dx(n * h);
  moe_combine_forward<double>(ctx, yp.data(), w.data(), ros.data(), n, k, h, out.data());
  moe_combine_backward<double>(ctx, yp.data(), w.data(), ros.data(), g.data(), n, k, h, dyp.data(), dw.data());
  moe_scatter_add<double>(ctx, xp.data(), ros.data(), n, k, h, dx.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < h; ++c) {
      double want = 0;
      for (int64_t j = 0; j < k; ++j) want += w[t * k + j] * yp[ros[t * k + j] * h + c];
      EXPECT_NEAR(out[t * h + c], want, 1e-15);
      EXPECT_NEAR(dx[t * h + c], k * x[t * h + c], 1e-15);  // every slot of t gathered x[t]
    }
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      double d = 0;
      for (int64_t c = 0; c < h; ++c) {
        EXPECT_EQ(dyp[ros[s] * h + c], w[s] * g[t * h + c]);
        d += g[t * h + c] * yp[ros[s] * h + c];
      }
      EXPECT_NEAR(dw[s], d, 1e-14);
    }
  }
}

TEST(GroupedLinear, MatchesPerExpertDefinitionAndSkipsEmptyExperts) {
  CpuContext ctx(2);
  const int64_t e = 4, in = 5, out = 3, rows = 9;
  const std::vector<int32_t> offsets = {0, 3, 3, 7, 9};  // expert 1 has no rows
  const int64_t ws = in * out + 2, bs = out + 1;          // strides larger than the matrices
  const auto x = testing::random_vec(rows * in, 1), w = testing::random_vec(e * ws, 2),
             b = testing::random_vec(e * bs, 3), dy = testing::random_vec(rows * out, 4);
  std::vector<double> y(rows * out), dx(rows * in), dw(e * ws, -0.0), db(e * bs, -0.0);
  grouped_linear_forward<double>(ctx, x.data(), w.data(), ws, b.data(), bs, offsets.data(), e, in, out, y.data());
  grouped_linear_backward<double>(ctx, dy.data(), x.data(), w.data(), ws, offsets.data(), e, in, out, dx.data(), dw.data(),
                                  db.data(), bs);
  for (int64_t ex = 0; ex < e; ++ex) {
    for (int64_t r = offsets[ex]; r < offsets[ex + 1]; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double want = b[ex * bs + o];
        for (int64_t c = 0; c < in; ++c) want += x[r * in + c] * w[ex * ws + o * in + c];
        EXPECT_NEAR(y[r * out + o], want, 1e-14);
      }
      for (int64_t c = 0; c < in; ++c) {
        double want = 0;
        for (int64_t o = 0; o < out; ++o) want += dy[r * out + o] * w[ex * ws + o * in + c];
        EXPECT_NEAR(dx[r * in + c], want, 1e-14);
      }
    }
    for (int64_t o = 0; o < out; ++o) {
      double want_b = 0;
      for (int64_t r = offsets[ex]; r < offsets[ex + 1]; ++r) want_b += dy[r * out + o];
      EXPECT_NEAR(db[ex * bs + o], want_b, 1e-14);
      for (int64_t c = 0; c < in; ++c) {
        double want = 0;
        for (int64_t r = offsets[ex]; r < offsets[ex + 1]; ++r) want += dy[r * out + o] * x[r * in + c];
        EXPECT_NEAR(dw[ex * ws + o * in + c], want, 1e-14);
      }
    }
  }
  // The empty expert's gradients and the padding between matrices were never written (-0.0 kept).
  for (int64_t j = 0; j < ws; ++j) EXPECT_TRUE(std::signbit(dw[1 * ws + j])) << "dW of the empty expert touched";
  for (int64_t j = 0; j < bs; ++j) EXPECT_TRUE(std::signbit(db[1 * bs + j])) << "db of the empty expert touched";
  for (int64_t ex = 0; ex < e; ++ex)
    for (int64_t j = in * out; j < ws; ++j) EXPECT_TRUE(std::signbit(dw[ex * ws + j]));
}

TEST(MoeAux, StatisticsAddAcrossCalls) {
  CpuContext ctx(1);
  const int64_t n = 4, e = 3, k = 2;
  const std::vector<double> logits = {0.1, 0.9, -0.3, 2.0, 0.0, 1.0, -1, -2, 0.5, 0.3, 0.2, 0.1};
  std::vector<int32_t> ex(n * k);
  std::vector<double> w(n * k), p(n * e);
  moe_route_forward<double>(ctx, logits.data(), n, e, k, true, ex.data(), w.data(), p.data());
  std::vector<double> count(e, 0.0), prob(e, 0.0);
  moe_aux_stats<double>(p.data(), ex.data(), n, e, k, count.data(), prob.data());
  moe_aux_stats<double>(p.data(), ex.data(), n, e, k, count.data(), prob.data());
  for (int64_t x = 0; x < e; ++x) {
    double c = 0, s = 0;
    for (int64_t j = 0; j < n * k; ++j) c += ex[j] == x;
    for (int64_t t = 0; t < n; ++t) s += p[t * e + x];
    EXPECT_EQ(count[x], 2 * c);
    EXPECT_NEAR(prob[x], 2 * s, 1e-15);
  }
}

}  // namespace
}  // namespace megatrain::cpu

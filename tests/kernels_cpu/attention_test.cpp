// Causal GQA attention: hand values, T = 1, the causal mask, GQA = MHA with repeated k/v, saved
// probabilities, finite differences of dq/dk/dv, float vs double, shape errors.
#include "megatrain/kernels/cpu/attention.h"

#include <cmath>

#include "test_util.h"

namespace megatrain::cpu {
namespace {

using testing::random_vec;

struct Fwd {
  std::vector<double> out, probs;
};

Fwd forward(CpuContext& ctx, const AttentionShape& s, const std::vector<double>& q, const std::vector<double>& k,
            const std::vector<double>& v) {
  Fwd r;
  r.out.resize(static_cast<size_t>(s.batch * s.seq * s.n_heads * s.head_dim));
  r.probs.resize(static_cast<size_t>(attention_probs_elems(s)));
  Status st = attention_forward(ctx, s, q.data(), k.data(), v.data(), r.out.data(), r.probs.data());
  EXPECT_TRUE(st.ok()) << st.to_string();
  return r;
}

size_t q_elems(const AttentionShape& s) { return static_cast<size_t>(s.batch * s.seq * s.n_heads * s.head_dim); }
size_t kv_elems(const AttentionShape& s) { return static_cast<size_t>(s.batch * s.seq * s.n_kv_heads * s.head_dim); }

TEST(Attention, HandComputedTwoTokens) {
  // head_dim 1 (scale 1): q1 = 1, k = [0, ln 3] -> scores [0, ln 3], p = [1/4, 3/4];
  // v = [2, 6] -> out1 = 2/4 + 18/4 = 5; token 0 sees only itself: out0 = v0 = 2.
  CpuContext ctx;
  const AttentionShape s{1, 2, 1, 1, 1};
  const Fwd r = forward(ctx, s, {0.3, 1}, {0, std::log(3.0)}, {2, 6});
  EXPECT_NEAR(r.out[0], 2, 1e-15);
  EXPECT_NEAR(r.out[1], 5, 1e-14);
  EXPECT_NEAR(r.probs[2], 0.25, 1e-15);  // row 1: [1/4, 3/4]
  EXPECT_NEAR(r.probs[3], 0.75, 1e-15);
  EXPECT_EQ(r.probs[1], 0.0);  // above the diagonal
}

TEST(Attention, ScaleIsOneOverSqrtHeadDim) {
  // head_dim 4, q1 = k1 = [1,1,1,1], k0 = 0: scores [0, 4 / 2 = 2], p1 = e^2 / (1 + e^2).
  CpuContext ctx;
  const AttentionShape s{1, 2, 1, 1, 4};
  const Fwd r = forward(ctx, s, {0, 0, 0, 0, 1, 1, 1, 1}, {0, 0, 0, 0, 1, 1, 1, 1}, {0, 0, 0, 0, 1, 1, 1, 1});
  const double p1 = std::exp(2.0) / (1 + std::exp(2.0));
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(r.out[4 + d], p1, 1e-15);
}

TEST(Attention, OneTokenReturnsItsValueHead) {
  CpuContext ctx;
  const AttentionShape s{2, 1, 6, 3, 5};  // 2 query heads per kv head
  const auto q = random_vec(q_elems(s), 1), k = random_vec(kv_elems(s), 2), v = random_vec(kv_elems(s), 3);
  const Fwd r = forward(ctx, s, q, k, v);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 6; ++h)
      for (int64_t d = 0; d < 5; ++d) EXPECT_EQ(r.out[(b * 6 + h) * 5 + d], v[(b * 3 + h / 2) * 5 + d]);
}

TEST(Attention, FutureTokensDoNotChangeEarlierOutputs) {
  CpuContext ctx;
  const AttentionShape s{2, 6, 4, 2, 8};
  auto q = random_vec(q_elems(s), 4), k = random_vec(kv_elems(s), 5), v = random_vec(kv_elems(s), 6);
  const Fwd before = forward(ctx, s, q, k, v);
  // Change everything of the last two positions of batch 0.
  const int64_t qrow = s.n_heads * s.head_dim, kvrow = s.n_kv_heads * s.head_dim;
  for (int64_t t = 4; t < 6; ++t) {
    for (int64_t i = 0; i < qrow; ++i) q[t * qrow + i] += 1.5;
    for (int64_t i = 0; i < kvrow; ++i) k[t * kvrow + i] -= 2, v[t * kvrow + i] *= -3;
  }
  const Fwd after = forward(ctx, s, q, k, v);
  for (int64_t i = 0; i < 4 * qrow; ++i) EXPECT_EQ(after.out[i], before.out[i]) << i;  // batch 0, t < 4
  for (int64_t i = 6 * qrow; i < 12 * qrow; ++i) EXPECT_EQ(after.out[i], before.out[i]) << i;  // batch 1
  bool changed = false;
  for (int64_t i = 4 * qrow; i < 6 * qrow; ++i) changed |= after.out[i] != before.out[i];
  EXPECT_TRUE(changed);
}

TEST(Attention, ProbabilityRowsAreCausalAndSumToOne) {
  CpuContext ctx;
  const AttentionShape s{1, 7, 2, 1, 4};
  const Fwd r = forward(ctx, s, random_vec(q_elems(s), 7, -3, 3), random_vec(kv_elems(s), 8, -3, 3),
                        random_vec(kv_elems(s), 9));
  for (int64_t row = 0; row < 2 * 7; ++row) {
    const int64_t i = row % 7;
    double sum = 0;
    for (int64_t j = 0; j < 7; ++j) {
      const double p = r.probs[row * 7 + j];
      if (j > i) {
        EXPECT_EQ(p, 0.0);
      }
      sum += p;
    }
    EXPECT_NEAR(sum, 1, 1e-15);
  }
}

// HF's repeat_kv: kv head g serves query heads g*rep .. g*rep+rep-1.
std::vector<double> repeat_kv(const std::vector<double>& kv, const AttentionShape& s) {
  const int64_t rep = s.n_heads / s.n_kv_heads;
  std::vector<double> out(q_elems(s));
  for (int64_t bt = 0; bt < s.batch * s.seq; ++bt)
    for (int64_t h = 0; h < s.n_heads; ++h)
      for (int64_t d = 0; d < s.head_dim; ++d)
        out[(bt * s.n_heads + h) * s.head_dim + d] = kv[(bt * s.n_kv_heads + h / rep) * s.head_dim + d];
  return out;
}

TEST(Attention, GqaEqualsMhaWithRepeatedKeysAndValues) {
  CpuContext ctx;
  const AttentionShape gqa{2, 5, 6, 2, 4};
  AttentionShape mha = gqa;
  mha.n_kv_heads = 6;
  const auto q = random_vec(q_elems(gqa), 11), k = random_vec(kv_elems(gqa), 12), v = random_vec(kv_elems(gqa), 13);
  const auto dout = random_vec(q_elems(gqa), 14);
  const auto kr = repeat_kv(k, gqa), vr = repeat_kv(v, gqa);
  const Fwd a = forward(ctx, gqa, q, k, v), b = forward(ctx, mha, q, kr, vr);
  EXPECT_EQ(a.out, b.out);  // same dot products in the same order
  EXPECT_EQ(a.probs, b.probs);

  std::vector<double> dq_a(q_elems(gqa)), dk_a(kv_elems(gqa)), dv_a(kv_elems(gqa)), ws(a.probs.size());
  std::vector<double> dq_b(q_elems(gqa)), dk_b(q_elems(gqa)), dv_b(q_elems(gqa));
  ASSERT_TRUE(attention_backward(ctx, gqa, q.data(), k.data(), v.data(), a.probs.data(), dout.data(), dq_a.data(),
                                 dk_a.data(), dv_a.data(), ws.data())
                  .ok());
  ASSERT_TRUE(attention_backward(ctx, mha, q.data(), kr.data(), vr.data(), b.probs.data(), dout.data(), dq_b.data(),
                                 dk_b.data(), dv_b.data(), ws.data())
                  .ok());
  EXPECT_EQ(dq_a, dq_b);
  // The gradient of a shared head is the sum over the query heads that read it.
  for (int64_t bt = 0; bt < 10; ++bt)
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t d = 0; d < 4; ++d) {
        double sk = 0, sv = 0;
        for (int64_t h = g * 3; h < g * 3 + 3; ++h) sk += dk_b[(bt * 6 + h) * 4 + d], sv += dv_b[(bt * 6 + h) * 4 + d];
        EXPECT_NEAR(dk_a[(bt * 2 + g) * 4 + d], sk, 1e-14);
        EXPECT_NEAR(dv_a[(bt * 2 + g) * 4 + d], sv, 1e-14);
      }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  CpuContext ctx(2);
  const AttentionShape s{2, 5, 4, 2, 3};
  std::vector<double> q = random_vec(q_elems(s), 21), k = random_vec(kv_elems(s), 22), v = random_vec(kv_elems(s), 23);
  const auto g = random_vec(q_elems(s), 24);
  std::vector<double> out(q_elems(s)), probs(static_cast<size_t>(attention_probs_elems(s)));
  auto loss = [&] {
    EXPECT_TRUE(attention_forward(ctx, s, q.data(), k.data(), v.data(), out.data(), probs.data()).ok());
    return testing::inner(out, g);
  };
  loss();
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), ws(probs.size());
  ASSERT_TRUE(attention_backward(ctx, s, q.data(), k.data(), v.data(), probs.data(), g.data(), dq.data(), dk.data(),
                                 dv.data(), ws.data())
                  .ok());
  testing::expect_gradient_matches("attention dq", q, dq, loss);
  testing::expect_gradient_matches("attention dk", k, dk, loss);
  testing::expect_gradient_matches("attention dv", v, dv, loss);
}

TEST(Attention, FloatAgreesWithDouble) {
  CpuContext ctx;
  const AttentionShape s{1, 32, 4, 1, 16};
  const auto q = random_vec(q_elems(s), 31, -2, 2), k = random_vec(kv_elems(s), 32, -2, 2),
             v = random_vec(kv_elems(s), 33), g = random_vec(q_elems(s), 34);
  const Fwd r = forward(ctx, s, q, k, v);
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), ws(r.probs.size());
  ASSERT_TRUE(attention_backward(ctx, s, q.data(), k.data(), v.data(), r.probs.data(), g.data(), dq.data(), dk.data(),
                                 dv.data(), ws.data())
                  .ok());
  const auto qf = testing::to_float(q), kf = testing::to_float(k), vf = testing::to_float(v), gf = testing::to_float(g);
  std::vector<float> of(q.size()), pf(r.probs.size()), dqf(q.size()), dkf(k.size()), dvf(v.size()), wsf(pf.size());
  ASSERT_TRUE(attention_forward(ctx, s, qf.data(), kf.data(), vf.data(), of.data(), pf.data()).ok());
  ASSERT_TRUE(attention_backward(ctx, s, qf.data(), kf.data(), vf.data(), pf.data(), gf.data(), dqf.data(), dkf.data(),
                                 dvf.data(), wsf.data())
                  .ok());
  EXPECT_LT(testing::max_rel_error(of, r.out), 1e-5);
  EXPECT_LT(testing::max_rel_error(dqf, dq), 1e-5);
  EXPECT_LT(testing::max_rel_error(dkf, dk), 1e-5);
  EXPECT_LT(testing::max_rel_error(dvf, dv), 1e-5);
}

// Packed rows without cross-document attention: a row of several documents (with starts) gives, for
// each document, the output and the dq/dk/dv that the same kernel gives for that document alone, in a
// sliding window too and across more than one block of query rows (kRows = 32).
TEST(Attention, DocumentsInAPackedRowEqualEachDocumentAlone) {
  CpuContext ctx(2);
  for (int64_t window : {0, 7}) {
    const int64_t T = 70, nh = 4, nkv = 2, hd = 3;
    const std::vector<std::vector<int64_t>> docs = {{1, 33, 20, 16}, {70}};  // per batch row
    AttentionShape s{2, T, nh, nkv, hd, window};
    std::vector<int32_t> starts;
    for (const auto& row : docs)
      for (int64_t at = 0; int64_t n : row) {
        for (int64_t t = 0; t < n; ++t) starts.push_back(static_cast<int32_t>(at));
        at += n;
      }
    s.starts = starts.data();
    const auto q = random_vec(q_elems(s), 41), k = random_vec(kv_elems(s), 42), v = random_vec(kv_elems(s), 43),
               g = random_vec(q_elems(s), 44);
    const Fwd r = forward(ctx, s, q, k, v);
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), ws(r.probs.size());
    ASSERT_TRUE(attention_backward(ctx, s, q.data(), k.data(), v.data(), r.probs.data(), g.data(), dq.data(), dk.data(),
                                   dv.data(), ws.data())
                    .ok());
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t at = 0; int64_t n : docs[static_cast<size_t>(b)]) {
        const AttentionShape a{1, n, nh, nkv, hd, window};
        auto cut = [&](const std::vector<double>& x, int64_t heads) {
          return std::vector<double>(x.begin() + (b * T + at) * heads * hd, x.begin() + (b * T + at + n) * heads * hd);
        };
        const auto qa = cut(q, nh), ka = cut(k, nkv), va = cut(v, nkv), ga = cut(g, nh);
        const Fwd ra = forward(ctx, a, qa, ka, va);
        std::vector<double> dqa(qa.size()), dka(ka.size()), dva(va.size()), wsa(ra.probs.size());
        ASSERT_TRUE(attention_backward(ctx, a, qa.data(), ka.data(), va.data(), ra.probs.data(), ga.data(), dqa.data(),
                                       dka.data(), dva.data(), wsa.data())
                        .ok());
        EXPECT_LT(testing::max_rel_error(cut(r.out, nh), ra.out), 1e-13) << "row " << b << " document at " << at;
        EXPECT_LT(testing::max_rel_error(cut(dq, nh), dqa), 1e-13) << "row " << b << " document at " << at;
        EXPECT_LT(testing::max_rel_error(cut(dk, nkv), dka), 1e-13) << "row " << b << " document at " << at;
        EXPECT_LT(testing::max_rel_error(cut(dv, nkv), dva), 1e-13) << "row " << b << " document at " << at;
        at += n;
      }
  }
  // Starts that are not contiguous documents are refused.
  std::vector<int32_t> bad = {0, 0, 1, 0};
  AttentionShape s{1, 4, 1, 1, 1};
  s.starts = bad.data();
  EXPECT_EQ(check_attention_shape(s).code(), StatusCode::kInvalidArgument);
}

TEST(Attention, RefusesBadShapes) {
  CpuContext ctx;
  EXPECT_EQ(check_attention_shape({1, 4, 4, 3, 8}).code(), StatusCode::kInvalidArgument);  // 3 does not divide 4
  EXPECT_EQ(check_attention_shape({1, 0, 4, 2, 8}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(check_attention_shape({1, 4, 4, 2, 8}).ok());
  double dummy = 0;
  Status st = attention_forward(ctx, AttentionShape{1, 1, 4, 3, 1}, &dummy, &dummy, &dummy, &dummy, &dummy);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("does not divide"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megatrain::cpu

// The block schedule of the CUDA attention (kernels/cuda/attention_schedule.h) checked without a
// GPU: the same schedule code runs over a plain host emulation of its operations (a row-major
// strided-batched GEMM and the four element-wise steps, written from their contracts), and its
// outputs must equal the CPU attention op's to fp32 rounding, for every block size (1 row, a few
// rows, blocks that do not divide the sequence, the whole sequence), with GQA and MHA, and with
// gpt-oss's sliding windows and attention sinks. This is what
// can be checked here of the GPU path: the sub-matrices, strides, causal limits and accumulation
// order of every GEMM. The kernels themselves are checked against the CPU op on a GPU
// (cuda_ops_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "cuda/attention_schedule.h"
#include "megatrain/kernels/cpu/attention.h"

namespace megatrain::cuda {
namespace {

struct HostOps {
  template <typename A, typename C>
  Status gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const A* a, int64_t lda, int64_t sa, const A* b,
              int64_t ldb, int64_t sb, float beta, C* c, int64_t ldc, int64_t sc, int64_t batch) {
    for (int64_t z = 0; z < batch; ++z)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int64_t l = 0; l < k; ++l) {
            const double av = ta ? a[z * sa + l * lda + i] : a[z * sa + i * lda + l];
            const double bv = tb ? b[z * sb + j * ldb + l] : b[z * sb + l * ldb + j];
            acc += av * bv;
          }
          C& out = c[z * sc + i * ldc + j];
          out = static_cast<C>(alpha * acc + (beta != 0.0f ? beta * static_cast<double>(out) : 0.0));
        }
    ++gemms;
    return {};
  }
  // One launch for the whole grid, as on the GPU. Its problems must write disjoint outputs (they
  // run in no particular order there): every problem's C rows are checked against the others'.
  template <typename A, typename C>
  Status gemm2(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const A* a, int64_t lda, Stride2 sa, const A* b,
               int64_t ldb, Stride2 sb, C* c, int64_t ldc, Stride2 sc, int64_t n_outer, int64_t n_inner) {
    std::vector<std::pair<int64_t, int64_t>> spans;  // [first, last] element of each C row
    for (int64_t o = 0; o < n_outer; ++o)
      for (int64_t i = 0; i < n_inner; ++i)
        for (int64_t r = 0; r < m; ++r) spans.emplace_back(o * sc.outer + i * sc.inner + r * ldc, o * sc.outer + i * sc.inner + r * ldc + n - 1);
    std::sort(spans.begin(), spans.end());
    for (size_t x = 1; x < spans.size(); ++x)
      if (spans[x].first <= spans[x - 1].second) return internal_error("gemm2: two problems write the same output");
    const int64_t before = gemms;
    for (int64_t o = 0; o < n_outer; ++o)
      for (int64_t i = 0; i < n_inner; ++i)
        MT_RETURN_IF_ERROR((gemm<A, C>(ta, tb, m, n, k, alpha, a + o * sa.outer + i * sa.inner, lda, 0, b + o * sb.outer + i * sb.inner,
                                       ldb, 0, 0.0f, c + o * sc.outer + i * sc.inner, ldc, 0, 1)));
    gemms = before + 1;
    return {};
  }
  Status softmax_rows(const float* s, float* p, float* lse, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0, int64_t k0,
                      int64_t window, int64_t seq, int64_t lse_base, const float* sinks, const int32_t* starts) {
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < rows; ++i) {
        const float* sr = s + (h * rows + i) * keys;
        float* pr = p + (h * rows + i) * keys;
        const int64_t t = r0 + i;
        const int64_t first = starts != nullptr ? starts[t] : 0;
        auto seen = [&](int64_t c) { return k0 + c <= t && k0 + c >= first && (window == 0 || k0 + c > t - window); };
        double mx = sinks ? sinks[h] : -INFINITY, sum = 0;
        for (int64_t c = 0; c < keys; ++c)
          if (seen(c)) mx = std::max(mx, static_cast<double>(sr[c]));
        for (int64_t c = 0; c < keys; ++c)
          if (seen(c)) sum += std::exp(sr[c] - mx);
        if (sinks) sum += std::exp(sinks[h] - mx);
        for (int64_t c = 0; c < keys; ++c) pr[c] = seen(c) ? static_cast<float>(std::exp(sr[c] - mx) / sum) : 0.0f;
        lse[lse_base + h * seq + t] = static_cast<float>(mx + std::log(sum));
        max_keys = std::max(max_keys, keys);
      }
    return {};
  }
  Status probs_from_lse(const float* s, const float* lse, float* p, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0,
                        int64_t k0, int64_t window, int64_t seq, int64_t lse_base, const int32_t* starts) {
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = 0; c < keys; ++c) {
          const int64_t e = (h * rows + i) * keys + c, t = r0 + i, j = k0 + c;
          const bool seen = j <= t && j >= (starts != nullptr ? starts[t] : 0) && (window == 0 || j > t - window);
          p[e] = seen ? static_cast<float>(std::exp(static_cast<double>(s[e]) - lse[lse_base + h * seq + t])) : 0.0f;
        }
    return {};
  }
  Status sink_grad(const float* sinks, const float* lse, const float* drow, int64_t batch, int64_t n_heads, int64_t seq,
                   float* d_sinks) {
    for (int64_t h = 0; h < n_heads; ++h) {
      double acc = 0;
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t t = 0; t < seq; ++t) {
          const int64_t at = (b * n_heads + h) * seq + t;
          acc -= std::exp(static_cast<double>(sinks[h]) - lse[at]) * drow[at];
        }
      d_sinks[h] += static_cast<float>(acc);
    }
    return {};
  }
  Status scores_grad(float* p_ds, const float* dp, const float* drow, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0,
                     int64_t seq, int64_t d_base, float scale) {
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < keys; ++j) {
          const int64_t e = (h * rows + i) * keys + j;
          p_ds[e] = p_ds[e] * (dp[e] - drow[d_base + h * seq + r0 + i]) * scale;
        }
    return {};
  }
  Status row_dot(const float* dout, const float* out, float* drow, int64_t batch, int64_t seq, int64_t n_heads, int64_t hd) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < seq; ++t)
        for (int64_t h = 0; h < n_heads; ++h) {
          double acc = 0;
          const int64_t row = (b * seq + t) * n_heads + h;
          for (int64_t x = 0; x < hd; ++x) acc += static_cast<double>(dout[row * hd + x]) * out[row * hd + x];
          drow[(b * n_heads + h) * seq + t] = static_cast<float>(acc);
        }
    return {};
  }
  Status zero(float* p, int64_t n) {
    std::fill(p, p + n, 0.0f);
    return {};
  }
  int64_t gemms = 0;
  int64_t max_keys = 0;  // the widest score block softmax_rows saw
};

std::vector<float> randn(int64_t n, std::mt19937& g) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(g);
  return v;
}

double normalised_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// The CPU op's forward and backward (the reference), with sinks when `sinks` is not null: the
// output, dq, dk, dv, the sinks' probabilities and their gradient (accumulated onto dsink0).
struct CpuReference {
  std::vector<float> out, dq, dk, dv, sink_probs, dsink;
};
CpuReference cpu_reference(const cpu::AttentionShape& shape, const std::vector<float>& q, const std::vector<float>& k,
                           const std::vector<float>& v, const std::vector<float>& dout, const float* sinks, float dsink0) {
  cpu::CpuContext ctx(1);
  const int64_t np = cpu::attention_probs_elems(shape), nrow = shape.batch * shape.n_heads * shape.seq;
  CpuReference r;
  r.out.resize(q.size());
  r.dq.resize(q.size());
  r.dk.resize(k.size());
  r.dv.resize(v.size());
  r.sink_probs.resize(static_cast<size_t>(nrow));
  r.dsink.assign(static_cast<size_t>(shape.n_heads), dsink0);
  std::vector<float> probs(static_cast<size_t>(np)), ws(static_cast<size_t>(np)), sink_rows(static_cast<size_t>(nrow));
  EXPECT_TRUE(cpu::attention_forward<float>(ctx, shape, q.data(), k.data(), v.data(), r.out.data(), probs.data(), sinks,
                                            sinks ? r.sink_probs.data() : nullptr)
                  .ok());
  EXPECT_TRUE(cpu::attention_backward<float>(ctx, shape, q.data(), k.data(), v.data(), probs.data(), dout.data(), r.dq.data(),
                                             r.dk.data(), r.dv.data(), ws.data(), sinks ? r.sink_probs.data() : nullptr,
                                             sinks ? r.dsink.data() : nullptr, sinks ? sink_rows.data() : nullptr)
                  .ok());
  return r;
}

struct Case {
  int64_t batch, seq, heads, kv_heads, head_dim;
};

class AttentionSchedule : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionSchedule, EqualsTheCpuOpForEveryBlockSize) {
  const Case c = GetParam();
  const AttnDims d{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim};
  std::mt19937 g(static_cast<uint32_t>(c.seq * 131 + c.heads * 7 + c.head_dim));
  const int64_t nq = c.batch * c.seq * c.heads * c.head_dim, nk = c.batch * c.seq * c.kv_heads * c.head_dim;
  const std::vector<float> q = randn(nq, g), k = randn(nk, g), v = randn(nk, g), dout = randn(nq, g);
  // The reference: the CPU op (saved probabilities, no blocks).
  cpu::CpuContext ctx(1);
  const cpu::AttentionShape shape{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim};
  const int64_t np = cpu::attention_probs_elems(shape);
  std::vector<float> out_ref(static_cast<size_t>(nq)), probs(static_cast<size_t>(np)), ws(static_cast<size_t>(np));
  ASSERT_TRUE(cpu::attention_forward<float>(ctx, shape, q.data(), k.data(), v.data(), out_ref.data(), probs.data()).ok());
  std::vector<float> dq_ref(static_cast<size_t>(nq)), dk_ref(static_cast<size_t>(nk)), dv_ref(static_cast<size_t>(nk));
  ASSERT_TRUE(cpu::attention_backward<float>(ctx, shape, q.data(), k.data(), v.data(), probs.data(), dout.data(), dq_ref.data(),
                                             dk_ref.data(), dv_ref.data(), ws.data())
                  .ok());
  for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{16}, c.seq}) {
    SCOPED_TRACE("rows per block " + std::to_string(rows));
    HostOps ops;
    const int64_t block = c.heads * std::min(rows, c.seq) * c.seq;
    std::vector<float> s(static_cast<size_t>(block)), p(static_cast<size_t>(block));
    std::vector<float> out(static_cast<size_t>(nq), NAN), lse(static_cast<size_t>(c.batch * c.heads * c.seq), NAN);
    ASSERT_TRUE(attention_forward_schedule<float>(ops, d, q.data(), k.data(), v.data(), out.data(), lse.data(), s.data(),
                                                  p.data(), rows)
                    .ok());
    EXPECT_LE(normalised_error(out, out_ref), 1e-5);
    // lse against the log-sum-exp of the scores, from scratch in double
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.heads; ++h)
        for (int64_t t = 0; t < c.seq; ++t) {
          const int64_t gk = h / (c.heads / c.kv_heads);
          double mx = -INFINITY;
          std::vector<double> sc;
          for (int64_t j = 0; j <= t; ++j) {
            double dot = 0;
            for (int64_t x = 0; x < c.head_dim; ++x)
              dot += static_cast<double>(q[(((b * c.seq + t) * c.heads) + h) * c.head_dim + x]) *
                     k[(((b * c.seq + j) * c.kv_heads) + gk) * c.head_dim + x];
            sc.push_back(dot * scale);
            mx = std::max(mx, dot * scale);
          }
          double sum = 0;
          for (double e : sc) sum += std::exp(e - mx);
          ASSERT_NEAR(lse[static_cast<size_t>((b * c.heads + h) * c.seq + t)], mx + std::log(sum), 1e-4)
              << "b " << b << " h " << h << " t " << t;
        }
    std::vector<float> dq(static_cast<size_t>(nq), NAN), dk(static_cast<size_t>(nk), NAN), dv(static_cast<size_t>(nk), NAN);
    std::vector<float> drow(static_cast<size_t>(c.batch * c.heads * c.seq));
    ASSERT_TRUE(attention_backward_schedule<float>(ops, d, q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(),
                                                   dq.data(), dk.data(), dv.data(), s.data(), p.data(), drow.data(), rows)
                    .ok());
    EXPECT_LE(normalised_error(dq, dq_ref), 1e-5);
    EXPECT_LE(normalised_error(dk, dk_ref), 1e-5);
    EXPECT_LE(normalised_error(dv, dv_ref), 1e-5);
    EXPECT_GT(ops.gemms, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionSchedule,
                         ::testing::Values(Case{1, 1, 2, 1, 8}, Case{2, 5, 4, 2, 8}, Case{1, 37, 6, 2, 16}, Case{2, 19, 3, 3, 8},
                                           Case{1, 33, 8, 1, 4}));

// Issue 31, row 7: the launches no longer grow with the heads of a GQA group. Per sequence and
// block of rows the forward issues 2 GEMM launches (scores, values) whatever the group size, and
// the backward 3 + 2 x rep (the dV and dK accumulations stay per head, in order, for determinism).
TEST(AttentionSchedule, GemmLaunchesPerBlockDoNotGrowWithTheGroup) {
  for (const Case c : {Case{2, 24, 8, 2, 8}, Case{1, 24, 8, 8, 8}, Case{3, 24, 8, 1, 8}}) {
    const AttnDims d{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim};
    const int64_t rep = c.heads / c.kv_heads, rows = 8, blocks = c.batch * ((c.seq + rows - 1) / rows);
    std::mt19937 g(5);
    const int64_t nq = c.batch * c.seq * c.heads * c.head_dim, nk = c.batch * c.seq * c.kv_heads * c.head_dim;
    const std::vector<float> q = randn(nq, g), k = randn(nk, g), v = randn(nk, g), dout = randn(nq, g);
    std::vector<float> s(static_cast<size_t>(c.heads * rows * c.seq)), p(s.size());
    std::vector<float> out(static_cast<size_t>(nq)), lse(static_cast<size_t>(c.batch * c.heads * c.seq));
    HostOps fwd;
    ASSERT_TRUE(attention_forward_schedule<float>(fwd, d, q.data(), k.data(), v.data(), out.data(), lse.data(), s.data(), p.data(), rows).ok());
    EXPECT_EQ(fwd.gemms, 2 * blocks) << "rep " << rep;
    HostOps bwd;
    std::vector<float> dq(static_cast<size_t>(nq)), dk(static_cast<size_t>(nk)), dv(static_cast<size_t>(nk));
    std::vector<float> drow(static_cast<size_t>(c.batch * c.heads * c.seq));
    ASSERT_TRUE(attention_backward_schedule<float>(bwd, d, q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(),
                                                   dq.data(), dk.data(), dv.data(), s.data(), p.data(), drow.data(), rows)
                    .ok());
    EXPECT_EQ(bwd.gemms, (3 + 2 * rep) * blocks) << "rep " << rep;
  }
}

TEST(AttentionSchedule, RefusesBadShapes) {
  HostOps ops;
  float x = 0;
  EXPECT_FALSE((attention_forward_schedule<float>(ops, AttnDims{1, 4, 3, 2, 8}, &x, &x, &x, &x, &x, &x, &x, 2).ok()));
  EXPECT_FALSE((attention_forward_schedule<float>(ops, AttnDims{1, 4, 2, 2, 8}, &x, &x, &x, &x, &x, &x, &x, 0).ok()));
  EXPECT_EQ(ops.gemms, 0);
}


// gpt-oss's attention: sliding windows (narrower and wider than a block, and one wider than the
// sequence) with and without sinks, against the CPU op (sinks' probabilities and gradient
// included); a window also narrows each block's keys to [r0 - window + 1, r0 + rows).
struct WindowCase {
  int64_t batch, seq, heads, kv_heads, head_dim, window;
  bool sinks;
};
class AttentionScheduleWindow : public ::testing::TestWithParam<WindowCase> {};

TEST_P(AttentionScheduleWindow, EqualsTheCpuOpWithSinksAndWindow) {
  const WindowCase c = GetParam();
  AttnDims d{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim};
  d.window = c.window;
  std::mt19937 g(static_cast<uint32_t>(c.seq * 17 + c.window * 5 + (c.sinks ? 1 : 0)));
  const int64_t nq = c.batch * c.seq * c.heads * c.head_dim, nk = c.batch * c.seq * c.kv_heads * c.head_dim;
  const std::vector<float> q = randn(nq, g), k = randn(nk, g), v = randn(nk, g), dout = randn(nq, g);
  std::vector<float> sinks = randn(c.heads, g);
  for (float& x : sinks) x *= 2.0f;  // sinks that matter: some rows' largest logit
  const float* sk = c.sinks ? sinks.data() : nullptr;
  const cpu::AttentionShape shape{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, c.window};
  const int64_t nrow = c.batch * c.heads * c.seq;
  const CpuReference ref = cpu_reference(shape, q, k, v, dout, sk, 0.5f);
  const auto& [out_ref, dq_ref, dk_ref, dv_ref, sink_probs, dsink_ref] = ref;
  for (int64_t rows : {int64_t{1}, int64_t{4}, int64_t{7}, c.seq}) {
    SCOPED_TRACE("rows per block " + std::to_string(rows) + ", window " + std::to_string(c.window));
    HostOps ops;
    const int64_t block = c.heads * std::min(rows, c.seq) * c.seq;
    std::vector<float> s(static_cast<size_t>(block)), p(static_cast<size_t>(block));
    std::vector<float> out(static_cast<size_t>(nq), NAN), lse(static_cast<size_t>(nrow), NAN);
    ASSERT_TRUE(attention_forward_schedule<float>(ops, d, q.data(), k.data(), v.data(), out.data(), lse.data(), s.data(),
                                                  p.data(), rows, sk)
                    .ok());
    EXPECT_LE(normalised_error(out, out_ref), 1e-5);
    // A block never reads more keys than its rows plus the window, nor more than the sequence.
    if (c.window > 0) {
      EXPECT_LE(ops.max_keys, std::min(c.seq, std::min(rows, c.seq) + c.window - 1));
    }
    if (c.sinks)  // the sink's probability is exp(sink - lse), the CPU op's sink_probs
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = 0; h < c.heads; ++h)
          for (int64_t t = 0; t < c.seq; ++t) {
            const size_t at = static_cast<size_t>((b * c.heads + h) * c.seq + t);
            ASSERT_NEAR(std::exp(sinks[static_cast<size_t>(h)] - lse[at]), sink_probs[at], 1e-5) << b << " " << h << " " << t;
          }
    std::vector<float> dq(static_cast<size_t>(nq), NAN), dk(static_cast<size_t>(nk), NAN), dv(static_cast<size_t>(nk), NAN);
    std::vector<float> drow(static_cast<size_t>(nrow)), dsink(static_cast<size_t>(c.heads), 0.5f);
    ASSERT_TRUE(attention_backward_schedule<float>(ops, d, q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(),
                                                   dq.data(), dk.data(), dv.data(), s.data(), p.data(), drow.data(), rows, sk,
                                                   c.sinks ? dsink.data() : nullptr)
                    .ok());
    EXPECT_LE(normalised_error(dq, dq_ref), 1e-5);
    EXPECT_LE(normalised_error(dk, dk_ref), 1e-5);
    EXPECT_LE(normalised_error(dv, dv_ref), 1e-5);
    if (c.sinks) {
      EXPECT_LE(normalised_error(dsink, dsink_ref), 1e-5);
      double moved = 0;  // the sinks' gradient is not trivially zero
      for (float x : dsink) moved += std::abs(x - 0.5f);
      EXPECT_GT(moved, 1e-3);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionScheduleWindow,
                         ::testing::Values(WindowCase{1, 23, 4, 2, 8, 5, true}, WindowCase{2, 17, 4, 1, 8, 3, false},
                                           WindowCase{1, 19, 2, 2, 16, 1, true}, WindowCase{2, 9, 3, 3, 8, 40, true},
                                           WindowCase{1, 21, 6, 2, 8, 0, true}));

TEST(AttentionSchedule, RefusesANegativeWindowAndSinksWithoutTheirGradient) {
  HostOps ops;
  float x[64] = {};
  AttnDims d{1, 2, 1, 1, 2};
  d.window = -1;
  EXPECT_FALSE((attention_forward_schedule<float>(ops, d, x, x, x, x, x, x, x, 2).ok()));
  d.window = 0;
  EXPECT_FALSE((attention_backward_schedule<float>(ops, d, x, x, x, x, x, x, x, x, x, x, x, x, 2, x, nullptr).ok()));
}


// Rows packed "neat": each query sees only its own document (AttnDims::starts), with and without
// a window and sinks, against the CPU op given the same starts; a block whose first query begins a
// later document reads no key before that document.
struct DocumentCase {
  int64_t batch, seq, heads, kv_heads, head_dim, window;
  bool sinks;
  std::vector<std::vector<int64_t>> documents;  // per row, the lengths of its documents (summing to seq)
};
class AttentionScheduleDocuments : public ::testing::TestWithParam<DocumentCase> {};

TEST_P(AttentionScheduleDocuments, EqualsTheCpuOpWithDocumentStarts) {
  const DocumentCase c = GetParam();
  std::vector<int32_t> starts;
  for (const auto& row : c.documents) {
    int64_t at = 0;
    for (int64_t len : row) {
      for (int64_t i = 0; i < len; ++i) starts.push_back(static_cast<int32_t>(at));
      at += len;
    }
    ASSERT_EQ(at, c.seq);
  }
  ASSERT_EQ(static_cast<int64_t>(starts.size()), c.batch * c.seq);
  AttnDims d{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, c.window, starts.data(), starts.data()};
  std::mt19937 g(static_cast<uint32_t>(c.seq * 29 + c.window * 3 + (c.sinks ? 1 : 0)));
  const int64_t nq = c.batch * c.seq * c.heads * c.head_dim, nk = c.batch * c.seq * c.kv_heads * c.head_dim;
  const std::vector<float> q = randn(nq, g), k = randn(nk, g), v = randn(nk, g), dout = randn(nq, g);
  std::vector<float> sinks = randn(c.heads, g);
  const float* sk = c.sinks ? sinks.data() : nullptr;
  cpu::AttentionShape shape{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, c.window, starts.data()};
  const int64_t nrow = c.batch * c.heads * c.seq;
  const CpuReference ref = cpu_reference(shape, q, k, v, dout, sk, 0.0f);
  const auto& [out_ref, dq_ref, dk_ref, dv_ref, sink_probs, dsink_ref] = ref;
  // The documents matter: without the starts the output differs.
  cpu::AttentionShape whole = shape;
  whole.starts = nullptr;
  EXPECT_GT(normalised_error(cpu_reference(whole, q, k, v, dout, sk, 0.0f).out, out_ref), 1e-2);
  for (int64_t rows : {int64_t{1}, int64_t{5}, int64_t{8}, c.seq}) {
    SCOPED_TRACE("rows per block " + std::to_string(rows));
    HostOps ops;
    const int64_t block = c.heads * std::min(rows, c.seq) * c.seq;
    std::vector<float> s(static_cast<size_t>(block)), p(static_cast<size_t>(block));
    std::vector<float> out(static_cast<size_t>(nq), NAN), lse(static_cast<size_t>(nrow), NAN);
    ASSERT_TRUE(attention_forward_schedule<float>(ops, d, q.data(), k.data(), v.data(), out.data(), lse.data(), s.data(),
                                                  p.data(), rows, sk)
                    .ok());
    EXPECT_LE(normalised_error(out, out_ref), 1e-5);
    if (rows == 1) {  // one query per block: it reads exactly its document's keys so far (or its window's)
      int64_t longest = 0;
      for (const auto& row : c.documents)
        for (int64_t len : row) longest = std::max(longest, c.window > 0 ? std::min(len, c.window) : len);
      EXPECT_EQ(ops.max_keys, longest);
    }
    std::vector<float> dq(static_cast<size_t>(nq), NAN), dk(static_cast<size_t>(nk), NAN), dv(static_cast<size_t>(nk), NAN);
    std::vector<float> drow(static_cast<size_t>(nrow)), dsink(static_cast<size_t>(c.heads), 0.0f);
    ASSERT_TRUE(attention_backward_schedule<float>(ops, d, q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(),
                                                   dq.data(), dk.data(), dv.data(), s.data(), p.data(), drow.data(), rows, sk,
                                                   c.sinks ? dsink.data() : nullptr)
                    .ok());
    EXPECT_LE(normalised_error(dq, dq_ref), 1e-5);
    EXPECT_LE(normalised_error(dk, dk_ref), 1e-5);
    EXPECT_LE(normalised_error(dv, dv_ref), 1e-5);
    if (c.sinks) {
      EXPECT_LE(normalised_error(dsink, dsink_ref), 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionScheduleDocuments,
                         ::testing::Values(DocumentCase{2, 19, 4, 2, 8, 0, false, {{5, 9, 5}, {1, 1, 17}}},
                                           DocumentCase{1, 24, 2, 1, 8, 4, true, {{7, 11, 6}}},
                                           DocumentCase{2, 16, 3, 3, 8, 0, true, {{16}, {3, 3, 3, 3, 4}}},
                                           DocumentCase{1, 21, 6, 2, 4, 30, false, {{2, 13, 6}}}));

TEST(AttentionSchedule, RefusesDocumentStartsThatAreNotContiguousDocuments) {
  HostOps ops;
  float x[64] = {};
  std::vector<int32_t> starts{0, 0, 2, 1};  // decreases: not contiguous documents
  AttnDims d{1, 4, 1, 1, 2, 0, starts.data(), starts.data()};
  const Status st = attention_forward_schedule<float>(ops, d, x, x, x, x, x, x, x, 2);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("token 3 starts its document at 1"), std::string::npos) << st.message();
  starts = {0, 2, 2, 2};  // a start after its token
  EXPECT_FALSE((attention_forward_schedule<float>(ops, d, x, x, x, x, x, x, x, 2).ok()));
  d.starts_dev = nullptr;  // one side only
  starts = {0, 0, 2, 2};
  EXPECT_FALSE((attention_forward_schedule<float>(ops, d, x, x, x, x, x, x, x, 2).ok()));
  EXPECT_EQ(ops.gemms, 0);
}

}  // namespace
}  // namespace megatrain::cuda

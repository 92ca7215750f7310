// The block schedule of the CUDA attention (kernels/cuda/attention_schedule.h) checked without a
// GPU: the same schedule code runs over a plain host emulation of its operations (a row-major
// strided-batched GEMM and the four element-wise steps, written from their contracts), and its
// outputs must equal the CPU attention op's to fp32 rounding, for every block size (1 row, a few
// rows, blocks that do not divide the sequence, the whole sequence), with GQA and MHA. This is what
// can be checked here of the GPU path: the sub-matrices, strides, causal limits and accumulation
// order of every GEMM. The kernels themselves are checked against the CPU op on a GPU
// (cuda_ops_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
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
  Status softmax_rows(const float* s, float* p, float* lse, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0, int64_t seq,
                      int64_t lse_base) {
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < rows; ++i) {
        const float* sr = s + (h * rows + i) * keys;
        float* pr = p + (h * rows + i) * keys;
        const int64_t visible = r0 + i + 1;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < visible; ++j) mx = std::max(mx, static_cast<double>(sr[j]));
        for (int64_t j = 0; j < visible; ++j) sum += std::exp(sr[j] - mx);
        for (int64_t j = 0; j < keys; ++j) pr[j] = j < visible ? static_cast<float>(std::exp(sr[j] - mx) / sum) : 0.0f;
        lse[lse_base + h * seq + r0 + i] = static_cast<float>(mx + std::log(sum));
      }
    return {};
  }
  Status probs_from_lse(const float* s, const float* lse, float* p, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0,
                        int64_t seq, int64_t lse_base) {
    for (int64_t h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < keys; ++j) {
          const int64_t e = (h * rows + i) * keys + j;
          p[e] = j <= r0 + i ? static_cast<float>(std::exp(static_cast<double>(s[e]) - lse[lse_base + h * seq + r0 + i])) : 0.0f;
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

TEST(AttentionSchedule, RefusesBadShapes) {
  HostOps ops;
  float x = 0;
  EXPECT_FALSE((attention_forward_schedule<float>(ops, AttnDims{1, 4, 3, 2, 8}, &x, &x, &x, &x, &x, &x, &x, 2).ok()));
  EXPECT_FALSE((attention_forward_schedule<float>(ops, AttnDims{1, 4, 2, 2, 8}, &x, &x, &x, &x, &x, &x, &x, 0).ok()));
  EXPECT_EQ(ops.gemms, 0);
}

}  // namespace
}  // namespace megatrain::cuda

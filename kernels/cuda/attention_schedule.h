// The block schedule of the memory-efficient attention (attention.cu): which GEMMs and which
// element-wise steps run, on which sub-matrices, in which order. It is host code over an `Ops`
// object, so that the same schedule drives cuBLAS and the CUDA kernels on the GPU and a plain host
// emulation in tests/kernels/attention_schedule_test.cpp, which checks it against the CPU op on a
// machine without a GPU.
//
// Ops provides, all row-major with leading dimensions and batch strides in elements:
//   gemm<A, C>(ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c, batch)
//       c[i] = alpha * op(a[i]) op(b[i]) + beta * c[i] for each of `batch` problems
//   gemm2<A, C>(ta, tb, m, n, k, alpha, a, lda, Stride2 sa, b, ldb, Stride2 sb, c, ldc, Stride2 sc, n_outer, n_inner)
//       the same for n_outer x n_inner problems, problem (o, i) at x + o * sx.outer + i * sx.inner
//       for each operand x, with beta 0; no two problems write the same c. One launch (GpuOps:
//       one pointer-array cuBLAS call where the operands allow it, else one call per inner index).
//       The query heads h = g * rep + r of a GQA group are such a grid: outer g (n_kv_heads), inner
//       r (rep), the group's K and V at inner stride 0.
//   softmax_rows(s, p, lse, n_heads, rows, keys, r0, k0, window, seq, lse_base, sinks, starts)
//       per score row (h, i) of s [n_heads, rows, keys], whose column c is key j = k0 + c: softmax
//       over the keys the query t = r0 + i sees (visible(t, j, window, starts[t]) below; starts is
//       the row's document starts, or null for one document) into p (0 elsewhere),
//       with the sink logit sinks[h] in the denominator when sinks is not null (a column with no
//       value), and lse[lse_base + h * seq + t] = max + log(sum), the sink included
//   probs_from_lse(s, lse, p, n_heads, rows, keys, r0, k0, window, seq, lse_base, starts)
//       p = exp(s - lse) on the visible keys, 0 elsewhere
//   sink_grad(sinks, lse, drow, batch, n_heads, seq, d_sinks)
//       d_sinks[h] += sum over (b, t) of -exp(sinks[h] - lse[b, h, t]) * drow[b, h, t]: the sink's
//       probability times (0 - D), its logit having no value row (a fixed order per head)
//   scores_grad(p_ds, dp, drow, n_heads, rows, keys, r0, seq, d_base, scale)
//       p_ds = p_ds * (dp - drow[d_base + h * seq + r0 + i]) * scale, in place
//   row_dot(dout, out, drow, batch, seq, n_heads, head_dim)
//       drow[(b * n_heads + h) * seq + t] = sum_d dout[b, t, h, d] * out[b, t, h, d]
//   zero(float* p, n)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "megatrain/core/status.h"

namespace megatrain::cuda {

// The two strides of a gemm2 operand, in elements.
struct Stride2 {
  int64_t outer = 0, inner = 0;
};

struct AttnDims {
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  // The sliding window (gpt-oss, Mistral): query t sees key j when t - window < j <= t; 0 for the
  // whole causal prefix. It does not change the workspace (a block never has more keys than seq).
  int64_t window = 0;
  // Packed documents that attend only to themselves (data packed "neat"): [batch * seq] int32, the
  // first key of each query's document within its row (cpu::AttentionShape::starts), so query t
  // sees key j only when starts[b * seq + t] <= j as well. `starts` is read on the host (each
  // block's first key: its first query's document start, since starts never decrease along a row)
  // and `starts_dev` by the kernels; the host emulation passes the same array for both. Null: one
  // document per row. Neither changes the workspace.
  const int32_t* starts = nullptr;
  const int32_t* starts_dev = nullptr;
};

// Whether query t sees key j (host and device), and the first key a block of queries from r0 sees.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool attention_visible(int64_t t, int64_t j, int64_t window, int64_t first = 0) {
  return j <= t && j >= first && (window <= 0 || j > t - window);
}
inline int64_t attention_first_key(int64_t r0, int64_t window) { return window > 0 ? std::max<int64_t>(0, r0 - window + 1) : 0; }

// Bytes of workspace forward and backward need with `rows` query rows per block: S (fp32) and
// P/dS (sized for fp32 so that one size serves both paths), the D rows, then gemm2's pointer
// arrays (A, B and C for each of the n_heads problems of one call); 256-byte aligned.
inline int64_t attention_align_up(int64_t x) { return (x + 255) / 256 * 256; }
inline int64_t attention_workspace_bytes(const AttnDims& d, int64_t rows) {
  rows = std::min(rows, d.seq);
  const int64_t block = d.n_heads * rows * d.seq;
  return 2 * attention_align_up(block * 4) + attention_align_up(d.batch * d.n_heads * d.seq * 4) +
         attention_align_up(3 * 8 * d.n_heads);
}
// Query rows per block for a workspace of `budget_bytes` (at least 16 rows, at most seq). Below seq
// it is a multiple of 8: then without a sliding window every block's key count (r0 + rows) and
// score block (rows x keys) are multiples of 8 when seq is, so each head's scores start on a
// 32-byte boundary and gemm2 can issue one pointer-array call (GpuOps).
inline int64_t attention_block_rows(const AttnDims& d, int64_t budget_bytes) {
  const int64_t fixed = attention_align_up(d.batch * d.n_heads * d.seq * 4) + 2 * 256 + attention_align_up(24 * d.n_heads);
  const int64_t per_row = 8 * d.n_heads * d.seq;
  int64_t rows = per_row > 0 ? (budget_bytes - fixed) / per_row : d.seq;
  rows = std::max<int64_t>(rows / 8 * 8, 16);
  return std::min(rows, d.seq);
}

// The first key the block of queries from r0 in row b reads: its first query's window start, or
// its document's start when that is later.
inline int64_t attention_first_key(const AttnDims& d, int64_t b, int64_t r0) {
  const int64_t k0 = attention_first_key(r0, d.window);
  return d.starts != nullptr ? std::max<int64_t>(k0, d.starts[b * d.seq + r0]) : k0;
}

inline Status check_attention(const AttnDims& d, int64_t rows) {
  if (d.batch <= 0 || d.seq <= 0 || d.n_heads <= 0 || d.n_kv_heads <= 0 || d.head_dim <= 0 || d.n_heads % d.n_kv_heads != 0)
    return invalid_argument("attention: batch, seq, heads and head_dim must be positive and n_kv_heads must divide n_heads");
  if (rows <= 0) return invalid_argument("attention: the block of query rows must be positive");
  if (d.window < 0) return invalid_argument("attention: window " + std::to_string(d.window) + "; accepted: 0 (none) or positive");
  if ((d.starts == nullptr) != (d.starts_dev == nullptr))
    return invalid_argument("attention: document starts given on one side only; accepted: both (host and device) or neither");
  if (d.starts != nullptr)
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t t = 0; t < d.seq; ++t) {
        const int64_t st = d.starts[b * d.seq + t];
        if (st < 0 || st > t || (t > 0 && st < d.starts[b * d.seq + t - 1]))
          return invalid_argument("attention: row " + std::to_string(b) + " token " + std::to_string(t) + " starts its document at " +
                                  std::to_string(st) + "; accepted: starts that never decrease along a row, with 0 <= start <= token");
      }
  return {};
}

// Row b's document starts for the kernels (device), or null.
inline const int32_t* row_starts(const AttnDims& d, int64_t b) { return d.starts_dev != nullptr ? d.starts_dev + b * d.seq : nullptr; }

// s: fp32 scores of one block [n_heads, rows, keys]; p: T probabilities of the same shape. A block
// of queries [r0, r0 + rows) reads keys [k0, r0 + rows): k0 = 0 without a window, else the first
// key its first query sees, so a sliding window costs rows x (rows + window) per head, not rows x
// r0. sinks [n_heads] (T, or null): gpt-oss's per-head sink logits.
template <typename T, typename Ops>
Status attention_forward_schedule(Ops& ops, const AttnDims& d, const T* q, const T* k, const T* v, T* out, float* lse,
                                  float* s, T* p, int64_t rows_per_block, const T* sinks = nullptr) {
  MT_RETURN_IF_ERROR(check_attention(d, rows_per_block));
  const int64_t rep = d.n_heads / d.n_kv_heads, hd = d.head_dim, seq = d.seq;
  const int64_t qld = d.n_heads * hd, kld = d.n_kv_heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t b = 0; b < d.batch; ++b) {
    const T* kb = k + b * seq * kld;
    const T* vb = v + b * seq * kld;
    for (int64_t r0 = 0; r0 < seq; r0 += rows_per_block) {
      const int64_t rows = std::min(rows_per_block, seq - r0);
      const int64_t k0 = attention_first_key(d, b, r0), keys = r0 + rows - k0;  // causal: keys < r0 + rows
      const int64_t hb = rows * keys;                                                // one head's scores
      // Query head h = g * rep + r reads kv head g: heads are head_dim apart in q (rep * head_dim
      // from group to group), hb apart in the scores, and a group's rep heads share its k and v
      // (inner stride 0): one gemm2 over the (g, r) grid.
      const Stride2 sq{rep * hd, hd}, skv{hd, 0}, ss{rep * hb, hb};
      MT_RETURN_IF_ERROR((ops.template gemm2<T, float>(false, true, rows, keys, hd, scale, q + (b * seq + r0) * qld, qld, sq,
                                                       kb + k0 * kld, kld, skv, s, keys, ss, d.n_kv_heads, rep)));
      MT_RETURN_IF_ERROR(
          ops.softmax_rows(s, p, lse, d.n_heads, rows, keys, r0, k0, d.window, seq, b * d.n_heads * seq, sinks, row_starts(d, b)));
      MT_RETURN_IF_ERROR((ops.template gemm2<T, T>(false, false, rows, hd, keys, 1.0f, p, keys, ss, vb + k0 * kld, kld, skv,
                                                   out + (b * seq + r0) * qld, qld, sq, d.n_kv_heads, rep)));
    }
  }
  return {};
}

// drow: [batch, n_heads, seq] fp32. With sinks (the forward's, whose lse includes them), their
// gradient is added into d_sinks [n_heads] (fp32).
template <typename T, typename Ops>
Status attention_backward_schedule(Ops& ops, const AttnDims& d, const T* q, const T* k, const T* v, const T* out,
                                   const T* dout, const float* lse, float* dq, float* dk, float* dv, float* s, T* p,
                                   float* drow, int64_t rows_per_block, const T* sinks = nullptr, float* d_sinks = nullptr) {
  MT_RETURN_IF_ERROR(check_attention(d, rows_per_block));
  const int64_t rep = d.n_heads / d.n_kv_heads, hd = d.head_dim, seq = d.seq;
  const int64_t qld = d.n_heads * hd, kld = d.n_kv_heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  MT_RETURN_IF_ERROR(ops.zero(dk, d.batch * seq * kld));
  MT_RETURN_IF_ERROR(ops.zero(dv, d.batch * seq * kld));
  MT_RETURN_IF_ERROR(ops.row_dot(dout, out, drow, d.batch, seq, d.n_heads, hd));
  if (sinks != nullptr) {
    if (d_sinks == nullptr) return invalid_argument("attention backward: sinks need their gradient d_sinks");
    MT_RETURN_IF_ERROR(ops.sink_grad(sinks, lse, drow, d.batch, d.n_heads, seq, d_sinks));
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    const T* kb = k + b * seq * kld;
    const T* vb = v + b * seq * kld;
    float* dkb = dk + b * seq * kld;
    float* dvb = dv + b * seq * kld;
    for (int64_t r0 = 0; r0 < seq; r0 += rows_per_block) {
      const int64_t rows = std::min(rows_per_block, seq - r0);
      const int64_t k0 = attention_first_key(d, b, r0), keys = r0 + rows - k0;
      const int64_t hb = rows * keys;
      const T* kw = kb + k0 * kld;  // the block's first key and value rows, and their gradients
      const T* vw = vb + k0 * kld;
      float* dkw = dkb + k0 * kld;
      float* dvw = dvb + k0 * kld;
      const Stride2 sq{rep * hd, hd}, skv{hd, 0}, ss{rep * hb, hb};
      const T* qb = q + (b * seq + r0) * qld;
      const T* dob = dout + (b * seq + r0) * qld;
      // The scores again, over the (g, r) grid of heads (as the forward).
      MT_RETURN_IF_ERROR((ops.template gemm2<T, float>(false, true, rows, keys, hd, scale, qb, qld, sq, kw, kld, skv, s, keys, ss,
                                                       d.n_kv_heads, rep)));
      MT_RETURN_IF_ERROR(
          ops.probs_from_lse(s, lse, p, d.n_heads, rows, keys, r0, k0, d.window, seq, b * d.n_heads * seq, row_starts(d, b)));
      // dP_h = dO_h V_g^T, over the scores (no longer needed): every head at once.
      MT_RETURN_IF_ERROR((ops.template gemm2<T, float>(false, true, rows, keys, hd, 1.0f, dob, qld, sq, vw, kld, skv, s, keys, ss,
                                                       d.n_kv_heads, rep)));
      // dV_g += P_h^T dO_h: the heads r of a group add into the same dV_g, so one call per r, in order.
      for (int64_t r = 0; r < rep; ++r)
        MT_RETURN_IF_ERROR((ops.template gemm<T, float>(true, false, keys, hd, rows, 1.0f, p + r * hb, keys, rep * hb,
                                                        dob + r * hd, qld, rep * hd, 1.0f, dvw, kld, hd, d.n_kv_heads)));
      MT_RETURN_IF_ERROR(ops.scores_grad(p, s, drow, d.n_heads, rows, keys, r0, seq, b * d.n_heads * seq, scale));
      // dQ_h = dS_h K_g: every head at once.
      MT_RETURN_IF_ERROR((ops.template gemm2<T, float>(false, false, rows, hd, keys, 1.0f, p, keys, ss, kw, kld, skv,
                                                       dq + (b * seq + r0) * qld, qld, sq, d.n_kv_heads, rep)));
      // dK_g += dS_h^T Q_h: as dV, one call per r, in order.
      for (int64_t r = 0; r < rep; ++r)
        MT_RETURN_IF_ERROR((ops.template gemm<T, float>(true, false, keys, hd, rows, 1.0f, p + r * hb, keys, rep * hb,
                                                        qb + r * hd, qld, rep * hd, 1.0f, dkw, kld, hd, d.n_kv_heads)));
    }
  }
  return {};
}

}  // namespace megatrain::cuda

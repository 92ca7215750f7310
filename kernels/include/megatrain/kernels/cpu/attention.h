// Causal scaled-dot-product attention with grouped-query attention (GQA), HF "eager" semantics.
//
// Query head h reads key/value head g = h / (n_heads / n_kv_heads): HF's repeat_kv repeats each kv
// head n_rep = n_heads / n_kv_heads times consecutively. With scale = head_dim^-0.5, for batch b,
// query head h and query position i (keys j <= i only; later keys are masked to -inf):
//   s[j]   = (q[b,i,h,:] . k[b,j,g,:]) * scale
//   p[j]   = exp(s[j] - max_j s) / sum_j exp(s[j] - max_j s)          (softmax in T)
//   out[b,i,h,:] = sum_{j<=i} p[j] * v[b,j,g,:]
// Backward, with dp[j] = dout[b,i,h,:] . v[b,j,g,:] and D = sum_j p[j] * dp[j]:
//   ds[j]  = p[j] * (dp[j] - D) * scale
//   dq[b,i,h,:] = sum_{j<=i} ds[j] * k[b,j,g,:]
//   dk[b,j,g,:] = sum_{h in group g} sum_{i>=j} ds_h[i][j] * q[b,i,h,:]
//   dv[b,j,g,:] = sum_{h in group g} sum_{i>=j} p_h[i][j] * dout[b,i,h,:]
//
// Sliding window (AttentionShape::window > 0; Mistral, Mixtral, gpt-oss's sliding layers): key j
// is seen by query i when i - window < j <= i, as HF's sliding_window_overlay masks it.
// Packed rows without cross-document attention (AttentionShape::starts non-null): each token's
// document begins at key starts[b * T + i] of its row, and query i sees key j only when
// starts[b * T + i] <= j (as well as j <= i and the window): what transformers computes for each
// document alone (its flattening collator's position_ids, LLaMA-Factory's neat_packing). starts
// must be non-decreasing along a row with starts[i] <= i (documents are contiguous).
// Attention sinks (gpt-oss): one learned logit per query head joins each row's softmax as an extra
// column with no value, HF's cat([scores, sink]) - max, softmax, drop the last column:
//   p[j] = exp(s[j] - m) / (sum_j exp(s[j] - m) + exp(sink_h - m)),  m = max(max_j s[j], sink_h)
//   p_sink = exp(sink_h - m) / (the same sum)          (saved per row in sink_probs [B, n_heads, T])
//   d sink_h = sum over rows (b, i) of -p_sink * D     (D as below; the rows in order, per head)
//
// What forward saves: the softmax probabilities P [B, n_heads, T, T] (row i holds p[0..i], zeros
// above the diagonal), so that backward uses exactly the P that produced the output (no recompute,
// no rounding difference between passes) at a cost of 4 B * n_heads * T^2 per sequence in fp32.
// Backward needs a workspace of attention_probs_elems() elements for ds.
//
// Shapes (row-major, contiguous, as the projections produce them): q, out, dout, dq
// [B, T, n_heads, head_dim]; k, v, dk, dv [B, T, n_kv_heads, head_dim]. q and k are after RoPE; a
// q/k/v bias belongs to the projection (linear). dq, dk, dv are overwritten.
// Deterministic and independent of the thread count: forward and dq split blocks of query rows of
// one head (b, h, rows), each block's scores, output and dq Eigen products over the keys it sees;
// dk/dv split blocks of key rows of one kv head (b, g, rows), summing the group's heads in order.
#pragma once

#include <cstdint>

#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;  // sliding window (HF sliding_window); 0: the whole causal prefix
  // [B * T]: the first key of each token's document within its row; null: one document per row.
  const int32_t* starts = nullptr;
};

// ok when every size is positive and n_kv_heads divides n_heads; otherwise invalid_argument.
Status check_attention_shape(const AttentionShape& s);
// B * n_heads * T * T: the size of the saved probabilities and of the backward workspace.
int64_t attention_probs_elems(const AttentionShape& s);

// sinks [n_heads] (null: none) with sink_probs [B * n_heads * T] to receive each row's p_sink.
template <typename T>
Status attention_forward(CpuContext& ctx, const AttentionShape& s, const T* q, const T* k, const T* v, T* out,
                         T* probs, const T* sinks = nullptr, T* sink_probs = nullptr);

// With sinks: sink_probs from the forward, d_sinks [n_heads] accumulated, sink_rows a workspace of
// B * n_heads * T elements.
template <typename T>
Status attention_backward(CpuContext& ctx, const AttentionShape& s, const T* q, const T* k, const T* v,
                          const T* probs, const T* dout, T* dq, T* dk, T* dv, T* workspace,
                          const T* sink_probs = nullptr, T* d_sinks = nullptr, T* sink_rows = nullptr);

}  // namespace megatrain::cpu

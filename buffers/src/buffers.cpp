// The buffer lists of the CPU and CUDA backends. Each list is in the order the backend carves it;
// comments name what each buffer holds where the name does not say.
#include "megatrain/buffers/buffers.h"

#include <algorithm>
#include <array>
#include <string>

#include "cuda/attention_schedule.h"
#include "megatrain/buffers/cuda_attention.h"
#include "cuda/workspace_sizes.h"

namespace megatrain::buffers {

const char* buf_name(Buf b) {
  static const char* const kNames[] = {
      "x", "rstd1", "xn1", "q", "k", "v", "probs", "attn", "lse", "h", "rstd2", "xn2", "gate", "up", "gate_up", "act",
      "q_pre", "k_pre", "rstd_q", "rstd_k", "sink_probs",
      "router_logits", "router_probs", "route_weight", "route_expert", "perm", "row_of_slot", "expert_offsets", "xp", "yp",
      "dout_t", "dact", "dgate", "dup", "dgate_up", "dh_t", "dattn", "dq_t", "dk_t", "dv_t", "dxn", "tmp", "dh", "dq", "dk",
      "dv", "dscores", "more", "dxp", "dyp", "dweight", "dlogits", "dlogits_t",
      "head_xn", "head_rstd", "head_dxn", "run_max", "run_sum", "target_logit", "head_lse", "logits", "dlogits_head",
      "blas_workspace", "attention_workspace", "tokens", "targets", "positions", "unique_tokens", "token_offsets",
      "token_positions", "inv_freq", "loss_sum", "token_count", "column_partials", "sort_scratch", "gemm_pointers", "aux_stats",
      "aux_grad", "documents"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Buf::kCount));
  return kNames[static_cast<size_t>(b)];
}

int64_t BufferList::bytes() const {
  int64_t n = 0;
  for (const BufferSpec& b : items) n += rounded(b.count * b.elem_bytes);
  return n;
}

Carving::Carving(const BufferList& list, void* base)
    : base_(static_cast<char*>(base)),
      offset_(static_cast<size_t>(Buf::kCount), -1),
      elem_(static_cast<size_t>(Buf::kCount), 0) {
  for (const BufferSpec& b : list.items) {
    MT_CHECK(offset_[static_cast<size_t>(b.id)] < 0 && b.count >= 0, std::string("buffer list: ") + buf_name(b.id) +
                                                                          " appears twice or has a negative size");
    offset_[static_cast<size_t>(b.id)] = bytes_;
    elem_[static_cast<size_t>(b.id)] = b.elem_bytes;
    bytes_ += list.rounded(b.count * b.elem_bytes);
  }
}

void Carving::check(Buf id, int32_t elem_bytes) const {
  const auto i = static_cast<size_t>(id);
  MT_CHECK(offset_[i] >= 0, std::string("buffer ") + buf_name(id) + " is not in this backend's list");
  MT_CHECK(elem_bytes == 0 || elem_[i] == elem_bytes, std::string("buffer ") + buf_name(id) + " holds elements of " +
                                                         std::to_string(elem_[i]) + " bytes, taken as " +
                                                         std::to_string(elem_bytes));
}

// ---- CPU -----------------------------------------------------------------------------------------

namespace {
constexpr int32_t kI32 = 4, kF32 = 4, kF64 = 8;
int64_t probs_of(const Shape& s) { return s.B * s.nh * s.T * s.T; }
}  // namespace

int64_t cuda_column_sum_cols(const Shape& s) { return std::max({s.H, s.q, s.kv, s.hd, s.moe ? s.E : int64_t{0}}); }

// A layer's kept activations are the values its ops write (arch::Val), each as large as its
// largest writer over the layer kinds the model has (the dense MLP's gate and an expert block's
// share one buffer), and what the ops keep beside them: each norm's 1/rms, the attention's
// probabilities (and sinks), the routing. The layer's input x is the first buffer.
BufferList cpu_layer_acts(const Shape& s, int32_t e) {
  using arch::OpKind;
  using arch::Val;
  constexpr size_t kVals = static_cast<size_t>(Val::kOut) + 1;
  std::array<int64_t, kVals> size{};
  bool attn_norm = false, mlp_norm = false, head_norm = false, attention = false, route = false;
  auto grow = [&size](Val v, int64_t n) { size[static_cast<size_t>(v)] = std::max(size[static_cast<size_t>(v)], n); };
  for (const std::vector<arch::Op>* ops : {&s.dense_ops, &s.moe_ops})
    for (const arch::Op& op : *ops) {
      attn_norm = attn_norm || (op.kind == OpKind::kNorm && op.weight == TensorRole::kAttnNorm);
      mlp_norm = mlp_norm || (op.kind == OpKind::kNorm && op.weight == TensorRole::kMlpNorm);
      head_norm = head_norm || op.kind == OpKind::kHeadNorm;
      attention = attention || op.kind == OpKind::kAttention;
      route = route || op.kind == OpKind::kRoute;
      if (op.dst == Val::kQk || op.dst == Val::kQkPre) {  // q and k, each its own buffer
        grow(op.dst == Val::kQk ? Val::kQ : Val::kQPre, s.N * s.q);
        grow(op.dst == Val::kQk ? Val::kK : Val::kKPre, s.N * s.kv);
      } else if (op.dst != Val::kNone && op.dst != Val::kOut) {
        grow(op.dst, (op.slots ? s.N * s.k : s.N) * dim_width(op.out, s));
      }
    }
  BufferList l;
  l.align = e;
  auto value = [&](Buf b, Val v) {
    if (size[static_cast<size_t>(v)] > 0) l.add(b, size[static_cast<size_t>(v)], e);
  };
  l.add(Buf::kX, s.N * s.H, e);
  if (attn_norm) l.add(Buf::kRstd1, s.N, e);
  value(Buf::kXn1, Val::kXn1);
  value(Buf::kQ, Val::kQ);
  value(Buf::kK, Val::kK);
  value(Buf::kV, Val::kV);
  if (attention) l.add(Buf::kProbs, probs_of(s), e);  // eager attention keeps the T x T probabilities
  value(Buf::kAttn, Val::kAttn);
  value(Buf::kH, Val::kH);
  if (mlp_norm) l.add(Buf::kRstd2, s.N, e);
  value(Buf::kXn2, Val::kXn2);
  value(Buf::kGate, Val::kGate);  // gpt-oss: gate and up interleaved, 2 x Im a slot
  value(Buf::kUp, Val::kUp);
  value(Buf::kAct, Val::kAct);
  value(Buf::kQPre, Val::kQPre);
  value(Buf::kKPre, Val::kKPre);
  if (head_norm) {
    l.add(Buf::kRstdQ, s.N * s.nh, e);
    l.add(Buf::kRstdK, s.N * s.nkv, e);
  }
  if (attention && s.sinks) l.add(Buf::kSinkProbs, s.B * s.nh * s.T, e);  // each attention row's sink probability
  if (route) {
    const int64_t slots = s.N * s.k;
    value(Buf::kRouterLogits, Val::kLogits);
    l.add(Buf::kRouterProbs, s.N * s.E, e);
    l.add(Buf::kRouteWeight, slots, e);
    value(Buf::kXp, Val::kXp);
    value(Buf::kYp, Val::kYp);
    l.add(Buf::kRouteExpert, slots, kI32);
    l.add(Buf::kPerm, slots, kI32);
    l.add(Buf::kRowOfSlot, slots, kI32);
    l.add(Buf::kExpertOffsets, s.E + 1, kI32);
  }
  return l;
}

BufferList cpu_layer_workspace(const Shape& s, int32_t e) {
  BufferList l;
  l.align = e;
  const int64_t NH = s.N * s.H;
  l.add(Buf::kDact, s.mlp_floats(), e);
  l.add(Buf::kDgate, s.mlp_floats(), e);
  l.add(Buf::kDup, s.mlp_floats(), e);
  l.add(Buf::kDxn, NH, e);
  l.add(Buf::kDh, NH, e);
  l.add(Buf::kDattn, s.N * s.q, e);
  l.add(Buf::kDq, s.N * s.q, e);
  l.add(Buf::kDk, s.N * s.kv, e);
  l.add(Buf::kDv, s.N * s.kv, e);
  l.add(Buf::kDscores, probs_of(s), e);
  l.add(Buf::kTmp, NH, e);
  // Used one after the other: the MoE block's dxp, dyp [N*k, H], d weight [N*k] and d logits
  // [N, E]; the attention sinks' per-row gradients [B, nh, T]; the q/k norms' input gradients.
  const int64_t moe = s.moe ? 2 * s.N * s.k * s.H + s.N * s.k + s.N * s.E : 0;
  const int64_t qk = s.qk_norm ? s.N * (s.q + s.kv) : 0;
  const int64_t sinks = s.sinks ? s.B * s.nh * s.T : 0;
  l.add(Buf::kMore, std::max({moe, qk, sinks}), e);
  return l;
}

BufferList cpu_head_workspace(const Shape& s, int32_t e) {
  BufferList l;
  l.align = e;
  l.add(Buf::kLogits, s.N * s.V, e);  // the logits, then their gradient in place
  l.add(Buf::kHeadLse, s.N, e);
  l.add(Buf::kHeadRstd, s.N, e);
  l.add(Buf::kHeadXn, s.N * s.H, e);
  l.add(Buf::kHeadDxn, s.N * s.H, e);
  return l;
}

// ---- CUDA ----------------------------------------------------------------------------------------

int64_t cuda_attention_rows(const Shape& s) {
  const int64_t rows = cuda::attention_block_rows(cuda_attention_dims(s), kCudaAttentionBudgetBytes);
  return s.caps.attention_rows > 0 ? std::min(rows, s.caps.attention_rows) : rows;
}

int64_t cuda_vocab_chunk(const Shape& s) {
  // At least 128 columns, at most the vocabulary (min after max: a vocabulary below 128 caps it).
  const int64_t chunk = std::min<int64_t>(std::max<int64_t>(kCudaLogitElems / std::max<int64_t>(s.N, 1) / 128 * 128, 128), s.V);
  return s.caps.vocab_chunk > 0 ? std::min(chunk, s.caps.vocab_chunk) : chunk;
}

BufferList cuda_layer_acts(const Shape& s, int32_t t) {
  BufferList l;
  l.align = kCudaCarveAlign;
  const int64_t NH = s.N * s.H;
  l.add(Buf::kX, NH, kF32);  // first: the pipeline writes a recompute's input here
  l.add(Buf::kRstd1, s.N, kF32);
  l.add(Buf::kXn1, NH, t);
  l.add(Buf::kQ, s.N * s.q, t);
  l.add(Buf::kK, s.N * s.kv, t);
  l.add(Buf::kV, s.N * s.kv, t);
  l.add(Buf::kAttn, s.N * s.q, t);
  // Fused attention keeps one log-sum-exp per row and head (gpt-oss: its sink included, so that
  // exp(sink - lse) is the sink's probability).
  l.add(Buf::kLse, s.B * s.nh * s.T, kF32);
  l.add(Buf::kH, NH, kF32);
  l.add(Buf::kRstd2, s.N, kF32);
  l.add(Buf::kXn2, NH, t);
  if (s.gpt_oss) {
    l.add(Buf::kGateUp, 2 * s.mlp_floats(), t);  // [N*k, 2 Im] interleaved as the projection writes it
  } else {
    l.add(Buf::kGate, s.mlp_floats(), t);
    l.add(Buf::kUp, s.mlp_floats(), t);
  }
  l.add(Buf::kAct, s.mlp_floats(), t);
  if (s.qk_norm) {
    l.add(Buf::kQPre, s.N * s.q, kF32);
    l.add(Buf::kKPre, s.N * s.kv, kF32);
    l.add(Buf::kRstdQ, s.N * s.nh, kF32);
    l.add(Buf::kRstdK, s.N * s.nkv, kF32);
  }
  if (s.moe) {  // routing in fp32 and int32; the gathered inputs and expert outputs in T
    const int64_t slots = s.N * s.k;
    l.add(Buf::kRouterLogits, s.N * s.E, kF32);
    l.add(Buf::kRouterProbs, s.N * s.E, kF32);
    l.add(Buf::kRouteWeight, slots, kF32);
    l.add(Buf::kRouteExpert, slots, kI32);
    l.add(Buf::kPerm, slots, kI32);
    l.add(Buf::kRowOfSlot, slots, kI32);
    l.add(Buf::kExpertOffsets, s.E + 1, kI32);
    l.add(Buf::kXp, slots * s.H, t);
    l.add(Buf::kYp, slots * s.H, t);
  }
  return l;
}

BufferList cuda_layer_workspace(const Shape& s, int32_t t) {
  BufferList l;
  l.align = kCudaCarveAlign;
  const bool cast = t != kF32;  // fp32 needs no bf16 copies for the GEMMs
  const int64_t NH = s.N * s.H;
  l.add(Buf::kDoutT, cast ? NH : 0, t);
  l.add(Buf::kDact, s.mlp_floats(), t);
  if (s.gpt_oss) {
    l.add(Buf::kDgateUp, 2 * s.mlp_floats(), t);  // d gate_up [N*k, 2 Im] in one piece
  } else {
    l.add(Buf::kDgate, s.mlp_floats(), t);
    l.add(Buf::kDup, s.mlp_floats(), t);
  }
  l.add(Buf::kDhT, cast ? NH : 0, t);
  l.add(Buf::kDattn, s.N * s.q, t);
  l.add(Buf::kDqT, cast ? s.N * s.q : 0, t);
  l.add(Buf::kDkT, cast ? s.N * s.kv : 0, t);
  l.add(Buf::kDvT, cast ? s.N * s.kv : 0, t);
  l.add(Buf::kDxn, NH, kF32);
  l.add(Buf::kTmp, NH, kF32);
  l.add(Buf::kDh, NH, kF32);
  l.add(Buf::kDq, s.N * s.q, kF32);
  l.add(Buf::kDk, s.N * s.kv, kF32);
  l.add(Buf::kDv, s.N * s.kv, kF32);
  if (s.moe) {  // the experts' input gradient, the combine's output gradient, d weight, d logits (and its T copy)
    const int64_t slots = s.N * s.k;
    l.add(Buf::kDxp, slots * s.H, kF32);
    l.add(Buf::kDyp, slots * s.H, t);
    l.add(Buf::kDweight, slots, kF32);
    l.add(Buf::kDlogits, s.N * s.E, kF32);
    l.add(Buf::kDlogitsT, cast ? s.N * s.E : 0, t);
  }
  return l;
}

BufferList cuda_head_workspace(const Shape& s, int32_t t) {
  BufferList l;
  l.align = kCudaCarveAlign;
  const int64_t chunk = cuda_vocab_chunk(s);
  l.add(Buf::kHeadXn, s.N * s.H, t);
  l.add(Buf::kHeadRstd, s.N, kF32);
  l.add(Buf::kHeadDxn, s.N * s.H, kF32);
  l.add(Buf::kRunMax, s.N, kF32);
  l.add(Buf::kRunSum, s.N, kF32);
  l.add(Buf::kTargetLogit, s.N, kF32);
  l.add(Buf::kHeadLse, s.N, kF32);
  l.add(Buf::kLogits, s.N * chunk, kF32);
  if (t != kF32) l.add(Buf::kDlogitsHead, s.N * chunk, t);  // fp32: in place over the logits
  return l;
}

BufferList cuda_private(const Shape& s) {
  BufferList l;
  l.align = kCudaCarveAlign;
  l.add(Buf::kBlasWorkspace, kCudaBlasWorkspaceBytes, 1);
  l.add(Buf::kAttentionWorkspace, cuda::attention_workspace_bytes(cuda_attention_dims(s), cuda_attention_rows(s)), 1);
  l.add(Buf::kTokens, s.N, kI32);
  l.add(Buf::kTargets, s.N, kI32);
  l.add(Buf::kPositions, s.N, kI32);
  l.add(Buf::kUniqueTokens, s.N, kI32);    // the embedding backward's distinct tokens
  l.add(Buf::kTokenOffsets, s.N + 1, kI32);  // and where each one's positions start
  l.add(Buf::kTokenPositions, s.N, kI32);
  // Rows packed "neat": each token's document start, then its RoPE position (restarting at 0 in
  // each document), copied per micro-batch; unused for rows of one document.
  l.add(Buf::kDocuments, 2 * s.N, kI32);
  l.add(Buf::kInvFreq, s.hd / 2, kF32);    // RoPE's inverse frequencies
  l.add(Buf::kLossSum, 1, kF64);
  l.add(Buf::kTokenCount, 1, 8);
  // The two-stage column sums' partials (RMSNorm weight gradients, bias gradients, the routing
  // statistics): one call at a time on the compute stream, over at most the widest of them.
  l.add(Buf::kColumnPartials, cuda::column_sum_scratch_bytes(cuda_column_sum_cols(s)), 1);
  // MoE: the counting sort's per-chunk counts, the grouped GEMMs' A/B/C pointer arrays, the routing
  // statistics (count and probability sums per expert, doubles) and the load-balancing gradient.
  const int64_t E = s.moe ? s.E : 0;
  l.add(Buf::kSortScratch, s.moe ? cuda::moe_permute_scratch_ints(s.N * s.k, E) : 0, kI32);
  l.add(Buf::kGemmPointers, cuda::grouped_gemm_pointer_slots(E), static_cast<int32_t>(sizeof(void*)));
  l.add(Buf::kAuxStats, 2 * E, kF64);
  l.add(Buf::kAuxGrad, E, kF32);
  return l;
}

}  // namespace megatrain::buffers

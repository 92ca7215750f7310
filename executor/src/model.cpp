// The Llama-family layer, embedding and head on the CPU kernels, forward and backward.
#include "megatrain/executor/model.h"

#include "megatrain/buffers/buffers.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "megatrain/kernels/cpu/moe.h"
#include "megatrain/kernels/cpu/ops.h"

namespace megatrain::exec {

namespace {
Result<cpu::RopeConfig> rope_config_of(const ModelConfig& mc) {
  cpu::RopeConfig rc;
  rc.head_dim = mc.head_dim;
  rc.theta = mc.rope_theta;
  MT_ASSIGN_OR_RETURN(rc.scaling, cpu::parse_rope_scaling_type(mc.rope_scaling_type));
  rc.factor = mc.rope_scaling_factor;
  rc.low_freq_factor = mc.rope_low_freq_factor;
  rc.high_freq_factor = mc.rope_high_freq_factor;
  rc.original_max_position_embeddings = mc.rope_original_max_position;
  rc.beta_fast = mc.rope_beta_fast;
  rc.beta_slow = mc.rope_beta_slow;
  rc.truncate = mc.rope_truncate;
  rc.attention_factor = mc.rope_attention_factor;
  return rc;
}
}  // namespace

Result<Dims> make_dims(const ModelSpec& model, int64_t micro_batch, int64_t seq_len) {
  const ModelConfig& c = model.config();
  Dims d;
  static_cast<buffers::Shape&>(d) = buffers::shape_of(c, micro_batch, seq_len);
  d.eps = c.rms_norm_eps;
  d.tied = c.tie_word_embeddings;
  if (c.mlp_bias)
    return unsupported("mlp_bias: biases on the dense MLP's gate/up/down are not supported by the CPU backend yet; accepted: "
                       "false (q/k/v/o biases, as in Qwen2 and gpt-oss, and gpt-oss's expert biases are supported)");
  d.window.assign(static_cast<size_t>(d.L), 0);
  for (int64_t l = 0; l < d.L; ++l)
    if (c.is_sliding_layer(l)) d.window[static_cast<size_t>(l)] = c.sliding_window;
  if (c.rope_scaling_type == "yarn") {
    MT_ASSIGN_OR_RETURN(cpu::RopeConfig rc, rope_config_of(c));
    d.rope_scale = cpu::rope_attention_scaling(rc);
  }
  if (c.is_moe()) {
    if (c.moe != "mixtral" && c.moe != "qwen3_moe" && c.moe != "gpt_oss")
      return unsupported("moe '" + c.moe + "': the executor trains the mixtral, qwen3_moe and gpt_oss blocks");
    // gpt-oss takes the softmax over the k largest logits, which equals the softmax over all
    // experts renormalised over the k chosen (exp(z_i) / sum_chosen exp(z_j)): the same block as
    // Mixtral's, differing by rounding (docs/moe.md).
    d.renorm = c.moe == "mixtral" || c.moe == "gpt_oss" || c.norm_topk_prob;
    d.swiglu_alpha = c.swiglu_alpha;
    d.swiglu_limit = c.swiglu_limit;
    for (int64_t l = 0; l < c.num_layers; ++l) d.moe_layers += c.is_moe_layer(l);
    if (d.E < 1 || d.k < 1 || d.k > d.E || d.Im < 1)
      return invalid_argument("MoE: num_experts " + std::to_string(d.E) + ", experts_per_tok " + std::to_string(d.k) +
                              ", moe_intermediate_size " + std::to_string(d.Im) +
                              ": accepted 1 <= experts_per_tok <= num_experts and an intermediate size >= 1");
  }
  return d;
}

template <typename T>
Result<std::vector<T>> rope_inv_freq_for(const ModelSpec& model) {
  MT_ASSIGN_OR_RETURN(cpu::RopeConfig rc, rope_config_of(model.config()));
  return cpu::rope_inv_freq<T>(rc);
}

namespace {
bool is_stacked_expert(TensorRole r) {
  return r == TensorRole::kExpertGateUp || r == TensorRole::kExpertGateUpBias || r == TensorRole::kExpertDown ||
         r == TensorRole::kExpertDownBias;
}
// Pointers and expert strides of a unit's tensors in a block laid out as layout.tensors: a
// per-expert tensor (expert >= 0) is addressed through expert 0's, with the distance to expert 1's
// as its stride.
template <typename P, typename V>
void bind_unit(const UnitState& layout, P block, V& v) {
  int64_t first[kTensorRoleCount];
  for (const auto& t : layout.tensors) {
    const int r = static_cast<int>(t.role);
    v.layer = t.layer;
    if (t.expert <= 0) {
      v.p[r] = block + t.offset;
      first[r] = t.offset;
      if (t.expert < 0 && is_stacked_expert(t.role) && !t.shape.empty() && t.shape[0] > 0)
        v.stride[r] = t.numel / t.shape[0];  // gpt-oss: [E, ...], one expert after the other
    } else if (t.expert == 1) {
      v.stride[r] = t.offset - first[r];
    }
  }
}
}  // namespace

template <typename T>
UnitViewT<T> view_unit(const UnitState& layout, const T* block) {
  UnitViewT<T> v;
  bind_unit(layout, block, v);
  return v;
}

template <typename T>
UnitGradT<T> grad_unit(const UnitState& layout, T* block) {
  UnitGradT<T> g;
  bind_unit(layout, block, g);
  return g;
}

int64_t layer_act_floats(const Dims& d) { return buffers::cpu_layer_acts(d).floats(); }

template <typename T>
LayerActsT<T> bind_layer_acts(const Dims& d, T* base) {
  using buffers::Buf;
  const buffers::Carving c(buffers::cpu_layer_acts(d, sizeof(T)), base);
  LayerActsT<T> a{};
  a.x = c.get<T>(Buf::kX);
  a.rstd1 = c.get<T>(Buf::kRstd1);
  a.xn1 = c.get<T>(Buf::kXn1);
  a.q = c.get<T>(Buf::kQ);
  a.k = c.get<T>(Buf::kK);
  a.v = c.get<T>(Buf::kV);
  a.probs = c.get<T>(Buf::kProbs);
  a.attn = c.get<T>(Buf::kAttn);
  a.h = c.get<T>(Buf::kH);
  a.rstd2 = c.get<T>(Buf::kRstd2);
  a.xn2 = c.get<T>(Buf::kXn2);
  a.gate = c.get<T>(Buf::kGate);
  a.up = c.get<T>(Buf::kUp);
  a.act = c.get<T>(Buf::kAct);
  if (d.qk_norm) {
    a.q_pre = c.get<T>(Buf::kQPre);
    a.k_pre = c.get<T>(Buf::kKPre);
    a.rstd_q = c.get<T>(Buf::kRstdQ);
    a.rstd_k = c.get<T>(Buf::kRstdK);
  }
  if (d.sinks) a.sink_probs = c.get<T>(Buf::kSinkProbs);
  if (d.moe) {
    a.logits = c.get<T>(Buf::kRouterLogits);
    a.rprobs = c.get<T>(Buf::kRouterProbs);
    a.rweight = c.get<T>(Buf::kRouteWeight);
    a.xp = c.get<T>(Buf::kXp);
    a.yp = c.get<T>(Buf::kYp);
    a.rexpert = c.get<int32_t>(Buf::kRouteExpert);
    a.perm = c.get<int32_t>(Buf::kPerm);
    a.row_of_slot = c.get<int32_t>(Buf::kRowOfSlot);
    a.offsets = c.get<int32_t>(Buf::kExpertOffsets);
  }
  return a;
}

int64_t layer_workspace_floats(const Dims& d) { return buffers::cpu_layer_workspace(d).floats(); }

int64_t head_workspace_floats(const Dims& d) { return buffers::cpu_head_workspace(d).floats(); }

template <typename T>
LayerMathT<T>::LayerMathT(cpu::CpuContext& ctx, const Dims& d, std::vector<T> inv_freq)
    : ctx_(ctx), d_(d), inv_freq_(std::move(inv_freq)) {
  positions_.resize(static_cast<size_t>(d.N));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t) positions_[static_cast<size_t>(b * d.T + t)] = static_cast<int32_t>(t);
}

template <typename T>
const int32_t* LayerMathT<T>::positions_for(const LayerActsT<T>& a) {
  if (a.doc_starts == nullptr) return positions_.data();
  doc_positions_.resize(static_cast<size_t>(d_.N));
  for (int64_t i = 0; i < d_.N; ++i)
    doc_positions_[static_cast<size_t>(i)] = positions_[static_cast<size_t>(i)] - a.doc_starts[i];
  return doc_positions_.data();
}

template <typename T>
Status LayerMathT<T>::forward(const UnitViewT<T>& w, const T* x_in, T* x_out, const LayerActsT<T>& a) {
  const Dims& d = d_;
  if (a.x != x_in) std::memcpy(a.x, x_in, sizeof(T) * static_cast<size_t>(d.N * d.H));
  cpu::rmsnorm_forward<T>(ctx_, a.x, w[TensorRole::kAttnNorm], d.N, d.H, d.eps, a.xn1, a.rstd1);
  T* q = d.qk_norm ? a.q_pre : a.q;
  T* k = d.qk_norm ? a.k_pre : a.k;
  cpu::linear_forward<T>(ctx_, a.xn1, w[TensorRole::kQ], w[TensorRole::kQBias], d.N, d.H, d.q, q);
  cpu::linear_forward<T>(ctx_, a.xn1, w[TensorRole::kK], w[TensorRole::kKBias], d.N, d.H, d.kv, k);
  cpu::linear_forward<T>(ctx_, a.xn1, w[TensorRole::kV], w[TensorRole::kVBias], d.N, d.H, d.kv, a.v);
  if (d.qk_norm) {  // Qwen3: RMSNorm over each head's head_dim, before RoPE
    cpu::rmsnorm_forward<T>(ctx_, a.q_pre, w[TensorRole::kQNorm], d.N * d.nh, d.hd, d.eps, a.q, a.rstd_q);
    cpu::rmsnorm_forward<T>(ctx_, a.k_pre, w[TensorRole::kKNorm], d.N * d.nkv, d.hd, d.eps, a.k, a.rstd_k);
  }
  const T rs = static_cast<T>(d.rope_scale);
  const int32_t* pos = positions_for(a);
  cpu::rope_forward<T>(ctx_, a.q, a.q, pos, d.N, d.nh, d.hd, inv_freq_.data(), rs);
  cpu::rope_forward<T>(ctx_, a.k, a.k, pos, d.N, d.nkv, d.hd, inv_freq_.data(), rs);
  const cpu::AttentionShape s{d.B, d.T, d.nh, d.nkv, d.hd, d.window_of(w.layer), a.doc_starts};
  MT_RETURN_IF_ERROR(cpu::attention_forward<T>(ctx_, s, a.q, a.k, a.v, a.attn, a.probs, w[TensorRole::kSinks], a.sink_probs));
  // h = x + o_proj(attn); x_out = h + down(silu(gate) * up)
  cpu::linear_forward<T>(ctx_, a.attn, w[TensorRole::kO], w[TensorRole::kOBias], d.N, d.q, d.H, a.h);
  cpu::add<T>(ctx_, a.x, a.h, d.N * d.H, a.h);
  cpu::rmsnorm_forward<T>(ctx_, a.h, w[TensorRole::kMlpNorm], d.N, d.H, d.eps, a.xn2, a.rstd2);
  if (w[TensorRole::kRouter] != nullptr) return moe_forward(w, x_out, a);
  cpu::linear_forward<T>(ctx_, a.xn2, w[TensorRole::kGate], nullptr, d.N, d.H, d.I, a.gate);
  cpu::linear_forward<T>(ctx_, a.xn2, w[TensorRole::kUp], nullptr, d.N, d.H, d.I, a.up);
  cpu::swiglu_forward<T>(ctx_, a.gate, a.up, d.N * d.I, a.act);
  cpu::linear_forward<T>(ctx_, a.act, w[TensorRole::kDown], nullptr, d.N, d.I, d.H, x_out);
  cpu::add<T>(ctx_, a.h, x_out, d.N * d.H, x_out);
  return {};
}

template <typename T>
Status LayerMathT<T>::backward(const UnitViewT<T>& w, const LayerActsT<T>& a, const T* dout, T* dx,
                               const UnitGradT<T>& g, T* ws) {
  const Dims& d = d_;
  using buffers::Buf;
  const buffers::Carving c(buffers::cpu_layer_workspace(d, sizeof(T)), ws);
  T* da = c.get<T>(Buf::kDact);
  T* dgate = c.get<T>(Buf::kDgate);
  T* dup = c.get<T>(Buf::kDup);
  T* dxn = c.get<T>(Buf::kDxn);
  T* dh = c.get<T>(Buf::kDh);
  T* dattn = c.get<T>(Buf::kDattn);
  T* dq = c.get<T>(Buf::kDq);
  T* dk = c.get<T>(Buf::kDk);
  T* dv = c.get<T>(Buf::kDv);
  T* dsw = c.get<T>(Buf::kDscores);
  T* tmp = c.get<T>(Buf::kTmp);
  T* more = c.get<T>(Buf::kMore);  // the MoE block's, the sinks' or the q/k norms' temporaries
  // MLP: out = h + down(act)
  if (w[TensorRole::kRouter] != nullptr) {
    moe_backward(w, a, dout, g, dxn, da, dgate, dup, more);
  } else {
    cpu::linear_backward<T>(ctx_, dout, a.act, w[TensorRole::kDown], d.N, d.I, d.H, da, false, g[TensorRole::kDown], nullptr);
    cpu::swiglu_backward<T>(ctx_, a.gate, a.up, da, d.N * d.I, dgate, dup);
    cpu::linear_backward<T>(ctx_, dgate, a.xn2, w[TensorRole::kGate], d.N, d.H, d.I, dxn, false, g[TensorRole::kGate], nullptr);
    cpu::linear_backward<T>(ctx_, dup, a.xn2, w[TensorRole::kUp], d.N, d.H, d.I, dxn, true, g[TensorRole::kUp], nullptr);
  }
  cpu::rmsnorm_backward<T>(ctx_, dxn, a.h, w[TensorRole::kMlpNorm], a.rstd2, d.N, d.H, tmp, g[TensorRole::kMlpNorm]);
  cpu::add<T>(ctx_, dout, tmp, d.N * d.H, dh);  // residual
  // Attention: h = x + o_proj(attn)
  cpu::linear_backward<T>(ctx_, dh, a.attn, w[TensorRole::kO], d.N, d.q, d.H, dattn, false, g[TensorRole::kO],
                          g[TensorRole::kOBias]);
  const cpu::AttentionShape s{d.B, d.T, d.nh, d.nkv, d.hd, d.window_of(w.layer), a.doc_starts};
  const bool sinks = w[TensorRole::kSinks] != nullptr;
  MT_RETURN_IF_ERROR(cpu::attention_backward<T>(ctx_, s, a.q, a.k, a.v, a.probs, dattn, dq, dk, dv, dsw,
                                                sinks ? a.sink_probs : nullptr, g[TensorRole::kSinks],
                                                sinks ? more : nullptr));
  const T rs = static_cast<T>(d.rope_scale);
  const int32_t* pos = positions_for(a);
  cpu::rope_backward<T>(ctx_, dq, dq, pos, d.N, d.nh, d.hd, inv_freq_.data(), rs);
  cpu::rope_backward<T>(ctx_, dk, dk, pos, d.N, d.nkv, d.hd, inv_freq_.data(), rs);
  if (d.qk_norm) {  // through the per-head norms to the projections' outputs
    T* dq_pre = more;
    T* dk_pre = dq_pre + d.N * d.q;
    cpu::rmsnorm_backward<T>(ctx_, dq, a.q_pre, w[TensorRole::kQNorm], a.rstd_q, d.N * d.nh, d.hd, dq_pre, g[TensorRole::kQNorm]);
    cpu::rmsnorm_backward<T>(ctx_, dk, a.k_pre, w[TensorRole::kKNorm], a.rstd_k, d.N * d.nkv, d.hd, dk_pre, g[TensorRole::kKNorm]);
    std::memcpy(dq, dq_pre, sizeof(T) * static_cast<size_t>(d.N * d.q));
    std::memcpy(dk, dk_pre, sizeof(T) * static_cast<size_t>(d.N * d.kv));
  }
  cpu::linear_backward<T>(ctx_, dq, a.xn1, w[TensorRole::kQ], d.N, d.H, d.q, dxn, false, g[TensorRole::kQ], g[TensorRole::kQBias]);
  cpu::linear_backward<T>(ctx_, dk, a.xn1, w[TensorRole::kK], d.N, d.H, d.kv, dxn, true, g[TensorRole::kK], g[TensorRole::kKBias]);
  cpu::linear_backward<T>(ctx_, dv, a.xn1, w[TensorRole::kV], d.N, d.H, d.kv, dxn, true, g[TensorRole::kV], g[TensorRole::kVBias]);
  cpu::rmsnorm_backward<T>(ctx_, dxn, a.x, w[TensorRole::kAttnNorm], a.rstd1, d.N, d.H, tmp, g[TensorRole::kAttnNorm]);
  cpu::add<T>(ctx_, dh, tmp, d.N * d.H, dx);
  return {};
}

// The MoE block on xn2 (Mixtral and Qwen3-MoE, as HF computes it): router logits, softmax over the
// experts, top-k (renormalised when d.renorm), the slots sorted by expert, each expert's SwiGLU MLP
// on its rows (one GEMM per expert and projection), and the weighted sum of each token's k outputs,
// added to the residual h.
template <typename T>
Status LayerMathT<T>::moe_forward(const UnitViewT<T>& w, T* x_out, const LayerActsT<T>& a) {
  const Dims& d = d_;
  const int64_t slots = d.N * d.k;
  cpu::linear_forward<T>(ctx_, a.xn2, w[TensorRole::kRouter], w[TensorRole::kRouterBias], d.N, d.H, d.E, a.logits);
  cpu::moe_route_forward<T>(ctx_, a.logits, d.N, d.E, d.k, d.renorm, a.rexpert, a.rweight, a.rprobs);
  cpu::moe_permute(a.rexpert, d.N, d.k, d.E, a.offsets, a.perm);
  for (int64_t r = 0; r < slots; ++r) a.row_of_slot[a.perm[r]] = static_cast<int32_t>(r);
  cpu::moe_gather<T>(ctx_, a.xn2, a.perm, slots, d.k, d.H, a.xp);
  if (d.gpt_oss) {
    // gate_up [rows, 2 Im] (interleaved) = xp @ W_gu + b_gu, held in gate and up (adjacent, each
    // slots * Im); act = the clamped SwiGLU; yp = act @ W_down + b_down.
    cpu::grouped_matmul_forward<T>(ctx_, a.xp, w[TensorRole::kExpertGateUp], w.stride_of(TensorRole::kExpertGateUp),
                                   w[TensorRole::kExpertGateUpBias], w.stride_of(TensorRole::kExpertGateUpBias), a.offsets,
                                   d.E, d.H, 2 * d.Im, a.gate);
    cpu::clamped_swiglu_forward<T>(ctx_, a.gate, slots, d.Im, static_cast<T>(d.swiglu_alpha), static_cast<T>(d.swiglu_limit),
                                   a.act);
    cpu::grouped_matmul_forward<T>(ctx_, a.act, w[TensorRole::kExpertDown], w.stride_of(TensorRole::kExpertDown),
                                   w[TensorRole::kExpertDownBias], w.stride_of(TensorRole::kExpertDownBias), a.offsets, d.E,
                                   d.Im, d.H, a.yp);
  } else {
  const int64_t ws = w.stride_of(TensorRole::kExpertGate);
  cpu::grouped_linear_forward<T>(ctx_, a.xp, w[TensorRole::kExpertGate], ws, nullptr, 0, a.offsets, d.E, d.H, d.Im, a.gate);
  cpu::grouped_linear_forward<T>(ctx_, a.xp, w[TensorRole::kExpertUp], w.stride_of(TensorRole::kExpertUp), nullptr, 0,
                                 a.offsets, d.E, d.H, d.Im, a.up);
  cpu::swiglu_forward<T>(ctx_, a.gate, a.up, slots * d.Im, a.act);
  cpu::grouped_linear_forward<T>(ctx_, a.act, w[TensorRole::kExpertDown], w.stride_of(TensorRole::kExpertDown), nullptr, 0, a.offsets, d.E, d.Im, d.H, a.yp);
  }
  cpu::moe_combine_forward<T>(ctx_, a.yp, a.rweight, a.row_of_slot, d.N, d.k, d.H, x_out);
  cpu::add<T>(ctx_, a.h, x_out, d.N * d.H, x_out);
  if (a.aux_count != nullptr) cpu::moe_aux_stats<T>(a.rprobs, a.rexpert, d.N, d.E, d.k, a.aux_count, a.aux_prob);
  return {};
}

// dxn = d MoE(xn2) / d xn2 . dout (overwritten); the router's and the chosen experts' gradients
// accumulate into g (an expert no token chose is not touched). Buffers: da, dgate, dup hold
// [N*k, Im]; more holds dxp, dyp [N*k, H], d weight [N*k] and d logits [N, E].
template <typename T>
void LayerMathT<T>::moe_backward(const UnitViewT<T>& w, const LayerActsT<T>& a, const T* dout, const UnitGradT<T>& g,
                                 T* dxn, T* da, T* dgate, T* dup, T* more) {
  const Dims& d = d_;
  const int64_t slots = d.N * d.k;
  T* dxp = more;
  T* dyp = dxp + slots * d.H;
  T* dweight = dyp + slots * d.H;
  T* dlogits = dweight + slots;
  cpu::moe_combine_backward<T>(ctx_, a.yp, a.rweight, a.row_of_slot, dout, d.N, d.k, d.H, dyp, dweight);
  if (d.gpt_oss) {
    // dgate and dup are adjacent: together the interleaved d gate_up [rows, 2 Im].
    cpu::grouped_matmul_backward<T>(ctx_, dyp, a.act, w[TensorRole::kExpertDown], w.stride_of(TensorRole::kExpertDown),
                                    a.offsets, d.E, d.Im, d.H, da, g[TensorRole::kExpertDown], g[TensorRole::kExpertDownBias],
                                    w.stride_of(TensorRole::kExpertDownBias));
    cpu::clamped_swiglu_backward<T>(ctx_, a.gate, da, slots, d.Im, static_cast<T>(d.swiglu_alpha),
                                    static_cast<T>(d.swiglu_limit), dgate);
    cpu::grouped_matmul_backward<T>(ctx_, dgate, a.xp, w[TensorRole::kExpertGateUp], w.stride_of(TensorRole::kExpertGateUp),
                                    a.offsets, d.E, d.H, 2 * d.Im, dxp, g[TensorRole::kExpertGateUp],
                                    g[TensorRole::kExpertGateUpBias], w.stride_of(TensorRole::kExpertGateUpBias));
  } else {
  cpu::grouped_linear_backward<T>(ctx_, dyp, a.act, w[TensorRole::kExpertDown], w.stride_of(TensorRole::kExpertDown),
                                  a.offsets, d.E, d.Im, d.H, da, g[TensorRole::kExpertDown], nullptr, 0);
  cpu::swiglu_backward<T>(ctx_, a.gate, a.up, da, slots * d.Im, dgate, dup);
  cpu::grouped_linear_backward<T>(ctx_, dgate, a.xp, w[TensorRole::kExpertGate], w.stride_of(TensorRole::kExpertGate),
                                  a.offsets, d.E, d.H, d.Im, dxp, g[TensorRole::kExpertGate], nullptr, 0);
  cpu::grouped_linear_backward<T>(ctx_, dup, a.xp, w[TensorRole::kExpertUp], w.stride_of(TensorRole::kExpertUp),
                                  a.offsets, d.E, d.H, d.Im, dyp, g[TensorRole::kExpertUp], nullptr, 0);
  cpu::add<T>(ctx_, dxp, dyp, slots * d.H, dxp);
  }
  cpu::moe_scatter_add<T>(ctx_, dxp, a.row_of_slot, d.N, d.k, d.H, dxn);
  std::vector<T> aux;
  if (a.aux_grad != nullptr) aux.assign(a.aux_grad, a.aux_grad + d.E);
  cpu::moe_route_backward<T>(ctx_, a.rprobs, a.rexpert, a.rweight, dweight, aux.empty() ? nullptr : aux.data(),
                             d.N, d.E, d.k, d.renorm, dlogits);
  cpu::linear_backward<T>(ctx_, dlogits, a.xn2, w[TensorRole::kRouter], d.N, d.H, d.E, dxn, true, g[TensorRole::kRouter],
                          g[TensorRole::kRouterBias]);
}

template <typename T>
Status LayerMathT<T>::embed(const T* table, const int32_t* tokens, T* x_out) {
  return cpu::embedding_forward<T>(ctx_, tokens, d_.N, table, d_.V, d_.H, x_out);
}

template <typename T>
Status LayerMathT<T>::embed_backward(const int32_t* tokens, const T* dx, T* dtable) {
  return cpu::embedding_backward<T>(ctx_, tokens, d_.N, dx, d_.V, d_.H, dtable);
}

template <typename T>
Status LayerMathT<T>::head(const T* final_norm, const T* lm_head, const T* x, const int32_t* targets, T grad_scale,
                           T* dx, T* d_final_norm, T* d_lm_head, double* loss_sum, int64_t* count, T* ws) {
  const Dims& d = d_;
  using buffers::Buf;
  const buffers::Carving c(buffers::cpu_head_workspace(d, sizeof(T)), ws);
  T* logits = c.get<T>(Buf::kLogits);
  T* lse = c.get<T>(Buf::kHeadLse);
  T* rstd = c.get<T>(Buf::kHeadRstd);
  T* xn = c.get<T>(Buf::kHeadXn);
  T* dxn = c.get<T>(Buf::kHeadDxn);
  cpu::rmsnorm_forward<T>(ctx_, x, final_norm, d.N, d.H, d.eps, xn, rstd);
  cpu::linear_forward<T>(ctx_, xn, lm_head, nullptr, d.N, d.H, d.V, logits);
  cpu::CrossEntropyStats stats;
  MT_RETURN_IF_ERROR(cpu::cross_entropy_forward<T>(ctx_, logits, targets, d.N, d.V, lse, nullptr, &stats));
  *loss_sum += stats.loss_sum;
  *count += stats.count;
  MT_RETURN_IF_ERROR(cpu::cross_entropy_backward<T>(ctx_, logits, targets, lse, d.N, d.V, grad_scale, logits));
  cpu::linear_backward<T>(ctx_, logits, xn, lm_head, d.N, d.H, d.V, dxn, false, d_lm_head, nullptr);
  cpu::rmsnorm_backward<T>(ctx_, dxn, x, final_norm, rstd, d.N, d.H, dx, d_final_norm);
  return {};
}

#define MT_INSTANTIATE(T)                                                 \
  template Result<std::vector<T>> rope_inv_freq_for<T>(const ModelSpec&);  \
  template UnitViewT<T> view_unit<T>(const UnitState&, const T*);          \
  template UnitGradT<T> grad_unit<T>(const UnitState&, T*);                \
  template LayerActsT<T> bind_layer_acts<T>(const Dims&, T*);              \
  template class LayerMathT<T>;
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::exec

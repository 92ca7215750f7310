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
    d.moe_ops = arch::layer_ops_of_kind(c, true);
    if (d.E < 1 || d.k < 1 || d.k > d.E || d.Im < 1)
      return invalid_argument("MoE: num_experts " + std::to_string(d.E) + ", experts_per_tok " + std::to_string(d.k) +
                              ", moe_intermediate_size " + std::to_string(d.Im) +
                              ": accepted 1 <= experts_per_tok <= num_experts and an intermediate size >= 1");
  }
  d.dense_ops = arch::layer_ops_of_kind(c, false);
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

// The layer's forward is its ops (arch::layer_ops), run in order: each reads and writes the values
// it names, bound to the activation buffers that backward reads.
template <typename T>
Status LayerMathT<T>::forward(const UnitViewT<T>& w, const T* x_in, T* x_out, const LayerActsT<T>& a) {
  const Dims& d = d_;
  if (a.x != x_in) std::memcpy(a.x, x_in, sizeof(T) * static_cast<size_t>(d.N * d.H));
  const std::vector<arch::Op>& ops = w[TensorRole::kRouter] != nullptr ? d.moe_ops : d.dense_ops;
  if (ops.empty())
    return internal_error(std::string("the layer math has no ") + (w[TensorRole::kRouter] != nullptr ? "MoE" : "dense") +
                          " ops: its Dims were not made by make_dims");
  for (const arch::Op& op : ops) MT_RETURN_IF_ERROR(forward_op(op, w, x_out, a));
  return {};
}

namespace {
template <typename T>
T* value_of(arch::Val v, T* x_out, const LayerActsT<T>& a) {
  using arch::Val;
  switch (v) {
    case Val::kX: return a.x;
    case Val::kXn1: return a.xn1;
    case Val::kQPre: return a.q_pre;
    case Val::kKPre: return a.k_pre;
    case Val::kQ: return a.q;
    case Val::kK: return a.k;
    case Val::kV: return a.v;
    case Val::kAttn: return a.attn;
    case Val::kH: return a.h;
    case Val::kXn2: return a.xn2;
    case Val::kGate: return a.gate;
    case Val::kUp: return a.up;
    case Val::kAct: return a.act;
    case Val::kLogits: return a.logits;
    case Val::kXp: return a.xp;
    case Val::kYp: return a.yp;
    case Val::kOut: return x_out;
    default: return nullptr;  // kNone, and the pairs (kQk, kQkPre), which their ops take apart
  }
}
int64_t width_of(arch::Dim v, const Dims& d) {
  using arch::Dim;
  switch (v) {
    case Dim::kVocab: return d.V;
    case Dim::kHidden: return d.H;
    case Dim::kIntermediate: return d.I;
    case Dim::kQ: return d.q;
    case Dim::kKv: return d.kv;
    case Dim::kHeadDim: return d.hd;
    case Dim::kHeads: return d.nh;
    case Dim::kExperts: return d.E;
    case Dim::kExpertInter: return d.Im;
    case Dim::kExpertInter2: return 2 * d.Im;
    case Dim::kQKv: return d.q + d.kv;
  }
  return 0;
}
}  // namespace

template <typename T>
Status LayerMathT<T>::forward_op(const arch::Op& op, const UnitViewT<T>& w, T* x_out, const LayerActsT<T>& a) {
  const Dims& d = d_;
  using arch::OpKind;
  using arch::Val;
  T* src = value_of(op.src, x_out, a);
  T* src2 = value_of(op.src2, x_out, a);
  T* dst = value_of(op.dst, x_out, a);
  const int64_t rows = op.slots ? d.N * d.k : d.N, in = width_of(op.in, d), out = width_of(op.out, d);
  const T* weight = op.weight == TensorRole::kCount ? nullptr : w[op.weight];
  const TensorRole bias = arch::bias_of(op.weight);
  const T* b = bias == TensorRole::kCount ? nullptr : w[bias];
  auto missing = [&](const char* what) {
    return internal_error(std::string("layer op '") + op.name + "' (" + arch::op_kind_name(op.kind) + "): " + what +
                          " is not bound for this layer");
  };
  switch (op.kind) {
    case OpKind::kNorm: {
      T* rstd = op.weight == TensorRole::kAttnNorm ? a.rstd1 : op.weight == TensorRole::kMlpNorm ? a.rstd2 : nullptr;
      if (!src || !dst || !weight || !rstd) return missing("its input, output, weight or 1/rms");
      cpu::rmsnorm_forward<T>(ctx_, src, weight, rows, in, d.eps, dst, rstd);
      return {};
    }
    case OpKind::kLinear:
      if (!src || !dst || !weight) return missing("its input, output or weight");
      cpu::linear_forward<T>(ctx_, src, weight, b, rows, in, out, dst);
      return {};
    case OpKind::kHeadNorm:  // q_pre, k_pre -> q, k: RMSNorm over each head's head_dim
      if (!a.q_pre || !a.k_pre || !w[TensorRole::kQNorm] || !w[TensorRole::kKNorm]) return missing("q_pre, k_pre or a head norm");
      cpu::rmsnorm_forward<T>(ctx_, a.q_pre, w[TensorRole::kQNorm], d.N * d.nh, d.hd, d.eps, a.q, a.rstd_q);
      cpu::rmsnorm_forward<T>(ctx_, a.k_pre, w[TensorRole::kKNorm], d.N * d.nkv, d.hd, d.eps, a.k, a.rstd_k);
      return {};
    case OpKind::kRope: {  // q and k in place
      const T rs = static_cast<T>(d.rope_scale);
      const int32_t* pos = positions_for(a);
      cpu::rope_forward<T>(ctx_, a.q, a.q, pos, d.N, d.nh, d.hd, inv_freq_.data(), rs);
      cpu::rope_forward<T>(ctx_, a.k, a.k, pos, d.N, d.nkv, d.hd, inv_freq_.data(), rs);
      return {};
    }
    case OpKind::kAttention: {
      if (!src2 || !dst) return missing("v or its output");
      const cpu::AttentionShape s{d.B, d.T, d.nh, d.nkv, d.hd, d.window_of(w.layer), a.doc_starts};
      return cpu::attention_forward<T>(ctx_, s, a.q, a.k, src2, dst, a.probs, w[TensorRole::kSinks], a.sink_probs);
    }
    case OpKind::kResidual:
      if (!src || !src2 || !dst) return missing("a term or its output");
      cpu::add<T>(ctx_, src, src2, rows * in, dst);
      return {};
    case OpKind::kRoute:  // logits -> probabilities, the k experts of each token and their weights
      if (!src || !a.rexpert) return missing("the logits or the routing buffers");
      cpu::moe_route_forward<T>(ctx_, src, d.N, d.E, d.k, d.renorm, a.rexpert, a.rweight, a.rprobs);
      if (a.aux_count != nullptr) cpu::moe_aux_stats<T>(a.rprobs, a.rexpert, d.N, d.E, d.k, a.aux_count, a.aux_prob);
      return {};
    case OpKind::kDispatch: {  // the slots sorted by expert, and each slot's row gathered
      if (!src || !dst || !a.perm) return missing("its input, output or the routing buffers");
      const int64_t slots = d.N * d.k;
      cpu::moe_permute(a.rexpert, d.N, d.k, d.E, a.offsets, a.perm);
      for (int64_t r = 0; r < slots; ++r) a.row_of_slot[a.perm[r]] = static_cast<int32_t>(r);
      cpu::moe_gather<T>(ctx_, src, a.perm, slots, d.k, in, dst);
      return {};
    }
    case OpKind::kGroupedLinear:
      if (!src || !dst || !weight) return missing("its input, output or weight");
      if (op.weight_in_out)  // stacked [E, in, out]: x W (+ b)
        cpu::grouped_matmul_forward<T>(ctx_, src, weight, w.stride_of(op.weight), b, b ? w.stride_of(bias) : 0, a.offsets, d.E,
                                       in, out, dst);
      else
        cpu::grouped_linear_forward<T>(ctx_, src, weight, w.stride_of(op.weight), b, b ? w.stride_of(bias) : 0, a.offsets, d.E,
                                       in, out, dst);
      return {};
    case OpKind::kGlu:
      if (!src || !dst || (!op.interleaved_clamped && !src2)) return missing("gate, up or its output");
      if (op.interleaved_clamped)
        cpu::clamped_swiglu_forward<T>(ctx_, src, rows, out, static_cast<T>(d.swiglu_alpha), static_cast<T>(d.swiglu_limit), dst);
      else
        cpu::swiglu_forward<T>(ctx_, src, src2, rows * out, dst);
      return {};
    case OpKind::kCombine:
      if (!src || !dst) return missing("the experts' outputs or its output");
      cpu::moe_combine_forward<T>(ctx_, src, a.rweight, a.row_of_slot, d.N, d.k, out, dst);
      return {};
  }
  return internal_error(std::string("layer op '") + op.name + "': unknown kind");
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

// The Llama-family layer, embedding and head on the CPU kernels, forward and backward.
#include "megatrain/executor/model.h"

#include "megatrain/buffers/buffers.h"

#include <algorithm>
#include <array>
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
  a.up = c.has(Buf::kUp) ? c.get<T>(Buf::kUp) : nullptr;  // gpt-oss: up is interleaved in gate
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
                          " ops: its Dims were not made by make_dims, or the model has no layer of this kind");
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
}  // namespace

template <typename T>
Status LayerMathT<T>::forward_op(const arch::Op& op, const UnitViewT<T>& w, T* x_out, const LayerActsT<T>& a) {
  const Dims& d = d_;
  using arch::OpKind;
  using arch::Val;
  T* src = value_of(op.src, x_out, a);
  T* src2 = value_of(op.src2, x_out, a);
  T* dst = value_of(op.dst, x_out, a);
  const int64_t rows = op.slots ? d.N * d.k : d.N, in = buffers::dim_width(op.in, d), out = buffers::dim_width(op.out, d);
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

// The layer's backward is its ops run in reverse. Each value's gradient lives in a buffer of the
// workspace of its own (own_grad below) or, until a second term arrives, is the buffer of the value
// it came from (a residual passes its output's gradient on as it is). Where gradients of one value
// sum, they sum as the forward's order gives, so that the result does not depend on how the list
// is walked: the linears that read one value (q, k and v; gate and up) run their backward as a
// group in forward order, the first writing the value's gradient and the others adding to it; a
// norm's gradient and a grouped linear's second term go through a scratch buffer and one add.
template <typename T>
Status LayerMathT<T>::backward(const UnitViewT<T>& w, const LayerActsT<T>& a, const T* dout, T* dx,
                               const UnitGradT<T>& g, T* ws) {
  const Dims& d = d_;
  using arch::OpKind;
  using arch::Val;
  using buffers::Buf;
  const buffers::Carving c(buffers::cpu_layer_workspace(d, sizeof(T)), ws);
  const int64_t slots = d.N * d.k;
  T* tmp = c.get<T>(Buf::kTmp);
  T* more = c.get<T>(Buf::kMore);  // the MoE block's, the sinks' or the q/k norms' temporaries
  T* dsw = c.get<T>(Buf::kDscores);
  // The MoE block's part of `more`: dxp and dyp [N*k, H], d weight [N*k], d logits [N, E].
  T* dxp = more;
  T* dyp = dxp + slots * d.H;
  T* dweight = dyp + slots * d.H;
  T* dlogits = dweight + slots;
  auto own_grad = [&](Val v) -> T* {
    switch (v) {
      case Val::kX: return dx;
      case Val::kXn1: case Val::kXn2: return c.get<T>(Buf::kDxn);  // xn2's is read before xn1's is written
      case Val::kQ: return c.get<T>(Buf::kDq);
      case Val::kK: return c.get<T>(Buf::kDk);
      case Val::kV: return c.get<T>(Buf::kDv);
      case Val::kQPre: return more;
      case Val::kKPre: return more + d.N * d.q;
      case Val::kAttn: return c.get<T>(Buf::kDattn);
      case Val::kH: return c.get<T>(Buf::kDh);
      case Val::kGate: return c.get<T>(Buf::kDgate);  // with dup after it: gpt-oss's interleaved 2 x Im
      case Val::kUp: return c.get<T>(Buf::kDup);
      case Val::kAct: return c.get<T>(Buf::kDact);
      case Val::kLogits: return dlogits;
      case Val::kXp: return dxp;
      case Val::kYp: return dyp;
      default: return nullptr;  // kOut: the caller's dout; the pairs are taken apart by their ops
    }
  };
  constexpr size_t kVals = static_cast<size_t>(Val::kOut) + 1;
  std::array<const T*, kVals> grad{};  // each value's gradient so far (null: none yet)
  auto gr = [&grad](Val v) -> const T*& { return grad[static_cast<size_t>(v)]; };
  gr(Val::kOut) = dout;
  const std::vector<arch::Op>& ops = w[TensorRole::kRouter] != nullptr ? d.moe_ops : d.dense_ops;
  if (ops.empty()) return internal_error("the layer math has no ops: its Dims were not made by make_dims");
  auto fail = [](const arch::Op& op, const char* what) {
    return internal_error(std::string("layer op '") + op.name + "' (" + arch::op_kind_name(op.kind) + ") backward: " + what);
  };
  // Adds `term` (n elements) into value v's gradient: the first term is kept where it is (its own
  // buffer, or the buffer of the value it was passed on from), a later one is summed into v's own.
  auto add_term = [&](Val v, const T* term, int64_t n) {
    if (gr(v) == nullptr) {
      gr(v) = term;
      return;
    }
    cpu::add<T>(ctx_, gr(v), term, n, own_grad(v));
    gr(v) = own_grad(v);
  };
  const int32_t* pos = positions_for(a);
  const T rs = static_cast<T>(d.rope_scale);
  for (int64_t i = static_cast<int64_t>(ops.size()) - 1; i >= 0;) {
    const arch::Op& last = ops[static_cast<size_t>(i)];
    // A linear and the linears of its kind just before it that read the same value: one group.
    int64_t first = i;
    if (last.kind == OpKind::kLinear || last.kind == OpKind::kGroupedLinear)
      while (first > 0 && ops[static_cast<size_t>(first - 1)].kind == last.kind && ops[static_cast<size_t>(first - 1)].src == last.src)
        --first;
    for (int64_t j = first; j <= i; ++j) {
      const arch::Op& op = ops[static_cast<size_t>(j)];
      const int64_t rows = op.slots ? slots : d.N, in = buffers::dim_width(op.in, d), out = buffers::dim_width(op.out, d);
      const T* weight = op.weight == TensorRole::kCount ? nullptr : w[op.weight];
      T* gw = op.weight == TensorRole::kCount ? nullptr : g[op.weight];
      const TensorRole bias = arch::bias_of(op.weight);
      T* gb = bias == TensorRole::kCount ? nullptr : g[bias];
      const T* dy = op.dst == Val::kNone ? nullptr : gr(op.dst);
      const T* x = value_of<T>(op.src, nullptr, a);
      switch (op.kind) {
        case OpKind::kResidual:  // dst = src + src2, dst in place of src2: src2's gradient is dst's
          if (op.dst != op.src2 || dy == nullptr) return fail(op, "expects its output in place of its second term, with a gradient");
          add_term(op.src, dy, rows * in);
          break;
        case OpKind::kNorm: {
          T* rstd = op.weight == TensorRole::kAttnNorm ? a.rstd1 : op.weight == TensorRole::kMlpNorm ? a.rstd2 : nullptr;
          if (!dy || !x || !rstd) return fail(op, "its output's gradient, its input or its 1/rms is missing");
          T* into = gr(op.src) == nullptr ? own_grad(op.src) : tmp;
          cpu::rmsnorm_backward<T>(ctx_, dy, x, weight, rstd, rows, in, into, gw);
          add_term(op.src, into, rows * in);
          break;
        }
        case OpKind::kLinear: {
          T* into = own_grad(op.src);
          if (!dy || !x || !into || (gr(op.src) != nullptr && gr(op.src) != into))
            return fail(op, "its output's gradient or its input is missing, or its input's gradient is not its own");
          cpu::linear_backward<T>(ctx_, dy, x, weight, rows, in, out, into, gr(op.src) != nullptr, gw, gb);
          gr(op.src) = into;
          break;
        }
        case OpKind::kGroupedLinear: {
          if (!dy || !x) return fail(op, "its output's gradient or its input is missing");
          // A second term goes through the slot rows' scratch (dyp: read by the experts' down
          // projection, the first of the block's grouped linears in reverse, and free after it).
          T* into = gr(op.src) == nullptr ? own_grad(op.src) : dyp;
          if (into == dy) return fail(op, "its scratch is its output's gradient");
          const int64_t gbs = gb ? w.stride_of(bias) : 0;
          if (op.weight_in_out)
            cpu::grouped_matmul_backward<T>(ctx_, dy, x, weight, w.stride_of(op.weight), a.offsets, d.E, in, out, into, gw, gb, gbs);
          else
            cpu::grouped_linear_backward<T>(ctx_, dy, x, weight, w.stride_of(op.weight), a.offsets, d.E, in, out, into, gw, gb, gbs);
          add_term(op.src, into, rows * in);
          break;
        }
        case OpKind::kGlu:
          if (!dy || gr(op.src) != nullptr) return fail(op, "its output's gradient is missing or gate's is already set");
          if (op.interleaved_clamped) {
            cpu::clamped_swiglu_backward<T>(ctx_, x, dy, rows, out, static_cast<T>(d.swiglu_alpha), static_cast<T>(d.swiglu_limit),
                                            own_grad(op.src));
          } else {
            cpu::swiglu_backward<T>(ctx_, x, value_of<T>(op.src2, nullptr, a), dy, rows * out, own_grad(op.src), own_grad(op.src2));
            gr(op.src2) = own_grad(op.src2);
          }
          gr(op.src) = own_grad(op.src);
          break;
        case OpKind::kCombine:  // the experts' outputs and the routing weights
          if (!dy || !x) return fail(op, "its output's gradient or the experts' outputs are missing");
          cpu::moe_combine_backward<T>(ctx_, x, a.rweight, a.row_of_slot, dy, d.N, d.k, out, own_grad(op.src), dweight);
          gr(op.src) = own_grad(op.src);
          break;
        case OpKind::kDispatch: {  // each token's k slot rows summed back
          if (!dy) return fail(op, "the slots' gradient is missing");
          T* into = gr(op.src) == nullptr ? own_grad(op.src) : tmp;
          cpu::moe_scatter_add<T>(ctx_, dy, a.row_of_slot, d.N, d.k, in, into);
          add_term(op.src, into, d.N * in);
          break;
        }
        case OpKind::kRoute: {  // the routing weights' gradient (and the balancing loss's) to the logits
          std::vector<T> aux;
          if (a.aux_grad != nullptr) aux.assign(a.aux_grad, a.aux_grad + d.E);
          cpu::moe_route_backward<T>(ctx_, a.rprobs, a.rexpert, a.rweight, dweight, aux.empty() ? nullptr : aux.data(), d.N, d.E,
                                     d.k, d.renorm, own_grad(op.src));
          gr(op.src) = own_grad(op.src);
          break;
        }
        case OpKind::kAttention: {
          if (!dy) return fail(op, "its output's gradient is missing");
          const cpu::AttentionShape s{d.B, d.T, d.nh, d.nkv, d.hd, d.window_of(w.layer), a.doc_starts};
          const bool sinks = w[TensorRole::kSinks] != nullptr;
          MT_RETURN_IF_ERROR(cpu::attention_backward<T>(ctx_, s, a.q, a.k, a.v, a.probs, dy, own_grad(Val::kQ), own_grad(Val::kK),
                                                        own_grad(Val::kV), dsw, sinks ? a.sink_probs : nullptr,
                                                        g[TensorRole::kSinks], sinks ? more : nullptr));
          for (Val v : {Val::kQ, Val::kK, Val::kV}) gr(v) = own_grad(v);
          break;
        }
        case OpKind::kRope:  // q's and k's gradients, in place
          cpu::rope_backward<T>(ctx_, own_grad(Val::kQ), own_grad(Val::kQ), pos, d.N, d.nh, d.hd, inv_freq_.data(), rs);
          cpu::rope_backward<T>(ctx_, own_grad(Val::kK), own_grad(Val::kK), pos, d.N, d.nkv, d.hd, inv_freq_.data(), rs);
          break;
        case OpKind::kHeadNorm:  // q, k -> q_pre, k_pre
          cpu::rmsnorm_backward<T>(ctx_, gr(Val::kQ), a.q_pre, w[TensorRole::kQNorm], a.rstd_q, d.N * d.nh, d.hd,
                                   own_grad(Val::kQPre), g[TensorRole::kQNorm]);
          cpu::rmsnorm_backward<T>(ctx_, gr(Val::kK), a.k_pre, w[TensorRole::kKNorm], a.rstd_k, d.N * d.nkv, d.hd,
                                   own_grad(Val::kKPre), g[TensorRole::kKNorm]);
          gr(Val::kQPre) = own_grad(Val::kQPre);
          gr(Val::kKPre) = own_grad(Val::kKPre);
          break;
      }
    }
    i = first - 1;
  }
  // The layer's input gradient ends in dx (its own buffer), unless no op added a second term.
  if (gr(Val::kX) != dx) {
    if (gr(Val::kX) == nullptr) return internal_error("the layer's ops never reach its input x");
    std::memmove(dx, gr(Val::kX), sizeof(T) * static_cast<size_t>(d.N * d.H));
  }
  return {};
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

// The Llama-family layer, embedding and head on the CPU kernels, forward and backward.
#include "megatrain/executor/model.h"

#include <cmath>
#include <cstring>

#include "megatrain/kernels/cpu/ops.h"

namespace megatrain::exec {

Result<Dims> make_dims(const ModelSpec& model, int64_t micro_batch, int64_t seq_len) {
  const ModelConfig& c = model.config();
  Dims d;
  d.B = micro_batch;
  d.T = seq_len;
  d.N = micro_batch * seq_len;
  d.H = c.hidden_size;
  d.I = c.intermediate_size;
  d.nh = c.num_heads;
  d.nkv = c.num_kv_heads;
  d.hd = c.head_dim;
  d.V = c.vocab_size;
  d.L = c.num_layers;
  d.q = d.nh * d.hd;
  d.kv = d.nkv * d.hd;
  d.eps = c.rms_norm_eps;
  d.tied = c.tie_word_embeddings;
  if (c.o_bias || c.mlp_bias)
    return unsupported("attention_bias/mlp_bias: o_proj and MLP biases are not supported by the CPU backend yet; accepted: false for both (q/k/v biases, as in Qwen2, are supported)");
  return d;
}

template <typename T>
Result<std::vector<T>> rope_inv_freq_for(const ModelSpec& model) {
  const ModelConfig& mc = model.config();
  cpu::RopeConfig rc;
  rc.head_dim = mc.head_dim;
  rc.theta = mc.rope_theta;
  MT_ASSIGN_OR_RETURN(rc.scaling, cpu::parse_rope_scaling_type(mc.rope_scaling_type));
  rc.factor = mc.rope_scaling_factor;
  rc.low_freq_factor = mc.rope_low_freq_factor;
  rc.high_freq_factor = mc.rope_high_freq_factor;
  rc.original_max_position_embeddings = mc.rope_original_max_position;
  return cpu::rope_inv_freq<T>(rc);
}

template <typename T>
UnitViewT<T> view_unit(const UnitState& layout, const T* block) {
  UnitViewT<T> v;
  for (const auto& t : layout.tensors) v.p[static_cast<int>(t.role)] = block + t.offset;
  return v;
}

template <typename T>
UnitGradT<T> grad_unit(const UnitState& layout, T* block) {
  UnitGradT<T> g;
  for (const auto& t : layout.tensors) g.p[static_cast<int>(t.role)] = block + t.offset;
  return g;
}

int64_t layer_act_floats(const Dims& d) {
  const int64_t probs = d.B * d.nh * d.T * d.T;
  return d.N * (d.H /*x*/ + 1 + d.H /*xn1*/ + d.q + 2 * d.kv + d.q /*attn*/ + d.H /*h*/ + 1 + d.H + 3 * d.I) + probs;
}

template <typename T>
LayerActsT<T> bind_layer_acts(const Dims& d, T* base) {
  LayerActsT<T> a{};
  T* p = base;
  auto take = [&](int64_t n) {
    T* r = p;
    p += n;
    return r;
  };
  a.x = take(d.N * d.H);
  a.rstd1 = take(d.N);
  a.xn1 = take(d.N * d.H);
  a.q = take(d.N * d.q);
  a.k = take(d.N * d.kv);
  a.v = take(d.N * d.kv);
  a.probs = take(d.B * d.nh * d.T * d.T);
  a.attn = take(d.N * d.q);
  a.h = take(d.N * d.H);
  a.rstd2 = take(d.N);
  a.xn2 = take(d.N * d.H);
  a.gate = take(d.N * d.I);
  a.up = take(d.N * d.I);
  a.act = take(d.N * d.I);
  return a;
}

int64_t layer_workspace_floats(const Dims& d) {
  // da, dgate, dup [N,I]; dxn, dh [N,H]; dattn, dq [N,q]; dk, dv [N,kv]; attention ds [probs]
  return 3 * d.N * d.I + 2 * d.N * d.H + 2 * d.N * d.q + 2 * d.N * d.kv + d.B * d.nh * d.T * d.T + d.N * d.H;
}

int64_t head_workspace_floats(const Dims& d) { return d.N * d.V + 2 * d.N + 2 * d.N * d.H; }

template <typename T>
LayerMathT<T>::LayerMathT(cpu::CpuContext& ctx, const Dims& d, std::vector<T> inv_freq)
    : ctx_(ctx), d_(d), inv_freq_(std::move(inv_freq)) {
  positions_.resize(static_cast<size_t>(d.N));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t) positions_[static_cast<size_t>(b * d.T + t)] = static_cast<int32_t>(t);
}

template <typename T>
Status LayerMathT<T>::forward(const UnitViewT<T>& w, const T* x_in, T* x_out, const LayerActsT<T>& a) {
  const Dims& d = d_;
  if (a.x != x_in) std::memcpy(a.x, x_in, sizeof(T) * static_cast<size_t>(d.N * d.H));
  cpu::rmsnorm_forward<T>(ctx_, a.x, w[TensorRole::kAttnNorm], d.N, d.H, d.eps, a.xn1, a.rstd1);
  cpu::linear_forward<T>(ctx_, a.xn1, w[TensorRole::kQ], w[TensorRole::kQBias], d.N, d.H, d.q, a.q);
  cpu::linear_forward<T>(ctx_, a.xn1, w[TensorRole::kK], w[TensorRole::kKBias], d.N, d.H, d.kv, a.k);
  cpu::linear_forward<T>(ctx_, a.xn1, w[TensorRole::kV], w[TensorRole::kVBias], d.N, d.H, d.kv, a.v);
  cpu::rope_forward<T>(ctx_, a.q, a.q, positions_.data(), d.N, d.nh, d.hd, inv_freq_.data());
  cpu::rope_forward<T>(ctx_, a.k, a.k, positions_.data(), d.N, d.nkv, d.hd, inv_freq_.data());
  const cpu::AttentionShape s{d.B, d.T, d.nh, d.nkv, d.hd};
  MT_RETURN_IF_ERROR(cpu::attention_forward<T>(ctx_, s, a.q, a.k, a.v, a.attn, a.probs));
  // h = x + o_proj(attn); x_out = h + down(silu(gate) * up)
  cpu::linear_forward<T>(ctx_, a.attn, w[TensorRole::kO], nullptr, d.N, d.q, d.H, a.h);
  cpu::add<T>(ctx_, a.x, a.h, d.N * d.H, a.h);
  cpu::rmsnorm_forward<T>(ctx_, a.h, w[TensorRole::kMlpNorm], d.N, d.H, d.eps, a.xn2, a.rstd2);
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
  T* da = ws;
  T* dgate = da + d.N * d.I;
  T* dup = dgate + d.N * d.I;
  T* dxn = dup + d.N * d.I;
  T* dh = dxn + d.N * d.H;
  T* dattn = dh + d.N * d.H;
  T* dq = dattn + d.N * d.q;
  T* dk = dq + d.N * d.q;
  T* dv = dk + d.N * d.kv;
  T* dsw = dv + d.N * d.kv;
  T* tmp = dsw + d.B * d.nh * d.T * d.T;
  // MLP: out = h + down(act)
  cpu::linear_backward<T>(ctx_, dout, a.act, w[TensorRole::kDown], d.N, d.I, d.H, da, false, g[TensorRole::kDown], nullptr);
  cpu::swiglu_backward<T>(ctx_, a.gate, a.up, da, d.N * d.I, dgate, dup);
  cpu::linear_backward<T>(ctx_, dgate, a.xn2, w[TensorRole::kGate], d.N, d.H, d.I, dxn, false, g[TensorRole::kGate], nullptr);
  cpu::linear_backward<T>(ctx_, dup, a.xn2, w[TensorRole::kUp], d.N, d.H, d.I, dxn, true, g[TensorRole::kUp], nullptr);
  cpu::rmsnorm_backward<T>(ctx_, dxn, a.h, w[TensorRole::kMlpNorm], a.rstd2, d.N, d.H, tmp, g[TensorRole::kMlpNorm]);
  cpu::add<T>(ctx_, dout, tmp, d.N * d.H, dh);  // residual
  // Attention: h = x + o_proj(attn)
  cpu::linear_backward<T>(ctx_, dh, a.attn, w[TensorRole::kO], d.N, d.q, d.H, dattn, false, g[TensorRole::kO], nullptr);
  const cpu::AttentionShape s{d.B, d.T, d.nh, d.nkv, d.hd};
  MT_RETURN_IF_ERROR(cpu::attention_backward<T>(ctx_, s, a.q, a.k, a.v, a.probs, dattn, dq, dk, dv, dsw));
  cpu::rope_backward<T>(ctx_, dq, dq, positions_.data(), d.N, d.nh, d.hd, inv_freq_.data());
  cpu::rope_backward<T>(ctx_, dk, dk, positions_.data(), d.N, d.nkv, d.hd, inv_freq_.data());
  cpu::linear_backward<T>(ctx_, dq, a.xn1, w[TensorRole::kQ], d.N, d.H, d.q, dxn, false, g[TensorRole::kQ], g[TensorRole::kQBias]);
  cpu::linear_backward<T>(ctx_, dk, a.xn1, w[TensorRole::kK], d.N, d.H, d.kv, dxn, true, g[TensorRole::kK], g[TensorRole::kKBias]);
  cpu::linear_backward<T>(ctx_, dv, a.xn1, w[TensorRole::kV], d.N, d.H, d.kv, dxn, true, g[TensorRole::kV], g[TensorRole::kVBias]);
  cpu::rmsnorm_backward<T>(ctx_, dxn, a.x, w[TensorRole::kAttnNorm], a.rstd1, d.N, d.H, tmp, g[TensorRole::kAttnNorm]);
  cpu::add<T>(ctx_, dh, tmp, d.N * d.H, dx);
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
  T* logits = ws;
  T* lse = logits + d.N * d.V;
  T* rstd = lse + d.N;
  T* xn = rstd + d.N;
  T* dxn = xn + d.N * d.H;
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

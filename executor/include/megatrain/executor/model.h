// Stateless layer templates: the math of one Llama-family decoder layer (and of the embedding and
// the head) bound at call time to whichever buffer holds the unit's weights. Semantics are Hugging
// Face's: pre-norm RMSNorm, q/k/v projections (with bias when the architecture has it), RoPE as HF
// applies it, causal GQA attention scaled by 1/sqrt(head_dim), o_proj, residual, RMSNorm, SwiGLU
// MLP (or a MoE block), residual. The decoder layer is not written out here: it is the op list of
// its architecture (arch::layer_ops), which LayerMathT runs forward and in reverse. The same
// functions serve the streamed pipeline and the plain in-memory loop, so the two differ only in
// where buffers live and when transfers happen.
#pragma once

#include <cstdint>
#include <vector>

#include "megatrain/buffers/shape.h"
#include "megatrain/core/arch.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::exec {

// The shape (megatrain/buffers/shape.h: sizes, q/k norms, sinks, experts) and what the layer math
// needs beyond it.
struct Dims : buffers::Shape {
  double eps = 1e-6;
  bool tied = false;
  bool renorm = false;           // top-k weights divided by their sum (Mixtral; Qwen3-MoE norm_topk_prob)
  int64_t moe_layers = 0;        // layers with the MoE block (the load-balancing loss averages over them)
  // gpt-oss: the experts stacked [E, in, out] (x @ W) with biases, gate and up interleaved in
  // gate_up_proj's output columns, the clamped SwiGLU (swiglu_alpha, swiglu_limit; 0: no clamp).
  double swiglu_alpha = 1.702, swiglu_limit = 0;
  double rope_scale = 1;         // RoPE's factor on cos and sin (yarn's attention scaling)
  // The attention window of decoder layer l (0-based) at window[l]: 0 for the whole causal prefix
  // (HF sliding_window on the layers layer_types marks sliding, or on every layer for Mistral).
  std::vector<int64_t> window;
  int64_t window_of(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(window.size()) ? window[static_cast<size_t>(layer)] : 0;
  }
};
Result<Dims> make_dims(const ModelSpec& model, int64_t micro_batch, int64_t seq_len);

// Everything below is a template over the element type T: float is what every backend trains
// with; double is the same math for semantic checks against a float64 reference (PyTorch), where
// rounding cannot hide a slip (tests/executor/torch_reference_test.cpp). The float names are the
// ones the pipeline uses.

// Pointers to one unit's tensors inside a contiguous block laid out as UnitState::tensors.
// Expert tensors: p[role] points at expert 0's tensor and stride[role] is the distance in elements
// from one expert's tensor to the next (per-expert tensors of Mixtral and Qwen3-MoE: the size of
// one expert's tensors; gpt-oss's stacked tensors: numel / E, their first dimension).
template <typename T>
struct UnitViewT {
  const T* p[kTensorRoleCount] = {};  // indexed by TensorRole
  int64_t stride[kTensorRoleCount] = {};
  int64_t layer = -1;  // the decoder layer (0-based) of the unit; -1 for the embedding and the head
  const T* operator[](TensorRole r) const { return p[static_cast<int>(r)]; }
  int64_t stride_of(TensorRole r) const { return stride[static_cast<int>(r)]; }
};
template <typename T>
struct UnitGradT {
  T* p[kTensorRoleCount] = {};
  int64_t stride[kTensorRoleCount] = {};
  int64_t layer = -1;
  T* operator[](TensorRole r) const { return p[static_cast<int>(r)]; }
};
using UnitView = UnitViewT<float>;
using UnitGrad = UnitGradT<float>;
template <typename T>
UnitViewT<T> view_unit(const UnitState& layout, const T* block);
template <typename T>
UnitGradT<T> grad_unit(const UnitState& layout, T* block);

// What backward needs from one layer's forward for one micro-batch.
template <typename T>
struct LayerActsT {
  T *x, *rstd1, *xn1, *q, *k, *v, *probs, *attn, *h, *rstd2, *xn2, *gate, *up, *act;
  // The log-sum-exp of each attention row [B, n_heads, T], kept instead of probs by a backend whose
  // attention recomputes the probabilities (CUDA); null on the CPU backend.
  T* lse = nullptr;
  // Qwen3 q/k norm: the projections before the norm and the norms' reciprocal RMS (per head).
  T *q_pre = nullptr, *k_pre = nullptr, *rstd_q = nullptr, *rstd_k = nullptr;
  // gpt-oss attention sinks: each attention row's sink probability [B, n_heads, T].
  T* sink_probs = nullptr;
  // MoE: router logits and probabilities [N, E]; per slot (token t, choice j at t*k+j) the expert
  // and its combine weight; the slots sorted by expert (perm, offsets[E+1], row_of_slot, int32
  // stored in T-sized cells); the gathered inputs xp and expert outputs yp [N*k, H].
  T *logits = nullptr, *rprobs = nullptr, *rweight = nullptr, *xp = nullptr, *yp = nullptr;
  int32_t *rexpert = nullptr, *perm = nullptr, *row_of_slot = nullptr, *offsets = nullptr;
  // Set by the trainer, not by bind: the forward adds the layer's load-balancing statistics (slots
  // per expert, summed router probabilities, in double) when non-null (a recompute passes null);
  // the backward adds aux_grad[e] (the loss's gradient with respect to every token's probability
  // of expert e) to the router's gradient when non-null.
  double *aux_count = nullptr, *aux_prob = nullptr;
  const double* aux_grad = nullptr;
  // Set by the caller, not by bind: packed rows without cross-document attention. [B * T] int32,
  // the first token of each token's document within its row (cpu::AttentionShape::starts); RoPE's
  // positions then restart at 0 at each document. Null: one document per row.
  const int32_t* doc_starts = nullptr;
};
using LayerActs = LayerActsT<float>;
// Floats of one layer's activations for one micro-batch (buffers::cpu_layer_acts); a buffer of
// this many elements of T holds them for T = double too.
int64_t layer_act_floats(const Dims& d);
template <typename T>
LayerActsT<T> bind_layer_acts(const Dims& d, T* base);
// Temporaries of one layer's backward (reused across layers; buffers::cpu_layer_workspace).
int64_t layer_workspace_floats(const Dims& d);
// Temporaries of the head (logits and friends) for one micro-batch (buffers::cpu_head_workspace).
int64_t head_workspace_floats(const Dims& d);

// RoPE's inverse frequencies for the model's rope_theta and rope_scaling, in T.
template <typename T>
Result<std::vector<T>> rope_inv_freq_for(const ModelSpec& model);

// Instantiated for float and double (model.cpp).
template <typename T>
class LayerMathT {
 public:
  LayerMathT(cpu::CpuContext& ctx, const Dims& d, std::vector<T> inv_freq);
  // x_out = layer(x_in); fills acts (acts.x receives a copy of x_in unless it already points at it).
  Status forward(const UnitViewT<T>& w, const T* x_in, T* x_out, const LayerActsT<T>& acts);
  // dx = d layer / d x_in . dout; unit gradients accumulate into g. dx may alias dout.
  Status backward(const UnitViewT<T>& w, const LayerActsT<T>& acts, const T* dout, T* dx, const UnitGradT<T>& g,
                  T* workspace);

  Status embed(const T* table, const int32_t* tokens, T* x_out);
  Status embed_backward(const int32_t* tokens, const T* dx, T* dtable);
  // Final norm, LM head and cross-entropy, forward and backward at once: adds the summed loss and
  // token count, writes dx (gradient at the last layer's output, scaled by grad_scale = 1 /
  // tokens of the step), and accumulates the norm and head gradients.
  Status head(const T* final_norm, const T* lm_head, const T* x, const int32_t* targets, T grad_scale, T* dx,
              T* d_final_norm, T* d_lm_head, double* loss_sum, int64_t* count, T* workspace);

  const Dims& dims() const { return d_; }

 private:
  // One op of the layer's forward over the values it names (bound to acts, and x_out for kOut).
  Status forward_op(const arch::Op& op, const UnitViewT<T>& w, T* x_out, const LayerActsT<T>& a);
  // RoPE's positions for this micro-batch: t within its row, or t - its document's start.
  const int32_t* positions_for(const LayerActsT<T>& a);

  cpu::CpuContext& ctx_;
  Dims d_;
  std::vector<T> inv_freq_;
  std::vector<int32_t> positions_, doc_positions_;
};
using LayerMath = LayerMathT<float>;

}  // namespace megatrain::exec

// Stateless layer templates: the math of one Llama-family decoder layer (and of the embedding and
// the head) bound at call time to whichever buffer holds the unit's weights. Semantics are Hugging
// Face's: pre-norm RMSNorm, q/k/v projections (with bias when the architecture has it), RoPE as HF
// applies it, causal GQA attention scaled by 1/sqrt(head_dim), o_proj, residual, RMSNorm, SwiGLU
// MLP, residual. The same functions serve the streamed pipeline and the plain in-memory loop, so
// the two differ only in where buffers live and when transfers happen.
#pragma once

#include <cstdint>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::exec {

struct Dims {
  int64_t B = 0, T = 0, N = 0;  // micro-batch rows, sequence length, tokens (B*T)
  int64_t H = 0, I = 0, nh = 0, nkv = 0, hd = 0, V = 0, L = 0;
  int64_t q = 0, kv = 0;        // nh*hd, nkv*hd
  double eps = 1e-6;
  bool tied = false;
};
Result<Dims> make_dims(const ModelSpec& model, int64_t micro_batch, int64_t seq_len);

// Pointers to one unit's tensors inside a contiguous block laid out as UnitState::tensors.
struct UnitView {
  const float* p[19] = {};  // indexed by TensorRole
  const float* operator[](TensorRole r) const { return p[static_cast<int>(r)]; }
};
struct UnitGrad {
  float* p[19] = {};
  float* operator[](TensorRole r) const { return p[static_cast<int>(r)]; }
};
UnitView view_unit(const UnitState& layout, const float* block);
UnitGrad grad_unit(const UnitState& layout, float* block);

// What backward needs from one layer's forward for one micro-batch.
struct LayerActs {
  float *x, *rstd1, *xn1, *q, *k, *v, *probs, *attn, *h, *rstd2, *xn2, *gate, *up, *act;
  // The log-sum-exp of each attention row [B, n_heads, T], kept instead of probs by a backend whose
  // attention recomputes the probabilities (CUDA); null on the CPU backend.
  float* lse = nullptr;
};
int64_t layer_act_floats(const Dims& d);
LayerActs bind_layer_acts(const Dims& d, float* base);
// Temporaries of one layer's backward (reused across layers).
int64_t layer_workspace_floats(const Dims& d);
// Temporaries of the head (logits and friends) for one micro-batch.
int64_t head_workspace_floats(const Dims& d);

class LayerMath {
 public:
  LayerMath(cpu::CpuContext& ctx, const Dims& d, std::vector<float> inv_freq);
  // x_out = layer(x_in); fills acts (acts.x receives a copy of x_in unless it already points at it).
  Status forward(const UnitView& w, const float* x_in, float* x_out, const LayerActs& acts);
  // dx = d layer / d x_in . dout; unit gradients accumulate into g. dx may alias dout.
  Status backward(const UnitView& w, const LayerActs& acts, const float* dout, float* dx, const UnitGrad& g,
                  float* workspace);

  Status embed(const float* table, const int32_t* tokens, float* x_out);
  Status embed_backward(const int32_t* tokens, const float* dx, float* dtable);
  // Final norm, LM head and cross-entropy, forward and backward at once: adds the summed loss and
  // token count, writes dx (gradient at the last layer's output, scaled by grad_scale = 1 /
  // tokens of the step), and accumulates the norm and head gradients.
  Status head(const float* final_norm, const float* lm_head, const float* x, const int32_t* targets,
              float grad_scale, float* dx, float* d_final_norm, float* d_lm_head, double* loss_sum,
              int64_t* count, float* workspace);

  const Dims& dims() const { return d_; }

 private:
  cpu::CpuContext& ctx_;
  Dims d_;
  std::vector<float> inv_freq_;
  std::vector<int32_t> positions_;
};

}  // namespace megatrain::exec

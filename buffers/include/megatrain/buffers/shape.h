// The model's shape for one micro-batch: the one struct every buffer size is computed from. The
// executor's Dims extends it with the layer math's constants (eps, windows, RoPE scale, ...).
#pragma once

#include <cstdint>
#include <vector>

#include "megatrain/core/arch.h"
#include "megatrain/core/model_spec.h"

namespace megatrain::buffers {

// Caps on how the CUDA backend blocks its work, for tests: the most vocabulary columns one chunk
// of the head's logits holds, and the most query rows one block of attention holds. 0 leaves the
// backend's own rule (buffers.h: cuda_vocab_chunk, cuda_attention_rows), which at a test's tiny
// shapes puts the whole vocabulary in one chunk and the whole sequence in one block; a whole-step
// test sets them small to run the head's chunked accumulation and multi-block attention. The
// layout and the backend read the same Shape, so the footprint follows.
struct BlockCaps {
  int64_t vocab_chunk = 0;
  int64_t attention_rows = 0;
  bool operator==(const BlockCaps&) const = default;
};

struct Shape {
  int64_t B = 0, T = 0, N = 0;  // micro-batch rows, sequence length, tokens (B*T)
  int64_t H = 0, I = 0, nh = 0, nkv = 0, hd = 0, V = 0, L = 0;
  int64_t q = 0, kv = 0;        // nh*hd, nkv*hd
  bool qk_norm = false;         // Qwen3: per-head RMSNorm of q and k before RoPE
  bool sinks = false;           // gpt-oss: learned per-head attention sinks
  // Mixture-of-Experts: E experts, k chosen per token, Im an expert's intermediate size. A model's
  // layers may mix MoE and dense MLPs (Qwen3-MoE mlp_only_layers, decoder_sparse_step):
  // `dense_mlp` says whether any layer has the dense MLP.
  bool moe = false;
  bool dense_mlp = true;
  bool gpt_oss = false;         // the experts' gate and up interleaved in one gate_up
  int64_t E = 0, k = 0, Im = 0;
  // Elements of each MLP intermediate (gate, up, act): N*I for the dense MLP, N*k*Im for the
  // experts; the buffers hold the larger, since they serve every layer.
  int64_t mlp_floats() const {
    const int64_t dense = dense_mlp ? N * I : 0;
    return moe ? (dense > N * k * Im ? dense : N * k * Im) : dense;
  }
  BlockCaps caps;               // tests only; none by default
  // The decoder layer's ops (arch::layer_ops_of_kind) with the dense MLP (when a layer has it) and
  // with the MoE block (when the model has one): the CPU backend runs them, and its activation
  // buffers are the values they write (cpu_layer_acts).
  std::vector<arch::Op> dense_ops, moe_ops;
};

// The shape of `config` for micro_batch x seq_len tokens. Plain arithmetic: whether the executor
// supports the model is make_dims's question.
Shape shape_of(const ModelConfig& config, int64_t micro_batch, int64_t seq_len);

// The width of an op's shape symbol (arch::Dim) in this shape: what arch::dim_value gives for the
// config, read from the Shape that the backends and the buffer lists hold.
int64_t dim_width(arch::Dim d, const Shape& s);

}  // namespace megatrain::buffers

// Rotary position embedding, applied exactly as Hugging Face Llama applies it (also Mistral, Qwen2).
//
//   inv_freq[i] = 1 / theta^((2i) / d)                      i in [0, d/2), d = head_dim
//   angle       = p * inv_freq[i]                           p = the token's position
//   cos, sin    = cos(angle), sin(angle), duplicated to d:  c = [cos, cos], s = [sin, sin]
//   out         = x * c + rotate_half(x) * s                rotate_half(x) = cat(-x[d/2:], x[:d/2])
// i.e. element i is paired with element i + d/2 (not with its neighbour, as in the GPT-J layout):
//   out[i]       = x[i] * cos - x[i + d/2] * sin
//   out[i + d/2] = x[i + d/2] * cos + x[i] * sin
// The backward is the transpose of that rotation, i.e. the rotation by -angle:
//   dx[i]        = dout[i] * cos + dout[i + d/2] * sin
//   dx[i + d/2]  = dout[i + d/2] * cos - dout[i] * sin
//
// rope_scaling (HF config): "linear" divides inv_freq by `factor` (transformers >= 4.45; older
// releases divided the positions, which differs only by rounding). "llama3" (Llama 3.1+) keeps the
// high frequencies (wavelength < original_max_position_embeddings / high_freq_factor), divides the
// low ones (wavelength > original_max_position_embeddings / low_freq_factor) by `factor`, and
// interpolates in between with smooth = (original_max / wavelength - low) / (high - low):
//   inv = (1 - smooth) * inv / factor + smooth * inv
// "yarn" (gpt-oss) blends the interpolated frequencies inv / factor and the original ones with a
// linear ramp over the dimensions between the correction range [low, high] that beta_fast and
// beta_slow give at original_max_position_embeddings (floored and ceiled when truncate):
//   ramp_i = clamp((i - low) / (high - low), 0, 1),  e = 1 - ramp_i
//   inv_i  = inv_i / factor * (1 - e) + inv_i * e
// and multiplies cos and sin by the attention scaling (attention_factor, or 0.1 ln(factor) + 1).
// "dynamic", "longrope" and other types are refused by parse_rope_scaling_type().
// With T = float every step is rounded to fp32 as HF does it (inv_freq, angles and cos/sin are fp32
// tensors there); with T = double everything is double.
//
// Shapes: x, out, dout, dx [n_tokens, n_heads, head_dim] contiguous; positions [n_tokens] int32 (for
// a batch of sequences of length S: 0..S-1 repeated); inv_freq [head_dim / 2]. Call once for q
// (n_heads) and once for k (n_kv_heads). out may equal x (in place). Deterministic: each element is
// one independent rotation.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

enum class RopeScaling { kNone, kLinear, kLlama3, kYarn };

struct RopeConfig {
  int64_t head_dim = 0;   // even, > 0
  double theta = 10000;   // rope_theta
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1;                           // linear, llama3
  double low_freq_factor = 1;                  // llama3
  double high_freq_factor = 4;                 // llama3
  double original_max_position_embeddings = 8192;  // llama3, yarn
  double beta_fast = 32, beta_slow = 1;            // yarn
  bool truncate = true;                            // yarn: floor/ceil the correction range
  double attention_factor = 0;                     // yarn: 0 derives it from factor
};

// The factor on cos and sin: 1 but for yarn (attention_factor, else 0.1 ln(factor) + 1 when
// factor > 1).
double rope_attention_scaling(const RopeConfig& config);

// The rope_scaling "type" (or "rope_type") of an HF config: "" or "default" -> kNone, "linear",
// "llama3", "yarn"; anything else is `unsupported`, naming the type.
Result<RopeScaling> parse_rope_scaling_type(std::string_view type);

// inv_freq [head_dim / 2] for the config; invalid_argument for an odd head_dim, theta <= 0, factor <= 0
// or llama3 with high_freq_factor <= low_freq_factor.
template <typename T>
Result<std::vector<T>> rope_inv_freq(const RopeConfig& config);

// scale multiplies cos and sin (rope_attention_scaling; 1 leaves them as they are).
template <typename T>
void rope_forward(CpuContext& ctx, const T* x, T* out, const int32_t* positions, int64_t n_tokens,
                  int64_t n_heads, int64_t head_dim, const T* inv_freq, T scale = T(1));

template <typename T>
void rope_backward(CpuContext& ctx, const T* dout, T* dx, const int32_t* positions, int64_t n_tokens,
                   int64_t n_heads, int64_t head_dim, const T* inv_freq, T scale = T(1));

}  // namespace megatrain::cpu

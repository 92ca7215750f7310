// Rotary position embedding, in place, HF's rotate_half layout (element i pairs with i + d/2);
// see rope.cu. angle = float(position) * inv_freq[i], cos/sin in fp32 as HF computes them, both
// times `scale` (yarn's attention factor, Dims::rope_scale; 1 otherwise).
//   forward   x[i] = x[i] cos - x[i+d/2] sin;    x[i+d/2] = x[i+d/2] cos + x[i] sin
//   backward  the rotation by -angle.
// x [n_tokens, n_heads, head_dim] in T; positions [n_tokens] int32; inv_freq [head_dim/2] fp32.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

template <typename T>
Status rope_forward(T* x, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                    const float* inv_freq, cudaStream_t s, float scale = 1.0f);

template <typename T>
Status rope_backward(T* dx, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                     const float* inv_freq, cudaStream_t s, float scale = 1.0f);

}  // namespace megatrain::cuda

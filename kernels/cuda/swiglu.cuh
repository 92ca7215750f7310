// SwiGLU's element-wise middle: out = silu(gate) * up; see swiglu.cu.
//   backward  dgate = dout * up * sig * (1 + g (1 - sig));  dup = dout * silu(g)
// All in T, arithmetic in fp32. dgate/dup may alias gate/up.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

template <typename T>
Status swiglu_forward(const T* gate, const T* up, int64_t n, T* out, cudaStream_t s);

template <typename T>
Status swiglu_backward(const T* gate, const T* up, const T* dout, int64_t n, T* dgate, T* dup, cudaStream_t s);

// gpt-oss: gu [n, 2] holds element i's gate at 2i and up at 2i+1 (gate_up_proj's interleaved
// columns); out [n] = (clamp(u) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit)) (no clamp when
// limit <= 0). The backward writes dgu [n, 2] (0 where the clamp cut the input); dgu may alias gu.
template <typename T>
Status clamped_swiglu_forward(const T* gu, int64_t n, float alpha, float limit, T* out, cudaStream_t s);
template <typename T>
Status clamped_swiglu_backward(const T* gu, const T* dout, int64_t n, float alpha, float limit, T* dgu, cudaStream_t s);

}  // namespace megatrain::cuda

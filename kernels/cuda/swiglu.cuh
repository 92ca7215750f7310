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

}  // namespace megatrain::cuda

// RMSNorm (Hugging Face LlamaRMSNorm) on the GPU; see rmsnorm.cu.
//   forward   rstd[r] = 1 / sqrt(mean_i x[r,i]^2 + eps);  y[r,i] = T(w[i] * (x[r,i] * rstd[r]))
//   backward  g = dy * w;  c = mean_i g[i] x[r,i];  dx[r,i] = rstd[r] (g[i] - x[r,i] rstd[r]^2 c)
//             dw[i] += sum_r dy[r,i] x[r,i] rstd[r]   (a two-stage sum in a fixed order: column_sum.cuh)
// x, dy, dx and dw are fp32; w and y are T. dx may alias dy; dx or dw may be null to skip it.
// scratch: column_sum_scratch_bytes(dim) bytes of device memory (workspace_sizes.h), for dw.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

template <typename T>
Status rmsnorm_forward(const float* x, const T* w, int64_t n, int64_t dim, float eps, T* y, float* rstd, cudaStream_t s);

template <typename T>
Status rmsnorm_backward(const float* dy, const float* x, const T* w, const float* rstd, int64_t n, int64_t dim, float* dx,
                        float* dw, void* scratch, cudaStream_t s);

}  // namespace megatrain::cuda

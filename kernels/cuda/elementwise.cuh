// Element-wise fp32 arithmetic of the residual stream and the bias; see elementwise.cu.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

// out[i] = a[i] + b[i] (out may alias a or b).
Status add(const float* a, const float* b, int64_t n, float* out, cudaStream_t s);
// dst[i] += src[i].
Status accumulate(const float* src, int64_t n, float* dst, cudaStream_t s);
// y[r, j] = T(float(y[r, j]) + float(bias[j])) for a [rows, cols] y.
template <typename T>
Status add_bias(T* y, const T* bias, int64_t rows, int64_t cols, cudaStream_t s);

}  // namespace megatrain::cuda

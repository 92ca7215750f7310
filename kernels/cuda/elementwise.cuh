// Element-wise fp32 arithmetic of the residual stream and the bias; see elementwise.cu.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

// out[i] = a[i] + b[i] (out may alias a or b).
Status add(const float* a, const float* b, int64_t n, float* out, cudaStream_t s);
// dst[i] += src[i].
Status accumulate(const float* src, int64_t n, float* dst, cudaStream_t s);
// y[r, j] = T(float(y[r, j]) + float(bias[j])) for a [rows, cols] y. Instantiated for (T, B) =
// (float, float), (bf16, bf16) and (float, bf16) (an fp32 output with a bf16 weight's bias: the
// residual stream's o_proj bias and the router's logits on the mixed-precision path).
template <typename T, typename B = T>
Status add_bias(T* y, const B* bias, int64_t rows, int64_t cols, cudaStream_t s);

}  // namespace megatrain::cuda

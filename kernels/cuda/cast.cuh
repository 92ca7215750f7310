// Element type conversions (round to nearest even into bf16, exact into fp32); see cast.cu.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

// dst[i] = To(src[i]). Instantiated for (float, bf16), (bf16, float) and (float, float).
template <typename From, typename To>
Status convert(const From* src, int64_t n, To* dst, cudaStream_t s);

}  // namespace megatrain::cuda

// The device scratch the CUDA kernels ask their callers for, as plain host functions: the kernels
// (moe.cu, grouped_gemm.cu) size their launches by them, and the buffer lists of the CUDA backend
// (buffers/src/buffers.cpp) size the arena by the same functions. Plain C++: no CUDA headers.
#pragma once

#include <cstdint>

#include "cuda/moe_math.h"

namespace megatrain::cuda {

// moe_permute's per-chunk expert counts: one row of e counters per chunk of moe_math::kChunk slots.
inline int64_t moe_permute_scratch_ints(int64_t slots, int64_t e) {
  return (slots + moe_math::kChunk - 1) / moe_math::kChunk * e;
}
// The grouped GEMMs' device pointer arrays: A, B and C for each of e experts.
inline int64_t grouped_gemm_pointer_slots(int64_t e) { return 3 * e; }

}  // namespace megatrain::cuda

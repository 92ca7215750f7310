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

// cublasGemmGroupedBatchedEx reads its matrices' addresses from device arrays, where cuBLAS cannot
// check them, and its 16-bit kernels load 16 bytes at a time: every matrix must start on a 16-byte
// boundary and every leading dimension be a multiple of 16 bytes. A weight that follows a tensor of
// odd size in its unit (gpt-oss's 4-element sinks lead every layer) does not. grouped_gemm.cu
// checks each operand with this, and runs a call that fails it as one cublasGemmEx per expert
// (which checks alignment itself). Plain arithmetic on the address, so the rule is tested here.
inline bool grouped_operand_aligned(const void* p, int64_t ld, int64_t elem_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld * elem_bytes % 16 == 0;
}

}  // namespace megatrain::cuda

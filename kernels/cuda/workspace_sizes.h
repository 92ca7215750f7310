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
// The same for every matrix of a two-level batch (gemm_batched_2d): p + o * stride_outer +
// i * stride_inner (elements) for every o and i, which holds when p and both strides are aligned.
inline bool batched_operand_aligned(const void* p, int64_t ld, int64_t elem_bytes, int64_t stride_outer, int64_t stride_inner) {
  return grouped_operand_aligned(p, ld, elem_bytes) && stride_outer * elem_bytes % 16 == 0 && stride_inner * elem_bytes % 16 == 0;
}

// Column sums over many rows (RMSNorm's weight gradient, bias gradients, the MoE routing
// statistics) run in two stages in a fixed order (column_sum.cuh): the rows are cut into
// column_sum_chunks(rows) chunks of column_sum_chunk_rows(rows) rows (the last one shorter, never
// empty); stage 1 sums each chunk's rows in order, one thread per (chunk, column), into a partial;
// stage 2 adds the partials to the output in chunk order. The cut depends on the row count alone,
// so the result is the same bits on every run. A chunk holds 256 rows or more (all of them when
// there are fewer), and there are at most 128 chunks: Qwen3's per-head norm at 16k tokens and 64
// heads (1M rows of 128 columns) runs 256 blocks instead of 2 blocks walking a million rows each.
inline constexpr int64_t kColumnSumMinChunkRows = 256;
inline constexpr int64_t kColumnSumMaxChunks = 128;
inline int64_t column_sum_chunks(int64_t rows) {
  const int64_t c = rows / kColumnSumMinChunkRows;
  return c < 1 ? 1 : c > kColumnSumMaxChunks ? kColumnSumMaxChunks : c;
}
inline int64_t column_sum_chunk_rows(int64_t rows) {
  const int64_t c = column_sum_chunks(rows);
  return rows > 0 ? (rows + c - 1) / c : 1;
}
// The partials of one call: one per chunk and column, doubles at most (8 bytes).
inline int64_t column_sum_scratch_bytes(int64_t cols) { return kColumnSumMaxChunks * cols * 8; }

}  // namespace megatrain::cuda

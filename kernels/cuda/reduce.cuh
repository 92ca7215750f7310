// Reductions in a fixed order (deterministic); see reduce.cu.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

// The gradient norm's building block: *out = sum_i x[i]^2, accumulated in double. Two passes:
// blocks of kSumSquaresChunk elements each write a partial sum to scratch, then one block adds the
// partials in index order. scratch holds sum_of_squares_scratch(n) doubles; out is device memory.
inline constexpr int64_t kSumSquaresChunk = 1 << 16;
int64_t sum_of_squares_scratch(int64_t n);
Status sum_of_squares(const float* x, int64_t n, double* scratch, double* out, cudaStream_t s);

// The bias gradient: db[j] += sum_r dy[r, j], a two-stage sum in a fixed order (column_sum.cuh);
// scratch holds column_sum_scratch_bytes(cols) bytes (workspace_sizes.h).
template <typename T>
Status column_sum_accumulate(const T* dy, int64_t rows, int64_t cols, float* db, void* scratch, cudaStream_t s);

}  // namespace megatrain::cuda

// The two-stage column sum in a fixed order (workspace_sizes.h: column_sum_chunks), for the
// kernels that sum a value over many rows per column: out[j] += sum over r of value(r, j).
//   stage 1: block (blockIdx.x: kColumnSumThreads columns, blockIdx.y: chunk c); thread j adds
//            value(r, j) for the chunk's rows r in order, from zero, into partial[c * cols + j];
//   stage 2: thread j loads out[j] once, adds partial[0 .. chunks) in order, and stores it.
// No atomics: the order depends on rows and cols only, so every run gives the same bits. The adds
// are __fadd_rn / __dadd_rn (Acc float or double), so nvcc contracts nothing into them.
// `value` is a functor with `__device__ Acc operator()(int64_t r, int64_t j) const`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/workspace_sizes.h"

namespace megatrain::cuda::detail {

inline constexpr int kColumnSumThreads = 64;

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename Acc, typename F>
__global__ void __launch_bounds__(kColumnSumThreads)
    column_partials_kernel(F value, int64_t rows, int64_t cols, int64_t chunk_rows, Acc* partial) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumnSumThreads + threadIdx.x;
  if (j >= cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  Acc acc = Acc(0);
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) acc = add_rn(acc, value(r, j));
  partial[static_cast<int64_t>(blockIdx.y) * cols + j] = acc;
}

template <typename Acc>
__global__ void __launch_bounds__(kColumnSumThreads)
    column_finish_kernel(const Acc* partial, int64_t chunks, int64_t cols, Acc* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumnSumThreads + threadIdx.x;
  if (j >= cols) return;
  Acc acc = out[j];
  for (int64_t c = 0; c < chunks; ++c) acc = add_rn(acc, partial[c * cols + j]);
  out[j] = acc;
}

// out[j] += sum over rows of value(r, j), j < cols; scratch holds column_sum_scratch_bytes(cols).
template <typename Acc, typename F>
Status column_sum_two_stage(F value, int64_t rows, int64_t cols, Acc* out, void* scratch, cudaStream_t s, const char* what) {
  if (rows <= 0 || cols <= 0) return {};
  if (scratch == nullptr) return invalid_argument(std::string(what) + ": the column sum's scratch is missing");
  const int64_t chunks = column_sum_chunks(rows), chunk_rows = column_sum_chunk_rows(rows);
  const auto col_blocks = static_cast<unsigned int>((cols + kColumnSumThreads - 1) / kColumnSumThreads);
  Acc* partial = static_cast<Acc*>(scratch);
  auto launched = [&](const char* stage) -> Status {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return {};
    return cuda_status(err, ("launch of " + std::string(what) + " (" + stage + ")").c_str(), __FILE__, __LINE__);
  };
  column_partials_kernel<Acc, F><<<dim3(col_blocks, static_cast<unsigned int>(chunks)), kColumnSumThreads, 0, s>>>(
      value, rows, cols, chunk_rows, partial);
  MT_RETURN_IF_ERROR(launched("partials"));
  column_finish_kernel<Acc><<<col_blocks, kColumnSumThreads, 0, s>>>(partial, chunks, cols, out);
  return launched("finish");
}

}  // namespace megatrain::cuda::detail

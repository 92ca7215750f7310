// Reductions in a fixed order on the GPU: the gradient norm's sum of squares, and the bias gradient.
//
// sum_of_squares: two passes, no atomics.
//   pass 1: one block of 256 threads per chunk of kSumSquaresChunk (65536) elements: chunk b covers
//           [b * chunk, min(n, (b + 1) * chunk)). Thread t adds x[i]^2 (in double) for
//           i = start + t, start + t + 256, ... in that order; the 256 partials are then added in a
//           fixed tree (warp shuffles with offsets 16..1, the 8 warp sums through shared memory,
//           the same shuffle tree in warp 0). scratch[b] = the chunk's sum.
//   pass 2: one block adds scratch[0 .. blocks) the same way (thread t takes t, t + 256, ..., then
//           the tree) and overwrites *out with the total.
//   The order depends only on n, so the result is bit-reproducible. n == 0 writes *out = 0 with a
//   cudaMemsetAsync (0.0 is all zero bits) and launches nothing.
//
// column_sum_accumulate: db[j] += sum over r of float(dy[r, j]), as a two-stage column sum in a
//   fixed order (column_sum.cuh): deterministic, though not the CPU op's order (rows one by one
//   straight into db), which on one thread per column walked every row of the micro-batch.
#include "cuda/reduce.cuh"

#include "cuda/column_sum.cuh"
#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) sum_squares_chunks_kernel(const float* x, int64_t n, double* scratch) {
  __shared__ double smem[kWarps];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kSumSquaresChunk;
  const int64_t end = n - start < kSumSquaresChunk ? n : start + kSumSquaresChunk;
  double acc = 0.0;
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) {
    const double v = static_cast<double>(x[i]);
    acc = __dadd_rn(acc, __dmul_rn(v, v));
  }
  acc = block_reduce_first<kThreads>(acc, 0.0, SumOp{}, smem);  // valid in thread 0
  if (threadIdx.x == 0) scratch[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) sum_partials_kernel(const double* scratch, int64_t blocks, double* out) {
  __shared__ double smem[kWarps];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < blocks; i += kThreads) acc = __dadd_rn(acc, scratch[i]);
  acc = block_reduce_first<kThreads>(acc, 0.0, SumOp{}, smem);  // valid in thread 0
  if (threadIdx.x == 0) *out = acc;
}

template <typename T>
struct ElementOf {
  const T* y;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t j) const { return to_f(y[r * cols + j]); }
};

}  // namespace

int64_t sum_of_squares_scratch(int64_t n) {
  const int64_t chunks = (n + kSumSquaresChunk - 1) / kSumSquaresChunk;
  return chunks < 1 ? 1 : chunks;
}

Status sum_of_squares(const float* x, int64_t n, double* scratch, double* out, cudaStream_t s) {
  if (n <= 0) {
    MT_CUDA_RETURN(cudaMemsetAsync(out, 0, sizeof(double), s));
    return {};
  }
  const int64_t blocks = (n + kSumSquaresChunk - 1) / kSumSquaresChunk;
  sum_squares_chunks_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, s>>>(x, n, scratch);
  MT_CUDA_LAUNCH_CHECK("sum_of_squares (chunks)");
  sum_partials_kernel<<<1, kThreads, 0, s>>>(scratch, blocks, out);
  MT_CUDA_LAUNCH_CHECK("sum_of_squares (partials)");
  return {};
}

template <typename T>
Status column_sum_accumulate(const T* dy, int64_t rows, int64_t cols, float* db, void* scratch, cudaStream_t s) {
  return detail::column_sum_two_stage<float>(ElementOf<T>{dy, cols}, rows, cols, db, scratch, s, "column_sum_accumulate");
}

template Status column_sum_accumulate<float>(const float*, int64_t, int64_t, float*, void*, cudaStream_t);
template Status column_sum_accumulate<bf16>(const bf16*, int64_t, int64_t, float*, void*, cudaStream_t);

}  // namespace megatrain::cuda

// Element-wise fp32 arithmetic of the residual stream, and the bias add, on the GPU.
//
// One thread per element, grid-stride loop over the flat index (int64), capped grid.
//   add         out[i] = a[i] + b[i]           (out may alias a or b: each element is read, then
//                                               written, by one thread)
//   accumulate  dst[i] += src[i]
//   add_bias    y[r, j] = T(float(y[r, j]) + float(bias[j])),  j = i % cols
// One IEEE fp32 add per element, exactly as the CPU op: deterministic and bit-identical.
#include "cuda/elementwise.cuh"

#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) add_kernel(const float* a, const float* b, int64_t n, float* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    out[i] = __fadd_rn(a[i], b[i]);
}

__global__ void __launch_bounds__(kThreads) accumulate_kernel(const float* src, int64_t n, float* dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    dst[i] = __fadd_rn(dst[i], src[i]);
}

template <typename T, typename B>
__global__ void __launch_bounds__(kThreads) add_bias_kernel(T* y, const B* bias, int64_t total, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride)
    y[i] = from_f<T>(__fadd_rn(to_f(y[i]), to_f(bias[i % cols])));
}

}  // namespace

Status add(const float* a, const float* b, int64_t n, float* out, cudaStream_t s) {
  if (n <= 0) return {};
  add_kernel<<<stride_grid<kThreads>(n), kThreads, 0, s>>>(a, b, n, out);
  MT_CUDA_LAUNCH_CHECK("add");
  return {};
}

Status accumulate(const float* src, int64_t n, float* dst, cudaStream_t s) {
  if (n <= 0) return {};
  accumulate_kernel<<<stride_grid<kThreads>(n), kThreads, 0, s>>>(src, n, dst);
  MT_CUDA_LAUNCH_CHECK("accumulate");
  return {};
}

template <typename T, typename B>
Status add_bias(T* y, const B* bias, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return {};
  const int64_t total = rows * cols;
  add_bias_kernel<T, B><<<stride_grid<kThreads>(total), kThreads, 0, s>>>(y, bias, total, cols);
  MT_CUDA_LAUNCH_CHECK("add_bias");
  return {};
}

template Status add_bias<float, float>(float*, const float*, int64_t, int64_t, cudaStream_t);
template Status add_bias<bf16, bf16>(bf16*, const bf16*, int64_t, int64_t, cudaStream_t);
template Status add_bias<float, bf16>(float*, const bf16*, int64_t, int64_t, cudaStream_t);

}  // namespace megatrain::cuda

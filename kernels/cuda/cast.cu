// Element type conversions on the GPU.
//
// One thread per element, grid-stride loop over the flat index (int64), capped grid:
// dst[i] = To(src[i]). fp32 -> bf16 rounds to nearest even (__float2bfloat16_rn, NaN stays NaN),
// bf16 -> fp32 is exact, fp32 -> fp32 is a copy. Element-wise, so deterministic.
#include "cuda/cast.cuh"

#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

template <typename From, typename To>
__global__ void __launch_bounds__(kThreads) convert_kernel(const From* src, int64_t n, To* dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    dst[i] = from_f<To>(to_f(src[i]));
}

}  // namespace

template <typename From, typename To>
Status convert(const From* src, int64_t n, To* dst, cudaStream_t s) {
  if (n <= 0) return {};
  convert_kernel<From, To><<<stride_grid<kThreads>(n), kThreads, 0, s>>>(src, n, dst);
  MT_CUDA_LAUNCH_CHECK("convert");
  return {};
}

template Status convert<float, bf16>(const float*, int64_t, bf16*, cudaStream_t);
template Status convert<bf16, float>(const bf16*, int64_t, float*, cudaStream_t);
template Status convert<float, float>(const float*, int64_t, float*, cudaStream_t);

}  // namespace megatrain::cuda

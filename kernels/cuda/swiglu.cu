// SwiGLU's element-wise middle on the GPU: out = silu(gate) * up, and its backward.
//
// One thread per element, grid-stride loop over the flat index (int64), capped grid. The formulas
// are the CPU op's (kernels/cpu/swiglu.cpp), in fp32 whatever T is:
//   forward   out = (g / (1 + expf(-g))) * u
//   backward  sig = 1 / (1 + expf(-g));  silu = g / (1 + expf(-g))
//             dgate = (d * u) * (sig * (1 + g * (1 - sig)));  dup = d * silu
// expf is the accurate one (not __expf); / is IEEE division (nvcc's default -prec-div=true); the
// products and sums use __fmul_rn / __fadd_rn / __fsub_rn so nothing is contracted into an FMA.
// g, u and d are loaded into registers before anything is written, so dgate/dup may alias
// gate/up (each element is read and written by one thread). Deterministic: element-wise.
#include "cuda/swiglu.cuh"

#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(const T* gate, const T* up, int64_t n, T* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float g = to_f(gate[i]);
    const float u = to_f(up[i]);
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    out[i] = from_f<T>(__fmul_rn(silu, u));
  }
}

// dgate may alias gate and dup may alias up: no __restrict__, all loads before the stores.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* gate, const T* up, const T* dout, int64_t n, T* dgate, T* dup) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float g = to_f(gate[i]);
    const float u = to_f(up[i]);
    const float d = to_f(dout[i]);
    const float den = __fadd_rn(1.0f, expf(-g));
    const float sig = __fdiv_rn(1.0f, den);
    const float silu = __fdiv_rn(g, den);
    const float dsig = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sig))));
    dgate[i] = from_f<T>(__fmul_rn(__fmul_rn(d, u), dsig));
    dup[i] = from_f<T>(__fmul_rn(d, silu));
  }
}

}  // namespace

template <typename T>
Status swiglu_forward(const T* gate, const T* up, int64_t n, T* out, cudaStream_t s) {
  if (n <= 0) return {};
  swiglu_forward_kernel<T><<<stride_grid<kThreads>(n), kThreads, 0, s>>>(gate, up, n, out);
  MT_CUDA_LAUNCH_CHECK("swiglu_forward");
  return {};
}

template <typename T>
Status swiglu_backward(const T* gate, const T* up, const T* dout, int64_t n, T* dgate, T* dup, cudaStream_t s) {
  if (n <= 0) return {};
  swiglu_backward_kernel<T><<<stride_grid<kThreads>(n), kThreads, 0, s>>>(gate, up, dout, n, dgate, dup);
  MT_CUDA_LAUNCH_CHECK("swiglu_backward");
  return {};
}

#define MT_INSTANTIATE(T)                                                                    \
  template Status swiglu_forward<T>(const T*, const T*, int64_t, T*, cudaStream_t); \
  template Status swiglu_backward<T>(const T*, const T*, const T*, int64_t, T*, T*, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace megatrain::cuda

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
//
// gpt-oss's clamped SwiGLU (the CPU op's clamped_swiglu_*), gate and up interleaved in the
// columns of gate_up [n, 2]: g = min(g, limit), u = clamp(u, -limit, limit) (limit > 0; no clamp
// at 0), out = (u + 1) * g * sigmoid(alpha g); the backward passes no gradient to a clamped input.
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

// gpt-oss: gate and up interleaved in gu [n, 2] (element i's gate at 2i, up at 2i+1).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    clamped_swiglu_forward_kernel(const T* __restrict__ gu, int64_t n, float alpha, float limit, T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float g = to_f(gu[2 * i]);
    float u = to_f(gu[2 * i + 1]);
    if (limit > 0.0f) {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
    }
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(g, alpha))));
    out[i] = from_f<T>(__fmul_rn(__fadd_rn(u, 1.0f), __fmul_rn(g, sig)));
  }
}

// dgu may alias gu (each pair is read, then written, by one thread).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    clamped_swiglu_backward_kernel(const T* gu, const T* dout, int64_t n, float alpha, float limit, T* dgu) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float graw = to_f(gu[2 * i]);
    const float uraw = to_f(gu[2 * i + 1]);
    const float d = to_f(dout[i]);
    const bool clamp = limit > 0.0f;
    const bool pass_g = !clamp || graw <= limit;
    const bool pass_u = !clamp || (uraw >= -limit && uraw <= limit);
    const float g = pass_g ? graw : limit;
    const float u = clamp ? fminf(fmaxf(uraw, -limit), limit) : uraw;
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(g, alpha))));
    // d (u + 1) (sig + g alpha sig (1 - sig)), left to right as the CPU op
    const float dsig = __fadd_rn(sig, __fmul_rn(__fmul_rn(__fmul_rn(g, alpha), sig), __fsub_rn(1.0f, sig)));
    dgu[2 * i] = from_f<T>(pass_g ? __fmul_rn(__fmul_rn(d, __fadd_rn(u, 1.0f)), dsig) : 0.0f);
    dgu[2 * i + 1] = from_f<T>(pass_u ? __fmul_rn(d, __fmul_rn(g, sig)) : 0.0f);
  }
}

}  // namespace

template <typename T>
Status clamped_swiglu_forward(const T* gu, int64_t n, float alpha, float limit, T* out, cudaStream_t s) {
  if (n <= 0) return {};
  clamped_swiglu_forward_kernel<T><<<stride_grid<kThreads>(n), kThreads, 0, s>>>(gu, n, alpha, limit, out);
  MT_CUDA_LAUNCH_CHECK("clamped_swiglu_forward");
  return {};
}

template <typename T>
Status clamped_swiglu_backward(const T* gu, const T* dout, int64_t n, float alpha, float limit, T* dgu, cudaStream_t s) {
  if (n <= 0) return {};
  clamped_swiglu_backward_kernel<T><<<stride_grid<kThreads>(n), kThreads, 0, s>>>(gu, dout, n, alpha, limit, dgu);
  MT_CUDA_LAUNCH_CHECK("clamped_swiglu_backward");
  return {};
}

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
  template Status swiglu_backward<T>(const T*, const T*, const T*, int64_t, T*, T*, cudaStream_t); \
  template Status clamped_swiglu_forward<T>(const T*, int64_t, float, float, T*, cudaStream_t);   \
  template Status clamped_swiglu_backward<T>(const T*, const T*, int64_t, float, float, T*, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace megatrain::cuda

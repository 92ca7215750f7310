// RMSNorm (HF LlamaRMSNorm) forward and backward on the GPU.
//
// forward: one block of kThreads (256) threads per row; the grid loops over rows (blockIdx.x,
//   blockIdx.x + gridDim.x, ...), so any n works with a capped grid. Thread t sums x[i]^2 for
//   i = t, t + 256, ... in that order (fp32), then the block reduces the 256 partials in a fixed
//   tree: a warp-shuffle tree inside each warp (offsets 16, 8, 4, 2, 1), the 8 warp sums through
//   shared memory, and the same shuffle tree in warp 0. The order depends only on dim, never on
//   timing, so results are bit-reproducible. rstd = 1 / sqrtf(sum / dim + eps) (IEEE division and
//   square root, as the CPU op), y[i] = T(w[i] * (x[i] * rstd)) (HF's order: normalise, then scale).
//
// backward: dw first (dx may alias dy, and the dx kernel overwrites dy's rows).
//   dw: dw[j] += sum over r of dy[r,j] * (x[r,j] * rstd[r]), as a two-stage column sum in a fixed
//       order (column_sum.cuh): chunks of rows summed in order, then the chunks' partials added to
//       dw[j] in order. Not the CPU op's order (rows one by one into dw[j]), which on one thread
//       per column took tens of milliseconds for Qwen3's per-head norms (a million rows).
//   dx: one block per row as in forward; c = (1/dim) sum_i (dy[i] * w[i]) * x[i] with the same
//       fixed-order block reduction; then each thread rewrites its own elements
//       dx[i] = rstd * (g[i] - x[i] * (rstd * rstd * c)). Every element of dy is read only by the
//       thread that later writes the same element of dx, and the reduction (with its barriers)
//       completes before any write, so dx == dy is safe.
// Products and sums that the CPU op rounds separately use __fmul_rn / __fadd_rn / __fsub_rn so
// nvcc does not contract them into FMAs; only the row reductions' order differs from the CPU op
// (16 interleaved lanes there, 256 strided threads + a tree here).
#include "cuda/rmsnorm.cuh"

#include "cuda/column_sum.cuh"
#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(const float* x, const T* w, int64_t n, int64_t dim, float eps, T* y, float* rstd) {
  __shared__ float smem[kWarps + 1];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * dim;
    T* yr = y + r * dim;
    float acc = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      const float v = xr[i];
      acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
    const float ss = block_reduce<kThreads>(acc, 0.0f, SumOp{}, smem);
    const float ms = ss / static_cast<float>(dim);
    const float rs = 1.0f / sqrtf(ms + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) yr[i] = from_f<T>(__fmul_rn(to_f(w[i]), __fmul_rn(xr[i], rs)));
  }
}

// One term of dw[j]: dy[r,j] * (x[r,j] * rstd[r]).
struct NormWeightTerm {
  const float* dy;
  const float* x;
  const float* rstd;
  int64_t dim;
  __device__ float operator()(int64_t r, int64_t j) const {
    const int64_t k = r * dim + j;
    return __fmul_rn(dy[k], __fmul_rn(x[k], rstd[r]));
  }
};

// dx may alias dy (no __restrict__): see the file comment.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_dx_kernel(const float* dy, const float* x, const T* w, const float* rstd, int64_t n, int64_t dim, float* dx) {
  __shared__ float smem[kWarps + 1];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    float acc = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      const float g = __fmul_rn(dyr[i], to_f(w[i]));
      acc = __fadd_rn(acc, __fmul_rn(g, xr[i]));
    }
    const float c = block_reduce<kThreads>(acc, 0.0f, SumOp{}, smem) / static_cast<float>(dim);
    const float rs = rstd[r];
    const float k = __fmul_rn(__fmul_rn(rs, rs), c);
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      const float g = __fmul_rn(dyr[i], to_f(w[i]));
      dxr[i] = __fmul_rn(rs, __fsub_rn(g, __fmul_rn(xr[i], k)));
    }
  }
}

}  // namespace

template <typename T>
Status rmsnorm_forward(const float* x, const T* w, int64_t n, int64_t dim, float eps, T* y, float* rstd, cudaStream_t s) {
  if (n <= 0 || dim <= 0) return {};
  rmsnorm_forward_kernel<T><<<row_grid(n), kThreads, 0, s>>>(x, w, n, dim, eps, y, rstd);
  MT_CUDA_LAUNCH_CHECK("rmsnorm_forward");
  return {};
}

template <typename T>
Status rmsnorm_backward(const float* dy, const float* x, const T* w, const float* rstd, int64_t n, int64_t dim, float* dx,
                        float* dw, void* scratch, cudaStream_t s) {
  if (n <= 0 || dim <= 0) return {};
  // dw first: the dx kernel may overwrite dy (dx == dy).
  if (dw) MT_RETURN_IF_ERROR(detail::column_sum_two_stage<float>(NormWeightTerm{dy, x, rstd, dim}, n, dim, dw, scratch, s,
                                                                  "rmsnorm_backward (dw)"));
  if (dx) {
    rmsnorm_dx_kernel<T><<<row_grid(n), kThreads, 0, s>>>(dy, x, w, rstd, n, dim, dx);
    MT_CUDA_LAUNCH_CHECK("rmsnorm_backward (dx)");
  }
  return {};
}

#define MT_INSTANTIATE(T)                                                                                          \
  template Status rmsnorm_forward<T>(const float*, const T*, int64_t, int64_t, float, T*, float*, cudaStream_t); \
  template Status rmsnorm_backward<T>(const float*, const float*, const T*, const float*, int64_t, int64_t, float*, \
                                      float*, void*, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace megatrain::cuda

// The Mixture-of-Experts ops on the GPU (moe.cuh), written to follow kernels/cpu/moe.cpp
// operation for operation, so that the fp32 path differs from the CPU reference only where a
// library function (expf) or a reduction tree differs:
//
// The per-token routing and the sort's per-chunk steps are moe_math.h's host-and-device functions,
// which the host-side tests also run, grid-emulated, against the CPU ops.
//
// - route_forward / route_backward: one thread per token, the experts in index order, exactly the
//   CPU op's sequence of fp32 operations (__fadd_rn / __fmul_rn / __fdiv_rn: nothing contracted
//   into an FMA). The top-k is the CPU's repeated selection (the largest remaining probability,
//   the lower index on a tie), so both choose the same experts from the same probabilities.
//   Routing is O(n e k) work on n threads: small next to the GEMMs that follow.
// - permute: a stable counting sort in three kernels over chunks of kChunk slots. (1) Each chunk's
//   block counts its slots per expert into counts[chunk][expert] (loops over the chunk in shared
//   memory; no atomics). (2) One block turns the counts into each expert's total, the exclusive
//   scan over experts (offsets), and each (chunk, expert) pair's first sorted row
//   (offsets[x] + the counts of expert x in earlier chunks). (3) Each slot's row is its pair's
//   first row plus the number of earlier slots of its chunk with the same expert. The order is
//   by expert, then by slot index, as cpu::moe_permute's; integers only, so bit-equal.
// - gather, scatter_add, combine_forward: element-wise grid-stride loops; a token's k terms are
//   added in j order (as the CPU op).
// - combine_backward: one block per slot; the dot product dout . yp is a fixed-order block
//   reduction (block_reduce), so it is reproducible but not in the CPU's sequential order.
// - aux_stats: one thread per expert adds the expert's row count (offsets[x+1] - offsets[x], an
//   integer, equal to adding 1.0 per slot: the CPU op's count exactly); the probabilities are a
//   two-stage column sum in double over the tokens in a fixed order (column_sum.cuh), onto the value
//   uploaded from the host: deterministic, and within double rounding of the CPU op's sequential sum.
#include "cuda/moe.cuh"

#include <string>

#include "cuda/column_sum.cuh"
#include "cuda/device_util.cuh"
#include "cuda/moe_math.h"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = moe_math::kChunk;  // slots per block of the counting sort (== its block size)
constexpr int kScanThreads = 256;

// ---- routing --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) route_forward_kernel(const float* logits, int64_t n, int e, int k, bool renorm,
                                                                 int32_t* expert, float* weight, float* probs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < n; t += stride)
    moe_math::route_forward_token(logits + t * e, e, k, renorm, expert + t * k, weight + t * k, probs + t * e);
}

__global__ void __launch_bounds__(kThreads)
    route_backward_kernel(const float* probs, const int32_t* expert, const float* weight, const float* d_weight,
                          const float* d_probs_const, int64_t n, int e, int k, bool renorm, float* dlogits) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < n; t += stride)
    moe_math::route_backward_token(probs + t * e, expert + t * k, weight + t * k, d_weight + t * k, d_probs_const, e, k, renorm,
                                   dlogits + t * e);
}

// ---- the stable counting sort ---------------------------------------------------------------

__global__ void __launch_bounds__(kChunk) permute_count_kernel(const int32_t* expert, int64_t slots, int e, int32_t* counts) {
  __shared__ int32_t ex[kChunk];
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int i = threadIdx.x;
  ex[i] = s0 + i < slots ? expert[s0 + i] : -1;
  __syncthreads();
  for (int x = i; x < e; x += kChunk) counts[static_cast<int64_t>(blockIdx.x) * e + x] = moe_math::chunk_count(ex, x);
}

// One block: counts[chunk][x] becomes the first sorted row of chunk's slots with expert x.
__global__ void __launch_bounds__(kScanThreads) permute_scan_kernel(int32_t* counts, int64_t chunks, int e, int64_t slots,
                                                                    int32_t* offsets) {
  extern __shared__ int32_t first[];  // e entries: each expert's total, then its first row
  for (int x = threadIdx.x; x < e; x += kScanThreads) first[x] = moe_math::expert_total(counts, chunks, e, x);
  __syncthreads();
  if (threadIdx.x == 0) moe_math::scan_totals(first, e, slots, offsets);
  __syncthreads();
  for (int x = threadIdx.x; x < e; x += kScanThreads) moe_math::first_rows(counts, chunks, e, x, first[x]);
}

__global__ void __launch_bounds__(kChunk) permute_place_kernel(const int32_t* expert, int64_t slots, int e,
                                                               const int32_t* first, int32_t* perm, int32_t* row_of_slot) {
  __shared__ int32_t ex[kChunk];
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int i = threadIdx.x;
  ex[i] = s0 + i < slots ? expert[s0 + i] : -1;
  __syncthreads();
  if (s0 + i >= slots) return;
  const int32_t row = first[static_cast<int64_t>(blockIdx.x) * e + ex[i]] + moe_math::rank_in_chunk(ex, i);
  perm[row] = static_cast<int32_t>(s0 + i);
  row_of_slot[s0 + i] = row;
}

// ---- data movement and combine --------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const T* x, const int32_t* perm, int64_t rows, int k, int64_t h, T* xp) {
  const int64_t n = rows * h, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / h, c = i - r * h;
    xp[i] = x[static_cast<int64_t>(perm[r] / k) * h + c];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) combine_forward_kernel(const T* yp, const float* weight, const int32_t* row_of_slot,
                                                                   const float* residual, int64_t n, int k, int64_t h,
                                                                   float* out) {
  const int64_t total = n * h, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / h, c = i - t * h;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      acc = __fadd_rn(acc, __fmul_rn(weight[s], to_f(yp[static_cast<int64_t>(row_of_slot[s]) * h + c])));
    }
    out[i] = __fadd_rn(residual[i], acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) combine_backward_kernel(const T* yp, const float* weight, const int32_t* row_of_slot,
                                                                    const float* dout, int64_t slots, int k, int64_t h, T* dyp,
                                                                    float* d_weight) {
  __shared__ float smem[kThreads / 32 + 1];
  for (int64_t s = blockIdx.x; s < slots; s += gridDim.x) {
    const int64_t t = s / k, r = row_of_slot[s];
    const float* d = dout + t * h;
    const T* y = yp + r * h;
    T* dy = dyp + r * h;
    const float ws = weight[s];
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < h; c += kThreads) {
      const float dc = d[c];
      dy[c] = from_f<T>(__fmul_rn(ws, dc));
      acc = __fadd_rn(acc, __fmul_rn(dc, to_f(y[c])));
    }
    const float dot = block_reduce<kThreads>(acc, 0.0f, SumOp{}, smem);
    if (threadIdx.x == 0) d_weight[s] = dot;
  }
}

__global__ void __launch_bounds__(kThreads)
    scatter_add_kernel(const float* dxp, const int32_t* row_of_slot, int64_t n, int k, int64_t h, float* dx) {
  const int64_t total = n * h, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / h, c = i - t * h;
    float acc = dxp[static_cast<int64_t>(row_of_slot[t * k]) * h + c];
    for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, dxp[static_cast<int64_t>(row_of_slot[t * k + j]) * h + c]);
    dx[i] = acc;
  }
}

__global__ void __launch_bounds__(kThreads) aux_count_kernel(const int32_t* offsets, int e, double* count) {
  const int x = static_cast<int>(blockIdx.x) * kThreads + threadIdx.x;
  if (x >= e) return;
  count[x] = __dadd_rn(count[x], static_cast<double>(offsets[x + 1] - offsets[x]));
}

struct ProbabilityOf {
  const float* probs;
  int64_t e;
  __device__ double operator()(int64_t t, int64_t x) const { return static_cast<double>(probs[t * e + x]); }
};

Status check_route(const char* what, int64_t n, int64_t e, int64_t k) {
  if (n < 0 || e < 1 || k < 1 || k > e || e > kMoeMaxExperts)
    return invalid_argument(std::string(what) + ": tokens " + std::to_string(n) + ", experts " + std::to_string(e) + ", k " +
                            std::to_string(k) + ": accepted 1 <= k <= experts <= " + std::to_string(kMoeMaxExperts));
  return {};
}

}  // namespace

Status moe_route_forward(const float* logits, int64_t n, int64_t e, int64_t k, bool renorm, int32_t* expert, float* weight,
                         float* probs, cudaStream_t s) {
  MT_RETURN_IF_ERROR(check_route("moe_route_forward", n, e, k));
  if (n == 0) return {};
  route_forward_kernel<<<stride_grid<kThreads>(n), kThreads, 0, s>>>(logits, n, static_cast<int>(e), static_cast<int>(k),
                                                                     renorm, expert, weight, probs);
  MT_CUDA_LAUNCH_CHECK("moe_route_forward");
  return {};
}

Status moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* d_weight,
                          const float* d_probs_const, int64_t n, int64_t e, int64_t k, bool renorm, float* dlogits,
                          cudaStream_t s) {
  MT_RETURN_IF_ERROR(check_route("moe_route_backward", n, e, k));
  if (n == 0) return {};
  route_backward_kernel<<<stride_grid<kThreads>(n), kThreads, 0, s>>>(probs, expert, weight, d_weight, d_probs_const, n,
                                                                      static_cast<int>(e), static_cast<int>(k), renorm, dlogits);
  MT_CUDA_LAUNCH_CHECK("moe_route_backward");
  return {};
}


Status moe_permute(const int32_t* expert, int64_t slots, int64_t e, int32_t* offsets, int32_t* perm, int32_t* row_of_slot,
                   int32_t* scratch, cudaStream_t s) {
  if (slots < 0 || slots > 2147483647 || e < 1 || e > kMoeMaxExperts)
    return invalid_argument("moe_permute: slots " + std::to_string(slots) + ", experts " + std::to_string(e) +
                            ": accepted slots in [0, 2^31) and 1 <= experts <= " + std::to_string(kMoeMaxExperts));
  const int64_t chunks = (slots + kChunk - 1) / kChunk;
  if (chunks > 0) {
    permute_count_kernel<<<static_cast<unsigned int>(chunks), kChunk, 0, s>>>(expert, slots, static_cast<int>(e), scratch);
    MT_CUDA_LAUNCH_CHECK("moe_permute (count)");
  }
  permute_scan_kernel<<<1, kScanThreads, sizeof(int32_t) * static_cast<size_t>(e), s>>>(scratch, chunks, static_cast<int>(e),
                                                                                        slots, offsets);
  MT_CUDA_LAUNCH_CHECK("moe_permute (scan)");
  if (chunks > 0) {
    permute_place_kernel<<<static_cast<unsigned int>(chunks), kChunk, 0, s>>>(expert, slots, static_cast<int>(e), scratch, perm,
                                                                             row_of_slot);
    MT_CUDA_LAUNCH_CHECK("moe_permute (place)");
  }
  return {};
}

template <typename T>
Status moe_gather(const T* x, const int32_t* perm, int64_t rows, int64_t k, int64_t h, T* xp, cudaStream_t s) {
  if (rows <= 0 || h <= 0) return {};
  gather_kernel<T><<<stride_grid<kThreads>(rows * h), kThreads, 0, s>>>(x, perm, rows, static_cast<int>(k), h, xp);
  MT_CUDA_LAUNCH_CHECK("moe_gather");
  return {};
}

template <typename T>
Status moe_combine_forward(const T* yp, const float* weight, const int32_t* row_of_slot, const float* residual, int64_t n,
                           int64_t k, int64_t h, float* out, cudaStream_t s) {
  if (n <= 0 || h <= 0) return {};
  combine_forward_kernel<T><<<stride_grid<kThreads>(n * h), kThreads, 0, s>>>(yp, weight, row_of_slot, residual, n,
                                                                              static_cast<int>(k), h, out);
  MT_CUDA_LAUNCH_CHECK("moe_combine_forward");
  return {};
}

template <typename T>
Status moe_combine_backward(const T* yp, const float* weight, const int32_t* row_of_slot, const float* dout, int64_t n,
                            int64_t k, int64_t h, T* dyp, float* d_weight, cudaStream_t s) {
  if (n <= 0 || h <= 0) return {};
  combine_backward_kernel<T><<<row_grid(n * k), kThreads, 0, s>>>(yp, weight, row_of_slot, dout, n * k, static_cast<int>(k), h,
                                                                  dyp, d_weight);
  MT_CUDA_LAUNCH_CHECK("moe_combine_backward");
  return {};
}

Status moe_scatter_add(const float* dxp, const int32_t* row_of_slot, int64_t n, int64_t k, int64_t h, float* dx,
                       cudaStream_t s) {
  if (n <= 0 || h <= 0) return {};
  scatter_add_kernel<<<stride_grid<kThreads>(n * h), kThreads, 0, s>>>(dxp, row_of_slot, n, static_cast<int>(k), h, dx);
  MT_CUDA_LAUNCH_CHECK("moe_scatter_add");
  return {};
}

Status moe_aux_stats(const float* probs, const int32_t* offsets, int64_t n, int64_t e, double* count, double* prob_sum,
                     void* scratch, cudaStream_t s) {
  if (e < 1) return {};
  aux_count_kernel<<<static_cast<unsigned int>((e + kThreads - 1) / kThreads), kThreads, 0, s>>>(offsets, static_cast<int>(e),
                                                                                                 count);
  MT_CUDA_LAUNCH_CHECK("moe_aux_stats (counts)");
  return detail::column_sum_two_stage<double>(ProbabilityOf{probs, e}, n, e, prob_sum, scratch, s, "moe_aux_stats (probabilities)");
}

#define MT_INSTANTIATE(T)                                                                                                \
  template Status moe_gather<T>(const T*, const int32_t*, int64_t, int64_t, int64_t, T*, cudaStream_t);                  \
  template Status moe_combine_forward<T>(const T*, const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, \
                                         float*, cudaStream_t);                                                          \
  template Status moe_combine_backward<T>(const T*, const float*, const int32_t*, const float*, int64_t, int64_t,        \
                                          int64_t, T*, float*, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

namespace {

// Expert g (blockIdx.y) owns sorted rows [offsets[g], offsets[g+1]); each thread one column,
// its rows in order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    expert_bias_fill_kernel(T* y, const T* bias, int64_t b_stride, const int32_t* offsets, int64_t cols) {
  const int64_t g = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const T b = bias[g * b_stride + c];
  for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) y[r * cols + c] = b;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    expert_bias_grad_kernel(const T* dy, const int32_t* offsets, int64_t cols, float* db, int64_t db_stride) {
  const int64_t g = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols || offsets[g + 1] == offsets[g]) return;  // an expert with no rows is not touched
  float acc = 0.0f;
  for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) acc = __fadd_rn(acc, to_f(dy[r * cols + c]));
  db[g * db_stride + c] = __fadd_rn(db[g * db_stride + c], acc);
}

}  // namespace

template <typename T>
Status moe_expert_bias_fill(T* y, const T* bias, int64_t b_stride, const int32_t* offsets, int64_t e, int64_t cols,
                            cudaStream_t s) {
  if (e <= 0 || cols <= 0) return {};
  const dim3 grid(static_cast<unsigned int>((cols + kThreads - 1) / kThreads), static_cast<unsigned int>(e));
  expert_bias_fill_kernel<T><<<grid, kThreads, 0, s>>>(y, bias, b_stride, offsets, cols);
  MT_CUDA_LAUNCH_CHECK("moe_expert_bias_fill");
  return {};
}

template <typename T>
Status moe_expert_bias_grad(const T* dy, const int32_t* offsets, int64_t e, int64_t cols, float* db, int64_t db_stride,
                            cudaStream_t s) {
  if (e <= 0 || cols <= 0) return {};
  const dim3 grid(static_cast<unsigned int>((cols + kThreads - 1) / kThreads), static_cast<unsigned int>(e));
  expert_bias_grad_kernel<T><<<grid, kThreads, 0, s>>>(dy, offsets, cols, db, db_stride);
  MT_CUDA_LAUNCH_CHECK("moe_expert_bias_grad");
  return {};
}

#define MT_INSTANTIATE_BIAS(T)                                                                                  \
  template Status moe_expert_bias_fill<T>(T*, const T*, int64_t, const int32_t*, int64_t, int64_t, cudaStream_t); \
  template Status moe_expert_bias_grad<T>(const T*, const int32_t*, int64_t, int64_t, float*, int64_t, cudaStream_t);
MT_INSTANTIATE_BIAS(float)
MT_INSTANTIATE_BIAS(bf16)
#undef MT_INSTANTIATE_BIAS

}  // namespace megatrain::cuda

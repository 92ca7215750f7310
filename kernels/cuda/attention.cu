// Causal GQA attention, memory-efficient by blocks of query rows, with the GEMMs on cuBLAS.
//
// Algorithm. For each sequence b and each block of R query rows [r0, r0 + rows), only the keys
// [k0, r0 + rows) can be seen (causal; k0 = 0, or the first key of the block's first query's
// sliding window, or of its document in a row packed "neat"), so the block's scores are an
// [n_heads, rows, r0 + rows - k0] tensor: at most
// n_heads x R x seq, never seq x seq. R is chosen from the workspace budget.
// Sinks (gpt-oss): a per-head logit in every row's softmax denominator with no value, so lse
// includes it; P = exp(S - lse) then leaves it out, and d sink_h = -sum_rows exp(sink_h - lse) D.
//
//   forward   S_h   = scale * Q_h K_g^T                  (cuBLAS, one call for every head: the
//                                                         query heads h = g * rep + r as a two-level
//                                                         batch, gemm2 below)
//             P_h   = softmax over the visible keys j <= r0 + i, and lse = max + log(sum)
//                                                        (softmax_rows: one block per row)
//             O_h   = P_h V_g                            (cuBLAS, one call, written into out in place)
//   backward  Drow  = rowsum(dO * O)                     (one warp per row, for all rows first)
//             per block: S again, P = exp(S - lse) (the saved log-sum-exp: no second softmax)
//             dP_h  = dO_h V_g^T
//             dV_g += P_h^T dO_h                         (heads r = 0..rep-1 in order: fixed)
//             dS_h  = P_h * (dP_h - Drow) * scale
//             dQ_h  = dS_h K_g;   dK_g += dS_h^T Q_h
// This is FlashAttention's arithmetic (the saved lse, D = rowsum(dO * O)) with the tiles made by
// cuBLAS at the size of a row block rather than in shared memory. P and dS are in T (bf16 on the
// mixed-precision path, as FlashAttention keeps them); S, dP, lse and D are fp32.
// Deterministic: each output is written by GEMMs issued in a fixed order, and the reductions in
// softmax_rows and row_dot have a fixed tree. The schedule itself (which GEMM on which sub-matrix)
// is attention_schedule.h, shared with a host emulation that tests it without a GPU; this file
// holds its GPU operations: the kernels and cuBLAS.
#include "cuda/attention.cuh"

#include <algorithm>
#include <cmath>

#include "cuda/device_util.cuh"
#include "cuda/workspace_sizes.h"
#include "cuda/gemm.cuh"

namespace megatrain::cuda {

namespace {

constexpr int kThreads = 256;

// One block per score row (h, i): S [n_heads, rows, keys] fp32 -> P in T, and lse. Column c is key
// k0 + c; query t = r0 + i sees keys (t - window, t] (all of [0, t] without a window). A sink
// logit (gpt-oss) joins the max and the denominator as a column with no value. starts (the row's
// document starts, or null) hides the keys before the query's document.
template <typename T>
__global__ void softmax_rows(const float* __restrict__ s, T* __restrict__ p, float* __restrict__ lse, int64_t rows,
                             int64_t keys, int64_t r0, int64_t k0, int64_t window, int64_t seq, int64_t lse_base,
                             const T* __restrict__ sinks, const int32_t* __restrict__ starts) {
  __shared__ float red[kThreads / 32 + 1];  // softmax_rows runs in blocks of kThreads
  const int64_t row = blockIdx.x;  // h * rows + i
  const int64_t h = row / rows, i = row % rows, t = r0 + i;
  // The visible columns [c0, c1): keys max(k0, t - window + 1, its document's start) .. t.
  int64_t c0 = window > 0 ? max(t - window + 1, k0) - k0 : 0;
  if (starts != nullptr) c0 = max(c0, static_cast<int64_t>(starts[t]) - k0);
  const int64_t c1 = t + 1 - k0;
  const float* sr = s + row * keys;
  T* pr = p + row * keys;
  const float sink = sinks != nullptr ? to_f(sinks[h]) : -INFINITY;
  float m = -INFINITY;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) m = fmaxf(m, sr[c]);
  m = fmaxf(block_reduce<kThreads>(m, -INFINITY, MaxOp{}, red), sink);
  float sum = 0.0f;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) sum += expf(sr[c] - m);
  sum = block_reduce<kThreads>(sum, 0.0f, SumOp{}, red);
  if (sinks != nullptr) sum += expf(sink - m);
  const float inv = 1.0f / sum;
  for (int64_t c = threadIdx.x; c < keys; c += blockDim.x) pr[c] = from_f<T>(c >= c0 && c < c1 ? expf(sr[c] - m) * inv : 0.0f);
  if (threadIdx.x == 0) lse[lse_base + h * seq + t] = m + logf(sum);
}

// P = exp(S - lse) on the visible keys (softmax_rows' rule), 0 elsewhere.
template <typename T>
__global__ void probs_from_lse(const float* __restrict__ s, const float* __restrict__ lse, T* __restrict__ p,
                               int64_t n_heads, int64_t rows, int64_t keys, int64_t r0, int64_t k0, int64_t window, int64_t seq,
                               int64_t lse_base, const int32_t* __restrict__ starts) {
  const int64_t total = n_heads * rows * keys;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = k0 + e % keys, i = (e / keys) % rows, h = e / (rows * keys), t = r0 + i;
    const float l = lse[lse_base + h * seq + t];
    p[e] = from_f<T>(attention_visible(t, j, window, starts != nullptr ? starts[t] : 0) ? expf(s[e] - l) : 0.0f);
  }
}

// d_sinks[h] += sum over (b, t) of -exp(sink_h - lse) * D: one block per head, each thread a fixed
// stride of rows in order, then a fixed tree (deterministic, no atomics).
template <typename T>
__global__ void sink_grad(const T* __restrict__ sinks, const float* __restrict__ lse, const float* __restrict__ drow,
                          int64_t batch, int64_t n_heads, int64_t seq, float* __restrict__ d_sinks) {
  __shared__ float red[kThreads / 32 + 1];
  const int64_t h = blockIdx.x;
  const float sink = to_f(sinks[h]);
  float acc = 0.0f;
  for (int64_t r = threadIdx.x; r < batch * seq; r += blockDim.x) {
    const int64_t b = r / seq, t = r % seq, at = (b * n_heads + h) * seq + t;
    acc += -expf(sink - lse[at]) * drow[at];
  }
  acc = block_reduce<kThreads>(acc, 0.0f, SumOp{}, red);
  if (threadIdx.x == 0) d_sinks[h] += acc;
}

// dS = P * (dP - D) * scale, in place over P.
template <typename T>
__global__ void scores_grad(T* __restrict__ p_ds, const float* __restrict__ dp, const float* __restrict__ drow,
                            int64_t n_heads, int64_t rows, int64_t keys, int64_t r0, int64_t seq, int64_t d_base,
                            float scale) {
  const int64_t total = n_heads * rows * keys;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = (e / keys) % rows, h = e / (rows * keys);
    const float pv = to_f(p_ds[e]);
    p_ds[e] = from_f<T>(pv * (dp[e] - drow[d_base + h * seq + r0 + i]) * scale);
  }
}

// D[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d]: one warp per (b, t, h) row, fixed lane order.
template <typename T>
__global__ void row_dot(const T* __restrict__ dout, const T* __restrict__ out, float* __restrict__ d, int64_t batch,
                        int64_t seq, int64_t n_heads, int64_t head_dim) {
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t row = blockIdx.x * warps_per_block + threadIdx.x / 32;  // (b * seq + t) * n_heads + h
  const int lane = threadIdx.x % 32;
  if (row >= batch * seq * n_heads) return;
  const T* a = dout + row * head_dim;
  const T* o = out + row * head_dim;
  float acc = 0.0f;
  for (int64_t k = lane; k < head_dim; k += 32) acc += to_f(a[k]) * to_f(o[k]);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const int64_t h = row % n_heads, bt = row / n_heads, t = bt % seq, b = bt / seq;
    d[(b * n_heads + h) * seq + t] = acc;
  }
}

unsigned int grid_for(int64_t n) { return stride_grid<kThreads>(n, 65535 * 8); }

constexpr int64_t kAlign = 256;
int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// The schedule's operations on the GPU: cuBLAS and the kernels above, on one stream.
template <typename T>
struct GpuOps {
  cublasHandle_t h;
  cudaStream_t s;
  void** pointers;  // gemm2's pointer arrays (3 x n_heads), in the workspace
  template <typename A, typename C>
  Status gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const A* a, int64_t lda, int64_t sa, const A* b,
              int64_t ldb, int64_t sb, float beta, C* c, int64_t ldc, int64_t sc, int64_t batch) {
    return gemm_strided_batched<A, C>(h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch);
  }
  // The (kv group, head in group) grid: one pointer-array call when every matrix of it is 16-byte
  // aligned (always without a sliding window when seq and the head size are multiples of 8: see
  // attention_block_rows), else one strided-batched call over the groups per head in the group.
  template <typename A, typename C>
  Status gemm2(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const A* a, int64_t lda, Stride2 sa, const A* b,
               int64_t ldb, Stride2 sb, C* c, int64_t ldc, Stride2 sc, int64_t n_outer, int64_t n_inner) {
    if (n_inner == 1) return gemm<A, C>(ta, tb, m, n, k, alpha, a, lda, sa.outer, b, ldb, sb.outer, 0.0f, c, ldc, sc.outer, n_outer);
    if (batched_operand_aligned(a, lda, sizeof(A), sa.outer, sa.inner) && batched_operand_aligned(b, ldb, sizeof(A), sb.outer, sb.inner) &&
        batched_operand_aligned(c, ldc, sizeof(C), sc.outer, sc.inner))
      return gemm_batched_2d<A, C>(h, s, ta, tb, m, n, k, alpha, a, lda, sa.outer, sa.inner, b, ldb, sb.outer, sb.inner, 0.0f, c, ldc,
                                   sc.outer, sc.inner, n_outer, n_inner, pointers);
    for (int64_t i = 0; i < n_inner; ++i)
      MT_RETURN_IF_ERROR((gemm<A, C>(ta, tb, m, n, k, alpha, a + i * sa.inner, lda, sa.outer, b + i * sb.inner, ldb, sb.outer, 0.0f,
                                     c + i * sc.inner, ldc, sc.outer, n_outer)));
    return {};
  }
  Status softmax_rows(const float* sc, T* p, float* lse, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0, int64_t k0,
                      int64_t window, int64_t seq, int64_t lse_base, const T* sinks, const int32_t* starts) {
    cuda::softmax_rows<T><<<static_cast<unsigned>(n_heads * rows), kThreads, 0, s>>>(sc, p, lse, rows, keys, r0, k0, window, seq,
                                                                                     lse_base, sinks, starts);
    MT_CUDA_LAUNCH_CHECK("attention softmax_rows");
    return {};
  }
  Status probs_from_lse(const float* sc, const float* lse, T* p, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0,
                        int64_t k0, int64_t window, int64_t seq, int64_t lse_base, const int32_t* starts) {
    cuda::probs_from_lse<T><<<grid_for(n_heads * rows * keys), kThreads, 0, s>>>(sc, lse, p, n_heads, rows, keys, r0, k0, window,
                                                                                   seq, lse_base, starts);
    MT_CUDA_LAUNCH_CHECK("attention probs_from_lse");
    return {};
  }
  Status sink_grad(const T* sinks, const float* lse, const float* drow, int64_t batch, int64_t n_heads, int64_t seq,
                   float* d_sinks) {
    cuda::sink_grad<T><<<static_cast<unsigned>(n_heads), kThreads, 0, s>>>(sinks, lse, drow, batch, n_heads, seq, d_sinks);
    MT_CUDA_LAUNCH_CHECK("attention sink_grad");
    return {};
  }
  Status scores_grad(T* p_ds, const float* dp, const float* drow, int64_t n_heads, int64_t rows, int64_t keys, int64_t r0,
                     int64_t seq, int64_t d_base, float scale) {
    cuda::scores_grad<T><<<grid_for(n_heads * rows * keys), kThreads, 0, s>>>(p_ds, dp, drow, n_heads, rows, keys, r0, seq,
                                                                                d_base, scale);
    MT_CUDA_LAUNCH_CHECK("attention scores_grad");
    return {};
  }
  Status row_dot(const T* dout, const T* out, float* drow, int64_t batch, int64_t seq, int64_t n_heads, int64_t head_dim) {
    const int64_t n_rows = batch * seq * n_heads, warps = kThreads / 32;
    cuda::row_dot<T><<<static_cast<unsigned>((n_rows + warps - 1) / warps), kThreads, 0, s>>>(dout, out, drow, batch, seq,
                                                                                               n_heads, head_dim);
    MT_CUDA_LAUNCH_CHECK("attention row_dot");
    return {};
  }
  Status zero(float* p, int64_t n) {
    MT_CUDA_RETURN(cudaMemsetAsync(p, 0, sizeof(float) * static_cast<size_t>(n), s));
    return {};
  }
};

struct Regions {
  float* s;
  void* p;
  float* drow;
  void** pointers;
};
// As attention_workspace_bytes lays it out.
Regions carve(const AttnDims& d, int64_t rows, void* workspace) {
  char* base = static_cast<char*>(workspace);
  const int64_t block = d.n_heads * rows * d.seq;
  Regions r;
  r.s = reinterpret_cast<float*>(base);
  r.p = base + align_up(block * 4);
  r.drow = reinterpret_cast<float*>(base + 2 * align_up(block * 4));
  r.pointers = reinterpret_cast<void**>(base + 2 * align_up(block * 4) + align_up(d.batch * d.n_heads * d.seq * 4));
  return r;
}

}  // namespace

template <typename T>
Status attention_forward(cublasHandle_t h, const AttnDims& d, const T* q, const T* k, const T* v, T* out, float* lse,
                         void* workspace, int64_t rows_per_block, cudaStream_t s, const T* sinks) {
  MT_RETURN_IF_ERROR(check_attention(d, rows_per_block));
  const Regions w = carve(d, std::min(rows_per_block, d.seq), workspace);
  GpuOps<T> ops{h, s, w.pointers};
  return attention_forward_schedule<T>(ops, d, q, k, v, out, lse, w.s, static_cast<T*>(w.p), rows_per_block, sinks);
}

template <typename T>
Status attention_backward(cublasHandle_t h, const AttnDims& d, const T* q, const T* k, const T* v, const T* out,
                          const T* dout, const float* lse, float* dq, float* dk, float* dv, void* workspace,
                          int64_t rows_per_block, cudaStream_t s, const T* sinks, float* d_sinks) {
  MT_RETURN_IF_ERROR(check_attention(d, rows_per_block));
  const Regions w = carve(d, std::min(rows_per_block, d.seq), workspace);
  GpuOps<T> ops{h, s, w.pointers};
  return attention_backward_schedule<T>(ops, d, q, k, v, out, dout, lse, dq, dk, dv, w.s, static_cast<T*>(w.p), w.drow,
                                        rows_per_block, sinks, d_sinks);
}

#define MT_INSTANTIATE(T)                                                                                             \
  template Status attention_forward<T>(cublasHandle_t, const AttnDims&, const T*, const T*, const T*, T*, float*, void*,    \
                                       int64_t, cudaStream_t, const T*);                                                    \
  template Status attention_backward<T>(cublasHandle_t, const AttnDims&, const T*, const T*, const T*, const T*, const T*, \
                                        const float*, float*, float*, float*, void*, int64_t, cudaStream_t, const T*,     \
                                        float*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace megatrain::cuda

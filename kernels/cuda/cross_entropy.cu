// Cross-entropy fused with the softmax, chunked over the vocabulary, on the GPU.
//
// chunk_stats: one block of 256 threads per row (the grid loops over rows when n exceeds the
//   capped grid). Thread t scans columns j = t, t + 256, ... of the chunk [r*vc, r*vc + vc):
//   first the chunk max cm (per-thread fmaxf, then a fixed block tree), then
//   cs = sum_j expf(x_j - cm) (per-thread fp32 sums in column order, then the fixed block tree:
//   warp shuffles with offsets 16..1, the 8 warp sums through shared memory, the same tree in warp
//   0). Thread 0 merges the chunk into the row's running (m, s):
//   new_m = max(m, cm); s = s * expf(m - new_m) + cs * expf(cm - new_m); v0 == 0 starts from
//   (m, s, target_logit) = (-inf, 0, 0), and a side that is -inf contributes 0 (no inf - inf).
//   If t = targets[r] is in [v0, v0 + vc), target_logit[r] = x[r, t - v0].
// finish: one block of 1024 threads walks the rows in tiles of 1024: each thread computes its
//   row's lse = m + logf(s) (written for every row) and loss = logf(s) - (x_t - m) (the CPU op's
//   formula -((x_t - m) - log s); 0 for ignored rows) into shared memory; thread 0 then adds the
//   tile's losses in row order into a double (as the CPU op adds row_loss in row order), and
//   __syncthreads_count counts the rows that are not ignored. At the end thread 0 does
//   *loss_sum += sum and *count += count. One thread's sequential sum: deterministic, and with
//   equal per-row losses equal to the CPU op's sum.
// chunk_grad: one block per row (grid loops over rows), threads over the chunk's columns:
//   dx[r, j] = T((expf(x - lse[r]) - [v0 + j == t]) * grad_scale), 0 for ignored rows.
//   Each element is read, then written, by the same thread, so dlogits may alias logits when T is
//   float (logits are fp32; with T = bf16 the buffers have different element sizes and must not
//   overlap).
// expf/logf are the accurate ones (not __expf/__logf). The sums inside a row use 256 strided
// lanes and a tree, where the CPU op uses 16 interleaved lanes: only rounding differs, and the
// online rescaling across chunks rounds once more per chunk.
#include "cuda/cross_entropy.cuh"

#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFinishThreads = 1024;
constexpr int32_t kIgnoreIndex = -1;

__global__ void __launch_bounds__(kThreads)
    ce_chunk_stats_kernel(const float* logits, int64_t n, int64_t vc, int64_t v0, const int32_t* targets,
                          float* run_max, float* run_sum, float* target_logit) {
  __shared__ float smem[kWarps + 1];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* x = logits + r * vc;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < vc; j += kThreads) mx = fmaxf(mx, x[j]);
    const float cm = block_reduce<kThreads>(mx, -INFINITY, MaxOp{}, smem);
    float acc = 0.0f;
    if (cm != -INFINITY) {
      for (int64_t j = threadIdx.x; j < vc; j += kThreads) acc = __fadd_rn(acc, expf(__fsub_rn(x[j], cm)));
    }
    const float cs = block_reduce<kThreads>(acc, 0.0f, SumOp{}, smem);
    if (threadIdx.x == 0) {
      float m = -INFINITY;
      float s = 0.0f;
      float tl = 0.0f;
      if (v0 != 0) {
        m = run_max[r];
        s = run_sum[r];
        tl = target_logit[r];
      }
      const float new_m = fmaxf(m, cm);
      const float old_part = m == -INFINITY ? 0.0f : __fmul_rn(s, expf(__fsub_rn(m, new_m)));
      const float new_part = cm == -INFINITY ? 0.0f : __fmul_rn(cs, expf(__fsub_rn(cm, new_m)));
      const int64_t t = targets[r];
      if (t >= v0 && t < v0 + vc) tl = x[t - v0];
      run_max[r] = new_m;
      run_sum[r] = __fadd_rn(old_part, new_part);
      target_logit[r] = tl;
    }
  }
}

__global__ void __launch_bounds__(kFinishThreads)
    ce_finish_kernel(const float* run_max, const float* run_sum, const float* target_logit, const int32_t* targets,
                     int64_t n, float* lse, double* loss_sum, long long* count) {
  __shared__ float tile[kFinishThreads];
  double acc = 0.0;
  long long cnt = 0;
  for (int64_t base = 0; base < n; base += kFinishThreads) {
    const int64_t r = base + threadIdx.x;
    float loss = 0.0f;
    int active = 0;
    if (r < n) {
      const float m = run_max[r];
      const float log_s = logf(run_sum[r]);
      lse[r] = __fadd_rn(m, log_s);
      if (targets[r] != kIgnoreIndex) {
        loss = __fsub_rn(log_s, __fsub_rn(target_logit[r], m));
        active = 1;
      }
    }
    tile[threadIdx.x] = loss;
    const int tile_count = __syncthreads_count(active);  // also the barrier that publishes the tile
    if (threadIdx.x == 0) {
      const int64_t len = n - base < kFinishThreads ? n - base : kFinishThreads;
      for (int64_t k = 0; k < len; ++k) acc = __dadd_rn(acc, static_cast<double>(tile[k]));
      cnt += tile_count;
    }
    __syncthreads();  // the tile is read before the next one overwrites it
  }
  if (threadIdx.x == 0) {
    *loss_sum = __dadd_rn(*loss_sum, acc);
    *count += cnt;
  }
}

// dlogits may alias logits when T is float: no __restrict__, each element read before written.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    ce_chunk_grad_kernel(const float* logits, int64_t n, int64_t vc, int64_t v0, const int32_t* targets,
                         const float* lse, float grad_scale, T* dlogits) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* x = logits + r * vc;
    T* dx = dlogits + r * vc;
    const int32_t t = targets[r];
    if (t == kIgnoreIndex) {
      for (int64_t j = threadIdx.x; j < vc; j += kThreads) dx[j] = from_f<T>(0.0f);
      continue;
    }
    const float l = lse[r];
    const int64_t tj = static_cast<int64_t>(t) - v0;  // the target's column in this chunk, if any
    for (int64_t j = threadIdx.x; j < vc; j += kThreads) {
      float p = expf(__fsub_rn(x[j], l));
      if (j == tj) p = __fsub_rn(p, 1.0f);
      dx[j] = from_f<T>(__fmul_rn(p, grad_scale));
    }
  }
}

}  // namespace

Status cross_entropy_chunk_stats(const float* logits, int64_t n, int64_t vc, int64_t v0, const int32_t* targets,
                                 float* run_max, float* run_sum, float* target_logit, cudaStream_t s) {
  if (n <= 0 || vc <= 0) return {};
  ce_chunk_stats_kernel<<<row_grid(n), kThreads, 0, s>>>(logits, n, vc, v0, targets, run_max, run_sum, target_logit);
  MT_CUDA_LAUNCH_CHECK("cross_entropy_chunk_stats");
  return {};
}

Status cross_entropy_finish(const float* run_max, const float* run_sum, const float* target_logit,
                            const int32_t* targets, int64_t n, float* lse, double* loss_sum, long long* count,
                            cudaStream_t s) {
  if (n <= 0) return {};
  ce_finish_kernel<<<1, kFinishThreads, 0, s>>>(run_max, run_sum, target_logit, targets, n, lse, loss_sum, count);
  MT_CUDA_LAUNCH_CHECK("cross_entropy_finish");
  return {};
}

template <typename T>
Status cross_entropy_chunk_grad(const float* logits, int64_t n, int64_t vc, int64_t v0, const int32_t* targets,
                                const float* lse, float grad_scale, T* dlogits, cudaStream_t s) {
  if (n <= 0 || vc <= 0) return {};
  ce_chunk_grad_kernel<T><<<row_grid(n), kThreads, 0, s>>>(logits, n, vc, v0, targets, lse, grad_scale, dlogits);
  MT_CUDA_LAUNCH_CHECK("cross_entropy_chunk_grad");
  return {};
}

template Status cross_entropy_chunk_grad<float>(const float*, int64_t, int64_t, int64_t, const int32_t*, const float*,
                                                float, float*, cudaStream_t);
template Status cross_entropy_chunk_grad<bf16>(const float*, int64_t, int64_t, int64_t, const int32_t*, const float*,
                                               float, bf16*, cudaStream_t);

}  // namespace megatrain::cuda

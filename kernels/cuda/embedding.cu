// Token embedding on the GPU: forward gather, backward ordered scatter-add.
//
// forward: one block of 256 threads per position i (grid loops over positions when n exceeds the
//   capped grid); threads stride over the hidden columns: out[i, c] = float(table[tokens[i], c]).
//   A pure copy (bf16 -> fp32 is exact): deterministic.
//
// backward: no atomics. The host groups the positions by token first (build_token_groups: distinct
//   token ids ascending, and for each the positions where it occurs, ascending). One block per
//   distinct token u (grid loops over u when n_unique exceeds the capped grid); threads stride over
//   the hidden columns; for column c the thread loads dtable[t, c] once, adds dout[p, c] for the
//   token's positions p in ascending order, and stores it back. Each table row belongs to one block
//   and each column to one thread, and the additions happen in the order the CPU op makes them
//   (tokens 0..n-1, i.e. ascending positions, one fp32 add each, straight into dtable), so the
//   result is deterministic and equals the CPU op bit for bit.
#include "cuda/embedding.cuh"

#include <algorithm>
#include <numeric>

#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const int32_t* tokens, int64_t n, const T* table, int64_t hidden, float* out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const T* src = table + static_cast<int64_t>(tokens[i]) * hidden;
    float* dst = out + i * hidden;
    for (int64_t c = threadIdx.x; c < hidden; c += kThreads) dst[c] = to_f(src[c]);
  }
}

__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(const int32_t* unique, const int32_t* offsets, const int32_t* positions, int64_t n_unique,
                              const float* dout, int64_t hidden, float* dtable) {
  for (int64_t u = blockIdx.x; u < n_unique; u += gridDim.x) {
    float* dst = dtable + static_cast<int64_t>(unique[u]) * hidden;
    const int32_t p0 = offsets[u];
    const int32_t p1 = offsets[u + 1];
    for (int64_t c = threadIdx.x; c < hidden; c += kThreads) {
      float acc = dst[c];
      for (int32_t p = p0; p < p1; ++p) acc = __fadd_rn(acc, dout[static_cast<int64_t>(positions[p]) * hidden + c]);
      dst[c] = acc;
    }
  }
}

}  // namespace

template <typename T>
Status embedding_forward(const int32_t* tokens, int64_t n, const T* table, int64_t hidden, float* out, cudaStream_t s) {
  if (n <= 0 || hidden <= 0) return {};
  embedding_forward_kernel<T><<<row_grid(n), kThreads, 0, s>>>(tokens, n, table, hidden, out);
  MT_CUDA_LAUNCH_CHECK("embedding_forward");
  return {};
}

// Counting positions per token would need the vocabulary size; a stable sort of the positions by
// token id gives the same groups (positions ascending within a token) in O(n log n).
TokenGroups build_token_groups(const int32_t* tokens, int64_t n) {
  TokenGroups g;
  if (n < 0) n = 0;
  g.positions.resize(static_cast<size_t>(n));
  std::iota(g.positions.begin(), g.positions.end(), int32_t{0});
  std::stable_sort(g.positions.begin(), g.positions.end(),
                   [tokens](int32_t a, int32_t b) { return tokens[a] < tokens[b]; });
  g.offsets.push_back(0);
  for (int64_t k = 0; k < n; ++k) {
    const int32_t t = tokens[g.positions[static_cast<size_t>(k)]];
    if (g.unique.empty() || g.unique.back() != t) {
      if (!g.unique.empty()) g.offsets.push_back(static_cast<int32_t>(k));
      g.unique.push_back(t);
    }
  }
  if (!g.unique.empty()) g.offsets.push_back(static_cast<int32_t>(n));
  return g;
}

Status embedding_backward(const int32_t* unique, const int32_t* offsets, const int32_t* positions, int64_t n_unique,
                          const float* dout, int64_t hidden, float* dtable, cudaStream_t s) {
  if (n_unique <= 0 || hidden <= 0) return {};
  embedding_backward_kernel<<<row_grid(n_unique), kThreads, 0, s>>>(unique, offsets, positions, n_unique, dout, hidden,
                                                                    dtable);
  MT_CUDA_LAUNCH_CHECK("embedding_backward");
  return {};
}

#define MT_INSTANTIATE(T) \
  template Status embedding_forward<T>(const int32_t*, int64_t, const T*, int64_t, float*, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace megatrain::cuda

// Device helpers shared by the kernels in kernels/cuda/*.cu: element conversions, the fixed-order
// block reductions and grid sizes. Device-only: include it from .cu files, never from a header the
// host compiler sees (common.cuh is the host-includable one).
#pragma once

#ifndef __CUDACC__
#error "cuda/device_util.cuh holds device code: include it only from .cu files"
#endif

#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"

// An inline namespace: the kernels' files, in megatrain::cuda, name these helpers unqualified.
namespace megatrain::cuda {
inline namespace device_util {

// ---- Element conversions: storage type (float or bf16) <-> the fp32 the arithmetic is done in.

// T -> float: a copy for float, exact for bf16.
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }

// float -> T: a copy for float, round to nearest even for bf16 (NaN stays NaN).
template <typename T>
__device__ __forceinline__ T from_f(float v) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>, "from_f: T is float or bf16");
  if constexpr (std::is_same_v<T, bf16>)
    return __float2bfloat16_rn(v);
  else
    return v;
}

// ---- Fixed-order reductions. The order depends only on the block size, never on timing, so
// the results are bit-reproducible.

// a + b, one IEEE round-to-nearest add (never contracted).
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
  __device__ __forceinline__ double operator()(double a, double b) const { return __dadd_rn(a, b); }
};
// max(a, b) (fmaxf: a NaN operand loses to a number).
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Warp tree: lane i combines its value with lane i + o's, for o = 16, 8, 4, 2, 1
// (__shfl_down_sync, all 32 lanes active). Lane 0 ends with the warp's result.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

// Reduction over a block of kThreads threads (blockDim.x == kThreads, a multiple of 32): the warp
// tree in every warp, the kThreads / 32 warp results through smem[0 .. kThreads / 32), then the
// same tree in warp 0 (lanes past the last warp hold identity). The result is valid in thread 0
// only; no trailing barrier, so smem is not free for reuse until the block syncs again.
template <int kThreads, typename V, typename Op>
__device__ __forceinline__ V block_reduce_first(V v, V identity, Op op, V* smem) {
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024, "kThreads: whole warps, at most 1024");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? smem[lane] : identity;
    v = warp_reduce(v, op);
  }
  return v;
}

// block_reduce_first, then thread 0's result broadcast to every thread through smem[kThreads / 32]
// (smem holds kThreads / 32 + 1 values). The trailing barrier lets the caller reuse smem at once.
template <int kThreads, typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, V identity, Op op, V* smem) {
  constexpr int kWarps = kThreads / 32;
  v = block_reduce_first<kThreads>(v, identity, op, smem);
  if (threadIdx.x == 0) smem[kWarps] = v;
  __syncthreads();
  const V r = smem[kWarps];
  __syncthreads();
  return r;
}

// ---- Grid sizes (host side, for the launchers).

// Element-wise kernels: grid-stride loops over the flat index, so the grid may be capped.
inline constexpr int64_t kMaxStrideBlocks = int64_t{1} << 16;
// Row kernels: one block per row, the grid looping over rows past the cap.
inline constexpr int64_t kMaxRowBlocks = int64_t{1} << 20;

// Blocks of kThreads covering n elements, ceil(n / kThreads), capped at max_blocks.
template <int kThreads>
inline unsigned int stride_grid(int64_t n, int64_t max_blocks = kMaxStrideBlocks) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < max_blocks ? blocks : max_blocks);
}

// One block per row for n rows, capped at kMaxRowBlocks.
inline unsigned int row_grid(int64_t n) { return static_cast<unsigned int>(n < kMaxRowBlocks ? n : kMaxRowBlocks); }

}  // namespace device_util
}  // namespace megatrain::cuda

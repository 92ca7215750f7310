// Internal helpers of the CPU ops: how work is split over threads, and reductions in a fixed order.
// Not a public header: nothing outside kernels/cpu/ includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu::detail {

// Splits [0, n) into at most ctx.threads() contiguous chunks and calls f(begin, end) once per chunk,
// each on its own thread. Chunk boundaries are multiples of `align` (the last chunk ends at n) and no
// split happens below `min_chunk` items per chunk. The split depends only on (n, threads, align,
// min_chunk); callers make sure each output element is written by one chunk only.
template <typename F>
void parallel_for(CpuContext& ctx, int64_t n, int64_t min_chunk, int64_t align, F&& f) {
  if (n <= 0) return;
  align = std::max<int64_t>(align, 1);
  const int64_t units = (n + align - 1) / align;
  const int64_t by_size = std::max<int64_t>(1, n / std::max<int64_t>(min_chunk, 1));
  const int64_t chunks = std::min<int64_t>({static_cast<int64_t>(ctx.threads()), units, by_size});
  if (chunks <= 1) {
    f(int64_t{0}, n);
    return;
  }
  ctx.run(static_cast<int>(chunks), [&](int c) {
    const int64_t begin = std::min(n, units * c / chunks * align);
    const int64_t end = std::min(n, units * (c + 1) / chunks * align);
    if (begin < end) f(begin, end);
  });
}

// Number of interleaved partial sums in the fixed-order reductions below. Lane j takes the items
// i = j (mod kLanes); the lanes are then added in a fixed binary tree. The order depends only on n,
// so a row's result never depends on threads, and the independent lanes let the compiler vectorise
// without -ffast-math (they also make the rounding error grow like log(n) across lanes).
inline constexpr int kLanes = 16;

template <typename T>
inline T reduce_lanes(T* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// sum_i a[i] * b[i]
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  return reduce_lanes(acc);
}

// y[i] += alpha * x[i]
template <typename T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

inline std::string str(int64_t v) { return std::to_string(v); }

}  // namespace megatrain::cpu::detail

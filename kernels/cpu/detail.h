// Internal helpers of the CPU ops: how work is split over threads, and reductions in a fixed order.
// Not a public header: nothing outside kernels/cpu/ includes it.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/context.h"
#include "megatrain/kernels/cpu/profile.h"

namespace megatrain::cpu::detail {

// Sizes as doubles, for the ops' FLOP and byte counts (profile.h).
inline double dbl(int64_t v) { return static_cast<double>(v); }

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

// e^x for float from IEEE basic operations only, so that a loop of it vectorises without
// -ffast-math and gives the same bits on every instruction set (the kernels compile with
// -ffp-contract=off; no floor, which would keep GCC from vectorising): x = n ln 2 + r with n the
// nearest integer and ln 2 in two parts (Cody and Waite), |r| <= ln 2 / 2,
// e^r from Cephes' degree-6 polynomial for expf (within about 1 ulp), times 2^n built in two
// exponent fields (so n may reach 128 or go into the subnormals). Overflow gives +inf, x below
// -104 gives 0, NaN stays NaN, as std::exp does. exp of double stays std::exp.
inline float exp_fast(float x) {
  const float xc = std::max(-104.0f, std::min(88.72283f, x));  // NaN becomes 88.72283 here, restored below
  const float t = xc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // t rounded to the nearest integer (1.5 * 2^23; |t| < 2^22)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float y = poly * (r * r) + r + 1.0f;
  const auto ni = static_cast<int32_t>(n);  // in [-150, 128]
  const int32_t n1 = ni >> 1, n2 = ni - n1;  // each in [-75, 64]: a normal power of two
  const float e = y * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
  return x != x ? x : x > 88.72283f ? std::numeric_limits<float>::infinity() : x < -104.0f ? 0.0f : e;
}
template <typename T>
inline T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_fast(x);
  } else {
    return std::exp(x);
  }
}

inline std::string str(int64_t v) { return std::to_string(v); }

}  // namespace megatrain::cpu::detail

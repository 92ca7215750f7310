// Residual add and gradient accumulation.
#include "megatrain/kernels/cpu/add.h"

#include "detail.h"

namespace megatrain::cpu {
namespace {
constexpr int64_t kChunk = 1 << 15;
}

template <typename T>
void add(CpuContext& ctx, const T* a, const T* b, int64_t n, T* out) {
  MT_CHECK(n >= 0, "add: bad size");
  const ProfiledOp op("add", detail::dbl(n), static_cast<double>(sizeof(T)) * 3 * detail::dbl(n));
  detail::parallel_for(ctx, n, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

template <typename T>
void accumulate(CpuContext& ctx, const T* src, int64_t n, T* dst) {
  MT_CHECK(n >= 0, "accumulate: bad size");
  const ProfiledOp op("add", detail::dbl(n), static_cast<double>(sizeof(T)) * 3 * detail::dbl(n));
  detail::parallel_for(ctx, n, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] += src[i];
  });
}

template void add<float>(CpuContext&, const float*, const float*, int64_t, float*);
template void add<double>(CpuContext&, const double*, const double*, int64_t, double*);
template void accumulate<float>(CpuContext&, const float*, int64_t, float*);
template void accumulate<double>(CpuContext&, const double*, int64_t, double*);

}  // namespace megatrain::cpu

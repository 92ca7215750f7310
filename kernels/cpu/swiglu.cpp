// SwiGLU forward and backward, elementwise.
#include "megatrain/kernels/cpu/swiglu.h"

#include <cmath>

#include "detail.h"

namespace megatrain::cpu {
namespace {
constexpr int64_t kChunk = 1 << 14;  // elements per thread at least
}

template <typename T>
void swiglu_forward(CpuContext& ctx, const T* gate, const T* up, int64_t n, T* out) {
  MT_CHECK(n >= 0, "swiglu_forward: bad size");
  detail::parallel_for(ctx, n, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T g = gate[i];
      out[i] = g / (T(1) + std::exp(-g)) * up[i];
    }
  });
}

template <typename T>
void swiglu_backward(CpuContext& ctx, const T* gate, const T* up, const T* dout, int64_t n, T* dgate, T* dup) {
  MT_CHECK(n >= 0, "swiglu_backward: bad size");
  detail::parallel_for(ctx, n, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T g = gate[i];
      const T u = up[i];
      const T d = dout[i];
      const T sig = T(1) / (T(1) + std::exp(-g));
      const T silu = g / (T(1) + std::exp(-g));
      dgate[i] = d * u * (sig * (T(1) + g * (T(1) - sig)));
      dup[i] = d * silu;
    }
  });
}

#define MT_INSTANTIATE(T)                                                             \
  template void swiglu_forward<T>(CpuContext&, const T*, const T*, int64_t, T*); \
  template void swiglu_backward<T>(CpuContext&, const T*, const T*, const T*, int64_t, T*, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

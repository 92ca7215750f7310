// SwiGLU forward and backward, elementwise (exp through detail::exp_of: vectorised, the same bits on
// every instruction set).
#include "megatrain/kernels/cpu/swiglu.h"

#include <algorithm>
#include <cmath>

#include "detail.h"

namespace megatrain::cpu {
namespace {
constexpr int64_t kChunk = 1 << 14;  // elements per thread at least
}

template <typename T>
void swiglu_forward(CpuContext& ctx, const T* gate, const T* up, int64_t n, T* out) {
  MT_CHECK(n >= 0, "swiglu_forward: bad size");
  const ProfiledOp op("swiglu forward", 6 * detail::dbl(n), static_cast<double>(sizeof(T)) * 3 * detail::dbl(n));
  detail::parallel_for(ctx, n, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T g = gate[i];
      out[i] = g / (T(1) + detail::exp_of(-g)) * up[i];
    }
  });
}

template <typename T>
void swiglu_backward(CpuContext& ctx, const T* gate, const T* up, const T* dout, int64_t n, T* dgate, T* dup) {
  MT_CHECK(n >= 0, "swiglu_backward: bad size");
  const ProfiledOp op("swiglu backward", 10 * detail::dbl(n), static_cast<double>(sizeof(T)) * 5 * detail::dbl(n));
  detail::parallel_for(ctx, n, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T g = gate[i];
      const T u = up[i];
      const T d = dout[i];
      const T e = detail::exp_of(-g);
      const T sig = T(1) / (T(1) + e);
      const T silu = g / (T(1) + e);
      dgate[i] = d * u * (sig * (T(1) + g * (T(1) - sig)));
      dup[i] = d * silu;
    }
  });
}

template <typename T>
void clamped_swiglu_forward(CpuContext& ctx, const T* gu, int64_t rows, int64_t m, T alpha, T limit, T* out) {
  MT_CHECK(rows >= 0 && m >= 0, "clamped_swiglu_forward: bad size");
  const ProfiledOp op("swiglu forward", 8 * detail::dbl(rows * m), static_cast<double>(sizeof(T)) * 3 * detail::dbl(rows * m));
  detail::parallel_for(ctx, rows * m, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T g = gu[2 * i], u = gu[2 * i + 1];
      if (limit > 0) {
        g = std::min(g, limit);
        u = std::clamp(u, -limit, limit);
      }
      const T sig = T(1) / (T(1) + detail::exp_of(-(g * alpha)));
      out[i] = (u + T(1)) * (g * sig);
    }
  });
}

template <typename T>
void clamped_swiglu_backward(CpuContext& ctx, const T* gu, const T* dout, int64_t rows, int64_t m, T alpha, T limit, T* dgu) {
  MT_CHECK(rows >= 0 && m >= 0, "clamped_swiglu_backward: bad size");
  const ProfiledOp op("swiglu backward", 12 * detail::dbl(rows * m), static_cast<double>(sizeof(T)) * 5 * detail::dbl(rows * m));
  detail::parallel_for(ctx, rows * m, kChunk, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T graw = gu[2 * i], uraw = gu[2 * i + 1];
      const bool pass_g = !(limit > 0) || graw <= limit;
      const bool pass_u = !(limit > 0) || (uraw >= -limit && uraw <= limit);
      const T g = pass_g ? graw : limit;
      const T u = limit > 0 ? std::clamp(uraw, -limit, limit) : uraw;
      const T sig = T(1) / (T(1) + detail::exp_of(-(g * alpha)));
      const T d = dout[i];
      dgu[2 * i] = pass_g ? d * (u + T(1)) * (sig + g * alpha * sig * (T(1) - sig)) : T(0);
      dgu[2 * i + 1] = pass_u ? d * (g * sig) : T(0);
    }
  });
}

#define MT_INSTANTIATE(T)                                                             \
  template void swiglu_forward<T>(CpuContext&, const T*, const T*, int64_t, T*); \
  template void swiglu_backward<T>(CpuContext&, const T*, const T*, const T*, int64_t, T*, T*); \
  template void clamped_swiglu_forward<T>(CpuContext&, const T*, int64_t, int64_t, T, T, T*); \
  template void clamped_swiglu_backward<T>(CpuContext&, const T*, const T*, int64_t, int64_t, T, T, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

// RMSNorm forward and backward (HF LlamaRMSNorm).
#include "megatrain/kernels/cpu/rmsnorm.h"

#include <cmath>

#include "detail.h"

namespace megatrain::cpu {

template <typename T>
void rmsnorm_forward(CpuContext& ctx, const T* x, const T* w, int64_t n, int64_t dim, double eps, T* y, T* rstd) {
  MT_CHECK(n >= 0 && dim > 0, "rmsnorm_forward: bad sizes");
  const ProfiledOp op("rmsnorm forward", 4 * detail::dbl(n * dim), static_cast<double>(sizeof(T)) * detail::dbl(2 * n * dim + dim + n));
  const T eps_t = static_cast<T>(eps);
  detail::parallel_for(ctx, n, 8, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T* yr = y + r * dim;
      const T ms = detail::dot(xr, xr, dim) / static_cast<T>(dim);
      const T rs = T(1) / std::sqrt(ms + eps_t);
      rstd[r] = rs;
      for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * rs);
    }
  });
}

template <typename T>
void rmsnorm_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t dim,
                      T* dx, T* dw) {
  MT_CHECK(n >= 0 && dim > 0, "rmsnorm_backward: bad sizes");
  const ProfiledOp op("rmsnorm backward", 8 * detail::dbl(n * dim), static_cast<double>(sizeof(T)) * detail::dbl(3 * n * dim + 2 * dim + n));
  // dw first: dx may alias dy, and the dx pass overwrites its row.
  if (dw) {
    detail::parallel_for(ctx, dim, 64, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < n; ++r) {
        const T* xr = x + r * dim;
        const T* dyr = dy + r * dim;
        const T rs = rstd[r];
        for (int64_t i = c0; i < c1; ++i) dw[i] += dyr[i] * (xr[i] * rs);
      }
    });
  }
  if (dx) {
    detail::parallel_for(ctx, n, 8, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = x + r * dim;
        const T* dyr = dy + r * dim;
        T* dxr = dx + r * dim;
        // dxr holds g = dy * w first; the row's own output is free scratch.
        for (int64_t i = 0; i < dim; ++i) dxr[i] = dyr[i] * w[i];
        const T c = detail::dot(dxr, xr, dim) / static_cast<T>(dim);
        const T rs = rstd[r];
        const T k = rs * rs * c;
        for (int64_t i = 0; i < dim; ++i) dxr[i] = rs * (dxr[i] - xr[i] * k);
      }
    });
  }
}

#define MT_INSTANTIATE(T)                                                                                  \
  template void rmsnorm_forward<T>(CpuContext&, const T*, const T*, int64_t, int64_t, double, T*, T*);     \
  template void rmsnorm_backward<T>(CpuContext&, const T*, const T*, const T*, const T*, int64_t, int64_t, T*, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

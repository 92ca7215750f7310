// Linear forward/backward and gemm: row-major arrays mapped into Eigen, split into aligned blocks.
#include "megatrain/kernels/cpu/linear.h"

#include "detail.h"
#include "eigen_maps.h"

namespace megatrain::cpu {
namespace {

using detail::CMap;
using detail::MMap;

// Block boundaries: a multiple of Eigen's register blocks (mr = 3 packets: 48 floats or 24 doubles
// with AVX-512, nr = 4 or 8) so a block boundary never changes which micro-kernel handles a row.
constexpr int64_t kAlign = 48;
// Below this many rows per block the split costs more than it gains.
constexpr int64_t kMinBlock = 96;

// C = alpha * A * B + beta * C for one block of C's rows [r0, r1) or columns [c0, c1).
template <typename T, typename MA, typename MB>
void gemm_expr(CpuContext& ctx, const MA& a, const MB& b, T alpha, T beta, MMap<T> c) {
  const int64_t m = c.rows();
  const int64_t n = c.cols();
  auto block = [&](auto&& a_blk, auto&& b_blk, auto&& c_blk) {
    if (beta == T(0)) {
      c_blk.setZero();
    } else if (beta != T(1)) {
      c_blk *= beta;
    }
    if (a.cols() == 0) return;
    if (alpha == T(1)) {
      c_blk.noalias() += a_blk * b_blk;
    } else {
      c_blk.noalias() += alpha * (a_blk * b_blk);
    }
  };
  if (m >= n) {
    detail::parallel_for(ctx, m, kMinBlock, kAlign, [&](int64_t r0, int64_t r1) {
      block(a.middleRows(r0, r1 - r0), b, c.middleRows(r0, r1 - r0));
    });
  } else {
    detail::parallel_for(ctx, n, kMinBlock, kAlign, [&](int64_t c0, int64_t c1) {
      block(a, b.middleCols(c0, c1 - c0), c.middleCols(c0, c1 - c0));
    });
  }
}

}  // namespace

template <typename T>
void gemm(CpuContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  MT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: negative size");
  MT_CHECK(lda >= (trans_a ? m : k) && ldb >= (trans_b ? k : n) && ldc >= n, "gemm: leading dimension too small");
  if (m == 0 || n == 0) return;
  // Named by what the layers use each form for: y = x W^T, dx = dy W, dW += dy^T x.
  const ProfiledOp op(trans_b ? "gemm x.W^T (forward)" : trans_a ? "gemm dy^T.x (weight grad)" : "gemm dy.W (input grad)",
                      2 * detail::dbl(m) * detail::dbl(n) * detail::dbl(k),
                      static_cast<double>(sizeof(T)) * detail::dbl(m * k + k * n + (beta != T(0) ? 2 : 1) * m * n));
  MMap<T> cm(c, m, n, Eigen::OuterStride<>(ldc));
  const CMap<T> am(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
  const CMap<T> bm(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
  if (!trans_a && !trans_b) gemm_expr(ctx, am, bm, alpha, beta, cm);
  if (!trans_a && trans_b) gemm_expr(ctx, am, bm.transpose(), alpha, beta, cm);
  if (trans_a && !trans_b) gemm_expr(ctx, am.transpose(), bm, alpha, beta, cm);
  if (trans_a && trans_b) gemm_expr(ctx, am.transpose(), bm.transpose(), alpha, beta, cm);
}

template <typename T>
void linear_forward(CpuContext& ctx, const T* x, const T* w, const T* bias, int64_t n, int64_t in, int64_t out,
                    T* y) {
  MT_CHECK(n >= 0 && in > 0 && out > 0, "linear_forward: bad sizes");
  if (n == 0) return;
  T beta = T(0);
  if (bias) {
    MMap<T>(y, n, out, Eigen::OuterStride<>(out)).rowwise() =
        Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, out);
    beta = T(1);
  }
  gemm(ctx, false, true, n, out, in, T(1), x, in, w, in, beta, y, out);
}

template <typename T>
void linear_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, int64_t n, int64_t in, int64_t out, T* dx,
                     bool accumulate_dx, T* dw, T* db) {
  MT_CHECK(n >= 0 && in > 0 && out > 0, "linear_backward: bad sizes");
  if (dx) gemm(ctx, false, false, n, in, out, T(1), dy, out, w, in, accumulate_dx ? T(1) : T(0), dx, in);
  if (n == 0) return;
  if (dw) gemm(ctx, true, false, out, in, n, T(1), dy, out, x, in, T(1), dw, in);
  if (db) {
    detail::parallel_for(ctx, out, 256, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < n; ++r) {
        const T* dyr = dy + r * out;
        for (int64_t c = c0; c < c1; ++c) db[c] += dyr[c];
      }
    });
  }
}

#define MT_INSTANTIATE(T)                                                                                       \
  template void gemm<T>(CpuContext&, bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*,      \
                        int64_t, T, T*, int64_t);                                                               \
  template void linear_forward<T>(CpuContext&, const T*, const T*, const T*, int64_t, int64_t, int64_t, T*);      \
  template void linear_backward<T>(CpuContext&, const T*, const T*, const T*, int64_t, int64_t, int64_t, T*, bool, \
                                   T*, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

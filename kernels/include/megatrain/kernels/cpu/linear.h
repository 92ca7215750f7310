// Linear layers (torch.nn.Linear: weights [out, in]) and a plain GEMM, all through Eigen.
//
//   forward   y[n, out]   = bias[out] + x[n, in] * W[out, in]^T          (bias optional)
//   backward  dx[n, in]   = dy[n, out] * W[out, in]                      (overwritten or accumulated)
//             dW[out, in] += dy^T * x
//             db[out]     += sum over rows of dy
//   gemm      C[m, n] = alpha * op(A) * op(B) + beta * C,   op(X) = X or X^T, all row-major with
//             leading dimensions lda/ldb/ldc (elements between consecutive rows)
//
// The bias is the GEMM's initial C (as torch's addmm does), not added afterwards. The LM head is a
// linear without bias. Threads split the output matrix into blocks of whole rows (or whole columns,
// when the output has fewer rows than columns); each block is one Eigen GEMM (Eigen itself runs
// single-threaded: no OpenMP). Block boundaries are multiples of 48 rows/columns, a multiple of
// Eigen's register-block sizes for float and double, so every element goes through the same Eigen
// micro-kernel with the same k-blocking whatever the thread count: results are deterministic and, as
// determinism_test.cpp checks, identical for 1, 2 and 3 threads. db splits columns and adds rows in
// order. Eigen's k-blocking makes dW += (dy1; dy2)^T (x1; x2) differ from two accumulations only by
// rounding.
#pragma once

#include <cstdint>

#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

template <typename T>
void linear_forward(CpuContext& ctx, const T* x, const T* w, const T* bias, int64_t n, int64_t in, int64_t out, T* y);

// Any of dx, dw, db may be null to skip it. dx is overwritten unless accumulate_dx (then dx += dy W,
// e.g. for the input of q, k and v projections). dw and db are always accumulated.
template <typename T>
void linear_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, int64_t n, int64_t in, int64_t out, T* dx,
                     bool accumulate_dx, T* dw, T* db);

// beta == 0 overwrites C (NaN in C is ignored, as in BLAS).
template <typename T>
void gemm(CpuContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace megatrain::cpu

// RMSNorm, with Hugging Face LlamaRMSNorm semantics (also Mistral and Qwen2).
//
//   forward   ms[r]   = (1/dim) * sum_i x[r,i]^2
//             rstd[r] = 1 / sqrt(ms[r] + eps)
//             y[r,i]  = w[i] * (x[r,i] * rstd[r])         (HF's order: normalise, then scale)
//   backward  with g[i] = dy[r,i] * w[i] and c = (1/dim) * sum_i g[i] * x[r,i]:
//             dx[r,i] = rstd[r] * (g[i] - x[r,i] * rstd[r]^2 * c)
//             dw[i]  += sum_r dy[r,i] * x[r,i] * rstd[r]
//
// HF upcasts to fp32 for the statistics; here everything is computed in T (float or double), which
// is already at least fp32. eps is rounded to T as torch does when it adds a Python float to an fp32
// tensor. The sum of squares uses the fixed-order lane reduction (detail.h).
// Shapes: x, y, dy, dx [n, dim]; w, dw [dim]; rstd [n] (saved by forward for backward).
// Deterministic and independent of the thread count: rows are split for y, rstd and dx; columns are
// split for dw, and each column adds the rows in order 0..n-1 directly into dw (+=), so two
// micro-batches accumulate exactly as one batch of their concatenation would.
#pragma once

#include <cstdint>

#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

template <typename T>
void rmsnorm_forward(CpuContext& ctx, const T* x, const T* w, int64_t n, int64_t dim, double eps, T* y, T* rstd);

// dx is overwritten (it may alias dy); dw is accumulated. Either may be null to skip it.
template <typename T>
void rmsnorm_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t dim,
                      T* dx, T* dw);

}  // namespace megatrain::cpu

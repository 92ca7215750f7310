// Cross-entropy over the vocabulary (torch.nn.functional.cross_entropy, reduction "mean",
// ignore_index), on logits produced by the LM head (a `linear` without bias).
//
//   forward   m[r]    = max_j x[r,j]
//             lse[r]  = m[r] + log(sum_j exp(x[r,j] - m[r]))          (max subtraction: no overflow)
//             loss[r] = log(sum_j exp(x[r,j] - m[r])) - (x[r,t[r]] - m[r])   (0 for ignored rows)
//             mean    = sum_r loss[r] / count,  count = rows whose target is not ignore_index
//   backward  dx[r,j] = (exp(x[r,j] - lse[r]) - [j == t[r]]) * grad_scale    (0 for ignored rows)
// For d(mean)/d(logits) pass grad_scale = dloss / count; gradient accumulation over micro-batches
// may pass 1 / (total count of the step) instead.
//
// Shapes: logits, dlogits [n, vocab]; targets [n] int32; lse, row_loss [n] (lse is saved for the
// backward). dlogits may alias logits (in place: each element is read before it is written), which
// halves the memory of a large-vocabulary head. Targets outside [0, vocab) that are not
// ignore_index are an invalid_argument naming the row; nothing is written then.
// Deterministic and independent of the thread count: rows are split; the loss sum is added in row
// order, in double, after the rows are done. Each row's exp-sum uses the fixed-order lane reduction.
#pragma once

#include <cstdint>

#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

inline constexpr int32_t kIgnoreIndex = -1;

struct CrossEntropyStats {
  double loss_sum = 0;  // sum of the per-row losses over non-ignored rows, added in row order
  int64_t count = 0;    // non-ignored rows
  // NaN when every row is ignored, as torch's mean reduction gives.
  double mean() const { return loss_sum / static_cast<double>(count); }
};

// row_loss may be null. lse is required.
template <typename T>
Status cross_entropy_forward(CpuContext& ctx, const T* logits, const int32_t* targets, int64_t n, int64_t vocab,
                             T* lse, T* row_loss, CrossEntropyStats* stats, int32_t ignore_index = kIgnoreIndex);

template <typename T>
Status cross_entropy_backward(CpuContext& ctx, const T* logits, const int32_t* targets, const T* lse, int64_t n,
                              int64_t vocab, T grad_scale, T* dlogits, int32_t ignore_index = kIgnoreIndex);

}  // namespace megatrain::cpu

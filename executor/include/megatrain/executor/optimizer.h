// The CPU AdamW of ARCHITECTURE.md section 5: one fused pass per tensor that reads the gradient,
// master weight and moments and writes the master weight, the moments and the streaming copy for
// the next step. The arithmetic follows torch.optim.AdamW (decoupled weight decay, bias
// correction, eps added to sqrt(v_hat)) operation by operation, so the two agree to rounding.
// Also: the learning-rate schedules of the plan and a deterministic global gradient norm.
#pragma once

#include <cstdint>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/executor/bf16.h"

namespace megatrain::exec {

struct AdamWStep {
  double lr = 0;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0;  // for this tensor (0 for norms and biases, as HF Trainer does)
  int64_t t = 1;            // 1-based update count, for bias correction
  float grad_scale = 1.0f;  // clipping factor applied to the gradient as it is read
};

// Updates n parameters. `stream_f32` / `stream_bf16` (either may be null) receive the new weights
// in the transfer dtype. Splits the range over `threads` fixed chunks: every element is computed
// independently, so the result does not depend on the thread count.
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s,
                  float* stream_f32, uint16_t* stream_bf16, int threads);

// The learning rate of 0-based step `step`: linear warmup over warmup_steps ((step+1)/warmup of
// lr), then constant, cosine or linear decay from lr to min_lr at the last step; or, for the -hf
// schedules, Hugging Face's: warmup step/warmup, then constant, or cosine or linear decay that
// reaches 0 one step after the last (core/plan.h).
double learning_rate(const TrainingConfig& t, int64_t step);

// Sum of squares in double, in a fixed order that no thread count or ISA changes: chunks of
// kSumOfSquaresChunk elements added in order, each chunk's blocks of 4096 added in order, and each
// block summed in 16 interleaved running sums (element i into sum i % 16) added pairwise. The 16
// chains let the adds overlap instead of waiting one add's latency per element: 4.3 G elements/s
// on one core of the development machine against 1.5 for one running sum, 8 on its two cores.
inline constexpr int64_t kSumOfSquaresChunk = int64_t{1} << 20;
double sum_of_squares(const float* g, int64_t n);

// sum_of_squares of every range, out[r] for ranges[r], their chunks spread over `threads` threads:
// the same bits as sum_of_squares range by range, whatever the thread count.
struct SquaresRange {
  const float* g = nullptr;
  int64_t n = 0;
};
void sums_of_squares(const std::vector<SquaresRange>& ranges, double* out, int threads);


}  // namespace megatrain::exec

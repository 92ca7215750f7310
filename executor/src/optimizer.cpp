// CPU AdamW (torch.optim.AdamW arithmetic), learning-rate schedules, gradient norm, bf16 rounding.
#include "megatrain/executor/optimizer.h"

#include "megatrain/executor/moments.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace megatrain::exec {

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s, float* stream_f32,
                  uint16_t* stream_bf16, int threads) {
  // fp32 moments through the fused SIMD pass (moments.h).
  MomentRef mr, vr;
  mr.f32 = m;
  vr.f32 = v;
  adamw_update_moments(w, g, mr, vr, n, s, stream_f32, stream_bf16, threads);
}

double learning_rate(const TrainingConfig& t, int64_t step) {
  const double kPi = 3.14159265358979323846;
  if (t.lr_schedule == LrSchedule::kConstantHf || t.lr_schedule == LrSchedule::kCosineHf || t.lr_schedule == LrSchedule::kLinearHf) {
    // Hugging Face's lambdas (transformers.optimization), times lr.
    if (step < t.warmup_steps) return t.lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, t.warmup_steps));
    if (t.lr_schedule == LrSchedule::kConstantHf) return t.lr;
    const double progress = static_cast<double>(step - t.warmup_steps) / static_cast<double>(std::max<int64_t>(1, t.steps - t.warmup_steps));
    if (t.lr_schedule == LrSchedule::kLinearHf) return t.lr * std::max(0.0, 1.0 - progress);
    return t.lr * std::max(0.0, 0.5 * (1.0 + std::cos(kPi * progress)));
  }
  if (t.warmup_steps > 0 && step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  if (t.lr_schedule == LrSchedule::kConstant) return t.lr;
  const double span = static_cast<double>(std::max<int64_t>(1, t.steps - 1 - t.warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - t.warmup_steps) / span, 0.0, 1.0);
  if (t.lr_schedule == LrSchedule::kLinear) return t.lr + (t.min_lr - t.lr) * progress;
  return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1.0 + std::cos(kPi * progress));  // cosine
}

double sum_of_squares(const float* g, int64_t n) {
  double total = 0;
  for (int64_t b = 0; b < n; b += 4096) {
    double part = 0;
    const int64_t e = std::min(n, b + 4096);
    for (int64_t i = b; i < e; ++i) part += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    total += part;
  }
  return total;
}

}  // namespace megatrain::exec

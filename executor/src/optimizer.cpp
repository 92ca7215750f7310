// CPU AdamW (torch.optim.AdamW arithmetic), learning-rate schedules, gradient norm, bf16 rounding.
#include "megatrain/executor/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace megatrain::exec {

namespace {

void adamw_range(float* w, const float* g, float* m, float* v, int64_t begin, int64_t end, const AdamWStep& s,
                 float* stream_f32, uint16_t* stream_bf16) {
  // torch: p *= 1 - lr*wd; m = m*b1 + (1-b1)*g; v = v*b2 + (1-b2)*g*g;
  //        denom = sqrt(v) / sqrt(1-b2^t) + eps; p -= (lr / (1-b1^t)) * m / denom
  const float decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  const float b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - s.beta1), one_minus_b2 = static_cast<float>(1.0 - s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.t));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.t));
  const float step_size = static_cast<float>(s.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(s.eps);
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i] * s.grad_scale;
    float p = w[i] * decay;
    const float mi = m[i] * b1 + one_minus_b1 * gi;  // torch 1.13: mul_(b1).add_(g, alpha=1-b1)
    const float vi = v[i] * b2 + one_minus_b2 * gi * gi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p = p - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    w[i] = p;
    if (stream_f32) stream_f32[i] = p;
    if (stream_bf16) stream_bf16[i] = fp32_to_bf16(p);
  }
}

}  // namespace

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s, float* stream_f32,
                  uint16_t* stream_bf16, int threads) {
  threads = std::max(1, threads);
  if (threads == 1 || n < 65536) {
    adamw_range(w, g, m, v, 0, n, s, stream_f32, stream_bf16);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int k = 1; k < threads; ++k) {
    const int64_t b = k * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back(adamw_range, w, g, m, v, b, e, std::cref(s), stream_f32, stream_bf16);
  }
  adamw_range(w, g, m, v, 0, std::min(n, chunk), s, stream_f32, stream_bf16);
  for (auto& t : pool) t.join();
}

double learning_rate(const TrainingConfig& t, int64_t step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  if (t.lr_schedule == "constant") return t.lr;
  const double span = static_cast<double>(std::max<int64_t>(1, t.steps - 1 - t.warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - t.warmup_steps) / span, 0.0, 1.0);
  if (t.lr_schedule == "linear") return t.lr + (t.min_lr - t.lr) * progress;
  const double kPi = 3.14159265358979323846;
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

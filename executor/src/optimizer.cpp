// CPU AdamW (torch.optim.AdamW arithmetic), learning-rate schedules, gradient norm, bf16 rounding.
#include "megatrain/executor/optimizer.h"

#include "megatrain/executor/moments.h"

#include <algorithm>
#include <atomic>
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

namespace {

// One block of at most 4096 elements: element i of the block into running sum i % 16 (16 chains,
// so the adds overlap and the compiler vectorises them; no reassociation is left to it), then the
// 16 sums added pairwise (8 pairs, 4, 2, 1). The same operations in the same order on every ISA.
double block_sum_of_squares(const float* g, int64_t n) {
  constexpr int kLanes = 16;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const double x = g[i + j];
      acc[j] += x * x;
    }
  for (int j = 0; i < n; ++i, ++j) {
    const double x = g[i];
    acc[j] += x * x;
  }
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// A chunk of at most kSumOfSquaresChunk elements: its blocks' sums added in order.
double chunk_sum_of_squares(const float* g, int64_t n) {
  double total = 0;
  for (int64_t b = 0; b < n; b += 4096) total += block_sum_of_squares(g + b, std::min<int64_t>(4096, n - b));
  return total;
}

}  // namespace

double sum_of_squares(const float* g, int64_t n) {
  double total = 0;
  for (int64_t c = 0; c < n; c += kSumOfSquaresChunk) total += chunk_sum_of_squares(g + c, std::min(kSumOfSquaresChunk, n - c));
  return total;
}

void sums_of_squares(const std::vector<SquaresRange>& ranges, double* out, int threads) {
  // Work items: every chunk of every range; each thread takes the next item, so the split does not
  // decide any sum, and each range's chunk sums are added in order afterwards.
  std::vector<std::pair<size_t, int64_t>> items;  // (range, first element of the chunk)
  for (size_t r = 0; r < ranges.size(); ++r)
    for (int64_t c = 0; c < ranges[r].n; c += kSumOfSquaresChunk) items.emplace_back(r, c);
  std::vector<double> chunk(items.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
      const auto [r, c] = items[k];
      chunk[k] = chunk_sum_of_squares(ranges[r].g + c, std::min(kSumOfSquaresChunk, ranges[r].n - c));
    }
  };
  const int team = static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(1, threads)), items.size()));
  std::vector<std::thread> helpers;
  for (int t = 1; t < team; ++t) helpers.emplace_back(work);
  work();
  for (std::thread& h : helpers) h.join();
  for (size_t r = 0; r < ranges.size(); ++r) out[r] = 0;
  for (size_t k = 0; k < items.size(); ++k) out[items[k].first] += chunk[k];
}

}  // namespace megatrain::exec

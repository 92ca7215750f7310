// Least-squares fits of the profiler (Eigen): latency-plus-bandwidth models and GEMM efficiency curves.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <Eigen/Dense>

#include "megatrain/planner/profile.h"

namespace megatrain::planner {
namespace {

// The peak is the best rate among the "large" shapes: those within this factor of the largest FLOPs.
constexpr double kLargeShapeRatio = 16;

void residuals(const std::vector<double>& x, const std::vector<double>& t, LatencyBandwidthFit& f) {
  double sum = 0, worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double pred = f.latency_s + x[i] / f.bandwidth;
    const double rel = std::abs(pred - t[i]) / t[i];
    sum += rel * rel;
    worst = std::max(worst, rel);
  }
  f.rms_rel = std::sqrt(sum / static_cast<double>(x.size()));
  f.max_rel = worst;
  f.points = static_cast<int64_t>(x.size());
}

// Pool adjacent violators: blocks of (mean rate, weight), merged while a block's mean is below its
// predecessor's. Weights are the sample counts, so this is the least-squares non-decreasing fit of
// the mean rate at each x. `by_x` maps x (ascending) to (sum of rates, count); returns x and the
// fitted rate at each.
template <typename Key>
std::pair<std::vector<double>, std::vector<double>> monotone_fit(const std::map<Key, std::pair<double, int>>& by_x) {
  struct Block {
    double mean, weight;
    size_t first, last;  // indices into `xs`
  };
  std::vector<double> xs;
  std::vector<Block> blocks;
  for (const auto& [x, e] : by_x) {
    xs.push_back(static_cast<double>(x));
    blocks.push_back({e.first / e.second, static_cast<double>(e.second), xs.size() - 1, xs.size() - 1});
    while (blocks.size() >= 2 && blocks[blocks.size() - 2].mean > blocks.back().mean) {
      const Block top = blocks.back();
      blocks.pop_back();
      Block& prev = blocks.back();
      prev.mean = (prev.mean * prev.weight + top.mean * top.weight) / (prev.weight + top.weight);
      prev.weight += top.weight;
      prev.last = top.last;
    }
  }
  std::vector<double> ys(xs.size());
  for (const Block& b : blocks)
    for (size_t i = b.first; i <= b.last; ++i) ys[i] = b.mean;
  return {std::move(xs), std::move(ys)};
}

}  // namespace

Result<LatencyBandwidthFit> fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& t) {
  if (x.size() != t.size())
    return invalid_argument("fit_latency_bandwidth: " + std::to_string(x.size()) + " sizes but " +
                            std::to_string(t.size()) + " times; expected one time per size");
  if (x.size() < 2) return invalid_argument("fit_latency_bandwidth: needs at least 2 points, got " + std::to_string(x.size()));
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] > 0) || !(t[i] > 0) || !std::isfinite(x[i]) || !std::isfinite(t[i]))
      return invalid_argument("fit_latency_bandwidth: point " + std::to_string(i) + " (" + std::to_string(x[i]) + ", " +
                              std::to_string(t[i]) + ") is not positive and finite");
  if (*std::min_element(x.begin(), x.end()) == *std::max_element(x.begin(), x.end()))
    return invalid_argument("fit_latency_bandwidth: all sizes are equal; at least two distinct sizes are needed");

  // Minimise sum_i ((lat + x_i s - t_i) / t_i)^2 over (lat, s = 1/bandwidth): rows [1/t_i, x_i/t_i], rhs 1.
  // x is scaled to its largest value so both columns are of similar magnitude.
  const double xs = *std::max_element(x.begin(), x.end());
  const Eigen::Index n = static_cast<Eigen::Index>(x.size());
  Eigen::MatrixXd a(n, 2);
  Eigen::VectorXd b = Eigen::VectorXd::Ones(n);
  for (Eigen::Index i = 0; i < n; ++i) {
    a(i, 0) = 1.0 / t[static_cast<size_t>(i)];
    a(i, 1) = (x[static_cast<size_t>(i)] / xs) / t[static_cast<size_t>(i)];
  }
  Eigen::Vector2d p = a.colPivHouseholderQr().solve(b);
  LatencyBandwidthFit f;
  double slope = p(1) / xs;
  f.latency_s = p(0);
  if (!(slope > 0) || !std::isfinite(slope))
    return invalid_argument("fit_latency_bandwidth: the times do not grow with size; no positive bandwidth fits them");
  if (!(f.latency_s >= 0)) {
    // Through the origin: minimise sum ((x_i s - t_i) / t_i)^2 -> s = sum(x/t) / sum((x/t)^2).
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double r = x[i] / t[i];
      num += r;
      den += r * r;
    }
    f.latency_s = 0;
    slope = num / den;
  }
  if (!(slope > 0) || !std::isfinite(slope))
    return invalid_argument("fit_latency_bandwidth: the times do not grow with size; no positive bandwidth fits them");
  f.bandwidth = 1.0 / slope;
  residuals(x, t, f);
  return f;
}

Result<GemmEfficiencyFit> fit_gemm_efficiency(const std::vector<GemmSample>& samples) {
  double max_flops = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const GemmSample& s = samples[i];
    if (s.m <= 0 || s.n <= 0 || s.k <= 0 || !(s.seconds > 0) || !std::isfinite(s.seconds))
      return invalid_argument("fit_gemm_efficiency: sample " + std::to_string(i) + " (" + std::to_string(s.m) + "x" +
                              std::to_string(s.n) + "x" + std::to_string(s.k) + ", " + std::to_string(s.seconds) +
                              " s) needs positive sizes and a positive time");
    max_flops = std::max(max_flops, s.flops());
  }
  GemmEfficiencyFit out;
  for (const GemmSample& s : samples)
    if (s.flops() >= max_flops / kLargeShapeRatio) out.peak_flops_per_s = std::max(out.peak_flops_per_s, s.flops() / s.seconds);

  std::map<double, std::pair<double, int>> by_flops;  // FLOPs -> (sum of rates clamped to the peak, count)
  std::vector<double> fx, ft;
  for (const GemmSample& s : samples) {
    auto& e = by_flops[s.flops()];
    e.first += std::min(s.flops() / s.seconds, out.peak_flops_per_s);
    e.second += 1;
    fx.push_back(s.flops());
    ft.push_back(s.seconds);
  }
  if (by_flops.size() < 2)
    return invalid_argument("fit_gemm_efficiency: needs samples of at least 2 distinct FLOP counts, got " +
                            std::to_string(by_flops.size()));

  const auto [xs, ys] = monotone_fit(by_flops);
  // Equal y on a run of x is kept only at the run's ends: the interpolation between them is flat anyway.
  for (size_t i = 0; i < xs.size(); ++i) {
    const bool interior = i > 0 && i + 1 < xs.size() && ys[i - 1] == ys[i] && ys[i + 1] == ys[i];
    if (interior) continue;
    const double y = std::clamp(ys[i] / out.peak_flops_per_s, 1e-12, 1.0);
    out.points.emplace_back(xs[i], y);
  }

  MT_ASSIGN_OR_RETURN(out.overhead, fit_latency_bandwidth(fx, ft));
  Curve c;
  c.points = out.points;
  double sum = 0, worst = 0;
  for (const GemmSample& s : samples) {
    const double measured = s.flops() / s.seconds;
    const double rel = std::abs(out.peak_flops_per_s * c.at(s.flops()) - measured) / measured;
    sum += rel * rel;
    worst = std::max(worst, rel);
  }
  out.curve_rms_rel = std::sqrt(sum / static_cast<double>(samples.size()));
  out.curve_max_rel = worst;
  return out;
}

Result<GroupedGemmFit> fit_grouped_gemm_efficiency(const std::vector<GroupedGemmSample>& samples, double peak) {
  if (!(peak > 0) || !std::isfinite(peak))
    return invalid_argument("fit_grouped_gemm_efficiency: the dense peak must be a positive FLOP rate, got " + std::to_string(peak));
  std::map<int64_t, std::pair<double, int>> by_rows;  // rows -> (sum of rates clamped to the peak, count)
  for (size_t i = 0; i < samples.size(); ++i) {
    const GroupedGemmSample& s = samples[i];
    if (s.experts <= 0 || s.rows <= 0 || s.n <= 0 || s.k <= 0 || !(s.seconds > 0) || !std::isfinite(s.seconds))
      return invalid_argument("fit_grouped_gemm_efficiency: sample " + std::to_string(i) + " (" + std::to_string(s.experts) +
                              " experts x " + std::to_string(s.rows) + "x" + std::to_string(s.k) + " -> " + std::to_string(s.n) +
                              ", " + std::to_string(s.seconds) + " s) needs positive sizes and a positive time");
    auto& e = by_rows[s.rows];
    e.first += std::min(s.flops() / s.seconds, peak);
    e.second += 1;
  }
  if (by_rows.size() < 2)
    return invalid_argument("fit_grouped_gemm_efficiency: needs samples of at least 2 distinct row counts, got " +
                            std::to_string(by_rows.size()));
  const auto [xs, ys] = monotone_fit(by_rows);
  GroupedGemmFit out;
  for (size_t i = 0; i < xs.size(); ++i) {
    const bool interior = i > 0 && i + 1 < xs.size() && ys[i - 1] == ys[i] && ys[i + 1] == ys[i];
    if (!interior) out.points.emplace_back(xs[i], std::clamp(ys[i] / peak, 1e-12, 1.0));
  }
  Curve c;
  c.points = out.points;
  double sum = 0, worst = 0;
  for (const GroupedGemmSample& s : samples) {
    const double measured = s.flops() / s.seconds;
    const double rel = std::abs(peak * c.at(static_cast<double>(s.rows)) - measured) / measured;
    sum += rel * rel;
    worst = std::max(worst, rel);
  }
  out.curve_rms_rel = std::sqrt(sum / static_cast<double>(samples.size()));
  out.curve_max_rel = worst;
  return out;
}

}  // namespace megatrain::planner

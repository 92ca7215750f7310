// What would relieve the best plan's bottleneck, each change simulated (detail/relief.h).
#include "detail/relief.h"

#include <algorithm>
#include <cmath>

#include "detail/candidates.h"
#include "detail/explain.h"
#include "detail/pruning.h"
#include "detail/sizing.h"
#include "megatrain/core/units.h"

namespace megatrain::planner::detail {
namespace {

constexpr size_t kReliefCandidates = 4;

std::string tier_more_text(const std::string& tier, double bytes) {
  const std::string what = tier == "device" ? "device memory" : tier == "pinned" ? "pinnable host memory"
                           : tier == "ram"  ? "host RAM"
                                            : "NVMe capacity";
  return format_bytes(bytes) + " more " + what;
}

// A copy of the rig with one tier's capacity enlarged by `more` bytes; for the device, the GPU's
// memory grows until the usable budget (step::usable_device_bytes) has `more` more.
HardwareProfile enlarged(const HardwareProfile& rig, const std::string& tier, double more) {
  HardwareProfile r = rig;
  if (tier == "device") {
    // The context reserve grows with the memory (up to 1 GiB): add until the budget has `more`.
    const double want = static_cast<double>(step::usable_device_bytes(rig)) + more;
    for (int i = 0; i < 8 && static_cast<double>(step::usable_device_bytes(r)) < want; ++i)
      r.gpu.memory_bytes.value += std::ceil(want - static_cast<double>(step::usable_device_bytes(r)));
  }
  if (tier == "ram") r.host.ram_bytes.value += more;
  if (tier == "pinned") {
    r.host.pinnable_bytes.value += more;
    r.host.ram_bytes.value = std::max(r.host.ram_bytes.value, r.host.pinnable_bytes.value);
  }
  if (tier == "nvme" && !r.storage.empty()) r.storage[0].capacity_bytes.value += more;
  return r;
}

// The knobs' best prefetch depth (1 .. 4, stopping when a deeper one gains nothing) on `on`.
bool simulate_best_k(Knobs k, const Space& s, const HardwareProfile& on, Candidate& out, int64_t& simulations) {
  bool found = false;
  for (int64_t K = 1; K <= std::min<int64_t>(4, s.kmax_all); ++K) {
    auto t = simulate_plan(make_plan(at_prefetch(k, K), s, on), s.model, on);
    ++simulations;
    if (!t.ok() || !t->feasible) continue;
    if (found && t->cand.result.step_time_s >= out.result.step_time_s * (1 - 1e-9)) break;
    if (!found || t->cand.result.step_time_s < out.result.step_time_s) out = t->cand;
    found = true;
  }
  return found;
}

// Candidates a tier blocked whose lower bound beats the best, on a rig enlarged by their shortfall.
void blocked_relief(SearchResult& res, const Space& s, std::vector<Structural> blocked) {
  const Candidate& best = res.best;
  std::vector<Structural> promising;
  for (Structural& c : blocked) {
    auto lb = lower_bound(make_plan(at_prefetch(c.k, 1), s), s.model, s.rig, &s.units);
    c.lb = lb.ok() ? *lb : 0;
    if (c.lb < best.result.step_time_s * (1 - kReliefMinGain)) promising.push_back(c);
  }
  auto shortfall_total = [&](const step::TierBytes& n) {
    double t = 0;
    for (const TierNeed& x : tier_needs(n, s.caps)) t += x.short_by() / std::max(1.0, x.have);
    return t;
  };
  std::stable_sort(promising.begin(), promising.end(), [&](const Structural& a, const Structural& b) {
    const double sa = shortfall_total(a.needs), sb = shortfall_total(b.needs);
    return sa != sb ? sa < sb : a.lb < b.lb;
  });
  std::vector<std::string> seen;
  std::vector<Relief> found;
  for (const Structural& c : promising) {
    if (seen.size() >= kReliefCandidates) break;
    const step::TierBytes& n = c.needs;
    // NVMe placement only relieves RAM; a blocked candidate that adds it for nothing is skipped.
    const bool ram_short = n.ram > s.caps.ram || n.pinned > s.caps.pinned;
    if (!ram_short && ((c.k.master_nvme && best.plan.placement.master_weights == Tier::kRam) ||
                       (c.k.states_nvme && best.plan.placement.optimizer_states == Tier::kRam)))
      continue;
    HardwareProfile bigger = s.rig;
    std::string tier;
    double more = 0;
    for (const TierNeed& x : tier_needs(n, s.caps)) {
      if (x.short_by() <= 0) continue;
      bigger = enlarged(bigger, x.tier, x.short_by() * 1.001 + 1);
      if (x.short_by() > more) {
        more = x.short_by();
        tier = x.tier;
      }
    }
    if (tier == "nvme" && s.rig.storage.empty()) continue;
    Knobs k = c.k;
    k.prefetch = best.plan.schedule.prefetch_depth;
    k.buffers = best.plan.schedule.device_layer_buffers;
    const std::string change = diff_text(make_plan(k, s), best.plan, false);
    if (std::find(seen.begin(), seen.end(), change) != seen.end()) continue;
    seen.push_back(change);
    Candidate sim;
    if (!simulate_best_k(c.k, s, bigger, sim, res.stats.relief_simulations)) continue;
    const double gain = sim.result.tokens_per_s / best.result.tokens_per_s - 1;
    if (gain < kReliefMinGain) continue;
    Relief rl;
    rl.change = change;
    rl.tokens_per_s = sim.result.tokens_per_s;
    rl.gain = gain;
    for (const TierNeed& x : tier_needs(n, s.caps))
      if (x.short_by() > 0) rl.needs += (rl.needs.empty() ? "" : " and ") + tier_more_text(x.tier, x.short_by());
    rl.tier = tier;
    rl.more_bytes = more;
    found.push_back(rl);
  }
  // Keep the changes no other one beats on both gain and price.
  for (const Relief& a : found) {
    bool beaten = false;
    for (const Relief& b : found)
      if (&a != &b && b.tier == a.tier && b.gain >= a.gain && b.more_bytes <= a.more_bytes &&
          (b.gain > a.gain || b.more_bytes < a.more_bytes))
        beaten = true;
    if (!beaten) res.relief.push_back(a);
  }
}

// The best plan simulated as `p` on `on`; a relief when it gains enough.
void try_relief(SearchResult& res, const Space& s, const Plan& p, const HardwareProfile& on, const std::string& change,
                const std::string& needs) {
  auto r = sim::simulate(p, s.model, on);
  ++res.stats.relief_simulations;
  if (!r.ok() || !r->feasible || r->tokens_per_s <= res.best.result.tokens_per_s * (1 + kReliefMinGain)) return;
  Relief rl;
  rl.change = change;
  rl.tokens_per_s = r->tokens_per_s;
  rl.gain = r->tokens_per_s / res.best.result.tokens_per_s - 1;
  rl.needs = needs;
  res.relief.push_back(rl);
}

// Policy: lossy state formats, where the optimizer or the state traffic limits the step.
void format_relief(SearchResult& res, const Space& s) {
  const std::string& bn = res.best.result.bottleneck;
  const bool state_bound = bn == "cpu" || bn == "nvme_read" || bn == "nvme_write" || bn == "host_memory";
  const bool bf16_allowed = std::find(s.formats.begin(), s.formats.end(), StateFormat::kBf16) != s.formats.end();
  if (!state_bound || bf16_allowed) return;
  Plan p = res.best.plan;
  p.optimizer.m_format = StateFormat::kBf16;
  p.optimizer.v_format = StateFormat::kBf16;
  try_relief(res, s, p, s.rig, "bf16 optimizer states (m/v bf16/bf16; lossy)", "the policy to allow them: --state-formats fp32,bf16");
}

// Hardware: twice the bottleneck resource.
void hardware_relief(SearchResult& res, const Space& s) {
  const std::string& bn = res.best.result.bottleneck;
  if (bn == "gpu" || bn == "none" || bn.empty()) return;
  const HardwareProfile& rig = s.rig;
  HardwareProfile faster = rig;
  std::string what;
  if (bn == "h2d" || bn == "d2h") {
    for (auto* curve : {&faster.links.h2d.pinned_bandwidth, &faster.links.d2h.pinned_bandwidth})
      for (auto& pt : curve->points) pt.second *= 2;
    what = "a host link with twice the bandwidth";
  } else if ((bn == "nvme_read" || bn == "nvme_write") && !rig.storage.empty()) {
    NvmeSpec extra = rig.storage.front();
    extra.name += " (second copy)";
    extra.path += "-extra";
    faster.storage.push_back(extra);
    what = "one more " + rig.storage.front().name.substr(0, rig.storage.front().name.find(" (")) + " drive";
  } else if (bn == "cpu") {
    faster.host.cores *= 2;
    for (auto& a : faster.host.adam) a.params_per_s.value *= 2;
    what = "twice the optimizer throughput (cores)";
  } else if (bn == "host_memory") {
    faster.host.memory_bandwidth.value *= 2;
    what = "twice the host memory bandwidth";
  }
  if (what.empty()) return;
  Plan p = res.best.plan;
  if (bn == "nvme_read" || bn == "nvme_write") {
    p.placement.nvme_dirs.clear();
    for (const auto& d : faster.storage) p.placement.nvme_dirs.push_back(d.path);
  }
  try_relief(res, s, p, faster, "the same plan", what);
}

}  // namespace

void add_relief(SearchResult& res, const Space& s, std::vector<Structural> blocked) {
  blocked_relief(res, s, std::move(blocked));
  format_relief(res, s);
  hardware_relief(res, s);
}

}  // namespace megatrain::planner::detail

// The search's words: knob phrases, plan differences, why a runner-up lost, the bottleneck and the
// "nothing fits" paragraph (detail/explain.h).
#include "detail/explain.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <utility>

#include "megatrain/core/units.h"

namespace megatrain::planner {
namespace detail {
namespace {

std::string ckpt_phrase(const Plan& p) {
  if (p.schedule.checkpoint_every == 0) return "none (every activation kept, no recompute)";
  return "every " + std::to_string(p.schedule.checkpoint_every) + " layer" + (p.schedule.checkpoint_every == 1 ? "" : "s") +
         " on " + name(p.schedule.checkpoint_location);
}

std::string stall_label(const std::string& s) {
  if (s == "buffer") return "transfers waiting for a free device buffer";
  if (s == "weights") return "GPU waiting for weights";
  if (s == "optimizer") return "GPU waiting for the optimizer";
  if (s == "activations") return "GPU waiting for activations";
  if (s == "checkpoint_copy") return "GPU waiting for checkpoint copies";
  return "GPU waiting (" + s + ")";
}

}  // namespace

std::string fmt_pct(double f) {
  char b[32];
  std::snprintf(b, sizeof b, std::fabs(f) < 0.001 && f != 0 ? "%.3f%%" : "%.1f%%", 100 * f);
  return b;
}

// "replicated on 8 ranks, gradients summed with NCCL", "sharded over 8 ranks", "shared per node (8 ranks
// each)"; "" for one rank.
std::string host_state_phrase(const Plan& p) {
  const ParallelConfig& c = p.parallel;
  if (c.data_parallel <= 1) return "";
  const std::string sums = c.collective == "nccl" ? ", gradients summed with NCCL" : "";
  if (node_shares_host_state(c)) return "shared per node (" + std::to_string(c.ranks_per_node) + " ranks each)" + sums;
  return c.host_state + (c.host_state == "sharded" ? " over " : " on ") + std::to_string(c.data_parallel) + " ranks" + sums;
}

std::vector<std::pair<std::string, std::string>> knob_phrases(const Plan& p) {
  return {
      {"micro-batch", std::to_string(p.training.micro_batch) + " x " + std::to_string(p.training.grad_accum)},
      {"order", name(p.schedule.order)},
      {"prefetch", std::to_string(p.schedule.prefetch_depth) + " (" + std::to_string(p.schedule.device_layer_buffers) + " buffers)"},
      {"checkpoints", ckpt_phrase(p)},
      {"master weights in", p.placement.master_weights == Tier::kNvme ? "NVMe" : "RAM"},
      {"optimizer states in", p.placement.optimizer_states == Tier::kNvme ? "NVMe" : "RAM"},
      {"m/v", std::string(state_format_name(p.optimizer.m_format)) + "/" + state_format_name(p.optimizer.v_format)},
      {"transfer", dtype_name(p.precision.transfer)},
      {"optimizer threads", std::to_string(p.optimizer.threads)},
      {"pinned staging", p.placement.pinned_staging_bytes > 0 ? format_bytes(static_cast<double>(p.placement.pinned_staging_bytes)) : ""},
      {"host state", host_state_phrase(p)},
  };
}

std::string diff_text(const Plan& a, const Plan& ref, bool with_ref) {
  const auto pa = knob_phrases(a), pr = knob_phrases(ref);
  std::string out;
  for (size_t i = 0; i < pa.size(); ++i) {
    if (pa[i].second == pr[i].second || pa[i].first == "pinned staging" || pa[i].first == "optimizer threads") continue;
    if (!out.empty()) out += "; ";
    out += pa[i].first + " " + pa[i].second;
    if (with_ref) out += " instead of " + pr[i].second;
  }
  return out.empty() ? "the same knobs" : out;
}

std::string resource_label(const std::string& r) {
  static const std::map<std::string, std::string> names = {
      {"gpu", "GPU compute"}, {"h2d", "H2D transfers"}, {"d2h", "D2H transfers"}, {"cpu", "the CPU optimizer"},
      {"host_memory", "host memory bandwidth"}, {"nvme_read", "NVMe reads"}, {"nvme_write", "NVMe writes"},
      {"none", "nothing"}};
  auto it = names.find(r);
  return it == names.end() ? r : it->second;
}

std::string upper_label(const std::string& r) {
  static const std::map<std::string, std::string> names = {
      {"gpu", "GPU"}, {"h2d", "H2D"}, {"d2h", "D2H"}, {"cpu", "CPU-optimizer"}, {"host_memory", "host-memory"},
      {"nvme_read", "NVMe-read"}, {"nvme_write", "NVMe-write"}, {"none", "nothing"}};
  auto it = names.find(r);
  return it == names.end() ? r : it->second;
}

namespace {

// The stall that grew most from `best` to `alt` and by how much; empty when none grew by more than
// 0.1% of the best step.
std::pair<std::string, double> grown_stall(const Candidate& alt, const Candidate& best) {
  std::string worst;
  double grow = 0;
  for (const auto& [k, v] : alt.result.stalls) {
    auto it = best.result.stalls.find(k);
    const double d = v - (it == best.result.stalls.end() ? 0 : it->second);
    if (d > grow) {
      grow = d;
      worst = k;
    }
  }
  if (grow <= 1e-3 * best.result.step_time_s) return {"", 0.0};
  return {worst, grow};
}

// What the order comparison says when the two bests are bound by different resources.
std::string stall_growth_text(const Candidate& alt, const Candidate& best) {
  const auto [worst, grow] = grown_stall(alt, best);
  if (!worst.empty()) return "the stall that grew most is +" + format_duration(grow) + " " + stall_label(worst);
  return "no stall grew; the step is " + format_duration(alt.result.step_time_s - best.result.step_time_s) + " longer";
}

}  // namespace

std::string loss_cause(const Candidate& alt, const Candidate& best) {
  if (alt.result.bottleneck != best.result.bottleneck) return upper_label(alt.result.bottleneck) + "-bound";
  const auto [worst, grow] = grown_stall(alt, best);
  if (!worst.empty()) return "+" + format_duration(grow) + " " + stall_label(worst);
  return "+" + format_duration(alt.result.step_time_s - best.result.step_time_s) + " per step, " +
         upper_label(alt.result.bottleneck) + "-bound like the best";
}

std::string why_lost(const Candidate& alt, const Candidate& best) {
  const double slower = 1 - alt.result.tokens_per_s / best.result.tokens_per_s;
  return fmt_pct(std::max(0.0, slower)) + " slower: " + loss_cause(alt, best) + "; " + diff_text(alt.plan, best.plan);
}

std::vector<Candidate> alternatives_of(const std::vector<Candidate>& simulated, const std::vector<size_t>& group,
                                       size_t best_i, int top) {
  std::map<size_t, size_t> group_best;  // structure -> simulated index
  for (size_t i = 0; i < simulated.size(); ++i) {
    auto it = group_best.find(group[i]);
    if (it == group_best.end() || simulated[i].result.step_time_s < simulated[it->second].result.step_time_s)
      group_best[group[i]] = i;
  }
  std::vector<size_t> order;
  for (const auto& [g, i] : group_best)
    if (g != group[best_i]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return simulated[a].result.step_time_s != simulated[b].result.step_time_s
               ? simulated[a].result.step_time_s < simulated[b].result.step_time_s
               : a < b;
  });
  std::vector<Candidate> out;
  for (size_t j = 0; j < order.size() && static_cast<int>(j) < top; ++j) {
    Candidate c = simulated[order[j]];
    c.why = why_lost(c, simulated[best_i]);
    out.push_back(std::move(c));
  }
  return out;
}

std::string order_text(const Candidate& best, const Candidate& other, double link_bytes_per_s, double peak_flops_per_s) {
  const sim::SimResult& b = best.result;
  const sim::SimResult& o = other.result;
  const std::string win = name(best.plan.schedule.order), lose = name(other.plan.schedule.order);
  char line[512];
  const double ratio = b.tokens_per_s / o.tokens_per_s;
  if (ratio >= 1.995) std::snprintf(line, sizeof line, "%.1fx as fast", ratio);
  else std::snprintf(line, sizeof line, "%s faster", fmt_pct(ratio - 1).c_str());
  std::ostringstream t;
  t << win << " wins: " << static_cast<int64_t>(std::llround(b.tokens_per_s)) << " tokens/s against "
    << static_cast<int64_t>(std::llround(o.tokens_per_s)) << " for the best " << lose << " plan ("
    << diff_text(other.plan, best.plan, false) << "), " << line << ". ";
  // Link traffic per FLOP of model work: the weights down (every expert) and the gradients up, each
  // once per step in layer-major order and once per micro-batch in microbatch-major; against what
  // one direction of the link carries per FLOP of the GPU's peak.
  auto per_kflop = [](double bytes, double flops) { return flops > 0 ? 1e3 * bytes / flops : 0.0; };
  std::snprintf(line, sizeof line,
                "Per step, weights down %s and gradients up %s (%.3g and %.3g bytes per kFLOP) against %s and %s (%.3g and %.3g); ",
                format_bytes(b.weight_bytes_per_step).c_str(), format_bytes(b.gradient_bytes_per_step).c_str(),
                per_kflop(b.weight_bytes_per_step, b.flops_per_step), per_kflop(b.gradient_bytes_per_step, b.flops_per_step),
                format_bytes(o.weight_bytes_per_step).c_str(), format_bytes(o.gradient_bytes_per_step).c_str(),
                per_kflop(o.weight_bytes_per_step, o.flops_per_step), per_kflop(o.gradient_bytes_per_step, o.flops_per_step));
  t << line;
  std::snprintf(line, sizeof line, "the link carries %.3g bytes per kFLOP of the GPU's peak each way. ",
                per_kflop(link_bytes_per_s, peak_flops_per_s));
  t << line;
  // What decides it: the link when the loser carries more traffic per FLOP and either is bound by
  // the link or holds at least half of the time it loses on the link's lanes of its critical path
  // (a step can be labelled CPU-bound with D2H a close second); else whatever grew (the placement
  // and checkpoints each order can afford on the tiers).
  const double traffic_b = (b.weight_bytes_per_step + b.gradient_bytes_per_step) / b.flops_per_step;
  const double traffic_o = (o.weight_bytes_per_step + o.gradient_bytes_per_step) / o.flops_per_step;
  auto on_link = [](const sim::SimResult& r) {
    double x = 0;
    for (const char* lane : {"h2d", "d2h"})
      if (auto it = r.critical_path.find(lane); it != r.critical_path.end()) x += it->second;
    return x;
  };
  const double lost = o.step_time_s - b.step_time_s;
  const double link_grew = on_link(o) - on_link(b);
  const bool link_bound = o.bottleneck == "h2d" || o.bottleneck == "d2h";
  const std::string bounds = o.bottleneck == b.bottleneck
                                 ? "both plans are " + upper_label(o.bottleneck) + "-bound"
                                 : "the " + lose + " plan is " + upper_label(o.bottleneck) + "-bound, the " + win + " plan " +
                                       upper_label(b.bottleneck) + "-bound";
  if (traffic_o > traffic_b && (link_bound || (lost > 0 && link_grew >= 0.5 * lost)))
    t << "Link traffic per FLOP decides it: " << bounds << ", and the " << lose << " plan's critical path holds "
      << format_duration(on_link(o)) << " on the link (H2D and D2H) against " << format_duration(on_link(b))
      << "; it loses " << format_duration(lost) << " per step.";
  else if (o.bottleneck != b.bottleneck)
    t << "Link traffic does not decide it: " << bounds << "; " << stall_growth_text(other, best) << ".";
  else
    t << "Link traffic does not decide it: " << bounds << ", and the " << lose << " plan loses by " << loss_cause(other, best)
      << ".";
  return t.str();
}

std::string bottleneck_text(const sim::SimResult& r) {
  const double busy = r.busy.count(r.bottleneck) ? r.busy.at(r.bottleneck) : 0;
  const double cp = r.critical_path.count(r.bottleneck) ? r.critical_path.at(r.bottleneck) : 0;
  std::ostringstream t;
  t << upper_label(r.bottleneck) << "-bound: " << resource_label(r.bottleneck) << " holds " << format_duration(cp)
    << " of the " << format_duration(r.step_time_s) << " step's critical path (busy " << fmt_pct(busy) << ")";
  if (r.bottleneck == "gpu") t << "; MFU " << fmt_pct(r.mfu);
  double stall_total = 0;
  for (const auto& [k, v] : r.stalls)
    if (k != "buffer") stall_total += v;
  if (stall_total > 0) t << "; the GPU waits " << format_duration(stall_total) << " per step";
  return t.str();
}

std::string infeasible_reason(const SearchResult& res, const std::string& rig_name, const Unfit& u) {
  const bool target_missed = u.structures_fit > 0 && u.target;
  std::ostringstream why;
  why << (target_missed ? "no plan reaches the target: " : "nothing fits: ") << res.model_name << " at seq " << u.seq << ", "
      << u.tokens << " tokens per step on rig '" << rig_name << "'.";
  if (!res.closest_needs.empty()) {
    why << " The closest plan (" << res.closest_description << ") is short of:";
    bool any = false;
    for (const TierNeed& t : res.closest_needs) {
      if (t.short_by() <= 0) continue;
      why << (any ? ";" : "") << " " << t.tier << " needs " << format_bytes(t.need) << ", has " << format_bytes(t.have)
          << ", short by " << format_bytes(t.short_by()) << " (" << static_cast<int64_t>(std::ceil(t.short_by())) << " bytes)";
      any = true;
    }
    why << ".";
  }
  if (!res.least_needs.empty()) {
    why << " The least any plan needs, tier by tier:";
    for (size_t i = 0; i < res.least_needs.size(); ++i) {
      const TierNeed& t = res.least_needs[i];
      why << (i ? "," : "") << " " << t.tier << " " << format_bytes(t.need) << " (has " << format_bytes(t.have) << ")";
    }
    why << ".";
  }
  if (target_missed)
    why << " " << u.structures_fit << " structures fit, but none can reach " << u.target_tokens_per_s
        << " tokens/s: the fastest lower bound is " << static_cast<double>(u.tokens) / u.fastest_bound_s << " tokens/s.";
  if (!res.refusals.empty()) why << " The simulator refused every plan that fitted statically, e.g. " << res.refusals.front();
  if (!u.has_nvme) why << " The rig has no NVMe drives, so every state must sit in RAM.";
  return why.str();
}

}  // namespace detail

std::string describe_knobs(const Plan& plan) {
  std::string out;
  for (const auto& [k, v] : detail::knob_phrases(plan)) {
    if (v.empty()) continue;
    if (!out.empty()) out += ", ";
    out += k + " " + v;
  }
  return out;
}

}  // namespace megatrain::planner

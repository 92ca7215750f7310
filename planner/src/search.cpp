// Plan search: enumerate the knobs, drop what cannot fit (the compiled step's footprint per tier,
// the figures the simulator checks and the executor allocates), drop what a fitting twin
// dominates, order the rest by a compute-only lower bound on the step time and simulate
// best-first until no remaining candidate can beat the best found. The rules, and why each is
// safe, are in docs/planner.md. The parts: candidates.cpp (the request and the knobs, sized with
// sizing.cpp), pruning.cpp, explain.cpp, relief.cpp and report.cpp.
#include "megatrain/planner/search.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "detail/candidates.h"
#include "detail/explain.h"
#include "detail/pruning.h"
#include "detail/relief.h"
#include "detail/sizing.h"
#include "megatrain/core/units.h"

namespace megatrain::planner {
namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;

constexpr size_t kRefusalsKept = 5;

void note_refusal(SearchResult& res, const Plan& plan, const std::string& reason) {
  ++res.stats.refused;
  if (res.refusals.size() < kRefusalsKept) res.refusals.push_back(describe_knobs(plan) + ": " + reason);
}

// Every simulated plan that the simulator accepted, in evaluation order, with its structure.
struct Simulated {
  std::vector<Candidate> cands;
  std::vector<size_t> group;  // index into the feasible structures
  size_t best_i = 0;
};

// Rig sizing without a target: the static bytes say a candidate fits; the simulator must agree for
// one of the first few (it also refuses a schedule that deadlocks on device memory).
Status check_feasibility(const Space& s, std::vector<Structural>& feasible, SearchResult& res) {
  res.feasible = false;
  for (size_t si = 0; si < feasible.size() && si < 16 && !res.feasible; ++si) {
    MT_ASSIGN_OR_RETURN(Trial t, simulate_plan(make_plan(at_prefetch(feasible[si].k, 1), s), s.model, s.rig, feasible[si].lb));
    ++res.stats.simulated;
    if (!t.feasible) {
      note_refusal(res, t.cand.plan, t.reason);
      continue;
    }
    res.best = std::move(t.cand);
    res.feasible = true;
  }
  if (!res.feasible) feasible.clear();
  return {};
}

// Best-first by lower bound: each structure at prefetch depth 1, 2, ... (buffers max(K + 1, c + K),
// or every count from the minimum when exhaustive) until a deeper prefetch is refused or gains
// nothing; stops when the next bound cannot beat the best (or the target) found.
Status simulate_best_first(const Space& s, const std::vector<Structural>& feasible, SearchResult& res, Simulated& out) {
  const SearchOptions& opt = s.opt;
  double best_time = std::numeric_limits<double>::infinity();
  // With a target, a candidate whose lower bound misses it is skipped like one that cannot win.
  const double target_time = opt.stop_at_tokens_per_s > 0 ? static_cast<double>(s.tokens) / opt.stop_at_tokens_per_s
                                                           : std::numeric_limits<double>::infinity();
  auto cut = [&] { return std::min(best_time, target_time) * (1 - opt.tolerance); };
  for (size_t si = 0; si < feasible.size(); ++si) {
    const Structural& st = feasible[si];
    if (!opt.exhaustive && st.lb >= cut()) {
      for (size_t r = si; r < feasible.size(); ++r) res.stats.bounded += feasible[r].kmax;
      return {};
    }
    double k_time = std::numeric_limits<double>::infinity();  // best step time of this structure so far
    for (int64_t K = 1; K <= st.kmax; ++K) {
      if (!opt.exhaustive && st.lb >= cut()) {
        res.stats.bounded += st.kmax - K + 1;
        break;
      }
      const int64_t c = st.k.ckpt_every;
      const LayerBufferRange range = layer_buffer_range(K, c);
      const int64_t b_lo = range.least, b_hi = range.most;
      bool plateau = false, refused = false;
      const double prev_k_time = k_time;
      for (int64_t B = opt.exhaustive ? b_lo : b_hi; B <= b_hi; ++B) {
        Knobs k = st.k;
        k.prefetch = K;
        k.buffers = B;
        const Plan plan = make_plan(k, s);
        auto t = simulate_plan(plan, s.model, s.rig, st.lb);
        if (!t.ok()) return t.status().with_context("simulating " + describe_knobs(plan));
        ++res.stats.simulated;
        if (!t->feasible) {
          note_refusal(res, plan, t->reason);
          refused = true;
          continue;
        }
        const double time = t->cand.result.step_time_s;
        plateau = plateau || time >= prev_k_time * (1 - 1e-9);
        k_time = std::min(k_time, time);
        if (time < best_time) {
          best_time = time;
          out.best_i = out.cands.size();
        }
        out.cands.push_back(std::move(t->cand));
        out.group.push_back(si);
        if (opt.stop_at_tokens_per_s > 0 && out.cands.back().result.tokens_per_s >= opt.stop_at_tokens_per_s) return {};
      }
      // A deeper prefetch holds more device memory: it is refused too.
      if (!opt.exhaustive && refused && K < st.kmax) {
        res.stats.infeasible += st.kmax - K;
        break;
      }
      // Prefetch plateau: when one more layer of prefetch gained nothing, the search stops
      // deepening (docs/planner.md).
      if (!opt.exhaustive && plateau && K < st.kmax) {
        res.stats.dominated += st.kmax - K;
        break;
      }
    }
  }
  return {};
}

// Fills the alternatives table: the structures the bound skipped, in lower-bound order, each at
// the prefetch depth that serves it best (they cannot win; the table says by how much).
void fill_table(const Space& s, const std::vector<Structural>& feasible, SearchResult& res, Simulated& sim) {
  const int top = s.req.top;
  // Group ids at or past feasible.size() are structures the order comparison simulated.
  std::vector<bool> seen(feasible.size(), false);
  const std::set<size_t> groups(sim.group.begin(), sim.group.end());
  for (size_t si : groups)
    if (si < seen.size()) seen[si] = true;
  size_t have = groups.size();
  int64_t extra = 0;
  for (size_t si = 0; si < feasible.size() && have < static_cast<size_t>(top) + 1 && extra < 4 * top + 8; ++si) {
    if (seen[si]) continue;
    double prev = std::numeric_limits<double>::infinity();
    bool any = false;
    for (int64_t K = 1; K <= std::min<int64_t>(feasible[si].kmax, 4); ++K) {
      auto t = simulate_plan(make_plan(at_prefetch(feasible[si].k, K), s), s.model, s.rig, feasible[si].lb);
      ++extra;
      ++res.stats.table_simulations;
      if (!t.ok() || !t->feasible) break;
      const double time = t->cand.result.step_time_s;
      sim.cands.push_back(std::move(t->cand));
      sim.group.push_back(si);
      any = true;
      if (time >= prev * (1 - 1e-9)) break;
      prev = time;
    }
    if (any) ++have;
  }
}

// Layer-major against microbatch-major. The search above finds the best plan; the order it did not
// pick gets its own exact best-first search among its candidates (every structure of that order
// that fits, with the RAM-placement and bf16-transfer dominance only), whose plans join the
// simulated set. Then the best of each order is compared. `pre` is every fitting structure before
// dominance. With `exhaustive` every candidate was simulated already.
Status compare_orders(const Space& s, const std::vector<Structural>& pre, const std::vector<Structural>& feasible,
                      SearchResult& res, Simulated& sim) {
  const bool best_layer_major = sim.cands[sim.best_i].plan.schedule.order == ScheduleOrder::kLayerMajor;
  size_t other_structures = 0;
  if (!s.opt.exhaustive) {
    std::vector<Structural> other;
    for (const Structural& st : pre)
      if (st.k.layer_major != best_layer_major) other.push_back(st);
    other_structures = other.size();
    int64_t dropped = 0;
    drop_dominated_twins(other, s.compute, false, dropped);
    order_by_bound(other, s);
    SearchResult scratch;
    Simulated sub;
    MT_RETURN_IF_ERROR(simulate_best_first(s, other, scratch, sub));
    res.stats.order_simulations += scratch.stats.simulated;
    res.stats.refused += scratch.stats.refused;
    // Merge, a structure keeping one group id whichever search simulated it.
    std::map<size_t, size_t> group_of;  // enumeration index -> group id
    for (size_t i = 0; i < feasible.size(); ++i) group_of[feasible[i].index] = i;
    for (size_t i = 0; i < sub.cands.size(); ++i) {
      const size_t index = other[sub.group[i]].index;
      auto it = group_of.find(index);
      const size_t g = it != group_of.end() ? it->second : feasible.size() + index;
      sim.cands.push_back(std::move(sub.cands[i]));
      sim.group.push_back(g);
      if (sim.cands.back().result.step_time_s < sim.cands[sim.best_i].result.step_time_s) sim.best_i = sim.cands.size() - 1;
    }
  } else {
    for (const Structural& st : pre) other_structures += st.k.layer_major != best_layer_major ? 1 : 0;
  }
  // The best of each order among everything simulated.
  const bool winner_layer_major = sim.cands[sim.best_i].plan.schedule.order == ScheduleOrder::kLayerMajor;
  const Candidate* other = nullptr;
  for (const Candidate& c : sim.cands)
    if ((c.plan.schedule.order == ScheduleOrder::kLayerMajor) != winner_layer_major &&
        (!other || c.result.step_time_s < other->result.step_time_s))
      other = &c;
  OrderComparison& o = res.order;
  o.compared = true;
  const Candidate& best = sim.cands[sim.best_i];
  const std::string win = name(best.plan.schedule.order);
  const std::string lose = winner_layer_major ? "microbatch-major" : "layer-major";
  if (!other) {
    o.text = win + " is the only order that runs: " +
             (other_structures == 0 ? "no " + lose + " plan fits the rig's tiers"
                                    : "the simulator refused every " + lose + " plan that fitted statically");
    return {};
  }
  o.other_fits = true;
  o.other = *other;
  o.speedup = best.result.tokens_per_s / other->result.tokens_per_s;
  // The link's plateau rate (a whole layer's transfer) against the GPU's peak.
  const auto& link = s.rig.links.h2d.pinned_bandwidth.points;
  const double link_rate = link.empty() ? 0 : link.back().second;
  o.text = order_text(best, *other, link_rate, sim::CostModel(best.plan, s.model, s.rig).matmul_peak());
  return {};
}

void add_request_assumptions(const Space& s, SearchResult& res) {
  res.assumptions.push_back("tokens per step " + std::to_string(s.tokens) + " = " +
                            (s.ranks > 1 ? std::to_string(s.ranks) + " ranks x " : std::string()) + std::to_string(s.sequences) +
                            " sequences of " + std::to_string(s.seq) + " tokens" +
                            (s.req.tokens_per_step > 0 ? "" : " (default: 64 sequences)"));
  if (s.ranks > 1)
    res.assumptions.push_back("data parallel: " + std::to_string(s.ranks) + " ranks, " + std::to_string(s.ranks_per_node) +
                              " per node; each rank's share of its node and the collectives as docs/cost-model.md models them; "
                              "host state replicated, sharded or shared per node, whichever is faster");
  std::string f;
  for (StateFormat x : s.formats) f += (f.empty() ? "" : ", ") + std::string(state_format_name(x));
  res.assumptions.push_back(std::string("compute ") + dtype_name(s.compute) + ", fp32 master weights; optimizer-state formats allowed: " + f);
}

// Nothing fits (or, with a target, nothing reaches it): per tier, with numbers.
void explain_unfit(const Space& s, const Enumeration& e, const std::vector<Structural>& feasible, SearchResult& res) {
  if (e.closest) {
    res.closest_needs = tier_needs(e.closest->needs, s.caps);
    res.closest_description = describe_knobs(make_plan(at_prefetch(e.closest->k, 1), s));
  }
  if (e.least.device != std::numeric_limits<int64_t>::max()) res.least_needs = tier_needs(e.least, s.caps);
  Unfit u;
  u.seq = s.seq;
  u.tokens = s.tokens;
  u.target = s.opt.stop_at_tokens_per_s > 0;
  u.target_tokens_per_s = s.opt.stop_at_tokens_per_s;
  u.structures_fit = feasible.size();
  u.fastest_bound_s = feasible.empty() ? 0 : feasible.front().lb;
  u.has_nvme = s.has_nvme;
  if (u.target && !feasible.empty()) {
    res.target_missed = true;
    res.target_bound_tokens_per_s = static_cast<double>(s.tokens) / u.fastest_bound_s;
  }
  res.infeasible_reason = infeasible_reason(res, s.rig.name, u);
}

Result<SearchResult> search_plan_once(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                                      const SearchOptions& opt) {
  const auto t_start = Clock::now();
  SearchResult res;
  res.model_name = model.name().empty() ? model.config().model_type : model.name();
  res.rig_name = rig.name;
  auto finish = [&]() -> Result<SearchResult> {
    res.stats.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    return std::move(res);
  };

  MT_ASSIGN_OR_RETURN(Space s, resolve_request(model, rig, req, opt, res));
  res.stats.dominated += drop_dominated_pairs(s);
  Sizer sizer(s);
  MT_ASSIGN_OR_RETURN(Enumeration e, enumerate_candidates(s, sizer, res.stats));
  std::vector<Structural>& feasible = e.feasible;
  const bool compare = opt.compare_orders && !opt.feasibility_only && opt.stop_at_tokens_per_s <= 0;
  const std::vector<Structural> pre = compare ? feasible : std::vector<Structural>{};
  // D3 (layer-major dominates its microbatch-major twin) is not applied to MoE models: their order
  // is decided by simulating both (docs/planner.md).
  if (!opt.exhaustive) drop_dominated_twins(feasible, s.compute, !model.config().is_moe(), res.stats.dominated);
  order_by_bound(feasible, s);

  Simulated sim;
  if (opt.feasibility_only) {
    MT_RETURN_IF_ERROR(check_feasibility(s, feasible, res));
  } else {
    MT_RETURN_IF_ERROR(simulate_best_first(s, feasible, res, sim));
  }
  add_request_assumptions(s, res);
  if (sim.cands.empty()) {
    res.feasible = opt.feasibility_only && !feasible.empty();
    if (!res.feasible) explain_unfit(s, e, feasible, res);
    return finish();
  }

  if (compare) MT_RETURN_IF_ERROR(compare_orders(s, pre, feasible, res, sim));
  fill_table(s, feasible, res, sim);
  res.feasible = true;
  res.best = sim.cands[sim.best_i];
  res.bottleneck = res.best.result.bottleneck;
  res.alternatives = alternatives_of(sim.cands, sim.group, sim.best_i, req.top);
  res.bottleneck_text = bottleneck_text(res.best.result);
  if (opt.relief) add_relief(res, s, std::move(e.blocked));
  for (const std::string& a : res.best.result.assumptions)
    if (std::find(res.assumptions.begin(), res.assumptions.end(), a) == res.assumptions.end()) res.assumptions.push_back(a);
  return finish();
}

}  // namespace

int64_t default_seq_len(const ModelSpec& model) {
  return std::min<int64_t>(kDefaultSeqCap, model.config().max_position_embeddings);
}

Result<std::vector<StateFormat>> parse_state_format_list(const std::string& text) {
  std::vector<StateFormat> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    auto f = parse_state_format(item);
    if (!f.ok() || item.empty())
      return invalid_argument("state format '" + item + "' is not known; accepted: a comma-separated list of fp32, bf16, q8, q4, q3, q2");
    if (std::find(out.begin(), out.end(), *f) == out.end()) out.push_back(*f);
  }
  if (out.empty()) return invalid_argument("empty list of state formats; accepted: a comma-separated list of fp32, bf16, q8, q4, q3, q2");
  return out;
}

Result<SearchResult> search_plan(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                                 const SearchOptions& opt) {
  MT_ASSIGN_OR_RETURN(SearchResult res, search_plan_once(model, rig, req, opt));
  const Plan& p = res.best.plan;
  if (res.feasible && (p.placement.master_weights == Tier::kNvme || p.placement.optimizer_states == Tier::kNvme)) {
    // Say why state goes to NVMe: the same plan with everything in RAM, as the simulator sees it.
    Plan in_ram = p;
    in_ram.placement.master_weights = Tier::kRam;
    in_ram.placement.optimizer_states = Tier::kRam;
    in_ram.placement.nvme_dirs.clear();
    in_ram.placement.pinned_staging_bytes = 0;
    const std::string what = p.placement.master_weights == Tier::kNvme && p.placement.optimizer_states == Tier::kNvme
                                 ? "master weights and optimizer states"
                             : p.placement.master_weights == Tier::kNvme ? "master weights"
                                                                    : "optimizer states";
    auto r = sim::simulate(in_ram, model, rig);
    if (r.ok() && !r->feasible)
      res.placement_note = what + " go to NVMe because RAM is short: with everything in RAM, " + r->reason + ".";
    else if (r.ok())
      res.placement_note = what + " go to NVMe although RAM would hold them (" +
                           format_bytes(static_cast<double>(r->peak_bytes.ram)) + " of " +
                           format_bytes(static_cast<double>(r->capacity_bytes.ram)) + "): the NVMe plan simulated faster.";
  }
  if (!res.feasible || (p.optimizer.m_format == StateFormat::kFp32 && p.optimizer.v_format == StateFormat::kFp32)) return res;
  // The best plan keeps lossy states: say what they buy against fp32 states.
  SearchRequest fp32 = req;
  fp32.policy.state_formats = {StateFormat::kFp32};
  const std::string fmt = std::string(state_format_name(p.optimizer.m_format)) + "/" + state_format_name(p.optimizer.v_format);
  SearchOptions fp32_opt = opt;
  fp32_opt.compare_orders = false;  // only its best plan is read
  auto alt = search_plan_once(model, rig, fp32, fp32_opt);
  if (alt.ok() && !alt->feasible) {
    res.state_format_note = "the lossy optimizer states (m/v " + fmt + ") are what make this plan fit: with fp32 states nothing fits (" +
                            alt->infeasible_reason + ")";
  } else if (alt.ok()) {
    const double gain = res.best.result.tokens_per_s / alt->best.result.tokens_per_s - 1;
    char b[160];
    std::snprintf(b, sizeof b, "%.1f%% faster than the best plan with fp32 states (%.0f tokens/s)", 100 * gain,
                  alt->best.result.tokens_per_s);
    res.state_format_note = "the lossy optimizer states (m/v " + fmt + ") make this plan " + b;
  }
  return res;
}

}  // namespace megatrain::planner

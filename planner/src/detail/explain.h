// Internal: the search's words. Knob phrases and the difference between two plans, resource and
// stall names, why a runner-up lost to the best, what the best plan's bottleneck means, and the
// per-tier paragraph when nothing fits. Not a public header.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/planner/search.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::planner::detail {

std::string fmt_pct(double f);  // "12.3%", "0.042%"
// (label, value) for each knob, in a fixed order, so two plans can be compared knob by knob.
std::vector<std::pair<std::string, std::string>> knob_phrases(const Plan& p);
// "micro-batch 8 x 8 instead of 4 x 16; prefetch 1 (2 buffers) instead of 2 (3 buffers)"; without
// `with_ref` only a's side ("micro-batch 8 x 8; prefetch 1 (2 buffers)").
std::string diff_text(const Plan& a, const Plan& ref, bool with_ref = true);
std::string resource_label(const std::string& r);  // "H2D transfers"
std::string upper_label(const std::string& r);     // "H2D"

// "3.1% slower: +12 ms GPU waiting for weights; micro-batch 2 x 32 instead of 4 x 16".
std::string why_lost(const Candidate& alt, const Candidate& best);
// The cause alone: "H2D-bound" when the bottlenecks differ, else the stall that grew most, else the
// extra time per step.
std::string loss_cause(const Candidate& alt, const Candidate& best);

// The best of each structure other than the best's, fastest first, at most `top`, each with why it
// lost. `group[i]` is the structure of simulated[i].
std::vector<Candidate> alternatives_of(const std::vector<Candidate>& simulated, const std::vector<size_t>& group,
                                       size_t best_i, int top);

// Which schedule order won and why: both orders' tokens/s, the ratio, and their weight traffic
// per FLOP against what the link delivers per FLOP of the GPU's peak (`link_bytes_per_s`). Then
// what decides it: "Link traffic per FLOP decides it" when `other` moves more bytes per FLOP and
// is link-bound, or its critical path's H2D and D2H time grew by at least half of the step time it
// loses; else "Link traffic does not decide it" with the stall that grew most.
std::string order_text(const Candidate& best, const Candidate& other, double link_bytes_per_s, double peak_flops_per_s);

// "H2D-bound: H2D transfers hold 1.2 s of the 1.3 s step's critical path (busy 97.0%); ...".
std::string bottleneck_text(const sim::SimResult& r);

// The "nothing fits" paragraph: the closest candidate's shortfall per tier, the least any needs,
// a missed target, the simulator's refusals, a rig without NVMe. Reads res (closest_needs,
// least_needs, refusals, target_*) and what the search saw.
struct Unfit {
  int64_t seq = 0, tokens = 0;
  bool target = false;          // SearchOptions::stop_at_tokens_per_s was set
  double target_tokens_per_s = 0;
  size_t structures_fit = 0;    // structures that fitted (statically)
  double fastest_bound_s = 0;   // the best lower bound among them
  bool has_nvme = false;
};
std::string infeasible_reason(const SearchResult& res, const std::string& rig_name, const Unfit& u);

}  // namespace megatrain::planner::detail

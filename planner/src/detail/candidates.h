// Internal: the search's candidates. The request resolved into a Space (sequence, tokens, compute,
// the transfers and format pairs searched, each pair's optimizer threads, the rig's capacities);
// the structural knob combinations in their fixed order; and each one sized with the compiled
// step's footprint (detail/sizing.h), given its staging and its deepest prefetch, and sorted into
// what fits and what a tier blocks. Not a public header.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "search_space.h"
#include "sizing.h"
#include "megatrain/core/status.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::planner::detail {

constexpr int64_t kDefaultSeqCap = 4096;
constexpr int64_t kDefaultSequencesPerStep = 64;
// A plan's bound on training.micro_batch and training.grad_accum (core/src/plan.cpp).
constexpr int64_t kMaxBatchKnob = int64_t{1} << 20;

// Checks the request and resolves it; writes the sequence, tokens per step and the CPU backend's
// assumption into `res`. The format pairs are every pair of the policy's formats, with their
// optimizer threads and Adam rates (pruning.h drops the dominated ones).
Result<Space> resolve_request(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                              const SearchOptions& opt, SearchResult& res);

// Every structural combination (micro-batch, order, checkpoints, placement, transfer, formats),
// in the enumeration order that breaks ties; staging, prefetch and buffers are not set.
std::vector<Knobs> structural_knobs(const Space& s);

struct Enumeration {
  std::vector<Structural> feasible;  // fits every tier at prefetch 1 (all of them when exhaustive)
  std::vector<Structural> blocked;   // over a tier, kept for relief what-ifs
  // When nothing fits: the candidate whose worst tier is least over, and the least need per tier.
  std::optional<Structural> closest;
  step::TierBytes least;
};
// Sizes every structural combination: staging (the largest multiple of one unit's NVMe transfer
// that fits; every multiple when exhaustive), the deepest prefetch the device holds, and whether
// it fits. Counts candidates and the infeasible ones into `stats`.
Result<Enumeration> enumerate_candidates(const Space& s, Sizer& sizer, SearchStats& stats);

// One simulated plan: the candidate (engine dropped, predicted filled in when feasible) or the
// simulator's reason for refusing it.
struct Trial {
  Candidate cand;
  bool feasible = false;
  std::string reason;
};
Result<Trial> simulate_plan(Plan plan, const ModelSpec& model, const HardwareProfile& rig, double lower_bound_s = 0);

Predicted predicted_of(const sim::SimResult& r);

}  // namespace megatrain::planner::detail

// Internal: a candidate's bytes per tier, from the compiled step's footprint (step::compile with
// ops = false, then step::footprint): the figures the simulator checks and the executor allocates.
// The search asks for thousands of candidates that differ in one knob at a time, so the two halves
// of the footprint are memoised on the plan fields each depends on (step::footprint_keys, checked
// against the footprint by tests/step/footprint_key_test.cpp). Not a public header.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "search_space.h"
#include "megatrain/core/status.h"
#include "megatrain/step/schedule.h"

namespace megatrain::planner::detail {

class Sizer {
 public:
  explicit Sizer(const Space& space);
  // The bytes per tier of the candidate's plan (make_plan) at its prefetch depth and buffers.
  // An error only for knobs the plan rules refuse, which the enumeration never builds.
  Result<step::TierBytes> need(const Knobs& k);
  int64_t compiles() const { return compiles_; }

 private:
  // The host half leaves out the arena, which is host memory on the CPU backend
  // (Footprint::ram_arena) and is added from the device half.
  struct Host {
    int64_t pinned = 0, ram_without_arena = 0, nvme = 0;
  };
  Result<step::Footprint> compiled(const Knobs& k, const Plan& plan);

  const Space& space_;
  std::map<int64_t, step::ActivationLayout> layouts_;  // per micro-batch size
  std::map<std::vector<int64_t>, int64_t> device_;     // on step::FootprintKeys::device
  std::map<std::vector<int64_t>, Host> host_;          // on step::FootprintKeys::host
  // step::take_rank_share's change to the footprint, per (host state, m and v formats, transfer, states on nvme)
  std::map<std::tuple<int, int, int, int, bool>, step::TierBytes> rank_share_;
  int64_t compiles_ = 0;
};

// What a need is against the capacities, tier by tier (device, pinned, ram, nvme).
std::vector<TierNeed> tier_needs(const step::TierBytes& n, const step::TierCapacity& c);
bool fits(const step::TierBytes& n, const step::TierCapacity& c);
// How far a candidate is from fitting: its worst tier's need over capacity.
double worst_ratio(const step::TierBytes& n, const step::TierCapacity& c);

}  // namespace megatrain::planner::detail

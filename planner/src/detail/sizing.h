// Internal: a candidate's bytes per tier, from the compiled step's footprint (step::compile with
// ops = false, then step::footprint): the figures the simulator checks and the executor allocates.
// The search asks for thousands of candidates that differ in one knob at a time, so the two halves
// of the footprint are memoised on the knobs each depends on. Not a public header.
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
  // The device arena depends on the micro-batch, the order (resident micro-batches), the
  // checkpoints and the buffers; host memory and the drives on everything but the buffers, except
  // that the CPU backend's arena is host memory too (Footprint::ram_arena).
  using DeviceKey = std::tuple<int64_t, int64_t, bool, int64_t, bool, int64_t>;
  using HostKey = std::tuple<int64_t, int64_t, bool, int64_t, bool, bool, bool, int, int, int, int64_t>;
  struct Host {
    int64_t pinned = 0, ram_without_arena = 0, nvme = 0;
  };
  Result<step::Footprint> compiled(const Knobs& k);

  const Space& space_;
  std::map<int64_t, step::ActivationLayout> layouts_;  // per micro-batch size
  std::map<DeviceKey, int64_t> device_;
  std::map<HostKey, Host> host_;
  int64_t compiles_ = 0;
};

// What a need is against the capacities, tier by tier (device, pinned, ram, nvme).
std::vector<TierNeed> tier_needs(const step::TierBytes& n, const step::TierCapacity& c);
bool fits(const step::TierBytes& n, const step::TierCapacity& c);
// How far a candidate is from fitting: its worst tier's need over capacity.
double worst_ratio(const step::TierBytes& n, const step::TierCapacity& c);

}  // namespace megatrain::planner::detail

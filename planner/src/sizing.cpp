// A candidate's bytes per tier: the compiled step's footprint, memoised (detail/sizing.h).
#include "detail/sizing.h"

#include <algorithm>
#include <limits>

namespace megatrain::planner::detail {

Sizer::Sizer(const Space& space) : space_(space) {}

Result<step::Footprint> Sizer::compiled(const Knobs& k, const Plan& plan) {
  auto it = layouts_.find(k.micro_batch);
  if (it == layouts_.end())
    it = layouts_.emplace(k.micro_batch, step::layout_for(step::backend_of_rig(space_.rig), space_.model, plan)).first;
  MT_ASSIGN_OR_RETURN(step::StepSchedule s, step::compile(plan, space_.model, it->second, {.ops = false, .units = &space_.units}));
  ++compiles_;
  return step::footprint(s, it->second);
}

Result<step::TierBytes> Sizer::need(const Knobs& k) {
  const Plan plan = make_plan(k, space_);
  step::FootprintKeys key = step::footprint_keys(plan);
  auto d = device_.find(key.device);
  auto h = host_.find(key.host);
  if (d == device_.end() || h == host_.end()) {
    MT_ASSIGN_OR_RETURN(step::Footprint f, compiled(k, plan));
    if (d == device_.end()) d = device_.emplace(std::move(key.device), f.peak.device).first;
    if (h == host_.end()) h = host_.emplace(std::move(key.host), Host{f.peak.pinned, f.peak.ram - f.ram_arena, f.peak.nvme}).first;
  }
  const bool arena_in_ram = layouts_.at(k.micro_batch).arena_in_ram;
  step::TierBytes n;
  n.device = d->second;
  n.pinned = h->second.pinned;
  n.ram = h->second.ram_without_arena + (arena_in_ram ? n.device : 0);
  n.nvme = h->second.nvme;
  if (k.host_state > 0) {  // one rank's share (step::take_rank_share): its moments, its part of a shared state
    const auto share_key = std::make_tuple(k.host_state, static_cast<int>(k.m_format), static_cast<int>(k.v_format),
                                     static_cast<int>(k.transfer), k.states_nvme);
    auto it = rank_share_.find(share_key);
    if (it == rank_share_.end()) {
      step::Footprint delta;  // take_rank_share adds the same amounts to any footprint
      step::take_rank_share(delta, plan, space_.model);
      it = rank_share_.emplace(share_key, delta.peak).first;
    }
    n.pinned += it->second.pinned;
    n.ram += it->second.ram;
    n.nvme += it->second.nvme;
  }
  return n;
}

std::vector<TierNeed> tier_needs(const step::TierBytes& n, const step::TierCapacity& c) {
  auto d = [](int64_t v) { return static_cast<double>(v); };
  return {{"device", d(n.device), d(c.device)}, {"pinned", d(n.pinned), d(c.pinned)}, {"ram", d(n.ram), d(c.ram)},
          {"nvme", d(n.nvme), d(c.nvme)}};
}

bool fits(const step::TierBytes& n, const step::TierCapacity& c) {
  return n.device <= c.device && n.pinned <= c.pinned && n.ram <= c.ram && n.nvme <= c.nvme;
}

double worst_ratio(const step::TierBytes& n, const step::TierCapacity& c) {
  double r = 0;
  for (const TierNeed& t : tier_needs(n, c)) {
    if (t.need <= 0) continue;
    r = std::max(r, t.have > 0 ? t.need / t.have : std::numeric_limits<double>::infinity());
  }
  return r;
}

}  // namespace megatrain::planner::detail

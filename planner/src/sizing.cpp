// A candidate's bytes per tier: the compiled step's footprint, memoised (detail/sizing.h).
#include "detail/sizing.h"

#include <algorithm>
#include <limits>

namespace megatrain::planner::detail {

Sizer::Sizer(const Space& space) : space_(space) {}

Result<step::Footprint> Sizer::compiled(const Knobs& k) {
  const Plan plan = make_plan(k, space_);
  auto it = layouts_.find(k.micro_batch);
  if (it == layouts_.end())
    it = layouts_.emplace(k.micro_batch, step::layout_for(step::backend_of_rig(space_.rig), space_.model, plan)).first;
  MT_ASSIGN_OR_RETURN(step::StepSchedule s, step::compile(plan, space_.model, it->second, {.ops = false, .units = &space_.units}));
  ++compiles_;
  return step::footprint(s, it->second);
}

Result<step::TierBytes> Sizer::need(const Knobs& k) {
  const DeviceKey dk{k.micro_batch, k.grad_accum, k.layer_major, k.ckpt_every, k.ckpt_host, k.buffers};
  const HostKey hk{k.micro_batch, k.grad_accum, k.layer_major, k.ckpt_every, k.ckpt_host, k.master_nvme, k.states_nvme,
                   static_cast<int>(k.transfer), static_cast<int>(k.m_format), static_cast<int>(k.v_format), k.staging};
  auto d = device_.find(dk);
  auto h = host_.find(hk);
  if (d == device_.end() || h == host_.end()) {
    MT_ASSIGN_OR_RETURN(step::Footprint f, compiled(k));
    if (d == device_.end()) d = device_.emplace(dk, f.peak.device).first;
    if (h == host_.end()) h = host_.emplace(hk, Host{f.peak.pinned, f.peak.ram - f.ram_arena, f.peak.nvme}).first;
  }
  const bool arena_in_ram = layouts_.at(k.micro_batch).arena_in_ram;
  step::TierBytes n;
  n.device = d->second;
  n.pinned = h->second.pinned;
  n.ram = h->second.ram_without_arena + (arena_in_ram ? n.device : 0);
  n.nvme = h->second.nvme;
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

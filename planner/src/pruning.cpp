// The search's pruning: dominance among format pairs and structural twins, and the lower bound
// (detail/pruning.h; the rules and why each is safe are in docs/planner.md).
#include "detail/pruning.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "megatrain/simulator/step_model.h"

namespace megatrain::planner::detail {

int64_t drop_dominated_pairs(Space& s) {
  if (s.opt.exhaustive || s.pairs.size() <= 1) return 0;
  auto rate = [&](DType t, const FormatPair& p) { return s.adam_rate_for.at(format_key(t, p.m, p.v)); };
  std::vector<FormatPair> kept;
  for (const FormatPair& a : s.pairs) {
    bool dominated = false;
    for (const FormatPair& b : s.pairs) {
      if (a.m == b.m && a.v == b.v) continue;
      const double ab = state_format_bytes_per_element(a.m, 128), av = state_format_bytes_per_element(a.v, 128);
      const double bb = state_format_bytes_per_element(b.m, 128), bv = state_format_bytes_per_element(b.v, 128);
      bool all = bb <= ab && bv <= av;
      bool strict = bb < ab || bv < av;
      for (DType t : s.transfers) {
        all = all && rate(t, b) >= rate(t, a);
        strict = strict || rate(t, b) > rate(t, a);
      }
      if (all && strict) dominated = true;
    }
    if (!dominated) kept.push_back(a);
  }
  const auto dropped = static_cast<int64_t>(s.pairs.size() - kept.size());
  s.pairs = std::move(kept);
  return dropped;
}

void drop_dominated_twins(std::vector<Structural>& feasible, DType compute, bool order_rule, int64_t& dominated) {
  auto key_of = [](const Knobs& k) {
    // Twins differ in the one knob a rule flips: the host state and collective are part of the key.
    return std::make_tuple(k.micro_batch, k.layer_major, k.ckpt_every, k.ckpt_host, k.master_nvme, k.states_nvme,
                           static_cast<int>(k.transfer), static_cast<int>(k.m_format), static_cast<int>(k.v_format), k.host_state,
                           k.nccl);
  };
  std::map<decltype(key_of(Knobs{})), size_t> by_key;
  for (size_t i = 0; i < feasible.size(); ++i) by_key[key_of(feasible[i].k)] = i;
  auto twin_fits = [&](const Knobs& k) { return by_key.count(key_of(k)) > 0; };
  std::vector<Structural> kept;
  for (const Structural& s : feasible) {
    const Knobs& k = s.k;
    bool is_dominated = false;
    // D1: RAM placement has the same tasks minus the NVMe reads and writes.
    if (k.master_nvme) {
      Knobs t = k;
      t.master_nvme = false;
      is_dominated = is_dominated || twin_fits(t);
    }
    if (k.states_nvme) {
      Knobs t = k;
      t.states_nvme = false;
      is_dominated = is_dominated || twin_fits(t);
    }
    // D2: a bf16 transfer moves half the bytes over the link, with the same optimizer bytes.
    if (k.transfer == DType::kFp32 && compute == DType::kBf16) {
      Knobs t = k;
      t.transfer = DType::kBf16;
      is_dominated = is_dominated || twin_fits(t);
    }
    // D3: microbatch-major does the same GPU work and streams the weights grad_accum times.
    if (order_rule && !k.layer_major) {
      Knobs t = k;
      t.layer_major = true;
      is_dominated = is_dominated || twin_fits(t);
    }
    if (is_dominated) {
      dominated += s.kmax;
      continue;
    }
    kept.push_back(s);
  }
  feasible = std::move(kept);
}

// The next step's GPU work and its H2D transfers both lie inside the measured period (the first
// H2D of a step is the embedding's, which waits for its update, which waits for the previous
// step's last GPU task), and a task never runs faster than its full-speed time.
Result<double> lower_bound(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig, const step::UnitTable* units) {
  const sim::CostModel cost(plan, model, rig);
  const double A = static_cast<double>(plan.training.grad_accum);
  const int64_t c = plan.schedule.checkpoint_every;
  // Every layer's own time: MoE and dense layers (and windowed attention) differ.
  const double recompute = c > 0 ? cost.layers_forward_time() : 0;
  const double gpu = A * (cost.layers_forward_time() + cost.layers_backward_time() + recompute + cost.head_time() +
                          cost.embed_forward_time() + cost.embed_backward_time());
  // The H2D queue of the compiled step, each copy at its full-speed time: every unit's weights in
  // the transfer dtype (each layer twice, forward and backward; a tied head's table again), and the
  // host checkpoints' restores in fp32, as the executor moves them.
  const step::ActivationLayout layout = step::layout_for(step::backend_of_rig(rig), model, plan);
  MT_ASSIGN_OR_RETURN(const step::StepSchedule s, step::compile(plan, model, layout, {.units = units}));
  const double tb = static_cast<double>(dtype_bytes(plan.precision.transfer));
  double round = 0;
  for (const step::Transfer& t : s.round.h2d) {
    const double bytes = t.kind == step::Transfer::kWeights ? static_cast<double>(s.unit_numel[static_cast<size_t>(t.unit)]) * tb
                                                            : 4.0 * static_cast<double>(s.buffers.hidden_floats);
    round += cost.h2d_time(bytes);
  }
  return std::max(gpu, s.rounds * round);
}

void order_by_bound(std::vector<Structural>& feasible, const Space& s) {
  for (Structural& c : feasible) {
    auto lb = lower_bound(make_plan(at_prefetch(c.k, 1), s), s.model, s.rig, &s.units);
    c.lb = lb.ok() ? *lb : 0;  // a plan the step cannot compile is refused by its simulation, with the reason
  }
  std::stable_sort(feasible.begin(), feasible.end(), [](const Structural& a, const Structural& b) {
    return a.lb != b.lb ? a.lb < b.lb : a.index < b.index;
  });
}

}  // namespace megatrain::planner::detail

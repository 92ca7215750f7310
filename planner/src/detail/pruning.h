// Internal: the search's pruning (docs/planner.md, "Pruning, in order, and why each is safe"):
// format pairs and structural candidates a fitting twin dominates, and the compute-only lower
// bound on the step time that orders the rest and stops the search. Not a public header.
#pragma once

#include <vector>

#include "search_space.h"

namespace megatrain::planner::detail {

// Drops from s.pairs every pair that another allowed pair dominates: no more bytes per parameter
// and an Adam rate at least as high for every transfer (strictly better in one). Exhaustive
// searches keep them all. Returns how many were dropped.
int64_t drop_dominated_pairs(Space& s);

// Drops every candidate whose fitting twin is at least as fast (D1: RAM placement, D2: bf16
// transfer, D3: layer-major order, only with `order_rule`: MoE models leave the order to the
// simulation); adds the dropped candidates' depths to `dominated`.
void drop_dominated_twins(std::vector<Structural>& feasible, DType compute, bool order_rule, int64_t& dominated);

// A lower bound on the simulated step time of a plan (docs/planner.md, "Lower bound"). The H2D
// side walks the compiled step's H2D queue (every weight load and checkpoint restore, at the bytes
// the executor moves); `units` is the model's step::unit_table, or null to group the tensors here.
Result<double> lower_bound(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig,
                           const step::UnitTable* units = nullptr);
// Gives each candidate its bound at prefetch depth 1 and sorts by it (ties: enumeration order).
void order_by_bound(std::vector<Structural>& feasible, const Space& s);

}  // namespace megatrain::planner::detail

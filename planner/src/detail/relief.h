// Internal: what would relieve the best plan's bottleneck (docs/planner.md, "Relief"): candidates
// a tier blocked, simulated on a rig enlarged by their shortfall; bf16 states where the policy
// forbids them; twice the bottleneck resource. Not a public header.
#pragma once

#include <string>
#include <vector>

#include "search_space.h"

namespace megatrain::planner::detail {

// A relief is reported when it gains at least this fraction.
constexpr double kReliefMinGain = 0.005;

// Fills res.relief for res.best (feasible), counting its simulations into res.stats.
void add_relief(SearchResult& res, const Space& s, std::vector<Structural> blocked);

}  // namespace megatrain::planner::detail

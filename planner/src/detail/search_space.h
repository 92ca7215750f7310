// Internal: the plan search's vocabulary, shared by its parts (search.cpp runs them in order):
// the knobs of one candidate, the resolved request every part reads, and a structural candidate
// (the knobs except prefetch depth and buffers) with its bytes per tier. Not a public header.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/planner/search.h"
#include "megatrain/step/schedule.h"

namespace megatrain::planner::detail {

struct Knobs {
  int64_t micro_batch = 1, grad_accum = 1;
  bool layer_major = true;
  int64_t ckpt_every = 1;
  bool ckpt_host = true;
  bool master_nvme = false, states_nvme = false;
  DType transfer = DType::kBf16;
  StateFormat m_format = StateFormat::kFp32, v_format = StateFormat::kFp32;
  int64_t staging = 0;
  int64_t threads = 1;
  int64_t prefetch = 1, buffers = 2;  // set per simulation
  // data parallelism: parallel.host_state, one of kHostStates, and parallel.collective nccl (GPU
  // rigs, replicated host state) instead of mpi
  int host_state = 0;
  bool nccl = false;
};

// parallel.host_state's values, as Knobs::host_state indexes them.
inline constexpr const char* kHostStates[] = {"replicated", "sharded", "shared"};

// The knobs at prefetch depth K with the buffers the search gives it: max(K + 1, c + K), the count
// at which buffers never bind (docs/planner.md). K = 1 is the least a candidate can run with.
Knobs at_prefetch(Knobs k, int64_t K);

struct FormatPair {
  StateFormat m, v;
};
// Keys of per-(transfer, format pair) tables.
using FormatKey = std::tuple<int, int, int>;
inline FormatKey format_key(DType t, StateFormat m, StateFormat v) {
  return {static_cast<int>(t), static_cast<int>(m), static_cast<int>(v)};
}

// The request, resolved and checked: what every part of the search reads.
struct Space {
  const ModelSpec& model;
  const HardwareProfile& rig;
  const SearchRequest& req;
  const SearchOptions& opt;
  int64_t seq = 0, tokens = 0, sequences = 0;  // tokens: the job's; sequences: one rank's
  int64_t ranks = 1, ranks_per_node = 1;          // data parallelism (SearchRequest::gpus)
  DType compute = DType::kBf16;
  bool cpu = false;                    // the CPU backend (step::backend_of_rig)
  std::vector<DType> transfers;        // transfer precisions searched
  std::vector<StateFormat> formats;    // the policy's state formats
  std::vector<FormatPair> pairs;       // (m, v) pairs searched, after dominance
  std::map<FormatKey, int64_t> threads_for;
  std::map<FormatKey, double> adam_rate_for;
  step::TierCapacity caps;             // step::capacity_of a plan for this rig
  bool has_nvme = false;
  int64_t kmax_all = 1;                // the deepest prefetch searched
  step::UnitTable units;               // the model's tensors grouped by unit, once (step::unit_table)
};

// The plan a candidate writes, for `on` (the rig, or an enlarged copy of it for a what-if): the
// request's references and steps, the knobs, and the device budget the rig can give it.
Plan make_plan(const Knobs& k, const Space& s, const HardwareProfile& on);
inline Plan make_plan(const Knobs& k, const Space& s) { return make_plan(k, s, s.rig); }

// A structural candidate: its bytes per tier at prefetch depth 1 (step::footprint), its lower
// bound on the step time, the deepest prefetch it may take, and its enumeration index (ties).
struct Structural {
  Knobs k;
  step::TierBytes needs;
  double lb = 0;
  int64_t kmax = 1;
  size_t index = 0;
};

}  // namespace megatrain::planner::detail

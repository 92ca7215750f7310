// `megatrain-plan plan`: searches the plan knobs (schedule order, prefetch depth and device
// buffers, micro-batch x accumulation, checkpoint interval and location, RAM/NVMe placement, state
// formats allowed by the user's policy, transfer precision, optimizer threads) for the highest
// simulated tokens/s that fits every tier of a rig. Deterministic branch and bound: each
// candidate's bytes per tier (step::footprint of its compiled step, the figures the simulator
// checks and the executor allocates) prune infeasible candidates before any simulation,
// documented dominance rules prune candidates that cannot be faster than a twin, and a
// compute-only lower bound on the step time skips candidates that cannot beat the best found.
// Every returned plan was simulated and accepted by sim::simulate. The rules and their reasons
// are in docs/planner.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::planner {

// What the user allows; the search never leaves it.
struct SearchPolicy {
  // Formats m and v may take. Full precision (fp32) unless the user names lossy ones.
  std::vector<StateFormat> state_formats = {StateFormat::kFp32};
  // Compute dtype; empty: bf16 on a GPU, fp32 on the CPU backend (the only one it runs).
  std::optional<DType> compute;
};

struct SearchRequest {
  int64_t seq_len = 0;          // 0: min(4096, the model's max_position_embeddings)
  int64_t tokens_per_step = 0;  // 0: 64 sequences; otherwise a multiple of seq_len
  // Sequences per micro-batch: 0 lets the search choose; otherwise fixed (it must divide the step's
  // sequences), as when a user sets per_device_train_batch_size (the Python package).
  int64_t micro_batch = 0;
  int64_t steps = 1000;         // training.steps written into the plan
  // Rows packed "neat" (each document attends only to itself): the documents' length-weighted mean
  // length, written into the plan as training.document_tokens; 0: whole-row contexts.
  double document_tokens = 0;
  // Data parallelism (docs/data-parallel.md): the ranks (GPUs) of the job, min(gpus, the rig's
  // cluster.gpus_per_node) per node. tokens_per_step is the job's; each rank trains 1/gpus of it. With
  // gpus > 1 the search also chooses parallel.host_state (replicated, sharded or shared).
  int64_t gpus = 1;
  // The nodes the ranks spread over (gpus / nodes per node, at most the rig's cluster.gpus_per_node);
  // 0: as few as hold them (min(gpus, gpus_per_node) per node).
  int64_t nodes = 0;
  SearchPolicy policy;
  int top = 5;                  // alternatives reported
  // References written into the plan (a name in profiles/, an absolute path, or an embedded object).
  ProfileRef model_ref;
  ProfileRef rig_ref;
};

struct SearchOptions {
  // A candidate is skipped when its lower bound >= best step time x (1 - tolerance). 0 is exact:
  // only candidates that provably cannot be faster are skipped.
  double tolerance = 0;
  int max_prefetch_depth = 8;
  // Stop as soon as a plan reaches this many tokens/s (0: search for the best). Rig sizing uses it.
  double stop_at_tokens_per_s = 0;
  // No dominance and no bound pruning: simulate every statically feasible candidate, with every
  // buffer count and staging size (tests compare the pruned search with this).
  bool exhaustive = false;
  // Simulate what-if changes that would relieve the bottleneck (a few extra simulations).
  bool relief = true;
  // Only decide whether anything fits statically; simulate nothing (rig sizing without a target).
  bool feasibility_only = false;
  // After the search, find the best plan of the other schedule order too (its own best-first
  // search among that order's candidates), so the report says which order won and by how much.
  bool compare_orders = true;
};

// Bytes one candidate needs per tier (step::footprint), against what the rig has
// (step::capacity_of; the device's is the usable budget, step::usable_device_bytes).
struct TierNeed {
  std::string tier;   // device | pinned | ram | nvme
  double need = 0;
  double have = 0;
  double short_by() const { return need > have ? need - have : 0; }
};

struct Candidate {
  Plan plan;
  sim::SimResult result;  // no engine kept
  double lower_bound_s = 0;
  std::string why;        // for alternatives: why it lost to the best
};

// A change that would relieve the best plan's bottleneck, with its simulated gain and its price.
struct Relief {
  std::string change;         // "micro-batch 8 x 8 instead of 4 x 16"
  double tokens_per_s = 0;    // simulated with the change (on a rig enlarged where it needs more)
  double gain = 0;            // fraction over the best plan's tokens/s
  std::string needs;          // "9.10 GiB more device memory" or a policy/hardware change
  std::string tier;           // tier it needs more of ("" when none)
  double more_bytes = 0;
};

struct SearchStats {
  int64_t candidates = 0;        // (knobs, prefetch depth) combinations enumerated
  int64_t infeasible = 0;        // over a tier's capacity, found without simulating
  int64_t dominated = 0;         // a twin that fits is at least as fast (docs/planner.md)
  int64_t bounded = 0;           // lower bound cannot beat the best found
  int64_t simulated = 0;
  int64_t refused = 0;           // simulated and refused by the simulator
  int64_t table_simulations = 0;  // runners-up the bound skipped, simulated to fill the table
  int64_t relief_simulations = 0;
  int64_t order_simulations = 0;  // the other order's search (SearchOptions::compare_orders)
  double seconds = 0;
};

// Layer-major against microbatch-major: the best plan of each (SearchOptions::compare_orders).
struct OrderComparison {
  bool compared = false;      // the comparison ran
  bool other_fits = false;    // some plan of the other order fits and was simulated
  Candidate other;            // its best plan, when other_fits
  double speedup = 0;         // best tokens/s over the other order's best
  std::string text;           // which order won, by how much, and why (weight traffic per FLOP)
};

struct SearchResult {
  bool feasible = false;
  int64_t seq_len = 0;
  int64_t tokens_per_step = 0;
  std::string model_name;
  std::string rig_name;
  Candidate best;                       // predicted filled in best.plan
  std::vector<Candidate> alternatives;  // runners-up, fastest first, each with `why`
  std::string bottleneck;               // the best plan's bottleneck resource
  std::string bottleneck_text;          // what it means in the step
  std::vector<Relief> relief;
  // When nothing fits: the closest candidate's need per tier, and the least any candidate needs
  // per tier (each tier on its own).
  std::vector<TierNeed> closest_needs;
  std::string closest_description;
  std::vector<TierNeed> least_needs;
  std::vector<std::string> refusals;    // simulator reasons, when it refused what fitted statically
  std::string infeasible_reason;        // one paragraph, per tier, with numbers
  // With SearchOptions::stop_at_tokens_per_s: plans fit, but none can reach the target; the
  // fastest any could be, by the lower bound.
  bool target_missed = false;
  double target_bound_tokens_per_s = 0;
  std::vector<std::string> assumptions;
  // When the best plan keeps m or v in a lossy format: what that format buys, against the best
  // plan with fp32 states ("makes the plan fit" or "x% faster"); empty otherwise.
  std::string state_format_note;
  // When the best plan puts state on NVMe: why (RAM too small, with the simulator's numbers, or
  // faster); empty otherwise.
  std::string placement_note;
  OrderComparison order;
  SearchStats stats;
};

// The default sequence length: min(4096, max_position_embeddings).
int64_t default_seq_len(const ModelSpec& model);

// Parses "fp32,bf16,q8" into formats; the error names the bad entry and the accepted ones.
Result<std::vector<StateFormat>> parse_state_format_list(const std::string& text);

// Runs the search. An invalid request (sequence too long, tokens per step not a multiple of the
// sequence length, a policy the rig cannot run) is an error; a valid request that nothing fits is
// a result with feasible == false and the per-tier explanation.
Result<SearchResult> search_plan(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& request,
                                 const SearchOptions& options = {});

// One line naming a plan's knobs: "micro-batch 4 x 16, layer-major, prefetch 2 (3 buffers), ...".
std::string describe_knobs(const Plan& plan);

// `plan --json`: {"feasible", "plan" (with predicted), "alternatives", "bottleneck", "relief",
// "search", "assumptions"}; when nothing fits: {"feasible": false, "reason", "shortfalls", ...}.
std::string search_json(const SearchResult& result);
// The terminal report.
std::string search_table(const SearchResult& result);

}  // namespace megatrain::planner

namespace megatrain::planner {

// The `megatrain-plan plan` command: the report (or --json) on stdout, errors on stderr. Exit code
// 0 with a plan, 2 when nothing fits (with the per-tier explanation), 1 for a bad request or file.
struct PlanCommand {
  std::string model;
  std::string rig;
  int64_t seq_len = 0;
  int64_t tokens_per_step = 0;
  int64_t micro_batch = 0;            // --micro-batch: 0, the search chooses
  int64_t steps = 1000;
  std::string data;                   // --data: a prepared dataset whose rows the plan is for
  double document_tokens = 0;         // --document-tokens: neat rows' weighted document length
  int64_t gpus = 1;                   // --gpus: data-parallel ranks
  int64_t nodes = 0;                  // --nodes: the nodes they spread over (0: as few as hold them)
  int top = 5;
  std::string output;                 // -o: write the best plan here, atomically
  std::string state_formats = "fp32"; // --state-formats
  std::string compute = "auto";       // --compute auto|bf16|fp32
  double tolerance = 0;               // --tolerance
  bool json = false;
};
int plan_command(const PlanCommand& cmd);

// A name in profiles/ stays a name; an existing path becomes absolute, so that a plan written
// anywhere still finds it.
ProfileRef profile_ref(const std::string& spec);

}  // namespace megatrain::planner

// Plan: the contract between megatrain-plan and megatrain-exec ("schema": "megatrain.plan/1",
// ARCHITECTURE.md section 8). Reading validates every field and names the key path and the
// accepted values on error; writing then reading gives back an equal Plan. Defaults for keys a
// hand-written plan may leave out are documented in docs/plan-format.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"

namespace megatrain {

inline constexpr const char* kPlanSchema = "megatrain.plan/1";

// "model" and "rig" are a name in profiles/, a path, or an embedded JSON object.
struct ProfileRef {
  bool inline_object = false;
  std::string value;  // the name/path, or the embedded object as JSON text
  bool operator==(const ProfileRef&) const = default;
};

// The plan's word-valued fields, parsed into enums when a plan is read. The plan file keeps the
// words (name() gives each enumerator's); enumerators are listed in the order the reading errors
// list the accepted words.
// constant | cosine | linear: warmup (s + 1) / warmup_steps, decay to min_lr at the last step.
// constant-hf | cosine-hf | linear-hf: Hugging Face's get_constant_schedule_with_warmup,
// get_cosine_schedule_with_warmup and get_linear_schedule_with_warmup: warmup s / warmup_steps (the
// first step's rate is 0), decay over steps - warmup_steps to 0 one step after the last.
enum class LrSchedule { kConstant, kCosine, kLinear, kConstantHf, kCosineHf, kLinearHf };
enum class DataOrder { kShuffled, kSequential };                // shuffled | sequential
enum class ScheduleOrder { kLayerMajor, kMicrobatchMajor };     // layer-major | microbatch-major
enum class CheckpointLocation { kDevice, kHost };               // device | host
enum class Tier { kRam, kNvme };                                // ram | nvme (placement of host state)

const char* name(LrSchedule v);
const char* name(DataOrder v);
const char* name(ScheduleOrder v);
const char* name(CheckpointLocation v);
const char* name(Tier v);

// Every enumerator's name, in enumerator order (the accepted words, as errors list them).
const std::vector<std::string>& lr_schedule_names();
const std::vector<std::string>& data_order_names();
const std::vector<std::string>& schedule_order_names();
const std::vector<std::string>& checkpoint_location_names();
const std::vector<std::string>& tier_names();

// Word -> enum. The error reads "<key>: '<word>' is not accepted; accepted: <the words>", the way
// Plan reading words it (less the "did you mean" hint).
Result<LrSchedule> parse_lr_schedule(std::string_view s, std::string_view key = "training.lr_schedule");
Result<DataOrder> parse_data_order(std::string_view s, std::string_view key = "training.data_order");
Result<ScheduleOrder> parse_schedule_order(std::string_view s, std::string_view key = "schedule.order");
Result<CheckpointLocation> parse_checkpoint_location(std::string_view s,
                                                     std::string_view key = "schedule.checkpoint_location");
Result<Tier> parse_tier(std::string_view s, std::string_view key = "tier");

struct TrainingConfig {
  int64_t seq_len = 4096;
  int64_t micro_batch = 1;
  int64_t grad_accum = 1;
  int64_t steps = 1;
  int64_t seed = 1;
  double lr = 3e-4;
  LrSchedule lr_schedule = LrSchedule::kCosine;
  int64_t warmup_steps = 0;
  double min_lr = 0;
  double clip_grad_norm = 1.0;         // 0 turns clipping off
  DataOrder data_order = DataOrder::kShuffled;
  // Rows that pack documents attending only to themselves (data packed "neat"): the documents'
  // length-weighted mean length in tokens (the sum of their squared lengths over the row tokens),
  // which the attention's work scales with instead of seq_len. 0: every row is one context.
  double document_tokens = 0;
  // The keys per query the attention costs as if unmasked (causal halves it): seq_len, or the
  // documents' weighted length in neat rows.
  double attention_span() const { return document_tokens > 0 ? document_tokens : static_cast<double>(seq_len); }
  bool operator==(const TrainingConfig&) const = default;
};

struct PrecisionConfig {
  DType compute = DType::kBf16;
  DType master = DType::kFp32;  // only fp32 is accepted
  DType transfer = DType::kBf16;
  bool operator==(const PrecisionConfig&) const = default;
};

struct ScheduleConfig {
  ScheduleOrder order = ScheduleOrder::kLayerMajor;
  int64_t prefetch_depth = 2;
  int64_t device_layer_buffers = 3;    // layer_buffer_range(prefetch_depth, checkpoint_every).least or more
  int64_t checkpoint_every = 1;        // layers between activation checkpoints; 0 keeps all activations
  CheckpointLocation checkpoint_location = CheckpointLocation::kHost;
  bool operator==(const ScheduleConfig&) const = default;
};

// The device layer buffers a schedule can run with: the one rule the parser, the planner, the
// simulator and the GUI's what-if use. With prefetch depth K and checkpoint interval c:
// - least = max(K + 1, c + 1): the layer being computed plus K loads ahead, and a backward block's c
//   layers held at once plus one to refill (fewer would deadlock the loads);
// - most = max(K + 1, c + K): every load of the prefetch window has a slot of its own through the
//   backward too, so no load waits for a slot; more buffers buy nothing. The planner writes it.
struct LayerBufferRange {
  int64_t least = 2, most = 2;
};
LayerBufferRange layer_buffer_range(int64_t prefetch_depth, int64_t checkpoint_every);

struct PlacementConfig {
  Tier master_weights = Tier::kRam;
  Tier optimizer_states = Tier::kRam;
  std::vector<std::string> nvme_dirs;     // required when anything is on nvme
  int64_t pinned_staging_bytes = 0;
  int64_t device_budget_bytes = 0;        // 0: the rig's whole GPU memory
  int64_t nvme_queue_depth = 32;          // NVMe requests in flight per transfer
  int64_t nvme_block_bytes = 1 << 20;     // NVMe request size (a multiple of 4096)
  bool operator==(const PlacementConfig&) const = default;
};

struct OptimizerConfig {
  std::string type = "adamw";
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  StateFormat m_format = StateFormat::kFp32;
  StateFormat v_format = StateFormat::kFp32;
  int64_t block_size = 128;
  int64_t threads = 0;  // 0: all cores of the rig
  bool operator==(const OptimizerConfig&) const = default;
};

// Data parallelism (docs/data-parallel.md): `data_parallel` ranks, launched by mpirun, each train
// their share of every step's rows and sum their gradients before the update. A plan without the
// section is one rank. The launch must match it: megatrain-exec refuses a plan for N ranks started
// with M, naming both.
struct ParallelConfig {
  int64_t data_parallel = 1;   // ranks in the job
  int64_t ranks_per_node = 1;  // ranks on each node (a divisor of data_parallel); 0 when read: data_parallel
  std::string collective = "mpi";         // what the gradients are summed with: mpi (host memory), nccl (between the GPUs)
  // replicated: every rank keeps the whole training state and makes the whole update; sharded
  // (ZeRO): each rank keeps Adam's moments of the tensors it owns (shard_owners), updates those, and
  // the ranks gather the updated weights; shared: one copy per node, in memory the node's ranks
  // share, of the master weights, the streaming copy and the summed gradients, with each of the
  // node's ranks keeping the moments of its own tensors (shard_owners over ranks_per_node) and
  // updating those in place (see node_shares_host_state).
  std::string host_state = "replicated";
  bool operator==(const ParallelConfig&) const = default;
};

// parallel.host_state shared with more than one rank: the node's ranks share one host state. (With
// one rank, shared is the same as replicated.)
inline bool node_shares_host_state(const ParallelConfig& p) { return p.host_state == "shared" && p.data_parallel > 1; }
// The ranks among which the optimizer states are split: the job's ranks when sharded, the node's
// when shared, else 1.
inline int64_t state_shard_ranks(const ParallelConfig& p) {
  if (p.data_parallel <= 1) return 1;
  if (p.host_state == "sharded") return p.data_parallel;
  if (p.host_state == "shared") return p.ranks_per_node;
  return 1;
}

struct PeakBytes {
  int64_t device = 0, pinned = 0, ram = 0, nvme = 0;
  bool operator==(const PeakBytes&) const = default;
};

// The planner's prediction for this plan; absent in a hand-written plan.
struct Predicted {
  double step_time_s = 0;
  double tokens_per_s = 0;
  double tflops = 0;
  double mfu = 0;
  std::string bottleneck = "gpu";  // one of plan_bottleneck_names()
  PeakBytes peak_bytes;
  bool operator==(const Predicted&) const = default;
};

// gpu, h2d, d2h, cpu, host_memory, nvme_read, nvme_write, none.
const std::vector<std::string>& plan_bottleneck_names();

// The most bytes one unit (the embedding, one layer, or the final norm with the head) moves between
// NVMe and pinned staging at once: its fp32 master weights when those are on nvme, plus its m and v
// when the optimizer states are, laid out as the executor stores them (quantised formats padded to
// whole blocks per tensor, one fp32 scale per block). 0 when nothing is on nvme.
int64_t nvme_unit_transfer_bytes(const ModelSpec& model, bool master_on_nvme, bool states_on_nvme,
                                 StateFormat m_format, StateFormat v_format, int64_t block_size);
// The same from each unit's tensor sizes (unit_tensor_numels[u]: the numels of unit u's tensors), for
// callers that group the tensors once and ask many times (a Mixture-of-Experts model has tens of
// thousands of tensors).
int64_t nvme_unit_transfer_bytes(const std::vector<std::vector<int64_t>>& unit_tensor_numels, bool master_on_nvme,
                                 bool states_on_nvme, StateFormat m_format, StateFormat v_format, int64_t block_size);
// Each unit's tensor sizes as the executor groups the tensors: 0 the embedding, l + 1 decoder layer
// l, L + 1 the rest (final norm and head), in the model's tensor order.
std::vector<std::vector<int64_t>> unit_tensor_numels(const ModelSpec& model);
// Where each tensor of a unit starts inside the unit's arrays (the fp32 master weights, the
// gradients, the streamed copy, and so the device's layer buffers), in elements: in order, each on
// a kUnitTensorAlignment-element boundary, 64 bytes in fp32 and 32 in bf16. A tensor that follows
// a small one (gpt-oss's 4-element sinks lead each layer of tiny-gpt-oss) would otherwise start off
// the 16-byte alignment that cuBLAS's pointer-array GEMMs and vector loads need. `numel` is the
// unit's whole extent, gaps included (they hold zeros and get zero gradients). Adam's moments are
// not laid out this way: their stores pack the tensors (moment_array_bytes). The one layout that
// HostState, the compiled step, the footprint and the NVMe regions all use.
inline constexpr int64_t kUnitTensorAlignment = 16;
struct UnitLayout {
  std::vector<int64_t> offsets;
  int64_t numel = 0;
};
UnitLayout unit_layout(const std::vector<int64_t>& tensor_numels);
// Sharded optimizer states (parallel.host_state sharded, docs/data-parallel.md): the rank that owns
// each tensor, for the model's tensors in unit order (unit 0's tensors, then unit 1's, ...). Whole
// tensors, in consecutive runs (rank r's tensors follow rank r - 1's), each run about one ranks-th of
// the elements: a tensor goes to the rank whose equal share of the elements holds its middle one.
// A rank may own nothing (more ranks than tensors, or one tensor larger than a share).
std::vector<int> shard_owners(const std::vector<int64_t>& tensor_numels, int ranks);
// One unit's region on the NVMe tier, as HostState lays it out and the footprint reserves it: its
// fp32 master weights (when on nvme; unit_layout's extent), then each array of m and of v (moment_array_bytes; when the
// states are on nvme), each starting on a kNvmeArrayAlignment boundary. Offsets are -1 / empty for
// what stays in RAM; `bytes` is the region before the store rounds it up to its blocks.
inline constexpr int64_t kNvmeArrayAlignment = 4096;
struct NvmeRegionLayout {
  int64_t master = -1;
  std::vector<int64_t> m, v;
  int64_t bytes = 0;
};
NvmeRegionLayout nvme_region_layout(const std::vector<int64_t>& tensor_numels, bool master_on_nvme, bool states_on_nvme,
                                    StateFormat m_format, StateFormat v_format, int64_t block_size);
// Blocks of `block_bytes` that the NVMe store reserves for a region of `region_bytes`: whole
// blocks, as it reads and writes them (NvmeStore, and step::footprint's NVMe figure).
inline int64_t nvme_region_blocks(int64_t region_bytes, int64_t block_bytes) {
  return (region_bytes + block_bytes - 1) / block_bytes;
}
// The staging rule: with state on nvme, placement.pinned_staging_bytes must hold at least one unit's
// transfer (nvme_unit_transfer_bytes); the error names the key, the value and the minimum in bytes.
Status check_pinned_staging(int64_t pinned_staging_bytes, int64_t unit_transfer_bytes);

struct Plan;
// Every rule that ties a plan to its model, in one place: Plan reading, the simulator and the
// executor all call it, so that none of them accepts a plan another refuses (docs/plan-format.md,
// "Cross-checks"). Capacity verdicts (does it fit the rig's memory) are not part of it.
Status check_plan_for_model(const Plan& plan, const ModelSpec& model);
// The same with the model's unit_tensor_numels() already grouped (the planner checks thousands of
// plans of one model).
Status check_plan_for_model(const Plan& plan, const ModelSpec& model, const std::vector<std::vector<int64_t>>& unit_tensor_numels);

struct Plan {
  ProfileRef model;
  ProfileRef rig;
  TrainingConfig training;
  PrecisionConfig precision;
  ScheduleConfig schedule;
  PlacementConfig placement;
  OptimizerConfig optimizer;
  ParallelConfig parallel;
  std::optional<Predicted> predicted;
  // Relative model/rig paths are resolved against this folder (the plan file's); not serialised.
  std::filesystem::path base_dir;

  bool operator==(const Plan& o) const {
    return model == o.model && rig == o.rig && training == o.training && precision == o.precision &&
           schedule == o.schedule && placement == o.placement && optimizer == o.optimizer &&
           parallel == o.parallel && predicted == o.predicted;
  }

  // Parses and validates every field, including that the model and rig exist and that the plan
  // agrees with them (sequence length, device budget, layer count). `what` names the source.
  static Result<Plan> from_json_text(const std::string& text, const std::string& what = "plan",
                                     const std::filesystem::path& base_dir = {});
  static Result<Plan> load(const std::filesystem::path& path);
  std::string to_json_text() const;
  Status save(const std::filesystem::path& path) const;  // atomic: temp file, fsync, rename

  Result<ModelSpec> resolve_model() const;
  Result<HardwareProfile> resolve_rig() const;
};

}  // namespace megatrain

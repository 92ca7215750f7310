// Plan reading (strict, with key paths in errors), cross-checks against model and rig, and writing.
#include "megatrain/core/plan.h"

#include <algorithm>
#include <cmath>

#include "detail/json_reader.h"
#include "megatrain/core/durable_file.h"
#include "megatrain/core/flags.h"
#include "megatrain/core/profiles.h"
#include "megatrain/core/units.h"

namespace megatrain {
namespace {

using detail::FieldReader;
using detail::Json;
using detail::Need;

constexpr int64_t kMaxI = INT64_MAX;

Status read_profile_ref(FieldReader& r, const Json& root, const std::string& key, ProfileRef& out) {
  const Json* j = r.member(key, Need::kRequired);
  if (!r.ok()) return r.finish();
  if (j->is_string()) {
    out = ProfileRef{false, j->get<std::string>()};
    if (out.value.empty())
      return invalid_argument(key + ": empty; expected a name from profiles/, a path, or an embedded object");
    return {};
  }
  if (j->is_object()) {
    out = ProfileRef{true, j->dump()};
    return {};
  }
  (void)root;
  return invalid_argument(key + ": expected a name, a path or an object, got " + detail::json_type_name(*j));
}

Result<DType> read_dtype(FieldReader& r, const std::string& key, DType fallback, const std::vector<std::string>& accepted) {
  std::string s = dtype_name(fallback);
  r.choice(key, s, Need::kOptional, accepted);
  if (!r.ok()) return r.finish();
  return parse_dtype(s);
}

Result<StateFormat> read_format(FieldReader& r, const std::string& key, StateFormat fallback) {
  std::string s = state_format_name(fallback);
  r.choice(key, s, Need::kOptional, {"fp32", "bf16", "q8", "q4", "q3", "q2"});
  if (!r.ok()) return r.finish();
  return parse_state_format(s);
}

// Reads an optional word-valued key into its enum; the accepted words and the error wording are
// FieldReader::choice's. `out` keeps its default when the key is absent.
template <class E>
void read_enum(FieldReader& r, const std::string& key, E& out, const std::vector<std::string>& accepted) {
  std::string s = name(out);
  r.choice(key, s, Need::kOptional, accepted);
  for (size_t i = 0; i < accepted.size(); ++i)
    if (accepted[i] == s) out = static_cast<E>(i);
}

template <class E>
Result<E> parse_word(std::string_view s, std::string_view key, const std::vector<std::string>& accepted) {
  for (size_t i = 0; i < accepted.size(); ++i)
    if (accepted[i] == s) return static_cast<E>(i);
  std::string list;
  for (const std::string& a : accepted) list += (list.empty() ? "" : ", ") + a;
  return invalid_argument(std::string(key) + ": '" + std::string(s) + "' is not accepted; accepted: " + list);
}

template <class E>
const char* word_of(E v, const std::vector<std::string>& names) {
  const auto i = static_cast<size_t>(v);
  return i < names.size() ? names[i].c_str() : "?";
}

std::filesystem::path resolve_relative(const ProfileRef& ref, const std::filesystem::path& base) {
  std::filesystem::path p(ref.value);
  if (!base.empty() && p.is_relative() && (ref.value.find('/') != std::string::npos || p.extension() == ".json"))
    return base / p;
  return p;
}

}  // namespace

const std::vector<std::string>& lr_schedule_names() {
  static const std::vector<std::string> names = {"constant", "cosine", "linear", "constant-hf", "cosine-hf", "linear-hf"};
  return names;
}
const std::vector<std::string>& data_order_names() {
  static const std::vector<std::string> names = {"shuffled", "sequential"};
  return names;
}
const std::vector<std::string>& schedule_order_names() {
  static const std::vector<std::string> names = {"layer-major", "microbatch-major"};
  return names;
}
const std::vector<std::string>& checkpoint_location_names() {
  static const std::vector<std::string> names = {"device", "host"};
  return names;
}
const std::vector<std::string>& tier_names() {
  static const std::vector<std::string> names = {"ram", "nvme"};
  return names;
}

const char* name(LrSchedule v) { return word_of(v, lr_schedule_names()); }
const char* name(DataOrder v) { return word_of(v, data_order_names()); }
const char* name(ScheduleOrder v) { return word_of(v, schedule_order_names()); }
const char* name(CheckpointLocation v) { return word_of(v, checkpoint_location_names()); }
const char* name(Tier v) { return word_of(v, tier_names()); }

Result<LrSchedule> parse_lr_schedule(std::string_view s, std::string_view key) {
  return parse_word<LrSchedule>(s, key, lr_schedule_names());
}
Result<DataOrder> parse_data_order(std::string_view s, std::string_view key) {
  return parse_word<DataOrder>(s, key, data_order_names());
}
Result<ScheduleOrder> parse_schedule_order(std::string_view s, std::string_view key) {
  return parse_word<ScheduleOrder>(s, key, schedule_order_names());
}
Result<CheckpointLocation> parse_checkpoint_location(std::string_view s, std::string_view key) {
  return parse_word<CheckpointLocation>(s, key, checkpoint_location_names());
}
Result<Tier> parse_tier(std::string_view s, std::string_view key) { return parse_word<Tier>(s, key, tier_names()); }

const std::vector<std::string>& plan_bottleneck_names() {
  static const std::vector<std::string> names = {"gpu", "h2d", "d2h", "cpu", "host_memory",
                                                 "nvme_read", "nvme_write", "none"};
  return names;
}

std::vector<std::vector<int64_t>> unit_tensor_numels(const ModelSpec& model) {
  const int64_t L = model.config().num_layers;
  std::vector<std::vector<int64_t>> units(static_cast<size_t>(L + 2));
  for (const TensorInfo& t : model.tensors()) {
    const int64_t u = t.layer >= 0 ? t.layer + 1 : t.role == TensorRole::kEmbedding ? 0 : L + 1;
    units[static_cast<size_t>(u)].push_back(t.numel);
  }
  return units;
}

UnitLayout unit_layout(const std::vector<int64_t>& tensor_numels) {
  UnitLayout l;
  l.offsets.reserve(tensor_numels.size());
  for (int64_t n : tensor_numels) {
    l.offsets.push_back(l.numel);
    l.numel += (n + kUnitTensorAlignment - 1) / kUnitTensorAlignment * kUnitTensorAlignment;
  }
  return l;
}

std::vector<int> shard_owners(const std::vector<int64_t>& tensor_numels, int ranks) {
  int64_t total = 0;
  for (int64_t n : tensor_numels) total += n;
  std::vector<int> owner;
  owner.reserve(tensor_numels.size());
  int64_t before = 0;
  for (int64_t n : tensor_numels) {
    // The middle element, 2 * before + n halves, falls in share floor(middle * ranks / total). In
    // int64: 2 * total * ranks stays below 2^63 for any model under 2^46 parameters and 65536 ranks.
    const int64_t r = total > 0 ? (2 * before + n) * ranks / (2 * total) : 0;
    owner.push_back(static_cast<int>(std::min<int64_t>(r, ranks - 1)));
    before += n;
  }
  return owner;
}

int64_t nvme_unit_transfer_bytes(const std::vector<std::vector<int64_t>>& unit_tensor_numels, bool master_on_nvme,
                                 bool states_on_nvme, StateFormat m_format, StateFormat v_format, int64_t block_size) {
  if (!master_on_nvme && !states_on_nvme) return 0;
  int64_t largest = 0;
  for (const auto& numels : unit_tensor_numels) {
    int64_t bytes = master_on_nvme ? 4 * unit_layout(numels).numel : 0;
    if (states_on_nvme) bytes += state_format_bytes(m_format, numels, block_size) + state_format_bytes(v_format, numels, block_size);
    largest = std::max(largest, bytes);
  }
  return largest;
}

LayerBufferRange layer_buffer_range(int64_t prefetch_depth, int64_t checkpoint_every) {
  const int64_t K = std::max<int64_t>(prefetch_depth, 1), c = std::max<int64_t>(checkpoint_every, 0);
  return {std::max(K + 1, c + 1), std::max(K + 1, c + K)};
}

NvmeRegionLayout nvme_region_layout(const std::vector<int64_t>& tensor_numels, bool master_on_nvme, bool states_on_nvme,
                                    StateFormat m_format, StateFormat v_format, int64_t block_size) {
  auto aligned = [](int64_t b) { return (b + kNvmeArrayAlignment - 1) / kNvmeArrayAlignment * kNvmeArrayAlignment; };
  NvmeRegionLayout r;
  if (master_on_nvme) {
    r.master = 0;
    r.bytes = aligned(4 * unit_layout(tensor_numels).numel);
  }
  if (states_on_nvme) {
    for (int64_t b : moment_array_bytes(m_format, tensor_numels, block_size)) r.m.push_back(r.bytes), r.bytes += aligned(b);
    for (int64_t b : moment_array_bytes(v_format, tensor_numels, block_size)) r.v.push_back(r.bytes), r.bytes += aligned(b);
  }
  return r;
}

int64_t nvme_unit_transfer_bytes(const ModelSpec& model, bool master_on_nvme, bool states_on_nvme,
                                 StateFormat m_format, StateFormat v_format, int64_t block_size) {
  if (!master_on_nvme && !states_on_nvme) return 0;
  return nvme_unit_transfer_bytes(unit_tensor_numels(model), master_on_nvme, states_on_nvme, m_format, v_format, block_size);
}

Status check_pinned_staging(int64_t pinned_staging_bytes, int64_t unit_transfer_bytes) {
  if (unit_transfer_bytes <= 0 || pinned_staging_bytes >= unit_transfer_bytes) return {};
  return invalid_argument("placement.pinned_staging_bytes: " + std::to_string(pinned_staging_bytes) +
                          " cannot hold one unit's NVMe transfer of " + std::to_string(unit_transfer_bytes) + " bytes (" +
                          format_bytes(static_cast<double>(unit_transfer_bytes)) +
                          ": the largest unit's state that placement puts on nvme); accepted: >= " +
                          std::to_string(unit_transfer_bytes));
}

Status check_plan_for_model(const Plan& p, const ModelSpec& model) {
  const bool nvme = p.placement.master_weights == Tier::kNvme || p.placement.optimizer_states == Tier::kNvme;
  return check_plan_for_model(p, model, nvme ? unit_tensor_numels(model) : std::vector<std::vector<int64_t>>{});
}

Status check_plan_for_model(const Plan& p, const ModelSpec& model, const std::vector<std::vector<int64_t>>& unit_tensor_numels) {
  const ModelConfig& mc = model.config();
  if (p.training.seq_len > mc.max_position_embeddings)
    return invalid_argument("training.seq_len: " + std::to_string(p.training.seq_len) +
                            " exceeds the model's max_position_embeddings; accepted: 1 .. " +
                            std::to_string(mc.max_position_embeddings));
  const ScheduleConfig& sc = p.schedule;
  if (sc.checkpoint_every > mc.num_layers)
    return invalid_argument("schedule.checkpoint_every: " + std::to_string(sc.checkpoint_every) + " exceeds the model's " +
                            std::to_string(mc.num_layers) + " layers; accepted: 0 .. " + std::to_string(mc.num_layers));
  {
    const int64_t least = layer_buffer_range(sc.prefetch_depth, sc.checkpoint_every).least;
    if (sc.device_layer_buffers < least) {
      // Backward recomputes a checkpoint block's layers from its checkpoint and keeps their weights
      // on the device while it walks back through them, with the next layer loading beside them.
      const std::string why = sc.prefetch_depth >= sc.checkpoint_every
                                  ? "the layer being computed plus schedule.prefetch_depth " + std::to_string(sc.prefetch_depth) +
                                        " layers in flight"
                                  : "the " + std::to_string(sc.checkpoint_every) +
                                        " layers a checkpoint block recomputes (schedule.checkpoint_every) plus one in flight";
      return invalid_argument("schedule.device_layer_buffers: " + std::to_string(sc.device_layer_buffers) + " cannot hold " +
                              why + "; accepted: >= " + std::to_string(least));
    }
  }
  const PlacementConfig& pc = p.placement;
  const bool master_nvme = pc.master_weights == Tier::kNvme, states_nvme = pc.optimizer_states == Tier::kNvme;
  if (master_nvme && p.precision.transfer != DType::kBf16)
    return invalid_argument("placement.master_weights: nvme with precision.transfer " +
                            std::string(dtype_name(p.precision.transfer)) +
                            ": the weights streamed to the device are a bf16 copy kept in RAM while the fp32 master "
                            "weights are on NVMe; accepted: precision.transfer bf16, or master_weights ram");
  return check_pinned_staging(pc.pinned_staging_bytes,
                              nvme_unit_transfer_bytes(unit_tensor_numels, master_nvme, states_nvme, p.optimizer.m_format,
                                                       p.optimizer.v_format, p.optimizer.block_size));
}

Result<ModelSpec> Plan::resolve_model() const {
  if (model.inline_object) return ModelSpec::from_config_json(model.value, "model (embedded config)");
  return ModelSpec::load(resolve_relative(model, base_dir).string());
}

Result<HardwareProfile> Plan::resolve_rig() const {
  if (rig.inline_object) return HardwareProfile::from_json_text(rig.value, "rig (embedded profile)");
  return HardwareProfile::load(resolve_relative(rig, base_dir).string());
}

Result<Plan> Plan::from_json_text(const std::string& text, const std::string& what,
                                  const std::filesystem::path& base_dir) {
  MT_ASSIGN_OR_RETURN(Json root, detail::parse_json(text, what));
  Plan p;
  p.base_dir = base_dir;
  auto ctx = [&](const Status& s) { return s.with_context(what); };

  FieldReader r(root, "");
  std::string schema;
  r.string("schema", schema, Need::kRequired);
  if (!r.ok()) return ctx(r.finish());
  if (schema != kPlanSchema)
    return ctx(invalid_argument("schema: '" + schema + "' is not supported; accepted: " + kPlanSchema));
  // Unknown top-level keys before any section is read, so a misspelt section is reported as
  // unknown (with a suggestion) rather than as the missing section it stands for.
  r.accept({"model", "rig", "training", "precision", "schedule", "placement", "optimizer", "parallel", "predicted"});
  if (Status s = r.finish(); !s.ok()) return ctx(s);
  if (Status s = read_profile_ref(r, root, "model", p.model); !s.ok()) return ctx(s);
  if (Status s = read_profile_ref(r, root, "rig", p.rig); !s.ok()) return ctx(s);

  // training
  if (const Json* t = r.object("training", Need::kRequired)) {
    FieldReader tr(*t, "training", {"seq_len", "micro_batch", "grad_accum", "steps", "seed", "lr", "lr_schedule",
                                      "warmup_steps", "min_lr", "clip_grad_norm", "data_order", "document_tokens"});
    TrainingConfig& c = p.training;
    tr.integer("seq_len", c.seq_len, Need::kRequired, 1, 1 << 24);
    tr.integer("micro_batch", c.micro_batch, Need::kRequired, 1, 1 << 20);
    tr.integer("grad_accum", c.grad_accum, Need::kOptional, 1, 1 << 20);
    tr.integer("steps", c.steps, Need::kOptional, 1, kMaxI);
    tr.integer("seed", c.seed, Need::kOptional, 0, kMaxI);
    tr.number("lr", c.lr, Need::kOptional, 0, 10);
    read_enum(tr, "lr_schedule", c.lr_schedule, lr_schedule_names());
    tr.integer("warmup_steps", c.warmup_steps, Need::kOptional, 0, kMaxI);
    tr.number("min_lr", c.min_lr, Need::kOptional, 0, 10);
    tr.number("clip_grad_norm", c.clip_grad_norm, Need::kOptional, 0, 1e30);
    read_enum(tr, "data_order", c.data_order, data_order_names());
    tr.number("document_tokens", c.document_tokens, Need::kOptional, 0, 1 << 24);
    if (Status s = tr.finish(); !s.ok()) return ctx(s);
    if (c.document_tokens != 0 && (c.document_tokens < 1 || c.document_tokens > static_cast<double>(c.seq_len)))
      return ctx(invalid_argument("training.document_tokens: " + format_flag_bound(c.document_tokens) +
                                  " is not a documents' mean length in rows of seq_len " + std::to_string(c.seq_len) +
                                  "; accepted: 0 (one context per row) or 1 .. seq_len"));
    if (c.warmup_steps > c.steps)
      return ctx(invalid_argument("training.warmup_steps: " + std::to_string(c.warmup_steps) +
                                  " exceeds training.steps " + std::to_string(c.steps) + "; accepted: 0 .. steps"));
    if (c.min_lr > c.lr)
      return ctx(invalid_argument("training.min_lr: must not exceed training.lr; accepted: 0 .. lr"));
    if (c.min_lr != 0 && (c.lr_schedule == LrSchedule::kConstantHf || c.lr_schedule == LrSchedule::kCosineHf ||
                          c.lr_schedule == LrSchedule::kLinearHf))
      return ctx(invalid_argument(std::string("training.min_lr: ") + name(c.lr_schedule) +
                                  " decays to 0 as Hugging Face's schedule does; accepted: min_lr 0, or lr_schedule " +
                                  "constant, cosine or linear (which decay to min_lr)"));
  }
  if (!r.ok()) return ctx(r.finish());

  // precision
  if (const Json* j = r.object("precision", Need::kOptional)) {
    FieldReader pr(*j, "precision", {"compute", "master", "transfer"});
    auto compute = read_dtype(pr, "compute", p.precision.compute, {"fp32", "bf16"});
    if (!compute.ok()) return ctx(compute.status());
    auto master = read_dtype(pr, "master", p.precision.master, {"fp32"});
    if (!master.ok()) return ctx(master.status());
    auto transfer = read_dtype(pr, "transfer", p.precision.transfer, {"fp32", "bf16"});
    if (!transfer.ok()) return ctx(transfer.status());
    if (Status s = pr.finish(); !s.ok()) return ctx(s);
    p.precision = PrecisionConfig{*compute, *master, *transfer};
  }
  if (!r.ok()) return ctx(r.finish());

  // schedule
  if (const Json* j = r.object("schedule", Need::kOptional)) {
    FieldReader sr(*j, "schedule",
                   {"order", "prefetch_depth", "device_layer_buffers", "checkpoint_every", "checkpoint_location"});
    ScheduleConfig& c = p.schedule;
    read_enum(sr, "order", c.order, schedule_order_names());
    sr.integer("prefetch_depth", c.prefetch_depth, Need::kOptional, 1, 1024);
    sr.integer("device_layer_buffers", c.device_layer_buffers, Need::kOptional, 2, 1025);
    sr.integer("checkpoint_every", c.checkpoint_every, Need::kOptional, 0, 100000);
    read_enum(sr, "checkpoint_location", c.checkpoint_location, checkpoint_location_names());
    if (Status s = sr.finish(); !s.ok()) return ctx(s);
  }

  if (!r.ok()) return ctx(r.finish());

  // placement
  if (const Json* j = r.object("placement", Need::kOptional)) {
    FieldReader pr(*j, "placement", {"master_weights", "optimizer_states", "nvme_dirs", "pinned_staging_bytes",
                                       "device_budget_bytes", "nvme_queue_depth", "nvme_block_bytes"});
    PlacementConfig& c = p.placement;
    read_enum(pr, "master_weights", c.master_weights, tier_names());
    read_enum(pr, "optimizer_states", c.optimizer_states, tier_names());
    pr.string_array("nvme_dirs", c.nvme_dirs, Need::kOptional);
    pr.integer("pinned_staging_bytes", c.pinned_staging_bytes, Need::kOptional, 0, kMaxI);
    pr.integer("device_budget_bytes", c.device_budget_bytes, Need::kOptional, 0, kMaxI);
    pr.integer("nvme_queue_depth", c.nvme_queue_depth, Need::kOptional, 1, 4096);
    pr.integer("nvme_block_bytes", c.nvme_block_bytes, Need::kOptional, 4096, int64_t{1} << 30);
    if (Status s = pr.finish(); !s.ok()) return ctx(s);
    if (c.nvme_block_bytes % 4096 != 0)
      return ctx(invalid_argument("placement.nvme_block_bytes: " + std::to_string(c.nvme_block_bytes) +
                                  " is not a multiple of 4096; O_DIRECT transfers need whole 4 KiB pages"));
    for (size_t i = 0; i < c.nvme_dirs.size(); ++i)
      if (c.nvme_dirs[i].empty())
        return ctx(invalid_argument("placement.nvme_dirs[" + std::to_string(i) + "]: empty; expected a directory path"));
    // The same folder twice (also spelled differently: /x, /x/, /y/../x, or a link to it) is one
    // drive, not two: counted twice, the planner would price bandwidth that does not exist.
    auto folder = [](const std::string& d) {
      std::error_code ec;
      std::filesystem::path f = std::filesystem::weakly_canonical(d, ec);
      if (ec) f = std::filesystem::path(d).lexically_normal();
      if (!f.has_filename() && f.has_parent_path()) f = f.parent_path();  // "/x/y/" is "/x/y"
      return f;
    };
    for (size_t i = 0; i < c.nvme_dirs.size(); ++i)
      for (size_t k = 0; k < i; ++k) {
        std::error_code ec;
        const bool same = folder(c.nvme_dirs[k]) == folder(c.nvme_dirs[i]) || std::filesystem::equivalent(c.nvme_dirs[k], c.nvme_dirs[i], ec);
        if (same)
          return ctx(invalid_argument("placement.nvme_dirs[" + std::to_string(i) + "]: '" + c.nvme_dirs[i] + "' is the folder of nvme_dirs[" +
                                      std::to_string(k) + "] ('" + c.nvme_dirs[k] + "'); list each drive's folder once"));
      }
    if ((c.master_weights == Tier::kNvme || c.optimizer_states == Tier::kNvme) && c.nvme_dirs.empty())
      return ctx(invalid_argument("placement.nvme_dirs: empty, but placement puts " +
                                  std::string(c.master_weights == Tier::kNvme ? "master_weights" : "optimizer_states") +
                                  " on nvme; list at least one NVMe directory"));
  }
  if (!r.ok()) return ctx(r.finish());

  // optimizer
  if (const Json* j = r.object("optimizer", Need::kOptional)) {
    FieldReader orr(*j, "optimizer", {"type", "beta1", "beta2", "eps", "weight_decay", "m_format", "v_format",
                                       "block_size", "threads"});
    OptimizerConfig& c = p.optimizer;
    orr.choice("type", c.type, Need::kOptional, {"adamw"});
    orr.number("beta1", c.beta1, Need::kOptional, 0, 0.999999999);
    orr.number("beta2", c.beta2, Need::kOptional, 0, 0.999999999);
    orr.number("eps", c.eps, Need::kOptional, 1e-30, 1);
    orr.number("weight_decay", c.weight_decay, Need::kOptional, 0, 10);
    auto m = read_format(orr, "m_format", c.m_format);
    if (!m.ok()) return ctx(m.status());
    auto v = read_format(orr, "v_format", c.v_format);
    if (!v.ok()) return ctx(v.status());
    c.m_format = *m;
    c.v_format = *v;
    orr.integer("block_size", c.block_size, Need::kOptional, 16, 65536);
    orr.integer("threads", c.threads, Need::kOptional, 0, 4096);
    if (Status s = orr.finish(); !s.ok()) return ctx(s);
    if ((c.block_size & (c.block_size - 1)) != 0)
      return ctx(invalid_argument("optimizer.block_size: " + std::to_string(c.block_size) +
                                  " is not a power of two; accepted: 16, 32, 64, ... 65536"));
  }
  if (!r.ok()) return ctx(r.finish());

  // parallel (absent: one rank)
  if (const Json* j = r.object("parallel", Need::kOptional)) {
    FieldReader pr(*j, "parallel", {"data_parallel", "ranks_per_node", "collective", "host_state"});
    ParallelConfig& c = p.parallel;
    c.ranks_per_node = 0;
    pr.integer("data_parallel", c.data_parallel, Need::kRequired, 1, 65536);
    pr.integer("ranks_per_node", c.ranks_per_node, Need::kOptional, 1, 65536);
    pr.choice("collective", c.collective, Need::kOptional, {"mpi", "nccl"});
    pr.choice("host_state", c.host_state, Need::kOptional, {"replicated", "sharded", "shared"});
    if (Status s = pr.finish(); !s.ok()) return ctx(s);
    if (c.ranks_per_node == 0) c.ranks_per_node = c.data_parallel;
    if (c.ranks_per_node > c.data_parallel || c.data_parallel % c.ranks_per_node != 0)
      return ctx(invalid_argument("parallel.ranks_per_node: " + std::to_string(c.ranks_per_node) + " does not divide data_parallel " +
                                  std::to_string(c.data_parallel) + " into whole nodes; accepted: a divisor of data_parallel"));
    if (c.host_state == "shared" && p.placement.master_weights == Tier::kNvme)
      return ctx(invalid_argument("parallel.host_state shared keeps one copy of the master weights per node, in shared memory, and "
                                  "placement.master_weights is nvme; accepted: placement.master_weights ram with host_state shared, or "
                                  "host_state sharded or replicated with master weights on nvme"));
  }
  if (!r.ok()) return ctx(r.finish());

  // predicted (written by the planner)
  if (const Json* j = r.object("predicted", Need::kOptional)) {
    FieldReader pr(*j, "predicted", {"step_time_s", "tokens_per_s", "tflops", "mfu", "bottleneck", "peak_bytes"});
    Predicted d;
    pr.number("step_time_s", d.step_time_s, Need::kRequired, 0, 1e12);
    pr.number("tokens_per_s", d.tokens_per_s, Need::kRequired, 0, 1e18);
    pr.number("tflops", d.tflops, Need::kRequired, 0, 1e9);
    pr.number("mfu", d.mfu, Need::kRequired, 0, 1);
    pr.choice("bottleneck", d.bottleneck, Need::kRequired, plan_bottleneck_names());
    if (const Json* pb = pr.object("peak_bytes", Need::kRequired)) {
      FieldReader br(*pb, "predicted.peak_bytes", {"device", "pinned", "ram", "nvme"});
      br.integer("device", d.peak_bytes.device, Need::kRequired, 0, kMaxI);
      br.integer("pinned", d.peak_bytes.pinned, Need::kRequired, 0, kMaxI);
      br.integer("ram", d.peak_bytes.ram, Need::kRequired, 0, kMaxI);
      br.integer("nvme", d.peak_bytes.nvme, Need::kRequired, 0, kMaxI);
      if (Status s = br.finish(); !s.ok()) return ctx(s);
    }
    if (Status s = pr.finish(); !s.ok()) return ctx(s);
    p.predicted = d;
  }
  if (Status s = r.finish(); !s.ok()) return ctx(s);

  // The plan must agree with the model and the rig it names.
  auto model = p.resolve_model();
  if (!model.ok()) return ctx(model.status().with_context("model"));
  auto rig = p.resolve_rig();
  if (!rig.ok()) return ctx(rig.status().with_context("rig"));
  if (Status s = check_plan_for_model(p, *model); !s.ok()) return ctx(s);
  const double gpu_bytes = rig->gpu.memory_bytes.value;
  if (static_cast<double>(p.placement.device_budget_bytes) > gpu_bytes)
    return ctx(invalid_argument("placement.device_budget_bytes: " + format_bytes(static_cast<double>(p.placement.device_budget_bytes)) +
                                " (" + std::to_string(p.placement.device_budget_bytes) + " bytes) exceeds the rig's GPU memory " +
                                format_bytes(gpu_bytes) + " (" + std::to_string(static_cast<int64_t>(gpu_bytes)) + " bytes, " +
                                rig->gpu.name + ") by " + std::to_string(p.placement.device_budget_bytes - static_cast<int64_t>(gpu_bytes)) +
                                " bytes; accepted: 0 (all of it) .. " + std::to_string(static_cast<int64_t>(gpu_bytes))));
  if (p.optimizer.threads > 2 * rig->host.cores)
    return ctx(invalid_argument("optimizer.threads: " + std::to_string(p.optimizer.threads) + " exceeds twice the rig's " +
                                std::to_string(rig->host.cores) + " cores; accepted: 0 (all cores) .. " +
                                std::to_string(2 * rig->host.cores)));
  return p;
}

Result<Plan> Plan::load(const std::filesystem::path& path) {
  MT_ASSIGN_OR_RETURN(Json j, detail::read_json_file(path, "plan"));
  std::filesystem::path base = path.parent_path();
  return from_json_text(j.dump(), path.string(), base.empty() ? std::filesystem::path(".") : base);
}

std::string Plan::to_json_text() const {
  Json j;
  j["schema"] = kPlanSchema;
  j["model"] = model.inline_object ? Json::parse(model.value) : Json(model.value);
  j["rig"] = rig.inline_object ? Json::parse(rig.value) : Json(rig.value);
  const TrainingConfig& t = training;
  j["training"] = {{"seq_len", t.seq_len}, {"micro_batch", t.micro_batch}, {"grad_accum", t.grad_accum},
                   {"steps", t.steps}, {"seed", t.seed}, {"lr", t.lr}, {"lr_schedule", name(t.lr_schedule)},
                   {"warmup_steps", t.warmup_steps}, {"min_lr", t.min_lr}, {"clip_grad_norm", t.clip_grad_norm},
                   {"data_order", name(t.data_order)}};
  if (t.document_tokens > 0) j["training"]["document_tokens"] = t.document_tokens;
  j["precision"] = {{"compute", dtype_name(precision.compute)}, {"master", dtype_name(precision.master)},
                    {"transfer", dtype_name(precision.transfer)}};
  j["schedule"] = {{"order", name(schedule.order)}, {"prefetch_depth", schedule.prefetch_depth},
                   {"device_layer_buffers", schedule.device_layer_buffers},
                   {"checkpoint_every", schedule.checkpoint_every},
                   {"checkpoint_location", name(schedule.checkpoint_location)}};
  j["placement"] = {{"master_weights", name(placement.master_weights)}, {"optimizer_states", name(placement.optimizer_states)},
                    {"nvme_dirs", placement.nvme_dirs}, {"pinned_staging_bytes", placement.pinned_staging_bytes},
                    {"device_budget_bytes", placement.device_budget_bytes}, {"nvme_queue_depth", placement.nvme_queue_depth},
                    {"nvme_block_bytes", placement.nvme_block_bytes}};
  const OptimizerConfig& o = optimizer;
  j["optimizer"] = {{"type", o.type}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps},
                    {"weight_decay", o.weight_decay}, {"m_format", state_format_name(o.m_format)},
                    {"v_format", state_format_name(o.v_format)}, {"block_size", o.block_size},
                    {"threads", o.threads}};
  if (parallel != ParallelConfig{}) {  // written when it says more than one rank, so one-rank plans read as before
    j["parallel"] = {{"data_parallel", parallel.data_parallel}, {"ranks_per_node", parallel.ranks_per_node},
                     {"collective", parallel.collective}, {"host_state", parallel.host_state}};
  }
  if (predicted) {
    const Predicted& d = *predicted;
    j["predicted"] = {{"step_time_s", d.step_time_s}, {"tokens_per_s", d.tokens_per_s}, {"tflops", d.tflops},
                      {"mfu", d.mfu}, {"bottleneck", d.bottleneck},
                      {"peak_bytes", {{"device", d.peak_bytes.device}, {"pinned", d.peak_bytes.pinned},
                                      {"ram", d.peak_bytes.ram}, {"nvme", d.peak_bytes.nvme}}}};
  }
  return j.dump(2) + "\n";
}

Status Plan::save(const std::filesystem::path& path) const { return write_file_atomic(path, to_json_text()); }

}  // namespace megatrain

// Plan search: enumerate the knobs, drop what cannot fit (static bytes per tier, computed as the
// simulator computes them), drop what a fitting twin dominates, order the rest by a compute-only
// lower bound on the step time and simulate best-first until no remaining candidate can beat the
// best found. The rules, and why each is safe, are in docs/planner.md.
#include "megatrain/planner/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "megatrain/core/units.h"

namespace megatrain::planner {
namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr int64_t kDefaultSeqCap = 4096;
constexpr int64_t kDefaultSequencesPerStep = 64;
// Checkpoint intervals tried (0: keep every activation, no recompute); capped by the layer count.
constexpr int64_t kCheckpointIntervals[] = {0, 1, 2, 4, 8};
// Pinned staging for NVMe traffic, in multiples of the largest single NVMe transfer of one unit.
constexpr int64_t kStagingMultiples[] = {1, 2, 4, 8};
// The simulator's reserve for the CUDA context (step_model.cpp): min(1 GiB, budget / 16).
constexpr double kDeviceReserveBytes = 1073741824.0;
// A relief is reported when it gains at least this fraction.
constexpr double kReliefMinGain = 0.005;
constexpr size_t kReliefCandidates = 4;

// ---- knobs and the facts they need --------------------------------------------------------------

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
};

// The model as the simulator sees it at one micro-batch size (docs/cost-model.md, memory per tier).
struct Facts {
  int64_t L = 0, V = 0;
  double n = 0;                   // all parameters
  std::vector<double> params;     // per unit: embedding, layers, head (updated parameters)
  std::vector<double> streamed;   // per unit: parameters sent to the device
  double full_act = 0;            // one layer's kept activations for one micro-batch (bytes)
  double hidden = 0;              // one micro-batch's hidden state (bytes)
  double T = 0;                   // tokens per micro-batch
  bool clip = TrainingConfig{}.clip_grad_norm > 0;  // the written plans keep the default clipping
};

double ceil_bytes(double v) { return std::ceil(v - 1e-9); }

Facts facts_for(const ModelSpec& model, int64_t seq, int64_t micro_batch, DType compute) {
  const ModelConfig& mc = model.config();
  const ParameterCounts pc = model.parameter_counts();
  Facts f;
  f.L = mc.num_layers;
  f.V = mc.vocab_size;
  f.n = static_cast<double>(pc.total);
  f.params.assign(static_cast<size_t>(f.L + 2), static_cast<double>(pc.per_layer));
  f.params[0] = static_cast<double>(pc.embedding);
  f.params[static_cast<size_t>(f.L + 1)] = static_cast<double>(pc.head + pc.final_norm);
  f.streamed = f.params;
  f.streamed[static_cast<size_t>(f.L + 1)] = static_cast<double>(mc.vocab_size * mc.hidden_size + pc.final_norm);
  f.T = static_cast<double>(micro_batch * seq);
  const ActivationBytes act = model.activation_bytes_per_token_per_layer(seq, dtype_bytes(compute));
  f.full_act = ceil_bytes(act.full_flash * f.T);
  f.hidden = ceil_bytes(act.checkpoint * f.T);
  return f;
}

struct Needs {
  double device = 0, pinned = 0, ram = 0, nvme = 0;
  double staging_min = 0;  // the largest single NVMe transfer (0 when nothing is on NVMe)
};

struct Caps {
  double device = 0, pinned = 0, ram = 0, nvme = 0;
  bool has_nvme = false;
};

Caps caps_of(const HardwareProfile& rig) {
  Caps c;
  c.device = rig.gpu.memory_bytes.value;
  c.pinned = rig.host.pinnable_bytes.value;
  c.ram = rig.host.ram_bytes.value;
  for (const auto& d : rig.storage) c.nvme += d.capacity_bytes.value;
  c.has_nvme = !rig.storage.empty();
  return c;
}

double state_bytes_pp(const Knobs& k) {
  return state_format_bytes_per_element(k.m_format, 128) + state_format_bytes_per_element(k.v_format, 128);
}

// Static bytes per tier, as step_model.cpp computes them before simulating, plus device
// checkpoints (the simulator acquires them at run time; a plan they do not fit cannot proceed).
Needs needs_of(const Knobs& k, const Facts& f, DType compute, double device_budget) {
  const double cb = static_cast<double>(dtype_bytes(compute)), tb = static_cast<double>(dtype_bytes(k.transfer));
  const double spp = state_bytes_pp(k);
  const double a_hidden = k.layer_major ? static_cast<double>(k.grad_accum) : 1;
  const double n_ckpt = k.ckpt_every > 0 ? static_cast<double>((f.L + k.ckpt_every - 1) / k.ckpt_every) : 0;
  const double ckpt_bytes = n_ckpt * a_hidden * f.hidden;
  const bool stream_from_nvme = k.master_nvme && k.transfer == DType::kFp32;
  Needs n;
  double largest_unit = 0;
  for (double p : f.params) largest_unit = std::max(largest_unit, p);
  const double grads = k.layer_major && !f.clip ? 3 * 4 * largest_unit : 4 * f.n;  // fp32 gradients (step_model.cpp)
  n.pinned = grads + (k.ckpt_host ? ckpt_bytes : 0) + static_cast<double>(k.staging) +
             (tb < 4 || !k.master_nvme ? f.n * tb : 0);
  n.ram = n.pinned;
  if (!k.master_nvme && tb < 4) n.ram += 4 * f.n;
  if (!k.states_nvme) n.ram += f.n * spp;
  n.nvme = (k.master_nvme ? 4 * f.n : 0) + (k.states_nvme ? f.n * spp : 0);
  if (k.master_nvme || k.states_nvme) {
    for (size_t u = 0; u < f.params.size(); ++u) {
      n.staging_min = std::max(n.staging_min, f.params[u] * ((k.states_nvme ? spp : 0) + (k.master_nvme ? 4 : 0)));
      if (stream_from_nvme) n.staging_min = std::max(n.staging_min, f.streamed[u] * 4);
    }
    n.staging_min = ceil_bytes(n.staging_min);
  }
  const double reserve = std::floor(std::min(kDeviceReserveBytes, device_budget / 16));
  const double device_static = reserve + 2 * a_hidden * f.hidden;
  double unit_max = 0;
  for (double s : f.streamed) unit_max = std::max(unit_max, s * (std::max(cb, tb) + 4));
  const double logits = 4 * f.T * static_cast<double>(f.V);
  const double kept_all = k.ckpt_every == 0 ? static_cast<double>(f.L) * a_hidden * f.full_act : 0;
  // Backward of a checkpoint block, one micro-batch at a time: the block's weights, its fp32
  // gradient accumulators and its recomputed activations are all resident, plus the restored input.
  const double layer = f.params.size() > 2 ? f.params[1] : 0;
  const double block = k.ckpt_every > 0 ? static_cast<double>(k.ckpt_every) * (layer * (std::max(cb, tb) + 4) + f.full_act) +
                                              (k.ckpt_host ? f.hidden : 0)
                                        : 0;
  n.device = device_static + (k.ckpt_host ? 0 : ckpt_bytes) +
             std::max(unit_max + std::max(logits, f.full_act) + kept_all, block);
  return n;
}

std::vector<TierNeed> tier_needs(const Needs& n, const Caps& c) {
  return {{"device", n.device, c.device}, {"pinned", n.pinned, c.pinned}, {"ram", n.ram, c.ram}, {"nvme", n.nvme, c.nvme}};
}

bool fits(const Needs& n, const Caps& c) {
  return n.device <= c.device && n.pinned <= c.pinned && n.ram <= c.ram && n.nvme <= c.nvme;
}

// How far a candidate is from fitting: its worst tier's need over capacity.
double worst_ratio(const Needs& n, const Caps& c) {
  double r = 0;
  for (const TierNeed& t : tier_needs(n, c)) {
    if (t.need <= 0) continue;
    r = std::max(r, t.have > 0 ? t.need / t.have : std::numeric_limits<double>::infinity());
  }
  return r;
}

// The deepest prefetch whose layers could all be resident during the forward pass beside the
// static buffers; deeper transfers could only wait for memory.
int64_t prefetch_cap(const Knobs& k, const Facts& f, DType compute, double device_budget, int64_t max_depth) {
  const double cb = static_cast<double>(dtype_bytes(compute)), tb = static_cast<double>(dtype_bytes(k.transfer));
  const double w = f.params.size() > 2 ? f.params[1] * std::max(cb, tb) : 0;
  const double need = needs_of(k, f, compute, device_budget).device;  // the unit (or block) being computed
  int64_t K = 1;
  while (K < max_depth && need + static_cast<double>(K + 1) * w <= device_budget) ++K;  // K layers beside the working set
  return K;
}

// ---- plans ---------------------------------------------------------------------------------------

Plan make_plan(const Knobs& k, const SearchRequest& req, int64_t seq, DType compute, const HardwareProfile& rig) {
  Plan p;
  p.model = req.model_ref;
  p.rig = req.rig_ref;
  p.training.seq_len = seq;
  p.training.micro_batch = k.micro_batch;
  p.training.grad_accum = k.grad_accum;
  p.training.steps = req.steps;
  p.precision = PrecisionConfig{compute, DType::kFp32, k.transfer};
  p.schedule.order = k.layer_major ? ScheduleOrder::kLayerMajor : ScheduleOrder::kMicrobatchMajor;
  p.schedule.prefetch_depth = k.prefetch;
  p.schedule.device_layer_buffers = k.buffers;
  p.schedule.checkpoint_every = k.ckpt_every;
  p.schedule.checkpoint_location = k.ckpt_host ? CheckpointLocation::kHost : CheckpointLocation::kDevice;
  p.placement.master_weights = k.master_nvme ? Tier::kNvme : Tier::kRam;
  p.placement.optimizer_states = k.states_nvme ? Tier::kNvme : Tier::kRam;
  if (k.master_nvme || k.states_nvme)
    for (const auto& d : rig.storage) p.placement.nvme_dirs.push_back(d.path);
  p.placement.pinned_staging_bytes = k.staging;
  p.placement.device_budget_bytes = 0;
  p.optimizer.m_format = k.m_format;
  p.optimizer.v_format = k.v_format;
  p.optimizer.threads = k.threads;
  return p;
}

// A lower bound on the simulated step: the next step's GPU work and its H2D transfers both lie
// inside the measured period (the first H2D of a step is the embedding's, which waits for its
// update, which waits for the previous step's last GPU task), and a task never runs faster than
// its full-speed time.
double lower_bound(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig) {
  const sim::CostModel cost(plan, model, rig);
  const ModelConfig& mc = model.config();
  const ParameterCounts pc = model.parameter_counts();
  const double L = static_cast<double>(mc.num_layers);
  const double A = static_cast<double>(plan.training.grad_accum);
  const int64_t c = plan.schedule.checkpoint_every;
  const double recompute = c > 0 ? cost.layer_forward_time() : 0;
  const double gpu = A * (L * (cost.layer_forward_time() + cost.layer_backward_time() + recompute) + cost.head_time() +
                          cost.embed_forward_time() + cost.embed_backward_time());
  const double tb = static_cast<double>(dtype_bytes(plan.precision.transfer));
  const double layer = static_cast<double>(pc.per_layer) * tb;
  const double head = static_cast<double>(mc.vocab_size * mc.hidden_size + pc.final_norm) * tb;
  const double embed = static_cast<double>(pc.embedding) * tb;
  const double weights = cost.h2d_time(embed) + cost.h2d_time(head) + 2 * L * cost.h2d_time(layer);
  const bool layer_major = plan.schedule.order == ScheduleOrder::kLayerMajor;
  double h2d = layer_major ? weights : A * weights;
  if (c > 0 && plan.schedule.checkpoint_location == CheckpointLocation::kHost) {
    const double n_ckpt = static_cast<double>((mc.num_layers + c - 1) / c);
    const ActivationBytes act =
        model.activation_bytes_per_token_per_layer(plan.training.seq_len, dtype_bytes(plan.precision.compute));
    const double hidden = std::ceil(act.checkpoint * static_cast<double>(plan.training.micro_batch * plan.training.seq_len) - 1e-9);
    h2d += n_ckpt * A * cost.h2d_time(hidden);
  }
  return std::max(gpu, h2d);
}

// Optimizer threads: the fewest that reach the highest Adam rate the cost model gives for these
// formats (the rate is capped by host memory bandwidth, so more threads than that only take cores
// from the data loader and copies). Hyper-threads (above `cores`) are not counted on.
int64_t best_threads(Plan plan, const ModelSpec& model, const HardwareProfile& rig) {
  int64_t best_t = rig.host.cores;
  double best_rate = -1;
  for (int64_t t = 1; t <= rig.host.cores; ++t) {
    plan.optimizer.threads = t;
    const double r = sim::CostModel(plan, model, rig).adam_rate();
    if (r > best_rate * (1 + 1e-12)) {
      best_rate = r;
      best_t = t;
    }
  }
  return best_t;
}

std::string fmt_pct(double f) {
  char b[32];
  std::snprintf(b, sizeof b, std::fabs(f) < 0.001 && f != 0 ? "%.3f%%" : "%.1f%%", 100 * f);
  return b;
}

std::string ckpt_phrase(const Plan& p) {
  if (p.schedule.checkpoint_every == 0) return "none (every activation kept, no recompute)";
  return "every " + std::to_string(p.schedule.checkpoint_every) + " layer" + (p.schedule.checkpoint_every == 1 ? "" : "s") +
         " on " + name(p.schedule.checkpoint_location);
}

// (label, value) for each knob, in a fixed order, so two plans can be compared knob by knob.
std::vector<std::pair<std::string, std::string>> knob_phrases(const Plan& p) {
  return {
      {"micro-batch", std::to_string(p.training.micro_batch) + " x " + std::to_string(p.training.grad_accum)},
      {"order", name(p.schedule.order)},
      {"prefetch", std::to_string(p.schedule.prefetch_depth) + " (" + std::to_string(p.schedule.device_layer_buffers) + " buffers)"},
      {"checkpoints", ckpt_phrase(p)},
      {"master weights in", p.placement.master_weights == Tier::kNvme ? "NVMe" : "RAM"},
      {"optimizer states in", p.placement.optimizer_states == Tier::kNvme ? "NVMe" : "RAM"},
      {"m/v", std::string(state_format_name(p.optimizer.m_format)) + "/" + state_format_name(p.optimizer.v_format)},
      {"transfer", dtype_name(p.precision.transfer)},
      {"optimizer threads", std::to_string(p.optimizer.threads)},
      {"pinned staging", p.placement.pinned_staging_bytes > 0 ? format_bytes(static_cast<double>(p.placement.pinned_staging_bytes)) : ""},
  };
}

// "micro-batch 8 x 8 instead of 4 x 16; prefetch 1 (2 buffers) instead of 2 (3 buffers)".
std::string diff_text(const Plan& a, const Plan& ref, bool with_ref = true) {
  const auto pa = knob_phrases(a), pr = knob_phrases(ref);
  std::string out;
  for (size_t i = 0; i < pa.size(); ++i) {
    if (pa[i].second == pr[i].second || pa[i].first == "pinned staging" || pa[i].first == "optimizer threads") continue;
    if (!out.empty()) out += "; ";
    out += pa[i].first + " " + pa[i].second;
    if (with_ref) out += " instead of " + pr[i].second;
  }
  return out.empty() ? "the same knobs" : out;
}

std::string resource_label(const std::string& r) {
  static const std::map<std::string, std::string> names = {
      {"gpu", "GPU compute"}, {"h2d", "H2D transfers"}, {"d2h", "D2H transfers"}, {"cpu", "the CPU optimizer"},
      {"host_memory", "host memory bandwidth"}, {"nvme_read", "NVMe reads"}, {"nvme_write", "NVMe writes"},
      {"none", "nothing"}};
  auto it = names.find(r);
  return it == names.end() ? r : it->second;
}

std::string upper_label(const std::string& r) {
  static const std::map<std::string, std::string> names = {
      {"gpu", "GPU"}, {"h2d", "H2D"}, {"d2h", "D2H"}, {"cpu", "CPU-optimizer"}, {"host_memory", "host-memory"},
      {"nvme_read", "NVMe-read"}, {"nvme_write", "NVMe-write"}, {"none", "nothing"}};
  auto it = names.find(r);
  return it == names.end() ? r : it->second;
}

std::string stall_label(const std::string& s) {
  if (s == "buffer") return "transfers waiting for a free device buffer";
  if (s == "weights") return "GPU waiting for weights";
  if (s == "optimizer") return "GPU waiting for the optimizer";
  if (s == "activations") return "GPU waiting for activations";
  if (s == "checkpoint_copy") return "GPU waiting for checkpoint copies";
  return "GPU waiting (" + s + ")";
}

std::string why_lost(const Candidate& alt, const Candidate& best) {
  const double slower = 1 - alt.result.tokens_per_s / best.result.tokens_per_s;
  std::string cause;
  if (alt.result.bottleneck != best.result.bottleneck) {
    cause = upper_label(alt.result.bottleneck) + "-bound";
  } else {
    std::string worst;
    double grow = 0;
    for (const auto& [k, v] : alt.result.stalls) {
      auto it = best.result.stalls.find(k);
      const double d = v - (it == best.result.stalls.end() ? 0 : it->second);
      if (d > grow) {
        grow = d;
        worst = k;
      }
    }
    if (!worst.empty() && grow > 1e-3 * best.result.step_time_s)
      cause = "+" + format_duration(grow) + " " + stall_label(worst);
    else
      cause = "+" + format_duration(alt.result.step_time_s - best.result.step_time_s) + " per step, " +
              upper_label(alt.result.bottleneck) + "-bound like the best";
  }
  return fmt_pct(std::max(0.0, slower)) + " slower: " + cause + "; " + diff_text(alt.plan, best.plan);
}

Predicted predicted_of(const sim::SimResult& r) {
  Predicted p;
  p.step_time_s = r.step_time_s;
  p.tokens_per_s = r.tokens_per_s;
  p.tflops = r.tflops;
  p.mfu = std::clamp(r.mfu, 0.0, 1.0);
  p.bottleneck = r.bottleneck.empty() ? "none" : r.bottleneck;
  p.peak_bytes = r.peak_bytes;
  return p;
}

// A copy of the rig with one tier enlarged by `more` bytes (relief what-ifs).
HardwareProfile enlarged(const HardwareProfile& rig, const std::string& tier, double more) {
  HardwareProfile r = rig;
  if (tier == "device") r.gpu.memory_bytes.value += more;
  if (tier == "ram") r.host.ram_bytes.value += more;
  if (tier == "pinned") {
    r.host.pinnable_bytes.value += more;
    r.host.ram_bytes.value = std::max(r.host.ram_bytes.value, r.host.pinnable_bytes.value);
  }
  if (tier == "nvme" && !r.storage.empty()) r.storage[0].capacity_bytes.value += more;
  return r;
}

struct Structural {
  Knobs k;
  Facts const* facts = nullptr;
  Needs needs;
  double lb = 0;
  int64_t kmax = 1;
  size_t index = 0;
};

std::string tier_more_text(const std::string& tier, double bytes) {
  const std::string what = tier == "device" ? "device memory" : tier == "pinned" ? "pinnable host memory"
                           : tier == "ram"  ? "host RAM"
                                            : "NVMe capacity";
  return format_bytes(bytes) + " more " + what;
}

}  // namespace

bool is_cpu_backend(const HardwareProfile& rig) {
  return rig.gpu.name.rfind("CPU backend", 0) == 0 || rig.links.kind == "host-memcpy";
}

int64_t default_seq_len(const ModelSpec& model) {
  return std::min<int64_t>(kDefaultSeqCap, model.config().max_position_embeddings);
}

Result<std::vector<StateFormat>> parse_state_format_list(const std::string& text) {
  std::vector<StateFormat> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    auto f = parse_state_format(item);
    if (!f.ok() || item.empty())
      return invalid_argument("state format '" + item + "' is not known; accepted: a comma-separated list of fp32, bf16, q8, q4, q3, q2");
    if (std::find(out.begin(), out.end(), *f) == out.end()) out.push_back(*f);
  }
  if (out.empty()) return invalid_argument("empty list of state formats; accepted: a comma-separated list of fp32, bf16, q8, q4, q3, q2");
  return out;
}

std::string describe_knobs(const Plan& plan) {
  std::string out;
  for (const auto& [k, v] : knob_phrases(plan)) {
    if (v.empty()) continue;
    if (!out.empty()) out += ", ";
    out += k + " " + v;
  }
  return out;
}

namespace {
Result<SearchResult> search_plan_once(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                                      const SearchOptions& opt);
}  // namespace

Result<SearchResult> search_plan(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                                 const SearchOptions& opt) {
  MT_ASSIGN_OR_RETURN(SearchResult res, search_plan_once(model, rig, req, opt));
  const Plan& p = res.best.plan;
  if (res.feasible && (p.placement.master_weights == Tier::kNvme || p.placement.optimizer_states == Tier::kNvme)) {
    // Say why state goes to NVMe: the same plan with everything in RAM, as the simulator sees it.
    Plan in_ram = p;
    in_ram.placement.master_weights = Tier::kRam;
    in_ram.placement.optimizer_states = Tier::kRam;
    in_ram.placement.nvme_dirs.clear();
    in_ram.placement.pinned_staging_bytes = 0;
    const std::string what = p.placement.master_weights == Tier::kNvme && p.placement.optimizer_states == Tier::kNvme
                                 ? "master weights and optimizer states"
                             : p.placement.master_weights == Tier::kNvme ? "master weights"
                                                                    : "optimizer states";
    auto r = sim::simulate(in_ram, model, rig);
    if (r.ok() && !r->feasible)
      res.placement_note = what + " go to NVMe because RAM is short: with everything in RAM, " + r->reason + ".";
    else if (r.ok())
      res.placement_note = what + " go to NVMe although RAM would hold them (" +
                           format_bytes(static_cast<double>(r->peak_bytes.ram)) + " of " +
                           format_bytes(static_cast<double>(r->capacity_bytes.ram)) + "): the NVMe plan simulated faster.";
  }
  if (!res.feasible || (p.optimizer.m_format == StateFormat::kFp32 && p.optimizer.v_format == StateFormat::kFp32)) return res;
  // The best plan keeps lossy states: say what they buy against fp32 states.
  SearchRequest fp32 = req;
  fp32.policy.state_formats = {StateFormat::kFp32};
  const std::string fmt = std::string(state_format_name(p.optimizer.m_format)) + "/" + state_format_name(p.optimizer.v_format);
  auto alt = search_plan_once(model, rig, fp32, opt);
  if (alt.ok() && !alt->feasible) {
    res.state_format_note = "the lossy optimizer states (m/v " + fmt + ") are what make this plan fit: with fp32 states nothing fits (" +
                            alt->infeasible_reason + ")";
  } else if (alt.ok()) {
    const double gain = res.best.result.tokens_per_s / alt->best.result.tokens_per_s - 1;
    char b[160];
    std::snprintf(b, sizeof b, "%.1f%% faster than the best plan with fp32 states (%.0f tokens/s)", 100 * gain,
                  alt->best.result.tokens_per_s);
    res.state_format_note = "the lossy optimizer states (m/v " + fmt + ") make this plan " + b;
  }
  return res;
}

namespace {
Result<SearchResult> search_plan_once(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                                      const SearchOptions& opt) {
  const auto t_start = Clock::now();
  const ModelConfig& mc = model.config();
  SearchResult res;
  res.model_name = model.name().empty() ? mc.model_type : model.name();
  res.rig_name = rig.name;

  // ---- the request ----
  const int64_t seq = req.seq_len > 0 ? req.seq_len : default_seq_len(model);
  if (seq > mc.max_position_embeddings)
    return invalid_argument("--seq " + std::to_string(seq) + " exceeds the model's max_position_embeddings; accepted: 1 .. " +
                            std::to_string(mc.max_position_embeddings));
  const int64_t tokens = req.tokens_per_step > 0 ? req.tokens_per_step : kDefaultSequencesPerStep * seq;
  if (tokens % seq != 0) {
    // The nearest multiples below and above; below 1 sequence there is only the one above.
    const int64_t below = tokens / seq * seq, above = below + seq;
    return invalid_argument("--tokens-per-step " + std::to_string(tokens) + " is not a multiple of the sequence length " +
                            std::to_string(seq) + "; accepted: a multiple of it, e.g. " +
                            (below > 0 ? std::to_string(below) + " or " : std::string()) + std::to_string(above));
  }
  const int64_t sequences = tokens / seq;
  res.seq_len = seq;
  res.tokens_per_step = tokens;
  if (req.policy.state_formats.empty()) return invalid_argument("the state-format policy is empty; accepted: fp32, bf16, q8, q4, q3, q2");

  const bool cpu = is_cpu_backend(rig);
  DType compute = req.policy.compute.value_or(cpu ? DType::kFp32 : DType::kBf16);
  std::vector<StateFormat> formats = req.policy.state_formats;
  std::vector<DType> transfers;
  if (cpu) {
    if (compute != DType::kFp32)
      return unsupported("rig '" + rig.name + "' is the CPU backend, which computes in fp32; accepted: --compute fp32 (or leave it out)");
    // fp32 transfer; a bf16 streaming copy only where master weights go to NVMe (the copy in RAM
    // is then what the layers are computed from).
    transfers = {DType::kFp32, DType::kBf16};
    res.assumptions.push_back("rig '" + rig.name + "' is the CPU backend (megatrain-exec --backend cpu): fp32 compute; fp32 transfer, "
                              "or a bf16 streaming copy when master weights go to NVMe; m and v in the allowed state formats");
  } else if (compute == DType::kBf16) {
    transfers = {DType::kBf16, DType::kFp32};
  } else {
    transfers = {DType::kFp32};  // streaming bf16 weights into an fp32 computation would round them
  }
  if (compute == DType::kFp16) return invalid_argument("compute fp16 is not a plan precision; accepted: bf16, fp32");

  const Caps caps = caps_of(rig);
  const double device_budget = caps.device;
  const int64_t L = mc.num_layers;

  // Formats: a pair with no more bytes per parameter and an Adam rate at least as high dominates.
  struct FormatPair {
    StateFormat m, v;
  };
  std::vector<FormatPair> pairs;
  for (StateFormat m : formats)
    for (StateFormat v : formats) pairs.push_back({m, v});

  // Threads per (transfer, formats).
  std::map<std::tuple<int, int, int>, int64_t> threads_for;
  std::map<std::tuple<int, int, int>, double> adam_rate_for;
  {
    Knobs k;
    k.micro_batch = 1;
    for (DType t : transfers)
      for (const FormatPair& fp : pairs) {
        k.transfer = t;
        k.m_format = fp.m;
        k.v_format = fp.v;
        Plan p = make_plan(k, req, seq, compute, rig);
        const int64_t th = best_threads(p, model, rig);
        p.optimizer.threads = th;
        const auto key = std::make_tuple(static_cast<int>(t), static_cast<int>(fp.m), static_cast<int>(fp.v));
        threads_for[key] = th;
        adam_rate_for[key] = sim::CostModel(p, model, rig).adam_rate();
      }
  }
  if (!opt.exhaustive && pairs.size() > 1) {
    std::vector<FormatPair> kept;
    for (const FormatPair& a : pairs) {
      bool dominated = false;
      for (const FormatPair& b : pairs) {
        if (a.m == b.m && a.v == b.v) continue;
        const double ab = state_format_bytes_per_element(a.m, 128), av = state_format_bytes_per_element(a.v, 128);
        const double bb = state_format_bytes_per_element(b.m, 128), bv = state_format_bytes_per_element(b.v, 128);
        bool all = bb <= ab && bv <= av;
        bool strict = bb < ab || bv < av;
        for (DType t : transfers) {
          const double ra = adam_rate_for[{static_cast<int>(t), static_cast<int>(a.m), static_cast<int>(a.v)}];
          const double rb = adam_rate_for[{static_cast<int>(t), static_cast<int>(b.m), static_cast<int>(b.v)}];
          all = all && rb >= ra;
          strict = strict || rb > ra;
        }
        if (all && strict) dominated = true;
      }
      if (!dominated) kept.push_back(a);
    }
    res.stats.dominated += static_cast<int64_t>(pairs.size() - kept.size());
    pairs = kept;
  }

  // ---- enumerate structural candidates ----
  std::vector<int64_t> micro_batches;
  for (int64_t m = 1; m <= sequences; ++m)
    if (sequences % m == 0) micro_batches.push_back(m);
  std::vector<Facts> facts;
  facts.reserve(micro_batches.size());
  for (int64_t m : micro_batches) facts.push_back(facts_for(model, seq, m, compute));

  std::vector<Structural> feasible;
  // When nothing fits: the candidate closest to fitting, and the least need per tier.
  double closest_ratio = std::numeric_limits<double>::infinity();
  Needs closest_needs;
  Knobs closest_knobs;
  Needs least{std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity(),
              std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity(), 0};
  std::vector<std::pair<Structural, Needs>> blocked;  // infeasible, kept for relief what-ifs
  size_t index = 0;
  const int64_t kmax_all = std::max(1, opt.max_prefetch_depth);

  for (size_t mi = 0; mi < micro_batches.size(); ++mi) {
    const Facts& f = facts[mi];
    for (bool layer_major : {true, false}) {
      for (int64_t c : kCheckpointIntervals) {
        if (c > L) continue;
        for (bool ckpt_host : {true, false}) {
          if (c == 0 && !ckpt_host) continue;  // no checkpoints: the location means nothing
          for (bool master_nvme : {false, true}) {
            for (bool states_nvme : {false, true}) {
              if ((master_nvme || states_nvme) && !caps.has_nvme) continue;
              for (DType t : transfers) {
                // The executor streams master weights on NVMe from a bf16 copy in RAM.
                if (master_nvme && t != DType::kBf16) continue;
                if (cpu && t == DType::kBf16 && !master_nvme) continue;
                for (const FormatPair& fp : pairs) {
                  Knobs k;
                  k.micro_batch = micro_batches[mi];
                  k.grad_accum = sequences / micro_batches[mi];
                  k.layer_major = layer_major;
                  k.ckpt_every = c;
                  k.ckpt_host = ckpt_host;
                  k.master_nvme = master_nvme;
                  k.states_nvme = states_nvme;
                  k.transfer = t;
                  k.m_format = fp.m;
                  k.v_format = fp.v;
                  k.threads = threads_for[{static_cast<int>(t), static_cast<int>(fp.m), static_cast<int>(fp.v)}];
                  // On the CPU backend a bf16 copy rounds the weights the layers compute with: only
                  // when RAM cannot hold the same plan with fp32 master weights in it.
                  if (cpu && master_nvme) {
                    Knobs in_ram = k;
                    in_ram.master_nvme = false;
                    in_ram.transfer = DType::kFp32;
                    if (fits(needs_of(in_ram, f, compute, device_budget), caps)) continue;
                  }
                  // Staging: the smallest that holds one transfer, then the largest multiple that fits.
                  Needs n = needs_of(k, f, compute, device_budget);
                  // The plan rule's minimum is exact (quantised blocks padded per tensor), a few
                  // bytes above the per-element estimate: start from whichever is larger.
                  if (n.staging_min > 0)
                    n.staging_min = std::max(n.staging_min, static_cast<double>(nvme_unit_transfer_bytes(
                                                                model, k.master_nvme, k.states_nvme, k.m_format,
                                                                k.v_format, OptimizerConfig{}.block_size)));
                  std::vector<int64_t> stagings = {0};
                  if (n.staging_min > 0) {
                    stagings.clear();
                    for (int64_t mult : kStagingMultiples) stagings.push_back(static_cast<int64_t>(n.staging_min) * mult);
                    if (!opt.exhaustive) {
                      int64_t chosen = stagings.front();
                      for (int64_t s : stagings) {
                        Knobs t2 = k;
                        t2.staging = s;
                        if (fits(needs_of(t2, f, compute, device_budget), caps)) chosen = s;
                      }
                      stagings = {chosen};
                    }
                  }
                  for (int64_t staging : stagings) {
                    k.staging = staging;
                    n = needs_of(k, f, compute, device_budget);
                    // The layer prefetched beside the working set (prefetch depth 1, the least a
                    // pass streams with) must fit too: in the simulator a transfer holding memory
                    // the GPU needs next is a deadlock.
                    {
                      const double w = f.params.size() > 2 ? f.params[1] * static_cast<double>(std::max(dtype_bytes(compute), dtype_bytes(k.transfer))) : 0;
                      if (!opt.exhaustive) n.device += w;
                    }
                    const int64_t kmax = opt.exhaustive ? kmax_all : prefetch_cap(k, f, compute, device_budget, kmax_all);
                    res.stats.candidates += kmax;
                    Structural s{k, &f, n, 0, kmax, index++};
                    const bool ok = opt.exhaustive || fits(n, caps);
                    least.device = std::min(least.device, n.device);
                    least.pinned = std::min(least.pinned, n.pinned);
                    least.ram = std::min(least.ram, n.ram);
                    least.nvme = std::min(least.nvme, n.nvme);
                    if (!ok) {
                      res.stats.infeasible += kmax;
                      const double r = worst_ratio(n, caps);
                      if (r < closest_ratio) {
                        closest_ratio = r;
                        closest_needs = n;
                        closest_knobs = k;
                      }
                      blocked.push_back({s, n});
                      continue;
                    }
                    feasible.push_back(s);
                  }
                }
              }
            }
          }
        }
      }
    }
  }

  // ---- dominance among the statically feasible ----
  if (!opt.exhaustive) {
    auto key_of = [](const Knobs& k) {
      return std::make_tuple(k.micro_batch, k.layer_major, k.ckpt_every, k.ckpt_host, k.master_nvme, k.states_nvme,
                             static_cast<int>(k.transfer), static_cast<int>(k.m_format), static_cast<int>(k.v_format));
    };
    std::map<decltype(key_of(Knobs{})), size_t> by_key;
    for (size_t i = 0; i < feasible.size(); ++i) by_key[key_of(feasible[i].k)] = i;
    auto twin_fits = [&](Knobs k) { return by_key.count(key_of(k)) > 0; };
    std::vector<Structural> kept;
    for (const Structural& s : feasible) {
      const Knobs& k = s.k;
      bool dominated = false;
      // D1: RAM placement has the same tasks minus the NVMe reads and writes.
      if (k.master_nvme) {
        Knobs t = k;
        t.master_nvme = false;
        dominated = dominated || twin_fits(t);
      }
      if (k.states_nvme) {
        Knobs t = k;
        t.states_nvme = false;
        dominated = dominated || twin_fits(t);
      }
      // D2: a bf16 transfer moves half the bytes over the link, with the same optimizer bytes.
      if (k.transfer == DType::kFp32 && compute == DType::kBf16) {
        Knobs t = k;
        t.transfer = DType::kBf16;
        dominated = dominated || twin_fits(t);
      }
      // D3: microbatch-major does the same GPU work and streams the weights grad_accum times.
      if (!k.layer_major) {
        Knobs t = k;
        t.layer_major = true;
        dominated = dominated || twin_fits(t);
      }
      if (dominated) {
        res.stats.dominated += s.kmax;
        continue;
      }
      kept.push_back(s);
    }
    feasible = std::move(kept);
  }

  // ---- lower bounds and best-first order ----
  for (Structural& s : feasible) {
    Knobs k = s.k;
    k.prefetch = 1;
    k.buffers = std::max<int64_t>(2, k.ckpt_every + 1);
    s.lb = lower_bound(make_plan(k, req, seq, compute, rig), model, rig);
  }
  std::stable_sort(feasible.begin(), feasible.end(), [](const Structural& a, const Structural& b) {
    return a.lb != b.lb ? a.lb < b.lb : a.index < b.index;
  });

  if (opt.feasibility_only) {
    // The static bytes say it fits; the simulator must agree for one of them (it also refuses a
    // schedule that deadlocks on device memory).
    res.feasible = false;
    for (size_t si = 0; si < feasible.size() && si < 16 && !res.feasible; ++si) {
      Knobs k = feasible[si].k;
      k.prefetch = 1;
      k.buffers = std::max<int64_t>(2, k.ckpt_every + 1);
      Candidate c;
      c.plan = make_plan(k, req, seq, compute, rig);
      auto r = sim::simulate(c.plan, model, rig);
      ++res.stats.simulated;
      if (!r.ok()) return r.status();
      if (!r->feasible) {
        ++res.stats.refused;
        if (res.refusals.size() < 5) res.refusals.push_back(describe_knobs(c.plan) + ": " + r->reason);
        continue;
      }
      r->engine.reset();
      c.result = std::move(*r);
      c.plan.predicted = predicted_of(c.result);
      c.lower_bound_s = feasible[si].lb;
      res.best = c;
      res.feasible = true;
    }
    if (!res.feasible) feasible.clear();
  }

  // ---- simulate ----
  std::vector<Candidate> simulated;  // feasible results, in evaluation order
  std::vector<size_t> simulated_struct;
  double best_time = std::numeric_limits<double>::infinity();
  // With a target, a candidate whose lower bound misses it is skipped like one that cannot win.
  const double target_time = opt.stop_at_tokens_per_s > 0 ? static_cast<double>(tokens) / opt.stop_at_tokens_per_s
                                                           : std::numeric_limits<double>::infinity();
  auto cut = [&] { return std::min(best_time, target_time) * (1 - opt.tolerance); };
  size_t best_i = 0;
  bool stop = opt.feasibility_only;
  for (size_t si = 0; si < feasible.size() && !stop; ++si) {
    const Structural& s = feasible[si];
    if (!opt.exhaustive && s.lb >= cut()) {
      for (size_t r = si; r < feasible.size(); ++r) res.stats.bounded += feasible[r].kmax;
      break;
    }
    double k_time = std::numeric_limits<double>::infinity();  // best step time of this structure so far
    for (int64_t K = 1; K <= s.kmax; ++K) {
      if (!opt.exhaustive && s.lb >= cut()) {
        res.stats.bounded += s.kmax - K + 1;
        break;
      }
      const int64_t c = s.k.ckpt_every;
      const int64_t b_lo = std::max<int64_t>(K + 1, c + 1), b_hi = std::max<int64_t>(K + 1, c + K);
      bool plateau = false, refused = false;
      const double prev_k_time = k_time;
      for (int64_t B = opt.exhaustive ? b_lo : b_hi; B <= b_hi; ++B) {
        Knobs k = s.k;
        k.prefetch = K;
        k.buffers = B;
        Candidate cand;
        cand.plan = make_plan(k, req, seq, compute, rig);
        cand.lower_bound_s = s.lb;
        auto r = sim::simulate(cand.plan, model, rig);
        if (!r.ok()) return r.status().with_context("simulating " + describe_knobs(cand.plan));
        ++res.stats.simulated;
        if (!r->feasible) {
          ++res.stats.refused;
          if (res.refusals.size() < 5) res.refusals.push_back(describe_knobs(cand.plan) + ": " + r->reason);
          refused = true;
          continue;
        }
        r->engine.reset();
        cand.result = std::move(*r);
        cand.plan.predicted = predicted_of(cand.result);
        plateau = plateau || cand.result.step_time_s >= prev_k_time * (1 - 1e-9);
        k_time = std::min(k_time, cand.result.step_time_s);
        if (cand.result.step_time_s < best_time) {
          best_time = cand.result.step_time_s;
          best_i = simulated.size();
        }
        simulated.push_back(std::move(cand));
        simulated_struct.push_back(si);
        if (opt.stop_at_tokens_per_s > 0 && simulated.back().result.tokens_per_s >= opt.stop_at_tokens_per_s) stop = true;
      }
      if (stop) break;
      // A deeper prefetch holds more device memory: it is refused too.
      if (!opt.exhaustive && refused && K < s.kmax) {
        res.stats.infeasible += s.kmax - K;
        break;
      }
      // Prefetch plateau: when one more layer of prefetch gained nothing, the search stops
      // deepening (docs/planner.md).
      if (!opt.exhaustive && plateau && K < s.kmax) {
        res.stats.dominated += s.kmax - K;
        break;
      }
    }
  }

  res.assumptions.push_back("tokens per step " + std::to_string(tokens) + " = " + std::to_string(sequences) +
                            " sequences of " + std::to_string(seq) + " tokens" +
                            (req.tokens_per_step > 0 ? "" : " (default: 64 sequences)"));
  {
    std::string f;
    for (StateFormat x : formats) f += (f.empty() ? "" : ", ") + std::string(state_format_name(x));
    res.assumptions.push_back(std::string("compute ") + dtype_name(compute) + ", fp32 master weights; optimizer-state formats allowed: " + f);
  }

  if (simulated.empty()) {
    res.feasible = opt.feasibility_only && !feasible.empty();
    if (res.feasible) {
      res.stats.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
      return res;
    }
    // Nothing fits: per tier, with numbers.
    if (std::isfinite(closest_ratio)) {
      res.closest_needs = tier_needs(closest_needs, caps);
      Knobs k = closest_knobs;
      k.prefetch = 1;
      k.buffers = std::max<int64_t>(2, k.ckpt_every + 1);
      res.closest_description = describe_knobs(make_plan(k, req, seq, compute, rig));
    }
    if (std::isfinite(least.device)) res.least_needs = tier_needs(least, caps);
    std::ostringstream why;
    why << (!feasible.empty() && opt.stop_at_tokens_per_s > 0 ? "no plan reaches the target: " : "nothing fits: ") << res.model_name << " at seq " << seq << ", " << tokens << " tokens per step on rig '"
        << rig.name << "'.";
    if (!res.closest_needs.empty()) {
      why << " The closest plan (" << res.closest_description << ") is short of:";
      bool any = false;
      for (const TierNeed& t : res.closest_needs) {
        if (t.short_by() <= 0) continue;
        why << (any ? ";" : "") << " " << t.tier << " needs " << format_bytes(t.need) << ", has " << format_bytes(t.have)
            << ", short by " << format_bytes(t.short_by()) << " (" << static_cast<int64_t>(std::ceil(t.short_by()))
            << " bytes)";
        any = true;
      }
      why << ".";
    }
    if (!res.least_needs.empty()) {
      why << " The least any plan needs, tier by tier:";
      for (size_t i = 0; i < res.least_needs.size(); ++i) {
        const TierNeed& t = res.least_needs[i];
        why << (i ? "," : "") << " " << t.tier << " " << format_bytes(t.need) << " (has " << format_bytes(t.have) << ")";
      }
      why << ".";
    }
    if (!feasible.empty() && opt.stop_at_tokens_per_s > 0) {
      res.target_missed = true;
      res.target_bound_tokens_per_s = static_cast<double>(tokens) / feasible.front().lb;
    }
    if (!feasible.empty() && opt.stop_at_tokens_per_s > 0)
      why << " " << feasible.size() << " structures fit, but none can reach " << opt.stop_at_tokens_per_s
          << " tokens/s: the fastest lower bound is " << static_cast<double>(tokens) / feasible.front().lb << " tokens/s.";
    if (!res.refusals.empty()) why << " The simulator refused every plan that fitted statically, e.g. " << res.refusals.front();
    if (!caps.has_nvme) why << " The rig has no NVMe drives, so every state must sit in RAM.";
    res.infeasible_reason = why.str();
    res.stats.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    return res;
  }

  // Fill the alternatives table: the structures the bound skipped, in lower-bound order, each at
  // the prefetch depth that serves it best (they cannot win; the table says by how much).
  {
    std::vector<bool> seen(feasible.size(), false);
    for (size_t si : simulated_struct) seen[si] = true;
    size_t have = 0;
    for (bool b : seen) have += b ? 1 : 0;
    int64_t extra = 0;
    for (size_t si = 0; si < feasible.size() && have < static_cast<size_t>(req.top) + 1 && extra < 4 * req.top + 8; ++si) {
      if (seen[si]) continue;
      double prev = std::numeric_limits<double>::infinity();
      bool any = false;
      for (int64_t K = 1; K <= std::min<int64_t>(feasible[si].kmax, 4); ++K) {
        Knobs k = feasible[si].k;
        k.prefetch = K;
        k.buffers = std::max<int64_t>(K + 1, k.ckpt_every + K);
        Candidate cand;
        cand.plan = make_plan(k, req, seq, compute, rig);
        cand.lower_bound_s = feasible[si].lb;
        auto r = sim::simulate(cand.plan, model, rig);
        ++extra;
        ++res.stats.table_simulations;
        if (!r.ok() || !r->feasible) break;
        r->engine.reset();
        cand.result = std::move(*r);
        cand.plan.predicted = predicted_of(cand.result);
        const double t = cand.result.step_time_s;
        simulated.push_back(std::move(cand));
        simulated_struct.push_back(si);
        any = true;
        if (t >= prev * (1 - 1e-9)) break;
        prev = t;
      }
      if (any) ++have;
    }
  }

  res.feasible = true;
  res.best = simulated[best_i];
  res.bottleneck = res.best.result.bottleneck;

  // ---- alternatives: the best of each other structure, fastest first ----
  {
    std::map<size_t, size_t> group_best;  // structural -> simulated index
    for (size_t i = 0; i < simulated.size(); ++i) {
      const size_t g = simulated_struct[i];
      auto it = group_best.find(g);
      if (it == group_best.end() || simulated[i].result.step_time_s < simulated[it->second].result.step_time_s) group_best[g] = i;
    }
    std::vector<size_t> order;
    for (const auto& [g, i] : group_best)
      if (g != simulated_struct[best_i]) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return simulated[a].result.step_time_s != simulated[b].result.step_time_s
                 ? simulated[a].result.step_time_s < simulated[b].result.step_time_s
                 : a < b;
    });
    for (size_t j = 0; j < order.size() && static_cast<int>(j) < req.top; ++j) {
      Candidate c = simulated[order[j]];
      c.why = why_lost(c, res.best);
      res.alternatives.push_back(std::move(c));
    }
  }

  // ---- the bottleneck and what would relieve it ----
  {
    const sim::SimResult& r = res.best.result;
    const double busy = r.busy.count(r.bottleneck) ? r.busy.at(r.bottleneck) : 0;
    const double cp = r.critical_path.count(r.bottleneck) ? r.critical_path.at(r.bottleneck) : 0;
    std::ostringstream t;
    t << upper_label(r.bottleneck) << "-bound: " << resource_label(r.bottleneck) << " holds " << format_duration(cp)
      << " of the " << format_duration(r.step_time_s) << " step's critical path (busy " << fmt_pct(busy) << ")";
    if (r.bottleneck == "gpu") t << "; MFU " << fmt_pct(r.mfu);
    double stall_total = 0;
    for (const auto& [k, v] : r.stalls)
      if (k != "buffer") stall_total += v;
    if (stall_total > 0) t << "; the GPU waits " << format_duration(stall_total) << " per step";
    res.bottleneck_text = t.str();
  }
  if (opt.relief) {
    const Candidate& best = res.best;
    auto simulate_best_k = [&](Knobs k, const HardwareProfile& on, Candidate& out) -> bool {
      bool found = false;
      for (int64_t K = 1; K <= std::min<int64_t>(4, kmax_all); ++K) {
        k.prefetch = K;
        k.buffers = std::max<int64_t>(K + 1, k.ckpt_every + K);
        Candidate c;
        c.plan = make_plan(k, req, seq, compute, on);
        auto r = sim::simulate(c.plan, model, on);
        ++res.stats.relief_simulations;
        if (!r.ok() || !r->feasible) continue;
        r->engine.reset();
        c.result = std::move(*r);
        if (found && c.result.step_time_s >= out.result.step_time_s * (1 - 1e-9)) break;
        if (!found || c.result.step_time_s < out.result.step_time_s) out = c;
        found = true;
      }
      return found;
    };
    // Candidates blocked by a tier that could beat the best by its lower bound.
    std::vector<std::pair<Structural, Needs>> promising;
    for (auto& [s, n] : blocked) {
      Knobs k = s.k;
      k.prefetch = 1;
      k.buffers = std::max<int64_t>(2, k.ckpt_every + 1);
      s.lb = lower_bound(make_plan(k, req, seq, compute, rig), model, rig);
      if (s.lb < best.result.step_time_s * (1 - kReliefMinGain)) promising.push_back({s, n});
    }
    auto shortfall_total = [&](const Needs& n) {
      double t = 0;
      for (const TierNeed& x : tier_needs(n, caps)) t += x.short_by() / std::max(1.0, x.have);
      return t;
    };
    std::stable_sort(promising.begin(), promising.end(), [&](const auto& a, const auto& b) {
      const double sa = shortfall_total(a.second), sb = shortfall_total(b.second);
      return sa != sb ? sa < sb : a.first.lb < b.first.lb;
    });
    std::vector<std::string> seen;
    std::vector<Relief> found;
    for (const auto& [s, n] : promising) {
      if (seen.size() >= kReliefCandidates) break;
      // NVMe placement only relieves RAM; a blocked candidate that adds it for nothing is skipped.
      const bool ram_short = n.ram > caps.ram || n.pinned > caps.pinned;
      if (!ram_short && ((s.k.master_nvme && best.plan.placement.master_weights == Tier::kRam) ||
                         (s.k.states_nvme && best.plan.placement.optimizer_states == Tier::kRam)))
        continue;
      HardwareProfile bigger = rig;
      std::string tier;
      double more = 0;
      for (const TierNeed& x : tier_needs(n, caps)) {
        if (x.short_by() <= 0) continue;
        bigger = enlarged(bigger, x.tier, x.short_by() * 1.001 + 1);
        if (x.short_by() > more) {
          more = x.short_by();
          tier = x.tier;
        }
      }
      if (tier == "nvme" && rig.storage.empty()) continue;
      Candidate c;
      Knobs k = s.k;
      k.prefetch = best.plan.schedule.prefetch_depth;
      k.buffers = best.plan.schedule.device_layer_buffers;
      const std::string change = diff_text(make_plan(k, req, seq, compute, rig), best.plan, false);
      if (std::find(seen.begin(), seen.end(), change) != seen.end()) continue;
      seen.push_back(change);
      if (!simulate_best_k(s.k, bigger, c)) continue;
      const double gain = c.result.tokens_per_s / best.result.tokens_per_s - 1;
      if (gain < kReliefMinGain) continue;
      Relief rl;
      rl.change = change;
      rl.tokens_per_s = c.result.tokens_per_s;
      rl.gain = gain;
      std::string needs;
      for (const TierNeed& x : tier_needs(n, caps))
        if (x.short_by() > 0) needs += (needs.empty() ? "" : " and ") + tier_more_text(x.tier, x.short_by());
      rl.needs = needs;
      rl.tier = tier;
      rl.more_bytes = more;
      found.push_back(rl);
    }
    // Keep the changes no other one beats on both gain and price.
    for (const Relief& a : found) {
      bool beaten = false;
      for (const Relief& b : found)
        if (&a != &b && b.tier == a.tier && b.gain >= a.gain && b.more_bytes <= a.more_bytes &&
            (b.gain > a.gain || b.more_bytes < a.more_bytes))
          beaten = true;
      if (!beaten) res.relief.push_back(a);
    }
    // Policy: lossy state formats, where the optimizer or the state traffic limits the step.
    const std::string& bn = best.result.bottleneck;
    const bool state_bound = bn == "cpu" || bn == "nvme_read" || bn == "nvme_write" || bn == "host_memory";
    const bool bf16_allowed = std::find(formats.begin(), formats.end(), StateFormat::kBf16) != formats.end();
    if (state_bound && !bf16_allowed) {
      Plan p = best.plan;
      p.optimizer.m_format = StateFormat::kBf16;
      p.optimizer.v_format = StateFormat::kBf16;
      auto r = sim::simulate(p, model, rig);
      ++res.stats.relief_simulations;
      if (r.ok() && r->feasible && r->tokens_per_s > best.result.tokens_per_s * (1 + kReliefMinGain)) {
        Relief rl;
        rl.change = "bf16 optimizer states (m/v bf16/bf16; lossy)";
        rl.tokens_per_s = r->tokens_per_s;
        rl.gain = r->tokens_per_s / best.result.tokens_per_s - 1;
        rl.needs = "the policy to allow them: --state-formats fp32,bf16";
        res.relief.push_back(rl);
      }
    }
    // Hardware: twice the bottleneck resource.
    if (bn != "gpu" && bn != "none" && !bn.empty()) {
      HardwareProfile faster = rig;
      std::string what;
      if (bn == "h2d" || bn == "d2h") {
        for (auto* curve : {&faster.links.h2d.pinned_bandwidth, &faster.links.d2h.pinned_bandwidth})
          for (auto& pt : curve->points) pt.second *= 2;
        what = "a host link with twice the bandwidth";
      } else if ((bn == "nvme_read" || bn == "nvme_write") && !rig.storage.empty()) {
        NvmeSpec extra = rig.storage.front();
        extra.name += " (second copy)";
        extra.path += "-extra";
        faster.storage.push_back(extra);
        what = "one more " + rig.storage.front().name.substr(0, rig.storage.front().name.find(" (")) + " drive";
      } else if (bn == "cpu") {
        faster.host.cores *= 2;
        for (auto& a : faster.host.adam) a.params_per_s.value *= 2;
        what = "twice the optimizer throughput (cores)";
      } else if (bn == "host_memory") {
        faster.host.memory_bandwidth.value *= 2;
        what = "twice the host memory bandwidth";
      }
      if (!what.empty()) {
        Plan p = best.plan;
        if (bn == "nvme_read" || bn == "nvme_write") {
          p.placement.nvme_dirs.clear();
          for (const auto& d : faster.storage) p.placement.nvme_dirs.push_back(d.path);
        }
        auto r = sim::simulate(p, model, faster);
        ++res.stats.relief_simulations;
        if (r.ok() && r->feasible && r->tokens_per_s > best.result.tokens_per_s * (1 + kReliefMinGain)) {
          Relief rl;
          rl.change = "the same plan";
          rl.tokens_per_s = r->tokens_per_s;
          rl.gain = r->tokens_per_s / best.result.tokens_per_s - 1;
          rl.needs = what;
          res.relief.push_back(rl);
        }
      }
    }
  }
  for (const std::string& a : res.best.result.assumptions)
    if (std::find(res.assumptions.begin(), res.assumptions.end(), a) == res.assumptions.end()) res.assumptions.push_back(a);
  res.stats.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  return res;
}
}  // namespace

// ---- output ---------------------------------------------------------------------------------------

namespace {

Json tiers_json(const std::vector<TierNeed>& v) {
  Json j = Json::array();
  for (const TierNeed& t : v)
    j.push_back({{"tier", t.tier}, {"need_bytes", static_cast<int64_t>(std::ceil(t.need))},
                 {"have_bytes", static_cast<int64_t>(t.have)}, {"short_bytes", static_cast<int64_t>(std::ceil(t.short_by()))}});
  return j;
}

Json stats_json(const SearchStats& s) {
  return {{"candidates", s.candidates}, {"infeasible", s.infeasible}, {"dominated", s.dominated}, {"bounded", s.bounded},
          {"simulated", s.simulated}, {"refused", s.refused}, {"table_simulations", s.table_simulations},
          {"relief_simulations", s.relief_simulations},
          {"seconds", s.seconds}};
}

Json knobs_json(const Plan& p) {
  return {{"micro_batch", p.training.micro_batch}, {"grad_accum", p.training.grad_accum}, {"order", name(p.schedule.order)},
          {"prefetch_depth", p.schedule.prefetch_depth}, {"device_layer_buffers", p.schedule.device_layer_buffers},
          {"checkpoint_every", p.schedule.checkpoint_every}, {"checkpoint_location", name(p.schedule.checkpoint_location)},
          {"master_weights", name(p.placement.master_weights)}, {"optimizer_states", name(p.placement.optimizer_states)},
          {"m_format", state_format_name(p.optimizer.m_format)}, {"v_format", state_format_name(p.optimizer.v_format)},
          {"transfer", dtype_name(p.precision.transfer)}, {"threads", p.optimizer.threads},
          {"pinned_staging_bytes", p.placement.pinned_staging_bytes}};
}

}  // namespace

std::string search_json(const SearchResult& r) {
  Json j;
  j["feasible"] = r.feasible;
  j["model"] = r.model_name;
  j["rig"] = r.rig_name;
  j["seq_len"] = r.seq_len;
  j["tokens_per_step"] = r.tokens_per_step;
  if (!r.feasible) {
    j["reason"] = r.infeasible_reason;
    Json shortfalls = Json::array();
    for (const TierNeed& t : r.closest_needs)
      if (t.short_by() > 0) shortfalls.push_back(tiers_json({t})[0]);
    j["shortfalls"] = shortfalls;
    j["closest"] = {{"plan", r.closest_description}, {"tiers", tiers_json(r.closest_needs)}};
    j["least_needs"] = tiers_json(r.least_needs);
    j["refusals"] = r.refusals;
  } else {
    j["plan"] = Json::parse(r.best.plan.to_json_text());
    Json alts = Json::array();
    for (const Candidate& c : r.alternatives) {
      alts.push_back({{"tokens_per_s", c.result.tokens_per_s}, {"step_time_s", c.result.step_time_s},
                      {"bottleneck", c.result.bottleneck}, {"relative", c.result.tokens_per_s / r.best.result.tokens_per_s},
                      {"why", c.why}, {"knobs", knobs_json(c.plan)},
                      {"peak_bytes", {{"device", c.result.peak_bytes.device}, {"pinned", c.result.peak_bytes.pinned},
                                      {"ram", c.result.peak_bytes.ram}, {"nvme", c.result.peak_bytes.nvme}}}});
    }
    j["alternatives"] = alts;
    Json relief = Json::array();
    for (const Relief& x : r.relief)
      relief.push_back({{"change", x.change}, {"tokens_per_s", x.tokens_per_s}, {"gain", x.gain}, {"needs", x.needs},
                        {"tier", x.tier}, {"more_bytes", static_cast<int64_t>(std::ceil(x.more_bytes))}});
    j["bottleneck"] = {{"resource", r.bottleneck}, {"text", r.bottleneck_text}, {"relief", relief}};
  }
  if (!r.state_format_note.empty()) j["state_formats"] = r.state_format_note;
  if (!r.placement_note.empty()) j["placement_note"] = r.placement_note;
  j["search"] = stats_json(r.stats);
  j["assumptions"] = r.assumptions;
  return j.dump(2) + "\n";
}

std::string search_table(const SearchResult& r) {
  std::ostringstream o;
  char line[512];
  o << "megatrain-plan plan: " << r.model_name << " on " << r.rig_name << ", seq " << r.seq_len << ", "
    << r.tokens_per_step << " tokens per step\n\n";
  if (!r.feasible) {
    o << r.infeasible_reason << "\n\n";
    if (!r.closest_needs.empty()) {
      o << "closest plan: " << r.closest_description << "\n";
      std::snprintf(line, sizeof line, "  %-8s %14s %14s %14s\n", "tier", "needs", "has", "short by");
      o << line;
      for (const TierNeed& t : r.closest_needs) {
        std::snprintf(line, sizeof line, "  %-8s %14s %14s %14s\n", t.tier.c_str(), format_bytes(t.need).c_str(),
                      format_bytes(t.have).c_str(), t.short_by() > 0 ? format_bytes(t.short_by()).c_str() : "-");
        o << line;
      }
    }
    if (!r.least_needs.empty()) {
      o << "\nthe least any plan needs, tier by tier\n";
      for (const TierNeed& t : r.least_needs) {
        std::snprintf(line, sizeof line, "  %-8s %14s of %14s%s\n", t.tier.c_str(), format_bytes(t.need).c_str(),
                      format_bytes(t.have).c_str(), t.short_by() > 0 ? "  (short even at best)" : "");
        o << line;
      }
    }
    for (const std::string& s : r.refusals) o << "simulator refused: " << s << "\n";
  } else {
    const sim::SimResult& b = r.best.result;
    o << "best plan\n  " << describe_knobs(r.best.plan) << "\n";
    std::snprintf(line, sizeof line, "  %.0f tokens/s, step %s, %.1f TFLOP/s, MFU %.1f%%\n", b.tokens_per_s,
                  format_duration(b.step_time_s).c_str(), b.tflops, 100 * b.mfu);
    o << line;
    o << "  peak bytes: device " << format_bytes(static_cast<double>(b.peak_bytes.device)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.device)) << ", pinned "
      << format_bytes(static_cast<double>(b.peak_bytes.pinned)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.pinned)) << ", ram "
      << format_bytes(static_cast<double>(b.peak_bytes.ram)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.ram)) << ", nvme "
      << format_bytes(static_cast<double>(b.peak_bytes.nvme)) << " of "
      << format_bytes(static_cast<double>(b.capacity_bytes.nvme)) << "\n";
    if (!r.state_format_note.empty()) o << "\noptimizer states\n  " << r.state_format_note << "\n";
    if (!r.placement_note.empty()) o << "\nplacement\n  " << r.placement_note << "\n";
    o << "\nbottleneck\n  " << r.bottleneck_text << "\n";
    if (r.relief.empty()) o << "  no single change within reach relieves it by " << fmt_pct(kReliefMinGain) << " or more\n";
    for (const Relief& x : r.relief) {
      std::snprintf(line, sizeof line, "  relief: %s gives %.0f tokens/s (+%.1f%%) but needs %s\n", x.change.c_str(),
                    x.tokens_per_s, 100 * x.gain, x.needs.c_str());
      o << line;
    }
    if (!r.alternatives.empty()) {
      o << "\nalternatives (the best plan of each other structure)\n";
      std::snprintf(line, sizeof line, "  %3s %12s %10s  %s\n", "#", "tokens/s", "bottleneck", "why it lost");
      o << line;
      for (size_t i = 0; i < r.alternatives.size(); ++i) {
        const Candidate& c = r.alternatives[i];
        std::snprintf(line, sizeof line, "  %3zu %12.0f %10s  ", i + 1, c.result.tokens_per_s, c.result.bottleneck.c_str());
        o << line << c.why << "\n";
      }
    }
  }
  const SearchStats& s = r.stats;
  std::snprintf(line, sizeof line,
                "\nsearch: %lld candidates: %lld over a tier, %lld dominated, %lld bounded, %lld simulated (%lld refused); "
                "%lld more simulations for the table and %lld for the relief; %.3f s\n",
                static_cast<long long>(s.candidates), static_cast<long long>(s.infeasible), static_cast<long long>(s.dominated),
                static_cast<long long>(s.bounded), static_cast<long long>(s.simulated), static_cast<long long>(s.refused),
                static_cast<long long>(s.table_simulations), static_cast<long long>(s.relief_simulations), s.seconds);
  o << line;
  for (const std::string& a : r.assumptions) o << "assumption: " << a << "\n";
  return o.str();
}

}  // namespace megatrain::planner

// The search's candidates: the request resolved, the knob combinations enumerated in a fixed
// order, and each sized with the compiled step's footprint (detail/candidates.h).
#include "detail/candidates.h"

#include <algorithm>
#include <limits>

#include "megatrain/core/flags.h"
#include "megatrain/core/units.h"

namespace megatrain::planner::detail {
namespace {

// Checkpoint intervals tried (0: keep every activation, no recompute); capped by the layer count.
constexpr int64_t kCheckpointIntervals[] = {0, 1, 2, 4, 8};
// Pinned staging for NVMe traffic, in multiples of the largest single NVMe transfer of one unit.
constexpr int64_t kStagingMultiples[] = {1, 2, 4, 8};

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

// The largest single NVMe transfer of one unit (0 when nothing is on NVMe): the plan rules' minimum.
int64_t staging_unit(const Space& s, const Knobs& k) {
  return nvme_unit_transfer_bytes(s.units.tensor_numels, k.master_nvme, k.states_nvme, k.m_format, k.v_format,
                                  OptimizerConfig{}.block_size);
}

// Staging: the smallest that holds one transfer, then the largest multiple that fits (every
// multiple when exhaustive); none when nothing is on NVMe.
Result<std::vector<int64_t>> staging_choices(const Space& s, Sizer& sizer, Knobs k) {
  const int64_t unit = staging_unit(s, k);
  if (unit == 0) return std::vector<int64_t>{0};
  std::vector<int64_t> stagings;
  for (int64_t mult : kStagingMultiples) stagings.push_back(unit * mult);
  if (s.opt.exhaustive) return stagings;
  int64_t chosen = stagings.front();
  for (int64_t staging : stagings) {
    k.staging = staging;
    MT_ASSIGN_OR_RETURN(step::TierBytes n, sizer.need(k));
    if (fits(n, s.caps)) chosen = staging;
  }
  return std::vector<int64_t>{chosen};
}

// On the CPU backend a bf16 copy rounds the weights the layers compute with: master weights go to
// NVMe only when RAM cannot hold the same plan with fp32 master weights in it.
Result<bool> cpu_in_ram_twin_fits(const Space& s, Sizer& sizer, Knobs k) {
  k.master_nvme = false;
  k.transfer = DType::kFp32;
  k.staging = staging_unit(s, k);
  MT_ASSIGN_OR_RETURN(step::TierBytes n, sizer.need(k));
  return fits(n, s.caps);
}

// The deepest prefetch (up to the search's cap) whose buffers the device budget holds beside the
// rest of the arena; deeper transfers could only wait for memory. At least 1.
Result<int64_t> prefetch_cap(const Space& s, Sizer& sizer, const Knobs& k) {
  int64_t K = 1;
  while (K < s.kmax_all) {
    MT_ASSIGN_OR_RETURN(step::TierBytes n, sizer.need(at_prefetch(k, K + 1)));
    if (n.device > s.caps.device) break;
    ++K;
  }
  return K;
}

}  // namespace

Knobs at_prefetch(Knobs k, int64_t K) {
  k.prefetch = K;
  k.buffers = layer_buffer_range(K, k.ckpt_every).most;
  return k;
}

Plan make_plan(const Knobs& k, const Space& s, const HardwareProfile& on) {
  Plan p;
  p.model = s.req.model_ref;
  p.rig = s.req.rig_ref;
  p.training.seq_len = s.seq;
  p.training.micro_batch = k.micro_batch;
  p.training.grad_accum = k.grad_accum;
  p.training.steps = s.req.steps;
  p.training.document_tokens = s.req.document_tokens;
  p.precision = PrecisionConfig{s.compute, DType::kFp32, k.transfer};
  p.schedule.order = k.layer_major ? ScheduleOrder::kLayerMajor : ScheduleOrder::kMicrobatchMajor;
  p.schedule.prefetch_depth = k.prefetch;
  p.schedule.device_layer_buffers = k.buffers;
  p.schedule.checkpoint_every = k.ckpt_every;
  p.schedule.checkpoint_location = k.ckpt_host ? CheckpointLocation::kHost : CheckpointLocation::kDevice;
  p.placement.master_weights = k.master_nvme ? Tier::kNvme : Tier::kRam;
  p.placement.optimizer_states = k.states_nvme ? Tier::kNvme : Tier::kRam;
  if (k.master_nvme || k.states_nvme)
    for (const auto& d : on.storage) p.placement.nvme_dirs.push_back(d.path);
  p.placement.pinned_staging_bytes = k.staging;
  p.placement.device_budget_bytes = step::usable_device_bytes(on);
  p.optimizer.m_format = k.m_format;
  p.optimizer.v_format = k.v_format;
  p.optimizer.threads = k.threads;
  if (s.ranks > 1) {
    p.parallel.data_parallel = s.ranks;
    p.parallel.ranks_per_node = s.ranks_per_node;
    p.parallel.host_state = kHostStates[k.host_state];
    p.parallel.collective = k.nccl ? "nccl" : "mpi";
  }
  return p;
}

// The micro-batches a step of `sequences` may use: its divisors m (only `fixed` when it is set)
// with m and sequences / m both within a plan's bounds, ascending; found in sqrt(sequences) steps.
std::vector<int64_t> micro_batch_choices(int64_t sequences, int64_t fixed) {
  std::vector<int64_t> low, high;
  for (int64_t d = 1; d <= sequences / d; ++d) {
    if (sequences % d != 0) continue;
    low.push_back(d);
    if (d != sequences / d) high.push_back(sequences / d);
  }
  std::vector<int64_t> out;
  low.insert(low.end(), high.rbegin(), high.rend());
  for (int64_t m : low)
    if (m <= kMaxBatchKnob && sequences / m <= kMaxBatchKnob && (fixed == 0 || m == fixed)) out.push_back(m);
  return out;
}

Result<Space> resolve_request(const ModelSpec& model, const HardwareProfile& rig, const SearchRequest& req,
                              const SearchOptions& opt, SearchResult& res) {
  const ModelConfig& mc = model.config();
  Space s{model, rig, req, opt};
  s.seq = req.seq_len > 0 ? req.seq_len : default_seq_len(model);
  if (s.seq > mc.max_position_embeddings)
    return invalid_argument("--seq " + std::to_string(s.seq) + " exceeds the model's max_position_embeddings; accepted: 1 .. " +
                            std::to_string(mc.max_position_embeddings));
  if (req.document_tokens != 0 && (req.document_tokens < 1 || req.document_tokens > static_cast<double>(s.seq)))
    return invalid_argument("--document-tokens " + format_flag_bound(req.document_tokens) +
                            " is not a documents' mean length in rows of " + std::to_string(s.seq) +
                            " tokens; accepted: 0 (one context per row) or 1 .. " + std::to_string(s.seq));
  s.tokens = req.tokens_per_step > 0 ? req.tokens_per_step : kDefaultSequencesPerStep * s.seq;
  if (s.tokens % s.seq != 0) {
    // The nearest multiples below and above; below 1 sequence there is only the one above.
    const int64_t below = s.tokens / s.seq * s.seq, above = below + s.seq;
    return invalid_argument("--tokens-per-step " + std::to_string(s.tokens) + " is not a multiple of the sequence length " +
                            std::to_string(s.seq) + "; accepted: a multiple of it, e.g. " +
                            (below > 0 ? std::to_string(below) + " or " : std::string()) + std::to_string(above));
  }
  s.sequences = s.tokens / s.seq;
  // A plan holds micro_batch and grad_accum up to 2^20 each (docs/plan-format.md): a step of more
  // sequences than that has no plan, and the search's candidates stay within them (issue 49: the
  // micro-batch loop ran once per sequence, 1.7e10 times for --seq 1 --tokens-per-step 2^34).
  if (s.sequences > kMaxBatchKnob * kMaxBatchKnob)
    return invalid_argument("--tokens-per-step " + std::to_string(s.tokens) + " is " + std::to_string(s.sequences) +
                            " sequences of " + std::to_string(s.seq) + " tokens; a plan holds at most 2^20 micro-batches of 2^20 sequences; "
                            "accepted: up to " + std::to_string(kMaxBatchKnob * kMaxBatchKnob) + " x seq tokens");
  if (req.micro_batch > kMaxBatchKnob)
    return invalid_argument("micro-batch " + std::to_string(req.micro_batch) + " is more than a plan holds; accepted: 0 (the search "
                            "chooses) or 1 .. " + std::to_string(kMaxBatchKnob));
  if (req.gpus < 1) return invalid_argument("--gpus " + std::to_string(req.gpus) + ": accepted: 1 or more");
  if (req.nodes > 0 && req.gpus == 1 && req.nodes != 1)
    return invalid_argument("--nodes " + std::to_string(req.nodes) + " with one GPU; accepted: --nodes 1, or --gpus N");
  if (req.gpus > 1) {
    if (!rig.cluster)
      return invalid_argument("--gpus " + std::to_string(req.gpus) + ": rig '" + rig.name +
                              "' describes one GPU (it has no cluster section); accepted: --gpus 1, or a rig with a cluster section "
                              "(h200x8-2tb, h200x8-2tb-4node; docs/hardware-profile.md)");
    s.ranks = req.gpus;
    s.ranks_per_node = std::min(req.gpus, rig.gpus_per_node());
    if (req.nodes > 0) {  // --nodes M: the ranks spread evenly over M nodes
      if (req.nodes > rig.nodes() || req.gpus % req.nodes != 0 || req.gpus / req.nodes > rig.gpus_per_node())
        return invalid_argument("--gpus " + std::to_string(req.gpus) + " --nodes " + std::to_string(req.nodes) + ": rig '" + rig.name +
                                "' has " + std::to_string(rig.nodes()) + " node(s) of " + std::to_string(rig.gpus_per_node()) +
                                " GPUs; accepted: --nodes up to " + std::to_string(rig.nodes()) + " that divides --gpus into at most " +
                                std::to_string(rig.gpus_per_node()) + " GPUs per node");
      s.ranks_per_node = req.gpus / req.nodes;
    }
    if (s.ranks % s.ranks_per_node != 0 || s.ranks / s.ranks_per_node > rig.nodes())
      return invalid_argument("--gpus " + std::to_string(req.gpus) + ": rig '" + rig.name + "' has " + std::to_string(rig.nodes()) +
                              " node(s) of " + std::to_string(rig.gpus_per_node()) + " GPUs; accepted: up to " +
                              std::to_string(rig.nodes() * rig.gpus_per_node()) + ", whole nodes beyond one (a multiple of " +
                              std::to_string(rig.gpus_per_node()) + ")");
    if (s.sequences % s.ranks != 0)
      return invalid_argument("--gpus " + std::to_string(req.gpus) + " does not divide the step's " + std::to_string(s.sequences) +
                              " sequences among the ranks; accepted: --tokens-per-step a multiple of " +
                              std::to_string(s.ranks * s.seq) + " (gpus x seq)");
    s.sequences /= s.ranks;  // each rank's
  }
  if (req.micro_batch < 0 || (req.micro_batch > 0 && s.sequences % req.micro_batch != 0))
    return invalid_argument("micro-batch " + std::to_string(req.micro_batch) + " does not divide the step's " +
                            std::to_string(s.sequences) + " sequences; accepted: 0 (the search chooses) or a divisor of it");
  if (micro_batch_choices(s.sequences, req.micro_batch).empty())
    return invalid_argument("the step's " + std::to_string(s.sequences) + " sequences split into no micro-batch of at most 2^20 sequences " +
                            "with at most 2^20 micro-batches (the plan's bounds); accepted: --tokens-per-step whose sequences have "
                            "such a divisor, or --micro-batch within them");
  res.seq_len = s.seq;
  res.tokens_per_step = s.tokens;
  if (req.policy.state_formats.empty()) return invalid_argument("the state-format policy is empty; accepted: fp32, bf16, q8, q4, q3, q2");

  s.cpu = step::backend_of_rig(rig) == step::BackendKind::kCpu;
  s.compute = req.policy.compute.value_or(s.cpu ? DType::kFp32 : DType::kBf16);
  s.formats = req.policy.state_formats;
  if (s.cpu) {
    if (s.compute != DType::kFp32)
      return unsupported("rig '" + rig.name + "' is the CPU backend, which computes in fp32; accepted: --compute fp32 (or leave it out)");
    // fp32 transfer; a bf16 streaming copy only where master weights go to NVMe (the copy in RAM
    // is then what the layers are computed from).
    s.transfers = {DType::kFp32, DType::kBf16};
    res.assumptions.push_back("rig '" + rig.name + "' is the CPU backend (megatrain-exec --backend cpu): fp32 compute; fp32 transfer, "
                              "or a bf16 streaming copy when master weights go to NVMe; m and v in the allowed state formats");
  } else if (s.compute == DType::kBf16) {
    s.transfers = {DType::kBf16, DType::kFp32};
  } else {
    s.transfers = {DType::kFp32};  // streaming bf16 weights into an fp32 computation would round them
  }
  if (s.compute == DType::kFp16) return invalid_argument("compute fp16 is not a plan precision; accepted: bf16, fp32");

  s.units = step::unit_table(model);
  s.caps = step::capacity_of(make_plan(Knobs{}, s), rig);
  s.has_nvme = !rig.storage.empty();
  s.kmax_all = std::max(1, opt.max_prefetch_depth);

  for (StateFormat m : s.formats)
    for (StateFormat v : s.formats) s.pairs.push_back({m, v});
  Knobs k;
  k.micro_batch = 1;
  for (DType t : s.transfers)
    for (const FormatPair& fp : s.pairs) {
      k.transfer = t;
      k.m_format = fp.m;
      k.v_format = fp.v;
      Plan p = make_plan(k, s);
      const int64_t th = best_threads(p, model, rig);
      p.optimizer.threads = th;
      s.threads_for[format_key(t, fp.m, fp.v)] = th;
      s.adam_rate_for[format_key(t, fp.m, fp.v)] = sim::CostModel(p, model, rig).adam_rate();
    }
  return s;
}

std::vector<Knobs> structural_knobs(const Space& s) {
  std::vector<Knobs> out;
  const int64_t L = s.model.config().num_layers;
  const std::vector<int64_t> micro_batches = micro_batch_choices(s.sequences, s.req.micro_batch);
  Knobs k;
  for (int64_t m : micro_batches) {
    k.micro_batch = m;
    k.grad_accum = s.sequences / m;
    for (bool layer_major : {true, false}) {
      k.layer_major = layer_major;
      for (int64_t c : kCheckpointIntervals) {
        if (c > L) continue;
        k.ckpt_every = c;
        for (bool ckpt_host : {true, false}) {
          if (c == 0 && !ckpt_host) continue;  // no checkpoints: the location means nothing
          k.ckpt_host = ckpt_host;
          for (bool master_nvme : {false, true})
            for (bool states_nvme : {false, true}) {
              if ((master_nvme || states_nvme) && !s.has_nvme) continue;
              k.master_nvme = master_nvme;
              k.states_nvme = states_nvme;
              for (DType t : s.transfers) {
                // The executor streams master weights on NVMe from a bf16 copy in RAM.
                if (master_nvme && t != DType::kBf16) continue;
                if (s.cpu && t == DType::kBf16 && !master_nvme) continue;
                k.transfer = t;
                for (const FormatPair& fp : s.pairs) {
                  k.m_format = fp.m;
                  k.v_format = fp.v;
                  k.threads = s.threads_for.at(format_key(t, fp.m, fp.v));
                  // Several ranks: replicated, sharded or node-shared host state (shared keeps the
                  // master weights in RAM, in the node's shared memory).
                  for (int hs = 0; hs < 3; ++hs) {
                    if (hs > 0 && s.ranks == 1) continue;
                    if (hs == 2 && master_nvme) continue;
                    k.host_state = hs;
                    // On GPUs the gradients may be summed with NCCL between the GPUs (then, with
                    // split states, each rank copies only its share of the sum to the host).
                    for (bool nccl : {false, true}) {
                      if (nccl && (s.cpu || s.ranks == 1)) continue;
                      k.nccl = nccl;
                      out.push_back(k);
                    }
                  }
                }
              }
            }
        }
      }
    }
  }
  return out;
}

Result<Enumeration> enumerate_candidates(const Space& s, Sizer& sizer, SearchStats& stats) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  Enumeration e;
  e.least = {kNone, kNone, kNone, kNone};
  double closest_ratio = std::numeric_limits<double>::infinity();
  size_t index = 0;
  for (Knobs k : structural_knobs(s)) {
    k = at_prefetch(k, 1);
    if (s.cpu && k.master_nvme) {
      MT_ASSIGN_OR_RETURN(const bool twin_fits, cpu_in_ram_twin_fits(s, sizer, k));
      if (twin_fits) continue;
    }
    MT_ASSIGN_OR_RETURN(const std::vector<int64_t> stagings, staging_choices(s, sizer, k));
    for (int64_t staging : stagings) {
      k.staging = staging;
      // The footprint at prefetch depth 1 (the least a pass streams with): the arena is carved once,
      // so a plan it does not fit cannot start.
      MT_ASSIGN_OR_RETURN(const step::TierBytes n, sizer.need(k));
      int64_t kmax = s.kmax_all;
      if (!s.opt.exhaustive) {
        MT_ASSIGN_OR_RETURN(kmax, prefetch_cap(s, sizer, k));
      }
      stats.candidates += kmax;
      const Structural st{k, n, 0, kmax, index++};
      e.least.device = std::min(e.least.device, n.device);
      e.least.pinned = std::min(e.least.pinned, n.pinned);
      e.least.ram = std::min(e.least.ram, n.ram);
      e.least.nvme = std::min(e.least.nvme, n.nvme);
      if (!s.opt.exhaustive && !fits(n, s.caps)) {
        stats.infeasible += kmax;
        const double r = worst_ratio(n, s.caps);
        if (r < closest_ratio) {
          closest_ratio = r;
          e.closest = st;
        }
        e.blocked.push_back(st);
        continue;
      }
      e.feasible.push_back(st);
    }
  }
  return e;
}

Result<Trial> simulate_plan(Plan plan, const ModelSpec& model, const HardwareProfile& rig, double lower_bound_s) {
  Trial t;
  t.cand.plan = std::move(plan);
  t.cand.lower_bound_s = lower_bound_s;
  MT_ASSIGN_OR_RETURN(sim::SimResult r, sim::simulate(t.cand.plan, model, rig));
  t.feasible = r.feasible;
  if (!r.feasible) {
    t.reason = r.reason;
    return t;
  }
  r.engine.reset();
  t.cand.result = std::move(r);
  t.cand.plan.predicted = predicted_of(t.cand.result);
  return t;
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

}  // namespace megatrain::planner::detail

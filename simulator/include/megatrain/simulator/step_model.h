// The step model: adds costs to the compiled step (megatrain/step/schedule.h, the schedule the
// executor walks) to make a task graph, simulates it on the Engine, and reports
// the steady-state step (the second simulated step): time, tokens/s, TFLOP/s, MFU, busy fraction
// per resource, stalls by reason, the critical path, the bottleneck and peak bytes per tier.
// Cost formulas are in docs/cost-model.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/core/trace_vocab.h"
#include "megatrain/simulator/engine.h"

namespace megatrain::sim {

// TaskSpec::kind is a SpanKind (megatrain/core/trace_vocab.h) and TaskSpec::resource a Lane: the
// simulated trace uses the executor's vocabulary, span for span.
inline SpanKind span_kind_of(const TaskSpec& t) { return static_cast<SpanKind>(t.kind); }

// Per-unit costs in seconds, from the profile (docs/cost-model.md). Units: 0 = embedding,
// 1..L = decoder layers, L+1 = head (final norm + lm_head).
class CostModel {
 public:
  CostModel(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig);

  double matmul_peak() const { return peak_; }  // FLOP/s for the compute dtype
  double gemm_time(double m, double n, double k) const;
  double elementwise_time(double bytes) const;
  double h2d_time(double bytes) const;
  double d2h_time(double bytes) const;
  double nvme_read_time(double bytes) const;
  double nvme_write_time(double bytes) const;
  double adam_time(double params) const;
  double host_pass_time(double bytes) const;  // one CPU streaming pass over host memory

  double layer_forward_time() const { return layer_fwd_; }   // one micro-batch
  double layer_backward_time() const { return layer_bwd_; }
  double head_time() const { return head_; }                 // forward + loss + backward
  double embed_forward_time() const { return embed_fwd_; }
  double embed_backward_time() const { return embed_bwd_; }

  double nvme_read_bandwidth() const { return nvme_read_bw_; }
  double nvme_write_bandwidth() const { return nvme_write_bw_; }
  double host_bandwidth() const { return host_bw_; }
  double adam_rate() const { return adam_rate_; }  // parameters/s
  // Figures that had to be estimated because the profile lacks them (e.g. an Adam rate for a
  // state format it does not list).
  const std::vector<std::string>& assumptions() const { return assumptions_; }

 private:
  const HardwareProfile& rig_;
  double peak_ = 0, host_bw_ = 0, adam_rate_ = 0, nvme_read_bw_ = 0, nvme_write_bw_ = 0;
  double layer_fwd_ = 0, layer_bwd_ = 0, head_ = 0, embed_fwd_ = 0, embed_bwd_ = 0;
  std::vector<std::string> assumptions_;
};

struct SimOptions {
  int steps = 3;             // the last one is reported: the first has no earlier update to wait
                             // for, so the period after it is not yet the steady state
  bool keep_engine = false;  // keep the engine for trace writing and tests
};

struct SimResult {
  bool feasible = true;
  std::string reason;        // when not feasible: which tier, by how many bytes
  double step_time_s = 0;
  double tokens_per_step = 0;
  double tokens_per_s = 0;
  double flops_per_step = 0; // model FLOPs (forward + backward, no recompute), as MFU counts them
  double tflops = 0;         // achieved model TFLOP/s
  double mfu = 0;
  std::string bottleneck;    // gpu | h2d | d2h | cpu | host_memory | nvme_read | nvme_write | none
  std::map<std::string, double> busy;           // resource lane -> busy fraction of the step
  std::map<std::string, double> stalls;         // reason -> seconds waited in the step: GPU idle by
                                                // cause, plus transfers waiting for a free "buffer"
  std::map<std::string, double> critical_path;  // bottleneck name -> seconds on the critical path
  PeakBytes peak_bytes;      // the compiled step's footprint (step::footprint), as the executor allocates it
  PeakBytes capacity_bytes;  // the limits the peaks were checked against  // the limits the peaks were checked against
  int64_t tasks = 0;         // tasks simulated (all steps)
  double simulated_s = 0;    // makespan of all simulated steps
  double step_start_s = 0;   // the reported step's window in the timeline
  std::vector<std::string> assumptions;
  std::shared_ptr<Engine> engine;  // when SimOptions::keep_engine
};

Result<SimResult> simulate(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig,
                           const SimOptions& options = {});
// Loads model and rig named by the plan, then simulates.
Result<SimResult> simulate(const Plan& plan, const SimOptions& options = {});

// Writes the simulated timeline (needs keep_engine): one lane per resource, spans per task,
// stall spans, counters of bytes in use per tier, and the plan and result in meta.
Status write_trace(const SimResult& result, const Plan& plan, const std::filesystem::path& path);

// The JSON of ARCHITECTURE.md section 8 (`simulate --json`), with a trailing newline.
std::string result_json(const SimResult& result);

}  // namespace megatrain::sim

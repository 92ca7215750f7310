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
// 1..L = decoder layers, L+1 = head (final norm + lm_head). Decoder layers may differ: a
// Mixture-of-Experts model can mix MoE and dense layers (Qwen3-MoE mlp_only_layers,
// decoder_sparse_step), and layers may attend within a sliding window (gpt-oss layer_types), so
// every layer time is asked for by layer.
class CostModel {
 public:
  CostModel(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig);

  double matmul_peak() const { return peak_; }  // FLOP/s for the compute dtype
  double gemm_time(double m, double n, double k) const;
  // A linear layer [tokens, in] -> [tokens, out]: its forward GEMM, and its backward (dX and dW),
  // from gpu.gemm_shapes by shape when the profile has it, else gemm_time at the FLOPs (the
  // backward then twice the forward).
  double linear_forward_time(double tokens, double in, double out) const;
  double linear_backward_time(double tokens, double in, double out) const;
  // `experts` GEMMs of one projection in one grouped call, each [rows, k] x [k, n] (rows per
  // expert may be fractional: the mean under uniform routing): from gpu.grouped_gemm_efficiency at
  // `rows`, else the dense curve at the call's FLOPs times kGroupedGemmFallback.
  double grouped_gemm_time(double experts, double rows, double n, double k) const;
  // The fraction of the peak such a call reaches.
  double grouped_gemm_efficiency(double experts, double rows, double n, double k) const;
  double elementwise_time(double bytes) const;
  double h2d_time(double bytes) const;
  double d2h_time(double bytes) const;
  double nvme_read_time(double bytes) const;
  double nvme_write_time(double bytes) const;
  double adam_time(double params) const;
  double host_pass_time(double bytes) const;  // one CPU streaming pass over host memory

  // ---- data parallelism (docs/cost-model.md, "Data parallelism") ----
  // With a plan for several ranks on a rig with a cluster section, one rank's step is simulated
  // with its share of its node: 1/R of the host's memory bandwidth, cores and drives (R ranks per
  // node), its PCIe switch's uplink shared with the GPUs behind it, and the collectives as tasks.
  bool multi_rank() const { return ranks_ > 1; }
  int64_t ranks() const { return ranks_; }
  int64_t nodes_used() const { return nodes_used_; }
  // A collective on `bytes` of one rank's data: its time and the host memory it moves (bytes).
  struct Collective {
    double time_s = 0, host_bytes = 0;
  };
  // A unit's final gradient: summed onto every rank (replicated states), onto its owners (sharded
  // states), or onto the node's owners into its shared memory and across nodes between the owners
  // of each range (a shared host state).
  Collective gradient_sum(double bytes) const;
  // The ranks whose owners split each unit's update: the job's (sharded), the node's (shared), or 1.
  int64_t update_share() const { return sharded_ ? ranks_ : shared_ ? ranks_per_node_ : 1; }
  // parallel.collective nccl: each round's gradient is summed between the GPUs (not only the last
  // round's through host memory).
  bool device_sums() const { return nccl_ && ranks_ > 1; }
  // Sharded states: the updated weights (`bytes` of one unit) taken from their owners.
  Collective weight_gather(double bytes) const;

  // The terms of one decoder layer's GPU work for one micro-batch (docs/cost-model.md).
  struct LayerCost {
    bool moe = false;            // the MoE block (router and experts) instead of the dense MLP
    int64_t window = 0;          // keys per query are limited to this (0: the whole causal prefix)
    double attention_gemms = 0;  // q, k, v, o projections (forward; their backward below)
    double attention = 0;        // the causal attention kernel (Q.K^T and P.V), forward
    double mlp_gemms = 0;        // dense layers: gate, up, down
    double router = 0;           // MoE layers: the router GEMM [T, H] x [H, E]
    double experts = 0;          // MoE layers: the grouped gate, up and down GEMMs of every expert
    double rows_per_expert = 0;  // MoE layers: T k / E (uniform routing)
    double gemms_backward = 0;   // the backward of the projections, MLP and router GEMMs (dX, dW)
    double elementwise_bytes = 0;  // forward bytes of the memory-bound work (norms, RoPE, SwiGLU,
                                   // adds; MoE: router softmax/top-k, permutation, combine)
    double forward = 0, backward = 0;
    bool probed = false;         // forward/backward are the profile's layer probe
  };
  const LayerCost& layer_cost(int64_t layer) const;   // decoder layer 0 .. L-1
  double layer_forward_time(int64_t layer) const { return layer_cost(layer).forward; }   // one micro-batch
  double layer_backward_time(int64_t layer) const { return layer_cost(layer).backward; }
  double layers_forward_time() const { return layers_fwd_; }   // every decoder layer, one micro-batch
  double layers_backward_time() const { return layers_bwd_; }
  double head_time() const { return head_; }                 // forward + loss + backward
  double embed_forward_time() const { return embed_fwd_; }
  double embed_backward_time() const { return embed_bwd_; }

  double nvme_read_bandwidth() const { return nvme_read_bw_; }
  double nvme_write_bandwidth() const { return nvme_write_bw_; }
  double host_bandwidth() const { return host_bw_; }
  double adam_rate() const { return adam_rate_; }  // parameters/s
  // The host's cores one rank has, and the optimizer's threads among them (plan.optimizer.threads,
  // 0: all of them). On the CPU backend the compute, the copies and the optimizer share these
  // cores (the simulator's "CPU cores" pool, docs/cost-model.md).
  int64_t rank_cores() const { return rank_cores_; }
  int64_t optimizer_threads() const { return optimizer_threads_; }
  // Figures that had to be estimated because the profile lacks them (e.g. an Adam rate for a
  // state format it does not list).
  const std::vector<std::string>& assumptions() const { return assumptions_; }

  // Without gpu.grouped_gemm_efficiency: the grouped call runs at this fraction of the dense
  // curve's rate for one GEMM of the same FLOPs (docs/cost-model.md).
  static constexpr double kGroupedGemmFallback = 0.7;

 private:
  const HardwareProfile& rig_;
  double peak_ = 0, host_bw_ = 0, adam_rate_ = 0, nvme_read_bw_ = 0, nvme_write_bw_ = 0;
  int64_t ranks_ = 1, ranks_per_node_ = 1, nodes_used_ = 1, rank_cores_ = 1, optimizer_threads_ = 1;
  bool sharded_ = false, shared_ = false;
  bool nccl_ = false;      // parallel.collective nccl: gradients summed between the GPUs
  double peer_bw_ = 0;     // bytes/s per GPU per direction to the node's other GPUs (0: over PCIe)
  double link_cap_ = 0;   // bytes/s: this GPU's share of its PCIe switch's uplink (0: no cap)
  double inter_bw_ = 0, inter_latency_ = 0;
  std::vector<LayerCost> kinds_;        // the distinct layer kinds (at most 4: dense/MoE x full/window)
  std::vector<uint8_t> kind_of_layer_;  // index into kinds_ per decoder layer
  double layers_fwd_ = 0, layers_bwd_ = 0;
  double head_ = 0, embed_fwd_ = 0, embed_bwd_ = 0;
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
  int64_t ranks = 1;          // data-parallel ranks (parallel.data_parallel): tokens and FLOPs are the job's
  double tokens_per_step = 0;
  double tokens_per_s = 0;
  double flops_per_step = 0; // model FLOPs (forward + backward, no recompute), as MFU counts them
  double tflops = 0;         // achieved model TFLOP/s
  double mfu = 0;
  // Weights copied to the device in one step: every load of every round (each expert of a MoE
  // layer included), in the transfer dtype. Over flops_per_step it is the step's weight traffic per
  // FLOP, which decides layer-major against microbatch-major (weights streamed once or per micro-batch).
  double weight_bytes_per_step = 0;
  // Gradients copied to the host in one step (fp32, each unit once per round: once per step in
  // layer-major order, once per micro-batch in microbatch-major).
  double gradient_bytes_per_step = 0;
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

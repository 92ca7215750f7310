// Internal: the profiler's probes of a decoder layer's non-GEMM work on the CPU backend.
// - Attention: the CPU backend's causal attention is dot-product and axpy loops, not a GEMM, so its
//   rate is measured on its own (cpu::attention_forward / _backward, the executor's kernels) and
//   written as gpu.attention_efficiency and gpu.attention_backward_ratio.
// - Element-wise: the layer's RMSNorms, RoPE, SwiGLU and residual adds, forward and backward, in the
//   order the layer runs them. On a CPU they are bound by arithmetic (exp, sin, cos, rsqrt) as much
//   as by memory, so their rate is measured as an effective bandwidth in the cost model's own byte
//   accounting (docs/cost-model.md) and written as the CPU backend's gpu.memory_bandwidth.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/attention.h"

namespace megatrain::planner::detail {

struct AttentionSample {
  cpu::AttentionShape shape;
  double forward_s = 0;   // best per call
  double backward_s = 0;  // best per call
  // What the cost model charges for: the lower triangle of Q.K^T and P.V, 2 * tokens * seq * q.
  double flops() const {
    return 2.0 * static_cast<double>(shape.batch * shape.seq) * static_cast<double>(shape.seq) *
           static_cast<double>(shape.n_heads * shape.head_dim);
  }
};

// The shapes timed: with a model, its heads at `seq` for micro-batches 1, 2, 4 and 8 (what plans
// of that model run); without one, a generic set of head sizes and sequence lengths. Shapes whose
// saved probabilities would exceed `max_probs_bytes` are skipped.
std::vector<cpu::AttentionShape> attention_shapes(const ModelConfig* model, int64_t seq, bool quick,
                                                  int64_t max_probs_bytes);

// Times forward and backward of every shape with `threads` threads, each for at least min_time_s.
Result<std::vector<AttentionSample>> measure_attention(const std::vector<cpu::AttentionShape>& shapes, int threads,
                                                       double min_time_s,
                                                       const std::function<void(const std::string&)>& progress);

struct AttentionFit {
  std::vector<std::pair<double, double>> points;  // (FLOPs, fraction of the matmul peak), x increasing
  double backward_ratio = 0;                      // median of backward / forward
  double ratio_min = 0, ratio_max = 0;
};
// Efficiency against `peak_flops_per_s` (the GEMM peak of the same profile); samples of equal FLOPs
// are averaged; y is clamped into (0, 1].
Result<AttentionFit> fit_attention(const std::vector<AttentionSample>& samples, double peak_flops_per_s);

// One layer's element-wise work for `tokens` rows of a layer shaped like `model` (or generic).
struct ElementwiseSample {
  int64_t tokens = 0, hidden = 0, q = 0, kv = 0, intermediate = 0;
  double forward_s = 0, backward_s = 0;
  // The cost model's bytes: forward 4 * tokens * (10 H + 2 q + 2 kv + 3 I), backward twice that.
  double cost_model_bytes() const {
    return 3.0 * 4.0 * static_cast<double>(tokens) *
           static_cast<double>(10 * hidden + 2 * q + 2 * kv + 3 * intermediate);
  }
  double effective_bandwidth() const { return cost_model_bytes() / (forward_s + backward_s); }
};
// Times the element-wise sequence of one layer forward and backward with `threads` threads.
Result<ElementwiseSample> measure_elementwise(int64_t tokens, int64_t hidden, int64_t n_heads, int64_t n_kv_heads,
                                              int64_t head_dim, int64_t intermediate, int threads, double min_time_s);

// One decoder layer of `model`, forward and backward, on the CPU backend (the executor's LayerMath
// through its backend table) at each micro-batch of `seq` tokens: what the pipeline's compute
// stream runs per layer and micro-batch. Models over `max_params` parameters are refused (the probe
// builds the model's RAM tier to lay out one layer's weights).
struct LayerSample {
  int64_t micro_batch = 0;
  double forward_s = 0, backward_s = 0;
  double head_s = 0;  // the head of the micro-batch: final norm, LM head, cross-entropy, backward
};
Result<std::vector<LayerSample>> measure_layer(const ModelSpec& model, int64_t seq, const std::vector<int64_t>& micro_batches,
                                               int threads, double min_time_s, int64_t max_params);

}  // namespace megatrain::planner::detail

// Costs of the step's tasks from the hardware profile; every formula is in docs/cost-model.md.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "megatrain/simulator/step_model.h"

namespace megatrain::sim {
namespace {

double bytes_per_param(StateFormat f, int64_t block) { return state_format_bytes_per_element(f, block); }

}  // namespace

CostModel::CostModel(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig) : rig_(rig) {
  const ModelConfig& c = model.config();
  const double cb = static_cast<double>(dtype_bytes(plan.precision.compute));
  const double tb = static_cast<double>(dtype_bytes(plan.precision.transfer));
  peak_ = plan.precision.compute == DType::kFp32 ? rig.gpu.matmul_fp32.value : rig.gpu.matmul_bf16.value;
  host_bw_ = rig.host.memory_bandwidth.value;

  // NVMe: the plan's directories matched to the profile's drives by path, else the first drives.
  std::vector<const NvmeSpec*> drives;
  for (const auto& dir : plan.placement.nvme_dirs)
    for (const auto& d : rig.storage)
      if (!d.path.empty() && dir.rfind(d.path, 0) == 0 &&
          std::find(drives.begin(), drives.end(), &d) == drives.end())
        drives.push_back(&d);
  if (drives.empty()) {
    const size_t want = plan.placement.nvme_dirs.empty() ? rig.storage.size()
                                                         : std::min(rig.storage.size(), plan.placement.nvme_dirs.size());
    for (size_t i = 0; i < want; ++i) drives.push_back(&rig.storage[i]);
  }
  for (const NvmeSpec* d : drives) {
    // The executor's access pattern (executor/nvme_store.h): the plan's block size and queue depth.
    nvme_read_bw_ += d->read_bandwidth(plan.placement.nvme_block_bytes, plan.placement.nvme_queue_depth);
    nvme_write_bw_ += d->write_bandwidth(plan.placement.nvme_block_bytes, plan.placement.nvme_queue_depth);
  }

  // Adam: the profile's rate for the state format and the nearest thread count at or below the
  // plan's, scaled by threads, and never faster than host memory allows.
  const int64_t threads = plan.optimizer.threads > 0 ? plan.optimizer.threads : rig.host.cores;
  const int64_t block = plan.optimizer.block_size;
  const double touched = tb + 4 + 2 * (bytes_per_param(plan.optimizer.m_format, block) +
                                       bytes_per_param(plan.optimizer.v_format, block)) +
                         4 + (plan.precision.transfer == DType::kFp32 ? 0 : tb);
  const double memory_bound = host_bw_ / touched;
  auto rate_for = [&](StateFormat f) -> double {
    // The largest listed thread count at or below the plan's; else the smallest listed.
    const AdamThroughput* best = nullptr;
    for (const auto& a : rig.host.adam) {
      if (a.state_format != state_format_name(f)) continue;
      const bool fits = a.threads <= threads;
      const bool best_fits = best && best->threads <= threads;
      if (!best || (fits && (!best_fits || a.threads > best->threads)) ||
          (!fits && !best_fits && a.threads < best->threads))
        best = &a;
    }
    if (!best) return 0;
    // Linear in threads from the nearest measurement, but never past the cores (or past the
    // measured thread count, when the profile measured more threads than cores): more threads than
    // cores share them.
    const int64_t usable = std::min(threads, std::max(rig.host.cores, best->threads));
    return best->params_per_s.value * static_cast<double>(usable) / static_cast<double>(best->threads);
  };
  const StateFormat slow = bytes_per_param(plan.optimizer.m_format, block) >= bytes_per_param(plan.optimizer.v_format, block)
                               ? plan.optimizer.v_format : plan.optimizer.m_format;
  double rate = std::min(rate_for(plan.optimizer.m_format) > 0 ? rate_for(plan.optimizer.m_format) : 1e300,
                         rate_for(plan.optimizer.v_format) > 0 ? rate_for(plan.optimizer.v_format) : 1e300);
  if (rate >= 1e300) {
    const double fp32 = rate_for(StateFormat::kFp32);
    const double fp32_touched = tb + 4 + 2 * 8 + 4 + (plan.precision.transfer == DType::kFp32 ? 0 : tb);
    std::ostringstream a;
    if (fp32 > 0) {
      rate = fp32 * fp32_touched / touched;
      a << "Adam rate for state format " << state_format_name(slow)
        << " is not in the profile: estimated from the fp32 rate scaled by bytes moved per parameter ("
        << fp32_touched << " -> " << touched << ")";
    } else {
      rate = 0.6 * memory_bound;
      a << "the profile lists no Adam rate: estimated as 60% of host memory bandwidth / " << touched << " bytes per parameter";
    }
    assumptions_.push_back(a.str());
  }
  adam_rate_ = std::min(rate, memory_bound);

  // Per micro-batch GPU work of one layer (T tokens).
  const double T = static_cast<double>(plan.training.micro_batch * plan.training.seq_len);
  const double s = static_cast<double>(plan.training.seq_len);
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double q = static_cast<double>(c.num_heads * c.head_dim), kv = static_cast<double>(c.num_kv_heads * c.head_dim);
  const double V = static_cast<double>(c.vocab_size);
  const double gemms = gemm_time(T, q, H) + 2 * gemm_time(T, kv, H) + gemm_time(T, H, q) + 2 * gemm_time(T, I, H) +
                       gemm_time(T, H, I);
  // Causal attention: a fused kernel computes the lower triangle, half of Q.K^T and P.V. A profile
  // may give the attention kernel's own rate (the CPU backend's is not GEMM-like) and its backward
  // / forward time ratio.
  double attention = 0.5 * 2 * gemm_time(T, s, q);
  if (rig.gpu.attention_efficiency) {
    const double f = 2 * T * s * q;  // 2 GEMMs of 2*T*s*q FLOPs, each half computed
    attention = f / (peak_ * rig.gpu.attention_efficiency->at(f));
  }
  const double attention_bwd_ratio = rig.gpu.attention_backward_ratio ? rig.gpu.attention_backward_ratio->value : 2.5;
  const double elementwise_bytes = cb * T * (10 * H + 2 * q + 2 * kv + 3 * I);
  layer_fwd_ = gemms + attention + elementwise_time(elementwise_bytes);
  layer_bwd_ = 2 * gemms + attention_bwd_ratio * attention + elementwise_time(2 * elementwise_bytes);
  // A profile made for this model (megatrain-plan profile --model) may hold the measured time of
  // the whole layer by micro-batch: it replaces the sum of op-level terms, which misses how the
  // layer's ops share threads and caches. Between points time is linear in the micro-batch; beyond
  // the last it scales in proportion; below the first, linearly to zero.
  if (const auto& lt = rig.gpu.layer_times;
      lt && lt->hidden == c.hidden_size && lt->intermediate == c.intermediate_size && lt->heads == c.num_heads &&
      lt->kv_heads == c.num_kv_heads && lt->head_dim == c.head_dim && lt->seq == plan.training.seq_len) {
    const double mb = static_cast<double>(plan.training.micro_batch);
    auto at = [&](auto field) {
      const auto& p = lt->points;
      if (mb <= static_cast<double>(p.front().micro_batch)) return field(p.front()) * mb / static_cast<double>(p.front().micro_batch);
      for (size_t i = 1; i < p.size(); ++i)
        if (mb <= static_cast<double>(p[i].micro_batch)) {
          const double x0 = static_cast<double>(p[i - 1].micro_batch), x1 = static_cast<double>(p[i].micro_batch);
          return field(p[i - 1]) + (field(p[i]) - field(p[i - 1])) * (mb - x0) / (x1 - x0);
        }
      return field(p.back()) * mb / static_cast<double>(p.back().micro_batch);
    };
    layer_fwd_ = at([](const LayerTimes::Point& pt) { return pt.forward_s; });
    layer_bwd_ = at([](const LayerTimes::Point& pt) { return pt.backward_s; });
    assumptions_.push_back("layer forward and backward times are the profile's layer probe of " + lt->model + " at seq " +
                           std::to_string(lt->seq) + " (" + std::to_string(lt->points.size()) + " micro-batch sizes)");
  }
  // Head: logits, cross-entropy in fp32 (write logits, softmax, gradient), dX and dW.
  head_ = 3 * gemm_time(T, V, H) + elementwise_time(3 * 4 * T * V + 4 * cb * T * H);
  embed_fwd_ = elementwise_time(2 * cb * T * H);
  embed_bwd_ = elementwise_time(3 * 4 * T * H);
}

double CostModel::gemm_time(double m, double n, double k) const {
  const double f = 2 * m * n * k;
  if (f <= 0) return 0;
  return f / (peak_ * rig_.gpu.gemm_efficiency.at(f));
}

double CostModel::elementwise_time(double bytes) const { return bytes / rig_.gpu.memory_bandwidth.value; }

double CostModel::h2d_time(double bytes) const {
  return bytes <= 0 ? 0 : bytes / rig_.links.h2d.pinned_bandwidth.at(bytes);
}

double CostModel::d2h_time(double bytes) const {
  return bytes <= 0 ? 0 : bytes / rig_.links.d2h.pinned_bandwidth.at(bytes);
}

double CostModel::nvme_read_time(double bytes) const { return bytes <= 0 ? 0 : bytes / nvme_read_bw_; }
double CostModel::nvme_write_time(double bytes) const { return bytes <= 0 ? 0 : bytes / nvme_write_bw_; }
double CostModel::adam_time(double params) const { return params / adam_rate_; }
double CostModel::host_pass_time(double bytes) const { return bytes / host_bw_; }

}  // namespace megatrain::sim

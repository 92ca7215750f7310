// Costs of the step's tasks from the hardware profile; every formula is in docs/cost-model.md.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "megatrain/core/arch.h"
#include "megatrain/simulator/step_model.h"
#include "megatrain/step/schedule.h"

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
  // Data parallelism on a rig with a cluster section: this rank's share of its node.
  if (plan.parallel.data_parallel > 1 && rig.cluster) {
    const ClusterSpec& cl = *rig.cluster;
    ranks_ = plan.parallel.data_parallel;
    ranks_per_node_ = step::ranks_sharing_host(plan, rig);  // the divisor capacity_of applies
    nodes_used_ = ranks_ / ranks_per_node_;
    sharded_ = plan.parallel.host_state == "sharded";
    shared_ = node_shares_host_state(plan.parallel);
    nccl_ = plan.parallel.collective == "nccl";
    if (cl.gpu_peer_bandwidth) peer_bw_ = cl.gpu_peer_bandwidth->value;
    host_bw_ /= static_cast<double>(ranks_per_node_);
    const int64_t sharing = std::min(cl.gpus_per_switch, ranks_per_node_);
    if (sharing > 1 && cl.switch_uplink_bandwidth) link_cap_ = cl.switch_uplink_bandwidth->value / static_cast<double>(sharing);
    if (cl.inter_node_bandwidth) inter_bw_ = cl.inter_node_bandwidth->value;
    if (cl.inter_node_latency_s) inter_latency_ = cl.inter_node_latency_s->value;
  }

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
  nvme_read_bw_ /= static_cast<double>(ranks_per_node_);  // the node's drives, shared by its ranks
  nvme_write_bw_ /= static_cast<double>(ranks_per_node_);

  // Adam: the profile's rate for the state format and the nearest thread count at or below the
  // plan's, scaled by threads, and never faster than host memory allows.
  // With R ranks on a node each rank's optimizer has 1/R of its cores.
  const int64_t rank_cores = std::max<int64_t>(1, rig.host.cores / ranks_per_node_);
  const int64_t threads = plan.optimizer.threads > 0 ? std::min(plan.optimizer.threads, rank_cores) : rank_cores;
  rank_cores_ = rank_cores;
  optimizer_threads_ = threads;
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
    const int64_t usable = std::min(threads, std::max(rank_cores, best->threads));
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

  // Per micro-batch GPU work of each decoder layer (T tokens). Layers differ in their block (MoE or
  // dense MLP) and their attention (a sliding window or the whole prefix); each distinct kind is
  // costed once.
  const double T = static_cast<double>(plan.training.micro_batch * plan.training.seq_len);
  // The keys per query as if unmasked: the row (seq_len), or in rows packed "neat" the documents'
  // length-weighted mean, each query seeing only its own document.
  const double s = plan.training.attention_span();
  const double H = static_cast<double>(c.hidden_size);
  const double q = static_cast<double>(c.num_heads * c.head_dim);
  const double V = static_cast<double>(c.vocab_size);
  const double E = static_cast<double>(c.num_experts), k = static_cast<double>(c.experts_per_token);
  const double attention_bwd_ratio = rig.gpu.attention_backward_ratio ? rig.gpu.attention_backward_ratio->value : 2.5;
  const auto& lt = rig.gpu.layer_times;
  const bool probe_shape = lt && lt->hidden == c.hidden_size && lt->intermediate == c.intermediate_size &&
                           lt->heads == c.num_heads && lt->kv_heads == c.num_kv_heads && lt->head_dim == c.head_dim &&
                           lt->seq == plan.training.seq_len;
  // The probe's figures by micro-batch: linear between points; beyond the last in proportion;
  // below the first, linearly to zero.
  const double mb = static_cast<double>(plan.training.micro_batch);
  auto probed_at = [&](auto field) {
    const auto& p = lt->points;
    if (mb <= static_cast<double>(p.front().micro_batch)) return field(p.front()) * mb / static_cast<double>(p.front().micro_batch);
    for (size_t i = 1; i < p.size(); ++i)
      if (mb <= static_cast<double>(p[i].micro_batch)) {
        const double x0 = static_cast<double>(p[i - 1].micro_batch), x1 = static_cast<double>(p[i].micro_batch);
        return field(p[i - 1]) + (field(p[i]) - field(p[i - 1])) * (mb - x0) / (x1 - x0);
      }
    return field(p.back()) * mb / static_cast<double>(p.back().micro_batch);
  };
  bool used_probe = false, fallback_grouped = false;
  auto cost_of = [&](bool moe, int64_t window) {
    LayerCost L;
    L.moe = moe;
    L.window = window > 0 && window < plan.training.seq_len ? window : 0;
    // Each op of the layer (arch::layer_ops) by its kind: a linear by its shape (forward, and dX
    // and dW for the backward), the experts' grouped GEMMs with uniform routing (T k / E rows to
    // each expert, E GEMMs a call), the attention kernel, and every other op as its memory-bound
    // traffic (the norms, RoPE, Qwen3's per-head norms, the residual adds, the GLU, and a MoE
    // block's router logits in fp32, its dispatch and its weighted combine).
    if (moe) L.rows_per_expert = T * k / E;
    for (const arch::Op& op : arch::layer_ops_of_kind(c, moe)) {
      const double in = static_cast<double>(arch::dim_value(op.in, c)), out = static_cast<double>(arch::dim_value(op.out, c));
      switch (op.kind) {
        case arch::OpKind::kLinear: {
          const double fwd = linear_forward_time(T, in, out);
          if (op.part == arch::Part::kAttention) L.attention_gemms += fwd;
          else if (op.weight == TensorRole::kRouter) L.router += fwd;
          else L.mlp_gemms += fwd;
          L.gemms_backward += linear_backward_time(T, in, out);
          break;
        }
        case arch::OpKind::kGroupedLinear: {
          const double g = grouped_gemm_time(E, L.rows_per_expert, out, in);
          L.experts += g;
          fallback_grouped = fallback_grouped || !rig.gpu.grouped_gemm_efficiency;
          break;
        }
        case arch::OpKind::kAttention: break;  // below: its own rate, its window, its documents
        default: L.elementwise_bytes += T * arch::op_elementwise_bytes(op, c, cb);
      }
    }
    // Causal attention: a fused kernel computes the lower triangle, half of Q.K^T and P.V (in neat
    // rows, each document's own triangle: s is their weighted length). Within a window of w < s keys a query sees min(i, w) keys: s w - w^2 / 2 pairs a sequence instead of
    // s^2 / 2, so the kernel (which skips the blocks outside the band) does (2 s w - w^2) / s^2 of
    // the work. A profile may give the attention kernel's own rate (the CPU backend's is not
    // GEMM-like) and its backward / forward time ratio.
    const double w = static_cast<double>(L.window);
    auto attention_over = [&](double span) {
      const double keys = L.window > 0 && w < span ? (2 * span * w - w * w) / span : span;  // keys per query, as if unmasked
      if (rig.gpu.attention_efficiency) {
        const double f = 2 * T * keys * q;  // 2 GEMMs of 2*T*keys*q FLOPs, each half computed
        return f / (peak_ * rig.gpu.attention_efficiency->at(f));
      }
      return 0.5 * 2 * gemm_time(T, keys, q);
    };
    L.attention = attention_over(s);
    const double block_gemms = moe ? L.router + L.experts : L.mlp_gemms;
    L.forward = L.attention_gemms + block_gemms + L.attention + elementwise_time(L.elementwise_bytes);
    // The backward: dX and dW of every linear (by their own shapes), twice the experts' grouped
    // GEMMs, the attention kernel's backward and twice the memory-bound traffic.
    L.backward = L.gemms_backward + 2 * L.experts + attention_bwd_ratio * L.attention + elementwise_time(2 * L.elementwise_bytes);
    // A profile made for this model (megatrain-plan profile --model) may hold the measured time of
    // a whole layer by micro-batch: it replaces the sum of op-level terms, which misses how the
    // layer's ops share threads and caches, for the layers of the kind it probed.
    const bool probe_kind = moe ? lt && lt->experts == c.num_experts && lt->experts_per_token == c.experts_per_token &&
                                      lt->moe_intermediate == c.moe_intermediate_size
                                : lt && lt->experts == 0;
    if (probe_shape && probe_kind && (lt->window > 0 && lt->window < plan.training.seq_len ? lt->window : 0) == L.window) {
      // The probe's rows are whole contexts: in neat rows the attention costs its documents' span
      // instead, the difference the op-level terms give (forward, and backward at its ratio).
      const double fewer = L.attention - attention_over(static_cast<double>(plan.training.seq_len));
      L.forward = probed_at([](const LayerTimes::Point& pt) { return pt.forward_s; }) + fewer;
      L.backward = probed_at([](const LayerTimes::Point& pt) { return pt.backward_s; }) + attention_bwd_ratio * fewer;
      L.probed = true;
      used_probe = true;
    }
    return L;
  };
  const int64_t layers = std::max<int64_t>(0, c.num_layers);
  kind_of_layer_.assign(static_cast<size_t>(layers), 0);
  for (int64_t l = 0; l < layers; ++l) {
    const bool moe = c.is_moe_layer(l);
    const int64_t window = c.is_sliding_layer(l) ? c.sliding_window : 0;
    const int64_t w = window > 0 && window < plan.training.seq_len ? window : 0;
    size_t i = 0;
    while (i < kinds_.size() && !(kinds_[i].moe == moe && kinds_[i].window == w)) ++i;
    if (i == kinds_.size()) kinds_.push_back(cost_of(moe, window));
    kind_of_layer_[static_cast<size_t>(l)] = static_cast<uint8_t>(i);
    layers_fwd_ += kinds_[i].forward;
    layers_bwd_ += kinds_[i].backward;
  }
  if (kinds_.empty()) kinds_.push_back(cost_of(false, 0));  // a model without layers still answers layer_cost(0)
  if (used_probe)
    assumptions_.push_back("layer forward and backward times are the profile's layer probe of " + lt->model + " at seq " +
                           std::to_string(lt->seq) + " (" + std::to_string(lt->points.size()) + " micro-batch sizes)" +
                           (kinds_.size() > 1 ? ", for the layers of the probed kind" : ""));
  if (fallback_grouped) {
    std::ostringstream a;
    a << "the profile has no grouped-GEMM rate (gpu.grouped_gemm_efficiency): the experts' grouped GEMMs are costed at "
      << kGroupedGemmFallback << " x the dense GEMM rate of one GEMM of the same FLOPs";
    assumptions_.push_back(a.str());
  }
  if (c.is_moe())
    assumptions_.push_back("MoE layers: uniform routing, " + std::to_string(c.experts_per_token) + " of " +
                           std::to_string(c.num_experts) + " experts per token, so each expert's grouped GEMM has T x " +
                           std::to_string(c.experts_per_token) + " / " + std::to_string(c.num_experts) +
                           " rows; every expert's weights are streamed");
  // Head: logits, cross-entropy in fp32 (write logits, softmax, gradient), dX and dW.
  head_ = linear_forward_time(T, H, V) + linear_backward_time(T, H, V) + elementwise_time(3 * 4 * T * V + 4 * cb * T * H);
  // A layer probe of this model's shape that timed the head too: its measured head instead.
  if (probe_shape && lt->vocab == c.vocab_size && !lt->points.empty() && lt->points.front().head_s > 0) {
    head_ = probed_at([](const LayerTimes::Point& pt) { return pt.head_s; });
    assumptions_.push_back("the head (final norm, LM head, cross-entropy and backward) is the profile's probe of " + lt->model +
                           " by micro-batch");
  }
  embed_fwd_ = elementwise_time(2 * cb * T * H);
  embed_bwd_ = elementwise_time(3 * 4 * T * H);
}

double CostModel::gemm_time(double m, double n, double k) const {
  const double f = 2 * m * n * k;
  if (f <= 0) return 0;
  return f / (peak_ * rig_.gpu.gemm_efficiency.at(f));
}

double CostModel::linear_forward_time(double tokens, double in, double out) const {
  const double f = 2 * tokens * in * out;
  if (f <= 0) return 0;
  if (!rig_.gpu.gemm_shapes) return gemm_time(tokens, out, in);
  return f / (peak_ * rig_.gpu.gemm_shapes->at(GemmShapes::kForward, tokens, in, out));
}

double CostModel::linear_backward_time(double tokens, double in, double out) const {
  const double f = 2 * tokens * in * out;
  if (f <= 0) return 0;
  if (!rig_.gpu.gemm_shapes) return 2 * gemm_time(tokens, out, in);
  const GemmShapes& g = *rig_.gpu.gemm_shapes;
  return f / (peak_ * g.at(GemmShapes::kBackwardData, tokens, in, out)) +
         f / (peak_ * g.at(GemmShapes::kBackwardWeight, tokens, in, out));
}

double CostModel::grouped_gemm_efficiency(double experts, double rows, double n, double k) const {
  if (rig_.gpu.grouped_gemm_efficiency) return rig_.gpu.grouped_gemm_efficiency->at(rows);
  return kGroupedGemmFallback * rig_.gpu.gemm_efficiency.at(2 * experts * rows * n * k);
}

double CostModel::grouped_gemm_time(double experts, double rows, double n, double k) const {
  const double f = 2 * experts * rows * n * k;
  if (f <= 0) return 0;
  return f / (peak_ * grouped_gemm_efficiency(experts, rows, n, k));
}

const CostModel::LayerCost& CostModel::layer_cost(int64_t layer) const {
  if (kind_of_layer_.empty()) return kinds_.front();
  MT_CHECK(layer >= 0 && layer < static_cast<int64_t>(kind_of_layer_.size()),
           "CostModel::layer_cost: decoder layer " + std::to_string(layer) + " of " + std::to_string(kind_of_layer_.size()));
  return kinds_[kind_of_layer_[static_cast<size_t>(layer)]];
}

double CostModel::elementwise_time(double bytes) const { return bytes / rig_.gpu.memory_bandwidth.value; }

double CostModel::h2d_time(double bytes) const {
  if (bytes <= 0) return 0;
  const double bw = rig_.links.h2d.pinned_bandwidth.at(bytes);
  return bytes / (link_cap_ > 0 ? std::min(bw, link_cap_) : bw);
}

double CostModel::d2h_time(double bytes) const {
  if (bytes <= 0) return 0;
  const double bw = rig_.links.d2h.pinned_bandwidth.at(bytes);
  return bytes / (link_cap_ > 0 ? std::min(bw, link_cap_) : bw);
}

// MPI's collectives through host memory (docs/cost-model.md, "Data parallelism"). Within a node of
// R ranks, a reduce-scatter moves 3 (R-1)/R S bytes of host memory per rank (its share of the other
// ranks' data read, its own read, the sum written) and an allgather 2 (R-1)/R S (read, written), at
// this rank's share of the host's bandwidth; across M nodes the node's network carries
// 2 (M-1)/M S for an allreduce of the node's shards (each rank's 1/R of S at 1/R of the network's
// bandwidth), (M-1)/M S for a reduce or a gather, plus one latency per ring step. A shared host
// state reduces to the node's owners (3 (R-1)/R S, the sums written into the node's memory) and the
// owners of each range on the M nodes allreduce it (2 (M-1)/M S over the node's network); its
// updated weights need no gather (weight_gather is 0). With parallel.collective nccl the sum is a
// ring on the GPUs (below).
CostModel::Collective CostModel::gradient_sum(double bytes) const {
  Collective c;
  if (ranks_ <= 1 || bytes <= 0) return c;
  const double R = static_cast<double>(ranks_per_node_), M = static_cast<double>(nodes_used_);
  if (nccl_) {
    // NCCL's ring all-reduce on the GPUs: 2 (R-1)/R S through each GPU's peer link (NVLink, or its
    // PCIe link where the rig names none), then across the nodes as MPI's; no host memory.
    const double peer = peer_bw_ > 0 ? peer_bw_ : bytes / std::max(1e-30, d2h_time(bytes));
    c.time_s = 2 * (R - 1) / R * bytes / peer;
    if (M > 1) c.time_s += 2 * (M - 1) / M * bytes / inter_bw_ + 2 * (M - 1) * inter_latency_;
    return c;
  }
  const double intra = (sharded_ || shared_ ? 3.0 : 5.0) * (R - 1) / R * bytes;  // reduce (to owners), or reduce-scatter + allgather
  c.host_bytes = intra;
  c.time_s = intra / host_bw_;
  if (M > 1) {
    const double steps = sharded_ ? (M - 1) : 2 * (M - 1);
    c.time_s += steps / M * bytes / inter_bw_ + steps * inter_latency_;
  }
  return c;
}

CostModel::Collective CostModel::weight_gather(double bytes) const {
  Collective c;
  if (ranks_ <= 1 || !sharded_ || bytes <= 0) return c;
  const double R = static_cast<double>(ranks_per_node_), M = static_cast<double>(nodes_used_);
  const double intra = 2.0 * (R - 1) / R * bytes;
  c.host_bytes = intra;
  c.time_s = intra / host_bw_;
  if (M > 1) c.time_s += (M - 1) / M * bytes / inter_bw_ + (M - 1) * inter_latency_;
  return c;
}

double CostModel::nvme_read_time(double bytes) const { return bytes <= 0 ? 0 : bytes / nvme_read_bw_; }
double CostModel::nvme_write_time(double bytes) const { return bytes <= 0 ? 0 : bytes / nvme_write_bw_; }
double CostModel::adam_time(double params) const { return params / adam_rate_; }
double CostModel::host_pass_time(double bytes) const { return bytes / host_bw_; }

}  // namespace megatrain::sim

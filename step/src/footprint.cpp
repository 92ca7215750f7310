// footprint(): the bytes each tier holds while the step runs. The executor carves its device arena
// once, at start-up, from exactly these buffers, and allocates the host parts listed here, so the
// figure is the executor's allocation, not an estimate of it (docs/executor.md, "Memory").
#include <algorithm>

#include "megatrain/core/units.h"
#include "megatrain/step/schedule.h"

namespace megatrain::step {
namespace {

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

}  // namespace

std::string Footprint::device_parts() const {
  auto b = [](int64_t v) { return format_bytes(static_cast<double>(v)); };
  std::string s = "layer buffers " + b(device_slots) + ", hidden states " + b(device_hidden) + ", checkpoints " +
                  b(device_checkpoints) + ", activations " + b(device_activations) + ", gradients " + b(device_gradients) +
                  ", workspace " + b(device_workspace);
  if (device_private > 0) s += ", backend " + b(device_private);
  return s;
}

Footprint footprint(const StepSchedule& s, const ActivationLayout& layout) {
  Footprint f;
  const Buffers& b = s.buffers;
  const int64_t al = layout.carve_align;
  auto carve = [&](int64_t floats) { return round_up(4 * floats, al); };
  f.device_slots = b.slots * carve(b.slot_floats);
  f.device_hidden = b.hidden * carve(b.hidden_floats);
  f.device_checkpoints = b.checkpoints * carve(b.hidden_floats);
  f.device_activations = b.act_sets * carve(b.act_floats);
  f.device_gradients = b.grad_sets * carve(b.grad_floats) + carve(b.embed_grad) + carve(b.head_grad) +
                       (s.tied ? carve(b.tied_grad) : 0);
  f.device_workspace = carve(b.workspace) + carve(b.scratch);
  f.device_private = layout.private_bytes;
  const int64_t pipeline = f.device_slots + f.device_hidden + f.device_checkpoints + f.device_activations +
                           f.device_gradients + f.device_workspace;
  f.peak.device = round_up(pipeline, layout.arena_align) + f.device_private;

  // Host memory: the state of every unit (HostState), the NVMe staging pool, host checkpoints,
  // lent gradients, the arena when the "device" is host memory, and the step's token rows.
  const bool bf16 = s.transfer_bf16;
  int64_t max_unit = 0, max_region = 0;
  for (size_t u = 0; u < s.unit_numel.size(); ++u) {
    const int64_t n = s.unit_numel[u];
    max_unit = std::max(max_unit, n);
    const auto& numels = s.unit_tensor_numels[u];
    const int64_t mv = state_format_bytes(s.m_format, numels, s.block_size) + state_format_bytes(s.v_format, numels, s.block_size);
    // The rank's own host gradient: every unit's, or none (lent, or summed into the node's memory,
    // where the rank page-locks its range of it).
    const bool own_gradient = s.lent_gradients == 0 && !s.node_gradients;
    f.ram_state += n * ((own_gradient ? 4 : 0) + (bf16 ? 2 : 0)) + (s.master_nvme ? 0 : 4 * n) + (s.states_nvme ? 0 : mv);
    f.peak.pinned += n * (bf16 ? 2 : 4) + (own_gradient ? 4 * n : 0) + (s.node_gradients ? 4 * n / s.grad_share : 0);
    if (s.master_nvme || s.states_nvme) {
      const NvmeRegionLayout region =
          nvme_region_layout(numels, s.master_nvme, s.states_nvme, s.m_format, s.v_format, s.block_size);
      const int64_t capacity = nvme_region_blocks(region.bytes, s.nvme_block_bytes) * s.nvme_block_bytes;
      f.peak.nvme += capacity;
      max_region = std::max(max_region, capacity);
    }
  }
  f.ram_staging = int64_t{s.staging_buffers} * max_region;
  f.ram_checkpoints = s.host_checkpoints ? int64_t{s.checkpoints_per_mb} * s.resident_mbs * 4 * b.hidden_floats : 0;
  f.ram_gradients = int64_t{s.lent_gradients} * 4 * max_unit;
  f.ram_arena = layout.arena_in_ram ? f.peak.device : 0;
  // Input and target rows of the step, and in rows packed "neat" each token's document start.
  f.ram_data = (s.documents ? 3 : 2) * int64_t{s.A} * s.tokens_per_mb * 4;
  f.peak.pinned += f.ram_checkpoints + f.ram_gradients;
  f.peak.ram = f.ram_state + f.ram_staging + f.ram_checkpoints + f.ram_gradients + f.ram_arena + f.ram_data;
  return f;
}

FootprintKeys footprint_keys(const Plan& p) {
  auto e = [](auto v) { return static_cast<int64_t>(v); };
  const TrainingConfig& t = p.training;
  const ScheduleConfig& sc = p.schedule;
  // The step's shape: tokens per micro-batch, micro-batches (resident ones in layer-major order),
  // and the checkpoints (their interval and place).
  const std::vector<int64_t> shape = {t.micro_batch, t.seq_len, t.grad_accum, e(sc.order), sc.checkpoint_every,
                                      e(sc.checkpoint_location)};
  FootprintKeys k{shape, shape};
  // Device: the layer buffers, and the compute dtype (the CUDA backend's activations and workspaces).
  k.device.insert(k.device.end(), {sc.device_layer_buffers, e(p.precision.compute)});
  // Host: the state's formats and places, the NVMe staging and request size, the streaming copy,
  // whether gradients are lent (no clipping, lends_gradients), and whether the rank copies a share
  // of them summed by NCCL (into the node's memory with a shared state).
  const PlacementConfig& pl = p.placement;
  const OptimizerConfig& o = p.optimizer;
  k.host.insert(k.host.end(), {e(pl.master_weights), e(pl.optimizer_states), pl.pinned_staging_bytes, pl.nvme_block_bytes,
                               e(p.precision.transfer), e(o.m_format), e(o.v_format), o.block_size, e(lends_gradients(p)),
                               copies_gradient_share(p) ? state_shard_ranks(p.parallel) : 1, e(gradients_in_node_memory(p)),
                               e(t.document_tokens > 0)});
  return k;
}

int64_t ranks_sharing_host(const Plan& plan, const HardwareProfile& rig) {
  return plan.parallel.data_parallel > 1 && rig.cluster ? plan.parallel.ranks_per_node : 1;
}

TierCapacity capacity_of(const Plan& plan, const HardwareProfile& rig) {
  TierCapacity c;
  c.device = device_budget_of(plan, rig);
  c.pinned = static_cast<int64_t>(rig.host.pinnable_bytes.value);
  c.ram = static_cast<int64_t>(rig.host.ram_bytes.value);
  for (const auto& d : rig.storage) c.nvme += static_cast<int64_t>(d.capacity_bytes.value);
  const int64_t r = ranks_sharing_host(plan, rig);
  c.pinned /= r;
  c.ram /= r;
  c.nvme /= r;
  return c;
}

int64_t sharded_moment_saving(const Plan& plan, const ModelSpec& model) {
  const auto ranks = static_cast<int>(state_shard_ranks(plan.parallel));
  if (ranks <= 1) return 0;
  std::vector<int64_t> all;
  for (const auto& numels : unit_tensor_numels(model)) all.insert(all.end(), numels.begin(), numels.end());
  const std::vector<int> owner = shard_owners(all, ranks);
  std::vector<int64_t> per(static_cast<size_t>(ranks), 0);
  int64_t whole = 0;
  for (size_t i = 0; i < all.size(); ++i)
    for (StateFormat f : {plan.optimizer.m_format, plan.optimizer.v_format}) {
      const int64_t b = state_format_bytes(f, {all[i]}, plan.optimizer.block_size);
      per[static_cast<size_t>(owner[i])] += b;
      whole += b;
    }
  return whole - *std::max_element(per.begin(), per.end());
}

int64_t node_shared_state_bytes(const std::vector<int64_t>& unit_numels, bool transfer_bf16) {
  auto pages = [](int64_t bytes) { return (bytes + 4095) / 4096 * 4096; };
  int64_t total = 0;
  for (int64_t n : unit_numels) total += pages(4 * n) + (transfer_bf16 ? pages(2 * n) : 0) + pages(4 * n);
  return total;
}

void take_rank_share(Footprint& fp, const Plan& plan, const ModelSpec& model) {
  (plan.placement.optimizer_states == Tier::kNvme ? fp.peak.nvme : fp.peak.ram) -= sharded_moment_saving(plan, model);
  if (!node_shares_host_state(plan.parallel)) return;
  // A shared host state: the master weights and the streaming copy the footprint counts for this rank
  // are the node's, in the node's shared memory with the summed gradients; this rank counts its share.
  const bool bf16 = plan.precision.transfer == DType::kBf16;
  std::vector<int64_t> numels;
  for (const auto& t : unit_tensor_numels(model)) numels.push_back(unit_layout(t).numel);
  const int64_t R = plan.parallel.ranks_per_node, streamed = bf16 ? 2 : 4;
  int64_t n = 0;
  for (int64_t v : numels) {
    n += v;
    fp.peak.pinned -= streamed * v - streamed * v / R;  // the streamed copy, page-locked once per node
  }
  const int64_t share = node_shared_state_bytes(numels, bf16) / R;
  fp.peak.ram += share - n * (4 + (bf16 ? 2 : 0));
  fp.ram_state += share - n * (4 + (bf16 ? 2 : 0));
}

Status check_fits(const Footprint& f, const TierCapacity& cap) {
  auto over = [](const std::string& tier, int64_t need, int64_t have, const std::string& parts, const std::string& accepted) {
    return resource_exhausted(tier + " needs " + format_bytes(static_cast<double>(need)) + " (" + std::to_string(need) +
                              " bytes" + (parts.empty() ? "" : ": " + parts) + ") but has " +
                              format_bytes(static_cast<double>(have)) + " (" + std::to_string(have) + " bytes): over by " +
                              format_bytes(static_cast<double>(need - have)) + " (" + std::to_string(need - have) +
                              " bytes); accepted: " + accepted);
  };
  if (f.peak.device > cap.device)
    return over("device", f.peak.device, cap.device, f.device_parts(),
                "placement.device_budget_bytes >= " + std::to_string(f.peak.device) +
                    " on a GPU that has it free, or a plan with fewer layer buffers, a smaller micro-batch or more recompute");
  if (f.peak.ram > cap.ram)
    return over("ram", f.peak.ram, cap.ram, "", "a rig with that much RAM, or a plan that puts master weights or optimizer states on nvme");
  if (f.peak.pinned > cap.pinned)
    return over("pinned", f.peak.pinned, cap.pinned, "", "a rig that can page-lock that much, or bf16 transfer and lent gradients");
  if (f.peak.nvme > cap.nvme) return over("nvme", f.peak.nvme, cap.nvme, "", "more or larger drives in the rig, or less state on nvme");
  return {};
}

}  // namespace megatrain::step

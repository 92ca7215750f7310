// compile(): the step's ordered work on each queue, as the executor issues it (docs/executor.md)
// and the simulator models it (docs/cost-model.md).
#include "megatrain/step/schedule.h"

#include <algorithm>

namespace megatrain::step {

const char* backend_name(BackendKind b) { return b == BackendKind::kCpu ? "cpu" : "cuda"; }

BackendKind backend_of_rig(const HardwareProfile& rig) {
  return rig.gpu.name.rfind("CPU backend", 0) == 0 || rig.links.kind == "host-memcpy" ? BackendKind::kCpu : BackendKind::kCuda;
}

bool lends_gradients(const Plan& plan, bool streamed) {
  return streamed && plan.schedule.order == ScheduleOrder::kLayerMajor && plan.training.clip_grad_norm <= 0;
}

namespace {

void build_round(StepSchedule& s) {
  Round& r = s.round;
  const int32_t L = s.L, U = s.U, c = s.c, R = s.resident_mbs;
  r.micro_batches = R;
  for (int32_t u = 0; u < U; ++u) r.loads.push_back(u);
  if (s.tied) r.loads.push_back(0);  // the head reads the shared table: unit 0 streams again
  r.backward_first_load = static_cast<int32_t>(r.loads.size());
  const int32_t cb = c > 0 ? c : 1;
  for (int32_t lo = 1; lo <= L; lo += cb) r.blocks.push_back({lo, std::min(L, lo + cb - 1)});
  std::reverse(r.blocks.begin(), r.blocks.end());
  for (auto [lo, hi] : r.blocks)
    for (int32_t l = lo; l <= hi; ++l) r.loads.push_back(l);

  // The H2D queue: the forward's loads, then per backward block its loads and its restores.
  for (int32_t i = 0; i < r.backward_first_load; ++i) r.h2d.push_back({Transfer::kWeights, r.loads[static_cast<size_t>(i)], i});
  {
    int32_t i = r.backward_first_load;
    for (size_t bi = 0; bi < r.blocks.size(); ++bi) {
      const auto [lo, hi] = r.blocks[bi];
      for (int32_t l = lo; l <= hi; ++l, ++i) r.h2d.push_back({Transfer::kWeights, l, i});
      if (s.host_checkpoints)
        for (int32_t j = 0; j < R; ++j)
          r.h2d.push_back({Transfer::kRestore, lo, -1, static_cast<int32_t>(bi), (lo - 1) / c, j});
    }
  }

  // The compute stream.
  auto& ops = r.compute;
  auto op = [&](OpKind k, int32_t layer = -1, int32_t mb = -1) -> Op& {
    Op o;
    o.kind = k;
    o.layer = layer;
    o.mb = mb;
    ops.push_back(o);
    return ops.back();
  };
  auto compute = [&](SpanKind kind, int32_t layer, int32_t mb, int32_t load, int32_t load2 = -1) {
    Op& o = op(OpKind::kCompute, layer, mb);
    o.span = kind;
    o.load = load;
    o.load2 = load2;
  };
  auto acquire = [&](int32_t load) { op(OpKind::kAcquire, r.loads[static_cast<size_t>(load)]).load = load; };
  auto release = [&](int32_t load) { op(OpKind::kRelease, r.loads[static_cast<size_t>(load)]).load = load; };
  int32_t li = 0;
  acquire(li);
  for (int32_t j = 0; j < R; ++j) compute(SpanKind::kEmbedForward, 0, j, li);
  release(li++);
  for (int32_t l = 1; l <= L; ++l, ++li) {
    acquire(li);
    const bool keep_input = c > 0 && (l - 1) % c == 0;
    for (int32_t j = 0; j < R; ++j) {
      // This layer overwrites the previous layer's input: a host copy of it must be done.
      if (s.host_checkpoints && l >= 2 && (l - 2) % c == 0) op(OpKind::kWaitCheckpoint, l, j).checkpoint = (l - 2) / c;
      if (keep_input) op(OpKind::kSaveCheckpoint, l, j).checkpoint = (l - 1) / c;
      compute(SpanKind::kForward, l, j, li);
    }
    release(li);
  }
  const int32_t head_load = li++;
  acquire(head_load);
  const int32_t table_load = s.tied ? li++ : -1;
  if (s.tied) acquire(table_load);
  for (int32_t j = 0; j < R; ++j) compute(SpanKind::kHead, L + 1, j, head_load, table_load);
  release(head_load);
  if (s.tied) release(table_load);
  op(OpKind::kGradFinal, L + 1);
  op(OpKind::kBackwardBegins);
  li = r.backward_first_load;
  for (size_t bi = 0; bi < r.blocks.size(); ++bi) {
    const auto [lo, hi] = r.blocks[bi];
    const int32_t first = li;
    for (int32_t l = lo; l <= hi; ++l) acquire(li++);
    for (int32_t l = lo; l <= hi; ++l) op(OpKind::kTakeGradBuffer, l);
    for (int32_t j = 0; j < R; ++j) {
      if (c > 0) {
        if (s.host_checkpoints) op(OpKind::kWaitRestore, lo, j).block = static_cast<int32_t>(bi);
        for (int32_t l = lo; l <= hi; ++l) {
          compute(SpanKind::kRecompute, l, j, first + (l - lo));
          if (l == lo && s.host_checkpoints) op(OpKind::kConsumed, lo, j).block = static_cast<int32_t>(bi);
        }
      }
      for (int32_t l = hi; l >= lo; --l) compute(SpanKind::kBackward, l, j, first + (l - lo));
    }
    for (int32_t l = hi; l >= lo; --l) {
      release(first + (l - lo));
      op(OpKind::kGradFinal, l);
    }
  }
  for (int32_t j = 0; j < R; ++j) compute(SpanKind::kEmbedBackward, 0, j, -1);
  op(OpKind::kGradFinal, 0);
}

}  // namespace

UnitTable unit_table(const ModelSpec& model) { return UnitTable{unit_tensor_numels(model)}; }

Result<StepSchedule> compile(const Plan& plan, const ModelSpec& model, const ActivationLayout& layout,
                             const CompileOptions& options) {
  // Units as HostState groups the tensors: 0 the embedding, l + 1 decoder layer l, L + 1 the rest.
  const UnitTable own = options.units ? UnitTable{} : unit_table(model);
  const UnitTable& units = options.units ? *options.units : own;
  MT_RETURN_IF_ERROR(check_plan_for_model(plan, model, units.tensor_numels));
  const ModelConfig& mc = model.config();
  StepSchedule s;
  s.L = static_cast<int32_t>(mc.num_layers);
  s.U = s.L + 2;
  s.A = static_cast<int32_t>(plan.training.grad_accum);
  s.K = static_cast<int32_t>(plan.schedule.prefetch_depth);
  s.B = static_cast<int32_t>(plan.schedule.device_layer_buffers);
  s.c = static_cast<int32_t>(plan.schedule.checkpoint_every);
  s.layer_major = plan.schedule.order == ScheduleOrder::kLayerMajor;
  s.clip = plan.training.clip_grad_norm > 0;
  s.tied = mc.tie_word_embeddings;
  s.host_checkpoints = plan.schedule.checkpoint_location == CheckpointLocation::kHost && s.c > 0;
  s.resident_mbs = s.layer_major ? s.A : 1;
  s.rounds = s.layer_major ? 1 : s.A;
  s.checkpoints_per_mb = s.c > 0 ? (s.L + s.c - 1) / s.c : 0;
  s.master_nvme = plan.placement.master_weights == Tier::kNvme;
  s.states_nvme = plan.placement.optimizer_states == Tier::kNvme;
  s.transfer_bf16 = plan.precision.transfer == DType::kBf16;
  s.m_format = plan.optimizer.m_format;
  s.v_format = plan.optimizer.v_format;
  s.block_size = plan.optimizer.block_size;
  s.nvme_block_bytes = plan.placement.nvme_block_bytes;
  s.lent_gradients = options.lent_gradients && lends_gradients(plan) ? kLentGradientBuffers : 0;
  s.tokens_per_mb = plan.training.micro_batch * plan.training.seq_len;
  s.unit_tensor_numels = units.tensor_numels;
  for (const auto& t : s.unit_tensor_numels) {
    int64_t n = 0;
    for (int64_t x : t) n += x;
    s.unit_numel.push_back(n);
  }
  if (s.master_nvme || s.states_nvme) {
    const int64_t unit = nvme_unit_transfer_bytes(units.tensor_numels, s.master_nvme, s.states_nvme, plan.optimizer.m_format,
                                                  plan.optimizer.v_format, plan.optimizer.block_size);
    s.staging_buffers = static_cast<int32_t>(plan.placement.pinned_staging_bytes / std::max<int64_t>(unit, 1));
  }
  s.layout = layout;

  Buffers& b = s.buffers;
  const int64_t max_unit = *std::max_element(s.unit_numel.begin(), s.unit_numel.end());
  b.slots = s.B;
  b.slot_floats = max_unit;
  b.hidden = 3 * s.resident_mbs;
  b.hidden_floats = layout.hidden_floats;
  b.checkpoints = s.host_checkpoints ? 0 : int64_t{s.checkpoints_per_mb} * s.resident_mbs;
  b.act_sets = s.c > 0 ? s.c : int64_t{s.L} * s.resident_mbs;
  b.act_floats = layout.layer_act_floats;
  b.grad_sets = (s.c > 0 ? s.c : 1) + 1;
  // The accumulators serve every decoder layer in turn: each holds the largest (a dense first layer
  // of a Mixture-of-Experts model is smaller than the others).
  b.grad_floats = s.L > 0 ? *std::max_element(s.unit_numel.begin() + 1, s.unit_numel.begin() + 1 + s.L) : 0;
  b.embed_grad = s.unit_numel[0];
  b.head_grad = s.unit_numel[static_cast<size_t>(s.L + 1)];
  b.tied_grad = s.tied ? mc.vocab_size * mc.hidden_size : 0;
  b.workspace = layout.workspace_floats();
  b.scratch = layout.hidden_floats;

  for (int32_t u = s.U - 1; u >= 0; --u) s.optimizer_order.push_back(u);  // as gradients become final
  if (s.clip) std::reverse(s.optimizer_order.begin(), s.optimizer_order.end());  // after the norm: the next forward's order
  if (options.ops) build_round(s);
  return s;
}

}  // namespace megatrain::step

// compile(): the step's ordered work on each queue, as the executor issues it (docs/executor.md)
// and the simulator models it (docs/cost-model.md).
#include "megatrain/step/schedule.h"

#include <algorithm>

namespace megatrain::step {

const char* backend_name(BackendKind b) { return b == BackendKind::kCpu ? "cpu" : "cuda"; }

BackendKind backend_of_rig(const HardwareProfile& rig) {
  return rig.gpu.name.rfind("CPU backend", 0) == 0 || rig.links.kind == "host-memcpy" ? BackendKind::kCpu : BackendKind::kCuda;
}

bool copies_gradient_share(const Plan& plan) {
  return plan.parallel.collective == "nccl" && state_shard_ranks(plan.parallel) > 1;
}

bool gradients_in_node_memory(const Plan& plan) {
  return plan.parallel.collective == "nccl" && node_shares_host_state(plan.parallel);
}

bool lends_gradients(const Plan& plan, bool streamed) {
  // A shared host state sums each gradient into the node's memory as soon as it is copied back, so
  // the lent buffer is free again before the update, with clipping too; summed by NCCL, the copy
  // needs no buffer at all.
  return streamed && !gradients_in_node_memory(plan) && plan.schedule.order == ScheduleOrder::kLayerMajor &&
         (plan.training.clip_grad_norm <= 0 || node_shares_host_state(plan.parallel));
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
  auto grad_final = [&](int32_t unit) {
    op(OpKind::kGradFinal, unit).transfer = static_cast<int32_t>(r.d2h.size());
    r.d2h.push_back({Transfer::kGradient, unit});
  };
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
      if (keep_input) {
        Op& save = op(OpKind::kSaveCheckpoint, l, j);
        save.checkpoint = (l - 1) / c;
        if (s.host_checkpoints) {
          save.transfer = static_cast<int32_t>(r.d2h.size());
          r.d2h.push_back({Transfer::kCheckpoint, l, -1, -1, save.checkpoint, j});
        }
      }
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
  grad_final(L + 1);
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
          ops.back().block = static_cast<int32_t>(bi);
          ops.back().checkpoint = (lo - 1) / c;
          if (l == lo && s.host_checkpoints) op(OpKind::kConsumed, lo, j).block = static_cast<int32_t>(bi);
        }
      }
      for (int32_t l = hi; l >= lo; --l) {
        compute(SpanKind::kBackward, l, j, first + (l - lo));
        ops.back().block = static_cast<int32_t>(bi);
      }
    }
    for (int32_t l = hi; l >= lo; --l) {
      release(first + (l - lo));
      grad_final(l);
    }
  }
  for (int32_t j = 0; j < R; ++j) compute(SpanKind::kEmbedBackward, 0, j, -1);
  grad_final(0);
}

// The edges of a built round. Slots: the H2D queue takes the loads in order and load n can only
// start once n - B + 1 slots have been released, so it waits for the compute stream's release
// number n - B (label_slots names the slot). Accumulators likewise: take number n reuses the
// accumulator whose gradient copy is number n - G among the decoder layers' copies, G = grad_sets.
Status wire_edges(StepSchedule& s) {
  Round& r = s.round;
  const auto n_ops = static_cast<int32_t>(r.compute.size());
  std::vector<int32_t> h2d_of_load(r.loads.size(), -1), acquire_op(r.loads.size(), -1);
  const auto cell = [&](int32_t a, int32_t mb) { return static_cast<size_t>(a) * static_cast<size_t>(r.micro_batches) + static_cast<size_t>(mb); };
  std::vector<int32_t> restore_h2d(r.blocks.size() * static_cast<size_t>(r.micro_batches), -1);
  std::vector<int32_t> consumed_op(restore_h2d.size(), -1);
  std::vector<int32_t> ckpt_d2h(static_cast<size_t>(std::max(1, s.checkpoints_per_mb)) * static_cast<size_t>(r.micro_batches), -1);
  for (int32_t i = 0; i < static_cast<int32_t>(r.h2d.size()); ++i) {
    const Transfer& t = r.h2d[static_cast<size_t>(i)];
    if (t.kind == Transfer::kWeights) h2d_of_load[static_cast<size_t>(t.load)] = i;
    else restore_h2d[cell(t.block, t.mb)] = i;
  }
  for (int32_t i = 0; i < static_cast<int32_t>(r.d2h.size()); ++i)
    if (const Transfer& t = r.d2h[static_cast<size_t>(i)]; t.kind == Transfer::kCheckpoint) ckpt_d2h[cell(t.checkpoint, t.mb)] = i;

  std::vector<int32_t> releases;                      // the release ops, in compute order
  std::vector<int32_t> grad_copies;                   // D2H indices of decoder layers' gradients, in order
  std::vector<int32_t> acc_of_unit(static_cast<size_t>(s.U), -1);
  int32_t takes = 0, backward_begins = -1;
  const auto G = static_cast<int32_t>(s.buffers.grad_sets);
  for (int32_t k = 0; k < n_ops; ++k) {
    Op& o = r.compute[static_cast<size_t>(k)];
    switch (o.kind) {
      case OpKind::kAcquire: acquire_op[static_cast<size_t>(o.load)] = k; o.transfer = h2d_of_load[static_cast<size_t>(o.load)]; break;
      case OpKind::kRelease: releases.push_back(k); break;
      case OpKind::kWaitRestore: o.transfer = restore_h2d[cell(o.block, o.mb)]; break;
      case OpKind::kWaitCheckpoint: o.transfer = ckpt_d2h[cell(o.checkpoint, o.mb)]; break;
      case OpKind::kConsumed: consumed_op[cell(o.block, o.mb)] = k; break;
      case OpKind::kBackwardBegins: backward_begins = k; break;
      case OpKind::kTakeGradBuffer: {
        const int32_t n = takes++;
        if (n < G) {
          o.accumulator = n;
        } else {
          if (static_cast<size_t>(n - G) >= grad_copies.size())
            return internal_error("the compiled step takes gradient accumulator " + std::to_string(n + 1) + " of layer " +
                                  std::to_string(o.layer) + " before enough of the " + std::to_string(G) + " are given back");
          o.transfer = grad_copies[static_cast<size_t>(n - G)];
          o.accumulator = r.d2h[static_cast<size_t>(o.transfer)].accumulator;
        }
        acc_of_unit[static_cast<size_t>(o.layer)] = o.accumulator;
        break;
      }
      case OpKind::kGradFinal: {
        Transfer& t = r.d2h[static_cast<size_t>(o.transfer)];
        t.after_op = k;
        t.accumulator = acc_of_unit[static_cast<size_t>(o.layer)];
        if (o.layer >= 1 && o.layer <= s.L) grad_copies.push_back(o.transfer);
        break;
      }
      case OpKind::kSaveCheckpoint:
        if (o.transfer >= 0) r.d2h[static_cast<size_t>(o.transfer)].after_op = k;
        break;
      case OpKind::kCompute: break;
    }
  }
  for (Transfer& t : r.h2d) {
    if (t.kind == Transfer::kRestore) {
      t.after_op = backward_begins;
      t.after_consumed = t.block > 0 ? consumed_op[cell(t.block - 1, t.mb)] : -1;
      t.after_copy = ckpt_d2h[cell(t.checkpoint, t.mb)];
      continue;
    }
    const int32_t n = t.load;
    t.after_update = true;
    t.window = n >= s.K ? acquire_op[static_cast<size_t>(n - s.K)] : -1;
    t.slot_freed = n >= s.B ? releases[static_cast<size_t>(n - s.B)] : -1;
  }
  return check_edges(s);
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
  if (copies_gradient_share(plan)) s.grad_share = static_cast<int32_t>(state_shard_ranks(plan.parallel));
  s.node_gradients = gradients_in_node_memory(plan);
  s.tokens_per_mb = plan.training.micro_batch * plan.training.seq_len;
  s.documents = plan.training.document_tokens > 0;
  s.unit_tensor_numels = units.tensor_numels;
  for (const auto& t : s.unit_tensor_numels) s.unit_numel.push_back(unit_layout(t).numel);
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
  if (options.ops) {
    build_round(s);
    MT_RETURN_IF_ERROR(wire_edges(s));
  }
  return s;
}

std::vector<int32_t> first_slots(int32_t B) {
  std::vector<int32_t> v(static_cast<size_t>(std::max(0, B)));
  for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<int32_t>(k);
  return v;
}

SlotLabels label_slots(const Round& r, int32_t B, const std::vector<int32_t>& carried) {
  SlotLabels out;
  out.of_load.assign(r.loads.size(), -1);
  std::vector<int32_t> queue = carried;  // free slots in the order loads take them
  queue.resize(static_cast<size_t>(B), -1);
  size_t next = 0;  // the next load in H2D order
  auto take = [&] {
    while (next < r.loads.size() && next < queue.size()) {
      out.of_load[next] = queue[next];
      ++next;
    }
  };
  take();
  for (const Op& o : r.compute)
    if (o.kind == OpKind::kRelease) {
      queue.push_back(out.of_load[static_cast<size_t>(o.load)]);
      take();
    }
  out.carried.assign(queue.begin() + static_cast<std::ptrdiff_t>(r.loads.size()),
                     queue.begin() + static_cast<std::ptrdiff_t>(r.loads.size()) + B);
  return out;
}

Status check_edges(const StepSchedule& s) {
  const Round& r = s.round;
  const auto n_ops = static_cast<int32_t>(r.compute.size()), n_h2d = static_cast<int32_t>(r.h2d.size()),
             n_d2h = static_cast<int32_t>(r.d2h.size());
  auto bad = [](const std::string& what) { return internal_error("the compiled step's edges are malformed: " + what); };
  auto in = [](int32_t i, int32_t n, bool optional) { return (optional && i == -1) || (i >= 0 && i < n); };
  // Indices in range; load n >= B waits for release number n - B, the first B loads for none.
  std::vector<int32_t> release_ops;
  for (int32_t k = 0; k < n_ops; ++k)
    if (r.compute[static_cast<size_t>(k)].kind == OpKind::kRelease) release_ops.push_back(k);
  if (release_ops.size() != r.loads.size())
    return bad(std::to_string(release_ops.size()) + " releases for " + std::to_string(r.loads.size()) + " loads");
  for (int32_t i = 0; i < n_h2d; ++i) {
    const Transfer& t = r.h2d[static_cast<size_t>(i)];
    const std::string at = "H2D " + std::to_string(i);
    if (t.kind == Transfer::kWeights) {
      if (!in(t.load, static_cast<int32_t>(r.loads.size()), false) || !in(t.window, n_ops, true) || !in(t.slot_freed, n_ops, true))
        return bad(at + " (a load) has an index out of range");
      const int32_t want = t.load >= s.B ? release_ops[static_cast<size_t>(t.load - s.B)] : -1;
      if (t.slot_freed != want)
        return bad(at + " (load " + std::to_string(t.load) + ") takes the slot given back at op " + std::to_string(t.slot_freed) +
                   ", but with " + std::to_string(s.B) + " slots it must wait for " +
                   (want < 0 ? std::string("none") : "op " + std::to_string(want)));
    } else if (t.kind == Transfer::kRestore) {
      if (!in(t.after_op, n_ops, false) || !in(t.after_consumed, n_ops, true) || !in(t.after_copy, n_d2h, false))
        return bad(at + " (a restore) has an index out of range");
    } else {
      return bad(at + " is not a load or a restore");
    }
  }
  std::vector<int32_t> acc_copy(static_cast<size_t>(std::max<int64_t>(0, s.buffers.grad_sets)), -1);  // last copy freeing it
  for (int32_t i = 0; i < n_d2h; ++i) {
    const Transfer& t = r.d2h[static_cast<size_t>(i)];
    if ((t.kind != Transfer::kGradient && t.kind != Transfer::kCheckpoint) || !in(t.after_op, n_ops, false))
      return bad("D2H " + std::to_string(i) + " is not a gradient or a checkpoint copy after an op");
  }
  for (int32_t k = 0; k < n_ops; ++k) {
    const Op& o = r.compute[static_cast<size_t>(k)];
    const std::string at = "op " + std::to_string(k);
    switch (o.kind) {
      case OpKind::kAcquire: case OpKind::kWaitRestore:
        if (!in(o.transfer, n_h2d, false)) return bad(at + " waits for an H2D copy out of range");
        break;
      case OpKind::kWaitCheckpoint: case OpKind::kGradFinal:
        if (!in(o.transfer, n_d2h, false)) return bad(at + " names a D2H copy out of range");
        break;
      case OpKind::kTakeGradBuffer: {
        if (!in(o.transfer, n_d2h, true) || !in(o.accumulator, static_cast<int32_t>(acc_copy.size()), false))
          return bad(at + " takes an accumulator out of range");
        if (o.transfer != acc_copy[static_cast<size_t>(o.accumulator)])
          return bad(at + " takes accumulator " + std::to_string(o.accumulator) + " without waiting for the copy that gives it back");
        acc_copy[static_cast<size_t>(o.accumulator)] = -2;  // in use until its gradient's copy
        break;
      }
      default: break;
    }
    if (o.kind == OpKind::kGradFinal) {
      const Transfer& t = r.d2h[static_cast<size_t>(o.transfer)];
      if (t.accumulator >= 0) acc_copy[static_cast<size_t>(t.accumulator)] = o.transfer;
    }
  }
  // Run the three queues in order with no durations: each takes its next item when what that item
  // waits for is done. A round that cannot finish so would hang the executor.
  int32_t pc = 0, ph = 0, pd = 0;
  std::vector<char> h_done(static_cast<size_t>(n_h2d), 0), d_done(static_cast<size_t>(n_d2h), 0);
  for (bool moved = true; moved;) {
    moved = false;
    while (pc < n_ops) {
      const Op& o = r.compute[static_cast<size_t>(pc)];
      const bool wait_h = o.kind == OpKind::kAcquire || o.kind == OpKind::kWaitRestore;
      const bool wait_d = o.kind == OpKind::kWaitCheckpoint || (o.kind == OpKind::kTakeGradBuffer && o.transfer >= 0);
      if ((wait_h && !h_done[static_cast<size_t>(o.transfer)]) || (wait_d && !d_done[static_cast<size_t>(o.transfer)])) break;
      ++pc;
      moved = true;
    }
    while (ph < n_h2d) {  // an edge to op k is met once the compute stream has issued op k
      const Transfer& t = r.h2d[static_cast<size_t>(ph)];
      const bool ready = t.kind == Transfer::kWeights
                             ? t.window < pc && t.slot_freed < pc
                             : t.after_op < pc && t.after_consumed < pc && d_done[static_cast<size_t>(t.after_copy)];
      if (!ready) break;
      h_done[static_cast<size_t>(ph++)] = 1;
      moved = true;
    }
    while (pd < n_d2h && r.d2h[static_cast<size_t>(pd)].after_op < pc) {
      d_done[static_cast<size_t>(pd++)] = 1;
      moved = true;
    }
  }
  if (pc < n_ops || ph < n_h2d || pd < n_d2h)
    return internal_error("the compiled step deadlocks: the compute stream stops at op " + std::to_string(pc) + " of " +
                          std::to_string(n_ops) + ", the H2D queue at " + std::to_string(ph) + " of " + std::to_string(n_h2d) +
                          ", the D2H queue at " + std::to_string(pd) + " of " + std::to_string(n_d2h));
  return {};
}

}  // namespace megatrain::step

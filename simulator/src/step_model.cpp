// Compiles a plan into the task graph of the executor's schedule (layer-major or
// microbatch-major), runs it on the Engine, and measures the steady-state step.
#include "megatrain/simulator/step_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "detail/stall.h"
#include "megatrain/core/units.h"
#include "megatrain/step/schedule.h"

namespace megatrain::sim {
namespace {

int64_t ceil_i(double v) { return static_cast<int64_t>(std::ceil(v - 1e-9)); }
int16_t kind_of(SpanKind k) { return static_cast<int16_t>(k); }

struct Ids {
  int32_t lane[kLaneCount];
  int32_t pool_host = -1, pool_pcie = -1, pool_nvme = -1;
  int32_t pool_cores = -1;  // the CPU backend's cores (compute, copies and optimizer share them)
  // One memory per slot (mem_slot0 + k) and per gradient accumulator (mem_accumulator0 + k).
  int32_t mem_device = -1, mem_slot0 = -1, mem_accumulator0 = -1, mem_lent = -1, mem_staging = -1;
};

// Adds the tasks of the compiled step (megatrain/step/schedule.h) to the engine, one step at a
// time, with the compiled step's edges: the queues are in the schedule's order, a load waits for
// the prefetch window, its slot and the unit's previous update, and the buffers the executor waits
// for are memories (each slot and gradient accumulator; the lent host gradients and the NVMe
// staging buffers, counted).
class Builder {
 public:
  Builder(const Plan& plan, const ModelSpec& model, const CostModel& cost, const step::StepSchedule& s, Engine& e, const Ids& ids)
      : cost_(cost), s_(s), e_(e), id_(ids) {
    const auto U = static_cast<size_t>(s_.U);
    adam_prev_.assign(U, -1);
    carried_ = step::first_slots(s_.B);
    nvme_write_prev_.assign(U, -1);
    const FlopsPerToken f = model.flops_per_token(plan.training.seq_len, plan.training.attention_span());
    const double T = static_cast<double>(s_.tokens_per_mb);
    // Each layer's own FLOPs (MoE and dense layers differ; MoE counts the k experts a token uses).
    layer_flops_.assign(static_cast<size_t>(s_.L), T * f.layer_forward);
    for (size_t l = 0; l < layer_flops_.size() && l < f.layer_forwards.size(); ++l) layer_flops_[l] = T * f.layer_forwards[l];
    head_flops_ = T * 3 * f.head_forward;
    tb_ = s_.transfer_bf16 ? 2 : 4;
    sharded_ = cost_.multi_rank() && plan.parallel.host_state == "sharded";
    // A shared host state frees a lent gradient buffer once its sum is in the node's memory (with a
    // cluster section after the gradient_sum task, else after the copy), not after the update.
    shared_ = node_shares_host_state(plan.parallel);
    state_pp_ = state_format_bytes_per_element(s_.m_format, s_.block_size) + state_format_bytes_per_element(s_.v_format, s_.block_size);
  }

  void build_step(int32_t step) {
    step_ = step;
    grad_ready_.assign(static_cast<size_t>(s_.U), -1);
    prev_update_ = adam_prev_;  // this step's loads wait for the previous step's updates
    nvme_read_.assign(static_cast<size_t>(s_.U), -1);
    if (s_.master_nvme || s_.states_nvme)  // issued at the step's start, in the optimizer's order
      for (int32_t u : s_.optimizer_order) {
        nvme_read_[static_cast<size_t>(u)] = nvme_read(u);
        for (TaskId b : {last_h2d_, last_d2h_}) after(b, nvme_read_[static_cast<size_t>(u)]);
      }
    for (int32_t r = 0; r < s_.rounds; ++r) round(r);
    if (s_.clip) {
      double bytes = 0;
      for (int64_t n : s_.unit_numel) bytes += 4 * static_cast<double>(n);
      TaskId n = task(Lane::kOptimizer, cost_.host_pass_time(bytes), SpanKind::kGradNorm, -1, -1, ceil_i(bytes));
      use_pool(n, id_.pool_host, bytes / std::max(1e-12, cost_.host_pass_time(bytes)));
      use_pool(n, id_.pool_cores, static_cast<double>(cost_.optimizer_threads()));
      for (TaskId g : grad_ready_) after(g, n);
      for (int32_t u : s_.optimizer_order) optimizer(u, n);
    }
  }

 private:
  TaskId task(Lane lane, double work, SpanKind kind, int32_t layer, int32_t mb, int64_t bytes = 0, double flops = 0) {
    TaskSpec t;
    t.resource = id_.lane[static_cast<int>(lane)];
    t.work_s = work;
    t.kind = kind_of(kind);
    t.step = step_;
    t.layer = layer;
    t.micro_batch = mb;
    t.bytes = bytes;
    t.flops = flops;
    return e_.add_task(t);
  }
  void use_pool(TaskId t, int32_t pool, double demand) {
    if (pool < 0) return;
    TaskSpec& ts = const_cast<TaskSpec&>(e_.task(t));
    for (int k = 0; k < kTaskPools; ++k) {
      if (ts.pool[k] < 0) {
        ts.pool[k] = pool;
        ts.demand[k] = demand;
        return;
      }
    }
  }
  // A DMA between host memory and the device uses host memory bandwidth and, on a half-duplex
  // link, the shared PCIe pool.
  void dma(TaskId t, double bytes, double time) {
    if (time <= 0) return;
    use_pool(t, id_.pool_host, bytes / time);
    use_pool(t, id_.pool_pcie, 1.0);
    use_pool(t, id_.pool_cores, 1.0);  // the CPU backend's copy thread
  }
  void after(TaskId before, TaskId t) {
    if (before >= 0 && t >= 0) e_.add_dependency(before, t);
  }
  double numel(int32_t u) const { return static_cast<double>(s_.unit_numel[static_cast<size_t>(u)]); }

  // `unit` is the op's unit: 1..L are the decoder layers 0..L-1.
  double compute_time(SpanKind k, int32_t unit) const {
    switch (k) {
      case SpanKind::kEmbedForward: return cost_.embed_forward_time();
      case SpanKind::kEmbedBackward: return cost_.embed_backward_time();
      case SpanKind::kHead: return cost_.head_time();
      case SpanKind::kBackward: return cost_.layer_backward_time(unit - 1);
      default: return cost_.layer_forward_time(unit - 1);  // forward and recompute
    }
  }
  double compute_flops(SpanKind k, int32_t unit) const {
    const auto l = static_cast<size_t>(std::max(0, unit - 1));
    switch (k) {
      case SpanKind::kForward: case SpanKind::kRecompute: return layer_flops_[l];
      case SpanKind::kBackward: return 2 * layer_flops_[l];
      case SpanKind::kHead: return head_flops_;
      default: return 0;
    }
  }

  // One round: the compute walk (each D2H copy follows the op that produces it), then the H2D
  // queue. Every wait is a compiled edge (megatrain/step/schedule.h): a transfer waits for the
  // compute task before the op it names, an op's wait holds back the next compute task, and a slot
  // or gradient accumulator is a memory of one that its compiled user acquires and its compiled
  // release gives back.
  void round(int32_t r) {
    const step::Round& rd = s_.round;
    const bool last_round = r == s_.rounds - 1;
    const size_t n_ops = rd.compute.size();
    const step::SlotLabels slots = step::label_slots(rd, s_.B, carried_);
    carried_ = slots.carried;
    std::vector<TaskId> reached(n_ops, -1);  // the compute task up to op k: done once the stream has issued op k
    std::vector<TaskId> waiter(n_ops, -1);   // the compute task after op k: what op k's wait holds back
    std::vector<TaskId> released(rd.loads.size(), -1);  // the task after which load i's slot is free
    std::vector<TaskId> d2h(rd.d2h.size(), -1), h2d(rd.h2d.size(), -1);
    // The executor drains the copy queues at the end of every round (its events and buffers are
    // reused by the next): this round's first copy and first compute wait for that.
    const TaskId barrier[2] = {last_h2d_, last_d2h_};
    std::vector<TaskId> pending_deps(barrier, barrier + 2);
    std::vector<size_t> pending_waiters;
    std::vector<int32_t> pending_accumulators;
    auto mb_of = [&](int32_t j) { return s_.mb_of(r, j); };
    for (size_t k = 0; k < n_ops; ++k) {
      const step::Op& op = rd.compute[k];
      reached[k] = last_gpu_;  // the ops other than compute add no compute task
      switch (op.kind) {
        case step::OpKind::kCompute: {
          TaskId g = task(Lane::kCompute, compute_time(op.span, op.layer), op.span, op.layer, mb_of(op.mb), 0,
                          compute_flops(op.span, op.layer));
          use_pool(g, id_.pool_cores, static_cast<double>(cost_.rank_cores()));
          after(last_gpu_, g);  // the compute stream is in order; explicit for the critical path
          for (TaskId d : pending_deps) after(d, g);
          for (int32_t a : pending_accumulators) e_.acquire(g, id_.mem_accumulator0 + a, 1);
          for (size_t w : pending_waiters) waiter[w] = g;
          pending_deps.clear();
          pending_accumulators.clear();
          pending_waiters.clear();
          last_gpu_ = reached[k] = g;
          break;
        }
        case step::OpKind::kAcquire: case step::OpKind::kWaitRestore: pending_waiters.push_back(k); break;
        case step::OpKind::kWaitCheckpoint: pending_deps.push_back(d2h[static_cast<size_t>(op.transfer)]); break;
        case step::OpKind::kTakeGradBuffer: pending_accumulators.push_back(op.accumulator); break;
        case step::OpKind::kRelease: released[static_cast<size_t>(op.load)] = last_gpu_; break;
        case step::OpKind::kSaveCheckpoint:  // a device copy on the compute stream needs no transfer
          if (op.transfer >= 0) d2h[static_cast<size_t>(op.transfer)] = copy_out(rd.d2h[static_cast<size_t>(op.transfer)], r, reached);
          break;
        case step::OpKind::kGradFinal:
          d2h[static_cast<size_t>(op.transfer)] = copy_out(rd.d2h[static_cast<size_t>(op.transfer)], r, reached);
          if ((last_round || cost_.device_sums()) && cost_.multi_rank()) gradient_sum(op.layer);
          if (last_round && shared_ && s_.lent_gradients > 0) e_.release(grad_ready_[static_cast<size_t>(op.layer)], id_.mem_lent, 1);
          if (last_round && !s_.clip) optimizer(op.layer, -1);
          break;
        case step::OpKind::kConsumed: case step::OpKind::kBackwardBegins: break;  // edges wait for reached[k]
      }
    }
    // The H2D queue in its issue order.
    for (size_t i = 0; i < rd.h2d.size(); ++i) {
      const step::Transfer& t = rd.h2d[i];
      const bool weights = t.kind == step::Transfer::kWeights;
      const double bytes = weights ? numel(t.unit) * tb_ : 4.0 * static_cast<double>(s_.buffers.hidden_floats);
      TaskId h = weights ? task(Lane::kH2D, cost_.h2d_time(bytes), SpanKind::kH2D, t.unit, -1, ceil_i(bytes))
                         : task(Lane::kH2D, cost_.h2d_time(bytes), SpanKind::kH2DCheckpoint, t.unit, mb_of(t.mb), ceil_i(bytes));
      dma(h, bytes, cost_.h2d_time(bytes));
      if (i == 0)
        for (TaskId b : barrier) after(b, h);
      if (weights) {
        const int32_t slot = id_.mem_slot0 + slots.of_load[static_cast<size_t>(t.load)];
        e_.acquire(h, slot, 1);  // free once the previous reader's release (slot_freed) is done
        e_.release(released[static_cast<size_t>(t.load)], slot, 1);
        if (t.after_update) after(prev_update_[static_cast<size_t>(t.unit)], h);  // the previous step's updated weights
        if (t.window >= 0) after(reached[static_cast<size_t>(t.window)], h);     // the prefetch window
      } else {
        after(reached[static_cast<size_t>(t.after_op)], h);
        if (t.after_consumed >= 0) after(reached[static_cast<size_t>(t.after_consumed)], h);  // it overwrites what that recompute read
        after(d2h[static_cast<size_t>(t.after_copy)], h);
      }
      h2d[i] = h;
      last_h2d_ = h;
    }
    for (size_t k = 0; k < n_ops; ++k) {
      const step::Op& op = rd.compute[k];
      if (op.kind == step::OpKind::kAcquire || op.kind == step::OpKind::kWaitRestore)
        after(h2d[static_cast<size_t>(op.transfer)], waiter[k]);
    }
  }

  // A D2H copy of a gradient (summed into the host's in later micro-batch-major rounds) or of a
  // host checkpoint, after the compute task before the op that issues it.
  TaskId copy_out(const step::Transfer& t, int32_t r, const std::vector<TaskId>& reached) {
    TaskId d;
    if (t.kind == step::Transfer::kCheckpoint) {
      const double bytes = 4.0 * static_cast<double>(s_.buffers.hidden_floats);
      d = task(Lane::kD2H, cost_.d2h_time(bytes), SpanKind::kD2HCheckpoint, t.unit, s_.mb_of(r, t.mb), ceil_i(bytes));
      dma(d, bytes, cost_.d2h_time(bytes));
    } else {
      const int32_t u = t.unit;
      // fp32 gradients; with NCCL and split states, the rank's share of the GPUs' sum
      const double bytes = 4 * numel(u) / s_.grad_share;
      double work = cost_.d2h_time(bytes);
      if (!s_.layer_major && r > 0) work += cost_.host_pass_time(3 * bytes);  // added into the host gradient
      d = task(Lane::kD2H, work, SpanKind::kD2H, u, s_.layer_major ? -1 : r, ceil_i(bytes));
      dma(d, bytes, work);
      if (t.accumulator >= 0) e_.release(d, id_.mem_accumulator0 + t.accumulator, 1);
      if (s_.lent_gradients > 0) e_.acquire(d, id_.mem_lent, 1);
      grad_ready_[static_cast<size_t>(u)] = d;
    }
    after(reached[static_cast<size_t>(t.after_op)], d);
    last_d2h_ = d;
    return d;
  }

  // Data parallelism: the unit's final gradient summed over the ranks on the D2H lane, after its
  // copy (the executor's gradient thread does both), before its update.
  void gradient_sum(int32_t u) {
    const double bytes = 4 * numel(u);
    const CostModel::Collective c = cost_.gradient_sum(bytes);
    TaskId g = task(Lane::kD2H, c.time_s, SpanKind::kGradSum, u, -1, ceil_i(bytes));
    if (c.time_s > 0) use_pool(g, id_.pool_host, c.host_bytes / c.time_s);
    use_pool(g, id_.pool_cores, 1.0);  // the gradient thread
    after(grad_ready_[static_cast<size_t>(u)], g);
    grad_ready_[static_cast<size_t>(u)] = g;
    last_d2h_ = g;
  }

  double nvme_bytes(int32_t u) const {
    return (s_.states_nvme ? numel(u) * state_pp_ : 0) + (s_.master_nvme ? 4 * numel(u) : 0);
  }
  TaskId nvme_read(int32_t u) {
    const double bytes = nvme_bytes(u);
    TaskId read = task(Lane::kNvmeRead, cost_.nvme_read_time(bytes), SpanKind::kNvmeRead, u, -1, ceil_i(bytes));
    use_pool(read, id_.pool_nvme, 1.0);
    use_pool(read, id_.pool_host, bytes / std::max(1e-12, cost_.nvme_read_time(bytes)));
    e_.acquire(read, id_.mem_staging, 1);
    after(nvme_write_prev_[static_cast<size_t>(u)], read);
    return read;
  }

  // AdamW of unit u once its gradient is final (and, with clipping, after the norm), then the
  // NVMe write-back.
  void optimizer(int32_t u, TaskId norm) {
    // Sharded states: each rank updates its own tensors, about 1/N of every unit on average (1/R of
    // the node's ranks with a shared host state).
    const double p = numel(u) / static_cast<double>(cost_.update_share());
    const double work = cost_.adam_time(p);
    TaskId a = task(Lane::kOptimizer, work, SpanKind::kOptimizer, u, -1, 0);
    const double touched = p * (tb_ + 4 + 2 * state_pp_ + 4 + (tb_ < 4 ? tb_ : 0));
    use_pool(a, id_.pool_host, touched / std::max(1e-12, work));
    use_pool(a, id_.pool_cores, static_cast<double>(cost_.optimizer_threads()));
    after(grad_ready_[static_cast<size_t>(u)], a);
    after(norm, a);
    after(nvme_read_[static_cast<size_t>(u)], a);
    if (s_.lent_gradients > 0 && !shared_) e_.release(a, id_.mem_lent, 1);
    if (sharded_) {  // the new weights from their owners (master, and the bf16 copy), before the next load
      const double bytes = numel(u) * (4 + (tb_ < 4 ? tb_ : 0));
      const CostModel::Collective c = cost_.weight_gather(bytes);
      TaskId g = task(Lane::kOptimizer, c.time_s, SpanKind::kWeightGather, u, -1, ceil_i(bytes));
      if (c.time_s > 0) use_pool(g, id_.pool_host, c.host_bytes / c.time_s);
      after(a, g);
      a = g;
    }
    if (nvme_read_[static_cast<size_t>(u)] >= 0) {
      const double bytes = nvme_bytes(u);
      TaskId w = task(Lane::kNvmeWrite, cost_.nvme_write_time(bytes), SpanKind::kNvmeWrite, u, -1, ceil_i(bytes));
      use_pool(w, id_.pool_nvme, 1.0);
      use_pool(w, id_.pool_host, bytes / std::max(1e-12, cost_.nvme_write_time(bytes)));
      after(a, w);
      e_.release(w, id_.mem_staging, 1);
      nvme_write_prev_[static_cast<size_t>(u)] = w;
    }
    adam_prev_[static_cast<size_t>(u)] = a;
  }

  const CostModel& cost_;
  const step::StepSchedule& s_;
  Engine& e_;
  const Ids& id_;
  int32_t step_ = 0;
  TaskId last_gpu_ = -1, last_h2d_ = -1, last_d2h_ = -1;
  std::vector<double> layer_flops_;  // per decoder layer, one micro-batch's forward
  double head_flops_ = 0, tb_ = 2, state_pp_ = 8;
  bool sharded_ = false, shared_ = false;
  std::vector<TaskId> adam_prev_, prev_update_, nvme_write_prev_, grad_ready_, nvme_read_;
  std::vector<int32_t> carried_;  // the slots the next round's first loads fill
};

}  // namespace

Result<SimResult> simulate(const Plan& plan, const SimOptions& options) {
  MT_ASSIGN_OR_RETURN(ModelSpec model, plan.resolve_model());
  MT_ASSIGN_OR_RETURN(HardwareProfile rig, plan.resolve_rig());
  return simulate(plan, model, rig, options);
}

Result<SimResult> simulate(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig,
                           const SimOptions& options) {
  if (options.steps < 2) return invalid_argument("simulate: steps must be >= 2 (the second step is the steady state)");
  CostModel cost(plan, model, rig);
  SimResult res;
  res.assumptions = cost.assumptions();
  auto refuse = [&](std::string why) {
    res.feasible = false;
    res.reason = std::move(why);
    return res;
  };
  const int64_t N = plan.parallel.data_parallel, R = plan.parallel.ranks_per_node;
  if (plan.parallel.collective == "nccl" && step::backend_of_rig(rig) == step::BackendKind::kCpu)  // as megatrain-exec refuses it
    return refuse("parallel.collective nccl sums the gradients between GPUs, and rig '" + rig.name +
                  "' is the CPU backend's; accepted on it: parallel.collective mpi");
  if (N > 1 && !rig.cluster)  // a rig of one GPU: one rank's step, without the others
    res.assumptions.push_back("parallel: one rank's step of " + std::to_string(N) +
                              " is simulated alone (step time and memory are one rank's, tokens/s the job's); the rig has no "
                              "cluster section, so the ranks' collectives and their sharing of one host are not modelled");
  if (N > 1 && rig.cluster) {
    if (R > rig.gpus_per_node())
      return refuse("the plan puts " + std::to_string(R) + " ranks on each node (parallel.ranks_per_node), but the rig's nodes have " +
                    std::to_string(rig.gpus_per_node()) + " GPUs (cluster.gpus_per_node); accepted: ranks_per_node <= " +
                    std::to_string(rig.gpus_per_node()));
    if (N / R > rig.nodes())
      return refuse("the plan needs " + std::to_string(N / R) + " nodes of " + std::to_string(R) + " ranks (parallel.data_parallel " +
                    std::to_string(N) + "), but the rig has " + std::to_string(rig.nodes()) + " (cluster.nodes); accepted: data_parallel <= " +
                    std::to_string(R * rig.nodes()));
    res.assumptions.push_back("parallel: " + std::to_string(N) + " ranks, " + std::to_string(R) + " per node on " + std::to_string(N / R) +
                              " node(s): one rank's step is simulated with 1/" + std::to_string(R) +
                              " of its node's host memory bandwidth, cores, drives, RAM and pinnable memory, its PCIe switch's uplink "
                              "shared, and the collectives as tasks (" +
                              (plan.parallel.collective == "nccl"
                                   ? std::string("NCCL's ring between the GPUs, over ") +
                                         (rig.cluster && rig.cluster->gpu_peer_bandwidth ? "cluster.gpu_peer_bandwidth" : "each GPU's PCIe link")
                                   : std::string("MPI through host memory")) +
                              "); tokens/s and FLOPs are the job's, memory figures one rank's (docs/cost-model.md)");
  }
  // The plan's own rules first (compile calls the function Plan reading and the executor call),
  // then the footprint against the capacities: the same figures the executor allocates.
  const step::ActivationLayout layout = step::layout_for(step::backend_of_rig(rig), model, plan);
  Result<step::StepSchedule> compiled = step::compile(plan, model, layout);
  if (!compiled.ok()) return refuse(compiled.status().message());
  const step::StepSchedule& sched = *compiled;
  step::Footprint fp = step::footprint(sched, layout);
  step::TierCapacity cap = step::capacity_of(plan, rig);
  // capacity_of gives one rank's share of its node, and take_rank_share the rank's part of the state.
  step::take_rank_share(fp, plan, model);
  res.capacity_bytes = {cap.device, cap.pinned, cap.ram, cap.nvme};
  res.peak_bytes = {fp.peak.device, fp.peak.pinned, fp.peak.ram, fp.peak.nvme};
  if (Status fits = step::check_fits(fp, cap); !fits.ok())
    return refuse(N > 1 && rig.cluster ? "one rank's share of its node (1/" + std::to_string(R) + "): " + fits.message() : fits.message());

  // ---- the engine --------------------------------------------------------------------------------
  // Without keep_engine the engine is a per-thread scratch whose arrays keep their capacity
  // between calls: the planner simulates thousands of plans, and fresh memory costs page faults.
  static thread_local Engine scratch;
  std::shared_ptr<Engine> engine;
  if (options.keep_engine) engine = std::make_shared<Engine>();
  else scratch.clear();
  Engine& e = engine ? *engine : scratch;
  Ids id{};
  for (int k = 0; k < kLaneCount; ++k) id.lane[k] = e.add_resource({lane_name(static_cast<Lane>(k)), lane_kind(static_cast<Lane>(k)), 1});
  id.pool_host = e.add_pool({"host memory", rig.host.memory_bandwidth.value});
  if (!rig.links.full_duplex) id.pool_pcie = e.add_pool({"PCIe (half duplex)", 1.0});
  id.pool_nvme = e.add_pool({"NVMe drives", 1.0});
  // The CPU backend's "GPU" is the host's cores: its compute threads, its copy threads and the
  // optimizer's threads run on them at once, each measured alone, so that work overlapping the
  // compute slows it as the cores' time is shared (docs/cost-model.md, "The CPU backend's cores").
  if (step::backend_of_rig(rig) == step::BackendKind::kCpu)
    id.pool_cores = e.add_pool({"CPU cores", static_cast<double>(cost.rank_cores())});
  // The device arena is carved once at start-up; what the pipeline waits for are its buffers.
  id.mem_device = e.add_memory({"device", cap.device, true});
  e.preallocate(id.mem_device, fp.peak.device);
  for (int32_t k = 0; k < sched.B; ++k) {
    const int32_t m = e.add_memory({"device layer buffer " + std::to_string(k), 1, false});
    if (k == 0) id.mem_slot0 = m;
  }
  for (int64_t k = 0; k < sched.buffers.grad_sets; ++k) {
    const int32_t m = e.add_memory({"gradient accumulator " + std::to_string(k), 1, false});
    if (k == 0) id.mem_accumulator0 = m;
  }
  id.mem_lent = e.add_memory({"lent host gradients", std::max(1, sched.lent_gradients), false});
  id.mem_staging = e.add_memory({"NVMe staging buffers", std::max(1, sched.staging_buffers), false});

  {
    const size_t per_step = sched.round.compute.size() * static_cast<size_t>(sched.rounds) + 4 * static_cast<size_t>(sched.U);
    const auto steps = static_cast<size_t>(options.steps);
    e.reserve(per_step * steps, 3 * per_step * steps, 2 * per_step * steps);
  }
  Builder b(plan, model, cost, sched, e, id);
  for (int32_t step = 0; step < options.steps; ++step) b.build_step(step);
  Status run = e.run();
  if (!run.ok()) {
    if (run.code() == StatusCode::kResourceExhausted) return refuse(run.message());
    return run;
  }

  // ---- the steady-state step ---------------------------------------------------------------------
  // The period is measured between the ends of consecutive steps' GPU work: a step's optimizer
  // and write-back tail overlaps the next step, so it belongs to the period only where the next
  // step's GPU work waits for it.
  std::vector<double> step_end(static_cast<size_t>(options.steps), 0.0);
  const int32_t gpu_lane = id.lane[static_cast<int>(Lane::kCompute)];
  for (TaskId t : e.queue(gpu_lane)) {
    const auto st = static_cast<size_t>(e.task(t).step);
    step_end[st] = std::max(step_end[st], e.times(t).end);
  }
  const int32_t last = options.steps - 1;
  const double t0 = step_end[static_cast<size_t>(last - 1)], t1 = step_end[static_cast<size_t>(last)];
  res.step_start_s = t0;
  res.step_time_s = t1 - t0;
  res.simulated_s = e.makespan();
  res.tasks = static_cast<int64_t>(e.task_count());
  res.ranks = N;
  res.tokens_per_step = static_cast<double>(sched.tokens_per_mb) * sched.A * static_cast<double>(N);  // the job's
  res.flops_per_step = model.flops_per_token(plan.training.seq_len, plan.training.attention_span()).training() * res.tokens_per_step;
  {
    double per_round = 0;
    for (int32_t u : sched.round.loads) per_round += static_cast<double>(sched.unit_numel[static_cast<size_t>(u)]);
    res.weight_bytes_per_step = per_round * sched.rounds * (sched.transfer_bf16 ? 2 : 4);
    double grads = 0;
    for (const step::Op& op : sched.round.compute)
      if (op.kind == step::OpKind::kGradFinal) grads += 4.0 * static_cast<double>(sched.unit_numel[static_cast<size_t>(op.layer)]);
    res.gradient_bytes_per_step = grads * sched.rounds;
  }
  if (res.step_time_s > 0) {
    res.tokens_per_s = res.tokens_per_step / res.step_time_s;
    res.tflops = res.flops_per_step / res.step_time_s / 1e12;
    res.mfu = res.flops_per_step / static_cast<double>(N) / res.step_time_s / cost.matmul_peak();  // per GPU
  }

  // Busy fractions and GPU stalls inside [t0, t1).
  std::vector<double> busy(e.resources().size(), 0.0);
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskTimes& tt = e.times(static_cast<TaskId>(t));
    const double ov = std::min(tt.end, t1) - std::max(tt.start, t0);
    if (ov > 0) busy[static_cast<size_t>(e.task(static_cast<TaskId>(t)).resource)] += ov;
  }
  for (size_t r = 0; r < busy.size(); ++r)
    res.busy[lane_bottleneck(static_cast<Lane>(r))] =
        res.step_time_s > 0 ? busy[r] / res.step_time_s / e.resources()[r].capacity : 0;
  // Host memory: bytes the DMA engines and the CPU moved in the step over what it can move.
  {
    double bytes = 0;
    for (size_t t = 0; t < e.task_count(); ++t) {
      const TaskSpec& ts = e.task(static_cast<TaskId>(t));
      const TaskTimes& tt = e.times(static_cast<TaskId>(t));
      const double len = tt.end - tt.start;
      const double ov = std::min(tt.end, t1) - std::max(tt.start, t0);
      if (len <= 0 || ov <= 0) continue;
      for (int k = 0; k < kTaskPools; ++k)
        if (ts.pool[k] == id.pool_host) bytes += ts.demand[k] * ts.work_s * ov / len;
    }
    res.busy["host_memory"] = res.step_time_s > 0 ? bytes / rig.host.memory_bandwidth.value / res.step_time_s : 0;
  }
  double prev_end = -1;
  for (TaskId t : e.queue(gpu_lane)) {
    const TaskTimes& tt = e.times(t);
    if (prev_end >= 0) {
      const double gap = std::min(tt.start, t1) - std::max(prev_end, t0);
      if (gap > 1e-12) res.stalls[detail::stall_reason(e, t)] += gap;
    }
    prev_end = tt.end;
  }
  // Transfers that waited for a free device buffer.
  for (TaskId t : e.queue(id.lane[static_cast<int>(Lane::kH2D)])) {
    const TaskTimes& tt = e.times(t);
    const double w = std::min(tt.start, t1) - std::max(tt.ready, t0);
    if (w > 1e-12) res.stalls["buffer"] += w;
  }

  // Critical path: walk back from the step's last task through whatever held each task back.
  {
    TaskId cur = -1;
    double latest = -1;
    for (TaskId t : e.queue(gpu_lane))
      if (e.task(t).step == last && e.times(t).end > latest) {
        latest = e.times(t).end;
        cur = t;
      }
    // Queue predecessor of each task on its resource.
    std::vector<TaskId> qprev(e.task_count(), -1);
    for (size_t r = 0; r < e.resources().size(); ++r) {
      const auto& q = e.queue(static_cast<int32_t>(r));
      for (size_t i = 1; i < q.size(); ++i) qprev[static_cast<size_t>(q[i])] = q[i - 1];
    }
    while (cur >= 0) {
      const TaskTimes& tt = e.times(cur);
      const TaskSpec& ts = e.task(cur);
      const double seg_end = std::min(tt.end, t1), seg_start = std::max(tt.start, t0);
      if (seg_end > seg_start) {
        // Time lost to host-memory sharing is host memory's; time lost to sharing a drive or a
        // half-duplex link stays with the task's own resource.
        const double dur = seg_end - seg_start;
        const double len = tt.end - tt.start;
        double host_share = 0;
        for (int k = 0; k < kTaskPools; ++k)
          if (ts.pool[k] == id.pool_host && len > 0) host_share += tt.slowed_s[k] / len;
        host_share = std::min(1.0, host_share);
        res.critical_path[lane_bottleneck(static_cast<Lane>(ts.resource))] += dur * (1 - host_share);
        if (host_share > 0) res.critical_path["host_memory"] += dur * host_share;
      }
      if (tt.start <= t0) break;
      const TaskId d = tt.binding, q = qprev[static_cast<size_t>(cur)];
      const double dend = d >= 0 ? e.times(d).end : -1, qend = q >= 0 ? e.times(q).end : -1;
      if (tt.start > std::max(dend, qend) + 1e-12) {
        // It waited for a buffer: the path goes on through the task whose release freed it (an NVMe
        // write freeing a staging buffer, a copy freeing a slot), so the drive or the link that holds
        // the buffers is what the step waits for. Unknown releaser: the wait is memory_wait.
        const TaskId m = tt.memory_binding;
        if (m >= 0 && e.times(m).end > std::max(dend, qend) + 1e-12) {
          cur = m;
          continue;
        }
        res.critical_path["memory_wait"] += std::min(tt.start, t1) - std::max(std::max(dend, qend), t0);
      }
      cur = dend >= qend ? d : q;
    }
    double best = 0;
    res.bottleneck = "none";
    for (const auto& [k, v] : res.critical_path)
      if (k != "memory_wait" && v > best) {
        best = v;
        res.bottleneck = k;
      }
  }

  if (options.keep_engine) res.engine = engine;
  return res;
}

}  // namespace megatrain::sim

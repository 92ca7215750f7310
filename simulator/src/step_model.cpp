// Compiles a plan into the task graph of the executor's schedule (layer-major or
// microbatch-major), runs it on the Engine, and measures the steady-state step.
#include "megatrain/simulator/step_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "detail/stall.h"
#include "megatrain/core/units.h"

namespace megatrain::sim {
namespace {

// CUDA context, cuBLAS workspaces and allocator slack kept out of the device budget: 1 GiB, or
// 1/16 of a small budget (the CPU backend has no CUDA context).
constexpr int64_t kDeviceReserveBytes = int64_t{1} << 30;
int64_t device_reserve(double budget) { return std::min<int64_t>(kDeviceReserveBytes, static_cast<int64_t>(budget / 16)); }

int64_t ceil_i(double v) { return static_cast<int64_t>(std::ceil(v - 1e-9)); }

// Everything the builder needs, computed once.
struct Shape {
  int64_t L = 0, A = 0, T = 0, H = 0, V = 0;
  int64_t c = 1;             // checkpoint interval (0 = keep all activations)
  bool layer_major = true;
  bool clip = false;
  bool master_nvme = false, states_nvme = false;
  bool stream_from_nvme = false;  // fp32 transfer of NVMe-resident master weights
  double cb = 2, tb = 2;
  std::vector<int64_t> params;    // per unit: 0 embed, 1..L layers, L+1 head (updated parameters)
  std::vector<int64_t> streamed;  // per unit: parameters sent to the device
  std::vector<int64_t> grad;      // per unit: gradient elements sent to the host (the head's
                                  // includes a tied embedding's share)
  bool tied = false;
  int64_t full_act = 0;           // bytes of one layer's kept activations for one micro-batch
  int64_t hidden = 0;             // bytes of one micro-batch's hidden state
  double state_pp = 8;            // bytes of m + v per parameter
};

struct Ids {
  int32_t gpu, h2d, d2h, cpu, nvme_r, nvme_w;
  int32_t pool_host = -1, pool_pcie = -1, pool_nvme = -1;
  int32_t mem_device, mem_slots, mem_staging;
};

class Builder {
 public:
  Builder(const Plan& plan, const ModelSpec& model, const CostModel& cost, const Shape& shape, Engine& e, const Ids& ids)
      : plan_(plan), model_(model), cost_(cost), s_(shape), e_(e), id_(ids) {
    const size_t units = static_cast<size_t>(s_.L + 2);
    const size_t cells = units * static_cast<size_t>(s_.A);
    kept_.assign(cells, 0);
    ckpt_device_.assign(cells, 0);
    ckpt_d2h_.assign(cells, -1);
    ckpt_copy_.assign(cells, -1);
    uses_.assign(units, {});
    pass_unit_index_.assign(units, 0);
    producer_.assign(static_cast<size_t>(s_.A), -1);
    adam_prev_.assign(units, -1);
    nvme_write_prev_.assign(units, -1);
    const FlopsPerToken f = model.flops_per_token(plan.training.seq_len);
    layer_flops_ = f.layer_forward;
    head_flops_ = f.head_forward;
  }

  void build_step(int32_t step) {
    step_ = step;
    grad_ready_.assign(static_cast<size_t>(s_.L + 2), -1);
    accum_prev_.assign(static_cast<size_t>(s_.L + 2), -1);
    if (s_.layer_major) {
      forward_pass(-1);
      backward_pass(-1);
    } else {
      for (int32_t mb = 0; mb < s_.A; ++mb) {
        forward_pass(mb);
        backward_pass(mb);
      }
    }
    optimizer();
  }

 private:
  // ---- helpers --------------------------------------------------------------------------------
  TaskId task(int32_t resource, double work, int16_t kind, int32_t layer, int32_t mb, int64_t bytes = 0,
              double flops = 0) {
    TaskSpec t;
    t.resource = resource;
    t.work_s = work;
    t.kind = kind;
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
    for (int k = 0; k < 2; ++k) {
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
  }
  void after(TaskId before, TaskId t) { e_.add_dependency(before, t); }
  TaskId gpu(double work, int16_t kind, int32_t layer, int32_t mb, double flops) {
    TaskId t = task(id_.gpu, work, kind, layer, mb, 0, flops);
    if (last_gpu_ >= 0) after(last_gpu_, t);  // the compute stream is in order; explicit for the critical path
    gpu_order_.push_back(t);
    last_gpu_ = t;
    return t;
  }

  // ---- weights streaming ------------------------------------------------------------------------
  // A pass: units in first-use order; each H2D may run at most K units ahead of the computing unit.
  struct PassUnit {
    int32_t unit;
    TaskId h2d = -1;
    size_t first_gpu_index = 0;  // index into gpu_order_ of the first task using the unit
    TaskId last_use = -1;
  };

  TaskId stream_in(std::vector<PassUnit>& pass, size_t i) {
    const int32_t u = pass[i].unit;
    const double bytes = static_cast<double>(s_.streamed[static_cast<size_t>(u)]) * s_.tb;
    TaskId read = -1;
    if (s_.stream_from_nvme) {  // fp32 master on NVMe: read into pinned staging, then DMA
      read = task(id_.nvme_r, cost_.nvme_read_time(bytes), kNvmeRead, u, -1, ceil_i(bytes));
      use_pool(read, id_.pool_nvme, 1.0);
      use_pool(read, id_.pool_host, bytes / std::max(1e-12, cost_.nvme_read_time(bytes)));
      e_.acquire(read, id_.mem_staging, ceil_i(bytes));
      window_dependency(pass, i, read, static_cast<size_t>(plan_.schedule.prefetch_depth) + 1);
    }
    TaskId h = task(id_.h2d, cost_.h2d_time(bytes), kH2DWeights, u, -1, ceil_i(bytes));
    dma(h, bytes, cost_.h2d_time(bytes));
    e_.acquire(h, id_.mem_slots, 1);  // the slot's bytes are carved at start-up (device_static)
    if (read >= 0) {
      after(read, h);
      e_.release(h, id_.mem_staging, ceil_i(bytes));
    }
    after(adam_prev_[static_cast<size_t>(u)], h);  // the next step streams the updated weights
    window_dependency(pass, i, h, static_cast<size_t>(plan_.schedule.prefetch_depth));
    pass[i].h2d = h;
    return h;
  }

  // Task `t` for pass position i may start once the GPU has begun the unit K positions earlier,
  // i.e. once the GPU task just before that unit's first use has ended.
  void window_dependency(const std::vector<PassUnit>& pass, size_t i, TaskId t, size_t K) {
    if (i < K) return;
    const size_t j = i - K;
    if (j >= pass.size()) return;
    const size_t gi = pass[j].first_gpu_index;
    if (gi == 0 || gi > gpu_order_.size()) return;
    pending_window_.push_back({t, gi - 1});
  }

  // Window dependencies refer to GPU tasks that exist only after the pass's GPU tasks are built.
  void resolve_windows() {
    for (auto [t, gi] : pending_window_)
      if (gi < gpu_order_.size()) after(gpu_order_[gi], t);
    pending_window_.clear();
  }

  // Builds a pass: `units` in first-use order and a callback that emits their GPU tasks. The
  // H2D queue is in order, so its tasks (weights and checkpoint restores) are created afterwards,
  // sorted by the GPU task that first needs them: that is the order the executor issues them.
  template <typename EmitGpu>
  void run_pass(std::vector<int32_t> units, EmitGpu emit) {
    std::vector<PassUnit> pass;
    for (int32_t u : units) pass.push_back(PassUnit{u});
    for (size_t i = 0; i < pass.size(); ++i) {
      pass[i].first_gpu_index = gpu_order_.size();
      pass_unit_index_[static_cast<size_t>(pass[i].unit)] = i;
    }
    pass_ = &pass;
    emit();
    pass_ = nullptr;
    struct Request {
      size_t needed_at;
      int priority;  // weights before a checkpoint needed by the same GPU task
      size_t index;
    };
    std::vector<Request> requests;
    for (size_t i = 0; i < pass.size(); ++i) requests.push_back({pass[i].first_gpu_index, 0, i});
    for (size_t k = 0; k < restores_.size(); ++k) requests.push_back({restores_[k].needed_at, 1, k});
    std::stable_sort(requests.begin(), requests.end(), [](const Request& a, const Request& b) {
      return a.needed_at != b.needed_at ? a.needed_at < b.needed_at : a.priority < b.priority;
    });
    for (const Request& r : requests) {
      if (r.priority == 1) {
        restores_[r.index].create();
        continue;
      }
      const size_t i = r.index;
      TaskId h = stream_in(pass, i);
      for (TaskId g : uses_[static_cast<size_t>(pass[i].unit)]) after(h, g);
      if (pass[i].last_use >= 0) {
        e_.release(pass[i].last_use, id_.mem_slots, 1);
      }
    }
    restores_.clear();
    resolve_windows();
    for (const PassUnit& pu : pass) uses_[static_cast<size_t>(pu.unit)].clear();
  }

  // Records that GPU task g uses unit u's weights in the current pass.
  void uses(int32_t u, TaskId g) {
    auto& pass = *pass_;
    const size_t i = pass_unit_index_[static_cast<size_t>(u)];
    auto& used = uses_[static_cast<size_t>(u)];
    if (used.empty()) pass[i].first_gpu_index = gpu_order_.size() - 1;
    used.push_back(g);
    pass[i].last_use = g;
  }

  // ---- forward ----------------------------------------------------------------------------------
  void forward_pass(int32_t only_mb) {
    const int32_t L = static_cast<int32_t>(s_.L);
    std::vector<int32_t> units;
    for (int32_t u = 0; u <= L + 1; ++u) units.push_back(u);
    const auto mbs = micro_batches(only_mb);
    run_pass(units, [&] {
      const double T = static_cast<double>(s_.T);
      for (int32_t mb : mbs) {
        TaskId g = gpu(cost_.embed_forward_time(), kEmbedForward, 0, mb, 0);
        uses(0, g);
        producer_[static_cast<size_t>(mb)] = g;
      }
      for (int32_t l = 1; l <= L; ++l) {
        const bool ckpt = s_.c > 0 && (l - 1) % s_.c == 0;
        for (int32_t mb : mbs) {
          TaskId g = gpu(cost_.layer_forward_time(), kForward, l, mb, T * layer_flops_);
          uses(l, g);
          // Ping-pong hidden buffers: this layer overwrites the previous layer's input, so a
          // checkpoint copy of that input must have finished.
          if (TaskId& d = ckpt_d2h_[cell(l - 1, mb)]; d >= 0) {
            after(d, g);
            d = -1;
          }
          // Kept activations: transient with recompute, held until backward without it.
          if (s_.c > 0) {
            e_.acquire(g, id_.mem_device, s_.full_act);
            e_.release(g, id_.mem_device, s_.full_act);
          } else {
            e_.acquire(g, id_.mem_device, s_.full_act);
            kept_[cell(l, mb)] = s_.full_act;
          }
          if (ckpt) checkpoint(l, mb);
          producer_[static_cast<size_t>(mb)] = g;
        }
      }
      for (int32_t mb : mbs) {
        const double flops = T * 3 * head_flops_;
        TaskId g = gpu(cost_.head_time(), kHead, L + 1, mb, flops);
        uses(L + 1, g);
        const int64_t logits = static_cast<int64_t>(4 * T * static_cast<double>(s_.V));
        e_.acquire(g, id_.mem_device, logits);
        e_.release(g, id_.mem_device, logits);
        gradient_produced(L + 1, mb, g, mb == mbs.front(), mb == mbs.back());
      }
    });
  }

  // The input of layer l for micro-batch mb (produced by the previous GPU task for mb) is kept:
  // on the device until backward recomputes from it, or copied to pinned host memory.
  void checkpoint(int32_t l, int32_t mb) {
    const TaskId producer = producer_[static_cast<size_t>(mb)];
    if (plan_.schedule.checkpoint_location == CheckpointLocation::kDevice) {
      e_.acquire(producer, id_.mem_device, s_.hidden);
      ckpt_device_[cell(l, mb)] = 1;
      return;
    }
    const double bytes = static_cast<double>(s_.hidden);
    TaskId d = task(id_.d2h, cost_.d2h_time(bytes), kD2HCheckpoint, l, mb, s_.hidden);
    dma(d, bytes, cost_.d2h_time(bytes));
    after(producer, d);
    ckpt_d2h_[cell(l, mb)] = d;
    ckpt_copy_[cell(l, mb)] = d;
  }

  // ---- backward ---------------------------------------------------------------------------------
  void backward_pass(int32_t only_mb) {
    const int32_t L = static_cast<int32_t>(s_.L);
    const auto mbs = micro_batches(only_mb);
    // Blocks of c layers from the last; with c == 0 every layer is its own block, no recompute.
    std::vector<std::pair<int32_t, int32_t>> blocks;
    const int32_t c = s_.c > 0 ? static_cast<int32_t>(s_.c) : 1;
    for (int32_t lo = 1; lo <= L; lo += c) blocks.push_back({lo, std::min(L, lo + c - 1)});
    std::reverse(blocks.begin(), blocks.end());
    std::vector<int32_t> units;
    for (auto [lo, hi] : blocks) {
      if (s_.c > 0)
        for (int32_t l = lo; l <= hi; ++l) units.push_back(l);
      else
        for (int32_t l = hi; l >= lo; --l) units.push_back(l);
    }
    const double T = static_cast<double>(s_.T);
    const double layer_flops = T * layer_flops_;
    run_pass(units, [&] {
      for (auto [lo, hi] : blocks) {
        for (int32_t mb : mbs) {
          if (s_.c > 0) {
            restore_checkpoint(lo, mb);
            for (int32_t l = lo; l <= hi; ++l) {
              TaskId g = gpu(cost_.layer_forward_time(), kRecompute, l, mb, layer_flops);
              uses(l, g);
              e_.acquire(g, id_.mem_device, s_.full_act);
              kept_[cell(l, mb)] = s_.full_act;
              if (l == lo) release_checkpoint(lo, mb, g);
            }
          }
          for (int32_t l = hi; l >= lo; --l) {
            TaskId g = gpu(cost_.layer_backward_time(), kBackward, l, mb, 2 * layer_flops);
            uses(l, g);
            if (int64_t& k = kept_[cell(l, mb)]; k > 0) {
              e_.release(g, id_.mem_device, k);
              k = 0;
            }
            gradient_produced(l, mb, g, mb == mbs.front(), mb == mbs.back());
          }
        }
      }
      for (int32_t mb : mbs) {
        TaskId g = gpu(cost_.embed_backward_time(), kEmbedBackward, 0, mb, 0);
        gradient_produced(0, mb, g, mb == mbs.front(), mb == mbs.back());
      }
    });
    std::fill(ckpt_d2h_.begin(), ckpt_d2h_.end(), -1);
  }

  // Registers the H2D of a host checkpoint, needed by the next GPU task (the block's first
  // recompute); the task itself is created in issue order by run_pass.
  void restore_checkpoint(int32_t lo, int32_t mb) {
    if (plan_.schedule.checkpoint_location == CheckpointLocation::kDevice) return;
    const size_t needed_at = gpu_order_.size();
    restores_.push_back({needed_at, [this, lo, mb, needed_at] {
      const double bytes = static_cast<double>(s_.hidden);
      TaskId h = task(id_.h2d, cost_.h2d_time(bytes), kH2DCheckpoint, lo, mb, s_.hidden);
      dma(h, bytes, cost_.h2d_time(bytes));
      e_.acquire(h, id_.mem_device, s_.hidden);
      after(ckpt_copy_[cell(lo, mb)], h);  // it reads what the forward's copy wrote
      after(h, gpu_order_[needed_at]);
    }});
  }

  void release_checkpoint(int32_t lo, int32_t mb, TaskId recompute) {
    if (plan_.schedule.checkpoint_location == CheckpointLocation::kDevice) {
      if (uint8_t& held = ckpt_device_[cell(lo, mb)]; held) {
        e_.release(recompute, id_.mem_device, s_.hidden);
        held = 0;
      }
    } else {
      e_.release(recompute, id_.mem_device, s_.hidden);
    }
  }

  // The gradient of unit u from GPU task g: accumulated on the device over micro-batches
  // (layer-major) and sent to the host once, or sent per micro-batch and summed on the host.
  void gradient_produced(int32_t u, int32_t mb, TaskId g, bool first, bool last) {
    const double p = static_cast<double>(s_.grad[static_cast<size_t>(u)]);
    const int64_t accum = ceil_i(4 * p);
    if (s_.layer_major) {
      if (first) e_.acquire(g, id_.mem_device, accum);
      if (!last) return;
    } else {
      e_.acquire(g, id_.mem_device, accum);
    }
    const double bytes = 4 * p;  // the executor copies fp32 gradients back
    TaskId d = task(id_.d2h, cost_.d2h_time(bytes), kD2HGradients, u, s_.layer_major ? -1 : mb, ceil_i(bytes));
    dma(d, bytes, cost_.d2h_time(bytes));
    after(g, d);
    e_.release(d, id_.mem_device, accum);
    if (!s_.layer_major) {
      // Sum into the fp32 host accumulator; the slab is reused by the next micro-batch's copy.
      after(accum_prev_[static_cast<size_t>(u)], d);
      const double pass_bytes = p * (s_.tb + 4 + 4);
      TaskId a = task(id_.cpu, cost_.host_pass_time(pass_bytes), kGradAccumulate, u, mb, ceil_i(pass_bytes));
      use_pool(a, id_.pool_host, pass_bytes / std::max(1e-12, cost_.host_pass_time(pass_bytes)));
      after(d, a);
      accum_prev_[static_cast<size_t>(u)] = a;
      d = a;
      if (mb != s_.A - 1) return;
    }
    grad_ready_[static_cast<size_t>(u)] = d;
    grad_order_.push_back(u);
  }

  // ---- optimizer --------------------------------------------------------------------------------
  void optimizer() {
    // With clipping every update waits for the global norm (one pass over each gradient as it
    // arrives); updates then run in the next forward's order so it can start soonest.
    std::vector<int32_t> order = grad_order_;
    TaskId norm_done = -1;
    if (s_.clip) {
      for (int32_t u : grad_order_) {
        const double bytes = static_cast<double>(s_.grad[static_cast<size_t>(u)]) * (s_.layer_major ? s_.tb : 4);
        TaskId n = task(id_.cpu, cost_.host_pass_time(bytes), kGradNorm, u, -1, ceil_i(bytes));
        use_pool(n, id_.pool_host, bytes / std::max(1e-12, cost_.host_pass_time(bytes)));
        after(grad_ready_[static_cast<size_t>(u)], n);
        norm_done = n;
      }
      std::sort(order.begin(), order.end());
    }
    const double state_bytes_pp = s_.state_pp;
    for (int32_t u : order) {
      const double p = static_cast<double>(s_.params[static_cast<size_t>(u)]);
      TaskId read = -1;
      double nvme_bytes = 0;
      if (s_.states_nvme) nvme_bytes += p * state_bytes_pp;
      if (s_.master_nvme) nvme_bytes += 4 * p;
      if (nvme_bytes > 0) {
        read = task(id_.nvme_r, cost_.nvme_read_time(nvme_bytes), kNvmeRead, u, -1, ceil_i(nvme_bytes));
        use_pool(read, id_.pool_nvme, 1.0);
        use_pool(read, id_.pool_host, nvme_bytes / std::max(1e-12, cost_.nvme_read_time(nvme_bytes)));
        e_.acquire(read, id_.mem_staging, ceil_i(nvme_bytes));
        after(nvme_write_prev_[static_cast<size_t>(u)], read);
      }
      const double work = cost_.adam_time(p);
      TaskId a = task(id_.cpu, work, kOptimizer, u, -1, 0);
      const double touched = p * (s_.tb + 4 + 2 * state_bytes_pp + 4 + (s_.tb < 4 ? s_.tb : 0));
      use_pool(a, id_.pool_host, touched / std::max(1e-12, work));
      after(grad_ready_[static_cast<size_t>(u)], a);
      after(norm_done, a);
      after(read, a);
      if (u == 0 && s_.tied) after(grad_ready_[static_cast<size_t>(s_.L + 1)], a);  // both halves of the shared table
      if (nvme_bytes > 0) {
        TaskId w = task(id_.nvme_w, cost_.nvme_write_time(nvme_bytes), kNvmeWrite, u, -1, ceil_i(nvme_bytes));
        use_pool(w, id_.pool_nvme, 1.0);
        use_pool(w, id_.pool_host, nvme_bytes / std::max(1e-12, cost_.nvme_write_time(nvme_bytes)));
        after(a, w);
        e_.release(w, id_.mem_staging, ceil_i(nvme_bytes));
        nvme_write_prev_[static_cast<size_t>(u)] = w;
      }
      adam_prev_[static_cast<size_t>(u)] = a;
    }
    grad_order_.clear();
  }

  std::vector<int32_t> micro_batches(int32_t only_mb) const {
    std::vector<int32_t> v;
    if (only_mb >= 0) {
      v.push_back(only_mb);
    } else {
      for (int32_t mb = 0; mb < s_.A; ++mb) v.push_back(mb);
    }
    return v;
  }

  const Plan& plan_;
  const ModelSpec& model_;
  const CostModel& cost_;
  const Shape& s_;
  Engine& e_;
  const Ids& id_;
  int32_t step_ = 0;
  TaskId last_gpu_ = -1;
  std::vector<TaskId> gpu_order_;
  std::vector<std::pair<TaskId, size_t>> pending_window_;
  std::vector<PassUnit>* pass_ = nullptr;
  // Flat per-unit and per-(layer, micro-batch) state; maps cost more than the simulation itself.
  size_t cell(int32_t l, int32_t mb) const { return static_cast<size_t>(l) * static_cast<size_t>(s_.A) + static_cast<size_t>(mb); }
  std::vector<size_t> pass_unit_index_;
  std::vector<std::vector<TaskId>> uses_;
  std::vector<TaskId> producer_;
  std::vector<int64_t> kept_;
  std::vector<uint8_t> ckpt_device_;
  std::vector<TaskId> ckpt_d2h_;
  std::vector<TaskId> ckpt_copy_;  // the D2H that wrote each host checkpoint, for its restore
  struct Restore {
    size_t needed_at;
    std::function<void()> create;
  };
  std::vector<Restore> restores_;
  double layer_flops_ = 0, head_flops_ = 0;
  std::vector<TaskId> adam_prev_, nvme_write_prev_, grad_ready_, accum_prev_;
  std::vector<int32_t> grad_order_;
};

std::string over(const std::string& tier, double need, double have) {
  return tier + " needs " + format_bytes(need) + " (" + std::to_string(ceil_i(need)) + " bytes) but has " +
         format_bytes(have) + ": over by " + format_bytes(need - have) + " (" + std::to_string(ceil_i(need - have)) +
         " bytes)";
}

const char* lane_name(int32_t r) {
  static const char* names[] = {"GPU compute", "H2D", "D2H", "CPU optimizer", "NVMe read", "NVMe write"};
  return names[r];
}
const char* bottleneck_of_resource(int32_t r) {
  static const char* names[] = {"gpu", "h2d", "d2h", "cpu", "nvme_read", "nvme_write"};
  return names[r];
}

}  // namespace

const char* task_kind_name(int16_t kind) {
  static const char* names[] = {"forward", "backward", "recompute", "head", "embed_forward", "embed_backward",
                                "h2d", "h2d_checkpoint", "d2h", "d2h_checkpoint", "optimizer", "grad_norm",
                                "grad_accumulate", "nvme_read", "nvme_write"};
  return kind >= 0 && kind < kTaskKindCount ? names[kind] : "?";
}

Result<SimResult> simulate(const Plan& plan, const SimOptions& options) {
  MT_ASSIGN_OR_RETURN(ModelSpec model, plan.resolve_model());
  MT_ASSIGN_OR_RETURN(HardwareProfile rig, plan.resolve_rig());
  return simulate(plan, model, rig, options);
}

Result<SimResult> simulate(const Plan& plan, const ModelSpec& model, const HardwareProfile& rig,
                           const SimOptions& options) {
  if (options.steps < 2) return invalid_argument("simulate: steps must be >= 2 (the second step is the steady state)");
  const ModelConfig& mc = model.config();
  const ParameterCounts pc = model.parameter_counts();
  CostModel cost(plan, model, rig);
  SimResult res;
  res.assumptions = cost.assumptions();

  Shape s;
  s.L = mc.num_layers;
  s.A = plan.training.grad_accum;
  s.T = plan.training.micro_batch * plan.training.seq_len;
  s.H = mc.hidden_size;
  s.V = mc.vocab_size;
  s.c = plan.schedule.checkpoint_every;
  s.layer_major = plan.schedule.order == ScheduleOrder::kLayerMajor;
  s.clip = plan.training.clip_grad_norm > 0;
  s.master_nvme = plan.placement.master_weights == Tier::kNvme;
  s.states_nvme = plan.placement.optimizer_states == Tier::kNvme;
  s.cb = static_cast<double>(dtype_bytes(plan.precision.compute));
  s.tb = static_cast<double>(dtype_bytes(plan.precision.transfer));
  s.stream_from_nvme = s.master_nvme && plan.precision.transfer == DType::kFp32;
  s.tied = mc.tie_word_embeddings;
  s.state_pp = state_format_bytes_per_element(plan.optimizer.m_format, plan.optimizer.block_size) +
               state_format_bytes_per_element(plan.optimizer.v_format, plan.optimizer.block_size);
  const int64_t table = mc.vocab_size * mc.hidden_size;
  s.params.assign(static_cast<size_t>(s.L + 2), pc.per_layer);
  s.params[0] = pc.embedding;
  s.params[static_cast<size_t>(s.L + 1)] = pc.head + pc.final_norm;
  s.streamed = s.params;
  s.streamed[static_cast<size_t>(s.L + 1)] = table + pc.final_norm;  // a tied head still needs the table
  s.grad = s.streamed;
  const ActivationBytes act = model.activation_bytes_per_token_per_layer(plan.training.seq_len, dtype_bytes(plan.precision.compute));
  s.full_act = ceil_i(act.full_flash * static_cast<double>(s.T));
  s.hidden = ceil_i(act.checkpoint * static_cast<double>(s.T));

  // ---- static bytes per tier and the capacities they must fit in ---------------------------------
  const double n = static_cast<double>(pc.total);
  const int64_t a_hidden = s.layer_major ? s.A : 1;
  const int64_t n_ckpt = s.c > 0 ? (s.L + s.c - 1) / s.c : 0;
  const double host_ckpt = plan.schedule.checkpoint_location == CheckpointLocation::kHost ? static_cast<double>(n_ckpt * a_hidden * s.hidden) : 0;
  const double stream_copy = n * s.tb;                 // bf16 copy, or the fp32 master itself
  // The executor's host gradients: one fp32 array per unit, which microbatch-major sums into; in
  // layer-major without clipping, three buffers of the largest unit lent from unit to unit.
  double largest_unit = 0;
  for (int64_t p : s.params) largest_unit = std::max(largest_unit, static_cast<double>(p));
  const double grads = s.layer_major && !s.clip ? 3 * 4 * largest_unit : 4 * n;  // pinned fp32 gradients
  const double staging = static_cast<double>(plan.placement.pinned_staging_bytes);
  double pinned = grads + host_ckpt + staging + (s.tb < 4 || !s.master_nvme ? stream_copy : 0);
  double ram = pinned;
  if (!s.master_nvme && s.tb < 4) ram += 4 * n;        // fp32 master beside the bf16 copy
  if (!s.states_nvme) ram += n * s.state_pp;
  double nvme = (s.master_nvme ? 4 * n : 0) + (s.states_nvme ? n * s.state_pp : 0);
  double nvme_capacity = 0;
  for (const auto& d : rig.storage) nvme_capacity += d.capacity_bytes.value;
  const double device_budget = plan.placement.device_budget_bytes > 0 ? static_cast<double>(plan.placement.device_budget_bytes)
                                                                       : rig.gpu.memory_bytes.value;
  // The layer buffers are carved once, as the executor's arena does: device_layer_buffers slots,
  // each the size of the largest streamed unit in the device's weight dtype.
  double largest_streamed = 0;
  for (int64_t n_u : s.streamed) largest_streamed = std::max(largest_streamed, static_cast<double>(n_u));
  const double slot_bytes = static_cast<double>(plan.schedule.device_layer_buffers) * largest_streamed * std::max(s.cb, s.tb);
  const double device_static =
      static_cast<double>(device_reserve(device_budget)) + 2.0 * static_cast<double>(a_hidden * s.hidden) + slot_bytes;
  res.capacity_bytes = {static_cast<int64_t>(device_budget), static_cast<int64_t>(rig.host.pinnable_bytes.value),
                        static_cast<int64_t>(rig.host.ram_bytes.value), static_cast<int64_t>(nvme_capacity)};
  res.peak_bytes = {ceil_i(device_static), ceil_i(pinned), ceil_i(ram), ceil_i(nvme)};
  auto refuse = [&](std::string why) {
    res.feasible = false;
    res.reason = std::move(why);
    return res;
  };
  // The plan's own rules first (the same function Plan reading and the executor call), then the
  // capacities: a plan built in memory, as the planner builds them, has not been through reading.
  if (Status valid = check_plan_for_model(plan, model); !valid.ok()) return refuse(valid.message());
  if (ram > rig.host.ram_bytes.value) return refuse(over("ram", ram, rig.host.ram_bytes.value));
  if (pinned > rig.host.pinnable_bytes.value) return refuse(over("pinned", pinned, rig.host.pinnable_bytes.value));
  if (nvme > nvme_capacity) return refuse(over("nvme", nvme, nvme_capacity));
  if (device_static > device_budget) return refuse(over("device", device_static, device_budget));
  // The largest single-unit working set must fit beside the static buffers.
  {
    double unit_max = 0;
    for (size_t u = 0; u < s.streamed.size(); ++u)
      unit_max = std::max(unit_max, static_cast<double>(s.streamed[u]) * 4);  // its fp32 gradient accumulator
    const double logits = 4.0 * static_cast<double>(s.T * s.V);
    const double need = device_static + unit_max + std::max(logits, static_cast<double>(s.full_act)) +
                        (s.c == 0 ? static_cast<double>(s.L * a_hidden * s.full_act) : 0);
    if (need > device_budget) return refuse(over("device", need, device_budget));
  }

  // ---- the engine --------------------------------------------------------------------------------
  // Without keep_engine the engine is a per-thread scratch whose arrays keep their capacity
  // between calls: the planner simulates thousands of plans, and fresh memory costs page faults.
  static thread_local Engine scratch;
  std::shared_ptr<Engine> engine;
  if (options.keep_engine) engine = std::make_shared<Engine>();
  else scratch.clear();
  Engine& e = engine ? *engine : scratch;
  Ids id{};
  id.gpu = e.add_resource({lane_name(0), "gpu", 1});
  id.h2d = e.add_resource({lane_name(1), "h2d", 1});
  id.d2h = e.add_resource({lane_name(2), "d2h", 1});
  id.cpu = e.add_resource({lane_name(3), "cpu", 1});
  id.nvme_r = e.add_resource({lane_name(4), "nvme_read", 1});
  id.nvme_w = e.add_resource({lane_name(5), "nvme_write", 1});
  id.pool_host = e.add_pool({"host memory", rig.host.memory_bandwidth.value});
  if (!rig.links.full_duplex) id.pool_pcie = e.add_pool({"PCIe (half duplex)", 1.0});
  id.pool_nvme = e.add_pool({"NVMe drives", 1.0});
  id.mem_device = e.add_memory({"device", static_cast<int64_t>(device_budget), true});
  id.mem_slots = e.add_memory({"device layer buffers", plan.schedule.device_layer_buffers, false});
  id.mem_staging = e.add_memory({"pinned staging", static_cast<int64_t>(staging), true});
  e.preallocate(id.mem_device, ceil_i(device_static));

  {
    // Per step and micro-batch: about three GPU tasks per layer and a few transfers per layer.
    const size_t per_step = static_cast<size_t>((s.L + 2) * (4 * s.A + 8));
    const auto steps = static_cast<size_t>(options.steps);
    e.reserve(per_step * steps, 3 * per_step * steps, 2 * per_step * steps);
  }
  Builder b(plan, model, cost, s, e, id);
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
  for (TaskId t : e.queue(id.gpu)) {
    const auto st = static_cast<size_t>(e.task(t).step);
    step_end[st] = std::max(step_end[st], e.times(t).end);
  }
  const int32_t last = options.steps - 1;
  const double t0 = step_end[static_cast<size_t>(last - 1)], t1 = step_end[static_cast<size_t>(last)];
  res.step_start_s = t0;
  res.step_time_s = t1 - t0;
  res.simulated_s = e.makespan();
  res.tasks = static_cast<int64_t>(e.task_count());
  res.tokens_per_step = static_cast<double>(s.T * s.A);
  res.flops_per_step = model.flops_per_token(plan.training.seq_len).training() * res.tokens_per_step;
  if (res.step_time_s > 0) {
    res.tokens_per_s = res.tokens_per_step / res.step_time_s;
    res.tflops = res.flops_per_step / res.step_time_s / 1e12;
    res.mfu = res.flops_per_step / res.step_time_s / cost.matmul_peak();
  }

  // Busy fractions and GPU stalls inside [t0, t1).
  std::vector<double> busy(e.resources().size(), 0.0);
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskTimes& tt = e.times(static_cast<TaskId>(t));
    const double ov = std::min(tt.end, t1) - std::max(tt.start, t0);
    if (ov > 0) busy[static_cast<size_t>(e.task(static_cast<TaskId>(t)).resource)] += ov;
  }
  for (size_t r = 0; r < busy.size(); ++r)
    res.busy[bottleneck_of_resource(static_cast<int32_t>(r))] =
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
      for (int k = 0; k < 2; ++k)
        if (ts.pool[k] == id.pool_host) bytes += ts.demand[k] * ts.work_s * ov / len;
    }
    res.busy["host_memory"] = res.step_time_s > 0 ? bytes / rig.host.memory_bandwidth.value / res.step_time_s : 0;
  }
  double prev_end = -1;
  for (TaskId t : e.queue(id.gpu)) {
    const TaskTimes& tt = e.times(t);
    if (prev_end >= 0) {
      const double gap = std::min(tt.start, t1) - std::max(prev_end, t0);
      if (gap > 1e-12) res.stalls[detail::stall_reason(e, t)] += gap;
    }
    prev_end = tt.end;
  }
  // Transfers that waited for a free device buffer.
  for (TaskId t : e.queue(id.h2d)) {
    const TaskTimes& tt = e.times(t);
    const double w = std::min(tt.start, t1) - std::max(tt.ready, t0);
    if (w > 1e-12) res.stalls["buffer"] += w;
  }

  // Critical path: walk back from the step's last task through whatever held each task back.
  {
    TaskId cur = -1;
    double latest = -1;
    for (TaskId t : e.queue(id.gpu))
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
        for (int k = 0; k < 2; ++k)
          if (ts.pool[k] == id.pool_host && len > 0) host_share += tt.slowed_s[k] / len;
        host_share = std::min(1.0, host_share);
        res.critical_path[bottleneck_of_resource(ts.resource)] += dur * (1 - host_share);
        if (host_share > 0) res.critical_path["host_memory"] += dur * host_share;
      }
      if (tt.start <= t0) break;
      const TaskId d = tt.binding, q = qprev[static_cast<size_t>(cur)];
      const double dend = d >= 0 ? e.times(d).end : -1, qend = q >= 0 ? e.times(q).end : -1;
      if (tt.start > std::max(dend, qend) + 1e-12) {
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

  res.peak_bytes.device = e.memory_peak(id.mem_device);
  res.peak_bytes.pinned = ceil_i(pinned - staging) + e.memory_peak(id.mem_staging);
  if (options.keep_engine) res.engine = engine;
  return res;
}

}  // namespace megatrain::sim

// Training from a plan: the streamed pipeline of ARCHITECTURE.md section 4 over the backend table
// of backend.h (weights prefetched K units ahead into a bounded set of device buffers on the H2D
// stream, gradients copied back per unit on the D2H stream, AdamW per unit on a host optimizer
// thread while compute goes on), and the plain in-memory loop of the same model that it is tested
// against. Both use the same layer templates, so on the CPU backend they agree bit for bit.
#pragma once

#include <cstdint>
#include <limits>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/buffers/shape.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/core/trace_store.h"
#include "megatrain/executor/communicator.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/step/schedule.h"

namespace megatrain::exec {

struct StepResult {
  int64_t step = 0;
  double loss = 0;        // mean cross-entropy over all tokens of the step, before its update
  int64_t tokens = 0;
  double time_s = 0;
  double stall_s = 0;     // time the compute thread waited for weights or the optimizer
  double grad_norm = 0;   // global norm before clipping (0 when clipping is off)
  // Mixture-of-Experts: the load-balancing loss as HF's load_balancing_loss_func computes it for
  // one micro-batch (over every MoE layer), averaged over the step's micro-batches; NaN for dense
  // models. The training objective adds router_aux_loss_coef times it only when the config's
  // output_router_logits is true (aux_in_loss), as HF does; `loss` stays the cross-entropy.
  double aux_loss = std::numeric_limits<double>::quiet_NaN();
  bool aux_in_loss = false;
  int64_t unused_experts = 0;  // (layer, expert) pairs no token of the step chose: AdamW skipped them
  // Non-finite guard (docs/reliability.md): a step whose loss or gradient norm is not finite, or
  // that has no counted targets, makes no update. `applied` is false then and `not_applied` says
  // why. `state_intact` is false only when some units were already updated before the reason was
  // known (a non-finite gradient without clipping, where updates overlap the backward): that state
  // must not be saved.
  bool applied = true;
  bool state_intact = true;
  std::string not_applied;
};

// A forward-only pass over an evaluation set (Trainer::evaluate).
struct EvalResult {
  double loss = 0;      // mean cross-entropy over the counted targets of every row, once each
  int64_t tokens = 0;   // counted targets
  int64_t rows = 0;
  double time_s = 0;
};

struct TrainerOptions {
  bool streamed = true;   // false: the plain in-memory loop (the reference)
  int threads = 1;        // compute threads of the CPU backend
  std::string backend = "cpu";  // auto | cpu | cuda (make_backend in backend.h)
  int64_t pinned_limit_bytes = -1;  // page-locked host memory of the CUDA backend; -1: half of RAM
  bool record_trace = false;
  // Tests only: caps on the CUDA backend's vocabulary chunks and attention blocks (buffers::BlockCaps),
  // so that a whole step at a test's small shapes runs several of each. The compiled step's layout
  // takes the same caps.
  buffers::BlockCaps block_caps;
  // Data parallelism (docs/data-parallel.md): the ranks that train together, each on its own rows
  // (the DataLoader's rank), summing every unit's gradient, the loss and the counted targets before
  // any update, so that every rank applies the same update. nullptr or one rank: this process alone.
  Communicator* comm = nullptr;
};

// What a trainer holds, per tier, measured from its own allocations: the arena it carved (and the
// backend's private region), the host buffers it handed to the backend for page-locking, the
// training state and its own host buffers, and the NVMe tier's reservation.
struct MemoryInUse {
  int64_t device = 0, pinned = 0, ram = 0, nvme = 0;
};

// Whether the plan's compiled step fits its budgets (the plan's device budget or the rig's GPU, the
// rig's host memory) and this machine's physical RAM, for the backend `backend` (auto, cpu, cuda)
// would pick: the streamed trainer's own check, made before any state is allocated, so a run that
// cannot fit is refused in a moment whatever the model's size.
Status check_plan_fits(const Plan& plan, const ModelSpec& model, const std::string& backend);

class Trainer {
 public:
  // Compiles the plan's step (megatrain/step/schedule.h) and validates, before anything runs, that
  // the backend supports the plan and that its footprint fits the plan's device budget (or the
  // rig's usable GPU memory), the rig's RAM and pinnable memory, and this machine's RAM (the error
  // names the tier, the bytes and their parts). The plan's rig must resolve.
  static Result<std::unique_ptr<Trainer>> create(const Plan& plan, const ModelSpec& model, HostState& state,
                                                 const DataLoader& data, const TrainerOptions& options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Runs training step `step` (0-based): forward, backward, optimizer; returns its loss and time.
  // On the streamed pipeline the step's last updates may still be running when it returns: the
  // next step's loads wait for them unit by unit (its forward overlaps the optimizer's tail). Call
  // wait_for_updates() before reading the weights or saving a checkpoint; the destructor waits too.
  Result<StepResult> run_step(int64_t step);
  // Steps before the next whose update was not applied (StepResult::applied). AdamW's update count
  // and the learning-rate schedule advance only with applied updates, as when an optimizer step is
  // skipped in PyTorch; a resumed run sets the count its checkpoint recorded.
  int64_t skipped_steps() const;
  void set_skipped_steps(int64_t n);
  void wait_for_updates();
  // A forward-only pass over every row of `eval` once, in order, with the current weights (the
  // updates in flight finish first): the mean loss over the counted targets. It streams the units
  // through the training step's own device buffers (or the in-memory loop's), micro-batch by
  // micro-batch in groups of the plan's accumulation, each unit loaded once per group; nothing of
  // the training state changes. `eval` must have the plan's sequence length and micro-batch.
  Result<EvalResult> evaluate(const DataLoader& eval);
  // wait_for_updates(), then the NVMe tier's error if a read or write of the updates failed (the
  // step that issued them has already returned); check it before saving a checkpoint.
  Status finish_updates();
  // The compiled step this trainer walks and its footprint (the figures the simulator reports).
  const step::StepSchedule& schedule() const;
  const step::Footprint& footprint() const;
  MemoryInUse memory_in_use() const;
  // The backend in use, in words ("CPU backend (2 compute threads)").
  std::string backend_description() const;
  // What sums the gradients over the ranks, in words ("MPI through host memory", "NCCL 2.27.3, 2
  // ranks on NVIDIA H100 (device 1)").
  std::string collective_description() const;
  // Page-locked host memory, in words ("" on the CPU backend).
  std::string pinned_report() const;
  // Writes every recorded span (compute, copies, optimizer, stalls), the steps and the memory
  // counters to a trace (needs record_trace).
  Status write_trace(const std::filesystem::path& path, const std::string& plan_json) const;

  struct Impl;  // opaque; defined in trainer.cpp

 private:
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace megatrain::exec

// The streamed pipeline over the backend table (backend.h), and the plain in-memory reference loop.
//
// The caller's thread issues the compute stream; an H2D thread issues the copies of units from the
// RAM tier into device buffer slots (the arena), at most prefetch_depth units ahead of the unit
// being computed; a D2H thread issues each unit's accumulated gradient back; an optimizer thread
// runs AdamW per unit on the host as soon as its gradient is final (without clipping) or after
// the global norm (with clipping). The next step's copy of a unit waits for that unit's update, so
// updates are exact, never stale. Cross-stream order is carried by backend events; host-side
// conditions (a free slot, the prefetch window, a finished update) are scheduling state kept here.
#include "megatrain/executor/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <tuple>

#include <unistd.h>

#include "megatrain/core/trace_vocab.h"
#include "megatrain/core/units.h"
#include "megatrain/step/schedule.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/model.h"
#include "megatrain/executor/optimizer.h"
#include "nvtx_range.h"

namespace megatrain::exec {
namespace {

using Clock = std::chrono::steady_clock;

struct Span {
  Lane lane;
  SpanKind kind;
  std::string name;  // span_name(kind, layer, mb), or a stall's reason
  int64_t step, layer, mb, start_ns, end_ns, bytes;
  double flops;
};

}  // namespace

struct Trainer::Impl {
  Plan plan;
  const ModelSpec* model = nullptr;
  HostState* state = nullptr;
  const DataLoader* data = nullptr;
  TrainerOptions opt;
  Dims d;
  step::StepSchedule sched;  // the compiled step this trainer walks (megatrain/step/schedule.h)
  step::Footprint fp;        // what it allocates, per tier
  int64_t pinned_requested = 0;  // host bytes handed to the backend for page-locking
  // Host memory the backend may have page-locked is declared before it, so that it is freed after
  // the backend lets go of it.
  AlignedArray<float> host_ckpt_store; // [checkpoint index][mb] in RAM
  // Gradients lent per unit (HostState without all_gradients): a unit's host gradient is a pool
  // buffer from its D2H copy to the end of its update. Guarded by mu.
  std::vector<AlignedArray<float>> grad_pool;
  std::vector<int> free_grads;
  std::vector<int> grad_of;  // per unit, -1 when it holds none
  std::unique_ptr<Backend> be;
  int64_t L = 0, U = 0, A = 0, c = 1;
  bool clip = false;

  // The device arena: one allocation of the compiled step's device footprint, carved at startup.
  std::unique_ptr<Arena> arena;
  std::vector<float*> slots;           // B weight buffers of the largest unit
  std::vector<float*> hid[2];          // A hidden states, ping-pong
  std::vector<float*> dhid;            // A gradients of the hidden state
  std::vector<std::vector<float*>> ckpt;  // [checkpoint index][mb] layer inputs kept on the device
  bool host_ckpt = false;              // checkpoints live in host memory (D2H, then H2D back)
  std::vector<float*> acts;            // activations: c layers (recompute) or L*A (keep all)
  std::vector<float*> grad_bufs;       // per-unit gradient accumulators (c + 1 layers in flight)
  float* embed_grad = nullptr;         // embedding gradient accumulator
  float* head_grad = nullptr;          // head (final norm + untied lm_head) accumulator
  float* tied_grad = nullptr;          // the head's share of a tied table
  float* ws = nullptr;                 // layer backward / head workspace
  float* x_scratch = nullptr;          // forward output of the last layer per micro-batch
  std::vector<std::vector<int32_t>> inputs, targets;
  // Per micro-batch, each token's document start in its row, when the data packs documents that
  // attend only to themselves (DataLoader::document_masked); empty otherwise.
  std::vector<std::vector<int32_t>> starts;
  std::vector<float> reference_x;      // the in-memory loop's working buffers
  // The in-memory loop's weights as the device would see them (the bf16 copy expanded), one array
  // per unit, allocated once so that each step only refills them.
  std::vector<std::vector<float>> reference_w;

  // Pipeline state, guarded by mu.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Event>> slot_free;  // per slot: recorded on compute when its reader's release is issued
  std::vector<int32_t> carried_slots;             // the slots the next round's first loads fill (step::label_slots)
  std::vector<int64_t> updated_step;   // last step whose update of unit u has finished
  int64_t last_step = -1;  // the step run_step last ran
  // The non-finite guard: steps whose update was not applied (AdamW's count and the learning rate
  // follow the applied ones), and, for the step running, why its update was not applied and whether
  // some units were updated all the same (guarded by mu).
  int64_t skipped = 0;
  std::string not_applied;
  bool partial = false, applied_any = false;
  bool aborting = false;  // an error mid-step: queued jobs give up instead of waiting forever
  // Data parallelism: the step's loss and counted targets summed over the ranks (by the first
  // gradient reduction of the step's last round, on the D2H thread), and the first collective
  // that failed (guarded by mu).
  bool loss_reduced = false;
  double reduced_loss_sum = 0;
  int64_t reduced_count = 0;
  Status collective_error;
  int ranks() const { return opt.comm ? opt.comm->size() : 1; }
  // parallel.collective nccl: each unit's gradient is summed between the GPUs before its copy to the
  // host (Backend::sum_across_ranks), not through host memory; what does it, in words.
  bool device_sums = false;
  std::string collective_text = "MPI through host memory";
  std::unique_ptr<Communicator> own_comm;  // one rank, when the caller gave no communicator
  std::unique_ptr<WorkQueue> h2d, d2h, optim;
  // The NVMe tier (host_state.h): units are read ahead of the optimizer, in its order, as far as
  // the staging buffers allow, and written back behind it. Guarded by mu.
  std::unique_ptr<WorkQueue> nvme_read, nvme_write;
  std::vector<int64_t> paged_step;    // the step whose read of unit u has finished
  std::vector<int64_t> written_step;  // the step whose write-back of unit u has finished
  bool nvme_failed = false;           // a read or write failed: the step ends with nvme_error
  Status nvme_error;

  // Mixture-of-Experts, written by the compute thread only: per micro-batch j and decoder layer l
  // (1-based) the slots that chose each expert and the summed router probabilities
  // ([(j * L + l - 1) * E + e]), the load-balancing loss's gradient per micro-batch and expert
  // ([j * E + e]) once computed, and per unit whether each expert was chosen in the step (read by
  // the optimizer after the unit's gradient is final; the next step rewrites it only after its
  // load of the unit has waited for that update).
  std::vector<double> moe_count, moe_prob, moe_grad;
  std::vector<char> moe_grad_ready;
  std::vector<std::vector<char>> chosen;

  // Trace.
  std::mutex trace_mu;
  std::vector<Span> spans;
  std::vector<TraceStep> steps;
  Clock::time_point t0 = Clock::now();

  int64_t ns(Clock::time_point t) const { return std::chrono::duration_cast<std::chrono::nanoseconds>(t - t0).count(); }
  // A span named as the simulator names it (span_name).
  void record(SpanKind kind, int64_t step, int64_t layer, int64_t mb, Clock::time_point a, Clock::time_point b,
              int64_t bytes = 0) {
    if (!opt.record_trace) return;
    std::lock_guard<std::mutex> g(trace_mu);
    spans.push_back(Span{lane_of(kind), kind, span_name(kind, layer, mb), step, layer, mb, ns(a), ns(b), bytes, 0});
  }
  void record_stall(const char* reason, int64_t step, int64_t layer, int64_t mb, Clock::time_point a, Clock::time_point b) {
    if (!opt.record_trace) return;
    std::lock_guard<std::mutex> g(trace_mu);
    spans.push_back(Span{Lane::kCompute, SpanKind::kStall, stall_name(reason), step, layer, mb, ns(a), ns(b), 0, 0});
  }
  // `counted`: this rank's part of the bytes (a shared host state's arrays are the node's; each of
  // its ranks counts its share, as the footprint does), or -1 for all of them.
  Status register_host(void* p, int64_t bytes, const char* what, int64_t counted = -1) {
    pinned_requested += counted >= 0 ? counted : bytes;
    return be->register_host(p, bytes, what);
  }
};

// The budgets: the plan's device budget (or the rig's usable GPU memory) and the rig's host memory,
// with the figures the simulator reports; and host memory against this machine's physical RAM too,
// since the rig may describe a bigger machine, rather than found short by the OOM killer.
static Status check_footprint_fits(const step::Footprint& fp, const Plan& plan, bool on_nvme) {
  MT_ASSIGN_OR_RETURN(HardwareProfile rig, plan.resolve_rig());
  step::TierCapacity cap = step::capacity_of(plan, rig);
  if (on_nvme) cap.nvme = std::max(cap.nvme, fp.peak.nvme);  // the drives' own free space is checked by the store
  if (Status fits = step::check_fits(fp, cap); !fits.ok()) return Status(fits.code(), "the plan does not fit its budgets: " + fits.message());
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0 && fp.peak.ram > static_cast<int64_t>(pages) * page)
    return resource_exhausted("the plan needs " + format_bytes(static_cast<double>(fp.peak.ram)) + " (" + std::to_string(fp.peak.ram) +
                              " bytes) of host RAM, but this machine has " +
                              format_bytes(static_cast<double>(pages) * static_cast<double>(page)) + " (" +
                              std::to_string(static_cast<int64_t>(pages) * page) +
                              " bytes); accepted: a plan for this machine's rig (megatrain-plan plan --rig), which puts state on NVMe when "
                              "RAM is short");
  return {};
}

Status check_plan_fits(const Plan& plan, const ModelSpec& model, const std::string& backend) {
  const bool cuda = backend == "cuda" || (backend == "auto" && have_cuda_backend() && cuda_unavailable_reason().empty());
  const step::ActivationLayout layout = step::layout_for(cuda ? step::BackendKind::kCuda : step::BackendKind::kCpu, model, plan);
  step::CompileOptions co;
  co.lent_gradients = step::lends_gradients(plan, true);
  MT_ASSIGN_OR_RETURN(const step::StepSchedule sched, step::compile(plan, model, layout, co));
  const bool on_nvme = plan.placement.master_weights == Tier::kNvme || plan.placement.optimizer_states == Tier::kNvme;
  step::Footprint fp = step::footprint(sched, layout);
  step::take_rank_share(fp, plan, model);  // data parallel: one rank's share (sharded moments, shared state)
  return check_footprint_fits(fp, plan, on_nvme);
}

Result<std::unique_ptr<Trainer>> Trainer::create(const Plan& plan, const ModelSpec& model, HostState& state,
                                                 const DataLoader& data, const TrainerOptions& options) {
  auto impl = std::make_unique<Impl>();
  Impl& I = *impl;
  I.plan = plan;
  I.model = &model;
  I.state = &state;
  I.data = &data;
  I.opt = options;
  // The plan's rules, the same function Plan reading and the simulator apply (core/plan.h).
  MT_RETURN_IF_ERROR(check_plan_for_model(plan, model));
  MT_ASSIGN_OR_RETURN(I.d, make_dims(model, plan.training.micro_batch, plan.training.seq_len));
  I.d.caps = options.block_caps;
  {
    const bool master_nvme = plan.placement.master_weights == Tier::kNvme, states_nvme = plan.placement.optimizer_states == Tier::kNvme;
    auto where = [](bool nvme) { return name(nvme ? Tier::kNvme : Tier::kRam); };
    if (master_nvme != state.master_on_nvme() || states_nvme != state.states_on_nvme())
      return invalid_argument(std::string("placement: the plan puts master weights in ") + where(master_nvme) + " and optimizer states in " +
                              where(states_nvme) + ", but the training state keeps them in " + where(state.master_on_nvme()) + " and " +
                              where(state.states_on_nvme()) + "; accepted: a HostState created with the plan's placement");
  }
  if (!state.units().empty() &&
      (state.units()[0].m.format() != plan.optimizer.m_format || state.units()[0].v.format() != plan.optimizer.v_format ||
       ((is_quantised(plan.optimizer.m_format) || is_quantised(plan.optimizer.v_format)) &&
        state.units()[0].m.block_size() != plan.optimizer.block_size)))
    return invalid_argument(std::string("the RAM tier keeps m/v in ") + state_format_name(state.units()[0].m.format()) + "/" +
                            state_format_name(state.units()[0].v.format()) + " (block " +
                            std::to_string(state.units()[0].m.block_size()) + ") but the plan says " +
                            state_format_name(plan.optimizer.m_format) + "/" + state_format_name(plan.optimizer.v_format) +
                            " (block " + std::to_string(plan.optimizer.block_size) +
                            "); accepted: a HostState created with the plan's optimizer formats");
  if (state.shared() && (options.comm == nullptr || options.comm->size() == 1))
    return invalid_argument("the training state is shared by a node's ranks (parallel.host_state shared), and this trainer is one "
                            "process; accepted: a shared state in a data-parallel job of several ranks, or a HostState without "
                            "StateSharding::node");
  if (state.sharded() || state.shared()) {
    // Sharded: the job's ranks own the tensors; shared: the node's (every node holds its own copy).
    const bool node = state.shared();
    const int ranks = options.comm ? (node ? options.comm->local_size() : options.comm->size()) : 1;
    const int rank = options.comm ? (node ? options.comm->local_rank() : options.comm->rank()) : 0;
    if (state.sharding().ranks != ranks || state.sharding().rank != rank || (node && state.sharding().node != options.comm))
      return invalid_argument("the training state is sharded as rank " + std::to_string(state.sharding().rank) + " of " +
                              std::to_string(state.sharding().ranks) + ", but this trainer is rank " + std::to_string(rank) + " of " +
                              std::to_string(ranks) + (node ? " on its node" : "") +
                              "; accepted: a HostState sharded for the job's communicator");
  }
  // Without all_gradients the state has no gradient array per unit: the trainer lends them, or
  // copies NCCL's sums straight into the node's shared memory.
  const bool node_gradients = step::gradients_in_node_memory(plan) && options.streamed && state.shared();
  if (!state.all_gradients() && !step::lends_gradients(plan, options.streamed) && !node_gradients)
    return invalid_argument("the training state lends gradients per unit (HostState created without all_gradients), which needs "
                            "the streamed pipeline in layer-major order without clipping or with a shared host state (every "
                            "gradient is needed until the global norm or the last micro-batch otherwise), or NCCL's sums into a "
                            "shared host state; accepted: a HostState with all_gradients for this plan");
  BackendOptions bo;
  bo.threads = options.threads;
  bo.transfer = state.transfer();
  bo.compute = plan.precision.compute;
  bo.pinned_limit_bytes = options.pinned_limit_bytes;
  if (I.ranks() > 1) bo.device = options.comm->local_rank();  // one GPU per rank of a node
  // The in-memory loop is the CPU reference: "auto" means the CPU backend there.
  MT_ASSIGN_OR_RETURN(I.be, make_backend(!options.streamed && options.backend == "auto" ? "cpu" : options.backend, model, I.d, bo));
  if (I.be->name() == "cpu" && plan.precision.compute != DType::kFp32) {
    const std::string why = cuda_unavailable_reason();
    return unsupported("precision.compute " + std::string(dtype_name(plan.precision.compute)) +
                       ": the CPU backend computes in fp32, and bf16 compute is the CUDA backend's" +
                       (why.empty() ? std::string(" (pass --backend cuda or auto)") : " (no GPU here: " + why + ")") +
                       "; accepted on the CPU backend: precision.compute fp32");
  }
  if (plan.parallel.collective == "nccl") {
    // Also with one rank (a 1-rank NCCL communicator: the sums are copies), so that one GPU runs
    // the code path (scripts/gpu-check.sh).
    if (!options.streamed)
      return unsupported("parallel.collective nccl sums gradients between GPUs, and the in-memory loop is the CPU reference; "
                         "accepted with --in-memory: parallel.collective mpi");
    if (options.comm == nullptr) I.own_comm = single_communicator();
    MT_ASSIGN_OR_RETURN(I.collective_text, I.be->enable_device_sums(options.comm ? *options.comm : *I.own_comm));
    I.device_sums = true;
  }
  if (!options.streamed && I.be->name() != "cpu")
    return unsupported("the plain in-memory loop is the CPU reference; accepted: backend cpu with --in-memory");

  const Dims& d = I.d;
  const int64_t NH = d.N * d.H;
  // The compiled step and its footprint, with the layout the planner and the simulator use
  // (step::layout_for). The backend carves by the same buffer lists (megatrain/buffers), so its own
  // figures are the layout's; a backend that disagreed would be refused here, by name.
  const step::ActivationLayout layout =
      step::layout_for(I.be->name() == "cpu" ? step::BackendKind::kCpu : step::BackendKind::kCuda, model, plan, options.block_caps);
  for (const auto& [what, own, planned] :
       {std::tuple<const char*, int64_t, int64_t>{"layer activations (floats)", I.be->layer_act_floats(), layout.layer_act_floats},
        {"layer workspace (floats)", I.be->layer_workspace_floats(), layout.layer_workspace_floats},
        {"head workspace (floats)", I.be->head_workspace_floats(), layout.head_workspace_floats},
        {"private region (bytes)", I.be->private_bytes(), layout.private_bytes},
        {"hidden state (floats)", NH, layout.hidden_floats}})
    if (own != planned)
      return internal_error("the " + I.be->name() + " backend's " + what + " are " + std::to_string(own) +
                            ", but the compiled step's layout, which the plan was sized by, says " + std::to_string(planned));
  step::CompileOptions co;
  co.lent_gradients = !state.all_gradients();
  MT_ASSIGN_OR_RETURN(I.sched, step::compile(plan, model, layout, co));
  // The schedule's shape, as compiled: the trainer reads it from there, not from the plan.
  I.L = I.sched.L;
  I.U = I.sched.U;
  I.A = I.sched.A;
  I.c = I.sched.c;
  I.clip = I.sched.clip;
  I.host_ckpt = I.sched.host_checkpoints;
  if (I.d.moe) {
    I.moe_count.assign(static_cast<size_t>(I.A * I.L * I.d.E), 0.0);
    I.moe_prob.assign(I.moe_count.size(), 0.0);
    I.moe_grad.assign(static_cast<size_t>(I.A * I.d.E), 0.0);
    I.moe_grad_ready.assign(static_cast<size_t>(I.A), 0);
    I.chosen.assign(static_cast<size_t>(I.L + 2), std::vector<char>(static_cast<size_t>(I.d.E), 1));
  }
  for (int64_t u = 0; u < I.U; ++u)
    if (state.units()[static_cast<size_t>(u)].numel != I.sched.unit_numel[static_cast<size_t>(u)])
      return internal_error("unit " + std::to_string(u) + " of the training state holds " +
                            std::to_string(state.units()[static_cast<size_t>(u)].numel) + " elements, the compiled step " +
                            std::to_string(I.sched.unit_numel[static_cast<size_t>(u)]));
  I.fp = step::footprint(I.sched, layout);
  step::take_rank_share(I.fp, plan, model);  // data parallel: one rank's share (sharded moments, shared state)
  const step::Buffers& sb = I.sched.buffers;
  const int64_t max_unit = sb.slot_floats, max_layer = sb.grad_floats;
  const int64_t n_ckpt = I.sched.checkpoints_per_mb;
  const int64_t A_dev = I.sched.resident_mbs;  // micro-batches on the device at once
  const int64_t act_sets = sb.act_sets, grad_sets = sb.grad_sets;
  const int64_t ws_floats = sb.workspace;
  const int64_t act_floats = sb.act_floats;
  if (options.streamed) {
    MT_RETURN_IF_ERROR(check_footprint_fits(I.fp, plan, I.state->on_nvme()));
    MT_ASSIGN_OR_RETURN(I.arena, I.be->create_arena(I.fp.peak.device));
    Arena& ar = *I.arena;
    auto take = [&](std::vector<float*>& into, int64_t count, int64_t n, const char* what) -> Status {
      for (int64_t k = 0; k < count; ++k) {
        MT_ASSIGN_OR_RETURN(float* p, ar.take_floats(n, what));
        into.push_back(p);
      }
      return Status{};
    };
    MT_RETURN_IF_ERROR(take(I.slots, sb.slots, max_unit, "layer buffers"));
    for (int k = 0; k < 2; ++k) MT_RETURN_IF_ERROR(take(I.hid[k], A_dev, NH, "hidden states"));
    MT_RETURN_IF_ERROR(take(I.dhid, A_dev, NH, "hidden-state gradients"));
    I.ckpt.resize(static_cast<size_t>(n_ckpt));
    if (I.host_ckpt) {
      I.host_ckpt_store.resize(n_ckpt * A_dev * NH);
      for (int64_t k = 0; k < n_ckpt; ++k)
        for (int64_t j = 0; j < A_dev; ++j) I.ckpt[static_cast<size_t>(k)].push_back(I.host_ckpt_store.data() + (k * A_dev + j) * NH);
    } else {
      for (auto& v : I.ckpt) MT_RETURN_IF_ERROR(take(v, A_dev, NH, "checkpoints"));
    }
    MT_RETURN_IF_ERROR(take(I.acts, act_sets, act_floats, "activations"));
    MT_RETURN_IF_ERROR(take(I.grad_bufs, grad_sets, max_layer, "gradient accumulators"));
    std::vector<float*> one;
    MT_RETURN_IF_ERROR(take(one, 1, sb.embed_grad, "embedding gradient"));
    MT_RETURN_IF_ERROR(take(one, 1, sb.head_grad, "head gradient"));
    if (d.tied) MT_RETURN_IF_ERROR(take(one, 1, sb.tied_grad, "tied head gradient"));
    MT_RETURN_IF_ERROR(take(one, 1, ws_floats, "workspace"));
    MT_RETURN_IF_ERROR(take(one, 1, sb.scratch, "last layer output"));
    size_t k1 = 0;
    I.embed_grad = one[k1++];
    I.head_grad = one[k1++];
    if (d.tied) I.tied_grad = one[k1++];
    I.ws = one[k1++];
    I.x_scratch = one[k1++];
    for (int64_t s = 0; s < I.sched.B; ++s) I.slot_free.push_back(std::make_unique<Event>(true));
    I.carried_slots = step::first_slots(I.sched.B);
    I.h2d = std::make_unique<WorkQueue>();
    I.d2h = std::make_unique<WorkQueue>();
    I.optim = std::make_unique<WorkQueue>();
    // Page-lock what the copy streams read and write (a no-op on the CPU backend): each unit's
    // streamed weights and its gradient, and the host checkpoints.
    const int64_t sharing = state.shared() ? state.sharding().ranks : 1;
    for (UnitState& us : state.units()) {
      if (state.transfer() == DType::kBf16)
        MT_RETURN_IF_ERROR(I.register_host(us.stream_bf16.data(), 2 * us.numel, "streamed weights", 2 * us.numel / sharing));
      else
        MT_RETURN_IF_ERROR(I.register_host(us.master.data(), 4 * us.numel, "streamed weights", 4 * us.numel / sharing));
      if (state.all_gradients()) MT_RETURN_IF_ERROR(I.register_host(us.grad.data(), 4 * us.numel, "gradients"));
      if (node_gradients) {  // NCCL's sums are copied into this rank's range of the node's
        const auto [begin, n] = state.owned_range(us);
        MT_RETURN_IF_ERROR(I.register_host(us.summed.data() + begin, 4 * n, "gradients"));
      }
    }
    if (!state.all_gradients() && !node_gradients) {
      // Three buffers: one being copied into, one being updated, one waiting between them.
      constexpr int kLentGradients = step::kLentGradientBuffers;
      I.grad_pool.resize(kLentGradients);
      for (int k = 0; k < kLentGradients; ++k) {
        I.grad_pool[static_cast<size_t>(k)].resize(max_unit);
        MT_RETURN_IF_ERROR(I.register_host(I.grad_pool[static_cast<size_t>(k)].data(), 4 * max_unit, "gradients"));
        I.free_grads.push_back(kLentGradients - 1 - k);
      }
      I.grad_of.assign(static_cast<size_t>(I.U), -1);
    }
    MT_RETURN_IF_ERROR(I.register_host(I.host_ckpt_store.data(), 4 * I.host_ckpt_store.size(), "host checkpoints"));
  } else {
    // The in-memory loop keeps every activation of every micro-batch; it is the reference, not a
    // way to train big models.
    I.reference_x.resize(static_cast<size_t>(I.A * (I.L + 1) * NH + I.A * I.L * act_floats + ws_floats + 2 * NH));
    if (d.tied) I.reference_x.resize(I.reference_x.size() + static_cast<size_t>(d.V * d.H));
    I.reference_w.resize(static_cast<size_t>(I.U));
    for (int64_t u = 0; u < I.U; ++u)
      I.reference_w[static_cast<size_t>(u)].resize(static_cast<size_t>(state.units()[static_cast<size_t>(u)].numel));
  }
  I.updated_step.assign(static_cast<size_t>(I.U), -1);
  I.paged_step.assign(static_cast<size_t>(I.U), -1);
  I.written_step.assign(static_cast<size_t>(I.U), -1);
  if (state.on_nvme() && options.streamed) {
    I.nvme_read = std::make_unique<WorkQueue>();
    I.nvme_write = std::make_unique<WorkQueue>();
  }
  I.inputs.assign(static_cast<size_t>(I.A), std::vector<int32_t>(static_cast<size_t>(d.N)));
  I.targets.assign(static_cast<size_t>(I.A), std::vector<int32_t>(static_cast<size_t>(d.N)));
  if (data.document_masked()) I.starts.assign(static_cast<size_t>(I.A), std::vector<int32_t>(static_cast<size_t>(d.N)));
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() { wait_for_updates(); }
void Trainer::wait_for_updates() {
  if (!impl_) return;
  if (impl_->nvme_read) impl_->nvme_read->synchronize();
  if (impl_->optim) impl_->optim->synchronize();
  if (impl_->nvme_write) impl_->nvme_write->synchronize();
}
Status Trainer::finish_updates() {
  wait_for_updates();
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->nvme_failed) return Status(impl_->nvme_error.code(), "the NVMe tier failed: " + impl_->nvme_error.message());
  if (!impl_->collective_error.ok()) return impl_->collective_error;  // a sharded update's gather
  return {};
}
const step::StepSchedule& Trainer::schedule() const { return impl_->sched; }
const step::Footprint& Trainer::footprint() const { return impl_->fp; }
MemoryInUse Trainer::memory_in_use() const {
  const Impl& I = *impl_;
  MemoryInUse m;
  m.device = I.arena ? I.arena->capacity() + I.be->private_bytes() : 0;
  m.pinned = I.pinned_requested;
  m.ram = I.state->bytes() + 4 * static_cast<int64_t>(I.host_ckpt_store.size());
  for (const auto& g : I.grad_pool) m.ram += 4 * g.size();
  for (const auto& v : I.inputs) m.ram += 4 * static_cast<int64_t>(v.size());
  for (const auto& v : I.targets) m.ram += 4 * static_cast<int64_t>(v.size());
  for (const auto& v : I.starts) m.ram += 4 * static_cast<int64_t>(v.size());
  if (I.be->name() == "cpu") m.ram += m.device;  // the CPU backend's arena is host memory
  m.nvme = I.state->nvme_bytes();
  return m;
}
std::string Trainer::backend_description() const { return impl_->be->describe(); }
std::string Trainer::collective_description() const { return impl_->collective_text; }
std::string Trainer::pinned_report() const { return impl_->be->pinned_report(); }

namespace {

// ---- Mixture-of-Experts bookkeeping (model.h LayerActs: aux_count, aux_prob, aux_grad) ----------

bool is_moe_unit(const Trainer::Impl& I, int64_t u) {
  return I.d.moe && u >= 1 && u <= I.L && I.state->units()[static_cast<size_t>(u)].find(TensorRole::kRouter) != nullptr;
}

// Micro-batch j's document starts on a layer's activations (packed documents that attend only to
// themselves); every forward, recompute and backward of j gets them.
LayerActs doc_acts(const Trainer::Impl& I, LayerActs a, int64_t j) {
  if (!I.starts.empty()) a.doc_starts = I.starts[static_cast<size_t>(j)].data();
  return a;
}

// The first forward of layer l for micro-batch j adds its routing statistics; a recompute does not.
LayerActs moe_forward_acts(Trainer::Impl& I, LayerActs a, int64_t l, int64_t j) {
  if (!is_moe_unit(I, l)) return a;
  const size_t at = static_cast<size_t>((j * I.L + l - 1) * I.d.E);
  a.aux_count = I.moe_count.data() + at;
  a.aux_prob = I.moe_prob.data() + at;
  return a;
}

// HF's load_balancing_loss_func over micro-batch j's router outputs, concatenated over the MoE
// layers (R = moe_layers * N rows): tokens_per_expert[k][e] is the fraction of rows whose k-th
// choice is e and router_prob_per_expert[e] the mean probability, so the loss is
// E * sum_e (c_e / R) * (P_e / R) with c_e the slots choosing e and P_e the summed probabilities,
// layer by layer in order.
double moe_aux_loss(const Trainer::Impl& I, int64_t j, std::vector<double>* count_out = nullptr) {
  const int64_t E = I.d.E;
  std::vector<double> c(static_cast<size_t>(E), 0.0), p(static_cast<size_t>(E), 0.0);
  for (int64_t l = 1; l <= I.L; ++l) {
    if (!is_moe_unit(I, l)) continue;
    const size_t at = static_cast<size_t>((j * I.L + l - 1) * E);
    for (int64_t e = 0; e < E; ++e) c[static_cast<size_t>(e)] += I.moe_count[at + static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e) p[static_cast<size_t>(e)] += I.moe_prob[at + static_cast<size_t>(e)];
  }
  const double R = static_cast<double>(I.d.moe_layers * I.d.N);
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) loss += (c[static_cast<size_t>(e)] / R) * (p[static_cast<size_t>(e)] / R);
  if (count_out) *count_out = std::move(c);
  return static_cast<double>(E) * loss;
}

// The backward of layer l for micro-batch j gets d(objective)/d p[t][e] = coef * E * c_e / R^2
// when the load-balancing loss is part of the objective (output_router_logits), else nothing. As in
// Hugging Face's Trainer (docs/moe.md): each micro-batch's loss carries coef times its own aux loss
// and is not divided by the accumulation steps (the cross-entropy is already normalised by the
// window's targets), so the aux terms add up over the micro-batches. With N ranks too: Trainer
// (average_tokens_across_devices, its default) multiplies each rank's loss by N before DDP averages
// the gradients, so the aux terms add up over every rank's micro-batches, as one process
// accumulating all of them would.
LayerActs moe_backward_acts(Trainer::Impl& I, LayerActs a, int64_t l, int64_t j) {
  const ModelConfig& mc = I.model->config();
  if (!is_moe_unit(I, l) || !mc.output_router_logits || mc.router_aux_loss_coef == 0) return a;
  const int64_t E = I.d.E;
  double* g = I.moe_grad.data() + static_cast<size_t>(j * E);
  if (!I.moe_grad_ready[static_cast<size_t>(j)]) {
    std::vector<double> c;
    (void)moe_aux_loss(I, j, &c);
    const double R = static_cast<double>(I.d.moe_layers * I.d.N);
    const double scale = mc.router_aux_loss_coef * static_cast<double>(E) / (R * R);
    for (int64_t e = 0; e < E; ++e) g[e] = scale * c[static_cast<size_t>(e)];
    I.moe_grad_ready[static_cast<size_t>(j)] = 1;
  }
  a.aux_grad = g;
  return a;
}

// Unit u's gradient is final: which experts did any micro-batch of the step choose?
void mark_chosen(Trainer::Impl& I, int64_t u) {
  if (!is_moe_unit(I, u)) return;
  std::vector<char>& ch = I.chosen[static_cast<size_t>(u)];
  ch.assign(static_cast<size_t>(I.d.E), 0);
  for (int64_t j = 0; j < I.A; ++j)
    for (int64_t e = 0; e < I.d.E; ++e)
      if (I.moe_count[static_cast<size_t>((j * I.L + u - 1) * I.d.E + e)] > 0) ch[static_cast<size_t>(e)] = 1;
}

// A step starts: no statistics yet.
void moe_begin_step(Trainer::Impl& I) {
  if (!I.d.moe) return;
  std::fill(I.moe_count.begin(), I.moe_count.end(), 0.0);
  std::fill(I.moe_prob.begin(), I.moe_prob.end(), 0.0);
  std::fill(I.moe_grad_ready.begin(), I.moe_grad_ready.end(), 0);
}

// The step's load-balancing loss and its unused experts, for StepResult.
void moe_end_step(const Trainer::Impl& I, StepResult& res) {
  if (!I.d.moe) return;
  double sum = 0;
  for (int64_t j = 0; j < I.A; ++j) sum += moe_aux_loss(I, j);
  res.aux_loss = sum / static_cast<double>(I.A);
  res.aux_in_loss = I.model->config().output_router_logits && I.model->config().router_aux_loss_coef != 0;
  res.unused_experts = 0;
  for (int64_t l = 1; l <= I.L; ++l) {
    if (!is_moe_unit(I, l)) continue;
    for (int64_t e = 0; e < I.d.E; ++e) {
      double c = 0;
      for (int64_t j = 0; j < I.A; ++j) c += I.moe_count[static_cast<size_t>((j * I.L + l - 1) * I.d.E + e)];
      if (c == 0) ++res.unused_experts;
    }
  }
}

// AdamW for one unit, tensor by tensor (weight decay only on matrices and the embedding).
// `opt_step` is the update's index among the applied ones (the step less the skipped steps before it).
void update_unit(Trainer::Impl& I, int64_t u, int64_t opt_step, float grad_scale) {
  const NvtxRange range("optimizer");
  UnitState& us = I.state->units()[static_cast<size_t>(u)];
  const OptimizerConfig& o = I.plan.optimizer;
  const double lr = learning_rate(I.plan.training, opt_step);
  // optimizer.threads 0 means all cores, as the simulator reads it: the cores this process may
  // run on, which is what megatrain-exec passes as the backend's threads unless --threads says less.
  const int threads = o.threads > 0 ? static_cast<int>(o.threads) : std::max(1, I.opt.threads);
  uint16_t* stream = I.state->transfer() == DType::kBf16 ? us.stream_bf16.data() : nullptr;
  // Per-expert tensors: an expert no token of the step chose has no gradient, and AdamW leaves it
  // alone as torch.optim.AdamW skips a parameter whose grad is None; a chosen expert is corrected
  // with its own update count (UnitState::expert_steps).
  const bool per_expert = !us.expert_steps.empty() && is_moe_unit(I, u);
  const std::vector<char>* chosen = per_expert ? &I.chosen[static_cast<size_t>(u)] : nullptr;
  // Sharded states: only the tensors this rank owns (their moments are here; the others' are not).
  auto skipped = [&](const TensorSlot& t) {
    return !I.state->owns(t) || (chosen && t.expert >= 0 && !(*chosen)[static_cast<size_t>(t.expert)]);
  };
  auto count_of = [&](const TensorSlot& t) {
    return chosen && t.expert >= 0 ? us.expert_steps[static_cast<size_t>(t.expert)] + 1 : opt_step + 1;
  };
  if (us.m.format() != StateFormat::kFp32 || us.v.format() != StateFormat::kFp32) {
    // Quantised or bf16 moments: tensor by tensor, since their blocks start at each tensor.
    for (size_t a = 0; a < us.tensors.size(); ++a) {
      const TensorSlot& t = us.tensors[a];
      if (skipped(t)) continue;
      AdamWStep s{lr, o.beta1, o.beta2, o.eps, t.decay ? o.weight_decay : 0.0, count_of(t), grad_scale};
      adamw_update_moments(us.master.data() + t.offset, us.final_grad() + t.offset, us.m.tensor(a), us.v.tensor(a), t.numel, s,
                           nullptr, stream ? stream + t.offset : nullptr, threads);
    }
  } else {
    // Adjacent tensors with the same weight decay (and the same expert) are one call: AdamW is
    // element-wise, so the result is the same, with fewer thread starts and longer chunks per thread.
    for (size_t a = 0; a < us.tensors.size();) {
      const TensorSlot& t = us.tensors[a];
      int64_t n = t.numel;
      size_t b = a + 1;
      while (b < us.tensors.size() && us.tensors[b].decay == t.decay && us.tensors[b].expert == t.expert &&
             us.tensors[b].owner == t.owner && us.tensors[b].offset == t.offset + n)
        n += us.tensors[b++].numel;
      if (!skipped(t)) {
        AdamWStep s{lr, o.beta1, o.beta2, o.eps, t.decay ? o.weight_decay : 0.0, count_of(t), grad_scale};
        adamw_update(us.master.data() + t.offset, us.final_grad() + t.offset, us.m.tensor(a).f32, us.v.tensor(a).f32, n,
                     s, nullptr, stream ? stream + t.offset : nullptr, threads);
      }
      a = b;
    }
  }
  if (chosen)
    for (size_t e = 0; e < us.expert_steps.size(); ++e)
      if ((*chosen)[e]) ++us.expert_steps[e];
}

// Sharded states: after the update, every rank takes the new weights of the tensors other ranks own
// (the master weights, and the streamed bf16 copy made from them), so that all ranks stream the
// same weights to the next step. A shared state: the node's ranks updated the node's one copy in
// place, each its own tensors, and meet at a barrier before any of them loads the unit again (every
// node made the same update from the same summed gradient). A no-op otherwise.
Status gather_unit_weights(Trainer::Impl& I, int64_t u, Channel channel) {
  if (I.state->shared()) return I.opt.comm->node_barrier(channel);
  if (!I.state->sharded()) return {};
  UnitState& us = I.state->units()[static_cast<size_t>(u)];
  std::vector<int64_t> bytes(us.shard_elems.size());
  for (size_t r = 0; r < bytes.size(); ++r) bytes[r] = 4 * us.shard_elems[r];
  MT_RETURN_IF_ERROR(I.opt.comm->gather_from_owners(us.master.data(), bytes, channel));
  if (I.state->transfer() != DType::kBf16) return {};
  for (size_t r = 0; r < bytes.size(); ++r) bytes[r] = 2 * us.shard_elems[r];
  return I.opt.comm->gather_from_owners(us.stream_bf16.data(), bytes, channel);
}

// The bytes of unit u's gather that come from other ranks.
int64_t gathered_bytes(const Trainer::Impl& I, int64_t u) {
  if (I.state->shared()) return 0;  // nothing is copied: the node's ranks share the weights
  const UnitState& us = I.state->units()[static_cast<size_t>(u)];
  const int64_t other = us.numel - us.shard_elems[static_cast<size_t>(I.state->sharding().rank)];
  return other * (I.state->transfer() == DType::kBf16 ? 6 : 4);
}

int64_t nvme_unit_bytes(const Trainer::Impl& I, int64_t u) {
  return I.state->nvme_store() ? I.state->nvme_store()->region_bytes(u) : 0;
}

void nvme_fail(Trainer::Impl& I, Status s) {
  {
    std::lock_guard<std::mutex> g(I.mu);
    if (!I.nvme_failed) I.nvme_error = std::move(s);
    I.nvme_failed = true;
  }
  I.cv.notify_all();
}

// Unit u gives its lent gradient buffer back (lent gradients only; the caller holds I.mu).
void return_lent_gradient(Trainer::Impl& I, size_t u) {
  if (I.grad_pool.empty() || I.grad_of[u] < 0) return;
  I.free_grads.push_back(I.grad_of[u]);
  I.grad_of[u] = -1;
  I.state->units()[u].grad.release();
}

// Step `step`'s read of unit u from the NVMe tier, once the previous step's write-back is done.
void nvme_read_unit(Trainer::Impl& I, int64_t u, int64_t step) {
  {
    std::unique_lock<std::mutex> l(I.mu);
    // Only this thread takes staging buffers, so once one is free page_in will not wait (a wait
    // there could not be interrupted when a step is abandoned).
    I.cv.wait(l, [&] {
      return I.nvme_failed || (I.written_step[static_cast<size_t>(u)] >= step - 1 && I.state->free_staging_buffers() > 0);
    });
    if (I.nvme_failed) return;
  }
  const auto a = Clock::now();
  Status s = I.state->page_in(u, true);
  I.record(SpanKind::kNvmeRead, step, u, -1, a, Clock::now(), nvme_unit_bytes(I, u));
  if (!s.ok()) return nvme_fail(I, std::move(s));
  {
    std::lock_guard<std::mutex> g(I.mu);
    I.paged_step[static_cast<size_t>(u)] = step;
  }
  I.cv.notify_all();
}

// The optimizer's job for unit u: (NVMe: wait for its read) AdamW, mark it updated for the next
// step's load, (NVMe: hand it to the writer).
// `apply` false: the step's update is not applied (the non-finite guard); the rest is the same, so
// that the bookkeeping of the loads, the lent gradients and the NVMe tier does not change.
void optimize_unit(Trainer::Impl& I, int64_t u, int64_t step, int64_t opt_step, float grad_scale, bool apply) {
  const bool nvme = I.state->on_nvme();
  bool skip = false;
  if (nvme) {
    std::unique_lock<std::mutex> l(I.mu);
    I.cv.wait(l, [&] { return I.nvme_failed || I.paged_step[static_cast<size_t>(u)] >= step; });
    skip = I.nvme_failed && I.paged_step[static_cast<size_t>(u)] < step;
  }
  if (!skip && apply) {
    const auto b = Clock::now();
    update_unit(I, u, opt_step, grad_scale);
    const auto c = Clock::now();
    I.record(SpanKind::kOptimizer, step, u, -1, b, c);
    // Every rank reaches this for every unit in the same order (the verdict is agreed), so the
    // gathers on the optimizer's channel pair up.
    Status s = gather_unit_weights(I, u, Channel::kOptimizer);
    if (I.state->sharded() || I.state->shared()) I.record(SpanKind::kWeightGather, step, u, -1, c, Clock::now(), gathered_bytes(I, u));
    if (!s.ok()) {
      std::lock_guard<std::mutex> g(I.mu);
      if (I.collective_error.ok())
        I.collective_error = Status(s.code(), "gathering the updated weights of unit " + std::to_string(u) + " failed: " + s.message());
    }
  }
  {
    std::lock_guard<std::mutex> g(I.mu);
    I.updated_step[static_cast<size_t>(u)] = step;
    return_lent_gradient(I, static_cast<size_t>(u));
  }
  I.cv.notify_all();
  if (!nvme || skip) return;
  I.nvme_write->post([&I, u, step] {
    const auto a = Clock::now();
    Status s = I.state->page_out(u, true);
    I.record(SpanKind::kNvmeWrite, step, u, -1, a, Clock::now(), nvme_unit_bytes(I, u));
    if (!s.ok()) return nvme_fail(I, std::move(s));
    {
      std::lock_guard<std::mutex> g(I.mu);
      I.written_step[static_cast<size_t>(u)] = step;
    }
    I.cv.notify_all();
  });
}

// Why the step's update must not be applied, or "" (the non-finite guard, docs/reliability.md).
std::string not_applied_reason(double loss_sum, int64_t count, double norm) {
  char buf[160];
  if (count == 0) return "it has no counted targets (every target of its rows is masked)";
  if (!std::isfinite(loss_sum)) {
    std::snprintf(buf, sizeof buf, "its loss is %g", loss_sum / static_cast<double>(count));
    return buf;
  }
  if (!std::isfinite(norm)) {
    std::snprintf(buf, sizeof buf, "its gradient norm is %g", norm);
    return buf;
  }
  return "";
}

// torch.nn.utils.clip_grad_norm_: scale = max_norm / (norm + 1e-6), applied only when below 1.
float clip_scale(const Trainer::Impl& I, double norm) {
  if (!I.clip) return 1.0f;
  const double s = I.plan.training.clip_grad_norm / (norm + 1e-6);
  return s < 1.0 ? static_cast<float>(s) : 1.0f;
}

// Per-tensor figures of the owners' summed gradients added up over the ranks that own them: the
// job's ranks with sharded states, the node's with a shared state (every node holds the same sums).
Status sum_over_owners(Trainer::Impl& I, double* data, int64_t n, Channel channel) {
  if (!I.state->sharded()) return {};
  return I.state->shared() ? I.opt.comm->node_sum(data, n, channel) : I.opt.comm->sum(data, n, channel);
}

// The norm of the step's whole gradient: tensor by tensor (each a fixed-order sum_of_squares), the
// tensors' sums added in the model's order. With sharded states each rank holds the summed gradient
// of its own tensors only: the per-tensor sums are summed over the ranks (one rank's value and zeros,
// so exactly), and every rank, sharded or not, adds the same numbers in the same order.
// The pass runs on the optimizer's threads (the updates wait for it, so they are free), each
// tensor's chunks spread over them (sums_of_squares: the same bits for any thread count).
Result<double> global_norm(Trainer::Impl& I, Channel channel) {
  std::vector<SquaresRange> ranges;
  for (int64_t u = 0; u < I.U; ++u) {
    UnitState& us = I.state->units()[static_cast<size_t>(u)];
    for (const TensorSlot& t : us.tensors)
      ranges.push_back(!I.state->sharded() || I.state->owns(t) ? SquaresRange{us.final_grad() + t.offset, t.numel} : SquaresRange{});
  }
  std::vector<double> part(ranges.size());
  const int threads = I.plan.optimizer.threads > 0 ? static_cast<int>(I.plan.optimizer.threads) : std::max(1, I.opt.threads);
  sums_of_squares(ranges, part.data(), threads);
  MT_RETURN_IF_ERROR(sum_over_owners(I, part.data(), static_cast<int64_t>(part.size()), channel));
  double total = 0;
  for (double p : part) total += p;
  return std::sqrt(total);
}

// ---- data parallelism (docs/data-parallel.md) ------------------------------------------------------

// The step's loss and counted targets summed over the ranks, once per step, on `channel`.
Status reduce_loss(Trainer::Impl& I, double loss_sum, int64_t count, Channel channel) {
  if (I.loss_reduced) return {};
  double l = loss_sum;
  int64_t c = count;
  MT_RETURN_IF_ERROR(I.opt.comm->sum(&l, 1, channel));
  MT_RETURN_IF_ERROR(I.opt.comm->sum(&c, 1, channel));
  I.reduced_loss_sum = l;
  I.reduced_count = c;
  I.loss_reduced = true;
  return {};
}

// Unit u's final gradient summed over the ranks (every rank then holds the same gradient and makes
// the same update), unless `sum_gradient` is false (parallel.collective nccl summed it between the
// GPUs already), and, for a Mixture-of-Experts layer, which experts any rank's tokens chose.
Status reduce_unit_gradient(Trainer::Impl& I, int64_t u, Channel channel, bool sum_gradient = true) {
  UnitState& us = I.state->units()[static_cast<size_t>(u)];
  // Sharded states: each rank needs the sum of its own tensors' gradients only; a shared state: each
  // rank's range of the node's summed gradient is the sum over every rank of the job.
  if (!sum_gradient) {
  } else if (I.state->shared()) {
    MT_RETURN_IF_ERROR(I.opt.comm->reduce_to_node_owners(us.grad.data(), us.summed.data(), us.shard_elems, channel));
  } else if (I.state->sharded()) {
    MT_RETURN_IF_ERROR(I.opt.comm->reduce_to_owners(us.grad.data(), us.shard_elems, channel));
  } else {
    MT_RETURN_IF_ERROR(I.opt.comm->sum(us.grad.data(), us.numel, channel));
  }
  if (!is_moe_unit(I, u)) return {};
  std::vector<char>& ch = I.chosen[static_cast<size_t>(u)];
  std::vector<int64_t> any(ch.begin(), ch.end());
  MT_RETURN_IF_ERROR(I.opt.comm->max(any.data(), static_cast<int64_t>(any.size()), channel));
  for (size_t e = 0; e < ch.size(); ++e) ch[e] = any[e] != 0 ? 1 : 0;
  return {};
}

// The plain in-memory loop: the reference the streamed pipeline is tested against. It keeps every
// activation of every micro-batch; it is not a way to train big models.
// The in-memory loop's working buffers, carved from reference_x.
struct ReferenceBuffers {
  std::vector<float*> xs;       // [mb][layer 0..L] hidden states
  std::vector<float*> act_buf;  // [mb][layer 1..L] saved activations
  float* ws = nullptr;          // layer backward / head workspace
  float* dx = nullptr;          // the hidden state's gradient
  float* tied = nullptr;        // the head's share of a tied table
};
ReferenceBuffers reference_buffers(Trainer::Impl& I) {
  const int64_t NH = I.d.N * I.d.H;
  ReferenceBuffers b;
  float* p = I.reference_x.data();
  for (int64_t k = 0; k < I.A * (I.L + 1); ++k, p += NH) b.xs.push_back(p);
  for (int64_t k = 0; k < I.A * I.L; ++k, p += I.be->layer_act_floats()) b.act_buf.push_back(p);
  b.ws = p;
  p += std::max(I.be->layer_workspace_floats(), I.be->head_workspace_floats());
  b.dx = p;
  p += NH;
  b.tied = I.d.tied ? p + NH : nullptr;
  return b;
}

Status reference_step(Trainer::Impl& I, int64_t step, float grad_scale, StepResult& res) {
  const Dims& d = I.d;
  double loss_sum = 0;
  int64_t count = 0;
  auto units = [&](int64_t u) -> UnitState& { return I.state->units()[static_cast<size_t>(u)]; };
  // ---- the plain in-memory loop -------------------------------------------------------------
  const ReferenceBuffers rb = reference_buffers(I);
  const std::vector<float*>& xs = rb.xs;
  const std::vector<float*>& act_buf = rb.act_buf;
  float* ws = rb.ws;
  float* dx = rb.dx;
  float* tied = rb.tied;
  // Weights as the device would see them (the bf16 copy expanded), then fresh gradients.
  std::vector<std::vector<float>>& w = I.reference_w;
  for (int64_t u = 0; u < I.U; ++u) {
    I.be->upload_unit(StreamKind::kCompute, units(u), I.state->transfer(), w[static_cast<size_t>(u)].data());
    std::fill(units(u).grad.data(), units(u).grad.data() + units(u).numel, 0.0f);
  }
  if (tied) std::fill(tied, tied + d.V * d.H, 0.0f);
  const UnitState& head_u = units(I.L + 1);
  const float* lm = d.tied ? w[0].data() : w[static_cast<size_t>(I.L + 1)].data() + head_u.find(TensorRole::kHead)->offset;
  float* dlm = d.tied ? tied : units(I.L + 1).grad.data() + head_u.find(TensorRole::kHead)->offset;
  for (int64_t j = 0; j < I.A; ++j) {
    float* const* x = &xs[static_cast<size_t>(j * (I.L + 1))];
    MT_RETURN_IF_ERROR(I.be->embed(w[0].data(), I.inputs[static_cast<size_t>(j)].data(), x[0]));
    for (int64_t l = 1; l <= I.L; ++l) {
      const LayerActs a = doc_acts(I, moe_forward_acts(I, bind_layer_acts(d, act_buf[static_cast<size_t>(j * I.L + l - 1)]), l, j), j);
      MT_RETURN_IF_ERROR(I.be->layer_forward(view_unit(units(l), w[static_cast<size_t>(l)].data()), x[l - 1], x[l], a));
    }
    const float* fn = w[static_cast<size_t>(I.L + 1)].data() + head_u.find(TensorRole::kFinalNorm)->offset;
    float* dfn = units(I.L + 1).grad.data() + head_u.find(TensorRole::kFinalNorm)->offset;
    MT_RETURN_IF_ERROR(I.be->head(fn, lm, x[I.L], I.targets[static_cast<size_t>(j)].data(), grad_scale, dx, dfn, dlm,
                                    &loss_sum, &count, ws));
    for (int64_t l = I.L; l >= 1; --l) {
      const LayerActs a = doc_acts(I, moe_backward_acts(I, bind_layer_acts(d, act_buf[static_cast<size_t>(j * I.L + l - 1)]), l, j), j);
      MT_RETURN_IF_ERROR(I.be->layer_backward(view_unit(units(l), w[static_cast<size_t>(l)].data()), a, dx, dx,
                                          grad_unit(units(l), units(l).grad.data()), ws));
    }
    MT_RETURN_IF_ERROR(I.be->embed_backward(I.inputs[static_cast<size_t>(j)].data(), dx, units(0).grad.data()));
  }
  if (tied) I.be->add(units(0).grad.data(), tied, d.V * d.H);
  for (int64_t u = 0; u < I.U; ++u) mark_chosen(I, u);
  if (I.ranks() > 1) {
    for (int64_t u = 0; u < I.U; ++u) {
      const auto b = Clock::now();
      MT_RETURN_IF_ERROR(reduce_unit_gradient(I, u, Channel::kMain));
      I.record(SpanKind::kGradSum, step, u, -1, b, Clock::now(), units(u).numel * 4);
    }
    MT_RETURN_IF_ERROR(reduce_loss(I, loss_sum, count, Channel::kMain));
    loss_sum = I.reduced_loss_sum;
    count = I.reduced_count;
  }
  // The norm is the guard's even without clipping: every gradient is here before any update.
  MT_ASSIGN_OR_RETURN(const double norm, global_norm(I, Channel::kMain));
  if (I.clip) res.grad_norm = norm;
  const float scale = clip_scale(I, res.grad_norm);
  I.not_applied = not_applied_reason(loss_sum, count, norm);
  for (int64_t u = 0; u < I.U && I.not_applied.empty(); ++u) {
    MT_RETURN_IF_ERROR(I.state->page_in(u, true));  // NVMe-resident units: read, update, write back
    update_unit(I, u, step - I.skipped, scale);
    const auto b = Clock::now();
    MT_RETURN_IF_ERROR(gather_unit_weights(I, u, Channel::kMain));
    if (I.state->sharded() || I.state->shared()) I.record(SpanKind::kWeightGather, step, u, -1, b, Clock::now(), gathered_bytes(I, u));
    MT_RETURN_IF_ERROR(I.state->page_out(u, true));
  }
  res.loss = loss_sum / static_cast<double>(count);
  res.tokens = count;
  moe_end_step(I, res);
  return {};
}

// ---- the streamed pipeline: one round of the compiled step -------------------------------------
// The caller's thread walks the round's compute ops, one small function per kind; the H2D and D2H
// threads run the round's transfers. Every wait is one of the compiled step's edges
// (megatrain/step/schedule.h): an edge to compute op k is the event recorded once the walk has
// issued op k, an edge to a transfer is that transfer's completion event, and a slot's first load
// of the round waits for the slot's last reader of the round before (the slot's own event).
class RoundRun {
 public:
  RoundRun(Trainer::Impl& I, int64_t step, int64_t round, float grad_scale)
      : I_(I), be_(*I.be), rd_(I.sched.round), slots_(step::label_slots(rd_, I.sched.B, I.carried_slots)), d_(I.d),
        step_(step), round_(round), AR_(rd_.micro_batches), j0_(I.sched.mb_of(static_cast<int32_t>(round), 0)),
        NH_(I.d.N * I.d.H), last_round_(round == I.sched.rounds - 1), grad_scale_(grad_scale) {
    grad_of_.assign(static_cast<size_t>(I.U), nullptr);
    reached_.assign(rd_.compute.size(), nullptr);
    auto mark = [&](int32_t k) {
      if (k >= 0 && reached_[static_cast<size_t>(k)] == nullptr) reached_[static_cast<size_t>(k)] = &new_event();
    };
    for (const step::Transfer& t : rd_.h2d) {
      for (int32_t k : {t.window, t.slot_freed, t.after_op, t.after_consumed}) mark(k);
      h2d_done_.push_back(&new_event());
    }
    for (const step::Transfer& t : rd_.d2h) {
      mark(t.after_op);
      d2h_done_.push_back(&new_event());
    }
  }
  RoundRun(const RoundRun&) = delete;
  RoundRun& operator=(const RoundRun&) = delete;
  // On an early return (an op's error), stop the queued jobs and wait for them: they refer to this
  // round's events.
  ~RoundRun() {
    if (armed_) drain();
  }

  // Issues the H2D queue, walks the compute ops, and waits for the round's copies (its buffers and
  // events are reused or freed by the next round).
  Status run(double& loss_sum, int64_t& count, double& stall) {
    loss_sum_ = &loss_sum;
    count_ = &count;
    stall_ = &stall;
    for (size_t i = 0; i < rd_.h2d.size(); ++i) {
      if (rd_.h2d[i].kind == step::Transfer::kWeights) post_load(i);
      else post_restore(i);
    }
    for (size_t k = 0; k < rd_.compute.size(); ++k) {
      MT_RETURN_IF_ERROR(issue(rd_.compute[k]));
      if (reached_[k] != nullptr) be_.record(kC, *reached_[k]);
    }
    I_.h2d->synchronize();
    I_.d2h->synchronize();
    I_.carried_slots = slots_.carried;
    armed_ = false;
    return {};
  }

 private:
  static constexpr StreamKind kC = StreamKind::kCompute, kH = StreamKind::kH2D, kD = StreamKind::kD2H;
  Event& new_event() { return events_.emplace_back(); }
  UnitState& unit(int64_t u) const { return I_.state->units()[static_cast<size_t>(u)]; }
  bool aborted() const {
    std::lock_guard<std::mutex> g(I_.mu);
    return I_.aborting;
  }

  Status issue(const step::Op& op) {
    switch (op.kind) {
      case step::OpKind::kAcquire: wait(*h2d_done_[static_cast<size_t>(op.transfer)], "weights", op.layer, -1); break;
      case step::OpKind::kRelease: be_.record(kC, *I_.slot_free[static_cast<size_t>(slot_of(op.load))]); break;
      case step::OpKind::kSaveCheckpoint: save_checkpoint(op); break;
      case step::OpKind::kWaitCheckpoint:
        wait(*d2h_done_[static_cast<size_t>(op.transfer)], "checkpoint_copy", op.layer, j0_ + op.mb);
        break;
      case step::OpKind::kWaitRestore: wait(*h2d_done_[static_cast<size_t>(op.transfer)], "activations", op.layer, j0_ + op.mb); break;
      case step::OpKind::kConsumed: break;  // its edge is the event recorded after it
      case step::OpKind::kBackwardBegins: zero(I_.embed_grad, unit(0).numel, "the embedding gradient"); break;
      case step::OpKind::kTakeGradBuffer: take_accumulator(op); break;
      case step::OpKind::kGradFinal: grad_final(op); break;
      case step::OpKind::kCompute: return compute(op);
    }
    return {};
  }

  // The compute stream waits for an event; a wait longer than 20 us is a stall with a reason.
  void wait(Event& e, const char* reason, int64_t layer, int64_t mb) {
    const auto a = Clock::now();
    be_.wait(kC, e);
    const auto b = Clock::now();
    const double waited = std::chrono::duration<double>(b - a).count();
    if (waited > 20e-6) {
      *stall_ += waited;
      I_.record_stall(reason, step_, layer, mb, a, b);
    }
  }
  void zero(float* p, int64_t n, const char* what) {
    I_.arena->check_view(p, n, what);
    be_.fill_zero(kC, p, n);
  }

  // ---- the H2D queue ----
  // A load waits for the prefetch window, for its slot's previous reader and for the unit's update
  // of the previous step, then copies the unit's streamed weights into its slot.
  void post_load(size_t i) {
    I_.h2d->post([this, i] {
      const step::Transfer& t = rd_.h2d[i];
      if (t.window >= 0) be_.wait(kH, *reached_[static_cast<size_t>(t.window)]);
      if (t.after_update) {
        std::unique_lock<std::mutex> l(I_.mu);
        I_.cv.wait(l, [&] { return I_.aborting || I_.nvme_failed || I_.updated_step[static_cast<size_t>(t.unit)] >= step_ - 1; });
        if (I_.aborting) return;
      }
      // The slot's previous reader: a release of this round, or the previous round's last release
      // of the slot, which its own event holds.
      const int32_t s = slot_of(t.load);
      be_.wait(kH, t.slot_freed >= 0 ? *reached_[static_cast<size_t>(t.slot_freed)] : *I_.slot_free[static_cast<size_t>(s)]);
      if (aborted()) return;
      const UnitState& us = unit(t.unit);
      float* slot = I_.slots[static_cast<size_t>(s)];
      I_.arena->check_view(slot, us.numel, "a unit's weight load");
      const auto a = Clock::now();
      be_.upload_unit(kH, us, I_.state->transfer(), slot);
      be_.synchronize(kH);
      I_.record(SpanKind::kH2D, step_, t.unit, -1, a, Clock::now(), us.numel * (I_.state->transfer() == DType::kBf16 ? 2 : 4));
      be_.record(kH, *h2d_done_[i]);
    });
  }
  // A checkpoint restore waits until backward has begun, the previous block's recompute of its
  // micro-batch has read the buffer it overwrites, and the checkpoint is in host memory.
  void post_restore(size_t i) {
    I_.h2d->post([this, i] {
      const step::Transfer& t = rd_.h2d[i];
      be_.wait(kH, *reached_[static_cast<size_t>(t.after_op)]);
      if (t.after_consumed >= 0) be_.wait(kH, *reached_[static_cast<size_t>(t.after_consumed)]);
      be_.wait(kH, *d2h_done_[static_cast<size_t>(t.after_copy)]);
      if (aborted()) return;
      const auto a = Clock::now();
      be_.copy_to_device(kH, I_.hid[0][static_cast<size_t>(t.mb)], I_.ckpt[static_cast<size_t>(t.checkpoint)][static_cast<size_t>(t.mb)], NH_);
      be_.synchronize(kH);
      I_.record(SpanKind::kH2DCheckpoint, step_, t.unit, j0_ + t.mb, a, Clock::now(), NH_ * 4);
      be_.record(kH, *h2d_done_[i]);
    });
  }

  // ---- the D2H queue ----
  // A host checkpoint: layer `unit`'s input of the micro-batch, after the op that saves it.
  void save_checkpoint(const step::Op& op) {
    const auto jj = static_cast<size_t>(op.mb);
    const float* x_in = I_.hid[cur_][jj];
    if (op.transfer < 0) {  // a device checkpoint: a copy on the compute stream
      be_.copy_on_device(kC, I_.ckpt[static_cast<size_t>(op.checkpoint)][jj], x_in, NH_);
      return;
    }
    const auto i = static_cast<size_t>(op.transfer);
    I_.d2h->post([this, i, x_in] {
      const step::Transfer& t = rd_.d2h[i];
      be_.wait(kD, *reached_[static_cast<size_t>(t.after_op)]);
      if (aborted()) return;
      const auto a = Clock::now();
      be_.copy_to_host(kD, I_.ckpt[static_cast<size_t>(t.checkpoint)][static_cast<size_t>(t.mb)], x_in, NH_);
      be_.synchronize(kD);
      I_.record(SpanKind::kD2HCheckpoint, step_, t.unit, j0_ + t.mb, a, Clock::now(), NH_ * 4);
      be_.record(kD, *d2h_done_[i]);
    });
  }
  // A unit's gradient is final for the round: copy it to the RAM tier (microbatch-major: add it
  // there after the first round), then, in the last round without clipping, update the unit.
  void grad_final(const step::Op& op) {
    const int64_t u = op.layer;
    const auto i = static_cast<size_t>(op.transfer);
    float* src;
    if (u == I_.L + 1) {
      src = I_.head_grad;
    } else if (u == 0) {
      if (d_.tied) be_.add(I_.embed_grad, I_.tied_grad, d_.V * d_.H);
      src = I_.embed_grad;
    } else {
      mark_chosen(I_, u);
      src = grad_of_[static_cast<size_t>(u)];
    }
    I_.d2h->post([this, i, u, src] {
      UnitState& us = unit(u);
      be_.wait(kD, *reached_[static_cast<size_t>(rd_.d2h[i].after_op)]);
      if (aborted()) return;
      if (!I_.grad_pool.empty()) {  // lent gradients: take a buffer (the optimizer frees them in order)
        std::unique_lock<std::mutex> l(I_.mu);
        I_.cv.wait(l, [&] { return I_.aborting || !I_.free_grads.empty(); });
        if (I_.aborting) return;
        const int k = I_.free_grads.back();
        I_.free_grads.pop_back();
        I_.grad_of[static_cast<size_t>(u)] = k;
        us.grad.view(I_.grad_pool[static_cast<size_t>(k)].data(), us.numel);
      }
      I_.arena->check_view(src, us.numel, "a unit's gradient copy to the host");
      std::string collective_failed;
      if (I_.device_sums) {
        // NCCL: this round's gradient summed between the GPUs before its copy (in microbatch-major
        // order every round's: the host then adds up sums, which is the sum of the rounds).
        const auto b = Clock::now();
        Status s = be_.sum_across_ranks(kD, src, us.numel);
        if (s.ok()) be_.synchronize(kD);
        I_.record(SpanKind::kGradSum, step_, u, I_.sched.layer_major ? -1 : round_, b, Clock::now(), us.numel * 4);
        if (!s.ok()) {
          collective_failed = "summing the gradient of unit " + std::to_string(u) + " between the GPUs failed";
          std::lock_guard<std::mutex> g(I_.mu);
          if (I_.collective_error.ok()) I_.collective_error = Status(s.code(), collective_failed + ": " + s.message());
        }
      }
      const auto a = Clock::now();
      // What the host takes: the whole gradient, or, summed by NCCL with split states, this rank's
      // range of it (with a shared state straight into the node's summed gradient).
      const auto [first, count] = I_.device_sums ? I_.state->owned_range(us) : std::pair<int64_t, int64_t>{0, us.numel};
      float* dst = (I_.device_sums && I_.state->shared() ? us.summed.data() : us.grad.data()) + first;
      // microbatch-major: the first micro-batch's gradient is copied, the others are summed into the
      // RAM tier in fp32 (the previous step's update of this unit finished before its load).
      if (I_.sched.layer_major || round_ == 0) be_.copy_to_host(kD, dst, src + first, count);
      else be_.add_to_host(kD, dst, src + first, count);
      be_.synchronize(kD);  // the host reads the gradient next, and the accumulator is free again
      I_.record(SpanKind::kD2H, step_, u, I_.sched.layer_major ? -1 : round_, a, Clock::now(), count * 4);
      be_.record(kD, *d2h_done_[i]);
      // Data parallelism: the final gradient is summed over the ranks here, on this thread, while
      // the compute stream goes on with the layers below; every rank walks the same schedule, so
      // the units are reduced in the same order everywhere. The loss is whole by now (below).
      if (last_round_ && I_.ranks() > 1) {
        const auto b = Clock::now();
        Status s = reduce_loss(I_, *loss_sum_, *count_, Channel::kGradients);
        if (s.ok()) s = reduce_unit_gradient(I_, u, Channel::kGradients, !I_.device_sums);
        if (!I_.device_sums) I_.record(SpanKind::kGradSum, step_, u, -1, b, Clock::now(), us.numel * 4);
        if (I_.state->shared()) {  // the sum is in the node's memory: a lent buffer is free again
          {
            std::lock_guard<std::mutex> g(I_.mu);
            return_lent_gradient(I_, static_cast<size_t>(u));
          }
          I_.cv.notify_all();
        }
        if (!s.ok()) {
          collective_failed = "summing the gradient of unit " + std::to_string(u) + " over the ranks failed";
          std::lock_guard<std::mutex> g(I_.mu);
          if (I_.collective_error.ok()) I_.collective_error = Status(s.code(), collective_failed + ": " + s.message());
        }
      }
      if (I_.clip || !last_round_) return;
      // Without clipping the updates overlap the backward, so the guard decides unit by unit: the
      // loss is whole by now (every head of the step ran before any gradient of its last round is
      // final), and each unit's gradient is checked before its own update. A gradient that is not
      // finite, when other units were updated already, leaves the step partly applied.
      std::string why = collective_failed;
      if (why.empty())
        why = I_.ranks() > 1 ? not_applied_reason(I_.reduced_loss_sum, I_.reduced_count, 0.0) : not_applied_reason(*loss_sum_, *count_, 0.0);
      if (why.empty()) {
        // Sharded states: each rank holds its own range of the summed gradient, so the ranks add up
        // their ranges' sums and reach the same verdict.
        const auto [begin, n] = I_.state->owned_range(us);
        double g = sum_of_squares(us.final_grad() + begin, n);
        if (I_.state->sharded())
          if (Status s = sum_over_owners(I_, &g, 1, Channel::kGradients); !s.ok()) {
            why = "summing the gradient norm of unit " + std::to_string(u) + " over the ranks failed";
            std::lock_guard<std::mutex> lk(I_.mu);
            if (I_.collective_error.ok()) I_.collective_error = Status(s.code(), why + ": " + s.message());
          }
        if (why.empty() && !std::isfinite(g))
          why = "the gradient of unit " + std::to_string(u) + " is not finite (sum of squares " + std::to_string(g) + ")";
      }
      {
        std::lock_guard<std::mutex> g(I_.mu);
        if (why.empty() && !I_.not_applied.empty()) why = I_.not_applied;  // a unit before this one was refused: none after it
        if (!why.empty() && I_.not_applied.empty()) {
          I_.not_applied = why;
          I_.partial = I_.applied_any;
        }
        I_.applied_any = I_.applied_any || why.empty();
      }
      Trainer::Impl& I = I_;
      const int64_t step = step_, opt_step = step_ - I_.skipped;
      const bool apply = why.empty();
      I_.optim->post([&I, u, step, opt_step, apply] { optimize_unit(I, u, step, opt_step, 1.0f, apply); });
    });
  }
  // A decoder layer's gradient accumulator, once the copy of its previous layer's gradient is done.
  void take_accumulator(const step::Op& op) {
    if (op.transfer >= 0) d2h_done_[static_cast<size_t>(op.transfer)]->host_wait();
    float* g = I_.grad_bufs[static_cast<size_t>(op.accumulator)];
    I_.arena->check_view(g, unit(op.layer).numel, "a layer's gradient accumulator");
    be_.fill_zero(kC, g, unit(op.layer).numel);
    grad_of_[static_cast<size_t>(op.layer)] = g;
  }

  // ---- compute ----
  int32_t slot_of(int32_t load) const { return slots_.of_load[static_cast<size_t>(load)]; }
  const float* weights(int32_t load) const { return load >= 0 ? I_.slots[static_cast<size_t>(slot_of(load))] : nullptr; }
  // Every view of weights or gradients handed to the backend is checked against its buffer.
  UnitView weights_in(int64_t u, const float* w) const {
    I_.arena->check_view(w, unit(u).numel, "a unit's weights");
    return be_.view_weights(unit(u), w);
  }
  Status compute(const step::Op& op) {
    const auto a = Clock::now();
    switch (op.span) {
      case SpanKind::kEmbedForward: MT_RETURN_IF_ERROR(embed_forward(op)); break;
      case SpanKind::kForward: MT_RETURN_IF_ERROR(forward(op)); break;
      case SpanKind::kHead: MT_RETURN_IF_ERROR(head(op)); break;
      case SpanKind::kRecompute: MT_RETURN_IF_ERROR(recompute(op)); break;
      case SpanKind::kBackward: MT_RETURN_IF_ERROR(backward(op)); break;
      case SpanKind::kEmbedBackward: MT_RETURN_IF_ERROR(embed_backward(op)); break;
      default: return internal_error("the compiled step has a compute op of kind " + std::string(span_kind_name(op.span)));
    }
    I_.record(op.span, step_, op.layer, j0_ + op.mb, a, Clock::now());
    return {};
  }
  const int32_t* inputs(int32_t mb) const { return I_.inputs[static_cast<size_t>(j0_ + mb)].data(); }
  Status embed_forward(const step::Op& op) {
    return be_.embed(weights(op.load), inputs(op.mb), I_.hid[0][static_cast<size_t>(op.mb)]);
  }
  Status forward(const step::Op& op) {
    const int64_t l = op.layer, j = op.mb;
    float* act = I_.c > 0 ? I_.acts[0] : I_.acts[static_cast<size_t>((l - 1) * AR_ + j)];
    MT_RETURN_IF_ERROR(be_.layer_forward(weights_in(l, weights(op.load)), I_.hid[cur_][static_cast<size_t>(j)],
                                         I_.hid[1 - cur_][static_cast<size_t>(j)],
                                         doc_acts(I_, moe_forward_acts(I_, be_.bind_acts(act), l, j0_ + j), j0_ + j)));
    if (j == AR_ - 1) cur_ = 1 - cur_;  // the layer is done for every micro-batch
    return {};
  }
  Status head(const step::Op& op) {
    const auto jj = static_cast<size_t>(op.mb);
    const UnitState& hu = unit(I_.L + 1);
    if (op.mb == 0) {
      zero(I_.head_grad, hu.numel, "the head gradient");
      if (d_.tied) zero(I_.tied_grad, d_.V * d_.H, "the tied head gradient");
    }
    const UnitView hv = weights_in(I_.L + 1, weights(op.load));
    const float* lm = d_.tied ? weights_in(0, weights(op.load2))[TensorRole::kEmbedding] : hv[TensorRole::kHead];
    float* dlm = d_.tied ? I_.tied_grad : I_.head_grad + hu.find(TensorRole::kHead)->offset;
    return be_.head(hv[TensorRole::kFinalNorm], lm, I_.hid[cur_][jj], I_.targets[static_cast<size_t>(j0_ + op.mb)].data(), grad_scale_,
                    I_.dhid[jj], I_.head_grad + hu.find(TensorRole::kFinalNorm)->offset, dlm, loss_sum_, count_, I_.ws);
  }
  // Layer l of a backward block again, from the block's checkpoint (restored into hid[0] when it
  // lives in host memory) or the previous layer's recomputed output.
  Status recompute(const step::Op& op) {
    const int64_t l = op.layer;
    const auto jj = static_cast<size_t>(op.mb);
    const auto [lo, hi] = rd_.blocks[static_cast<size_t>(op.block)];
    const float* x = I_.host_ckpt ? I_.hid[0][jj] : I_.ckpt[static_cast<size_t>(op.checkpoint)][jj];
    float* out = l == hi ? I_.x_scratch : I_.acts[static_cast<size_t>(l - lo + 1)];  // the next layer's acts.x
    const LayerActs acts = doc_acts(I_, be_.bind_acts(I_.acts[static_cast<size_t>(l - lo)]), j0_ + op.mb);
    return be_.layer_forward(weights_in(l, weights(op.load)), l == lo ? x : acts.x, out, acts);
  }
  Status backward(const step::Op& op) {
    const int64_t l = op.layer, j = op.mb;
    const int64_t lo = rd_.blocks[static_cast<size_t>(op.block)].first;
    float* act = I_.c > 0 ? I_.acts[static_cast<size_t>(l - lo)] : I_.acts[static_cast<size_t>((l - 1) * AR_ + j)];
    float* dx = I_.dhid[static_cast<size_t>(j)];
    float* g = grad_of_[static_cast<size_t>(l)];
    I_.arena->check_view(g, unit(l).numel, "a unit's gradient");
    return be_.layer_backward(weights_in(l, weights(op.load)), doc_acts(I_, moe_backward_acts(I_, be_.bind_acts(act), l, j0_ + j), j0_ + j), dx, dx,
                              grad_unit(unit(l), g), I_.ws);
  }
  Status embed_backward(const step::Op& op) {
    return be_.embed_backward(inputs(op.mb), I_.dhid[static_cast<size_t>(op.mb)], I_.embed_grad);
  }
  void drain() {
    {
      std::lock_guard<std::mutex> g(I_.mu);
      I_.aborting = true;
      // The NVMe tier's reads and writes of an abandoned step stop too; the tier is then out of
      // step with the weights, so later steps refuse to run (the run resumes from a checkpoint).
      if (I_.nvme_read && !I_.nvme_failed) {
        I_.nvme_failed = true;
        I_.nvme_error = internal_error("a step was abandoned midway, so the NVMe tier no longer matches the weights");
      }
    }
    I_.cv.notify_all();
    for (Event& e : events_) e.signal();
    I_.h2d->synchronize();
    I_.d2h->synchronize();
    if (I_.nvme_read) I_.nvme_read->synchronize();
    I_.optim->synchronize();
    if (I_.nvme_write) I_.nvme_write->synchronize();
    std::lock_guard<std::mutex> g(I_.mu);
    I_.aborting = false;
    for (auto& e : I_.slot_free) e->signal();
    for (size_t u = 0; u < I_.grad_of.size(); ++u) return_lent_gradient(I_, u);
  }

  Trainer::Impl& I_;
  Backend& be_;
  const step::Round& rd_;
  const step::SlotLabels slots_;  // the slot each load fills (step::label_slots)
  const Dims& d_;
  const int64_t step_, round_, AR_, j0_, NH_;
  const bool last_round_;
  const float grad_scale_;
  double* loss_sum_ = nullptr;
  int64_t* count_ = nullptr;
  double* stall_ = nullptr;
  std::deque<Event> events_;  // a deque keeps their addresses while it grows
  std::vector<Event*> reached_;  // per compute op that an edge names: recorded once the walk has issued it
  std::vector<Event*> h2d_done_, d2h_done_;
  std::vector<float*> grad_of_;  // per decoder layer: the accumulator its take op gave it this round
  int cur_ = 0;  // hid[cur_] holds the hidden state the next layer reads
  bool armed_ = true;
};

}  // namespace

Result<EvalResult> Trainer::evaluate(const DataLoader& eval) {
  Impl& I = *impl_;
  const Dims& d = I.d;
  const auto t0 = Clock::now();
  if (eval.options().seq_len != d.T || eval.options().micro_batch != d.B)
    return invalid_argument("the evaluation data is read as rows of " + std::to_string(eval.options().seq_len) + " tokens, " +
                            std::to_string(eval.options().micro_batch) + " per micro-batch; the plan's are " + std::to_string(d.T) +
                            " and " + std::to_string(d.B));
  MT_RETURN_IF_ERROR(finish_updates());
  auto units = [&](int64_t u) -> UnitState& { return I.state->units()[static_cast<size_t>(u)]; };
  const int64_t rows = eval.rows_per_epoch();
  const int64_t batches = (rows + d.B - 1) / d.B;
  // The buffers: the streamed step's device buffers (two weight slots, the ping-pong hidden states,
  // one layer's activations, the head's workspace and gradient outputs, which the next step
  // overwrites), or the in-memory loop's, whose head gradients go to scratch.
  std::vector<float*> hid0(static_cast<size_t>(I.A)), hid1(static_cast<size_t>(I.A)), dx(static_cast<size_t>(I.A));
  float *act = nullptr, *ws = nullptr, *dfn = nullptr, *dlm = nullptr;
  std::vector<float> scratch;
  const UnitState& hu = units(I.L + 1);
  if (I.opt.streamed) {
    for (int64_t j = 0; j < I.A; ++j) {
      hid0[static_cast<size_t>(j)] = I.hid[0][static_cast<size_t>(j)];
      hid1[static_cast<size_t>(j)] = I.hid[1][static_cast<size_t>(j)];
      dx[static_cast<size_t>(j)] = I.dhid[static_cast<size_t>(j)];
    }
    act = I.acts[0];
    ws = I.ws;
    dfn = I.head_grad + hu.find(TensorRole::kFinalNorm)->offset;
    dlm = d.tied ? I.tied_grad : I.head_grad + hu.find(TensorRole::kHead)->offset;
  } else {
    const ReferenceBuffers rb = reference_buffers(I);
    for (int64_t j = 0; j < I.A; ++j) {
      hid0[static_cast<size_t>(j)] = rb.xs[static_cast<size_t>(j * (I.L + 1))];
      hid1[static_cast<size_t>(j)] = rb.xs[static_cast<size_t>(j * (I.L + 1) + 1)];
      dx[static_cast<size_t>(j)] = rb.dx;
    }
    act = rb.act_buf[0];
    ws = rb.ws;
    scratch.assign(static_cast<size_t>(hu.numel + (d.tied ? d.V * d.H : 0)), 0.0f);
    dfn = scratch.data() + hu.find(TensorRole::kFinalNorm)->offset;
    dlm = d.tied ? scratch.data() + hu.numel : scratch.data() + hu.find(TensorRole::kHead)->offset;
  }
  // Where unit u's weights are for this group: slot (u % 2) of the streamed step, or the in-memory
  // loop's own copy; the head of a tied model reads the embedding from the other slot.
  auto load = [&](int64_t u, int which) -> const float* {
    float* dst = I.opt.streamed ? I.slots[static_cast<size_t>(which)] : I.reference_w[static_cast<size_t>(u)].data();
    I.be->upload_unit(StreamKind::kCompute, units(u), I.state->transfer(), dst);
    return dst;
  };
  double loss_sum = 0;
  int64_t count = 0;
  // Packed documents that attend only to themselves: each batch's document starts.
  std::vector<std::vector<int32_t>> estarts(eval.document_masked() ? static_cast<size_t>(I.A) : 0,
                                            std::vector<int32_t>(static_cast<size_t>(d.N)));
  for (int64_t g0 = 0; g0 < batches; g0 += I.A) {
    const int64_t n = std::min(I.A, batches - g0);
    for (int64_t j = 0; j < n; ++j) {
      std::vector<int32_t>& in = I.inputs[static_cast<size_t>(j)];
      std::vector<int32_t>& tg = I.targets[static_cast<size_t>(j)];
      MT_RETURN_IF_ERROR(eval.fill(g0 + j, 0, in.data(), tg.data(), estarts.empty() ? nullptr : estarts[static_cast<size_t>(j)].data()));
      // The last batch's rows past the end of the set come round again from its start: not counted.
      for (int64_t b = 0; b < d.B; ++b)
        if ((g0 + j) * d.B + b >= rows) std::fill(tg.begin() + b * d.T, tg.begin() + (b + 1) * d.T, -1);
    }
    const float* w = load(0, 0);
    for (int64_t j = 0; j < n; ++j) MT_RETURN_IF_ERROR(I.be->embed(w, I.inputs[static_cast<size_t>(j)].data(), hid0[static_cast<size_t>(j)]));
    bool cur0 = true;
    for (int64_t l = 1; l <= I.L; ++l) {
      w = load(l, static_cast<int>(l % 2));
      for (int64_t j = 0; j < n; ++j) {
        float* x = cur0 ? hid0[static_cast<size_t>(j)] : hid1[static_cast<size_t>(j)];
        float* y = cur0 ? hid1[static_cast<size_t>(j)] : hid0[static_cast<size_t>(j)];
        LayerActs a = moe_forward_acts(I, I.be->bind_acts(act), l, j);
        if (!estarts.empty()) a.doc_starts = estarts[static_cast<size_t>(j)].data();
        MT_RETURN_IF_ERROR(I.be->layer_forward(I.be->view_weights(units(l), w), x, y, a));
      }
      cur0 = !cur0;
    }
    const int hs = static_cast<int>((I.L + 1) % 2);
    const UnitView hv = I.be->view_weights(hu, load(I.L + 1, hs));
    const float* lm = d.tied ? I.be->view_weights(units(0), load(0, 1 - hs))[TensorRole::kEmbedding] : hv[TensorRole::kHead];
    for (int64_t j = 0; j < n; ++j)
      MT_RETURN_IF_ERROR(I.be->head(hv[TensorRole::kFinalNorm], lm, cur0 ? hid0[static_cast<size_t>(j)] : hid1[static_cast<size_t>(j)],
                                    I.targets[static_cast<size_t>(j)].data(), 0.0f, dx[static_cast<size_t>(j)], dfn, dlm, &loss_sum, &count,
                                    ws));
    I.be->synchronize(StreamKind::kCompute);
  }
  // The next step must reload every unit's weights: the slots no longer hold what the step left there.
  I.last_step = -1;
  EvalResult r;
  r.loss = count > 0 ? loss_sum / static_cast<double>(count) : std::numeric_limits<double>::quiet_NaN();
  if (I.opt.record_trace && !I.steps.empty()) I.steps.back().eval_loss = r.loss;  // the loss after the last step's update
  r.tokens = count;
  r.rows = rows;
  r.time_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

Result<StepResult> Trainer::run_step(int64_t step) {
  Impl& I = *impl_;
  const auto step_start = Clock::now();
  StepResult res;
  res.step = step;
  if (I.last_step < 0 || step != I.last_step + 1) {
    // A fresh Trainer may start at any step (a resumed run), and a caller may skip steps: once the
    // updates in flight are done, every unit counts as up to date for `step`. Consecutive steps
    // instead let this step's loads wait, unit by unit, for the previous step's updates.
    if (I.nvme_read) I.nvme_read->synchronize();
    if (I.optim) I.optim->synchronize();
    if (I.nvme_write) I.nvme_write->synchronize();
    std::lock_guard<std::mutex> g(I.mu);
    for (int64_t& u : I.updated_step) u = std::max(u, step - 1);
    for (int64_t& u : I.written_step) u = std::max(u, step - 1);
  }
  {
    std::lock_guard<std::mutex> g(I.mu);
    if (I.nvme_failed) return Status(I.nvme_error.code(), "the NVMe tier failed earlier: " + I.nvme_error.message());
  }
  I.last_step = step;
  {
    std::lock_guard<std::mutex> g(I.mu);
    I.not_applied.clear();
    I.partial = I.applied_any = false;
  }
  // The guard's verdict, once the step has decided it (its updates may still be running).
  auto verdict = [&I](StepResult& r) {
    std::lock_guard<std::mutex> g(I.mu);
    r.applied = I.not_applied.empty();
    r.not_applied = I.not_applied;
    r.state_intact = !I.partial;
    if (!r.applied) ++I.skipped;
  };
  for (int64_t j = 0; j < I.A; ++j)
    MT_RETURN_IF_ERROR(I.data->fill(step, j, I.inputs[static_cast<size_t>(j)].data(), I.targets[static_cast<size_t>(j)].data(),
                                    I.starts.empty() ? nullptr : I.starts[static_cast<size_t>(j)].data()));
  // The loss is the mean over the step's counted targets (a prepared dataset's mask leaves prompts
  // and padding out as -1), as transformers' Trainer divides by the items in the whole batch: so
  // the gradient is scaled by one over their number, not over every token.
  int64_t counted = 0;
  for (int64_t j = 0; j < I.A; ++j)
    for (int32_t t : I.targets[static_cast<size_t>(j)]) counted += t >= 0;
  // With several ranks, over all of them: each rank's gradient is its share of the step's mean.
  {
    std::lock_guard<std::mutex> g(I.mu);
    I.loss_reduced = false;
  }
  if (I.ranks() > 1) {
    if (Status s = I.opt.comm->sum(&counted, 1, Channel::kMain); !s.ok())
      return Status(s.code(), "step " + std::to_string(step) + ": counting the targets of every rank failed: " + s.message());
  }
  const float grad_scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  moe_begin_step(I);
  double loss_sum = 0;
  int64_t count = 0;
  if (!I.opt.streamed) {
    MT_RETURN_IF_ERROR(reference_step(I, step, grad_scale, res));
    verdict(res);
    res.time_s = std::chrono::duration<double>(Clock::now() - step_start).count();
    return res;
  }

  // ---- the streamed pipeline -----------------------------------------------------------------------
  // layer-major: one round with every micro-batch, weights cross the link twice per step.
  // microbatch-major: one round per micro-batch, weights cross twice per micro-batch, gradients are
  // summed on the host, and the updates wait for the last round.
  double stall = 0;
  // The NVMe tier's reads of this step, issued now in the optimizer's order: the staging buffers
  // bound how far ahead they run, and the forward pass overlaps them.
  if (I.nvme_read)
    for (int64_t u : I.sched.optimizer_order) I.nvme_read->post([&I, u, step] { nvme_read_unit(I, u, step); });
  for (int64_t round = 0; round < I.sched.rounds; ++round) {
    RoundRun run(I, step, round, grad_scale);
    MT_RETURN_IF_ERROR(run.run(loss_sum, count, stall));
  }
  I.h2d->synchronize();
  I.d2h->synchronize();
  if (I.ranks() > 1) {
    std::lock_guard<std::mutex> g(I.mu);
    if (!I.collective_error.ok()) return Status(I.collective_error.code(), "step " + std::to_string(step) + ": " + I.collective_error.message());
    loss_sum = I.reduced_loss_sum;
    count = I.reduced_count;
  }
  if (I.clip) {
    // Every update waits for the global norm: the cost of clipping is losing the overlap of the
    // optimizer with backward (docs/executor.md).
    const auto a = Clock::now();
    MT_ASSIGN_OR_RETURN(res.grad_norm, global_norm(I, Channel::kMain));
    I.record(SpanKind::kGradNorm, step, -1, -1, a, Clock::now());
    const float scale = clip_scale(I, res.grad_norm);
    I.not_applied = not_applied_reason(loss_sum, count, res.grad_norm);
    const bool apply = I.not_applied.empty();
    const int64_t opt_step = step - I.skipped;
    for (int64_t u : I.sched.optimizer_order)
      I.optim->post([&I, u, step, opt_step, scale, apply] { optimize_unit(I, u, step, opt_step, scale, apply); });
  }
  // The updates may still be running: the next step's loads wait for them unit by unit, so its
  // forward overlaps the optimizer's tail. wait_for_updates() (checkpoints, the end of a run) and
  // the destructor wait for all of them.
  {
    std::lock_guard<std::mutex> g(I.mu);
    if (I.nvme_failed) return Status(I.nvme_error.code(), "step " + std::to_string(step) + ": " + I.nvme_error.message());
  }
  res.loss = loss_sum / static_cast<double>(count);
  res.tokens = count;
  moe_end_step(I, res);
  verdict(res);
  res.stall_s = stall;
  res.time_s = std::chrono::duration<double>(Clock::now() - step_start).count();
  if (I.opt.record_trace) {
    std::lock_guard<std::mutex> g(I.trace_mu);
    I.steps.push_back(TraceStep{step, res.loss, res.tokens, res.time_s, res.aux_loss});
  }
  return res;
}

int64_t Trainer::skipped_steps() const { return impl_->skipped; }
void Trainer::set_skipped_steps(int64_t n) { impl_->skipped = n; }

Status Trainer::write_trace(const std::filesystem::path& path, const std::string& plan_json) const {
  const Impl& I = *impl_;
  if (I.optim) I.optim->synchronize();  // the optimizer's last spans
  MT_ASSIGN_OR_RETURN(auto w, TraceWriter::create(path, {{"source", "measured"}, {"plan", plan_json}, {"backend", I.be->name()}}));
  std::vector<int64_t> lane(kLaneCount, -1);
  const int lanes = I.state->on_nvme() ? kLaneCount : static_cast<int>(Lane::kNvmeRead);  // NVMe lanes only with an NVMe tier
  for (int k = 0; k < lanes; ++k) {
    MT_ASSIGN_OR_RETURN(lane[static_cast<size_t>(k)], w->add_lane(lane_name(static_cast<Lane>(k)), lane_kind(static_cast<Lane>(k))));
  }
  for (const Span& s : I.spans)
    MT_RETURN_IF_ERROR(w->add_span(TraceSpan{lane[static_cast<size_t>(s.lane)], s.name, span_kind_name(s.kind), s.step, s.layer,
                                             s.mb, s.start_ns, std::max(s.start_ns, s.end_ns), s.bytes, s.flops}));
  for (const TraceStep& s : I.steps) MT_RETURN_IF_ERROR(w->add_step(s));
  // Memory is allocated once, at start-up: each tier is flat over the run.
  const MemoryInUse m = memory_in_use();
  const int64_t end = I.spans.empty() ? 0 : I.spans.back().end_ns;
  for (int64_t t : {int64_t{0}, end}) {
    MT_RETURN_IF_ERROR(w->add_counter({"bytes.device", t, static_cast<double>(m.device)}));
    MT_RETURN_IF_ERROR(w->add_counter({"bytes.pinned", t, static_cast<double>(m.pinned)}));
    MT_RETURN_IF_ERROR(w->add_counter({"bytes.ram", t, static_cast<double>(m.ram)}));
    if (I.state->on_nvme()) MT_RETURN_IF_ERROR(w->add_counter({"bytes.nvme", t, static_cast<double>(m.nvme)}));
  }
  return w->close();
}

}  // namespace megatrain::exec

// The compiled step: one description of a training step that the simulator, the planner and the
// executor share (ARCHITECTURE.md section 4). compile() turns a plan and a model into the ordered
// work of one step on each of the pipeline's queues, and footprint() gives the bytes each memory
// tier holds while it runs. The simulator adds costs to the schedule and runs it on its engine;
// the trainer walks the same lists and issues backend calls; the planner's search and every
// budget check call the same footprint. Nothing here knows about time or about a backend's code:
// a backend is described by its ActivationLayout (what it keeps, in bytes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/buffers/shape.h"
#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/core/trace_vocab.h"

namespace megatrain::step {

enum class BackendKind : int8_t { kCpu, kCuda };
const char* backend_name(BackendKind b);  // "cpu" | "cuda"
// The backend a rig profile describes: the CPU backend's rigs (gpu.name "CPU backend ...", or a
// host-memcpy link) or a CUDA GPU.
BackendKind backend_of_rig(const HardwareProfile& rig);

// What a backend keeps on the device for one micro-batch, in bytes, and how it carves its arena.
struct ActivationLayout {
  BackendKind backend = BackendKind::kCpu;
  int64_t hidden_floats = 0;        // one micro-batch's hidden state (the fp32 residual stream)
  int64_t layer_act_floats = 0;     // one layer's kept activations (eager attention keeps T x T probabilities)
  int64_t layer_workspace_floats = 0;
  int64_t head_workspace_floats = 0;
  int64_t private_bytes = 0;        // the backend's own region of the arena (cuBLAS, attention blocks, tokens)
  bool eager_attention = true;      // CPU: softmax probabilities kept; CUDA: fused, log-sum-exp only
  bool arena_in_ram = true;         // the CPU backend's "device" is host memory
  int64_t carve_align = 64;         // every buffer carved from the arena is rounded up to this
  int64_t arena_align = 64;         // the pipeline's part of the arena is rounded up to this
  int64_t workspace_floats() const { return std::max(layer_workspace_floats, head_workspace_floats); }
};
// The CPU backend's layout (executor/src/model.cpp binds the activations in this order).
ActivationLayout cpu_layout(const ModelSpec& model, int64_t micro_batch, int64_t seq_len);
// The CUDA backend's layout for a compute dtype (fp32 or bf16; executor/src/cuda/cuda_backend.cpp),
// with the tests' caps on its blocking (buffers::BlockCaps; none by default).
ActivationLayout cuda_layout(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, DType compute,
                             const buffers::BlockCaps& caps = {});
ActivationLayout layout_for(BackendKind backend, const ModelSpec& model, const Plan& plan, const buffers::BlockCaps& caps = {});

// Device memory the CUDA runtime keeps outside the arena (context, module images, allocator
// slack): min(1 GiB, memory / 16). The CPU backend has none.
int64_t device_context_reserve(BackendKind backend, int64_t device_memory_bytes);
// The device budget a plan for this rig may fill: the rig's GPU memory less the context reserve.
int64_t usable_device_bytes(const HardwareProfile& rig);
// The budget a plan enforces: placement.device_budget_bytes, or the rig's usable bytes when 0.
int64_t device_budget_of(const Plan& plan, const HardwareProfile& rig);

// ---- the schedule ------------------------------------------------------------------------------

// The waits are compiled with the work (docs/compiled-step.md): every transfer and every op that
// waits names what it waits for as an index into the round's lists, and the trainer and the
// simulator both interpret these edges. An edge to compute op k means "the compute stream has
// issued op k, and the work issued up to it is complete".

// One copy between host and device, in its queue's order: the H2D queue holds the weight loads and
// the checkpoint restores, the D2H queue the gradients and the host checkpoints.
struct Transfer {
  enum Kind : int8_t { kWeights, kRestore, kGradient, kCheckpoint } kind = kWeights;
  int32_t unit = 0;        // kWeights, kGradient: the unit; kRestore, kCheckpoint: the block's first layer / the layer whose input it keeps
  int32_t load = -1;       // kWeights: its index among the round's loads
  int32_t block = -1;      // kRestore: the backward block
  int32_t checkpoint = -1; // kRestore: the checkpoint it reads; kCheckpoint: the one it writes
  int32_t mb = -1;         // kRestore, kCheckpoint: the micro-batch (within the round)
  // kWeights: the compute op (the acquire of load - K) that opens the prefetch window, or -1; the
  // release op whose slot it fills, or -1 for the first B loads of a round, which fill the slots
  // that the previous round's last releases gave back (label_slots); and it waits for the previous
  // step's update of its unit.
  int32_t window = -1;
  int32_t slot_freed = -1;
  bool after_update = false;
  // kRestore: the ops "backward has begun" and "the previous block's first recompute of mb has
  // read the buffer" (-1 for the first block), and the D2H copy of the checkpoint it reads.
  // kGradient, kCheckpoint: `after_op` is the op whose result it copies.
  int32_t after_op = -1;
  int32_t after_consumed = -1;
  int32_t after_copy = -1;
  int32_t accumulator = -1;  // kGradient of a decoder layer: the gradient accumulator it frees
};

// One step of the compute stream's walk, in issue order.
enum class OpKind : int8_t {
  kAcquire,         // wait for H2D `transfer` (load `load`); issuing it opens the prefetch window
  kRelease,         // load `load`'s slot may be refilled once the ops issued so far are done
  kCompute,         // `span` (embed, forward, head, recompute, backward, embed backward) of `layer`, `mb`
  kSaveCheckpoint,  // keep layer `layer`'s input of `mb`: a device copy, or D2H `transfer` into host memory
  kWaitCheckpoint,  // host checkpoints: wait for D2H `transfer` (checkpoint `checkpoint` of `mb`)
  kWaitRestore,     // host checkpoints: wait for H2D `transfer` (restore `block` of `mb`)
  kConsumed,        // the block's first recompute of `mb` has read the restored buffer
  kBackwardBegins,  // the head is done: restores may start
  kTakeGradBuffer,  // gradient accumulator `accumulator` for `layer`, once D2H `transfer` (its previous
                    // layer's gradient) is done, or at once when `transfer` is -1
  kGradFinal,       // unit `layer`'s gradient is final for the round: D2H `transfer` (then, last round, update)
};
struct Op {
  OpKind kind = OpKind::kCompute;
  SpanKind span = SpanKind::kForward;  // kCompute
  int32_t layer = -1;                  // the unit (0 embedding, 1..L layers, L+1 head)
  int32_t mb = -1;                     // within the round
  int32_t load = -1;                   // kAcquire/kRelease; kCompute: the load whose weights it reads
  int32_t load2 = -1;                  // kCompute of a tied head: the table's load
  int32_t checkpoint = -1;             // kSaveCheckpoint/kWaitCheckpoint; kRecompute: the checkpoint its block starts from
  int32_t block = -1;                  // kWaitRestore/kConsumed; kRecompute/kBackward: the backward block
  int32_t transfer = -1;               // the H2D or D2H transfer it waits for or issues (see OpKind)
  int32_t accumulator = -1;            // kTakeGradBuffer
};

// The round: layer-major has one with every micro-batch; microbatch-major one per micro-batch,
// all alike, so one Round describes each of them (micro-batch j of round r is r + j). A round
// starts with every gradient accumulator free (the executor drains its copy queues between
// rounds); its first loads wait for the slots the previous round's last releases give back.
struct Round {
  int32_t micro_batches = 1;
  std::vector<int32_t> loads;       // unit of each load, in issue order
  int32_t backward_first_load = 0;  // loads before it are the forward pass's
  std::vector<Transfer> h2d;        // the H2D queue: loads and restores
  std::vector<Transfer> d2h;        // the D2H queue: gradients and host checkpoints
  std::vector<Op> compute;          // the compute stream
  std::vector<std::pair<int32_t, int32_t>> blocks;  // backward blocks (lo, hi), last first
};

struct Buffers {  // what the pipeline carves from the device arena, in floats
  int64_t slots = 0, slot_floats = 0;            // weight buffers, each the largest unit
  int64_t hidden = 0, hidden_floats = 0;         // hid[0], hid[1], dhid per resident micro-batch
  int64_t checkpoints = 0;                       // device checkpoints (of hidden_floats)
  int64_t act_sets = 0, act_floats = 0;          // kept activations
  int64_t grad_sets = 0, grad_floats = 0;        // per-layer gradient accumulators
  int64_t embed_grad = 0, head_grad = 0, tied_grad = 0;
  int64_t workspace = 0, scratch = 0;            // layer/head workspace; the last layer's output
};

struct StepSchedule {
  int32_t L = 0, U = 0, A = 0;          // layers, units (L + 2), micro-batches per step
  int32_t K = 1, B = 2, c = 1;          // prefetch depth, device layer buffers, checkpoint interval
  int32_t resident_mbs = 1;             // micro-batches on the device at once (A layer-major, 1 otherwise)
  int32_t rounds = 1;
  int32_t checkpoints_per_mb = 0;       // ceil(L / c), 0 without recompute
  bool layer_major = true, clip = false, tied = false, host_checkpoints = false;
  bool master_nvme = false, states_nvme = false;
  bool transfer_bf16 = true;            // the streaming copy is bf16 (else the fp32 master streams)
  StateFormat m_format = StateFormat::kFp32, v_format = StateFormat::kFp32;
  int64_t block_size = 128;             // quantised moments' block
  int64_t nvme_block_bytes = 1 << 20;   // the NVMe store's request size (regions are whole blocks)
  int32_t lent_gradients = 0;           // 0: every unit has its host gradient; else the pool's size
  // parallel.collective nccl with sharded or shared states: each rank copies 1/grad_share of every
  // gradient to the host (copies_gradient_share), and with a shared state (node_gradients) into the
  // node's memory, keeping no host gradient of its own (gradients_in_node_memory).
  int32_t grad_share = 1;
  bool node_gradients = false;
  int32_t staging_buffers = 0;          // NVMe staging buffers (whole units)
  int64_t tokens_per_mb = 0;
  bool documents = false;               // rows packed "neat": the loader keeps each token's document start too
  std::vector<int64_t> unit_numel;      // per unit, as HostState lays them out (unit_layout: gaps included)
  std::vector<std::vector<int64_t>> unit_tensor_numels;
  Round round;
  std::vector<int32_t> optimizer_order; // units, as the optimizer takes them (and NVMe reads them)
  Buffers buffers;
  ActivationLayout layout;
  int32_t mb_of(int32_t round_index, int32_t mb) const { return layer_major ? mb : round_index; }
};

// Lent gradients (a small pool of host gradient buffers instead of one per unit) are possible in
// layer-major order without clipping on the streamed pipeline, where no gradient outlives its own
// update; megatrain-exec lends them whenever the plan allows it.
bool lends_gradients(const Plan& plan, bool streamed = true);
// parallel.collective nccl with the optimizer states split between ranks (sharded, or shared by a
// node's ranks): the GPUs sum each gradient, and each rank copies only its own range of the sum to
// the host, state_shard_ranks(plan.parallel) of them making the whole (docs/data-parallel.md).
bool copies_gradient_share(const Plan& plan);
// parallel.collective nccl with a shared host state: the rank's range of the GPUs' sum goes straight
// into the node's summed gradient, and the rank keeps no host gradient at all (no array per unit,
// nothing lent).
bool gradients_in_node_memory(const Plan& plan);
inline constexpr int32_t kLentGradientBuffers = 3;

// Each unit's tensor sizes (megatrain::unit_tensor_numels of the model). compile() groups the
// model's tensors itself; a caller that compiles one model many times (the planner sizes thousands
// of candidates, and a Mixture-of-Experts model has tens of thousands of tensors) groups them once
// and passes them in.
struct UnitTable {
  std::vector<std::vector<int64_t>> tensor_numels;
};
UnitTable unit_table(const ModelSpec& model);

struct CompileOptions {
  bool ops = true;  // false: only the shape, buffers and layout (what footprint() needs), cheaply
  bool lent_gradients = true;  // follow lends_gradients(plan) (the executor's choice)
  const UnitTable* units = nullptr;  // the model's unit_table(), or null to group the tensors here
};
Result<StepSchedule> compile(const Plan& plan, const ModelSpec& model, const ActivationLayout& layout,
                             const CompileOptions& options = {});

// The device layer buffers (slots) free for loading form a queue: the B slots a round starts with
// (`carried`, in order; 0 .. B-1 in the first round of a run), then each slot as a release op
// gives it back. Load n takes the queue's n-th slot, which is what its `slot_freed` edge says: the
// first B loads take the carried slots, load n >= B the slot of the load that release number
// n - B gives back. The slots left in the queue after the round's loads are the next round's
// `carried`. This is the timing of B interchangeable buffers, with each one named; the trainer and
// the simulator both label their slots with it.
struct SlotLabels {
  std::vector<int32_t> of_load;  // the slot each load of the round fills
  std::vector<int32_t> carried;  // what the next round starts with
};
SlotLabels label_slots(const Round& round, int32_t B, const std::vector<int32_t>& carried);
std::vector<int32_t> first_slots(int32_t B);  // 0 .. B-1

// The round's edges are well formed and the three queues, each in order, run to the end: every
// index is in range, load n >= B waits for release number n - B, an accumulator is taken after
// the copy that gives it back, and no queue waits for work that could only come after it (a deadlock).
// compile() checks what it builds; the error names the first queue position that can never start.
Status check_edges(const StepSchedule& schedule);

// ---- the footprint -----------------------------------------------------------------------------

struct TierBytes {
  int64_t device = 0;   // the arena: the pipeline's buffers and the backend's private region
  int64_t pinned = 0;   // host memory the copies read or write, page-locked on the CUDA backend
  int64_t ram = 0;      // all host memory of the training state and the pipeline (pinned included)
  int64_t nvme = 0;     // reserved on the drives
};
struct Footprint {
  TierBytes peak;
  // The parts, for messages and the simulator's report.
  int64_t device_slots = 0, device_hidden = 0, device_checkpoints = 0, device_activations = 0, device_gradients = 0,
          device_workspace = 0, device_private = 0;
  int64_t ram_state = 0, ram_staging = 0, ram_checkpoints = 0, ram_gradients = 0, ram_arena = 0, ram_data = 0;
  std::string device_parts() const;  // "layer buffers 12 MiB, hidden states 3 MiB, ..."
};
Footprint footprint(const StepSchedule& schedule, const ActivationLayout& layout);

// What footprint() depends on, as plan fields, for one model and one backend: `device` decides the
// device arena, `host` the pinned, RAM (less the arena, which is RAM on the CPU backend) and NVMe
// figures. Plans whose keys are equal have equal figures, so the planner memoises the two halves on
// them instead of compiling each candidate; tests/step/footprint_key_test.cpp changes every field
// of a plan's file in turn and checks it. A new plan field that compile() or footprint() reads
// belongs here.
struct FootprintKeys {
  std::vector<int64_t> device, host;
};
FootprintKeys footprint_keys(const Plan& plan);

// The capacities a footprint must fit: the plan's device budget, the rig's pinnable memory, RAM
// and drives. The first tier over its capacity is an error naming the tier, both byte counts and
// what would be accepted; `who` starts the message ("simulate", "megatrain-exec").
struct TierCapacity {
  int64_t device = 0, pinned = 0, ram = 0, nvme = 0;
};
// A plan for several ranks on a rig with a cluster section gets one rank's share of its node: the
// pinnable memory, RAM and drives divided by parallel.ranks_per_node (docs/cost-model.md).
TierCapacity capacity_of(const Plan& plan, const HardwareProfile& rig);
// The ranks of such a plan share their node's host: the divisor capacity_of applies (1 otherwise).
int64_t ranks_sharing_host(const Plan& plan, const HardwareProfile& rig);
Status check_fits(const Footprint& f, const TierCapacity& cap);
// Sharded optimizer states (parallel.host_state sharded, or shared over a node's ranks): the bytes of
// Adam's moments a rank does not keep, against the footprint's whole-model figure: all of them less
// those of the rank that keeps the most (core's shard_owners over state_shard_ranks). 0 for other
// plans. They come off the tier the states are on.
int64_t sharded_moment_saving(const Plan& plan, const ModelSpec& model);
// A shared host state (node_shares_host_state): the bytes of the node's shared memory, per unit (its
// unit_layout extent) its fp32 master weights, its streaming copy when the transfer is bf16, and its
// summed gradient, each on a 4096-byte page. HostState lays the memory out so.
int64_t node_shared_state_bytes(const std::vector<int64_t>& unit_numels, bool transfer_bf16);
// One rank's footprint from the whole-model figure: the sharded moments taken off, and with a shared
// host state the master weights and streaming copy replaced by the rank's share (1/ranks_per_node)
// of the node's shared memory. What the simulator reports and the executor checks.
void take_rank_share(Footprint& fp, const Plan& plan, const ModelSpec& model);

}  // namespace megatrain::step

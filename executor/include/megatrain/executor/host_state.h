// The RAM tier (ARCHITECTURE.md section 6): the training state of every unit (embedding, each
// decoder layer, head) laid out per unit so that one unit is one contiguous transfer: fp32 master
// weights, fp32 gradients, Adam m and v, and the streaming copy in the transfer dtype. Tensors
// keep their HF names, shapes and state-dict order inside their unit.
//
// The NVMe tier (issue 9): with an NvmePlacement, a unit's fp32 master weights and/or its Adam
// moments live in a region of an NvmeStore (nvme_store.h) instead of RAM, laid out as in RAM
// (each array starting on a 4096-byte boundary). Such a unit's arrays are empty until page_in()
// binds them to one of a bounded pool of staging buffers (and reads the region into it);
// page_out() writes the region back and frees the buffer. The streaming copy and the gradients
// always stay in RAM, so the loads to the device never wait for the drive.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/aligned_array.h"
#include "megatrain/executor/communicator.h"
#include "megatrain/executor/moments.h"
#include "megatrain/executor/nvme_store.h"

namespace megatrain::exec {

struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  TensorRole role = TensorRole::kEmbedding;
  int64_t offset = 0;  // elements from the start of the unit
  int64_t numel = 0;
  bool decay = true;   // AdamW weight decay applies (not to norms and biases, as HF Trainer does)
  int64_t expert = -1; // the expert of a per-expert tensor (TensorInfo::expert)
  int64_t layer = -1;  // the decoder layer (TensorInfo::layer); -1 for the embedding, final norm and head
  int owner = 0;       // sharded states: the rank that keeps its moments and updates it (shard_owners)
};

struct UnitState {
  std::vector<TensorSlot> tensors;
  int64_t numel = 0;
  AlignedArray<float> master, grad;
  MomentStore m, v;  // Adam's moments in the plan's state formats (moments.h)
  AlignedArray<uint16_t> stream_bf16;  // the copy streamed to the device when transfer is bf16
  // Per-expert tensors (Mixtral, Qwen3-MoE): how many AdamW updates each expert has had. An expert
  // that no token of a step chose has no gradient in that step, and torch.optim.AdamW skips such a
  // parameter (no decay, no moment update, its step count unchanged); the optimizer does the same
  // and corrects each expert's bias with its own count. Empty for units without such tensors.
  std::vector<int64_t> expert_steps;
  // Sharded states: the unit's elements in consecutive ranges, shard_elems[r] for rank r (gaps
  // included), each rank's range covering the tensors it owns; one range of all when not sharded.
  std::vector<int64_t> shard_elems;
  // Shared host state: the gradient summed over the ranks, in the node's shared memory (each range
  // written by its owner); empty otherwise, when the sum is made in `grad` itself.
  AlignedArray<float> summed;
  float* final_grad() { return summed.size() > 0 ? summed.data() : grad.data(); }
  const float* final_grad() const { return summed.size() > 0 ? summed.data() : grad.data(); }
  const TensorSlot* find(TensorRole role) const;
};

// Which rank this process is among the ranks that share the optimizer states (parallel.host_state
// sharded, docs/data-parallel.md); ranks 1 is the unsharded state.
struct StateSharding {
  int rank = 0;
  int ranks = 1;
  // parallel.host_state shared: the job's communicator, through which the node's ranks map one copy
  // of the master weights, the streaming copy and the summed gradients; rank and ranks are then this
  // rank's place among its node's (Communicator::local_rank, local_size).
  Communicator* node = nullptr;
};

// Where the NVMe tier keeps what (the plan's placement section).
struct NvmePlacement {
  bool master = false;        // fp32 master weights on NVMe (the streaming copy must be bf16)
  bool states = false;        // Adam's m and v on NVMe
  NvmeStoreOptions store;     // directories, queue depth, block size
  int64_t staging_bytes = 0;  // the staging pool: as many whole-unit buffers as fit, at least one
};
// The NVMe placement a plan's placement section asks for (megatrain-exec and the tests build the
// HostState from it).
NvmePlacement nvme_placement_of(const PlacementConfig& placement);

class HostState {
 public:
  HostState();
  ~HostState();
  HostState(HostState&&) noexcept;
  HostState& operator=(HostState&&) noexcept;

  // Units: 0 = embedding, 1..L = decoder layers, L+1 = head (final norm, and lm_head unless tied).
  // m and v are kept in the given state formats (moments.h), quantised in blocks of block_size.
  static HostState create(const ModelSpec& model, DType transfer, StateFormat m_format = StateFormat::kFp32,
                          StateFormat v_format = StateFormat::kFp32, int64_t block_size = 128);
  // The same with the parts `nvme` names on NVMe. Errors: a bad directory, a drive too small
  // (nvme_store.h), master weights on NVMe with an fp32 streaming copy, no placement at all.
  // all_gradients = false: the units get no gradient arrays; the streamed trainer lends each unit
  // one from a small pool between its gradient's copy to the host and its update (layer-major
  // without clipping, where no gradient is needed after its own update), which saves 4 bytes per
  // parameter of RAM.
  // With sharding, every rank keeps every master weight, gradient and streaming copy, but Adam's m
  // and v (in RAM or on NVMe) only of the tensors it owns (TensorSlot::owner); the other tensors'
  // moments are empty (zero elements). With sharding.node (a shared host state), the master weights,
  // the streaming copy and the summed gradients (UnitState::summed) of every unit are views of one
  // SharedMemory the node's ranks map (a collective call), and master weights on NVMe are refused.
  static Result<HostState> create(const ModelSpec& model, DType transfer, StateFormat m_format, StateFormat v_format,
                                  int64_t block_size, const NvmePlacement& nvme, bool all_gradients = true,
                                  StateSharding sharding = {});
  const StateSharding& sharding() const { return sharding_; }
  bool sharded() const { return sharding_.ranks > 1; }
  // The node's ranks share the master weights, streaming copy and summed gradients.
  bool shared() const { return sharding_.node != nullptr; }
  // This rank writes the weights when they are set whole (initialisation, loading): with a shared
  // state only the node's first rank does, and the node's ranks meet at a barrier after it.
  bool writes_weights() const { return !shared() || sharding_.rank == 0; }
  // The node's shared memory (null when not shared).
  const SharedMemory* shared_memory() const { return shared() ? &shm_ : nullptr; }
  // This rank keeps the moments of tensor t and updates it.
  bool owns(const TensorSlot& t) const { return t.owner == sharding_.rank; }
  // The elements of unit us (first, count) whose summed gradient this rank holds and whose tensors it
  // updates: all of them, or with sharded states its own range (UnitState::shard_elems).
  std::pair<int64_t, int64_t> owned_range(const UnitState& us) const {
    if (!sharded()) return {0, us.numel};
    int64_t begin = 0;
    const auto rank = static_cast<size_t>(sharding_.rank);
    for (size_t r = 0; r < rank; ++r) begin += us.shard_elems[r];
    return {begin, us.shard_elems[rank]};
  }
  bool all_gradients() const { return all_gradients_; }
  // HF initialisation: matrices and the embedding ~ N(0, std), norms 1, biases 0; a counter-based
  // generator keyed by (seed, tensor name) makes it independent of thread count and layout.
  // NVMe-resident units are paged in one at a time, set, and written back (with zero moments).
  Status init_random(uint64_t seed, double std);
  // Refreshes the streaming copy from the master weights (after init or load).
  Status refresh_stream();

  std::vector<UnitState>& units() { return units_; }
  const std::vector<UnitState>& units() const { return units_; }
  int64_t num_layers() const { return static_cast<int64_t>(units_.size()) - 2; }
  DType transfer() const { return transfer_; }
  bool tied() const { return tied_; }
  // Bytes of host memory this state occupies (with the staging pool).
  int64_t bytes() const;
  // The bytes of Adam's moments this state keeps (in RAM or on NVMe); and what they would be unsharded.
  int64_t moment_bytes() const;
  int64_t unsharded_moment_bytes() const;

  // ---- the NVMe tier ------------------------------------------------------------------------------
  bool master_on_nvme() const;
  bool states_on_nvme() const;
  bool on_nvme() const { return master_on_nvme() || states_on_nvme(); }
  const NvmeStore* nvme_store() const;
  int64_t nvme_bytes() const;      // reserved on the drives
  int64_t staging_buffers() const;
  int64_t free_staging_buffers() const;  // page_in returns without waiting while this is > 0
  int64_t staging_bytes() const;   // the pool's RAM
  // Binds unit u's NVMe-resident arrays to a free staging buffer (waiting for one), then reads
  // the unit from the drive (read) or zero-fills it (the caller sets every value). Units held in
  // RAM need nothing: both calls return at once. A unit is paged in by one caller at a time.
  Status page_in(int64_t u, bool read);
  // Writes unit u back to the drive (write) and frees its buffer; its arrays are empty again.
  Status page_out(int64_t u, bool write);
  bool paged_in(int64_t u) const;

 private:
  void build_units(const ModelSpec& model, StateFormat m_format, StateFormat v_format, int64_t block_size);
  Status map_shared();
  struct Tier;
  SharedMemory shm_;
  std::unique_ptr<Tier> tier_;
  std::vector<UnitState> units_;
  DType transfer_ = DType::kFp32;
  bool tied_ = false;
  bool all_gradients_ = true;
  StateSharding sharding_;
};

// Visits NVMe-resident units one at a time for whole-state passes (checkpoints, initialisation):
// get(u) pages u in (after paging out the previous one, writing it back when it was got with
// dirty = true); finish() pages the last one out. Units in RAM are returned as they are.
class UnitPager {
 public:
  explicit UnitPager(HostState& state) : state_(state) {}
  ~UnitPager() { (void)finish(); }
  UnitPager(const UnitPager&) = delete;
  UnitPager& operator=(const UnitPager&) = delete;
  // dirty: the caller overwrites every value (the unit is zero-filled, not read, and written back).
  Result<UnitState*> get(int64_t u, bool dirty = false);
  Status finish();

 private:
  HostState& state_;
  int64_t current_ = -1;
  bool dirty_ = false;
};

}  // namespace megatrain::exec

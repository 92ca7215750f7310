// Building the per-unit RAM tier from a ModelSpec, and seeded HF-style initialisation.
#include "megatrain/executor/host_state.h"
#include "megatrain/core/arch.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/core/units.h"

#include "megatrain/executor/optimizer.h"
#include "megatrain/step/schedule.h"

namespace megatrain::exec {

NvmePlacement nvme_placement_of(const PlacementConfig& placement) {
  NvmePlacement nvme;
  nvme.master = placement.master_weights == Tier::kNvme;
  nvme.states = placement.optimizer_states == Tier::kNvme;
  for (const std::string& d : placement.nvme_dirs) nvme.store.dirs.emplace_back(d);
  nvme.store.queue_depth = static_cast<int>(placement.nvme_queue_depth);
  nvme.store.block_bytes = placement.nvme_block_bytes;
  nvme.staging_bytes = placement.pinned_staging_bytes;
  return nvme;
}
namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}


}  // namespace

const TensorSlot* UnitState::find(TensorRole role) const {
  for (const auto& t : tensors)
    if (t.role == role) return &t;
  return nullptr;
}

// ---- the NVMe tier --------------------------------------------------------------------------------

struct HostState::Tier {
  bool master = false, states = false;
  std::unique_ptr<NvmeStore> store;
  // Per unit: where master, m's arrays and v's arrays start in its region (each 4096-aligned).
  struct Layout {
    int64_t master = -1;
    std::vector<int64_t> m, v;
  };
  std::vector<Layout> layout;
  int64_t slot_bytes = 0;
  std::vector<AlignedArray<uint8_t>> slots;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> free_slots;
  std::vector<int> slot_of;  // per unit, -1 when not paged in
};

HostState::HostState() = default;
HostState::~HostState() = default;
HostState::HostState(HostState&&) noexcept = default;
HostState& HostState::operator=(HostState&&) noexcept = default;

bool HostState::master_on_nvme() const { return tier_ && tier_->master; }
bool HostState::states_on_nvme() const { return tier_ && tier_->states; }
const NvmeStore* HostState::nvme_store() const { return tier_ ? tier_->store.get() : nullptr; }
int64_t HostState::nvme_bytes() const { return tier_ ? tier_->store->total_bytes() : 0; }
int64_t HostState::staging_buffers() const { return tier_ ? static_cast<int64_t>(tier_->slots.size()) : 0; }
int64_t HostState::staging_bytes() const { return tier_ ? staging_buffers() * tier_->slot_bytes : 0; }

int64_t HostState::free_staging_buffers() const {
  if (!tier_) return 0;
  std::lock_guard<std::mutex> g(tier_->mu);
  return static_cast<int64_t>(tier_->free_slots.size());
}

bool HostState::paged_in(int64_t u) const {
  if (!tier_) return true;
  std::lock_guard<std::mutex> g(tier_->mu);
  return tier_->slot_of[static_cast<size_t>(u)] >= 0;
}

Status HostState::page_in(int64_t u, bool read) {
  if (!tier_) return {};
  Tier& t = *tier_;
  int slot = -1;
  {
    std::unique_lock<std::mutex> l(t.mu);
    if (t.slot_of[static_cast<size_t>(u)] >= 0)
      return internal_error("unit " + std::to_string(u) + " is paged in twice; one caller at a time may hold a unit");
    t.cv.wait(l, [&] { return !t.free_slots.empty(); });
    slot = t.free_slots.back();
    t.free_slots.pop_back();
    t.slot_of[static_cast<size_t>(u)] = slot;
  }
  uint8_t* base = t.slots[static_cast<size_t>(slot)].data();
  UnitState& us = units_[static_cast<size_t>(u)];
  const Tier::Layout& lay = t.layout[static_cast<size_t>(u)];
  if (t.master) us.master.view(reinterpret_cast<float*>(base + lay.master), us.numel);
  if (t.states) {
    std::vector<void*> pm, pv;
    for (int64_t off : lay.m) pm.push_back(base + off);
    for (int64_t off : lay.v) pv.push_back(base + off);
    us.m.attach(pm);
    us.v.attach(pv);
  }
  Status s;
  if (read)
    s = t.store->read(u, base);
  else
    std::memset(base, 0, static_cast<size_t>(t.store->region_capacity(u)));
  if (!s.ok()) (void)page_out(u, false);
  return s;
}

Status HostState::page_out(int64_t u, bool write) {
  if (!tier_) return {};
  Tier& t = *tier_;
  int slot = -1;
  {
    std::lock_guard<std::mutex> g(t.mu);
    slot = t.slot_of[static_cast<size_t>(u)];
  }
  if (slot < 0) return internal_error("unit " + std::to_string(u) + " is paged out but was not paged in");
  Status s;
  if (write) s = t.store->write(u, t.slots[static_cast<size_t>(slot)].data());
  UnitState& us = units_[static_cast<size_t>(u)];
  if (t.master) us.master.release();
  if (t.states) {
    us.m.detach();
    us.v.detach();
  }
  {
    std::lock_guard<std::mutex> g(t.mu);
    t.slot_of[static_cast<size_t>(u)] = -1;
    t.free_slots.push_back(slot);
  }
  t.cv.notify_all();
  return s;
}

Result<UnitState*> UnitPager::get(int64_t u, bool dirty) {
  UnitState* us = &state_.units()[static_cast<size_t>(u)];
  if (!state_.on_nvme() || u == current_) return us;
  MT_RETURN_IF_ERROR(finish());
  MT_RETURN_IF_ERROR(state_.page_in(u, !dirty));
  current_ = u;
  dirty_ = dirty;
  return us;
}

Status UnitPager::finish() {
  if (current_ < 0) return {};
  const int64_t u = current_;
  current_ = -1;
  return state_.page_out(u, dirty_);
}

Result<HostState> HostState::create(const ModelSpec& model, DType transfer, StateFormat m_format, StateFormat v_format,
                                    int64_t block_size, const NvmePlacement& nvme, bool all_gradients, StateSharding sharding) {
  if (sharding.ranks < 1 || sharding.rank < 0 || sharding.rank >= sharding.ranks)
    return internal_error("state sharding: rank " + std::to_string(sharding.rank) + " of " + std::to_string(sharding.ranks));
  if (!nvme.master && !nvme.states && all_gradients && sharding.ranks == 1 && sharding.node == nullptr)
    return create(model, transfer, m_format, v_format, block_size);
  if (sharding.node != nullptr && nvme.master)
    return unsupported("parallel.host_state shared keeps one copy of the master weights per node in shared memory, and "
                       "placement.master_weights is nvme; accepted: master_weights ram, or host_state sharded or replicated");
  if (nvme.master && transfer != DType::kBf16)
    return unsupported("placement.master_weights nvme with precision.transfer " + std::string(dtype_name(transfer)) +
                       ": the weights streamed to the device stay in RAM, so with master weights on NVMe they must be a bf16 "
                       "copy; accepted: precision.transfer bf16, or master_weights ram");
  HostState hs;
  hs.transfer_ = transfer;
  hs.tied_ = model.config().tie_word_embeddings;
  hs.all_gradients_ = all_gradients;
  hs.sharding_ = sharding;
  if (!nvme.master && !nvme.states) {
    hs.build_units(model, m_format, v_format, block_size);
    MT_RETURN_IF_ERROR(hs.map_shared());
    return hs;
  }
  hs.tier_ = std::make_unique<Tier>();
  Tier& t = *hs.tier_;
  t.master = nvme.master;
  t.states = nvme.states;
  hs.build_units(model, m_format, v_format, block_size);
  std::vector<int64_t> region;
  static_assert(kNvmeArrayAlignment % kNvmeAlignment == 0, "every array of a region is aligned for O_DIRECT");
  for (const UnitState& us : hs.units_) {
    // The master weights of every tensor; the moments of the tensors this rank owns (all unsharded).
    std::vector<int64_t> numels, owned;
    for (const auto& tensor : us.tensors) {
      numels.push_back(tensor.numel);
      owned.push_back(hs.owns(tensor) ? tensor.numel : 0);
    }
    const NvmeRegionLayout w = nvme_region_layout(numels, t.master, false, m_format, v_format, block_size);
    NvmeRegionLayout r = nvme_region_layout(owned, false, t.states, m_format, v_format, block_size);
    for (int64_t& off : r.m) off += w.bytes;
    for (int64_t& off : r.v) off += w.bytes;
    t.layout.push_back(Tier::Layout{w.master, r.m, r.v});
    region.push_back(w.bytes + r.bytes);
  }
  // Buffers: as many whole units as the staging bytes hold, counted at the units' own NVMe bytes
  // (master, m, v) by the core function the simulator's staging rule uses; fewer than one unit is
  // refused by that rule, before any space is reserved. Each buffer is then the largest region
  // rounded to the store's blocks, a little more than that.
  const int64_t largest = nvme_unit_transfer_bytes(model, t.master, t.states, m_format, v_format, block_size);
  MT_RETURN_IF_ERROR(check_pinned_staging(nvme.staging_bytes, largest));
  MT_ASSIGN_OR_RETURN(t.store, NvmeStore::create(nvme.store, region));
  for (int64_t u = 0; u < static_cast<int64_t>(region.size()); ++u) t.slot_bytes = std::max(t.slot_bytes, t.store->region_capacity(u));
  const int64_t n_slots = nvme.staging_bytes / largest;
  t.slots.resize(static_cast<size_t>(n_slots));
  for (int64_t k = 0; k < n_slots; ++k) {
    t.slots[static_cast<size_t>(k)].resize(t.slot_bytes);
    t.free_slots.push_back(static_cast<int>(n_slots - 1 - k));
  }
  t.slot_of.assign(hs.units_.size(), -1);
  MT_RETURN_IF_ERROR(hs.map_shared());
  return hs;
}

// One SharedMemory for the node: per unit its master weights, streaming copy (bf16 transfer) and
// summed gradient, each array on a page boundary (the CUDA backend page-locks each one).
Status HostState::map_shared() {
  if (!shared()) return {};
  auto pages = [](int64_t bytes) { return (bytes + 4095) / 4096 * 4096; };
  std::vector<int64_t> numels;
  for (const UnitState& us : units_) numels.push_back(us.numel);
  const int64_t total = step::node_shared_state_bytes(numels, transfer_ == DType::kBf16);  // the footprint's figure
  MT_ASSIGN_OR_RETURN(shm_, sharding_.node->node_shared_memory(total));
  auto* base = static_cast<uint8_t*>(shm_.data());
  int64_t at = 0;
  for (UnitState& us : units_) {
    us.master.view(reinterpret_cast<float*>(base + at), us.numel);
    at += pages(4 * us.numel);
    if (transfer_ == DType::kBf16) {
      us.stream_bf16.view(reinterpret_cast<uint16_t*>(base + at), us.numel);
      at += pages(2 * us.numel);
    }
    us.summed.view(reinterpret_cast<float*>(base + at), us.numel);
    at += pages(4 * us.numel);
  }
  return {};
}

HostState HostState::create(const ModelSpec& model, DType transfer, StateFormat m_format, StateFormat v_format,
                            int64_t block_size) {
  HostState hs;
  hs.transfer_ = transfer;
  hs.tied_ = model.config().tie_word_embeddings;
  hs.build_units(model, m_format, v_format, block_size);
  return hs;
}

void HostState::build_units(const ModelSpec& model, StateFormat m_format, StateFormat v_format, int64_t block_size) {
  const bool master_ram = !master_on_nvme(), states_ram = !states_on_nvme();
  const int64_t L = model.config().num_layers;
  units_.resize(static_cast<size_t>(L + 2));
  for (const TensorInfo& t : model.tensors()) {
    size_t u = 0;
    if (t.layer >= 0) u = static_cast<size_t>(t.layer + 1);
    else if (t.role == TensorRole::kEmbedding) u = 0;
    else u = static_cast<size_t>(L + 1);
    units_[u].tensors.push_back(TensorSlot{t.name, t.shape, t.role, 0, t.numel, arch::role_traits(t.role).decay, t.expert, t.layer});
  }
  // Sharded states: owners over the tensors in unit order (core/plan.h).
  std::vector<int64_t> all_numels;
  for (const UnitState& us : units_)
    for (const TensorSlot& t : us.tensors) all_numels.push_back(t.numel);
  const std::vector<int> owners = shard_owners(all_numels, sharding_.ranks);
  size_t next_owner = 0;
  for (UnitState& us : units_) {
    std::vector<int64_t> sizes, owned;
    for (TensorSlot& t : us.tensors) {
      t.owner = owners[next_owner++];
      sizes.push_back(t.numel);
      owned.push_back(owns(t) ? t.numel : 0);
    }
    const UnitLayout layout = unit_layout(sizes);  // each tensor on an aligned offset (core/plan.h)
    for (size_t a = 0; a < us.tensors.size(); ++a) us.tensors[a].offset = layout.offsets[a];
    us.numel = layout.numel;
    // Rank r's range starts at its first tensor, or where the next rank's starts when it owns none here.
    const auto R = static_cast<size_t>(sharding_.ranks);
    std::vector<int64_t> start(R + 1, us.numel);
    for (size_t a = us.tensors.size(); a-- > 0;)
      for (size_t r = 0; r <= static_cast<size_t>(us.tensors[a].owner); ++r) start[r] = us.tensors[a].offset;
    start[0] = 0;
    us.shard_elems.resize(R);
    for (size_t r = 0; r < R; ++r) us.shard_elems[r] = start[r + 1] - start[r];
    int64_t experts = 0;
    for (const TensorSlot& t : us.tensors) experts = std::max(experts, t.expert + 1);
    us.expert_steps.assign(static_cast<size_t>(experts), 0);
    if (master_ram && !shared()) us.master.resize(us.numel);  // shared: views of the node's memory (map_shared)
    if (all_gradients_) us.grad.resize(us.numel);
    us.m = MomentStore::create(m_format, false, owned, block_size, states_ram);
    us.v = MomentStore::create(v_format, true, owned, block_size, states_ram);
    if (transfer_ == DType::kBf16 && !shared()) us.stream_bf16.resize(us.numel);
  }
}

Status HostState::init_random(uint64_t seed, double std) {
  UnitPager pager(*this);
  for (size_t u = 0; u < units_.size(); ++u) {
    UnitState& us = units_[u];
    // NVMe-resident master weights: the unit is zero-filled (fresh moments), set and written back.
    if (master_on_nvme()) MT_RETURN_IF_ERROR(pager.get(static_cast<int64_t>(u), true).status());
    if (!writes_weights()) continue;  // shared: the node's first rank sets them
    for (const TensorSlot& t : us.tensors) {
      float* w = us.master.data() + t.offset;
      // Norms start at one and biases at zero (arch::role_traits), the rest from a normal draw.
      if (const arch::Init init = arch::role_traits(t.role).init; init != arch::Init::kNormal) {
        std::fill(w, w + t.numel, init == arch::Init::kOnes ? 1.0f : 0.0f);
        continue;
      }
      // Box-Muller on a counter-based stream: element i's value depends only on (seed, name, i).
      // splitmix64 advances its state by a constant, so a thread can start anywhere in the stream:
      // pair p uses draws 2p and 2p + 1. Threads split the pairs; the values do not change.
      const uint64_t state0 = seed ^ hash_name(t.name);
      const int64_t pairs = (t.numel + 1) / 2;
      auto fill = [&, w, state0](int64_t p0, int64_t p1) {
        uint64_t state = state0 + static_cast<uint64_t>(2 * p0) * 0x9e3779b97f4a7c15ull;
        const double kTwoPi = 6.283185307179586;
        for (int64_t i = 2 * p0; i < 2 * p1; i += 2) {
          const double u1 = (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
          const double u2 = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
          const double r = std::sqrt(-2.0 * std::log(u1));
          w[i] = static_cast<float>(std * r * std::cos(kTwoPi * u2));
          if (i + 1 < t.numel) w[i + 1] = static_cast<float>(std * r * std::sin(kTwoPi * u2));
        }
      };
      const int64_t n_threads = std::clamp<int64_t>(pairs / (int64_t{1} << 20), 1, std::max(1u, std::thread::hardware_concurrency()));
      std::vector<std::thread> workers;
      for (int64_t k = 1; k < n_threads; ++k) workers.emplace_back(fill, pairs * k / n_threads, pairs * (k + 1) / n_threads);
      fill(0, pairs / n_threads);
      for (auto& th : workers) th.join();
    }
    if (transfer_ == DType::kBf16)
      for (int64_t i = 0; i < us.numel; ++i) us.stream_bf16[i] = fp32_to_bf16(us.master[i]);
  }
  return pager.finish();
}

Status HostState::refresh_stream() {
  if (transfer_ != DType::kBf16 || !writes_weights()) return {};
  UnitPager pager(*this);
  for (size_t u = 0; u < units_.size(); ++u) {
    if (master_on_nvme()) MT_RETURN_IF_ERROR(pager.get(static_cast<int64_t>(u)).status());
    UnitState& us = units_[u];
    for (int64_t i = 0; i < us.numel; ++i) us.stream_bf16[i] = fp32_to_bf16(us.master[i]);
  }
  return pager.finish();
}

int64_t HostState::bytes() const {
  int64_t b = staging_bytes();
  if (shared()) b += shm_.bytes() / sharding_.ranks;  // this rank's share of the node's copy
  for (const UnitState& us : units_) {
    b += us.numel * ((all_gradients_ ? 4 : 0) + (transfer_ == DType::kBf16 && !shared() ? 2 : 0));  // gradient, streaming copy
    if (!master_on_nvme() && !shared()) b += 4 * us.numel;
    if (!states_on_nvme()) b += us.m.bytes() + us.v.bytes();
  }
  return b;
}

int64_t HostState::moment_bytes() const {
  int64_t b = 0;
  for (const UnitState& us : units_) b += us.m.bytes_if_allocated() + us.v.bytes_if_allocated();
  return b;
}

int64_t HostState::unsharded_moment_bytes() const {
  int64_t b = 0;
  for (const UnitState& us : units_) {
    std::vector<int64_t> sizes;
    for (const TensorSlot& t : us.tensors) sizes.push_back(t.numel);
    for (const MomentStore* ms : {&us.m, &us.v})
      for (int64_t a : moment_array_bytes(ms->format(), sizes, ms->block_size())) b += a;
  }
  return b;
}

}  // namespace megatrain::exec

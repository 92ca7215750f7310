// Issue 31, row 1: the RAM tier lays every tensor of a unit where core's unit_layout says, so that
// each starts on a 64-byte boundary in the fp32 arrays (master weights, gradients) and a 32-byte
// one in the bf16 streaming copy, for every small shipped model (the big ones are checked without
// allocating, in tests/step/state_layout_test.cpp). The device's layer buffers hold the same
// layout from a 64-byte aligned carve, so the views a backend makes of a load are aligned too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/core/profiles.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/step/schedule.h"

namespace {

using namespace megatrain;
using namespace megatrain::exec;

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

TEST(UnitLayoutInRam, EveryTensorOfEverySmallModelStartsAligned) {
  int checked = 0;
  for (const std::string& name : list_profiles("models")) {
    if (name.rfind("tiny-", 0) != 0 && name != "small-llama") continue;
    auto model = ModelSpec::load(name);
    ASSERT_TRUE(model.ok()) << name << ": " << model.status().to_string();
    const HostState hs = HostState::create(*model, DType::kBf16);
    const auto numels = unit_tensor_numels(*model);
    ASSERT_EQ(hs.units().size(), numels.size()) << name;
    for (size_t u = 0; u < numels.size(); ++u) {
      const UnitState& us = hs.units()[u];
      const UnitLayout l = unit_layout(numels[u]);
      ASSERT_EQ(us.tensors.size(), l.offsets.size()) << name << " unit " << u;
      EXPECT_EQ(us.numel, l.numel) << name << " unit " << u;
      EXPECT_EQ(us.master.size(), l.numel) << name << " unit " << u;
      EXPECT_EQ(us.stream_bf16.size(), l.numel) << name << " unit " << u;
      for (size_t a = 0; a < us.tensors.size(); ++a) {
        const TensorSlot& t = us.tensors[a];
        EXPECT_EQ(t.offset, l.offsets[a]) << name << " " << t.name;
        EXPECT_EQ(t.numel, numels[u][a]) << name << " " << t.name;
        EXPECT_TRUE(aligned(us.master.data() + t.offset, 64)) << name << " " << t.name << " master";
        EXPECT_TRUE(aligned(us.grad.data() + t.offset, 64)) << name << " " << t.name << " gradient";
        EXPECT_TRUE(aligned(us.stream_bf16.data() + t.offset, 32)) << name << " " << t.name << " bf16 copy";
      }
      // The moments pack the tensors: their stores count the parameters, not the gaps.
      int64_t params = 0;
      for (int64_t n : numels[u]) params += n;
      EXPECT_EQ(us.m.numel(), params) << name << " unit " << u;
    }
    ++checked;
  }
  EXPECT_GE(checked, 6) << "the tiny models and small-llama";
}

// The gaps between tensors start at zero and stay there through initialisation, so that the global
// gradient norm and the streamed copy over a whole unit see nothing but the tensors.
TEST(UnitLayoutInRam, TheGapsHoldZerosAfterInitialisation) {
  auto model = ModelSpec::load("tiny-gpt-oss");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  HostState hs = HostState::create(*model, DType::kBf16);
  ASSERT_TRUE(hs.init_random(7, 0.02).ok());
  ASSERT_TRUE(hs.refresh_stream().ok());
  int64_t gaps = 0;
  for (const UnitState& us : hs.units()) {
    std::vector<char> used(static_cast<size_t>(us.numel), 0);
    for (const TensorSlot& t : us.tensors)
      for (int64_t i = 0; i < t.numel; ++i) used[static_cast<size_t>(t.offset + i)] = 1;
    for (int64_t i = 0; i < us.numel; ++i) {
      if (used[static_cast<size_t>(i)]) continue;
      ++gaps;
      ASSERT_EQ(us.master[i], 0.0f) << "element " << i;
      ASSERT_EQ(us.stream_bf16[i], 0) << "element " << i;
    }
  }
  EXPECT_GT(gaps, 0) << "tiny-gpt-oss's 4-element sinks leave a gap in every layer";
}

}  // namespace

namespace {

// Sharded states (docs/data-parallel.md): for 1 to 5 ranks, every tensor's moments are kept by
// exactly one rank (its owner, from core's shard_owners), in its format, and by no other; each
// unit's ranges (shard_elems) tile the unit and start at the first tensor of their rank; the ranks'
// moment bytes add up to the unsharded state's, for fp32 and for quantised formats.
TEST(UnitLayoutInRam, ShardedStatesKeepEachTensorsMomentsOnItsOwnerOnly) {
  auto model = ModelSpec::load("tiny-mixtral");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kQ4}) {
    const HostState whole = HostState::create(*model, DType::kFp32, f, f, 64);
    for (int ranks = 1; ranks <= 5; ++ranks) {
      std::vector<int64_t> all;
      for (const UnitState& us : whole.units())
        for (const TensorSlot& t : us.tensors) all.push_back(t.numel);
      const std::vector<int> owners = shard_owners(all, ranks);
      int64_t bytes = 0;
      std::vector<int> kept(all.size(), 0);
      for (int rank = 0; rank < ranks; ++rank) {
        auto hs = HostState::create(*model, DType::kFp32, f, f, 64, NvmePlacement{}, true, StateSharding{rank, ranks});
        ASSERT_TRUE(hs.ok()) << hs.status().to_string();
        EXPECT_EQ(hs->sharded(), ranks > 1);
        bytes += hs->moment_bytes();
        EXPECT_EQ(hs->unsharded_moment_bytes(), whole.moment_bytes());
        size_t k = 0;
        for (const UnitState& us : hs->units()) {
          ASSERT_EQ(us.shard_elems.size(), static_cast<size_t>(ranks));
          int64_t tiled = 0, mine = 0;
          for (int r = 0; r < ranks; ++r) {
            if (r == rank) mine = tiled;
            tiled += us.shard_elems[static_cast<size_t>(r)];
          }
          EXPECT_EQ(tiled, us.numel);
          for (size_t a = 0; a < us.tensors.size(); ++a, ++k) {
            const TensorSlot& t = us.tensors[a];
            EXPECT_EQ(t.owner, owners[k]) << t.name;
            const bool own = t.owner == rank;
            EXPECT_EQ(hs->owns(t), own);
            EXPECT_EQ(us.m.tensor_numel(a), own ? t.numel : 0) << t.name;
            EXPECT_EQ(us.v.tensor_numel(a), own ? t.numel : 0) << t.name;
            kept[k] += own;
            if (own) {  // inside this rank's range of the unit
              EXPECT_TRUE(t.offset >= mine && t.offset + t.numel <= mine + us.shard_elems[static_cast<size_t>(rank)]) << t.name;
            }
          }
        }
      }
      EXPECT_EQ(bytes, whole.moment_bytes()) << ranks << " ranks";
      for (size_t k = 0; k < kept.size(); ++k) EXPECT_EQ(kept[k], 1) << "tensor " << k << ", " << ranks << " ranks";
    }
  }
}

// A shared host state (parallel.host_state shared) in one process, through the single-rank
// communicator's private memory: every unit's master weights, bf16 copy and summed gradient are page-
// aligned views of one segment of step::node_shared_state_bytes, none overlapping; the segment is
// counted in aligned_bytes_in_use while it lives; initialisation writes the same weights as an
// unshared state; and master weights on NVMe are refused. In-process, so the sanitizer build covers
// the segment's mapping and accounting too.
TEST(UnitLayoutInRam, ASharedStateIsOnePageAlignedSegmentOfTheFootprintsSize) {
  auto model = ModelSpec::load("tiny-llama-gqa");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto comm = single_communicator();
  const int64_t before = aligned_bytes_in_use().load();
  {
    auto shared = HostState::create(*model, DType::kBf16, StateFormat::kFp32, StateFormat::kFp32, 128, NvmePlacement{}, true,
                                    StateSharding{0, 1, comm.get()});
    ASSERT_TRUE(shared.ok()) << shared.status().to_string();
    ASSERT_TRUE(shared->shared());
    ASSERT_TRUE(shared->writes_weights());
    const SharedMemory& mem = *shared->shared_memory();
    std::vector<int64_t> numels;
    for (const UnitState& us : shared->units()) numels.push_back(us.numel);
    EXPECT_EQ(mem.bytes(), step::node_shared_state_bytes(numels, true));
    const auto* lo = static_cast<const uint8_t*>(mem.data());
    const uint8_t* hi = lo + mem.bytes();
    std::vector<std::pair<const uint8_t*, const uint8_t*>> arrays;
    for (const UnitState& us : shared->units()) {
      const auto add = [&](const void* p, int64_t bytes) {
        const auto* b = static_cast<const uint8_t*>(p);
        EXPECT_TRUE(b >= lo && b + bytes <= hi);
        EXPECT_TRUE(aligned(b, 4096));
        arrays.emplace_back(b, b + bytes);
      };
      add(us.master.data(), 4 * us.numel);
      add(us.stream_bf16.data(), 2 * us.numel);
      add(us.summed.data(), 4 * us.numel);
      EXPECT_EQ(us.final_grad(), us.summed.data());
    }
    std::sort(arrays.begin(), arrays.end());
    for (size_t i = 1; i < arrays.size(); ++i) EXPECT_LE(arrays[i - 1].second, arrays[i].first);
    EXPECT_GE(aligned_bytes_in_use().load() - before, mem.bytes());
    ASSERT_TRUE(shared->init_random(5, 0.02).ok());
    HostState plain = HostState::create(*model, DType::kBf16);
    ASSERT_TRUE(plain.init_random(5, 0.02).ok());
    for (size_t u = 0; u < plain.units().size(); ++u)
      for (int64_t i = 0; i < plain.units()[u].numel; ++i) {
        ASSERT_EQ(shared->units()[u].master[i], plain.units()[u].master[i]) << "unit " << u;
        ASSERT_EQ(shared->units()[u].stream_bf16[i], plain.units()[u].stream_bf16[i]) << "unit " << u;
      }
  }
  EXPECT_EQ(aligned_bytes_in_use().load(), before);  // the segment went with the state
  NvmePlacement nvme;
  nvme.master = true;
  nvme.store.dirs.emplace_back("/tmp");
  auto refused = HostState::create(*model, DType::kBf16, StateFormat::kFp32, StateFormat::kFp32, 128, nvme, true,
                                   StateSharding{0, 1, comm.get()});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("host_state shared"), std::string::npos) << refused.status().message();
}

}  // namespace

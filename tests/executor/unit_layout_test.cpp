// Issue 31, row 1: the RAM tier lays every tensor of a unit where core's unit_layout says, so that
// each starts on a 64-byte boundary in the fp32 arrays (master weights, gradients) and a 32-byte
// one in the bf16 streaming copy, for every small shipped model (the big ones are checked without
// allocating, in tests/step/state_layout_test.cpp). The device's layer buffers hold the same
// layout from a 64-byte aligned carve, so the views a backend makes of a load are aligned too.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/core/profiles.h"
#include "megatrain/executor/host_state.h"

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

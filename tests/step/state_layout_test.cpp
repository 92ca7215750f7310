// The one function for each figure the compiled step shares with the allocators (issue 30), against
// hand-computed values: the device layer buffers a schedule can run with, the arrays of a moment,
// and a unit's region on the NVMe tier.
#include <gtest/gtest.h>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"

namespace {

using namespace megatrain;

TEST(LayerBufferRange, LeastAndMostByHand) {
  struct Case {
    int64_t K, c, least, most;
  };
  // least = max(K + 1, c + 1); most = max(K + 1, c + K).
  for (const Case& k : {Case{1, 0, 2, 2}, Case{2, 0, 3, 3}, Case{2, 1, 3, 3}, Case{1, 3, 4, 4}, Case{2, 3, 4, 5},
                        Case{4, 2, 5, 6}, Case{3, 8, 9, 11}}) {
    const LayerBufferRange r = layer_buffer_range(k.K, k.c);
    EXPECT_EQ(r.least, k.least) << "K " << k.K << " c " << k.c;
    EXPECT_EQ(r.most, k.most) << "K " << k.K << " c " << k.c;
  }
}

TEST(MomentArrays, EachFormatByHand) {
  const std::vector<int64_t> tensors = {100, 300};  // blocks of 128: 1 + 3
  EXPECT_EQ(moment_array_bytes(StateFormat::kFp32, tensors, 128), (std::vector<int64_t>{1600}));
  EXPECT_EQ(moment_array_bytes(StateFormat::kBf16, tensors, 128), (std::vector<int64_t>{800}));
  // Codes for 4 whole blocks, then one fp32 scale per block.
  EXPECT_EQ(moment_array_bytes(StateFormat::kQ8, tensors, 128), (std::vector<int64_t>{512, 16}));
  EXPECT_EQ(moment_array_bytes(StateFormat::kQ4, tensors, 128), (std::vector<int64_t>{256, 16}));
  EXPECT_EQ(moment_array_bytes(StateFormat::kQ3, tensors, 128), (std::vector<int64_t>{192, 16}));
  EXPECT_EQ(moment_array_bytes(StateFormat::kQ2, tensors, 128), (std::vector<int64_t>{128, 16}));
  EXPECT_EQ(state_format_bytes(StateFormat::kQ4, tensors, 128), 272);
}

TEST(NvmeRegion, ArraysStartOn4KiBBoundaries) {
  const std::vector<int64_t> tensors = {100, 300};
  // Master (1600 B) at 0; m in q8: codes (512 B) at 4096, scales (16 B) at 8192; v in fp32 (1600 B)
  // at 12288; 16384 bytes in all.
  const NvmeRegionLayout r = nvme_region_layout(tensors, true, true, StateFormat::kQ8, StateFormat::kFp32, 128);
  EXPECT_EQ(r.master, 0);
  EXPECT_EQ(r.m, (std::vector<int64_t>{4096, 8192}));
  EXPECT_EQ(r.v, (std::vector<int64_t>{12288}));
  EXPECT_EQ(r.bytes, 16384);
  const NvmeRegionLayout states = nvme_region_layout(tensors, false, true, StateFormat::kBf16, StateFormat::kBf16, 128);
  EXPECT_EQ(states.master, -1);
  EXPECT_EQ(states.m, (std::vector<int64_t>{0}));
  EXPECT_EQ(states.v, (std::vector<int64_t>{4096}));
  EXPECT_EQ(states.bytes, 8192);
  const NvmeRegionLayout master = nvme_region_layout(tensors, true, false, StateFormat::kFp32, StateFormat::kFp32, 128);
  EXPECT_TRUE(master.m.empty() && master.v.empty());
  EXPECT_EQ(master.bytes, 4096);
}

}  // namespace

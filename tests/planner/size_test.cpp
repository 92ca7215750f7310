// Rig sizing and model sizing: the smallest rig per GPU trains the model (and meets a target when
// one is given), an unreachable target is said to be one, and the largest model of a family that
// a rig trains lies between the published size it trains and the one it does not.
#include <gtest/gtest.h>

#include "megatrain/planner/size.h"

namespace megatrain::planner {
namespace {

TEST(Size, SmallestRigTrainsAndIsAValidProfile) {
  auto m = ModelSpec::load("llama-2-7b");
  ASSERT_TRUE(m.ok());
  auto r = size_rigs(*m, "h100-sxm", SizeOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->rigs.size(), 1u);
  const RigOption& o = r->rigs[0];
  ASSERT_TRUE(o.trains) << o.why_not;
  EXPECT_GT(o.tokens_per_s, 0);
  EXPECT_EQ(o.rig.host.ram_bytes.value, o.ram_bytes);
  EXPECT_EQ(static_cast<int>(o.rig.storage.size()), o.drives);
  EXPECT_EQ(o.rig.host.ram_bytes.provenance.kind, Provenance::Kind::kEstimate);
  // The synthesised profile is a valid one.
  auto back = HardwareProfile::from_json_text(o.rig.to_json_text(), "synthesised rig");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_FALSE(r->assumptions.empty());
  // A target beyond any host is reported as such.
  SizeOptions fast;
  fast.target_tokens_per_s = 1e9;
  auto none = size_rigs(*m, "h100-sxm", fast);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->rigs[0].trains);
  EXPECT_NE(none->rigs[0].why_not.find("target"), std::string::npos) << none->rigs[0].why_not;
}

TEST(Size, TargetNeedsAtLeastAsBigARig) {
  auto m = ModelSpec::load("llama-2-70b");
  ASSERT_TRUE(m.ok());
  auto any = size_rigs(*m, "h200", SizeOptions{});
  SizeOptions opt;
  opt.target_tokens_per_s = 1000;
  auto fast = size_rigs(*m, "h200", opt);
  ASSERT_TRUE(any.ok() && fast.ok());
  ASSERT_TRUE(any->rigs[0].trains && fast->rigs[0].trains) << fast->rigs[0].why_not;
  EXPECT_GE(fast->rigs[0].tokens_per_s, 1000);
  EXPECT_GE(fast->rigs[0].ram_bytes * 16 + fast->rigs[0].drives, any->rigs[0].ram_bytes * 16 + any->rigs[0].drives);
}

TEST(Size, UnknownGpuListsTheKnownOnes) {
  auto m = ModelSpec::load("llama-2-7b");
  ASSERT_TRUE(m.ok());
  auto r = size_rigs(*m, "voodoo5", SizeOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("h200-1.5tb"), std::string::npos) << r.status().message();
}

TEST(Size, LargestModelOfAFamilyLiesBetweenItsPublishedSizes) {
  auto rig = HardwareProfile::load("rtx4090-256gb");
  ASSERT_TRUE(rig.ok());
  auto r = largest_model("llama-2", *rig, SizeOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->published.size(), 2u);
  EXPECT_TRUE(r->published[0].trains);   // 7B
  EXPECT_FALSE(r->published[1].trains);  // 70B
  ASSERT_TRUE(r->any);
  EXPECT_GT(r->largest.parameters, r->published[0].parameters);
  EXPECT_LT(r->largest.parameters, r->published[1].parameters);
  EXPECT_GT(r->largest.tokens_per_s, 0);
  EXPECT_GT(r->smallest_that_does_not.parameters, r->largest.parameters);
  EXPECT_FALSE(r->smallest_that_does_not.trains);
}

TEST(Size, FamilyNeedsTwoPublishedSizes) {
  auto rig = HardwareProfile::load("h200-1.5tb");
  ASSERT_TRUE(rig.ok());
  auto r = largest_model("mistral", *rig, SizeOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("llama-2"), std::string::npos) << r.status().message();
  const auto families = model_families();
  EXPECT_NE(std::find(families.begin(), families.end(), "qwen2.5"), families.end());
}

}  // namespace
}  // namespace megatrain::planner

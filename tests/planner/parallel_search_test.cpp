// `megatrain-plan plan --gpus N` (issue 20, docs/data-parallel.md): the search plans N data-parallel
// ranks on a rig with a cluster section. The best plan carries the parallel section and each rank's
// share of the step's sequences, a fresh simulation of it gives the reported figures, it is at least
// as fast as every replicated and every sharded plan a brute-force search finds for a tiny model,
// and requests a rig cannot serve are refused by name.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "megatrain/core/plan.h"
#include "megatrain/planner/search.h"
#include "megatrain/planner/size.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::planner {
namespace {

using Json = nlohmann::ordered_json;

HardwareProfile rig(const std::string& name) {
  auto r = HardwareProfile::load(name);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : HardwareProfile{};
}

ModelSpec model(const std::string& name) {
  auto m = ModelSpec::load(name);
  EXPECT_TRUE(m.ok()) << name << ": " << m.status().to_string();
  return m.ok() ? *m : ModelSpec{};
}

SearchRequest request(const std::string& m, const std::string& r, int64_t gpus, int64_t seq, int64_t tokens) {
  SearchRequest q;
  q.model_ref = ProfileRef{false, m};
  q.rig_ref = ProfileRef{false, r};
  q.seq_len = seq;
  q.tokens_per_step = tokens;
  q.gpus = gpus;
  return q;
}

TEST(ParallelSearch, EightRanksOnOneNodeGiveAPlanTheSimulatorConfirms) {
  const ModelSpec m = model("llama-2-7b");
  const HardwareProfile node = rig("h200x8-2tb");
  auto r = search_plan(m, node, request("llama-2-7b", "h200x8-2tb", 8, 4096, 64 * 4096));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->feasible) << r->infeasible_reason;
  const Plan& p = r->best.plan;
  EXPECT_EQ(p.parallel.data_parallel, 8);
  EXPECT_EQ(p.parallel.ranks_per_node, 8);
  EXPECT_EQ(p.training.micro_batch * p.training.grad_accum, 8);  // 64 sequences over 8 ranks
  EXPECT_EQ(r->tokens_per_step, 64 * 4096);
  auto again = sim::simulate(p, m, node);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  ASSERT_TRUE(again->feasible) << again->reason;
  EXPECT_EQ(again->ranks, 8);
  EXPECT_DOUBLE_EQ(again->tokens_per_s, r->best.result.tokens_per_s);
  EXPECT_DOUBLE_EQ(again->tokens_per_step, 64.0 * 4096);
  // The plan file round-trips with its parallel section.
  auto back = Plan::from_json_text(p.to_json_text());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->parallel, p.parallel);
}

// A tiny model on 4 ranks of a 4-GPU node: the pruned search against every candidate simulated
// (exhaustive), replicated, sharded and shared host states all among them.
TEST(ParallelSearch, ThePrunedSearchKeepsTheExhaustiveBestAcrossHostStates) {
  const ModelSpec m = model("tiny-llama-gqa");
  HardwareProfile node = rig("h200x8-2tb");
  node.cluster->gpus_per_node = 4;
  node.cluster->gpus_per_switch = 2;
  SearchRequest q = request("tiny-llama-gqa", "h200x8-2tb", 4, 128, 16 * 128);
  q.rig_ref = ProfileRef{true, node.to_json_text()};
  SearchOptions all;
  all.exhaustive = true;
  all.relief = false;
  auto pruned = search_plan(m, node, q);
  auto brute = search_plan(m, node, q, all);
  ASSERT_TRUE(pruned.ok() && brute.ok());
  ASSERT_TRUE(pruned->feasible && brute->feasible);
  EXPECT_GE(pruned->best.result.tokens_per_s, brute->best.result.tokens_per_s * (1 - 1e-12));
  EXPECT_EQ(pruned->best.plan.parallel.data_parallel, 4);
}

TEST(ParallelSearch, RequestsTheRigCannotServeAreRefusedByName) {
  const ModelSpec m = model("llama-2-7b");
  auto one = search_plan(m, rig("h200-1.5tb"), request("llama-2-7b", "h200-1.5tb", 8, 4096, 64 * 4096));
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.status().message().find("no cluster section"), std::string::npos) << one.status().message();
  auto many = search_plan(m, rig("h200x8-2tb"), request("llama-2-7b", "h200x8-2tb", 16, 4096, 64 * 4096));
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.status().message().find("accepted: up to 8"), std::string::npos) << many.status().message();
  // --nodes: 8 ranks over 2 nodes of the 4-node rig is 4 per node; 3 nodes do not divide 8, 5 are too many.
  SearchRequest spread = request("llama-2-7b", "h200x8-2tb-4node", 8, 4096, 64 * 4096);
  spread.nodes = 2;
  auto two = search_plan(m, rig("h200x8-2tb-4node"), spread);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  ASSERT_TRUE(two->feasible);
  EXPECT_EQ(two->best.plan.parallel.ranks_per_node, 4);
  for (int64_t bad : {3, 5}) {
    spread.nodes = bad;
    auto r = search_plan(m, rig("h200x8-2tb-4node"), spread);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--nodes " + std::to_string(bad)), std::string::npos) << r.status().message();
  }
  auto uneven = search_plan(m, rig("h200x8-2tb"), request("llama-2-7b", "h200x8-2tb", 8, 4096, 4 * 4096));
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("does not divide the step's 4 sequences"), std::string::npos) << uneven.status().message();
}

// llama-2-7b on 8 ranks of a node with 400 GB of RAM: a whole host state per rank (replicated) is
// about 1 TB in all, and one per node (shared) about 130 GB, so with the states in RAM only the shared
// host state fits; the best plan uses it, and its footprint is one rank's share.
TEST(ParallelSearch, ANodeTooSmallForACopyPerRankGetsTheSharedHostState) {
  const ModelSpec m = model("llama-2-7b");
  HardwareProfile node = rig("h200x8-2tb");
  node.host.ram_bytes.value = 400e9;
  node.host.pinnable_bytes.value = 360e9;
  SearchRequest q = request("llama-2-7b", "h200x8-2tb", 8, 4096, 64 * 4096);
  q.rig_ref = ProfileRef{true, node.to_json_text()};
  auto r = search_plan(m, node, q);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->feasible) << r->infeasible_reason;
  const Plan& p = r->best.plan;
  EXPECT_EQ(p.parallel.host_state, "shared") << describe_knobs(p);
  auto again = sim::simulate(p, m, node);
  ASSERT_TRUE(again.ok() && again->feasible);
  EXPECT_DOUBLE_EQ(again->tokens_per_s, r->best.result.tokens_per_s);
  EXPECT_LE(again->peak_bytes.ram, static_cast<int64_t>(400e9 / 8));
  // The same plan with a copy per rank does not fit the node.
  Plan rep = p;
  rep.parallel.host_state = "replicated";
  auto whole = sim::simulate(rep, m, node);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE(whole->feasible);
}

// size --model M --rig R: the best plan per GPU count (each the search of plan --gpus N), the fewest
// GPUs that reach a target, the fastest without one; a rig without a cluster section is refused.
TEST(SizeGpuCount, TheFewestGpusThatReachTheTargetAndTheFastestWithoutOne) {
  const ModelSpec m = model("tiny-llama-gqa");
  HardwareProfile node = rig("h200x8-2tb-4node");
  node.cluster->gpus_per_node = 4;
  node.cluster->nodes = 2;
  SizeOptions opt;
  opt.seq_len = 128;
  opt.tokens_per_step = 16 * 128;
  auto all = size_gpu_count(m, node, opt);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  std::vector<int64_t> counts;
  for (const GpuCountOption& o : all->counts) counts.push_back(o.gpus);
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 2, 4, 8}));  // one node's counts, then whole nodes (8 = 2 x 4)
  size_t fastest = 0;
  for (size_t i = 0; i < all->counts.size(); ++i) {
    const GpuCountOption& o = all->counts[i];
    ASSERT_TRUE(o.fits) << o.gpus << ": " << o.why_not;
    SearchRequest q = request("tiny-llama-gqa", node.name, o.gpus, 128, 16 * 128);
    SearchOptions so;
    so.relief = false;
    so.compare_orders = false;
    auto r = search_plan(m, node, q, so);
    ASSERT_TRUE(r.ok() && r->feasible);
    EXPECT_DOUBLE_EQ(o.tokens_per_s, r->best.result.tokens_per_s) << o.gpus;
    if (o.tokens_per_s > all->counts[fastest].tokens_per_s) fastest = i;
  }
  EXPECT_EQ(all->chosen, static_cast<int64_t>(fastest));
  // A target between the best 2-GPU and 4-GPU figures: the first count that reaches it.
  const double lo = std::max(all->counts[0].tokens_per_s, all->counts[1].tokens_per_s);
  opt.target_tokens_per_s = lo * 1.0001;
  auto target = size_gpu_count(m, node, opt);
  ASSERT_TRUE(target.ok());
  int64_t expect = -1;
  for (size_t i = 0; i < target->counts.size() && expect < 0; ++i)
    if (target->counts[i].tokens_per_s >= opt.target_tokens_per_s) expect = static_cast<int64_t>(i);
  ASSERT_GE(expect, 2);
  EXPECT_EQ(target->chosen, expect);
  EXPECT_FALSE(target->counts[0].trains);
  auto json = Json::parse(gpu_count_json(*target));
  EXPECT_EQ(json["gpus"], target->counts[static_cast<size_t>(expect)].gpus);
  // Out of reach: no count, and the answer says so.
  opt.target_tokens_per_s = 1e15;
  auto none = size_gpu_count(m, node, opt);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->chosen, -1);
  EXPECT_NE(gpu_count_table(*none).find("no GPU count of this rig reaches the target"), std::string::npos);
  auto single = size_gpu_count(m, rig("h200-1.5tb"), opt);
  ASSERT_FALSE(single.ok());
  EXPECT_NE(single.status().message().find("has no cluster section"), std::string::npos) << single.status().message();
}

}  // namespace
}  // namespace megatrain::planner

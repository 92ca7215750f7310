// The plan search: its best plan is one the simulator accepts, it is deterministic, more RAM never
// makes it slower, an impossible request is explained per tier, it beats the hand-written plans,
// its pruning keeps the best that a brute-force simulation of every candidate finds, every plan it
// writes fits the compiled step's footprint, and its memoised sizing equals that footprint.
#include <gtest/gtest.h>

#include <chrono>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "detail/candidates.h"
#include "detail/sizing.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/profiles.h"
#include "megatrain/planner/search.h"
#include "megatrain/simulator/step_model.h"
#include "megatrain/step/schedule.h"

namespace megatrain::planner {
namespace {

ModelSpec model(const std::string& name) {
  auto m = ModelSpec::load(name);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return *m;
}

HardwareProfile rig(const std::string& name) {
  auto r = HardwareProfile::load(name);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return *r;
}

SearchRequest request(const std::string& m, const std::string& r, int64_t seq = 0, int64_t tokens = 0) {
  SearchRequest q;
  q.model_ref = ProfileRef{false, m};
  q.rig_ref = ProfileRef{false, r};
  q.seq_len = seq;
  q.tokens_per_step = tokens;
  return q;
}

HardwareProfile with_ram(HardwareProfile r, double ram) {
  r.host.ram_bytes.value = ram;
  r.host.pinnable_bytes.value = std::floor(0.9 * ram);
  return r;
}

TEST(Search, BestPlanIsFeasibleUnderTheSimulatorAndRoundTrips) {
  const ModelSpec m = model("llama-2-7b");
  const HardwareProfile h = rig("rtx4090-256gb");
  auto res = search_plan(m, h, request("llama-2-7b", "rtx4090-256gb"));
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  ASSERT_TRUE(res->feasible) << res->infeasible_reason;
  ASSERT_TRUE(res->best.plan.predicted.has_value());
  auto again = Plan::from_json_text(res->best.plan.to_json_text(), "searched plan");
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, res->best.plan);
  auto sim = sim::simulate(*again);
  ASSERT_TRUE(sim.ok()) << sim.status().to_string();
  EXPECT_TRUE(sim->feasible) << sim->reason;
  EXPECT_DOUBLE_EQ(sim->tokens_per_s, res->best.plan.predicted->tokens_per_s);
  EXPECT_EQ(res->seq_len, 4096);
  EXPECT_EQ(res->tokens_per_step, 64 * 4096);
  EXPECT_EQ(res->best.plan.training.micro_batch * res->best.plan.training.grad_accum * 4096, res->tokens_per_step);
  // Every alternative is feasible too, slower or equal, and says why it lost.
  for (const Candidate& c : res->alternatives) {
    EXPECT_TRUE(c.result.feasible);
    EXPECT_LE(c.result.tokens_per_s, res->best.result.tokens_per_s);
    EXPECT_NE(c.why.find("slower"), std::string::npos) << c.why;
  }
  EXPECT_FALSE(res->bottleneck_text.empty());
}

TEST(Search, IsDeterministic) {
  const ModelSpec m = model("mistral-large-2");
  const HardwareProfile h = rig("h200-1.5tb");
  auto a = search_plan(m, h, request("mistral-large-2", "h200-1.5tb"));
  auto b = search_plan(m, h, request("mistral-large-2", "h200-1.5tb"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(a->feasible && b->feasible);
  EXPECT_EQ(a->best.plan, b->best.plan);
  ASSERT_EQ(a->alternatives.size(), b->alternatives.size());
  for (size_t i = 0; i < a->alternatives.size(); ++i) {
    EXPECT_EQ(a->alternatives[i].plan, b->alternatives[i].plan);
    EXPECT_EQ(a->alternatives[i].why, b->alternatives[i].why);
  }
  EXPECT_EQ(a->stats.simulated, b->stats.simulated);
}

TEST(Search, MoreRamNeverGivesASlowerBestPlan) {
  struct Case {
    std::string model, rig;
    std::vector<double> ram_gib;
  };
  for (const Case& c : {Case{"llama-2-7b", "rtx4090-256gb", {96, 112, 128, 160, 256, 512}},
                        Case{"llama-2-70b", "h200-1.5tb", {768, 1024, 1280, 1536, 2048}}}) {
    const ModelSpec m = model(c.model);
    const HardwareProfile base = rig(c.rig);
    double prev = 0;
    for (double gib : c.ram_gib) {
      auto res = search_plan(m, with_ram(base, gib * 1073741824.0), request(c.model, c.rig));
      ASSERT_TRUE(res.ok()) << res.status().to_string();
      const double tps = res->feasible ? res->best.result.tokens_per_s : 0;
      EXPECT_GE(tps, prev) << c.model << " on " << c.rig << " with " << gib << " GiB RAM";
      prev = std::max(prev, tps);
    }
    EXPECT_GT(prev, 0) << c.model;
  }
}

TEST(Search, ImpossibleRequestIsExplainedPerTier) {
  // 123B parameters on a rig with 24 GiB of RAM and no NVMe.
  HardwareProfile h = with_ram(rig("rtx4090-256gb"), 24.0 * 1073741824.0);
  h.storage.clear();
  auto res = search_plan(model("mistral-large-2"), h, request("mistral-large-2", "rtx4090-256gb"));
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  EXPECT_FALSE(res->feasible);
  ASSERT_EQ(res->closest_needs.size(), 4u);
  ASSERT_EQ(res->least_needs.size(), 4u);
  bool ram_short = false;
  for (const TierNeed& t : res->least_needs)
    if (t.tier == "ram") {
      ram_short = t.short_by() > 0;
      EXPECT_GT(t.need, 123e9 * 12);  // at least master + moments per parameter
      EXPECT_EQ(t.have, 24.0 * 1073741824.0);
    }
  EXPECT_TRUE(ram_short);
  EXPECT_NE(res->infeasible_reason.find("ram needs"), std::string::npos) << res->infeasible_reason;
  EXPECT_NE(res->infeasible_reason.find("short by"), std::string::npos) << res->infeasible_reason;
  EXPECT_NE(res->infeasible_reason.find("no NVMe"), std::string::npos) << res->infeasible_reason;
  const std::string j = search_json(*res);
  EXPECT_NE(j.find("\"feasible\": false"), std::string::npos);
  EXPECT_NE(j.find("\"shortfalls\""), std::string::npos);
}

TEST(Search, AtLeastAsFastAsEveryHandWrittenPlan) {
  const std::filesystem::path dir = std::filesystem::path(MEGATRAIN_PROFILES_DIR) / "plans";
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    auto hand = Plan::load(e.path());
    ASSERT_TRUE(hand.ok()) << hand.status().to_string();
    auto m = hand->resolve_model();
    auto h = hand->resolve_rig();
    ASSERT_TRUE(m.ok() && h.ok());
    auto hs = sim::simulate(*hand, *m, *h);
    ASSERT_TRUE(hs.ok() && hs->feasible) << e.path();
    SearchRequest q;
    q.model_ref = hand->model;
    q.rig_ref = hand->rig;
    q.seq_len = hand->training.seq_len;
    q.tokens_per_step = hand->training.seq_len * hand->training.micro_batch * hand->training.grad_accum;
    q.policy.compute = hand->precision.compute;
    q.policy.state_formats = {hand->optimizer.m_format};
    if (hand->optimizer.v_format != hand->optimizer.m_format) q.policy.state_formats.push_back(hand->optimizer.v_format);
    auto res = search_plan(*m, *h, q);
    ASSERT_TRUE(res.ok()) << res.status().to_string();
    ASSERT_TRUE(res->feasible) << e.path() << ": " << res->infeasible_reason;
    EXPECT_GE(res->best.result.tokens_per_s, hs->tokens_per_s * (1 - 1e-12)) << e.path();
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

// Pruning (static bytes, dominance, the lower bound, the prefetch plateau) against simulating every
// candidate, every buffer count and staging size.
TEST(Search, PruningKeepsTheBruteForceBest) {
  const ModelSpec m = model("tiny-llama-gqa");
  const HardwareProfile base = rig("rtx4090-256gb");
  const ParameterCounts pc = m.parameter_counts();
  const double n = static_cast<double>(pc.total);
  // RAM from "only the states on NVMe fit" to "everything fits": every placement rule gets used.
  for (double bytes_per_param : {15.0, 22.0, 40.0}) {
    HardwareProfile h = base;
    h.host.ram_bytes.value = bytes_per_param * n + 4e6;
    h.host.pinnable_bytes.value = h.host.ram_bytes.value;
    SearchRequest q = request("tiny-llama-gqa", "rtx4090-256gb", 128, 128 * 8);
    q.policy.state_formats = {StateFormat::kFp32, StateFormat::kBf16};
    SearchOptions brute;
    brute.exhaustive = true;
    brute.relief = false;
    brute.max_prefetch_depth = 4;
    SearchOptions pruned;
    pruned.max_prefetch_depth = 4;
    auto a = search_plan(m, h, q, brute);
    auto b = search_plan(m, h, q, pruned);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->feasible, b->feasible) << bytes_per_param;
    if (!a->feasible) continue;
    EXPECT_GT(a->stats.simulated, 5 * b->stats.simulated) << "the brute force must really be bigger";
    EXPECT_GE(b->best.result.tokens_per_s, a->best.result.tokens_per_s * (1 - 1e-12))
        << bytes_per_param << " B/param: pruned " << describe_knobs(b->best.plan) << " vs brute "
        << describe_knobs(a->best.plan);
  }
}

TEST(Search, CpuBackendRigGetsPlansTheCpuExecutorAccepts) {
  auto res = search_plan(model("tiny-llama-gqa"), rig("cpu-dev-2core"), request("tiny-llama-gqa", "cpu-dev-2core", 128, 1024));
  ASSERT_TRUE(res.ok() && res->feasible);
  const Plan& p = res->best.plan;
  EXPECT_EQ(p.precision.compute, DType::kFp32);
  EXPECT_EQ(p.precision.transfer, DType::kFp32);
  EXPECT_EQ(p.placement.master_weights, Tier::kRam);
  EXPECT_EQ(p.placement.optimizer_states, Tier::kRam);
  EXPECT_EQ(p.optimizer.m_format, StateFormat::kFp32);
  EXPECT_EQ(p.optimizer.v_format, StateFormat::kFp32);
  SearchRequest bf16 = request("tiny-llama-gqa", "cpu-dev-2core", 128, 1024);
  bf16.policy.compute = DType::kBf16;
  auto bad = search_plan(model("tiny-llama-gqa"), rig("cpu-dev-2core"), bf16);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fp32"), std::string::npos);
}

// Batch shapes past a plan's bounds (issue 49): the library refuses them at once; the CLI's flags
// stop them earlier, Python's TrainingArguments reach this. The micro-batch candidates are the
// divisors within the bounds, found in sqrt(sequences) steps (the loop ran once per sequence).
TEST(Search, BatchShapesPastAPlansBoundsAreRefusedAtOnce) {
  const ModelSpec m = model("tiny-llama-gqa");
  const HardwareProfile h = rig("cpu-dev-2core");
  const auto t0 = std::chrono::steady_clock::now();
  SearchRequest huge = request("tiny-llama-gqa", "cpu-dev-2core", 1, (int64_t{1} << 40) + 1);
  auto r = search_plan(m, h, huge);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("at most 2^20 micro-batches of 2^20 sequences"), std::string::npos) << r.status().message();
  SearchRequest wide = request("tiny-llama-gqa", "cpu-dev-2core", 1, int64_t{1} << 40);
  wide.micro_batch = int64_t{1} << 40;
  r = search_plan(m, h, wide);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("micro-batch 1099511627776 is more than a plan holds"), std::string::npos) << r.status().message();
  // 1,048,583 is prime and above 2^20: one micro-batch of all, or 2^20+ micro-batches of one.
  r = search_plan(m, h, request("tiny-llama-gqa", "cpu-dev-2core", 1, 1048583));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("split into no micro-batch"), std::string::npos) << r.status().message();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

TEST(Search, BadRequestsNameWhatIsAccepted) {
  const ModelSpec m = model("tiny-llama-gqa");
  const HardwareProfile h = rig("cpu-dev-2core");
  auto odd = search_plan(m, h, request("tiny-llama-gqa", "cpu-dev-2core", 128, 1000));
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("multiple"), std::string::npos) << odd.status().message();
  auto longseq = search_plan(m, h, request("tiny-llama-gqa", "cpu-dev-2core", 4096, 4096));
  ASSERT_FALSE(longseq.ok());
  EXPECT_NE(longseq.status().message().find("max_position_embeddings"), std::string::npos);
  auto formats = parse_state_format_list("fp32,q5");
  ASSERT_FALSE(formats.ok());
  EXPECT_NE(formats.status().message().find("q5"), std::string::npos);
  auto good = parse_state_format_list("fp32, bf16,q8");
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->size(), 3u);
}

// A fixed micro-batch (the Python package's per_device_train_batch_size): every plan the search
// returns has it, the best is no faster than the free search's, and one that does not divide the
// step's sequences is refused by name.
TEST(Search, AFixedMicroBatchIsKept) {
  const ModelSpec m = model("tiny-llama-gqa");
  const HardwareProfile h = rig("cpu-dev-2core");
  SearchRequest free_q = request("tiny-llama-gqa", "cpu-dev-2core", 128, 128 * 8);
  auto free_res = search_plan(m, h, free_q);
  ASSERT_TRUE(free_res.ok() && free_res->feasible);
  for (int64_t mb : {1, 2, 8}) {
    SearchRequest q = free_q;
    q.micro_batch = mb;
    auto res = search_plan(m, h, q);
    ASSERT_TRUE(res.ok() && res->feasible) << mb;
    EXPECT_EQ(res->best.plan.training.micro_batch, mb);
    EXPECT_EQ(res->best.plan.training.grad_accum, 8 / mb);
    for (const Candidate& c : res->alternatives) EXPECT_EQ(c.plan.training.micro_batch, mb);
    EXPECT_LE(res->best.result.tokens_per_s, free_res->best.result.tokens_per_s * (1 + 1e-12));
  }
  SearchRequest bad = free_q;
  bad.micro_batch = 3;
  auto refused = search_plan(m, h, bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("micro-batch 3 does not divide the step's 8 sequences"), std::string::npos)
      << refused.status().message();
}

TEST(Search, LossyFormatsOnlyWhenThePolicyAllowsThem) {
  HardwareProfile h = with_ram(rig("h200-1.5tb"), 768.0 * 1073741824.0);
  SearchRequest q = request("llama-2-70b", "h200-1.5tb");
  auto full = search_plan(model("llama-2-70b"), h, q);
  ASSERT_TRUE(full.ok() && full->feasible);
  EXPECT_EQ(full->best.plan.optimizer.m_format, StateFormat::kFp32);
  EXPECT_EQ(full->best.plan.optimizer.v_format, StateFormat::kFp32);
  q.policy.state_formats = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kQ8};
  auto lossy = search_plan(model("llama-2-70b"), h, q);
  ASSERT_TRUE(lossy.ok() && lossy->feasible);
  EXPECT_GE(lossy->best.result.tokens_per_s, full->best.result.tokens_per_s * (1 - 1e-12));
}

// Every plan the search writes (the best and the alternatives) for each shipped rig fits the
// compiled step's footprint against the rig's capacities, is accepted by the simulator, and
// carries the rig's usable device budget (the executor enforces it).
TEST(Search, EveryWrittenPlanFitsTheStepFootprintOnEveryShippedRig) {
  int plans = 0;
  for (const std::string& model_name : {std::string("small-llama"), std::string("llama-2-7b")}) {
    const ModelSpec m = model(model_name);
    for (const std::string& rig_name : list_profiles("hardware")) {
      const HardwareProfile h = rig(rig_name);
      auto res = search_plan(m, h, request(model_name, rig_name));
      ASSERT_TRUE(res.ok()) << model_name << " on " << rig_name << ": " << res.status().to_string();
      if (!res->feasible) continue;
      std::vector<Plan> written = {res->best.plan};
      for (const Candidate& c : res->alternatives) written.push_back(c.plan);
      for (const Plan& p : written) {
        SCOPED_TRACE(model_name + " on " + rig_name + ": " + describe_knobs(p));
        EXPECT_EQ(p.placement.device_budget_bytes, step::usable_device_bytes(h));
        const step::ActivationLayout layout = step::layout_for(step::backend_of_rig(h), m, p);
        auto sched = step::compile(p, m, layout);
        ASSERT_TRUE(sched.ok()) << sched.status().to_string();
        const Status fits = step::check_fits(step::footprint(*sched, layout), step::capacity_of(p, h));
        EXPECT_TRUE(fits.ok()) << fits.to_string();
        auto sim = sim::simulate(p, m, h);
        ASSERT_TRUE(sim.ok()) << sim.status().to_string();
        EXPECT_TRUE(sim->feasible) << sim->reason;
        ++plans;
      }
    }
  }
  EXPECT_GE(plans, 7);
}

// The search's sizing memoises the device arena and the host tiers on the knobs each depends on;
// every candidate's figures must equal the compiled step's footprint, in any order of asking.
TEST(Search, MemoisedSizingEqualsTheCompiledFootprint) {
  for (const std::string& rig_name : {std::string("rtx4090-256gb"), std::string("cpu-dev-2core")}) {
    const ModelSpec m = model("tiny-llama-gqa");
    const HardwareProfile h = rig(rig_name);
    SearchRequest q = request("tiny-llama-gqa", rig_name, 128, 128 * 8);
    q.policy.state_formats = {StateFormat::kFp32, StateFormat::kQ8};
    SearchOptions opt;
    SearchResult res;
    auto space = detail::resolve_request(m, h, q, opt, res);
    ASSERT_TRUE(space.ok()) << space.status().to_string();
    detail::Sizer sizer(*space);
    std::vector<detail::Knobs> all = detail::structural_knobs(*space);
    ASSERT_GT(all.size(), 20u);
    int64_t checked = 0;
    for (int pass = 0; pass < 2; ++pass) {  // the second pass asks in reverse: cache hits across keys
      if (pass == 1) std::reverse(all.begin(), all.end());
      for (const detail::Knobs& base : all)
        for (int64_t K : {1, 3}) {
          detail::Knobs k = detail::at_prefetch(base, K);
          k.staging = nvme_unit_transfer_bytes(m, k.master_nvme, k.states_nvme, k.m_format, k.v_format, 128) * (K == 1 ? 1 : 2);
          auto got = sizer.need(k);
          ASSERT_TRUE(got.ok()) << got.status().to_string();
          const Plan p = detail::make_plan(k, *space);
          const step::ActivationLayout layout = step::layout_for(step::backend_of_rig(h), m, p);
          auto sched = step::compile(p, m, layout);
          ASSERT_TRUE(sched.ok()) << sched.status().to_string();
          const step::Footprint f = step::footprint(*sched, layout);
          EXPECT_EQ(got->device, f.peak.device) << describe_knobs(p);
          EXPECT_EQ(got->pinned, f.peak.pinned) << describe_knobs(p);
          EXPECT_EQ(got->ram, f.peak.ram) << describe_knobs(p);
          EXPECT_EQ(got->nvme, f.peak.nvme) << describe_knobs(p);
          ++checked;
        }
    }
    EXPECT_LT(sizer.compiles(), checked / 2) << "the memo must save compilations";
  }
}

}  // namespace
}  // namespace megatrain::planner

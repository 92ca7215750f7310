// The simulator and the executor accept and refuse the same plans (issue 16).
//
// Each plan goes through both entry points as their programs use them:
// - simulator: Plan::from_json_text, then sim::simulate (what `megatrain-plan simulate` runs);
//   "accept" is a feasible result.
// - executor: Plan::from_json_text, the model, a data loader, HostState::create with the NVMe tier
//   in a temporary folder, then Trainer::create on the CPU backend (the sequence of
//   executor/app/main.cpp); "accept" is that all of them succeed.
// What is compared is plan validity, not capacity: every plan is run against an ample rig
// (h200-1.5tb: 1.5 TiB of RAM, two 7.68 TB drives, 141 GB of GPU memory) with the whole GPU as the
// device budget, and with the tiny model, so no capacity verdict can decide; a refusal on either
// side is then a plan rule, and both must give it. precision.compute is fp32 throughout: bf16
// compute is the CUDA backend's, a backend capability the CPU backend refuses, not a plan rule.
// The plans: every example in profiles/plans/ with its model and rig replaced as above (and its
// staging capped at four unit transfers, so the executor does not allocate the 32 GiB a 123B plan
// asks for), then 500 from a seeded RNG mutating the fields of the tiny plan (on tiny-llama-gqa
// or tiny-qwen2), each field drawn from values on both sides of its rules.
// A disagreement prints the plan and both messages.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "executor/file_test_util.h"
#include "megatrain/core/plan.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/simulator/step_model.h"

namespace {

using namespace megatrain;
using namespace megatrain::exec;
using Json = nlohmann::ordered_json;
namespace fs = std::filesystem;
using megatrain::test::ScratchDir;

fs::path make_dir(const ScratchDir& dir, const std::string& name) {
  fs::create_directories(dir / name);
  return dir / name;
}

constexpr const char* kModel = "tiny-llama-gqa";
constexpr const char* kRig = "h200-1.5tb";

struct Verdict {
  bool accepted = false;
  std::string message;
};

Verdict refused(const Status& s) { return Verdict{false, s.to_string()}; }

Verdict simulator_verdict(const std::string& text) {
  auto plan = Plan::from_json_text(text);
  if (!plan.ok()) return refused(plan.status());
  auto r = sim::simulate(*plan, sim::SimOptions{});
  if (!r.ok()) return refused(r.status());
  if (!r->feasible) return Verdict{false, "infeasible: " + r->reason};
  return Verdict{true, ""};
}

Verdict executor_verdict(const std::string& text, const std::shared_ptr<const TokenFile>& tokens) {
  auto plan = Plan::from_json_text(text);
  if (!plan.ok()) return refused(plan.status());
  auto model = plan->resolve_model();
  if (!model.ok()) return refused(model.status());
  auto loader = DataLoader::create(tokens, plan->training.seq_len, plan->training.micro_batch, plan->training.grad_accum,
                                   plan->training.data_order, static_cast<uint64_t>(plan->training.seed), model->config().vocab_size);
  if (!loader.ok()) return refused(loader.status());
  NvmePlacement nvme = nvme_placement_of(plan->placement);
  const bool all_gradients = plan->schedule.order != ScheduleOrder::kLayerMajor || plan->training.clip_grad_norm > 0;
  auto state = HostState::create(*model, plan->precision.transfer, plan->optimizer.m_format, plan->optimizer.v_format,
                                 plan->optimizer.block_size, nvme, all_gradients);
  if (!state.ok()) return refused(state.status());
  TrainerOptions opt;
  opt.backend = "cpu";
  opt.threads = 1;
  auto trainer = Trainer::create(*plan, *model, *state, *loader, opt);
  if (!trainer.ok()) return refused(trainer.status());
  return Verdict{true, ""};
}

// The least staging the plan rule accepts for this plan's placement and formats.
int64_t unit_transfer(const Json& pj) {
  Json ram = pj;
  ram["placement"] = {{"master_weights", "ram"}, {"optimizer_states", "ram"}};
  auto plan = Plan::from_json_text(ram.dump());
  if (!plan.ok()) return 0;
  auto model = plan->resolve_model();
  if (!model.ok()) return 0;
  const Json& pl = pj["placement"];
  return nvme_unit_transfer_bytes(*model, pl.value("master_weights", "ram") == "nvme",
                                  pl.value("optimizer_states", "ram") == "nvme", plan->optimizer.m_format,
                                  plan->optimizer.v_format, plan->optimizer.block_size);
}

Json read_json(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return Json::parse(ss.str());
}

// An example plan made runnable here: the tiny model, the ample rig, fp32 compute, and fields
// that name the model's size clamped to the tiny model's.
Json retarget(Json pj, const fs::path& nvme_dir) {
  pj["model"] = kModel;
  pj["rig"] = kRig;
  pj["precision"]["compute"] = "fp32";
  pj["training"]["seq_len"] = std::min<int64_t>(pj["training"]["seq_len"].get<int64_t>(), 64);
  pj["training"]["micro_batch"] = std::min<int64_t>(pj["training"]["micro_batch"].get<int64_t>(), 2);
  pj["training"]["grad_accum"] = std::min<int64_t>(pj["training"]["grad_accum"].get<int64_t>(), 2);
  pj["schedule"]["checkpoint_every"] = std::min<int64_t>(pj["schedule"]["checkpoint_every"].get<int64_t>(), 2);
  pj["placement"]["device_budget_bytes"] = 0;
  if (!pj["placement"]["nvme_dirs"].empty()) pj["placement"]["nvme_dirs"] = Json::array({nvme_dir.string()});
  if (const int64_t unit = unit_transfer(pj); unit > 0)
    pj["placement"]["pinned_staging_bytes"] = std::min<int64_t>(pj["placement"]["pinned_staging_bytes"].get<int64_t>(), 4 * unit);
  if (pj.contains("optimizer")) pj["optimizer"]["threads"] = std::min<int64_t>(pj["optimizer"]["threads"].get<int64_t>(), 4);
  return pj;
}

template <typename T>
T pick(std::mt19937_64& rng, const std::vector<T>& v) {
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

// One mutation of the tiny plan: every field drawn from values on both sides of its rules.
Json fuzzed_plan(const Json& base, std::mt19937_64& rng, const fs::path& nvme_dir) {
  Json pj = base;
  Json& t = pj["training"];
  pj["model"] = pick<std::string>(rng, {kModel, "tiny-qwen2"});  // tiny-qwen2: tied head, q/k/v biases
  t["seq_len"] = pick<int64_t>(rng, {1, 8, 16, 64, 64, 128, 129});
  t["micro_batch"] = pick<int64_t>(rng, {1, 2, 3});
  t["grad_accum"] = pick<int64_t>(rng, {1, 2, 3});
  const int64_t steps = pick<int64_t>(rng, {1, 4, 50});
  t["steps"] = steps;
  t["warmup_steps"] = pick<int64_t>(rng, {0, 0, 1, steps, steps + 1});
  t["lr_schedule"] = pick<std::string>(rng, {"constant", "cosine", "linear"});
  t["clip_grad_norm"] = pick<double>(rng, {0.0, 1.0});
  t["data_order"] = pick<std::string>(rng, {"shuffled", "sequential"});
  pj["precision"]["transfer"] = pick<std::string>(rng, {"fp32", "bf16", "bf16"});
  Json& s = pj["schedule"];
  s["order"] = pick<std::string>(rng, {"layer-major", "microbatch-major"});
  s["prefetch_depth"] = pick<int64_t>(rng, {1, 1, 2, 3});
  s["device_layer_buffers"] = pick<int64_t>(rng, {2, 3, 4, 4, 5});
  s["checkpoint_every"] = pick<int64_t>(rng, {0, 1, 1, 2, 2, 3});
  s["checkpoint_location"] = pick<std::string>(rng, {"device", "host"});
  Json& o = pj["optimizer"];
  o["m_format"] = pick<std::string>(rng, {"fp32", "bf16", "q8", "q4", "q3", "q2"});
  o["v_format"] = pick<std::string>(rng, {"fp32", "bf16", "q8", "q4", "q3", "q2"});
  o["block_size"] = pick<int64_t>(rng, {16, 64, 128, 1024});
  o["threads"] = pick<int64_t>(rng, {0, 1, 2, 224, 225});
  Json& p = pj["placement"];
  p["master_weights"] = pick<std::string>(rng, {"ram", "nvme"});
  p["optimizer_states"] = pick<std::string>(rng, {"ram", "nvme", "nvme"});
  p["nvme_dirs"] = pick<int>(rng, {0, 1, 1, 1, 1, 1}) ? Json::array({nvme_dir.string()}) : Json::array();
  p["nvme_queue_depth"] = pick<int64_t>(rng, {1, 8, 32});
  p["nvme_block_bytes"] = pick<int64_t>(rng, {4096, 65536, 1048576});
  p["device_budget_bytes"] = 0;
  const int64_t unit = unit_transfer(pj);
  p["pinned_staging_bytes"] = pick<int64_t>(rng, {0, 1, 4096, unit - 1, unit, unit + 1, 2 * unit + 7, 3 * unit});
  if (p["pinned_staging_bytes"].get<int64_t>() < 0) p["pinned_staging_bytes"] = 0;
  return pj;
}

TEST(PlanAgreement, SimulatorAndExecutorAcceptTheSamePlans) {
  ScratchDir dir("plan-agreement");
  const fs::path nvme_dir = make_dir(dir, "nvme");
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 20000; ++i) toks.push_back((i * 2654435761u >> 7) % 256);
  auto tokens = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks, "tokens"));

  std::vector<std::pair<std::string, Json>> plans;
  const fs::path examples = fs::path(MEGATRAIN_PROFILES_DIR) / "plans";
  for (const auto& e : fs::directory_iterator(examples))
    if (e.path().extension() == ".json")
      plans.emplace_back(e.path().filename().string(), retarget(read_json(e.path()), nvme_dir));
  ASSERT_GE(plans.size(), 3u) << "no example plans in " << examples;
  const Json base = retarget(read_json(examples / "tiny-cpu.json"), nvme_dir);
  std::mt19937_64 rng(16);
  for (int i = 0; i < 500; ++i) plans.emplace_back("fuzzed plan " + std::to_string(i), fuzzed_plan(base, rng, nvme_dir));

  int accepted = 0, refused_both = 0, disagreements = 0;
  const bool verbose = std::getenv("MEGATRAIN_AGREEMENT_VERBOSE") != nullptr;  // every verdict, to tune the fuzzer
  for (const auto& [name, pj] : plans) {
    const std::string text = pj.dump();
    const Verdict sim = simulator_verdict(text);
    const Verdict exe = executor_verdict(text, tokens);
    if (verbose) std::printf("%s: %s | %s\n", name.c_str(), sim.accepted ? "feasible" : sim.message.c_str(),
                             exe.accepted ? "accepted" : exe.message.c_str());
    if (sim.accepted != exe.accepted) {
      ++disagreements;
      ADD_FAILURE() << name << ": the simulator " << (sim.accepted ? "accepts" : "refuses") << " and the executor "
                    << (exe.accepted ? "accepts" : "refuses") << " this plan:\n"
                    << pj.dump(2) << "\nsimulator: " << (sim.accepted ? "feasible" : sim.message)
                    << "\nexecutor: " << (exe.accepted ? "accepted" : exe.message);
    } else if (sim.accepted) {
      ++accepted;
    } else {
      ++refused_both;
    }
  }
  std::printf("%zu plans: %d accepted by both, %d refused by both, %d disagreements\n", plans.size(), accepted,
              refused_both, disagreements);
  // The fuzzer must exercise both verdicts, or it proves nothing.
  EXPECT_GT(accepted, 20);
  EXPECT_GT(refused_both, 20);
}

// The case: NVMe-resident states with no staging are refused by the one rule, and the
// message names the key, the value and the minimum.
TEST(PlanAgreement, NvmeStatesWithoutStagingAreRefusedByBothWithTheSameMessage) {
  ScratchDir dir("plan-agreement-staging");
  Json pj = retarget(read_json(fs::path(MEGATRAIN_PROFILES_DIR) / "plans" / "tiny-cpu.json"), dir.path());
  pj["placement"]["optimizer_states"] = "nvme";
  pj["placement"]["nvme_dirs"] = Json::array({make_dir(dir, "nvme").string()});
  pj["placement"]["pinned_staging_bytes"] = 0;
  const int64_t unit = unit_transfer(pj);
  ASSERT_GT(unit, 0);
  auto tokens = std::make_shared<const TokenFile>(TokenFile::from_tokens(std::vector<uint32_t>(4096, 1), "tokens"));
  const Verdict sim = simulator_verdict(pj.dump()), exe = executor_verdict(pj.dump(), tokens);
  EXPECT_FALSE(sim.accepted);
  EXPECT_FALSE(exe.accepted);
  EXPECT_EQ(sim.message, exe.message);
  for (const std::string& part : {std::string("placement.pinned_staging_bytes: 0"), "accepted: >= " + std::to_string(unit)})
    EXPECT_NE(sim.message.find(part), std::string::npos) << sim.message;
  // One unit's transfer is enough, on both sides.
  pj["placement"]["pinned_staging_bytes"] = unit;
  EXPECT_TRUE(simulator_verdict(pj.dump()).accepted) << simulator_verdict(pj.dump()).message;
  EXPECT_TRUE(executor_verdict(pj.dump(), tokens).accepted) << executor_verdict(pj.dump(), tokens).message;
}

// The rule also holds for a HostState made without a plan (the library's own callers).
TEST(PlanAgreement, HostStateRefusesStagingBelowOneUnit) {
  ScratchDir dir("plan-agreement-hoststate");
  auto model = ModelSpec::load(kModel);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  NvmePlacement nvme;
  nvme.states = true;
  nvme.store.dirs.push_back(make_dir(dir, "nvme"));
  const int64_t unit = nvme_unit_transfer_bytes(*model, false, true, StateFormat::kQ4, StateFormat::kQ4, 128);
  nvme.staging_bytes = unit - 1;
  auto hs = HostState::create(*model, DType::kFp32, StateFormat::kQ4, StateFormat::kQ4, 128, nvme, true);
  ASSERT_FALSE(hs.ok());
  EXPECT_NE(hs.status().message().find("placement.pinned_staging_bytes: " + std::to_string(unit - 1)), std::string::npos)
      << hs.status().to_string();
  nvme.staging_bytes = unit;
  auto ok = HostState::create(*model, DType::kFp32, StateFormat::kQ4, StateFormat::kQ4, 128, nvme, true);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->staging_buffers(), 1);
}

}  // namespace

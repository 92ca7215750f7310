// The compiled step (step/) is one schedule and one footprint for the simulator, the planner and
// the executor (issue 17). These tests train real plans on the CPU backend and hold the executor's
// measured trace and allocations against the simulator's prediction of the same plan:
// - span for span: on every lane, the (kind, step, layer, micro-batch) sequence of the measured
//   trace equals the simulated one (stalls aside);
// - byte for byte: the predicted peak per tier against the trainer's own accounting and against
//   the process's real allocations (every AlignedArray and the CPU arena), within 5%;
// - a budget one byte short of the footprint is refused by both, and a budget at it runs;
// - every plan the planner writes for a rig is accepted by Trainer::create against that budget.
// The plans are the planner's choices for three small models on the CPU rig at several device and
// RAM sizes (best and runners-up), plus variants of them that cover what the planner did not pick.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "executor/file_test_util.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/trace_store.h"
#include "megatrain/core/trace_vocab.h"
#include "megatrain/executor/aligned_array.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/planner/search.h"
#include "megatrain/simulator/step_model.h"
#include "megatrain/step/schedule.h"

namespace {

using namespace megatrain;
using namespace megatrain::exec;
namespace fs = std::filesystem;
using megatrain::test::ScratchDir;

constexpr int kSteps = 3;  // the simulator's default: the reported step is the last

struct SpanKey {
  std::string kind;
  int64_t step, layer, mb;
  bool operator==(const SpanKey&) const = default;
};
std::string text(const SpanKey& k) {
  return k.kind + " step " + std::to_string(k.step) + " L" + std::to_string(k.layer) + " mb" + std::to_string(k.mb);
}
using Lanes = std::map<std::string, std::vector<SpanKey>>;  // lane kind -> spans in order

HardwareProfile dev_rig(double gpu_bytes, double ram_bytes, const fs::path& nvme_dir) {
  auto rig = HardwareProfile::load((fs::path(MEGATRAIN_PROFILES_DIR) / "hardware" / "cpu-dev-2core.json").string());
  EXPECT_TRUE(rig.ok()) << rig.status().to_string();
  HardwareProfile r = *rig;
  r.gpu.memory_bytes.value = gpu_bytes;
  r.host.ram_bytes.value = ram_bytes;
  r.host.pinnable_bytes.value = std::floor(ram_bytes * 0.9);
  for (auto& d : r.storage) d.path = nvme_dir.string();
  return r;
}

ProfileRef inline_rig(const HardwareProfile& rig) { return ProfileRef{true, rig.to_json_text()}; }

struct GridPlan {
  std::string label;
  Plan plan;
};

// Qwen3-MoE with a dense first layer (mlp_only_layers [0]): its later layers are larger than
// layer 0, which every per-layer buffer must allow for. Embedded in the plan as a config object.
std::string dense_first_moe_config() {
  static const std::string text = [] {
    std::ifstream in(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / "tiny-qwen3-moe.json");
    auto j = nlohmann::ordered_json::parse(in);
    j["mlp_only_layers"] = {0};
    return j.dump();
  }();
  return text;
}
constexpr const char* kDenseFirstMoe = "tiny-qwen3-moe, dense layer 0";

ProfileRef model_ref(const std::string& model) {
  return model == kDenseFirstMoe ? ProfileRef{true, dense_first_moe_config()} : ProfileRef{false, model};
}

// The planner's choices: best and runners-up of searches over dense models (Llama, Qwen2's tied
// head, Qwen3's q/k norms), Mixture-of-Experts models (gpt-oss with its sliding and full layers,
// Qwen3-MoE with a dense first layer), several device and RAM sizes (tight RAM pushes state to
// NVMe) and two state-format policies.
std::vector<GridPlan> planner_plans(const fs::path& nvme_dir, std::vector<std::string>& errors) {
  std::vector<GridPlan> out;
  std::set<std::string> seen;
  struct Case {
    const char* model;
    double gpu, ram;
    bool lossy;
  };
  const Case cases[] = {
      {"small-llama", 64.0 * (1 << 20), 24e9, false},   {"small-llama", 24.0 * (1 << 20), 24e9, true},
      {"small-llama", 256.0 * (1 << 20), 60e6, false}, {"tiny-qwen2", 16.0 * (1 << 20), 24e9, true},
      {"tiny-qwen2", 64.0 * (1 << 20), 24e9, false},    {"tiny-llama-gqa", 16.0 * (1 << 20), 24e9, false},
      {"tiny-llama-gqa", 128.0 * (1 << 20), 40e6, true}, {"tiny-qwen3", 16.0 * (1 << 20), 24e9, false},
      {"tiny-gpt-oss", 32.0 * (1 << 20), 24e9, true},    {kDenseFirstMoe, 16.0 * (1 << 20), 24e9, false},
      {kDenseFirstMoe, 64.0 * (1 << 20), 6e6, true},
  };
  for (const Case& c : cases) {
    const ProfileRef ref = model_ref(c.model);
    auto model = ref.inline_object ? ModelSpec::from_config_json(ref.value, c.model) : ModelSpec::load(c.model);
    if (!model.ok()) {
      errors.push_back(model.status().to_string());
      continue;
    }
    const HardwareProfile rig = dev_rig(c.gpu, c.ram, nvme_dir);
    planner::SearchRequest req;
    req.seq_len = 64;
    req.tokens_per_step = 64 * 4;
    req.steps = kSteps;
    req.top = 5;
    if (c.lossy) req.policy.state_formats = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kQ8};
    req.model_ref = ref;
    req.rig_ref = inline_rig(rig);
    planner::SearchOptions opt;
    opt.relief = false;
    auto r = planner::search_plan(*model, rig, req, opt);
    if (!r.ok() || !r->feasible) {
      errors.push_back(std::string("no plan for ") + c.model + " with " + std::to_string(c.gpu) + " device bytes and " +
                       std::to_string(c.ram) + " bytes of RAM" + (r.ok() ? "" : ": " + r.status().to_string()));
      continue;
    }
    std::vector<const planner::Candidate*> cands = {&r->best};
    for (const auto& a : r->alternatives) cands.push_back(&a);
    for (const planner::Candidate* cand : cands) {
      Plan p = cand->plan;
      p.predicted.reset();
      if (seen.insert(p.to_json_text()).second)
        out.push_back({std::string(c.model) + " (" + planner::describe_knobs(p) + ")", p});
    }
  }
  return out;
}

bool simulates(const Plan& p) {
  auto r = sim::simulate(p);
  return r.ok() && r->feasible;
}

// Variants of planner plans for what a search may not pick: clipping on and off, the other order,
// the other checkpoint location, deeper prefetch, quantised moments.
std::vector<GridPlan> variants(const std::vector<GridPlan>& base) {
  std::vector<GridPlan> out;
  for (size_t i = 0; i < base.size(); ++i) {
    Plan p = base[i].plan;
    switch (i % 6) {
      case 0: p.training.clip_grad_norm = p.training.clip_grad_norm > 0 ? 0 : 1.0; break;
      case 1:
        p.schedule.order = p.schedule.order == ScheduleOrder::kLayerMajor ? ScheduleOrder::kMicrobatchMajor : ScheduleOrder::kLayerMajor;
        break;
      case 2:
        p.schedule.checkpoint_every = std::max<int64_t>(p.schedule.checkpoint_every, 1);
        p.schedule.checkpoint_location =
            p.schedule.checkpoint_location == CheckpointLocation::kHost ? CheckpointLocation::kDevice : CheckpointLocation::kHost;
        p.schedule.device_layer_buffers = std::max(p.schedule.device_layer_buffers, p.schedule.checkpoint_every + 1);
        break;
      case 3:
        p.schedule.prefetch_depth += 1;
        p.schedule.device_layer_buffers = std::max(p.schedule.device_layer_buffers, p.schedule.prefetch_depth + 1);
        break;
      case 4:
        p.optimizer.m_format = StateFormat::kBf16;
        p.optimizer.v_format = StateFormat::kQ8;
        break;
      case 5: {  // the optimizer states on NVMe, with room to stage two units
        auto model = p.resolve_model();
        if (!model.ok()) break;
        p.placement.optimizer_states = Tier::kNvme;
        auto rig = p.resolve_rig();
        if (rig.ok() && !rig->storage.empty()) p.placement.nvme_dirs = {rig->storage[0].path};
        p.placement.pinned_staging_bytes = 2 * nvme_unit_transfer_bytes(*model, p.placement.master_weights == Tier::kNvme, true,
                                                                         p.optimizer.m_format, p.optimizer.v_format,
                                                                         p.optimizer.block_size);
        break;
      }
    }
    if (!(p == base[i].plan) && simulates(p)) out.push_back({base[i].label + " [variant " + std::to_string(i % 5) + "]", p});
  }
  return out;
}

Lanes simulated_lanes(const sim::SimResult& r) {
  Lanes lanes;
  const sim::Engine& e = *r.engine;
  for (size_t res = 0; res < e.resources().size(); ++res)
    for (sim::TaskId t : e.queue(static_cast<int32_t>(res))) {
      const sim::TaskSpec& ts = e.task(t);
      lanes[e.resources()[res].kind].push_back({span_kind_name(sim::span_kind_of(ts)), ts.step, ts.layer, ts.micro_batch});
    }
  return lanes;
}

Result<Lanes> measured_lanes(const fs::path& trace) {
  MT_ASSIGN_OR_RETURN(auto reader, TraceReader::open(trace));
  Lanes lanes;
  for (const TraceLane& lane : reader->lanes()) {
    MT_ASSIGN_OR_RETURN(auto spans, reader->spans(lane.id));
    std::stable_sort(spans.begin(), spans.end(), [](const TraceSpan& a, const TraceSpan& b) {
      return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.end_ns < b.end_ns;
    });
    auto& v = lanes[lane.kind];
    for (const TraceSpan& s : spans)
      if (s.kind != span_kind_name(SpanKind::kStall)) v.push_back({s.kind, s.step, s.layer, s.micro_batch});
  }
  return lanes;
}

struct Measured {
  Lanes lanes;
  MemoryInUse memory;
  int64_t allocated = 0;  // AlignedArray and arena bytes the state and the trainer allocated
  sim::SimResult predicted;
};

std::shared_ptr<const TokenFile> tokens() {
  static auto file = [] {
    std::vector<uint32_t> toks;
    for (uint32_t i = 0; i < 40000; ++i) toks.push_back((i * 2654435761u >> 7) % 256);
    return std::make_shared<const TokenFile>(TokenFile::from_tokens(toks));
  }();
  return file;
}

// Simulates the plan, then trains it for kSteps steps on the CPU backend with a trace.
Result<Measured> run(const Plan& plan, const fs::path& trace) {
  Measured m;
  MT_ASSIGN_OR_RETURN(ModelSpec model, plan.resolve_model());
  MT_ASSIGN_OR_RETURN(HardwareProfile rig, plan.resolve_rig());
  sim::SimOptions so;
  so.steps = kSteps;
  so.keep_engine = true;
  MT_ASSIGN_OR_RETURN(m.predicted, sim::simulate(plan, model, rig, so));
  if (!m.predicted.feasible) return invalid_argument("the simulator refuses the plan: " + m.predicted.reason);
  MT_ASSIGN_OR_RETURN(auto loader, DataLoader::create(tokens(), plan.training.seq_len, plan.training.micro_batch,
                                                      plan.training.grad_accum, plan.training.data_order, 1,
                                                      model.config().vocab_size));
  const int64_t before = aligned_bytes_in_use().load();
  MT_ASSIGN_OR_RETURN(HostState state, HostState::create(model, plan.precision.transfer, plan.optimizer.m_format,
                                                         plan.optimizer.v_format, plan.optimizer.block_size,
                                                         nvme_placement_of(plan.placement), !step::lends_gradients(plan)));
  MT_RETURN_IF_ERROR(state.init_random(7, 0.02));
  TrainerOptions o;
  o.backend = "cpu";
  o.threads = 1;
  o.record_trace = true;
  MT_ASSIGN_OR_RETURN(auto trainer, Trainer::create(plan, model, state, loader, o));
  m.allocated = aligned_bytes_in_use().load() - before;
  m.memory = trainer->memory_in_use();
  for (int s = 0; s < kSteps; ++s) MT_RETURN_IF_ERROR(trainer->run_step(s).status());
  MT_RETURN_IF_ERROR(trainer->finish_updates());
  MT_RETURN_IF_ERROR(trainer->write_trace(trace, plan.to_json_text()));
  MT_ASSIGN_OR_RETURN(m.lanes, measured_lanes(trace));
  return m;
}

// The first difference between two lanes' sequences, or "" when equal.
std::string first_difference(const std::vector<SpanKey>& sim, const std::vector<SpanKey>& exe) {
  for (size_t i = 0; i < std::max(sim.size(), exe.size()); ++i) {
    if (i >= sim.size()) return "the executor has more spans from #" + std::to_string(i) + ": " + text(exe[i]);
    if (i >= exe.size()) return "the simulator has more spans from #" + std::to_string(i) + ": " + text(sim[i]);
    if (!(sim[i] == exe[i])) return "span #" + std::to_string(i) + ": simulated " + text(sim[i]) + ", measured " + text(exe[i]);
  }
  return "";
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1.0); }

class CompiledStep : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("compiled-step");
    fs::create_directories(*dir_ / "nvme");
    errors_ = new std::vector<std::string>;
    plans_ = new std::vector<GridPlan>(planner_plans(*dir_ / "nvme", *errors_));
    const auto more = variants(*plans_);
    plans_->insert(plans_->end(), more.begin(), more.end());
    // The example plans' schedules on the CPU: tiny-cpu as it is.
    auto tiny = Plan::load(fs::path(MEGATRAIN_PROFILES_DIR) / "plans" / "tiny-cpu.json");
    if (tiny.ok()) plans_->insert(plans_->begin(), {"example tiny-cpu.json", *tiny});
    else errors_->push_back(tiny.status().to_string());
  }
  static void TearDownTestSuite() {
    delete errors_;
    delete plans_;
    delete dir_;
  }
  static ScratchDir* dir_;
  static std::vector<GridPlan>* plans_;
  static std::vector<std::string>* errors_;  // what building the grid could not do (failed in the first test)
};
ScratchDir* CompiledStep::dir_ = nullptr;
std::vector<GridPlan>* CompiledStep::plans_ = nullptr;
std::vector<std::string>* CompiledStep::errors_ = nullptr;

TEST_F(CompiledStep, TheGridCoversEveryScheduleFeature) {
  for (const std::string& e : *errors_) ADD_FAILURE() << e;
  std::map<std::string, int> have;
  for (const GridPlan& g : *plans_) {
    const Plan& p = g.plan;
    auto model = p.resolve_model();
    ASSERT_TRUE(model.ok());
    have["layer-major"] += p.schedule.order == ScheduleOrder::kLayerMajor;
    have["microbatch-major"] += p.schedule.order == ScheduleOrder::kMicrobatchMajor;
    have["prefetch 1"] += p.schedule.prefetch_depth == 1;
    have["prefetch >= 2"] += p.schedule.prefetch_depth >= 2;
    have["no recompute"] += p.schedule.checkpoint_every == 0;
    have["host checkpoints"] += p.schedule.checkpoint_every > 0 && p.schedule.checkpoint_location == CheckpointLocation::kHost;
    have["device checkpoints"] += p.schedule.checkpoint_every > 0 && p.schedule.checkpoint_location == CheckpointLocation::kDevice;
    have["nvme"] += p.placement.master_weights == Tier::kNvme || p.placement.optimizer_states == Tier::kNvme;
    have["clipping"] += p.training.clip_grad_norm > 0;
    have["lent gradients"] += step::lends_gradients(p);
    have["tied head"] += model->config().tie_word_embeddings;
    have["quantised moments"] += p.optimizer.m_format != StateFormat::kFp32 || p.optimizer.v_format != StateFormat::kFp32;
    have["grad_accum > 1"] += p.training.grad_accum > 1;
    have["qwen3"] += model->config().qk_norm && !model->config().is_moe();
    have["gpt-oss"] += model->config().moe == "gpt_oss";
    bool mixed = false;
    for (int64_t l = 0; l < model->config().num_layers; ++l) mixed |= model->config().is_moe_layer(l) != model->config().is_moe_layer(0);
    have["mixed dense and MoE layers"] += mixed;
  }
  const auto chosen = std::count_if(plans_->begin(), plans_->end(), [](const GridPlan& g) {
    return g.label.find("[variant") == std::string::npos && g.label.rfind("example", 0) != 0;
  });
  EXPECT_GE(chosen, 30) << "at least 30 plans the planner chose";
  for (const char* f : {"layer-major", "microbatch-major", "prefetch 1", "prefetch >= 2", "no recompute", "host checkpoints",
                        "device checkpoints", "nvme", "clipping", "lent gradients", "tied head", "quantised moments",
                        "grad_accum > 1", "qwen3", "gpt-oss", "mixed dense and MoE layers"})
    EXPECT_GT(have[f], 0) << "no plan in the grid has " << f;
  std::printf("%zu plans (%ld chosen by the planner); coverage:", plans_->size(), static_cast<long>(chosen));
  for (const auto& [k, v] : have) std::printf(" %s %d,", k.c_str(), v);
  std::printf("\n");
}

TEST_F(CompiledStep, MeasuredSpansAndBytesEqualThePrediction) {
  double worst_ram = 0, worst_alloc = 0;
  std::string worst_ram_plan, worst_alloc_plan;
  int index = 0;
  for (const GridPlan& g : *plans_) {
    SCOPED_TRACE(g.label);
    auto m = run(g.plan, *dir_ / ("run" + std::to_string(index++) + ".mtrace"));
    ASSERT_TRUE(m.ok()) << m.status().to_string() << "\n" << g.plan.to_json_text();
    // Span for span on every lane the executor has.
    const Lanes sim = simulated_lanes(m->predicted);
    for (const auto& [lane, spans] : m->lanes) {
      ASSERT_TRUE(sim.count(lane)) << "the simulator has no lane " << lane;
      const std::string diff = first_difference(sim.at(lane), spans);
      EXPECT_EQ(diff, "") << "lane " << lane << " (" << spans.size() << " measured spans)\n" << g.plan.to_json_text();
    }
    for (const auto& [lane, spans] : sim) {
      if (!m->lanes.count(lane)) {
        EXPECT_TRUE(spans.empty()) << "the executor has no lane " << lane << " but the simulator has spans on it";
      }
    }
    // Bytes per tier: the trainer's accounting, and the allocations themselves.
    const PeakBytes& p = m->predicted.peak_bytes;
    EXPECT_EQ(m->memory.device, p.device) << "the arena is the footprint's device figure";
    EXPECT_LE(rel(static_cast<double>(m->memory.pinned), static_cast<double>(p.pinned)), 0.05) << m->memory.pinned << " vs " << p.pinned;
    EXPECT_LE(rel(static_cast<double>(m->memory.nvme), static_cast<double>(p.nvme)), 0.05) << m->memory.nvme << " vs " << p.nvme;
    const double ram_err = rel(static_cast<double>(m->memory.ram), static_cast<double>(p.ram));
    const double alloc_err = rel(static_cast<double>(m->allocated), static_cast<double>(p.ram));
    EXPECT_LE(ram_err, 0.05) << m->memory.ram << " vs " << p.ram;
    EXPECT_LE(alloc_err, 0.05) << "allocated " << m->allocated << " vs predicted " << p.ram;
    if (ram_err > worst_ram) worst_ram = ram_err, worst_ram_plan = g.label;
    if (alloc_err > worst_alloc) worst_alloc = alloc_err, worst_alloc_plan = g.label;
  }
  std::printf("%zu plans: worst RAM error %.3f%% against the trainer's accounting (%s), %.3f%% against the allocations (%s)\n",
              plans_->size(), 100 * worst_ram, worst_ram_plan.c_str(), 100 * worst_alloc, worst_alloc_plan.c_str());
}

TEST_F(CompiledStep, ABudgetOneByteShortIsRefusedByBothAndOneAtTheFootprintRuns) {
  int index = 0;
  for (size_t i = 0; i < plans_->size(); i += 7) {  // a sample of the grid: each takes two trainings
    const GridPlan& g = (*plans_)[i];
    SCOPED_TRACE(g.label);
    Plan p = g.plan;
    auto model = p.resolve_model();
    auto rig = p.resolve_rig();
    ASSERT_TRUE(model.ok() && rig.ok());
    const step::ActivationLayout layout = step::layout_for(step::BackendKind::kCpu, *model, p);
    auto sched = step::compile(p, *model, layout);
    ASSERT_TRUE(sched.ok()) << sched.status().to_string();
    const int64_t need = step::footprint(*sched, layout).peak.device;
    p.placement.device_budget_bytes = need - 1;
    auto short_sim = sim::simulate(p, *model, *rig);
    ASSERT_TRUE(short_sim.ok());
    EXPECT_FALSE(short_sim->feasible);
    EXPECT_EQ(short_sim->reason.rfind("device needs " , 0), 0u) << short_sim->reason;
    auto short_run = run(p, *dir_ / ("short" + std::to_string(index) + ".mtrace"));
    ASSERT_FALSE(short_run.ok());
    // The executor's own check, not the simulator inside run(): create a trainer directly.
    {
      auto loader = DataLoader::create(tokens(), p.training.seq_len, p.training.micro_batch, p.training.grad_accum,
                                       p.training.data_order, 1, model->config().vocab_size);
      ASSERT_TRUE(loader.ok());
      auto state = HostState::create(*model, p.precision.transfer, p.optimizer.m_format, p.optimizer.v_format,
                                     p.optimizer.block_size, nvme_placement_of(p.placement), !step::lends_gradients(p));
      ASSERT_TRUE(state.ok()) << state.status().to_string();
      TrainerOptions o;
      o.backend = "cpu";
      auto t = Trainer::create(p, *model, *state, *loader, o);
      ASSERT_FALSE(t.ok());
      EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted) << t.status().to_string();
      EXPECT_NE(t.status().message().find("device needs"), std::string::npos) << t.status().to_string();
      EXPECT_NE(t.status().message().find("(" + std::to_string(need) + " bytes"), std::string::npos) << t.status().to_string();
      EXPECT_NE(t.status().message().find("(1 bytes)"), std::string::npos) << "over by one byte: " << t.status().to_string();
    }
    p.placement.device_budget_bytes = need;
    auto at = run(p, *dir_ / ("at" + std::to_string(index++) + ".mtrace"));
    EXPECT_TRUE(at.ok()) << at.status().to_string();
  }
}

TEST_F(CompiledStep, EveryPlanThePlannerWritesIsAcceptedByTheExecutorAgainstItsBudget) {
  for (const GridPlan& g : *plans_) {
    if (g.label.find("[variant") != std::string::npos || g.label.rfind("example", 0) == 0) continue;  // the planner's own
    SCOPED_TRACE(g.label);
    const Plan& p = g.plan;
    auto model = p.resolve_model();
    auto rig = p.resolve_rig();
    ASSERT_TRUE(model.ok() && rig.ok());
    EXPECT_EQ(p.placement.device_budget_bytes, step::usable_device_bytes(*rig)) << "the plan carries the rig's usable memory";
    auto loader = DataLoader::create(tokens(), p.training.seq_len, p.training.micro_batch, p.training.grad_accum,
                                     p.training.data_order, 1, model->config().vocab_size);
    ASSERT_TRUE(loader.ok());
    auto state = HostState::create(*model, p.precision.transfer, p.optimizer.m_format, p.optimizer.v_format, p.optimizer.block_size,
                                   nvme_placement_of(p.placement), !step::lends_gradients(p));
    ASSERT_TRUE(state.ok()) << state.status().to_string();
    TrainerOptions o;
    o.backend = "cpu";
    auto t = Trainer::create(p, *model, *state, *loader, o);
    EXPECT_TRUE(t.ok()) << t.status().to_string() << "\n" << p.to_json_text();
  }
}

TEST(CompiledStepLayout, TheCpuBackendKeepsWhatTheLayoutSays) {
  // The trainer sizes its buffers with the backend's own figures; the planner and the simulator
  // with step::cpu_layout. They must be the same numbers.
  for (const char* name : {"small-llama", "tiny-qwen2", "tiny-llama-gqa", "tiny-qwen3", "tiny-mixtral", "tiny-gpt-oss", kDenseFirstMoe}) {
    const ProfileRef ref = model_ref(name);
    auto model = ref.inline_object ? ModelSpec::from_config_json(ref.value, name) : ModelSpec::load(name);
    ASSERT_TRUE(model.ok());
    for (int64_t mb : {1, 3})
      for (int64_t seq : {16, 64}) {
        auto d = make_dims(*model, mb, seq);
        ASSERT_TRUE(d.ok());
        BackendOptions bo;
        auto be = make_backend("cpu", *model, *d, bo);
        ASSERT_TRUE(be.ok()) << be.status().to_string();
        const step::ActivationLayout l = step::cpu_layout(*model, mb, seq);
        EXPECT_EQ((*be)->layer_act_floats(), l.layer_act_floats) << name;
        EXPECT_EQ((*be)->layer_workspace_floats(), l.layer_workspace_floats) << name;
        EXPECT_EQ((*be)->head_workspace_floats(), l.head_workspace_floats) << name;
        EXPECT_EQ((*be)->private_bytes(), l.private_bytes) << name;
      }
  }
}

}  // namespace

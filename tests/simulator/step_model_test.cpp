// The step model on a synthetic rig and model whose costs are round numbers: hand-computed step
// times (serial chain, transfer-bound, compute-bound, hidden optimizer), weight traffic per
// order, peak device bytes, refusals, and properties of random plans.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/core/plan.h"
#include "megatrain/simulator/step_model.h"
#include "megatrain/step/schedule.h"

namespace megatrain::sim {
namespace {

using Json = nlohmann::ordered_json;

// ---- the synthetic rig and model ---------------------------------------------------------------

// Flat curves (one point) make every efficiency and bandwidth a constant. "Negligible" figures
// are chosen so that the tasks they time take under 1e-13 s, far below every tolerance below.
struct RigFigures {
  double matmul_bf16 = 1e12;      // FLOP/s at efficiency 1
  double gpu_bandwidth = 1e24;    // element-wise work ~0
  double gpu_memory = 1e12;
  double h2d = 1e9;               // bytes/s
  double d2h = 1e20;
  double host_bandwidth = 1e22;   // pools never slow anything
  double ram = 1e15;
  double adam = 1e20;             // parameters/s
  int cores = 4;
  bool cpu_backend = false;       // links.kind "host-memcpy": the CPU backend's rig
  // The cluster section (gpus_per_node 0: none).
  int gpus_per_node = 0, nodes = 1, gpus_per_switch = 1;
  double uplink = 0, inter_node = 0, inter_latency = 0;
  double nvme_read = 0, nvme_write = 0;  // one drive at /nvme with these bytes/s (0: no drive)
};

Json figure(double v) { return Json{{"value", v}, {"provenance", {{"kind", "estimate"}, {"source", "synthetic test rig"}}}}; }
Json flat_curve(double y) {
  return Json{{"points", Json::array({Json::array({1.0, y})})}, {"provenance", {{"kind", "estimate"}, {"source", "synthetic test rig"}}}};
}

Json rig_json(const RigFigures& f) {
  const Json link = {{"latency_s", figure(0)}, {"pinned_bandwidth", flat_curve(f.h2d)}, {"pageable_bandwidth", flat_curve(f.h2d)}};
  Json d2h = link;
  d2h["pinned_bandwidth"] = flat_curve(f.d2h);
  d2h["pageable_bandwidth"] = flat_curve(f.d2h);
  Json rig = Json{
      {"schema", "megatrain.rig/1"},
      {"name", "synthetic"},
      {"gpu",
       {{"name", "synthetic GPU"},
        {"memory_bytes", figure(f.gpu_memory)},
        {"memory_bandwidth", figure(f.gpu_bandwidth)},
        {"matmul_fp32", figure(f.matmul_bf16 / 2)},
        {"matmul_tf32", figure(f.matmul_bf16 / 2)},
        {"matmul_bf16", figure(f.matmul_bf16)},
        {"gemm_efficiency", flat_curve(1.0)}}},
      {"links", {{"kind", f.cpu_backend ? "host-memcpy" : "synthetic"}, {"full_duplex", true}, {"h2d", link}, {"d2h", d2h}}},
      {"host",
       {{"cpu", "synthetic CPU"},
        {"cores", f.cores},
        {"ram_bytes", figure(f.ram)},
        {"memory_bandwidth", figure(f.host_bandwidth)},
        {"pinnable_bytes", figure(f.ram)},
        {"adam", Json::array({{{"state_format", "fp32"}, {"threads", f.cores}, {"params_per_s", figure(f.adam)}}})}}},
      {"storage", Json::array()}};
  if (f.nvme_read > 0) {
    const Json table_r = Json::array({{{"block_bytes", 1 << 20}, {"queue_depth", 32}, {"bytes_per_s", f.nvme_read}}});
    const Json table_w = Json::array({{{"block_bytes", 1 << 20}, {"queue_depth", 32}, {"bytes_per_s", f.nvme_write}}});
    rig["storage"] = Json::array({{{"name", "synthetic drive"}, {"path", "/nvme"}, {"capacity_bytes", figure(1e13)}, {"read", table_r},
                                   {"write", table_w}, {"io_provenance", {{"kind", "estimate"}, {"source", "synthetic test rig"}}}}});
  }
  if (f.gpus_per_node > 0) {
    Json c = {{"gpus_per_node", f.gpus_per_node}, {"nodes", f.nodes}, {"gpus_per_switch", f.gpus_per_switch}};
    if (f.uplink > 0) c["switch_uplink_bandwidth"] = figure(f.uplink);
    if (f.inter_node > 0) c["inter_node_bandwidth"] = figure(f.inter_node), c["inter_node_latency_s"] = figure(f.inter_latency);
    rig["cluster"] = c;
  }
  return rig;
}

// Llama, no GQA: H = q = kv = 512, I = 1024, V = 1024. Per layer 4 H^2 + 3 H I + 2 H parameters.
constexpr int64_t kH = 512, kI = 1024, kV = 1024, kSeq = 128, kT = 128;  // micro_batch 1
constexpr int64_t kLayerParams = 4 * kH * kH + 3 * kH * kI + 2 * kH;    // 2,622,464
constexpr int64_t kEmbedParams = kV * kH;                               // 524,288
constexpr int64_t kHeadParams = kV * kH + kH;                           // lm_head + final norm
// GEMM FLOPs of one layer's forward for one micro-batch: 2 T (4 H^2 + 3 H I) for the seven
// projections, plus half of QK^T and PV (causal): 0.5 x 2 x 2 T s q.
constexpr double kLayerGemmFlops = 2.0 * kT * (4 * kH * kH + 3 * kH * kI);  // 671,088,640
constexpr double kAttentionFlops = 2.0 * kT * kSeq * kH;                   // 16,777,216

Json model_json(int layers) {
  return Json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", kH},
              {"intermediate_size", kI},
              {"num_hidden_layers", layers},
              {"num_attention_heads", 8},
              {"num_key_value_heads", 8},
              {"vocab_size", kV},
              {"max_position_embeddings", 256},
              {"tie_word_embeddings", false}};
}

struct PlanKnobs {
  int layers = 4;
  std::string order = "layer-major";
  int prefetch = 2;
  int buffers = 3;
  int checkpoint_every = 0;
  std::string location = "device";
  int grad_accum = 1;
  double clip = 0;
  std::string transfer = "bf16";
  int64_t device_budget = 0;
  int ranks = 1, ranks_per_node = 0;  // the parallel section (ranks 1: none)
  bool states_nvme = false;           // optimizer states on the synthetic drive, with one unit of staging
  int64_t staging = 0;
  std::string host_state = "replicated";
  std::string collective = "mpi";
};

Plan make_plan(const PlanKnobs& k, const RigFigures& f) {
  Json j = {{"schema", "megatrain.plan/1"},
            {"model", model_json(k.layers)},
            {"rig", rig_json(f)},
            {"training", {{"seq_len", kSeq}, {"micro_batch", 1}, {"grad_accum", k.grad_accum}, {"clip_grad_norm", k.clip}}},
            {"precision", {{"compute", "bf16"}, {"master", "fp32"}, {"transfer", k.transfer}}},
            {"schedule",
             {{"order", k.order},
              {"prefetch_depth", k.prefetch},
              {"device_layer_buffers", k.buffers},
              {"checkpoint_every", k.checkpoint_every},
              {"checkpoint_location", k.location}}},
            {"placement", {{"device_budget_bytes", k.device_budget}}}};
  if (k.states_nvme)
    j["placement"] = {{"device_budget_bytes", k.device_budget}, {"optimizer_states", "nvme"}, {"nvme_dirs", {"/nvme"}},
                      {"pinned_staging_bytes", k.staging}};
  if (k.ranks > 1)
    j["parallel"] = {{"data_parallel", k.ranks}, {"ranks_per_node", k.ranks_per_node > 0 ? k.ranks_per_node : k.ranks},
                     {"host_state", k.host_state}, {"collective", k.collective}};
  auto p = Plan::from_json_text(j.dump(), "synthetic plan");
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? *p : Plan{};
}

struct Sim {
  Plan plan;
  ModelSpec model;
  HardwareProfile rig;
  SimResult result;
};

Sim simulate_plan(const PlanKnobs& k, const RigFigures& f, bool keep_engine = false) {
  Sim s;
  s.plan = make_plan(k, f);
  auto model = s.plan.resolve_model();
  auto rig = s.plan.resolve_rig();
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  EXPECT_TRUE(rig.ok()) << rig.status().to_string();
  if (!model.ok() || !rig.ok()) return s;
  s.model = *model;
  s.rig = *rig;
  SimOptions opts;
  opts.keep_engine = keep_engine;
  auto r = simulate(s.plan, s.model, s.rig, opts);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (r.ok()) s.result = *r;
  return s;
}

// Relative error. The hand formulas below hold to 1e-9 relative: the only terms they leave out are
// the "negligible" tasks (under 1e-13 s each, against steps of milliseconds), while one missing or
// extra task of the synthetic sizes would move a step by more than 1e-4.
double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

// ---- costs -------------------------------------------------------------------------------------

TEST(StepModelCosts, SyntheticFiguresGiveHandComputedCosts) {
  RigFigures f;
  f.adam = 2e9;
  const Sim s = simulate_plan({}, f);
  const CostModel cost(s.plan, s.model, s.rig);
  const auto pc = s.model.parameter_counts();
  ASSERT_EQ(pc.per_layer, kLayerParams);
  ASSERT_EQ(pc.embedding, kEmbedParams);
  ASSERT_EQ(pc.head + pc.final_norm, kHeadParams);
  EXPECT_DOUBLE_EQ(cost.h2d_time(5244928.0), 5244928.0 / 1e9);
  EXPECT_DOUBLE_EQ(cost.d2h_time(1048576.0), 1048576.0 / 1e20);
  EXPECT_DOUBLE_EQ(cost.adam_rate(), 2e9);  // below host bandwidth / 28 bytes touched
  EXPECT_DOUBLE_EQ(cost.adam_time(kLayerParams), kLayerParams / 2e9);
  // Efficiency 1: the seven projection GEMMs plus half the attention square, over the peak;
  // element-wise work at 1e24 B/s adds ~1e-18 s.
  EXPECT_LT(rel(cost.layer_forward_time(0), (kLayerGemmFlops + kAttentionFlops) / 1e12), 1e-9);
  EXPECT_LT(rel(cost.layer_backward_time(0), (2 * kLayerGemmFlops + 2.5 * kAttentionFlops) / 1e12), 1e-9);
  EXPECT_LT(rel(cost.head_time(), 3 * 2.0 * kT * kV * kH / 1e12), 1e-9);
  EXPECT_LT(cost.embed_forward_time() + cost.embed_backward_time(), 1e-15);
}

TEST(StepModelCosts, AdamScalesWithThreadsUpToTheCoresOnly) {
  RigFigures f;
  f.adam = 2e9;  // measured at f.cores = 4 threads
  const Sim s = simulate_plan({}, f);
  Plan p = s.plan;
  p.optimizer.threads = 2;  // below the measurement: the rate of 4 threads scaled down
  EXPECT_DOUBLE_EQ(CostModel(p, s.model, s.rig).adam_rate(), 1e9);
  p.optimizer.threads = 16;  // more threads than the 4 cores share them: no faster than 4
  EXPECT_DOUBLE_EQ(CostModel(p, s.model, s.rig).adam_rate(), 2e9);
}

TEST(StepModelCosts, AnAttentionCurveAndBackwardRatioReplaceTheGemmRuleForAttention) {
  const Sim s = simulate_plan({}, RigFigures{});
  HardwareProfile rig = s.rig;
  const CostModel gemm_rule(s.plan, s.model, rig);
  // A kernel at 25% of peak, whose backward takes 3x its forward.
  rig.gpu.attention_efficiency = Curve{{{1.0, 0.25}}, Provenance{}};
  rig.gpu.attention_backward_ratio = Figure{3.0, Provenance{}};
  const CostModel own(s.plan, s.model, rig);
  const double attention = kAttentionFlops / (1e12 * 0.25);
  EXPECT_LT(rel(own.layer_forward_time(0), kLayerGemmFlops / 1e12 + attention), 1e-9);
  EXPECT_LT(rel(own.layer_backward_time(0), 2 * kLayerGemmFlops / 1e12 + 3 * attention), 1e-9);
  EXPECT_GT(own.layer_forward_time(0), gemm_rule.layer_forward_time(0));
  // The head and the GEMMs are untouched.
  EXPECT_DOUBLE_EQ(own.head_time(), gemm_rule.head_time());
}

TEST(StepModelCosts, AMatchingLayerProbeGivesTheLayerTimesInterpolatedByMicroBatch) {
  const Sim s = simulate_plan({}, RigFigures{});
  ASSERT_EQ(s.plan.training.micro_batch, 1);
  const ModelConfig& c = s.model.config();
  HardwareProfile rig = s.rig;
  LayerTimes lt{"synthetic", c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                s.plan.training.seq_len, {{1, 0.010, 0.030}, {4, 0.025, 0.070}}, Provenance{}};
  rig.gpu.layer_times = lt;
  const CostModel at_one(s.plan, s.model, rig);
  EXPECT_DOUBLE_EQ(at_one.layer_forward_time(0), 0.010);
  EXPECT_DOUBLE_EQ(at_one.layer_backward_time(0), 0.030);
  Plan two = s.plan;
  two.training.micro_batch = 2;  // a third of the way from 1 to 4
  const CostModel at_two(two, s.model, rig);
  EXPECT_NEAR(at_two.layer_forward_time(0), 0.015, 1e-15);
  EXPECT_NEAR(at_two.layer_backward_time(0), 0.030 + 0.040 / 3, 1e-15);
  Plan eight = s.plan;
  eight.training.micro_batch = 8;  // beyond the last point: in proportion
  EXPECT_NEAR(CostModel(eight, s.model, rig).layer_forward_time(0), 0.050, 1e-15);
  // Another sequence length (or shape) is not this probe: the op-level terms apply.
  rig.gpu.layer_times->seq += 1;
  const CostModel other(s.plan, s.model, rig);
  const CostModel none(s.plan, s.model, s.rig);
  EXPECT_DOUBLE_EQ(other.layer_forward_time(0), none.layer_forward_time(0));
}

// ---- hand-computed schedules -------------------------------------------------------------------

// Bytes of one unit's weights in bf16.
constexpr double kLayerBytes = 2.0 * kLayerParams, kEmbedBytes = 2.0 * kEmbedParams, kHeadBytes = 2.0 * kHeadParams;

TEST(StepModel, DepthOneWithNoOverlapPossibleIsTheSumOfTheSerialChain) {
  // Depth 1, GPU work ~0 and an optimizer so slow that the CPU never catches up. The next
  // forward needs the embedding first, whose update is the last of the step, so the period
  // (between the ends of consecutive steps' GPU work) is one chain with nothing beside it: the
  // forward's transfers (embedding, 4 layers, head), the head's gradient D2H, then every unit's
  // AdamW one after the other. (Conditions: a layer's update, 52 ms, outlasts its H2D + D2H,
  // 5.8 ms, so each gradient is on the host before the CPU wants it.)
  RigFigures f;
  f.matmul_bf16 = 1e30;
  f.h2d = 1e9;
  f.d2h = 1e10;
  f.adam = 5e7;
  PlanKnobs k;
  k.prefetch = 1;
  k.buffers = 2;
  const Sim s = simulate_plan(k, f);
  ASSERT_TRUE(s.result.feasible) << s.result.reason;
  const double forward_h2d = (kEmbedBytes + 4 * kLayerBytes + kHeadBytes) / 1e9;
  const double head_grad_d2h = 4.0 * kHeadParams / 1e10;  // the executor copies fp32 gradients back
  const double adam = (kEmbedParams + 4 * kLayerParams + kHeadParams) / 5e7;
  const double want = forward_h2d + head_grad_d2h + adam;
  EXPECT_LT(rel(s.result.step_time_s, want), 1e-9) << s.result.step_time_s << " vs " << want;
  EXPECT_EQ(s.result.bottleneck, "cpu");
  // The critical path walks the whole period: the step's H2D (forward and the backward's 4
  // layers again), the rest is the CPU chain that delayed it.
  double total = 0;
  for (const auto& [k2, v] : s.result.critical_path) total += v;
  EXPECT_LT(rel(total, s.result.step_time_s), 1e-9);
  EXPECT_LT(rel(s.result.critical_path.at("h2d"), forward_h2d + 4 * kLayerBytes / 1e9), 1e-9);
}

TEST(StepModel, TransferBoundStepIsTotalTransferPlusTheLastLayersBackward) {
  // Slow link: a layer's H2D (5.2 ms) outlasts its compute for both micro-batches (forward
  // 1.4 ms, backward 2.8 ms), so H2D never idles within the step. The period ends with the GPU
  // draining the last transfer: layer 1's backward for each micro-batch (embedding backward ~0).
  for (int depth : {2, 3}) {
    RigFigures f;
    f.h2d = 1e9;
    PlanKnobs k;
    k.prefetch = depth;
    k.buffers = depth + 1;
    k.grad_accum = 2;
    const Sim s = simulate_plan(k, f);
    ASSERT_TRUE(s.result.feasible) << s.result.reason;
    const double transfers = (kEmbedBytes + 4 * kLayerBytes + kHeadBytes + 4 * kLayerBytes) / 1e9;
    const double drain = 2 * (2 * kLayerGemmFlops + 2.5 * kAttentionFlops) / 1e12;
    EXPECT_LT(rel(s.result.step_time_s, transfers + drain), 1e-9)
        << "depth " << depth << ": " << s.result.step_time_s << " vs " << transfers + drain;
    EXPECT_EQ(s.result.bottleneck, "h2d");
    EXPECT_LT(rel(s.result.busy.at("h2d"), transfers / s.result.step_time_s), 1e-9);
  }
}

TEST(StepModel, ComputeBoundStepIsTotalComputePlusTheFill) {
  // Fast link (a layer's weights in 5 us): the GPU never waits once the embedding and layer 1
  // are on the device (the embedding's forward is ~0, so layer 1's transfer is on the path too).
  for (int depth : {2, 4}) {
    RigFigures f;
    f.h2d = 1e12;
    PlanKnobs k;
    k.prefetch = depth;
    k.buffers = depth + 1;
    k.grad_accum = 2;
    const Sim s = simulate_plan(k, f);
    ASSERT_TRUE(s.result.feasible) << s.result.reason;
    const double fwd = (kLayerGemmFlops + kAttentionFlops) / 1e12;
    const double bwd = (2 * kLayerGemmFlops + 2.5 * kAttentionFlops) / 1e12;
    const double head = 3 * 2.0 * kT * kV * kH / 1e12;
    const double compute = 2 * (4 * fwd + head + 4 * bwd);
    const double fill = (kEmbedBytes + kLayerBytes) / 1e12;
    EXPECT_LT(rel(s.result.step_time_s, compute + fill), 1e-9)
        << "depth " << depth << ": " << s.result.step_time_s << " vs " << compute + fill;
    EXPECT_EQ(s.result.bottleneck, "gpu");
    EXPECT_LT(rel(s.result.busy.at("gpu"), compute / s.result.step_time_s), 1e-9);
  }
}

TEST(StepModel, OverlappedOptimizerIsHiddenExceptWhereTheNextForwardWaits) {
  // Four micro-batches of backward per layer (5.5 ms) hide each layer's update (1.3 ms, 2.6 ms at
  // half the rate). What the next step waits for: the embedding's update, queued behind layer
  // 1's, both after the GPU's last task. Halving the Adam rate adds exactly those two updates'
  // time again, not the whole optimizer's.
  RigFigures f;
  f.h2d = 1e11;
  f.d2h = 1e11;
  PlanKnobs k;
  k.grad_accum = 4;
  f.adam = 2e9;
  const Sim fast = simulate_plan(k, f);
  f.adam = 1e9;
  const Sim half = simulate_plan(k, f);
  ASSERT_TRUE(fast.result.feasible && half.result.feasible);
  const double exposed = (kLayerParams + kEmbedParams) / 2e9;
  const double all_updates = (kEmbedParams + 4 * kLayerParams + kHeadParams) / 2e9;
  EXPECT_NEAR(half.result.step_time_s - fast.result.step_time_s, exposed, 1e-12);
  EXPECT_LT(exposed, 0.3 * all_updates);
  EXPECT_EQ(fast.result.bottleneck, "gpu");

  // A very slow optimizer shows up whole: the CPU is the bottleneck and the GPU waits for it.
  f.adam = 1e7;
  const Sim slow = simulate_plan(k, f);
  ASSERT_TRUE(slow.result.feasible);
  EXPECT_EQ(slow.result.bottleneck, "cpu");
  EXPECT_GE(slow.result.step_time_s, (kEmbedParams + 4 * kLayerParams + kHeadParams) / 1e7);
  ASSERT_TRUE(slow.result.stalls.count("optimizer"));
  EXPECT_GT(slow.result.stalls.at("optimizer"), 0.5 * slow.result.step_time_s);
}

TEST(StepModel, OnTheCpuBackendTheOptimizerTakesItsCoresFromTheCompute) {
  // The setting above (each layer's update hidden under the next layer's four backward
  // micro-batches), with links so fast that copies cost ~0. On the CPU backend the compute and
  // the optimizer both want all 4 cores: while they overlap each runs at half speed, so the
  // compute is late by exactly the update work that ran beside it: the head's and layers 4, 3
  // and 2's. Layer 1's and the embedding's updates run after the step's last compute and before
  // the next step's first (which waits for them) on the GPU rig and the CPU one alike.
  RigFigures f;
  f.h2d = 1e20;
  f.d2h = 1e20;
  f.adam = 2e9;
  PlanKnobs k;
  k.grad_accum = 4;
  const Sim gpu = simulate_plan(k, f);
  f.cpu_backend = true;
  const Sim cpu = simulate_plan(k, f);
  ASSERT_TRUE(gpu.result.feasible && cpu.result.feasible) << gpu.result.reason << cpu.result.reason;
  const double overlapped = (kHeadParams + 3.0 * kLayerParams) / 2e9;
  EXPECT_LT(rel(cpu.result.step_time_s - gpu.result.step_time_s, overlapped), 1e-9)
      << cpu.result.step_time_s << " - " << gpu.result.step_time_s << " vs " << overlapped;
}

// Bytes and count of the weight transfers of the steady-state step.
std::pair<int64_t, int> weights_moved(const SimResult& r) {
  int64_t bytes = 0;
  int count = 0;
  for (size_t t = 0; t < r.engine->task_count(); ++t) {
    const TaskSpec& ts = r.engine->task(static_cast<TaskId>(t));
    if (span_kind_of(ts) == SpanKind::kH2D && ts.step == 1) {
      bytes += ts.bytes;
      ++count;
    }
  }
  return {bytes, count};
}

TEST(StepModel, LayerMajorMovesWeightsGradAccumTimesLessOften) {
  for (int accum : {1, 3, 4}) {
    RigFigures f;
    PlanKnobs k;
    k.grad_accum = accum;
    k.order = "layer-major";
    const Sim lm = simulate_plan(k, f, true);
    k.order = "microbatch-major";
    const Sim mm = simulate_plan(k, f, true);
    ASSERT_TRUE(lm.result.engine && mm.result.engine);
    const auto [lm_bytes, lm_count] = weights_moved(lm.result);
    const auto [mm_bytes, mm_count] = weights_moved(mm.result);
    // Forward: embedding, 4 layers, head; backward: the 4 layers again.
    const int64_t once = static_cast<int64_t>(kEmbedBytes + kHeadBytes + 8 * kLayerBytes);
    EXPECT_EQ(lm_bytes, once) << "accum " << accum;
    EXPECT_EQ(lm_count, 10);
    EXPECT_EQ(mm_bytes, accum * once) << "accum " << accum;
    EXPECT_EQ(mm_count, accum * 10);
  }
}

TEST(StepModel, PeakDeviceBytesAreTheHandSummedBuffers) {
  // 2 layers, 1 micro-batch, no recompute, depth 1 with 2 buffers: the arena the CUDA backend
  // carves at start-up (bf16 compute), every buffer rounded up to 64 bytes, each activation of
  // the backend's carve rounded up to 256 (step/src/layout.cpp, cuda_backend.cpp).
  RigFigures f;
  PlanKnobs k;
  k.layers = 2;
  k.prefetch = 1;
  k.buffers = 2;
  k.device_budget = int64_t{512} << 20;
  const Sim s = simulate_plan(k, f);
  ASSERT_TRUE(s.result.feasible) << s.result.reason;
  auto a64 = [](int64_t b) { return (b + 63) / 64 * 64; };
  auto a256 = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t NH = kT * kH;
  const int64_t largest_unit = std::max({kLayerParams, kEmbedParams, kHeadParams});
  const int64_t slots = 2 * a64(4 * largest_unit);                  // fp32-sized slots of the largest unit
  const int64_t hidden = 3 * a64(4 * NH);                           // hid[0], hid[1], dhid: fp32 residual stream
  // One layer's kept activations, per micro-batch: fp32 x, rstd1, lse (8 heads), h, rstd2; bf16
  // xn1, q, k, v, attn, xn2, gate, up, act.
  const int64_t act_bytes = a256(4 * NH) + a256(4 * kT) + a256(2 * NH) + 4 * a256(2 * NH) + a256(4 * 8 * kT) +
                            a256(4 * NH) + a256(4 * kT) + a256(2 * NH) + 3 * a256(2 * kT * kI);
  const int64_t activations = 2 * a64((act_bytes + 3) / 4 * 4);     // no recompute: L x 1 micro-batch
  const int64_t gradients = 2 * a64(4 * kLayerParams) + a64(4 * kEmbedParams) + a64(4 * kHeadParams);  // 2 accumulators, embed, head
  const int64_t pipeline = slots + hidden + activations + gradients;
  const int64_t with_workspace_min = pipeline + a64(4 * NH);        // plus the workspace (a backend figure) and the scratch
  EXPECT_GT(s.result.peak_bytes.device, with_workspace_min + (int64_t{32} << 20)) << "the cuBLAS workspace is in the arena";
  const step::ActivationLayout layout = step::layout_for(step::BackendKind::kCuda, s.model, s.plan);
  const int64_t want = a256(pipeline + a64(4 * layout.workspace_floats()) + a64(4 * NH)) + layout.private_bytes;
  EXPECT_EQ(s.result.peak_bytes.device, want);
  EXPECT_LE(s.result.peak_bytes.device, s.result.capacity_bytes.device);
}

TEST(StepModel, PlanThatDoesNotFitNamesTheTierAndTheExcess) {
  {  // RAM: 14 bytes per parameter (fp32 master and moments, bf16 copy), three lent fp32 gradient
     // buffers of the largest unit (layer-major without clipping) and the step's token rows > 100 MB
    RigFigures f;
    f.ram = 1e8;
    const Sim s = simulate_plan({}, f);
    EXPECT_FALSE(s.result.feasible);
    EXPECT_EQ(s.result.reason.rfind("ram", 0), 0u) << s.result.reason;
    EXPECT_NE(s.result.reason.find("over by"), std::string::npos) << s.result.reason;
    const int64_t n = kEmbedParams + 4 * kLayerParams + kHeadParams;
    const int64_t lent = 3 * 4 * std::max({kEmbedParams, kLayerParams, kHeadParams});
    const int64_t tokens = 2 * 4 * kT;  // inputs and targets of one micro-batch, int32
    EXPECT_NE(s.result.reason.find(std::to_string(14 * n + lent + tokens - 100000000) + " bytes"), std::string::npos)
        << s.result.reason;
  }
  {  // device: 16 MiB cannot hold the cuBLAS workspace (32 MiB) and the buffers
    RigFigures f;
    PlanKnobs k;
    k.device_budget = int64_t{16} << 20;
    const Sim s = simulate_plan(k, f);
    EXPECT_FALSE(s.result.feasible);
    EXPECT_EQ(s.result.reason.rfind("device", 0), 0u) << s.result.reason;
    EXPECT_NE(s.result.reason.find("over by"), std::string::npos) << s.result.reason;
  }
}

// ---- properties on random plans ----------------------------------------------------------------

PlanKnobs random_knobs(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  PlanKnobs k;
  k.order = pick(0, 1) ? "layer-major" : "microbatch-major";
  k.prefetch = pick(1, 4);
  k.checkpoint_every = pick(0, 2);
  k.buffers = std::max(k.prefetch + 1, k.checkpoint_every + 1) + pick(0, 1);
  k.location = pick(0, 1) ? "device" : "host";
  k.grad_accum = pick(1, 4);
  k.clip = pick(0, 1) ? 1.0 : 0.0;
  k.transfer = pick(0, 1) ? "bf16" : "fp32";
  return k;
}

RigFigures random_rig(std::mt19937& rng) {
  auto log_uniform = [&](double lo, double hi) {
    return std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng));
  };
  RigFigures f;
  // Wide enough that each of GPU, link and optimizer is the bottleneck in some plans.
  f.matmul_bf16 = log_uniform(1e10, 1e14);
  f.gpu_bandwidth = log_uniform(1e10, 1e14);
  f.h2d = log_uniform(1e8, 1e12);
  f.d2h = log_uniform(1e8, 1e12);
  f.adam = log_uniform(1e7, 1e11);
  return f;
}

// Invariants of the simulated timeline itself: queues of capacity 1 never overlap, every
// dependency holds, memory stays within its capacity, and a host checkpoint is read back only
// after its copy to the host has ended.
void check_timeline(const SimResult& r, const std::string& what) {
  const Engine& e = *r.engine;
  for (size_t q = 0; q < e.resources().size(); ++q) {
    const auto& queue = e.queue(static_cast<int32_t>(q));
    for (size_t i = 1; i < queue.size(); ++i)
      ASSERT_GE(e.times(queue[i]).start, e.times(queue[i - 1]).end - 1e-12) << what << ": overlap on " << e.resources()[q].name;
  }
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskTimes& tt = e.times(static_cast<TaskId>(t));
    ASSERT_GE(tt.end - tt.start, e.task(static_cast<TaskId>(t)).work_s - 1e-12) << what;
    for (TaskId d : e.dependencies(static_cast<TaskId>(t)))
      ASSERT_GE(tt.start, e.times(d).end - 1e-12) << what << ": task " << t << " before its dependency " << d;
  }
  for (size_t m = 0; m < e.memories().size(); ++m) {
    for (const auto& [time, bytes] : e.memory_timeline(static_cast<int32_t>(m))) {
      ASSERT_GE(bytes, 0) << what << " " << e.memories()[m].name;
      ASSERT_LE(bytes, e.memories()[m].capacity) << what << " " << e.memories()[m].name;
    }
    EXPECT_LE(e.memory_peak(static_cast<int32_t>(m)), e.memories()[m].capacity) << what;
  }
  std::map<std::tuple<int32_t, int32_t, int32_t>, TaskId> copies;
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    if (span_kind_of(ts) == SpanKind::kD2HCheckpoint) copies[{ts.step, ts.layer, ts.micro_batch}] = static_cast<TaskId>(t);
  }
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    if (span_kind_of(ts) != SpanKind::kH2DCheckpoint) continue;
    auto it = copies.find({ts.step, ts.layer, ts.micro_batch});
    ASSERT_NE(it, copies.end()) << what << ": a restore without a copy";
    EXPECT_GE(e.times(static_cast<TaskId>(t)).start, e.times(it->second).end - 1e-12)
        << what << ": checkpoint of layer " << ts.layer << " mb " << ts.micro_batch << " read back before it was written";
  }
}

std::string describe(const PlanKnobs& k) {
  return k.order + " K=" + std::to_string(k.prefetch) + " buffers=" + std::to_string(k.buffers) +
         " c=" + std::to_string(k.checkpoint_every) + " " + k.location + " A=" + std::to_string(k.grad_accum) +
         " clip=" + std::to_string(k.clip > 0) + " " + k.transfer;
}

TEST(StepModelProperties, RandomPlansKeepTheirInvariants) {
  std::mt19937 rng(20261202);
  for (int i = 0; i < 200; ++i) {
    const PlanKnobs k = random_knobs(rng);
    const RigFigures f = random_rig(rng);
    const std::string what = "plan " + std::to_string(i) + " (" + describe(k) + ")";
    const Sim s = simulate_plan(k, f, true);
    ASSERT_TRUE(s.result.feasible) << what << ": " << s.result.reason;
    ASSERT_TRUE(s.result.engine);
    check_timeline(s.result, what);
    ASSERT_GT(s.result.step_time_s, 0) << what;
    for (const char* lane : {"gpu", "h2d", "d2h", "cpu", "nvme_read", "nvme_write"})
      EXPECT_LE(s.result.busy.at(lane), 1 + 1e-9) << what << " " << lane;
    double path = 0;
    for (const auto& [name, v] : s.result.critical_path) path += v;
    EXPECT_LT(rel(path, s.result.step_time_s), 1e-9) << what << ": the critical path covers the step";
  }
}

TEST(StepModelProperties, MoreBandwidthOrComputeNeverMakesTheStepSlower) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    const PlanKnobs k = random_knobs(rng);
    const RigFigures f = random_rig(rng);
    const std::string what = "plan " + std::to_string(i) + " (" + describe(k) + ")";
    const double base = simulate_plan(k, f).result.step_time_s;
    RigFigures link = f;
    link.h2d *= 2;
    link.d2h *= 2;
    EXPECT_LE(simulate_plan(k, link).result.step_time_s, base * (1 + 1e-9)) << what << ": twice the link bandwidth";
    RigFigures h2d_only = f;
    h2d_only.h2d *= 1.5;
    EXPECT_LE(simulate_plan(k, h2d_only).result.step_time_s, base * (1 + 1e-9)) << what << ": faster H2D";
    RigFigures gpu = f;
    gpu.matmul_bf16 *= 2;
    gpu.gpu_bandwidth *= 2;
    EXPECT_LE(simulate_plan(k, gpu).result.step_time_s, base * (1 + 1e-9)) << what << ": twice the compute rate";
  }
}

TEST(StepModelProperties, DeeperPrefetchNeverMakesTheStepSlowerWhileBuffersFit) {
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    PlanKnobs k = random_knobs(rng);
    const RigFigures f = random_rig(rng);
    k.prefetch = std::uniform_int_distribution<int>(1, 3)(rng);
    k.buffers = std::max(k.prefetch + 1, k.checkpoint_every + 1);
    const std::string what = "plan " + std::to_string(i) + " (" + describe(k) + ")";
    const Sim shallow = simulate_plan(k, f);
    PlanKnobs deeper = k;
    deeper.prefetch = k.prefetch + 1;
    deeper.buffers = std::max(deeper.prefetch + 1, k.checkpoint_every + 1);
    const Sim deep = simulate_plan(deeper, f);
    ASSERT_TRUE(shallow.result.feasible && deep.result.feasible) << what;
    EXPECT_LE(deep.result.step_time_s, shallow.result.step_time_s * (1 + 1e-9)) << what << ": prefetch " << deeper.prefetch;
  }
}

// ---- data parallelism (docs/cost-model.md, "Data parallelism") ------------------------------------

// Hand-computed: R ranks per node each get 1/R of the host's memory bandwidth B, cores and RAM; a
// gradient of S bytes costs 5 (R-1)/R S / (B/R) replicated (reduce-scatter + allgather through host
// memory), 3 (R-1)/R S / (B/R) sharded (reduce to owners), a gather 2 (R-1)/R S / (B/R); across M
// nodes add 2 (M-1)/M S / W + 2 (M-1) latency (allreduce of the shards) or (M-1)/M S / W + (M-1)
// latency (reduce or gather) at the network's W bytes/s; two GPUs behind one switch share its uplink.
TEST(StepModelDataParallel, CollectivesContentionAndLinksFollowTheHandFormulas) {
  RigFigures f;
  f.host_bandwidth = 8e10;
  f.adam = 2e9;
  f.cores = 8;
  f.h2d = 5e10;
  f.gpus_per_node = 8, f.nodes = 2, f.gpus_per_switch = 2, f.uplink = 6e10, f.inter_node = 1e11, f.inter_latency = 1e-5;
  PlanKnobs k;
  k.ranks = 4;  // one node of 4
  const Sim one = simulate_plan(k, f);
  const CostModel c(one.plan, one.model, one.rig);
  const double S = 4e8, B = 8e10 / 4;
  EXPECT_TRUE(c.multi_rank());
  EXPECT_DOUBLE_EQ(c.host_bandwidth(), B);
  EXPECT_LT(rel(c.gradient_sum(S).time_s, 5.0 * 3 / 4 * S / B), 1e-12);
  EXPECT_LT(rel(c.gradient_sum(S).host_bytes, 5.0 * 3 / 4 * S), 1e-12);
  EXPECT_EQ(c.weight_gather(S).time_s, 0);  // replicated: nothing to gather
  EXPECT_DOUBLE_EQ(c.h2d_time(1e9), 1e9 / 3e10);  // min(link 5e10, uplink 6e10 / 2 GPUs)
  EXPECT_DOUBLE_EQ(c.adam_rate(), 2e9 * 2 / 8);   // 8 cores / 4 ranks = 2 threads of the rate at 8
  k.host_state = "sharded";
  const CostModel cs(simulate_plan(k, f).plan, one.model, one.rig);
  EXPECT_LT(rel(cs.gradient_sum(S).time_s, 3.0 * 3 / 4 * S / B), 1e-12);
  EXPECT_LT(rel(cs.weight_gather(S).time_s, 2.0 * 3 / 4 * S / B), 1e-12);
  k.ranks = 8, k.ranks_per_node = 4;  // two nodes of 4
  const CostModel c2(simulate_plan(k, f).plan, one.model, one.rig);
  EXPECT_EQ(c2.nodes_used(), 2);
  EXPECT_LT(rel(c2.gradient_sum(S).time_s, 3.0 * 3 / 4 * S / B + 0.5 * S / 1e11 + 1e-5), 1e-12);
  EXPECT_LT(rel(c2.weight_gather(S).time_s, 2.0 * 3 / 4 * S / B + 0.5 * S / 1e11 + 1e-5), 1e-12);
  k.host_state = "replicated";
  const CostModel c3(simulate_plan(k, f).plan, one.model, one.rig);
  EXPECT_LT(rel(c3.gradient_sum(S).time_s, 5.0 * 3 / 4 * S / B + 2 * 0.5 * S / 1e11 + 2e-5), 1e-12);
  // A shared host state: reduce to the node's owners, then the owners' allreduce across the nodes;
  // nothing gathered; each update a quarter (the node's 4 ranks own the tensors).
  k.host_state = "shared";
  const CostModel c4(simulate_plan(k, f).plan, one.model, one.rig);
  EXPECT_LT(rel(c4.gradient_sum(S).time_s, 3.0 * 3 / 4 * S / B + 2 * 0.5 * S / 1e11 + 2e-5), 1e-12);
  EXPECT_LT(rel(c4.gradient_sum(S).host_bytes, 3.0 * 3 / 4 * S), 1e-12);
  EXPECT_EQ(c4.weight_gather(S).time_s, 0);
  EXPECT_EQ(c4.update_share(), 4);
  EXPECT_EQ(c2.update_share(), 8);
  EXPECT_EQ(c3.update_share(), 1);
  // NCCL: a ring on the GPUs, 2 (R-1)/R S through each GPU's PCIe link where the rig names no peer
  // link (here min(link 5e10, uplink 6e10 / 2) = 3e10), or through the peer link (NVLink) when it
  // does; across nodes as MPI's allreduce; no host memory moved.
  k.host_state = "replicated", k.collective = "nccl";
  const Sim n = simulate_plan(k, f);
  const CostModel c5(n.plan, n.model, n.rig);
  EXPECT_TRUE(c5.device_sums());
  EXPECT_LT(rel(c5.gradient_sum(S).time_s, 2.0 * 3 / 4 * S / 3e10 + 2 * 0.5 * S / 1e11 + 2e-5), 1e-12);
  EXPECT_EQ(c5.gradient_sum(S).host_bytes, 0);
  HardwareProfile nvlink = n.rig;
  nvlink.cluster->gpu_peer_bandwidth = Figure{4.5e11, {}};
  const CostModel c6(n.plan, n.model, nvlink);
  EXPECT_LT(rel(c6.gradient_sum(S).time_s, 2.0 * 3 / 4 * S / 4.5e11 + 2 * 0.5 * S / 1e11 + 2e-5), 1e-12);
  EXPECT_FALSE(c3.device_sums());
}

// One node of 4 GPUs sharing 80 GB/s of host memory bandwidth, for 4 ranks.
RigFigures four_gpu_node() {
  RigFigures f;
  f.host_bandwidth = 8e10;
  f.adam = 2e9;
  f.gpus_per_node = 4, f.nodes = 1;
  return f;
}

// A shared host state with clipping in layer-major order lends gradient buffers, freed after each
// unit's sum (not after the update, which waits for the norm): the step runs (it would deadlock if
// the buffers came back only after the updates), each update is a quarter of its unit, no weight
// gathers, and the footprint is one rank's share of the node's copy (step::take_rank_share).
TEST(StepModelDataParallel, SharedHostStateLendsBuffersWithClippingAndCountsItsShare) {
  const RigFigures f = four_gpu_node();
  PlanKnobs k;
  k.ranks = 4, k.clip = 1.0;
  const Sim rep = simulate_plan(k, f, true);
  ASSERT_TRUE(rep.result.feasible) << rep.result.reason;
  k.host_state = "shared";
  const Sim s = simulate_plan(k, f, true);
  ASSERT_TRUE(s.result.feasible) << s.result.reason;
  EXPECT_TRUE(step::lends_gradients(s.plan));
  EXPECT_FALSE(step::lends_gradients(rep.plan));
  const CostModel c(s.plan, s.model, s.rig);
  const Engine& e = *s.result.engine;
  int sums = 0, gathers = 0;
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    if (span_kind_of(ts) == SpanKind::kGradSum) ++sums;
    if (span_kind_of(ts) == SpanKind::kWeightGather) ++gathers;
  }
  EXPECT_EQ(sums, 3 * (k.layers + 2));
  EXPECT_EQ(gathers, 0);
  // The footprint: the replicated rank's whole-model gradients, master weights and bf16 copy become
  // lent buffers and a quarter of the node's shared memory; the moments a quarter's worth.
  std::vector<int64_t> numels;
  int64_t n = 0;
  for (const auto& t : unit_tensor_numels(s.model)) {
    numels.push_back(unit_layout(t).numel);
    n += numels.back();
  }
  const step::StepSchedule sched = *step::compile(s.plan, s.model, step::layout_for(step::backend_of_rig(s.rig), s.model, s.plan));
  const int64_t max_unit = *std::max_element(numels.begin(), numels.end());
  const int64_t expect = rep.result.peak_bytes.ram - n * (4 + 4 + 2) + step::kLentGradientBuffers * 4 * max_unit +
                         step::node_shared_state_bytes(numels, true) / 4 - step::sharded_moment_saving(s.plan, s.model);
  EXPECT_EQ(s.result.peak_bytes.ram, expect);
  EXPECT_EQ(sched.lent_gradients, step::kLentGradientBuffers);
}

// NCCL with split states: the GPUs sum each gradient, and each of the 4 ranks copies a quarter of it
// (its range) to the host. Sharded, into its own gradients (the footprint of the MPI run); shared,
// straight into the node's summed gradient, so the rank keeps no gradient and lends none: its RAM is
// the MPI shared run's without the lent buffers, and it page-locks its quarter of the node's sums.
TEST(StepModelDataParallel, NcclWithSplitStatesCopiesEachRanksShareOfTheSum) {
  const RigFigures f = four_gpu_node();
  PlanKnobs k;
  k.ranks = 4, k.clip = 1.0;
  std::vector<int64_t> numels;
  for (const auto& t : unit_tensor_numels(simulate_plan(k, f, true).model)) numels.push_back(unit_layout(t).numel);
  auto d2h_bytes = [](const Sim& s) {
    std::map<int32_t, int64_t> b;
    const Engine& e = *s.result.engine;
    for (size_t t = 0; t < e.task_count(); ++t) {
      const TaskSpec& ts = e.task(static_cast<TaskId>(t));
      if (span_kind_of(ts) == SpanKind::kD2H && ts.step == 0) b[ts.layer] += ts.bytes;
    }
    return b;
  };
  for (const char* hs : {"sharded", "shared"}) {
    SCOPED_TRACE(hs);
    k.host_state = hs, k.collective = "mpi";
    const Sim mpi = simulate_plan(k, f, true);
    k.collective = "nccl";
    const Sim nccl = simulate_plan(k, f, true);
    ASSERT_TRUE(mpi.result.feasible && nccl.result.feasible) << mpi.result.reason << nccl.result.reason;
    EXPECT_TRUE(step::copies_gradient_share(nccl.plan));
    EXPECT_FALSE(step::copies_gradient_share(mpi.plan));
    const auto whole = d2h_bytes(mpi), share = d2h_bytes(nccl);
    ASSERT_EQ(whole.size(), numels.size());
    for (size_t u = 0; u < numels.size(); ++u) {
      EXPECT_EQ(whole.at(static_cast<int32_t>(u)), 4 * numels[u]) << "unit " << u;
      EXPECT_EQ(share.at(static_cast<int32_t>(u)), numels[u]) << "unit " << u;
    }
    const step::StepSchedule sched = *step::compile(nccl.plan, nccl.model, step::layout_for(step::backend_of_rig(nccl.rig), nccl.model, nccl.plan));
    EXPECT_EQ(sched.grad_share, 4);
    EXPECT_EQ(sched.lent_gradients, 0);
    const int64_t max_unit = *std::max_element(numels.begin(), numels.end());
    int64_t n = 0;
    for (int64_t v : numels) n += v;
    if (std::string(hs) == "sharded") {
      EXPECT_FALSE(sched.node_gradients);
      EXPECT_EQ(nccl.result.peak_bytes.ram, mpi.result.peak_bytes.ram);
    } else {
      EXPECT_TRUE(sched.node_gradients);
      EXPECT_TRUE(step::lends_gradients(mpi.plan));
      EXPECT_EQ(nccl.result.peak_bytes.ram, mpi.result.peak_bytes.ram - step::kLentGradientBuffers * 4 * max_unit);
      int64_t quarter = 0;
      for (int64_t v : numels) quarter += 4 * v / 4;
      EXPECT_EQ(nccl.result.peak_bytes.pinned, mpi.result.peak_bytes.pinned - step::kLentGradientBuffers * 4 * max_unit + quarter);
    }
  }
}

// The step: one grad_sum task per unit after its gradient's copy on the D2H lane, before its update;
// sharded, one weight_gather per unit after its update on the optimizer lane, before the next step's
// load; tokens are the job's; memory is checked against one rank's share; too many ranks for the
// rig are refused naming the key.
TEST(StepModelDataParallel, CollectiveTasksMemoryShareAndRefusals) {
  RigFigures f;
  f.host_bandwidth = 8e10;
  f.adam = 2e9;
  f.gpus_per_node = 4, f.nodes = 1;
  f.ram = 1e9;
  PlanKnobs k;
  const Sim alone = simulate_plan(k, f);
  k.ranks = 4, k.host_state = "sharded";
  const Sim s = simulate_plan(k, f, true);
  ASSERT_TRUE(s.result.feasible) << s.result.reason;
  EXPECT_EQ(s.result.ranks, 4);
  EXPECT_DOUBLE_EQ(s.result.tokens_per_step, 4 * alone.result.tokens_per_step);
  EXPECT_EQ(s.result.capacity_bytes.ram, static_cast<int64_t>(1e9) / 4);
  const CostModel c(s.plan, s.model, s.rig);
  const Engine& e = *s.result.engine;
  const int L = k.layers;
  std::map<std::pair<int, int>, size_t> sums, gathers, adams;  // (step, unit) -> task
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    const auto key = std::make_pair(static_cast<int>(ts.step), static_cast<int>(ts.layer));
    if (span_kind_of(ts) == SpanKind::kGradSum) sums[key] = t;
    if (span_kind_of(ts) == SpanKind::kWeightGather) gathers[key] = t;
    if (span_kind_of(ts) == SpanKind::kOptimizer) adams[key] = t;
  }
  ASSERT_EQ(sums.size(), static_cast<size_t>(3 * (L + 2)));  // 3 simulated steps x every unit
  ASSERT_EQ(gathers.size(), sums.size());
  for (const auto& [key, t] : sums) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    const double numel = static_cast<double>(ts.bytes) / 4;
    EXPECT_LT(rel(ts.work_s, c.gradient_sum(ts.bytes).time_s), 1e-12);
    EXPECT_EQ(e.resources()[static_cast<size_t>(ts.resource)].kind, std::string("d2h"));
    const size_t a = adams.at(key), g = gathers.at(key);
    EXPECT_GE(e.times(static_cast<TaskId>(a)).start, e.times(static_cast<TaskId>(t)).end - 1e-15);
    EXPECT_GE(e.times(static_cast<TaskId>(g)).start, e.times(static_cast<TaskId>(a)).end - 1e-15);
    EXPECT_LT(rel(e.task(static_cast<TaskId>(g)).work_s, c.weight_gather(numel * (4 + 2)).time_s), 1e-9);  // master + bf16 copy
    EXPECT_LT(rel(e.task(static_cast<TaskId>(a)).work_s, c.adam_time(numel / 4)), 1e-9);  // a quarter of the unit each
  }
  k.ranks = 8;
  auto too_many = simulate(make_plan(k, f));
  ASSERT_TRUE(too_many.ok());
  EXPECT_FALSE(too_many->feasible);
  EXPECT_NE(too_many->reason.find("cluster.gpus_per_node"), std::string::npos) << too_many->reason;
  k.ranks = 4;
  k.host_state = "replicated";
  f.ram = 2.5e7;  // a quarter of it is below one rank's RAM
  auto small = simulate(make_plan(k, f));
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(small->feasible);
  EXPECT_NE(small->reason.find("one rank's share of its node (1/4): ram needs"), std::string::npos) << small->reason;
}

// A step bound by NVMe writes through the staging buffers: every read of the next step waits for a
// buffer that a write frees, so the critical path goes through the writes (Engine's memory_binding)
// and the bottleneck is nvme_write, not an unexplained memory wait.
TEST(StepModel, WaitsForStagingBuffersNameTheDriveThatFreesThem) {
  RigFigures f;
  f.nvme_read = 1e12;
  f.nvme_write = 1e8;  // 8 bytes of m and v per parameter: a layer's write takes 0.2 s
  PlanKnobs k;
  k.states_nvme = true;
  k.staging = 8 * kLayerParams;  // one buffer: each read waits for the write-back that frees it
  const Sim s = simulate_plan(k, f);
  ASSERT_TRUE(s.result.feasible) << s.result.reason;
  EXPECT_EQ(s.result.bottleneck, "nvme_write");
  ASSERT_TRUE(s.result.critical_path.count("nvme_write"));
  EXPECT_GT(s.result.critical_path.at("nvme_write"), 0.5 * s.result.step_time_s);
  EXPECT_LT(s.result.critical_path.count("memory_wait") ? s.result.critical_path.at("memory_wait") : 0.0, 0.01 * s.result.step_time_s);
}

}  // namespace
}  // namespace megatrain::sim

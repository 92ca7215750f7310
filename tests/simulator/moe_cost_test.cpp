// The cost model and step model for Mixture-of-Experts models, against figures computed by hand
// from the configs (not from ModelSpec's counts): an MoE layer's time from its GEMM FLOPs and the
// grouped-GEMM rate, the per-layer times of a Qwen3-MoE model with dense layers among its MoE
// layers, the weight bytes a step streams (every expert of every layer), and the FLOPs behind
// TFLOP/s and MFU (only the k experts a token uses).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "megatrain/core/plan.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::sim {
namespace {

using Json = nlohmann::ordered_json;

Json figure(double v) { return Json{{"value", v}, {"provenance", {{"kind", "estimate"}, {"source", "synthetic test rig"}}}}; }
Json curve(const Json& points) { return Json{{"points", points}, {"provenance", {{"kind", "estimate"}, {"source", "synthetic test rig"}}}}; }
Json flat_curve(double y) { return curve(Json::array({Json::array({1.0, y})})); }

// A rig whose GEMMs run at 1e12 FLOP/s at every size, whose element-wise work is free (unless
// `gpu_bandwidth` is set) and whose host side never binds. `grouped` is the grouped-GEMM curve, or
// null for a profile without one.
Json rig_json(const Json& grouped, double gpu_bandwidth = 1e24, double h2d = 1e20) {
  const Json link = {{"latency_s", figure(0)}, {"pinned_bandwidth", flat_curve(h2d)}, {"pageable_bandwidth", flat_curve(h2d)}};
  Json gpu = {{"name", "synthetic GPU"},           {"memory_bytes", figure(1e12)}, {"memory_bandwidth", figure(gpu_bandwidth)},
              {"matmul_fp32", figure(5e11)},       {"matmul_tf32", figure(5e11)},  {"matmul_bf16", figure(1e12)},
              {"gemm_efficiency", flat_curve(1.0)}};
  if (!grouped.is_null()) gpu["grouped_gemm_efficiency"] = grouped;
  return Json{{"schema", "megatrain.rig/1"},
              {"name", "synthetic"},
              {"gpu", gpu},
              {"links", {{"kind", "synthetic"}, {"full_duplex", true}, {"h2d", link}, {"d2h", link}}},
              {"host",
               {{"cpu", "synthetic CPU"},
                {"cores", 4},
                {"ram_bytes", figure(1e15)},
                {"memory_bandwidth", figure(1e22)},
                {"pinnable_bytes", figure(1e15)},
                {"adam", Json::array({{{"state_format", "fp32"}, {"threads", 4}, {"params_per_s", figure(1e20)}}})}}},
              {"storage", Json::array()}};
}

// Mixtral-shaped: H 256, 4 heads of 64 (no GQA: q = kv = 256), each of E = 8 experts has
// intermediate 512, k = 2 experts per token, vocabulary 512, untied head.
constexpr int64_t kH = 256, kI = 512, kE = 8, kK = 2, kV = 512, kSeq = 128;
Json mixtral_json(int layers) {
  return Json{{"architectures", {"MixtralForCausalLM"}},
              {"model_type", "mixtral"},
              {"hidden_size", kH},
              {"intermediate_size", kI},
              {"num_hidden_layers", layers},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 4},
              {"num_local_experts", kE},
              {"num_experts_per_tok", kK},
              {"vocab_size", kV},
              {"max_position_embeddings", 256},
              {"sliding_window", nullptr},
              {"tie_word_embeddings", false}};
}

// Qwen3-MoE-shaped, four layers of which 0 and 2 are dense (mlp_only_layers): H 256, 4 heads and
// 2 KV heads of 64 (q = 256, kv = 128), dense intermediate 768, E = 4 experts of intermediate 128,
// k = 2.
constexpr int64_t kQI = 768, kQIe = 128, kQE = 4, kQK = 2;
Json qwen3_moe_json() {
  return Json{{"architectures", {"Qwen3MoeForCausalLM"}},
              {"model_type", "qwen3_moe"},
              {"hidden_size", kH},
              {"intermediate_size", kQI},
              {"moe_intermediate_size", kQIe},
              {"num_hidden_layers", 4},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 64},
              {"num_experts", kQE},
              {"num_experts_per_tok", kQK},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", {0, 2}},
              {"norm_topk_prob", true},
              {"vocab_size", kV},
              {"max_position_embeddings", 256},
              {"tie_word_embeddings", false}};
}

struct Knobs {
  std::string order = "layer-major";
  int micro_batch = 1, grad_accum = 1, checkpoint_every = 0;
};

Plan make_plan(const Json& model, const Json& rig, const Knobs& k = {}) {
  const Json j = {{"schema", "megatrain.plan/1"},
                  {"model", model},
                  {"rig", rig},
                  {"training", {{"seq_len", kSeq}, {"micro_batch", k.micro_batch}, {"grad_accum", k.grad_accum}, {"clip_grad_norm", 0}}},
                  {"precision", {{"compute", "bf16"}, {"master", "fp32"}, {"transfer", "bf16"}}},
                  {"schedule",
                   {{"order", k.order},
                    {"prefetch_depth", 2},
                    {"device_layer_buffers", 3},
                    {"checkpoint_every", k.checkpoint_every},
                    {"checkpoint_location", "device"}}}};
  auto p = Plan::from_json_text(j.dump(), "synthetic MoE plan");
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? *p : Plan{};
}

struct Loaded {
  Plan plan;
  ModelSpec model;
  HardwareProfile rig;
};
Loaded load(const Json& model, const Json& rig, const Knobs& k = {}) {
  Loaded l;
  l.plan = make_plan(model, rig, k);
  auto m = l.plan.resolve_model();
  auto r = l.plan.resolve_rig();
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (m.ok()) l.model = *m;
  if (r.ok()) l.rig = *r;
  return l;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

// FLOPs of one micro-batch (T = 128 tokens) of the Mixtral-shaped layer's forward, by hand:
constexpr double kT = 128;
constexpr double kAttnGemmFlops = 2 * kT * 4 * kH * kH;          // q, k, v, o: 67,108,864
constexpr double kRouterFlops = 2 * kT * kE * kH;                // 524,288
constexpr double kExpertFlops = 3 * 2 * kT * kK * kI * kH;       // gate, up, down of k experts: 201,326,592
constexpr double kAttentionFlops = 2 * kT * kSeq * kH;           // causal half of Q.K^T and P.V: 8,388,608

// ---- the MoE layer's time --------------------------------------------------------------------

TEST(MoeCost, AnMoeLayerIsItsAttentionPlusRouterPlusGroupedExpertGemms) {
  // A flat grouped curve at 0.5: the experts' 201 MFLOP run at half the dense rate.
  const Loaded l = load(mixtral_json(2), rig_json(flat_curve(0.5)));
  const CostModel cost(l.plan, l.model, l.rig);
  const CostModel::LayerCost& c = cost.layer_cost(0);
  EXPECT_TRUE(c.moe);
  EXPECT_DOUBLE_EQ(c.rows_per_expert, 32.0);  // 128 tokens x 2 / 8 experts
  const double experts = kExpertFlops / (1e12 * 0.5);
  EXPECT_LT(rel(c.experts, experts), 1e-12);
  EXPECT_LT(rel(c.router, kRouterFlops / 1e12), 1e-12);
  EXPECT_DOUBLE_EQ(c.mlp_gemms, 0);
  const double fwd = (kAttnGemmFlops + kRouterFlops + kAttentionFlops) / 1e12 + experts;
  const double bwd = 2 * (kAttnGemmFlops + kRouterFlops) / 1e12 + 2 * experts + 2.5 * kAttentionFlops / 1e12;
  EXPECT_LT(rel(cost.layer_forward_time(0), fwd), 1e-9);
  EXPECT_LT(rel(cost.layer_backward_time(0), bwd), 1e-9);
  EXPECT_LT(rel(cost.layers_forward_time(), 2 * fwd), 1e-9);
}

TEST(MoeCost, TheGroupedRateIsLookedUpAtTheRowsPerExpert) {
  // Efficiency 0.2 at 16 rows and 0.6 at 64, linear in log(rows): 32 rows -> 0.4, 64 rows -> 0.6.
  const Json grouped = curve(Json::array({Json::array({16.0, 0.2}), Json::array({64.0, 0.6})}));
  const Loaded one = load(mixtral_json(2), rig_json(grouped));
  EXPECT_LT(rel(CostModel(one.plan, one.model, one.rig).layer_cost(0).experts, kExpertFlops / (1e12 * 0.4)), 1e-12);
  Knobs two;
  two.micro_batch = 2;  // 256 tokens: 64 rows per expert, twice the FLOPs
  const Loaded l2 = load(mixtral_json(2), rig_json(grouped), two);
  const CostModel c2(l2.plan, l2.model, l2.rig);
  EXPECT_DOUBLE_EQ(c2.layer_cost(0).rows_per_expert, 64.0);
  EXPECT_LT(rel(c2.layer_cost(0).experts, 2 * kExpertFlops / (1e12 * 0.6)), 1e-12);
}

TEST(MoeCost, WithoutAGroupedCurveTheDenseRateTimesTheFallbackApplies) {
  const Loaded l = load(mixtral_json(2), rig_json(nullptr));
  const CostModel cost(l.plan, l.model, l.rig);
  ASSERT_DOUBLE_EQ(CostModel::kGroupedGemmFallback, 0.7);
  EXPECT_LT(rel(cost.layer_cost(0).experts, kExpertFlops / (1e12 * 0.7)), 1e-12);
  bool said = false;
  for (const std::string& a : cost.assumptions()) said = said || a.find("no grouped-GEMM rate") != std::string::npos;
  EXPECT_TRUE(said) << "the fallback is listed among the assumptions";
}

TEST(MoeCost, TheMemoryBoundTrafficOfAnMoeLayerIsHandComputed) {
  // bf16 compute (2 bytes): norms, RoPE and adds 2 T (10 H + 2 q + 2 kv) = 917,504; router logits
  // in fp32, written and read, 8 T E = 8,192; permutation 2 T k H, SwiGLU 3 T k I and combine
  // T (k + 1) H, times 2 bytes: 1,245,184. In all 2,170,880 bytes, at 1e9 B/s.
  const Loaded fast = load(mixtral_json(2), rig_json(flat_curve(0.5)));
  const Loaded slow = load(mixtral_json(2), rig_json(flat_curve(0.5), 1e9));
  const CostModel a(fast.plan, fast.model, fast.rig), b(slow.plan, slow.model, slow.rig);
  EXPECT_DOUBLE_EQ(b.layer_cost(0).elementwise_bytes, 2170880.0);
  EXPECT_LT(rel(b.layer_forward_time(0) - a.layer_forward_time(0), 2170880.0 / 1e9), 1e-9);
  EXPECT_LT(rel(b.layer_backward_time(0) - a.layer_backward_time(0), 2 * 2170880.0 / 1e9), 1e-9);
}

// ---- per-layer times: dense layers among MoE layers ----------------------------------------------

TEST(MoeCost, QwenMoeDenseLayersAndMoeLayersHaveTheirOwnTimes) {
  const Loaded l = load(qwen3_moe_json(), rig_json(flat_curve(0.5)));
  const CostModel cost(l.plan, l.model, l.rig);
  // q = 256, kv = 128: projections 2 T (q H + 2 kv H + H q) = 2 T (4 x 65,536) = 67,108,864.
  const double proj = 2 * kT * (256.0 * kH + 2 * 128.0 * kH + kH * 256.0);
  const double attention = 2 * kT * kSeq * 256.0;
  const double dense_mlp = 3 * 2 * kT * kH * kQI;
  const double router = 2 * kT * kQE * kH;
  const double experts = 3 * 2 * kT * kQK * kQIe * kH / 0.5;  // at half the rate
  const double dense = (proj + dense_mlp + attention) / 1e12;
  const double moe = (proj + router + experts + attention) / 1e12;
  for (int64_t layer : {0, 2}) {
    EXPECT_FALSE(cost.layer_cost(layer).moe) << layer;
    EXPECT_LT(rel(cost.layer_forward_time(layer), dense), 1e-9) << layer;
    EXPECT_LT(rel(cost.layer_backward_time(layer), 2 * (proj + dense_mlp) / 1e12 + 2.5 * attention / 1e12), 1e-9) << layer;
  }
  for (int64_t layer : {1, 3}) {
    EXPECT_TRUE(cost.layer_cost(layer).moe) << layer;
    EXPECT_LT(rel(cost.layer_forward_time(layer), moe), 1e-9) << layer;
  }
  EXPECT_GT(std::abs(dense - moe) / dense, 0.1) << "the shapes are chosen so that the two kinds differ";
  EXPECT_LT(rel(cost.layers_forward_time(), 2 * dense + 2 * moe), 1e-9);

  // The simulated step gives each layer's forward its own time and its own FLOPs.
  auto r = simulate(l.plan, l.model, l.rig, SimOptions{3, true});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->feasible) << r->reason;
  const Engine& e = *r->engine;
  std::map<int32_t, std::pair<double, double>> fwd;  // unit -> (work, flops)
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    if (ts.step == 1 && span_kind_of(ts) == SpanKind::kForward) fwd[ts.layer] = {ts.work_s, ts.flops};
  }
  ASSERT_EQ(fwd.size(), 4u);
  // FLOPs per token by hand (Megatron's count: the full attention square, 4 s q per token).
  const double dense_flops = 2 * (256.0 * kH + 2 * 128.0 * kH + kH * 256.0) + 4 * kSeq * 256.0 + 6.0 * kH * kQI;
  const double moe_flops = 2 * (256.0 * kH + 2 * 128.0 * kH + kH * 256.0) + 4 * kSeq * 256.0 + 2.0 * kQE * kH + kQK * 6.0 * kH * kQIe;
  for (int32_t unit : {1, 3}) {
    EXPECT_LT(rel(fwd[unit].first, dense), 1e-9) << unit;
    EXPECT_LT(rel(fwd[unit].second, kT * dense_flops), 1e-12) << unit;
  }
  for (int32_t unit : {2, 4}) {
    EXPECT_LT(rel(fwd[unit].first, moe), 1e-9) << unit;
    EXPECT_LT(rel(fwd[unit].second, kT * moe_flops), 1e-12) << unit;
  }
}

TEST(MoeCost, Qwen3QkNormsAddTheirTrafficToDenseAndMoeLayers) {
  // Qwen3-MoE (q_norm and k_norm): bf16, T = 128, q = 256, kv = 128. Norms, RoPE and adds
  // 2 T (10 H + 2 q + 2 kv) = 851,968; the q/k norms read and write q and k, 2 T 2 (q + kv) =
  // 196,608. Dense layers add SwiGLU 2 T 3 I = 589,824: 1,638,400 in all. MoE layers add the router
  // logits 8 T E = 4,096 and 2 T (2 k H + 3 k I_e + (k + 1) H) = 655,360: 1,708,032 in all.
  const Loaded l = load(qwen3_moe_json(), rig_json(flat_curve(0.5), 1e9));
  ASSERT_TRUE(l.model.config().qk_norm);
  const CostModel cost(l.plan, l.model, l.rig);
  EXPECT_DOUBLE_EQ(cost.layer_cost(0).elementwise_bytes, 1638400.0);
  EXPECT_DOUBLE_EQ(cost.layer_cost(1).elementwise_bytes, 1708032.0);
  // At 1e9 B/s the bytes are the forward's extra time over the same layer with free element-wise work.
  const Loaded free_bw = load(qwen3_moe_json(), rig_json(flat_curve(0.5)));
  const CostModel fast(free_bw.plan, free_bw.model, free_bw.rig);
  EXPECT_LT(rel(cost.layer_forward_time(0) - fast.layer_forward_time(0), 1638400.0 / 1e9), 1e-9);
  EXPECT_LT(rel(cost.layer_forward_time(1) - fast.layer_forward_time(1), 1708032.0 / 1e9), 1e-9);
}

// A probe that timed the head too (vocab set) gives the head's time for plans of that vocabulary;
// in neat rows a probed layer keeps its measured time less the attention its documents do not do
// (the op-level difference, forward and backward at the backward ratio, 2.5 on this rig).
TEST(MoeCost, AProbeOfTheHeadAndAProbedLayerInNeatRows) {
  Loaded l = load(qwen3_moe_json(), rig_json(flat_curve(0.5)));
  const ModelConfig& c = l.model.config();
  const CostModel none(l.plan, l.model, l.rig);
  l.rig.gpu.layer_times = LayerTimes{"tiny", c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, kSeq,
                                     {{1, 0.010, 0.030, 0.5}, {2, 0.020, 0.060, 0.9}}, Provenance{}};
  l.rig.gpu.layer_times->vocab = c.vocab_size;
  const CostModel probed(l.plan, l.model, l.rig);
  EXPECT_DOUBLE_EQ(probed.head_time(), 0.5);
  Loaded other_vocab = l;
  other_vocab.rig.gpu.layer_times->vocab = c.vocab_size + 1;
  EXPECT_DOUBLE_EQ(CostModel(other_vocab.plan, other_vocab.model, other_vocab.rig).head_time(), none.head_time());
  Loaded neat = l;
  neat.plan.training.document_tokens = 32;
  const CostModel docs(neat.plan, neat.model, neat.rig);
  const double fewer = CostModel(neat.plan, neat.model, l.rig).layer_cost(1).attention - none.layer_cost(1).attention;
  ASSERT_LT(fewer, 0);
  EXPECT_DOUBLE_EQ(docs.layer_forward_time(0), 0.010 + fewer);
  EXPECT_DOUBLE_EQ(docs.layer_backward_time(0), 0.030 + 2.5 * fewer);
  EXPECT_DOUBLE_EQ(docs.head_time(), 0.5);
}

TEST(MoeCost, ALayerProbeAppliesOnlyToTheLayersOfTheKindItTimed) {
  const Loaded l = load(qwen3_moe_json(), rig_json(flat_curve(0.5)));
  const CostModel none(l.plan, l.model, l.rig);
  const ModelConfig& c = l.model.config();
  HardwareProfile rig = l.rig;
  // A probe of a dense layer (the profiler times layer 0, which mlp_only_layers makes dense here).
  rig.gpu.layer_times = LayerTimes{"tiny", c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, kSeq,
                                   {{1, 0.010, 0.030}}, Provenance{}};
  const CostModel dense_probe(l.plan, l.model, rig);
  for (int64_t layer : {0, 2}) {
    EXPECT_DOUBLE_EQ(dense_probe.layer_forward_time(layer), 0.010) << layer;
    EXPECT_DOUBLE_EQ(dense_probe.layer_backward_time(layer), 0.030) << layer;
  }
  for (int64_t layer : {1, 3}) EXPECT_DOUBLE_EQ(dense_probe.layer_forward_time(layer), none.layer_forward_time(layer)) << layer;
  // A probe of an MoE layer of this shape: the MoE layers only.
  rig.gpu.layer_times->experts = kQE;
  rig.gpu.layer_times->experts_per_token = kQK;
  rig.gpu.layer_times->moe_intermediate = kQIe;
  const CostModel moe_probe(l.plan, l.model, rig);
  for (int64_t layer : {1, 3}) EXPECT_DOUBLE_EQ(moe_probe.layer_forward_time(layer), 0.010) << layer;
  for (int64_t layer : {0, 2}) EXPECT_DOUBLE_EQ(moe_probe.layer_forward_time(layer), none.layer_forward_time(layer)) << layer;
  // Another expert count is another layer: no probe applies.
  rig.gpu.layer_times->experts = 2 * kQE;
  const CostModel other(l.plan, l.model, rig);
  for (int64_t layer = 0; layer < 4; ++layer) EXPECT_DOUBLE_EQ(other.layer_forward_time(layer), none.layer_forward_time(layer));
}

TEST(MoeCost, SlidingLayersCostTheBandTheyAttendTo) {
  // Mistral-shaped attention with a window of 32 keys at seq 128: a query sees min(i, 32) keys,
  // 128 x 32 - 32^2 / 2 = 3584 pairs a sequence against 128^2 / 2 = 8192 for the full prefix.
  Json windowed = mixtral_json(2);
  windowed["sliding_window"] = 32;
  const Loaded full = load(mixtral_json(2), rig_json(flat_curve(0.5)));
  const Loaded band = load(windowed, rig_json(flat_curve(0.5)));
  const CostModel a(full.plan, full.model, full.rig), b(band.plan, band.model, band.rig);
  EXPECT_EQ(b.layer_cost(0).window, 32);
  EXPECT_LT(rel(a.layer_cost(0).attention, kAttentionFlops / 1e12), 1e-12);
  EXPECT_LT(rel(b.layer_cost(0).attention, kAttentionFlops / 1e12 * 3584.0 / 8192.0), 1e-12);
  EXPECT_DOUBLE_EQ(b.layer_cost(0).experts, a.layer_cost(0).experts);
}

TEST(MoeCost, NeatRowsCostTheirDocumentsAttention) {
  // Rows of 128 packed "neat" with documents of 32 tokens (weighted): each query sees its own
  // document, 4 x 32^2 / 2 pairs a row against 128^2 / 2, a quarter; with a window of 16 inside
  // those documents, (2 x 32 x 16 - 16^2) / 32^2 of that. Nothing else in the layer changes, and
  // the model FLOPs count the documents' span as well.
  const Loaded full = load(mixtral_json(2), rig_json(flat_curve(0.5)));
  Loaded docs = full;
  docs.plan.training.document_tokens = 32;
  const CostModel a(full.plan, full.model, full.rig), b(docs.plan, docs.model, docs.rig);
  EXPECT_LT(rel(b.layer_cost(0).attention, kAttentionFlops / 1e12 / 4), 1e-12);
  EXPECT_DOUBLE_EQ(b.layer_cost(0).experts, a.layer_cost(0).experts);
  EXPECT_DOUBLE_EQ(b.layer_cost(0).attention_gemms, a.layer_cost(0).attention_gemms);
  EXPECT_LT(b.layer_forward_time(0), a.layer_forward_time(0));
  Json windowed = mixtral_json(2);
  windowed["sliding_window"] = 16;
  Loaded band = load(windowed, rig_json(flat_curve(0.5)));
  band.plan.training.document_tokens = 32;
  const CostModel c(band.plan, band.model, band.rig);
  EXPECT_LT(rel(c.layer_cost(0).attention, kAttentionFlops / 1e12 / 4 * (2 * 32 * 16 - 16 * 16) / (32.0 * 32)), 1e-12);
  const FlopsPerToken f = full.model.flops_per_token(kSeq), g = docs.model.flops_per_token(kSeq, 32);
  EXPECT_DOUBLE_EQ(g.attention_forward * 4, f.attention_forward);
  EXPECT_DOUBLE_EQ(g.experts_forward, f.experts_forward);
}

// ---- GEMMs by shape (issue 50) --------------------------------------------------------------------

// A shape grid over tokens {64, 128}, in and out {8, 256, 512}: forward efficiency 0.5 except the
// cells of 8 inputs (0.2) and the vocabulary head's cell (tokens 128, in 256, out 512) at 0.1; dX
// 0.25 and dW 0.125 everywhere. A head GEMM is costed by its own cell, not by its FLOPs.
Json shapes_json() {
  const std::vector<double> tokens = {64, 128}, sizes = {8, 256, 512};
  Json fwd = Json::array(), dx = Json::array(), dw = Json::array();
  for (double t : tokens)
    for (double i : sizes)
      for (double o : sizes) {
        fwd.push_back(t == 128 && i == 256 && o == 512 ? 0.1 : i == 8 ? 0.2 : 0.5);
        dx.push_back(0.25);
        dw.push_back(0.125);
      }
  return Json{{"tokens", tokens}, {"in", sizes}, {"out", sizes}, {"forward", fwd}, {"backward_data", dx},
              {"backward_weight", dw}, {"provenance", {{"kind", "estimate"}, {"source", "synthetic test grid"}}}};
}

TEST(GemmShapes, TheLayerAndHeadGemmsAreCostedByTheirCells) {
  Json rig = rig_json(flat_curve(0.5));
  rig["gpu"]["gemm_shapes"] = shapes_json();
  const Loaded l = load(mixtral_json(2), rig);
  ASSERT_TRUE(l.rig.gpu.gemm_shapes.has_value());
  const CostModel cost(l.plan, l.model, l.rig);
  const CostModel::LayerCost& c = cost.layer_cost(0);
  // q, k, v, o: four (128, 256 -> 256) linears at 0.5 forward; backward dX at 0.25 and dW at 0.125.
  const double one = 2 * kT * kH * kH;
  EXPECT_LT(rel(c.attention_gemms, 4 * one / (1e12 * 0.5)), 1e-12);
  // The router (128, 256 -> 8 experts): its cell, 0.5.
  EXPECT_LT(rel(c.router, 2 * kT * kH * kE / (1e12 * 0.5)), 1e-12);
  const double bwd_one = one / (1e12 * 0.25) + one / (1e12 * 0.125);
  const double bwd_router = 2 * kT * kH * kE / (1e12 * 0.25) + 2 * kT * kH * kE / (1e12 * 0.125);
  EXPECT_LT(rel(c.gemms_backward, 4 * bwd_one + bwd_router), 1e-12);
  // The head (128 tokens, 256 -> 512 vocabulary) at its own 0.1, dX and dW as the others; the
  // element-wise work is free on this rig.
  const double head = 2 * kT * kH * kV;
  EXPECT_LT(rel(cost.head_time(), head / (1e12 * 0.1) + head / (1e12 * 0.25) + head / (1e12 * 0.125)), 1e-12);
  // Without the grid, the FLOPs curve (1.0 on this rig) and a backward of twice the forward.
  const Loaded flat = load(mixtral_json(2), rig_json(flat_curve(0.5)));
  const CostModel f(flat.plan, flat.model, flat.rig);
  EXPECT_LT(rel(f.head_time(), 3 * head / 1e12), 1e-12);
  EXPECT_LT(rel(f.layer_cost(0).gemms_backward, 2 * (4 * one + 2 * kT * kH * kE) / 1e12), 1e-12);
}

TEST(GemmShapes, InterpolatesInLogSizeAndClampsAtTheEnds) {
  GemmShapes g;
  g.tokens = {64, 256};
  g.in = {8, 32};
  g.out = {8};
  // forward: tokens 64 -> 0.2 and 0.4 (in 8, 32); tokens 256 -> 0.6 and 0.8
  g.efficiency[0] = {0.2, 0.4, 0.6, 0.8};
  g.efficiency[1] = g.efficiency[2] = g.efficiency[0];
  EXPECT_DOUBLE_EQ(g.at(GemmShapes::kForward, 64, 8, 8), 0.2);  // on the grid
  EXPECT_DOUBLE_EQ(g.at(GemmShapes::kForward, 256, 32, 8), 0.8);
  EXPECT_NEAR(g.at(GemmShapes::kForward, 128, 8, 8), 0.4, 1e-12);   // halfway in log(tokens)
  EXPECT_NEAR(g.at(GemmShapes::kForward, 128, 16, 8), 0.5, 1e-12);  // halfway on both axes
  EXPECT_DOUBLE_EQ(g.at(GemmShapes::kForward, 16, 8, 8), 0.2);      // below the grid: its edge
  EXPECT_DOUBLE_EQ(g.at(GemmShapes::kForward, 4096, 1e6, 1e6), 0.8); // above
}

// ---- bytes streamed: every expert ---------------------------------------------------------------

// Parameters of the Mixtral-shaped decoder layer, from the shapes: q, k, v, o 4 H^2, two norms 2 H,
// the router E H, and every expert's w1, w2, w3: E x 3 H I.
constexpr double kLayerParams = 4.0 * kH * kH + 2 * kH + kE * kH + kE * 3.0 * kH * kI;  // 3,410,432
constexpr double kEmbedParams = kV * kH, kHeadParams = kV * kH + kH;

double h2d_weight_bytes(const SimResult& r, int32_t step) {
  double bytes = 0;
  const Engine& e = *r.engine;
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    if (ts.step == step && span_kind_of(ts) == SpanKind::kH2D) bytes += static_cast<double>(ts.bytes);
  }
  return bytes;
}

TEST(MoeStep, AStepStreamsEveryExpertOfEveryLayer) {
  // Layer-major: the embedding, both layers and the head forward, the layers again backward; bf16.
  const double once = 2 * (kEmbedParams + 2 * 2 * kLayerParams + kHeadParams);
  EXPECT_DOUBLE_EQ(once, 27808256.0);
  {
    const Loaded l = load(mixtral_json(2), rig_json(flat_curve(0.5)));
    auto r = simulate(l.plan, l.model, l.rig, SimOptions{3, true});
    ASSERT_TRUE(r.ok() && r->feasible);
    EXPECT_DOUBLE_EQ(h2d_weight_bytes(*r, 1), once);
    EXPECT_DOUBLE_EQ(r->weight_bytes_per_step, once);
    // Every parameter's fp32 gradient goes back once.
    EXPECT_DOUBLE_EQ(r->gradient_bytes_per_step, 4 * (kEmbedParams + 2 * kLayerParams + kHeadParams));
  }
  {
    // Microbatch-major with two micro-batches streams it all twice.
    Knobs k;
    k.order = "microbatch-major";
    k.grad_accum = 2;
    const Loaded l = load(mixtral_json(2), rig_json(flat_curve(0.5)), k);
    auto r = simulate(l.plan, l.model, l.rig, SimOptions{3, true});
    ASSERT_TRUE(r.ok() && r->feasible);
    EXPECT_DOUBLE_EQ(h2d_weight_bytes(*r, 1), 2 * once);
    EXPECT_DOUBLE_EQ(r->weight_bytes_per_step, 2 * once);
    EXPECT_DOUBLE_EQ(r->gradient_bytes_per_step, 2 * 4 * (kEmbedParams + 2 * kLayerParams + kHeadParams));
    double d2h = 0;
    const Engine& e = *r->engine;
    for (size_t t = 0; t < e.task_count(); ++t) {
      const TaskSpec& ts = e.task(static_cast<TaskId>(t));
      if (ts.step == 1 && span_kind_of(ts) == SpanKind::kD2H) d2h += static_cast<double>(ts.bytes);
    }
    EXPECT_DOUBLE_EQ(d2h, r->gradient_bytes_per_step);
  }
}

// ---- FLOPs: the active experts only -------------------------------------------------------------

TEST(MoeStep, FlopsAndMfuCountOnlyTheExpertsATokenUses) {
  // Per token, forward: per layer 2 x 4 H^2 (projections) + 4 s q (attention, the full square) +
  // 2 E H (router) + k x 6 H I (the k experts' gate, up, down), two layers; head 2 V H.
  const double layer = 2 * 4.0 * kH * kH + 4.0 * kSeq * kH + 2.0 * kE * kH + kK * 6.0 * kH * kI;  // 2,232,320
  const double forward = 2 * layer + 2.0 * kV * kH;                                              // 4,726,784
  const double per_step = 3 * forward * kT;  // forward + backward, one micro-batch of 128 tokens
  EXPECT_DOUBLE_EQ(per_step, 1815085056.0);
  const Loaded l = load(mixtral_json(2), rig_json(flat_curve(0.5)));
  auto r = simulate(l.plan, l.model, l.rig, SimOptions{3, true});
  ASSERT_TRUE(r.ok() && r->feasible);
  EXPECT_LT(rel(r->flops_per_step, per_step), 1e-12);
  EXPECT_LT(rel(r->mfu, per_step / r->step_time_s / 1e12), 1e-12);
  EXPECT_LT(rel(r->tflops, per_step / r->step_time_s / 1e12), 1e-12);
  // The GPU tasks of a step carry the same FLOPs (no recompute here).
  double tasks = 0;
  const Engine& e = *r->engine;
  for (size_t t = 0; t < e.task_count(); ++t)
    if (e.task(static_cast<TaskId>(t)).step == 1) tasks += e.task(static_cast<TaskId>(t)).flops;
  EXPECT_LT(rel(tasks, per_step), 1e-12);
  // Counting every expert instead would be (E / k = 4) times the experts' share higher.
  const double all_experts = 3 * kT * (2 * (layer + (kE - kK) * 6.0 * kH * kI) + 2.0 * kV * kH);
  EXPECT_GT(all_experts / r->flops_per_step, 2.5);
}

}  // namespace
}  // namespace megatrain::sim

// step::compile and step::footprint against hand-computed op lists and byte counts (issue 30):
// the compute stream and the H2D queue of a small layer-major step with host checkpoints, the tied
// head's second load of the embedding, microbatch-major rounds, and the buffers of a model whose
// decoder layers differ in size (a dense first layer of a Mixture-of-Experts model).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/step/schedule.h"

namespace {

using namespace megatrain;
using step::OpKind;
namespace fs = std::filesystem;

Plan plan_for(const std::string& model, int64_t grad_accum, int64_t K, int64_t B, int64_t c, bool host, bool layer_major = true) {
  Plan p;
  p.model = ProfileRef{false, model};
  p.rig = ProfileRef{false, "cpu-dev-2core"};
  p.training.seq_len = 16;
  p.training.micro_batch = 2;
  p.training.grad_accum = grad_accum;
  p.training.steps = 1;
  p.training.warmup_steps = 0;
  p.training.clip_grad_norm = 0;
  p.precision = PrecisionConfig{DType::kFp32, DType::kFp32, DType::kFp32};
  p.schedule.order = layer_major ? ScheduleOrder::kLayerMajor : ScheduleOrder::kMicrobatchMajor;
  p.schedule.prefetch_depth = K;
  p.schedule.device_layer_buffers = B;
  p.schedule.checkpoint_every = c;
  p.schedule.checkpoint_location = host ? CheckpointLocation::kHost : CheckpointLocation::kDevice;
  return p;
}

std::string text(const step::Op& o) {
  switch (o.kind) {
    case OpKind::kAcquire: return "acquire " + std::to_string(o.load);
    case OpKind::kRelease: return "release " + std::to_string(o.load);
    case OpKind::kCompute:
      return std::string(span_kind_name(o.span)) + " L" + std::to_string(o.layer) + " mb" + std::to_string(o.mb) + " load" +
             std::to_string(o.load) + (o.load2 >= 0 ? "+" + std::to_string(o.load2) : "");
    case OpKind::kSaveCheckpoint: return "save L" + std::to_string(o.layer) + " mb" + std::to_string(o.mb) + " ck" + std::to_string(o.checkpoint);
    case OpKind::kWaitCheckpoint: return "wait_ck L" + std::to_string(o.layer) + " mb" + std::to_string(o.mb) + " ck" + std::to_string(o.checkpoint);
    case OpKind::kWaitRestore: return "wait_restore L" + std::to_string(o.layer) + " mb" + std::to_string(o.mb) + " b" + std::to_string(o.block);
    case OpKind::kConsumed: return "consumed L" + std::to_string(o.layer) + " mb" + std::to_string(o.mb) + " b" + std::to_string(o.block);
    case OpKind::kBackwardBegins: return "backward_begins";
    case OpKind::kTakeGradBuffer: return "take_grad L" + std::to_string(o.layer);
    case OpKind::kGradFinal: return "grad_final L" + std::to_string(o.layer);
  }
  return "?";
}

std::vector<std::string> ops_of(const step::StepSchedule& s) {
  std::vector<std::string> v;
  for (const step::Op& o : s.round.compute) v.push_back(text(o));
  return v;
}

std::vector<std::string> h2d_of(const step::StepSchedule& s) {
  std::vector<std::string> v;
  for (const step::Transfer& t : s.round.h2d)
    v.push_back(t.kind == step::Transfer::kWeights
                    ? "weights U" + std::to_string(t.unit) + " load" + std::to_string(t.load)
                    : "restore L" + std::to_string(t.unit) + " b" + std::to_string(t.block) + " ck" + std::to_string(t.checkpoint) +
                          " mb" + std::to_string(t.mb));
  return v;
}

step::StepSchedule compiled(const Plan& p) {
  auto model = p.resolve_model();
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  auto s = step::compile(p, *model, step::cpu_layout(*model, p.training.micro_batch, p.training.seq_len));
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return *s;
}

// tiny-llama-gqa has two decoder layers: units 0 (embedding), 1, 2 and 3 (final norm and head).
TEST(Compile, LayerMajorWithHostCheckpointsByHand) {
  const step::StepSchedule s = compiled(plan_for("tiny-llama-gqa", 2, 1, 2, 1, true));
  EXPECT_EQ(s.rounds, 1);
  EXPECT_EQ(s.resident_mbs, 2);
  EXPECT_EQ(s.checkpoints_per_mb, 2);
  EXPECT_EQ(s.round.loads, (std::vector<int32_t>{0, 1, 2, 3, 2, 1}));
  EXPECT_EQ(s.round.backward_first_load, 4);
  EXPECT_EQ(h2d_of(s), (std::vector<std::string>{"weights U0 load0", "weights U1 load1", "weights U2 load2", "weights U3 load3",
                                                 "weights U2 load4", "restore L2 b0 ck1 mb0", "restore L2 b0 ck1 mb1",
                                                 "weights U1 load5", "restore L1 b1 ck0 mb0", "restore L1 b1 ck0 mb1"}));
  const std::vector<std::string> want = {
      "acquire 0", "embed_forward L0 mb0 load0", "embed_forward L0 mb1 load0", "release 0",
      "acquire 1", "save L1 mb0 ck0", "forward L1 mb0 load1", "save L1 mb1 ck0", "forward L1 mb1 load1", "release 1",
      "acquire 2", "wait_ck L2 mb0 ck0", "save L2 mb0 ck1", "forward L2 mb0 load2",
      "wait_ck L2 mb1 ck0", "save L2 mb1 ck1", "forward L2 mb1 load2", "release 2",
      "acquire 3", "head L3 mb0 load3", "head L3 mb1 load3", "release 3", "grad_final L3", "backward_begins",
      "acquire 4", "take_grad L2",
      "wait_restore L2 mb0 b0", "recompute L2 mb0 load4", "consumed L2 mb0 b0", "backward L2 mb0 load4",
      "wait_restore L2 mb1 b0", "recompute L2 mb1 load4", "consumed L2 mb1 b0", "backward L2 mb1 load4",
      "release 4", "grad_final L2",
      "acquire 5", "take_grad L1",
      "wait_restore L1 mb0 b1", "recompute L1 mb0 load5", "consumed L1 mb0 b1", "backward L1 mb0 load5",
      "wait_restore L1 mb1 b1", "recompute L1 mb1 load5", "consumed L1 mb1 b1", "backward L1 mb1 load5",
      "release 5", "grad_final L1",
      "embed_backward L0 mb0 load-1", "embed_backward L0 mb1 load-1", "grad_final L0"};
  EXPECT_EQ(ops_of(s), want);
  // Without clipping the optimizer takes the units as their gradients become final.
  EXPECT_EQ(s.optimizer_order, (std::vector<int32_t>{3, 2, 1, 0}));
}

// The same step's edges, by hand. Ops (index: op): 0 acquire 0, 3 release 0, 4 acquire 1, 5 and 7
// save L1, 9 release 1, 10 acquire 2, 11 and 14 wait for checkpoint 0, 12 and 15 save L2,
// 17 release 2, 18 acquire 3, 21 release 3, 22 grad_final L3, 23 backward_begins, 24 acquire 4,
// 25 take_grad L2, 26 and 30 wait_restore b0, 28 and 32 consumed b0, 34 release 4, 35 grad_final
// L2, 36 acquire 5, 37 take_grad L1, 38 and 42 wait_restore b1, 46 release 5, 47 grad_final L1,
// 50 grad_final L0.
TEST(Compile, LayerMajorWithHostCheckpointsEdgesByHand) {
  const step::StepSchedule s = compiled(plan_for("tiny-llama-gqa", 2, 1, 2, 1, true));
  const step::Round& r = s.round;
  ASSERT_EQ(r.compute.size(), 51u);
  // D2H: the four host checkpoints as the forward saves them, then the gradients as they become final.
  struct Out { step::Transfer::Kind kind; int32_t unit, mb, checkpoint, after_op, accumulator; };
  const std::vector<Out> d2h = {{step::Transfer::kCheckpoint, 1, 0, 0, 5, -1}, {step::Transfer::kCheckpoint, 1, 1, 0, 7, -1},
                                {step::Transfer::kCheckpoint, 2, 0, 1, 12, -1}, {step::Transfer::kCheckpoint, 2, 1, 1, 15, -1},
                                {step::Transfer::kGradient, 3, -1, -1, 22, -1}, {step::Transfer::kGradient, 2, -1, -1, 35, 0},
                                {step::Transfer::kGradient, 1, -1, -1, 47, 1}, {step::Transfer::kGradient, 0, -1, -1, 50, -1}};
  ASSERT_EQ(r.d2h.size(), d2h.size());
  for (size_t i = 0; i < d2h.size(); ++i) {
    SCOPED_TRACE("D2H " + std::to_string(i));
    const step::Transfer& t = r.d2h[i];
    EXPECT_EQ(t.kind, d2h[i].kind);
    EXPECT_EQ(t.unit, d2h[i].unit);
    EXPECT_EQ(t.mb, d2h[i].mb);
    EXPECT_EQ(t.checkpoint, d2h[i].checkpoint);
    EXPECT_EQ(t.after_op, d2h[i].after_op);
    EXPECT_EQ(t.accumulator, d2h[i].accumulator);
  }
  // H2D: two slots, K = 1. Load n >= 2 waits for release number n - 2 (releases at ops 3, 9, 17,
  // 21 free loads 0, 1, 2, 3), and until load n - 1's acquire is issued.
  // Restores wait for backward_begins (op 23), the previous block's consumed op of their
  // micro-batch, and the D2H copy of their checkpoint.
  struct In { int32_t window, slot_freed, after_op, after_consumed, after_copy; };
  const std::vector<In> h2d = {{-1, -1, -1, -1, -1}, {0, -1, -1, -1, -1}, {4, 3, -1, -1, -1},  {10, 9, -1, -1, -1},
                               {18, 17, -1, -1, -1}, {-1, -1, 23, -1, 2}, {-1, -1, 23, -1, 3}, {24, 21, -1, -1, -1},
                               {-1, -1, 23, 28, 0},  {-1, -1, 23, 32, 1}};
  ASSERT_EQ(r.h2d.size(), h2d.size());
  for (size_t i = 0; i < h2d.size(); ++i) {
    SCOPED_TRACE("H2D " + std::to_string(i));
    const step::Transfer& t = r.h2d[i];
    EXPECT_EQ(t.window, h2d[i].window);
    EXPECT_EQ(t.slot_freed, h2d[i].slot_freed);
    EXPECT_EQ(t.after_update, t.kind == step::Transfer::kWeights);
    EXPECT_EQ(t.after_op, h2d[i].after_op);
    EXPECT_EQ(t.after_consumed, h2d[i].after_consumed);
    EXPECT_EQ(t.after_copy, h2d[i].after_copy);
  }
  // What each waiting op waits for, and the accumulators the takes name.
  const std::vector<std::pair<int, int32_t>> waits = {{0, 0},  {4, 1},  {10, 2}, {11, 0}, {14, 1}, {18, 3}, {22, 4}, {24, 4},
                                                      {26, 5}, {30, 6}, {35, 5}, {36, 7}, {38, 8}, {42, 9}, {47, 6}, {50, 7}};
  for (auto [k, transfer] : waits) EXPECT_EQ(r.compute[static_cast<size_t>(k)].transfer, transfer) << "op " << k;
  // The slots: loads 0 and 1 fill slots 0 and 1, then each load the slot of the load two
  // releases back; the round gives back slots 0 and 1 last, in that order.
  const step::SlotLabels labels = step::label_slots(r, s.B, step::first_slots(s.B));
  EXPECT_EQ(labels.of_load, (std::vector<int32_t>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(labels.carried, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.compute[25].accumulator, 0);
  EXPECT_EQ(r.compute[25].transfer, -1);
  EXPECT_EQ(r.compute[37].accumulator, 1);
  EXPECT_EQ(r.compute[37].transfer, -1);
}

TEST(Compile, AGradientAccumulatorIsTakenAgainOnlyAfterItsCopy) {
  // Three decoder layers, one per block, two accumulators: layer 1 takes the accumulator that
  // layer 3's gradient copy gives back, and waits for that copy.
  const step::StepSchedule s = compiled(plan_for("tiny-qwen3-moe", 1, 1, 2, 1, false));
  ASSERT_EQ(s.L, 3);
  ASSERT_EQ(s.buffers.grad_sets, 2);
  std::vector<const step::Op*> takes;
  for (const step::Op& o : s.round.compute)
    if (o.kind == OpKind::kTakeGradBuffer) takes.push_back(&o);
  ASSERT_EQ(takes.size(), 3u);
  EXPECT_EQ(takes[0]->layer, 3);
  EXPECT_EQ(takes[0]->accumulator, 0);
  EXPECT_EQ(takes[1]->accumulator, 1);
  EXPECT_EQ(takes[2]->layer, 1);
  EXPECT_EQ(takes[2]->accumulator, 0);
  ASSERT_GE(takes[2]->transfer, 0);
  const step::Transfer& copy = s.round.d2h[static_cast<size_t>(takes[2]->transfer)];
  EXPECT_EQ(copy.kind, step::Transfer::kGradient);
  EXPECT_EQ(copy.unit, 3);
  EXPECT_EQ(copy.accumulator, 0);
}

TEST(Compile, EdgesThatCouldHangTheExecutorAreRefused) {
  const step::StepSchedule good = compiled(plan_for("tiny-llama-gqa", 2, 1, 2, 1, true));
  ASSERT_TRUE(step::check_edges(good).ok());
  auto expect_refused = [&](const std::function<void(step::StepSchedule&)>& edit, const std::string& says) {
    step::StepSchedule s = good;
    edit(s);
    const Status st = step::check_edges(s);
    ASSERT_FALSE(st.ok()) << says;
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
  };
  // Load 2 refilling a slot without waiting for load 0's release.
  expect_refused([](step::StepSchedule& s) { s.round.h2d[2].slot_freed = -1; },
                 "(load 2) takes the slot given back at op -1, but with 2 slots it must wait for op 3");
  // Load 1 waiting for load 2's acquire, which waits for a load queued behind it.
  expect_refused([](step::StepSchedule& s) { s.round.h2d[1].window = 10; }, "deadlocks");
  // A restore waiting for a checkpoint copy that follows the recompute it feeds.
  expect_refused([](step::StepSchedule& s) { s.round.h2d[5].after_consumed = 40; }, "deadlocks");
  // Layer 1 taking layer 2's accumulator without waiting for its copy.
  expect_refused([](step::StepSchedule& s) { s.round.compute[37].accumulator = 0; }, "without waiting for the copy");
  expect_refused([](step::StepSchedule& s) { s.round.compute[0].transfer = 99; }, "out of range");
}

TEST(Compile, ATiedHeadLoadsTheTableAgainAndNoRecomputeKeepsEveryLayer) {
  // tiny-qwen2 ties its head to the embedding: the head's compute reads load 3 (final norm) and
  // load 4 (the table, unit 0 again). checkpoint_every 0: no recompute, no checkpoints.
  const step::StepSchedule s = compiled(plan_for("tiny-qwen2", 1, 1, 2, 0, false));
  ASSERT_EQ(s.L, 2);
  EXPECT_EQ(s.round.loads, (std::vector<int32_t>{0, 1, 2, 3, 0, 2, 1}));
  EXPECT_EQ(s.round.backward_first_load, 5);
  const std::vector<std::string> want = {
      "acquire 0", "embed_forward L0 mb0 load0", "release 0",
      "acquire 1", "forward L1 mb0 load1", "release 1",
      "acquire 2", "forward L2 mb0 load2", "release 2",
      "acquire 3", "acquire 4", "head L3 mb0 load3+4", "release 3", "release 4", "grad_final L3", "backward_begins",
      "acquire 5", "take_grad L2", "backward L2 mb0 load5", "release 5", "grad_final L2",
      "acquire 6", "take_grad L1", "backward L1 mb0 load6", "release 6", "grad_final L1",
      "embed_backward L0 mb0 load-1", "grad_final L0"};
  EXPECT_EQ(ops_of(s), want);
  // Seven loads through two slots: the head and the table hold both, so the slots the round gives
  // back last are 1 then 0, and the next round's first load fills slot 1 (B interchangeable
  // buffers: it takes the first one free).
  const step::SlotLabels first = step::label_slots(s.round, s.B, step::first_slots(s.B));
  EXPECT_EQ(first.of_load, (std::vector<int32_t>{0, 1, 0, 1, 0, 1, 0}));
  EXPECT_EQ(first.carried, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(step::label_slots(s.round, s.B, first.carried).of_load, (std::vector<int32_t>{1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(s.round.h2d[6].slot_freed, 13) << "load 6 waits for release number 4, the table's";
  EXPECT_EQ(s.buffers.checkpoints, 0);
  EXPECT_EQ(s.buffers.act_sets, 2) << "every layer's activations of the one micro-batch";
  EXPECT_EQ(s.buffers.tied_grad, 256 * 64) << "vocab x hidden";
}

TEST(Compile, MicrobatchMajorIsOneRoundPerMicroBatch) {
  const step::StepSchedule s = compiled(plan_for("tiny-llama-gqa", 3, 2, 3, 2, false, false));
  EXPECT_EQ(s.rounds, 3);
  EXPECT_EQ(s.resident_mbs, 1);
  EXPECT_EQ(s.round.micro_batches, 1);
  EXPECT_EQ(s.round.blocks, (std::vector<std::pair<int32_t, int32_t>>{{1, 2}}));
  EXPECT_EQ(s.buffers.checkpoints, 1) << "one device checkpoint per block of 2 layers, one micro-batch resident";
  EXPECT_EQ(s.buffers.grad_sets, 3) << "c + 1 accumulators";
}

// The host side of the footprint with the whole state on NVMe, by hand. tiny-llama-gqa: hidden 64,
// 4 heads and 2 KV heads of 16, intermediate 160, vocabulary 256. Units: the embedding 256 x 64 =
// 16384; a layer q 4096 + k 2048 + v 2048 + o 4096 + gate, up, down 3 x 10240 + two norms 128 =
// 43136; the head: final norm 64 + lm_head 16384 = 16448.
TEST(Footprint, StateOnNvmeWithHostCheckpointsAndLentGradientsByHand) {
  Plan p = plan_for("tiny-llama-gqa", 2, 1, 2, 1, true);
  p.precision.transfer = DType::kBf16;
  p.placement.master_weights = Tier::kNvme;
  p.placement.optimizer_states = Tier::kNvme;
  p.placement.nvme_dirs = {fs::temp_directory_path().string()};
  p.placement.nvme_block_bytes = 65536;
  p.placement.pinned_staging_bytes = 655360;
  p.optimizer.m_format = StateFormat::kQ8;
  p.optimizer.v_format = StateFormat::kQ8;
  p.optimizer.block_size = 128;
  const step::StepSchedule s = compiled(p);
  ASSERT_EQ(s.unit_numel, (std::vector<int64_t>{16384, 43136, 43136, 16448}));
  const step::Footprint f = step::footprint(s, s.layout);
  // NVMe regions: master (4 B per parameter), then m and v in q8 (a code byte per element of
  // whole 128-blocks per tensor, then a 4-byte scale per block), each array on a 4 KiB boundary,
  // the region in whole 64 KiB blocks.
  //   layer: 338 blocks (32 + 16 + 16 + 32 + 3 x 80 + 1 + 1); master 172544 B, m codes at 176128
  //     (43264 B), m scales at 221184 (1352 B), v codes at 225280, v scales at 270336, end 271688:
  //     5 blocks, 327680 B.
  //   embedding: 128 blocks; master 65536 B, m codes 65536 .. 81920, scales at 81920 (512 B),
  //     v codes at 86016 .. 102400, scales to 102912: 2 blocks, 131072 B.
  //   head: 129 blocks; master 65792 B, m codes at 69632 (16512 B), m scales at 90112 (516 B),
  //     v codes at 94208, v scales at 114688, end 115204: 2 blocks, 131072 B.
  EXPECT_EQ(f.peak.nvme, 131072 + 2 * 327680 + 131072);
  // Staging: 655360 B holds two of the largest unit's transfers, each buffer a whole region.
  EXPECT_EQ(s.staging_buffers, 2);
  EXPECT_EQ(f.ram_staging, 2 * 327680);
  // RAM: the bf16 streaming copy of every parameter (master and states are on NVMe; gradients are
  // lent: three buffers of the largest unit); host checkpoints: 2 per micro-batch x 2 resident
  // micro-batches x 32 tokens x 64 x 4 B; token rows: inputs and targets of 2 x 32 tokens, int32.
  const int64_t params = 16384 + 2 * 43136 + 16448;
  EXPECT_EQ(f.ram_state, 2 * params);
  EXPECT_EQ(f.ram_checkpoints, 2 * 2 * 32 * 64 * 4);
  EXPECT_EQ(f.ram_gradients, 3 * 4 * 43136);
  EXPECT_EQ(f.ram_data, 2 * 2 * 32 * 4);
  EXPECT_EQ(f.peak.ram - f.ram_arena, 2 * params + 2 * 327680 + 2 * 2 * 32 * 64 * 4 + 3 * 4 * 43136 + 2 * 2 * 32 * 4);
  // Pinned: what the copies read and write: the bf16 copy, the host checkpoints, the lent gradients.
  EXPECT_EQ(f.peak.pinned, 2 * params + 2 * 2 * 32 * 64 * 4 + 3 * 4 * 43136);
  // Rows packed "neat": the loader also keeps each token's document start (int32), in RAM only.
  const auto keys_before = step::footprint_keys(p).host;
  p.training.document_tokens = 5;
  const step::StepSchedule sd = compiled(p);
  const step::Footprint fd = step::footprint(sd, sd.layout);
  EXPECT_EQ(fd.ram_data, 3 * 2 * 32 * 4);
  EXPECT_EQ(fd.peak.ram - f.peak.ram, 2 * 32 * 4);
  EXPECT_EQ(fd.peak.pinned, f.peak.pinned);
  EXPECT_NE(step::footprint_keys(p).host, keys_before) << "the planner's footprint cache tells the two apart";
}

TEST(Compile, EveryPerLayerBufferHoldsTheLargestLayer) {
  // Qwen3-MoE with one dense layer: the gradient accumulators hold the largest decoder layer
  // wherever the dense one is (sizing them by layer 0 corrupted training with a dense first layer).
  std::ifstream in(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / "tiny-qwen3-moe.json");
  const auto base = nlohmann::json::parse(in);
  const int64_t H = base["hidden_size"], I = base["intermediate_size"], E = base["num_experts"],
                Im = base["moe_intermediate_size"], hd = base["head_dim"], nh = base["num_attention_heads"],
                nkv = base["num_key_value_heads"], V = base["vocab_size"];
  // q and o [H, nh hd], k and v [H, nkv hd], the q/k norms [hd], two RMSNorms [H]; then the MLP:
  // gate, up, down [H, I], or the router [E, H] and E experts' gate, up, down [H, Im].
  const int64_t attn = 2 * H * nh * hd + 2 * H * nkv * hd + 2 * hd + 2 * H;
  const int64_t dense = attn + 3 * H * I, moe = attn + E * H + E * 3 * H * Im;
  ASSERT_GT(moe, dense);
  for (int64_t d : {0, 1, 2}) {
    auto cfg = base;
    cfg["mlp_only_layers"] = {d};
    Plan p = plan_for("tiny-qwen3-moe", 1, 1, 2, 1, false);
    p.model = ProfileRef{true, cfg.dump()};
    SCOPED_TRACE("dense layer " + std::to_string(d));
    const step::StepSchedule s = compiled(p);
    ASSERT_EQ(s.L, 3);
    for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(s.unit_numel[static_cast<size_t>(l + 1)], l == d ? dense : moe) << "layer " << l;
    EXPECT_EQ(s.buffers.grad_floats, moe);
    EXPECT_EQ(s.buffers.slot_floats, std::max(moe, V * H + H));
    EXPECT_EQ(s.buffers.embed_grad, V * H);
    EXPECT_EQ(s.buffers.head_grad, V * H + H);
  }
}

}  // namespace

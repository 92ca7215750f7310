// The streamed pipeline against the plain in-memory loop of the same model: the same losses and
// the same final weights, bit for bit, for every prefetch depth and checkpoint interval, with and
// without clipping, bf16 transfer, a tied head; and plans whose buffers do not fit are refused
// before training with the bytes they need.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "megatrain/core/plan.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/executor/trainer.h"

namespace megatrain::exec {
namespace {

using Json = nlohmann::ordered_json;

Json base_plan(const std::string& model) {
  return Json{{"schema", "megatrain.plan/1"},
              {"model", model},
              {"rig", "cpu-dev-2core"},
              {"training", {{"seq_len", 16}, {"micro_batch", 2}, {"grad_accum", 3}, {"steps", 4}, {"lr", 3e-3},
                            {"warmup_steps", 1}, {"min_lr", 3e-4}, {"clip_grad_norm", 0.0}, {"data_order", "sequential"}}},
              {"precision", {{"compute", "fp32"}, {"transfer", "fp32"}}},
              {"schedule", {{"prefetch_depth", 1}, {"device_layer_buffers", 2}, {"checkpoint_every", 1},
                            {"checkpoint_location", "device"}}},
              {"optimizer", {{"threads", 1}}}};
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<std::vector<float>> master;
};

TrainRun train(const Json& pj, bool streamed, int steps = 4) {
  auto plan = Plan::from_json_text(pj.dump());
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  auto model = plan->resolve_model();
  EXPECT_TRUE(model.ok());
  HostState hs = HostState::create(*model, plan->precision.transfer);
  EXPECT_TRUE(hs.init_random(7, 0.02).ok());
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 4000; ++i) toks.push_back((i * 2654435761u >> 7) % 256);
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks));
  auto loader = DataLoader::create(file, plan->training.seq_len, plan->training.micro_batch, plan->training.grad_accum,
                                   DataOrder::kSequential, 1, model->config().vocab_size);
  EXPECT_TRUE(loader.ok()) << loader.status().to_string();
  TrainerOptions o;
  o.streamed = streamed;
  auto trainer = Trainer::create(*plan, *model, hs, *loader, o);
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  TrainRun r;
  for (int s = 0; s < steps; ++s) {
    auto res = (*trainer)->run_step(s);
    EXPECT_TRUE(res.ok()) << res.status().to_string();
    r.losses.push_back(res->loss);
  }
  (*trainer)->wait_for_updates();
  for (const auto& u : hs.units()) r.master.emplace_back(u.master.data(), u.master.data() + u.numel);
  return r;
}

void expect_identical(const TrainRun& a, const TrainRun& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i;
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t u = 0; u < a.master.size(); ++u) EXPECT_TRUE(a.master[u] == b.master[u]) << "unit " << u << " differs";
}

TEST(StreamedTraining, MatchesTheInMemoryLoopBitForBit) {
  const TrainRun reference = train(base_plan("tiny-llama-gqa"), false);
  EXPECT_LT(reference.losses.back(), reference.losses.front());  // it learns
  EXPECT_NEAR(reference.losses.front(), std::log(256.0), 0.05);   // a fresh model is near uniform
  for (const char* where : {"device", "host"}) {
    for (int k : {1, 2, 3}) {
      for (int c : {0, 1, 2}) {
        Json pj = base_plan("tiny-llama-gqa");
        pj["schedule"]["prefetch_depth"] = k;
        pj["schedule"]["device_layer_buffers"] = std::max(k + 1, c + 1);
        pj["schedule"]["checkpoint_every"] = c;
        pj["schedule"]["checkpoint_location"] = where;
        SCOPED_TRACE(std::string(where) + " K=" + std::to_string(k) + " checkpoint_every=" + std::to_string(c));
        expect_identical(train(pj, true), reference);
      }
    }
  }
}

TEST(StreamedTraining, MatchesWithClippingBf16TransferAndATiedHead) {
  Json pj = base_plan("tiny-qwen2");  // tied embeddings, q/k/v biases
  pj["training"]["clip_grad_norm"] = 0.5;
  pj["precision"]["transfer"] = "bf16";
  pj["schedule"]["prefetch_depth"] = 2;
  pj["schedule"]["device_layer_buffers"] = 3;
  pj["schedule"]["checkpoint_location"] = "host";
  expect_identical(train(pj, true), train(pj, false));
}

// microbatch-major sends every micro-batch's gradient to the host and sums it there. The in-memory
// loop instead adds each micro-batch straight into the running sum inside the ops (dW += ...,
// row by row for norms and biases), so the order of additions differs and so does the rounding:
// losses and weights agree within 1e-6 relative, not bit for bit. With one micro-batch per step
// there is nothing to sum and the two are identical.
TEST(StreamedTraining, MicrobatchMajorMatchesWithinRounding) {
  Json pj = base_plan("tiny-llama-gqa");
  pj["schedule"]["order"] = "microbatch-major";
  for (const char* where : {"device", "host"}) {
    for (int k : {1, 2}) {
      pj["schedule"]["prefetch_depth"] = k;
      pj["schedule"]["device_layer_buffers"] = k + 1;
      pj["schedule"]["checkpoint_location"] = where;
      SCOPED_TRACE(std::string(where) + " K=" + std::to_string(k));
      const TrainRun ref = train(pj, false), mb = train(pj, true);
      for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(mb.losses[i], ref.losses[i], 1e-6 * ref.losses[i]);
      for (size_t u = 0; u < ref.master.size(); ++u) {
        float scale = 0, diff = 0;
        for (size_t e = 0; e < ref.master[u].size(); ++e) {
          scale = std::max(scale, std::fabs(ref.master[u][e]));
          diff = std::max(diff, std::fabs(ref.master[u][e] - mb.master[u][e]));
        }
        EXPECT_LE(diff, 1e-6f * scale) << "unit " << u;
      }
    }
  }
  pj["training"]["grad_accum"] = 1;
  expect_identical(train(pj, true), train(pj, false));
}

TEST(StreamedTraining, APlanWhoseBuffersDoNotFitIsRefusedBeforeTraining) {
  Json pj = base_plan("tiny-llama-gqa");
  pj["placement"] = {{"device_budget_bytes", 65536}};
  auto plan = Plan::from_json_text(pj.dump());
  ASSERT_TRUE(plan.ok());
  auto model = plan->resolve_model();
  HostState hs = HostState::create(*model, plan->precision.transfer);
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(std::vector<uint32_t>(1000, 1)));
  auto loader = DataLoader::create(file, 16, 2, 3, DataOrder::kSequential, 1, 256);
  ASSERT_TRUE(loader.ok());
  auto t = Trainer::create(*plan, *model, hs, *loader, TrainerOptions{});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("device_budget_bytes"), std::string::npos);
  EXPECT_NE(t.status().message().find("needs"), std::string::npos);
  EXPECT_NE(t.status().message().find("layer buffers"), std::string::npos);
}


// ---- the non-finite guard (issue 32) -------------------------------------------------------------

// Rows of the base plan's shape (seq 16, 2 rows per micro-batch, 3 micro-batches: 6 rows a step):
// row k's tokens depend on k alone; the rows of the steps in `masked` count no target at all.
std::shared_ptr<const data::SequenceFile> guard_rows(const std::filesystem::path& path, int steps, const std::vector<int>& masked,
                                                     const std::vector<int>& dropped = {}) {
  data::SequenceRows r;
  for (int s = 0; s < steps; ++s) {
    if (std::find(dropped.begin(), dropped.end(), s) != dropped.end()) continue;
    const bool none = std::find(masked.begin(), masked.end(), s) != masked.end();
    for (int k = 6 * s; k < 6 * s + 6; ++k)
      for (int t = 0; t <= 16; ++t) {
        r.tokens.push_back(static_cast<uint32_t>(((k * 131 + t) * 2654435761u >> 9) % 256));
        r.mask.push_back(none ? 0 : 1);
      }
  }
  data::SequenceHeader h;
  h.seq_len = 16;
  h.vocab_size = 256;
  h.packing = "pad";
  h.train_on = "answer";
  EXPECT_TRUE(data::write_sequence_file(path, h, r).ok());
  auto f = data::SequenceFile::open(path);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  return std::make_shared<const data::SequenceFile>(std::move(*f));
}

struct GuardRun {
  std::vector<StepResult> steps;
  std::vector<std::vector<float>> master, initial;
  int64_t skipped = 0;
};

// `poison`: the final norm's weights set to FLT_MAX, so that every logit overflows.
GuardRun guarded(const Json& pj, bool streamed, const std::shared_ptr<const data::SequenceFile>& rows, int steps, bool poison = false) {
  auto plan = Plan::from_json_text(pj.dump());
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  auto model = plan->resolve_model();
  HostState hs = HostState::create(*model, plan->precision.transfer);
  EXPECT_TRUE(hs.init_random(7, 0.02).ok());
  GuardRun g;
  if (poison) {
    UnitState& head = hs.units().back();
    const TensorSlot* fn = head.find(TensorRole::kFinalNorm);
    std::fill(head.master.data() + fn->offset, head.master.data() + fn->offset + fn->numel, std::numeric_limits<float>::max());
  }
  for (const auto& u : hs.units()) g.initial.emplace_back(u.master.data(), u.master.data() + u.numel);
  DataLoaderOptions lo;
  lo.seq_len = 16;
  lo.micro_batch = 2;
  lo.grad_accum = 3;
  lo.vocab_size = 256;
  auto loader = DataLoader::create(rows, lo);
  EXPECT_TRUE(loader.ok()) << loader.status().to_string();
  TrainerOptions o;
  o.streamed = streamed;
  auto trainer = Trainer::create(*plan, *model, hs, *loader, o);
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  for (int s = 0; s < steps; ++s) {
    auto res = (*trainer)->run_step(s);
    EXPECT_TRUE(res.ok()) << res.status().to_string();
    g.steps.push_back(*res);
  }
  (*trainer)->wait_for_updates();
  g.skipped = (*trainer)->skipped_steps();
  for (const auto& u : hs.units()) g.master.emplace_back(u.master.data(), u.master.data() + u.numel);
  return g;
}

std::filesystem::path scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("megatrain-guard-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

// A step with no counted target makes no update, and AdamW's count and the learning rate follow
// the applied steps: 4 steps whose second has no targets end with the weights, bit for bit, of the
// 3 steps without it. Before the guard such a step divided by zero (loss NaN) and moved every
// weight by its momentum. Streamed (with and without clipping, where the verdict is reached before
// or during the backward) and in memory.
TEST(NonFiniteGuard, AStepWithoutTargetsIsSkippedAsIfItWereNotThere) {
  const auto with = guard_rows(scratch("with.mtseq"), 4, {1});
  const auto without = guard_rows(scratch("without.mtseq"), 4, {}, {1});
  for (double clip : {0.0, 0.5}) {
    for (bool streamed : {false, true}) {
      SCOPED_TRACE("clip " + std::to_string(clip) + (streamed ? " streamed" : " in memory"));
      Json pj = base_plan("tiny-llama-gqa");
      pj["training"]["clip_grad_norm"] = clip;
      const GuardRun a = guarded(pj, streamed, with, 4), b = guarded(pj, streamed, without, 3);
      ASSERT_EQ(a.steps.size(), 4u);
      EXPECT_TRUE(a.steps[0].applied && a.steps[2].applied && a.steps[3].applied);
      EXPECT_FALSE(a.steps[1].applied);
      EXPECT_TRUE(a.steps[1].state_intact);
      EXPECT_NE(a.steps[1].not_applied.find("no counted targets"), std::string::npos) << a.steps[1].not_applied;
      EXPECT_EQ(a.skipped, 1);
      EXPECT_EQ(a.steps[2].loss, b.steps[1].loss);
      EXPECT_EQ(a.steps[3].loss, b.steps[2].loss);
      ASSERT_EQ(a.master.size(), b.master.size());
      for (size_t u = 0; u < a.master.size(); ++u) EXPECT_TRUE(a.master[u] == b.master[u]) << "unit " << u << " differs";
    }
  }
  std::filesystem::remove_all(scratch("").parent_path());
}

// Weights whose logits overflow: every step's loss is not finite, no update is applied, and the
// weights after 3 steps are the initial ones, bit for bit (before the guard, NaN everywhere).
TEST(NonFiniteGuard, ANonFiniteLossMakesNoUpdate) {
  const auto rows = guard_rows(scratch("plain.mtseq"), 3, {});
  for (double clip : {0.0, 0.5}) {
    for (bool streamed : {false, true}) {
      SCOPED_TRACE("clip " + std::to_string(clip) + (streamed ? " streamed" : " in memory"));
      Json pj = base_plan("tiny-llama-gqa");
      pj["training"]["clip_grad_norm"] = clip;
      const GuardRun g = guarded(pj, streamed, rows, 3, true);
      for (const StepResult& r : g.steps) {
        EXPECT_FALSE(std::isfinite(r.loss));
        EXPECT_FALSE(r.applied);
        EXPECT_TRUE(r.state_intact);
        EXPECT_NE(r.not_applied.find("its loss is"), std::string::npos) << r.not_applied;
      }
      EXPECT_EQ(g.skipped, 3);
      for (size_t u = 0; u < g.master.size(); ++u) EXPECT_TRUE(g.master[u] == g.initial[u]) << "unit " << u << " moved";
    }
  }
  std::filesystem::remove_all(scratch("").parent_path());
}

}  // namespace
}  // namespace megatrain::exec

namespace megatrain::exec {
namespace {

// Trainer::evaluate: the forward-only pass over the rows the next step will train on gives that
// step's loss (computed before its update), bit for bit, on the streamed pipeline and the in-memory
// loop, dense, tied and Mixture-of-Experts; running it between steps changes nothing of the
// training; a set whose last micro-batch is short counts each row once.
TEST(Evaluation, TheNextStepsRowsGiveThatStepsLossAndTrainingIsUnchanged) {
  for (const char* name : {"tiny-llama-gqa", "tiny-qwen2", "tiny-mixtral"}) {
    for (bool streamed : {true, false}) {
      SCOPED_TRACE(std::string(name) + (streamed ? " streamed" : " in memory"));
      Json pj = base_plan(name);
      pj["schedule"]["checkpoint_every"] = 1;
      auto plan = Plan::from_json_text(pj.dump());
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      auto model = plan->resolve_model();
      ASSERT_TRUE(model.ok());
      const int64_t T = plan->training.seq_len, B = plan->training.micro_batch, A = plan->training.grad_accum;
      std::vector<uint32_t> toks;
      for (uint32_t i = 0; i < 4000; ++i) toks.push_back((i * 2654435761u >> 7) % 256);
      auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks));
      auto loader = DataLoader::create(file, T, B, A, DataOrder::kSequential, 1, model->config().vocab_size);
      ASSERT_TRUE(loader.ok());
      // The rows of step s as their own token file: rows s*A*B .. (s+1)*A*B - 1 of the training data.
      auto rows_of = [&](int64_t s, int64_t n) {
        const auto first = toks.begin() + s * A * B * T;
        DataLoaderOptions eo;
        eo.seq_len = T;
        eo.micro_batch = B;
        eo.vocab_size = model->config().vocab_size;
        auto l = DataLoader::create(std::make_shared<const TokenFile>(TokenFile::from_tokens({first, first + n * T + 1})), eo);
        EXPECT_TRUE(l.ok()) << l.status().to_string();
        return std::move(*l);
      };
      TrainerOptions o;
      o.streamed = streamed;
      HostState with_eval = HostState::create(*model, plan->precision.transfer);
      HostState plain = HostState::create(*model, plan->precision.transfer);
      ASSERT_TRUE(with_eval.init_random(7, 0.02).ok() && plain.init_random(7, 0.02).ok());
      auto te = Trainer::create(*plan, *model, with_eval, *loader, o);
      auto tp = Trainer::create(*plan, *model, plain, *loader, o);
      ASSERT_TRUE(te.ok() && tp.ok());
      for (int64_t s = 0; s < 4; ++s) {
        auto e = (*te)->evaluate(rows_of(s, A * B));
        ASSERT_TRUE(e.ok()) << e.status().to_string();
        EXPECT_EQ(e->rows, A * B);
        EXPECT_EQ(e->tokens, A * B * T);
        auto r = (*te)->run_step(s);
        auto p = (*tp)->run_step(s);
        ASSERT_TRUE(r.ok() && p.ok());
        EXPECT_EQ(e->loss, r->loss) << "step " << s;
        EXPECT_EQ(r->loss, p->loss) << "step " << s;
      }
      // A set of A*B - 1 rows: the last micro-batch has a row from the start again, not counted.
      auto shorter = (*te)->evaluate(rows_of(0, A * B - 1));
      ASSERT_TRUE(shorter.ok());
      EXPECT_EQ(shorter->rows, A * B - 1);
      EXPECT_EQ(shorter->tokens, (A * B - 1) * T);
      (*te)->wait_for_updates();
      (*tp)->wait_for_updates();
      for (size_t u = 0; u < plain.units().size(); ++u)
        EXPECT_TRUE(std::equal(plain.units()[u].master.data(), plain.units()[u].master.data() + plain.units()[u].numel,
                               with_eval.units()[u].master.data()))
            << "unit " << u << " differs after evaluations";
    }
  }
}

}  // namespace
}  // namespace megatrain::exec

// run_training (run.h) as megatrain-exec calls it: a run of 3 steps with a checkpoint, resumed for 2
// more, has the losses of a straight 5-step run bit for bit; a requested stop saves and says so.
#include "megatrain/executor/run.h"

#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <sstream>
#include <string>

#include "executor/file_test_util.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/safetensors.h"

namespace megatrain::exec {
namespace {

namespace fs = std::filesystem;

// A small English text (bytes, vocab 256), enough for 5 steps of the tiny plan (1024 tokens each).
std::string text_file(const test::ScratchDir& dir) {
  std::string text;
  while (text.size() < 20000) text += "the quick brown fox jumps over the lazy dog, and the dog sleeps on. ";
  const fs::path path = dir / "text.txt";
  test::write_bytes(path, text);
  return path.string();
}

RunOptions tiny_run(const std::string& data, int64_t steps) {
  RunOptions o;
  o.plan_path = (fs::path(MEGATRAIN_PROFILES_DIR) / "plans" / "tiny-cpu.json").string();
  o.data_path = data;
  o.steps = steps;
  o.backend = "cpu";
  o.threads = 2;
  return o;
}

TEST(RunTraining, ResumedRunHasTheStraightRunsLossesBitForBit) {
  test::ScratchDir dir("run");
  const std::string data = text_file(dir);

  std::ostringstream straight_out;
  auto straight = run_training(tiny_run(data, 5), straight_out);
  ASSERT_TRUE(straight.ok()) << straight.status().to_string();
  EXPECT_EQ(straight->first_step, 0);
  EXPECT_EQ(straight->next_step, 5);
  EXPECT_EQ(straight->stop_signal, 0);
  ASSERT_EQ(straight->losses.size(), 5u);
  EXPECT_NE(straight_out.str().find("step     5/5  loss"), std::string::npos) << straight_out.str();

  RunOptions first = tiny_run(data, 3);
  first.checkpoint_dir = (dir / "ckpt").string();
  std::ostringstream first_out;
  auto head = run_training(first, first_out);
  ASSERT_TRUE(head.ok()) << head.status().to_string();
  EXPECT_EQ(head->next_step, 3);
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000003" / "manifest.json"));
  EXPECT_NE(first_out.str().find("checkpoint "), std::string::npos) << first_out.str();

  RunOptions second = tiny_run(data, 5);
  second.checkpoint_dir = first.checkpoint_dir;
  second.resume = true;
  std::ostringstream second_out;
  auto tail = run_training(second, second_out);
  ASSERT_TRUE(tail.ok()) << tail.status().to_string();
  EXPECT_EQ(tail->first_step, 3);
  EXPECT_EQ(tail->next_step, 5);
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000005" / "manifest.json"));
  EXPECT_NE(second_out.str().find("resuming from "), std::string::npos) << second_out.str();
  EXPECT_EQ(second_out.str().find("step     3/5"), std::string::npos) << "the resumed run ran step 3 again";

  // The history carries the checkpoint's 3 losses and the resumed 2; all 5 equal as doubles.
  EXPECT_EQ(tail->losses_first_step, 0);
  ASSERT_EQ(tail->losses.size(), 5u);
  ASSERT_EQ(head->losses.size(), 3u);
  for (size_t i = 0; i < 5; ++i) {
    if (i < 3) {
      EXPECT_EQ(head->losses[i], straight->losses[i]) << "step " << i;
    }
    EXPECT_EQ(tail->losses[i], straight->losses[i]) << "step " << i;
  }

  // Resuming the finished run runs nothing.
  std::ostringstream again_out;
  auto again = run_training(second, again_out);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->next_step, 5);
  EXPECT_NE(again_out.str().find("nothing to run"), std::string::npos) << again_out.str();
}

TEST(RunTraining, StopRequestSavesAfterTheStepAndReportsTheSignal) {
  test::ScratchDir dir("run-stop");
  RunOptions o = tiny_run(text_file(dir), 50);
  o.checkpoint_dir = (dir / "ckpt").string();
  int polls = 0;
  bool started = false;
  RunCallbacks callbacks;
  callbacks.before_first_step = [&] { started = true; };
  callbacks.stop_requested = [&] { return ++polls == 2 ? SIGINT : 0; };
  std::ostringstream out;
  auto run = run_training(o, out, callbacks);
  ASSERT_TRUE(run.ok()) << run.status().to_string();
  EXPECT_TRUE(started);
  EXPECT_EQ(run->stop_signal, SIGINT);
  EXPECT_EQ(run->next_step, 2);
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000002" / "manifest.json"));
  EXPECT_NE(out.str().find("stopped by SIGINT after step 2 of 50; continue with --resume"), std::string::npos) << out.str();
}

// Ctrl-C and --resume with a Mixture-of-Experts model (gpt-oss: sinks, a sliding layer, stacked
// experts; the aux loss in the objective): a run stopped by SIGINT after step 2 and resumed has the
// losses of a straight run bit for bit, and the progress line reports the aux loss.
TEST(RunTraining, StopAndResumeWithAMixtureOfExpertsModelIsBitExact) {
  test::ScratchDir dir("run-moe");
  const std::string data = text_file(dir);
  std::string plan = test::read_bytes(fs::path(MEGATRAIN_PROFILES_DIR) / "plans" / "tiny-cpu.json");
  const std::string from = "\"model\": \"tiny-llama-gqa\"";
  ASSERT_NE(plan.find(from), std::string::npos);
  plan.replace(plan.find(from), from.size(), "\"model\": \"tiny-gpt-oss\"");
  const fs::path plan_path = dir / "moe.json";
  test::write_bytes(plan_path, plan);
  auto opts = [&](int64_t steps) {
    RunOptions o = tiny_run(data, steps);
    o.plan_path = plan_path.string();
    return o;
  };
  std::ostringstream straight_out;
  auto straight = run_training(opts(4), straight_out);
  ASSERT_TRUE(straight.ok()) << straight.status().to_string();
  ASSERT_EQ(straight->losses.size(), 4u);
  EXPECT_NE(straight_out.str().find(" aux "), std::string::npos) << straight_out.str();

  RunOptions first = opts(4);
  first.checkpoint_dir = (dir / "ckpt").string();
  int polls = 0;
  RunCallbacks callbacks;
  callbacks.stop_requested = [&] { return ++polls == 2 ? SIGINT : 0; };
  std::ostringstream first_out;
  auto head = run_training(first, first_out, callbacks);
  ASSERT_TRUE(head.ok()) << head.status().to_string();
  EXPECT_EQ(head->stop_signal, SIGINT);
  EXPECT_EQ(head->next_step, 2);
  // The step directory is a Hugging Face folder: config.json next to model.safetensors, describing
  // fp32 weights, the same model (its parameters and tensors), no quantization_config.
  const fs::path step2 = dir / "ckpt" / "step-00000002";
  const std::string config = test::read_bytes(step2 / "config.json");
  auto reread = ModelSpec::from_config_json(config);
  ASSERT_TRUE(reread.ok()) << reread.status().to_string();
  auto original = ModelSpec::load("tiny-gpt-oss");
  ASSERT_TRUE(original.ok());
  EXPECT_EQ(reread->parameter_counts().total, original->parameter_counts().total);
  ASSERT_EQ(reread->tensors().size(), original->tensors().size());
  for (size_t i = 0; i < reread->tensors().size(); ++i) EXPECT_EQ(reread->tensors()[i].name, original->tensors()[i].name);
  EXPECT_NE(config.find("\"torch_dtype\": \"float32\""), std::string::npos) << config;
  EXPECT_NE(test::read_bytes(step2 / "manifest.json").find("\"config.json\""), std::string::npos);

  RunOptions second = first;
  second.resume = true;
  std::ostringstream second_out;
  auto tail = run_training(second, second_out);
  ASSERT_TRUE(tail.ok()) << tail.status().to_string();
  EXPECT_EQ(tail->first_step, 2);
  ASSERT_EQ(tail->losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(tail->losses[i], straight->losses[i]) << "step " << i;
}

// gpt-oss's published config says its experts are MXFP4; the checkpoint's weights are the
// dequantised masters under the plain names, so its config.json must not say so.
TEST(RunTraining, CheckpointConfigDropsTheQuantizationConfig) {
  std::string cfg = test::read_bytes(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / "tiny-gpt-oss.json");
  const size_t brace = cfg.find('{');
  ASSERT_NE(brace, std::string::npos);
  cfg.insert(brace + 1, "\"quantization_config\": {\"quant_method\": \"mxfp4\", \"modules_to_not_convert\": []},");
  auto spec = ModelSpec::from_config_json(cfg);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  const std::string out = hf_checkpoint_config(*spec);
  EXPECT_EQ(out.find("quantization_config"), std::string::npos) << out;
  EXPECT_NE(out.find("\"torch_dtype\": \"float32\""), std::string::npos) << out;
  EXPECT_NE(out.find("GptOssForCausalLM"), std::string::npos) << out;
}

TEST(RunTraining, RefusesANewRunIntoAFolderOfCheckpoints) {
  test::ScratchDir dir("run-mix");
  RunOptions o = tiny_run(text_file(dir), 1);
  o.checkpoint_dir = (dir / "ckpt").string();
  std::ostringstream out;
  ASSERT_TRUE(run_training(o, out).ok());
  auto again = run_training(o, out);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("pass --resume"), std::string::npos) << again.status().to_string();
}

// The non-finite guard at the run (issue 32): the tiny plan's third step (8 rows of 129 tokens)
// counts no target. Without --skip-nonfinite-steps the run stops before that step's update, saves
// the 2 steps done and says how to go on; resumed with the flag, it skips the step and ends with
// the files, bit for bit, of a run that skipped it from the start. The count of skipped steps is in
// the manifest, and the optimizer file's "step" is AdamW's count (4 updates in 5 steps).
TEST(RunTraining, AStepWithoutTargetsStopsTheRunOrIsSkipped) {
  test::ScratchDir dir("run-guard");
  data::SequenceRows rows;
  for (int k = 0; k < 5 * 8; ++k)
    for (int t = 0; t <= 128; ++t) {
      rows.tokens.push_back(static_cast<uint32_t>("the quick brown fox jumps over the lazy dog. "[(k * 7 + t) % 45]));
      rows.mask.push_back(k / 8 == 2 ? 0 : 1);
    }
  data::SequenceHeader h;
  h.seq_len = 128;
  h.vocab_size = 256;
  h.packing = "pad";
  h.train_on = "answer";
  const fs::path data = dir / "sft.mtseq";
  ASSERT_TRUE(data::write_sequence_file(data, h, rows).ok());

  RunOptions skip = tiny_run(data.string(), 5);
  skip.checkpoint_dir = (dir / "A").string();
  skip.skip_nonfinite_steps = true;
  std::ostringstream skip_out;
  auto skipped = run_training(skip, skip_out);
  ASSERT_TRUE(skipped.ok()) << skipped.status().to_string();
  EXPECT_EQ(skipped->skipped_steps, 1);
  EXPECT_NE(skip_out.str().find("step     3/5  skipped: it has no counted targets (every target of its rows is masked); no update (1 "
                                "skipped in all)"),
            std::string::npos)
      << skip_out.str();
  EXPECT_NE(test::read_bytes(dir / "A" / "step-00000005" / "manifest.json").find("\"skipped_steps\": 1"), std::string::npos);
  auto opt = SafetensorsFile::open(dir / "A" / "step-00000005" / "optimizer.safetensors");
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  EXPECT_EQ(opt->metadata().at("step"), "4");

  RunOptions stop = tiny_run(data.string(), 5);
  stop.checkpoint_dir = (dir / "B").string();
  std::ostringstream stop_out;
  auto stopped = run_training(stop, stop_out);
  ASSERT_FALSE(stopped.ok());
  const std::string& m = stopped.status().message();
  EXPECT_NE(m.find("step 3/5: it has no counted targets"), std::string::npos) << m;
  EXPECT_NE(m.find("no update was applied and the run stops; the checkpoint of step 2 holds the 2 steps done; "
                   "--skip-nonfinite-steps skips such steps and goes on"),
            std::string::npos)
      << m;
  EXPECT_TRUE(fs::exists(dir / "B" / "step-00000002" / "manifest.json"));
  EXPECT_FALSE(fs::exists(dir / "B" / "step-00000003"));

  RunOptions resume = stop;
  resume.resume = true;
  resume.skip_nonfinite_steps = true;
  std::ostringstream resume_out;
  auto resumed = run_training(resume, resume_out);
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  EXPECT_EQ(resumed->skipped_steps, 1);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(test::read_bytes(dir / "A" / "step-00000005" / f) == test::read_bytes(dir / "B" / "step-00000005" / f)) << f;
}

}  // namespace
}  // namespace megatrain::exec

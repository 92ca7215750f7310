// MegaTrain's streamed training against an independent PyTorch implementation of the same model
// (tests/python/torch_train_ref.py, run with Debian's /usr/bin/python3): the same initial
// safetensors, the same sequential batches, torch.optim.AdamW for 10 steps; losses and final
// weights must agree within 1e-4 relative. Skips with a message when torch is missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "megatrain/core/plan.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/executor/weights_io.h"

namespace megatrain::exec {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

bool torch_available() {
  return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

void run_against_torch(const std::string& model_name, double clip) {
  if (!fs::exists("/usr/bin/python3") || !torch_available())
    GTEST_SKIP() << "PyTorch is not installed for /usr/bin/python3 (scripts/setup.sh installs python3-torch)";
  const fs::path dir = fs::temp_directory_path() / ("mt_torch_" + model_name + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  Json pj = {{"schema", "megatrain.plan/1"}, {"model", model_name}, {"rig", "cpu-dev-2core"},
             {"training", {{"seq_len", 32}, {"micro_batch", 2}, {"grad_accum", 2}, {"steps", 10}, {"lr", 2e-3},
                           {"warmup_steps", 2}, {"min_lr", 2e-4}, {"clip_grad_norm", clip}, {"data_order", "sequential"}}},
             {"precision", {{"compute", "fp32"}, {"transfer", "fp32"}}},
             {"schedule", {{"prefetch_depth", 2}, {"device_layer_buffers", 3}, {"checkpoint_every", 1},
                           {"checkpoint_location", "device"}}},
             {"optimizer", {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"threads", 1}}}};
  auto plan = Plan::from_json_text(pj.dump());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  auto model = plan->resolve_model();
  ASSERT_TRUE(model.ok());
  HostState hs = HostState::create(*model, DType::kFp32);
  EXPECT_TRUE(hs.init_random(11, 0.02).ok());
  ASSERT_TRUE(save_weights(hs, dir / "init.safetensors").ok());
  // Round trip through our own reader first: --init must reproduce the same state.
  HostState again = HostState::create(*model, DType::kFp32);
  ASSERT_TRUE(load_weights(again, dir / "init.safetensors").ok());
  for (size_t u = 0; u < hs.units().size(); ++u)
    for (int64_t i = 0; i < hs.units()[u].numel; ++i) ASSERT_EQ(hs.units()[u].master[i], again.units()[u].master[i]);

  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 2000; ++i) toks.push_back((i * 2654435761u >> 9) % 97 + (i % 7) * 20);
  {
    std::ofstream f(dir / "tokens.u32", std::ios::binary);
    f.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 4));
  }
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks));
  auto loader = DataLoader::create(file, 32, 2, 2, DataOrder::kSequential, 1, model->config().vocab_size);
  ASSERT_TRUE(loader.ok()) << loader.status().to_string();
  auto trainer = Trainer::create(*plan, *model, hs, *loader, TrainerOptions{});
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  Json ours = {{"losses", Json::array()}};
  for (int s = 0; s < 10; ++s) {
    auto r = (*trainer)->run_step(s);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ours["losses"].push_back(r->loss);
  }
  (*trainer)->wait_for_updates();
  ASSERT_TRUE(save_weights(hs, dir / "final.safetensors").ok());
  std::ofstream(dir / "ours.json") << ours.dump();
  Json spec = pj["training"];
  spec.update(pj["optimizer"]);
  std::ofstream(dir / "spec.json") << spec.dump();
  fs::copy_file(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / (model_name + ".json"), dir / "config.json",
                fs::copy_options::overwrite_existing);
  // tests/data may not exist in a fresh checkout, so the script's path is built, not resolved.
  const fs::path script = fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "python" / "torch_train_ref.py";
  const std::string cmd = "/usr/bin/python3 " + script.string() + " " +
                          (dir / "config.json").string() + " " + (dir / "init.safetensors").string() + " " +
                          (dir / "tokens.u32").string() + " " + (dir / "spec.json").string() + " " +
                          (dir / "ours.json").string() + " " + (dir / "final.safetensors").string() + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0) << out;
  std::printf("%s", out.c_str());
}

TEST(TorchReference, LlamaWithGqaTrainsLikePyTorch) { run_against_torch("tiny-llama-gqa", 0.0); }
TEST(TorchReference, Qwen2WithBiasesTiedHeadAndClippingTrainsLikePyTorch) { run_against_torch("tiny-qwen2", 0.5); }

}  // namespace
}  // namespace megatrain::exec

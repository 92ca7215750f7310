// step::footprint_keys against the footprint itself (issue 30): the planner memoises the device and
// host halves of a candidate's footprint on these keys instead of compiling it, so a plan field
// that the footprint reads but the keys leave out would give a candidate another one's figures.
// Every field of two plan files is changed in turn, to every value of the same kind that the plan
// rules accept; whenever a key is unchanged, its half of the footprint must be too.
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
using Json = nlohmann::json;
namespace fs = std::filesystem;

struct Figures {
  step::FootprintKeys keys;
  int64_t device = 0, pinned = 0, ram_without_arena = 0, nvme = 0;
};

// The figures of a plan as the planner's Sizer and the simulator get them; false when the plan
// rules or the model refuse it.
bool figures_of(const Json& j, Figures& out) {
  auto plan = Plan::from_json_text(j.dump(), "mutated plan");
  if (!plan.ok()) return false;
  auto model = plan->resolve_model();
  auto rig = plan->resolve_rig();
  if (!model.ok() || !rig.ok()) return false;
  const step::ActivationLayout layout = step::layout_for(step::backend_of_rig(*rig), *model, *plan);
  auto s = step::compile(*plan, *model, layout, {.ops = false});
  if (!s.ok()) return false;
  const step::Footprint f = step::footprint(*s, layout);
  out = {step::footprint_keys(*plan), f.peak.device, f.peak.pinned, f.peak.ram - f.ram_arena, f.peak.nvme};
  return true;
}

// Every leaf of a JSON document, with a function that sets it.
void leaves(Json& j, const std::string& path, std::vector<std::pair<std::string, Json*>>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) leaves(it.value(), path + "." + it.key(), out);
  } else if (!j.is_array()) {
    out.emplace_back(path, &j);
  }
}

// Values of the same kind to try in place of v.
std::vector<Json> alternatives(const Json& v) {
  static const std::vector<std::string> words = {"fp32", "bf16", "layer-major", "microbatch-major", "host", "device", "ram",
                                                 "nvme", "q8", "q4", "q3", "q2", "cosine", "constant", "linear", "shuffled",
                                                 "sequential", "adamw"};
  std::vector<Json> alt;
  if (v.is_string()) {
    for (const std::string& w : words)
      if (w != v.get<std::string>()) alt.emplace_back(w);
  } else if (v.is_boolean()) {
    alt.emplace_back(!v.get<bool>());
  } else if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    for (int64_t y : {int64_t{0}, x + 1, x * 2, x / 2, x * 4 + 4096})
      if (y != x) alt.emplace_back(y);
  } else if (v.is_number()) {
    const double x = v.get<double>();
    for (double y : {0.0, x * 2, x / 2, 0.5})
      if (y != x) alt.emplace_back(y);
  }
  return alt;
}

struct Tally {
  int device_compared = 0, host_compared = 0, keys_changed = 0;
};

void check_every_field(const Json& base, Tally& tally) {
  Figures b;
  ASSERT_TRUE(figures_of(base, b)) << base.dump();
  Json work = base;
  std::vector<std::pair<std::string, Json*>> paths;
  leaves(work, "", paths);
  for (auto& [path, leaf] : paths) {
    const Json original = *leaf;
    for (const Json& v : alternatives(original)) {
      *leaf = v;
      Figures m;
      if (!figures_of(work, m)) continue;
      SCOPED_TRACE(path + " = " + v.dump());
      if (m.keys.device == b.keys.device) {
        ++tally.device_compared;
        EXPECT_EQ(m.device, b.device) << "the device key missed a field the footprint reads";
      }
      if (m.keys.host == b.keys.host) {
        ++tally.host_compared;
        EXPECT_EQ(m.pinned, b.pinned) << "the host key missed a field the footprint reads";
        EXPECT_EQ(m.ram_without_arena, b.ram_without_arena) << "the host key missed a field the footprint reads";
        EXPECT_EQ(m.nvme, b.nvme) << "the host key missed a field the footprint reads";
      }
      if (m.keys.device != b.keys.device || m.keys.host != b.keys.host) ++tally.keys_changed;
    }
    *leaf = original;
  }
}

TEST(FootprintKeys, EqualKeysGiveEqualFiguresWhateverFieldChanges) {
  Tally tally;
  {
    SCOPED_TRACE("the demo's CPU plan");
    std::ifstream in(fs::path(MEGATRAIN_PROFILES_DIR) / "plans" / "tiny-cpu.json");
    check_every_field(Json::parse(in), tally);
  }
  {
    // A CUDA rig (bf16 compute: the CUDA backend's layout), host checkpoints, lent gradients
    // (no clipping, layer-major), quantised moments in blocks and master weights and states on
    // NVMe with staging.
    SCOPED_TRACE("a CUDA plan with its state on NVMe");
    const fs::path dir = fs::temp_directory_path() / "megatrain-footprint-key-test";
    fs::create_directories(dir);
    Json j = {{"schema", "megatrain.plan/1"},
              {"model", "tiny-qwen3-moe"},
              {"rig", "h100-sxm-80gb"},
              {"training", {{"seq_len", 64}, {"micro_batch", 2}, {"grad_accum", 3}, {"steps", 10}, {"seed", 1}, {"lr", 1e-3},
                            {"lr_schedule", "cosine"}, {"warmup_steps", 1}, {"min_lr", 0.0}, {"clip_grad_norm", 0.0},
                            {"data_order", "shuffled"}}},
              {"precision", {{"compute", "bf16"}, {"master", "fp32"}, {"transfer", "bf16"}}},
              {"schedule", {{"order", "layer-major"}, {"prefetch_depth", 2}, {"device_layer_buffers", 4},
                            {"checkpoint_every", 2}, {"checkpoint_location", "host"}}},
              {"placement", {{"master_weights", "nvme"}, {"optimizer_states", "nvme"}, {"nvme_dirs", {dir.string()}},
                             {"pinned_staging_bytes", 8 << 20}, {"device_budget_bytes", 0}, {"nvme_queue_depth", 16},
                             {"nvme_block_bytes", 1 << 20}}},
              {"optimizer", {{"type", "adamw"}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1},
                             {"m_format", "q8"}, {"v_format", "q4"}, {"block_size", 128}, {"threads", 4}}}};
    check_every_field(j, tally);
    fs::remove_all(dir);
  }
  // Not vacuous: many changes leave a key alone and are compared, and many change a key.
  EXPECT_GT(tally.device_compared, 40);
  EXPECT_GT(tally.host_compared, 40);
  EXPECT_GT(tally.keys_changed, 20);
  std::printf("compared %d device and %d host halves; %d changes changed a key\n", tally.device_compared, tally.host_compared,
              tally.keys_changed);
}

}  // namespace

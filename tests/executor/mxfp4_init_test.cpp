// --init from a gpt-oss checkpoint whose expert weights are stored in MXFP4 (the published
// openai/gpt-oss-* layout): load_weights (executor/src/weights_io.cpp, what megatrain-exec --init
// calls, run.cpp) dequantises mlp.experts.gate_up_proj_blocks/_scales and down_proj_blocks/_scales
// into the model's fp32 [E, H, 2I] and [E, I, H] tensors. The folder, single file and sharded, and
// the expected fp32 values come from tests/python/mxfp4_checkpoint.py (numpy, an independent
// dequantiser and a hand-written safetensors writer); the comparison is bit for bit. The error
// cases and hand values need no Python.
#include <gtest/gtest.h>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "file_test_util.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/safetensors.h"
#include "megatrain/executor/weights_io.h"

namespace megatrain::exec {
namespace {

namespace fs = std::filesystem;
using megatrain::test::ScratchDir;

ModelSpec tiny_gpt_oss() {
  std::ifstream in(std::string(MEGATRAIN_PROFILES_DIR) + "/models/tiny-gpt-oss.json");
  std::stringstream ss;
  ss << in.rdbuf();
  auto spec = ModelSpec::from_config_json(ss.str(), "tiny-gpt-oss.json");
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  return *spec;
}

bool numpy_available() {
  return std::system((std::string(megatrain::test::python()) + " -c 'import numpy' >/dev/null 2>&1").c_str()) == 0;
}

// ---- hand values ------------------------------------------------------------------------------

TEST(Mxfp4, HandValuesNibbleOrderScaleAndTranspose) {
  // One expert, model shape [A = 32, B = 2]: rows r = 0, 1 of the stored [B, A/32, 16] blocks.
  std::vector<uint8_t> blocks(2 * 16, 0), scales = {127, 130};
  blocks[0] = 0x71;   // row 0: element 0 = code 1 (0.5), element 1 = code 7 (6)
  blocks[1] = 0x9A;   // row 0: element 2 = code 0xA (-1), element 3 = code 9 (-0.5)
  blocks[15] = 0x8F;  // row 0: element 30 = code 0xF (-6), element 31 = code 8 (-0)
  blocks[16] = 0x52;  // row 1 (scale 2^3): element 0 = code 2 (1) * 8, element 1 = code 5 (3) * 8
  std::vector<float> out(32 * 2, 99.0f);
  ASSERT_TRUE(dequantize_mxfp4_expert(blocks.data(), scales.data(), 32, 2, out.data(), "test").ok());
  auto at = [&](int a, int r) { return out[static_cast<size_t>(a * 2 + r)]; };  // out [A, B]
  EXPECT_EQ(at(0, 0), 0.5f);
  EXPECT_EQ(at(1, 0), 6.0f);
  EXPECT_EQ(at(2, 0), -1.0f);
  EXPECT_EQ(at(3, 0), -0.5f);
  EXPECT_EQ(at(30, 0), -6.0f);
  EXPECT_EQ(at(31, 0), 0.0f);
  EXPECT_TRUE(std::signbit(at(31, 0)));
  EXPECT_FALSE(std::signbit(at(4, 0)));  // byte 0x00: +0
  EXPECT_EQ(at(0, 1), 8.0f);
  EXPECT_EQ(at(1, 1), 24.0f);
  EXPECT_EQ(at(2, 1), 0.0f);
}

TEST(Mxfp4, ExtremeScales) {
  std::vector<uint8_t> blocks(16, 0), scales = {0};
  blocks[0] = 0x51;  // 0.5 and 3 times 2^-127: 2^-128 and 3 * 2^-127, fp32 subnormals, exact
  std::vector<float> out(32);
  ASSERT_TRUE(dequantize_mxfp4_expert(blocks.data(), scales.data(), 32, 1, out.data(), "t").ok());
  EXPECT_EQ(out[0], std::ldexp(1.0f, -128));
  EXPECT_EQ(out[1], std::ldexp(3.0f, -127));
  scales[0] = 254;
  blocks[0] = 0x33;  // 1.5 * 2^127 is finite
  ASSERT_TRUE(dequantize_mxfp4_expert(blocks.data(), scales.data(), 32, 1, out.data(), "t").ok());
  EXPECT_EQ(out[0], std::ldexp(1.5f, 127));
  blocks[0] = 0x04;  // 2 * 2^127 overflows fp32
  Status s = dequantize_mxfp4_expert(blocks.data(), scales.data(), 32, 1, out.data(), "tensor X, expert 0");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overflows"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tensor X, expert 0"), std::string::npos) << s.message();
  scales[0] = 255;
  blocks[0] = 0;
  s = dequantize_mxfp4_expert(blocks.data(), scales.data(), 32, 1, out.data(), "t");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("255"), std::string::npos) << s.message();
}

TEST(Mxfp4, ShapesOfTheStoredTensors) {
  // gpt-oss-20b: gate_up_proj [32, 2880, 5760] is stored as [32, 5760, 90, 16] and [32, 5760, 90].
  auto s = mxfp4_shapes("gate_up_proj", {32, 2880, 5760});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->blocks, (std::vector<int64_t>{32, 5760, 90, 16}));
  EXPECT_EQ(s->scales, (std::vector<int64_t>{32, 5760, 90}));
  EXPECT_FALSE(mxfp4_shapes("x", {32, 40, 64}).ok());  // 40 is not a multiple of 32
  EXPECT_FALSE(mxfp4_shapes("x", {64, 64}).ok());
}

// ---- errors through HfCheckpoint / load_weights ----------------------------------------------------

struct Written {
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<TensorToWrite> tensors;
  void add(const std::string& name, std::vector<int64_t> shape, const std::string& dtype, uint8_t fill = 0x21) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bufs.emplace_back(static_cast<size_t>(n * static_cast<int64_t>(*safetensors_element_bytes(dtype))), fill);
    tensors.push_back(raw_tensor(name, std::move(shape), bufs.back().data(), dtype));
  }
};

Status load_from(const fs::path& file, const std::vector<int64_t>& shape) {
  auto ck = HfCheckpoint::open(file);
  if (!ck.ok()) return ck.status();
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  return ck->load_mxfp4_fp32("w", shape, out.data());
}

TEST(Mxfp4, ErrorsNameTheTensorAndBothShapes) {
  ScratchDir dir("mxfp4-errors");
  const std::vector<int64_t> model_shape = {2, 64, 48};  // blocks [2, 48, 2, 16], scales [2, 48, 2]
  {
    Written w;
    w.bufs.reserve(4);
    w.add("w_blocks", {2, 48, 2, 16}, "U8");
    w.add("w_scales", {2, 48, 2}, "U8", 127);
    ASSERT_TRUE(write_safetensors(dir / "ok.safetensors", w.tensors).ok());
    EXPECT_TRUE(load_from(dir / "ok.safetensors", model_shape).ok());
    // 0x21: codes 1 and 2 at scale 2^0
    auto ck = HfCheckpoint::open(dir / "ok.safetensors");
    std::vector<float> out(2 * 64 * 48);
    ASSERT_TRUE(ck->load_mxfp4_fp32("w", model_shape, out.data()).ok());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], (i / 48) % 2 == 0 ? 0.5f : 1.0f) << i;
  }
  {  // blocks of another model
    Written w;
    w.bufs.reserve(4);
    w.add("w_blocks", {2, 48, 3, 16}, "U8");
    w.add("w_scales", {2, 48, 2}, "U8", 127);
    ASSERT_TRUE(write_safetensors(dir / "shape.safetensors", w.tensors).ok());
    const Status s = load_from(dir / "shape.safetensors", model_shape);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    for (const char* part : {"w_blocks", "[2, 48, 3, 16]", "[2, 48, 2, 16]", "[2, 64, 48]"})
      EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s.message();
  }
  {  // scales missing
    Written w;
    w.bufs.reserve(4);
    w.add("w_blocks", {2, 48, 2, 16}, "U8");
    ASSERT_TRUE(write_safetensors(dir / "noscales.safetensors", w.tensors).ok());
    const Status s = load_from(dir / "noscales.safetensors", model_shape);
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(s.message().find("w_scales"), std::string::npos) << s.message();
  }
  {  // scales stored as another dtype
    Written w;
    w.bufs.reserve(4);
    w.add("w_blocks", {2, 48, 2, 16}, "U8");
    w.add("w_scales", {2, 48, 2}, "I8");
    ASSERT_TRUE(write_safetensors(dir / "dtype.safetensors", w.tensors).ok());
    const Status s = load_from(dir / "dtype.safetensors", model_shape);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("I8"), std::string::npos) << s.message();
  }
  {  // a scale of 255 in expert 1
    Written w;
    w.bufs.reserve(4);
    w.add("w_blocks", {2, 48, 2, 16}, "U8");
    w.add("w_scales", {2, 48, 2}, "U8", 127);
    w.bufs[1][48 * 2 + 5] = 255;
    ASSERT_TRUE(write_safetensors(dir / "nan.safetensors", w.tensors).ok());
    const Status s = load_from(dir / "nan.safetensors", model_shape);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("expert 1"), std::string::npos) << s.message();
  }
}

TEST(Mxfp4Init, RefusedForATensorHfNeverQuantises) {
  // The embedding stored as _blocks/_scales: not an expert tensor, refused by name.
  ScratchDir dir("mxfp4-role");
  const ModelSpec spec = tiny_gpt_oss();
  HostState state = HostState::create(spec, DType::kFp32);
  const TensorSlot& emb = state.units()[0].tensors[0];
  Written w;
  w.bufs.reserve(4);
  w.add(emb.name + "_blocks", {1, 16}, "U8");
  w.add(emb.name + "_scales", {1}, "U8");
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", w.tensors).ok());
  const Status s = load_weights(state, dir.path());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(emb.name), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("MXFP4"), std::string::npos) << s.message();
}

TEST(Mxfp4Init, PublishedConfigWithQuantizationConfigParses) {
  // The Hub's config.json of gpt-oss carries quantization_config (quant_method mxfp4); it describes
  // the storage of the weights, which --init dequantises, not the model's math.
  std::ifstream in(std::string(MEGATRAIN_PROFILES_DIR) + "/models/gpt-oss-20b.json");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json c = nlohmann::json::parse(ss.str());
  c["quantization_config"] = {{"modules_to_not_convert", {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                          "model.embed_tokens", "lm_head"}},
                              {"quant_method", "mxfp4"}};
  auto spec = ModelSpec::from_config_json(c.dump(), "gpt-oss-20b config.json");
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_EQ(spec->config().num_experts, 32);
}

// ---- a whole tiny gpt-oss folder, against the independent Python dequantiser -------------------------

TEST(Mxfp4Init, TinyGptOssFolderSingleAndShardedBitExact) {
  if (!megatrain::test::have_python3() || !numpy_available())
    FAIL() << "numpy is missing for " << megatrain::test::python() << " (run scripts/python-env.sh: requirements.txt)";
  const ModelSpec spec = tiny_gpt_oss();
  ScratchDir dir("mxfp4-init");
  HostState layout = HostState::create(spec, DType::kFp32);
  nlohmann::json manifest = nlohmann::json::array();
  int64_t expert_tensors = 0;
  for (const UnitState& us : layout.units())
    for (const TensorSlot& t : us.tensors) {
      const bool q = t.role == TensorRole::kExpertGateUp || t.role == TensorRole::kExpertDown;
      expert_tensors += q;
      manifest.push_back({{"name", t.name}, {"shape", t.shape}, {"mxfp4", q}});
    }
  ASSERT_EQ(expert_tensors, 2 * spec.config().num_layers) << "tiny-gpt-oss should have gate_up and down per layer";
  megatrain::test::write_bytes(dir / "manifest.json", manifest.dump());
  const fs::path script = fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "python" / "mxfp4_checkpoint.py";
  ASSERT_TRUE(fs::exists(script)) << script;

  for (int shards : {1, 3}) {
    SCOPED_TRACE("shards " + std::to_string(shards));
    const fs::path folder = dir / ("ckpt-" + std::to_string(shards));
    const fs::path expected = dir / ("expected-" + std::to_string(shards) + ".safetensors");
    const std::string cmd = std::string(megatrain::test::python()) + " '" + script.string() + "' '" + (dir / "manifest.json").string() + "' '" +
                            folder.string() + "' " + std::to_string(shards) + " '" + expected.string() + "' 2>&1";
    FILE* pipe = ::popen(cmd.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string output;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, n);
    ASSERT_EQ(::pclose(pipe), 0) << output;
    const nlohmann::json stats = nlohmann::json::parse(output);
    // The data covers what matters: signed zeros, subnormals, both ends of the scale range.
    EXPECT_GT(stats["negative_zero"].get<int64_t>(), 0) << output;
    EXPECT_GT(stats["subnormal"].get<int64_t>(), 0) << output;
    EXPECT_GT(stats["scale_254"].get<int64_t>(), 0) << output;
    EXPECT_GT(stats["scale_0"].get<int64_t>(), 0) << output;
    if (shards > 1) {
      ASSERT_TRUE(fs::exists(folder / "model.safetensors.index.json"));
      ASSERT_FALSE(fs::exists(folder / "model.safetensors"));
    }
    auto ck = HfCheckpoint::open(folder);
    ASSERT_TRUE(ck.ok()) << ck.status().to_string();
    EXPECT_EQ(ck->files().size(), static_cast<size_t>(shards));
    for (const auto& m : manifest)
      if (m["mxfp4"].get<bool>()) {
        EXPECT_FALSE(ck->contains(m["name"].get<std::string>()));
        EXPECT_TRUE(ck->has_mxfp4(m["name"].get<std::string>()));
      }

    HostState state = HostState::create(spec, DType::kFp32);
    const Status s = load_weights(state, folder);
    ASSERT_TRUE(s.ok()) << s.to_string();
    auto want = SafetensorsFile::open(expected);
    ASSERT_TRUE(want.ok()) << want.status().to_string();
    int64_t compared = 0, mismatched = 0;
    for (const UnitState& us : state.units())
      for (const TensorSlot& t : us.tensors) {
        const SafetensorsEntry* e = want->find(t.name);
        ASSERT_NE(e, nullptr) << t.name;
        ASSERT_EQ(e->shape, t.shape) << t.name;
        std::vector<float> ref(static_cast<size_t>(e->numel));
        ASSERT_TRUE(want->read_fp32(*e, ref.data(), e->numel).ok());
        const float* got = us.master.data() + t.offset;
        for (int64_t i = 0; i < t.numel; ++i) {
          const bool same = std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(ref[static_cast<size_t>(i)]);
          if (!same && mismatched++ < 5)
            ADD_FAILURE() << t.name << "[" << i << "]: loaded " << got[i] << ", expected " << ref[static_cast<size_t>(i)];
        }
        compared += t.numel;
      }
    EXPECT_EQ(mismatched, 0);
    EXPECT_GT(compared, 0);
  }
}

}  // namespace
}  // namespace megatrain::exec

// --init from block-scaled FP8 weights, DeepSeek-V3's and Kimi-K2's published layout (issue 47):
// F8_E4M3 matrices with F32 weight_scale_inv per 128 x 128 block. The e4m3 decoding is checked
// against PyTorch's float8_e4m3fn for all 256 codes (and by hand for a few); the block indexing
// (partial blocks at the bottom and right edges), the errors, and load_weights on a whole tiny
// model's checkpoint are checked against values computed here from the stored bytes; and the
// multi-token-prediction layers such checkpoints carry are skipped by name.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <random>
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

TEST(Fp8, E4m3ByHand) {
  EXPECT_EQ(fp8_e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_float(0x80)));
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);      // exponent 7 = bias
  EXPECT_EQ(fp8_e4m3_to_float(0xB8), -1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);    // the largest: 1.75 * 2^8
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_float(0x07), std::ldexp(7.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_float(0x3C), 1.5f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xFF)));
  EXPECT_EQ(fp8_e4m3_to_float(0x78), 256.0f);    // exponent 15 is a normal exponent in E4M3FN
}

TEST(Fp8, E4m3EqualsPyTorchForEveryCode) {
  ScratchDir dir("fp8-table");
  const fs::path out = dir / "table.txt";
  const std::string cmd = std::string(megatrain::test::python()) +
                          " -c \"import torch; v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(); "
                          "print('\\n'.join(str(x) for x in v.view(torch.int32).tolist()))\" > " + out.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "PyTorch is the reference (scripts/python-env.sh installs it): " << cmd;
  std::ifstream in(out);
  for (int b = 0; b < 256; ++b) {
    int64_t bits = 0;
    ASSERT_TRUE(in >> bits) << "code " << b;
    const float ref = std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(bits)));
    const float ours = fp8_e4m3_to_float(static_cast<uint8_t>(b));
    if (std::isnan(ref)) EXPECT_TRUE(std::isnan(ours)) << "code " << b;
    else EXPECT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(ref)) << "code " << b << ": " << ours << " vs " << ref;
  }
}

// A matrix of random non-NaN codes and its scales, as a checkpoint stores them.
struct Fp8Matrix {
  int64_t rows, cols;
  std::vector<uint8_t> q;
  std::vector<float> scale;
  Fp8Matrix(int64_t r, int64_t c, uint64_t seed) : rows(r), cols(c), q(static_cast<size_t>(r * c)) {
    std::mt19937_64 rng(seed);
    for (uint8_t& b : q) {
      b = static_cast<uint8_t>(rng());
      if ((b & 0x7F) == 0x7F) b ^= 0x01;
    }
    const int64_t br = (r + kFp8Block - 1) / kFp8Block, bc = (c + kFp8Block - 1) / kFp8Block;
    std::uniform_real_distribution<float> u(1.0f / 1024, 1.0f / 64);
    for (int64_t i = 0; i < br * bc; ++i) scale.push_back(u(rng));
  }
  // The value at [i, j], from the bytes: the block is found here by hand.
  float at(int64_t i, int64_t j) const {
    const int64_t bc = (cols + kFp8Block - 1) / kFp8Block;
    return fp8_e4m3_to_float(q[static_cast<size_t>(i * cols + j)]) * scale[static_cast<size_t>((i / 128) * bc + j / 128)];
  }
  void add_to(std::vector<TensorToWrite>& t, const std::string& name) const {
    t.push_back(raw_tensor(name, {rows, cols}, q.data(), "F8_E4M3"));
    t.push_back(raw_tensor(fp8_scale_name(name), {(rows + 127) / 128, (cols + 127) / 128}, scale.data(), "F32"));
  }
};

TEST(Fp8, BlockScaledMatrixWithPartialBlocks) {
  ScratchDir dir("fp8-matrix");
  const Fp8Matrix m(300, 130, 7);  // blocks of 128, 128 and 44 rows; 128 and 2 columns
  std::vector<TensorToWrite> t;
  m.add_to(t, "w.weight");
  ASSERT_TRUE(write_safetensors(dir / "m.safetensors", t).ok());
  auto ck = HfCheckpoint::open(dir / "m.safetensors");
  ASSERT_TRUE(ck.ok()) << ck.status().to_string();
  ASSERT_TRUE(ck->has_fp8_blocks("w.weight"));
  std::vector<float> out(300 * 130, -1.0f);
  ASSERT_TRUE(ck->load_fp8_blocks_fp32("w.weight", {300, 130}, out.data()).ok());
  for (int64_t i = 0; i < 300; ++i)
    for (int64_t j = 0; j < 130; ++j)
      ASSERT_EQ(out[static_cast<size_t>(i * 130 + j)], m.at(i, j)) << "[" << i << ", " << j << "]";
  // Another model's shape, and a scale table of the wrong size, are refused naming both.
  Status s = ck->load_fp8_blocks_fp32("w.weight", {130, 300}, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[300, 130]"), std::string::npos) << s.message();
  std::vector<float> few(2);
  std::vector<TensorToWrite> bad = {raw_tensor("w.weight", {300, 130}, m.q.data(), "F8_E4M3"),
                                    raw_tensor("w.weight_scale_inv", {2, 1}, few.data(), "F32")};
  ASSERT_TRUE(write_safetensors(dir / "bad.safetensors", bad).ok());
  auto bk = HfCheckpoint::open(dir / "bad.safetensors");
  s = bk->load_fp8_blocks_fp32("w.weight", {300, 130}, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("F32 [3, 2]"), std::string::npos) << s.message();
  // A NaN code is refused naming the element.
  Fp8Matrix nan = m;
  nan.q[static_cast<size_t>(129 * 130 + 3)] = 0xFF;
  std::vector<TensorToWrite> nt;
  nan.add_to(nt, "w.weight");
  ASSERT_TRUE(write_safetensors(dir / "nan.safetensors", nt).ok());
  s = HfCheckpoint::open(dir / "nan.safetensors")->load_fp8_blocks_fp32("w.weight", {300, 130}, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("element [129, 3] is FP8's NaN (0xFF)"), std::string::npos) << s.message();
  // Without its scales an F8 tensor is not block-scaled.
  std::vector<TensorToWrite> alone = {raw_tensor("w.weight", {300, 130}, m.q.data(), "F8_E4M3")};
  ASSERT_TRUE(write_safetensors(dir / "alone.safetensors", alone).ok());
  auto ak = HfCheckpoint::open(dir / "alone.safetensors");
  EXPECT_FALSE(ak->has_fp8_blocks("w.weight"));
  s = ak->load_fp8_blocks_fp32("w.weight", {300, 130}, out.data());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("w.weight_scale_inv"), std::string::npos) << s.message();
}

// load_weights (megatrain-exec --init) on a checkpoint of tiny-llama-gqa whose matrices are all
// block-scaled FP8 and whose norms are F32, as DeepSeek-V3's are.
TEST(Fp8, LoadWeightsDequantisesEveryMatrixOfAModel) {
  auto spec = ModelSpec::load("tiny-llama-gqa");
  ASSERT_TRUE(spec.ok());
  HostState hs = HostState::create(*spec, DType::kFp32);
  std::vector<Fp8Matrix> mats;
  std::vector<std::vector<float>> plain;
  std::vector<const TensorSlot*> slots;
  for (const UnitState& us : hs.units())
    for (const TensorSlot& t : us.tensors) slots.push_back(&t);
  mats.reserve(slots.size());
  plain.reserve(slots.size());
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < slots.size(); ++i) {
    const TensorSlot& t = *slots[i];
    if (t.shape.size() == 2) {
      mats.emplace_back(t.shape[0], t.shape[1], 100 + i);
      mats.back().add_to(tensors, t.name);
    } else {
      plain.emplace_back(static_cast<size_t>(t.numel), 1.0f + 0.001f * static_cast<float>(i));
      tensors.push_back(raw_tensor(t.name, t.shape, plain.back().data(), "F32"));
    }
  }
  ScratchDir dir("fp8-model");
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors).ok());
  ASSERT_TRUE(load_weights(hs, dir.path()).ok());
  size_t m = 0, p = 0;
  int checked = 0;
  for (const UnitState& us : hs.units())
    for (const TensorSlot& t : us.tensors) {
      const float* w = us.master.data() + t.offset;
      if (t.shape.size() == 2) {
        const Fp8Matrix& fm = mats[m++];
        for (int64_t i = 0; i < t.shape[0]; ++i)
          for (int64_t j = 0; j < t.shape[1]; ++j) ASSERT_EQ(w[i * t.shape[1] + j], fm.at(i, j)) << t.name;
        ++checked;
      } else {
        for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(w[i], plain[p][static_cast<size_t>(i)]) << t.name;
        ++p;
      }
    }
  EXPECT_GE(checked, 9);  // embedding, 7 matrices a layer, head
}

// The multi-token-prediction layer a DeepSeek-V3 or GLM-4.5 checkpoint carries after its decoder
// layers (num_nextn_predict_layers) is skipped by name; without the key, or beyond it, a layer the
// model does not have is still refused.
TEST(Fp8, TheMtpLayersACheckpointCarriesAreSkippedByName) {
  std::ifstream in(std::string(MEGATRAIN_PROFILES_DIR) + "/models/tiny-llama-gqa.json");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json cfg = nlohmann::json::parse(ss.str());
  cfg["num_nextn_predict_layers"] = 1;
  auto spec = ModelSpec::from_config_json(cfg.dump(), "tiny-llama-gqa with an MTP layer");
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  const int64_t L = spec->config().num_layers;
  ASSERT_EQ(spec->config().mtp_layers, 1);
  HostState hs = HostState::create(*spec, DType::kFp32);
  std::vector<std::vector<float>> data;
  std::vector<TensorToWrite> tensors;
  for (const UnitState& us : hs.units())
    for (const TensorSlot& t : us.tensors) {
      data.emplace_back(static_cast<size_t>(t.numel), 0.5f);
      tensors.push_back(raw_tensor(t.name, t.shape, data.back().data(), "F32"));
    }
  std::vector<float> mtp(64, 1.0f);
  const std::string mtp_name = "model.layers." + std::to_string(L) + ".eh_proj.weight";
  tensors.push_back(raw_tensor(mtp_name, {8, 8}, mtp.data(), "F32"));
  ScratchDir dir("mtp");
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors).ok());
  EXPECT_TRUE(load_weights(hs, dir.path(), spec->config().mtp_layers).ok());
  const Status without = load_weights(hs, dir.path(), 0);
  EXPECT_EQ(without.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(without.message().find(mtp_name), std::string::npos) << without.message();
  tensors.back() = raw_tensor("model.layers." + std::to_string(L + 1) + ".eh_proj.weight", {8, 8}, mtp.data(), "F32");
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", tensors).ok());
  EXPECT_EQ(load_weights(hs, dir.path(), 1).code(), StatusCode::kInvalidArgument);  // layer L + 1 is not an MTP layer
  cfg["num_nextn_predict_layers"] = 65;
  EXPECT_FALSE(ModelSpec::from_config_json(cfg.dump(), "x").ok());
}

}  // namespace
}  // namespace megatrain::exec

// ModelSpec against published parameter counts, hand-computed shapes and FLOPs, Megatron's closed
// form, and every kind of bad config.json.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/profiles.h"

namespace megatrain {
namespace {

using Json = nlohmann::ordered_json;

ModelSpec load_or_die(const std::string& name) {
  auto s = ModelSpec::load(name);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return std::move(s).value();
}

// Published totals (model cards / HF safetensors metadata).
struct Published {
  const char* name;
  int64_t total;
};
class PublishedCount : public ::testing::TestWithParam<Published> {};

TEST_P(PublishedCount, EqualsPublishedExactly) {
  const ModelSpec s = load_or_die(GetParam().name);
  const ParameterCounts pc = s.parameter_counts();
  EXPECT_EQ(pc.total, GetParam().total) << GetParam().name;
  // The parts add up, and the tensor list agrees with the breakdown.
  EXPECT_EQ(pc.embedding + pc.layers + pc.final_norm + pc.head, pc.total);
  EXPECT_EQ(pc.per_layer * s.config().num_layers, pc.layers);
  int64_t sum = 0;
  for (const auto& t : s.tensors()) sum += t.numel;
  EXPECT_EQ(sum, pc.total);
}

INSTANTIATE_TEST_SUITE_P(Models, PublishedCount,
                         ::testing::Values(Published{"llama-2-7b", 6738415616}, Published{"llama-2-70b", 68976648192},
                                           Published{"llama-3-8b", 8030261248}, Published{"llama-3-70b", 70553706496},
                                           Published{"mistral-7b", 7241732096}, Published{"qwen2.5-7b", 7615616512},
                                           Published{"qwen2.5-72b", 72706203648},
                                           Published{"tinyllama-1.1b", 1100048384}),
                         [](const auto& param_info) {
                           std::string n = param_info.param.name;
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(ModelSpec, MistralLarge2IsA123BClassModel) {
  const ModelSpec s = load_or_die("mistral-large-2");
  // Hand count: 2 x 32768 x 12288 embeddings + 88 x 1,384,144,896 per layer + 12288 final norm.
  EXPECT_EQ(s.parameter_counts().per_layer, 1384144896);
  EXPECT_EQ(s.parameter_counts().total, 122610069504);
  EXPECT_EQ(s.config().head_dim, 128);
}

TEST(ModelSpec, EveryProfileLoads) {
  const auto names = list_profiles("models");
  ASSERT_GE(names.size(), 10u);
  for (const auto& n : names) {
    auto s = ModelSpec::load(n);
    EXPECT_TRUE(s.ok()) << n << ": " << s.status().to_string();
    if (s.ok()) {
      EXPECT_EQ(s->name(), n);
    }
  }
}

TEST(ModelSpec, Qwen2TensorsCarryQkvBiasButNotOBias) {
  const ModelSpec s = load_or_die("qwen2.5-7b");
  const auto layer = s.layer_tensors(5);
  std::vector<std::string> names;
  for (const auto& t : layer) names.push_back(t.name);
  const std::vector<std::string> expected = {
      "model.layers.5.self_attn.q_proj.weight", "model.layers.5.self_attn.q_proj.bias",
      "model.layers.5.self_attn.k_proj.weight", "model.layers.5.self_attn.k_proj.bias",
      "model.layers.5.self_attn.v_proj.weight", "model.layers.5.self_attn.v_proj.bias",
      "model.layers.5.self_attn.o_proj.weight", "model.layers.5.mlp.gate_proj.weight",
      "model.layers.5.mlp.up_proj.weight",      "model.layers.5.mlp.down_proj.weight",
      "model.layers.5.input_layernorm.weight",  "model.layers.5.post_attention_layernorm.weight"};
  EXPECT_EQ(names, expected);
  EXPECT_EQ(layer[2].shape, (std::vector<int64_t>{512, 3584}));  // 4 KV heads x 128
  EXPECT_EQ(layer[3].shape, (std::vector<int64_t>{512}));
  EXPECT_EQ(layer[6].shape, (std::vector<int64_t>{3584, 3584}));
  EXPECT_EQ(layer[9].shape, (std::vector<int64_t>{3584, 18944}));
}

TEST(ModelSpec, TinyModelsListEveryTensor) {
  const ModelSpec llama = load_or_die("tiny-llama-gqa");
  // embed + 2 x 9 + norm + head
  ASSERT_EQ(llama.tensors().size(), 1u + 2 * 9 + 1 + 1);
  EXPECT_EQ(llama.tensors().front().name, "model.embed_tokens.weight");
  EXPECT_EQ(llama.tensors().back().name, "lm_head.weight");
  EXPECT_EQ(llama.tensors().back().shape, (std::vector<int64_t>{256, 64}));
  // Hand count: 256*64 emb; per layer q 64*64 + k,v 32*64 each + o 64*64 + 3*64*160 + 2*64; norm; head.
  EXPECT_EQ(llama.parameter_counts().per_layer, 4096 + 2048 + 2048 + 4096 + 3 * 64 * 160 + 128);
  EXPECT_EQ(llama.parameter_counts().total, 16384 + 2 * 43136 + 64 + 16384);

  const ModelSpec qwen = load_or_die("tiny-qwen2");
  EXPECT_TRUE(qwen.config().tie_word_embeddings);
  EXPECT_EQ(qwen.tensors().back().name, "model.norm.weight");  // tied: no lm_head tensor
  EXPECT_EQ(qwen.parameter_counts().head, 0);
  // per layer: q 4096+64, k 2048+32, v 2048+32, o 4096, mlp 3*64*128, norms 128
  EXPECT_EQ(qwen.parameter_counts().per_layer, 4160 + 2080 + 2080 + 4096 + 24576 + 128);
}

TEST(ModelSpec, FlopsHandComputedForLlama2_7B) {
  const ModelSpec s = load_or_die("llama-2-7b");
  const FlopsPerToken f = s.flops_per_token(4096);
  const double H = 4096, I = 11008, L = 32, V = 32000, seq = 4096;
  const double layer = 2 * 4 * H * H + 2 * 3 * H * I + 4 * seq * H;
  EXPECT_DOUBLE_EQ(f.layer_forward, layer);
  EXPECT_DOUBLE_EQ(f.forward, L * layer + 2 * H * V);
  EXPECT_DOUBLE_EQ(f.backward, 2 * f.forward);
  EXPECT_DOUBLE_EQ(f.recompute, L * layer);
  EXPECT_DOUBLE_EQ(f.training(), 3 * (L * layer + 2 * H * V));
  // 6 x (matmul weights) + the attention term: the familiar "6N" form.
  const double matmul_weights = L * (4 * H * H + 3 * H * I) + V * H;
  EXPECT_DOUBLE_EQ(f.training(), 6 * matmul_weights + 12 * L * seq * H);
}

TEST(ModelSpec, FlopsReduceToMegatronClosedFormForGptShapedLayers) {
  // With full multi-head attention and 3 I = 8 H (the FLOPs of a 4H two-matrix MLP), the
  // generalised count must equal Megatron's 72 L H^2 (1 + s/6H + V/12HL) per token, and with full
  // recompute 96 L H^2 (1 + s/6H + V/16HL) (Narayanan et al., 2021).
  Json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 96}, {"intermediate_size", 256},
              {"num_hidden_layers", 5}, {"num_attention_heads", 6}, {"vocab_size", 1000},
              {"max_position_embeddings", 512}};
  auto s = ModelSpec::from_config_json(cfg.dump());
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const double H = 96, L = 5, V = 1000, seq = 512;
  const FlopsPerToken f = s->flops_per_token(512);
  EXPECT_DOUBLE_EQ(f.training(), 72 * L * H * H * (1 + seq / (6 * H) + V / (12 * H * L)));
  EXPECT_DOUBLE_EQ(f.training_with_recompute(), 96 * L * H * H * (1 + seq / (6 * H) + V / (16 * H * L)));
}

TEST(ModelSpec, StateBytesPerSetup) {
  const ModelSpec s = load_or_die("llama-2-7b");
  const double n = 6738415616.0;
  const StateBytes fp32 = s.training_state_bytes(PrecisionSetup::fp32());
  EXPECT_DOUBLE_EQ(fp32.total(), 16 * n);
  EXPECT_DOUBLE_EQ(fp32.streaming_copy, 0);
  const StateBytes mixed = s.training_state_bytes(PrecisionSetup::mixed());
  EXPECT_DOUBLE_EQ(mixed.master, 4 * n);
  EXPECT_DOUBLE_EQ(mixed.gradients, 2 * n);
  EXPECT_DOUBLE_EQ(mixed.streaming_copy, 2 * n);
  EXPECT_DOUBLE_EQ(mixed.total(), 16 * n);
  PrecisionSetup q8 = PrecisionSetup::mixed();
  q8.m_format = StateFormat::kQ8;
  q8.v_format = StateFormat::kQ4;
  q8.block_size = 128;
  const StateBytes q = s.training_state_bytes(q8);
  EXPECT_DOUBLE_EQ(q.m, n * (1 + 4.0 / 128));
  EXPECT_DOUBLE_EQ(q.v, n * (0.5 + 4.0 / 128));
}

TEST(ModelSpec, ActivationBytesHandComputed) {
  const ModelSpec s = load_or_die("tiny-llama-gqa");  // H 64, I 160, 4 heads x 16, 2 KV heads
  const ActivationBytes a = s.activation_bytes_per_token_per_layer(128, 2);
  EXPECT_DOUBLE_EQ(a.checkpoint, 2 * 64);
  const double common = 2 * (4 * 64 + 64 + 2 * 32 + 64 + 3 * 160) + 8;
  EXPECT_DOUBLE_EQ(a.full_flash, common + 4 * 4);
  EXPECT_DOUBLE_EQ(a.full_eager, common + 2 * 4 * 128);
  // Qwen3-MoE (tiny-qwen3-moe: H 64, 4 heads x 16, 2 KV heads, 8 experts of 32, top 2, q and k
  // normalised per head; layer 1 dense with I 96): the MoE layer keeps more than the dense one,
  // its router logits and probabilities (2 E), the k slots' inputs and outputs (2 k H) and their
  // gate, up and product (3 k I), and q and k before their norms.
  const ActivationBytes m = load_or_die("tiny-qwen3-moe").activation_bytes_per_token_per_layer(128, 2);
  const double moe = 2 * (4 * 64 + 64 + 2 * 32 + 64 + (64 + 32) + (2 * 8 + 2 * 2 * 64 + 3 * 2 * 32)) + 8;
  EXPECT_DOUBLE_EQ(m.full_flash, moe + 4 * 4);
}

// ---- bad configs ---------------------------------------------------------------------------

Json base_config() {
  return Json{{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", 64},
              {"intermediate_size", 128}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2}, {"vocab_size", 256}, {"max_position_embeddings", 128}};
}

Status error_of(const Json& cfg) {
  auto s = ModelSpec::from_config_json(cfg.dump(), "cfg");
  return s.ok() ? Status() : s.status();
}

// transformers 5 writes rope_parameters (theta, type and scaling in one object): read as the
// published rope_theta and rope_scaling; both forms given must agree.
TEST(ModelSpecTransformers5, RopeParametersAreReadAsRopeThetaAndRopeScaling) {
  Json c = base_config();
  c["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "default"}};
  auto m = ModelSpec::from_config_json(c.dump(), "cfg");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->config().rope_theta, 500000.0);
  EXPECT_TRUE(m->config().rope_scaling_type.empty());
  c["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  m = ModelSpec::from_config_json(c.dump(), "cfg");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->config().rope_scaling_type, "llama3");
  EXPECT_EQ(m->config().rope_scaling_factor, 8.0);
  EXPECT_EQ(m->config().rope_original_max_position, 64.0);
  c["rope_theta"] = 10000.0;
  Status s = error_of(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("contradicts rope_parameters.rope_theta"), std::string::npos) << s.message();
  c.erase("rope_theta");
  c["rope_parameters"] = "yarn";
  EXPECT_NE(error_of(c).message().find("rope_parameters: expected an object"), std::string::npos);
}

TEST(ModelSpecErrors, UnsupportedArchitectureNamesTheField) {
  Json c = base_config();
  c["architectures"] = {"GPT2LMHeadModel"};
  Status s = error_of(c);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("architectures"), std::string::npos);
  EXPECT_NE(s.message().find("GPT2LMHeadModel"), std::string::npos);
  EXPECT_NE(s.message().find("Qwen2ForCausalLM"), std::string::npos);  // says what is supported
}

TEST(ModelSpecErrors, MissingFieldIsNamed) {
  for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                          "architectures"}) {
    Json c = base_config();
    c.erase(key);
    Status s = error_of(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << key;
    EXPECT_NE(s.message().find(key), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("missing"), std::string::npos) << s.message();
  }
}

TEST(ModelSpecErrors, AMisspeltRequiredKeyIsPointedAt) {
  // config.json may carry keys MegaTrain does not read, so a misspelt one is not "unknown"; the
  // missing key it stands for names it instead.
  Json c = base_config();
  c["num_hiden_layers"] = c["num_hidden_layers"];
  c.erase("num_hidden_layers");
  Status s = error_of(c);
  EXPECT_NE(s.message().find("num_hidden_layers: missing"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("found \"num_hiden_layers\", a misspelling?"), std::string::npos) << s.message();
}

TEST(ModelSpecErrors, DuplicateKeyIsRefused) {
  std::string text = base_config().dump();
  text.insert(1, "\"hidden_size\":32,");
  auto s = ModelSpec::from_config_json(text, "config.json");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("config.json: hidden_size: duplicate key"), std::string::npos) << s.status().to_string();
}

TEST(ModelSpecErrors, ContradictoryFieldsAreNamed) {
  Json c = base_config();
  c["num_key_value_heads"] = 3;  // 4 heads cannot be split into 3 groups
  EXPECT_NE(error_of(c).message().find("num_key_value_heads"), std::string::npos);

  c = base_config();
  c["hidden_size"] = 66;  // not divisible by 4 heads, and no head_dim
  EXPECT_NE(error_of(c).message().find("head_dim"), std::string::npos);

  c = base_config();
  c["model_type"] = "qwen2";
  Status s = error_of(c);
  EXPECT_NE(s.message().find("model_type"), std::string::npos);
  EXPECT_NE(s.message().find("contradicts"), std::string::npos);

  c = base_config();
  c["architectures"] = {"MistralForCausalLM"};
  c["model_type"] = "mistral";
  c["attention_bias"] = true;
  EXPECT_NE(error_of(c).message().find("attention_bias"), std::string::npos);
}

TEST(ModelSpecErrors, WrongTypesAndRangesAreNamed) {
  Json c = base_config();
  c["hidden_size"] = "64";
  Status s = error_of(c);
  EXPECT_NE(s.message().find("hidden_size"), std::string::npos);
  EXPECT_NE(s.message().find("expected an integer"), std::string::npos);

  c = base_config();
  c["num_hidden_layers"] = 0;
  EXPECT_NE(error_of(c).message().find("num_hidden_layers"), std::string::npos);

  c = base_config();
  c["hidden_act"] = "gelu";
  s = error_of(c);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("hidden_act"), std::string::npos);

  c = base_config();
  c["num_local_experts"] = 8;
  EXPECT_EQ(error_of(c).code(), StatusCode::kUnsupported);
}

TEST(ModelSpecErrors, TruncatedJsonAndMissingFiles) {
  std::string text = base_config().dump();
  auto s = ModelSpec::from_config_json(text.substr(0, text.size() / 2), "cfg");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kParseError);
  EXPECT_NE(s.status().message().find("truncated"), std::string::npos) << s.status().message();

  auto missing = ModelSpec::load("/nonexistent/dir/config.json");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/dir/config.json"), std::string::npos);

  auto unknown = ModelSpec::load("llama-2-7");
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("llama-2-7b"), std::string::npos);  // lists / suggests known names
}

TEST(ModelSpec, LoadsFromAFolderHoldingConfigJson) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("mt_model_dir_" + std::to_string(::getpid())) / "my-model";
  fs::create_directories(dir);
  fs::copy_file(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / "tiny-qwen2.json", dir / "config.json",
                fs::copy_options::overwrite_existing);
  auto s = ModelSpec::load(dir.string());
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->name(), "my-model");
  fs::remove_all(dir.parent_path());
}

}  // namespace
}  // namespace megatrain

namespace megatrain {
namespace {

// Mixture-of-Experts and Qwen3 (issue 18). Our exact counts, and the published figures they round
// to. Sources:
//   Mixtral-8x7B-v0.1: 46,702,792,704 = the Hub's model.safetensors.index.json total_size
//     (93,405,585,408 bytes of bf16) / 2; "46.7B total, 12.9B active" (Mistral AI's announcement).
//   Mixtral-8x22B-v0.1: "141B total, 39B active" (Mistral AI's announcement).
//   Qwen3-235B-A22B: "235B in total and 22B activated"; Qwen3-30B-A3B: "30.5B in total and 3.3B
//   activated"; Qwen3-32B: "32.8B" (the Qwen3 model cards).
//   gpt-oss-120b: 116.83B total, 5.13B active; gpt-oss-20b: 20.91B total, 3.61B active (the
//   gpt-oss model card, arXiv 2508.10925, table 1). Its active figure leaves out the embedding
//   table (a lookup, not a matmul) and counts the unembedding: ours, total less the unchosen
//   experts, counts both, so the test subtracts the embedding for it.
struct PublishedMoe {
  const char* name;
  int64_t total, active;                 // ours, exact
  double total_pub, active_pub, unit;   // the published figures and their last digit
  bool active_without_embedding;
  bool truncated = false;  // the card cuts the active figure off instead of rounding it (Qwen3-30B-A3B: 3.353B -> "3.3B")
};

TEST(ModelSpecMoe, CountsEqualThePublishedFigures) {
  const PublishedMoe cases[] = {
      {"mixtral-8x7b", 46702792704, 12879925248, 46.7e9, 12.9e9, 0.1e9, false},
      {"mixtral-8x22b", 140620634112, 39152031744, 141e9, 39e9, 1e9, false},
      {"qwen3-235b-a22b", 235093634560, 22190763520, 235e9, 22e9, 1e9, false},
      {"qwen3-30b-a3b", 30532122624, 3353032704, 30.5e9, 3.3e9, 0.1e9, false, true},
      {"qwen3-32b", 32762123264, 32762123264, 32.8e9, 32.8e9, 0.1e9, false},
      {"gpt-oss-120b", 116829156672, 5711982912, 116.83e9, 5.13e9, 0.01e9, true},
      {"gpt-oss-20b", 20914757184, 4187440704, 20.91e9, 3.61e9, 0.01e9, true},
  };
  for (const PublishedMoe& p : cases) {
    SCOPED_TRACE(p.name);
    auto spec = ModelSpec::load(p.name);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    const ParameterCounts pc = spec->parameter_counts();
    EXPECT_EQ(pc.total, p.total);
    EXPECT_EQ(pc.active, p.active);
    auto rounded = [&](double v) { return std::round(v / p.unit) * p.unit; };
    EXPECT_DOUBLE_EQ(rounded(static_cast<double>(pc.total)), p.total_pub);
    const double active = static_cast<double>(pc.active - (p.active_without_embedding ? pc.embedding : 0));
    EXPECT_DOUBLE_EQ(p.truncated ? std::floor(active / p.unit) * p.unit : rounded(active), p.active_pub);
    // The parts add up.
    int64_t layers = 0;
    for (int64_t n : pc.layer) layers += n;
    EXPECT_EQ(layers, pc.layers);
    EXPECT_EQ(pc.embedding + pc.layers + pc.final_norm + pc.head, pc.total);
    if (spec->config().is_moe()) {
      EXPECT_EQ(pc.experts, pc.moe_layers * spec->config().num_experts * pc.per_expert);
      // FLOPs count the k chosen experts: forward is about 2 x active parameters less the
      // embedding (plus attention).
      const FlopsPerToken f = spec->flops_per_token(128);
      const double matmul_params = static_cast<double>(pc.active - pc.embedding) - 0.0;
      EXPECT_GT(f.forward, 2 * matmul_params * 0.99);
      EXPECT_LT(f.forward, 2 * matmul_params * 1.10);
    }
  }
}

TEST(ModelSpecMoe, TensorsHaveTheHubNamesAndShapes) {
  {
    auto m = ModelSpec::load("mixtral-8x7b");
    ASSERT_TRUE(m.ok());
    const auto t = m->layer_tensors(3);
    // q, k, v, o, the router, 8 experts x (w1, w2, w3), two norms
    ASSERT_EQ(t.size(), 4u + 1u + 24u + 2u);
    EXPECT_EQ(t[4].name, "model.layers.3.block_sparse_moe.gate.weight");
    EXPECT_EQ(t[4].shape, (std::vector<int64_t>{8, 4096}));
    EXPECT_EQ(t[5].name, "model.layers.3.block_sparse_moe.experts.0.w1.weight");
    EXPECT_EQ(t[5].shape, (std::vector<int64_t>{14336, 4096}));
    EXPECT_EQ(t[6].name, "model.layers.3.block_sparse_moe.experts.0.w2.weight");
    EXPECT_EQ(t[6].shape, (std::vector<int64_t>{4096, 14336}));
    EXPECT_EQ(t[28].name, "model.layers.3.block_sparse_moe.experts.7.w3.weight");
    EXPECT_EQ(t[28].expert, 7);
  }
  {
    auto m = ModelSpec::load("qwen3-30b-a3b");
    ASSERT_TRUE(m.ok());
    const auto t = m->layer_tensors(0);
    EXPECT_EQ(t[4].name, "model.layers.0.self_attn.q_norm.weight");
    EXPECT_EQ(t[4].shape, (std::vector<int64_t>{128}));
    EXPECT_EQ(t[6].name, "model.layers.0.mlp.gate.weight");
    EXPECT_EQ(t[7].name, "model.layers.0.mlp.experts.0.gate_proj.weight");
    EXPECT_EQ(t[7].shape, (std::vector<int64_t>{768, 2048}));
  }
  {
    auto m = ModelSpec::load("gpt-oss-120b");
    ASSERT_TRUE(m.ok());
    std::vector<std::string> names;
    for (const auto& t : m->layer_tensors(0)) names.push_back(t.name);
    const std::vector<std::string> want = {
        "model.layers.0.self_attn.sinks",         "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.bias",
        "model.layers.0.mlp.router.weight",
        "model.layers.0.mlp.router.bias",         "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.down_proj_bias", "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight"};
    EXPECT_EQ(names, want);
    EXPECT_EQ(m->layer_tensors(0)[11].shape, (std::vector<int64_t>{128, 2880, 5760}));
    EXPECT_TRUE(m->config().is_sliding_layer(0));
    EXPECT_FALSE(m->config().is_sliding_layer(1));
    EXPECT_EQ(m->config().rope_scaling_type, "yarn");
  }
}

TEST(ModelSpecMoe, DenseLayersAmongMoeLayers) {
  auto m = ModelSpec::load("tiny-qwen3-moe");  // mlp_only_layers [1]
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->config().is_moe_layer(0));
  EXPECT_FALSE(m->config().is_moe_layer(1));
  EXPECT_TRUE(m->config().is_moe_layer(2));
  const ParameterCounts pc = m->parameter_counts();
  EXPECT_EQ(pc.moe_layers, 2);
  EXPECT_NE(pc.layer[0], pc.layer[1]);
  EXPECT_EQ(pc.layer[0], pc.layer[2]);
  const FlopsPerToken f = m->flops_per_token(16);
  ASSERT_EQ(f.layer_forwards.size(), 3u);
  EXPECT_NE(f.layer_forwards[0], f.layer_forwards[1]);
}

TEST(ModelSpecMoe, WhatChangesTheMathIsRefusedByName) {
  auto cfg = [](const std::string& extra) {
    std::string base = R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
      "num_local_experts": 4, "num_experts_per_tok": 2)";
    return base + extra + "}";
  };
  ASSERT_TRUE(ModelSpec::from_config_json(cfg("")).ok());
  for (const std::string& extra : {std::string(R"(, "n_shared_experts": 2)"), std::string(R"(, "kv_lora_rank": 512)"),
                                   std::string(R"(, "router_jitter_noise": 0.1)")}) {
    auto s = ModelSpec::from_config_json(cfg(extra));
    ASSERT_FALSE(s.ok()) << extra;
    EXPECT_EQ(s.status().code(), StatusCode::kUnsupported) << s.status().to_string();
    const std::string key = extra.substr(3, extra.find('"', 3) - 3);
    EXPECT_NE(s.status().message().find(key), std::string::npos) << s.status().to_string();
  }
  auto k_too_big = ModelSpec::from_config_json(cfg("").replace(cfg("").find("\"num_experts_per_tok\": 2"), 24,
                                                               "\"num_experts_per_tok\": 5"));
  EXPECT_FALSE(k_too_big.ok());
  auto ds = ModelSpec::from_config_json(R"({"architectures": ["DeepseekV3ForCausalLM"]})");
  ASSERT_FALSE(ds.ok());
  EXPECT_NE(ds.status().message().find("later step"), std::string::npos) << ds.status().to_string();
}

}  // namespace
}  // namespace megatrain

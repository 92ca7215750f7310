// The tensor tables (core/arch.h, issue 47): the tensors each architecture lays out, against the
// state-dict names and shapes Hugging Face's modeling code gives (written out here by hand from
// transformers' Qwen2, Mixtral and gpt-oss modules), and the traits of each role.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "megatrain/core/arch.h"
#include "megatrain/core/model_spec.h"

namespace {

using megatrain::ModelSpec;
using megatrain::TensorInfo;
using megatrain::TensorRole;
namespace arch = megatrain::arch;

// Every model profile the project ships, loaded (a file that does not load fails the test).
struct Shipped {
  std::filesystem::path file;
  ModelSpec spec;
  const std::filesystem::path& path() const { return file; }
};
std::vector<Shipped> shipped_models() {
  std::vector<Shipped> out;
  for (const auto& e : std::filesystem::directory_iterator(MEGATRAIN_PROFILES_DIR "/models")) {
    auto m = ModelSpec::load(e.path().string());
    if (m.ok()) out.push_back({e.path(), std::move(*m)});
    else ADD_FAILURE() << e.path() << ": " << m.status().to_string();
  }
  return out;
}

// "name [d0, d1, ...]" of each tensor of `layer` (-1: the embedding and the head).
std::vector<std::string> described(const ModelSpec& m, int64_t layer) {
  std::vector<std::string> out;
  for (const TensorInfo& t : m.tensors()) {
    if (t.layer != layer) continue;
    std::string s = t.name + " [";
    for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
    out.push_back(s + "]");
  }
  return out;
}

TEST(Arch, Qwen2LayerIsTheStateDictOfQwen2DecoderLayer) {
  // tiny-qwen2: hidden 64, 4 heads of 16 (2 KV heads), MLP 128, vocabulary 256, tied head.
  auto m = ModelSpec::load("tiny-qwen2");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const std::vector<std::string> layer1 = {
      "model.layers.1.self_attn.q_proj.weight [64, 64]",   "model.layers.1.self_attn.q_proj.bias [64]",
      "model.layers.1.self_attn.k_proj.weight [32, 64]",   "model.layers.1.self_attn.k_proj.bias [32]",
      "model.layers.1.self_attn.v_proj.weight [32, 64]",   "model.layers.1.self_attn.v_proj.bias [32]",
      "model.layers.1.self_attn.o_proj.weight [64, 64]",   "model.layers.1.mlp.gate_proj.weight [128, 64]",
      "model.layers.1.mlp.up_proj.weight [128, 64]",       "model.layers.1.mlp.down_proj.weight [64, 128]",
      "model.layers.1.input_layernorm.weight [64]",        "model.layers.1.post_attention_layernorm.weight [64]"};
  EXPECT_EQ(described(*m, 1), layer1);
  // Tied: no lm_head.weight.
  EXPECT_EQ(described(*m, -1), (std::vector<std::string>{"model.embed_tokens.weight [256, 64]", "model.norm.weight [64]"}));
}

TEST(Arch, MixtralExpertsFollowTheRouterEachW1W2W3) {
  auto m = ModelSpec::load("tiny-mixtral");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const std::vector<std::string> got = described(*m, 0);
  // q, k, v, o; the router; 8 experts x 3; the two norms.
  ASSERT_EQ(got.size(), 4u + 1u + 24u + 2u);
  EXPECT_EQ(got[4], "model.layers.0.block_sparse_moe.gate.weight [8, 64]");
  EXPECT_EQ(got[5], "model.layers.0.block_sparse_moe.experts.0.w1.weight [48, 64]");
  EXPECT_EQ(got[6], "model.layers.0.block_sparse_moe.experts.0.w2.weight [64, 48]");
  EXPECT_EQ(got[7], "model.layers.0.block_sparse_moe.experts.0.w3.weight [48, 64]");
  EXPECT_EQ(got[28], "model.layers.0.block_sparse_moe.experts.7.w3.weight [48, 64]");
  EXPECT_EQ(got[29], "model.layers.0.input_layernorm.weight [64]");
  for (const TensorInfo& t : m->tensors()) {
    if (t.name.find(".experts.3.") != std::string::npos) {
      EXPECT_EQ(t.expert, 3) << t.name;
    }
  }
  EXPECT_EQ(described(*m, -1).back(), "lm_head.weight [256, 64]");
}

TEST(Arch, GptOssLayerHasSinksFirstAndStackedExperts) {
  // tiny-gpt-oss: hidden 64, 4 heads of 16 (2 KV), 8 experts of 32, biases on q/k/v/o.
  auto m = ModelSpec::load("tiny-gpt-oss");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const std::vector<std::string> want = {
      "model.layers.0.self_attn.sinks [4]",
      "model.layers.0.self_attn.q_proj.weight [64, 64]",        "model.layers.0.self_attn.q_proj.bias [64]",
      "model.layers.0.self_attn.k_proj.weight [32, 64]",        "model.layers.0.self_attn.k_proj.bias [32]",
      "model.layers.0.self_attn.v_proj.weight [32, 64]",        "model.layers.0.self_attn.v_proj.bias [32]",
      "model.layers.0.self_attn.o_proj.weight [64, 64]",        "model.layers.0.self_attn.o_proj.bias [64]",
      "model.layers.0.mlp.router.weight [8, 64]",               "model.layers.0.mlp.router.bias [8]",
      "model.layers.0.mlp.experts.gate_up_proj [8, 64, 64]",    "model.layers.0.mlp.experts.gate_up_proj_bias [8, 64]",
      "model.layers.0.mlp.experts.down_proj [8, 32, 64]",       "model.layers.0.mlp.experts.down_proj_bias [8, 64]",
      "model.layers.0.input_layernorm.weight [64]",             "model.layers.0.post_attention_layernorm.weight [64]"};
  EXPECT_EQ(described(*m, 0), want);
}

TEST(Arch, EveryRoleHasItsNameAndTraits) {
  // The enum-to-name mapping, spot-checked at both ends and in the middle (a row out of order in
  // the traits table shifts every name after it).
  EXPECT_STREQ(megatrain::tensor_role_name(TensorRole::kEmbedding), "embedding");
  EXPECT_STREQ(megatrain::tensor_role_name(TensorRole::kFinalNorm), "final_norm");
  EXPECT_STREQ(megatrain::tensor_role_name(TensorRole::kSinks), "sinks");
  EXPECT_STREQ(megatrain::tensor_role_name(TensorRole::kExpertDownBias), "expert_down_bias");
  std::set<std::string> names;
  for (int r = 0; r < megatrain::kTensorRoleCount; ++r) {
    const arch::RoleTraits& t = arch::role_traits(static_cast<TensorRole>(r));
    const std::string n = t.name;
    EXPECT_TRUE(names.insert(n).second) << n << " twice";
    const bool norm = n.size() > 5 && n.compare(n.size() - 5, 5, "_norm") == 0, bias = n.find("bias") != std::string::npos;
    // As HF Trainer groups parameters: no weight decay on norms and biases; norms start at one,
    // biases at zero, the rest from the normal draw.
    EXPECT_EQ(t.decay, !norm && !bias) << n;
    EXPECT_EQ(t.init, norm ? arch::Init::kOnes : bias ? arch::Init::kZeros : arch::Init::kNormal) << n;
    EXPECT_EQ(t.expert, n.rfind("expert_", 0) == 0) << n;
  }
}

// extent() counts what tensor_list() lists, without listing: every shipped model, exactly.
TEST(Arch, ExtentCountsWhatTheTablesList) {
  int models = 0;
  for (const Shipped& e : shipped_models()) {
    const ModelSpec* m = &e.spec;
    const arch::Extent x = arch::extent(m->config());
    EXPECT_EQ(static_cast<int64_t>(x.tensors), static_cast<int64_t>(m->tensors().size())) << e.path();
    EXPECT_EQ(static_cast<int64_t>(x.parameters), m->parameter_counts().total) << e.path();
    ++models;
  }
  EXPECT_GE(models, 20);
}

// The layer's ops (arch::layer_ops) against its tensor tables, for every layer of every shipped
// model: the ops' matrix-multiply FLOPs are twice the matrices a token multiplies (every weight
// matrix of the layer, an expert's k / E of the time), and the ops read exactly the layer's matrices.
TEST(Arch, LayerOpsMultiplyTheLayersMatrices) {
  int layers = 0;
  for (const Shipped& e : shipped_models()) {
    const ModelSpec* m = &e.spec;
    const megatrain::ModelConfig& c = m->config();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      // From the tables: the decayed tensors of rank 2 and more are the weight matrices.
      long double dense = 0, experts = 0;
      std::set<TensorRole> matrices;
      for (const TensorInfo& t : m->tensors()) {
        if (t.layer != l || t.shape.size() < 2 || !arch::role_traits(t.role).decay) continue;
        (arch::role_traits(t.role).expert ? experts : dense) += static_cast<long double>(t.numel);
        matrices.insert(t.role);
      }
      // From the ops: E x FLOPs = 2 (E dense + k experts), in integers.
      long double flops = 0;
      std::set<TensorRole> read;
      for (const arch::Op& op : arch::layer_ops(c, l)) {
        if (op.kind == arch::OpKind::kAttention) {
          EXPECT_EQ(arch::op_flops(op, c, 100), 4.0 * 100 * static_cast<double>(c.num_heads * c.head_dim)) << e.path();
          continue;
        }
        flops += arch::op_flops(op, c, 0);
        if (op.weight != TensorRole::kCount && arch::role_traits(op.weight).decay && op.kind != arch::OpKind::kNorm) read.insert(op.weight);
        if (op.weight != TensorRole::kCount) {
          bool present = false;
          for (const TensorInfo& t : m->tensors()) present = present || (t.layer == l && t.role == op.weight);
          EXPECT_TRUE(present) << e.path() << " layer " << l << ": op " << op.name << " reads a tensor the layer does not have";
        }
      }
      const long double E = c.num_experts > 0 ? c.num_experts : 1;
      EXPECT_EQ(static_cast<double>(flops * E), static_cast<double>(2 * (E * dense + c.experts_per_token * experts)))
          << e.path() << " layer " << l;
      EXPECT_EQ(read, matrices) << e.path() << " layer " << l;
      ++layers;
    }
  }
  EXPECT_GE(layers, 200);
}

// The values the ops pass along (what the CPU backend's forward runs): for every layer of every
// shipped model, each op reads only values written before it (the layer's input, x, to start), the
// layer writes its output, a linear's width matches its weight's shape in the tables, and a
// value written twice is rewritten only in place (RoPE, a residual added into its second term).
TEST(Arch, LayerOpsPassTheirValuesInOrder) {
  using arch::Val;
  int layers = 0;
  for (const Shipped& e : shipped_models()) {
    const ModelSpec* m = &e.spec;
    const megatrain::ModelConfig& c = m->config();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::set<Val> written = {Val::kX};
      auto mark = [&written](Val v) {
        written.insert(v);
        if (v == Val::kQk) written.insert({Val::kQ, Val::kK});
        if (v == Val::kQ || v == Val::kK)
          if (written.count(Val::kQ) && written.count(Val::kK)) written.insert(Val::kQk);
        if (v == Val::kQPre || v == Val::kKPre)
          if (written.count(Val::kQPre) && written.count(Val::kKPre)) written.insert(Val::kQkPre);
      };
      for (const arch::Op& op : arch::layer_ops(c, l)) {
        const std::string where = e.path().filename().string() + " layer " + std::to_string(l) + " op " + op.name;
        for (Val v : {op.src, op.src2})
          if (v != Val::kNone) EXPECT_TRUE(written.count(v)) << where << " reads " << arch::val_name(v) << " before it is written";
        if (op.kind == arch::OpKind::kRoute) {
          EXPECT_EQ(op.dst, Val::kNone) << where;  // the routing lives in the block's own buffers
        } else {
          ASSERT_NE(op.dst, Val::kNone) << where;
          if (written.count(op.dst))
            EXPECT_TRUE(op.dst == op.src || op.dst == op.src2) << where << " overwrites " << arch::val_name(op.dst);
        }
        if (op.kind == arch::OpKind::kLinear || op.kind == arch::OpKind::kGroupedLinear) {
          std::vector<int64_t> shape;
          for (const TensorInfo& t : m->tensors())
            if (t.layer == l && t.role == op.weight && t.expert <= 0) shape = t.shape;
          int64_t numel = 1;
          for (int64_t dim : shape) numel *= dim;
          const int64_t per = op.kind == arch::OpKind::kGroupedLinear && !shape.empty() && op.weight_in_out ? numel / shape[0] : numel;
          EXPECT_EQ(per, arch::dim_value(op.in, c) * arch::dim_value(op.out, c)) << where;
        }
        mark(op.dst);
      }
      EXPECT_TRUE(written.count(Val::kOut)) << e.path() << " layer " << l;
      ++layers;
    }
  }
  EXPECT_GE(layers, 200);
}

// The ops of a layer, in order, for a dense and a MoE layer (what the next slices run).
TEST(Arch, LayerOpsInOrder) {
  auto names = [](const megatrain::ModelConfig& c, int64_t l) {
    std::string s;
    for (const arch::Op& op : arch::layer_ops(c, l)) s += std::string(s.empty() ? "" : ", ") + op.name;
    return s;
  };
  auto qwen3 = ModelSpec::load("tiny-qwen3-moe");  // layer 0 MoE, layer 1 dense (mlp_only_layers)
  ASSERT_TRUE(qwen3.ok());
  EXPECT_EQ(names(qwen3->config(), 0),
            "input_layernorm, q_proj, k_proj, v_proj, q_norm, k_norm, rope, attention, o_proj, attention residual, "
            "post_attention_layernorm, router, route, dispatch, experts.gate, experts.up, experts.act(gate) * up, experts.down, "
            "combine, mlp residual");
  EXPECT_EQ(names(qwen3->config(), 1),
            "input_layernorm, q_proj, k_proj, v_proj, q_norm, k_norm, rope, attention, o_proj, attention residual, "
            "post_attention_layernorm, gate_proj, up_proj, act(gate) * up, down_proj, mlp residual");
  EXPECT_STREQ(arch::op_kind_name(arch::OpKind::kGroupedLinear), "grouped linear");
}

}  // namespace

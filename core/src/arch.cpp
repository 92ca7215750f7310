#include "megatrain/core/arch.h"

#include <cstddef>
#include <initializer_list>

namespace megatrain::arch {
namespace {

using D = Dim;
using R = TensorRole;

// ---- what holds for every role ----------------------------------------------------------------------

constexpr RoleTraits kRoles[] = {
    // name, decay, init, expert; in TensorRole's order
    {"embedding", true, Init::kNormal, false},       {"attn_norm", false, Init::kOnes, false},
    {"q", true, Init::kNormal, false},               {"k", true, Init::kNormal, false},
    {"v", true, Init::kNormal, false},               {"o", true, Init::kNormal, false},
    {"q_bias", false, Init::kZeros, false},          {"k_bias", false, Init::kZeros, false},
    {"v_bias", false, Init::kZeros, false},          {"o_bias", false, Init::kZeros, false},
    {"mlp_norm", false, Init::kOnes, false},         {"gate", true, Init::kNormal, false},
    {"up", true, Init::kNormal, false},              {"down", true, Init::kNormal, false},
    {"gate_bias", false, Init::kZeros, false},       {"up_bias", false, Init::kZeros, false},
    {"down_bias", false, Init::kZeros, false},       {"final_norm", false, Init::kOnes, false},
    {"head", true, Init::kNormal, false},            {"q_norm", false, Init::kOnes, false},
    {"k_norm", false, Init::kOnes, false},           {"sinks", true, Init::kNormal, false},
    {"router", true, Init::kNormal, false},          {"router_bias", false, Init::kZeros, false},
    {"expert_gate", true, Init::kNormal, true},      {"expert_up", true, Init::kNormal, true},
    {"expert_down", true, Init::kNormal, true},      {"expert_gate_up", true, Init::kNormal, true},
    {"expert_gate_up_bias", false, Init::kZeros, true}, {"expert_down_bias", false, Init::kZeros, true},
};
static_assert(std::size(kRoles) == static_cast<size_t>(kTensorRoleCount), "one RoleTraits per TensorRole, in its order");

// ---- the tensor tables ------------------------------------------------------------------------------

constexpr TensorRule kEmbedding[] = {{"model.embed_tokens.weight", {D::kVocab, D::kHidden}, 2, R::kEmbedding}};

// LlamaAttention and its kin. GptOssAttention's own parameter (the sinks) comes before its
// submodules' in the state dict; Qwen3's per-head norms after the projections.
constexpr TensorRule kAttention[] = {
    {"self_attn.sinks", {D::kHeads}, 1, R::kSinks, When::kSinks},
    {"self_attn.q_proj.weight", {D::kQ, D::kHidden}, 2, R::kQ},
    {"self_attn.q_proj.bias", {D::kQ}, 1, R::kQBias, When::kQkvBias},
    {"self_attn.k_proj.weight", {D::kKv, D::kHidden}, 2, R::kK},
    {"self_attn.k_proj.bias", {D::kKv}, 1, R::kKBias, When::kQkvBias},
    {"self_attn.v_proj.weight", {D::kKv, D::kHidden}, 2, R::kV},
    {"self_attn.v_proj.bias", {D::kKv}, 1, R::kVBias, When::kQkvBias},
    {"self_attn.o_proj.weight", {D::kHidden, D::kQ}, 2, R::kO},
    {"self_attn.o_proj.bias", {D::kHidden}, 1, R::kOBias, When::kOBias},
    {"self_attn.q_norm.weight", {D::kHeadDim}, 1, R::kQNorm, When::kQkNorm},
    {"self_attn.k_norm.weight", {D::kHeadDim}, 1, R::kKNorm, When::kQkNorm},
};

constexpr TensorRule kDenseMlp[] = {
    {"mlp.gate_proj.weight", {D::kIntermediate, D::kHidden}, 2, R::kGate},
    {"mlp.gate_proj.bias", {D::kIntermediate}, 1, R::kGateBias, When::kMlpBias},
    {"mlp.up_proj.weight", {D::kIntermediate, D::kHidden}, 2, R::kUp},
    {"mlp.up_proj.bias", {D::kIntermediate}, 1, R::kUpBias, When::kMlpBias},
    {"mlp.down_proj.weight", {D::kHidden, D::kIntermediate}, 2, R::kDown},
    {"mlp.down_proj.bias", {D::kHidden}, 1, R::kDownBias, When::kMlpBias},
};

// MixtralSparseMoeBlock: the router, then each expert's w1 (gate), w2 (down), w3 (up).
constexpr TensorRule kMixtralMoe[] = {
    {"block_sparse_moe.gate.weight", {D::kExperts, D::kHidden}, 2, R::kRouter},
    {"w1.weight", {D::kExpertInter, D::kHidden}, 2, R::kExpertGate, When::kAlways, true},
    {"w2.weight", {D::kHidden, D::kExpertInter}, 2, R::kExpertDown, When::kAlways, true},
    {"w3.weight", {D::kExpertInter, D::kHidden}, 2, R::kExpertUp, When::kAlways, true},
};

// Qwen3MoeSparseMoeBlock: the router, then each expert's gate, up and down projections.
constexpr TensorRule kQwen3Moe[] = {
    {"mlp.gate.weight", {D::kExperts, D::kHidden}, 2, R::kRouter},
    {"gate_proj.weight", {D::kExpertInter, D::kHidden}, 2, R::kExpertGate, When::kAlways, true},
    {"up_proj.weight", {D::kExpertInter, D::kHidden}, 2, R::kExpertUp, When::kAlways, true},
    {"down_proj.weight", {D::kHidden, D::kExpertInter}, 2, R::kExpertDown, When::kAlways, true},
};

// GptOssMLP: a router with a bias, and GptOssExperts' stacked parameters (gate and up interleaved
// in gate_up_proj's last dimension).
constexpr TensorRule kGptOssMoe[] = {
    {"mlp.router.weight", {D::kExperts, D::kHidden}, 2, R::kRouter},
    {"mlp.router.bias", {D::kExperts}, 1, R::kRouterBias},
    {"mlp.experts.gate_up_proj", {D::kExperts, D::kHidden, D::kExpertInter2}, 3, R::kExpertGateUp},
    {"mlp.experts.gate_up_proj_bias", {D::kExperts, D::kExpertInter2}, 2, R::kExpertGateUpBias},
    {"mlp.experts.down_proj", {D::kExperts, D::kExpertInter, D::kHidden}, 3, R::kExpertDown},
    {"mlp.experts.down_proj_bias", {D::kExperts, D::kHidden}, 2, R::kExpertDownBias},
};

constexpr TensorRule kLayerNorms[] = {
    {"input_layernorm.weight", {D::kHidden}, 1, R::kAttnNorm},
    {"post_attention_layernorm.weight", {D::kHidden}, 1, R::kMlpNorm},
};

constexpr TensorRule kHead[] = {
    {"model.norm.weight", {D::kHidden}, 1, R::kFinalNorm},
    {"lm_head.weight", {D::kVocab, D::kHidden}, 2, R::kHead, When::kUntiedHead},
};

constexpr const char* kLayerPrefix = "model.layers.{l}.";
const Block kEmbeddingBlock{"embedding", "", "", kEmbedding};
const Block kAttentionBlock{"attention", kLayerPrefix, "", kAttention};
const Block kDenseMlpBlock{"dense MLP", kLayerPrefix, "", kDenseMlp};
const Block kMixtralBlock{"Mixtral MoE", kLayerPrefix, "block_sparse_moe.experts.", kMixtralMoe};
const Block kQwen3MoeBlock{"Qwen3-MoE MoE", kLayerPrefix, "mlp.experts.", kQwen3Moe};
const Block kGptOssBlock{"gpt-oss MoE", kLayerPrefix, "", kGptOssMoe};
const Block kLayerNormsBlock{"layer norms", kLayerPrefix, "", kLayerNorms};
const Block kHeadBlock{"head", "", "", kHead};

std::string with_layer(const char* pattern, int64_t layer) {
  std::string s = pattern;
  if (const size_t at = s.find("{l}"); at != std::string::npos) s.replace(at, 3, std::to_string(layer));
  return s;
}

void lay_out(const Block& b, const ModelConfig& c, int64_t layer, std::vector<TensorInfo>& out) {
  const std::string prefix = with_layer(b.prefix, layer);
  auto add = [&](const TensorRule& r, std::string name, int64_t expert) {
    TensorInfo t;
    t.name = std::move(name);
    t.numel = 1;
    for (int k = 0; k < r.rank; ++k) {
      t.shape.push_back(dim_value(r.shape[static_cast<size_t>(k)], c));
      t.numel *= t.shape.back();
    }
    t.layer = layer;
    t.role = r.role;
    t.expert = expert;
    out.push_back(std::move(t));
  };
  for (const TensorRule& r : b.rules)
    if (!r.per_expert && rule_applies(r.when, c)) add(r, prefix + r.name, -1);
  bool experts = false;
  for (const TensorRule& r : b.rules) experts = experts || r.per_expert;
  if (!experts) return;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string x = prefix + b.expert_prefix + std::to_string(e) + ".";
    for (const TensorRule& r : b.rules)
      if (r.per_expert && rule_applies(r.when, c)) add(r, x + r.name, e);
  }
}

void add_extent(const Block& b, const ModelConfig& c, Extent& x) {
  const long double experts = static_cast<long double>(c.num_experts);
  for (const TensorRule& r : b.rules) {
    if (!rule_applies(r.when, c)) continue;
    long double n = 1;
    for (int k = 0; k < r.rank; ++k) n *= static_cast<long double>(dim_value(r.shape[static_cast<size_t>(k)], c));
    const long double copies = r.per_expert ? experts : 1;
    x.parameters += copies * n;
    x.tensors += copies;
  }
}

}  // namespace

const RoleTraits& role_traits(TensorRole r) {
  static const RoleTraits kUnknown{"?", true, Init::kNormal, false};
  const auto i = static_cast<size_t>(r);
  return i < std::size(kRoles) ? kRoles[i] : kUnknown;
}

const Block& embedding_block() { return kEmbeddingBlock; }
const Block& attention_block() { return kAttentionBlock; }
const Block& layer_norms_block() { return kLayerNormsBlock; }
const Block& head_block() { return kHeadBlock; }

const Block* mlp_block(const ModelConfig& c, int64_t layer) {
  if (!c.is_moe_layer(layer)) return &kDenseMlpBlock;
  if (c.moe == "mixtral") return &kMixtralBlock;
  if (c.moe == "qwen3_moe") return &kQwen3MoeBlock;
  if (c.moe == "gpt_oss") return &kGptOssBlock;
  return &kDenseMlpBlock;  // (the config reader accepts no other MoE kind)
}

int64_t dim_value(Dim d, const ModelConfig& c) {
  switch (d) {
    case Dim::kVocab: return c.vocab_size;
    case Dim::kHidden: return c.hidden_size;
    case Dim::kIntermediate: return c.intermediate_size;
    case Dim::kQ: return c.num_heads * c.head_dim;
    case Dim::kKv: return c.num_kv_heads * c.head_dim;
    case Dim::kHeadDim: return c.head_dim;
    case Dim::kHeads: return c.num_heads;
    case Dim::kExperts: return c.num_experts;
    case Dim::kExpertInter: return c.moe_intermediate_size;
    case Dim::kExpertInter2: return 2 * c.moe_intermediate_size;
    case Dim::kQKv: return (c.num_heads + c.num_kv_heads) * c.head_dim;
  }
  return 0;
}

bool rule_applies(When w, const ModelConfig& c) {
  switch (w) {
    case When::kAlways: return true;
    case When::kQkvBias: return c.qkv_bias;
    case When::kOBias: return c.o_bias;
    case When::kQkNorm: return c.qk_norm;
    case When::kMlpBias: return c.mlp_bias;
    case When::kSinks: return c.attention_sinks;
    case When::kUntiedHead: return !c.tie_word_embeddings;
  }
  return false;
}

Extent extent(const ModelConfig& c) {
  Extent x;
  add_extent(kEmbeddingBlock, c, x);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    add_extent(kAttentionBlock, c, x);
    add_extent(*mlp_block(c, l), c, x);
    add_extent(kLayerNormsBlock, c, x);
  }
  add_extent(kHeadBlock, c, x);
  return x;
}

std::vector<TensorInfo> tensor_list(const ModelConfig& c) {
  std::vector<TensorInfo> out;
  lay_out(kEmbeddingBlock, c, -1, out);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    lay_out(kAttentionBlock, c, l, out);
    lay_out(*mlp_block(c, l), c, l, out);
    lay_out(kLayerNormsBlock, c, l, out);
  }
  lay_out(kHeadBlock, c, -1, out);
  return out;
}

// ---- the decoder layer as ops ------------------------------------------------------------------------

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kNorm: return "norm";
    case OpKind::kLinear: return "linear";
    case OpKind::kHeadNorm: return "head norm";
    case OpKind::kRope: return "rope";
    case OpKind::kAttention: return "attention";
    case OpKind::kRoute: return "route";
    case OpKind::kDispatch: return "dispatch";
    case OpKind::kGroupedLinear: return "grouped linear";
    case OpKind::kGlu: return "glu";
    case OpKind::kCombine: return "combine";
    case OpKind::kResidual: return "residual";
  }
  return "?";
}

std::vector<Op> layer_ops(const ModelConfig& c, int64_t layer) { return layer_ops_of_kind(c, c.is_moe_layer(layer)); }

const char* val_name(Val v) {
  switch (v) {
    case Val::kNone: return "none";
    case Val::kX: return "x";
    case Val::kXn1: return "xn1";
    case Val::kQPre: return "q_pre";
    case Val::kKPre: return "k_pre";
    case Val::kQkPre: return "q_pre, k_pre";
    case Val::kQ: return "q";
    case Val::kK: return "k";
    case Val::kQk: return "q, k";
    case Val::kV: return "v";
    case Val::kAttn: return "attn";
    case Val::kH: return "h";
    case Val::kXn2: return "xn2";
    case Val::kGate: return "gate";
    case Val::kUp: return "up";
    case Val::kAct: return "act";
    case Val::kLogits: return "logits";
    case Val::kXp: return "xp";
    case Val::kYp: return "yp";
    case Val::kOut: return "out";
  }
  return "?";
}

TensorRole bias_of(TensorRole weight) {
  switch (weight) {
    case R::kQ: return R::kQBias;
    case R::kK: return R::kKBias;
    case R::kV: return R::kVBias;
    case R::kO: return R::kOBias;
    case R::kRouter: return R::kRouterBias;
    case R::kExpertGateUp: return R::kExpertGateUpBias;
    case R::kExpertDown: return R::kExpertDownBias;
    default: return R::kCount;
  }
}

std::vector<Op> layer_ops_of_kind(const ModelConfig& c, bool moe) {
  constexpr Part A = Part::kAttention, M = Part::kMlp;
  using V = Val;
  // Qwen3 normalises q and k per head before RoPE: the projections write q_pre and k_pre.
  const V q = c.qk_norm ? V::kQPre : V::kQ, k = c.qk_norm ? V::kKPre : V::kK;
  std::vector<Op> ops = {
      {OpKind::kNorm, "input_layernorm", A, D::kHidden, D::kHidden, false, R::kAttnNorm, true, true, V::kX, V::kNone, V::kXn1},
      {OpKind::kLinear, "q_proj", A, D::kHidden, D::kQ, false, R::kQ, false, false, V::kXn1, V::kNone, q},
      {OpKind::kLinear, "k_proj", A, D::kHidden, D::kKv, false, R::kK, false, false, V::kXn1, V::kNone, k},
      {OpKind::kLinear, "v_proj", A, D::kHidden, D::kKv, false, R::kV, false, true, V::kXn1, V::kNone, V::kV},
  };
  auto add = [&ops](std::initializer_list<Op> more) {
    for (const Op& op : more) ops.push_back(op);
  };
  // Backward needs q and k as they were before the per-head norms.
  if (c.qk_norm)
    ops.push_back({OpKind::kHeadNorm, "q_norm, k_norm", A, D::kQKv, D::kQKv, false, R::kQNorm, true, false, V::kQkPre, V::kNone, V::kQk});
  add({
      {OpKind::kRope, "rope", A, D::kQKv, D::kQKv, false, R::kCount, false, true, V::kQk, V::kNone, V::kQk},
      {OpKind::kAttention, "attention", A, D::kQ, D::kQ, false, R::kCount, false, true, V::kQk, V::kV, V::kAttn},
      {OpKind::kLinear, "o_proj", A, D::kQ, D::kHidden, false, R::kO, false, false, V::kAttn, V::kNone, V::kH},
      {OpKind::kResidual, "attention residual", A, D::kHidden, D::kHidden, false, R::kCount, false, false, V::kX, V::kH, V::kH},
      {OpKind::kNorm, "post_attention_layernorm", M, D::kHidden, D::kHidden, false, R::kMlpNorm, true, true, V::kH, V::kNone, V::kXn2},
  });
  const Op residual{OpKind::kResidual, "mlp residual", M, D::kHidden, D::kHidden, false, R::kCount, false, false, V::kH, V::kOut, V::kOut};
  if (!moe) {
    add({
        {OpKind::kLinear, "gate_proj", M, D::kHidden, D::kIntermediate, false, R::kGate, false, true, V::kXn2, V::kNone, V::kGate},
        {OpKind::kLinear, "up_proj", M, D::kHidden, D::kIntermediate, false, R::kUp, false, true, V::kXn2, V::kNone, V::kUp},
        {OpKind::kGlu, "act(gate) * up", M, D::kIntermediate, D::kIntermediate, false, R::kCount, false, true, V::kGate, V::kUp, V::kAct},
        {OpKind::kLinear, "down_proj", M, D::kIntermediate, D::kHidden, false, R::kDown, false, false, V::kAct, V::kNone, V::kOut},
        residual,
    });
    return ops;
  }
  add({
      {OpKind::kLinear, "router", M, D::kHidden, D::kExperts, false, R::kRouter, false, true, V::kXn2, V::kNone, V::kLogits},
      {OpKind::kRoute, "route", M, D::kExperts, D::kExperts, false, R::kCount, false, true, V::kLogits},
      {OpKind::kDispatch, "dispatch", M, D::kHidden, D::kHidden, true, R::kCount, false, true, V::kXn2, V::kNone, V::kXp},
  });
  const bool gpt_oss = c.moe == "gpt_oss";
  if (gpt_oss) {
    // gpt-oss's experts hold gate and up interleaved in one stacked weight [E, H, 2 I]: one
    // grouped GEMM of 2 x I outputs, then its clamped GLU over the pairs.
    Op gate_up{OpKind::kGroupedLinear, "experts.gate_up", M, D::kHidden, D::kExpertInter2, true, R::kExpertGateUp, false, true,
               V::kXp, V::kNone, V::kGate};
    gate_up.weight_in_out = true;
    Op glu{OpKind::kGlu, "experts.act(gate) * up", M, D::kExpertInter, D::kExpertInter, true, R::kCount, false, true,
           V::kGate, V::kNone, V::kAct};
    glu.interleaved_clamped = true;
    add({gate_up, glu});
  } else {
    add({
        {OpKind::kGroupedLinear, "experts.gate", M, D::kHidden, D::kExpertInter, true, R::kExpertGate, false, true, V::kXp, V::kNone, V::kGate},
        {OpKind::kGroupedLinear, "experts.up", M, D::kHidden, D::kExpertInter, true, R::kExpertUp, false, true, V::kXp, V::kNone, V::kUp},
        {OpKind::kGlu, "experts.act(gate) * up", M, D::kExpertInter, D::kExpertInter, true, R::kCount, false, true, V::kGate, V::kUp, V::kAct},
    });
  }
  Op down{OpKind::kGroupedLinear, "experts.down", M, D::kExpertInter, D::kHidden, true, R::kExpertDown, false, true, V::kAct, V::kNone, V::kYp};
  down.weight_in_out = gpt_oss;
  add({
      down,
      {OpKind::kCombine, "combine", M, D::kHidden, D::kHidden, false, R::kCount, false, false, V::kYp, V::kNone, V::kOut},
      residual,
  });
  return ops;
}

namespace {
// Rows of an op per token: k for the expert slots, else 1.
double rows_per_token(const Op& op, const ModelConfig& c) { return op.slots ? static_cast<double>(c.experts_per_token) : 1.0; }
double width(Dim d, const ModelConfig& c) { return static_cast<double>(dim_value(d, c)); }
}  // namespace

double op_flops(const Op& op, const ModelConfig& c, double keys) {
  switch (op.kind) {
    case OpKind::kLinear:
    case OpKind::kGroupedLinear: return rows_per_token(op, c) * 2 * width(op.in, c) * width(op.out, c);
    case OpKind::kAttention: return 2 * 2 * keys * width(op.out, c);  // QK^T and PV
    default: return 0;
  }
}

double op_elementwise_bytes(const Op& op, const ModelConfig& c, double cb) {
  const double rows = rows_per_token(op, c);
  switch (op.kind) {
    case OpKind::kNorm:
    case OpKind::kHeadNorm:
    case OpKind::kRope: return cb * 2 * width(op.in, c);  // read and written once
    case OpKind::kResidual: return cb * 3 * width(op.in, c);  // two read, one written
    case OpKind::kGlu: return cb * rows * 3 * width(op.out, c);  // gate and up read, the product written
    case OpKind::kRoute: return 2 * 4 * width(op.in, c);  // fp32 logits written by the router, read by softmax and top-k
    case OpKind::kDispatch: return cb * 2 * rows * width(op.out, c);  // k rows a token, read and written
    case OpKind::kCombine: return cb * (static_cast<double>(c.experts_per_token) + 1) * width(op.out, c);  // k rows read, one written
    default: return 0;
  }
}

double op_saved_bytes(const Op& op, const ModelConfig& c, double cb) {
  const double rows = rows_per_token(op, c);
  double b = 0;
  if (op.saves_in) b += cb * rows * width(op.in, c);
  if (op.saves_out) b += cb * rows * width(op.out, c);
  if (op.kind == OpKind::kNorm) b += 4;  // its fp32 1/rms
  return b;
}

}  // namespace megatrain::arch

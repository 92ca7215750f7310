// ModelSpec: reading HF config.json for Llama, Mistral and Qwen2, and the derived counts.
#include "megatrain/core/model_spec.h"
#include "megatrain/core/arch.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "detail/json_reader.h"
#include "megatrain/core/profiles.h"

namespace megatrain {
namespace {

using detail::Json;

struct ArchInfo {
  const char* architecture;
  const char* model_type;
};
constexpr ArchInfo kArchs[] = {
    {"LlamaForCausalLM", "llama"},
    {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3"},
    {"Qwen3MoeForCausalLM", "qwen3_moe"},
    {"MixtralForCausalLM", "mixtral"},
    {"GptOssForCausalLM", "gpt_oss"},
};
// Mixture-of-Experts architectures whose blocks change the math beyond these (shared experts,
// multi-head latent attention): refused by name until they are built.
constexpr const char* kLaterArchs[] = {"DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Glm4MoeForCausalLM",
                                       "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "DbrxForCausalLM",
                                       "JambaForCausalLM", "Llama4ForCausalLM", "PhimoeForCausalLM"};

std::string supported_list() {
  std::string s;
  for (const auto& a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a.architecture);
  return s;
}

// transformers 5 writes RoPE as one object, rope_parameters {rope_theta, rope_type, factor, ...},
// where earlier releases (and the published configs) write rope_theta and rope_scaling. The object
// is read as those two keys; a config that gives both forms must give the same theta.
Status fold_rope_parameters(Json& j, const std::string& what) {
  auto rp = j.find("rope_parameters");
  if (rp == j.end() || rp->is_null()) return {};
  if (!rp->is_object()) return invalid_argument(what + ": rope_parameters: expected an object (transformers 5), got " + rp->dump());
  Json params = *rp;
  if (auto th = params.find("rope_theta"); th != params.end()) {
    if (!th->is_number()) return invalid_argument(what + ": rope_parameters.rope_theta: expected a number, got " + th->dump());
    if (auto top = j.find("rope_theta"); top != j.end() && top->is_number() && top->get<double>() != th->get<double>())
      return invalid_argument(what + ": rope_theta " + top->dump() + " contradicts rope_parameters.rope_theta " + th->dump());
    j["rope_theta"] = *th;
    params.erase("rope_theta");
  }
  auto type = params.find("rope_type");
  const bool scaled = type != params.end() && !(type->is_string() && type->get<std::string>() == "default");
  if (scaled) {
    if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null() && *rs != params)
      return invalid_argument(what + ": rope_scaling " + rs->dump() + " contradicts rope_parameters " + rp->dump());
    j["rope_scaling"] = params;
  }
  j.erase("rope_parameters");
  return {};
}

// Reads an optional integer that HF writes as null when unused (sliding_window).
Status read_nullable_int(const Json& j, const std::string& key, int64_t& out, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_number_integer() && !it->is_number_unsigned())
    return invalid_argument(what + ": " + key + ": expected an integer or null, got " + detail::json_type_name(*it));
  out = it->get<int64_t>();
  if (out < 0) return invalid_argument(what + ": " + key + ": " + std::to_string(out) + " must be >= 0");
  return {};
}

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFp32: return "fp32";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
  }
  return "?";
}

Result<DType> parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::kFp32;
  if (s == "bf16") return DType::kBf16;
  if (s == "fp16") return DType::kFp16;
  return invalid_argument("'" + s + "' is not a dtype; accepted: fp32, bf16, fp16");
}

size_t dtype_bytes(DType d) { return d == DType::kFp32 ? 4 : 2; }

const char* state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::kFp32: return "fp32";
    case StateFormat::kBf16: return "bf16";
    case StateFormat::kQ8: return "q8";
    case StateFormat::kQ4: return "q4";
    case StateFormat::kQ3: return "q3";
    case StateFormat::kQ2: return "q2";
  }
  return "?";
}

Result<StateFormat> parse_state_format(const std::string& s) {
  for (StateFormat f : {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kQ8, StateFormat::kQ4,
                        StateFormat::kQ3, StateFormat::kQ2})
    if (s == state_format_name(f)) return f;
  return invalid_argument("'" + s + "' is not a state format; accepted: fp32, bf16, q8, q4, q3, q2");
}

std::vector<int64_t> moment_array_bytes(StateFormat f, const std::vector<int64_t>& tensor_numels, int64_t block_size) {
  int64_t numel = 0, blocks = 0;
  for (int64_t n : tensor_numels) numel += n;
  if (f == StateFormat::kFp32) return {4 * numel};
  if (f == StateFormat::kBf16) return {2 * numel};
  for (int64_t n : tensor_numels) blocks += block_size > 0 ? (n + block_size - 1) / block_size : 0;
  return {blocks * block_size * state_format_bits(f) / 8, 4 * blocks};
}

int64_t state_format_bytes(StateFormat f, const std::vector<int64_t>& tensor_numels, int64_t block_size) {
  int64_t bytes = 0;
  for (int64_t b : moment_array_bytes(f, tensor_numels, block_size)) bytes += b;
  return bytes;
}

int state_format_bits(StateFormat f) {
  switch (f) {
    case StateFormat::kQ8: return 8;
    case StateFormat::kQ4: return 4;
    case StateFormat::kQ3: return 3;
    case StateFormat::kQ2: return 2;
    default: return 0;
  }
}

double state_format_bytes_per_element(StateFormat f, int64_t block_size) {
  const double scale = block_size > 0 ? 4.0 / static_cast<double>(block_size) : 0.0;  // one fp32 scale per block
  switch (f) {
    case StateFormat::kFp32: return 4;
    case StateFormat::kBf16: return 2;
    case StateFormat::kQ8: return 1 + scale;
    case StateFormat::kQ4: return 0.5 + scale;
    case StateFormat::kQ3: return 0.375 + scale;
    case StateFormat::kQ2: return 0.25 + scale;
  }
  return 4;
}

PrecisionSetup PrecisionSetup::fp32() { return PrecisionSetup{"fp32", DType::kFp32, DType::kFp32}; }
PrecisionSetup PrecisionSetup::mixed() { return PrecisionSetup{"mixed", DType::kBf16, DType::kBf16}; }

Result<ModelSpec> ModelSpec::from_config_json(const std::string& json_text, const std::string& what) {
  MT_ASSIGN_OR_RETURN(Json j, detail::parse_json(json_text, what));
  if (!j.is_object()) return invalid_argument(what + ": expected a JSON object (a Hugging Face config.json), got " +
                                              detail::json_type_name(j));
  ModelConfig c;
  MT_RETURN_IF_ERROR(fold_rope_parameters(j, what));

  // The architecture decides the layer semantics; it must be one we implement exactly.
  auto arch_it = j.find("architectures");
  if (arch_it == j.end())
    return invalid_argument(what + ": architectures: missing; expected a list with one of: " + supported_list());
  if (!arch_it->is_array() || arch_it->size() != 1 || !(*arch_it)[0].is_string())
    return invalid_argument(what + ": architectures: expected a list with exactly one name, one of: " + supported_list());
  c.architecture = (*arch_it)[0].get<std::string>();
  const ArchInfo* arch = nullptr;
  for (const auto& a : kArchs)
    if (c.architecture == a.architecture) arch = &a;
  for (const char* later : kLaterArchs)
    if (c.architecture == later)
      return unsupported(what + ": architectures: '" + c.architecture +
                         "' is a Mixture-of-Experts design (shared experts or latent attention) that MegaTrain does not "
                         "build yet; it is a later step. Supported: " + supported_list());
  if (!arch)
    return unsupported(what + ": architectures: '" + c.architecture + "' is not supported; supported: " + supported_list());
  c.model_type = arch->model_type;
  if (auto mt = j.find("model_type"); mt != j.end()) {
    if (!mt->is_string() || mt->get<std::string>() != arch->model_type)
      return invalid_argument(what + ": model_type: '" + (mt->is_string() ? mt->get<std::string>() : mt->dump()) +
                              "' contradicts architectures '" + c.architecture + "' (expected '" + arch->model_type + "')");
  }

  // HF configs carry many keys we do not need (token ids, versions): those are not checked.
  // Keys that change the layer's math are read strictly.
  detail::FieldReader r(j, "");
  const int64_t kBig = int64_t{1} << 40;
  r.integer("vocab_size", c.vocab_size, detail::Need::kRequired, 1, kBig);
  r.integer("hidden_size", c.hidden_size, detail::Need::kRequired, 1, kBig);
  r.integer("intermediate_size", c.intermediate_size, detail::Need::kRequired, 1, kBig);
  r.integer("num_hidden_layers", c.num_layers, detail::Need::kRequired, 1, 100000);
  r.integer("num_attention_heads", c.num_heads, detail::Need::kRequired, 1, 1 << 20);
  c.num_kv_heads = c.num_heads;  // HF default when the key is absent (multi-head attention)
  r.integer("num_key_value_heads", c.num_kv_heads, detail::Need::kOptional, 1, 1 << 20);
  c.max_position_embeddings = 2048;
  r.integer("max_position_embeddings", c.max_position_embeddings, detail::Need::kOptional, 1, kBig);
  r.number("rms_norm_eps", c.rms_norm_eps, detail::Need::kOptional, 0, 1);
  r.number("rope_theta", c.rope_theta, detail::Need::kOptional, 1e-9, 1e30);
  r.boolean("tie_word_embeddings", c.tie_word_embeddings, detail::Need::kOptional);
  r.string("hidden_act", c.hidden_act, detail::Need::kOptional);
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) c.torch_dtype = j["torch_dtype"].get<std::string>();
  if (!r.ok()) return r.finish().with_context(what);

  if (c.hidden_act != "silu")
    return unsupported(what + ": hidden_act: '" + c.hidden_act + "' is not supported; accepted: silu (SwiGLU MLP)");
  const bool moe_arch = c.model_type == "qwen3_moe" || c.model_type == "mixtral" || c.model_type == "gpt_oss";
  if (!moe_arch) {
    for (const char* moe_key : {"num_local_experts", "num_experts", "n_routed_experts"}) {
      if (auto it = j.find(moe_key); it != j.end() && it->is_number() && it->get<double>() > 0)
        return unsupported(what + ": " + moe_key + ": " + c.architecture +
                           " is dense; mixture-of-experts configs are accepted for Qwen3MoeForCausalLM, MixtralForCausalLM "
                           "and GptOssForCausalLM");
    }
  }
  // Keys that would change the math in ways none of these architectures define.
  for (const char* k : {"n_shared_experts", "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank",
                        "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group"}) {
    if (auto it = j.find(k); it != j.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0))
      return unsupported(what + ": " + k + ": shared experts and latent attention (DeepSeek-V3, GLM-4.5) are a later step; "
                         "accepted: Mixtral, Qwen3-MoE and gpt-oss blocks without it");
  }
  if (moe_arch) {
    c.moe = c.model_type;
    c.norm_topk_prob = c.model_type == "mixtral";
    detail::FieldReader m(j, "");
    if (c.model_type == "qwen3_moe") {
      // The published configs say num_experts; transformers 5 writes num_local_experts (its
      // Qwen3MoeConfig renamed the attribute). Either is read; both must agree.
      auto ne = j.find("num_experts"), nl = j.find("num_local_experts");
      if (ne != j.end() && nl != j.end() && !ne->is_null() && !nl->is_null() && *ne != *nl)
        return invalid_argument(what + ": num_experts " + ne->dump() + " and num_local_experts " + nl->dump() +
                                " disagree; give one (transformers 5 writes num_local_experts)");
      m.integer(ne != j.end() && !ne->is_null() ? "num_experts" : "num_local_experts", c.num_experts, detail::Need::kRequired, 1,
                1 << 16);
      m.integer("moe_intermediate_size", c.moe_intermediate_size, detail::Need::kRequired, 1, kBig);
      c.norm_topk_prob = false;  // Qwen3MoeConfig's default
      m.boolean("norm_topk_prob", c.norm_topk_prob, detail::Need::kOptional);
      m.integer("decoder_sparse_step", c.decoder_sparse_step, detail::Need::kOptional, 1, 100000);
      c.router_aux_loss_coef = 0.001;
    } else {
      m.integer("num_local_experts", c.num_experts, detail::Need::kRequired, 1, 1 << 16);
      c.moe_intermediate_size = c.intermediate_size;  // Mixtral and gpt-oss: intermediate_size is one expert's
      c.router_aux_loss_coef = c.model_type == "mixtral" ? 0.001 : 0.9;
    }
    c.experts_per_token = c.model_type == "gpt_oss" ? 4 : 2;
    if (auto a = j.find("experts_per_token"), b = j.find("num_experts_per_tok"); a != j.end() && b != j.end() && *a != *b)
      return invalid_argument(what + ": experts_per_token " + a->dump() + " and num_experts_per_tok " + b->dump() +
                              " disagree; give one (they are the same setting)");
    if (j.contains("experts_per_token")) m.integer("experts_per_token", c.experts_per_token, detail::Need::kOptional, 1, 1 << 16);
    m.integer("num_experts_per_tok", c.experts_per_token, detail::Need::kOptional, 1, 1 << 16);
    m.number("router_aux_loss_coef", c.router_aux_loss_coef, detail::Need::kOptional, 0, 1e6);
    m.boolean("output_router_logits", c.output_router_logits, detail::Need::kOptional);
    if (!m.ok()) return m.finish().with_context(what);
    if (c.experts_per_token > c.num_experts)
      return invalid_argument(what + ": num_experts_per_tok " + std::to_string(c.experts_per_token) + " exceeds the " +
                              std::to_string(c.num_experts) + " experts");
    if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_array()) return invalid_argument(what + ": mlp_only_layers: expected a list of layer indices");
      for (const auto& v : *it) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_layers)
          return invalid_argument(what + ": mlp_only_layers: " + v.dump() + " is not a layer index in [0, " +
                                  std::to_string(c.num_layers) + ")");
        c.mlp_only_layers.push_back(v.get<int64_t>());
      }
      if (!c.mlp_only_layers.empty() && c.model_type != "qwen3_moe")
        return unsupported(what + ": mlp_only_layers: only Qwen3-MoE has dense layers among its MoE layers");
    }
    if (auto it = j.find("router_jitter_noise"); it != j.end() && it->is_number() && it->get<double>() != 0)
      return unsupported(what + ": router_jitter_noise: " + it->dump() + " makes routing random; accepted: 0");
  }
  if (c.model_type == "qwen3" || c.model_type == "qwen3_moe") c.qk_norm = true;
  if (c.model_type == "gpt_oss") {
    c.attention_sinks = true;
    c.swiglu_limit = 7.0;
    detail::FieldReader g(j, "");
    g.number("swiglu_limit", c.swiglu_limit, detail::Need::kOptional, 0, 1e9);
    if (!g.ok()) return g.finish().with_context(what);
    // transformers fills these from GptOssConfig's defaults, which have changed between versions;
    // a config without them is refused, naming the key, rather than trained on a guess.
    for (const auto& [key, hf] : {std::pair<const char*, const char*>{"sliding_window", "128"},
                                  {"layer_types", "sliding and full attention alternating, from sliding"},
                                  {"rope_scaling", "yarn, factor 32, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1"}})
      if (auto it = j.find(key); it == j.end() || it->is_null())
        return invalid_argument(what + ": " + key + ": missing; a gpt-oss config must give it (the published models do; transformers "
                                "would assume " + hf + "): add it to config.json");
  }

  // head_dim: explicit in newer configs (Mistral Large 2 uses it); otherwise hidden / heads.
  if (auto hd = j.find("head_dim"); hd != j.end() && !hd->is_null()) {
    if (!hd->is_number_integer() || hd->get<int64_t>() <= 0)
      return invalid_argument(what + ": head_dim: expected a positive integer, got " + hd->dump());
    c.head_dim = hd->get<int64_t>();
  } else {
    if (c.hidden_size % c.num_heads != 0)
      return invalid_argument(what + ": hidden_size " + std::to_string(c.hidden_size) +
                              " is not divisible by num_attention_heads " + std::to_string(c.num_heads) +
                              "; give head_dim explicitly or fix one of them");
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.num_heads % c.num_kv_heads != 0)
    return invalid_argument(what + ": num_key_value_heads " + std::to_string(c.num_kv_heads) +
                            " does not divide num_attention_heads " + std::to_string(c.num_heads) +
                            " (grouped-query attention needs whole groups)");
  if (c.head_dim % 2 != 0)
    return invalid_argument(what + ": head_dim " + std::to_string(c.head_dim) + " is odd; RoPE rotates pairs");

  // Biases as each HF implementation defines them.
  if (c.model_type == "qwen2") {
    c.qkv_bias = true;  // Qwen2Attention: q/k/v with bias, o_proj without
    for (const char* k : {"attention_bias", "mlp_bias"}) {
      if (auto it = j.find(k); it != j.end() && it->is_boolean() && it->get<bool>() != (std::string(k) == "attention_bias"))
        return invalid_argument(what + ": " + k + ": Qwen2 fixes q/k/v bias on and o/mlp bias off; the value contradicts it");
    }
  } else if (c.model_type == "llama") {
    bool attention_bias = false, mlp_bias = false;
    for (auto [k, dst] : {std::pair{"attention_bias", &attention_bias}, std::pair{"mlp_bias", &mlp_bias}}) {
      if (auto it = j.find(k); it != j.end()) {
        if (!it->is_boolean()) return invalid_argument(what + ": " + k + ": expected true or false, got " + it->dump());
        *dst = it->get<bool>();
      }
    }
    c.qkv_bias = c.o_bias = attention_bias;
    c.mlp_bias = mlp_bias;
  } else if (c.model_type == "qwen3" || c.model_type == "qwen3_moe" || c.model_type == "gpt_oss") {
    // Qwen3Attention and GptOssAttention: attention_bias puts a bias on q, k, v and o alike
    // (gpt-oss publishes true); no MLP bias (gpt-oss' expert biases are their own tensors).
    bool attention_bias = c.model_type == "gpt_oss";
    if (auto it = j.find("attention_bias"); it != j.end()) {
      if (!it->is_boolean()) return invalid_argument(what + ": attention_bias: expected true or false, got " + it->dump());
      attention_bias = it->get<bool>();
    }
    c.qkv_bias = c.o_bias = attention_bias;
    if (c.model_type == "qwen3_moe" && c.o_bias)
      return unsupported(what + ": attention_bias: true is not supported for Qwen3-MoE yet; accepted: false");
  } else {  // mistral, mixtral: no biases at all
    for (const char* k : {"attention_bias", "mlp_bias"}) {
      if (auto it = j.find(k); it != j.end() && it->is_boolean() && it->get<bool>())
        return invalid_argument(what + ": " + k + ": MistralForCausalLM has no biases; true contradicts the architecture");
    }
  }

  // RoPE scaling (Llama 3.1 "llama3", linear, dynamic, yarn): kept for the executor's RoPE.
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    if (!rs->is_object()) return invalid_argument(what + ": rope_scaling: expected an object or null");
    auto t = rs->find("rope_type");
    if (t == rs->end()) t = rs->find("type");
    if (t == rs->end() || !t->is_string())
      return invalid_argument(what + ": rope_scaling.rope_type: missing; expected llama3, linear, dynamic or yarn");
    c.rope_scaling_type = t->get<std::string>();
    // Only what the kernels compute, with numbers that make sense: inspect, simulate and plan must
    // not price a model megatrain-exec would refuse (issue 32 rows 11 and 13).
    const std::string& type = c.rope_scaling_type;
    if (type != "default" && type != "linear" && type != "llama3" && type != "yarn")
      return unsupported(what + ": rope_scaling.rope_type: '" + type + "' is not supported" +
                         (type == "dynamic" ? " (dynamic NTK scaling changes with the sequence length)" : "") +
                         (type == "longrope" || type == "su" ? " (Phi-3's per-frequency factors)" : "") +
                         "; accepted: default, linear, llama3, yarn");
    for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                          "attention_factor"})
      if (auto f = rs->find(k); f != rs->end() && !f->is_null() && !f->is_number())
        return invalid_argument(what + ": rope_scaling." + k + ": expected a number, got " + detail::json_type_name(*f) + " " + f->dump());
    auto number = [&](const char* k) { return rs->find(k) != rs->end() && rs->at(k).is_number() ? rs->at(k).get<double>() : NAN; };
    if (type != "default") {
      const double factor = number("factor");
      if (!(factor > 0 && factor <= 1e4))
        return invalid_argument(what + ": rope_scaling.factor: " + (std::isnan(factor) ? std::string("missing") : rs->at("factor").dump()) +
                                "; accepted: a number in (0, 10000] for rope_type " + type);
    }
    if (type == "llama3") {
      const double lo = number("low_freq_factor"), hi = number("high_freq_factor"), omp = number("original_max_position_embeddings");
      if (!(lo > 0) || !(hi > lo) || !(omp > 0))
        return invalid_argument(what + ": rope_scaling: llama3 needs high_freq_factor > low_freq_factor > 0 and original_max_position_embeddings "
                                "> 0; got low_freq_factor " + (std::isnan(lo) ? std::string("(missing)") : rs->at("low_freq_factor").dump()) +
                                ", high_freq_factor " + (std::isnan(hi) ? std::string("(missing)") : rs->at("high_freq_factor").dump()) +
                                ", original_max_position_embeddings " +
                                (std::isnan(omp) ? std::string("(missing)") : rs->at("original_max_position_embeddings").dump()));
    }
    if (type == "yarn") {
      const double omp = number("original_max_position_embeddings"), fast = number("beta_fast"), slow = number("beta_slow");
      if (!std::isnan(omp) && !(omp > 0))
        return invalid_argument(what + ": rope_scaling.original_max_position_embeddings: " + rs->at("original_max_position_embeddings").dump() +
                                "; accepted: a positive number");
      if ((!std::isnan(fast) && !(fast > 0)) || (!std::isnan(slow) && !(slow > 0)))
        return invalid_argument(what + ": rope_scaling: beta_fast and beta_slow must be positive");
    }
    if (c.rope_scaling_type != "default") {
      if (auto f = rs->find("factor"); f != rs->end() && f->is_number()) c.rope_scaling_factor = f->get<double>();
      if (auto f = rs->find("low_freq_factor"); f != rs->end() && f->is_number()) c.rope_low_freq_factor = f->get<double>();
      if (auto f = rs->find("high_freq_factor"); f != rs->end() && f->is_number()) c.rope_high_freq_factor = f->get<double>();
      if (auto f = rs->find("original_max_position_embeddings"); f != rs->end() && f->is_number())
        c.rope_original_max_position = f->get<double>();
    } else {
      c.rope_scaling_type.clear();
    }
  }
  MT_RETURN_IF_ERROR(read_nullable_int(j, "sliding_window", c.sliding_window, what));
  MT_RETURN_IF_ERROR(read_nullable_int(j, "num_nextn_predict_layers", c.mtp_layers, what));
  if (c.mtp_layers > 64)
    return invalid_argument(what + ": num_nextn_predict_layers: " + std::to_string(c.mtp_layers) +
                            " multi-token-prediction layers; accepted: 0 .. 64");
  if (auto us = j.find("use_sliding_window"); us != j.end() && us->is_boolean() && !us->get<bool>())
    c.sliding_window = 0;  // Qwen2 and Qwen3 publish a window but turn it off
  else if (us != j.end() && us->is_boolean() && us->get<bool>() && (c.model_type == "qwen3" || c.model_type == "qwen3_moe"))
    return unsupported(what + ": use_sliding_window: true (Qwen3 with max_window_layers) is not supported; accepted: false");
  if (auto lt = j.find("layer_types"); lt != j.end() && !lt->is_null()) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != c.num_layers)
      return invalid_argument(what + ": layer_types: expected a list of " + std::to_string(c.num_layers) +
                              " entries, sliding_attention or full_attention");
    for (const auto& v : *lt) {
      const std::string t = v.is_string() ? v.get<std::string>() : v.dump();
      if (t != "sliding_attention" && t != "full_attention")
        return invalid_argument(what + ": layer_types: '" + t + "'; accepted: sliding_attention, full_attention");
      c.layer_sliding.push_back(t == "sliding_attention");
    }
  }
  if (c.rope_scaling_type == "yarn") {
    if (auto rs = j.find("rope_scaling"); rs != j.end() && rs->is_object()) {
      if (auto f = rs->find("beta_fast"); f != rs->end() && f->is_number()) c.rope_beta_fast = f->get<double>();
      if (auto f = rs->find("beta_slow"); f != rs->end() && f->is_number()) c.rope_beta_slow = f->get<double>();
      if (auto f = rs->find("truncate"); f != rs->end() && f->is_boolean()) c.rope_truncate = f->get<bool>();
      if (auto f = rs->find("attention_factor"); f != rs->end() && f->is_number()) c.rope_attention_factor = f->get<double>();
      for (const char* k : {"mscale", "mscale_all_dim"})
        if (auto f = rs->find(k); f != rs->end() && !f->is_null())
          return unsupported(what + ": rope_scaling." + k + " (DeepSeek's YaRN attention factor) is not supported; accepted: "
                             "yarn with factor, beta_fast, beta_slow, truncate, attention_factor and original_max_position_embeddings");
      // HF takes the context the model was trained at from the config when rope_scaling leaves it out.
      if (rs->find("original_max_position_embeddings") == rs->end())
        c.rope_original_max_position = static_cast<double>(c.max_position_embeddings);
    }
  }

  // Every count and byte figure downstream is an int64: a config whose sizes multiply past what
  // can be counted (vocab_size and hidden_size 2^40) is refused here, before any is computed, and so
  // is one with more tensors than can be listed (65,536 experts in each of 100,000 layers).
  {
    using Wide = long double;  // exact to 2^64, and no product of these sizes overflows it
    auto sci = [](Wide x) {
      char b[32];
      std::snprintf(b, sizeof(b), "%.3g", static_cast<double>(x));
      return std::string(b);
    };
    // Counted from the architecture's tensor tables (arch.h), exactly, without listing them.
    const arch::Extent x = arch::extent(c);
    const Wide total = x.parameters;
    const Wide E = c.is_moe() ? static_cast<Wide>(c.num_experts) : 0;
    constexpr Wide kMaxParameters = 1125899906842624.0L;  // 2^50 = 1.1e15: a thousand times the largest models
    if (total > kMaxParameters)
      return invalid_argument(what + ": the sizes (vocab_size " + std::to_string(c.vocab_size) + ", hidden_size " +
                              std::to_string(c.hidden_size) + ", intermediate_size " + std::to_string(c.intermediate_size) +
                              ", num_hidden_layers " + std::to_string(c.num_layers) + ", heads x head_dim " + std::to_string(c.num_heads) +
                              " x " + std::to_string(c.head_dim) + (E > 0 ? ", num_experts " + std::to_string(c.num_experts) +
                                                                            " x moe_intermediate_size " + std::to_string(c.moe_intermediate_size)
                                                                      : std::string()) +
                              ") give " + sci(total) +
                              " parameters; at most 2^50 (1.1e15) can be counted and stored");
    const Wide tensors = x.tensors;
    if (tensors > 16777216.0L)
      return invalid_argument(what + ": num_hidden_layers " + std::to_string(c.num_layers) + " x num_experts " + std::to_string(c.num_experts) +
                              " give " + sci(tensors) + " tensors; at most 2^24 (16.8 million)");
  }

  ModelSpec spec;
  spec.config_ = c;
  spec.config_json_ = j.dump(2);

  // The tensors in HF state-dict order, laid out from the architecture's tensor tables (arch.h).
  spec.tensors_ = arch::tensor_list(c);
  return spec;
}

Result<ModelSpec> ModelSpec::load(const std::string& name_or_path) {
  MT_ASSIGN_OR_RETURN(std::filesystem::path path, resolve_profile("models", name_or_path));
  MT_ASSIGN_OR_RETURN(Json j, detail::read_json_file(path, "model config"));
  MT_ASSIGN_OR_RETURN(ModelSpec spec, from_config_json(j.dump(), path.string()));
  // A profile is named by its file; an HF folder by the folder that holds config.json.
  if (path.filename() == "config.json" && path.has_parent_path())
    spec.name_ = std::filesystem::absolute(path).parent_path().filename().string();
  else
    spec.name_ = path.stem().string();
  return spec;
}

std::vector<TensorInfo> ModelSpec::layer_tensors(int64_t layer) const {
  std::vector<TensorInfo> out;
  for (const auto& t : tensors_)
    if (t.layer == layer) out.push_back(t);
  return out;
}


ParameterCounts ModelSpec::parameter_counts() const {
  const ModelConfig& c = config_;
  ParameterCounts pc;
  pc.layer.assign(static_cast<size_t>(c.num_layers), 0);
  for (const auto& t : tensors_) {
    if (t.role == TensorRole::kEmbedding) pc.embedding += t.numel;
    else if (t.role == TensorRole::kHead) pc.head += t.numel;
    else if (t.role == TensorRole::kFinalNorm) pc.final_norm += t.numel;
    else if (t.layer == 0) pc.per_layer += t.numel;
    if (t.layer >= 0) {
      pc.layers += t.numel;
      pc.layer[static_cast<size_t>(t.layer)] += t.numel;
    }
    if (arch::role_traits(t.role).expert) pc.experts += t.numel;
    if (t.role == TensorRole::kRouter || t.role == TensorRole::kRouterBias) pc.router += t.numel;
    pc.total += t.numel;
  }
  pc.active = pc.total;
  if (c.is_moe()) {
    for (int64_t l = 0; l < c.num_layers; ++l) pc.moe_layers += c.is_moe_layer(l) ? 1 : 0;
    if (pc.moe_layers > 0) pc.per_expert = pc.experts / (pc.moe_layers * c.num_experts);
    // One token runs k of the E experts of every MoE layer.
    pc.active = pc.total - pc.moe_layers * (c.num_experts - c.experts_per_token) * pc.per_expert;
  }
  return pc;
}

FlopsPerToken ModelSpec::flops_per_token(int64_t seq_len, double attention_span) const {
  const ModelConfig& c = config_;
  const double s = static_cast<double>(seq_len > 0 ? seq_len : c.max_position_embeddings);
  const double keys = attention_span > 0 ? attention_span : s;
  FlopsPerToken f;
  f.seq_len = static_cast<int64_t>(s);
  // Each layer's ops (arch::layer_ops): the attention half's linears, the attention, then the MLP
  // block's GEMMs (the router and the k chosen experts in a MoE layer).
  double layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    double projections = 0, attention = 0, block = 0, router = 0, experts = 0;
    for (const arch::Op& op : arch::layer_ops(c, l)) {
      const double x = arch::op_flops(op, c, keys);
      if (op.kind == arch::OpKind::kAttention) attention += x;
      else if (op.part == arch::Part::kAttention) projections += x;
      else block += x;
      if (op.weight == TensorRole::kRouter) router += x;
      if (op.kind == arch::OpKind::kGroupedLinear) experts += x;
    }
    f.attention_forward = attention;
    if (c.is_moe_layer(l)) {
      f.router_forward = router;
      f.experts_forward = experts;
    }
    const double lf = projections + attention + block;
    f.layer_forwards.push_back(lf);
    layers += lf;
  }
  f.layer_forward = c.num_layers > 0 ? layers / static_cast<double>(c.num_layers) : 0;
  f.head_forward = 2 * static_cast<double>(c.hidden_size) * static_cast<double>(c.vocab_size);
  f.forward = layers + f.head_forward;
  f.backward = 2 * f.forward;
  f.recompute = layers;
  return f;
}

StateBytes ModelSpec::training_state_bytes(const PrecisionSetup& p) const {
  const double n = static_cast<double>(parameter_counts().total);
  StateBytes b;
  b.master = 4 * n;
  b.gradients = static_cast<double>(dtype_bytes(p.transfer)) * n;
  b.m = state_format_bytes_per_element(p.m_format, p.block_size) * n;
  b.v = state_format_bytes_per_element(p.v_format, p.block_size) * n;
  b.streaming_copy = p.transfer == DType::kFp32 ? 0 : static_cast<double>(dtype_bytes(p.transfer)) * n;
  return b;
}

ActivationBytes ModelSpec::activation_bytes_per_token_per_layer(int64_t seq_len, size_t compute_bytes) const {
  const ModelConfig& c = config_;
  const double b = static_cast<double>(compute_bytes);
  const double heads = static_cast<double>(c.num_heads);
  const double s = static_cast<double>(seq_len > 0 ? seq_len : c.max_position_embeddings);
  // What backward needs when nothing is recomputed: each op's saved inputs and outputs
  // (arch::layer_ops: the norms' inputs and outputs and their fp32 1/rms, v, q and k after RoPE
  // (and before Qwen3's per-head norms), the attention output, the MLP's gate, up and product, or
  // a MoE layer's router logits and probabilities and its k slots' gathered inputs, gate, up,
  // product and outputs), for the layer that keeps the most.
  double common = 0;
  for (int64_t l = 0; l < std::max<int64_t>(1, c.num_layers); ++l) {
    double kept = 0;
    for (const arch::Op& op : arch::layer_ops(c, l)) kept += arch::op_saved_bytes(op, c, b);
    common = std::max(common, kept);
  }
  ActivationBytes a;
  a.checkpoint = b * static_cast<double>(c.hidden_size);
  a.full_eager = common + b * heads * s;  // softmax probabilities: one row of s per head
  a.full_flash = common + 4.0 * heads;    // fused attention keeps one fp32 log-sum-exp per head
  return a;
}

}  // namespace megatrain

namespace megatrain {

bool ModelConfig::is_moe_layer(int64_t l) const {
  if (moe.empty() || l < 0 || l >= num_layers) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) != mlp_only_layers.end()) return false;
  return decoder_sparse_step <= 1 || (l + 1) % decoder_sparse_step == 0;
}

bool ModelConfig::is_sliding_layer(int64_t l) const {
  if (sliding_window <= 0 || l < 0) return false;
  if (layer_sliding.empty()) return true;
  return l < static_cast<int64_t>(layer_sliding.size()) && layer_sliding[static_cast<size_t>(l)];
}

const char* tensor_role_name(TensorRole r) { return arch::role_traits(r).name; }

}  // namespace megatrain

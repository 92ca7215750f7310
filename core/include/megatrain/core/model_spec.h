// ModelSpec: a decoder-only transformer read from a Hugging Face config.json (LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, and the Mixture-of-Experts models
// Qwen3MoeForCausalLM, MixtralForCausalLM and GptOssForCausalLM). It lists every tensor with its HF name and shape and
// derives exact parameter counts, training FLOPs per token (generalised Megatron formula),
// training-state bytes per precision setup and activation bytes per token per layer.
// Layer semantics follow the HF implementations (see docs/model-spec.md).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain {

// Element formats for tensors and optimizer states.
enum class DType { kFp32, kBf16, kFp16 };
enum class StateFormat { kFp32, kBf16, kQ8, kQ4, kQ3, kQ2 };

const char* dtype_name(DType d);
Result<DType> parse_dtype(const std::string& s);  // "fp32" | "bf16" | "fp16"
size_t dtype_bytes(DType d);
const char* state_format_name(StateFormat f);
Result<StateFormat> parse_state_format(const std::string& s);  // fp32 | bf16 | q8 | q4 | q3 | q2
// Bytes per element including the per-block fp32 scale of quantised formats.
double state_format_bytes_per_element(StateFormat f, int64_t block_size);
// Bits per code of a quantised format (q8 8, q4 4, q3 3, q2 2); 0 for fp32 and bf16.
int state_format_bits(StateFormat f);
// The arrays of one moment over tensors of these element counts, in bytes, as the executor's
// MomentStore keeps them: {4 n} fp32, {2 n} bf16, or {codes, scales} for a quantised format, which
// pads each tensor to whole blocks of `block_size` and keeps one fp32 scale per block. The one
// function every moment size comes from (the store, the footprint, the NVMe regions and transfers).
std::vector<int64_t> moment_array_bytes(StateFormat f, const std::vector<int64_t>& tensor_numels, int64_t block_size);
// Their sum: the bytes of one moment.
int64_t state_format_bytes(StateFormat f, const std::vector<int64_t>& tensor_numels, int64_t block_size);

struct ModelConfig {
  std::string architecture;     // "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM"
  std::string model_type;       // "llama" | "mistral" | "qwen2"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000;
  std::string rope_scaling_type;  // "" when absent; "llama3", "linear", "dynamic", "yarn"
  double rope_scaling_factor = 1;
  double rope_low_freq_factor = 1;            // llama3 scaling
  double rope_high_freq_factor = 4;           // llama3 scaling
  double rope_original_max_position = 8192;   // llama3 scaling: original_max_position_embeddings
  bool tie_word_embeddings = false;
  bool qkv_bias = false;          // q/k/v projections carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;            // o_proj carries a bias (Llama attention_bias)
  bool mlp_bias = false;          // gate/up/down carry a bias (Llama mlp_bias)
  std::string hidden_act = "silu";
  int64_t sliding_window = 0;     // 0 when full attention
  // Multi-token-prediction modules a checkpoint carries after the decoder layers
  // (num_nextn_predict_layers: DeepSeek-V3, GLM-4.5): model.layers.{L} .. {L + n - 1} are not
  // trained here, and --init skips them by name.
  int64_t mtp_layers = 0;
  std::string torch_dtype;        // as published ("bfloat16"); informative

  // ---- Qwen3 and gpt-oss attention
  bool qk_norm = false;           // per-head RMSNorm of q and k before RoPE (Qwen3: self_attn.q_norm / k_norm, [head_dim])
  bool attention_sinks = false;   // learned per-head sink logits (gpt-oss: self_attn.sinks, [num_heads])
  // Per layer: whether the layer attends within sliding_window (gpt-oss layer_types
  // "sliding_attention"; every layer for Mistral/Mixtral when sliding_window > 0). Empty or all
  // false: every layer attends to the whole causal prefix.
  std::vector<bool> layer_sliding;
  double rope_beta_fast = 32, rope_beta_slow = 1;  // yarn
  bool rope_truncate = true;                       // yarn: HF's `truncate` (round the correction range)
  // yarn: rope_scaling.attention_factor, the factor on cos and sin; 0 when the config leaves it out
  // (HF then takes 0.1 * ln(factor) + 1 for factor > 1, else 1).
  double rope_attention_factor = 0;

  // ---- Mixture-of-Experts ("" for dense models)
  // The router and expert semantics, as HF's modeling code for the architecture defines them:
  //   "mixtral":   logits = gate(x); softmax over all experts; top-k; weights renormalised.
  //   "qwen3_moe": the same, renormalised only when norm_topk_prob.
  //   "gpt_oss":   logits = router(x) + bias; top-k of the logits; softmax over the k chosen.
  std::string moe;
  int64_t num_experts = 0;          // num_local_experts (Mixtral) / num_experts / num_local_experts (gpt-oss)
  int64_t experts_per_token = 0;    // num_experts_per_tok (experts_per_token in gpt-oss' original config)
  int64_t moe_intermediate_size = 0;  // one expert's intermediate size (Mixtral and gpt-oss: intermediate_size)
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;  // Qwen3-MoE: layer l is MoE when (l + 1) % step == 0 and l not in mlp_only_layers
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0;  // load-balancing loss weight
  bool output_router_logits = false;  // HF adds the aux loss to the loss only when true
  double swiglu_alpha = 1.702;      // gpt-oss clamped SwiGLU: (up + 1) * gate * sigmoid(alpha * gate)
  double swiglu_limit = 0;          // gpt-oss: gate clamped to (-inf, limit], up to [-limit, limit]; 0: none
  bool is_moe() const { return !moe.empty(); }
  // Whether decoder layer l (0-based) has the MoE block (false for dense models and mlp_only_layers).
  bool is_moe_layer(int64_t l) const;
  bool is_sliding_layer(int64_t l) const;
};

enum class TensorRole { kEmbedding, kAttnNorm, kQ, kK, kV, kO, kQBias, kKBias, kVBias, kOBias,
                        kMlpNorm, kGate, kUp, kDown, kGateBias, kUpBias, kDownBias, kFinalNorm, kHead,
                        // Qwen3 / gpt-oss attention
                        kQNorm, kKNorm, kSinks,
                        // MoE: the router [E, H] (and its bias [E], gpt-oss); one expert's gate, up
                        // [I, H] and down [H, I] (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj),
                        // one tensor per expert with TensorInfo::expert set; gpt-oss stacks the
                        // experts: gate_up_proj [E, H, 2I] (gate and up interleaved in the last
                        // dim), its bias [E, 2I], down_proj [E, I, H], its bias [E, H].
                        kRouter, kRouterBias, kExpertGate, kExpertUp, kExpertDown,
                        kExpertGateUp, kExpertGateUpBias, kExpertDownBias,
                        kCount };
constexpr int kTensorRoleCount = static_cast<int>(TensorRole::kCount);
const char* tensor_role_name(TensorRole r);

struct TensorInfo {
  std::string name;             // HF name: "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;   // HF (PyTorch) shape: Linear weights are [out, in]
  int64_t numel = 0;
  int64_t layer = -1;           // -1 for embedding, final norm and head
  TensorRole role = TensorRole::kEmbedding;
  int64_t expert = -1;          // the expert of a per-expert tensor (Mixtral, Qwen3-MoE); -1 otherwise
};

struct ParameterCounts {
  int64_t total = 0;            // unique parameters (a tied head is counted once, in embedding)
  int64_t embedding = 0;        // model.embed_tokens
  int64_t per_layer = 0;        // decoder layer 0 (layers differ only with Qwen3-MoE mlp_only_layers)
  int64_t layers = 0;           // all decoder layers
  // Mixture-of-Experts (all 0 for dense models but active, which equals total there):
  int64_t active = 0;           // parameters one token uses: total less the (E - k) unchosen experts of every MoE layer
  int64_t experts = 0;          // every expert of every layer
  int64_t per_expert = 0;       // one expert of one MoE layer (with its biases)
  int64_t router = 0;           // every layer's router (and router bias)
  int64_t moe_layers = 0;       // decoder layers with the MoE block
  std::vector<int64_t> layer;   // parameters of each decoder layer
  int64_t final_norm = 0;       // model.norm
  int64_t head = 0;             // lm_head; 0 when tied
};

// FLOPs per token, counting matrix multiplies as 2*m*n*k (Megatron convention: element-wise work,
// norms and softmax are not counted; the attention score and value products are counted over the
// full sequence, without causal halving). Backward is twice the forward of every matmul.
struct FlopsPerToken {
  int64_t seq_len = 0;
  double forward = 0;           // all layers + LM head
  double backward = 0;          // 2 x forward
  double recompute = 0;         // one extra forward of the layers (not the head), full checkpointing
  double training() const { return forward + backward; }
  double training_with_recompute() const { return forward + backward + recompute; }
  double layer_forward = 0;     // one layer's forward (the mean over layers when they differ)
  std::vector<double> layer_forwards;  // each decoder layer's forward (dense and MoE layers differ)
  double attention_forward = 0; // the seq-dependent part of one layer's forward (QK^T and AV)
  double head_forward = 0;      // LM head forward
  // MoE: FLOPs count the k experts a token uses (active parameters), not all E.
  double router_forward = 0;    // one MoE layer's router GEMM, per token
  double experts_forward = 0;   // one MoE layer's k experts, per token
};

// How a training state is held: the precision of compute and transfer, and the optimizer formats.
struct PrecisionSetup {
  std::string name;                  // "fp32", "mixed"
  DType compute = DType::kFp32;      // weights and activations on the device
  DType transfer = DType::kFp32;     // streaming copy and gradients crossing the link
  StateFormat m_format = StateFormat::kFp32;
  StateFormat v_format = StateFormat::kFp32;
  int64_t block_size = 128;          // for quantised formats
  static PrecisionSetup fp32();      // fp32 everything: 16 bytes/param
  static PrecisionSetup mixed();     // bf16 compute+transfer, fp32 master and moments: 16 bytes/param
};

// Host-side training state (bytes), the part that does not fit on one GPU.
struct StateBytes {
  double master = 0;                 // fp32 master weights
  double gradients = 0;              // one gradient per parameter, in the transfer dtype
  double m = 0, v = 0;               // Adam moments
  double streaming_copy = 0;         // the weights in the transfer dtype, when it is not fp32
  double total() const { return master + gradients + m + v + streaming_copy; }
};

// Activation bytes per token per layer kept for backward. `compute_bytes` is the compute dtype size.
struct ActivationBytes {
  double checkpoint = 0;        // full recompute: only the layer input is kept
  double full_eager = 0;        // no recompute, attention probabilities materialised (s x s per head)
  double full_flash = 0;        // no recompute, fused attention (keeps only log-sum-exp per head)
};

class ModelSpec {
 public:
  // `what` names the source in error messages (a path or a profile name).
  static Result<ModelSpec> from_config_json(const std::string& json_text, const std::string& what = "config.json");
  // A path to config.json, a folder holding one, or a name in profiles/models/.
  static Result<ModelSpec> load(const std::string& name_or_path);

  const ModelConfig& config() const { return config_; }
  const std::string& name() const { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }
  // The config as canonical JSON text (the original keys as read, so a plan can embed it).
  const std::string& config_json() const { return config_json_; }

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Tensors of one decoder layer, in HF state-dict order.
  std::vector<TensorInfo> layer_tensors(int64_t layer) const;
  ParameterCounts parameter_counts() const;
  // seq_len 0 means the model's max_position_embeddings. attention_span: the keys per query the
  // attention counts (TrainingConfig::attention_span: fewer in rows packed "neat"); 0: seq_len.
  FlopsPerToken flops_per_token(int64_t seq_len = 0, double attention_span = 0) const;
  StateBytes training_state_bytes(const PrecisionSetup& p) const;
  ActivationBytes activation_bytes_per_token_per_layer(int64_t seq_len, size_t compute_bytes) const;

 private:
  ModelConfig config_;
  std::string name_;
  std::string config_json_;
  std::vector<TensorInfo> tensors_;
};

}  // namespace megatrain

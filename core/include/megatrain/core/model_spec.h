// ModelSpec: a decoder-only transformer read from a Hugging Face config.json (LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM). It lists every tensor with its HF name and shape and
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
// Exact bytes of one moment array over tensors of these element counts, as the executor stores it:
// quantised formats pad each tensor to whole blocks of `block_size` and keep one fp32 scale per block.
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
  std::string torch_dtype;        // as published ("bfloat16"); informative
};

enum class TensorRole { kEmbedding, kAttnNorm, kQ, kK, kV, kO, kQBias, kKBias, kVBias, kOBias,
                        kMlpNorm, kGate, kUp, kDown, kGateBias, kUpBias, kDownBias, kFinalNorm, kHead };

struct TensorInfo {
  std::string name;             // HF name: "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;   // HF (PyTorch) shape: Linear weights are [out, in]
  int64_t numel = 0;
  int64_t layer = -1;           // -1 for embedding, final norm and head
  TensorRole role = TensorRole::kEmbedding;
};

struct ParameterCounts {
  int64_t total = 0;            // unique parameters (a tied head is counted once, in embedding)
  int64_t embedding = 0;        // model.embed_tokens
  int64_t per_layer = 0;        // one decoder layer (all layers are identical)
  int64_t layers = 0;           // per_layer * num_layers
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
  double layer_forward = 0;     // one layer's forward
  double attention_forward = 0; // the seq-dependent part of one layer's forward (QK^T and AV)
  double head_forward = 0;      // LM head forward
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
  // seq_len 0 means the model's max_position_embeddings.
  FlopsPerToken flops_per_token(int64_t seq_len = 0) const;
  StateBytes training_state_bytes(const PrecisionSetup& p) const;
  ActivationBytes activation_bytes_per_token_per_layer(int64_t seq_len, size_t compute_bytes) const;

 private:
  ModelConfig config_;
  std::string name_;
  std::string config_json_;
  std::vector<TensorInfo> tensors_;
};

}  // namespace megatrain

// Architectures as descriptions (issue 47, part 1, first slice: the tensor tables).
//
// A model's tensors are not written out per architecture in code: each block of a decoder (the
// attention, a dense MLP, each kind of MoE block, the layer's norms, the embedding and the head)
// is a table of rules, one per Hugging Face tensor, with its name, its symbolic shape, its role,
// the config switch that adds it and whether it is one per expert. ModelSpec lays the tables out
// in state-dict order for a config, and what is known of each role (its name, whether AdamW
// decays it, how it is initialised, whether it is an expert's) is one table too, read by the
// parameter counts, the initialisation and the optimizer. A new architecture is a new table.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "megatrain/core/model_spec.h"

namespace megatrain::arch {

// How a fresh tensor is initialised (HostState::init_random): a normal draw of the run's std,
// ones (RMSNorm weights) or zeros (biases).
enum class Init { kNormal, kOnes, kZeros };

// What holds for every tensor of a role, whatever the architecture.
struct RoleTraits {
  const char* name;  // tensor_role_name
  bool decay;        // AdamW's weight decay applies (not to norms and biases, as HF Trainer does)
  Init init;
  bool expert;       // an expert's weights (counted in ParameterCounts::experts)
};
const RoleTraits& role_traits(TensorRole r);

// The symbols of a tensor's shape, read from the config.
enum class Dim : uint8_t {
  kVocab,         // vocab_size
  kHidden,        // hidden_size
  kIntermediate,  // intermediate_size (a dense MLP)
  kQ,             // num_heads x head_dim
  kKv,            // num_kv_heads x head_dim
  kHeadDim,       // head_dim
  kHeads,         // num_heads
  kExperts,       // num_experts
  kExpertInter,   // moe_intermediate_size
  kExpertInter2,  // 2 x moe_intermediate_size (gate and up side by side)
  kQKv,           // (num_heads + num_kv_heads) x head_dim: q and k together (RoPE, per-head norms)
};

// The config switch a rule needs (kAlways: every config of the block's architecture).
enum class When : uint8_t { kAlways, kQkvBias, kOBias, kQkNorm, kMlpBias, kSinks, kUntiedHead };

// One Hugging Face tensor of a block. `name` follows the block's prefix ("model.layers.{l}.");
// a per-expert rule's name follows "<expert_prefix>{e}.".
struct TensorRule {
  const char* name;
  std::array<Dim, 3> shape;
  int rank;  // 1 to 3: the first `rank` symbols of `shape`
  TensorRole role;
  When when = When::kAlways;
  bool per_expert = false;
};

// A block: its rules in state-dict order, and for per-expert rules the prefix of expert e's
// tensors (they come after the block's other tensors, expert by expert, in the rules' order).
struct Block {
  const char* name;          // for people: "attention", "mixtral MoE", ...
  const char* prefix;        // "" or "model.layers.{l}." ({l}: the layer)
  const char* expert_prefix; // "block_sparse_moe.experts." (with {l}'s prefix before it), or ""
  std::span<const TensorRule> rules;
};

// The blocks of each part of a model.
const Block& embedding_block();
const Block& attention_block();
// The MLP of layer l for a config: the dense MLP, or the MoE block its `moe` names
// (mixtral, qwen3_moe, gpt_oss).
const Block* mlp_block(const ModelConfig& c, int64_t layer);
const Block& layer_norms_block();
const Block& head_block();  // the final norm, and the head unless tied

// The value of a shape symbol, and whether a rule's switch is on, for a config.
int64_t dim_value(Dim d, const ModelConfig& c);
bool rule_applies(When w, const ModelConfig& c);

// The tensors of a config in Hugging Face state-dict order, laid out from the tables.
std::vector<TensorInfo> tensor_list(const ModelConfig& c);

// How many parameters and tensors tensor_list(c) would give, counted from the tables in long
// double without listing them (exact to 2^64), so that a config too large to count in int64 or to
// list is refused before either is tried.
struct Extent {
  long double parameters = 0, tensors = 0;
};
Extent extent(const ModelConfig& c);

// ---- the decoder layer as ops (issue 47, part 1, second slice) ----------------------------------
//
// A decoder layer's forward, in order, as typed ops over rows: one row per token, or, for the ops
// between a MoE block's dispatch and its combine, one row per expert slot (k per token). What the
// project knows of a layer's work is derived from these lists: its matrix-multiply FLOPs
// (ModelSpec::flops_per_token), the bytes its backward keeps (ModelSpec::
// activation_bytes_per_token_per_layer) and the cost model's op-level terms (sim::CostModel, each
// op costed by its kind) and the CPU backend's layer forward (exec::LayerMathT, which runs the list
// op by op over the values it names).
enum class OpKind : uint8_t {
  kNorm,           // RMSNorm of a row of `in` (its weight: `weight`), keeping its fp32 1/rms
  kLinear,         // a row of `in` times `weight` [out, in] (and its bias)
  kHeadNorm,       // per-head RMSNorm of q and k (Qwen3), in place: `in` = kQKv
  kRope,           // rotary embedding of q and k, in place: `in` = kQKv
  kAttention,      // causal attention of q (kQ) against the row's keys and values: out kQ
  kRoute,          // the router's logits (kExperts, fp32) to probabilities, the k chosen experts and their weights
  kDispatch,       // each token's row of `in` copied to its k expert slots
  kGroupedLinear,  // each slot's row of `in` times its expert's `weight` [out, in]
  kGlu,            // act(gate) * up over rows of `out` (gate and up read, the product written)
  kCombine,        // the k slots' rows of `in`, weighted, summed into the token's row
  kResidual,       // x + y over rows of `in`
};
const char* op_kind_name(OpKind k);

// The half of a layer an op belongs to: attention (with its norm and residual) or the MLP block.
enum class Part : uint8_t { kAttention, kMlp };

// The named per-token (or per-slot) values a layer's ops read and write; a backend binds each to
// one of its activation buffers. kX is the layer's input and kOut its output. kQk and kQkPre are q
// and k taken together (the ops that treat both alike: the per-head norms, RoPE, the attention).
enum class Val : uint8_t {
  kNone,
  kX,       // the layer's input (the residual stream)
  kXn1,     // the attention's normalised input
  kQPre,    // q and k as projected, before the per-head norms (Qwen3)
  kKPre,
  kQkPre,   // kQPre and kKPre
  kQ,       // q and k as the attention reads them
  kK,
  kQk,      // kQ and kK
  kV,
  kAttn,    // the attention's output, before o_proj
  kH,       // the residual stream after the attention half
  kXn2,     // the MLP block's normalised input
  kGate,    // a GLU's gate (gpt-oss: gate and up interleaved, 2 x I wide)
  kUp,
  kAct,     // act(gate) * up
  kLogits,  // the router's logits
  kXp,      // the experts' inputs, one row per slot, sorted by expert
  kYp,      // the experts' outputs, one row per slot
  kOut,     // the layer's output
};
const char* val_name(Val v);

struct Op {
  OpKind kind;
  const char* name;  // for people and errors: "q_proj", "experts.down", ...
  Part part;
  Dim in, out;       // row widths read and written
  bool slots = false;                        // rows per expert slot (k a token) instead of per token
  TensorRole weight = TensorRole::kCount;    // the weight a norm or a linear reads (kCount: none)
  bool saves_in = false, saves_out = false;  // what backward reads of it, when the layer is not recomputed
  // What it reads (src, and src2 for a residual's second term and a GLU's up) and writes (dst).
  Val src = Val::kNone, src2 = Val::kNone, dst = Val::kNone;
  // A grouped linear whose stacked weight is stored [in, out] (x W; gpt-oss) instead of [out, in].
  bool weight_in_out = false;
  // A GLU over one interleaved gate/up value (src, 2 x out wide), clamped (gpt-oss: swiglu_alpha,
  // swiglu_limit) instead of silu(gate) * up over two values.
  bool interleaved_clamped = false;
};

// The bias of a linear's weight role in the tensor tables (kCount: the weight has none).
TensorRole bias_of(TensorRole weight);

// Decoder layer l's ops for a config, in forward order; the ops of a layer with the MoE block
// (moe) or the dense MLP.
std::vector<Op> layer_ops(const ModelConfig& c, int64_t layer);
std::vector<Op> layer_ops_of_kind(const ModelConfig& c, bool moe);

// Per token of a forward, derived from an op's kind and widths (`cb`: bytes of a compute element):
//   flops: matrix-multiply FLOPs (2 m n k; a linear 2 in out, a grouped one k times that, the
//          attention 2 x 2 x keys x q for QK^T and PV, `keys` the keys a query sees, as if unmasked);
//   elementwise_bytes: the memory-bound traffic of the op (0 for the GEMMs and the attention);
//   saved_bytes: what backward keeps of it when the layer is not recomputed.
double op_flops(const Op& op, const ModelConfig& c, double keys);
double op_elementwise_bytes(const Op& op, const ModelConfig& c, double cb);
double op_saved_bytes(const Op& op, const ModelConfig& c, double cb);

}  // namespace megatrain::arch

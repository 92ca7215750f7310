// Formatting a ModelSpec for `megatrain-plan inspect`, as JSON and as a table.
#include "megatrain/planner/inspect.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "megatrain/core/arch.h"
#include "megatrain/core/units.h"

namespace megatrain::planner {
namespace {

using Json = nlohmann::ordered_json;

// Byte and FLOP counts are whole numbers; print them as integers (a fractional byte from a
// quantised format's per-block scale rounds up).
Json whole(double v) { return static_cast<int64_t>(std::ceil(v - 1e-9)); }

int64_t effective_seq(const ModelSpec& spec, const InspectOptions& opt) {
  return opt.seq_len > 0 ? opt.seq_len : spec.config().max_position_embeddings;
}

Json state_bytes_json(const StateBytes& b) {
  return Json{{"master", whole(b.master)}, {"gradients", whole(b.gradients)}, {"m", whole(b.m)},
              {"v", whole(b.v)}, {"streaming_copy", whole(b.streaming_copy)}, {"total", whole(b.total())}};
}

// The kinds of decoder layer a model has (dense, MoE), each with a layer of that kind.
std::vector<std::pair<std::string, int64_t>> layer_kinds(const ModelConfig& c) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const bool moe : {false, true})
    for (int64_t l = 0; l < c.num_layers; ++l)
      if (c.is_moe_layer(l) == moe) {
        out.emplace_back(moe ? "moe" : "dense", l);
        break;
      }
  return out;
}

// An op's rows per token, as text: "" (one per token) or "k x" (its expert slots).
// The values an op reads (arch::Val names), in order.
Json op_reads(const arch::Op& op) {
  Json r = Json::array();
  for (arch::Val v : {op.src, op.src2})
    if (v != arch::Val::kNone) r.push_back(arch::val_name(v));
  return r;
}
std::string op_flow(const arch::Op& op) {
  std::string s;
  for (arch::Val v : {op.src, op.src2})
    if (v != arch::Val::kNone) s += std::string(s.empty() ? "" : " + ") + arch::val_name(v);
  return s + " -> " + (op.dst == arch::Val::kNone ? "routing" : arch::val_name(op.dst));
}
std::string op_rows(const arch::Op& op, const ModelConfig& c) { return op.slots ? std::to_string(c.experts_per_token) + " x " : ""; }

std::string pad(const std::string& s, size_t w) { return s.size() >= w ? s : s + std::string(w - s.size(), ' '); }
std::string rpad(const std::string& s, size_t w) { return s.size() >= w ? s : std::string(w - s.size(), ' ') + s; }

}  // namespace

std::string inspect_json(const ModelSpec& spec, const InspectOptions& opt) {
  const ModelConfig& c = spec.config();
  const ParameterCounts pc = spec.parameter_counts();
  const int64_t seq = effective_seq(spec, opt);
  const FlopsPerToken f = spec.flops_per_token(seq);
  Json j;
  j["model"] = spec.name();
  j["architecture"] = c.architecture;
  j["parameters"] = pc.total;
  // Parameters one token uses: all of a dense model; for MoE, total less the unchosen experts.
  j["active_parameters"] = c.is_moe() ? pc.active : pc.total;
  j["embedding"] = pc.embedding;
  j["per_layer"] = pc.per_layer;
  j["head"] = pc.head;
  j["layers"] = c.num_layers;
  j["final_norm"] = pc.final_norm;
  j["tied_embeddings"] = c.tie_word_embeddings;
  if (c.is_moe())
    j["experts"] = {{"kind", c.moe}, {"num_experts", c.num_experts}, {"experts_per_token", c.experts_per_token},
                    {"per_expert", pc.per_expert}, {"all_experts", pc.experts}, {"router", pc.router},
                    {"moe_layers", pc.moe_layers}, {"expert_intermediate_size", c.moe_intermediate_size},
                    {"router_forward_flops", whole(f.router_forward)},
                    {"experts_forward_flops", whole(f.experts_forward)}};
  else
    j["experts"] = nullptr;
  j["seq_len"] = seq;
  j["flops_per_token"] = whole(f.training());
  j["flops"] = {{"forward", whole(f.forward)}, {"backward", whole(f.backward)}, {"recompute", whole(f.recompute)},
                {"training", whole(f.training())}, {"training_with_recompute", whole(f.training_with_recompute())},
                {"layer_forward", whole(f.layer_forward)}, {"attention_forward_per_layer", whole(f.attention_forward)},
                {"head_forward", whole(f.head_forward)}};
  Json bytes = Json::object();
  for (const PrecisionSetup& p : {PrecisionSetup::fp32(), PrecisionSetup::mixed()})
    bytes[p.name] = state_bytes_json(spec.training_state_bytes(p));
  j["bytes"] = bytes;
  Json act = Json::object();
  for (DType d : {DType::kFp32, DType::kBf16}) {
    const ActivationBytes a = spec.activation_bytes_per_token_per_layer(seq, dtype_bytes(d));
    act[dtype_name(d)] = {{"checkpoint", whole(a.checkpoint)}, {"full_eager", whole(a.full_eager)},
                          {"full_flash", whole(a.full_flash)}};
  }
  j["activation_bytes_per_token_per_layer"] = act;
  j["config"] = {{"hidden_size", c.hidden_size}, {"intermediate_size", c.intermediate_size},
                 {"num_attention_heads", c.num_heads}, {"num_key_value_heads", c.num_kv_heads},
                 {"head_dim", c.head_dim}, {"vocab_size", c.vocab_size},
                 {"max_position_embeddings", c.max_position_embeddings}, {"rms_norm_eps", c.rms_norm_eps},
                 {"rope_theta", c.rope_theta}, {"qkv_bias", c.qkv_bias}, {"o_bias", c.o_bias},
                 {"mlp_bias", c.mlp_bias}, {"qk_norm", c.qk_norm}, {"attention_sinks", c.attention_sinks},
                 {"sliding_window", c.sliding_window}};
  if (opt.list_ops) {
    Json kinds = Json::object();
    for (const auto& [kind, layer] : layer_kinds(c)) {
      Json ops = Json::array();
      for (const arch::Op& op : arch::layer_ops(c, layer))
        ops.push_back({{"name", op.name}, {"kind", arch::op_kind_name(op.kind)},
                       {"in", arch::dim_value(op.in, c)}, {"out", arch::dim_value(op.out, c)},
                       {"rows_per_token", op.slots ? c.experts_per_token : 1},
                       {"weight", op.weight == TensorRole::kCount ? Json(nullptr) : Json(tensor_role_name(op.weight))},
                       {"reads", op_reads(op)}, {"writes", op.dst == arch::Val::kNone ? Json(nullptr) : Json(arch::val_name(op.dst))},
                       {"forward_flops_per_token", arch::op_flops(op, c, static_cast<double>(seq))},
                       {"saved_bytes_per_token_bf16", arch::op_saved_bytes(op, c, 2)}});
      kinds[kind] = {{"first_layer", layer}, {"ops", ops}};
    }
    j["layer_ops"] = kinds;
  }
  if (opt.list_tensors) {
    Json ts = Json::array();
    for (const auto& t : spec.tensors()) ts.push_back({{"name", t.name}, {"shape", t.shape}, {"numel", t.numel}});
    j["tensors"] = ts;
  }
  return j.dump(2) + "\n";
}

std::string inspect_table(const ModelSpec& spec, const InspectOptions& opt) {
  const ModelConfig& c = spec.config();
  const ParameterCounts pc = spec.parameter_counts();
  const int64_t seq = effective_seq(spec, opt);
  const FlopsPerToken f = spec.flops_per_token(seq);
  std::ostringstream o;
  o << spec.name() << " (" << c.architecture << ")\n";
  o << "  " << c.num_layers << " layers, hidden " << c.hidden_size << ", ";
  if (c.is_moe()) {
    o << c.num_experts << " experts of " << c.moe_intermediate_size << " (top " << c.experts_per_token << ")";
    if (pc.moe_layers < c.num_layers) o << " on " << pc.moe_layers << " layers, dense MLP " << c.intermediate_size;
  } else {
    o << "MLP " << c.intermediate_size;
  }
  o << ", " << c.num_heads << " heads (" << c.num_kv_heads << " KV, head_dim " << c.head_dim << "), vocab "
    << c.vocab_size << (c.tie_word_embeddings ? ", tied head" : ", untied head")
    << (c.qkv_bias ? (c.o_bias ? ", q/k/v/o bias" : ", q/k/v bias") : "") << (c.qk_norm ? ", q/k norm" : "")
    << (c.attention_sinks ? ", attention sinks" : "");
  if (c.sliding_window > 0) {
    int64_t sliding = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) sliding += c.is_sliding_layer(l) ? 1 : 0;
    o << ", window " << c.sliding_window
      << (sliding == c.num_layers ? std::string(" on every layer") : " on " + std::to_string(sliding) + " layers");
  }
  o << "\n\n";

  o << "Parameters\n";
  auto row = [&](const std::string& name, int64_t n) {
    o << "  " << pad(name, 22) << rpad(format_thousands(static_cast<uint64_t>(n)), 18) << "  "
      << rpad(format_count(static_cast<double>(n)), 8) << "\n";
  };
  row("embedding", pc.embedding);
  row(c.is_moe() ? "layer 0" : "per layer", pc.per_layer);
  row("layers (x" + std::to_string(c.num_layers) + ")", pc.layers);
  row("final norm", pc.final_norm);
  row(c.tie_word_embeddings ? "head (tied)" : "head", pc.head);
  row("total", pc.total);
  row("active per token", c.is_moe() ? pc.active : pc.total);
  if (c.is_moe()) {
    o << "\nExperts (" << c.experts_per_token << " of " << c.num_experts << " per token, " << c.moe << " routing)\n";
    row("per expert", pc.per_expert);
    row("experts (x" + std::to_string(c.num_experts) + " x" + std::to_string(pc.moe_layers) + ")", pc.experts);
    row("router", pc.router);
    o << "  " << pad("moe layers", 22) << rpad(std::to_string(pc.moe_layers) + " of " + std::to_string(c.num_layers), 18)
      << "\n";
    row("active experts", static_cast<int64_t>(c.experts_per_token) * pc.per_expert * pc.moe_layers);
    row("rest (non-expert)", pc.total - pc.experts);
    row("active less embedding", pc.active - pc.embedding);  // the way gpt-oss' model card counts active
  }

  o << "\nFLOPs per token at seq " << seq << " (matmuls, 2mnk)\n";
  auto frow = [&](const std::string& name, double v) {
    o << "  " << pad(name, 22) << rpad(format_flops(v), 14) << "\n";
  };
  frow("forward", f.forward);
  frow("backward", f.backward);
  frow("recompute", f.recompute);
  frow("training (fwd+bwd)", f.training());
  frow("with recompute", f.training_with_recompute());
  if (c.is_moe()) {
    frow("router, one layer", f.router_forward);
    frow("k experts, one layer", f.experts_forward);
  }
  char buf[128];
  std::snprintf(buf, sizeof buf, "  attention share of forward: %.1f%%\n",
                100.0 * f.attention_forward * static_cast<double>(c.num_layers) / f.forward);
  o << buf;

  o << "\nTraining state (host)\n";
  o << "  " << pad("setup", 8) << rpad("master", 11) << rpad("grads", 11) << rpad("m", 11) << rpad("v", 11)
    << rpad("stream", 11) << rpad("total", 11) << "\n";
  for (const PrecisionSetup& p : {PrecisionSetup::fp32(), PrecisionSetup::mixed()}) {
    const StateBytes b = spec.training_state_bytes(p);
    o << "  " << pad(p.name, 8) << rpad(format_bytes(b.master), 11) << rpad(format_bytes(b.gradients), 11)
      << rpad(format_bytes(b.m), 11) << rpad(format_bytes(b.v), 11) << rpad(format_bytes(b.streaming_copy), 11)
      << rpad(format_bytes(b.total()), 11) << "\n";
  }
  o << "  fp32: fp32 compute and transfer; mixed: bf16 compute, transfer and gradients, fp32 master, m and v\n";

  o << "\nActivations per token per layer (bf16) at seq " << seq << "\n";
  const ActivationBytes a = spec.activation_bytes_per_token_per_layer(seq, 2);
  o << "  " << pad("checkpoint (input)", 22) << rpad(format_bytes(a.checkpoint), 12) << "\n";
  o << "  " << pad("all, fused attention", 22) << rpad(format_bytes(a.full_flash), 12) << "\n";
  o << "  " << pad("all, eager attention", 22) << rpad(format_bytes(a.full_eager), 12) << "\n";
  if (opt.list_ops) {
    for (const auto& [kind, layer] : layer_kinds(c)) {
      o << "\nOps of a " << kind << " layer (layer " << layer << "), per token at seq " << seq << "\n";
      o << "  " << pad("op", 26) << pad("kind", 16) << rpad("in -> out", 22) << rpad("FLOPs", 12) << rpad("kept (bf16)", 13)
        << "  values\n";
      for (const arch::Op& op : arch::layer_ops(c, layer)) {
        const std::string shape =
            op_rows(op, c) + std::to_string(arch::dim_value(op.in, c)) + " -> " + std::to_string(arch::dim_value(op.out, c));
        const double fl = arch::op_flops(op, c, static_cast<double>(seq)), kept = arch::op_saved_bytes(op, c, 2);
        o << "  " << pad(op.name, 26) << pad(arch::op_kind_name(op.kind), 16) << rpad(shape, 22)
          << rpad(fl > 0 ? format_flops(fl) : "-", 12) << rpad(kept > 0 ? format_bytes(kept) : "-", 13) << "  " << op_flow(op)
          << "\n";
      }
    }
  }
  if (opt.list_tensors) {
    o << "\nTensors (" << spec.tensors().size() << ")\n";
    for (const auto& t : spec.tensors()) {
      std::string shape = "[";
      for (size_t i = 0; i < t.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(t.shape[i]);
      shape += "]";
      o << "  " << pad(t.name, 56) << rpad(shape, 16) << "\n";
    }
  }
  return o.str();
}

}  // namespace megatrain::planner

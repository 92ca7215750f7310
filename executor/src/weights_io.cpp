// HF safetensors <-> the RAM tier's master weights.
#include "megatrain/executor/weights_io.h"

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "megatrain/executor/safetensors.h"

namespace megatrain::exec {

Status save_weights(const HostState& state, const std::filesystem::path& path) {
  // Master weights on NVMe are paged in one unit at a time as the file is written.
  auto pager = std::make_shared<UnitPager>(const_cast<HostState&>(state));
  std::vector<TensorToWrite> tensors;
  for (size_t u = 0; u < state.units().size(); ++u) {
    for (const TensorSlot& t : state.units()[u].tensors) {
      TensorToWrite w{t.name, t.shape, state.units()[u].master.data() + t.offset, DType::kFp32, DType::kFp32};
      if (state.master_on_nvme()) {
        w.data = nullptr;
        w.fetch = [&state, pager, u, off = t.offset]() -> Result<const void*> {
          MT_RETURN_IF_ERROR(pager->get(static_cast<int64_t>(u)).status());
          return static_cast<const void*>(state.units()[u].master.data() + off);
        };
      }
      tensors.push_back(std::move(w));
    }
  }
  Status s = write_safetensors(path, tensors, {{"writer", "megatrain"}});
  Status done = pager->finish();
  return s.ok() ? done : s;
}

namespace {
// Whether `name` belongs to one of the multi-token-prediction layers a checkpoint carries after
// the decoder layers (model.layers.{L} .. {L + mtp_layers - 1}.).
bool is_mtp_tensor(const std::string& name, int64_t layers, int64_t mtp_layers) {
  const std::string prefix = "model.layers.";
  if (mtp_layers <= 0 || name.compare(0, prefix.size(), prefix) != 0) return false;
  size_t i = prefix.size();
  int64_t layer = 0;
  const size_t start = i;
  while (i < name.size() && i - start < 6 && name[i] >= '0' && name[i] <= '9') layer = layer * 10 + (name[i++] - '0');
  if (i == start || i >= name.size() || name[i] != '.') return false;
  return layer >= layers && layer < layers + mtp_layers;
}
}  // namespace

Status load_weights(HostState& state, const std::filesystem::path& checkpoint, int64_t mtp_layers) {
  MT_ASSIGN_OR_RETURN(HfCheckpoint ckpt, HfCheckpoint::open(checkpoint));
  // Every tensor of the checkpoint must be one the model takes: a deeper or wider model's checkpoint
  // would otherwise load its first layers silently. Left out: buffers transformers never loads
  // (rotary inv_freq) and a separate lm_head.weight beside tied embeddings.
  std::set<std::string> used;
  for (const UnitState& us : state.units())
    for (const TensorSlot& t : us.tensors) {
      used.insert(t.name);
      used.insert(t.name + "_blocks");
      used.insert(t.name + "_scales");
      used.insert(fp8_scale_name(t.name));
    }
  std::vector<std::string> extra;
  for (const auto& [name, loc] : ckpt.tensors()) {
    if (used.count(name)) continue;
    if (name.size() > 9 && name.compare(name.size() - 9, 9, ".inv_freq") == 0) continue;
    if (name == "lm_head.weight" && !used.count("lm_head.weight") && used.count("model.embed_tokens.weight")) continue;
    // Multi-token prediction: not trained here. The decoder layers are the units between the
    // embedding and the head.
    if (is_mtp_tensor(name, static_cast<int64_t>(state.units().size()) - 2, mtp_layers)) continue;
    extra.push_back(name);
  }
  if (!extra.empty()) {
    std::string list;
    for (size_t k = 0; k < extra.size() && k < 5; ++k) list += (k ? ", " : "") + extra[k];
    if (extra.size() > 5) list += " and " + std::to_string(extra.size() - 5) + " more";
    return invalid_argument(checkpoint.string() + ": the checkpoint holds " + std::to_string(extra.size()) +
                            " tensor(s) the model does not have (" + list +
                            "): is it the checkpoint of another (deeper or wider) model? --init takes the weights of the plan's model only");
  }
  if (!state.writes_weights()) return {};  // a shared state: the node's first rank loads the node's copy
  UnitPager pager(state);  // master weights on NVMe: one unit at a time, set and written back
  for (size_t u = 0; u < state.units().size(); ++u) {
    UnitState& us = state.units()[u];
    if (state.master_on_nvme()) MT_RETURN_IF_ERROR(pager.get(static_cast<int64_t>(u), true).status());
    for (const TensorSlot& t : us.tensors) {
      float* out = us.master.data() + t.offset;
      if (ckpt.contains(t.name) && ckpt.has_mxfp4(t.name))
        return invalid_argument(checkpoint.string() + ": the model's tensor " + t.name + " is stored both plain and in MXFP4 (" + t.name +
                                "_blocks/_scales); which one to train from is ambiguous: keep one");
      if (ckpt.has_fp8_blocks(t.name)) {
        // DeepSeek-V3's and Kimi-K2's published checkpoints: F8_E4M3 with 128 x 128 block scales.
        MT_RETURN_IF_ERROR(ckpt.load_fp8_blocks_fp32(t.name, t.shape, out).with_context(checkpoint.string()));
      } else if (ckpt.contains(t.name)) {
        MT_RETURN_IF_ERROR(ckpt.load_fp32(t.name, t.shape, out).with_context(checkpoint.string()));
      } else if (ckpt.has_mxfp4(t.name)) {
        // gpt-oss's published checkpoints keep the experts' gate_up_proj and down_proj in MXFP4
        // (name_blocks, name_scales); HF stores nothing else that way.
        if (t.role != TensorRole::kExpertGateUp && t.role != TensorRole::kExpertDown)
          return invalid_argument(checkpoint.string() + ": the model's tensor " + t.name + " is stored in MXFP4 (" +
                                  t.name + "_blocks/_scales); MXFP4 is accepted only for gpt-oss's "
                                  "mlp.experts.gate_up_proj and mlp.experts.down_proj");
        MT_RETURN_IF_ERROR(ckpt.load_mxfp4_fp32(t.name, t.shape, out).with_context(checkpoint.string()));
      } else {
        return not_found(checkpoint.string() + ": the model's tensor " + t.name + " is not in the checkpoint");
      }
      // A NaN or an infinity in the initial weights trains NaN from the first step.
      for (int64_t i = 0; i < t.numel; ++i)
        if (!std::isfinite(out[i])) {
          std::string at;
          int64_t rest = i;
          for (size_t d = t.shape.size(); d-- > 0;) {
            at = std::to_string(rest % t.shape[d]) + (at.empty() ? "" : ", ") + at;
            rest /= t.shape[d];
          }
          return invalid_argument(checkpoint.string() + ": tensor " + t.name + " holds " + (std::isnan(out[i]) ? "NaN" : "an infinity") +
                                  " at [" + at + "] (element " + std::to_string(i) + "); training from it would give NaN losses");
        }
    }
  }
  MT_RETURN_IF_ERROR(pager.finish());
  return state.refresh_stream();
}

}  // namespace megatrain::exec

// Weights in and out of the RAM tier as Hugging Face safetensors with HF tensor names, so that HF
// tools load what MegaTrain writes and MegaTrain starts from HF checkpoints (--init).
#pragma once

#include <filesystem>

#include "megatrain/core/status.h"
#include "megatrain/executor/host_state.h"

namespace megatrain::exec {

// Writes every master weight (fp32) to `path` (atomic: temp file, fsync, rename). A tied head is
// written once, as model.embed_tokens.weight, as HF does.
Status save_weights(const HostState& state, const std::filesystem::path& path);
// Loads every tensor of the model from an HF checkpoint (a folder with model.safetensors or a
// sharded index, or a .safetensors file): a missing tensor or a shape mismatch is an error naming
// it. F32, BF16 and F16 are widened to fp32; gpt-oss's expert gate_up_proj and down_proj may be
// stored in MXFP4 instead (name_blocks and name_scales, as the published checkpoints are), which is
// dequantised exactly to fp32 (HfCheckpoint::load_mxfp4_fp32). Refreshes the streaming copy.
Status load_weights(HostState& state, const std::filesystem::path& checkpoint);

}  // namespace megatrain::exec

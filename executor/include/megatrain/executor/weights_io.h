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
// dequantised exactly to fp32 (HfCheckpoint::load_mxfp4_fp32), and any matrix may be block-scaled
// FP8 (HfCheckpoint::load_fp8_blocks_fp32). The `mtp_layers` multi-token-prediction layers a
// checkpoint carries after the decoder layers (ModelConfig::mtp_layers) are skipped by name.
// Refreshes the streaming copy.
Status load_weights(HostState& state, const std::filesystem::path& checkpoint, int64_t mtp_layers = 0);

}  // namespace megatrain::exec

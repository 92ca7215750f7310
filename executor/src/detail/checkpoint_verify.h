// Internal to the checkpoint code: the manifest of a step directory and the verification of a step
// directory against the state it would be loaded into. Not a public header.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "detail/checkpoint_hash.h"
#include "detail/optimizer_file.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/safetensors.h"

namespace megatrain::exec::detail {

// The manifest (manifest.json) as written: schema, step, created, model, files (their bytes and
// XXH64), data position, RNG seed, losses and plan as 2-space JSON whose last key,
// "manifest_xxh64", holds the XXH64 of every byte before its comma.
std::string manifest_text(const CheckpointInfo& info, const std::map<std::string, FileDigest>& files,
                          const std::string& created);

// A step directory whose files have all been verified, with its files open.
struct Verified {
  std::filesystem::path dir;
  CheckpointInfo info;
  bool compressed = false;  // fp32 moments stored as planes_zstd
  std::optional<SafetensorsFile> model;
  OptimizerFiles optimizer;
};

// Verifies the step directory `dir` for loading into `state`: the manifest's schema and checksum,
// every file's size and XXH64, the moment formats against `state`'s, and every tensor's name,
// dtype and shape (load_checkpoint in checkpoint.h lists the errors). Reads `state` only.
Result<Verified> verify_step_dir(const std::filesystem::path& dir, const HostState& state);

}  // namespace megatrain::exec::detail

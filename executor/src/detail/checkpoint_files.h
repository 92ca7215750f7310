// Internal to the checkpoint code: the names in a checkpoint directory (checkpoints.md), small files
// read whole, step directories found and listed, and stale temporaries removed. Not a public header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::exec::detail {

// The files of a step directory, and the file beside the step directories naming the newest.
inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kConfigFile = "config.json";  // optional: the HF config of the weights
inline constexpr const char* kLatestFile = "latest";
// The optimizer file of a step directory: optimizer.safetensors, or with sharded states (N > 1
// shards, one per rank) "optimizer-<k>-of-<N>.safetensors", k and N in 5 digits.
std::string optimizer_file_name(int64_t shard, int64_t shards);

// strerror's text for `err`, as every checkpoint message spells it.
std::string errno_text(int err);

// The whole file, when it is at most `limit` bytes (else kCorrupt). A missing file is kNotFound.
Result<std::string> read_small_file(const std::filesystem::path& path, uint64_t limit);

// "step-<NNNNNNNN>" (8 digits, more when needed).
std::string step_dir_name(int64_t step);
// The step of a directory named step-<digits>, or nothing.
std::optional<int64_t> parse_step_dir_name(const std::string& name);
// Step directories of `root`, highest step first.
std::vector<std::pair<int64_t, std::filesystem::path>> list_step_dirs(const std::filesystem::path& root);

// Removes `.step-*.tmp-<pid>`, `.step-*.old-<pid>` and `.latest.tmp-<pid>` entries whose process is
// gone (or is this one: a save of this process is not running while another starts). Best effort.
void remove_stale_temporaries(const std::filesystem::path& root);

// One tensor a checkpoint file must hold.
struct ExpectedTensor {
  std::string name;
  const char* dtype;
  std::vector<int64_t> shape;
  bool any_length = false;  // a compressed tensor: rank 1, any length
};

}  // namespace megatrain::exec::detail

// Training checkpoints (ARCHITECTURE.md section 6): the fp32 master weights as HF safetensors, the
// Adam moments alongside in their storage format (fp32, bf16 bits, or q8/q4/q3/q2 codes and scales;
// moments.h), and a JSON manifest (step, plan, data position, RNG seed, sizes and XXH64
// checksums). A checkpoint becomes visible only when complete, and a resumed run continues bit for
// bit. Layout, atomicity and resume rules: docs/checkpoints.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/xxh64.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/communicator.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"

namespace megatrain::exec {

inline constexpr const char* kCheckpointSchema = "megatrain.checkpoint/1";

// Where the data stream stands. The loader has no cursor (a batch is a pure function of step,
// micro-batch, options and file), so the position is CheckpointInfo::next_step (the next batch is
// micro-batch 0 of that step) plus these options, which must not change across a resume.
struct DataPosition {
  int64_t seq_len = 0;
  int64_t micro_batch = 0;
  int64_t grad_accum = 0;
  std::string order;          // "sequential" | "shuffled"
  uint64_t seed = 0;          // the shuffle seed
  std::string source;         // the token file as it was named (for people; not checked)
  int64_t tokens = 0;         // its token count (checked: other data means other batches)
  // DataLoader::source_fingerprint (checked likewise: other data of the same size); "" in a
  // checkpoint written before the key existed, which is then not checked.
  std::string fingerprint;
};

// The options of `loader` as a checkpoint records them.
DataPosition data_position(const DataLoader& loader);

struct CheckpointInfo {
  int64_t next_step = 0;      // steps done; a resumed run starts with this step
  int64_t skipped_steps = 0;  // of those, the steps whose update was not applied (--skip-nonfinite-steps)
  std::string model_name;
  int64_t parameters = 0;
  std::string plan_json;      // the run's plan (Plan::to_json_text())
  DataPosition data;
  uint64_t seed = 0;          // the run's RNG seed (initialisation and shuffling are keyed by it)
  // Optional: the loss of steps losses_first_step, losses_first_step + 1, ..., next_step - 1.
  int64_t losses_first_step = 0;
  std::vector<double> losses;
  std::string created;        // UTC, ISO 8601; set by save_checkpoint, read back by load
  // Optional: the Hugging Face config.json of the weights, written as `config.json` next to
  // model.safetensors so that transformers' from_pretrained loads the step directory as it is
  // (hf_checkpoint_config() makes it from the model's config). Verified and read back by load: a
  // resume compares it with the model.
  std::string hf_config_json;
  // The optimizer files: 1 (optimizer.safetensors), or one shard per rank of a job with sharded
  // states (parallel.host_state sharded; the manifest's "optimizer_shards").
  int64_t optimizer_shards = 1;
};

// The model's config.json as it describes a checkpoint MegaTrain writes: the model's own keys,
// with torch_dtype "float32" (the weights are the fp32 masters) and without quantization_config
// (gpt-oss's MXFP4 experts are written dequantised, under their plain names).
std::string hf_checkpoint_config(const ModelSpec& model);

struct LoadedCheckpoint {
  std::filesystem::path dir;  // the step directory that was loaded
  CheckpointInfo info;
  std::string note;           // something the user should hear (a 'latest' file that named an older step), or ""
};

// `<checkpoint_dir>/step-<NNNNNNNN>` for `next_step` (8 digits, more when needed).
std::filesystem::path checkpoint_step_dir(const std::filesystem::path& checkpoint_dir, int64_t next_step);

// Writes `state` (master weights, m and v as stored, with their formats in the optimizer file's
// __metadata__) and `info` as `<checkpoint_dir>/step-<info.next_step>`:
// everything goes to a hidden temporary directory first, every file and the directory are
// fsynced, then one rename makes the step visible, and `latest` is updated (temp file + rename).
// A step directory of the same number is replaced atomically. Temporary directories left by dead
// processes are removed first. On failure nothing visible changes: earlier checkpoints stay as
// they were and the error says so. Creates checkpoint_dir if needed. Not thread-safe: one saver per
// checkpoint_dir at a time, and no training step may be writing `state` meanwhile.
//
// With options.compress_fp32_moments, m and v held in fp32 are stored losslessly compressed (byte
// planes + zstd, plane_codec.h) as "<name>.exp_avg.planes_zstd" U8 entries, and the optimizer
// file's __metadata__ says "fp32_moments": "planes_zstd". Loading reads either form. Quantised and
// bf16 moments are stored as they are either way.
struct SaveOptions {
  bool compress_fp32_moments = false;
  int zstd_level = 1;  // 1..19; level 3 measured no smaller on real moments (docs/optimizer-states.md)
  int threads = 1;     // zstd workers per plane of a large tensor (plane_codec.h)
  // Sharded states (parallel.host_state sharded): the job's ranks, which all call save_checkpoint
  // together. Rank k writes optimizer-<k>-of-<N>.safetensors, the moments of the tensors it owns,
  // into rank 0's temporary directory; rank 0 writes the weights and the manifest (with
  // "optimizer_shards": N) and publishes the step once every shard is complete.
  Communicator* comm = nullptr;
};
Status save_checkpoint(const std::filesystem::path& checkpoint_dir, const HostState& state, const CheckpointInfo& info,
                       const SaveOptions& options = {});

// Retention (megatrain-exec --keep-checkpoints N, the Python package's save_total_limit): once the
// checkpoint of `saved_step` is complete, removes the step directories of `checkpoint_dir` older
// than it beyond the newest `keep` - 1, so that `keep` checkpoints remain counting the one just
// saved. A step directory of saved_step or later is never touched. Each one removed is first renamed
// to a hidden `.step-<N>.old-<pid>` in one rename (the rename made durable before anything is
// deleted), so a crash or a failure part-way never leaves a partly deleted step-* directory; a
// hidden leftover is removed by the next save. The oldest go first. Returns the step directories
// removed.
// Errors: kInvalidArgument for keep < 1; kNotFound when saved_step's directory is not there
// (nothing is removed); kIoError naming the directory, with every checkpoint not yet removed
// left as it was.
Result<std::vector<std::filesystem::path>> prune_checkpoints(const std::filesystem::path& checkpoint_dir, int64_t keep,
                                                             int64_t saved_step);

// Loads a checkpoint into `state` and refreshes its streaming copy. `path` is a step directory
// (holding manifest.json), or a checkpoint_dir, whose newest checkpoint is the one `latest` names,
// or, when `latest` is missing or names no directory, the highest-numbered step-* directory.
// Everything is verified before `state` is touched: the manifest's schema and its own checksum,
// every file's size and XXH64, the moment formats and block size against `state`'s (an optimizer
// file without them holds fp32 moments), and every tensor's name, dtype and shape. m and v are
// restored bit for bit in their format. Errors: kNotFound (no checkpoint), kCorrupt naming the file
// and the problem, kInvalidArgument (a checkpoint of another model, or one whose m/v formats or
// block size differ from `state`'s, naming both). When the newest checkpoint is corrupt and an older one verifies, the error (kCorrupt)
// names both and says how to resume from the older one; it never falls back silently. Writes no file.
Result<LoadedCheckpoint> load_checkpoint(const std::filesystem::path& path, HostState& state);

// The step directory load_checkpoint would try first, without verifying it; kNotFound when
// checkpoint_dir holds no checkpoint.
Result<std::filesystem::path> find_latest_checkpoint(const std::filesystem::path& checkpoint_dir);

// A resumed run must be the same run: the same model, the same plan keys that decide the numbers
// (training.*, precision.*, optimizer.* except threads) and the same data options and token count.
// The error (kInvalidArgument) names the first key that differs and both values.
Status check_resume_compatible(const CheckpointInfo& saved, const Plan& plan, const ModelSpec& model,
                               const DataLoader& data);

// XXH64, the checksum of every checkpoint file (core/xxh64.h).
using ::megatrain::Xxh64;
using ::megatrain::xxh64;

}  // namespace megatrain::exec

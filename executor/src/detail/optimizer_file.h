// Internal to the checkpoint code: the optimizer file (optimizer.safetensors) of a step directory.
// Per parameter it holds m then v ("<name>.exp_avg", "<name>.exp_avg_sq", torch AdamW's names) in
// their storage format: fp32 and bf16 as one tensor of the parameter's shape (fp32 optionally as
// "<name>.exp_avg.planes_zstd" U8), a quantised format as ".codes" (U8) then ".scales" (F32); the
// formats and block size are in its __metadata__. Not a public header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "detail/checkpoint_files.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/safetensors.h"

namespace megatrain::exec::detail {

// Where tensor `index` of a unit lies in one of its MomentStores: elements, blocks and code bytes
// from the start of the unit's arrays, as MomentStore lays them out (moments.h: every tensor's
// blocks start at its first element, every block takes block_size * bits / 8 bytes of codes).
struct MomentSpan {
  int64_t elem_offset = 0, numel = 0;
  int64_t block_offset = 0, blocks = 0;
  int64_t code_offset = 0, code_bytes = 0;
};

// The formats the optimizer file keeps m and v in, and their block size.
struct MomentFormats {
  StateFormat m = StateFormat::kFp32, v = StateFormat::kFp32;
  int64_t block_size = 128;
  bool compressed = false;  // fp32 moments stored as planes_zstd (how they are stored, not what they hold)
  bool quantised() const { return is_quantised(m) || is_quantised(v); }
  // Block sizes matter only to quantised formats.
  bool operator==(const MomentFormats& o) const {
    return m == o.m && v == o.v && (!quantised() || block_size == o.block_size);
  }
  std::string text() const {
    std::string t = std::string(state_format_name(m)) + "/" + state_format_name(v);
    if (quantised()) t += " (block " + std::to_string(block_size) + ")";
    return t;
  }
};

// The formats `state` keeps m and v in (those of its first unit; all units share them).
MomentFormats formats_of(const HostState& state);

// Writes the optimizer file of `state` to `path` (write_safetensors: atomic), recording AdamW's
// update count (`updates`: the steps done less the skipped ones, torch's state "step") and the
// formats in its __metadata__; moments on NVMe are paged in one unit at a time.
Status write_optimizer(const HostState& state, const std::filesystem::path& path, int64_t updates,
                       const SaveOptions& options);

// The optimizer files' tensors for the state's formats, of every tensor of the model (with sharded
// states also those other ranks own): per parameter, m then v; fp32 and bf16 as
// one tensor of the parameter's shape, a quantised format as ".codes" (U8) then ".scales" (F32).
Result<std::vector<ExpectedTensor>> expected_optimizer_tensors(const HostState& state, bool compressed);

// The formats recorded in the optimizer file's __metadata__; a file without them predates the
// storage formats and holds fp32 moments.
Result<MomentFormats> formats_in(const SafetensorsFile& f);
// Per-expert AdamW step counts (UnitState::expert_steps) as the optimizer file's __metadata__
// "expert_steps" holds them ("<unit>:<count>,...;..."), "" for a model without per-expert tensors;
// and reading them back into `state` (corrupt when missing for such a model or not matching it).
std::string expert_steps_text(const HostState& state);
Status read_expert_steps(const SafetensorsFile& f, HostState& state);

// A checkpoint's optimizer files: optimizer.safetensors, or one shard per rank of a job with
// sharded states (optimizer-<k>-of-<N>.safetensors), each holding the moments of the tensors its
// rank owned. Every moment entry is in exactly one file (verify_step_dir checks it).
struct OptimizerFiles {
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> file_of;  // entry name -> index in files
  const SafetensorsFile* holder(const std::string& entry) const {
    const auto it = file_of.find(entry);
    return it == file_of.end() ? nullptr : &files[it->second];
  }
};

// Reads the moments of one unit's tensors from verified optimizer files into the unit's stores
// (with sharded states, of the tensors this rank owns). `opt` and `us` must outlive the reader.
class MomentReader {
 public:
  // Fails (kInternal) when the unit's stores do not have the layout of its tensors (checked_spans).
  static Result<MomentReader> for_unit(const OptimizerFiles& opt, bool compressed, UnitState& us);
  // m, then v, of the unit's tensor `index` (nothing when another rank owns it).
  Status read(size_t index);

 private:
  MomentReader(const OptimizerFiles& opt, bool compressed, UnitState& us)
      : opt_(&opt), compressed_(compressed), us_(&us) {}
  const OptimizerFiles* opt_;
  bool compressed_;
  UnitState* us_;
  std::vector<MomentSpan> spans_[2];
};

}  // namespace megatrain::exec::detail

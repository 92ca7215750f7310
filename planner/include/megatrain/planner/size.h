// `megatrain-plan size`: which rigs train a model, and which model a rig trains.
// Rig sizing synthesises host configurations around each GPU in profiles/hardware/ (host RAM,
// NVMe drive count, PCIe generation; the host CPU of the GPU's own shipped rig) and reports, per
// GPU, the smallest one whose plan search finds a plan (meeting a tokens/s target when one is
// given). Model sizing scales a family's published shapes (profiles/models/<family>-<N>b.json)
// and finds the largest that a given rig trains. Every assumption is listed in the result; the
// rules are in docs/planner.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/planner/search.h"

namespace megatrain::planner {

struct SizeOptions {
  double target_tokens_per_s = 0;  // 0: any speed
  int64_t seq_len = 0;             // as in SearchRequest
  int64_t tokens_per_step = 0;
  SearchPolicy policy;
};

// One synthesised rig and what the search made of it.
struct RigOption {
  std::string gpu_rig;      // the shipped rig the GPU (and host CPU) come from
  std::string gpu;          // GPU name
  std::string link;         // pcie-gen4-x16 | pcie-gen5-x16 | the GPU's own link
  double ram_bytes = 0;
  int drives = 0;
  std::string drive;        // drive model
  bool trains = false;      // a plan fits (and meets the target)
  double tokens_per_s = 0;  // of the best plan found
  std::string plan;         // describe_knobs of that plan
  std::string why_not;      // when no host configuration trains it
  HardwareProfile rig;      // the synthesised profile
};

struct SizeResult {
  std::string model;
  int64_t seq_len = 0;
  int64_t tokens_per_step = 0;
  std::vector<RigOption> rigs;          // one per GPU, smallest GPU first
  std::vector<std::string> assumptions;
  int64_t searches = 0;
  double seconds = 0;
};

// `gpu_filter`: empty for every GPU, else a case-insensitive substring of the shipped rig's name or
// the GPU's name; an unmatched filter is an error that lists the GPUs.
Result<SizeResult> size_rigs(const ModelSpec& model, const std::string& gpu_filter, const SizeOptions& opt);

// A family scaled through its published sizes.
struct FamilyPoint {
  std::string name;        // "llama-2-70b" for a published size, "llama-2~31.5b" for a scaled one
  bool published = false;
  int64_t parameters = 0;
  int64_t layers = 0, hidden = 0, intermediate = 0, heads = 0, kv_heads = 0;
  bool trains = false;
  double tokens_per_s = 0;
  std::string plan;
};

struct FamilyResult {
  std::string family;
  std::string rig;
  int64_t seq_len = 0;
  int64_t tokens_per_step = 0;
  std::vector<FamilyPoint> published;    // each published size: does it train here?
  bool any = false;
  FamilyPoint largest;                   // the largest scaled size that trains
  FamilyPoint smallest_that_does_not;    // the next size up, and why
  std::string why_not;
  std::vector<std::string> assumptions;
  int64_t searches = 0;
  double seconds = 0;
};

// GPU-count sizing (`size --model M --rig R` on a rig with a cluster section): the best plan for each
// GPU count the rig allows (1 .. gpus_per_node on one node, then whole nodes; counts that divide the
// step's sequences), and the fewest GPUs whose best plan reaches the target tokens/s.
struct GpuCountOption {
  int64_t gpus = 0, nodes = 0;
  bool trains = false;        // a plan fits (and, with a target, reaches it)
  bool fits = false;          // a plan fits, whether or not it reaches the target
  double tokens_per_s = 0, mfu = 0;
  std::string bottleneck;
  std::string host_state;     // of the best plan (replicated, sharded, shared; "-" for one GPU)
  std::string plan;           // describe_knobs
  std::string why_not;
};
struct GpuCountResult {
  std::string model, rig;
  int64_t seq_len = 0, tokens_per_step = 0;
  double target_tokens_per_s = 0;
  std::vector<GpuCountOption> counts;  // ascending
  int64_t chosen = -1;                 // index of the fewest GPUs that reach the target (no target: the fastest)
  std::vector<std::string> assumptions;
  int64_t searches = 0;
  double seconds = 0;
};
// Errors: a rig without a cluster section, a step whose sequences no GPU count above 1 divides.
Result<GpuCountResult> size_gpu_count(const ModelSpec& model, const HardwareProfile& rig, const SizeOptions& opt);
std::string gpu_count_json(const GpuCountResult& r);
std::string gpu_count_table(const GpuCountResult& r);

// Families with two or more published sizes in profiles/models/ ("llama-2", "qwen2.5", ...).
std::vector<std::string> model_families();
Result<FamilyResult> largest_model(const std::string& family, const HardwareProfile& rig, const SizeOptions& opt);

std::string size_json(const SizeResult& r);
std::string size_table(const SizeResult& r);
std::string family_json(const FamilyResult& r);
std::string family_table(const FamilyResult& r);

// The `megatrain-plan size` command: `--model M` sizes rigs; `--model M --rig R` (a rig with a
// cluster section) the GPU count; `--family F --rig R` finds the largest model of the family that R
// trains. Exit code 0, 2 when nothing trains it, 1 on errors.
struct SizeCommand {
  std::string model;
  std::string family;
  std::string rig;
  std::string gpu;
  double target_tokens_per_s = 0;
  int64_t seq_len = 0;
  int64_t tokens_per_step = 0;
  std::string state_formats = "fp32";
  bool json = false;
};
int size_command(const SizeCommand& cmd);

}  // namespace megatrain::planner

// megatrain-plan: argument parsing only; the work is in megatrain_planner.
#include <cstdio>
#include <iostream>

#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/output_path.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/units.h"
#include "megatrain/planner/inspect.h"
#include "megatrain/planner/profile.h"
#include "megatrain/planner/search.h"
#include "megatrain/planner/size.h"
#include "megatrain/simulator/step_model.h"

namespace {

int fail(const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-plan: error: %s\n", s.to_string().c_str());
  return 1;
}

void print_table(const megatrain::sim::SimResult& r) {
  using namespace megatrain;
  std::printf("step time       %s (steady state: the last of three simulated steps)\n", format_duration(r.step_time_s).c_str());
  std::printf("throughput      %.0f tokens/s, %.1f TFLOP/s, MFU %.1f%%\n", r.tokens_per_s, r.tflops, 100 * r.mfu);
  std::printf("bottleneck      %s\n", r.bottleneck.c_str());
  std::printf("\nbusy fraction of the step\n");
  for (const auto& [k, v] : r.busy) std::printf("  %-16s %5.1f%%\n", k.c_str(), 100 * v);
  if (!r.stalls.empty()) {
    std::printf("\nstalls (seconds in the step)\n");
    for (const auto& [k, v] : r.stalls) std::printf("  %-16s %s\n", k.c_str(), format_duration(v).c_str());
  }
  std::printf("\ncritical path\n");
  for (const auto& [k, v] : r.critical_path) std::printf("  %-16s %s\n", k.c_str(), format_duration(v).c_str());
  std::printf("\npeak bytes       used        capacity\n");
  auto row = [](const char* n, int64_t used, int64_t cap) {
    std::printf("  %-10s %12s  %12s\n", n, format_bytes(static_cast<double>(used)).c_str(),
                format_bytes(static_cast<double>(cap)).c_str());
  };
  row("device", r.peak_bytes.device, r.capacity_bytes.device);
  row("pinned", r.peak_bytes.pinned, r.capacity_bytes.pinned);
  row("ram", r.peak_bytes.ram, r.capacity_bytes.ram);
  row("nvme", r.peak_bytes.nvme, r.capacity_bytes.nvme);
  for (const auto& a : r.assumptions) std::printf("\nassumption: %s\n", a.c_str());
  std::printf("\n%lld tasks simulated\n", static_cast<long long>(r.tasks));
}

int run_simulate(const std::string& plan_path, const std::string& trace_path, bool json) {
  auto plan = megatrain::Plan::load(plan_path);
  if (!plan.ok()) return fail(plan.status());
  megatrain::sim::SimOptions opt;
  opt.keep_engine = !trace_path.empty();
  auto r = megatrain::sim::simulate(*plan, opt);
  if (!r.ok()) return fail(r.status());
  if (!r->feasible) {
    if (json) std::fputs(megatrain::sim::result_json(*r).c_str(), stdout);
    std::fprintf(stderr, "megatrain-plan: the plan does not fit: %s\n", r->reason.c_str());
    return 2;
  }
  if (!trace_path.empty()) {
    megatrain::Status s = megatrain::sim::write_trace(*r, *plan, trace_path);
    if (!s.ok()) return fail(s);
  }
  if (json) std::fputs(megatrain::sim::result_json(*r).c_str(), stdout);
  else print_table(*r);
  if (!trace_path.empty() && !json) std::printf("trace written to %s\n", trace_path.c_str());
  return 0;
}

// Ranges of the numeric flags (docs/decisions.md, "Output paths and flag ranges"): a sequence as
// long as a plan file accepts, 2^40 tokens per step, a billion steps as megatrain-exec takes.
constexpr int64_t kMaxSeq = int64_t{1} << 24;
constexpr int64_t kMaxTokensPerStep = int64_t{1} << 40;
constexpr int64_t kMaxSteps = 1'000'000'000;

// An output file of the subcommand, probed before it measures, searches or simulates (profile's
// --storage folders are probed by run_profile, also before it measures).
megatrain::Status check_output_file(const char* flag, const std::string& path) {
  return path.empty() ? megatrain::Status{} : megatrain::check_output(flag, path, megatrain::OutputKind::kFile);
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = megatrain::cli;
  CLI::App app{"megatrain-plan: inspect models, profile rigs, simulate and search training plans"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("megatrain-plan ") + MEGATRAIN_VERSION);

  std::string model;
  megatrain::planner::InspectOptions inspect_opt;
  bool json = false;
  CLI::App* inspect = app.add_subcommand("inspect", "Parameter counts, FLOPs per token and training-state bytes of a model");
  inspect->add_option("--model,-m", model, "config.json, a folder holding one, or a name in profiles/models/")->required();
  inspect->add_option("--seq", inspect_opt.seq_len, "sequence length for FLOPs and activations (default: the model's max)")
      ->check(cli::int_range(1, kMaxSeq));
  inspect->add_flag("--tensors", inspect_opt.list_tensors, "also list every tensor with its HF name and shape");
  inspect->add_flag("--ops", inspect_opt.list_ops,
                    "also list the decoder layer's ops (each kind of layer): widths, FLOPs and bytes kept per token");
  inspect->add_flag("--json", json, "print one JSON object on stdout");

  std::string plan_path, trace_path;
  bool sim_json = false;
  CLI::App* simulate = app.add_subcommand("simulate", "Simulate a plan's training step: time, bottleneck, memory per tier");
  simulate->add_option("plan", plan_path, "plan file (megatrain.plan/1)")->required();
  simulate->add_option("--trace", trace_path, "write the simulated timeline to this .mtrace file");
  simulate->add_flag("--json", sim_json, "print one JSON object on stdout");

  megatrain::planner::ProfileCommand prof;
  CLI::App* profile = app.add_subcommand("profile", "Measure this machine (memory, AdamW, GEMMs, transfers, storage) and write a rig profile");
  profile->add_option("--storage", prof.storage_dirs, "directory on a drive to measure with O_DIRECT (repeatable)");
  profile->add_flag("--quick", prof.quick, "smaller sizes and fewer points (about 15-30 s instead of 1-3 min)");
  profile->add_option("--storage-gib", prof.storage_gib,
                      "size of the storage probe's temp file in GiB (default 1, quick 0.25); make it larger than any cache "
                      "between this machine and its drive (a VM host's page cache) to measure sustained rates")
      ->check(cli::number_range(0.01, 4096.0));
  profile->add_option("--model,-m", prof.model,
                      "also time this model's layer GEMMs, attention and element-wise work (config.json, folder or name)");
  profile->add_option("--seq", prof.seq, "sequence length for --model (default: min(its max, 2048))")
      ->check(cli::int_range(1, int64_t{1} << 20));
  profile->add_option("-o,--output", prof.output, "write the measured rig (megatrain.rig/1) to this file, atomically");
  profile->add_flag("--json", prof.json, "print one JSON object {rig, fits, ...} on stdout");

  megatrain::planner::PlanCommand plan_cmd;
  CLI::App* plan = app.add_subcommand("plan", "Search the plan knobs for the highest simulated tokens/s that fits the rig");
  plan->add_option("--model,-m", plan_cmd.model, "config.json, a folder holding one, or a name in profiles/models/")->required();
  plan->add_option("--rig,-r", plan_cmd.rig, "rig profile: a path or a name in profiles/hardware/")->required();
  plan->add_option("--seq", plan_cmd.seq_len, "sequence length (default: min(4096, the model's max))")
      ->check(cli::int_range(1, kMaxSeq));
  plan->add_option("--tokens-per-step", plan_cmd.tokens_per_step, "tokens per optimizer step, a multiple of --seq (default: 64 sequences)")
      ->check(cli::int_range(1, kMaxTokensPerStep));
  plan->add_option("--micro-batch", plan_cmd.micro_batch,
                   "sequences per micro-batch, a divisor of the step's sequences (default: the search chooses)")
      ->check(cli::int_range(1, 1 << 20));
  plan->add_option("--gpus", plan_cmd.gpus,
                   "data-parallel ranks, one per GPU, on a rig with a cluster section (default 1); --tokens-per-step is the job's")
      ->check(cli::int_range(1, 65536));
  plan->add_option("--nodes", plan_cmd.nodes,
                   "with --gpus: the nodes the ranks spread over, evenly (default: as few as hold them)")
      ->check(cli::int_range(1, 65536));
  plan->add_option("--data", plan_cmd.data,
                   "a prepared dataset (megatrain-data prepare) the plan is for: its seq_len, and in rows packed \"neat\" its "
                   "documents' lengths, which the attention's cost scales with");
  plan->add_option("--document-tokens", plan_cmd.document_tokens,
                   "rows packed \"neat\": the documents' length-weighted mean length in tokens (default: what --data says; "
                   "without it 0, every row one context)")
      ->check(cli::number_range(0.0, static_cast<double>(kMaxSeq)));
  plan->add_option("--top", plan_cmd.top, "alternatives to list (default 5)")->check(cli::int_range(0, 1000));
  plan->add_option("-o,--output", plan_cmd.output, "write the best plan (with predicted) to this file, atomically");
  plan->add_option("--state-formats", plan_cmd.state_formats,
                   "optimizer-state formats m and v may use, comma-separated (default fp32: full precision; lossy: bf16, q8, q4, q3, q2)");
  plan->add_option("--compute", plan_cmd.compute, "compute dtype: auto (bf16 on a GPU, fp32 on the CPU backend), bf16, fp32");
  plan->add_option("--steps", plan_cmd.steps, "training.steps written into the plan (default 1000)")->check(cli::int_range(1, kMaxSteps));
  plan->add_option("--tolerance", plan_cmd.tolerance, "skip candidates that cannot beat the best by more than this fraction (default 0: exact)")
      ->check(cli::number_range(0.0, 0.5));
  plan->add_flag("--json", plan_cmd.json, "print one JSON object {plan, alternatives, ...} on stdout");

  megatrain::planner::SizeCommand size_cmd;
  CLI::App* size = app.add_subcommand("size", "The smallest rig per GPU that trains a model, or the largest model of a family a rig trains");
  size->add_option("--model,-m", size_cmd.model, "model to size rigs for: config.json, a folder holding one, or a name in profiles/models/");
  size->add_option("--target-tokens-per-s", size_cmd.target_tokens_per_s, "the rig (or, with --rig, the GPU count) must also reach this many tokens/s")
      ->check(cli::number_range(0.0, 1e15));
  size->add_option("--gpu", size_cmd.gpu, "only GPUs whose rig or GPU name contains this (case-insensitive)");
  size->add_option("--family", size_cmd.family, "with --rig: the largest model of this family (llama-2, llama-3, qwen2.5, ...) the rig trains");
  size->add_option("--rig,-r", size_cmd.rig, "the rig, a path or a name in profiles/hardware/: with --family, the largest model it trains; with --model, how many of its GPUs (a rig with a cluster section)");
  size->add_option("--seq", size_cmd.seq_len, "sequence length (default: min(4096, the model's max))")->check(cli::int_range(1, kMaxSeq));
  size->add_option("--tokens-per-step", size_cmd.tokens_per_step, "tokens per step, a multiple of --seq (default: 64 sequences)")
      ->check(cli::int_range(1, kMaxTokensPerStep));
  size->add_option("--state-formats", size_cmd.state_formats, "optimizer-state formats allowed (default fp32)");
  size->add_flag("--json", size_cmd.json, "print one JSON object on stdout");

  if (const int rc = cli::parse(app, argc, argv, "megatrain-plan"); rc >= 0) return rc;

  if (inspect->parsed()) {
    auto spec = megatrain::ModelSpec::load(model);
    if (!spec.ok()) return fail(spec.status());
    std::fputs((json ? megatrain::planner::inspect_json(*spec, inspect_opt)
                     : megatrain::planner::inspect_table(*spec, inspect_opt)).c_str(), stdout);
    return 0;
  }
  if (simulate->parsed()) {
    if (megatrain::Status s = check_output_file("--trace", trace_path); !s.ok()) return fail(s);
    return run_simulate(plan_path, trace_path, sim_json);
  }
  if (profile->parsed()) {
    if (megatrain::Status s = check_output_file("-o", prof.output); !s.ok()) return fail(s);
    return megatrain::planner::profile_command(prof);
  }
  if (plan->parsed()) {
    if (megatrain::Status s = check_output_file("-o", plan_cmd.output); !s.ok()) return fail(s);
    return megatrain::planner::plan_command(plan_cmd);
  }
  if (size->parsed()) return megatrain::planner::size_command(size_cmd);
  return 0;
}

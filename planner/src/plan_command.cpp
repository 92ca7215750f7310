// `megatrain-plan plan`: load the model and the rig, search, print the report or JSON, and write
// the best plan atomically when asked. Exit codes: 0 a plan, 1 a bad request or file, 2 nothing fits.
#include <cstdio>
#include <filesystem>

#include "megatrain/core/units.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/planner/search.h"

namespace megatrain::planner {
namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "megatrain-plan: error: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

ProfileRef profile_ref(const std::string& spec) {
  std::error_code ec;
  if (std::filesystem::exists(spec, ec)) return ProfileRef{false, std::filesystem::absolute(spec, ec).lexically_normal().string()};
  return ProfileRef{false, spec};
}

int plan_command(const PlanCommand& cmd) {
  auto model = ModelSpec::load(cmd.model);
  if (!model.ok()) return fail(model.status().with_context("--model"));
  auto rig = HardwareProfile::load(cmd.rig);
  if (!rig.ok()) return fail(rig.status().with_context("--rig"));
  SearchRequest req;
  req.seq_len = cmd.seq_len;
  req.document_tokens = cmd.document_tokens;
  if (!cmd.data.empty()) {
    if (!data::SequenceFile::is_sequence_file(cmd.data))
      return fail(invalid_argument(cmd.data + ": not a prepared dataset (no MTSEQ001 magic); accepted: a file written by "
                                   "megatrain-data prepare (a token file's rows are whole contexts: leave --data out)")
                      .with_context("--data"));
    auto rows = data::SequenceFile::open(cmd.data);
    if (!rows.ok()) return fail(rows.status().with_context("--data"));
    if (cmd.seq_len != 0 && cmd.seq_len != rows->seq_len())
      return fail(invalid_argument("--seq " + std::to_string(cmd.seq_len) + ", but " + cmd.data + " holds rows of " +
                                   std::to_string(rows->seq_len()) + " tokens; accepted: --seq " +
                                   std::to_string(rows->seq_len()) + " or no --seq"));
    req.seq_len = rows->seq_len();
    if (cmd.document_tokens == 0) req.document_tokens = rows->document_tokens();
  }
  req.tokens_per_step = cmd.tokens_per_step;
  req.micro_batch = cmd.micro_batch;
  req.gpus = cmd.gpus;
  req.nodes = cmd.nodes;
  req.steps = cmd.steps;
  req.top = cmd.top;
  req.model_ref = profile_ref(cmd.model);
  req.rig_ref = profile_ref(cmd.rig);
  auto formats = parse_state_format_list(cmd.state_formats);
  if (!formats.ok()) return fail(formats.status().with_context("--state-formats"));
  req.policy.state_formats = *formats;
  if (cmd.compute == "bf16") req.policy.compute = DType::kBf16;
  else if (cmd.compute == "fp32") req.policy.compute = DType::kFp32;
  else if (cmd.compute != "auto")
    return fail(invalid_argument("--compute '" + cmd.compute + "' is not accepted; accepted: auto, bf16, fp32"));
  SearchOptions opt;
  opt.tolerance = cmd.tolerance;
  auto res = search_plan(*model, *rig, req, opt);
  if (!res.ok()) return fail(res.status());
  if (!res->feasible) {
    if (cmd.json) std::fputs(search_json(*res).c_str(), stdout);
    else std::fputs(search_table(*res).c_str(), stdout);
    std::fprintf(stderr, "megatrain-plan: %s\n", res->infeasible_reason.c_str());
    return 2;
  }
  if (!cmd.output.empty()) {
    Status s = res->best.plan.save(cmd.output);
    if (!s.ok()) return fail(s.with_context("-o"));
    auto back = Plan::load(cmd.output);
    if (!back.ok()) return fail(back.status().with_context("the written plan does not load back"));
  }
  if (cmd.json) {
    std::fputs(search_json(*res).c_str(), stdout);
  } else {
    std::fputs(search_table(*res).c_str(), stdout);
    if (!cmd.output.empty()) std::printf("plan written to %s\n", cmd.output.c_str());
  }
  return 0;
}

}  // namespace megatrain::planner

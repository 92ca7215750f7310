// megatrain-plan: argument parsing only; the work is in megatrain_planner.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "megatrain/core/model_spec.h"
#include "megatrain/planner/inspect.h"

namespace {

int fail(const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-plan: error: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatrain-plan: inspect models, profile rigs, simulate and search training plans"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("megatrain-plan ") + MEGATRAIN_VERSION);

  std::string model;
  megatrain::planner::InspectOptions inspect_opt;
  bool json = false;
  CLI::App* inspect = app.add_subcommand("inspect", "Parameter counts, FLOPs per token and training-state bytes of a model");
  inspect->add_option("--model,-m", model, "config.json, a folder holding one, or a name in profiles/models/")->required();
  inspect->add_option("--seq", inspect_opt.seq_len, "sequence length for FLOPs and activations (default: the model's max)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  inspect->add_flag("--tensors", inspect_opt.list_tensors, "also list every tensor with its HF name and shape");
  inspect->add_flag("--json", json, "print one JSON object on stdout");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (inspect->parsed()) {
    auto spec = megatrain::ModelSpec::load(model);
    if (!spec.ok()) return fail(spec.status());
    std::fputs((json ? megatrain::planner::inspect_json(*spec, inspect_opt)
                     : megatrain::planner::inspect_table(*spec, inspect_opt)).c_str(), stdout);
    return 0;
  }
  return 0;
}

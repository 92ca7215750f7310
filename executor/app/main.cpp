// megatrain-exec: trains from a plan file on the CPU backend. Argument parsing and the progress
// line only; the work is in megatrain_executor.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>

#include "megatrain/core/plan.h"
#include "megatrain/core/units.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/executor/weights_io.h"

namespace {

int fail(const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-exec: error: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace megatrain;
  CLI::App app{"megatrain-exec: train from a plan file (CPU backend)"};
  std::string plan_path, data_path, trace_path, init_dir, backend = "cpu";
  int64_t steps = 0;
  int threads = 1;
  bool reference = false;
  app.add_option("plan", plan_path, "plan file (megatrain.plan/1)")->required();
  app.add_option("--data", data_path, "token file: llm.c .bin, raw .u16/.u32, or any other file as bytes (vocab 256)")->required();
  app.add_option("--steps", steps, "steps to run (default: training.steps of the plan)")->check(CLI::PositiveNumber);
  app.add_option("--init", init_dir, "start from a Hugging Face checkpoint: a folder with model.safetensors or a sharded index")
      ->check(CLI::ExistingPath);
  app.add_option("--trace", trace_path, "write the measured timeline to this .mtrace file");
  app.add_option("--backend", backend, "cpu (the CUDA backend arrives with issue 7)")->check(CLI::IsMember({"cpu"}));
  app.add_option("--threads", threads, "compute threads of the CPU backend")->check(CLI::Range(1, 256));
  app.add_flag("--in-memory", reference, "run the plain in-memory loop instead of the streamed pipeline (the reference)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto plan = Plan::load(plan_path);
  if (!plan.ok()) return fail(plan.status());
  auto model = plan->resolve_model();
  if (!model.ok()) return fail(model.status());
  auto file = exec::TokenFile::open(data_path);
  if (!file.ok()) return fail(file.status());
  auto tokens = std::make_shared<const exec::TokenFile>(std::move(file).value());
  if (Status s = tokens->check_vocab(model->config().vocab_size); !s.ok()) return fail(s);
  auto order = exec::parse_data_order(plan->training.data_order);
  if (!order.ok()) return fail(order.status());
  auto loader = exec::DataLoader::create(tokens, plan->training.seq_len, plan->training.micro_batch,
                                         plan->training.grad_accum, *order, static_cast<uint64_t>(plan->training.seed),
                                         model->config().vocab_size);
  if (!loader.ok()) return fail(loader.status());
  exec::HostState state = exec::HostState::create(*model, plan->precision.transfer);
  if (!init_dir.empty()) {
    if (Status s = exec::load_weights(state, init_dir); !s.ok()) return fail(s);
  } else {
    state.init_random(static_cast<uint64_t>(plan->training.seed), 0.02);
  }
  exec::TrainerOptions opt;
  opt.streamed = !reference;
  opt.threads = threads;
  opt.record_trace = !trace_path.empty();
  auto trainer = exec::Trainer::create(*plan, *model, state, *loader, opt);
  if (!trainer.ok()) return fail(trainer.status());

  const int64_t total = steps > 0 ? steps : plan->training.steps;
  std::printf("megatrain-exec: %s, %lld parameters, %lld tokens/step, %lld steps, %s on the CPU backend\n",
              model->name().c_str(), static_cast<long long>(model->parameter_counts().total),
              static_cast<long long>(loader->tokens_per_step()), static_cast<long long>(total),
              reference ? "in-memory loop" : "streamed");
  if (!reference)
    std::printf("device arena %s of %s budget\n", format_bytes(static_cast<double>((*trainer)->budget().total())).c_str(),
                plan->placement.device_budget_bytes > 0
                    ? format_bytes(static_cast<double>(plan->placement.device_budget_bytes)).c_str()
                    : "the rig's whole");
  double elapsed = 0;
  for (int64_t s = 0; s < total; ++s) {
    auto r = (*trainer)->run_step(s);
    if (!r.ok()) return fail(r.status());
    elapsed += r->time_s;
    const double eta = elapsed / static_cast<double>(s + 1) * static_cast<double>(total - s - 1);
    std::printf("step %5lld/%lld  loss %.4f  %8.0f tokens/s  stall %4.1f%%  ETA %s\n", static_cast<long long>(s + 1),
                static_cast<long long>(total), r->loss, static_cast<double>(r->tokens) / r->time_s,
                100.0 * r->stall_s / r->time_s, format_duration(eta).c_str());
    std::fflush(stdout);
  }
  if (!trace_path.empty()) {
    if (Status s = (*trainer)->write_trace(trace_path, plan->to_json_text()); !s.ok()) return fail(s);
    std::printf("trace written to %s\n", trace_path.c_str());
  }
  return 0;
}

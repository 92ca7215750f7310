// megatrain-bench-states: what the lossy optimizer-state formats cost in quality (issue 8).
//
//   update  Trains a model with fp32 states for --warmup steps, keeps that state, runs one more
//           step to get its gradient, then makes that step's AdamW update from the kept state once
//           with fp32 moments and once per format (the kept m and v encoded in it), and reports
//           the relative error of the update ||dw_f - dw_fp32|| / ||dw_fp32|| over all parameters.
//   train   Trains the same model from the same initialisation on the same data for --steps steps
//           once per format and reports the final loss (mean of the last 10 steps) against fp32's.
//
// Data: any file as bytes (vocab 256), default the GPL-3 text. Models: names or paths (vocab 256).

#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/core/plan.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/moments.h"
#include "megatrain/executor/trainer.h"

namespace exec = megatrain::exec;
using megatrain::StateFormat;

namespace {

const StateFormat kFormats[] = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kQ8,
                                StateFormat::kQ4,   StateFormat::kQ3,   StateFormat::kQ2};

[[noreturn]] void die(const std::string& what, const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-bench-states: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}

std::string plan_text(const std::string& model, int64_t steps, StateFormat f, int64_t seq, int64_t mb) {
  const std::string fmt = megatrain::state_format_name(f);
  return R"({"schema": "megatrain.plan/1", "model": ")" + model + R"(", "rig": "cpu-dev-2core",
    "training": {"seq_len": )" + std::to_string(seq) + R"(, "micro_batch": )" + std::to_string(mb) + R"(, "grad_accum": 2,
                 "steps": )" + std::to_string(steps) + R"(, "seed": 1, "lr": 3e-3, "lr_schedule": "cosine",
                 "warmup_steps": 10, "min_lr": 3e-4, "clip_grad_norm": 1.0, "data_order": "sequential"},
    "precision": {"compute": "fp32", "master": "fp32", "transfer": "fp32"},
    "schedule": {"order": "layer-major", "prefetch_depth": 1, "device_layer_buffers": 2, "checkpoint_every": 1,
                 "checkpoint_location": "device"},
    "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "threads": 2,
                  "m_format": ")" + fmt + R"(", "v_format": ")" + fmt + R"(", "block_size": 128}})";
}

struct Setup {
  megatrain::Plan plan;
  std::unique_ptr<megatrain::ModelSpec> model;
  std::unique_ptr<exec::HostState> state;
  std::unique_ptr<exec::DataLoader> data;
  std::unique_ptr<exec::Trainer> trainer;
};

Setup make(const std::string& model, int64_t steps, StateFormat f, int64_t seq, int64_t mb,
           const std::shared_ptr<const exec::TokenFile>& tokens, int threads) {
  Setup s;
  auto plan = megatrain::Plan::from_json_text(plan_text(model, steps, f, seq, mb), "states plan");
  if (!plan.ok()) die("plan", plan.status());
  s.plan = *plan;
  auto m = s.plan.resolve_model();
  if (!m.ok()) die("model", m.status());
  s.model = std::make_unique<megatrain::ModelSpec>(std::move(m).value());
  s.state = std::make_unique<exec::HostState>(exec::HostState::create(*s.model, s.plan.precision.transfer, f, f, 128));
  (void)s.state->init_random(1, 0.02);  // RAM only: cannot fail
  auto loader = exec::DataLoader::create(tokens, seq, mb, 2, exec::DataOrder::kSequential, 1, s.model->config().vocab_size);
  if (!loader.ok()) die("data", loader.status());
  s.data = std::make_unique<exec::DataLoader>(std::move(loader).value());
  exec::TrainerOptions o;
  o.threads = threads;
  auto t = exec::Trainer::create(s.plan, *s.model, *s.state, *s.data, o);
  if (!t.ok()) die("trainer", t.status());
  s.trainer = std::move(t).value();
  return s;
}

// ||dw_f - dw_ref|| / ||dw_ref|| for one step from the kept state, per format.
std::vector<double> update_errors(const std::string& model, int64_t warmup, int64_t seq, int64_t mb,
                                  const std::shared_ptr<const exec::TokenFile>& tokens, int threads) {
  Setup s = make(model, warmup + 1, StateFormat::kFp32, seq, mb, tokens, threads);
  for (int64_t k = 0; k < warmup; ++k)
    if (auto r = s.trainer->run_step(k); !r.ok()) die("step", r.status());
  s.trainer->wait_for_updates();
  struct Kept {
    std::vector<float> w, m, v;
  };
  std::vector<Kept> kept;
  for (const auto& u : s.state->units())
    kept.push_back({std::vector<float>(u.master.data(), u.master.data() + u.numel), std::vector<float>(u.m.data(), u.m.data() + u.numel),
                    std::vector<float>(u.v.data(), u.v.data() + u.numel)});
  auto last = s.trainer->run_step(warmup);  // its gradient stays in the RAM tier
  if (!last.ok()) die("step", last.status());
  s.trainer->wait_for_updates();
  const megatrain::OptimizerConfig& o = s.plan.optimizer;
  const double lr = exec::learning_rate(s.plan.training, warmup);
  const float clip = last->grad_norm > 0 && s.plan.training.clip_grad_norm > 0 &&
                             s.plan.training.clip_grad_norm / (last->grad_norm + 1e-6) < 1.0
                         ? static_cast<float>(s.plan.training.clip_grad_norm / (last->grad_norm + 1e-6))
                         : 1.0f;
  std::vector<double> errors;
  std::vector<std::vector<float>> ref_delta;
  for (StateFormat f : kFormats) {
    double num = 0, den = 0;
    for (size_t ui = 0; ui < s.state->units().size(); ++ui) {
      const exec::UnitState& u = s.state->units()[ui];
      std::vector<int64_t> sizes;
      for (const auto& t : u.tensors) sizes.push_back(t.numel);
      exec::MomentStore m = exec::MomentStore::create(f, false, sizes, 128);
      exec::MomentStore v = exec::MomentStore::create(f, true, sizes, 128);
      std::vector<float> w = kept[ui].w;
      for (size_t ti = 0; ti < u.tensors.size(); ++ti) {
        const auto& t = u.tensors[ti];
        m.encode(ti, kept[ui].m.data() + t.offset);
        v.encode(ti, kept[ui].v.data() + t.offset);
        exec::AdamWStep st{lr, o.beta1, o.beta2, o.eps, t.decay ? o.weight_decay : 0.0, warmup + 1, clip};
        exec::adamw_update_moments(w.data() + t.offset, u.grad.data() + t.offset, m.tensor(ti), v.tensor(ti), t.numel, st,
                                   nullptr, nullptr, threads);
      }
      std::vector<float> delta(w.size());
      for (size_t i = 0; i < w.size(); ++i) delta[i] = w[i] - kept[ui].w[i];
      if (f == StateFormat::kFp32) {
        // The reference must be the trainer's own update: check it, then keep it.
        for (size_t i = 0; i < w.size(); ++i)
          if (w[i] != u.master.data()[i]) die("reference", megatrain::internal_error("the fp32 replay differs from the trainer's update"));
        ref_delta.push_back(delta);
      }
      for (size_t i = 0; i < w.size(); ++i) {
        const double d = static_cast<double>(delta[i]) - ref_delta[ui][i];
        num += d * d;
        den += static_cast<double>(ref_delta[ui][i]) * ref_delta[ui][i];
      }
    }
    errors.push_back(std::sqrt(num / den));
  }
  return errors;
}

// Final loss (mean of the last 10 steps) per format.
std::vector<double> final_losses(const std::string& model, int64_t steps, int64_t seq, int64_t mb,
                                 const std::shared_ptr<const exec::TokenFile>& tokens, int threads,
                                 std::vector<double>* first) {
  std::vector<double> out;
  for (StateFormat f : kFormats) {
    Setup s = make(model, steps, f, seq, mb, tokens, threads);
    double tail = 0;
    int n = 0;
    for (int64_t k = 0; k < steps; ++k) {
      auto r = s.trainer->run_step(k);
      if (!r.ok()) die("step", r.status());
      if (k == 0 && first) first->push_back(r->loss);
      if (k >= steps - 10) tail += r->loss, ++n;
    }
    s.trainer->wait_for_updates();
    out.push_back(tail / n);
    std::fprintf(stderr, "  %s %s: final loss %.4f\n", model.c_str(), megatrain::state_format_name(f), tail / n);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = megatrain::cli;
  CLI::App app{"megatrain-bench-states: update error and training loss of each optimizer-state format"};
  std::vector<std::string> models = {"tiny-llama-gqa", "small-llama"};
  std::string data_path = "/usr/share/common-licenses/GPL-3";
  int64_t steps = 150, warmup = 40, seq = 64, mb = 4;
  int threads = 2;
  bool json = false;
  app.add_option("--model", models, "models (vocab 256), repeatable");
  app.add_option("--data", data_path, "token file, or any file as bytes");
  app.add_option("--steps", steps, "training steps per format")->check(cli::int_range(11, 100000));
  app.add_option("--warmup", warmup, "fp32 steps before the update whose error is measured")->check(cli::int_range(1, 100000));
  app.add_option("--seq", seq, "sequence length")->check(cli::int_range(2, 4096));
  app.add_option("--micro-batch", mb, "micro-batch")->check(cli::int_range(1, 256));
  app.add_option("--threads", threads, "compute and optimizer threads")->check(cli::int_range(1, 1024));
  app.add_flag("--json", json, "print one JSON object on stdout");
  if (const int rc = cli::parse(app, argc, argv, "megatrain-bench-states"); rc >= 0) return rc;
  auto file = exec::TokenFile::open(data_path);
  if (!file.ok()) die("data", file.status());
  auto tokens = std::make_shared<const exec::TokenFile>(std::move(file).value());
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const std::string& model : models) {
    std::fprintf(stderr, "%s: update error after %lld fp32 steps\n", model.c_str(), static_cast<long long>(warmup));
    const std::vector<double> err = update_errors(model, warmup, seq, mb, tokens, threads);
    std::fprintf(stderr, "%s: %lld training steps per format\n", model.c_str(), static_cast<long long>(steps));
    std::vector<double> first;
    const std::vector<double> loss = final_losses(model, steps, seq, mb, tokens, threads, &first);
    if (!json) {
      std::printf("\n%s (%lld steps, seq %lld, micro-batch %lld x 2, block 128)\n\n", model.c_str(), static_cast<long long>(steps),
                  static_cast<long long>(seq), static_cast<long long>(mb));
      std::printf("| format | update error vs fp32 | final loss | vs fp32 |\n|---|---|---|---|\n");
    }
    nlohmann::ordered_json jm = nlohmann::ordered_json::object();
    for (size_t i = 0; i < std::size(kFormats); ++i) {
      const double rel = (loss[i] - loss[0]) / loss[0];
      if (!json)
        std::printf("| %s | %.4f | %.4f | %+.2f%% |\n", megatrain::state_format_name(kFormats[i]), err[i], loss[i], 100 * rel);
      jm[megatrain::state_format_name(kFormats[i])] = {{"update_error", err[i]}, {"final_loss", loss[i]}, {"loss_vs_fp32", rel}};
    }
    j[model] = {{"steps", steps}, {"first_loss", first.empty() ? 0.0 : first[0]}, {"formats", jm}};
  }
  if (json) std::printf("%s\n", j.dump(1).c_str());
  return 0;
}

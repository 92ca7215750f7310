// megatrain-bench-exec: the executor's speed, each figure reported as a ratio against a reference
// measured in the same run: `overlap` (streamed vs in-memory training tokens/s), `gemm` (the model's
// GEMM path, megatrain::cpu::linear_*, vs a plain Eigen product), `moe` (grouped expert GEMMs vs a
// dense one) and `ops` (where the CPU backend's step goes, op by op, against each op's roofline).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

// GCC 12 reports false "(may be) used uninitialized" warnings inside Eigen's AVX-512 packet code.
#ifndef __clang__  // a GCC-only warning; clang warns about the name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>

#include "megatrain/core/plan.h"
#include "bench_flags.h"
#include "bench_util.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/kernels/cpu/context.h"
#include "megatrain/kernels/cpu/add.h"
#include "megatrain/kernels/cpu/linear.h"
#include "megatrain/kernels/cpu/moe.h"
#include "megatrain/kernels/cpu/profile.h"
#include "megatrain/kernels/cpu/swiglu.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace exec = megatrain::exec;

double seconds_since(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

using megatrain::bench::OtherLoad;

// Minor page faults of this process so far. A page fault costs microseconds on these VMs, so a
// buffer that gets fresh pages on every call (malloc handing memory back to the kernel and taking
// it again) can cost more than the arithmetic; the benchmarks count them to show it.
int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_minflt);
}

// A Llama-like model big enough that a layer's compute (about 9 GFLOP per step) dwarfs the copy of
// its weights (2.9 MB, about 0.1 ms at the rig's 30 GB/s): a compute-bound configuration.
const char* kModel = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 4,
  "num_hidden_layers": 6, "vocab_size": 512, "max_position_embeddings": 128,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": null, "attention_bias": false,
  "tie_word_embeddings": false, "torch_dtype": "float32"
})";

std::string plan_text(int checkpoint_every, int64_t steps) {
  return std::string(R"({"schema": "megatrain.plan/1", "model": )") + kModel + R"(, "rig": "cpu-dev-2core",
    "training": {"seq_len": 128, "micro_batch": 4, "grad_accum": 4, "steps": )" + std::to_string(steps) + R"(,
                 "seed": 1, "lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr": 1e-4,
                 "clip_grad_norm": 1.0, "data_order": "sequential"},
    "precision": {"compute": "fp32", "master": "fp32", "transfer": "fp32"},
    "schedule": {"order": "layer-major", "prefetch_depth": 2, "device_layer_buffers": 3,
                 "checkpoint_every": )" + std::to_string(checkpoint_every) + R"(, "checkpoint_location": "device"},
    "placement": {"master_weights": "ram", "optimizer_states": "ram", "device_budget_bytes": 1073741824},
    "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "threads": 1}
  })";
}

[[noreturn]] void die(const std::string& what, const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-bench-exec: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}

// ---- overlap ------------------------------------------------------------------------------------

// One training run: its own plan, RAM tier, data and trainer, so runs never share state.
struct Run {
  std::string label;
  bool streamed = true;
  int checkpoint_every = 1;
  megatrain::Plan plan;
  std::unique_ptr<megatrain::ModelSpec> model;
  std::unique_ptr<exec::HostState> state;
  std::unique_ptr<exec::DataLoader> data;
  std::unique_ptr<exec::Trainer> trainer;
  std::vector<double> losses, wall_s, stall_s;
  int64_t tokens_per_step = 0, faults = 0;  // faults: minor page faults in the timed steps
};

void setup(Run& r, int64_t steps, int threads, const std::shared_ptr<const exec::TokenFile>& tokens) {
  auto plan = megatrain::Plan::from_json_text(plan_text(r.checkpoint_every, steps), "bench plan");
  if (!plan.ok()) die("plan", plan.status());
  r.plan = *plan;
  auto model = r.plan.resolve_model();
  if (!model.ok()) die("model", model.status());
  r.model = std::make_unique<megatrain::ModelSpec>(std::move(model).value());
  r.state = std::make_unique<exec::HostState>(exec::HostState::create(*r.model, r.plan.precision.transfer));
  (void)r.state->init_random(static_cast<uint64_t>(r.plan.training.seed), 0.02);  // RAM only: cannot fail
  auto loader = exec::DataLoader::create(tokens, r.plan.training.seq_len, r.plan.training.micro_batch,
                                         r.plan.training.grad_accum, exec::DataOrder::kSequential, 1,
                                         r.model->config().vocab_size);
  if (!loader.ok()) die("data", loader.status());
  r.data = std::make_unique<exec::DataLoader>(std::move(loader).value());
  r.tokens_per_step = r.data->tokens_per_step();
  exec::TrainerOptions o;
  o.streamed = r.streamed;
  o.threads = threads;
  auto t = exec::Trainer::create(r.plan, *r.model, *r.state, *r.data, o);
  if (!t.ok()) die("trainer (" + r.label + ")", t.status());
  r.trainer = std::move(t).value();
}

using megatrain::bench::make_tokens;

bool same_weights(const exec::HostState& a, const exec::HostState& b) {
  for (size_t u = 0; u < a.units().size(); ++u) {
    const auto& x = a.units()[u];
    const auto& y = b.units()[u];
    if (x.numel != y.numel || std::memcmp(x.master.data(), y.master.data(), sizeof(float) * static_cast<size_t>(x.numel)) != 0)
      return false;
  }
  return true;
}

struct RunStats {
  double tokens_per_s = 0, step_min = 0, step_max = 0, stall_share = 0, faults_per_step = 0;
};

// Step 0 is a warm-up (first touch of every buffer) and is left out of the rates.
RunStats stats_of(const Run& r) {
  RunStats s;
  double wall = 0, stall = 0, lo = 1e30, hi = 0;
  for (size_t i = 1; i < r.wall_s.size(); ++i) {
    wall += r.wall_s[i];
    stall += r.stall_s[i];
    lo = std::min(lo, r.wall_s[i]);
    hi = std::max(hi, r.wall_s[i]);
  }
  const double tok = static_cast<double>(r.tokens_per_step);
  s.tokens_per_s = tok * static_cast<double>(r.wall_s.size() - 1) / wall;
  s.step_min = tok / hi;
  s.step_max = tok / lo;
  s.stall_share = stall / wall;
  s.faults_per_step = static_cast<double>(r.faults) / static_cast<double>(r.wall_s.size() - 1);
  return s;
}

int overlap(int64_t steps, int threads, bool json) {
  // Three runs of the same model, seed and batches, stepped in rotation (step s: A B C, then B C A,
  // ...) so that machine noise falls on all of them alike:
  //   in-memory:  the plain loop, every activation kept, optimizer inline (the reference);
  //   streamed c=1: the brief's configuration, checkpoints every layer, so backward recomputes each
  //                 layer's forward (one more forward per layer than the reference);
  //   streamed c=0: every activation kept on the device: the same arithmetic as the reference, so
  //                 its ratio is the cost of streaming itself.
  std::vector<Run> runs(3);
  runs[0].label = "in-memory loop (reference)";
  runs[0].streamed = false;
  runs[1].label = "streamed, checkpoint_every 1";
  runs[1].checkpoint_every = 1;
  runs[2].label = "streamed, checkpoint_every 0";
  runs[2].checkpoint_every = 0;
  auto tokens = std::make_shared<const exec::TokenFile>(exec::TokenFile::from_tokens(make_tokens(1 << 20, 512)));
  for (Run& r : runs) setup(r, steps, threads, tokens);
  const OtherLoad load;

  for (int64_t s = 0; s < steps; ++s) {
    for (size_t k = 0; k < runs.size(); ++k) {
      Run& r = runs[(static_cast<size_t>(s) + k) % runs.size()];
      const int64_t f0 = minor_faults();
      const auto a = Clock::now();
      auto res = r.trainer->run_step(s);
      r.trainer->wait_for_updates();  // the runs take turns: none may overlap another's optimizer
      const double wall = seconds_since(a);
      if (s > 0) r.faults += minor_faults() - f0;  // a step returns when all its threads' work is done
      if (!res.ok()) die("step " + std::to_string(s) + " (" + r.label + ")", res.status());
      r.losses.push_back(res->loss);
      r.wall_s.push_back(wall);
      r.stall_s.push_back(res->stall_s);
    }
  }
  const double other_share = load.share();
  bool identical = true;
  for (size_t k = 1; k < runs.size(); ++k)
    identical = identical && runs[k].losses == runs[0].losses && same_weights(*runs[k].state, *runs[0].state);

  std::vector<RunStats> st;
  for (const Run& r : runs) st.push_back(stats_of(r));
  // Per-step ratios (same step, adjacent in time) give the spread within the run.
  auto step_ratios = [&](size_t k) {
    std::vector<double> q;
    for (size_t i = 1; i < runs[0].wall_s.size(); ++i) q.push_back(runs[0].wall_s[i] / runs[k].wall_s[i]);
    std::sort(q.begin(), q.end());
    return q;
  };
  auto median = [](const std::vector<double>& q) {
    return q.size() % 2 ? q[q.size() / 2] : 0.5 * (q[q.size() / 2 - 1] + q[q.size() / 2]);
  };
  const double ratio1 = st[1].tokens_per_s / st[0].tokens_per_s;
  const double ratio0 = st[2].tokens_per_s / st[0].tokens_per_s;
  if (json) {
    std::printf("{\"benchmark\": \"overlap\", \"steps\": %lld, \"timed_steps\": %lld, \"threads\": %d, "
                "\"tokens_per_step\": %lld, \"losses_identical\": %s, \"runs\": [",
                static_cast<long long>(steps), static_cast<long long>(steps - 1), threads,
                static_cast<long long>(runs[0].tokens_per_step), identical ? "true" : "false");
    for (size_t k = 0; k < runs.size(); ++k) {
      std::printf("%s{\"name\": \"%s\", \"tokens_per_s\": %.1f, \"ratio_to_in_memory\": %.4f, \"stall_share\": %.4f, "
                  "\"page_faults_per_step\": %.0f, \"median_step_ratio\": %.4f, \"final_loss\": %.6f}",
                  k ? ", " : "", runs[k].label.c_str(), st[k].tokens_per_s, st[k].tokens_per_s / st[0].tokens_per_s,
                  st[k].stall_share, st[k].faults_per_step, k ? median(step_ratios(k)) : 1.0, runs[k].losses.back());
    }
    std::printf("], \"target\": 0.90, \"ratio\": %.4f, \"ratio_same_arithmetic\": %.4f, \"other_load\": %.3f}\n", ratio1,
                ratio0, other_share);
    return identical ? 0 : 2;
  }
  const auto& cfg = runs[0].model->config();
  std::printf("megatrain-bench-exec overlap: Llama-like hidden %lld, intermediate %lld, %lld heads / %lld kv, %lld layers,\n"
              "  vocab %lld, %lld parameters; seq 128 x micro-batch 4 x grad_accum 4 = %lld tokens/step; fp32 transfer,\n"
              "  prefetch 2, 3 layer buffers, clip 1.0, rig cpu-dev-2core; %d compute thread(s); %lld steps, step 0 untimed\n",
              static_cast<long long>(cfg.hidden_size), static_cast<long long>(cfg.intermediate_size),
              static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.num_kv_heads),
              static_cast<long long>(cfg.num_layers), static_cast<long long>(cfg.vocab_size),
              static_cast<long long>(runs[0].model->parameter_counts().total),
              static_cast<long long>(runs[0].tokens_per_step), threads, static_cast<long long>(steps));
  std::printf("  %-30s %11s %19s %14s %24s %8s %12s\n", "", "tokens/s", "per step (min-max)", "vs in-memory",
              "per-step ratio: median (range)", "stall", "faults/step");
  for (size_t k = 0; k < runs.size(); ++k) {
    char range[40] = "";
    if (k > 0) {
      const auto q = step_ratios(k);
      std::snprintf(range, sizeof range, "%.2f (%.2f-%.2f)", median(q), q.front(), q.back());
    }
    char stall[16] = "";
    if (runs[k].streamed) std::snprintf(stall, sizeof stall, "%.1f%%", 100 * st[k].stall_share);
    std::printf("  %-30s %11.0f %9.0f-%-9.0f %13.3fx %24s %8s %12.0f\n", runs[k].label.c_str(), st[k].tokens_per_s,
                st[k].step_min, st[k].step_max, st[k].tokens_per_s / st[0].tokens_per_s, range, stall, st[k].faults_per_step);
  }
  std::printf("  losses (step 0 .. %lld): %.6f .. %.6f; streamed and in-memory losses and final weights %s\n",
              static_cast<long long>(steps - 1), runs[0].losses.front(), runs[0].losses.back(),
              identical ? "bit-identical" : "DIFFER (a correctness bug)");
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other_share,
              other_share > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  std::printf("  recompute cost, measured: checkpoint_every 1 runs at %.3fx the tokens/s of checkpoint_every 0\n",
              st[1].tokens_per_s / st[2].tokens_per_s);
  std::printf("  verdict: streamed (checkpoint_every 1) / in-memory = %.3f, target >= 0.90: %s; "
              "with the reference's arithmetic (checkpoint_every 0): %.3f, %s\n",
              ratio1, ratio1 >= 0.90 ? "met" : "MISSED", ratio0, ratio0 >= 0.90 ? "met" : "MISSED");
  return identical ? 0 : 2;
}

// ---- gemm ---------------------------------------------------------------------------------------

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMap = Eigen::Map<const RowMat>;
using MMap = Eigen::Map<RowMat>;

struct Shape {
  std::string name;
  int64_t in, out;
};

struct Operands {
  int64_t n, in, out;
  std::vector<float> x, w, y, dy, dx, dw;
  Operands(int64_t n_, int64_t in_, int64_t out_) : n(n_), in(in_), out(out_) {
    uint32_t s = 12345;
    auto fill = [&](std::vector<float>& v, int64_t count) {
      v.resize(static_cast<size_t>(count));
      for (float& f : v) {
        s = s * 1664525u + 1013904223u;
        f = static_cast<float>(s >> 8) / 16777216.0f - 0.5f;
      }
    };
    fill(x, n * in);
    fill(w, out * in);
    fill(dy, n * out);
    y.assign(static_cast<size_t>(n * out), 0.0f);
    dx.assign(static_cast<size_t>(n * in), 0.0f);
    dw.assign(static_cast<size_t>(out * in), 0.0f);
  }
};

// Mean seconds per call over `iters` back-to-back calls (the caller keeps the best of several).
template <typename F>
double seconds_per_call(F&& f, int iters) {
  const auto a = Clock::now();
  for (int i = 0; i < iters; ++i) f();
  return seconds_since(a) / iters;
}

int gemm(int reps, bool json) {
  auto plan = megatrain::Plan::from_json_text(plan_text(1, 1), "bench plan");
  if (!plan.ok()) die("plan", plan.status());
  auto model = plan->resolve_model();
  if (!model.ok()) die("model", model.status());
  const auto& c = model->config();
  const int64_t n = plan->training.micro_batch * plan->training.seq_len;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const std::vector<Shape> shapes = {{"q_proj", c.hidden_size, q},
                                     {"k_proj", c.hidden_size, kv},
                                     {"v_proj", c.hidden_size, kv},
                                     {"o_proj", q, c.hidden_size},
                                     {"gate_proj", c.hidden_size, c.intermediate_size},
                                     {"up_proj", c.hidden_size, c.intermediate_size},
                                     {"down_proj", c.intermediate_size, c.hidden_size},
                                     {"lm_head", c.hidden_size, c.vocab_size}};
  megatrain::cpu::CpuContext ctx1(1), ctx2(2);

  struct Row {
    double flops = 0;
    double fwd_model = 1e30, fwd_eigen = 1e30, bwd_model = 1e30, bwd_eigen = 1e30, fwd_model2 = 1e30;
    int64_t calls_model = 0, faults_model = 0, calls_eigen = 0, faults_eigen = 0;  // 1-thread fwd + bwd
  };
  std::vector<Row> rows(shapes.size());
  std::vector<Operands> ops;
  for (const Shape& s : shapes) ops.emplace_back(n, s.in, s.out);
  // About 20 ms per timing whatever the shape (at a nominal 100 GFLOP/s).
  auto iters_for = [](double flops) { return std::max(3, static_cast<int>(2e9 / flops)); };

  const OtherLoad load;
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      Operands& o = ops[i];
      Row& row = rows[i];
      row.flops = 2.0 * static_cast<double>(n * o.in * o.out);
      const int it = iters_for(row.flops);
      const int bwd_it = std::max(2, it / 2);
      int64_t f0 = minor_faults();
      // Forward: y = x W^T. The model's path, then the plain Eigen product, back to back.
      row.fwd_model = std::min(row.fwd_model, seconds_per_call([&] {
        megatrain::cpu::linear_forward<float>(ctx1, o.x.data(), o.w.data(), nullptr, n, o.in, o.out, o.y.data());
      }, it));
      row.faults_model += minor_faults() - f0;
      f0 = minor_faults();
      row.fwd_eigen = std::min(row.fwd_eigen, seconds_per_call([&] {
        MMap(o.y.data(), n, o.out).noalias() = CMap(o.x.data(), n, o.in) * CMap(o.w.data(), o.out, o.in).transpose();
      }, it));
      row.faults_eigen += minor_faults() - f0;
      row.fwd_model2 = std::min(row.fwd_model2, seconds_per_call([&] {
        megatrain::cpu::linear_forward<float>(ctx2, o.x.data(), o.w.data(), nullptr, n, o.in, o.out, o.y.data());
      }, it));
      // Backward: dx = dy W (overwrite) and dW += dy^T x: two GEMMs of the forward's size.
      f0 = minor_faults();
      row.bwd_model = std::min(row.bwd_model, seconds_per_call([&] {
        megatrain::cpu::linear_backward<float>(ctx1, o.dy.data(), o.x.data(), o.w.data(), n, o.in, o.out, o.dx.data(),
                                               false, o.dw.data(), nullptr);
      }, bwd_it));
      row.faults_model += minor_faults() - f0;
      f0 = minor_faults();
      row.bwd_eigen = std::min(row.bwd_eigen, seconds_per_call([&] {
        const CMap dy(o.dy.data(), n, o.out);
        MMap(o.dx.data(), n, o.in).noalias() = dy * CMap(o.w.data(), o.out, o.in);
        MMap(o.dw.data(), o.out, o.in).noalias() += dy.transpose() * CMap(o.x.data(), n, o.in);
      }, bwd_it));
      row.faults_eigen += minor_faults() - f0;
      row.calls_model += it + bwd_it;
      row.calls_eigen += it + bwd_it;
    }
  }
  const double other_share = load.share();
  // Totals weight each shape by its FLOPs: one layer's seven projections plus the LM head once.
  double t_fm = 0, t_fe = 0, t_bm = 0, t_be = 0, t_fm2 = 0, fl = 0;
  double worst_fwd = 1e30, worst_bwd = 1e30;
  for (const Row& r : rows) {
    t_fm += r.fwd_model, t_fe += r.fwd_eigen, t_bm += r.bwd_model, t_be += r.bwd_eigen, t_fm2 += r.fwd_model2;
    fl += r.flops;
    worst_fwd = std::min(worst_fwd, r.fwd_eigen / r.fwd_model);
    worst_bwd = std::min(worst_bwd, r.bwd_eigen / r.bwd_model);
  }
  const double ratio_fwd = t_fe / t_fm, ratio_bwd = t_be / t_bm;
  auto per_call = [](int64_t faults, int64_t calls) { return static_cast<double>(faults) / static_cast<double>(calls); };
  if (json) {
    std::printf("{\"benchmark\": \"gemm\", \"n\": %lld, \"reps\": %d, \"shapes\": [", static_cast<long long>(n), reps);
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Row& r = rows[i];
      std::printf("%s{\"name\": \"%s\", \"in\": %lld, \"out\": %lld, \"fwd_gflops\": %.2f, \"fwd_eigen_gflops\": %.2f, "
                  "\"fwd_ratio\": %.4f, \"fwd_2threads_gflops\": %.2f, \"bwd_gflops\": %.2f, \"bwd_eigen_gflops\": %.2f, "
                  "\"bwd_ratio\": %.4f, \"faults_per_call_model\": %.2f, \"faults_per_call_eigen\": %.2f}",
                  i ? ", " : "", shapes[i].name.c_str(), static_cast<long long>(shapes[i].in),
                  static_cast<long long>(shapes[i].out), r.flops / r.fwd_model * 1e-9, r.flops / r.fwd_eigen * 1e-9,
                  r.fwd_eigen / r.fwd_model, r.flops / r.fwd_model2 * 1e-9, 2 * r.flops / r.bwd_model * 1e-9,
                  2 * r.flops / r.bwd_eigen * 1e-9, r.bwd_eigen / r.bwd_model, per_call(r.faults_model, r.calls_model),
                  per_call(r.faults_eigen, r.calls_eigen));
    }
    std::printf("], \"target\": 0.70, \"fwd_ratio\": %.4f, \"bwd_ratio\": %.4f, \"worst_fwd_ratio\": %.4f, "
                "\"worst_bwd_ratio\": %.4f, \"other_load\": %.3f}\n", ratio_fwd, ratio_bwd, worst_fwd, worst_bwd, other_share);
    return 0;
  }
  std::printf("megatrain-bench-exec gemm: the model's projections at N = micro-batch x seq = %lld rows, fp32, row-major,\n"
              "  best of %d; reference: a plain Eigen product (row-major maps, noalias) timed right after, 1 thread each;\n"
              "  page faults per call (forward and backward, 1 thread): model path, Eigen\n",
              static_cast<long long>(n), reps);
  std::printf("  %-10s %5s %5s | %-27s | %-27s | %-18s | %s\n", "", "in", "out", "forward GFLOP/s: model  Eigen",
              "backward GFLOP/s: model Eigen", "forward, 2 threads", "page faults/call");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Row& r = rows[i];
    std::printf("  %-10s %5lld %5lld | %7.1f %7.1f %9.2fx | %7.1f %7.1f %9.2fx | %7.1f GFLOP/s    | %6.1f %6.1f\n",
                shapes[i].name.c_str(), static_cast<long long>(shapes[i].in), static_cast<long long>(shapes[i].out),
                r.flops / r.fwd_model * 1e-9, r.flops / r.fwd_eigen * 1e-9, r.fwd_eigen / r.fwd_model,
                2 * r.flops / r.bwd_model * 1e-9, 2 * r.flops / r.bwd_eigen * 1e-9, r.bwd_eigen / r.bwd_model,
                r.flops / r.fwd_model2 * 1e-9, per_call(r.faults_model, r.calls_model), per_call(r.faults_eigen, r.calls_eigen));
  }
  std::printf("  %-22s | %7.1f %7.1f %9.2fx | %7.1f %7.1f %9.2fx | %7.1f GFLOP/s\n", "all (FLOP-weighted)", fl / t_fm * 1e-9,
              fl / t_fe * 1e-9, ratio_fwd, 2 * fl / t_bm * 1e-9, 2 * fl / t_be * 1e-9, ratio_bwd, fl / t_fm2 * 1e-9);
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other_share,
              other_share > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  std::printf("  verdict: model GEMM path / Eigen = %.2f forward (worst shape %.2f), %.2f backward (worst %.2f); "
              "target >= 0.70: %s\n",
              ratio_fwd, worst_fwd, ratio_bwd, worst_bwd, std::min(ratio_fwd, ratio_bwd) >= 0.70 ? "met" : "MISSED");
  return 0;
}

// ---- moe ----------------------------------------------------------------------------------------

// The CPU MoE block of a Mixtral-like layer on main's cpu::moe_* ops, called in the order of
// LayerMathT::moe_forward / moe_backward (executor/src/model.cpp): router linear, softmax-top-k with
// renormalisation, the sort by expert, gather, per-expert gate/up GEMMs [E, I, H], SwiGLU, per-expert
// down GEMM [E, H, I], the weighted combine, the load-balancing statistics, and the backward of
// each (the aux gradient included). One phase at a time with its own clock, on buffers allocated
// once.
struct MoeBench {
  enum Phase {
    kRouterFwd, kRoute, kPermute, kGather, kGateUpFwd, kActFwd, kDownFwd, kCombineFwd, kAuxStats,
    kCombineBwd, kDownBwd, kActBwd, kGateUpBwd, kScatter, kRouteBwd, kRouterBwd, kPhases
  };
  static const char* name(int p) {
    static const char* names[kPhases] = {"router linear fwd", "route (softmax, top-k)", "permute", "gather",
                                         "gate+up GEMMs fwd", "swiglu fwd", "down GEMM fwd", "combine fwd",
                                         "aux stats", "combine bwd", "down GEMM bwd", "swiglu bwd",
                                         "gate+up GEMMs bwd", "scatter-add", "route bwd", "router linear bwd"};
    return names[p];
  }

  int64_t n, h, e, k, i, rows;
  std::vector<float> x, wr, wg, wu, wd, dout;
  std::vector<float> logits, weight, probs, xp, gate, up, act, yp, out;
  std::vector<int32_t> expert, offsets, perm, ros;
  std::vector<double> count, prob_sum;
  std::vector<float> dyp, d_weight, dact, dgate, dup, dxp, dx, dlogits, dpc, gwr, gwg, gwu, gwd;

  static void fill(std::vector<float>& v, int64_t count_, float scale, uint32_t& s) {
    v.resize(static_cast<size_t>(count_));
    for (float& f : v) {
      s = s * 1664525u + 1013904223u;
      f = scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
    }
  }

  MoeBench(int64_t n_, int64_t h_, int64_t e_, int64_t k_, int64_t i_)
      : n(n_), h(h_), e(e_), k(k_), i(i_), rows(n_ * k_) {
    uint32_t s = 777;
    fill(x, n * h, 2.0f, s);
    fill(wr, e * h, 0.2f, s);
    fill(wg, e * i * h, 0.06f, s);
    fill(wu, e * i * h, 0.06f, s);
    fill(wd, e * h * i, 0.06f, s);
    fill(dout, n * h, 1.0f, s);
    auto zeros = [](std::vector<float>& v, int64_t c) { v.assign(static_cast<size_t>(c), 0.0f); };
    zeros(logits, n * e), zeros(weight, rows), zeros(probs, n * e), zeros(xp, rows * h), zeros(gate, rows * i);
    zeros(up, rows * i), zeros(act, rows * i), zeros(yp, rows * h), zeros(out, n * h);
    zeros(dyp, rows * h), zeros(d_weight, rows), zeros(dact, rows * i), zeros(dgate, rows * i), zeros(dup, rows * i);
    zeros(dxp, rows * h), zeros(dx, n * h), zeros(dlogits, n * e), zeros(dpc, e), zeros(gwr, e * h);
    zeros(gwg, e * i * h), zeros(gwu, e * i * h), zeros(gwd, e * h * i);
    expert.assign(static_cast<size_t>(rows), 0);
    offsets.assign(static_cast<size_t>(e + 1), 0);
    perm.assign(static_cast<size_t>(rows), 0);
    ros.assign(static_cast<size_t>(rows), 0);
    count.assign(static_cast<size_t>(e), 0.0);
    prob_sum.assign(static_cast<size_t>(e), 0.0);
  }

  // One forward + backward; adds each phase's seconds to t.
  void step(megatrain::cpu::CpuContext& ctx, double* t) {
    namespace cpu = megatrain::cpu;
    const int64_t ws = i * h;
    auto a = Clock::now();
    auto lap = [&](int p) {
      const auto b = Clock::now();
      t[p] += std::chrono::duration<double>(b - a).count();
      a = b;
    };
    cpu::linear_forward<float>(ctx, x.data(), wr.data(), nullptr, n, h, e, logits.data());
    lap(kRouterFwd);
    cpu::moe_route_forward<float>(ctx, logits.data(), n, e, k, true, expert.data(), weight.data(), probs.data());
    lap(kRoute);
    cpu::moe_permute(expert.data(), n, k, e, offsets.data(), perm.data());
    for (int64_t r = 0; r < rows; ++r) ros[static_cast<size_t>(perm[static_cast<size_t>(r)])] = static_cast<int32_t>(r);
    lap(kPermute);
    cpu::moe_gather<float>(ctx, x.data(), perm.data(), rows, k, h, xp.data());
    lap(kGather);
    cpu::grouped_linear_forward<float>(ctx, xp.data(), wg.data(), ws, nullptr, 0, offsets.data(), e, h, i, gate.data());
    cpu::grouped_linear_forward<float>(ctx, xp.data(), wu.data(), ws, nullptr, 0, offsets.data(), e, h, i, up.data());
    lap(kGateUpFwd);
    cpu::swiglu_forward<float>(ctx, gate.data(), up.data(), rows * i, act.data());
    lap(kActFwd);
    cpu::grouped_linear_forward<float>(ctx, act.data(), wd.data(), ws, nullptr, 0, offsets.data(), e, i, h, yp.data());
    lap(kDownFwd);
    cpu::moe_combine_forward<float>(ctx, yp.data(), weight.data(), ros.data(), n, k, h, out.data());
    lap(kCombineFwd);
    std::fill(count.begin(), count.end(), 0.0);
    std::fill(prob_sum.begin(), prob_sum.end(), 0.0);
    cpu::moe_aux_stats<float>(probs.data(), expert.data(), n, e, k, count.data(), prob_sum.data());
    // HF's aux gradient with respect to p[t][x], coef * E * count_x / n^2 (coef 0.02 as Mixtral's config).
    for (int64_t x_ = 0; x_ < e; ++x_)
      dpc[static_cast<size_t>(x_)] = static_cast<float>(0.02 * static_cast<double>(e) * count[static_cast<size_t>(x_)] /
                                                        (static_cast<double>(n) * static_cast<double>(n)));
    lap(kAuxStats);
    cpu::moe_combine_backward<float>(ctx, yp.data(), weight.data(), ros.data(), dout.data(), n, k, h, dyp.data(),
                                     d_weight.data());
    lap(kCombineBwd);
    cpu::grouped_linear_backward<float>(ctx, dyp.data(), act.data(), wd.data(), ws, offsets.data(), e, i, h, dact.data(),
                                        gwd.data(), nullptr, 0);
    lap(kDownBwd);
    cpu::swiglu_backward<float>(ctx, gate.data(), up.data(), dact.data(), rows * i, dgate.data(), dup.data());
    lap(kActBwd);
    // As model.cpp: up's dx goes to the free dyp buffer, then into dxp.
    cpu::grouped_linear_backward<float>(ctx, dgate.data(), xp.data(), wg.data(), ws, offsets.data(), e, h, i, dxp.data(),
                                        gwg.data(), nullptr, 0);
    cpu::grouped_linear_backward<float>(ctx, dup.data(), xp.data(), wu.data(), ws, offsets.data(), e, h, i, dyp.data(),
                                        gwu.data(), nullptr, 0);
    cpu::add<float>(ctx, dxp.data(), dyp.data(), rows * h, dxp.data());
    lap(kGateUpBwd);
    cpu::moe_scatter_add<float>(ctx, dxp.data(), ros.data(), n, k, h, dx.data());
    lap(kScatter);
    cpu::moe_route_backward<float>(ctx, probs.data(), expert.data(), weight.data(), d_weight.data(), dpc.data(), n, e, k,
                                   true, dlogits.data());
    lap(kRouteBwd);
    cpu::linear_backward<float>(ctx, dlogits.data(), x.data(), wr.data(), n, h, e, dx.data(), true, gwr.data(), nullptr);
    lap(kRouterBwd);
  }
};

// The reference: the experts' nine GEMMs (gate, up and down forward; dx and dW of each in the
// backward) as dense products over all n*k rows with one weight of the expert shape each, through
// the same cpu::linear_* path: the same FLOPs as the MoE block's expert GEMMs.
struct DenseRef {
  int64_t rows, h, i;
  std::vector<float> x, w1, w3, w2, g1, g3, y, dy, da, dx, gw1, gw3, gw2;
  DenseRef(int64_t rows_, int64_t h_, int64_t i_) : rows(rows_), h(h_), i(i_) {
    uint32_t s = 4242;
    MoeBench::fill(x, rows * h, 2.0f, s), MoeBench::fill(w1, i * h, 0.06f, s), MoeBench::fill(w3, i * h, 0.06f, s);
    MoeBench::fill(w2, h * i, 0.06f, s), MoeBench::fill(dy, rows * h, 1.0f, s), MoeBench::fill(da, rows * i, 1.0f, s);
    g1.assign(static_cast<size_t>(rows * i), 0.0f), g3 = g1, y.assign(static_cast<size_t>(rows * h), 0.0f), dx = y;
    gw1.assign(static_cast<size_t>(i * h), 0.0f), gw3 = gw1, gw2 = gw1;
  }
  void step(megatrain::cpu::CpuContext& ctx) {
    namespace cpu = megatrain::cpu;
    cpu::linear_forward<float>(ctx, x.data(), w1.data(), nullptr, rows, h, i, g1.data());
    cpu::linear_forward<float>(ctx, x.data(), w3.data(), nullptr, rows, h, i, g3.data());
    cpu::linear_forward<float>(ctx, g1.data(), w2.data(), nullptr, rows, i, h, y.data());
    cpu::linear_backward<float>(ctx, dy.data(), g1.data(), w2.data(), rows, i, h, g3.data(), false, gw2.data(), nullptr);
    cpu::linear_backward<float>(ctx, da.data(), x.data(), w1.data(), rows, h, i, dx.data(), false, gw1.data(), nullptr);
    cpu::linear_backward<float>(ctx, da.data(), x.data(), w3.data(), rows, h, i, dx.data(), true, gw3.data(), nullptr);
  }
};

int moe(int reps, int threads, bool json) {
  const int64_t n = 2048, h = 1024, e = 8, k = 2, i = 1024;
  MoeBench mb(n, h, e, k, i);
  DenseRef ref(n * k, h, i);
  megatrain::cpu::CpuContext ctx(threads);
  const double expert_flops = 18.0 * static_cast<double>(n * k) * static_cast<double>(h * i);
  const double router_flops = 6.0 * static_cast<double>(n * h * e);

  std::vector<double> scratch(MoeBench::kPhases, 0.0);
  mb.step(ctx, scratch.data());  // warm-up: first touch of every buffer, untimed
  ref.step(ctx);

  std::vector<double> best_phase(MoeBench::kPhases, 1e30), ratios;
  double best_moe = 1e30, best_ref = 1e30;
  int64_t faults_moe = 0, faults_ref = 0;
  const OtherLoad load;
  for (int r = 0; r < reps; ++r) {  // interleaved, so that a change in the machine's load hits both
    std::vector<double> t(MoeBench::kPhases, 0.0);
    int64_t f0 = minor_faults();
    auto a = Clock::now();
    mb.step(ctx, t.data());
    const double moe_s = seconds_since(a);
    faults_moe += minor_faults() - f0;
    f0 = minor_faults();
    a = Clock::now();
    ref.step(ctx);
    const double ref_s = seconds_since(a);
    faults_ref += minor_faults() - f0;
    best_moe = std::min(best_moe, moe_s);
    best_ref = std::min(best_ref, ref_s);
    ratios.push_back(ref_s / moe_s);
    for (int p = 0; p < MoeBench::kPhases; ++p) best_phase[p] = std::min(best_phase[p], t[p]);
  }
  const double other_share = load.share();
  std::sort(ratios.begin(), ratios.end());
  const double ratio = best_ref / best_moe;
  int32_t lo = INT32_MAX, hi = 0;
  for (int64_t x = 0; x < e; ++x) {
    lo = std::min(lo, mb.offsets[static_cast<size_t>(x + 1)] - mb.offsets[static_cast<size_t>(x)]);
    hi = std::max(hi, mb.offsets[static_cast<size_t>(x + 1)] - mb.offsets[static_cast<size_t>(x)]);
  }
  if (json) {
    std::printf("{\"benchmark\": \"moe\", \"tokens\": %lld, \"hidden\": %lld, \"experts\": %lld, \"top_k\": %lld, "
                "\"intermediate\": %lld, \"threads\": %d, \"reps\": %d, \"moe_s\": %.6f, \"dense_s\": %.6f, "
                "\"moe_gflops\": %.2f, \"dense_gflops\": %.2f, \"rows_per_expert_min\": %d, \"rows_per_expert_max\": %d, "
                "\"phases\": {",
                static_cast<long long>(n), static_cast<long long>(h), static_cast<long long>(e),
                static_cast<long long>(k), static_cast<long long>(i), threads, reps, best_moe, best_ref,
                (expert_flops + router_flops) / best_moe * 1e-9, expert_flops / best_ref * 1e-9, lo, hi);
    for (int p = 0; p < MoeBench::kPhases; ++p)
      std::printf("%s\"%s\": %.6f", p ? ", " : "", MoeBench::name(p), best_phase[p]);
    std::printf("}, \"faults_per_step_moe\": %.1f, \"faults_per_step_dense\": %.1f, \"target\": 0.70, \"ratio\": %.4f, "
                "\"median_ratio\": %.4f, \"other_load\": %.3f}\n",
                static_cast<double>(faults_moe) / reps, static_cast<double>(faults_ref) / reps, ratio,
                ratios[ratios.size() / 2], other_share);
    return 0;
  }
  std::printf("megatrain-bench-exec moe: Mixtral-like MoE block, tokens %lld, hidden %lld, %lld experts, top-%lld,\n"
              "  expert intermediate %lld, fp32, %d thread(s), best of %d (one untimed warm-up); rows per expert %d-%d\n"
              "  reference: the experts' nine GEMMs as dense products over all %lld rows (same FLOPs, cpu::linear_*)\n",
              static_cast<long long>(n), static_cast<long long>(h), static_cast<long long>(e),
              static_cast<long long>(k), static_cast<long long>(i), threads, reps, lo, hi,
              static_cast<long long>(n * k));
  double sum_phase = 0;
  for (double v : best_phase) sum_phase += v;
  for (int p = 0; p < MoeBench::kPhases; ++p)
    std::printf("  %-24s %9.2f ms %6.1f%%\n", MoeBench::name(p), best_phase[p] * 1e3, 100 * best_phase[p] / sum_phase);
  std::printf("  MoE block fwd+bwd %.1f ms (%.1f GFLOP/s), dense GEMMs %.1f ms (%.1f GFLOP/s); page faults per step %.0f / %.0f\n",
              best_moe * 1e3, (expert_flops + router_flops) / best_moe * 1e-9, best_ref * 1e3,
              expert_flops / best_ref * 1e-9, static_cast<double>(faults_moe) / reps,
              static_cast<double>(faults_ref) / reps);
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other_share,
              other_share > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  std::printf("  verdict: dense / MoE = %.3f (per-rep %.3f-%.3f, median %.3f), target >= 0.70: %s\n", ratio,
              ratios.front(), ratios.back(), ratios[ratios.size() / 2], ratio >= 0.70 ? "met" : "MISSED");
  return 0;
}

// ---- ops ---------------------------------------------------------------------------------------

// Where the CPU backend's step goes (issue 21): the bench model trained by the streamed trainer with
// every state in RAM, its CPU ops timed through cpu::OpProfile over the steps after the first, and
// each op kind set against its roofline measured in the same run: the compute peak (a plain Eigen
// GEMM at the layers' largest shape, on one thread, times the threads) and the memory bandwidth (a
// copy of 256 MiB split over the threads). An op's roofline time is the larger of its FLOPs at the
// peak and its bytes at the bandwidth; "of roofline" is that time over the measured one.
double peak_flops(int threads, int reps) {
  const int64_t m = 512, k = 256, n = 688;
  Eigen::MatrixXf a = Eigen::MatrixXf::Random(m, k), b = Eigen::MatrixXf::Random(k, n), c(m, n);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) best = std::min(best, seconds_per_call([&] { c.noalias() = a * b; }, 20));
  return 2.0 * static_cast<double>(m * k * n) / best * threads;
}

double copy_bandwidth(int threads, int reps) {
  const size_t n = (256u << 20) / sizeof(float);
  std::vector<float> src(n, 1.0f), dst(n, 0.0f);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto a = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const size_t b = n * static_cast<size_t>(t) / static_cast<size_t>(threads);
        const size_t e = n * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
        std::memcpy(dst.data() + b, src.data() + b, (e - b) * sizeof(float));
      });
    for (auto& t : ts) t.join();
    best = std::min(best, seconds_since(a));
  }
  return 2.0 * static_cast<double>(n * sizeof(float)) / best;  // read and written
}

int ops(int64_t steps, int threads, int checkpoint_every, bool json) {
  Run r;
  r.label = "streamed";
  r.checkpoint_every = checkpoint_every;
  auto tokens = std::make_shared<const exec::TokenFile>(exec::TokenFile::from_tokens(make_tokens(1 << 20, 512)));
  setup(r, steps, threads, tokens);
  const OtherLoad load;
  megatrain::cpu::OpProfile profile;
  double wall = 0;
  for (int64_t s = 0; s < steps; ++s) {
    if (s == 1) megatrain::cpu::attach_op_profile(&profile);  // step 0 is the warm-up
    const auto a = Clock::now();
    auto res = r.trainer->run_step(s);
    r.trainer->wait_for_updates();
    if (s > 0) wall += seconds_since(a);
    if (!res.ok()) die("step " + std::to_string(s), res.status());
  }
  megatrain::cpu::attach_op_profile(nullptr);
  const double peak = peak_flops(threads, 5), bw = copy_bandwidth(threads, 5);
  const double timed = static_cast<double>(steps - 1);
  const double step_s = wall / timed;
  struct Row {
    std::string op;
    megatrain::cpu::OpTally t;
    double roof_s;
  };
  std::vector<Row> rows;
  double ops_s = 0, roof_s = 0;
  for (const auto& [op, t] : profile.tallies()) {
    const double rs = std::max(t.flops / peak, t.bytes / bw) / timed;
    rows.push_back({op, t, rs});
    ops_s += t.seconds / timed;
    roof_s += rs;
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.t.seconds > b.t.seconds; });
  const double tok = static_cast<double>(r.tokens_per_step);
  if (json) {
    std::printf("{\"benchmark\": \"ops\", \"timed_steps\": %lld, \"threads\": %d, \"checkpoint_every\": %d, "
                "\"tokens_per_s\": %.1f, \"step_s\": %.6f, \"peak_flops\": %.4g, \"bandwidth\": %.4g, \"ops\": [",
                static_cast<long long>(steps - 1), threads, checkpoint_every, tok / step_s, step_s, peak, bw);
    for (size_t i = 0; i < rows.size(); ++i)
      std::printf("%s{\"op\": \"%s\", \"calls_per_step\": %.1f, \"s_per_step\": %.6f, \"flops_per_step\": %.4g, "
                  "\"bytes_per_step\": %.4g, \"roofline_s_per_step\": %.6f}",
                  i ? ", " : "", rows[i].op.c_str(), static_cast<double>(rows[i].t.calls) / timed, rows[i].t.seconds / timed,
                  rows[i].t.flops / timed, rows[i].t.bytes / timed, rows[i].roof_s);
    std::printf("], \"ops_s_per_step\": %.6f, \"outside_ops_s_per_step\": %.6f, \"roofline_s_per_step\": %.6f, "
                "\"other_load\": %.3f}\n", ops_s, step_s - ops_s, roof_s, load.share());
    return 0;
  }
  std::printf("megatrain-bench-exec ops: the overlap benchmark's model, streamed, every state in RAM, checkpoint_every %d,\n"
              "  %d thread(s), %lld timed steps of %lld tokens: %.0f tokens/s, %.1f ms per step\n"
              "  rooflines measured now: compute %.1f GFLOP/s (Eigen GEMM x %d threads), memory %.1f GB/s (copy)\n",
              checkpoint_every, threads, static_cast<long long>(steps - 1), static_cast<long long>(r.tokens_per_step),
              tok / step_s, step_s * 1e3, peak / 1e9, threads, bw / 1e9);
  std::printf("| op | calls/step | ms/step | share of step | GFLOP/s | GB/s | roofline ms | of roofline |\n"
              "|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    const double sec = row.t.seconds / timed;
    std::printf("| %s | %.0f | %.2f | %.1f%% | %.1f | %.1f | %.2f | %.0f%% |\n", row.op.c_str(),
                static_cast<double>(row.t.calls) / timed, sec * 1e3, 100 * sec / step_s, row.t.flops / timed / sec / 1e9,
                row.t.bytes / timed / sec / 1e9, row.roof_s * 1e3, 100 * row.roof_s / sec);
  }
  std::printf("| all ops | | %.2f | %.1f%% | | | %.2f | %.0f%% |\n", ops_s * 1e3, 100 * ops_s / step_s, roof_s * 1e3,
              100 * roof_s / ops_s);
  std::printf("| outside the ops (optimizer, norm, copies, waits) | | %.2f | %.1f%% | | | | |\n", (step_s - ops_s) * 1e3,
              100 * (step_s - ops_s) / step_s);
  std::printf("  other load on the machine during the run: %.0f%%%s\n", 100 * load.share(),
              load.share() > 0.05 ? " (noisy: rerun when the machine is quiet)" : "");
  return 0;
}

int usage() {
  std::fprintf(stderr, "usage: megatrain-bench-exec overlap [--steps N] [--threads T] [--json]\n"
                       "       megatrain-bench-exec gemm [--repeat N] [--json]\n"
                       "       megatrain-bench-exec moe [--repeat N] [--threads T] [--json]\n"
                       "       megatrain-bench-exec ops [--steps N] [--threads T] [--checkpoint-every C] [--json]\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string which = argv[1];
  if (which != "overlap" && which != "gemm" && which != "moe" && which != "ops") return usage();
  const std::string program = "megatrain-bench-exec " + which;
  int64_t steps = 5;
  int threads = which == "moe" ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : 2;
  int reps = which == "moe" ? 5 : 7;
  bool json = false;
  int checkpoint_every = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "--checkpoint-every" && which == "ops")
      checkpoint_every = static_cast<int>(megatrain::bench::int_arg(program.c_str(), argc, argv, i, 0, 64));
    else if (a == "--steps" && (which == "overlap" || which == "ops")) steps = megatrain::bench::int_arg(program.c_str(), argc, argv, i, 2, 100000);
    else if (a == "--threads" && (which == "overlap" || which == "moe" || which == "ops"))
      threads = static_cast<int>(megatrain::bench::int_arg(program.c_str(), argc, argv, i, 1, 1024));
    else if (a == "--repeat" && (which == "gemm" || which == "moe")) reps = static_cast<int>(megatrain::bench::int_arg(program.c_str(), argc, argv, i, 1, 1000));
    else {
      std::fprintf(stderr, "megatrain-bench-exec %s: unknown argument '%s'\n", which.c_str(), a.c_str());
      return usage();
    }
  }
  if (which == "moe") return moe(reps, threads, json);
  if (which == "ops") return ops(steps, threads, checkpoint_every, json);
  return which == "overlap" ? overlap(steps, threads, json) : gemm(reps, json);
}

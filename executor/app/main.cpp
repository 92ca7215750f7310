// megatrain-exec: trains from a plan file on a backend (backend.h). Argument parsing, the progress line,
// and when to checkpoint, resume and stop on a signal; the work is in megatrain_executor.
#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/core/output_path.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/units.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/moments.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/executor/weights_io.h"

namespace {

int fail(const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-exec: error: %s\n", s.to_string().c_str());
  return 1;
}

// SIGINT/SIGTERM only set this; the training loop finishes its step, saves and exits 128 + signal.
// SA_RESETHAND: a second signal takes the default action and stops the process at once (the last
// complete checkpoint stays intact: a checkpoint becomes visible only when complete).
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_RESETHAND;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// Cores in this process's affinity mask (what taskset or a container allows).
int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

// The longest run a command line may ask for; a plan's own training.steps is checked when it loads.
constexpr int64_t kMaxSteps = 1'000'000'000;

int main(int argc, char** argv) {
  using namespace megatrain;
  CLI::App app{"megatrain-exec: train from a plan file"};
  std::string plan_path, data_path, trace_path, init_dir, checkpoint_dir, backend = "auto";
  int64_t steps = 0, checkpoint_every = 0;
  int threads = 0;
  bool reference = false, resume = false;
  app.add_option("plan", plan_path, "plan file (megatrain.plan/1)")->required();
  app.add_option("--data", data_path, "token file: llm.c .bin, raw .u16/.u32, or any other file as bytes (vocab 256)")->required();
  app.add_option("--steps", steps, "total steps of the run, counted from step 0 also when resuming (default: training.steps of the plan)")
      ->check(cli::int_range(1, kMaxSteps));
  auto* init_opt = app.add_option("--init", init_dir, "start from a Hugging Face checkpoint: a folder with model.safetensors or a sharded index")
      ->check(CLI::ExistingPath);
  auto* ckpt_opt = app.add_option("--checkpoint-dir", checkpoint_dir,
                                  "write training checkpoints to this folder (always at the end of the run and on Ctrl-C)");
  app.add_option("--checkpoint-every", checkpoint_every, "also write a checkpoint every N steps")
      ->check(cli::int_range(1, kMaxSteps))->needs(ckpt_opt);
  bool compress_states = false;
  app.add_flag("--checkpoint-compress", compress_states,
               "store fp32 Adam moments in checkpoints losslessly compressed (byte planes + zstd; about 1.2x smaller, "
               "bit for bit the same on load; quantised and bf16 moments are stored as they are)")
      ->needs(ckpt_opt);
  app.add_flag("--resume", resume, "continue bit for bit from the newest checkpoint in --checkpoint-dir")
      ->needs(ckpt_opt)->excludes(init_opt);
  app.add_option("--trace", trace_path, "write the measured timeline to this .mtrace file");
  app.add_option("--backend", backend, "auto (default: CUDA when this build can train on a present GPU, else cpu), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--threads", threads,
                 "compute threads of the CPU backend (default: every core this process may run on, as megatrain-plan "
                 "profile measures them)")
      ->check(cli::int_range(1, 1024));
  double pinned_limit_gib = -1;
  app.add_option("--pinned-limit-gib", pinned_limit_gib,
                 "most host memory (GiB) the CUDA backend may page-lock for copies (default: half of RAM); the rest of "
                 "the RAM tier is copied from pageable memory, more slowly")
      ->check(cli::number_range(0.0, 1048576.0));
  app.add_flag("--in-memory", reference, "run the plain in-memory loop instead of the streamed pipeline (the reference)");
  if (const int rc = cli::parse(app, argc, argv, "megatrain-exec"); rc >= 0) return rc;
  // Every output is probed before anything loads or trains: a bad path costs a second, not a run.
  // A resumed run's folder must hold its checkpoints already, so it is not created.
  if (!checkpoint_dir.empty()) {
    if (Status s = check_output("--checkpoint-dir", checkpoint_dir, resume ? OutputKind::kExistingFolder : OutputKind::kFolder);
        !s.ok())
      return fail(s);
  }
  if (!trace_path.empty()) {
    if (Status s = check_output("--trace", trace_path, OutputKind::kFile); !s.ok()) return fail(s);
  }
  // A forced instruction set this CPU cannot run (MEGATRAIN_ISA, docs/testing.md): refuse up front.
  if (auto isa = exec::isa_from_environment(); !isa.ok()) return fail(isa.status());
  // Asked for a GPU that is not there: say so before loading anything.
  if (backend == "cuda") {
    if (const std::string why = exec::cuda_unavailable_reason(); !why.empty())
      return fail(unavailable("--backend cuda: no usable GPU: " + why + "; accepted here: --backend cpu (or auto)"));
  }

  auto plan = Plan::load(plan_path);
  if (!plan.ok()) return fail(plan.status());
  auto model = plan->resolve_model();
  if (!model.ok()) return fail(model.status());
  if (compress_states && plan->optimizer.m_format != StateFormat::kFp32 && plan->optimizer.v_format != StateFormat::kFp32)
    return fail(invalid_argument(std::string("--checkpoint-compress compresses fp32 moments losslessly, and this plan keeps m/v in ") +
                                 state_format_name(plan->optimizer.m_format) + "/" +
                                 state_format_name(plan->optimizer.v_format) +
                                 ", which are stored as they are; accepted: drop the flag, or a plan with "
                                 "optimizer.m_format or optimizer.v_format fp32"));
  auto file = exec::TokenFile::open(data_path);
  if (!file.ok()) return fail(file.status());
  auto tokens = std::make_shared<const exec::TokenFile>(std::move(file).value());
  if (Status s = tokens->check_vocab(model->config().vocab_size); !s.ok()) return fail(s);
  auto loader = exec::DataLoader::create(tokens, plan->training.seq_len, plan->training.micro_batch,
                                         plan->training.grad_accum, plan->training.data_order, static_cast<uint64_t>(plan->training.seed),
                                         model->config().vocab_size);
  if (!loader.ok()) return fail(loader.status());
  // The training state: in RAM, or partly on the NVMe tier as placement says (the drives are
  // checked and their space reserved here, before anything runs).
  exec::NvmePlacement nvme = exec::nvme_placement_of(plan->placement);
  // Layer-major without clipping needs no gradient after its own update: the trainer lends each
  // unit a gradient buffer from a pool of three instead of holding them all (4 bytes per parameter).
  const bool all_gradients = reference || plan->schedule.order != ScheduleOrder::kLayerMajor || plan->training.clip_grad_norm > 0;
  auto created = exec::HostState::create(*model, plan->precision.transfer, plan->optimizer.m_format, plan->optimizer.v_format,
                                         plan->optimizer.block_size, nvme, all_gradients);
  if (!created.ok()) return fail(created.status());
  exec::HostState state = std::move(created).value();
  if (state.on_nvme())
    std::printf("NVMe tier: %s%s%s on %zu drive(s), %s reserved, %s; %lld staging buffer(s), %s of RAM\n",
                nvme.master ? "master weights" : "", nvme.master && nvme.states ? " and " : "", nvme.states ? "optimizer states" : "",
                nvme.store.dirs.size(), format_bytes(static_cast<double>(state.nvme_bytes())).c_str(),
                state.nvme_store()->engine().c_str(), static_cast<long long>(state.staging_buffers()),
                format_bytes(static_cast<double>(state.staging_bytes())).c_str());
  int64_t start = 0;          // the first step this process runs
  int64_t losses_first = 0;   // the step of losses[0]
  std::vector<double> losses;
  if (resume) {
    auto loaded = exec::load_checkpoint(checkpoint_dir, state);
    if (!loaded.ok()) return fail(loaded.status());
    if (Status s = exec::check_resume_compatible(loaded->info, *plan, *model, *loader); !s.ok())
      return fail(s.with_context(loaded->dir.string()));
    start = loaded->info.next_step;
    losses_first = loaded->info.losses_first_step;
    losses = loaded->info.losses;
    if (losses_first + static_cast<int64_t>(losses.size()) != start) {  // an incomplete history is dropped
      losses_first = start;
      losses.clear();
    }
    std::printf("resuming from %s: %lld steps done\n", loaded->dir.string().c_str(), static_cast<long long>(start));
  } else {
    // A new run never mixes its checkpoints with another run's.
    if (!checkpoint_dir.empty()) {
      if (auto existing = exec::find_latest_checkpoint(checkpoint_dir); existing.ok())
        return fail(invalid_argument("--checkpoint-dir '" + checkpoint_dir + "' already holds checkpoints (newest: " +
                                     existing->string() + "); pass --resume to continue that run, or choose another folder"));
    }
    if (!init_dir.empty()) {
      if (Status s = exec::load_weights(state, init_dir); !s.ok()) return fail(s);
    } else {
      if (Status s = state.init_random(static_cast<uint64_t>(plan->training.seed), 0.02); !s.ok()) return fail(s);
    }
  }
  exec::TrainerOptions opt;
  opt.streamed = !reference;
  opt.threads = threads > 0 ? threads : usable_cores();
  opt.backend = backend;
  opt.pinned_limit_bytes = pinned_limit_gib >= 0 ? static_cast<int64_t>(pinned_limit_gib * 1073741824.0) : -1;
  opt.record_trace = !trace_path.empty();
  auto trainer = exec::Trainer::create(*plan, *model, state, *loader, opt);
  if (!trainer.ok()) return fail(trainer.status());

  const int64_t total = steps > 0 ? steps : plan->training.steps;
  if (start >= total) {
    std::printf("the checkpoint has %lld steps done, the run has %lld in all: nothing to run\n", static_cast<long long>(start),
                static_cast<long long>(total));
    return 0;
  }
  std::printf("megatrain-exec: %s, %lld parameters, %lld tokens/step, %lld steps, %s on the %s\n",
              model->name().c_str(), static_cast<long long>(model->parameter_counts().total),
              static_cast<long long>(loader->tokens_per_step()), static_cast<long long>(total),
              reference ? "in-memory loop" : "streamed", (*trainer)->backend_description().c_str());
  if (!reference) {
    const step::TierBytes& fp = (*trainer)->footprint().peak;
    std::printf("memory: device arena %s of a %s budget, RAM %s (%s handed to the backend for page-locking)%s\n",
                format_bytes(static_cast<double>(fp.device)).c_str(),
                plan->placement.device_budget_bytes > 0 ? format_bytes(static_cast<double>(plan->placement.device_budget_bytes)).c_str()
                                                        : "rig-wide",
                format_bytes(static_cast<double>(fp.ram)).c_str(), format_bytes(static_cast<double>(fp.pinned)).c_str(),
                fp.nvme > 0 ? (", NVMe " + format_bytes(static_cast<double>(fp.nvme))).c_str() : "");
  }
  if (const std::string pinned = (*trainer)->pinned_report(); !pinned.empty()) std::printf("%s\n", pinned.c_str());
  const std::string plan_text = plan->to_json_text();
  auto save = [&](int64_t next_step) -> Status {
    exec::CheckpointInfo info;
    info.next_step = next_step;
    info.model_name = model->name();
    info.parameters = model->parameter_counts().total;
    info.plan_json = plan_text;
    info.data = exec::data_position(*loader);
    info.seed = static_cast<uint64_t>(plan->training.seed);
    info.losses_first_step = losses_first;
    info.losses = losses;
    const auto t0 = std::chrono::steady_clock::now();
    exec::SaveOptions options;
    options.compress_fp32_moments = compress_states;
    options.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    MT_RETURN_IF_ERROR(exec::save_checkpoint(checkpoint_dir, state, info, options));
    const std::filesystem::path step_dir = exec::checkpoint_step_dir(checkpoint_dir, next_step);
    std::error_code ec;
    const auto opt_bytes = std::filesystem::file_size(step_dir / "optimizer.safetensors", ec);
    std::printf("checkpoint %s written in %.2f s (optimizer states %s%s)\n", step_dir.string().c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                ec ? "?" : format_bytes(static_cast<double>(opt_bytes)).c_str(),
                compress_states ? ", fp32 moments compressed" : "");
    std::fflush(stdout);
    return {};
  };
  install_stop_handlers();
  double elapsed = 0;
  for (int64_t s = start; s < total; ++s) {
    auto r = (*trainer)->run_step(s);
    if (!r.ok()) return fail(r.status());
    losses.push_back(r->loss);
    elapsed += r->time_s;
    const double eta = elapsed / static_cast<double>(s + 1 - start) * static_cast<double>(total - s - 1);
    std::printf("step %5lld/%lld  loss %.4f  %8.0f tokens/s  stall %4.1f%%  ETA %s\n", static_cast<long long>(s + 1),
                static_cast<long long>(total), r->loss, static_cast<double>(r->tokens) / r->time_s,
                100.0 * r->stall_s / r->time_s, format_duration(eta).c_str());
    std::fflush(stdout);
    const int64_t done = s + 1;
    const int sig = g_stop_signal.load();
    if (!checkpoint_dir.empty() && (done == total || sig != 0 || (checkpoint_every > 0 && done % checkpoint_every == 0))) {
      // The checkpoint holds the state after this step's updates, all of them written.
      if (Status st = (*trainer)->finish_updates(); !st.ok()) return fail(st);
      if (Status st = save(done); !st.ok()) return fail(st);
    }
    if (sig != 0 && done < total) {
      std::printf("stopped by %s after step %lld of %lld; %s\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
                  static_cast<long long>(done), static_cast<long long>(total),
                  checkpoint_dir.empty() ? "nothing saved (no --checkpoint-dir)" : "continue with --resume");
      if (!trace_path.empty()) {
        if (Status st = (*trainer)->write_trace(trace_path, plan_text); !st.ok()) return fail(st);
        std::printf("trace written to %s\n", trace_path.c_str());
      }
      std::fflush(stdout);
      return 128 + sig;
    }
  }
  // The last step's updates finish after it returns: a failure there fails the run.
  if (Status st = (*trainer)->finish_updates(); !st.ok()) return fail(st);
  if (!trace_path.empty()) {
    if (Status s = (*trainer)->write_trace(trace_path, plan_text); !s.ok()) return fail(s);
    std::printf("trace written to %s\n", trace_path.c_str());
  }
  return 0;
}

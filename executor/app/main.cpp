// megatrain-exec: trains from a plan file on a backend (backend.h). Argument parsing, the stop signals
// and the exit code; the run itself (loading, resuming, the progress line, checkpoints) is run_training (run.h).
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <iostream>

#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/executor/communicator.h"
#include "megatrain/executor/run.h"

namespace {

// One of several ranks (mpirun) that fails ends the whole job at once, so that the others, which
// may be waiting for it in a collective, do not hang (docs/data-parallel.md).
int fail(const megatrain::Status& s) {
  auto world = megatrain::exec::world_communicator();
  if (world.ok() && (*world)->size() > 1) {
    std::fprintf(stderr, "megatrain-exec: rank %d of %d: error: %s\n", (*world)->rank(), (*world)->size(), s.to_string().c_str());
    std::fflush(stderr);
    (*world)->abort_job(1);
  }
  std::fprintf(stderr, "megatrain-exec: error: %s\n", s.to_string().c_str());
  return 1;
}

// SIGINT, SIGTERM and SIGHUP (an ssh session that drops) only set this; the training loop finishes
// its step, saves and exits 128 + signal.
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
  sigaction(SIGHUP, &sa, nullptr);
}

}  // namespace

// The longest run a command line may ask for; a plan's own training.steps is checked when it loads.
constexpr int64_t kMaxSteps = 1'000'000'000;

int main(int argc, char** argv) {
  using namespace megatrain;
  CLI::App app{"megatrain-exec: train from a plan file"};
  exec::RunOptions o;
  app.add_option("plan", o.plan_path, "plan file (megatrain.plan/1)")->required();
  app.add_option("--data", o.data_path,
                 "a prepared dataset (megatrain-data prepare), a token file (llm.c .bin, raw .u16/.u32, any other file as "
                 "bytes: vocab 256), or with --tokenizer a dataset file (.jsonl, .json, text)")
      ->required();
  app.add_option("--tokenizer", o.tokenizer_path,
                 "a model folder with tokenizer.json: --data is then a dataset file, prepared on the fly (packed; alpaca "
                 "answers only) into <checkpoint-dir>/data-cache or ~/.cache/megatrain/data-cache ($XDG_CACHE_HOME), and reused, "
                 "verified, while its inputs are unchanged");
  app.add_option("--steps", o.steps, "total steps of the run, counted from step 0 also when resuming (default: training.steps of the plan)")
      ->check(cli::int_range(1, kMaxSteps));
  auto* init_opt = app.add_option("--init", o.init_dir, "start from a Hugging Face checkpoint: a folder with model.safetensors or a sharded index")
      ->check(CLI::ExistingPath);
  auto* ckpt_opt = app.add_option("--checkpoint-dir", o.checkpoint_dir,
                                  "write training checkpoints to this folder (always at the end of the run and on Ctrl-C)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "also write a checkpoint every N steps")
      ->check(cli::int_range(1, kMaxSteps))->needs(ckpt_opt);
  app.add_option("--keep-checkpoints", o.keep_checkpoints,
                 "after each checkpoint is written, remove the older ones but the newest N, counting it (default: keep all); "
                 "a checkpoint is removed only once a newer one is complete")
      ->check(cli::int_range(1, kMaxSteps))->needs(ckpt_opt);
  app.add_flag("--checkpoint-compress", o.compress_states,
               "store fp32 Adam moments in checkpoints losslessly compressed (byte planes + zstd; about 1.2x smaller, "
               "bit for bit the same on load; quantised and bf16 moments are stored as they are)")
      ->needs(ckpt_opt);
  app.add_flag("--resume", o.resume, "continue bit for bit from the newest checkpoint in --checkpoint-dir")
      ->needs(ckpt_opt)->excludes(init_opt);
  app.add_option("--trace", o.trace_path, "write the measured timeline to this .mtrace file");
  app.add_option("--backend", o.backend, "auto (default: CUDA when this build can train on a present GPU, else cpu), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--threads", o.threads,
                 "compute threads of the CPU backend (default: every core this process may run on, as megatrain-plan "
                 "profile measures them)")
      ->check(cli::int_range(1, 1024));
  app.add_option("--pinned-limit-gib", o.pinned_limit_gib,
                 "most host memory (GiB) the CUDA backend may page-lock for copies (default: half of RAM); the rest of "
                 "the RAM tier is copied from pageable memory, more slowly")
      ->check(cli::number_range(0.0, 1048576.0));
  app.add_flag("--skip-nonfinite-steps", o.skip_nonfinite_steps,
               "skip a step whose loss or gradient norm is not finite, or that has no counted targets, and go on (its "
               "update is not applied; AdamW's count and the learning rate follow the applied steps). Without it such a "
               "step stops the run before its update, and the steps done are saved");
  auto* eval_opt = app.add_option("--eval-data", o.eval_data_path,
                                  "evaluate on this prepared dataset or token file (every row once, in order, forward only, with "
                                  "the training step's buffers): at the end of the run, and every --eval-every steps")
                       ->check(CLI::ExistingFile);
  app.add_option("--eval-every", o.eval_every, "also evaluate every N steps")->check(cli::int_range(1, kMaxSteps))->needs(eval_opt);
  app.add_option("--collective-timeout", o.collective_timeout_s,
                 "data parallel (mpirun): seconds a rank waits in one collective before it asks which ranks are alive, names "
                 "the ones that are not, and ends the job (0: wait for ever)")
      ->check(cli::number_range(0.0, 1e7));
  app.add_flag("--in-memory", o.in_memory, "run the plain in-memory loop instead of the streamed pipeline (the reference)");
  if (const int rc = cli::parse(app, argc, argv, "megatrain-exec"); rc >= 0) return rc;
  o.eval_at_end = !o.eval_data_path.empty();
  auto summary = exec::run_training(o, std::cout, {.before_first_step = install_stop_handlers,
                                                   .stop_requested = [] { return g_stop_signal.load(); }});
  if (!summary.ok()) return fail(summary.status());
  return summary->stop_signal != 0 ? 128 + summary->stop_signal : 0;
}

// A training run from a plan file, as megatrain-exec runs it: probes the outputs, loads the plan,
// model and data, builds the training state with the plan's placement, initialises or loads the
// weights (or resumes from the newest checkpoint), trains with a progress line per step, writes
// checkpoints and the trace. The command line only parses flags into RunOptions and calls this.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::exec {

// What megatrain-exec's flags set; the defaults are the flags' defaults.
struct RunOptions {
  std::string plan_path;       // megatrain.plan/1
  std::string data_path;       // a prepared dataset or a token file (data.h); with tokenizer_path, a dataset file
  // A model folder with tokenizer.json: data_path is then a dataset file (JSON Lines, JSON, text)
  // that is prepared on the fly (megatrain-data prepare's defaults: packed, alpaca answers only)
  // into a cache, <checkpoint_dir>/data-cache or the system's temporary folder, and reused while
  // the file, the tokenizer and seq_len stay the same.
  std::string tokenizer_path;
  int64_t steps = 0;           // total steps counted from step 0, also when resuming; 0: training.steps of the plan
  std::string init_dir;        // Hugging Face checkpoint to start from; "": random initialisation
  std::string checkpoint_dir;  // "": no checkpoints
  int64_t checkpoint_every = 0;  // also checkpoint every N steps (0: only at the end and on a stop)
  int64_t keep_checkpoints = 0;  // after each checkpoint, keep only the newest N (prune_checkpoints); 0: keep all
  bool compress_states = false;  // fp32 moments stored losslessly compressed in checkpoints
  bool skip_nonfinite_steps = false;  // skip (and count) steps the non-finite guard refuses, instead of stopping
  bool resume = false;         // continue from the newest checkpoint in checkpoint_dir
  std::string trace_path;      // "": no trace
  std::string backend = "auto";  // auto | cpu | cuda
  int threads = 0;             // CPU backend compute threads; 0: every core this process may run on
  double pinned_limit_gib = -1;  // CUDA backend page-locking limit; negative: the backend's default
  bool in_memory = false;      // the plain in-memory loop instead of the streamed pipeline
  // Evaluation (Trainer::evaluate): a prepared dataset or token file read as the training data is,
  // every row once; every eval_every steps (0: only when a hook asks), and with eval_only once,
  // on the starting state (the newest checkpoint with resume), without training.
  std::string eval_data_path;
  int64_t eval_every = 0;
  bool eval_at_end = false;  // also after the last step (megatrain-exec with --eval-data)
  bool eval_only = false;
  // Data parallelism: how long a rank waits in one collective before it decides another rank hangs
  // (Communicator::set_hang_timeout; docs/data-parallel.md). 0: for ever.
  double collective_timeout_s = 1800;
};

struct StepResult;  // trainer.h

// Where a run is, so that a caller can tell what an error concerns (the Python package raises
// mt.PlanError for a plan that does not fit and mt.CheckpointError for a checkpoint that does not load).
enum class RunPhase { kChecking, kPlan, kData, kState, kResume, kTraining };

// What an after_step hook asks of the run (the Python package's TrainerControl).
struct StepControl {
  bool save = false;  // write a checkpoint after this step (with a checkpoint_dir)
  bool evaluate = false;  // run the evaluation pass after this step (needs eval_data_path)
  bool stop = false;  // stop after this step, with a checkpoint when there is a checkpoint_dir
};

// Hooks into the run; every one is optional. Called on the thread that called run_training. A hook
// that returns an error stops the run at once with that error: nothing more is saved.
struct RunCallbacks {
  // Called once, right before the first step runs (megatrain-exec installs its signal handlers here,
  // so that a signal while loading still stops the process at once).
  std::function<void()> before_first_step;
  // Polled after every step: nonzero (a signal number, SIGINT, SIGTERM or SIGHUP) stops the run after that
  // step, with a checkpoint when there is a checkpoint_dir.
  std::function<int()> stop_requested;
  // Before each step runs; `step` counts from 0.
  std::function<Status(int64_t step)> before_step;
  // After each step that ran (applied or skipped), before its checkpoint: the step's result and the
  // learning rate its update used.
  std::function<Result<StepControl>(const StepResult& result, double learning_rate)> after_step;
  // After each evaluation pass: the steps done when it ran, and its result.
  std::function<Status(int64_t next_step, double loss, int64_t tokens, double time_s)> after_eval;
  // After each checkpoint is written: the steps it holds and its folder.
  std::function<Status(int64_t next_step, const std::string& dir)> after_save;
  // Optional: set to the phase the run is in, as it goes (read after run_training returns).
  RunPhase* phase = nullptr;
};

struct RunSummary {
  int64_t first_step = 0;  // the first step this call ran (the resumed checkpoint's step, or 0)
  int64_t next_step = 0;   // steps done when it returned
  int64_t total_steps = 0;  // the steps the run asked for
  // The loss history the last checkpoint records: losses[i] is the loss of step losses_first_step + i,
  // resumed history included.
  int64_t losses_first_step = 0;
  std::vector<double> losses;
  int stop_signal = 0;  // nonzero: stopped by stop_requested() before total_steps (exit 128 + it)
  bool stopped_by_hook = false;  // after_step asked to stop before total_steps
  int64_t skipped_steps = 0;  // steps whose update was not applied (--skip-nonfinite-steps), resumed ones included
  // Each evaluation pass this call ran: the steps done then, the mean loss, the counted targets.
  struct Eval {
    int64_t next_step = 0;
    double loss = 0;
    int64_t tokens = 0;
    double time_s = 0;
  };
  std::vector<Eval> evals;
};

// Runs training as the options say, writing megatrain-exec's lines to `out` (flushed after each
// line). Every output path is probed before anything loads. A failure at any point returns its
// Status, whatever was printed before it.
Result<RunSummary> run_training(const RunOptions& options, std::ostream& out, const RunCallbacks& callbacks = {});

}  // namespace megatrain::exec

// run_training (run.h): megatrain-exec's run, from the plan file to the last checkpoint and the trace.
// The lines it prints are megatrain-exec's user interface (tests/cli/*.sh read them): keep them as they are.
#include "megatrain/executor/run.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <thread>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "megatrain/core/output_path.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/units.h"
#include "megatrain/core/xxh64.h"
#include "megatrain/data/dataset.h"
#include "megatrain/data/tokenizer.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/communicator.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/moments.h"
#include "megatrain/executor/optimizer.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/executor/weights_io.h"
#include "megatrain/step/schedule.h"
#include "detail/checkpoint_files.h"
#include "detail/checkpoint_hash.h"

namespace megatrain::exec {
namespace {

// One printf-formatted line to `out`, flushed (a watcher of the output sees each step as it ends).
[[gnu::format(printf, 2, 3)]] void say(std::ostream& out, const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list sizing;
  va_copy(sizing, args);
  const int n = std::vsnprintf(nullptr, 0, format, sizing);
  va_end(sizing);
  std::string line(static_cast<size_t>(std::max(n, 0)), '\0');
  std::vsnprintf(line.data(), line.size() + 1, format, args);
  va_end(args);
  out << line << '\n' << std::flush;
}

// Cores in this process's affinity mask (what taskset or a container allows).
int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// A run's hold on its checkpoint folder: an flock on `<dir>/.megatrain-exec.lock`, held until the run
// ends. The kernel drops it when the process dies, however it dies, so a killed run's lock is no
// lock: the next run takes it. The file says who holds it, for the message a second run gets.
class FolderLock {
 public:
  FolderLock() = default;
  FolderLock(FolderLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  FolderLock& operator=(FolderLock&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock() {
    if (fd_ >= 0) ::close(fd_);
  }

  static Result<FolderLock> take(const std::filesystem::path& dir) {
    const std::filesystem::path path = dir / ".megatrain-exec.lock";
    FolderLock l;
    l.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (l.fd_ < 0) return io_error("cannot open the lock file '" + path.string() + "': " + std::strerror(errno));
    if (::flock(l.fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err != EWOULDBLOCK) return io_error("cannot lock '" + path.string() + "': " + std::strerror(err));
      char buf[512] = {};
      const ssize_t n = ::pread(l.fd_, buf, sizeof(buf) - 1, 0);
      std::string who = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("an unknown process");
      while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
      for (char& c : who)
        if (c == '\n') c = ',';
      return unavailable("--checkpoint-dir '" + dir.string() + "' is in use by another megatrain-exec run (" + who +
                         "); two runs in one folder would overwrite each other's checkpoints: wait for that run, stop it, or "
                         "choose another folder");
    }
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    const std::time_t now = std::time(nullptr);
    char when[32] = {};
    std::tm tm{};
    ::gmtime_r(&now, &tm);
    std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    const std::string text = "pid " + std::to_string(::getpid()) + " on " + host + ", since " + when + "\n";
    if (::ftruncate(l.fd_, 0) != 0 || ::pwrite(l.fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
      return io_error("cannot write the lock file '" + path.string() + "': " + std::strerror(errno));
    return l;
  }

 private:
  int fd_ = -1;
};

// Everything that can be refused without loading anything: a bad path costs a second, not a run.
Status check_before_loading(const RunOptions& o, bool writes_checkpoints) {
  if (o.keep_checkpoints < 0)
    return invalid_argument("--keep-checkpoints " + std::to_string(o.keep_checkpoints) + ": accepted: 1 or more, or 0 to keep every checkpoint");
  // A resumed run's folder must hold its checkpoints already, so it is not created.
  if (!o.checkpoint_dir.empty() && (writes_checkpoints || o.resume))
    MT_RETURN_IF_ERROR(check_output("--checkpoint-dir", o.checkpoint_dir, o.resume ? OutputKind::kExistingFolder : OutputKind::kFolder));
  if (!o.trace_path.empty()) MT_RETURN_IF_ERROR(check_output("--trace", o.trace_path, OutputKind::kFile));
  // A forced instruction set this CPU cannot run (MEGATRAIN_ISA, docs/testing.md).
  if (auto isa = isa_from_environment(); !isa.ok()) return isa.status();
  // Asked for a GPU that is not there: say so before loading anything.
  if (o.backend == "cuda") {
    if (const std::string why = cuda_unavailable_reason(); !why.empty())
      return unavailable("--backend cuda: no usable GPU: " + why + "; accepted here: --backend cpu (or auto)");
  }
  return {};
}

Status check_compression(const RunOptions& o, const Plan& plan) {
  if (!o.compress_states || plan.optimizer.m_format == StateFormat::kFp32 || plan.optimizer.v_format == StateFormat::kFp32) return {};
  return invalid_argument(std::string("--checkpoint-compress compresses fp32 moments losslessly, and this plan keeps m/v in ") +
                          state_format_name(plan.optimizer.m_format) + "/" + state_format_name(plan.optimizer.v_format) +
                          ", which are stored as they are; accepted: drop the flag, or a plan with "
                          "optimizer.m_format or optimizer.v_format fp32");
}

// The training state: in RAM, or partly on the NVMe tier as placement says (the drives are checked
// and their space reserved here, before anything runs).
Result<HostState> create_state(const RunOptions& o, const Plan& plan, const ModelSpec& model, Communicator& comm, std::ostream& out) {
  NvmePlacement nvme = nvme_placement_of(plan.placement);
  if (comm.size() > 1)  // each rank keeps its own copy of the NVMe-resident state, in rank-<k> of each folder
    for (std::filesystem::path& dir : nvme.store.dirs) {
      std::error_code ec;
      if (!std::filesystem::is_directory(dir, ec)) continue;  // the store names a missing folder
      dir /= "rank-" + std::to_string(comm.rank());
      std::filesystem::create_directory(dir, ec);
      if (ec) return io_error("cannot create the NVMe folder '" + dir.string() + "' of rank " + std::to_string(comm.rank()) + ": " + ec.message());
    }
  // Where the trainer may lend gradients (step::lends_gradients, the rule it checks too) the state
  // holds a small pool of them instead of one per parameter; where NCCL's sums go straight into the
  // node's shared memory (step::gradients_in_node_memory), none.
  const bool all_gradients =
      !step::lends_gradients(plan, !o.in_memory) && !(step::gradients_in_node_memory(plan) && !o.in_memory);
  // parallel.host_state sharded: this rank keeps the moments of the tensors it owns (ZeRO).
  StateSharding sharding;
  if (plan.parallel.host_state == "sharded") sharding = StateSharding{comm.rank(), comm.size()};
  // parallel.host_state shared: one copy per node in shared memory; the node's ranks own the moments.
  if (node_shares_host_state(plan.parallel)) sharding = StateSharding{comm.local_rank(), comm.local_size(), &comm};
  MT_ASSIGN_OR_RETURN(HostState state, HostState::create(model, plan.precision.transfer, plan.optimizer.m_format, plan.optimizer.v_format,
                                                         plan.optimizer.block_size, nvme, all_gradients, sharding));
  if (state.on_nvme())
    say(out, "NVMe tier: %s%s%s on %zu drive(s), %s reserved, %s; %lld staging buffer(s), %s of RAM",
        nvme.master ? "master weights" : "", nvme.master && nvme.states ? " and " : "", nvme.states ? "optimizer states" : "",
        nvme.store.dirs.size(), format_bytes(static_cast<double>(state.nvme_bytes())).c_str(), state.nvme_store()->engine().c_str(),
        static_cast<long long>(state.staging_buffers()), format_bytes(static_cast<double>(state.staging_bytes())).c_str());
  return state;
}

// Fills the state to start from: the newest checkpoint (its step and loss history into `summary`),
// the --init weights, or a random initialisation from the plan's seed.
Status start_state(const RunOptions& o, const Plan& plan, const ModelSpec& model, const DataLoader& loader, HostState& state,
                   RunSummary& summary, std::ostream& out) {
  if (o.resume) {
    MT_ASSIGN_OR_RETURN(LoadedCheckpoint loaded, load_checkpoint(o.checkpoint_dir, state));
    if (Status s = check_resume_compatible(loaded.info, plan, model, loader); !s.ok()) return s.with_context(loaded.dir.string());
    summary.first_step = loaded.info.next_step;
    summary.skipped_steps = loaded.info.skipped_steps;
    summary.losses_first_step = loaded.info.losses_first_step;
    summary.losses = std::move(loaded.info.losses);
    if (summary.losses_first_step + static_cast<int64_t>(summary.losses.size()) != summary.first_step) {  // an incomplete history is dropped
      summary.losses_first_step = summary.first_step;
      summary.losses.clear();
    }
    if (!loaded.note.empty()) say(out, "note: %s", loaded.note.c_str());
    say(out, "resuming from %s: %lld steps done", loaded.dir.string().c_str(), static_cast<long long>(summary.first_step));
    return {};
  }
  // A new run never mixes its checkpoints with another run's.
  if (!o.checkpoint_dir.empty()) {
    if (auto existing = find_latest_checkpoint(o.checkpoint_dir); existing.ok())
      return invalid_argument("--checkpoint-dir '" + o.checkpoint_dir + "' already holds checkpoints (newest: " + existing->string() +
                              "); pass --resume to continue that run, or choose another folder");
  }
  if (!o.init_dir.empty()) return load_weights(state, o.init_dir, model.config().mtp_layers);
  return state.init_random(static_cast<uint64_t>(plan.training.seed), 0.02);
}

// What the run is and where its memory goes, before the first step.
void print_header(const RunOptions& o, const Plan& plan, const ModelSpec& model, const DataLoader& loader, const Trainer& trainer,
                  int64_t total, std::ostream& out) {
  say(out, "megatrain-exec: %s, %lld parameters, %lld tokens/step, %lld steps, %s on the %s", model.name().c_str(),
      static_cast<long long>(model.parameter_counts().total), static_cast<long long>(loader.tokens_per_step() * loader.options().ranks),
      static_cast<long long>(total), o.in_memory ? "in-memory loop" : "streamed", trainer.backend_description().c_str());
  if (loader.prepared()) {
    const data::SequenceHeader& h = loader.sequences().header();
    say(out, "data: %s: %lld rows (%s), %lld of their %lld targets count (train on %s): the loss and targets/s count those, "
        "tokens/s every position",
        loader.source_name().c_str(), static_cast<long long>(h.rows), h.packing.c_str(), static_cast<long long>(h.counted),
        static_cast<long long>(h.rows * h.seq_len), h.train_on.c_str());
  }
  if (!o.in_memory) {
    const step::TierBytes& fp = trainer.footprint().peak;
    say(out, "memory: device arena %s of a %s budget, RAM %s (%s handed to the backend for page-locking)%s",
        format_bytes(static_cast<double>(fp.device)).c_str(),
        plan.placement.device_budget_bytes > 0 ? format_bytes(static_cast<double>(plan.placement.device_budget_bytes)).c_str()
                                               : "rig-wide",
        format_bytes(static_cast<double>(fp.ram)).c_str(), format_bytes(static_cast<double>(fp.pinned)).c_str(),
        fp.nvme > 0 ? (", NVMe " + format_bytes(static_cast<double>(fp.nvme))).c_str() : "");
  }
  if (const std::string pinned = trainer.pinned_report(); !pinned.empty()) say(out, "%s", pinned.c_str());
}

// A shared host state on several nodes: every node made the same updates from the same summed
// gradients, so their copies of the weights are equal bit for bit. Before node 0's copy is saved for
// the job, the nodes' first ranks compare an XXH64 of theirs; a difference (a fault) stops the run
// with the earlier checkpoints as they were.
Status check_node_copies_agree(Communicator& comm, const HostState& state, int64_t next_step) {
  int64_t h[2] = {INT64_MIN, INT64_MIN};  // the largest hash, and the largest of its negations
  if (comm.local_rank() == 0) {
    Xxh64 x;
    for (const UnitState& us : state.units()) x.update(us.master.data(), sizeof(float) * static_cast<size_t>(us.numel));
    h[0] = static_cast<int64_t>(x.digest() >> 1);
    h[1] = -h[0];
  }
  MT_RETURN_IF_ERROR(comm.max(h, 2, Channel::kMain));
  if (h[0] != -h[1])
    return internal_error("after step " + std::to_string(next_step) + " the " + std::to_string(comm.nodes()) +
                     " nodes' copies of the weights differ (parallel.host_state shared keeps one per node, and every node makes the "
                     "same update), so no checkpoint is written; the newest earlier checkpoint is intact; this is a fault of a node's "
                     "memory or of the MPI library, not of the plan");
  return {};
}

// The checkpoint of the state after step next_step - 1, all its updates written.
// With several ranks and replicated states every one holds the same state, and rank 0 writes it;
// with sharded states every rank writes the shard of the moments it owns (save_checkpoint).
Status save(const RunOptions& o, Communicator& comm, const Plan& plan, const std::string& plan_text, const ModelSpec& model,
            const DataLoader& loader, HostState& state, const RunSummary& summary, int64_t next_step, std::ostream& out,
            const std::function<Status(int64_t, const std::string&)>& after_save) {
  if (state.shared() && comm.nodes() > 1) MT_RETURN_IF_ERROR(check_node_copies_agree(comm, state, next_step));
  if (comm.rank() != 0 && !state.sharded()) return {};
  CheckpointInfo info;
  info.next_step = next_step;
  info.skipped_steps = summary.skipped_steps;
  info.model_name = model.name();
  info.parameters = model.parameter_counts().total;
  info.plan_json = plan_text;
  info.data = data_position(loader);
  info.seed = static_cast<uint64_t>(plan.training.seed);
  info.losses_first_step = summary.losses_first_step;
  info.losses = summary.losses;
  info.hf_config_json = hf_checkpoint_config(model);
  const auto t0 = std::chrono::steady_clock::now();
  SaveOptions options;
  options.compress_fp32_moments = o.compress_states;
  options.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.comm = &comm;
  MT_RETURN_IF_ERROR(save_checkpoint(o.checkpoint_dir, state, info, options));
  if (comm.rank() != 0) return {};
  const std::filesystem::path step_dir = checkpoint_step_dir(o.checkpoint_dir, next_step);
  std::error_code ec;
  uintmax_t opt_bytes = 0;  // optimizer.safetensors, or the shards of sharded states
  for (const auto& e : std::filesystem::directory_iterator(step_dir, ec))
    if (e.path().filename().string().rfind("optimizer", 0) == 0) opt_bytes += e.file_size(ec);
  say(out, "checkpoint %s written in %.2f s (optimizer states %s%s)", step_dir.string().c_str(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
      ec ? "?" : format_bytes(static_cast<double>(opt_bytes)).c_str(), o.compress_states ? ", fp32 moments compressed" : "");
  if (o.keep_checkpoints > 0) {
    // The new checkpoint is complete and durable: the old ones beyond the newest N go. A failure to
    // remove one costs disk space, not training state, so the run goes on and says so.
    auto removed = prune_checkpoints(o.checkpoint_dir, o.keep_checkpoints, next_step);
    if (!removed.ok()) {
      say(out, "warning: %s", removed.status().message().c_str());
    } else if (!removed->empty()) {
      std::string names;
      for (const auto& d : *removed) names += (names.empty() ? "" : ", ") + d.filename().string();
      say(out, "removed %zu older checkpoint%s (keeping the newest %lld): %s", removed->size(), removed->size() == 1 ? "" : "s",
          static_cast<long long>(o.keep_checkpoints), names.c_str());
    }
  }
  if (after_save) return after_save(next_step, step_dir.string());
  return {};
}

// The trace of rank k > 0 of a data-parallel job goes beside rank 0's: <stem>.rank<k><extension>.
std::string trace_path_of(const std::string& path, const Communicator& comm) {
  if (path.empty() || comm.rank() == 0) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(comm.rank()) + p.extension().string())).string();
}

Status write_trace(const RunOptions& o, const Trainer& trainer, const std::string& plan_text, std::ostream& out) {
  if (o.trace_path.empty()) return {};
  MT_RETURN_IF_ERROR(trainer.write_trace(o.trace_path, plan_text));
  say(out, "trace written to %s", o.trace_path.c_str());
  return {};
}

// The launch must be the plan's: as many ranks, as many on each node.
Status check_launch(const Plan& plan, const Communicator& comm) {
  const ParallelConfig& p = plan.parallel;
  if (p.data_parallel != comm.size())
    return invalid_argument("the plan is for " + std::to_string(p.data_parallel) + " rank" + (p.data_parallel == 1 ? "" : "s") +
                            " (parallel.data_parallel), but this job has " + std::to_string(comm.size()) + " (" + comm.description() +
                            "); accepted: mpirun -np " + std::to_string(p.data_parallel) + " megatrain-exec ..." +
                            (p.data_parallel == 1 ? " or megatrain-exec alone" : "") + ", or a plan for " + std::to_string(comm.size()) +
                            " (parallel.data_parallel " + std::to_string(comm.size()) + ")");
  if (comm.size() > 1 && p.ranks_per_node != comm.local_size())
    return invalid_argument("the plan puts " + std::to_string(p.ranks_per_node) + " ranks on each node (parallel.ranks_per_node), but " +
                            std::to_string(comm.local_size()) + " share this rank's node; accepted: a launch with " +
                            std::to_string(p.ranks_per_node) + " ranks per node (mpirun --map-by ppr:" + std::to_string(p.ranks_per_node) +
                            ":node), or a plan with ranks_per_node " + std::to_string(comm.local_size()));
  return {};
}

// The content fingerprint (content_fingerprint) of one file, read through a mapping; "" for an
// empty file.
Result<std::string> file_fingerprint(const std::filesystem::path& path, uint64_t whole_limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return io_error("cannot open '" + path.string() + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("'" + path.string() + "' is not a regular file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    return std::string();
  }
  void* m = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return io_error("cannot map '" + path.string() + "': " + std::strerror(errno));
  std::string f = content_fingerprint({{static_cast<const uint8_t*>(m), static_cast<uint64_t>(st.st_size)}}, whole_limit);
  ::munmap(m, static_cast<size_t>(st.st_size));
  return f;
}

// What one rank brings to a data-parallel job, each as one int64 to compare: a count as it is, the
// rest as an XXH64 (its top 63 bits, so that no value is INT64_MIN).
struct RankKey {
  const char* name;  // for the message
  int64_t value;
  bool counted;      // a count, printed as a number; otherwise a digest, printed in hex
  std::string mine;  // what this rank read it from, for its own message
};

int64_t digest_key(const std::string& text) {
  Xxh64 x;
  x.update(text.data(), text.size());
  return static_cast<int64_t>(x.digest() >> 1);
}

// Ranks agree before training (issue 49): every rank's plan, model config, data, evaluation data,
// --init weights, --steps, resume point and run options, gathered in one collective; a rank that
// differs from rank 0 is refused by every rank, naming it and the key. Two ranks with different
// models would otherwise corrupt memory in the first sum, and different data or learning rates
// train without a word.
Status check_ranks_agree(const RunOptions& o, const Plan& plan, const ModelSpec& model, const DataLoader& loader,
                         const DataLoader* eval, Communicator& comm) {
  if (comm.size() < 2) return {};
  namespace fs = std::filesystem;
  std::vector<RankKey> keys;
  {
    // The plan's content, less the paths that may differ between nodes and do not change the numbers.
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(plan.to_json_text());
    j.erase("model");
    j.erase("rig");
    if (j.contains("placement") && j["placement"].is_object()) j["placement"].erase("nvme_dirs");
    keys.push_back({"plan", digest_key(j.dump()), false, "plan " + o.plan_path});
  }
  keys.push_back({"model config", digest_key(model.config_json()), false, "model " + model.name()});
  keys.push_back({"data", digest_key(loader.source_fingerprint() + " " + std::to_string(loader.source_tokens())), false,
                  "data " + loader.source_name()});
  keys.push_back({"evaluation data", eval ? digest_key(eval->source_fingerprint()) : 0, false,
                  eval ? "--eval-data " + eval->source_name() : "no --eval-data"});
  {
    std::string init;
    if (!o.init_dir.empty()) {
      std::error_code ec;
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(o.init_dir, ec))
        if (e.is_regular_file(ec)) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const fs::path& f : files) {
        auto fp = file_fingerprint(f, uint64_t{64} << 20);
        init += f.filename().string() + " " + (fp.ok() ? *fp : "unreadable") + "\n";
      }
    }
    keys.push_back({"--init weights", o.init_dir.empty() ? 0 : digest_key(init), false,
                    o.init_dir.empty() ? "no --init" : "--init " + o.init_dir});
  }
  keys.push_back({"--steps", o.steps > 0 ? o.steps : plan.training.steps, true, "the steps to run"});
  {
    int64_t step = -1, manifest = 0;
    std::string where = "no --resume";
    if (o.resume) {
      where = "--resume from " + o.checkpoint_dir + ": no checkpoint";
      if (auto latest = find_latest_checkpoint(o.checkpoint_dir); latest.ok()) {
        where = "--resume from " + latest->string();
        step = detail::parse_step_dir_name(latest->filename().string()).value_or(-2);
        if (auto d = detail::digest_file(*latest / detail::kManifestFile); d.ok()) manifest = static_cast<int64_t>(d->xxh64 >> 1);
      }
    }
    keys.push_back({"resume step (-1: a new run)", step, true, where});
    keys.push_back({"resumed checkpoint's manifest", manifest, false, where});
  }
  {
    // The options every rank must take alike: they decide when the ranks meet in a collective
    // (saves, evaluations, the guard's skips) or what they compute.
    std::string opts = "checkpoint_every " + std::to_string(o.checkpoint_every) + " eval_every " + std::to_string(o.eval_every) +
                       " eval_at_end " + std::to_string(o.eval_at_end) + " eval_only " + std::to_string(o.eval_only) +
                       " skip_nonfinite " + std::to_string(o.skip_nonfinite_steps) + " in_memory " + std::to_string(o.in_memory) +
                       " compress " + std::to_string(o.compress_states) + " checkpoints " + std::to_string(!o.checkpoint_dir.empty()) +
                       " backend " + o.backend;
    keys.push_back({"run options (--checkpoint-every, --eval-every, --eval-at-end, --eval-only, --skip-nonfinite-steps, --in-memory, "
                    "--checkpoint-compress, --checkpoint-dir given or not, --backend)",
                    digest_key(opts), false, opts});
  }
  // One collective: every rank's values laid out by rank, gathered by a max over INT64_MIN.
  const int64_t n = comm.size(), K = static_cast<int64_t>(keys.size());
  std::vector<int64_t> all(static_cast<size_t>(K * n), INT64_MIN);
  for (int64_t k = 0; k < K; ++k) all[static_cast<size_t>(k * n + comm.rank())] = keys[static_cast<size_t>(k)].value;
  MT_RETURN_IF_ERROR(comm.max(all.data(), K * n, Channel::kMain));
  for (int64_t k = 0; k < K; ++k) {
    const RankKey& key = keys[static_cast<size_t>(k)];
    const int64_t* v = all.data() + k * n;
    std::vector<int64_t> odd;
    for (int64_t r = 1; r < n; ++r)
      if (v[r] != v[0]) odd.push_back(r);
    if (odd.empty()) continue;
    auto shown = [&](int64_t x) {
      char b[24];
      std::snprintf(b, sizeof b, key.counted ? "%lld" : "%016llx", static_cast<long long>(x));
      return std::string(b);
    };
    std::string ranks;
    for (size_t i = 0; i < odd.size() && i < 4; ++i)
      ranks += (i ? ", " : "") + std::string("rank ") + std::to_string(odd[i]) + " has " + shown(v[odd[i]]);
    if (odd.size() > 4) ranks += " and " + std::to_string(odd.size() - 4) + " more ranks differ";
    return invalid_argument("the ranks of this data-parallel job do not agree on the " + std::string(key.name) + ": rank 0 has " +
                               shown(v[0]) + ", " + ranks + " (this is rank " + std::to_string(comm.rank()) + ", with " + key.mine +
                               "); every rank must run the same plan, model config, data, --init, --steps, resume point and run "
                               "options (nodes must hold identical copies of the files); nothing was trained");
  }
  return {};
}

}  // namespace

namespace {

// The folder of prepared datasets: <checkpoint-dir>/data-cache, else the user's cache folder
// ($XDG_CACHE_HOME/megatrain/data-cache or ~/.cache/megatrain/data-cache), else
// <temporary folder>/megatrain-data-cache-<uid> (also when the user's cache folder cannot be made:
// a read-only home). Made with mode 0700 when missing; refused unless it
// is a real folder (not a symlink), owned by this user, that no one else may write (issue 49: a
// cache in the shared temporary folder could be planted or pointed elsewhere).
Result<std::filesystem::path> data_cache_dir(const RunOptions& o) {
  namespace fs = std::filesystem;
  fs::path dir;
  if (!o.checkpoint_dir.empty()) {
    dir = fs::path(o.checkpoint_dir) / "data-cache";
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && x[0] == '/') {
    dir = fs::path(x) / "megatrain" / "data-cache";
  } else if (const char* h = std::getenv("HOME"); h != nullptr && h[0] == '/') {
    dir = fs::path(h) / ".cache" / "megatrain" / "data-cache";
  } else {
    dir = fs::temp_directory_path() / ("megatrain-data-cache-" + std::to_string(::geteuid()));
  }
  std::error_code ec;
  fs::create_directories(dir.parent_path(), ec);
  if (ec && o.checkpoint_dir.empty()) {  // a read-only or missing home: this user's folder in the temporary one
    dir = fs::temp_directory_path() / ("megatrain-data-cache-" + std::to_string(::geteuid()));
    ec.clear();
  }
  if (ec) return io_error("cannot create the prepared-data cache's folder " + dir.parent_path().string() + ": " + ec.message());
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return io_error("cannot create the prepared-data cache " + dir.string() + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return io_error("cannot read the prepared-data cache " + dir.string() + ": " + std::strerror(errno));
  const std::string accepted = "; accepted: a folder of this user's that only it may write (chmod go-w), or another place "
                               "(--checkpoint-dir DIR uses DIR/data-cache; XDG_CACHE_HOME)";
  if (S_ISLNK(st.st_mode)) return invalid_argument("the prepared-data cache " + dir.string() + " is a symbolic link, which is not followed" + accepted);
  if (!S_ISDIR(st.st_mode)) return invalid_argument("the prepared-data cache " + dir.string() + " is not a folder" + accepted);
  if (st.st_uid != ::geteuid())
    return invalid_argument("the prepared-data cache " + dir.string() + " belongs to user " + std::to_string(st.st_uid) +
                            ", not to this one (" + std::to_string(::geteuid()) + "): its files could be anyone's" + accepted);
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return invalid_argument("the prepared-data cache " + dir.string() + " may be written by other users (mode " +
                            [&] { char b[8]; std::snprintf(b, sizeof b, "%03o", st.st_mode & 0777); return std::string(b); }() + ")" +
                            accepted);
  return dir;
}

// --data FILE --tokenizer DIR: the prepared dataset in the cache, made when it is not there. Its
// name and its header carry an XXH64 of everything it is made from (the contents of the data file,
// tokenizer.json, tokenizer_config.json and chat_template.jinja, seq_len and packing, the format's
// version), so a changed input makes a new one. On reuse the file is verified (its checksum, by
// open) and must carry that key: a file put there under the name (or a symbolic link) is not
// trained on, and the dataset is prepared again in its place.
Result<data::SequenceFile> prepared_on_the_fly(const RunOptions& o, const Plan& plan, std::ostream& out) {
  namespace fs = std::filesystem;
  MT_ASSIGN_OR_RETURN(data::Tokenizer tok, data::Tokenizer::load(o.tokenizer_path));
  std::error_code ec;
  if (!fs::is_regular_file(o.data_path, ec)) return not_found("--data " + o.data_path + ": not a file");
  Xxh64 key;
  const fs::path folder = fs::path(tok.source()).parent_path();
  for (const fs::path& p : {fs::path(o.data_path), fs::path(tok.source()), folder / "tokenizer_config.json", folder / "chat_template.jinja"}) {
    auto d = detail::digest_file(p);
    if (!d.ok() && d.status().code() != StatusCode::kNotFound) return d.status();
    const detail::FileDigest digest = d.ok() ? *d : detail::FileDigest{};
    key.update(&digest, sizeof(digest));
  }
  data::PrepareOptions po;  // packed "neat", each document attending only to itself (the default)
  po.seq_len = plan.training.seq_len;
  const std::string version = "megatrain.sequences/1 seq " + std::to_string(plan.training.seq_len) + (po.neat ? " neat" : " pack");
  key.update(version.data(), version.size());
  po.cache_key = detail::hex64(key.digest());
  MT_ASSIGN_OR_RETURN(fs::path dir, data_cache_dir(o));
  const fs::path cached = dir / (fs::path(o.data_path).stem().string() + "-" + po.cache_key + ".mtseq");
  struct stat st {};
  if (::lstat(cached.c_str(), &st) == 0) {
    std::string why;
    if (!S_ISREG(st.st_mode)) {
      why = S_ISLNK(st.st_mode) ? "is a symbolic link (not followed)" : "is not a regular file";
    } else if (auto f = data::SequenceFile::open(cached); !f.ok()) {
      why = "does not verify (" + f.status().message() + ")";
    } else if (f->header().cache_key != po.cache_key) {
      why = "does not carry the key of these inputs (" + (f->header().cache_key.empty() ? std::string("none") : f->header().cache_key) + ")";
    } else {
      say(out, "data: %s, prepared before (%s, verified)", o.data_path.c_str(), cached.string().c_str());
      return f;
    }
    say(out, "note: the cached %s %s: prepared again in its place", cached.string().c_str(), why.c_str());
    if (!S_ISREG(st.st_mode) && ::unlink(cached.c_str()) != 0 && errno != ENOENT)
      return io_error("cannot remove " + cached.string() + ": " + std::strerror(errno));
  }
  MT_ASSIGN_OR_RETURN(data::PrepareResult r, data::prepare_dataset(tok, {o.data_path}, "auto", data::FieldNames{}, po, cached));
  say(out, "data: %s prepared with %s: %lld documents (%s), %lld rows, %lld counted targets (train on %s) -> %s", o.data_path.c_str(),
      tok.source().c_str(), static_cast<long long>(r.header.documents), r.format.c_str(), static_cast<long long>(r.header.rows),
      static_cast<long long>(r.header.counted), r.header.train_on.c_str(), cached.string().c_str());
  return data::SequenceFile::open(cached);
}

// A prepared dataset (megatrain-data prepare: rows with a mask of the counted targets) or a token
// file (every next token counts), read as `d` says.
Result<DataLoader> open_file_data(const std::string& path, const DataLoaderOptions& d) {
  if (data::SequenceFile::is_sequence_file(path)) {
    MT_ASSIGN_OR_RETURN(data::SequenceFile rows, data::SequenceFile::open(path));
    return DataLoader::create(std::make_shared<const data::SequenceFile>(std::move(rows)), d);
  }
  // A dataset file read as bytes would train on its JSON syntax: it needs a tokenizer (issue 49).
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".jsonl" || ext == ".json")
    return invalid_argument("'" + path + "' is a " + (ext == ".jsonl" ? "JSON Lines" : "JSON") +
                            " dataset, which needs a tokenizer: give --tokenizer MODEL_FOLDER to prepare it on the fly, or prepare it "
                            "with megatrain-data prepare; without --tokenizer, --data takes a prepared dataset (.mtseq) or a token "
                            "file (llm.c .bin, raw .u16/.u32, or text read as bytes)");
  MT_ASSIGN_OR_RETURN(TokenFile file, TokenFile::open(path));
  auto tokens = std::make_shared<const TokenFile>(std::move(file));
  MT_RETURN_IF_ERROR(tokens->check_vocab(d.vocab_size));
  return DataLoader::create(tokens, d);
}

// The run's data: a file as open_file_data reads it, or a dataset file prepared with --tokenizer.
Result<DataLoader> open_data(const RunOptions& o, const Plan& plan, const ModelSpec& model, const Communicator& comm, std::ostream& out) {
  DataLoaderOptions d;
  d.ranks = comm.size();
  d.rank = comm.rank();
  d.seq_len = plan.training.seq_len;
  d.micro_batch = plan.training.micro_batch;
  d.grad_accum = plan.training.grad_accum;
  d.order = plan.training.data_order;
  d.seed = static_cast<uint64_t>(plan.training.seed);
  d.vocab_size = model.config().vocab_size;
  if (o.tokenizer_path.empty()) return open_file_data(o.data_path, d);
  MT_ASSIGN_OR_RETURN(data::SequenceFile rows, prepared_on_the_fly(o, plan, out));
  return DataLoader::create(std::make_shared<const data::SequenceFile>(std::move(rows)), d);
}

// The evaluation data (--eval-data): a prepared dataset or token file, read in order, every row once,
// in the plan's micro-batches.
Result<DataLoader> open_eval_data(const RunOptions& o, const Plan& plan, const ModelSpec& model) {
  DataLoaderOptions d;
  d.seq_len = plan.training.seq_len;
  d.micro_batch = plan.training.micro_batch;
  d.grad_accum = 1;
  d.order = DataOrder::kSequential;
  d.vocab_size = model.config().vocab_size;
  auto r = open_file_data(o.eval_data_path, d);
  if (!r.ok()) return r.status().with_context("--eval-data");
  return r;
}

// One evaluation pass, its line, and the hook.
Status run_eval(Trainer& trainer, const DataLoader& eval, int64_t next_step, RunSummary& summary, const RunCallbacks& callbacks,
                std::ostream& out) {
  MT_ASSIGN_OR_RETURN(EvalResult r, trainer.evaluate(eval));
  say(out, "eval after step %lld: loss %.4f over %lld targets of %lld rows (%.2f s)", static_cast<long long>(next_step), r.loss,
      static_cast<long long>(r.tokens), static_cast<long long>(r.rows), r.time_s);
  summary.evals.push_back({next_step, r.loss, r.tokens, r.time_s});
  if (callbacks.after_eval) return callbacks.after_eval(next_step, r.loss, r.tokens, r.time_s);
  return {};
}

}  // namespace

Result<RunSummary> run_training(const RunOptions& options, std::ostream& rank0_out, const RunCallbacks& callbacks) {
  RunPhase ignored = RunPhase::kChecking;
  RunPhase& phase = callbacks.phase != nullptr ? *callbacks.phase : ignored;
  phase = RunPhase::kChecking;
  // Data parallelism (docs/data-parallel.md): rank 0 prints, writes the checkpoints and takes the
  // folder's lock; every rank writes its own trace. One process is rank 0 of 1.
  MT_ASSIGN_OR_RETURN(Communicator* comm, world_communicator());
  comm->set_hang_timeout(options.collective_timeout_s);
  const bool rank0 = comm->rank() == 0;
  std::ostream quiet(nullptr);
  std::ostream& out = rank0 ? rank0_out : quiet;
  RunOptions o = options;
  o.trace_path = trace_path_of(options.trace_path, *comm);
  MT_RETURN_IF_ERROR(check_before_loading(o, rank0));
  FolderLock lock;  // one run per checkpoint folder, for the whole run, --resume included
  if (!o.checkpoint_dir.empty() && rank0) {
    MT_ASSIGN_OR_RETURN(lock, FolderLock::take(o.checkpoint_dir));
  }
  phase = RunPhase::kPlan;
  MT_ASSIGN_OR_RETURN(Plan plan, Plan::load(o.plan_path));
  MT_RETURN_IF_ERROR(check_launch(plan, *comm));
  MT_ASSIGN_OR_RETURN(ModelSpec model, plan.resolve_model());
  MT_RETURN_IF_ERROR(check_compression(o, plan));
  // The budgets before anything is allocated (issue 32 row 2): the trainer checks them again.
  if (!o.in_memory) MT_RETURN_IF_ERROR(check_plan_fits(plan, model, o.backend));
  phase = RunPhase::kData;
  MT_ASSIGN_OR_RETURN(DataLoader loader, open_data(o, plan, model, *comm, out));
  // The plan's prediction counts the attention over its document length: say so when the data's
  // differs by more than a tenth (training is right either way; only the prediction is off).
  if (const double want = loader.document_tokens(), have = plan.training.document_tokens;
      std::abs(want - have) > 0.1 * std::max(want, have))
    say(out, "note: the data's rows %s, but the plan was made for %s: its predicted times count the attention over %s "
             "(megatrain-plan plan --data %s makes a plan for these rows)",
        want > 0 ? ("pack documents of " + format_count(want) + " tokens each (weighted), each attending only to itself").c_str()
                 : "are whole contexts",
        have > 0 ? ("documents of " + format_count(have) + " tokens").c_str() : "whole-row contexts",
        have > 0 ? "the plan's documents" : "whole rows", (loader.prepared() ? loader.sequences().name() : o.data_path).c_str());
  std::optional<DataLoader> eval_loader;
  if (!o.eval_data_path.empty()) {
    MT_ASSIGN_OR_RETURN(DataLoader e, open_eval_data(o, plan, model));
    eval_loader.emplace(std::move(e));
  } else if (o.eval_only || o.eval_every > 0) {
    return invalid_argument("evaluation needs --eval-data FILE (a prepared dataset or token file)");
  }
  MT_RETURN_IF_ERROR(check_ranks_agree(o, plan, model, loader, eval_loader ? &*eval_loader : nullptr, *comm));
  phase = RunPhase::kState;
  MT_ASSIGN_OR_RETURN(HostState state, create_state(o, plan, model, *comm, out));
  RunSummary summary;
  if (o.resume) phase = RunPhase::kResume;
  MT_RETURN_IF_ERROR(start_state(o, plan, model, loader, state, summary, out));
  // A shared state is set by the node's first rank; the others wait for it before they read it.
  if (state.shared()) MT_RETURN_IF_ERROR(comm->node_barrier(Channel::kMain));
  phase = RunPhase::kState;

  TrainerOptions topt;
  topt.streamed = !o.in_memory;
  topt.threads = o.threads > 0 ? o.threads : usable_cores();
  topt.backend = o.backend;
  topt.pinned_limit_bytes = o.pinned_limit_gib >= 0 ? static_cast<int64_t>(o.pinned_limit_gib * 1073741824.0) : -1;
  topt.record_trace = !o.trace_path.empty();
  topt.comm = comm;
  MT_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::create(plan, model, state, loader, topt));
  if (comm->size() > 1) {
    // Every rank on a node keeps its training state: with replicated states a whole copy each, with
    // sharded ones the moments of its own tensors only (the footprint is the rank's that keeps the
    // most), with a shared state its share of the node's copy and its own moments and buffers. The
    // node's RAM must hold the largest rank's that many times.
    int64_t ram = o.in_memory ? trainer->memory_in_use().ram : trainer->footprint().peak.ram;
    MT_RETURN_IF_ERROR(comm->max(&ram, 1, Channel::kMain));
    ram *= comm->local_size();
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0 && ram > static_cast<int64_t>(pages) * page)
      return resource_exhausted("the " + std::to_string(comm->local_size()) + " ranks on this node need " +
                                format_bytes(static_cast<double>(ram)) + " (" + std::to_string(ram) + " bytes) of host RAM, " +
                                std::to_string(comm->local_size()) + " times the largest rank's training state (parallel.host_state " +
                                plan.parallel.host_state + "), but this machine has " +
                                format_bytes(static_cast<double>(pages) * static_cast<double>(page)) +
                                "; accepted: fewer ranks per node, or a plan that puts state on NVMe");
  }
  trainer->set_skipped_steps(summary.skipped_steps);

  const int64_t start = summary.first_step;
  const int64_t total = o.steps > 0 ? o.steps : plan.training.steps;
  summary.next_step = start;
  summary.total_steps = total;
  if (o.eval_only) {
    phase = RunPhase::kTraining;
    MT_RETURN_IF_ERROR(run_eval(*trainer, *eval_loader, start, summary, callbacks, out));
    return summary;
  }
  if (start >= total) {
    say(out, "the checkpoint has %lld steps done, the run has %lld in all: nothing to run", static_cast<long long>(start),
        static_cast<long long>(total));
    return summary;
  }
  print_header(o, plan, model, loader, *trainer, total, out);
  if (comm->size() > 1)
    say(out, "data parallel: %s; each rank trains %lld of every %lld rows of a step and the gradients are summed before the update "
             "(%s)",
        comm->description().c_str(), static_cast<long long>(plan.training.micro_batch * plan.training.grad_accum),
        static_cast<long long>(plan.training.micro_batch * plan.training.grad_accum * comm->size()),
        trainer->collective_description().c_str());
  if (state.shared()) {
    int64_t owned = 0, tensors = 0;
    for (const UnitState& us : state.units())
      for (const TensorSlot& t : us.tensors) owned += state.owns(t), ++tensors;
    say(out, "host state shared by each node's %d ranks: one copy of the master weights, streaming copy and summed gradients per "
             "node (%s in %s), each rank keeping Adam's moments of its own tensors and updating them in place; rank 0 keeps %lld of "
             "the %lld tensors' moments, %s of %s%s",
        comm->local_size(), format_bytes(static_cast<double>(state.shared_memory()->bytes())).c_str(), SharedMemory::folder().c_str(),
        static_cast<long long>(owned), static_cast<long long>(tensors), format_bytes(static_cast<double>(state.moment_bytes())).c_str(),
        format_bytes(static_cast<double>(state.unsharded_moment_bytes())).c_str(), state.states_on_nvme() ? " (on NVMe)" : "");
  } else if (state.sharded()) {
    int64_t owned = 0, tensors = 0;
    for (const UnitState& us : state.units())
      for (const TensorSlot& t : us.tensors) owned += state.owns(t), ++tensors;
    say(out, "optimizer states sharded over the ranks: each keeps Adam's moments of its own tensors and updates them, then the ranks "
             "gather the new weights; rank 0 keeps %lld of the %lld tensors' moments, %s of %s%s",
        static_cast<long long>(owned), static_cast<long long>(tensors),
        format_bytes(static_cast<double>(state.moment_bytes())).c_str(),
        format_bytes(static_cast<double>(state.unsharded_moment_bytes())).c_str(), state.states_on_nvme() ? " (on NVMe)" : "");
  }
  phase = RunPhase::kTraining;
  const std::string plan_text = plan.to_json_text();
  if (callbacks.before_first_step) callbacks.before_first_step();
  double elapsed = 0;
  int64_t saved = start;  // the step the newest checkpoint holds
  for (int64_t s = start; s < total; ++s) {
    // The data file is mapped: one truncated or rewritten under the run is caught here, before the
    // step reads it, and the steps done so far are saved (issue 32 row 9).
    if (Status changed = loader.check_unchanged(); !changed.ok()) {
      if (!o.checkpoint_dir.empty() && s > saved) {
        MT_RETURN_IF_ERROR(trainer->finish_updates());
        MT_RETURN_IF_ERROR(save(o, *comm, plan, plan_text, model, loader, state, summary, s, out, callbacks.after_save));
      }
      const std::string after = o.checkpoint_dir.empty() ? "the run stops here (no --checkpoint-dir: nothing saved)"
                                : s == 0                 ? "the run stops here, before its first step"
                                                         : "the run stops here; the checkpoint of step " + std::to_string(s) + " holds the steps done";
      return Status(changed.code(), changed.message() + "; " + after);
    }
    if (callbacks.before_step) MT_RETURN_IF_ERROR(callbacks.before_step(s));
    const double lr = learning_rate(plan.training, s - summary.skipped_steps);
    MT_ASSIGN_OR_RETURN(StepResult r, trainer->run_step(s));
    // The non-finite guard (docs/reliability.md): the step made no update. Unless told to skip such
    // steps, the run stops here and the steps done are saved; a state some of whose units were
    // updated before the reason was known is never saved.
    if (!r.applied && (!o.skip_nonfinite_steps || !r.state_intact)) {
      const std::string what = "step " + std::to_string(s + 1) + "/" + std::to_string(total) + ": " + r.not_applied;
      const std::string newest = saved > start || o.resume ? "; the newest checkpoint (step " + std::to_string(saved) + ") is intact" : "";
      if (!r.state_intact)
        return unavailable(what + ", found after other units of the step were updated (without clipping, updates overlap the "
                           "backward); this state is not saved" + (o.checkpoint_dir.empty() ? std::string() : newest) +
                           "; with training.clip_grad_norm set such a step is found before any update");
      std::string after = "; no update was applied and the run stops";
      if (!o.checkpoint_dir.empty() && s > saved) {
        MT_RETURN_IF_ERROR(trainer->finish_updates());
        MT_RETURN_IF_ERROR(save(o, *comm, plan, plan_text, model, loader, state, summary, s, out, callbacks.after_save));
        after += "; the checkpoint of step " + std::to_string(s) + " holds the " + std::to_string(s) + " steps done";
      } else if (!o.checkpoint_dir.empty()) {
        after += newest;
      }
      return unavailable(what + after + "; --skip-nonfinite-steps skips such steps and goes on");
    }
    summary.losses.push_back(r.loss);
    summary.next_step = s + 1;
    elapsed += r.time_s;
    const double eta = elapsed / static_cast<double>(s + 1 - start) * static_cast<double>(total - s - 1);
    // MoE: the router's load-balancing loss, marked "(not trained)" when the config leaves it out
    // of the objective (output_router_logits false), and the experts AdamW skipped.
    std::string moe;
    if (!std::isnan(r.aux_loss)) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "  aux %.4f%s  unused experts %lld", r.aux_loss, r.aux_in_loss ? "" : " (not trained)",
                    static_cast<long long>(r.unused_experts));
      moe = buf;
    }
    if (r.applied) {
      // One unit for speed (the plan's): tokens/s over every position of the step's rows; with a
      // loss mask, the counted targets/s beside it, labelled.
      const double positions = static_cast<double>(loader.tokens_per_step() * loader.options().ranks);
      char targets[48] = "";
      if (loader.prepared()) std::snprintf(targets, sizeof targets, " (%.0f targets/s)", static_cast<double>(r.tokens) / r.time_s);
      say(out, "step %5lld/%lld  loss %.4f%s  %8.0f tokens/s%s  stall %4.1f%%  ETA %s", static_cast<long long>(s + 1),
          static_cast<long long>(total), r.loss, moe.c_str(), positions / r.time_s, targets, 100.0 * r.stall_s / r.time_s,
          format_duration(eta).c_str());
    } else {
      ++summary.skipped_steps;
      say(out, "step %5lld/%lld  skipped: %s; no update (%lld skipped in all)  ETA %s", static_cast<long long>(s + 1),
          static_cast<long long>(total), r.not_applied.c_str(), static_cast<long long>(summary.skipped_steps), format_duration(eta).c_str());
    }
    const int64_t done = s + 1;
    StepControl control;
    if (callbacks.after_step) {
      MT_ASSIGN_OR_RETURN(control, callbacks.after_step(r, lr));
    }
    if (eval_loader && (control.evaluate || (o.eval_every > 0 && done % o.eval_every == 0) || (o.eval_at_end && done == total)))
      MT_RETURN_IF_ERROR(run_eval(*trainer, *eval_loader, done, summary, callbacks, out));
    int sig = callbacks.stop_requested ? callbacks.stop_requested() : 0;
    if (comm->size() > 1) {
      // A signal or a hook on any rank stops (or saves) every rank after the same step.
      int64_t asked[3] = {sig, control.stop ? 1 : 0, control.save ? 1 : 0};
      MT_RETURN_IF_ERROR(comm->max(asked, 3, Channel::kMain));
      sig = static_cast<int>(asked[0]);
      control.stop = asked[1] != 0;
      control.save = asked[2] != 0;
    }
    const bool stop = sig != 0 || control.stop;
    if (!o.checkpoint_dir.empty() &&
        (done == total || stop || control.save || (o.checkpoint_every > 0 && done % o.checkpoint_every == 0))) {
      // The checkpoint holds the state after this step's updates, all of them written.
      MT_RETURN_IF_ERROR(trainer->finish_updates());
      MT_RETURN_IF_ERROR(save(o, *comm, plan, plan_text, model, loader, state, summary, done, out, callbacks.after_save));
      saved = done;
    }
    if (stop && sig == 0 && done < total) {
      say(out, "stopped by a callback after step %lld of %lld; %s", static_cast<long long>(done), static_cast<long long>(total),
          o.checkpoint_dir.empty() ? "nothing saved (no checkpoint folder)" : "continue with --resume");
      MT_RETURN_IF_ERROR(write_trace(o, *trainer, plan_text, out));
      summary.stopped_by_hook = true;
      return summary;
    }
    if (sig != 0 && done < total) {
      say(out, "stopped by %s after step %lld of %lld; %s", sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : sig == SIGTERM ? "SIGTERM" : "a signal", static_cast<long long>(done),
          static_cast<long long>(total), o.checkpoint_dir.empty() ? "nothing saved (no --checkpoint-dir)" : "continue with --resume");
      MT_RETURN_IF_ERROR(write_trace(o, *trainer, plan_text, out));
      summary.stop_signal = sig;
      return summary;
    }
  }
  // The last step's updates finish after it returns: a failure there fails the run.
  MT_RETURN_IF_ERROR(trainer->finish_updates());
  MT_RETURN_IF_ERROR(write_trace(o, *trainer, plan_text, out));
  return summary;
}

}  // namespace megatrain::exec

// Training checkpoints: the public save, load and resume flow. A step directory is built in a hidden
// temporary directory and published by one rename (all files and directories fsynced first, with
// core's durable_file.h); the loader verifies everything (detail/checkpoint_verify.h) before it
// touches the training state. The optimizer file is detail/optimizer_file.h, the hash
// detail/checkpoint_hash.h, the directory layout detail/checkpoint_files.h.
#include "megatrain/executor/checkpoint.h"
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <ctime>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "detail/checkpoint_files.h"
#include "detail/checkpoint_hash.h"
#include "detail/checkpoint_verify.h"
#include "detail/optimizer_file.h"
#include "megatrain/core/durable_file.h"
#include "megatrain/executor/weights_io.h"

namespace megatrain::exec {
namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using namespace detail;

std::string hf_checkpoint_config(const ModelSpec& model) {
  Json j = Json::parse(model.config_json(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return "";
  j.erase("quantization_config");
  // The weights written are fp32: transformers before 5 reads torch_dtype, transformers 5 dtype (a
  // bf16 model's "dtype": "bfloat16" left as it was would load the fp32 weights rounded to bf16).
  j["torch_dtype"] = "float32";
  if (j.contains("dtype")) j["dtype"] = "float32";
  return j.dump(2) + "\n";
}

namespace {

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

// `latest`'s text: the step directory's name, then the XXH64 of that name.
std::string latest_text(const std::string& name) { return name + "\nxxh64 " + hex64(xxh64(name.data(), name.size())) + "\n"; }

}  // namespace

fs::path checkpoint_step_dir(const fs::path& checkpoint_dir, int64_t next_step) {
  return checkpoint_dir / step_dir_name(next_step);
}

DataPosition data_position(const DataLoader& loader) {
  const DataLoaderOptions& o = loader.options();
  // grad_accum counts the micro-batches of a step over every rank: the rows a step reads are the
  // same for N ranks x A as for one process x N*A (docs/data-parallel.md), so either resumes the other.
  return DataPosition{o.seq_len, o.micro_batch, o.grad_accum * o.ranks, data_order_name(o.order), o.seed,
                      loader.source_name(), loader.source_tokens(), loader.source_fingerprint()};
}

// ---- saving --------------------------------------------------------------------------------------

namespace {

// A save's temporary step directory, made by the one process that publishes it.
Result<fs::path> start_save(const fs::path& checkpoint_dir, const std::string& name, const CheckpointInfo& info, const std::string& what) {
  if (info.next_step < 0) return invalid_argument(what + "the step is negative");
  if (!info.plan_json.empty() && !Json::accept(info.plan_json))
    return invalid_argument(what + "the plan text is not valid JSON");
  std::error_code ec;
  if (fs::exists(checkpoint_dir, ec) && !fs::is_directory(checkpoint_dir, ec))
    return invalid_argument(what + "the path exists and is not a directory");
  const bool created_dir = fs::create_directories(checkpoint_dir, ec);
  if (ec) return io_error(what + "cannot create the directory: " + ec.message());
  if (created_dir) {  // its own entry must be durable too, or the whole folder could vanish on a crash
    const fs::path parent = checkpoint_dir.has_parent_path() ? checkpoint_dir.parent_path() : fs::path(".");
    if (Status s = fsync_path(parent, true); !s.ok()) return Status(s.code(), what + s.message());
  }
  remove_stale_temporaries(checkpoint_dir);
  const fs::path tmp = checkpoint_dir / ("." + name + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  if (file_io().mkdir(tmp.c_str(), 0755) != 0) return io_error(what + "cannot create '" + tmp.string() + "': " + errno_text(errno));
  return tmp;
}

// Writes the manifest into the complete temporary directory `tmp` and makes it the step directory
// (replacing one of the same number atomically), then updates `latest`. On failure before the
// step is visible, `tmp` is removed and the error ends with `unchanged`.
Status publish_save(const fs::path& checkpoint_dir, const std::string& name, const fs::path& tmp, const CheckpointInfo& info,
                    const std::map<std::string, FileDigest>& files, const std::string& what) {
  const std::string pid = std::to_string(::getpid());
  const std::string unchanged = "; earlier checkpoints are unchanged";
  auto fail = [&](const Status& s) {
    std::error_code ec2;
    fs::remove_all(tmp, ec2);
    return Status(s.code(), what + s.message() + unchanged);
  };
  std::error_code ec;
  const std::string created = utc_now();
  if (Status s = write_new_file(tmp / kManifestFile, manifest_text(info, files, created)); !s.ok())
    return fail(s);
  if (Status s = fsync_path(tmp, true); !s.ok()) return fail(s);

  // Publish: the complete directory appears under its final name in one rename. When the step
  // exists already (a re-save), RENAME_EXCHANGE swaps the two atomically, so a checkpoint of that
  // number is visible at every instant; the old one is then deleted.
  const fs::path target = checkpoint_dir / name;
  fs::path old;  // what to delete once the new step is in place
  if (fs::exists(target, ec)) {
    if (file_io().rename_exchange(tmp.c_str(), target.c_str()) == 0) {
      old = tmp;
    } else {
      const fs::path aside = checkpoint_dir / ("." + name + ".old-" + pid);
      fs::remove_all(aside, ec);
      if (file_io().rename(target.c_str(), aside.c_str()) != 0)
        return fail(io_error("cannot move the existing '" + target.string() + "' aside: " + errno_text(errno)));
      if (file_io().rename(tmp.c_str(), target.c_str()) != 0) {
        const int err = errno;
        if (file_io().rename(aside.c_str(), target.c_str()) != 0)
          return io_error(what + "cannot rename '" + tmp.string() + "' to '" + target.string() + "': " + errno_text(err) +
                          ", and the previous " + name + " is left at '" + aside.string() + "'");
        return fail(io_error("cannot rename '" + tmp.string() + "' to '" + target.string() + "': " + errno_text(err)));
      }
      old = aside;
    }
  } else if (file_io().rename(tmp.c_str(), target.c_str()) != 0) {
    return fail(io_error("cannot rename '" + tmp.string() + "' to '" + target.string() + "': " + errno_text(errno)));
  }
  const std::string published = "checkpoint '" + target.string() + "' is complete, but ";
  if (Status s = fsync_path(checkpoint_dir, true); !s.ok()) return io_error(published + s.message());
  if (!old.empty()) fs::remove_all(old, ec);

  // `latest`: a small file naming the step directory, replaced atomically.
  const fs::path latest_tmp = checkpoint_dir / (".latest.tmp-" + pid);
  fs::remove(latest_tmp, ec);
  if (Status s = write_new_file(latest_tmp, latest_text(name)); !s.ok())
    return io_error(published + "'latest' was not updated: " + s.message());
  if (Status s = publish(latest_tmp, checkpoint_dir / kLatestFile); !s.ok()) {
    fs::remove(latest_tmp, ec);
    return io_error(published + s.message());
  }
  return {};
}

// The weights, config.json and the optimizer file(s) of rank 0 (or the only process) into `tmp`.
Status write_rank0_files(const fs::path& tmp, const HostState& state, const CheckpointInfo& info, const SaveOptions& options,
                         const std::string& optimizer_file) {
  MT_RETURN_IF_ERROR(save_weights(state, tmp / kModelFile));
  if (!info.hf_config_json.empty()) MT_RETURN_IF_ERROR(write_new_file(tmp / kConfigFile, info.hf_config_json));
  return write_optimizer(state, tmp / optimizer_file, info.next_step - info.skipped_steps, options);
}

// Sharded states (docs/data-parallel.md): every rank writes the shard of the moments it owns into
// rank 0's temporary directory; rank 0 writes the weights and, once every shard is complete, the
// manifest, and publishes the step in one rename, so the checkpoint is visible only whole. Every
// rank returns the same verdict.
Status save_sharded(const fs::path& checkpoint_dir, const HostState& state, CheckpointInfo info, const SaveOptions& options,
                    const std::string& name, const std::string& what) {
  Communicator& comm = *options.comm;
  const int rank = comm.rank();
  // The shards: one per rank, or with a shared host state one per rank of a node (every node holds
  // the same states, and node 0's ranks write them).
  const int shards = state.sharding().ranks, shard_index = state.sharding().rank;
  const int expect_shards = state.shared() ? comm.local_size() : comm.size(), expect_index = state.shared() ? comm.local_rank() : rank;
  const bool writer = !state.shared() || comm.node() == 0;
  if (shards != expect_shards || shard_index != expect_index)
    return internal_error(what + "the state is sharded as shard " + std::to_string(shard_index) + " of " + std::to_string(shards) +
                          ", the job's rank is " + std::to_string(expect_index) + " of " + std::to_string(expect_shards));
  info.optimizer_shards = shards;
  // Rank 0 makes the temporary directory; every rank learns its name (rank 0's process id).
  Status mine;
  fs::path tmp;
  int64_t head[2] = {0, 0};  // rank 0: started, its pid
  if (rank == 0) {
    auto t = start_save(checkpoint_dir, name, info, what);
    if (t.ok()) tmp = *t, head[0] = 1, head[1] = ::getpid();
    else mine = t.status();
  }
  MT_RETURN_IF_ERROR(comm.sum(head, 2, Channel::kMain));
  if (head[0] == 0)
    return rank == 0 ? mine : unavailable(what + "rank 0 could not start it (its message says why)");
  if (rank != 0) tmp = checkpoint_dir / ("." + name + ".tmp-" + std::to_string(head[1]));
  // Every rank its shard (rank 0 also the weights), its size and checksum to rank 0.
  const std::string shard = optimizer_file_name(shard_index, shards);
  if (writer)
    mine = rank == 0 ? write_rank0_files(tmp, state, info, options, shard)
                     : write_optimizer(state, tmp / shard, info.next_step - info.skipped_steps, options);
  std::vector<int64_t> digests(3 * static_cast<size_t>(shards), 0);  // per shard: ok, bytes, xxh64 bits
  if (writer && mine.ok()) {
    auto d = digest_file(tmp / shard);
    if (d.ok()) {
      const auto k = static_cast<size_t>(shard_index);
      digests[3 * k] = 1;
      digests[3 * k + 1] = static_cast<int64_t>(d->bytes);
      digests[3 * k + 2] = static_cast<int64_t>(d->xxh64);
    } else {
      mine = d.status();
    }
  }
  MT_RETURN_IF_ERROR(comm.sum(digests.data(), static_cast<int64_t>(digests.size()), Channel::kMain));
  int64_t published = 0;
  if (rank == 0) {
    std::string failed;
    for (int r = 0; r < shards; ++r)
      if (digests[3 * static_cast<size_t>(r)] == 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    if (!failed.empty()) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      if (mine.ok()) mine = io_error(what + "the rank writing optimizer shard " + failed + " could not write it (its message says why); earlier checkpoints are unchanged");
      else mine = Status(mine.code(), what + mine.message() + "; earlier checkpoints are unchanged");
    } else {
      std::map<std::string, FileDigest> files;
      for (int r = 0; r < shards; ++r)
        files[optimizer_file_name(r, shards)] = FileDigest{static_cast<uint64_t>(digests[3 * static_cast<size_t>(r) + 1]),
                                                          static_cast<uint64_t>(digests[3 * static_cast<size_t>(r) + 2])};
      for (const char* f : {kModelFile, kConfigFile}) {
        if (f == kConfigFile && info.hf_config_json.empty()) continue;
        auto d = digest_file(tmp / f);
        if (!d.ok()) {
          mine = d.status();
          break;
        }
        files[f] = *d;
      }
      if (mine.ok()) mine = publish_save(checkpoint_dir, name, tmp, info, files, what);
      else {
        std::error_code ec;
        fs::remove_all(tmp, ec);
        mine = Status(mine.code(), what + mine.message() + "; earlier checkpoints are unchanged");
      }
    }
    published = mine.ok() ? 1 : 0;
  }
  MT_RETURN_IF_ERROR(comm.sum(&published, 1, Channel::kMain));
  if (rank == 0) return mine;
  if (!mine.ok()) return Status(mine.code(), what + mine.message());
  if (published == 0) return unavailable(what + "rank 0 could not complete it (its message says why)");
  return {};
}

}  // namespace

// Everything goes to a hidden temporary directory, every file and the directory are fsynced, then
// one rename publishes it.
Status save_checkpoint(const fs::path& checkpoint_dir, const HostState& state, const CheckpointInfo& info,
                       const SaveOptions& options) {
  const std::string name = step_dir_name(info.next_step);
  const std::string what = "cannot save checkpoint " + name + " in '" + checkpoint_dir.string() + "': ";
  if (state.sharded()) {
    if (options.comm == nullptr) return invalid_argument(what + "the optimizer states are sharded, and no communicator was given to gather the shards");
    return save_sharded(checkpoint_dir, state, info, options, name, what);
  }
  MT_ASSIGN_OR_RETURN(const fs::path tmp, start_save(checkpoint_dir, name, info, what));
  auto fail = [&](const Status& s) {
    std::error_code ec2;
    fs::remove_all(tmp, ec2);
    return Status(s.code(), what + s.message() + "; earlier checkpoints are unchanged");
  };
  if (Status s = write_rank0_files(tmp, state, info, options, kOptimizerFile); !s.ok()) return fail(s);
  std::map<std::string, FileDigest> files;
  for (const char* f : {kModelFile, kOptimizerFile, kConfigFile}) {
    if (f == kConfigFile && info.hf_config_json.empty()) continue;
    auto d = digest_file(tmp / f);
    if (!d.ok()) return fail(d.status());
    files[f] = *d;
  }
  return publish_save(checkpoint_dir, name, tmp, info, files, what);
}

Result<std::vector<fs::path>> prune_checkpoints(const fs::path& checkpoint_dir, int64_t keep, int64_t saved_step) {
  if (keep < 1)
    return invalid_argument("keep " + std::to_string(keep) + " checkpoints: accepted: 1 or more (the newest, just saved, counts as one)");
  const std::string saved = step_dir_name(saved_step);
  const std::string what = "cannot remove old checkpoints of '" + checkpoint_dir.string() + "' (keeping " + std::to_string(keep) + "): ";
  std::error_code ec;
  if (!fs::is_directory(checkpoint_dir / saved, ec))
    return not_found(what + "the checkpoint just saved, '" + saved + "', is not there; nothing was removed");
  // Older steps, newest first: the first keep - 1 stay.
  std::vector<fs::path> doomed;
  int64_t kept = 1;
  for (const auto& [step, dir] : list_step_dirs(checkpoint_dir)) {
    if (step >= saved_step) continue;
    if (kept < keep) ++kept;
    else doomed.push_back(dir);
  }
  if (doomed.empty()) return std::vector<fs::path>{};
  std::reverse(doomed.begin(), doomed.end());  // oldest first: a failure part-way keeps the newer ones
  // Out of sight first: each step directory becomes a hidden name in one rename, so a directory
  // is either a whole checkpoint or gone, whatever happens after.
  const std::string pid = std::to_string(::getpid());
  std::vector<fs::path> removed, aside;
  std::string failure;  // what went wrong after the checks, if anything
  for (const fs::path& dir : doomed) {
    const fs::path hidden = checkpoint_dir / ("." + dir.filename().string() + ".old-" + pid);
    fs::remove_all(hidden, ec);
    if (file_io().rename(dir.c_str(), hidden.c_str()) != 0) {
      failure = "cannot rename '" + dir.string() + "' to '" + hidden.string() + "': " + errno_text(errno) +
                "; it and the newer checkpoints are kept";
      break;
    }
    removed.push_back(dir);
    aside.push_back(hidden);
  }
  // The renames made durable before anything is deleted (else a crash could keep a rename's undoing
  // and lose the files); then the files themselves. Left hidden, the next save removes them.
  if (!aside.empty())
    if (Status s = fsync_path(checkpoint_dir, true); !s.ok())
      return io_error(what + s.message() + "; the " + std::to_string(aside.size()) +
                      " checkpoint(s) moved out of sight are deleted by the next save" + (failure.empty() ? "" : "; " + failure));
  for (const fs::path& hidden : aside) {
    fs::remove_all(hidden, ec);
    if (ec && failure.empty()) failure = "cannot delete '" + hidden.string() + "': " + ec.message() + " (the next save tries again)";
  }
  if (!failure.empty()) return io_error(what + failure);
  return removed;
}

namespace {

Status apply(const Verified& v, HostState& state) {
  auto incomplete = [](const Status& s) {
    return Status(s.code(), s.message() + "; the training state is incomplete and must not be used");
  };
  const SafetensorsFile& model = *v.model;
  const OptimizerFiles& opt = v.optimizer;
  // A unit on NVMe is paged in zero-filled, set from the files and written back.
  UnitPager pager(state);
  for (size_t u = 0; u < state.units().size(); ++u) {
    MT_ASSIGN_OR_RETURN(UnitState * paged, pager.get(static_cast<int64_t>(u), true));
    UnitState& us = *paged;
    MT_ASSIGN_OR_RETURN(MomentReader moments, MomentReader::for_unit(opt, v.compressed, us));
    for (size_t i = 0; i < us.tensors.size(); ++i) {
      const TensorSlot& t = us.tensors[i];
      if (state.writes_weights())  // a shared state: the node's first rank loads the node's copy
        if (Status s = model.read_fp32(*model.find(t.name), us.master.data() + t.offset, t.numel); !s.ok())
          return incomplete(s);
      if (Status s = moments.read(i); !s.ok()) return incomplete(s);
    }
  }
  if (Status s = pager.finish(); !s.ok()) return incomplete(s);
  if (Status s = read_expert_steps(opt.files.front(), state); !s.ok()) return incomplete(s);
  if (Status s = state.refresh_stream(); !s.ok()) return incomplete(s);
  return {};
}

// The newest step directory of `root`: the one `latest` names when `latest` is intact and names a
// step directory, otherwise the highest-numbered step-* directory, with `note` saying why. `latest`
// carries the XXH64 of the name (its second line), so one flipped bit is not read as an older step;
// a `latest` without that line (written before it existed) is taken as it is.
Result<fs::path> newest_step_dir(const fs::path& root, std::string* note = nullptr) {
  auto latest = read_small_file(root / kLatestFile, 4096);
  std::string why;
  if (latest.ok()) {
    const std::string& t = *latest;
    const size_t nl = t.find('\n');
    std::string name = t.substr(0, nl), rest = nl == std::string::npos ? std::string() : t.substr(nl + 1);
    while (!name.empty() && (name.back() == '\r' || name.back() == ' ')) name.pop_back();
    while (!rest.empty() && (rest.back() == '\n' || rest.back() == '\r' || rest.back() == ' ')) rest.pop_back();
    std::error_code ec;
    if (!rest.empty() && rest != "xxh64 " + hex64(xxh64(name.data(), name.size())))
      why = "is damaged (its checksum does not match the step it names, '" + name + "')";
    else if (!parse_step_dir_name(name)) why = "does not name a step directory";
    else if (!fs::is_directory(root / name, ec)) why = "names '" + name + "', which does not exist";
    else return root / name;
  } else {
    why = "is missing or unreadable";
  }
  auto dirs = list_step_dirs(root);
  if (dirs.empty())
    return not_found("no checkpoint in '" + root.string() + "' (no 'latest' file naming a step directory, no step-* directory)");
  if (note != nullptr)
    *note = "'" + (root / kLatestFile).string() + "' " + why + ": resuming from the highest-numbered step, '" +
            dirs.front().second.filename().string() + "'";
  return dirs.front().second;
}

}  // namespace

Result<fs::path> find_latest_checkpoint(const fs::path& checkpoint_dir) {
  std::error_code ec;
  if (!fs::is_directory(checkpoint_dir, ec)) return not_found("'" + checkpoint_dir.string() + "' is not a directory");
  return newest_step_dir(checkpoint_dir);
}

Result<LoadedCheckpoint> load_checkpoint(const fs::path& path, HostState& state) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return not_found("checkpoint '" + path.string() + "' does not exist");
  if (!fs::is_directory(path, ec))
    return invalid_argument("'" + path.string() + "' is not a directory; expected a checkpoint directory or a step-* directory in it");
  const bool step_dir = fs::exists(path / kManifestFile, ec) || parse_step_dir_name(path.filename().string()).has_value();
  fs::path dir = path;
  std::string note;
  if (!step_dir) {
    MT_ASSIGN_OR_RETURN(dir, newest_step_dir(path, &note));
  }
  auto v = verify_step_dir(dir, state);
  if (!v.ok()) {
    // Decision: never fall back silently. Resuming from an older step repeats work and changes the
    // run's history, so that is the user's call; the error says which older checkpoint verifies.
    if (!step_dir && v.status().code() == StatusCode::kCorrupt) {
      for (const auto& [step, other] : list_step_dirs(path)) {
        if (other == dir) continue;
        if (verify_step_dir(other, state).ok())
          return corrupt("the newest checkpoint '" + dir.string() + "' is corrupt (" + v.status().message() +
                         "); the older checkpoint '" + other.string() + "' verifies but is not used without your say: to resume from it, move '" +
                         dir.string() + "' out of '" + path.string() + "'");
      }
    }
    return v.status();
  }
  MT_RETURN_IF_ERROR(apply(*v, state));
  return LoadedCheckpoint{dir, std::move(v->info), note};
}

// ---- resume compatibility ------------------------------------------------------------------------

Status check_resume_compatible(const CheckpointInfo& saved, const Plan& plan, const ModelSpec& model,
                               const DataLoader& data) {
  auto differs = [](const std::string& key, const std::string& was, const std::string& now, const std::string& source) {
    return invalid_argument("cannot resume: " + key + " is " + was + " in the checkpoint but " + now + " in the " + source +
                            "; a resumed run must keep it (to change it, start a new run from the checkpoint's weights with --init <step dir>)");
  };
  if (saved.model_name != model.name()) return differs("model", "'" + saved.model_name + "'", "'" + model.name() + "'", "plan");
  if (saved.parameters != model.parameter_counts().total)
    return differs("model parameters", std::to_string(saved.parameters), std::to_string(model.parameter_counts().total), "plan");
  // The whole model: the checkpoint's config.json (verified with its checksum) against the model's,
  // key by key, leaving out the keys that do not change the numbers.
  if (!saved.hf_config_json.empty()) {
    const Json was = Json::parse(saved.hf_config_json, nullptr, false), now = Json::parse(hf_checkpoint_config(model), nullptr, false);
    if (!was.is_object()) return corrupt("cannot resume: the checkpoint's config.json is not a JSON object");
    static const std::set<std::string> kNoEffect = {"_name_or_path", "transformers_version", "torch_dtype", "use_cache", "bos_token_id",
                                                    "eos_token_id", "pad_token_id", "quantization_config", "output_router_logits"};
    std::vector<std::string> keys;
    for (const auto& [k, _] : was.items()) keys.push_back(k);
    for (const auto& [k, _] : now.items())
      if (!was.contains(k)) keys.push_back(k);
    std::string list;
    for (const std::string& k : keys) {
      if (kNoEffect.count(k)) continue;
      const Json a = was.value(k, Json()), b = now.value(k, Json());
      if (a != b) list += (list.empty() ? "" : ", ") + k + " " + (a.is_null() ? std::string("(absent)") : a.dump()) + " -> " +
                          (b.is_null() ? std::string("(absent)") : b.dump());
    }
    if (!list.empty())
      return invalid_argument("cannot resume: the model differs from the checkpoint's (config.json, checkpoint -> plan): " + list +
                              "; a resumed run must train the same model (to change it, start a new run from the checkpoint's "
                              "weights with --init <step dir>)");
  }
  if (!saved.plan_json.empty()) {
    Json was, now;
    try {
      was = Json::parse(saved.plan_json);
      now = Json::parse(plan.to_json_text());
    } catch (const Json::exception& e) {
      return corrupt("cannot resume: the checkpoint's plan is not valid JSON (" + std::string(e.what()) + ")");
    }
    for (const char* section : {"training", "precision", "optimizer"}) {
      const Json a = was.value(section, Json::object()), b = now.value(section, Json::object());
      std::vector<std::string> keys;
      for (const auto& [k, _] : a.items()) keys.push_back(k);
      for (const auto& [k, _] : b.items())
        if (!a.contains(k)) keys.push_back(k);
      for (const std::string& k : keys) {
        if (std::string(section) == "optimizer" && k == "threads") continue;  // results do not depend on it
        Json va = a.value(k, Json()), vb = b.value(k, Json());
        if (std::string(section) == "training" && k == "grad_accum" && va.is_number_integer() && vb.is_number_integer()) {
          // The step's micro-batches over every rank: N ranks x A resumes as one process x N*A and back.
          const auto ranks = [](const Json& p) {
            const Json par = p.value("parallel", Json::object());
            return par.is_object() && par.value("data_parallel", Json(1)).is_number_integer() ? par.value("data_parallel", Json(1)).get<int64_t>()
                                                                                              : int64_t{1};
          };
          va = va.get<int64_t>() * ranks(was);
          vb = vb.get<int64_t>() * ranks(now);
          if (va != vb) return differs("training.grad_accum x parallel.data_parallel", va.dump(), vb.dump(), "plan");
          continue;
        }
        if (va != vb) return differs(std::string(section) + "." + k, va.dump(), vb.dump(), "plan");
      }
    }
  }
  const DataPosition now = data_position(data);
  const DataPosition& was = saved.data;
  if (was.seq_len != now.seq_len) return differs("data.seq_len", std::to_string(was.seq_len), std::to_string(now.seq_len), "loader");
  if (was.micro_batch != now.micro_batch)
    return differs("data.micro_batch", std::to_string(was.micro_batch), std::to_string(now.micro_batch), "loader");
  if (was.grad_accum != now.grad_accum)
    return differs("data.grad_accum", std::to_string(was.grad_accum), std::to_string(now.grad_accum), "loader");
  if (was.order != now.order) return differs("data.order", was.order, now.order, "loader");
  if (was.seed != now.seed) return differs("data.seed", std::to_string(was.seed), std::to_string(now.seed), "loader");
  if (was.tokens != now.tokens)
    return differs("data.tokens (the token count of the data file)", std::to_string(was.tokens) + " ('" + was.source + "')",
                   std::to_string(now.tokens) + " ('" + now.source + "')", "data given");
  if (!was.fingerprint.empty() && was.fingerprint != now.fingerprint)
    return differs("data.fingerprint (the data's content: same size, other tokens or loss mask)",
                   was.fingerprint + " ('" + was.source + "')", now.fingerprint + " ('" + now.source + "')", "data given");
  return {};
}

}  // namespace megatrain::exec

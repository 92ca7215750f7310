// Training checkpoints: a step directory built in a hidden temporary directory and published by one
// rename (all files and directories fsynced first), a self-checksummed manifest, XXH64 over every
// file, and a loader that verifies everything before it touches the training state.
#include "megatrain/executor/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "megatrain/executor/plane_codec.h"
#include "megatrain/executor/safetensors.h"
#include "megatrain/executor/weights_io.h"

namespace megatrain::exec {
namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// ---- XXH64 (xxHash specification, doc/xxhash_spec.md) ------------------------------------------

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

constexpr uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian host (static_assert in data.cpp)
  return v;
}
uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t xxh_round(uint64_t acc, uint64_t lane) { return rotl64(acc + lane * kP2, 31) * kP1; }
uint64_t xxh_merge(uint64_t acc, uint64_t v) { return (acc ^ xxh_round(0, v)) * kP1 + kP4; }

}  // namespace

Xxh64::Xxh64(uint64_t seed) : acc_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, seed_(seed), buf_{} {}

void Xxh64::update(const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += len;
  if (buffered_ > 0) {
    const size_t take = std::min(len, 32 - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    len -= take;
    if (buffered_ < 32) return;
    for (int i = 0; i < 4; ++i) acc_[i] = xxh_round(acc_[i], read64(buf_ + 8 * i));
    buffered_ = 0;
  }
  uint64_t a0 = acc_[0], a1 = acc_[1], a2 = acc_[2], a3 = acc_[3];
  for (; len >= 32; p += 32, len -= 32) {
    a0 = xxh_round(a0, read64(p));
    a1 = xxh_round(a1, read64(p + 8));
    a2 = xxh_round(a2, read64(p + 16));
    a3 = xxh_round(a3, read64(p + 24));
  }
  acc_[0] = a0, acc_[1] = a1, acc_[2] = a2, acc_[3] = a3;
  std::memcpy(buf_, p, len);
  buffered_ = len;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl64(acc_[0], 1) + rotl64(acc_[1], 7) + rotl64(acc_[2], 12) + rotl64(acc_[3], 18);
    for (uint64_t a : acc_) h = xxh_merge(h, a);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const unsigned char* p = buf_;
  size_t len = buffered_;
  for (; len >= 8; p += 8, len -= 8) h = rotl64(h ^ xxh_round(0, read64(p)), 27) * kP1 + kP4;
  if (len >= 4) {
    h = rotl64(h ^ (static_cast<uint64_t>(read32(p)) * kP1), 23) * kP2 + kP3;
    p += 4;
    len -= 4;
  }
  for (; len > 0; ++p, --len) h = rotl64(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t len, uint64_t seed) {
  Xxh64 x(seed);
  x.update(data, len);
  return x.digest();
}

// ---- files and directories -----------------------------------------------------------------------

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kLatestFile = "latest";
// The manifest ends with this key; its value is the XXH64 of every byte before the comma.
constexpr const char* kTrailer = ",\n  \"manifest_xxh64\": \"";
constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016" PRIx64, v);
  return b;
}

std::string errno_text(int err) { return std::strerror(err); }

Status fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open directory '" + dir.string() + "' to sync it: " + errno_text(errno));
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  if (rc != 0) return io_error("cannot sync directory '" + dir.string() + "': " + errno_text(err));
  return {};
}

// Creates `path` (which must not exist), writes `text`, fsyncs and closes it.
Status write_file_synced(const fs::path& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot create '" + path.string() + "': " + errno_text(errno));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return io_error("cannot write '" + path.string() + "': " + errno_text(err) +
                      (err == ENOSPC ? " (the disk is full)" : ""));
    }
    done += static_cast<size_t>(n);
  }
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    ::close(fd);
    return io_error("cannot flush '" + path.string() + "': " + errno_text(err));
  }
  if (::close(fd) != 0) return io_error("cannot close '" + path.string() + "': " + errno_text(errno));
  return {};
}

struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

// Reads the whole file once: its size and XXH64. A missing file is kNotFound.
Result<FileDigest> digest_file(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return not_found("'" + path.string() + "' is missing");
    return io_error("cannot open '" + path.string() + "': " + errno_text(err));
  }
  std::vector<unsigned char> buf(size_t{4} << 20);
  Xxh64 h;
  FileDigest d;
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return io_error("cannot read '" + path.string() + "': " + errno_text(err));
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<size_t>(n));
    d.bytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  d.xxh64 = h.digest();
  return d;
}

Result<std::string> read_small_file(const fs::path& path, uint64_t limit) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return not_found("'" + path.string() + "' is missing");
    return io_error("cannot open '" + path.string() + "': " + errno_text(err));
  }
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return io_error("cannot read '" + path.string() + "': " + errno_text(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > limit) {
      ::close(fd);
      return corrupt("'" + path.string() + "' is larger than " + std::to_string(limit) + " bytes");
    }
  }
  ::close(fd);
  return out;
}

std::string step_dir_name(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08lld", static_cast<long long>(step));
  return b;
}

// The step of a directory named step-<digits>, or nothing.
std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 18) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// Step directories of `root`, highest step first.
std::vector<std::pair<int64_t, fs::path>> list_step_dirs(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    auto step = parse_step_dir_name(it->path().filename().string());
    std::error_code ec2;
    if (step && it->is_directory(ec2)) out.emplace_back(*step, it->path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

bool process_alive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

// Removes `.step-*.tmp-<pid>`, `.step-*.old-<pid>` and `.latest.tmp-<pid>` entries whose process is
// gone (or is this one: a save of this process is not running while another starts). Best effort.
void remove_stale_temporaries(const fs::path& root) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(".step-", 0) != 0 && name.rfind(".latest.", 0) != 0) continue;
    size_t tag = name.rfind(".tmp-");
    if (const size_t old = name.rfind(".old-"); old != std::string::npos && (tag == std::string::npos || old > tag)) tag = old;
    if (tag == std::string::npos) continue;
    const std::string digits = name.substr(tag + 5);
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid == ::getpid() || !process_alive(pid)) stale.push_back(it->path());
  }
  for (const fs::path& p : stale) fs::remove_all(p, ec);
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

// ---- the optimizer file: Adam's moments in their storage format ---------------------------------

constexpr const char* kMomentSuffix[2] = {".exp_avg", ".exp_avg_sq"};  // m, v (torch AdamW's names)
// fp32 moments stored compressed (SaveOptions::compress_fp32_moments): the entry's suffix and the
// __metadata__ key and value that say so.
constexpr const char* kCompressedSuffix = ".planes_zstd";
constexpr const char* kCompressedKey = "fp32_moments";
constexpr const char* kCompressedValue = "planes_zstd";

// Where tensor `index` of a unit lies in one of its MomentStores: elements, blocks and code bytes
// from the start of the unit's arrays, as MomentStore lays them out (moments.h: every tensor's
// blocks start at its first element, every block takes block_size * bits / 8 bytes of codes).
struct MomentSpan {
  int64_t elem_offset = 0, numel = 0;
  int64_t block_offset = 0, blocks = 0;
  int64_t code_offset = 0, code_bytes = 0;
};

std::vector<MomentSpan> moment_spans(const UnitState& us, const MomentStore& ms) {
  std::vector<MomentSpan> out;
  const int64_t bs = ms.block_size();
  const int64_t block_bytes = bs * state_format_bits(ms.format()) / 8;
  int64_t elems = 0, blocks = 0;
  for (const TensorSlot& t : us.tensors) {
    MomentSpan sp;
    sp.elem_offset = elems;
    sp.numel = t.numel;
    sp.block_offset = blocks;
    sp.blocks = is_quantised(ms.format()) ? (t.numel + bs - 1) / bs : 0;
    sp.code_offset = blocks * block_bytes;
    sp.code_bytes = sp.blocks * block_bytes;
    elems += t.numel;
    blocks += sp.blocks;
    out.push_back(sp);
  }
  return out;
}

// The spans of `ms`, after checking that they cover its arrays exactly (they always do for a
// HostState::create'd state; anything else would make reads and writes run off the arrays).
Result<std::vector<MomentSpan>> checked_spans(const UnitState& us, const MomentStore& ms, int m_or_v) {
  std::vector<MomentSpan> spans = moment_spans(us, ms);
  int64_t elems = 0, blocks = 0, codes = 0;
  for (const MomentSpan& sp : spans) elems += sp.numel, blocks += sp.blocks, codes += sp.code_bytes;
  bool fits = elems == us.numel && ms.numel() == us.numel;
  // array_bytes, not the arrays: a unit on NVMe has none until it is paged in.
  const std::vector<int64_t> arrays = ms.array_bytes();
  switch (ms.format()) {
    case StateFormat::kFp32: fits = fits && arrays.at(0) == 4 * elems; break;
    case StateFormat::kBf16: fits = fits && arrays.at(0) == 2 * elems; break;
    default: fits = fits && arrays.at(0) == codes && arrays.at(1) == 4 * blocks;
  }
  if (!fits)
    return internal_error(std::string("Adam's ") + (m_or_v ? "v" : "m") + " (" + state_format_name(ms.format()) +
                          ") of a unit does not have the layout of its tensors; the state was not built by HostState::create");
  return spans;
}

// The formats the optimizer file keeps m and v in, and their block size.
struct MomentFormats {
  StateFormat m = StateFormat::kFp32, v = StateFormat::kFp32;
  int64_t block_size = 128;
  bool compressed = false;  // fp32 moments stored as planes_zstd (how they are stored, not what they hold)
  bool quantised() const { return is_quantised(m) || is_quantised(v); }
  // Block sizes matter only to quantised formats.
  bool operator==(const MomentFormats& o) const {
    return m == o.m && v == o.v && (!quantised() || block_size == o.block_size);
  }
  std::string text() const {
    std::string t = std::string(state_format_name(m)) + "/" + state_format_name(v);
    if (quantised()) t += " (block " + std::to_string(block_size) + ")";
    return t;
  }
};

MomentFormats formats_of(const HostState& state) {
  MomentFormats f;
  if (state.units().empty()) return f;
  const UnitState& u = state.units()[0];
  f.m = u.m.format();
  f.v = u.v.format();
  f.block_size = u.m.block_size();
  return f;
}

Status write_optimizer(const HostState& state, const fs::path& path, int64_t next_step, const SaveOptions& options) {
  // Moments on NVMe are paged in one unit at a time as the file is written (read-only: nothing
  // is written back).
  auto pager = std::make_shared<UnitPager>(const_cast<HostState&>(state));
  std::vector<TensorToWrite> tensors;
  for (size_t u = 0; u < state.units().size(); ++u) {
    const UnitState& us = state.units()[u];
    std::vector<MomentSpan> spans[2];
    for (int k = 0; k < 2; ++k) {
      MT_ASSIGN_OR_RETURN(spans[k], checked_spans(us, k ? us.v : us.m, k));
    }
    for (size_t i = 0; i < us.tensors.size(); ++i) {
      const TensorSlot& t = us.tensors[i];
      for (int k = 0; k < 2; ++k) {
        const StateFormat format = (k ? us.v : us.m).format();
        const MomentSpan sp = spans[k][i];
        const std::string name = t.name + kMomentSuffix[k];
        // The bytes of one array of this moment, from the unit as it is now (paged in if need be).
        auto at = [&state, pager, u, k](int array, int64_t byte_offset) -> std::function<Result<const void*>()> {
          return [&state, pager, u, k, array, byte_offset]() -> Result<const void*> {
            if (state.states_on_nvme()) MT_RETURN_IF_ERROR(pager->get(static_cast<int64_t>(u)).status());
            const MomentStore& ms = k ? state.units()[u].v : state.units()[u].m;
            const void* base = ms.format() == StateFormat::kFp32   ? static_cast<const void*>(ms.f32().data())
                               : ms.format() == StateFormat::kBf16 ? static_cast<const void*>(ms.bf16().data())
                               : array == 0                        ? static_cast<const void*>(ms.codes().data())
                                                                   : static_cast<const void*>(ms.scales().data());
            return static_cast<const void*>(static_cast<const uint8_t*>(base) + byte_offset);
          };
        };
        switch (format) {
          case StateFormat::kFp32: {
            if (options.compress_fp32_moments) {  // compressed just before it is written
              TensorToWrite w = raw_tensor(name + kCompressedSuffix, {}, nullptr, "U8");
              w.max_bytes = compress_fp32_bound(sp.numel);
              w.produce = [fetch = at(0, 4 * sp.elem_offset), n = sp.numel, options]() -> Result<std::vector<uint8_t>> {
                MT_ASSIGN_OR_RETURN(const void* p, fetch());
                return compress_fp32(static_cast<const float*>(p), n, options.zstd_level, PlaneSplit::kBytePlanes,
                                     options.threads);
              };
              tensors.push_back(std::move(w));
              break;
            }
            TensorToWrite w{name, t.shape, nullptr, DType::kFp32, DType::kFp32};
            w.fetch = at(0, 4 * sp.elem_offset);
            tensors.push_back(std::move(w));
            break;
          }
          case StateFormat::kBf16: {  // the bits as they are: equal types are copied, never rounded
            TensorToWrite w{name, t.shape, nullptr, DType::kBf16, DType::kBf16};
            w.fetch = at(0, 2 * sp.elem_offset);
            tensors.push_back(std::move(w));
            break;
          }
          default: {
            TensorToWrite codes = raw_tensor(name + ".codes", {sp.code_bytes}, nullptr, "U8");
            codes.fetch = at(0, sp.code_offset);
            tensors.push_back(std::move(codes));
            TensorToWrite scales{name + ".scales", {sp.blocks}, nullptr, DType::kFp32, DType::kFp32};
            scales.fetch = at(1, 4 * sp.block_offset);
            tensors.push_back(std::move(scales));
          }
        }
      }
    }
  }
  const MomentFormats f = formats_of(state);
  std::map<std::string, std::string> metadata = {
      {"writer", "megatrain"}, {"optimizer", "adamw"}, {"step", std::to_string(next_step)},
      {"m_format", state_format_name(f.m)}, {"v_format", state_format_name(f.v)},
      {"block_size", std::to_string(f.block_size)}};
  if (options.compress_fp32_moments && (f.m == StateFormat::kFp32 || f.v == StateFormat::kFp32))
    metadata[kCompressedKey] = kCompressedValue;
  Status s = write_safetensors(path, tensors, metadata);
  if (options.compress_fp32_moments) release_plane_codec_scratch();  // nothing stays held while training
  Status done = pager->finish();
  return s.ok() ? done : s;
}

Json manifest_json(const CheckpointInfo& info, const std::map<std::string, FileDigest>& files, const std::string& created) {
  Json j = Json::object();
  j["schema"] = kCheckpointSchema;
  j["step"] = info.next_step;
  j["created"] = created;
  j["model"] = {{"name", info.model_name}, {"parameters", info.parameters}};
  Json jf = Json::object();
  for (const auto& [name, d] : files) jf[name] = {{"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}};
  j["files"] = std::move(jf);
  const DataPosition& dp = info.data;
  j["data"] = {{"next_step", info.next_step}, {"next_micro_batch", 0},   {"seq_len", dp.seq_len},
               {"micro_batch", dp.micro_batch}, {"grad_accum", dp.grad_accum}, {"order", dp.order},
               {"seed", dp.seed}, {"source", dp.source}, {"tokens", dp.tokens}};
  j["rng"] = {{"seed", info.seed}};
  j["losses"] = {{"first_step", info.losses_first_step}, {"values", info.losses}};
  j["plan"] = info.plan_json.empty() ? Json(nullptr) : Json::parse(info.plan_json);
  return j;
}

// The manifest as written: the JSON without its last "}", then the trailer with the XXH64 of
// everything before it.
std::string manifest_text(const Json& j) {
  std::string body = j.dump(2);
  body.resize(body.size() - 2);  // drop "\n}"
  return body + kTrailer + hex64(xxh64(body.data(), body.size())) + "\"\n}\n";
}

}  // namespace

fs::path checkpoint_step_dir(const fs::path& checkpoint_dir, int64_t next_step) {
  return checkpoint_dir / step_dir_name(next_step);
}

DataPosition data_position(const DataLoader& loader) {
  const DataLoaderOptions& o = loader.options();
  return DataPosition{o.seq_len, o.micro_batch, o.grad_accum, data_order_name(o.order), o.seed,
                      loader.tokens().name(), loader.tokens().size()};
}

// ---- saving --------------------------------------------------------------------------------------

Status save_checkpoint(const fs::path& checkpoint_dir, const HostState& state, const CheckpointInfo& info,
                       const SaveOptions& options) {
  const std::string name = step_dir_name(info.next_step);
  const std::string what = "cannot save checkpoint " + name + " in '" + checkpoint_dir.string() + "': ";
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
    if (Status s = fsync_dir(parent); !s.ok()) return Status(s.code(), what + s.message());
  }
  remove_stale_temporaries(checkpoint_dir);

  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = checkpoint_dir / ("." + name + ".tmp-" + pid);
  fs::remove_all(tmp, ec);
  if (::mkdir(tmp.c_str(), 0755) != 0) return io_error(what + "cannot create '" + tmp.string() + "': " + errno_text(errno));
  const std::string unchanged = "; earlier checkpoints are unchanged";
  auto fail = [&](const Status& s) {
    std::error_code ec2;
    fs::remove_all(tmp, ec2);
    return Status(s.code(), what + s.message() + unchanged);
  };

  if (Status s = save_weights(state, tmp / kModelFile); !s.ok()) return fail(s);
  if (Status s = write_optimizer(state, tmp / kOptimizerFile, info.next_step, options); !s.ok()) return fail(s);
  std::map<std::string, FileDigest> files;
  for (const char* f : {kModelFile, kOptimizerFile}) {
    auto d = digest_file(tmp / f);
    if (!d.ok()) return fail(d.status());
    files[f] = *d;
  }
  const std::string created = utc_now();
  if (Status s = write_file_synced(tmp / kManifestFile, manifest_text(manifest_json(info, files, created))); !s.ok())
    return fail(s);
  if (Status s = fsync_dir(tmp); !s.ok()) return fail(s);

  // Publish: one rename. An existing step of the same number is swapped out atomically where the
  // filesystem can (RENAME_EXCHANGE), otherwise moved aside just before the rename.
  const fs::path target = checkpoint_dir / name;
  fs::path old;  // what to delete once the new step is in place
  if (fs::exists(target, ec)) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      old = tmp;
    } else {
      const fs::path aside = checkpoint_dir / ("." + name + ".old-" + pid);
      fs::remove_all(aside, ec);
      if (::rename(target.c_str(), aside.c_str()) != 0)
        return fail(io_error("cannot move the existing '" + target.string() + "' aside: " + errno_text(errno)));
      if (::rename(tmp.c_str(), target.c_str()) != 0) {
        const int err = errno;
        if (::rename(aside.c_str(), target.c_str()) != 0)
          return io_error(what + "cannot rename '" + tmp.string() + "' to '" + target.string() + "': " + errno_text(err) +
                          ", and the previous " + name + " is left at '" + aside.string() + "'");
        return fail(io_error("cannot rename '" + tmp.string() + "' to '" + target.string() + "': " + errno_text(err)));
      }
      old = aside;
    }
  } else if (::rename(tmp.c_str(), target.c_str()) != 0) {
    return fail(io_error("cannot rename '" + tmp.string() + "' to '" + target.string() + "': " + errno_text(errno)));
  }
  const std::string published = "checkpoint '" + target.string() + "' is complete, but ";
  if (Status s = fsync_dir(checkpoint_dir); !s.ok()) return io_error(published + s.message());
  if (!old.empty()) fs::remove_all(old, ec);

  // `latest` names the newest step: a temporary file, fsync, rename, fsync of the directory.
  const fs::path latest_tmp = checkpoint_dir / (".latest.tmp-" + pid);
  fs::remove(latest_tmp, ec);
  if (Status s = write_file_synced(latest_tmp, name + "\n"); !s.ok()) {
    fs::remove(latest_tmp, ec);
    return io_error(published + "'latest' was not updated: " + s.message());
  }
  if (::rename(latest_tmp.c_str(), (checkpoint_dir / kLatestFile).c_str()) != 0) {
    const int err = errno;
    fs::remove(latest_tmp, ec);
    return io_error(published + "'latest' was not updated: " + errno_text(err));
  }
  if (Status s = fsync_dir(checkpoint_dir); !s.ok()) return io_error(published + s.message());
  return {};
}

// ---- loading -------------------------------------------------------------------------------------

namespace {

// A step directory whose files have all been verified, with its files open.
struct Verified {
  fs::path dir;
  CheckpointInfo info;
  bool compressed = false;  // fp32 moments stored as planes_zstd
  std::optional<SafetensorsFile> model, optimizer;
};

Result<CheckpointInfo> parse_manifest(const fs::path& dir) {
  const fs::path mpath = dir / kManifestFile;
  auto text = read_small_file(mpath, kMaxManifestBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound)
      return corrupt("'" + mpath.string() + "' is missing; '" + dir.string() + "' is not a complete checkpoint");
    return text.status();
  }
  const std::string& t = *text;
  const std::string where = "'" + mpath.string() + "': ";
  const size_t at = t.rfind(kTrailer);
  const std::string tail_end = "\"\n}\n";
  const size_t trailer_len = std::strlen(kTrailer);
  if (at == std::string::npos || t.size() != at + trailer_len + 16 + tail_end.size() ||
      t.compare(at + trailer_len + 16, tail_end.size(), tail_end) != 0)
    return corrupt(where + "the checksum trailer (\"manifest_xxh64\") is missing or damaged; the file is truncated or altered");
  const std::string stored = t.substr(at + trailer_len, 16);
  const std::string computed = hex64(xxh64(t.data(), at));
  if (stored != computed)
    return corrupt(where + "checksum mismatch: the content hashes to " + computed + ", the manifest says " + stored +
                   "; the file was altered or damaged");
  Json j;
  try {
    j = Json::parse(t);
  } catch (const Json::exception& e) {
    return corrupt(where + "not valid JSON (" + std::string(e.what()) + ")");
  }
  const std::string schema = j.value("schema", std::string());
  if (schema != kCheckpointSchema) {
    if (schema.rfind("megatrain.checkpoint/", 0) == 0)
      return unsupported(where + "schema '" + schema + "' is not supported; accepted: " + kCheckpointSchema);
    return corrupt(where + "schema '" + schema + "' is not " + kCheckpointSchema);
  }
  CheckpointInfo info;
  int64_t data_step = -1;
  try {
    info.next_step = j.at("step").get<int64_t>();
    info.created = j.value("created", std::string());
    info.model_name = j.at("model").at("name").get<std::string>();
    info.parameters = j.at("model").at("parameters").get<int64_t>();
    const Json& d = j.at("data");
    data_step = d.at("next_step").get<int64_t>();
    if (d.at("next_micro_batch").get<int64_t>() != 0)
      return corrupt(where + "data.next_micro_batch is not 0; checkpoints are taken between steps");
    info.data = DataPosition{d.at("seq_len").get<int64_t>(),
                             d.at("micro_batch").get<int64_t>(), d.at("grad_accum").get<int64_t>(),
                             d.at("order").get<std::string>(), d.at("seed").get<uint64_t>(),
                             d.at("source").get<std::string>(), d.at("tokens").get<int64_t>()};
    info.seed = j.at("rng").at("seed").get<uint64_t>();
    if (j.contains("losses")) {
      info.losses_first_step = j["losses"].at("first_step").get<int64_t>();
      for (const Json& v : j["losses"].at("values"))
        info.losses.push_back(v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>());
    }
    if (!j.at("plan").is_null()) info.plan_json = j["plan"].dump(2);
    for (const char* f : {kModelFile, kOptimizerFile}) {
      const Json& e = j.at("files").at(f);
      e.at("bytes").get<uint64_t>();
      const std::string h = e.at("xxh64").get<std::string>();
      if (h.size() != 16 || h.find_first_not_of("0123456789abcdef") != std::string::npos)
        return corrupt(where + "files." + f + ".xxh64 is not 16 lower-case hex digits");
    }
  } catch (const Json::exception& e) {
    return corrupt(where + "a required field is missing or has the wrong type (" + std::string(e.what()) + ")");
  }
  if (info.next_step < 0 || data_step != info.next_step)
    return corrupt(where + "step " + std::to_string(info.next_step) + " and data.next_step " + std::to_string(data_step) +
                   " disagree");
  if (auto n = parse_step_dir_name(dir.filename().string()); n && *n != info.next_step)
    return corrupt(where + "the directory is named for step " + std::to_string(*n) + " but the manifest says step " +
                   std::to_string(info.next_step));
  // Sizes and checksums of the data files.
  for (const char* f : {kModelFile, kOptimizerFile}) {
    const fs::path p = dir / f;
    const uint64_t bytes = j["files"][f]["bytes"].get<uint64_t>();
    const std::string want = j["files"][f]["xxh64"].get<std::string>();
    auto dg = digest_file(p);
    if (!dg.ok()) {
      if (dg.status().code() == StatusCode::kNotFound)
        return corrupt("'" + p.string() + "' is missing; the manifest lists it");
      return dg.status();
    }
    if (dg->bytes != bytes)
      return corrupt("'" + p.string() + "' " + (dg->bytes < bytes ? "is truncated: " : "has extra bytes: ") +
                     std::to_string(dg->bytes) + " bytes, the manifest says " + std::to_string(bytes));
    if (hex64(dg->xxh64) != want)
      return corrupt("'" + p.string() + "': checksum mismatch: XXH64 " + hex64(dg->xxh64) + ", the manifest says " + want +
                     "; the file is damaged");
  }
  return info;
}

// One tensor a checkpoint file must hold.
struct ExpectedTensor {
  std::string name;
  const char* dtype;
  std::vector<int64_t> shape;
  bool any_length = false;  // a compressed tensor: rank 1, any length
};

std::vector<ExpectedTensor> expected_model_tensors(const HostState& state) {
  std::vector<ExpectedTensor> out;
  for (const UnitState& us : state.units())
    for (const TensorSlot& t : us.tensors) out.push_back({t.name, "F32", t.shape});
  return out;
}

// The optimizer file's tensors for the state's formats: per parameter, m then v; fp32 and bf16 as
// one tensor of the parameter's shape, a quantised format as ".codes" (U8) then ".scales" (F32).
Result<std::vector<ExpectedTensor>> expected_optimizer_tensors(const HostState& state, bool compressed) {
  std::vector<ExpectedTensor> out;
  for (const UnitState& us : state.units()) {
    const MomentStore* stores[2] = {&us.m, &us.v};
    std::vector<MomentSpan> spans[2];
    for (int k = 0; k < 2; ++k) {
      MT_ASSIGN_OR_RETURN(spans[k], checked_spans(us, *stores[k], k));
    }
    for (size_t i = 0; i < us.tensors.size(); ++i) {
      for (int k = 0; k < 2; ++k) {
        const std::string name = us.tensors[i].name + kMomentSuffix[k];
        switch (stores[k]->format()) {
          case StateFormat::kFp32:
            if (compressed) out.push_back({name + kCompressedSuffix, "U8", {}, true});
            else out.push_back({name, "F32", us.tensors[i].shape});
            break;
          case StateFormat::kBf16: out.push_back({name, "BF16", us.tensors[i].shape}); break;
          default:
            out.push_back({name + ".codes", "U8", {spans[k][i].code_bytes}});
            out.push_back({name + ".scales", "F32", {spans[k][i].blocks}});
        }
      }
    }
  }
  return out;
}

// Every tensor the state needs, present with its dtype and shape, and nothing else.
Status check_tensors(const SafetensorsFile& f, const std::vector<ExpectedTensor>& expected, const CheckpointInfo& info) {
  const std::string where = "'" + f.path().string() + "' (a checkpoint of model '" + info.model_name + "'): ";
  auto text = [](const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  };
  for (const ExpectedTensor& x : expected) {
    const SafetensorsEntry* e = f.find(x.name);
    if (!e) return invalid_argument(where + "tensor " + x.name + " is missing; is this checkpoint of another model?");
    if (e->dtype != x.dtype) return corrupt(where + "tensor " + x.name + " is " + e->dtype + ", expected " + x.dtype);
    if (x.any_length) {
      if (e->shape.size() != 1) return corrupt(where + "tensor " + x.name + " is not one-dimensional");
      continue;
    }
    if (e->shape != x.shape)
      return invalid_argument(where + "tensor " + x.name + " has shape " + text(e->shape) + ", the model needs " +
                              text(x.shape) + "; is this checkpoint of another model?");
  }
  if (f.entries().size() != expected.size())
    return invalid_argument(where + "it holds " + std::to_string(f.entries().size()) + " tensors, the model has " +
                            std::to_string(expected.size()) + "; is this checkpoint of another model?");
  return {};
}

// The formats recorded in the optimizer file's __metadata__; a file without them predates the
// storage formats and holds fp32 moments.
Result<MomentFormats> formats_in(const SafetensorsFile& f) {
  const auto& md = f.metadata();
  MomentFormats out;
  const bool any = md.count("m_format") || md.count("v_format") || md.count("block_size");
  const std::string where = "'" + f.path().string() + "': __metadata__.";
  if (auto c = md.find(kCompressedKey); c != md.end()) {
    if (c->second != kCompressedValue)
      return corrupt(where + kCompressedKey + " is '" + c->second + "'; this build reads '" + kCompressedValue + "'");
    if (!any) return corrupt(where + kCompressedKey + " is set but the optimizer formats are not recorded");
    out.compressed = true;
  }
  if (!any) return out;
  for (const char* key : {"m_format", "v_format", "block_size"})
    if (!md.count(key)) return corrupt(where + key + " is missing while the other optimizer formats are recorded");
  using Field = std::pair<const char*, StateFormat*>;
  for (const auto& [key, dst] : {Field{"m_format", &out.m}, Field{"v_format", &out.v}}) {
    auto fmt = parse_state_format(md.at(key));
    if (!fmt.ok()) return corrupt(where + key + " is '" + md.at(key) + "'; expected fp32, bf16, q8, q4, q3 or q2");
    *dst = *fmt;
  }
  const std::string& bs = md.at("block_size");
  int64_t b = 0;
  bool ok = !bs.empty() && bs.size() <= 9 && bs.find_first_not_of("0123456789") == std::string::npos;
  if (ok) b = std::stoll(bs);
  if (!ok || b < 1) return corrupt(where + "block_size is '" + bs + "'; expected a positive integer");
  out.block_size = b;
  return out;
}

Result<Verified> verify_step_dir(const fs::path& dir, const HostState& state) {
  Verified v;
  v.dir = dir;
  MT_ASSIGN_OR_RETURN(v.info, parse_manifest(dir));
  MT_ASSIGN_OR_RETURN(SafetensorsFile model, SafetensorsFile::open(dir / kModelFile));
  MT_ASSIGN_OR_RETURN(SafetensorsFile optimizer, SafetensorsFile::open(dir / kOptimizerFile));
  MT_RETURN_IF_ERROR(check_tensors(model, expected_model_tensors(state), v.info));
  MT_ASSIGN_OR_RETURN(const MomentFormats saved, formats_in(optimizer));
  const MomentFormats now = formats_of(state);
  if (!(saved == now))
    return invalid_argument("'" + optimizer.path().string() + "': the checkpoint keeps m/v in " + saved.text() +
                            ", this run's plan says " + now.text() +
                            "; accepted: resume with the plan the checkpoint was written with (optimizer.m_format, "
                            "optimizer.v_format, optimizer.block_size)");
  MT_ASSIGN_OR_RETURN(const std::vector<ExpectedTensor> opt_tensors, expected_optimizer_tensors(state, saved.compressed));
  MT_RETURN_IF_ERROR(check_tensors(optimizer, opt_tensors, v.info));
  v.compressed = saved.compressed;
  v.model.emplace(std::move(model));
  v.optimizer.emplace(std::move(optimizer));
  return v;
}

Status apply(const Verified& v, HostState& state) {
  auto incomplete = [](const Status& s) {
    return Status(s.code(), s.message() + "; the training state is incomplete and must not be used");
  };
  const SafetensorsFile& model = *v.model;
  const SafetensorsFile& opt = *v.optimizer;
  // A unit on NVMe is paged in zero-filled, set from the files and written back.
  UnitPager pager(state);
  for (size_t u = 0; u < state.units().size(); ++u) {
    MT_ASSIGN_OR_RETURN(UnitState * paged, pager.get(static_cast<int64_t>(u), true));
    UnitState& us = *paged;
    MomentStore* stores[2] = {&us.m, &us.v};
    std::vector<MomentSpan> spans[2];
    for (int k = 0; k < 2; ++k) {
      MT_ASSIGN_OR_RETURN(spans[k], checked_spans(us, *stores[k], k));
    }
    for (size_t i = 0; i < us.tensors.size(); ++i) {
      const TensorSlot& t = us.tensors[i];
      if (Status s = model.read_fp32(*model.find(t.name), us.master.data() + t.offset, t.numel); !s.ok())
        return incomplete(s);
      for (int k = 0; k < 2; ++k) {
        MomentStore& ms = *stores[k];
        const MomentSpan& sp = spans[k][i];
        const std::string name = t.name + kMomentSuffix[k];
        Status s;
        switch (ms.format()) {
          case StateFormat::kFp32:
            if (v.compressed) {
              const SafetensorsEntry& e = *opt.find(name + kCompressedSuffix);
              std::vector<uint8_t> bytes(static_cast<size_t>(e.end - e.begin));
              s = opt.read_raw(e, "U8", bytes.data(), bytes.size());
              if (s.ok()) s = decompress_fp32(bytes, ms.f32().data() + sp.elem_offset, sp.numel);
              if (!s.ok()) s = corrupt("'" + opt.path().string() + "': tensor " + e.name + ": " + s.message());
              break;
            }
            s = opt.read_raw(*opt.find(name), "F32", ms.f32().data() + sp.elem_offset, static_cast<size_t>(sp.numel) * 4);
            break;
          case StateFormat::kBf16:
            s = opt.read_raw(*opt.find(name), "BF16", ms.bf16().data() + sp.elem_offset, static_cast<size_t>(sp.numel) * 2);
            break;
          default:
            s = opt.read_raw(*opt.find(name + ".codes"), "U8", ms.codes().data() + sp.code_offset,
                             static_cast<size_t>(sp.code_bytes));
            if (s.ok())
              s = opt.read_raw(*opt.find(name + ".scales"), "F32", ms.scales().data() + sp.block_offset,
                               static_cast<size_t>(sp.blocks) * 4);
        }
        if (!s.ok()) return incomplete(s);
      }
    }
  }
  if (Status s = pager.finish(); !s.ok()) return incomplete(s);
  if (Status s = state.refresh_stream(); !s.ok()) return incomplete(s);
  return {};
}

// The newest step directory of `root`: the one `latest` names when that is a directory, otherwise
// the highest-numbered step-* directory.
Result<fs::path> newest_step_dir(const fs::path& root) {
  auto latest = read_small_file(root / kLatestFile, 4096);
  if (latest.ok()) {
    std::string name = *latest;
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
    std::error_code ec;
    if (parse_step_dir_name(name) && fs::is_directory(root / name, ec)) return root / name;
  }
  auto dirs = list_step_dirs(root);
  if (dirs.empty())
    return not_found("no checkpoint in '" + root.string() + "' (no 'latest' file naming a step directory, no step-* directory)");
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
  if (!step_dir) {
    MT_ASSIGN_OR_RETURN(dir, newest_step_dir(path));
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
  return LoadedCheckpoint{dir, std::move(v->info)};
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
        const Json va = a.value(k, Json()), vb = b.value(k, Json());
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
  return {};
}

}  // namespace megatrain::exec

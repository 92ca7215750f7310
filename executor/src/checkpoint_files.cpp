// The layout of a checkpoint directory: step directory names, small files read whole, and the
// temporaries a dead saver left behind; see detail/checkpoint_files.h.
#include "detail/checkpoint_files.h"
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace megatrain::exec::detail {
namespace fs = std::filesystem;

std::string errno_text(int err) { return std::strerror(err); }

Result<std::string> read_small_file(const fs::path& path, uint64_t limit) {
  int fd = file_io().open(path.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return not_found("'" + path.string() + "' is missing");
    return io_error("cannot open '" + path.string() + "': " + errno_text(err));
  }
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = file_io().read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      file_io().close(fd);
      return io_error("cannot read '" + path.string() + "': " + errno_text(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > limit) {
      file_io().close(fd);
      return corrupt("'" + path.string() + "' is larger than " + std::to_string(limit) + " bytes");
    }
  }
  file_io().close(fd);
  return out;
}

std::string optimizer_file_name(int64_t shard, int64_t shards) {
  if (shards <= 1) return kOptimizerFile;
  char b[64];
  std::snprintf(b, sizeof b, "optimizer-%05lld-of-%05lld.safetensors", static_cast<long long>(shard), static_cast<long long>(shards));
  return b;
}

std::string step_dir_name(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08lld", static_cast<long long>(step));
  return b;
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 18) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

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

namespace {
bool process_alive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }
}  // namespace

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

}  // namespace megatrain::exec::detail

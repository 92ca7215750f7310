// check_output: refuse an output path before the work, naming the path and the reason.
#include "megatrain/core/output_path.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace megatrain {
namespace {

namespace fs = std::filesystem;

std::string prefix(const std::string& flag, const fs::path& path) {
  return flag.empty() ? path.string() : flag + " " + path.string();
}

// Creates and removes a uniquely named file in `folder`; empty when that worked, else the reason
// (strerror of the failure). A file, not access(2): access ignores read-only mounts for root.
std::string probe_folder(const fs::path& folder) {
  std::string name = (folder / ".megatrain-write-probe-XXXXXX").string();
  std::vector<char> buf(name.begin(), name.end());
  buf.push_back('\0');
  const int fd = ::mkstemp(buf.data());
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(buf.data());
  return {};
}

Status check_folder(const std::string& flag, const fs::path& path, bool create) {
  const std::string what = prefix(flag, path);
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) return invalid_argument(what + ": exists and is not a folder");
  } else if (!create) {
    return not_found(what + ": the folder does not exist");
  } else if (!fs::create_directories(path, ec) && ec) {
    return io_error(what + ": the folder could not be created (" + ec.message() + ")");
  }
  if (std::string why = probe_folder(path); !why.empty()) return io_error(what + ": not writable (" + why + ")");
  return {};
}

Status check_file(const std::string& flag, const fs::path& path) {
  const std::string what = prefix(flag, path);
  std::error_code ec;
  if (fs::is_directory(path, ec)) return invalid_argument(what + ": is a folder; accepted: a file path");
  if (!path.has_filename()) return invalid_argument(what + ": names a folder (ends in /); accepted: a file path");
  const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const fs::file_status st = fs::status(parent, ec);
  if (!fs::exists(st)) return not_found(what + ": the folder " + parent.string() + " does not exist");
  if (!fs::is_directory(st)) return invalid_argument(what + ": " + parent.string() + " is not a folder");
  if (std::string why = probe_folder(parent); !why.empty())
    return io_error(what + ": the folder " + parent.string() + " is not writable (" + why + ")");
  return {};
}

}  // namespace

Status check_output(const std::string& flag, const std::filesystem::path& path, OutputKind kind) {
  if (path.empty()) return invalid_argument((flag.empty() ? std::string("the output") : flag) + ": the path is empty");
  switch (kind) {
    case OutputKind::kFile: return check_file(flag, path);
    case OutputKind::kFolder: return check_folder(flag, path, true);
    case OutputKind::kExistingFolder: return check_folder(flag, path, false);
  }
  return internal_error("check_output: unknown OutputKind");
}

}  // namespace megatrain

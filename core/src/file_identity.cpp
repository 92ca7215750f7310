// File identities (file_identity.h).
#include "megatrain/core/file_identity.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

namespace megatrain {

namespace {
FileIdentity identity_of(const struct stat& st) {
  return FileIdentity{static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}
}  // namespace

Result<FileIdentity> file_identity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return io_error("cannot stat '" + path + "': " + std::strerror(errno));
  return identity_of(st);
}

Result<FileIdentity> file_identity(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return io_error(std::string("cannot stat an open file: ") + std::strerror(errno));
  return identity_of(st);
}

Status check_file_unchanged(const std::string& path, const FileIdentity& was) {
  if (was.bytes < 0) return {};
  auto now = file_identity(path);
  if (!now.ok())
    return io_error("the data file '" + path + "' changed during the run: it is gone or unreadable now (" + now.status().message() + ")");
  if (now->bytes == was.bytes && now->modified_ns == was.modified_ns) return {};
  return io_error("the data file '" + path + "' changed during the run (" + std::to_string(was.bytes) + " bytes when opened, " +
                  std::to_string(now->bytes) + (now->bytes == was.bytes ? " now, rewritten in place" : " now") +
                  "): reading it further could crash the run or train on other data");
}

}  // namespace megatrain

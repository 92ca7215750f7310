// The hex spelling of an XXH64 digest (core/xxh64.h) and the digest of a whole file; see
// detail/checkpoint_hash.h.
#include "detail/checkpoint_hash.h"
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <vector>

#include "megatrain/executor/checkpoint.h"

namespace megatrain::exec {

namespace detail {

namespace fs = std::filesystem;

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016" PRIx64, v);
  return b;
}

Result<FileDigest> digest_file(const fs::path& path) {
  int fd = file_io().open(path.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return not_found("'" + path.string() + "' is missing");
    return io_error("cannot open '" + path.string() + "': " + std::strerror(err));
  }
  std::vector<unsigned char> buf(size_t{4} << 20);
  Xxh64 h;
  FileDigest d;
  for (;;) {
    ssize_t n = file_io().read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      file_io().close(fd);
      return io_error("cannot read '" + path.string() + "': " + std::strerror(err));
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<size_t>(n));
    d.bytes += static_cast<uint64_t>(n);
  }
  file_io().close(fd);
  d.xxh64 = h.digest();
  return d;
}

}  // namespace detail
}  // namespace megatrain::exec

// Durable files (durable_file.h): temporary beside the target, fsync, rename, fsync of the folder,
// with every system call's failure turned into a Status that names the file and the errno text.
#include "megatrain/core/durable_file.h"
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

namespace megatrain {
namespace {

namespace fs = std::filesystem;

std::string errno_text(int err) { return std::strerror(err); }
std::string quoted(const fs::path& p) { return "'" + p.string() + "'"; }

fs::path folder_of(const fs::path& p) {
  fs::path d = p.parent_path();
  return d.empty() ? fs::path(".") : d;
}

constexpr const char* kUnchanged = "; the previous file, if any, is unchanged";

int open_retrying(const fs::path& p, int flags, mode_t mode = 0) {
  int fd;
  do fd = file_io().open(p.c_str(), flags, mode);
  while (fd < 0 && errno == EINTR);
  return fd;
}

int fsync_retrying(int fd) {
  int rc;
  do rc = file_io().fsync(fd);
  while (rc != 0 && errno == EINTR);
  return rc;
}

// Linux releases the descriptor even when close() reports EINTR, and the data was fsynced before,
// so EINTR is no failure here (and retrying could close a descriptor another thread just opened).
bool close_ok(int fd) { return file_io().close(fd) == 0 || errno == EINTR; }

// Why `file` (a temporary for `target`, or `target` itself) could not be created; a folder that is
// missing or is no folder is named as the cause.
Status create_error(const fs::path& file, const fs::path& target, int err) {
  const fs::path dir = folder_of(target);
  std::error_code ec;
  if ((err == ENOENT || err == ENOTDIR) && !fs::is_directory(dir, ec)) {
    if (!fs::exists(dir, ec))
      return not_found("cannot write " + quoted(target) + ": the directory " + quoted(dir) + " does not exist");
    return io_error("cannot write " + quoted(target) + ": " + quoted(dir) + " is not a directory");
  }
  std::string m = "cannot create " + quoted(file);
  if (file != target) m += " to write " + quoted(target);
  return io_error(m + ": " + errno_text(err));
}

// Writes all of `data` at the file offset (offset < 0) or at `offset`, retrying short writes and EINTR.
Status write_fully(int fd, const void* data, size_t bytes, int64_t offset, const fs::path& what, const char* tail) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = offset < 0 ? file_io().write(fd, p + done, bytes - done)
                                 : file_io().pwrite(fd, p + done, bytes - done, offset + static_cast<int64_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return io_error("cannot write " + quoted(what) + ": " + errno_text(err) + (err == ENOSPC ? " (the disk is full)" : "") +
                      tail);
    }
    done += static_cast<size_t>(n);
  }
  return {};
}

Status rename_into_place(const fs::path& tmp, const fs::path& dst) {
  if (file_io().rename(tmp.c_str(), dst.c_str()) != 0)
    return io_error("cannot rename " + quoted(tmp) + " to " + quoted(dst) + ": " + errno_text(errno) + kUnchanged);
  return {};
}

// After the rename: its folder entry must reach the disk too.
Status sync_folder_of(const fs::path& dst) {
  Status s = fsync_path(folder_of(dst), true);
  if (!s.ok()) return io_error("wrote " + quoted(dst) + " but " + s.message());
  return {};
}

}  // namespace

Status fsync_path(const fs::path& path, bool directory) {
  const int fd = open_retrying(path, O_RDONLY | (directory ? O_DIRECTORY : 0) | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open " + quoted(path) + " to sync it: " + errno_text(errno));
  const int rc = fsync_retrying(fd);
  const int err = errno;
  file_io().close(fd);
  // Some filesystems cannot fsync a directory; the rename is then as durable as they allow.
  if (rc != 0 && !(directory && (err == EINVAL || err == ENOTSUP || err == EROFS)))
    return io_error("cannot sync " + std::string(directory ? "the directory " : "") + quoted(path) + ": " + errno_text(err));
  return {};
}

fs::path temp_path_beside(const fs::path& path) {
  static std::atomic<uint64_t> counter{0};
  return folder_of(path) / ("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                            std::to_string(counter.fetch_add(1)));
}

Status publish(const fs::path& tmp, const fs::path& dst) {
  if (Status s = fsync_path(tmp, false); !s.ok()) return io_error(s.message() + kUnchanged);
  MT_RETURN_IF_ERROR(rename_into_place(tmp, dst));
  return sync_folder_of(dst);
}

Status write_new_file(const fs::path& path, std::string_view bytes) {
  const int fd = open_retrying(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return create_error(path, path, errno);
  auto fail = [&](Status s) {
    file_io().unlink(path.c_str());
    return s;
  };
  if (Status s = write_fully(fd, bytes.data(), bytes.size(), -1, path, ""); !s.ok()) {
    file_io().close(fd);
    return fail(s);
  }
  if (fsync_retrying(fd) != 0) {
    const int err = errno;
    file_io().close(fd);
    return fail(io_error("cannot flush " + quoted(path) + " to disk: " + errno_text(err)));
  }
  if (!close_ok(fd)) return fail(io_error("cannot close " + quoted(path) + ": " + errno_text(errno)));
  return {};
}

Status write_file_atomic(const fs::path& path, std::string_view bytes) {
  MT_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::create(path));
  MT_RETURN_IF_ERROR(f.write(bytes.data(), bytes.size()));
  return f.commit();
}

// ---- AtomicFile ----------------------------------------------------------------------------------

Result<AtomicFile> AtomicFile::create(const fs::path& path) {
  if (path.empty() || path.filename().empty())
    return invalid_argument("cannot write " + quoted(path) + ": the path does not name a file");
  fs::path tmp = temp_path_beside(path);
  const int fd = open_retrying(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return create_error(tmp, path, errno);
  return AtomicFile(path, std::move(tmp), fd);
}

AtomicFile::AtomicFile(fs::path path, fs::path tmp, int fd) : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)), tmp_(std::exchange(o.tmp_, {})), fd_(std::exchange(o.fd_, -1)) {}

AtomicFile& AtomicFile::operator=(AtomicFile&& o) noexcept {
  if (this != &o) {
    discard();
    path_ = std::move(o.path_);
    tmp_ = std::exchange(o.tmp_, {});
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

AtomicFile::~AtomicFile() { discard(); }

void AtomicFile::discard() {
  if (fd_ >= 0) file_io().close(std::exchange(fd_, -1));
  if (!tmp_.empty()) file_io().unlink(std::exchange(tmp_, {}).c_str());
}

Status AtomicFile::write(const void* data, size_t bytes) {
  if (fd_ < 0) return internal_error("writing " + quoted(path_) + ": the file was committed or discarded");
  return write_fully(fd_, data, bytes, -1, path_, kUnchanged);
}

Status AtomicFile::write_at(uint64_t offset, const void* data, size_t bytes) {
  if (fd_ < 0) return internal_error("writing " + quoted(path_) + ": the file was committed or discarded");
  return write_fully(fd_, data, bytes, static_cast<int64_t>(offset), path_, kUnchanged);
}

Status AtomicFile::commit() {
  if (fd_ < 0) return internal_error("committing " + quoted(path_) + ": the file was committed or discarded");
  Status s;
  if (fsync_retrying(fd_) != 0)
    s = io_error("cannot flush " + quoted(tmp_) + " to disk: " + errno_text(errno) + kUnchanged);
  const int fd = std::exchange(fd_, -1);
  if (!close_ok(fd) && s.ok()) s = io_error("cannot close " + quoted(tmp_) + ": " + errno_text(errno) + kUnchanged);
  if (s.ok()) s = rename_into_place(tmp_, path_);
  if (!s.ok()) {
    discard();
    return s;
  }
  tmp_.clear();  // renamed: nothing left to remove
  return sync_folder_of(path_);
}

}  // namespace megatrain

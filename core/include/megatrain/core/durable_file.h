// Durable files: a file appears at its path only complete, and a crash just after a successful
// call leaves it there. The one home of "write a temporary file beside the target, fsync it, rename
// it over the target, fsync the directory" for every module (plans, profiles, traces, safetensors,
// checkpoints).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "megatrain/core/status.h"

namespace megatrain {

// fsyncs the file or directory at `path`, retrying on EINTR. A directory whose filesystem cannot
// fsync directories (EINVAL, ENOTSUP, EROFS) is not an error: a rename there is then as durable as
// that filesystem allows. Errors (kIoError) name the path and the errno text.
Status fsync_path(const std::filesystem::path& path, bool directory);

// A fresh name for a temporary file beside `path`: "<folder>/.<name>.tmp-<pid>-<n>", unique within
// this process too, so two writers aimed at one path never share a temporary. Creates nothing.
std::filesystem::path temp_path_beside(const std::filesystem::path& path);

// Publishes the complete file `tmp` as `dst`: fsync `tmp`, rename it over `dst`, fsync the folder
// of `dst` so the rename survives a crash. On failure `tmp` is left for the caller to remove and
// `dst` holds what it held before (unless only the final folder fsync failed: the message then says
// that `dst` was written).
Status publish(const std::filesystem::path& tmp, const std::filesystem::path& dst);

// Creates `path`, which must not exist (O_EXCL), writes `bytes`, fsyncs and closes it. For files
// inside a folder that is itself published later; on failure a file this call created is removed.
Status write_new_file(const std::filesystem::path& path, std::string_view bytes);

// Replaces `path` atomically with `bytes` (AtomicFile: temporary beside it, fsync, rename, fsync of
// the folder). On failure the temporary is gone and a previous file at `path` is unchanged.
Status write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// A file written in pieces that appears at its path only when commit() succeeds. The bytes go to a
// temporary beside the path (temp_path_beside); destroying the object without a successful commit()
// removes the temporary and leaves a previous file at the path as it was. Not thread-safe; movable.
class AtomicFile {
 public:
  // Opens the temporary. A missing folder is kNotFound ("cannot write 'p': the directory 'd' does
  // not exist"), a folder that is not one, or any other failure, kIoError naming both paths.
  static Result<AtomicFile> create(const std::filesystem::path& path);

  AtomicFile(AtomicFile&& o) noexcept;
  AtomicFile& operator=(AtomicFile&& o) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  // Appends all `bytes` (retrying short writes and EINTR).
  Status write(const void* data, size_t bytes);
  // Overwrites bytes already written, at `offset` from the start.
  Status write_at(uint64_t offset, const void* data, size_t bytes);
  // fsync, close, rename over the path, fsync of the folder. Once it returns, nothing is left to
  // clean up, whatever the outcome; a second call is an error.
  Status commit();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& temp_path() const { return tmp_; }

 private:
  AtomicFile(std::filesystem::path path, std::filesystem::path tmp, int fd);
  void discard();

  std::filesystem::path path_, tmp_;
  int fd_ = -1;
};

}  // namespace megatrain

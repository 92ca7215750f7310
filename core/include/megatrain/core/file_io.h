// The system calls of every durable file (durable_file.h), checkpoint, safetensors file and the
// NVMe tier, behind one interface that a test replaces to inject faults, as leveldb tests its
// durability through a replaceable Env. The default forwards to the kernel. Each call returns what
// the system call returns and sets errno as it does, so the callers' error handling is the one
// that runs in production; the fault tests (tests/executor/fault_injection_test.cpp) make fsync,
// rename, reads and writes fail, come back short or torn, fill the disk, or stop as a crash would.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace megatrain {

class FileIo {
 public:
  virtual ~FileIo() = default;
  virtual int open(const char* path, int flags, unsigned mode);
  virtual ssize_t read(int fd, void* buf, size_t n);
  virtual ssize_t pread(int fd, void* buf, size_t n, int64_t offset);
  virtual ssize_t write(int fd, const void* buf, size_t n);
  virtual ssize_t pwrite(int fd, const void* buf, size_t n, int64_t offset);
  virtual int fsync(int fd);
  virtual int close(int fd);
  virtual int rename(const char* from, const char* to);
  // renameat2(RENAME_EXCHANGE): swaps two existing paths atomically.
  virtual int rename_exchange(const char* a, const char* b);
  virtual int mkdir(const char* path, unsigned mode);
  virtual int unlink(const char* path);
  // io_uring: what io_uring_submit_and_wait returned, and each completion's result (`res`, the
  // bytes moved or -errno) for `requested` bytes of `fd`; the default passes them on unchanged.
  virtual int submitted(int rc);
  virtual int completed(int fd, bool write, int res, size_t requested);
};

// The process's FileIo: the kernel's, unless a test installed another.
FileIo& file_io();

// Installs `io` for the process while the guard lives (tests; install it before any I/O starts and
// keep `io` alive longer than the guard).
class ScopedFileIo {
 public:
  explicit ScopedFileIo(FileIo& io);
  ~ScopedFileIo();
  ScopedFileIo(const ScopedFileIo&) = delete;
  ScopedFileIo& operator=(const ScopedFileIo&) = delete;

 private:
  FileIo* previous_;
};

}  // namespace megatrain

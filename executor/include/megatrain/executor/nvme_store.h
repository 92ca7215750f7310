// The NVMe tier's storage engine (ARCHITECTURE.md section 6; issue 9): fixed-size regions (one per
// unit of the training state) in files opened with O_DIRECT, one file per directory (one directory
// per drive), read and written whole through io_uring with up to queue_depth requests in flight.
//
// Layout. The regions are laid end to end in a logical space, each rounded up to whole blocks of
// block_bytes. Logical block k lives in file k % D (D directories) at offset (k / D) * block_bytes,
// so every region is striped over every drive and a whole-region transfer keeps all of them busy.
//
// Integrity. Every block written gets an XXH64 checksum of its bytes (and of its logical block
// number, so a block written to the wrong place is caught too), kept in memory; every block read
// is verified against it. A short read or write, a torn write and a corrupted or truncated file
// are all reported as kCorrupt or kIoError naming the file, the byte offset and the region. A
// block never written reads as zeros without touching the disk (fresh Adam moments are zero).
//
// Fallback. Where io_uring cannot be set up (an old kernel, a seccomp filter), a pool of threads
// does pread/pwrite of the same blocks; engine() says which one runs and why.
//
// The files are scratch: created (or truncated) by create(), removed by the destructor. A run's
// durable copy of this state is a checkpoint (checkpoint.h), never these files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::exec {

struct NvmeStoreOptions {
  std::vector<std::filesystem::path> dirs;  // one per drive; at least one
  int queue_depth = 32;                     // requests in flight per transfer
  int64_t block_bytes = int64_t{1} << 20;   // request size and checksum unit; a multiple of 4096
  std::string file_prefix = "megatrain-state";
  bool force_thread_pool = false;           // use pread/pwrite even where io_uring works (tests, benchmarks)
};

// Buffers given to read/write must be aligned to this (O_DIRECT), and hold region_capacity bytes.
inline constexpr int64_t kNvmeAlignment = 4096;

class NvmeStore {
 public:
  // Checks every directory first (exists, is a directory, writable, O_DIRECT supported, room for
  // its share of the regions); the error names the directory, the problem and what is accepted.
  // Then creates one file per directory and reserves its size (fallocate), so that a disk too
  // small fails here, before training, and not in the middle of a step. If SIGXFSZ has its
  // default action it is set to ignored, so that a file-size limit (RLIMIT_FSIZE) becomes an
  // error this store reports instead of killing the process.
  static Result<std::unique_ptr<NvmeStore>> create(const NvmeStoreOptions& options, const std::vector<int64_t>& region_bytes);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  int64_t regions() const;
  int64_t region_bytes(int64_t r) const;     // as asked for
  int64_t region_capacity(int64_t r) const;  // rounded up to whole blocks: the buffer size to pass
  int64_t block_bytes() const;
  int queue_depth() const;
  int64_t total_bytes() const;               // bytes reserved on all drives together
  const std::vector<std::filesystem::path>& files() const;
  // "io_uring, queue depth 32" or "thread pool (pread/pwrite, 4 threads): io_uring unavailable: ..."
  std::string engine() const;
  bool uses_io_uring() const;

  // Whole-region transfers; blocking, and safe to call from several threads at once (each call
  // has its own ring). `buf` is kNvmeAlignment-aligned and holds region_capacity(r) bytes.
  Status read(int64_t r, void* buf);
  Status write(int64_t r, const void* buf);
  // Forgets what region r holds: it reads as zeros again, with no I/O.
  void reset(int64_t r);

  struct Impl;

 private:
  explicit NvmeStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace megatrain::exec

// The ranks of a data-parallel job (docs/data-parallel.md) and the collectives the trainer needs:
// element-wise sums and maxima across ranks, and a barrier. A process started without mpirun (or a
// build without MPI) is one rank, and every collective is then a no-op, so a single process runs
// exactly as it did before data parallelism existed.
//
// Every rank calls the same collectives in the same order on each channel. Two threads of a rank
// may call at once only on different channels: the caller's thread uses kMain, the thread that
// copies gradients back uses kGradients, the optimizer's thread kOptimizer (each channel is its own
// MPI communicator).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::exec {

enum class Channel { kMain = 0, kGradients = 1, kOptimizer = 2 };
inline constexpr int kChannels = 3;

// Host memory that every rank on a node maps (parallel.host_state shared, docs/data-parallel.md):
// a file in a memory-backed folder (/dev/shm, or MEGATRAIN_SHM_DIR), reserved whole when it is made,
// so that a folder too small is an error naming it then, never a SIGBUS in the middle of a step.
// The file is unlinked once every rank has mapped it (nothing is left behind), and unmapping is
// each rank's own affair (no collective). A single process gets private memory.
class SharedMemory {
 public:
  SharedMemory() = default;
  ~SharedMemory();
  SharedMemory(SharedMemory&& o) noexcept;
  SharedMemory& operator=(SharedMemory&& o) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  void* data() const { return p_; }
  int64_t bytes() const { return bytes_; }
  // Maps `bytes` of the file at `path` (already made and reserved), or anonymous private memory
  // when `path` is empty; `share` is this process's part of aligned_bytes_in_use().
  static Result<SharedMemory> map(const std::string& path, int64_t bytes, int64_t share);
  // Makes and reserves the file (posix_fallocate), or names the folder and its free space.
  static Status make_file(const std::string& path, int64_t bytes);
  // The folder for the files: MEGATRAIN_SHM_DIR, else /dev/shm.
  static std::string folder();

 private:
  void* p_ = nullptr;
  int64_t bytes_ = 0;
  int64_t share_ = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks on this rank's node (MPI's shared-memory split), and this rank's index among them.
  virtual int local_size() const = 0;
  virtual int local_rank() const = 0;
  // This rank's node among the job's (0 .. nodes() - 1, in the order of their lowest world ranks).
  virtual int node() const = 0;
  virtual int nodes() const = 0;
  // "single process" or "MPI (Open MPI 4.1.4), 2 ranks on 1 node".
  virtual std::string description() const = 0;

  // In place: data[i] becomes the sum over ranks of data[i]. For a given rank count the order in
  // which the ranks' values are added does not depend on timing, and every rank gets the same bits.
  virtual Status sum(float* data, int64_t n, Channel channel) = 0;
  virtual Status sum(double* data, int64_t n, Channel channel) = 0;
  virtual Status sum(int64_t* data, int64_t n, Channel channel) = 0;
  // In place: data[i] becomes the largest data[i] of any rank.
  virtual Status max(int64_t* data, int64_t n, Channel channel) = 0;
  // Sharded state (ZeRO): `data` is split into consecutive ranges, counts[r] elements for rank r
  // (counts has size() entries). reduce_to_owners: in place, rank r's range becomes the sum over
  // ranks of that range (the other ranges keep this rank's own values); each range is added up by
  // one reduction to its owner, in an order fixed by the rank count and the size, never by timing.
  // gather_from_owners: every rank's range r becomes rank r's (bytes: counts are in bytes).
  virtual Status reduce_to_owners(float* data, const std::vector<int64_t>& counts, Channel channel) = 0;
  virtual Status gather_from_owners(void* data, const std::vector<int64_t>& byte_counts, Channel channel) = 0;
  virtual Status barrier(Channel channel) = 0;

  // ---- one host state per node (parallel.host_state shared) ---------------------------------------
  // Collective over every rank: each node's ranks get one SharedMemory of `bytes` (the node's first
  // rank makes it, the others map it). Every rank of a node counts bytes / local_size() of it.
  virtual Result<SharedMemory> node_shared_memory(int64_t bytes) = 0;
  // Summed gradients into node-shared memory: `mine` (this rank's values) is split into consecutive
  // ranges, counts[r] elements for the node's rank r (counts has local_size() entries); range r of
  // `shared` becomes the sum over every rank of the job of their range r. The node's rank r adds up
  // its node's values (one reduction into `shared`), then the ranks with local rank r on the other
  // nodes add up their nodes' sums (a fixed-order sum, so every node gets the same bits).
  virtual Status reduce_to_node_owners(const float* mine, float* shared, const std::vector<int64_t>& counts, Channel channel) = 0;
  // In place over this node's ranks only: data[i] becomes the node's sum (fixed order).
  virtual Status node_sum(double* data, int64_t n, Channel channel) = 0;
  virtual Status node_barrier(Channel channel) = 0;
  // A rank that hangs: when this rank has waited `seconds` in one collective, it asks every other
  // rank whether it is alive (a few seconds to answer), names the ranks that did not answer, and
  // ends the job. 0: wait for ever. A no-op with one rank.
  virtual void set_hang_timeout(double seconds) = 0;
  // Ends the whole job at once with `code` (a rank that failed while the others wait in a collective).
  [[noreturn]] virtual void abort_job(int code) = 0;
};

// The process's communicator, made on the first call: MPI's world when this process was started by
// mpirun (or another MPI launcher) and the build has MPI, else one rank. An MPI that cannot start
// is an error naming why.
Result<Communicator*> world_communicator();

// Whether this build can run more than one rank (it was built with MPI), and the MPI library's
// name and version when it was.
bool have_mpi();
std::string mpi_library_version();

// One rank: rank 0 of 1, every collective a no-op (tests, and processes started without mpirun).
std::unique_ptr<Communicator> single_communicator();

}  // namespace megatrain::exec

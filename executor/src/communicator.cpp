// world_communicator (communicator.h): one rank unless this process was started by an MPI launcher
// in a build with MPI (src/mpi/communicator_mpi.cpp).
#include "megatrain/executor/communicator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "megatrain/core/units.h"
#include "megatrain/executor/aligned_array.h"

#include "detail/mpi_world.h"

namespace megatrain::exec {
namespace {

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_size() const override { return 1; }
  int local_rank() const override { return 0; }
  int node() const override { return 0; }
  int nodes() const override { return 1; }
  std::string description() const override { return "single process"; }
  Status sum(float*, int64_t, Channel) override { return {}; }
  Status sum(double*, int64_t, Channel) override { return {}; }
  Status sum(int64_t*, int64_t, Channel) override { return {}; }
  Status max(int64_t*, int64_t, Channel) override { return {}; }
  Status reduce_to_owners(float*, const std::vector<int64_t>&, Channel) override { return {}; }
  Status gather_from_owners(void*, const std::vector<int64_t>&, Channel) override { return {}; }
  Status barrier(Channel) override { return {}; }
  Result<SharedMemory> node_shared_memory(int64_t bytes) override { return SharedMemory::map("", bytes, bytes); }
  Status reduce_to_node_owners(const float* mine, float* shared, const std::vector<int64_t>& counts, Channel) override {
    int64_t n = 0;
    for (int64_t c : counts) n += c;
    if (mine != shared) std::memcpy(shared, mine, sizeof(float) * static_cast<size_t>(n));
    return {};
  }
  Status node_sum(double*, int64_t, Channel) override { return {}; }
  Status node_barrier(Channel) override { return {}; }
  void set_hang_timeout(double) override {}
  [[noreturn]] void abort_job(int code) override { std::_Exit(code); }
};

// The rank and size an MPI launcher gave this process in its environment (Open MPI, PMIx, MPICH's
// PMI), or 0 and 1 when none did.
struct LaunchedAs {
  int rank = 0, size = 1;
};
LaunchedAs launched_as() {
  for (const auto& [r, s] : {std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, std::pair{"PMI_RANK", "PMI_SIZE"},
                              std::pair{"PMIX_RANK", "PMIX_SIZE"}}) {
    const char* rv = std::getenv(r);
    const char* sv = std::getenv(s);
    if (rv && sv) return {std::atoi(rv), std::atoi(sv)};
  }
  return {};
}

}  // namespace

// ---- SharedMemory -----------------------------------------------------------------------------------

SharedMemory::~SharedMemory() {
  if (p_ != nullptr) {
    ::munmap(p_, static_cast<size_t>(bytes_));
    aligned_bytes_in_use() -= share_;
  }
}
SharedMemory::SharedMemory(SharedMemory&& o) noexcept : p_(o.p_), bytes_(o.bytes_), share_(o.share_) {
  o.p_ = nullptr;
  o.bytes_ = o.share_ = 0;
}
SharedMemory& SharedMemory::operator=(SharedMemory&& o) noexcept {
  if (this != &o) {
    this->~SharedMemory();
    p_ = o.p_;
    bytes_ = o.bytes_;
    share_ = o.share_;
    o.p_ = nullptr;
    o.bytes_ = o.share_ = 0;
  }
  return *this;
}

std::string SharedMemory::folder() {
  const char* d = std::getenv("MEGATRAIN_SHM_DIR");
  return d != nullptr && *d != 0 ? d : "/dev/shm";
}

Status SharedMemory::make_file(const std::string& path, int64_t bytes) {
  const std::string dir = path.substr(0, path.find_last_of('/'));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return io_error("cannot make the node's shared training state '" + path + "': " + std::strerror(errno) +
                    "; accepted: a writable memory-backed folder (MEGATRAIN_SHM_DIR, default /dev/shm)");
  const int rc = bytes > 0 ? ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) : 0;
  ::close(fd);
  if (rc != 0) {
    ::unlink(path.c_str());
    struct statvfs st {};
    std::string free_text;
    if (::statvfs(dir.c_str(), &st) == 0)
      free_text = ", which has " + format_bytes(static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize)) + " free";
    return resource_exhausted("the node's shared training state needs " + format_bytes(static_cast<double>(bytes)) + " (" +
                              std::to_string(bytes) + " bytes) in '" + dir + "'" + free_text + ": " + std::strerror(rc) +
                              "; accepted: a larger memory-backed folder (docker run --shm-size, or a tmpfs named by "
                              "MEGATRAIN_SHM_DIR), or parallel.host_state sharded or replicated");
  }
  return {};
}

Result<SharedMemory> SharedMemory::map(const std::string& path, int64_t bytes, int64_t share) {
  SharedMemory m;
  const size_t len = static_cast<size_t>(std::max<int64_t>(bytes, 1));
  void* p = MAP_FAILED;
  if (path.empty()) {
    p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  } else {
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return io_error("cannot open the node's shared training state '" + path + "': " + std::strerror(errno));
    p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
  }
  if (p == MAP_FAILED)
    return resource_exhausted("cannot map " + format_bytes(static_cast<double>(bytes)) + " of the node's shared training state" +
                              (path.empty() ? std::string() : " '" + path + "'") + ": " + std::strerror(errno));
  m.p_ = p;
  m.bytes_ = static_cast<int64_t>(len);
  m.share_ = share;
  aligned_bytes_in_use() += share;
  return m;
}

std::unique_ptr<Communicator> single_communicator() { return std::make_unique<SingleCommunicator>(); }

Result<Communicator*> world_communicator() {
  static std::mutex mu;
  static std::unique_ptr<Communicator> world;
  static Status failed;
  std::lock_guard<std::mutex> g(mu);
  if (world) return world.get();
  if (!failed.ok()) return failed;
  const LaunchedAs l = launched_as();
  if (l.size > 1 || (have_mpi() && std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr)) {
    if (!have_mpi()) {
      failed = unsupported("this process was started by an MPI launcher as rank " + std::to_string(l.rank) + " of " +
                           std::to_string(l.size) + ", but this build has no MPI, so its ranks could not train together; accepted: " +
                           "a build with MPI (install openmpi-bin and libopenmpi-dev, then rebuild), or one process without mpirun");
      return failed;
    }
    auto mpi = detail::mpi_world();
    if (!mpi.ok()) {
      failed = mpi.status();
      return failed;
    }
    world = std::move(*mpi);
  } else {
    world = single_communicator();
  }
  return world.get();
}

#ifndef MEGATRAIN_HAVE_MPI
bool have_mpi() { return false; }
std::string mpi_library_version() { return ""; }
namespace detail {
Result<std::unique_ptr<Communicator>> mpi_world() { return unsupported("this build has no MPI"); }
}  // namespace detail
#endif

}  // namespace megatrain::exec

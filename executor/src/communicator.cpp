// world_communicator (communicator.h): one rank unless this process was started by an MPI launcher
// in a build with MPI (src/mpi/communicator_mpi.cpp).
#include "megatrain/executor/communicator.h"

#include <cstdlib>
#include <mutex>

#include "detail/mpi_world.h"

namespace megatrain::exec {
namespace {

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_size() const override { return 1; }
  int local_rank() const override { return 0; }
  std::string description() const override { return "single process"; }
  Status sum(float*, int64_t, Channel) override { return {}; }
  Status sum(double*, int64_t, Channel) override { return {}; }
  Status sum(int64_t*, int64_t, Channel) override { return {}; }
  Status max(int64_t*, int64_t, Channel) override { return {}; }
  Status reduce_to_owners(float*, const std::vector<int64_t>&, Channel) override { return {}; }
  Status gather_from_owners(void*, const std::vector<int64_t>&, Channel) override { return {}; }
  Status barrier(Channel) override { return {}; }
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

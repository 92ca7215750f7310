// MPI's world as a Communicator (communicator.h, docs/data-parallel.md). Floating-point sums are a
// reduce-scatter (each rank adds up one contiguous share of the elements) followed by an allgather
// of the shares: every element is added up once, by one rank, in an order fixed by the rank count
// and the message size, so every rank gets the same bits and no result depends on timing.
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "detail/mpi_world.h"

namespace megatrain::exec {
namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(std::max(len, 0)));
}

Status mpi_failed(const char* what, int code) {
  return unavailable(std::string("MPI ") + what + " failed: " + mpi_error_text(code) +
                     " (another rank may have stopped; its own message names why)");
}

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() { return MPI_FLOAT; }
template <>
MPI_Datatype mpi_type<double>() { return MPI_DOUBLE; }

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() = default;
  ~MpiCommunicator() override = default;

  Status init() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) return mpi_failed("initialisation (MPI_Init_thread)", rc);
      std::atexit([] {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
      });
      if (provided < MPI_THREAD_MULTIPLE)
        return unsupported("the MPI library gives thread level " + std::to_string(provided) + ", below MPI_THREAD_MULTIPLE (" +
                           std::to_string(MPI_THREAD_MULTIPLE) +
                           "), which the trainer needs (gradients are summed on their own thread); accepted: an MPI built with "
                           "thread support (Debian's Open MPI has it)");
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    for (MPI_Comm& c : channels_) {
      if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c); rc != MPI_SUCCESS) return mpi_failed("MPI_Comm_dup", rc);
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    }
    MPI_Comm node;
    if (int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node); rc != MPI_SUCCESS)
      return mpi_failed("MPI_Comm_split_type", rc);
    MPI_Comm_rank(node, &local_rank_);
    MPI_Comm_size(node, &local_size_);
    int nodes_leader = local_rank_ == 0 ? 1 : 0, nodes = 0;
    MPI_Allreduce(&nodes_leader, &nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    nodes_ = nodes;
    MPI_Comm_free(&node);
    return {};
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_size() const override { return local_size_; }
  int local_rank() const override { return local_rank_; }
  std::string description() const override {
    return "MPI (" + mpi_library_version() + "), " + std::to_string(size_) + " rank" + (size_ == 1 ? "" : "s") + " on " +
           std::to_string(nodes_) + " node" + (nodes_ == 1 ? "" : "s");
  }

  Status sum(float* data, int64_t n, Channel c) override { return float_sum(data, n, c); }
  Status sum(double* data, int64_t n, Channel c) override { return float_sum(data, n, c); }
  Status sum(int64_t* data, int64_t n, Channel c) override { return int_op(data, n, MPI_SUM, c); }
  Status max(int64_t* data, int64_t n, Channel c) override { return int_op(data, n, MPI_MAX, c); }
  Status barrier(Channel c) override {
    if (int rc = MPI_Barrier(comm(c)); rc != MPI_SUCCESS) return mpi_failed("barrier", rc);
    return {};
  }
  [[noreturn]] void abort_job(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  MPI_Comm comm(Channel c) const { return channels_[static_cast<int>(c)]; }

  // A message of at most 2^28 elements at a time, so that every count fits MPI's int.
  static constexpr int64_t kChunk = int64_t{1} << 28;

  template <typename T>
  Status float_sum(T* data, int64_t n, Channel c) {
    if (size_ == 1 || n == 0) return {};
    const int P = size_;
    std::vector<int> counts(static_cast<size_t>(P)), displs(static_cast<size_t>(P));
    std::vector<T> share;
    for (int64_t at = 0; at < n; at += kChunk) {
      const int64_t len = std::min(kChunk, n - at);
      int64_t off = 0;
      for (int r = 0; r < P; ++r) {
        const int64_t cnt = len / P + (r < len % P ? 1 : 0);
        counts[static_cast<size_t>(r)] = static_cast<int>(cnt);
        displs[static_cast<size_t>(r)] = static_cast<int>(off);
        off += cnt;
      }
      share.resize(static_cast<size_t>(std::max(counts[static_cast<size_t>(rank_)], 1)));
      if (int rc = MPI_Reduce_scatter(data + at, share.data(), counts.data(), mpi_type<T>(), MPI_SUM, comm(c)); rc != MPI_SUCCESS)
        return mpi_failed("reduce-scatter", rc);
      if (int rc = MPI_Allgatherv(share.data(), counts[static_cast<size_t>(rank_)], mpi_type<T>(), data + at, counts.data(),
                                  displs.data(), mpi_type<T>(), comm(c));
          rc != MPI_SUCCESS)
        return mpi_failed("allgather", rc);
    }
    return {};
  }

  Status int_op(int64_t* data, int64_t n, MPI_Op op, Channel c) {
    if (size_ == 1 || n == 0) return {};
    for (int64_t at = 0; at < n; at += kChunk) {
      const int len = static_cast<int>(std::min(kChunk, n - at));
      if (int rc = MPI_Allreduce(MPI_IN_PLACE, data + at, len, MPI_INT64_T, op, comm(c)); rc != MPI_SUCCESS)
        return mpi_failed("allreduce", rc);
    }
    return {};
  }

  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, nodes_ = 1;
  MPI_Comm channels_[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
};

}  // namespace

bool have_mpi() { return true; }

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string s(text, static_cast<size_t>(std::max(len, 0)));
  if (const size_t cut = s.find_first_of(",\n"); cut != std::string::npos) s.resize(cut);
  return s;
}

namespace detail {
Result<std::unique_ptr<Communicator>> mpi_world() {
  auto c = std::make_unique<MpiCommunicator>();
  MT_RETURN_IF_ERROR(c->init());
  return std::unique_ptr<Communicator>(std::move(c));
}
}  // namespace detail

}  // namespace megatrain::exec

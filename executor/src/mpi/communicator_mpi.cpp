// MPI's world as a Communicator (communicator.h, docs/data-parallel.md). Floating-point sums are a
// reduce-scatter (each rank adds up one contiguous share of the elements) followed by an allgather
// of the shares: every element is added up once, by one rank, in an order fixed by the rank count
// and the message size, so every rank gets the same bits and no result depends on timing.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

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

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class MpiCommunicator;
MpiCommunicator* g_world = nullptr;  // stopped before MPI_Finalize (the atexit handler)

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() = default;
  ~MpiCommunicator() override { stop_watchdog(); }

  Status init() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) return mpi_failed("initialisation (MPI_Init_thread)", rc);
      std::atexit([] {
        if (g_world != nullptr) g_world->stop_watchdog();
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
    if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &alive_); rc != MPI_SUCCESS) return mpi_failed("MPI_Comm_dup", rc);
    g_world = this;
    MPI_Comm node;
    if (int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node); rc != MPI_SUCCESS)
      return mpi_failed("MPI_Comm_split_type", rc);
    // Tests emulate several nodes on one machine: MEGATRAIN_TEST_RANKS_PER_NODE=k groups each node's
    // ranks k at a time, each group a "node" with its own shared memory (docs/data-parallel.md).
    if (const char* e = std::getenv("MEGATRAIN_TEST_RANKS_PER_NODE"); e != nullptr && std::atoi(e) > 0) {
      int lr = 0;
      MPI_Comm_rank(node, &lr);
      MPI_Comm group;
      if (int rc = MPI_Comm_split(node, lr / std::atoi(e), rank_, &group); rc != MPI_SUCCESS) return mpi_failed("MPI_Comm_split", rc);
      MPI_Comm_free(&node);
      node = group;
    }
    MPI_Comm_rank(node, &local_rank_);
    MPI_Comm_size(node, &local_size_);
    // Nodes are numbered in the order of their first ranks (each node's local rank 0 is its lowest).
    MPI_Comm leaders;
    if (int rc = MPI_Comm_split(MPI_COMM_WORLD, local_rank_ == 0 ? 0 : MPI_UNDEFINED, rank_, &leaders); rc != MPI_SUCCESS)
      return mpi_failed("MPI_Comm_split", rc);
    int where[2] = {0, 1};  // this node's index, the node count
    if (local_rank_ == 0) {
      MPI_Comm_rank(leaders, &where[0]);
      MPI_Comm_size(leaders, &where[1]);
      MPI_Comm_free(&leaders);
    }
    MPI_Bcast(where, 2, MPI_INT, 0, node);
    node_ = where[0];
    nodes_ = where[1];
    for (int c = 0; c < kChannels; ++c) {
      if (int rc = MPI_Comm_dup(node, &node_channels_[c]); rc != MPI_SUCCESS) return mpi_failed("MPI_Comm_dup", rc);
      if (int rc = MPI_Comm_split(MPI_COMM_WORLD, local_rank_, rank_, &cross_channels_[c]); rc != MPI_SUCCESS)
        return mpi_failed("MPI_Comm_split", rc);
      MPI_Comm_set_errhandler(node_channels_[c], MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(cross_channels_[c], MPI_ERRORS_RETURN);
    }
    MPI_Comm_free(&node);
    return {};
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_size() const override { return local_size_; }
  int local_rank() const override { return local_rank_; }
  int node() const override { return node_; }
  int nodes() const override { return nodes_; }
  std::string description() const override {
    return "MPI (" + mpi_library_version() + "), " + std::to_string(size_) + " rank" + (size_ == 1 ? "" : "s") + " on " +
           std::to_string(nodes_) + " node" + (nodes_ == 1 ? "" : "s");
  }

  Status sum(float* data, int64_t n, Channel c) override { return float_sum(data, n, c); }
  Status sum(double* data, int64_t n, Channel c) override { return float_sum(data, n, c); }
  Status sum(int64_t* data, int64_t n, Channel c) override { return int_op(data, n, MPI_SUM, c); }
  Status max(int64_t* data, int64_t n, Channel c) override { return int_op(data, n, MPI_MAX, c); }
  Status reduce_to_owners(float* data, const std::vector<int64_t>& counts, Channel c) override {
    if (size_ == 1) return {};
    if (Status s = check_counts(counts, "reduce_to_owners"); !s.ok()) return s;
    int64_t at = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t n = counts[static_cast<size_t>(r)];
      for (int64_t k = 0; k < n; k += kChunk) {
        const int len = static_cast<int>(std::min(kChunk, n - k));
        float* p = data + at + k;
        const Waiting w(*this, c, "summing a gradient shard for its owner");
        const int rc = r == rank_ ? MPI_Reduce(MPI_IN_PLACE, p, len, MPI_FLOAT, MPI_SUM, r, comm(c))
                                  : MPI_Reduce(p, nullptr, len, MPI_FLOAT, MPI_SUM, r, comm(c));
        if (rc != MPI_SUCCESS) return mpi_failed("reduce", rc);
      }
      at += n;
    }
    return {};
  }
  Status gather_from_owners(void* data, const std::vector<int64_t>& byte_counts, Channel c) override {
    if (size_ == 1) return {};
    if (Status s = check_counts(byte_counts, "gather_from_owners"); !s.ok()) return s;
    auto* bytes = static_cast<uint8_t*>(data);
    int64_t at = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t n = byte_counts[static_cast<size_t>(r)];
      for (int64_t k = 0; k < n; k += kChunk) {
        const int len = static_cast<int>(std::min(kChunk, n - k));
        const Waiting w(*this, c, "gathering updated weights from their owners");
        if (int rc = MPI_Bcast(bytes + at + k, len, MPI_BYTE, r, comm(c)); rc != MPI_SUCCESS) return mpi_failed("broadcast", rc);
      }
      at += n;
    }
    return {};
  }
  Result<SharedMemory> node_shared_memory(int64_t bytes) override {
    // The node's first rank makes and reserves the file; the others learn its name and map it; it is
    // unlinked once all have (the mappings keep it alive, and nothing is left if a rank dies later).
    char path[4096] = {};
    Status made;
    int64_t ok = 1;
    if (local_rank_ == 0) {
      const std::string p = SharedMemory::folder() + "/megatrain-" + std::to_string(::getpid()) + "-" + std::to_string(segments_);
      made = SharedMemory::make_file(p, bytes);
      ok = made.ok() ? 1 : 0;
      std::snprintf(path, sizeof path, "%s", p.c_str());
    }
    ++segments_;
    MPI_Comm node = node_comm(Channel::kMain);
    if (int rc = MPI_Bcast(&ok, 1, MPI_INT64_T, 0, node); rc != MPI_SUCCESS) return mpi_failed("broadcast", rc);
    if (ok == 0)
      return local_rank_ == 0 ? made : unavailable("the first rank of this node could not make the node's shared training state (its message says why)");
    if (int rc = MPI_Bcast(path, sizeof path, MPI_CHAR, 0, node); rc != MPI_SUCCESS) return mpi_failed("broadcast", rc);
    auto mem = SharedMemory::map(path, bytes, bytes / local_size_);
    int64_t mapped = mem.ok() ? 1 : 0;
    if (int rc = MPI_Allreduce(MPI_IN_PLACE, &mapped, 1, MPI_INT64_T, MPI_MIN, node); rc != MPI_SUCCESS) return mpi_failed("allreduce", rc);
    if (local_rank_ == 0) ::unlink(path);
    if (!mem.ok()) return mem.status();
    if (mapped == 0) return unavailable("another rank of this node could not map the node's shared training state (its message says why)");
    return mem;
  }
  Status reduce_to_node_owners(const float* mine, float* shared, const std::vector<int64_t>& counts, Channel c) override {
    if (counts.size() != static_cast<size_t>(local_size_))
      return internal_error("reduce_to_node_owners: " + std::to_string(counts.size()) + " ranges for " + std::to_string(local_size_) + " ranks");
    int64_t at = 0, my_at = 0;
    for (int r = 0; r < local_size_; ++r) {
      const int64_t n = counts[static_cast<size_t>(r)];
      if (r == local_rank_) my_at = at;
      for (int64_t k = 0; k < n; k += kChunk) {
        const int len = static_cast<int>(std::min(kChunk, n - k));
        if (local_size_ == 1) {
          std::memcpy(shared + at + k, mine + at + k, sizeof(float) * static_cast<size_t>(len));
          continue;
        }
        const Waiting w(*this, c, "summing a gradient shard for its owner on the node");
        const int rc = MPI_Reduce(mine + at + k, r == local_rank_ ? shared + at + k : nullptr, len, MPI_FLOAT, MPI_SUM, r, node_comm(c));
        if (rc != MPI_SUCCESS) return mpi_failed("reduce", rc);
      }
      at += n;
    }
    // Across nodes: the ranks that own this range on each node add up their nodes' sums.
    if (nodes_ > 1) return float_sum_in(cross_channels_[static_cast<int>(c)], shared + my_at, counts[static_cast<size_t>(local_rank_)], c);
    return {};
  }
  Status node_sum(double* data, int64_t n, Channel c) override { return float_sum_in(node_comm(c), data, n, c); }
  Status node_barrier(Channel c) override {
    if (local_size_ == 1) return {};
    const Waiting w(*this, c, "a barrier of the node's ranks");
    if (int rc = MPI_Barrier(node_comm(c)); rc != MPI_SUCCESS) return mpi_failed("barrier", rc);
    return {};
  }
  Status barrier(Channel c) override {
    const Waiting w(*this, c, "a barrier");
    if (int rc = MPI_Barrier(comm(c)); rc != MPI_SUCCESS) return mpi_failed("barrier", rc);
    return {};
  }
  void set_hang_timeout(double seconds) override {
    timeout_ns_.store(static_cast<int64_t>(seconds * 1e9));
    if (size_ > 1 && seconds > 0 && !watchdog_.joinable()) watchdog_ = std::thread([this] { watch(); });
  }
  void stop_watchdog() {
    stop_.store(true);
    if (watchdog_.joinable()) watchdog_.join();
  }
  [[noreturn]] void abort_job(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  MPI_Comm comm(Channel c) const { return channels_[static_cast<int>(c)]; }
  MPI_Comm node_comm(Channel c) const { return node_channels_[static_cast<int>(c)]; }
  Status check_counts(const std::vector<int64_t>& counts, const char* what) const {
    if (counts.size() != static_cast<size_t>(size_))
      return internal_error(std::string(what) + ": " + std::to_string(counts.size()) + " ranges for " + std::to_string(size_) + " ranks");
    for (int64_t n : counts)
      if (n < 0) return internal_error(std::string(what) + ": a negative range");
    return {};
  }

  // ---- the hang watchdog -------------------------------------------------------------------------
  // While a collective runs, its channel records since when and what it is; the watchdog thread
  // answers other ranks' "are you alive?" at once (whatever this rank's main threads are doing), and
  // when one of this rank's collectives has waited longer than the timeout it asks the others.
  struct Waiting {
    Waiting(MpiCommunicator& m, Channel c, const char* what) : m_(m), c_(static_cast<int>(c)) {
      m_.what_[c_].store(what);
      m_.since_ns_[c_].store(now_ns());
    }
    ~Waiting() { m_.since_ns_[c_].store(0); }
    MpiCommunicator& m_;
    int c_;
  };
  static constexpr int kPing = 1, kPong = 2;

  // The longest this rank has been waiting in a collective, in ns (0: not waiting), and in what.
  int64_t waited_ns(const char** what) const {
    int64_t most = 0;
    const int64_t t = now_ns();
    for (int c = 0; c < kChannels; ++c)
      if (const int64_t s = since_ns_[c].load(); s > 0 && t - s > most) {
        most = t - s;
        if (what) *what = what_[c].load();
      }
    return most;
  }
  // Answers a ping if one has come (the receive for the next is posted again).
  void serve(MPI_Request& ping, int& ping_buf) {
    int done = 0;
    MPI_Status st;
    MPI_Test(&ping, &done, &st);
    if (!done) return;
    int64_t answer = waited_ns(nullptr);
    MPI_Send(&answer, 1, MPI_INT64_T, st.MPI_SOURCE, kPong, alive_);
    MPI_Irecv(&ping_buf, 1, MPI_INT, MPI_ANY_SOURCE, kPing, alive_, &ping);
  }
  void watch() {
    int ping_buf = 0;
    MPI_Request ping;
    MPI_Irecv(&ping_buf, 1, MPI_INT, MPI_ANY_SOURCE, kPing, alive_, &ping);
    while (!stop_.load()) {
      serve(ping, ping_buf);
      const char* what = "a collective";
      const int64_t limit = timeout_ns_.load();
      if (limit > 0 && waited_ns(&what) > limit) hung(what, ping, ping_buf);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    MPI_Cancel(&ping);
    MPI_Wait(&ping, MPI_STATUS_IGNORE);
  }
  // This rank has waited too long: ask every other rank, 5 s to answer, name the ones that did not,
  // and end the job.
  [[noreturn]] void hung(const char* what, MPI_Request& ping, int& ping_buf) {
    const double waited = static_cast<double>(waited_ns(nullptr)) / 1e9;
    std::vector<MPI_Request> sent, got;
    std::vector<int64_t> answer(static_cast<size_t>(size_), -2);
    int one = 1;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sent.emplace_back();
      MPI_Isend(&one, 1, MPI_INT, r, kPing, alive_, &sent.back());
      got.emplace_back();
      MPI_Irecv(&answer[static_cast<size_t>(r)], 1, MPI_INT64_T, r, kPong, alive_, &got.back());
    }
    const int64_t until = now_ns() + int64_t{5'000'000'000};
    int all = 0;
    while (!all && now_ns() < until) {
      serve(ping, ping_buf);
      MPI_Testall(static_cast<int>(got.size()), got.data(), &all, MPI_STATUSES_IGNORE);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string silent, busy;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const int64_t a = answer[static_cast<size_t>(r)];
      if (a == -2) silent += (silent.empty() ? "" : ", ") + std::to_string(r);
      else if (a == 0) busy += (busy.empty() ? "" : ", ") + std::to_string(r);
    }
    std::string why = "megatrain-exec: rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": waited " +
                      std::to_string(static_cast<int64_t>(waited)) + " s in " + what + " for the other ranks";
    if (!silent.empty()) why += "; rank " + silent + " did not answer within 5 s (stopped, hung, or its node is gone)";
    if (!busy.empty()) why += "; rank " + busy + " answered but has not reached the collective";
    if (silent.empty() && busy.empty()) why += "; every rank answered and is waiting too";
    why += "; ending the job (the newest complete checkpoint stays loadable; --collective-timeout sets the wait)\n";
    std::fputs(why.c_str(), stderr);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

  // A message of at most 2^28 elements at a time, so that every count fits MPI's int.
  static constexpr int64_t kChunk = int64_t{1} << 28;

  template <typename T>
  Status float_sum(T* data, int64_t n, Channel c) { return float_sum_in(comm(c), data, n, c); }
  // The same over the ranks of `group`.
  template <typename T>
  Status float_sum_in(MPI_Comm group, T* data, int64_t n, Channel c) {
    int P = 1, me = 0;
    MPI_Comm_size(group, &P);
    MPI_Comm_rank(group, &me);
    if (P == 1 || n == 0) return {};
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
      share.resize(static_cast<size_t>(std::max(counts[static_cast<size_t>(me)], 1)));
      const Waiting w(*this, c, c == Channel::kGradients ? "summing a gradient" : "a sum");
      if (int rc = MPI_Reduce_scatter(data + at, share.data(), counts.data(), mpi_type<T>(), MPI_SUM, group); rc != MPI_SUCCESS)
        return mpi_failed("reduce-scatter", rc);
      if (int rc = MPI_Allgatherv(share.data(), counts[static_cast<size_t>(me)], mpi_type<T>(), data + at, counts.data(),
                                  displs.data(), mpi_type<T>(), group);
          rc != MPI_SUCCESS)
        return mpi_failed("allgather", rc);
    }
    return {};
  }

  Status int_op(int64_t* data, int64_t n, MPI_Op op, Channel c) {
    if (size_ == 1 || n == 0) return {};
    for (int64_t at = 0; at < n; at += kChunk) {
      const int len = static_cast<int>(std::min(kChunk, n - at));
      const Waiting w(*this, c, op == MPI_MAX ? "agreeing on a stop or a save" : "a sum");
      if (int rc = MPI_Allreduce(MPI_IN_PLACE, data + at, len, MPI_INT64_T, op, comm(c)); rc != MPI_SUCCESS)
        return mpi_failed("allreduce", rc);
    }
    return {};
  }

  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, node_ = 0, nodes_ = 1;
  int64_t segments_ = 0;  // node_shared_memory calls so far (each file's name has its number)
  MPI_Comm channels_[kChannels] = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
  MPI_Comm node_channels_[kChannels] = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};   // this node's ranks
  MPI_Comm cross_channels_[kChannels] = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};  // the same local rank on every node
  MPI_Comm alive_ = MPI_COMM_NULL;  // the watchdog's pings and answers
  std::atomic<int64_t> since_ns_[kChannels] = {0, 0, 0};
  std::atomic<const char*> what_[kChannels] = {nullptr, nullptr, nullptr};
  std::atomic<int64_t> timeout_ns_{0};
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
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

// NcclSum (nccl_sum.h): NCCL's all-reduce on device memory, the library resolved at run time.
#include "nccl_sum.h"

#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

namespace megatrain::exec::cuda_nccl {
namespace {

// The NCCL entry points the sum needs, resolved once from libnccl.so.2.
struct Nccl {
  ncclResult_t (*get_version)(int*) = nullptr;
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
};

Result<const Nccl*> load_nccl() {
  static std::mutex mu;
  static Nccl nccl;
  static std::string failed;
  static bool loaded = false;
  std::lock_guard<std::mutex> g(mu);
  if (loaded) return &nccl;
  if (!failed.empty()) return unavailable(failed);
  void* lib = nullptr;
  std::string tried;
  for (const char* name : {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}) {
    lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* e = ::dlerror();
    tried += std::string(tried.empty() ? "" : "; ") + (e != nullptr ? e : name);
  }
  if (lib == nullptr) {
    failed = "parallel.collective nccl needs NCCL's library, which could not be loaded (" + tried +
             "); accepted: NCCL installed (the CUDA toolkit ships it; LD_LIBRARY_PATH may name its folder), or collective mpi";
    return unavailable(failed);
  }
  auto get = [&](const char* sym, auto& fn) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, sym));
    if (fn == nullptr && failed.empty()) failed = std::string("NCCL's library has no ") + sym + "; accepted: NCCL 2.x";
  };
  get("ncclGetVersion", nccl.get_version);
  get("ncclGetUniqueId", nccl.get_unique_id);
  get("ncclCommInitRank", nccl.comm_init_rank);
  get("ncclAllReduce", nccl.all_reduce);
  get("ncclCommDestroy", nccl.comm_destroy);
  get("ncclGetErrorString", nccl.error_string);
  if (!failed.empty()) return unavailable(failed);
  loaded = true;
  return &nccl;
}

Status nccl_failed(const Nccl& n, const char* what, ncclResult_t r) {
  return unavailable(std::string("NCCL ") + what + " failed: " + n.error_string(r) +
                     " (another rank may have stopped; its own message names why)");
}

class NcclSumImpl final : public NcclSum {
 public:
  NcclSumImpl(const Nccl& n, ncclComm_t c, int ranks) : n_(n), comm_(c), ranks_(ranks) {}
  ~NcclSumImpl() override {
    if (comm_ != nullptr) n_.comm_destroy(comm_);
  }
  Status sum(float* data, int64_t n, cudaStream_t stream) override {
    if (n == 0) return {};
    const ncclResult_t r = n_.all_reduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream);
    if (r != ncclSuccess) return nccl_failed(n_, "all-reduce", r);
    return {};
  }
  std::string description() const override {
    int v = 0;
    n_.get_version(&v);
    return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100) + ", " +
           std::to_string(ranks_) + " rank" + (ranks_ == 1 ? "" : "s");
  }

 private:
  const Nccl& n_;
  ncclComm_t comm_ = nullptr;
  int ranks_ = 1;
};

}  // namespace

Result<std::string> nccl_version() {
  MT_ASSIGN_OR_RETURN(const Nccl* n, load_nccl());
  int v = 0;
  if (ncclResult_t r = n->get_version(&v); r != ncclSuccess) return nccl_failed(*n, "ncclGetVersion", r);
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

Result<std::unique_ptr<NcclSum>> make_nccl_sum(Communicator& comm, int device) {
  // Every rank learns whether NCCL loaded everywhere before any of them waits in NCCL's init.
  auto lib = load_nccl();
  int64_t all = lib.ok() ? 1 : 0;
  MT_RETURN_IF_ERROR(comm.sum(&all, 1, Channel::kMain));
  if (!lib.ok()) return lib.status();
  if (all != comm.size()) return unavailable("NCCL could not be loaded on every rank (the others' messages say why)");
  const Nccl& n = **lib;
  // Rank 0's unique id to every rank (a gather whose only non-empty range is rank 0's).
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  int64_t failed = 0;  // summed: rank 0's verdict reaches every rank
  if (comm.rank() == 0 && n.get_unique_id(&id) != ncclSuccess) failed = 1;
  MT_RETURN_IF_ERROR(comm.sum(&failed, 1, Channel::kMain));
  std::vector<int64_t> bytes(static_cast<size_t>(comm.size()), 0);
  bytes[0] = static_cast<int64_t>(sizeof id);
  MT_RETURN_IF_ERROR(comm.gather_from_owners(&id, bytes, Channel::kMain));
  if (failed != 0) return unavailable("rank 0 could not make NCCL's unique id (ncclGetUniqueId)");
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return unavailable("cudaSetDevice(" + std::to_string(device) + ") for NCCL failed: " + cudaGetErrorString(e));
  ncclComm_t c = nullptr;
  if (ncclResult_t r = n.comm_init_rank(&c, comm.size(), id, comm.rank()); r != ncclSuccess)
    return nccl_failed(n, "communicator initialisation (ncclCommInitRank)", r);
  return std::unique_ptr<NcclSum>(std::make_unique<NcclSumImpl>(n, c, comm.size()));
}

}  // namespace megatrain::exec::cuda_nccl

// The backend table: everything the streamed pipeline asks of a device, and nothing more. The
// shape follows ggml's backend interface: a small virtual table for memory, copies, events and
// the ops, with the scheduling (what runs when, on which stream) kept above it in the trainer, so
// that the CPU backend (the reference) and the CUDA backend run the very same pipeline.
//
// Streams. Three in-order streams: compute, H2D and D2H. The pipeline issues work onto a stream
// from one host thread per stream (the caller's thread for compute, a WorkQueue thread for each
// copy stream), so a stream's work is ordered by issue. A backend either performs the work during
// the call (the CPU backend: its streams are these threads) or enqueues it on its own device
// stream (CUDA) and makes Backend::record / Backend::wait carry the ordering to the device.
//
// Events. An Event is signalled by record(s, e) once the work issued on s before it is complete
// as far as other streams are concerned, and waited on by wait(s, e): work issued on s after the
// wait runs after it. The host part of a wait blocks the issuing thread, which is how a late
// prefetch shows up as a stall of the compute stream.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/model.h"

namespace megatrain::exec {

enum class StreamKind : int { kCompute = 0, kH2D = 1, kD2H = 2 };
constexpr int kStreamCount = 3;
const char* stream_name(StreamKind s);

// A reusable completion flag. signal() wakes every waiter; reset() re-arms it. `native` is the
// backend's own handle for device-side ordering (nullptr on the CPU backend).
class Event {
 public:
  Event() = default;
  explicit Event(bool signalled) : signalled_(signalled) {}
  ~Event() {
    if (native != nullptr && release_native != nullptr) release_native(native);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void signal() {
    {
      std::lock_guard<std::mutex> g(m_);
      signalled_ = true;
    }
    cv_.notify_all();
  }
  void reset() {
    std::lock_guard<std::mutex> g(m_);
    signalled_ = false;
  }
  bool ready() const {
    std::lock_guard<std::mutex> g(m_);
    return signalled_;
  }
  void host_wait() const {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return signalled_; });
  }
  // Created by the backend's first record() and destroyed with the Event.
  void* native = nullptr;
  void (*release_native)(void*) = nullptr;

 private:
  mutable std::mutex m_;
  mutable std::condition_variable cv_;
  bool signalled_ = false;
};

// An in-order queue of host jobs served by its own thread: the issuing thread of a copy stream
// (and of the CPU optimizer).
class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;
  void post(std::function<void()> job);
  // Returns once every job posted so far has run.
  void synchronize();

 private:
  void loop();
  std::mutex m_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false, busy_ = false;
  std::thread thread_;
};

// Device memory: one allocation of the plan's device budget, carved by the pipeline at start-up
// into its buffers. Nothing is allocated on the device after that.
class Arena {
 public:
  Arena(void* base, int64_t capacity_bytes, std::function<void(void*)> release);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  // The next `n` floats, on a buffers::kPipelineCarveAlign (64-byte) boundary. The pipeline sizes the arena first, so running out is
  // a programming error reported with `what` and the byte counts.
  Result<float*> take_floats(int64_t n, const char* what);
  int64_t capacity() const { return capacity_; }
  int64_t used() const { return used_; }
  // The guard against a silent overrun (an accumulator sized for a smaller layer writing into its
  // neighbour): the trainer checks every view it hands a backend, `n` floats from `p` for `use`,
  // against the buffer it was carved as (its requested size, not the rounding). A view that leaves
  // its buffer is a programming error: it aborts with the buffer, both sizes and the use. The
  // check is a search over a few tens of buffers per call, always on.
  void check_view(const float* p, int64_t n, const char* use) const;

 private:
  struct Carve {
    int64_t offset, bytes;
    const char* what;
  };
  char* base_;
  int64_t capacity_, used_ = 0;
  std::vector<Carve> carves_;  // in offset order
  std::function<void(void*)> release_;
};

struct BackendOptions {
  int threads = 1;  // compute threads (CPU backend)
  // The dtype weights are streamed in, and the plan's compute dtype. The CUDA backend computes in
  // bf16 (the mixed-precision path: bf16 GEMM inputs and activations, fp32 accumulation, fp32
  // residual stream and gradients; weights streamed in bf16) or fp32 (the exact path; weights
  // streamed in fp32). The CPU backend computes in fp32 from either transfer dtype.
  DType transfer = DType::kFp32;
  DType compute = DType::kFp32;
  // The most host memory the backend may page-lock (register) for copies; -1: half of physical RAM.
  int64_t pinned_limit_bytes = -1;
  // Which of the visible GPUs (the CUDA backend): a data-parallel rank takes the one of its index
  // among its node's ranks; -1: the first.
  int device = -1;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;      // "cpu", "cuda"
  virtual std::string describe() const = 0;  // one line for the progress header
  const Dims& dims() const { return dims_; }

  // ---- memory
  // The arena: `bytes` of device memory at once.
  virtual Result<std::unique_ptr<Arena>> create_arena(int64_t bytes) = 0;

  // ---- copies, each issued on stream `s` from that stream's issuing thread
  // A unit's weights from the RAM tier into a device buffer, in the layout of UnitState::tensors
  // and the compute dtype (the CPU backend expands a bf16 streaming copy to fp32 on arrival).
  virtual void upload_unit(StreamKind s, const UnitState& unit, DType transfer, float* dst) = 0;
  virtual void copy_to_device(StreamKind s, float* dst, const float* host_src, int64_t n) = 0;
  virtual void copy_to_host(StreamKind s, float* host_dst, const float* src, int64_t n) = 0;
  // host_dst[i] += src[i] in fp32, in index order (microbatch-major gradient accumulation).
  virtual void add_to_host(StreamKind s, float* host_dst, const float* src, int64_t n) = 0;
  virtual void copy_on_device(StreamKind s, float* dst, const float* src, int64_t n) = 0;
  virtual void fill_zero(StreamKind s, float* dst, int64_t n) = 0;

  // ---- ordering
  virtual void record(StreamKind s, Event& e) = 0;
  virtual void wait(StreamKind s, Event& e) = 0;
  // Blocks until all work issued on s is complete (its results may then be read by the host).
  virtual void synchronize(StreamKind s) = 0;

  // ---- ops on the compute stream: the layer templates of model.h, bound to whichever device
  // buffer holds the unit's weights
  virtual Status embed(const float* table, const int32_t* tokens, float* x_out) = 0;
  virtual Status embed_backward(const int32_t* tokens, const float* dx, float* dtable) = 0;
  virtual Status layer_forward(const UnitView& w, const float* x_in, float* x_out, const LayerActs& acts) = 0;
  virtual Status layer_backward(const UnitView& w, const LayerActs& acts, const float* dout, float* dx,
                                const UnitGrad& g, float* workspace) = 0;
  virtual Status head(const float* final_norm, const float* lm_head, const float* x, const int32_t* targets,
                      float grad_scale, float* dx, float* d_final_norm, float* d_lm_head, double* loss_sum,
                      int64_t* count, float* workspace) = 0;
  // dst[i] += src[i] on the device.
  virtual void add(float* dst, const float* src, int64_t n) = 0;

  // Floats of one layer's saved activations for one micro-batch, of its backward temporaries, and
  // of the head's temporaries.
  virtual int64_t layer_act_floats() const = 0;
  virtual int64_t layer_workspace_floats() const = 0;
  virtual int64_t head_workspace_floats() const = 0;

  // ---- layouts: how the backend reads a unit's weights in a device buffer and a layer's saved
  // activations (a backend computing in bf16 keeps both in bf16; the pointers keep the float type
  // of the table and are reinterpreted by that backend). acts.x is always first and fp32.
  virtual UnitView view_weights(const UnitState& layout, const float* block) const { return view_unit(layout, block); }
  virtual LayerActs bind_acts(float* base) const { return bind_layer_acts(dims_, base); }
  // Device bytes the backend keeps for itself inside the arena (library workspaces, token buffers,
  // attention blocks); create_arena(bytes) must be given them on top of the pipeline's buffers.
  virtual int64_t private_bytes() const { return 0; }

  // ---- host memory
  // Page-locks a host buffer that copies read or write (the RAM tier's streamed weights and
  // gradients), within BackendOptions::pinned_limit_bytes; beyond the limit the buffer stays
  // pageable (slower copies), which pinned_report() says. A no-op on the CPU backend.
  virtual Status register_host(void* p, int64_t bytes, const char* what) {
    (void)p, (void)bytes, (void)what;
    return {};
  }
  // One line on pinned host memory ("" when the backend pins nothing).
  virtual std::string pinned_report() const { return ""; }

  // ---- sums between the ranks' devices (parallel.collective nccl, docs/data-parallel.md)
  // Sets them up, collectively over `comm`'s ranks, before the first step; returns a one-line
  // description. The CPU backend has no devices to sum between, and refuses.
  virtual Result<std::string> enable_device_sums(Communicator& comm) {
    (void)comm;
    return unsupported("parallel.collective nccl sums the gradients between GPUs, and the " + name() +
                       " backend has none; accepted here: parallel.collective mpi (through host memory)");
  }
  // In place, issued on stream s: `data` (n floats of device memory) becomes the sum over the
  // ranks. Only after enable_device_sums.
  virtual Status sum_across_ranks(StreamKind s, float* data, int64_t n) {
    (void)s, (void)data, (void)n;
    return internal_error("sum_across_ranks before enable_device_sums");
  }

 protected:
  explicit Backend(const Dims& d) : dims_(d) {}
  Dims dims_;
};

// Why the CUDA backend cannot run here, or an empty string when a CUDA device is usable.
std::string cuda_unavailable_reason();

// "cpu", "cuda" or "auto" (CUDA when a GPU is present and the build has the CUDA training backend,
// else the CPU backend). The backend is bound to the model's shapes for one micro-batch.
Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const ModelSpec& model, const Dims& dims,
                                              const BackendOptions& options);
// The CPU backend: streams are host threads, device memory is an aligned region of host RAM
// bounded by the arena, ops are kernels/cpu (Eigen GEMMs), deterministic for a thread count.
Result<std::unique_ptr<Backend>> make_cpu_backend(const ModelSpec& model, const Dims& dims, const BackendOptions& options);
// The CUDA backend (kernels/cuda, cuBLAS): three CUDA streams with events, the arena in device
// memory, the RAM tier's buffers page-locked within a bound. Only in builds with CUDA.
Result<std::unique_ptr<Backend>> make_cuda_backend(const ModelSpec& model, const Dims& dims, const BackendOptions& options,
                                                   std::vector<float> inv_freq);
// Whether this build has the CUDA training backend.
bool have_cuda_backend();
// Why parallel.collective nccl cannot run here (no NCCL in the build, or its library not found), or
// an empty string when NCCL's library loads.
std::string nccl_unavailable_reason();

}  // namespace megatrain::exec

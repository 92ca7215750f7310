// The CPU backend: the reference implementation of the backend table (backend.h).
//
// Its streams are the pipeline's issuing threads themselves: a copy or an op runs during the call
// on the thread that issues it, so record() can signal at once and wait() is a host wait. Device
// memory is one 64-byte aligned region of host RAM (the arena), and the ops are kernels/cpu with
// GEMMs through Eigen, deterministic for a given thread count.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "megatrain/buffers/buffers.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/bf16.h"
#include "megatrain/executor/communicator.h"
#include "megatrain/kernels/cpu/ops.h"
#if defined(MEGATRAIN_HAVE_CUDA)
#include "megatrain/kernels/cuda_device.h"
#endif

namespace megatrain::exec {

const char* stream_name(StreamKind s) {
  switch (s) {
    case StreamKind::kCompute: return "compute";
    case StreamKind::kH2D: return "h2d";
    case StreamKind::kD2H: return "d2h";
  }
  return "?";
}

WorkQueue::WorkQueue() : thread_([this] { loop(); }) {}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> g(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void WorkQueue::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> g(m_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void WorkQueue::synchronize() {
  std::unique_lock<std::mutex> l(m_);
  idle_cv_.wait(l, [&] { return jobs_.empty() && !busy_; });
}

void WorkQueue::loop() {
  std::unique_lock<std::mutex> l(m_);
  while (true) {
    cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty() && stop_) return;
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    l.unlock();
    job();
    l.lock();
    busy_ = false;
    idle_cv_.notify_all();
  }
}

Arena::Arena(void* base, int64_t capacity_bytes, std::function<void(void*)> release)
    : base_(static_cast<char*>(base)), capacity_(capacity_bytes), release_(std::move(release)) {}

Arena::~Arena() {
  if (release_) release_(base_);
}

Result<float*> Arena::take_floats(int64_t n, const char* what) {
  constexpr int64_t a = buffers::kPipelineCarveAlign;  // the footprint's ActivationLayout::carve_align
  const int64_t bytes = (n * static_cast<int64_t>(sizeof(float)) + a - 1) / a * a;
  if (n < 0 || used_ + bytes > capacity_)
    return internal_error(std::string("device arena: ") + what + " needs " + std::to_string(bytes) + " bytes, but only " +
                          std::to_string(capacity_ - used_) + " of " + std::to_string(capacity_) + " are left");
  float* p = reinterpret_cast<float*>(base_ + used_);
  carves_.push_back({used_, n * static_cast<int64_t>(sizeof(float)), what});
  used_ += bytes;
  return p;
}

void Arena::check_view(const float* p, int64_t n, const char* use) const {
  const int64_t at = reinterpret_cast<const char*>(p) - base_;
  MT_CHECK(p != nullptr && at >= 0 && at < used_, std::string("device arena: ") + use + " is handed a view that is not in the arena");
  // The carve that holds `at`: the last one starting at or before it.
  const auto it = std::upper_bound(carves_.begin(), carves_.end(), at, [](int64_t x, const Carve& c) { return x < c.offset; });
  MT_CHECK(it != carves_.begin(), std::string("device arena: ") + use + " is handed a view before the first buffer");
  const Carve& c = *std::prev(it);
  const int64_t end = at + n * static_cast<int64_t>(sizeof(float));
  MT_CHECK(n >= 0 && end <= c.offset + c.bytes,
           std::string("device arena: ") + use + " is handed " + std::to_string(n) + " floats at byte " +
               std::to_string(at - c.offset) + " of '" + c.what + "', which holds " + std::to_string(c.bytes / 4) +
               " floats: the view overruns its buffer by " + std::to_string((end - c.offset - c.bytes + 3) / 4) + " floats");
}

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Dims& d, int threads, std::vector<float> inv_freq)
      : Backend(d), ctx_(threads), math_(ctx_, d, std::move(inv_freq)) {}

  std::string name() const override { return "cpu"; }
  std::string describe() const override {
    return "CPU backend (" + std::to_string(ctx_.threads()) + " compute thread" + (ctx_.threads() == 1 ? "" : "s") + ")";
  }

  Result<std::unique_ptr<Arena>> create_arena(int64_t bytes) override {
    const size_t rounded = static_cast<size_t>(((std::max<int64_t>(bytes, 1) + 63) / 64) * 64);
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr)
      return resource_exhausted("CPU backend: could not allocate the device arena of " + std::to_string(bytes) +
                                " bytes of host memory");
    std::memset(p, 0, rounded);  // touch every page now, not during the first step
    aligned_bytes_in_use() += static_cast<int64_t>(rounded);
    return std::make_unique<Arena>(p, static_cast<int64_t>(rounded), [rounded](void* q) {
      aligned_bytes_in_use() -= static_cast<int64_t>(rounded);
      std::free(q);
    });
  }

  void upload_unit(StreamKind, const UnitState& unit, DType transfer, float* dst) override {
    if (transfer == DType::kBf16) {
      for (int64_t i = 0; i < unit.numel; ++i) dst[i] = bf16_to_fp32(unit.stream_bf16[i]);
    } else {
      std::memcpy(dst, unit.master.data(), sizeof(float) * static_cast<size_t>(unit.numel));
    }
  }
  void copy_to_device(StreamKind, float* dst, const float* src, int64_t n) override { copy(dst, src, n); }
  void copy_to_host(StreamKind, float* dst, const float* src, int64_t n) override { copy(dst, src, n); }
  void copy_on_device(StreamKind, float* dst, const float* src, int64_t n) override { copy(dst, src, n); }
  void add_to_host(StreamKind, float* dst, const float* src, int64_t n) override {
    for (int64_t k = 0; k < n; ++k) dst[k] += src[k];
  }
  void fill_zero(StreamKind, float* dst, int64_t n) override { std::fill(dst, dst + n, 0.0f); }

  // The work before a record has already run on the recording thread.
  void record(StreamKind, Event& e) override { e.signal(); }
  void wait(StreamKind, Event& e) override { e.host_wait(); }
  void synchronize(StreamKind) override {}

  Status embed(const float* table, const int32_t* tokens, float* x_out) override { return math_.embed(table, tokens, x_out); }
  Status embed_backward(const int32_t* tokens, const float* dx, float* dtable) override {
    return math_.embed_backward(tokens, dx, dtable);
  }
  Status layer_forward(const UnitView& w, const float* x_in, float* x_out, const LayerActs& acts) override {
    return math_.forward(w, x_in, x_out, acts);
  }
  Status layer_backward(const UnitView& w, const LayerActs& acts, const float* dout, float* dx, const UnitGrad& g,
                        float* workspace) override {
    return math_.backward(w, acts, dout, dx, g, workspace);
  }
  Status head(const float* final_norm, const float* lm_head, const float* x, const int32_t* targets, float grad_scale,
              float* dx, float* d_final_norm, float* d_lm_head, double* loss_sum, int64_t* count, float* workspace) override {
    return math_.head(final_norm, lm_head, x, targets, grad_scale, dx, d_final_norm, d_lm_head, loss_sum, count, workspace);
  }
  void add(float* dst, const float* src, int64_t n) override { cpu::accumulate<float>(ctx_, src, n, dst); }

  // parallel.collective nccl sums between GPUs, which this backend has none of. For tests only,
  // MEGATRAIN_CPU_DEVICE_SUMS=mpi makes it sum its "device" gradients over MPI instead (the caller's
  // thread is the stream): the trainer's NCCL path (each unit summed before its copy, and with split
  // states each rank copying its own range) then runs on this machine's ranks, checked against the
  // host sums (docs/data-parallel.md, "Testing the NCCL path without GPUs").
  Result<std::string> enable_device_sums(Communicator& comm) override {
    const char* v = std::getenv("MEGATRAIN_CPU_DEVICE_SUMS");
    if (v == nullptr || std::string(v) != "mpi") return Backend::enable_device_sums(comm);
    device_comm_ = &comm;
    return std::string("the backend's gradients summed before their copy, over MPI (MEGATRAIN_CPU_DEVICE_SUMS=mpi, the CPU "
                       "backend's test stand-in for NCCL)");
  }
  Status sum_across_ranks(StreamKind s, float* data, int64_t n) override {
    if (device_comm_ == nullptr) return Backend::sum_across_ranks(s, data, n);
    return device_comm_->sum(data, n, Channel::kGradients);
  }

  int64_t layer_act_floats() const override { return exec::layer_act_floats(dims_); }
  int64_t layer_workspace_floats() const override { return exec::layer_workspace_floats(dims_); }
  int64_t head_workspace_floats() const override { return exec::head_workspace_floats(dims_); }

 private:
  static void copy(float* dst, const float* src, int64_t n) {
    if (dst != src) std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n));
  }
  cpu::CpuContext ctx_;
  LayerMath math_;
  Communicator* device_comm_ = nullptr;  // MEGATRAIN_CPU_DEVICE_SUMS=mpi
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cpu_backend(const ModelSpec& model, const Dims& dims, const BackendOptions& options) {
  MT_ASSIGN_OR_RETURN(std::vector<float> inv_freq, rope_inv_freq_for<float>(model));
  return std::unique_ptr<Backend>(new CpuBackend(dims, options.threads, std::move(inv_freq)));
}

std::string cuda_unavailable_reason() {
#if defined(MEGATRAIN_HAVE_CUDA)
  auto devices = cuda::list_devices();
  if (!devices.ok()) return devices.status().message();
  if (devices->empty()) return "no CUDA device is visible";
  return "";
#else
  return "this build has no CUDA (configured with MEGATRAIN_CUDA=OFF or without nvcc)";
#endif
}

#if !defined(MEGATRAIN_HAVE_NCCL)
std::string nccl_unavailable_reason() { return "this build has no NCCL (configured without nccl.h or with MEGATRAIN_NCCL=OFF)"; }
#endif

#if !defined(MEGATRAIN_HAVE_CUDA)
bool have_cuda_backend() { return false; }
Result<std::unique_ptr<Backend>> make_cuda_backend(const ModelSpec&, const Dims&, const BackendOptions&, std::vector<float>) {
  return unsupported("this build has no CUDA backend (configured with MEGATRAIN_CUDA=OFF or without nvcc); accepted: "
                     "--backend cpu");
}
#endif

Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const ModelSpec& model, const Dims& dims,
                                              const BackendOptions& options) {
  bool use_cuda = false;
  if (name == "cuda") {
    const std::string why = cuda_unavailable_reason();
    if (!why.empty()) return unavailable("--backend cuda: no usable GPU: " + why + "; accepted here: --backend cpu (or auto)");
    use_cuda = true;
  } else if (name == "auto") {
    use_cuda = have_cuda_backend() && cuda_unavailable_reason().empty();
  } else if (name != "cpu") {
    return invalid_argument("backend '" + name + "' is unknown; accepted: auto, cpu, cuda");
  }
  if (!use_cuda) return make_cpu_backend(model, dims, options);
  // The CUDA backend trains what the CPU backend does, gpt-oss included (attention sinks, per-layer
  // sliding windows, yarn's RoPE factor, biased stacked experts); make_cuda_backend refuses only
  // what its kernels cannot size (experts, slots) and the device.
  MT_ASSIGN_OR_RETURN(std::vector<float> inv_freq, rope_inv_freq_for<float>(model));
  return make_cuda_backend(model, dims, options, std::move(inv_freq));
}

}  // namespace megatrain::exec

// The CUDA backend: the backend table (backend.h) on a GPU, with the ops of kernels/cuda and
// GEMMs on cuBLAS. The pipeline above it (trainer.cpp) is the same as on the CPU backend.
//
// Streams and events. Three CUDA streams (compute, H2D, D2H). record(s, e) records a CUDA event on
// stream s and signals the host Event; wait(s, e) waits for the host signal (the record has been
// issued) and then makes stream s wait for the CUDA event on the device. The pipeline synchronises
// a copy stream after each copy, and every op on the compute stream returns once its kernels are
// done, so the spans the trainer records are the GPU's real busy times: the cost is one host round
// trip per layer (tens of microseconds against milliseconds of layer compute).
//
// Precision. T is the dtype the weights are streamed in. bf16 is the mixed-precision path: weights,
// GEMM inputs and the attention/MLP activations in bf16, fp32 accumulation in every GEMM, and fp32
// for the residual stream (the hidden states between layers), the norms' statistics, the
// log-sum-exp rows and all gradients (accumulated in fp32 on the device, then copied to the fp32
// RAM tier). fp32 is the exact path: everything fp32, no TF32, equal to the CPU backend to rounding.
//
// Memory. One cudaMalloc of the arena at start-up, capped by the plan's device budget: the
// pipeline's buffers, then this backend's private region (the cuBLAS workspace, token buffers, the
// attention blocks). The RAM tier's streamed weights and gradients are page-locked with
// cudaHostRegister up to a limit, counted and reported.
//
// Qwen3's q/k norms: q and k are projected in fp32 (q_pre, k_pre, kept for the backward), each
// head's head_dim is RMS-normalised by the rmsnorm op into T, then RoPE. The backward runs the norm's
// backward in place on dq/dk after RoPE's.
//
// Mixture-of-Experts (Mixtral, Qwen3-MoE; moe_forward/moe_backward below, kernels in cuda/moe.cuh
// and cuda/grouped_gemm.cuh; docs/cuda-backend.md "Mixture-of-Experts"): router GEMM into fp32
// logits, softmax and top-k per token, a stable counting sort of the token slots by expert on the
// device, gather, the three expert projections as one grouped cuBLAS call each, SwiGLU, the
// weighted combine added to the residual; the backward of each in reverse. The per-expert row
// counts go to the host once per layer and direction (cuBLAS takes grouped shapes from host
// arrays): one small device-to-host copy and a stream synchronisation.
//
// gpt-oss (docs/cuda-backend.md "gpt-oss"): each layer's sliding window (UnitView::layer, set by
// view_weights) narrows the attention's key blocks; the sinks join each row's softmax and lse, their
// gradient a per-head fixed-order sum; RoPE's cos/sin times Dims::rope_scale; o_proj and router
// biases on the fp32 residual and logits; the stacked experts [E, in, out] as grouped x @ W calls
// whose initial C is the experts' biases, the clamped SwiGLU on the interleaved gate_up (one
// buffer), and the biases' gradients summed over each expert's rows in order.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cuda/attention.cuh"
#include "cuda/cast.cuh"
#include "cuda/cross_entropy.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/embedding.cuh"
#include "cuda/gemm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/reduce.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/swiglu.cuh"
#include "megatrain/buffers/buffers.h"
#include "megatrain/buffers/cuda_attention.h"
#include "megatrain/core/units.h"
#include "megatrain/executor/backend.h"
#include "megatrain/kernels/cuda_device.h"

#ifdef MEGATRAIN_HAVE_NCCL
#include "nccl_sum.h"
#endif

namespace megatrain::exec {

namespace {

using cuda::bf16;

using buffers::Buf;

constexpr int64_t kPinMinBytes = int64_t{64} << 10;       // smaller buffers are not worth pinning

int64_t align_up(int64_t x) { return (x + buffers::kCudaCarveAlign - 1) / buffers::kCudaCarveAlign * buffers::kCudaCarveAlign; }

// A scoped NVTX range (Nsight Systems shows the pipeline's stages under these names).
struct Range {
  explicit Range(const char* name) { nvtxRangePushA(name); }
  ~Range() { nvtxRangePop(); }
};

void destroy_event(void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }

bool is_stacked_expert(TensorRole r) {
  return r == TensorRole::kExpertGateUp || r == TensorRole::kExpertGateUpBias || r == TensorRole::kExpertDown ||
         r == TensorRole::kExpertDownBias;
}

int64_t physical_ram_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

template <typename T>
class CudaBackend final : public Backend {
 public:
  CudaBackend(const Dims& d, const BackendOptions& o, std::vector<float> inv_freq, cuda::DeviceInfo dev)
      : Backend(d), opt_(o), inv_freq_(std::move(inv_freq)), dev_(std::move(dev)) {
    attn_ = buffers::cuda_attention_dims(d);
    attn_rows_ = buffers::cuda_attention_rows(d);
    vocab_chunk_ = buffers::cuda_vocab_chunk(d);
    pinned_limit_ = o.pinned_limit_bytes >= 0 ? o.pinned_limit_bytes : physical_ram_bytes() / 2;
  }

  ~CudaBackend() override {
#ifdef MEGATRAIN_HAVE_NCCL
    nccl_.reset();  // before the streams its work was issued on
#endif
    for (auto& [p, bytes] : registered_) cudaHostUnregister(p);
    if (staging_) cudaFreeHost(staging_);
    if (blas_) cublasDestroy(blas_);
    for (cudaStream_t s : streams_)
      if (s) cudaStreamDestroy(s);
  }


  Status init() {
    MT_CUDA_RETURN(cudaSetDevice(dev_.index));
    for (cudaStream_t& s : streams_) MT_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    MT_CUBLAS_RETURN(cublasCreate(&blas_));
    MT_CUBLAS_RETURN(cublasSetStream(blas_, stream(StreamKind::kCompute)));
    MT_CUBLAS_RETURN(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));  // no TF32 on the fp32 path
    return {};
  }

  std::string name() const override { return "cuda"; }
  std::string describe() const override {
    return "CUDA backend: " + dev_.name + " (sm_" + std::to_string(dev_.compute_major) + std::to_string(dev_.compute_minor) +
           ", " + format_bytes(static_cast<double>(dev_.total_memory_bytes)) + "), " +
           (std::is_same_v<T, float> ? "fp32" : "bf16 mixed precision") + ", cuBLAS GEMMs" +
           (dims_.moe ? ", " + std::to_string(dims_.E) + " experts (top-" + std::to_string(dims_.k) +
                            ") with one grouped cuBLAS call per expert projection"
                      : "") +
           (dims_.sinks ? ", attention sinks" : "") + (has_window() ? ", sliding-window attention" : "");
  }

  // ---- memory -----------------------------------------------------------------------------
  int64_t private_bytes() const override { return buffers::cuda_private(dims_).bytes(); }

  Result<std::unique_ptr<Arena>> create_arena(int64_t bytes) override {
    MT_CUDA_RETURN(cudaSetDevice(dev_.index));
    const int64_t priv = private_bytes();
    const int64_t pipeline = std::max<int64_t>(bytes - priv, 0);
    size_t free_b = 0, total_b = 0;
    MT_CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b));
    const int64_t want = align_up(pipeline) + priv;
    if (want > static_cast<int64_t>(free_b))
      return resource_exhausted("CUDA backend: the device arena needs " + format_bytes(static_cast<double>(want)) + " (" +
                                std::to_string(want) + " bytes), but " + dev_.name + " has " +
                                format_bytes(static_cast<double>(free_b)) +
                                " free; accepted: a plan whose placement.device_budget_bytes fits the free memory");
    if (static_cast<int64_t>(inv_freq_.size()) != dims_.hd / 2)
      return internal_error("CUDA backend: RoPE has " + std::to_string(inv_freq_.size()) +
                            " inverse frequencies, but the buffer list holds head_dim / 2 = " + std::to_string(dims_.hd / 2));
    void* base = nullptr;
    MT_CUDA_RETURN(cudaMalloc(&base, static_cast<size_t>(want)));
    MT_CUDA_RETURN(cudaMemset(base, 0, static_cast<size_t>(want)));
    char* priv_base = static_cast<char*>(base) + align_up(pipeline);
    carve_private(priv_base);
    MT_CUBLAS_RETURN(cublasSetWorkspace(blas_, blas_ws_, static_cast<size_t>(buffers::kCudaBlasWorkspaceBytes)));
    // Constant inputs of every layer: positions (0..T-1 per sequence) and RoPE's inverse frequencies.
    std::vector<int32_t> pos(static_cast<size_t>(dims_.N));
    for (int64_t i = 0; i < dims_.N; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % dims_.T);
    MT_CUDA_RETURN(cudaMemcpy(positions_, pos.data(), sizeof(int32_t) * pos.size(), cudaMemcpyHostToDevice));
    MT_CUDA_RETURN(cudaMemcpy(inv_freq_dev_, inv_freq_.data(), sizeof(float) * inv_freq_.size(), cudaMemcpyHostToDevice));
    // The memset and the copies above ran on the legacy stream, which the backend's own streams do
    // not wait for: finish them before any of those streams reads the arena.
    MT_CUDA_RETURN(cudaDeviceSynchronize());
    return std::make_unique<Arena>(base, pipeline, [](void* p) { cudaFree(p); });
  }

  Status register_host(void* p, int64_t bytes, const char* what) override {
    if (p == nullptr || bytes < kPinMinBytes) return {};
    if (pinned_ + bytes > pinned_limit_) {
      unpinned_ += bytes;
      return {};
    }
    const cudaError_t err = cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterDefault);
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();
      return {};
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      return resource_exhausted(std::string("CUDA backend: could not page-lock ") + format_bytes(static_cast<double>(bytes)) +
                                " of host memory for " + what + " (" + cudaGetErrorString(err) + ") after pinning " +
                                format_bytes(static_cast<double>(pinned_)) +
                                "; accepted: a lower --pinned-limit-gib (the rest is copied from pageable memory)");
    }
    registered_.push_back({p, bytes});
    pinned_ += bytes;
    return {};
  }

  std::string pinned_report() const override {
    std::string r = "pinned host memory: " + format_bytes(static_cast<double>(pinned_ + staging_bytes_)) + " (limit " +
                    format_bytes(static_cast<double>(pinned_limit_)) + ")";
    if (unpinned_ > 0)
      r += "; " + format_bytes(static_cast<double>(unpinned_)) + " of the RAM tier over the limit is copied from pageable memory";
    return r;
  }

  // ---- copies -----------------------------------------------------------------------------
  // The copy streams are driven from the trainer's own threads, and CUDA's current device is per
  // thread: a rank on GPU k makes k current on each thread before it issues work there (once).
  void bind() const {
    static thread_local int current = -1;
    if (current != dev_.index) {
      MT_CUDA_CHECK(cudaSetDevice(dev_.index));
      current = dev_.index;
    }
  }
  void upload_unit(StreamKind s, const UnitState& unit, DType transfer, float* dst) override {
    bind();
    Range r("prefetch");
    if constexpr (std::is_same_v<T, bf16>) {
      if (transfer != DType::kBf16) die("a bf16 CUDA backend was given fp32 weights to upload");
      MT_CUDA_CHECK(cudaMemcpyAsync(dst, unit.stream_bf16.data(), 2 * static_cast<size_t>(unit.numel), cudaMemcpyHostToDevice,
                                    stream(s)));
    } else {
      if (transfer != DType::kFp32) die("an fp32 CUDA backend was given bf16 weights to upload");
      MT_CUDA_CHECK(cudaMemcpyAsync(dst, unit.master.data(), 4 * static_cast<size_t>(unit.numel), cudaMemcpyHostToDevice,
                                    stream(s)));
    }
  }
  void copy_to_device(StreamKind s, float* dst, const float* src, int64_t n) override {
    bind();
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, 4 * static_cast<size_t>(n), cudaMemcpyHostToDevice, stream(s)));
  }
  void copy_to_host(StreamKind s, float* dst, const float* src, int64_t n) override {
    bind();
    Range r("offload");
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, 4 * static_cast<size_t>(n), cudaMemcpyDeviceToHost, stream(s)));
  }
  void add_to_host(StreamKind s, float* dst, const float* src, int64_t n) override {
    bind();
    Range r("offload (accumulate)");
    // Through a pinned staging buffer, then summed on the host in index order (as the CPU backend).
    if (staging_bytes_ < 4 * n) {
      if (staging_) MT_CUDA_CHECK(cudaFreeHost(staging_));
      staging_ = nullptr;
      MT_CUDA_CHECK(cudaMallocHost(&staging_, 4 * static_cast<size_t>(n)));
      staging_bytes_ = 4 * n;
    }
    MT_CUDA_CHECK(cudaMemcpyAsync(staging_, src, 4 * static_cast<size_t>(n), cudaMemcpyDeviceToHost, stream(s)));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream(s)));
    const float* st = static_cast<const float*>(staging_);
    for (int64_t k = 0; k < n; ++k) dst[k] += st[k];
  }
  void copy_on_device(StreamKind s, float* dst, const float* src, int64_t n) override {
    bind();
    if (dst != src) MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, 4 * static_cast<size_t>(n), cudaMemcpyDeviceToDevice, stream(s)));
  }
  void fill_zero(StreamKind s, float* dst, int64_t n) override {
    bind();
    MT_CUDA_CHECK(cudaMemsetAsync(dst, 0, 4 * static_cast<size_t>(n), stream(s)));
  }

  // ---- ordering ---------------------------------------------------------------------------
  void record(StreamKind s, Event& e) override {
    bind();
    if (e.native == nullptr) {
      cudaEvent_t ev = nullptr;
      MT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      e.native = ev;
      e.release_native = destroy_event;
    }
    MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e.native), stream(s)));
    e.signal();
  }
  void wait(StreamKind s, Event& e) override {
    bind();
    e.host_wait();
    if (e.native != nullptr) MT_CUDA_CHECK(cudaStreamWaitEvent(stream(s), static_cast<cudaEvent_t>(e.native), 0));
  }
  void synchronize(StreamKind s) override {
    bind();
    MT_CUDA_CHECK(cudaStreamSynchronize(stream(s)));
  }

  // ---- ops --------------------------------------------------------------------------------
  Status embed(const float* table, const int32_t* tokens, float* x_out) override {
    Range r("embed");
    MT_RETURN_IF_ERROR(check_ids(tokens, "token", false));
    cudaStream_t s = compute();
    MT_CUDA_RETURN(cudaMemcpyAsync(tokens_, tokens, sizeof(int32_t) * static_cast<size_t>(dims_.N), cudaMemcpyHostToDevice, s));
    MT_RETURN_IF_ERROR(cuda::embedding_forward<T>(tokens_, dims_.N, as_t(table), dims_.H, x_out, s));
    return finish();
  }

  Status embed_backward(const int32_t* tokens, const float* dx, float* dtable) override {
    Range r("embed backward");
    MT_RETURN_IF_ERROR(check_ids(tokens, "token", false));
    const cuda::TokenGroups g = cuda::build_token_groups(tokens, dims_.N);
    cudaStream_t s = compute();
    const int64_t nu = static_cast<int64_t>(g.unique.size());
    MT_CUDA_RETURN(cudaMemcpyAsync(g_unique_, g.unique.data(), sizeof(int32_t) * g.unique.size(), cudaMemcpyHostToDevice, s));
    MT_CUDA_RETURN(cudaMemcpyAsync(g_offsets_, g.offsets.data(), sizeof(int32_t) * g.offsets.size(), cudaMemcpyHostToDevice, s));
    MT_CUDA_RETURN(
        cudaMemcpyAsync(g_positions_, g.positions.data(), sizeof(int32_t) * g.positions.size(), cudaMemcpyHostToDevice, s));
    MT_RETURN_IF_ERROR(cuda::embedding_backward(g_unique_, g_offsets_, g_positions_, nu, dx, dims_.H, dtable, s));
    return finish();
  }

  Status layer_forward(const UnitView& w, const float* x_in, float* x_out, const LayerActs& a) override {
    Range r("forward layer");
    const int32_t* pos = nullptr;
    cuda::AttnDims ad = attn_of(w);
    MT_RETURN_IF_ERROR(documents(a, ad, pos));
    const Dims& d = dims_;
    cudaStream_t s = compute();
    const int64_t NH = d.N * d.H;
    if (a.x != x_in) MT_CUDA_RETURN(cudaMemcpyAsync(a.x, x_in, 4 * static_cast<size_t>(NH), cudaMemcpyDeviceToDevice, s));
    T* xn1 = as_t(a.xn1);
    T* q = as_t(a.q);
    T* k = as_t(a.k);
    T* v = as_t(a.v);
    T* attn = as_t(a.attn);
    T* xn2 = as_t(a.xn2);
    T* gate = as_t(a.gate);
    T* up = as_t(a.up);
    T* act = as_t(a.act);
    MT_RETURN_IF_ERROR(cuda::rmsnorm_forward<T>(a.x, wt(w, TensorRole::kAttnNorm), d.N, d.H, eps(), xn1, a.rstd1, s));
    if (d.qk_norm) {  // Qwen3: q and k in fp32, then RMSNorm over each head's head_dim into T, before RoPE
      if (w[TensorRole::kQBias] != nullptr || w[TensorRole::kKBias] != nullptr)
        return unsupported("--backend cuda: q/k norms together with q/k projection biases; accepted: Qwen3 (no attention bias)");
      MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, xn1, wt(w, TensorRole::kQ), d.N, d.H, d.q, a.q_pre, 0.0f)));
      MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, xn1, wt(w, TensorRole::kK), d.N, d.H, d.kv, a.k_pre, 0.0f)));
      MT_RETURN_IF_ERROR(cuda::rmsnorm_forward<T>(a.q_pre, wt(w, TensorRole::kQNorm), d.N * d.nh, d.hd, eps(), q, a.rstd_q, s));
      MT_RETURN_IF_ERROR(cuda::rmsnorm_forward<T>(a.k_pre, wt(w, TensorRole::kKNorm), d.N * d.nkv, d.hd, eps(), k, a.rstd_k, s));
    } else {
      MT_RETURN_IF_ERROR(project(xn1, w, TensorRole::kQ, TensorRole::kQBias, d.q, q));
      MT_RETURN_IF_ERROR(project(xn1, w, TensorRole::kK, TensorRole::kKBias, d.kv, k));
    }
    MT_RETURN_IF_ERROR(project(xn1, w, TensorRole::kV, TensorRole::kVBias, d.kv, v));
    MT_RETURN_IF_ERROR(cuda::rope_forward<T>(q, pos, d.N, d.nh, d.hd, inv_freq_dev_, s, rope_scale()));
    MT_RETURN_IF_ERROR(cuda::rope_forward<T>(k, pos, d.N, d.nkv, d.hd, inv_freq_dev_, s, rope_scale()));
    // The layer's sliding window (0: none), the rows' documents and gpt-oss's sinks (their logits
    // join lse).
    MT_RETURN_IF_ERROR(cuda::attention_forward<T>(blas_, ad, q, k, v, attn, a.lse, attn_ws_, attn_rows_, s,
                                                  wt(w, TensorRole::kSinks)));
    // h = x + o_proj(attn) (+ its bias): the GEMM adds into a copy of x (beta = 1), in fp32.
    MT_CUDA_RETURN(cudaMemcpyAsync(a.h, a.x, 4 * static_cast<size_t>(NH), cudaMemcpyDeviceToDevice, s));
    MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, attn, wt(w, TensorRole::kO), d.N, d.q, d.H, a.h, 1.0f)));
    if (w[TensorRole::kOBias] != nullptr)
      MT_RETURN_IF_ERROR((cuda::add_bias<float, T>(a.h, wt(w, TensorRole::kOBias), d.N, d.H, s)));
    MT_RETURN_IF_ERROR(cuda::rmsnorm_forward<T>(a.h, wt(w, TensorRole::kMlpNorm), d.N, d.H, eps(), xn2, a.rstd2, s));
    if (w[TensorRole::kRouter] != nullptr) {
      MT_RETURN_IF_ERROR(moe_forward(w, x_out, a));
      return finish();
    }
    MT_RETURN_IF_ERROR((cuda::linear_forward<T, T>(blas_, xn2, wt(w, TensorRole::kGate), d.N, d.H, d.I, gate, 0.0f)));
    MT_RETURN_IF_ERROR((cuda::linear_forward<T, T>(blas_, xn2, wt(w, TensorRole::kUp), d.N, d.H, d.I, up, 0.0f)));
    MT_RETURN_IF_ERROR(cuda::swiglu_forward<T>(gate, up, d.N * d.I, act, s));
    // x_out = h + down(act)
    if (x_out != a.h) MT_CUDA_RETURN(cudaMemcpyAsync(x_out, a.h, 4 * static_cast<size_t>(NH), cudaMemcpyDeviceToDevice, s));
    MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, act, wt(w, TensorRole::kDown), d.N, d.I, d.H, x_out, 1.0f)));
    return finish();
  }

  Status layer_backward(const UnitView& w, const LayerActs& a, const float* dout, float* dx, const UnitGrad& g,
                        float* workspace) override {
    Range r("backward layer");
    const int32_t* pos = nullptr;
    cuda::AttnDims ad = attn_of(w);
    MT_RETURN_IF_ERROR(documents(a, ad, pos));
    const Dims& d = dims_;
    cudaStream_t s = compute();
    const int64_t NH = d.N * d.H;
    const Ws ws = layer_ws(workspace);
    const T* xn1 = as_t(a.xn1);
    const T* q = as_t(a.q);
    const T* k = as_t(a.k);
    const T* v = as_t(a.v);
    const T* attn = as_t(a.attn);
    const T* xn2 = as_t(a.xn2);
    const T* gate = as_t(a.gate);
    const T* up = as_t(a.up);
    const T* act = as_t(a.act);
    if (w[TensorRole::kRouter] != nullptr) {
      MT_RETURN_IF_ERROR(moe_backward(w, a, dout, g, ws));  // the MoE block: writes ws.dxn
    } else {
      // MLP: out = h + down(act)
      const T* dout_t = to_t(dout, ws.dout_t, NH);
      MT_RETURN_IF_ERROR((cuda::linear_backward_data<T, T>(blas_, dout_t, wt(w, TensorRole::kDown), d.N, d.I, d.H, ws.dact, false)));
      MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, dout_t, act, d.N, d.I, d.H, g[TensorRole::kDown]));
      MT_RETURN_IF_ERROR(cuda::swiglu_backward<T>(gate, up, ws.dact, d.N * d.I, ws.dgate, ws.dup, s));
      MT_RETURN_IF_ERROR(
          (cuda::linear_backward_data<T, float>(blas_, ws.dgate, wt(w, TensorRole::kGate), d.N, d.H, d.I, ws.dxn, false)));
      MT_RETURN_IF_ERROR((cuda::linear_backward_data<T, float>(blas_, ws.dup, wt(w, TensorRole::kUp), d.N, d.H, d.I, ws.dxn, true)));
      MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, ws.dgate, xn2, d.N, d.H, d.I, g[TensorRole::kGate]));
      MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, ws.dup, xn2, d.N, d.H, d.I, g[TensorRole::kUp]));
    }
    MT_RETURN_IF_ERROR(cuda::rmsnorm_backward<T>(ws.dxn, a.h, wt(w, TensorRole::kMlpNorm), a.rstd2, d.N, d.H, ws.tmp,
                                                 g[TensorRole::kMlpNorm], col_ws(d.H), s));
    MT_RETURN_IF_ERROR(cuda::add(dout, ws.tmp, NH, ws.dh, s));  // the residual
    // Attention: h = x + o_proj(attn)
    const T* dh_t = to_t(ws.dh, ws.dh_t, NH);
    MT_RETURN_IF_ERROR((cuda::linear_backward_data<T, T>(blas_, dh_t, wt(w, TensorRole::kO), d.N, d.q, d.H, ws.dattn, false)));
    MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, dh_t, attn, d.N, d.q, d.H, g[TensorRole::kO]));
    if (g[TensorRole::kOBias] != nullptr)  // from the fp32 gradient
      MT_RETURN_IF_ERROR(cuda::column_sum_accumulate<float>(ws.dh, d.N, d.H, g[TensorRole::kOBias], col_ws(d.H), s));
    const T* sinks = wt(w, TensorRole::kSinks);
    if (sinks != nullptr && g[TensorRole::kSinks] == nullptr)
      return internal_error("CUDA backend: a layer with attention sinks was given no gradient for them");
    MT_RETURN_IF_ERROR(cuda::attention_backward<T>(blas_, ad, q, k, v, attn, ws.dattn, a.lse, ws.dq, ws.dk, ws.dv, attn_ws_,
                                                   attn_rows_, s, sinks, sinks ? g[TensorRole::kSinks] : nullptr));
    MT_RETURN_IF_ERROR(cuda::rope_backward<float>(ws.dq, pos, d.N, d.nh, d.hd, inv_freq_dev_, s, rope_scale()));
    MT_RETURN_IF_ERROR(cuda::rope_backward<float>(ws.dk, pos, d.N, d.nkv, d.hd, inv_freq_dev_, s, rope_scale()));
    if (d.qk_norm) {  // through the per-head norms, in place, to the projections' outputs
      MT_RETURN_IF_ERROR(cuda::rmsnorm_backward<T>(ws.dq, a.q_pre, wt(w, TensorRole::kQNorm), a.rstd_q, d.N * d.nh, d.hd, ws.dq,
                                                   g[TensorRole::kQNorm], col_ws(d.hd), s));
      MT_RETURN_IF_ERROR(cuda::rmsnorm_backward<T>(ws.dk, a.k_pre, wt(w, TensorRole::kKNorm), a.rstd_k, d.N * d.nkv, d.hd, ws.dk,
                                                   g[TensorRole::kKNorm], col_ws(d.hd), s));
    }
    MT_RETURN_IF_ERROR(project_backward(ws.dq, ws.dq_t, xn1, w, g, TensorRole::kQ, TensorRole::kQBias, d.q, ws.dxn, false));
    MT_RETURN_IF_ERROR(project_backward(ws.dk, ws.dk_t, xn1, w, g, TensorRole::kK, TensorRole::kKBias, d.kv, ws.dxn, true));
    MT_RETURN_IF_ERROR(project_backward(ws.dv, ws.dv_t, xn1, w, g, TensorRole::kV, TensorRole::kVBias, d.kv, ws.dxn, true));
    MT_RETURN_IF_ERROR(cuda::rmsnorm_backward<T>(ws.dxn, a.x, wt(w, TensorRole::kAttnNorm), a.rstd1, d.N, d.H, ws.tmp,
                                                 g[TensorRole::kAttnNorm], col_ws(d.H), s));
    MT_RETURN_IF_ERROR(cuda::add(ws.dh, ws.tmp, NH, dx, s));
    return finish();
  }

  Status head(const float* final_norm, const float* lm_head, const float* x, const int32_t* targets, float grad_scale,
              float* dx, float* d_final_norm, float* d_lm_head, double* loss_sum, int64_t* count, float* workspace) override {
    Range r("head");
    const Dims& d = dims_;
    cudaStream_t s = compute();
    MT_RETURN_IF_ERROR(check_ids(targets, "target", true));
    MT_CUDA_RETURN(cudaMemcpyAsync(targets_, targets, sizeof(int32_t) * static_cast<size_t>(d.N), cudaMemcpyHostToDevice, s));
    const Hw hw = head_ws(workspace);
    const T* norm = as_t(final_norm);
    const T* lm = as_t(lm_head);
    MT_RETURN_IF_ERROR(cuda::rmsnorm_forward<T>(x, norm, d.N, d.H, eps(), hw.xn, hw.rstd, s));
    // Pass 1: the log-sum-exp of every row, one vocabulary chunk at a time.
    for (int64_t v0 = 0; v0 < d.V; v0 += vocab_chunk_) {
      const int64_t vc = std::min(vocab_chunk_, d.V - v0);
      MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, hw.xn, lm + v0 * d.H, d.N, d.H, vc, hw.logits, 0.0f)));
      MT_RETURN_IF_ERROR(cuda::cross_entropy_chunk_stats(hw.logits, d.N, vc, v0, targets_, hw.run_max, hw.run_sum, hw.target_logit, s));
    }
    MT_CUDA_RETURN(cudaMemsetAsync(loss_dev_, 0, sizeof(double), s));
    MT_CUDA_RETURN(cudaMemsetAsync(count_dev_, 0, sizeof(long long), s));
    MT_RETURN_IF_ERROR(cuda::cross_entropy_finish(hw.run_max, hw.run_sum, hw.target_logit, targets_, d.N, hw.lse, loss_dev_,
                                                  count_dev_, s));
    // Pass 2: the logits again, their gradient, and its products with the head and the input.
    for (int64_t v0 = 0; v0 < d.V; v0 += vocab_chunk_) {
      const int64_t vc = std::min(vocab_chunk_, d.V - v0);
      MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, hw.xn, lm + v0 * d.H, d.N, d.H, vc, hw.logits, 0.0f)));
      MT_RETURN_IF_ERROR(cuda::cross_entropy_chunk_grad<T>(hw.logits, d.N, vc, v0, targets_, hw.lse, grad_scale, hw.dlogits, s));
      MT_RETURN_IF_ERROR((cuda::linear_backward_data<T, float>(blas_, hw.dlogits, lm + v0 * d.H, d.N, d.H, vc, hw.dxn, v0 > 0)));
      MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, hw.dlogits, hw.xn, d.N, d.H, vc, d_lm_head + v0 * d.H));
    }
    MT_RETURN_IF_ERROR(cuda::rmsnorm_backward<T>(hw.dxn, x, norm, hw.rstd, d.N, d.H, dx, d_final_norm, col_ws(d.H), s));
    double loss = 0;
    long long n = 0;
    MT_CUDA_RETURN(cudaMemcpyAsync(&loss, loss_dev_, sizeof(double), cudaMemcpyDeviceToHost, s));
    MT_CUDA_RETURN(cudaMemcpyAsync(&n, count_dev_, sizeof(long long), cudaMemcpyDeviceToHost, s));
    MT_RETURN_IF_ERROR(finish());
    *loss_sum += loss;
    *count += static_cast<int64_t>(n);
    return {};
  }

  void add(float* dst, const float* src, int64_t n) override {
    const Status st = cuda::accumulate(src, n, dst, compute());
    if (!st.ok()) die(st.message());
  }

  int64_t layer_act_floats() const override { return buffers::cuda_layer_acts(dims_, sizeof(T)).floats(); }
  int64_t layer_workspace_floats() const override { return buffers::cuda_layer_workspace(dims_, sizeof(T)).floats(); }
  int64_t head_workspace_floats() const override { return buffers::cuda_head_workspace(dims_, sizeof(T)).floats(); }

  // The block holds T elements: p[role] is expert 0's tensor (or the only one) and stride[role]
  // the distance to expert 1's, both in elements of T (model.h UnitView, as the CPU binds them:
  // per-expert tensors by their offsets, gpt-oss's stacked ones by numel / E); layer as well.
  UnitView view_weights(const UnitState& layout, const float* block) const override {
    UnitView v;
    const T* base = reinterpret_cast<const T*>(block);
    int64_t first[kTensorRoleCount] = {};
    for (const auto& t : layout.tensors) {
      const int r = static_cast<int>(t.role);
      v.layer = t.layer;  // the decoder layer (its sliding window); -1 for the embedding and the head
      if (t.expert <= 0) {
        v.p[r] = reinterpret_cast<const float*>(base + t.offset);
        first[r] = t.offset;
        if (t.expert < 0 && is_stacked_expert(t.role) && !t.shape.empty() && t.shape[0] > 0)
          v.stride[r] = t.numel / t.shape[0];  // gpt-oss's [E, ...] tensors: one expert after the other
      } else if (t.expert == 1) {
        v.stride[r] = t.offset - first[r];
      }
    }
    return v;
  }
  LayerActs bind_acts(float* base) const override { return carve_acts(base); }

  Result<std::string> enable_device_sums(Communicator& comm) override {
#ifdef MEGATRAIN_HAVE_NCCL
    MT_ASSIGN_OR_RETURN(nccl_, cuda_nccl::make_nccl_sum(comm, dev_.index));
    return nccl_->description() + " on " + dev_.name + " (device " + std::to_string(dev_.index) + ")";
#else
    (void)comm;
    return unsupported("parallel.collective nccl: this build has no NCCL (configure found no nccl.h, MEGATRAIN_NCCL); accepted: "
                       "parallel.collective mpi, or a build with NCCL");
#endif
  }
  Status sum_across_ranks(StreamKind s, float* data, int64_t n) override {
#ifdef MEGATRAIN_HAVE_NCCL
    if (!nccl_) return internal_error("sum_across_ranks before enable_device_sums");
    bind();
    return nccl_->sum(data, n, stream(s));
#else
    (void)s, (void)data, (void)n;
    return internal_error("sum_across_ranks in a build without NCCL");
#endif
  }

 private:
#ifdef MEGATRAIN_HAVE_NCCL
  std::unique_ptr<cuda_nccl::NcclSum> nccl_;  // parallel.collective nccl (enable_device_sums)
#endif
  // ---- layouts ----------------------------------------------------------------------------
  // Each carve walks this backend's buffer list (megatrain/buffers), the one the footprint sums.
  LayerActs carve_acts(float* base) const {
    const Dims& d = dims_;
    const buffers::Carving c(buffers::cuda_layer_acts(d, sizeof(T)), base);
    LayerActs a{};
    a.x = c.get<float>(Buf::kX);  // first: the pipeline writes a recompute's input here
    a.rstd1 = c.get<float>(Buf::kRstd1);
    a.xn1 = f(c.get<T>(Buf::kXn1));
    a.q = f(c.get<T>(Buf::kQ));
    a.k = f(c.get<T>(Buf::kK));
    a.v = f(c.get<T>(Buf::kV));
    a.attn = f(c.get<T>(Buf::kAttn));
    a.lse = c.get<float>(Buf::kLse);
    a.h = c.get<float>(Buf::kH);
    a.rstd2 = c.get<float>(Buf::kRstd2);
    a.xn2 = f(c.get<T>(Buf::kXn2));
    if (d.gpt_oss) {  // gate_up [N*k, 2 Im], interleaved as the projection writes it: gate and up adjacent
      T* gu = c.get<T>(Buf::kGateUp);
      a.gate = f(gu);
      a.up = f(gu ? gu + d.mlp_floats() : nullptr);
    } else {
      a.gate = f(c.get<T>(Buf::kGate));  // the dense MLP's N*I or the experts' N*k*Im, the larger
      a.up = f(c.get<T>(Buf::kUp));
    }
    a.act = f(c.get<T>(Buf::kAct));
    a.probs = nullptr;
    if (d.qk_norm) {
      a.q_pre = c.get<float>(Buf::kQPre);
      a.k_pre = c.get<float>(Buf::kKPre);
      a.rstd_q = c.get<float>(Buf::kRstdQ);
      a.rstd_k = c.get<float>(Buf::kRstdK);
    }
    if (d.moe) {  // routing in fp32 and int32; the gathered inputs and expert outputs in T
      a.logits = c.get<float>(Buf::kRouterLogits);
      a.rprobs = c.get<float>(Buf::kRouterProbs);
      a.rweight = c.get<float>(Buf::kRouteWeight);
      a.rexpert = c.get<int32_t>(Buf::kRouteExpert);
      a.perm = c.get<int32_t>(Buf::kPerm);
      a.row_of_slot = c.get<int32_t>(Buf::kRowOfSlot);
      a.offsets = c.get<int32_t>(Buf::kExpertOffsets);
      a.xp = f(c.get<T>(Buf::kXp));
      a.yp = f(c.get<T>(Buf::kYp));
    }
    return a;
  }

  struct Ws {
    T *dout_t, *dact, *dgate, *dup, *dh_t, *dattn, *dq_t, *dk_t, *dv_t;
    float *dxn, *tmp, *dh, *dq, *dk, *dv;
    // MoE: the experts' input gradient, the combine's output gradient, d weight, d logits (and its T copy)
    float *dxp, *dweight, *dlogits;
    T *dyp, *dlogits_t;
  };
  Ws layer_ws(float* base) const {
    const Dims& d = dims_;
    const buffers::Carving c(buffers::cuda_layer_workspace(d, sizeof(T)), base);
    Ws w{};
    w.dout_t = c.get<T>(Buf::kDoutT);
    w.dact = c.get<T>(Buf::kDact);
    if (d.gpt_oss) {  // d gate_up [N*k, 2 Im] in one piece
      w.dgate = c.get<T>(Buf::kDgateUp);
      w.dup = w.dgate ? w.dgate + d.mlp_floats() : nullptr;
    } else {
      w.dgate = c.get<T>(Buf::kDgate);
      w.dup = c.get<T>(Buf::kDup);
    }
    w.dh_t = c.get<T>(Buf::kDhT);
    w.dattn = c.get<T>(Buf::kDattn);
    w.dq_t = c.get<T>(Buf::kDqT);
    w.dk_t = c.get<T>(Buf::kDkT);
    w.dv_t = c.get<T>(Buf::kDvT);
    w.dxn = c.get<float>(Buf::kDxn);
    w.tmp = c.get<float>(Buf::kTmp);
    w.dh = c.get<float>(Buf::kDh);
    w.dq = c.get<float>(Buf::kDq);
    w.dk = c.get<float>(Buf::kDk);
    w.dv = c.get<float>(Buf::kDv);
    if (d.moe) {
      w.dxp = c.get<float>(Buf::kDxp);
      w.dyp = c.get<T>(Buf::kDyp);
      w.dweight = c.get<float>(Buf::kDweight);
      w.dlogits = c.get<float>(Buf::kDlogits);
      w.dlogits_t = c.get<T>(Buf::kDlogitsT);
    }
    return w;
  }

  struct Hw {
    T *xn, *dlogits;
    float *rstd, *logits, *run_max, *run_sum, *target_logit, *lse, *dxn;
  };
  Hw head_ws(float* base) const {
    const buffers::Carving c(buffers::cuda_head_workspace(dims_, sizeof(T)), base);
    Hw h{};
    h.xn = c.get<T>(Buf::kHeadXn);
    h.rstd = c.get<float>(Buf::kHeadRstd);
    h.dxn = c.get<float>(Buf::kHeadDxn);
    h.run_max = c.get<float>(Buf::kRunMax);
    h.run_sum = c.get<float>(Buf::kRunSum);
    h.target_logit = c.get<float>(Buf::kTargetLogit);
    h.lse = c.get<float>(Buf::kHeadLse);
    h.logits = c.get<float>(Buf::kLogits);
    if constexpr (std::is_same_v<T, float>)
      h.dlogits = h.logits;  // in place: each logit is read before its gradient is written
    else
      h.dlogits = c.get<T>(Buf::kDlogitsHead);
    return h;
  }

  // The backend's own region of the arena (const: only computes its size when base is null).
  void carve_private(char* base) {
    const buffers::Carving c(buffers::cuda_private(dims_), base);
    blas_ws_ = c.raw(Buf::kBlasWorkspace);
    attn_ws_ = c.raw(Buf::kAttentionWorkspace);
    tokens_ = c.get<int32_t>(Buf::kTokens);
    targets_ = c.get<int32_t>(Buf::kTargets);
    positions_ = c.get<int32_t>(Buf::kPositions);
    g_unique_ = c.get<int32_t>(Buf::kUniqueTokens);
    g_offsets_ = c.get<int32_t>(Buf::kTokenOffsets);
    g_positions_ = c.get<int32_t>(Buf::kTokenPositions);
    docs_dev_ = c.get<int32_t>(Buf::kDocuments);
    doc_sent_.clear();  // a new arena holds no documents yet
    inv_freq_dev_ = c.get<float>(Buf::kInvFreq);
    loss_dev_ = c.get<double>(Buf::kLossSum);
    count_dev_ = c.get<long long>(Buf::kTokenCount);
    col_ws_ = c.raw(Buf::kColumnPartials);  // the two-stage column sums' partials
    // MoE: the counting sort's per-chunk counts, the grouped GEMMs' pointer arrays, the routing
    // statistics (count, probability sums; doubles) and the load-balancing gradient (fp32).
    sort_scratch_ = c.get<int32_t>(Buf::kSortScratch);
    gemm_ptrs_ = c.get<void*>(Buf::kGemmPointers);
    aux_dev_ = c.get<double>(Buf::kAuxStats);
    aux_grad_dev_ = c.get<float>(Buf::kAuxGrad);
  }

  // ---- helpers ----------------------------------------------------------------------------
  cudaStream_t stream(StreamKind s) const { return streams_[static_cast<int>(s)]; }
  cudaStream_t compute() const { return stream(StreamKind::kCompute); }
  // The two-stage column sums' partials, for a sum over `cols` columns (buffers::cuda_column_sum_cols
  // sized them for the widest this backend makes).
  void* col_ws(int64_t cols) const {
    MT_CHECK(cols <= buffers::cuda_column_sum_cols(dims_),
             "CUDA backend: a column sum over " + std::to_string(cols) + " columns, but the partials hold " +
                 std::to_string(buffers::cuda_column_sum_cols(dims_)));
    return col_ws_;
  }
  float eps() const { return static_cast<float>(dims_.eps); }
  float rope_scale() const { return static_cast<float>(dims_.rope_scale); }
  bool has_window() const {
    for (int64_t l = 0; l < dims_.L; ++l)
      if (dims_.window_of(l) > 0) return true;
    return false;
  }
  // The attention's shape for the unit's layer: its sliding window (Dims::window_of; 0 for none).
  cuda::AttnDims attn_of(const UnitView& w) const {
    cuda::AttnDims ad = attn_;
    ad.window = dims_.window_of(w.layer);
    return ad;
  }
  // Rows packed "neat" (a.doc_starts, host memory, [N]): their document starts and the RoPE
  // positions that restart at 0 in each document, on the device (copied when they differ from the
  // last micro-batch's), into the attention's shape; otherwise the constant positions 0..T-1.
  Status documents(const LayerActs& a, cuda::AttnDims& ad, const int32_t*& pos) {
    pos = positions_;
    if (a.doc_starts == nullptr) return {};
    const int64_t N = dims_.N, seq = dims_.T;
    doc_host_.resize(static_cast<size_t>(2 * N));
    for (int64_t i = 0; i < N; ++i) {
      const int32_t st = a.doc_starts[i];
      doc_host_[static_cast<size_t>(i)] = st;
      doc_host_[static_cast<size_t>(N + i)] = static_cast<int32_t>(i % seq - st);
    }
    ad.starts = doc_host_.data();  // checked by the attention (contiguous documents)
    ad.starts_dev = docs_dev_;
    pos = docs_dev_ + N;
    if (doc_host_ != doc_sent_) {
      MT_CUDA_RETURN(cudaMemcpyAsync(docs_dev_, doc_host_.data(), sizeof(int32_t) * doc_host_.size(), cudaMemcpyHostToDevice,
                                     compute()));
      doc_sent_ = doc_host_;
    }
    return {};
  }
  static float* f(T* p) { return reinterpret_cast<float*>(p); }
  static T* as_t(float* p) { return reinterpret_cast<T*>(p); }
  static const T* as_t(const float* p) { return reinterpret_cast<const T*>(p); }
  static const T* wt(const UnitView& w, TensorRole r) { return reinterpret_cast<const T*>(w[r]); }
  [[noreturn]] static void die(const std::string& what) {
    die_on_bad_result_access(internal_error("CUDA backend: " + what));
  }

  // An op returns once its kernels are done, so that its span is its real GPU time.
  Status finish() {
    MT_CUDA_RETURN(cudaStreamSynchronize(compute()));
    MT_CUDA_RETURN(cudaGetLastError());
    return {};
  }

  // fp32 -> T for a GEMM input (the fp32 path uses the fp32 buffer itself).
  const T* to_t(const float* src, T* dst, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      (void)dst, (void)n;
      return src;
    } else {
      const Status st = cuda::convert<float, T>(src, n, dst, compute());
      if (!st.ok()) die(st.message());
      return dst;
    }
  }

  // y = xn W^T (+ bias), in T.
  Status project(const T* xn, const UnitView& w, TensorRole weight, TensorRole bias, int64_t out, T* y) {
    MT_RETURN_IF_ERROR((cuda::linear_forward<T, T>(blas_, xn, wt(w, weight), dims_.N, dims_.H, out, y, 0.0f)));
    if (w[bias] != nullptr) MT_RETURN_IF_ERROR(cuda::add_bias<T>(y, wt(w, bias), dims_.N, out, compute()));
    return {};
  }
  // The backward of project for a q/k/v projection whose output gradient dy is fp32.
  Status project_backward(const float* dy, T* dy_t_buf, const T* xn, const UnitView& w, const UnitGrad& g, TensorRole weight,
                          TensorRole bias, int64_t out, float* dxn, bool accumulate) {
    const T* dy_t = to_t(dy, dy_t_buf, dims_.N * out);
    MT_RETURN_IF_ERROR((cuda::linear_backward_data<T, float>(blas_, dy_t, wt(w, weight), dims_.N, dims_.H, out, dxn, accumulate)));
    MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, dy_t, xn, dims_.N, dims_.H, out, g[weight]));
    if (g[bias] != nullptr) MT_RETURN_IF_ERROR(cuda::column_sum_accumulate<float>(dy, dims_.N, out, g[bias], col_ws(out), compute()));
    return {};
  }

  // ---- Mixture-of-Experts ------------------------------------------------------------------
  // The experts' row offsets of this layer's sort, copied to the host (cuBLAS takes the grouped
  // GEMMs' shapes from host arrays).
  Status load_offsets(const int32_t* offsets_dev) {
    offsets_host_.resize(static_cast<size_t>(dims_.E + 1));
    MT_CUDA_RETURN(cudaMemcpyAsync(offsets_host_.data(), offsets_dev, sizeof(int32_t) * offsets_host_.size(),
                                   cudaMemcpyDeviceToHost, compute()));
    MT_CUDA_RETURN(cudaStreamSynchronize(compute()));
    // The sort places every one of the N x k slots: anything else would send the grouped GEMMs
    // outside the permuted buffers.
    const int64_t slots = dims_.N * dims_.k;
    if (offsets_host_.front() != 0 || offsets_host_.back() != slots)
      return internal_error("MoE sort: the experts' offsets run from " + std::to_string(offsets_host_.front()) + " to " +
                            std::to_string(offsets_host_.back()) + ", not from 0 to the " + std::to_string(slots) +
                            " slots (tokens x experts per token)");
    return {};
  }

  // The MoE block on xn2, added to the residual h into x_out (model.cpp moe_forward, the same math).
  Status moe_forward(const UnitView& w, float* x_out, const LayerActs& a) {
    const Dims& d = dims_;
    cudaStream_t s = compute();
    const int64_t slots = d.N * d.k;
    const T* xn2 = as_t(a.xn2);
    T* xp = as_t(a.xp);
    T* yp = as_t(a.yp);
    T* gate = as_t(a.gate);
    T* up = as_t(a.up);
    T* act = as_t(a.act);
    MT_RETURN_IF_ERROR((cuda::linear_forward<T, float>(blas_, xn2, wt(w, TensorRole::kRouter), d.N, d.H, d.E, a.logits, 0.0f)));
    if (w[TensorRole::kRouterBias] != nullptr)  // gpt-oss
      MT_RETURN_IF_ERROR((cuda::add_bias<float, T>(a.logits, wt(w, TensorRole::kRouterBias), d.N, d.E, s)));
    MT_RETURN_IF_ERROR(cuda::moe_route_forward(a.logits, d.N, d.E, d.k, d.renorm, a.rexpert, a.rweight, a.rprobs, s));
    MT_RETURN_IF_ERROR(cuda::moe_permute(a.rexpert, slots, d.E, a.offsets, a.perm, a.row_of_slot, sort_scratch_, s));
    MT_RETURN_IF_ERROR(cuda::moe_gather<T>(xn2, a.perm, slots, d.k, d.H, xp, s));
    MT_RETURN_IF_ERROR(load_offsets(a.offsets));
    const int32_t* off = offsets_host_.data();
    if (d.gpt_oss) {
      MT_RETURN_IF_ERROR(gpt_oss_experts_forward(w, a));
    } else {
    MT_RETURN_IF_ERROR((cuda::grouped_linear_forward<T, T>(blas_, xp, wt(w, TensorRole::kExpertGate),
                                                           w.stride_of(TensorRole::kExpertGate), off, d.E, d.H, d.Im, gate, 0.0f,
                                                           gemm_ptrs_)));
    MT_RETURN_IF_ERROR((cuda::grouped_linear_forward<T, T>(blas_, xp, wt(w, TensorRole::kExpertUp), w.stride_of(TensorRole::kExpertUp),
                                                           off, d.E, d.H, d.Im, up, 0.0f, gemm_ptrs_)));
    MT_RETURN_IF_ERROR(cuda::swiglu_forward<T>(gate, up, slots * d.Im, act, s));
    MT_RETURN_IF_ERROR((cuda::grouped_linear_forward<T, T>(blas_, act, wt(w, TensorRole::kExpertDown),
                                                           w.stride_of(TensorRole::kExpertDown), off, d.E, d.Im, d.H, yp, 0.0f,
                                                           gemm_ptrs_)));
    }
    MT_RETURN_IF_ERROR(cuda::moe_combine_forward<T>(yp, a.rweight, a.row_of_slot, a.h, d.N, d.k, d.H, x_out, s));
    if (a.aux_count != nullptr) {
      // The trainer's running sums go up, the layer's slots and probabilities are added on the
      // device in the CPU op's order, and the sums come back.
      const size_t bytes = sizeof(double) * static_cast<size_t>(d.E);
      MT_CUDA_RETURN(cudaMemcpyAsync(aux_dev_, a.aux_count, bytes, cudaMemcpyHostToDevice, s));
      MT_CUDA_RETURN(cudaMemcpyAsync(aux_dev_ + d.E, a.aux_prob, bytes, cudaMemcpyHostToDevice, s));
      MT_RETURN_IF_ERROR(cuda::moe_aux_stats(a.rprobs, a.offsets, d.N, d.E, aux_dev_, aux_dev_ + d.E, col_ws(d.E), s));
      MT_CUDA_RETURN(cudaMemcpyAsync(a.aux_count, aux_dev_, bytes, cudaMemcpyDeviceToHost, s));
      MT_CUDA_RETURN(cudaMemcpyAsync(a.aux_prob, aux_dev_ + d.E, bytes, cudaMemcpyDeviceToHost, s));
    }
    return {};
  }

  // ws.dxn = d MoE(xn2) / d xn2 . dout; the router's and the chosen experts' gradients accumulate
  // into g (model.cpp moe_backward).
  Status moe_backward(const UnitView& w, const LayerActs& a, const float* dout, const UnitGrad& g, const Ws& ws) {
    const Dims& d = dims_;
    cudaStream_t s = compute();
    const int64_t slots = d.N * d.k;
    const T* xn2 = as_t(a.xn2);
    const T* xp = as_t(a.xp);
    const T* yp = as_t(a.yp);
    const T* gate = as_t(a.gate);
    const T* up = as_t(a.up);
    const T* act = as_t(a.act);
    const auto gs = [&](TensorRole r) { return g.stride[static_cast<int>(r)]; };
    MT_RETURN_IF_ERROR(cuda::moe_combine_backward<T>(yp, a.rweight, a.row_of_slot, dout, d.N, d.k, d.H, ws.dyp, ws.dweight, s));
    MT_RETURN_IF_ERROR(load_offsets(a.offsets));
    const int32_t* off = offsets_host_.data();
    if (d.gpt_oss) {
      MT_RETURN_IF_ERROR(gpt_oss_experts_backward(w, a, g, ws));
    } else {
    MT_RETURN_IF_ERROR((cuda::grouped_linear_backward_data<T, T>(blas_, ws.dyp, wt(w, TensorRole::kExpertDown),
                                                                 w.stride_of(TensorRole::kExpertDown), off, d.E, d.Im, d.H,
                                                                 ws.dact, false, gemm_ptrs_)));
    MT_RETURN_IF_ERROR(cuda::grouped_linear_backward_weight<T>(blas_, ws.dyp, act, off, d.E, d.Im, d.H, g[TensorRole::kExpertDown],
                                                               gs(TensorRole::kExpertDown), gemm_ptrs_));
    MT_RETURN_IF_ERROR(cuda::swiglu_backward<T>(gate, up, ws.dact, slots * d.Im, ws.dgate, ws.dup, s));
    MT_RETURN_IF_ERROR((cuda::grouped_linear_backward_data<T, float>(blas_, ws.dgate, wt(w, TensorRole::kExpertGate),
                                                                     w.stride_of(TensorRole::kExpertGate), off, d.E, d.H, d.Im,
                                                                     ws.dxp, false, gemm_ptrs_)));
    MT_RETURN_IF_ERROR((cuda::grouped_linear_backward_data<T, float>(blas_, ws.dup, wt(w, TensorRole::kExpertUp),
                                                                     w.stride_of(TensorRole::kExpertUp), off, d.E, d.H, d.Im,
                                                                     ws.dxp, true, gemm_ptrs_)));
    MT_RETURN_IF_ERROR(cuda::grouped_linear_backward_weight<T>(blas_, ws.dgate, xp, off, d.E, d.H, d.Im, g[TensorRole::kExpertGate],
                                                               gs(TensorRole::kExpertGate), gemm_ptrs_));
    MT_RETURN_IF_ERROR(cuda::grouped_linear_backward_weight<T>(blas_, ws.dup, xp, off, d.E, d.H, d.Im, g[TensorRole::kExpertUp],
                                                               gs(TensorRole::kExpertUp), gemm_ptrs_));
    }
    MT_RETURN_IF_ERROR(cuda::moe_scatter_add(ws.dxp, a.row_of_slot, d.N, d.k, d.H, ws.dxn, s));
    const float* aux = nullptr;
    if (a.aux_grad != nullptr) {  // in fp32, as the CPU op takes it
      aux_grad_host_.assign(a.aux_grad, a.aux_grad + d.E);
      MT_CUDA_RETURN(cudaMemcpyAsync(aux_grad_dev_, aux_grad_host_.data(), sizeof(float) * aux_grad_host_.size(),
                                     cudaMemcpyHostToDevice, s));
      aux = aux_grad_dev_;
    }
    MT_RETURN_IF_ERROR(
        cuda::moe_route_backward(a.rprobs, a.rexpert, a.rweight, ws.dweight, aux, d.N, d.E, d.k, d.renorm, ws.dlogits, s));
    const T* dlogits_t = to_t(ws.dlogits, ws.dlogits_t, d.N * d.E);
    MT_RETURN_IF_ERROR(
        (cuda::linear_backward_data<T, float>(blas_, dlogits_t, wt(w, TensorRole::kRouter), d.N, d.H, d.E, ws.dxn, true)));
    MT_RETURN_IF_ERROR(cuda::linear_backward_weight<T>(blas_, dlogits_t, xn2, d.N, d.H, d.E, g[TensorRole::kRouter]));
    if (g[TensorRole::kRouterBias] != nullptr)
      MT_RETURN_IF_ERROR(cuda::column_sum_accumulate<float>(ws.dlogits, d.N, d.E, g[TensorRole::kRouterBias], col_ws(d.E), s));
    return {};
  }

  // gpt-oss's experts on the sorted rows (model.cpp moe_forward's gpt_oss branch): gate_up [rows,
  // 2 Im] = xp @ W_gu + b_gu (the biases are the GEMM's initial C), act = the clamped SwiGLU of the
  // interleaved columns, yp = act @ W_down + b_down. offsets_host_ holds this layer's offsets.
  Status gpt_oss_experts_forward(const UnitView& w, const LayerActs& a) {
    const Dims& d = dims_;
    cudaStream_t s = compute();
    const int32_t* off = offsets_host_.data();
    T* gu = as_t(a.gate);
    T* act = as_t(a.act);
    T* yp = as_t(a.yp);
    const int64_t gu_cols = 2 * d.Im;
    float beta = 0.0f;
    if (w[TensorRole::kExpertGateUpBias] != nullptr) {
      MT_RETURN_IF_ERROR(cuda::moe_expert_bias_fill<T>(gu, wt(w, TensorRole::kExpertGateUpBias),
                                                       w.stride_of(TensorRole::kExpertGateUpBias), a.offsets, d.E, gu_cols, s));
      beta = 1.0f;
    }
    MT_RETURN_IF_ERROR((cuda::grouped_matmul_forward<T, T>(blas_, as_t(a.xp), wt(w, TensorRole::kExpertGateUp),
                                                           w.stride_of(TensorRole::kExpertGateUp), off, d.E, d.H, gu_cols, gu,
                                                           beta, gemm_ptrs_)));
    MT_RETURN_IF_ERROR(cuda::clamped_swiglu_forward<T>(gu, d.N * d.k * d.Im, static_cast<float>(d.swiglu_alpha),
                                                       static_cast<float>(d.swiglu_limit), act, s));
    beta = 0.0f;
    if (w[TensorRole::kExpertDownBias] != nullptr) {
      MT_RETURN_IF_ERROR(cuda::moe_expert_bias_fill<T>(yp, wt(w, TensorRole::kExpertDownBias),
                                                       w.stride_of(TensorRole::kExpertDownBias), a.offsets, d.E, d.H, s));
      beta = 1.0f;
    }
    MT_RETURN_IF_ERROR((cuda::grouped_matmul_forward<T, T>(blas_, act, wt(w, TensorRole::kExpertDown),
                                                           w.stride_of(TensorRole::kExpertDown), off, d.E, d.Im, d.H, yp, beta,
                                                           gemm_ptrs_)));
    return {};
  }

  // Its backward from ws.dyp to ws.dxp; the experts' weight and bias gradients accumulate into g
  // (the biases' over each expert's rows in order; an expert with no rows is not touched).
  Status gpt_oss_experts_backward(const UnitView& w, const LayerActs& a, const UnitGrad& g, const Ws& ws) {
    const Dims& d = dims_;
    cudaStream_t s = compute();
    const int32_t* off = offsets_host_.data();
    const auto gs = [&](TensorRole r) { return g.stride[static_cast<int>(r)]; };
    const T* gu = as_t(a.gate);
    const T* act = as_t(a.act);
    const T* xp = as_t(a.xp);
    T* dgu = ws.dgate;  // [rows, 2 Im]: dgate and dup are one piece on gpt-oss
    const int64_t gu_cols = 2 * d.Im;
    MT_RETURN_IF_ERROR((cuda::grouped_matmul_backward_data<T, T>(blas_, ws.dyp, wt(w, TensorRole::kExpertDown),
                                                                 w.stride_of(TensorRole::kExpertDown), off, d.E, d.Im, d.H,
                                                                 ws.dact, false, gemm_ptrs_)));
    MT_RETURN_IF_ERROR(cuda::grouped_matmul_backward_weight<T>(blas_, ws.dyp, act, off, d.E, d.Im, d.H,
                                                               g[TensorRole::kExpertDown], gs(TensorRole::kExpertDown),
                                                               gemm_ptrs_));
    if (g[TensorRole::kExpertDownBias] != nullptr)
      MT_RETURN_IF_ERROR(cuda::moe_expert_bias_grad<T>(ws.dyp, a.offsets, d.E, d.H, g[TensorRole::kExpertDownBias],
                                                       gs(TensorRole::kExpertDownBias), s));
    MT_RETURN_IF_ERROR(cuda::clamped_swiglu_backward<T>(gu, ws.dact, d.N * d.k * d.Im, static_cast<float>(d.swiglu_alpha),
                                                        static_cast<float>(d.swiglu_limit), dgu, s));
    MT_RETURN_IF_ERROR((cuda::grouped_matmul_backward_data<T, float>(blas_, dgu, wt(w, TensorRole::kExpertGateUp),
                                                                     w.stride_of(TensorRole::kExpertGateUp), off, d.E, d.H,
                                                                     gu_cols, ws.dxp, false, gemm_ptrs_)));
    MT_RETURN_IF_ERROR(cuda::grouped_matmul_backward_weight<T>(blas_, dgu, xp, off, d.E, d.H, gu_cols,
                                                               g[TensorRole::kExpertGateUp], gs(TensorRole::kExpertGateUp),
                                                               gemm_ptrs_));
    if (g[TensorRole::kExpertGateUpBias] != nullptr)
      MT_RETURN_IF_ERROR(cuda::moe_expert_bias_grad<T>(dgu, a.offsets, d.E, gu_cols, g[TensorRole::kExpertGateUpBias],
                                                       gs(TensorRole::kExpertGateUpBias), s));
    return {};
  }

  // Token ids and targets are checked on the host before they reach a kernel (as the CPU ops do).
  Status check_ids(const int32_t* ids, const char* what, bool allow_ignore) const {
    for (int64_t i = 0; i < dims_.N; ++i) {
      const int32_t t = ids[i];
      if ((t < 0 || t >= dims_.V) && !(allow_ignore && t == -1))
        return invalid_argument(std::string(what) + " id " + std::to_string(t) + " at position " + std::to_string(i) +
                                " is outside the vocabulary [0, " + std::to_string(dims_.V) + ")" +
                                (allow_ignore ? " and is not the ignore index -1" : ""));
    }
    return {};
  }

  BackendOptions opt_;
  std::vector<float> inv_freq_;
  cuda::DeviceInfo dev_;
  cuda::AttnDims attn_;
  int64_t attn_rows_ = 0, vocab_chunk_ = 0;
  cudaStream_t streams_[kStreamCount] = {};
  cublasHandle_t blas_ = nullptr;
  // the private region
  void *blas_ws_ = nullptr, *attn_ws_ = nullptr, *col_ws_ = nullptr;
  int32_t *tokens_ = nullptr, *targets_ = nullptr, *positions_ = nullptr;
  int32_t *g_unique_ = nullptr, *g_offsets_ = nullptr, *g_positions_ = nullptr;
  int32_t* docs_dev_ = nullptr;               // Buf::kDocuments: starts [N], then positions [N]
  std::vector<int32_t> doc_host_, doc_sent_;  // this call's, and what the device holds
  float* inv_freq_dev_ = nullptr;
  double* loss_dev_ = nullptr;
  long long* count_dev_ = nullptr;
  int32_t* sort_scratch_ = nullptr;
  void** gemm_ptrs_ = nullptr;
  double* aux_dev_ = nullptr;
  float* aux_grad_dev_ = nullptr;
  // host copies: the experts' row offsets of the layer at hand, the load-balancing gradient in fp32
  std::vector<int32_t> offsets_host_;
  std::vector<float> aux_grad_host_;
  // pinned host memory
  std::vector<std::pair<void*, int64_t>> registered_;
  int64_t pinned_ = 0, unpinned_ = 0, pinned_limit_ = 0;
  void* staging_ = nullptr;
  int64_t staging_bytes_ = 0;
};

}  // namespace

bool have_cuda_backend() { return true; }

#ifdef MEGATRAIN_HAVE_NCCL
std::string nccl_unavailable_reason() {
  auto v = cuda_nccl::nccl_version();
  return v.ok() ? "" : v.status().message();
}
#endif

// The CUDA backend's own sizes for these shapes: layer activations, layer workspace and head
// workspace (floats) and its private bytes, in out[0..3]. The constructor touches no device, so
// this runs without a GPU: tests/executor/cuda_trainer_test.cpp compares it with step::cuda_layout
// on any machine with a CUDA build (the same comparison on a real backend needs the GPU).
void cuda_backend_figures(const Dims& dims, DType compute, std::vector<float> inv_freq, int64_t out[4]) {
  BackendOptions o;
  o.compute = o.transfer = compute;
  auto figures = [&](const Backend& b) {
    out[0] = b.layer_act_floats();
    out[1] = b.layer_workspace_floats();
    out[2] = b.head_workspace_floats();
    out[3] = b.private_bytes();
  };
  if (compute == DType::kBf16)
    figures(CudaBackend<bf16>(dims, o, std::move(inv_freq), cuda::DeviceInfo{}));
  else
    figures(CudaBackend<float>(dims, o, std::move(inv_freq), cuda::DeviceInfo{}));
}

Result<std::unique_ptr<Backend>> make_cuda_backend(const ModelSpec& model, const Dims& dims, const BackendOptions& options,
                                                   std::vector<float> inv_freq) {
  (void)model;
  if (dims.moe && (dims.E > cuda::kMoeMaxExperts || dims.N * dims.k > 2147483647))
    return unsupported("--backend cuda: " + std::to_string(dims.E) + " experts and " + std::to_string(dims.N * dims.k) +
                       " token slots per micro-batch; accepted: at most " + std::to_string(cuda::kMoeMaxExperts) +
                       " experts and fewer than 2^31 slots");
  MT_ASSIGN_OR_RETURN(std::vector<cuda::DeviceInfo> devices, cuda::list_devices());
  if (devices.empty()) return unavailable("--backend cuda: no CUDA device is visible; accepted here: --backend cpu");
  // A data-parallel rank takes the GPU of its index among its node's ranks.
  const int want = std::max(0, options.device);
  if (want >= static_cast<int>(devices.size()))
    return unavailable("--backend cuda: this rank is number " + std::to_string(want) + " on its node and takes GPU " + std::to_string(want) +
                       ", but " + std::to_string(devices.size()) + " CUDA device(s) are visible; accepted: at most " +
                       std::to_string(devices.size()) + " ranks per node (one GPU each)");
  const cuda::DeviceInfo& device = devices[static_cast<size_t>(want)];
  if (device.compute_major < 8)
    return unsupported("--backend cuda: " + device.name + " (sm_" + std::to_string(device.compute_major) +
                       std::to_string(device.compute_minor) + ") has no bf16 tensor cores; accepted: sm_80 or newer, or --backend cpu");
  if (dims.hd % 2 != 0) return invalid_argument("head_dim " + std::to_string(dims.hd) + " is odd; RoPE needs an even head_dim");
  if (options.compute != options.transfer || (options.compute != DType::kBf16 && options.compute != DType::kFp32))
    return unsupported(std::string("precision: the CUDA backend streams weights in the dtype it computes in; got compute ") +
                       dtype_name(options.compute) + " with transfer " + dtype_name(options.transfer) +
                       "; accepted: compute bf16 with transfer bf16 (mixed precision), or fp32 with fp32");
  std::unique_ptr<Backend> be;
  if (options.compute == DType::kBf16) {
    auto b = std::make_unique<CudaBackend<bf16>>(dims, options, std::move(inv_freq), device);
    MT_RETURN_IF_ERROR(b->init());
    be = std::move(b);
  } else {
    auto b = std::make_unique<CudaBackend<float>>(dims, options, std::move(inv_freq), device);
    MT_RETURN_IF_ERROR(b->init());
    be = std::move(b);
  }
  return be;
}

}  // namespace megatrain::exec

// The profiler's GPU probe (built with MEGATRAIN_CUDA): H2D/D2H by transfer size from pinned and
// pageable memory, both directions at once, device memory bandwidth, cuBLAS fp32/TF32/bf16 GEMMs
// at the layer shapes, and the MoE experts' grouped GEMMs (one strided-batched call per projection). Times come from CUDA events on one stream; every call is checked.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "detail/profile_probes.h"
#include "megatrain/kernels/cuda_device.h"

namespace megatrain::planner::detail {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  return internal_error(std::string("GPU probe: ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define MT_PROBE_CUDA(stmt)                                           \
  do {                                                                \
    cudaError_t mt_e_ = (stmt);                                       \
    if (mt_e_ != cudaSuccess) return cuda_status(mt_e_, #stmt);       \
  } while (0)
#define MT_PROBE_CUBLAS(stmt)                                                                           \
  do {                                                                                                  \
    cublasStatus_t mt_s_ = (stmt);                                                                      \
    if (mt_s_ != CUBLAS_STATUS_SUCCESS)                                                                 \
      return internal_error(std::string("GPU probe: ") + #stmt + ": cuBLAS status " + std::to_string(static_cast<int>(mt_s_))); \
  } while (0)

// Everything the probe allocates, released on every path.
struct Resources {
  void* h_pinned = nullptr;
  void* h_pinned2 = nullptr;
  void* h_pageable = nullptr;
  void* d_a = nullptr;
  void* d_b = nullptr;
  void* d_c = nullptr;
  cudaStream_t s1 = nullptr, s2 = nullptr;
  cudaEvent_t e[4] = {nullptr, nullptr, nullptr, nullptr};
  cublasHandle_t blas = nullptr;
  ~Resources() {
    if (blas) cublasDestroy(blas);
    for (auto ev : e)
      if (ev) cudaEventDestroy(ev);
    if (s1) cudaStreamDestroy(s1);
    if (s2) cudaStreamDestroy(s2);
    if (h_pinned) cudaFreeHost(h_pinned);
    if (h_pinned2) cudaFreeHost(h_pinned2);
    std::free(h_pageable);
    if (d_a) cudaFree(d_a);
    if (d_b) cudaFree(d_b);
    if (d_c) cudaFree(d_c);
  }
};

// Best per-transfer time of `reps` batches of `batch` copies (events around each batch).
Result<double> time_copies(Resources& r, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int batch, int reps) {
  double best = 1e300;
  for (int rep = 0; rep < reps; ++rep) {
    MT_PROBE_CUDA(cudaEventRecord(r.e[0], r.s1));
    for (int i = 0; i < batch; ++i) MT_PROBE_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, r.s1));
    MT_PROBE_CUDA(cudaEventRecord(r.e[1], r.s1));
    MT_PROBE_CUDA(cudaEventSynchronize(r.e[1]));
    float ms = 0;
    MT_PROBE_CUDA(cudaEventElapsedTime(&ms, r.e[0], r.e[1]));
    best = std::min(best, 1e-3 * ms / batch);
  }
  return best;
}

}  // namespace

// Seconds per call of a cuBLAS call on r.s1: one untimed warm-up (heuristics, workspace), then the
// best of 3 timings of `batch` calls back to back, batch sized to about 2 GFLOP per timing.
template <typename Call>
Result<double> time_cublas(Resources& r, double flops, Call&& call) {
  MT_PROBE_CUBLAS(call());
  const int batch = static_cast<int>(std::clamp(2e9 / std::max(flops, 1.0), 1.0, 200.0));
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    MT_PROBE_CUDA(cudaEventRecord(r.e[0], r.s1));
    for (int i = 0; i < batch; ++i) MT_PROBE_CUBLAS(call());
    MT_PROBE_CUDA(cudaEventRecord(r.e[1], r.s1));
    MT_PROBE_CUDA(cudaEventSynchronize(r.e[1]));
    float ms = 0;
    MT_PROBE_CUDA(cudaEventElapsedTime(&ms, r.e[0], r.e[1]));
    best = std::min(best, 1e-3 * ms / batch);
  }
  return best;
}

Result<std::string> gpu_present() {
  MT_ASSIGN_OR_RETURN(auto devices, cuda::list_devices());
  return devices.front().name;
}

Result<GpuProbe> probe_gpu(const ProfileSizes& sizes, const std::vector<GemmSample>& shapes,
                           const std::vector<GroupedGemmSample>& grouped, const std::vector<int64_t>& grid_tokens,
                           const std::vector<int64_t>& grid_sizes, const Progress& progress) {
  MT_ASSIGN_OR_RETURN(auto devices, cuda::list_devices());
  const cuda::DeviceInfo& dev = devices.front();
  MT_PROBE_CUDA(cudaSetDevice(dev.index));
  GpuProbe out;
  out.name = dev.name;
  out.free_memory_bytes = static_cast<double>(dev.free_memory_bytes);

  Resources r;
  int64_t largest = 1 << 20;
  for (int64_t b : sizes.copy_bytes) largest = std::max(largest, b);
  const size_t big = static_cast<size_t>(largest);
  MT_PROBE_CUDA(cudaMallocHost(&r.h_pinned, big));
  MT_PROBE_CUDA(cudaMallocHost(&r.h_pinned2, big));
  r.h_pageable = std::malloc(big);
  if (!r.h_pageable) return resource_exhausted("GPU probe: cannot allocate " + std::to_string(big) + " pageable bytes");
  std::memset(r.h_pageable, 1, big);
  std::memset(r.h_pinned, 1, big);
  std::memset(r.h_pinned2, 1, big);
  MT_PROBE_CUDA(cudaMalloc(&r.d_a, big));
  MT_PROBE_CUDA(cudaMalloc(&r.d_b, big));
  MT_PROBE_CUDA(cudaStreamCreateWithFlags(&r.s1, cudaStreamNonBlocking));
  MT_PROBE_CUDA(cudaStreamCreateWithFlags(&r.s2, cudaStreamNonBlocking));
  for (auto& ev : r.e) MT_PROBE_CUDA(cudaEventCreate(&ev));

  // Transfers by size: batches sized so each lasts about a millisecond or more.
  if (progress) progress("H2D/D2H pinned and pageable, " + std::to_string(sizes.copy_bytes.size()) + " sizes");
  for (int64_t b : sizes.copy_bytes) {
    const size_t bytes = static_cast<size_t>(b);
    const int batch = static_cast<int>(std::clamp<int64_t>((8ll << 20) / b, 1, 64));
    const int reps = 5;
    MT_ASSIGN_OR_RETURN(double t1, time_copies(r, r.d_a, r.h_pinned, bytes, cudaMemcpyHostToDevice, batch, reps));
    MT_ASSIGN_OR_RETURN(double t2, time_copies(r, r.d_a, r.h_pageable, bytes, cudaMemcpyHostToDevice, batch, reps));
    MT_ASSIGN_OR_RETURN(double t3, time_copies(r, r.h_pinned, r.d_a, bytes, cudaMemcpyDeviceToHost, batch, reps));
    MT_ASSIGN_OR_RETURN(double t4, time_copies(r, r.h_pageable, r.d_a, bytes, cudaMemcpyDeviceToHost, batch, reps));
    out.h2d_pinned.emplace_back(static_cast<double>(b), t1);
    out.h2d_pageable.emplace_back(static_cast<double>(b), t2);
    out.d2h_pinned.emplace_back(static_cast<double>(b), t3);
    out.d2h_pageable.emplace_back(static_cast<double>(b), t4);
  }

  // Both directions at once (two streams), largest size, against each alone.
  {
    if (progress) progress("H2D and D2H at once");
    const int n = 8;
    MT_ASSIGN_OR_RETURN(double alone_h2d, time_copies(r, r.d_a, r.h_pinned, big, cudaMemcpyHostToDevice, n, 2));
    MT_ASSIGN_OR_RETURN(double alone_d2h, time_copies(r, r.h_pinned2, r.d_b, big, cudaMemcpyDeviceToHost, n, 2));
    MT_PROBE_CUDA(cudaDeviceSynchronize());
    MT_PROBE_CUDA(cudaEventRecord(r.e[0], r.s1));
    MT_PROBE_CUDA(cudaStreamWaitEvent(r.s2, r.e[0], 0));
    for (int i = 0; i < n; ++i) {
      MT_PROBE_CUDA(cudaMemcpyAsync(r.d_a, r.h_pinned, big, cudaMemcpyHostToDevice, r.s1));
      MT_PROBE_CUDA(cudaMemcpyAsync(r.h_pinned2, r.d_b, big, cudaMemcpyDeviceToHost, r.s2));
    }
    MT_PROBE_CUDA(cudaEventRecord(r.e[1], r.s1));
    MT_PROBE_CUDA(cudaEventRecord(r.e[2], r.s2));
    MT_PROBE_CUDA(cudaEventSynchronize(r.e[1]));
    MT_PROBE_CUDA(cudaEventSynchronize(r.e[2]));
    float ms1 = 0, ms2 = 0;
    MT_PROBE_CUDA(cudaEventElapsedTime(&ms1, r.e[0], r.e[1]));
    MT_PROBE_CUDA(cudaEventElapsedTime(&ms2, r.e[0], r.e[2]));
    const double both_h2d = 1e-3 * ms1 / n, both_d2h = 1e-3 * ms2 / n;
    out.duplex_ratio = 0.5 * (alone_h2d / both_h2d + alone_d2h / both_d2h);
  }

  // Device memory bandwidth: device-to-device copy reads and writes each byte.
  {
    if (progress) progress("device memory bandwidth");
    MT_ASSIGN_OR_RETURN(double t, time_copies(r, r.d_b, r.d_a, big, cudaMemcpyDeviceToDevice, 10, 5));
    out.memory_bandwidth = 2.0 * static_cast<double>(big) / t;
  }
  cudaFree(r.d_a);
  cudaFree(r.d_b);
  r.d_a = r.d_b = nullptr;

  // GEMMs: row-major C[m, n] = A[m, k] B[n, k]^T, as a linear layer computes. Column-major cuBLAS
  // sees C as C^T (n x m) = B A^T, where B is a k x n column-major array (op T) and A a k x m one (op N).
  int64_t amax = 1, bmax = 1, cmax = 1;
  for (const GemmSample& s : shapes) {
    amax = std::max(amax, s.m * s.k);
    bmax = std::max(bmax, s.n * s.k);
    cmax = std::max(cmax, s.m * s.n);
  }
  MT_PROBE_CUDA(cudaMalloc(&r.d_a, static_cast<size_t>(amax) * 4));
  MT_PROBE_CUDA(cudaMalloc(&r.d_b, static_cast<size_t>(bmax) * 4));
  MT_PROBE_CUDA(cudaMalloc(&r.d_c, static_cast<size_t>(cmax) * 4));
  MT_PROBE_CUDA(cudaMemset(r.d_a, 0, static_cast<size_t>(amax) * 4));
  MT_PROBE_CUDA(cudaMemset(r.d_b, 0, static_cast<size_t>(bmax) * 4));
  MT_PROBE_CUBLAS(cublasCreate(&r.blas));
  MT_PROBE_CUBLAS(cublasSetStream(r.blas, r.s1));
  enum class Mode { kFp32, kTf32, kBf16 };
  auto time_gemm = [&](const GemmSample& s, Mode mode) -> Result<double> {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType_t t = mode == Mode::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t c = mode == Mode::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    auto call = [&]() -> cublasStatus_t {
      return cublasGemmEx(r.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n), static_cast<int>(s.m),
                          static_cast<int>(s.k), &one, r.d_b, t, static_cast<int>(s.k), r.d_a, t, static_cast<int>(s.k),
                          &zero, r.d_c, t, static_cast<int>(s.n), c, CUBLAS_GEMM_DEFAULT);
    };
    return time_cublas(r, s.flops(), call);
  };
  if (progress) progress("cuBLAS bf16 GEMMs, " + std::to_string(shapes.size()) + " shapes");
  for (GemmSample s : shapes) {
    MT_ASSIGN_OR_RETURN(s.seconds, time_gemm(s, Mode::kBf16));
    out.bf16_samples.push_back(s);
    out.matmul_bf16 = std::max(out.matmul_bf16, s.flops() / s.seconds);
  }
  // fp32 and TF32 peaks at the largest shape.
  const GemmSample* biggest = &shapes.front();
  for (const GemmSample& s : shapes)
    if (s.flops() > biggest->flops()) biggest = &s;
  if (progress) progress("cuBLAS fp32 and TF32 peaks");
  MT_ASSIGN_OR_RETURN(double t32, time_gemm(*biggest, Mode::kFp32));
  MT_ASSIGN_OR_RETURN(double ttf, time_gemm(*biggest, Mode::kTf32));
  out.matmul_fp32 = biggest->flops() / t32;
  out.matmul_tf32 = biggest->flops() / ttf;

  // The GEMM shape grid: a linear's three bf16 GEMMs (fp32 accumulate) as the CUDA backend lays them
  // out, row-major, seen column-major by cuBLAS:
  //   forward  y[N, out] = x[N, in] W[out, in]^T:  y^T (out x N) = W (op T, ld in) x^T (op N, ld in)
  //   dX       dx[N, in] = dy[N, out] W[out, in]:  dx^T (in x N) = W^T (op N, ld in) dy^T (op N, ld out)
  //   dW       dW[out, in] = dy^T x:               dW^T (in x out) = x^T (op N, ld in) dy (op T, ld out)
  if (!grid_tokens.empty() && !grid_sizes.empty()) {
    LinearGrid& g = out.grid;
    g.tokens = grid_tokens;
    g.sizes = grid_sizes;
    const size_t n = grid_tokens.size() * grid_sizes.size() * grid_sizes.size();
    for (auto& v : g.seconds) v.assign(n, 0.0);
    auto timed = [&](int64_t t, int64_t i, int64_t o) { return grid_cell_timed(t, i, o, kGpuGridMaxFlops, kGpuGridMaxElems); };
    int64_t xs = 1, ws = 1, ys = 1;
    for (int64_t t : grid_tokens)
      for (int64_t i : grid_sizes)
        for (int64_t o : grid_sizes)
          if (timed(t, i, o)) {
            xs = std::max(xs, t * i);
            ws = std::max(ws, i * o);
            ys = std::max(ys, t * o);
          }
    cudaFree(r.d_a);
    cudaFree(r.d_b);
    cudaFree(r.d_c);
    r.d_a = r.d_b = r.d_c = nullptr;
    MT_PROBE_CUDA(cudaMalloc(&r.d_a, static_cast<size_t>(xs) * 2));  // x, or dx
    MT_PROBE_CUDA(cudaMalloc(&r.d_b, static_cast<size_t>(ws) * 2));  // W, or dW
    MT_PROBE_CUDA(cudaMalloc(&r.d_c, static_cast<size_t>(ys) * 2));  // y, or dy
    MT_PROBE_CUDA(cudaMemset(r.d_a, 0, static_cast<size_t>(xs) * 2));
    MT_PROBE_CUDA(cudaMemset(r.d_b, 0, static_cast<size_t>(ws) * 2));
    MT_PROBE_CUDA(cudaMemset(r.d_c, 0, static_cast<size_t>(ys) * 2));
    if (progress) progress("cuBLAS bf16 linears by shape (forward, dX, dW), " + std::to_string(n) + " cells each");
    const float one = 1.0f, zero = 0.0f;
    for (size_t a = 0; a < grid_tokens.size(); ++a)
      for (size_t b = 0; b < grid_sizes.size(); ++b)
        for (size_t c = 0; c < grid_sizes.size(); ++c) {
          const int t = static_cast<int>(grid_tokens[a]), in = static_cast<int>(grid_sizes[b]), o = static_cast<int>(grid_sizes[c]);
          if (!timed(t, in, o)) continue;
          const size_t cell = (a * grid_sizes.size() + b) * grid_sizes.size() + c;
          const double f = 2.0 * t * static_cast<double>(in) * o;
          auto fwd = [&]() -> cublasStatus_t {
            return cublasGemmEx(r.blas, CUBLAS_OP_T, CUBLAS_OP_N, o, t, in, &one, r.d_b, CUDA_R_16BF, in, r.d_a, CUDA_R_16BF, in,
                                &zero, r.d_c, CUDA_R_16BF, o, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          };
          auto dx = [&]() -> cublasStatus_t {
            return cublasGemmEx(r.blas, CUBLAS_OP_N, CUBLAS_OP_N, in, t, o, &one, r.d_b, CUDA_R_16BF, in, r.d_c, CUDA_R_16BF, o,
                                &zero, r.d_a, CUDA_R_16BF, in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          };
          auto dw = [&]() -> cublasStatus_t {
            return cublasGemmEx(r.blas, CUBLAS_OP_N, CUBLAS_OP_T, in, o, t, &one, r.d_a, CUDA_R_16BF, in, r.d_c, CUDA_R_16BF, o,
                                &one, r.d_b, CUDA_R_16BF, in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
          };
          MT_ASSIGN_OR_RETURN(g.seconds[0][cell], time_cublas(r, f, fwd));
          MT_ASSIGN_OR_RETURN(g.seconds[1][cell], time_cublas(r, f, dx));
          MT_ASSIGN_OR_RETURN(g.seconds[2][cell], time_cublas(r, f, dw));
        }
  }

  // Grouped GEMMs: every expert's projection in one cublasGemmStridedBatchedEx call, expert e's
  // rows contiguous after expert e-1's (the permuted tokens), its weights [n, k] at e * n * k; row
  // major C_e[rows, n] = A_e[rows, k] B_e[n, k]^T, seen by cuBLAS as C_e^T = B_e A_e^T (as above).
  if (!grouped.empty()) {
    int64_t ga = 1, gb = 1, gc = 1;
    for (const GroupedGemmSample& g : grouped) {
      ga = std::max(ga, g.experts * g.rows * g.k);
      gb = std::max(gb, g.experts * g.n * g.k);
      gc = std::max(gc, g.experts * g.rows * g.n);
    }
    cudaFree(r.d_a);
    cudaFree(r.d_b);
    cudaFree(r.d_c);
    r.d_a = r.d_b = r.d_c = nullptr;
    MT_PROBE_CUDA(cudaMalloc(&r.d_a, static_cast<size_t>(ga) * 2));
    MT_PROBE_CUDA(cudaMalloc(&r.d_b, static_cast<size_t>(gb) * 2));
    MT_PROBE_CUDA(cudaMalloc(&r.d_c, static_cast<size_t>(gc) * 2));
    MT_PROBE_CUDA(cudaMemset(r.d_a, 0, static_cast<size_t>(ga) * 2));
    MT_PROBE_CUDA(cudaMemset(r.d_b, 0, static_cast<size_t>(gb) * 2));
    if (progress) progress("cuBLAS strided-batched bf16 GEMMs (MoE experts), " + std::to_string(grouped.size()) + " shapes");
    for (GroupedGemmSample g : grouped) {
      const float one = 1.0f, zero = 0.0f;
      auto call = [&]() -> cublasStatus_t {
        return cublasGemmStridedBatchedEx(r.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(g.n), static_cast<int>(g.rows),
                                          static_cast<int>(g.k), &one, r.d_b, CUDA_R_16BF, static_cast<int>(g.k),
                                          static_cast<long long>(g.n * g.k), r.d_a, CUDA_R_16BF, static_cast<int>(g.k),
                                          static_cast<long long>(g.rows * g.k), &zero, r.d_c, CUDA_R_16BF,
                                          static_cast<int>(g.n), static_cast<long long>(g.rows * g.n),
                                          static_cast<int>(g.experts), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      };
      MT_ASSIGN_OR_RETURN(g.seconds, time_cublas(r, g.flops(), call));
      out.grouped_bf16.push_back(g);
    }
  }
  return out;
}

}  // namespace megatrain::planner::detail

// The experts' GEMMs as one cuBLAS call per projection.
//
// Why cublasGemmGroupedBatchedEx. The experts' row counts differ from one micro-batch to the next
// (they are the router's choices), so the problems of one projection have equal n and k but
// different m. cuBLAS 12.5 added cublasGemmGroupedBatchedEx, which takes per-group shapes (host
// arrays) and per-problem pointers (device arrays); CUDA 13.0 here has it (cublas_api.h), so each
// non-empty expert is one group of one problem and the whole projection is one call. The
// alternatives were worse: cublasGemmBatchedEx needs equal shapes, i.e. every expert padded to the
// largest row count (device memory that grows with the routing's imbalance, unknown when the
// arena is sized, and wasted FLOPs); a loop over experts is E launches per projection (128 for
// Qwen3-30B-A3B), microseconds each, against a layer's milliseconds.
//
// The fallback. cuBLAS documents a narrower set of type combinations for the grouped call than
// for cublasGemmEx; the mixed-precision path also needs bf16 inputs with fp32 outputs (the weight
// gradients accumulate in fp32, and the experts' input gradient is fp32 like the dense MLP's).
// So the first grouped call of each (input, output) type pair is checked: if cuBLAS refuses it,
// that pair runs as one cublasGemmEx per expert from then on (the same arithmetic: fp32
// accumulation, no TF32), and grouped_gemm_path() says so with cuBLAS's status, which the CUDA
// backend reports. Both paths are deterministic for a fixed device and launch configuration, like
// every cuBLAS GEMM (no split-K atomics are requested; CUBLAS_GEMM_DEFAULT).
//
// Row-major to column-major as in gemm.cu: the row-major C = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T, so operands swap and m, n swap; the transpose flags stay.
#include "cuda/grouped_gemm.cuh"

#include <atomic>
#include <type_traits>
#include <vector>

#include "cuda/gemm.cuh"

namespace megatrain::cuda {

namespace {


std::atomic<bool> g_force_loop{false};

// Per (T, C): 0 not used yet, 1 the grouped call works, 2 the loop (with the refusing status);
// and how many calls ran as the loop because an operand was not 16-byte aligned.
template <typename T, typename C>
struct PathState {
  static inline std::atomic<int> mode{0};
  static inline std::atomic<int> refused{CUBLAS_STATUS_SUCCESS};
  static inline std::atomic<int64_t> misaligned{0};
};

// One row-major problem C[m, n] = alpha op(A) op(B) + beta C (all problems share op and alpha/beta).
struct Problem {
  int m, n, k;
  const void* a;
  int lda;
  const void* b;
  int ldb;
  void* c;
  int ldc;
};

constexpr int64_t kMaxDim = 2147483647;

Status check_sizes(const char* what, int64_t e, int64_t in, int64_t out, const int32_t* offsets) {
  if (e < 1 || in < 0 || out < 0 || in > kMaxDim || out > kMaxDim)
    return invalid_argument(std::string(what) + ": experts " + std::to_string(e) + ", in " + std::to_string(in) + ", out " +
                            std::to_string(out) + ": accepted at least one expert and sizes in [0, 2^31)");
  if (offsets[0] != 0)
    return invalid_argument(std::string(what) + ": offsets[0] is " + std::to_string(offsets[0]) + "; accepted: 0");
  for (int64_t g = 0; g < e; ++g)
    if (offsets[g + 1] < offsets[g])
      return invalid_argument(std::string(what) + ": offsets decrease at expert " + std::to_string(g) + " (" +
                              std::to_string(offsets[g]) + " > " + std::to_string(offsets[g + 1]) +
                              "); accepted: non-decreasing host offsets of moe_permute");
  return {};
}

template <typename T, typename C>
Status run_loop(cublasHandle_t h, bool ta, bool tb, float alpha, float beta, const std::vector<Problem>& ps) {
  for (const Problem& p : ps)
    MT_CUBLAS_RETURN(cublasGemmEx(h, cublas_op(tb), cublas_op(ta), p.n, p.m, p.k, &alpha, p.b, cublas_data_type<T>(), p.ldb, p.a, cublas_data_type<T>(),
                                  p.lda, &beta, p.c, cublas_data_type<C>(), p.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return {};
}

template <typename T, typename C>
Status run_grouped(cublasHandle_t h, bool ta, bool tb, float alpha, float beta, const std::vector<Problem>& ps,
                   void** dev_ptrs) {
  if (ps.empty()) return {};
  using S = PathState<T, C>;
  if (g_force_loop.load() || S::mode.load() == 2) return run_loop<T, C>(h, ta, tb, alpha, beta, ps);
  for (const Problem& p : ps)
    if (!grouped_operand_aligned(p.a, p.lda, sizeof(T)) || !grouped_operand_aligned(p.b, p.ldb, sizeof(T)) ||
        !grouped_operand_aligned(p.c, p.ldc, sizeof(C))) {
      S::misaligned.fetch_add(1);
      return run_loop<T, C>(h, ta, tb, alpha, beta, ps);
    }
  const int groups = static_cast<int>(ps.size());
  // Column-major arguments (operands swapped, see the file comment).
  std::vector<cublasOperation_t> opa(ps.size(), cublas_op(tb)), opb(ps.size(), cublas_op(ta));
  std::vector<int> m(ps.size()), n(ps.size()), k(ps.size()), lda(ps.size()), ldb(ps.size()), ldc(ps.size()), size(ps.size(), 1);
  std::vector<float> alphas(ps.size(), alpha), betas(ps.size(), beta);
  std::vector<const void*> ptrs(3 * ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const Problem& p = ps[i];
    m[i] = p.n;
    n[i] = p.m;
    k[i] = p.k;
    ptrs[i] = p.b;
    lda[i] = p.ldb;
    ptrs[ps.size() + i] = p.a;
    ldb[i] = p.lda;
    ptrs[2 * ps.size() + i] = p.c;
    ldc[i] = p.ldc;
  }
  cudaStream_t s = nullptr;
  MT_CUBLAS_RETURN(cublasGetStream(h, &s));
  // Pageable source: the call returns once the host array is staged, and the copy is ordered on s
  // before the GEMM that reads it (and after the previous call's GEMM, which read the last arrays).
  MT_CUDA_RETURN(cudaMemcpyAsync(dev_ptrs, ptrs.data(), sizeof(void*) * ptrs.size(), cudaMemcpyHostToDevice, s));
  const auto* const* a_arr = reinterpret_cast<const void* const*>(dev_ptrs);
  const auto* const* b_arr = reinterpret_cast<const void* const*>(dev_ptrs + groups);
  auto* const* c_arr = reinterpret_cast<void* const*>(dev_ptrs + 2 * groups);
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(h, opa.data(), opb.data(), m.data(), n.data(), k.data(), alphas.data(),
                                                       a_arr, cublas_data_type<T>(), lda.data(), b_arr, cublas_data_type<T>(), ldb.data(),
                                                       betas.data(), c_arr, cublas_data_type<C>(), ldc.data(), groups, size.data(),
                                                       CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_SUCCESS) {
    S::mode.store(1);
    return {};
  }
  if (S::mode.load() == 1)  // it has worked for this type pair before: a real failure
    return internal_error(std::string("cublasGemmGroupedBatchedEx failed: ") + cublas_status_name(st));
  // Refused on first use (a type combination this cuBLAS does not group): the loop, from now on.
  const Status looped = run_loop<T, C>(h, ta, tb, alpha, beta, ps);
  if (!looped.ok()) return looped;
  S::refused.store(static_cast<int>(st));
  S::mode.store(2);
  return {};
}

}  // namespace

template <typename T, typename C>
std::string grouped_gemm_path() {
  using S = PathState<T, C>;
  if (g_force_loop.load()) return "one cublasGemmEx per expert (forced)";
  const int64_t loose = S::misaligned.load();
  const std::string misaligned =
      loose > 0 ? "; " + std::to_string(loose) + " calls with an operand off a 16-byte boundary ran as one cublasGemmEx per expert" : "";
  switch (S::mode.load()) {
    case 1: return "cublasGemmGroupedBatchedEx" + misaligned;
    case 2:
      return std::string("one cublasGemmEx per expert (cublasGemmGroupedBatchedEx refused this type pair: ") +
             cublas_status_name(static_cast<cublasStatus_t>(S::refused.load())) + ")";
    default: return loose > 0 ? "one cublasGemmEx per expert" + misaligned : "not used yet";
  }
}

void force_grouped_gemm_loop(bool on) { g_force_loop.store(on); }

namespace {

// The problems of one grouped GEMM: one per expert g with rows (offsets[g] .. offsets[g + 1]).
template <typename F>
std::vector<Problem> per_expert(const int32_t* offsets, int64_t e, F&& problem_of) {
  std::vector<Problem> ps;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows > 0) ps.push_back(problem_of(g, r0, static_cast<int>(rows)));
  }
  return ps;
}

// The three grouped products for either weight layout: W_g [out, in] (nn.Linear, x W^T) or, with
// w_in_out, W_g [in, out] (gpt-oss's stacked experts, x @ W): the same problems with the weight's
// transpose flag flipped and its leading dimension `out` (the weight gradient's operands swap).
template <typename T, typename Y>
Status experts_forward(const char* what, bool w_in_out, cublasHandle_t h, const T* x, const T* w, int64_t w_stride,
                       const int32_t* offsets, int64_t e, int64_t in, int64_t out, Y* y, float beta, void** dev_ptrs) {
  MT_RETURN_IF_ERROR(check_sizes(what, e, in, out, offsets));
  if (in == 0 || out == 0) return {};
  const int i = static_cast<int>(in), o = static_cast<int>(out);
  // y_g[rows, out] = x_g[rows, in] W_g^T (W_g [out, in]) or x_g W_g (W_g [in, out])
  const auto ps = per_expert(offsets, e, [&](int64_t g, int64_t r0, int rows) {
    return Problem{rows, o, i, x + r0 * in, i, w + g * w_stride, w_in_out ? o : i, y + r0 * out, o};
  });
  return run_grouped<T, Y>(h, false, !w_in_out, 1.0f, beta, ps, dev_ptrs);
}

template <typename T, typename DX>
Status experts_backward_data(const char* what, bool w_in_out, cublasHandle_t h, const T* dy, const T* w, int64_t w_stride,
                             const int32_t* offsets, int64_t e, int64_t in, int64_t out, DX* dx, bool accumulate,
                             void** dev_ptrs) {
  MT_RETURN_IF_ERROR(check_sizes(what, e, in, out, offsets));
  if (in == 0) return {};
  const int i = static_cast<int>(in), o = static_cast<int>(out);
  // dx_g[rows, in] = dy_g[rows, out] W_g (W_g [out, in]) or dy_g W_g^T (W_g [in, out])
  const auto ps = per_expert(offsets, e, [&](int64_t g, int64_t r0, int rows) {
    return Problem{rows, i, o, dy + r0 * out, o, w + g * w_stride, w_in_out ? o : i, dx + r0 * in, i};
  });
  return run_grouped<T, DX>(h, false, w_in_out, 1.0f, accumulate ? 1.0f : 0.0f, ps, dev_ptrs);
}

template <typename T>
Status experts_backward_weight(const char* what, bool w_in_out, cublasHandle_t h, const T* dy, const T* x,
                               const int32_t* offsets, int64_t e, int64_t in, int64_t out, float* dw, int64_t dw_stride,
                               void** dev_ptrs) {
  MT_RETURN_IF_ERROR(check_sizes(what, e, in, out, offsets));
  if (in == 0 || out == 0) return {};
  const int i = static_cast<int>(in), o = static_cast<int>(out);
  // dW_g[out, in] += dy_g^T x_g, or dW_g[in, out] += x_g^T dy_g
  const auto ps = per_expert(offsets, e, [&](int64_t g, int64_t r0, int rows) {
    return w_in_out ? Problem{i, o, rows, x + r0 * in, i, dy + r0 * out, o, dw + g * dw_stride, o}
                    : Problem{o, i, rows, dy + r0 * out, o, x + r0 * in, i, dw + g * dw_stride, i};
  });
  return run_grouped<T, float>(h, true, false, 1.0f, 1.0f, ps, dev_ptrs);
}

}  // namespace

template <typename T, typename Y>
Status grouped_linear_forward(cublasHandle_t h, const T* x, const T* w, int64_t w_stride, const int32_t* offsets, int64_t e,
                              int64_t in, int64_t out, Y* y, float beta, void** dev_ptrs) {
  return experts_forward<T, Y>("grouped_linear_forward", false, h, x, w, w_stride, offsets, e, in, out, y, beta, dev_ptrs);
}

template <typename T, typename DX>
Status grouped_linear_backward_data(cublasHandle_t h, const T* dy, const T* w, int64_t w_stride, const int32_t* offsets,
                                    int64_t e, int64_t in, int64_t out, DX* dx, bool accumulate, void** dev_ptrs) {
  return experts_backward_data<T, DX>("grouped_linear_backward_data", false, h, dy, w, w_stride, offsets, e, in, out, dx,
                                      accumulate, dev_ptrs);
}

template <typename T>
Status grouped_linear_backward_weight(cublasHandle_t h, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t in,
                                      int64_t out, float* dw, int64_t dw_stride, void** dev_ptrs) {
  return experts_backward_weight<T>("grouped_linear_backward_weight", false, h, dy, x, offsets, e, in, out, dw, dw_stride,
                                    dev_ptrs);
}

template <typename T, typename Y>
Status grouped_matmul_forward(cublasHandle_t h, const T* x, const T* w, int64_t w_stride, const int32_t* offsets, int64_t e,
                              int64_t in, int64_t out, Y* y, float beta, void** dev_ptrs) {
  return experts_forward<T, Y>("grouped_matmul_forward", true, h, x, w, w_stride, offsets, e, in, out, y, beta, dev_ptrs);
}

template <typename T, typename DX>
Status grouped_matmul_backward_data(cublasHandle_t h, const T* dy, const T* w, int64_t w_stride, const int32_t* offsets,
                                    int64_t e, int64_t in, int64_t out, DX* dx, bool accumulate, void** dev_ptrs) {
  return experts_backward_data<T, DX>("grouped_matmul_backward_data", true, h, dy, w, w_stride, offsets, e, in, out, dx,
                                      accumulate, dev_ptrs);
}

template <typename T>
Status grouped_matmul_backward_weight(cublasHandle_t h, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t in,
                                      int64_t out, float* dw, int64_t dw_stride, void** dev_ptrs) {
  return experts_backward_weight<T>("grouped_matmul_backward_weight", true, h, dy, x, offsets, e, in, out, dw, dw_stride,
                                    dev_ptrs);
}

#define MT_GROUPED_INSTANTIATE(T, C)                                                                                    \
  template std::string grouped_gemm_path<T, C>();                                                                      \
  template Status grouped_linear_forward<T, C>(cublasHandle_t, const T*, const T*, int64_t, const int32_t*, int64_t,   \
                                               int64_t, int64_t, C*, float, void**);                                   \
  template Status grouped_linear_backward_data<T, C>(cublasHandle_t, const T*, const T*, int64_t, const int32_t*,      \
                                                     int64_t, int64_t, int64_t, C*, bool, void**);                     \
  template Status grouped_matmul_forward<T, C>(cublasHandle_t, const T*, const T*, int64_t, const int32_t*, int64_t,   \
                                               int64_t, int64_t, C*, float, void**);                                   \
  template Status grouped_matmul_backward_data<T, C>(cublasHandle_t, const T*, const T*, int64_t, const int32_t*,      \
                                                     int64_t, int64_t, int64_t, C*, bool, void**);
MT_GROUPED_INSTANTIATE(float, float)
MT_GROUPED_INSTANTIATE(bf16, bf16)
MT_GROUPED_INSTANTIATE(bf16, float)
#undef MT_GROUPED_INSTANTIATE
template Status grouped_linear_backward_weight<float>(cublasHandle_t, const float*, const float*, const int32_t*, int64_t,
                                                      int64_t, int64_t, float*, int64_t, void**);
template Status grouped_linear_backward_weight<bf16>(cublasHandle_t, const bf16*, const bf16*, const int32_t*, int64_t,
                                                     int64_t, int64_t, float*, int64_t, void**);
template Status grouped_matmul_backward_weight<float>(cublasHandle_t, const float*, const float*, const int32_t*, int64_t,
                                                      int64_t, int64_t, float*, int64_t, void**);
template Status grouped_matmul_backward_weight<bf16>(cublasHandle_t, const bf16*, const bf16*, const int32_t*, int64_t,
                                                     int64_t, int64_t, float*, int64_t, void**);

}  // namespace megatrain::cuda

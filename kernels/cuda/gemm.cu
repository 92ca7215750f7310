// GEMMs through cuBLAS (cublasGemmEx / cublasGemmStridedBatchedEx) with fp32 accumulation.
//
// Two-level batches (gemm_batched_2d): a kernel writes each problem's addresses into a device array
// and one cublasGemmBatchedEx runs them all: the attention's (kv group, head in group) grid, whose
// heads share their group's K and V (an inner stride of 0) and so are no single strided batch.
//
// Row-major to column-major: cuBLAS is column-major, and a row-major [m, n] matrix with leading
// dimension ld is, bit for bit, a column-major [n, m] matrix with the same ld. So the row-major
// C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap the operands, swap
// m and n, and keep each operand's transpose flag. No data moves.
//
// Types: A and B in T (fp32 or bf16), C in fp32 or T, compute CUBLAS_COMPUTE_32F always (bf16
// inputs use the tensor cores with fp32 accumulation; fp32 inputs stay true fp32, no TF32, so the
// fp32 path matches the CPU reference to rounding). alpha and beta are fp32 scalars on the host.
#include "cuda/gemm.cuh"

#include <string>
#include <type_traits>

namespace megatrain::cuda {

namespace {

// Problem z = o * n_inner + i: A, B and C at their two-level offsets (in bytes: the arrays are
// untyped), into pointers[z], pointers[count + z] and pointers[2 * count + z].
__global__ void fill_batch_pointers_kernel(const char* a, int64_t sa_o, int64_t sa_i, const char* b, int64_t sb_o, int64_t sb_i,
                                           char* c, int64_t sc_o, int64_t sc_i, int64_t n_outer, int64_t n_inner, void** pointers) {
  const int64_t count = n_outer * n_inner;
  const int64_t z = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (z >= count) return;
  const int64_t o = z / n_inner, i = z - o * n_inner;
  pointers[z] = const_cast<char*>(a + o * sa_o + i * sa_i);
  pointers[count + z] = const_cast<char*>(b + o * sb_o + i * sb_i);
  pointers[2 * count + z] = c + o * sc_o + i * sc_i;
}

Status check_dims(const char* what, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kMax = 2147483647;
  if (m < 0 || n < 0 || k < 0 || m > kMax || n > kMax || k > kMax)
    return invalid_argument(std::string(what) + ": dimensions m=" + std::to_string(m) + " n=" + std::to_string(n) +
                            " k=" + std::to_string(k) + " must be in [0, 2^31)");
  return {};
}

}  // namespace

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED (no handle, or no GPU)";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED (out of device memory)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (a bad size, leading dimension or type)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (the GPU lacks a needed feature)";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED (the kernel failed to run)";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (this type/layout combination)";
    default: return "an unknown cuBLAS status";
  }
}

template <typename T, typename C>
Status gemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a,
            int64_t lda, const T* b, int64_t ldb, float beta, C* c, int64_t ldc) {
  MT_RETURN_IF_ERROR(check_dims("gemm", m, n, k));
  if (m == 0 || n == 0) return {};
  MT_CUBLAS_RETURN(cublasGemmEx(h, cublas_op(trans_b), cublas_op(trans_a), static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                &alpha, b, cublas_data_type<T>(), static_cast<int>(ldb), a, cublas_data_type<T>(), static_cast<int>(lda),
                                &beta, c, cublas_data_type<C>(), static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return {};
}

template <typename T, typename C>
Status gemm_strided_batched(cublasHandle_t h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                            const T* a, int64_t lda, int64_t stride_a, const T* b, int64_t ldb, int64_t stride_b,
                            float beta, C* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  MT_RETURN_IF_ERROR(check_dims("gemm_strided_batched", m, n, k));
  if (m == 0 || n == 0 || batch == 0) return {};
  MT_CUBLAS_RETURN(cublasGemmStridedBatchedEx(
      h, cublas_op(trans_b), cublas_op(trans_a), static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
      cublas_data_type<T>(), static_cast<int>(ldb), stride_b, a, cublas_data_type<T>(), static_cast<int>(lda), stride_a, &beta, c,
      cublas_data_type<C>(), static_cast<int>(ldc), stride_c, static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return {};
}

template <typename T, typename C>
Status gemm_batched_2d(cublasHandle_t h, cudaStream_t s, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                       float alpha, const T* a, int64_t lda, int64_t sa_outer, int64_t sa_inner, const T* b, int64_t ldb,
                       int64_t sb_outer, int64_t sb_inner, float beta, C* c, int64_t ldc, int64_t sc_outer, int64_t sc_inner,
                       int64_t n_outer, int64_t n_inner, void** pointers) {
  MT_RETURN_IF_ERROR(check_dims("gemm_batched_2d", m, n, k));
  const int64_t count = n_outer * n_inner;
  if (m == 0 || n == 0 || count == 0) return {};
  if (count > 2147483647) return invalid_argument("gemm_batched_2d: " + std::to_string(count) + " problems; at most 2^31 - 1");
  constexpr int kThreads = 128;
  const int64_t ta = sizeof(T), tc = sizeof(C);
  fill_batch_pointers_kernel<<<static_cast<unsigned int>((count + kThreads - 1) / kThreads), kThreads, 0, s>>>(
      reinterpret_cast<const char*>(a), sa_outer * ta, sa_inner * ta, reinterpret_cast<const char*>(b), sb_outer * ta,
      sb_inner * ta, reinterpret_cast<char*>(c), sc_outer * tc, sc_inner * tc, n_outer, n_inner, pointers);
  MT_CUDA_LAUNCH_CHECK("gemm_batched_2d (pointers)");
  // Row-major as column-major: B's array first (see the file comment).
  MT_CUBLAS_RETURN(cublasGemmBatchedEx(
      h, cublas_op(trans_b), cublas_op(trans_a), static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
      const_cast<const void* const*>(pointers + count), cublas_data_type<T>(), static_cast<int>(ldb),
      const_cast<const void* const*>(pointers), cublas_data_type<T>(), static_cast<int>(lda), &beta, pointers + 2 * count,
      cublas_data_type<C>(), static_cast<int>(ldc), static_cast<int>(count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return {};
}

template <typename T, typename Y>
Status linear_forward(cublasHandle_t h, const T* x, const T* w, int64_t n, int64_t in, int64_t out, Y* y, float beta) {
  // y[n, out] = x[n, in] * W[out, in]^T
  return gemm<T, Y>(h, false, true, n, out, in, 1.0f, x, in, w, in, beta, y, out);
}

template <typename T, typename DX>
Status linear_backward_data(cublasHandle_t h, const T* dy, const T* w, int64_t n, int64_t in, int64_t out, DX* dx,
                            bool accumulate) {
  // dx[n, in] = dy[n, out] * W[out, in]
  return gemm<T, DX>(h, false, false, n, in, out, 1.0f, dy, out, w, in, accumulate ? 1.0f : 0.0f, dx, in);
}

template <typename T>
Status linear_backward_weight(cublasHandle_t h, const T* dy, const T* x, int64_t n, int64_t in, int64_t out, float* dw) {
  // dW[out, in] += dy[n, out]^T * x[n, in]
  return gemm<T, float>(h, true, false, out, in, n, 1.0f, dy, out, x, in, 1.0f, dw, in);
}

#define MT_GEMM_INSTANTIATE(T, C)                                                                                \
  template Status gemm<T, C>(cublasHandle_t, bool, bool, int64_t, int64_t, int64_t, float, const T*, int64_t,    \
                             const T*, int64_t, float, C*, int64_t);                                              \
  template Status gemm_strided_batched<T, C>(cublasHandle_t, bool, bool, int64_t, int64_t, int64_t, float,        \
                                             const T*, int64_t, int64_t, const T*, int64_t, int64_t, float, C*,   \
                                             int64_t, int64_t, int64_t);                                          \
  template Status gemm_batched_2d<T, C>(cublasHandle_t, cudaStream_t, bool, bool, int64_t, int64_t, int64_t, float,   \
                                        const T*, int64_t, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, float, \
                                        C*, int64_t, int64_t, int64_t, int64_t, int64_t, void**);                      \
  template Status linear_forward<T, C>(cublasHandle_t, const T*, const T*, int64_t, int64_t, int64_t, C*, float); \
  template Status linear_backward_data<T, C>(cublasHandle_t, const T*, const T*, int64_t, int64_t, int64_t, C*, bool);
MT_GEMM_INSTANTIATE(float, float)
MT_GEMM_INSTANTIATE(bf16, bf16)
MT_GEMM_INSTANTIATE(bf16, float)
#undef MT_GEMM_INSTANTIATE
template Status linear_backward_weight<float>(cublasHandle_t, const float*, const float*, int64_t, int64_t, int64_t, float*);
template Status linear_backward_weight<bf16>(cublasHandle_t, const bf16*, const bf16*, int64_t, int64_t, int64_t, float*);

}  // namespace megatrain::cuda

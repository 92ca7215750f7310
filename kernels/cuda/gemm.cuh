// GEMMs through cuBLAS, row-major as the rest of MegaTrain: bf16 (or fp32) inputs, fp32
// accumulation (CUBLAS_COMPUTE_32F), output in fp32 or in the input type. See gemm.cu.
//   C[m, n] = alpha * op(A) * op(B) + beta * C      op(X) = X or X^T, leading dimensions in elements
// The handle's stream is the caller's (cublasSetStream); every cuBLAS status is checked.
#pragma once

#include <cublas_v2.h>

#include <type_traits>

#include "cuda/common.cuh"

namespace megatrain::cuda {

// cuBLAS's name for float and bf16, and a transpose flag as a cuBLAS operation.
template <typename T>
constexpr cudaDataType_t cublas_data_type() {
  if constexpr (std::is_same_v<T, float>)
    return CUDA_R_32F;
  else
    return CUDA_R_16BF;
}
inline cublasOperation_t cublas_op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

// Instantiated for (T, C) = (float, float), (bf16, bf16) and (bf16, float).
template <typename T, typename C>
Status gemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a,
            int64_t lda, const T* b, int64_t ldb, float beta, C* c, int64_t ldc);

// The same GEMM for `batch` problems at fixed strides (elements) between consecutive A, B and C.
template <typename T, typename C>
Status gemm_strided_batched(cublasHandle_t h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                            const T* a, int64_t lda, int64_t stride_a, const T* b, int64_t ldb, int64_t stride_b,
                            float beta, C* c, int64_t ldc, int64_t stride_c, int64_t batch);

// The GEMM for n_outer x n_inner problems, problem (o, i) at x + o * stride_outer + i * stride_inner
// for each operand x, in one pointer-array call (cublasGemmBatchedEx): a kernel on stream s writes
// the A, B and C addresses into `pointers` (device memory for 3 * n_outer * n_inner of them) first.
// The caller checks that every matrix is 16-byte aligned (batched_operand_aligned in
// workspace_sizes.h: cuBLAS cannot check addresses it reads from device memory) and that no two
// problems write the same C.
template <typename T, typename C>
Status gemm_batched_2d(cublasHandle_t h, cudaStream_t s, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                       float alpha, const T* a, int64_t lda, int64_t sa_outer, int64_t sa_inner, const T* b, int64_t ldb,
                       int64_t sb_outer, int64_t sb_inner, float beta, C* c, int64_t ldc, int64_t sc_outer, int64_t sc_inner,
                       int64_t n_outer, int64_t n_inner, void** pointers);

// torch.nn.Linear with weights [out, in]:
//   forward   y[n, out] = x[n, in] W^T (+ bias)              (beta 1 adds into y: the residual)
//   backward  dx (=|+=) dy W;  dW += dy^T x                  (dW fp32, accumulated)
template <typename T, typename Y>
Status linear_forward(cublasHandle_t h, const T* x, const T* w, int64_t n, int64_t in, int64_t out, Y* y, float beta);
template <typename T, typename DX>
Status linear_backward_data(cublasHandle_t h, const T* dy, const T* w, int64_t n, int64_t in, int64_t out, DX* dx,
                            bool accumulate);
template <typename T>
Status linear_backward_weight(cublasHandle_t h, const T* dy, const T* x, int64_t n, int64_t in, int64_t out, float* dw);

// A description of a cuBLAS status, for messages.
const char* cublas_status_name(cublasStatus_t status);

}  // namespace megatrain::cuda

#define MT_CUBLAS_RETURN(stmt)                                                                     \
  do {                                                                                             \
    cublasStatus_t mt_cublas_st_ = (stmt);                                                         \
    if (mt_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                    \
      return ::megatrain::internal_error(std::string(#stmt) + " failed at " + __FILE__ + ":" +     \
                                         std::to_string(__LINE__) + ": " +                         \
                                         ::megatrain::cuda::cublas_status_name(mt_cublas_st_));    \
  } while (0)

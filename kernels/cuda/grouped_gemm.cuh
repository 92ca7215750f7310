// The Mixture-of-Experts GEMMs: one linear layer per expert over that expert's rows of the
// permuted buffers, as ONE cuBLAS call per projection (cublasGemmGroupedBatchedEx); see
// grouped_gemm.cu for the choice and the fallback.
//
// Expert g owns rows [offsets[g], offsets[g+1]) of x, y, dy and dx (row-major, `in` or `out`
// columns); its weight [out, in] is w + g * w_stride (elements of T), its fp32 gradient
// dw + g * dw_stride. `offsets` (e + 1 entries) is on the HOST: cuBLAS takes the problem shapes
// from host arrays, so the caller copies the device offsets of moe_permute back first. An expert
// with no rows is left out of the call (its output rows do not exist; its gradient is not touched).
//   forward         y_g (= | +=, beta) x_g W_g^T
//   backward_data   dx_g (= | +=) dy_g W_g
//   backward_weight dW_g += dy_g^T x_g                  (fp32, accumulated)
// Types as gemm.cuh: T is float or bf16, fp32 accumulation (CUBLAS_COMPUTE_32F), outputs fp32 or T.
// `dev_ptrs` is device memory for grouped_gemm_pointer_slots(e) pointers (the A, B and C arrays
// cuBLAS reads on the device); it is rewritten by each call, in stream order.
#pragma once

#include <cublas_v2.h>

#include <string>

#include "cuda/common.cuh"
#include "cuda/workspace_sizes.h"

namespace megatrain::cuda {

// grouped_gemm_pointer_slots(e): in workspace_sizes.h.

template <typename T, typename Y>
Status grouped_linear_forward(cublasHandle_t h, const T* x, const T* w, int64_t w_stride, const int32_t* offsets, int64_t e,
                              int64_t in, int64_t out, Y* y, float beta, void** dev_ptrs);
template <typename T, typename DX>
Status grouped_linear_backward_data(cublasHandle_t h, const T* dy, const T* w, int64_t w_stride, const int32_t* offsets,
                                    int64_t e, int64_t in, int64_t out, DX* dx, bool accumulate, void** dev_ptrs);
template <typename T>
Status grouped_linear_backward_weight(cublasHandle_t h, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t in,
                                      int64_t out, float* dw, int64_t dw_stride, void** dev_ptrs);

// gpt-oss's stacked experts: W_g [in, out] at w + g * w_stride (x @ W, not x W^T), dW_g likewise.
//   forward         y_g (= | +=, beta) x_g W_g      (beta 1 over a y pre-filled with the biases)
//   backward_data   dx_g (= | +=) dy_g W_g^T
//   backward_weight dW_g += x_g^T dy_g              (fp32, accumulated)
template <typename T, typename Y>
Status grouped_matmul_forward(cublasHandle_t h, const T* x, const T* w, int64_t w_stride, const int32_t* offsets, int64_t e,
                              int64_t in, int64_t out, Y* y, float beta, void** dev_ptrs);
template <typename T, typename DX>
Status grouped_matmul_backward_data(cublasHandle_t h, const T* dy, const T* w, int64_t w_stride, const int32_t* offsets,
                                    int64_t e, int64_t in, int64_t out, DX* dx, bool accumulate, void** dev_ptrs);
template <typename T>
Status grouped_matmul_backward_weight(cublasHandle_t h, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t in,
                                      int64_t out, float* dw, int64_t dw_stride, void** dev_ptrs);

// How the grouped GEMMs of the (input, output) type pair `T -> C` ran so far: "not used yet",
// "cublasGemmGroupedBatchedEx", or "one cublasGemmEx per expert (...why)". Instantiated for
// (float, float), (bf16, bf16) and (bf16, float).
template <typename T, typename C>
std::string grouped_gemm_path();

// Tests and diagnosis: true makes every grouped GEMM one cublasGemmEx per expert (the fallback).
void force_grouped_gemm_loop(bool on);

}  // namespace megatrain::cuda

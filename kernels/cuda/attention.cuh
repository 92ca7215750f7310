// Causal scaled-dot-product attention with grouped-query attention, memory-efficient: the scores
// are made one block of query rows at a time, so no seq x seq matrix ever exists; see
// attention.cu for the algorithm. Semantics are the CPU op's (HF eager attention, kv head
// g = h / (n_heads / n_kv_heads), scale = head_dim^-0.5), with AttnDims::window's sliding window
// and gpt-oss's sinks (sinks [n_heads] in T; their gradient d_sinks [n_heads] fp32, accumulated).
// Shapes: q, out, dout [B, T, n_heads, head_dim]; k, v [B, T, n_kv_heads, head_dim] in T; lse
// [B, n_heads, T] fp32 (saved by forward); dq [B, T, n_heads, head_dim], dk, dv
// [B, T, n_kv_heads, head_dim] fp32 (overwritten).
#pragma once

#include <cublas_v2.h>

#include "cuda/attention_schedule.h"
#include "cuda/common.cuh"

namespace megatrain::cuda {

// attention_block_rows and attention_workspace_bytes are in attention_schedule.h (host code: the
// step library sizes the CUDA backend's arena with them).

template <typename T>
Status attention_forward(cublasHandle_t h, const AttnDims& d, const T* q, const T* k, const T* v, T* out, float* lse,
                         void* workspace, int64_t rows, cudaStream_t s, const T* sinks = nullptr);

template <typename T>
Status attention_backward(cublasHandle_t h, const AttnDims& d, const T* q, const T* k, const T* v, const T* out,
                          const T* dout, const float* lse, float* dq, float* dk, float* dv, void* workspace,
                          int64_t rows, cudaStream_t s, const T* sinks = nullptr, float* d_sinks = nullptr);

}  // namespace megatrain::cuda

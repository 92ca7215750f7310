// The Mixture-of-Experts ops on the GPU (Mixtral, Qwen3-MoE, gpt-oss), the counterparts of
// kernels/cpu/moe.h; the expert GEMMs are in grouped_gemm.cuh. See moe.cu.
//
// Shapes: n tokens, e experts, k chosen per token, slots = n * k (slot t*k + j is token t's j-th
// choice), h the hidden size. Routing data is fp32 whatever T is (logits, probabilities, combine
// weights and their gradients); the gathered inputs xp and expert outputs yp [slots, h] are T.
//   route_forward   probs = softmax(logits) per token; the k largest (the lower index on a tie),
//                   expert[t*k+j] and weight[t*k+j] = probs (divided by their sum when renorm)
//   permute         a stable counting sort of the slots by expert: offsets[e+1] (expert g owns
//                   sorted rows [offsets[g], offsets[g+1])), perm[row] = slot, row_of_slot[slot] = row;
//                   equal, integer for integer, to cpu::moe_permute
//   gather          xp[row] = x[perm[row] / k]
//   combine_forward out[t] = residual[t] + sum_j weight[t*k+j] * yp[row_of_slot[t*k+j]] (fp32;
//                   out may alias residual)
//   combine_backward dyp[row_of_slot[s]] = T(weight[s] * dout[t]);  d_weight[s] = dout[t] . yp[row]
//   scatter_add     dx[t] = sum_j dxp[row_of_slot[t*k+j]] (fp32, j in order; overwrites dx)
//   route_backward  dlogits from d_weight (through the renorm) and, when non-null, d_probs_const[e]
//                   added to every token's probability gradient (the load-balancing loss)
//   aux_stats       count[x] += slots routed to x; prob_sum[x] += sum_t probs[t, x] (doubles on
//                   the device, in and out; the tokens in a two-stage sum of fixed order,
//                   column_sum.cuh; scratch: column_sum_scratch_bytes(e) bytes)
// Deterministic: no atomics; every sum has a fixed order.
#pragma once

#include "cuda/common.cuh"
#include "cuda/workspace_sizes.h"

namespace megatrain::cuda {

Status moe_route_forward(const float* logits, int64_t n, int64_t e, int64_t k, bool renorm, int32_t* expert, float* weight,
                         float* probs, cudaStream_t s);

// scratch: moe_permute_scratch_ints(slots, e) int32 of device memory (workspace_sizes.h).
// The largest e moe_permute takes (its scan keeps e counters in shared memory).
inline constexpr int64_t kMoeMaxExperts = 8192;
Status moe_permute(const int32_t* expert, int64_t slots, int64_t e, int32_t* offsets, int32_t* perm, int32_t* row_of_slot,
                   int32_t* scratch, cudaStream_t s);

template <typename T>
Status moe_gather(const T* x, const int32_t* perm, int64_t rows, int64_t k, int64_t h, T* xp, cudaStream_t s);

template <typename T>
Status moe_combine_forward(const T* yp, const float* weight, const int32_t* row_of_slot, const float* residual, int64_t n,
                           int64_t k, int64_t h, float* out, cudaStream_t s);

template <typename T>
Status moe_combine_backward(const T* yp, const float* weight, const int32_t* row_of_slot, const float* dout, int64_t n,
                            int64_t k, int64_t h, T* dyp, float* d_weight, cudaStream_t s);

Status moe_scatter_add(const float* dxp, const int32_t* row_of_slot, int64_t n, int64_t k, int64_t h, float* dx,
                       cudaStream_t s);

Status moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* d_weight,
                          const float* d_probs_const, int64_t n, int64_t e, int64_t k, bool renorm, float* dlogits,
                          cudaStream_t s);

Status moe_aux_stats(const float* probs, const int32_t* offsets, int64_t n, int64_t e, double* count, double* prob_sum,
                     void* scratch, cudaStream_t s);

// gpt-oss's expert biases over the sorted rows (offsets on the DEVICE, e + 1 entries):
//   bias_fill  y[r, :] = bias_g for every row r of expert g (the grouped GEMM's initial C, beta 1,
//              as the CPU op and torch's addmm have it); bias_g = bias + g * b_stride
//   bias_grad  db_g[c] += sum over expert g's rows r, in order, of dy[r, c] (fp32; an expert with no
//              rows is not touched); db_g = db + g * db_stride
template <typename T>
Status moe_expert_bias_fill(T* y, const T* bias, int64_t b_stride, const int32_t* offsets, int64_t e, int64_t cols,
                            cudaStream_t s);
template <typename T>
Status moe_expert_bias_grad(const T* dy, const int32_t* offsets, int64_t e, int64_t cols, float* db, int64_t db_stride,
                            cudaStream_t s);

}  // namespace megatrain::cuda

// Cross-entropy fused with the softmax, chunked over the vocabulary: the LM head's logits are made
// one vocabulary chunk at a time (a GEMM by the caller), so that they never need all of it at once.
// See cross_entropy.cu. Semantics are the CPU op's (torch cross_entropy, ignore_index -1):
//   pass 1, per chunk [v0, v0+vc):  running max m[r] and running sum s[r] of exp(x - m) (online
//                                   log-sum-exp), and the target's logit when it is in the chunk
//   finish:                         lse[r] = m[r] + log s[r];  loss[r] = lse[r] - x[r, t[r]]
//                                   (0 for ignored rows); *loss_sum += sum_r loss[r] in row order
//                                   (double); *count += rows not ignored
//   pass 2, per chunk:              dx[r, j] = (exp(x[r,j] - lse[r]) - [j == t[r]]) * grad_scale
// logits chunks are fp32 [n, vc] (row stride vc); targets were range-checked by the caller.
#pragma once

#include "cuda/common.cuh"

namespace megatrain::cuda {

// v0 == 0 starts the rows afresh (m = -inf, s = 0, target logit = 0).
Status cross_entropy_chunk_stats(const float* logits, int64_t n, int64_t vc, int64_t v0, const int32_t* targets,
                                 float* run_max, float* run_sum, float* target_logit, cudaStream_t s);

// loss_sum (double) and count (int64) are device scalars that are added to.
Status cross_entropy_finish(const float* run_max, const float* run_sum, const float* target_logit,
                            const int32_t* targets, int64_t n, float* lse, double* loss_sum, long long* count,
                            cudaStream_t s);

template <typename T>
Status cross_entropy_chunk_grad(const float* logits, int64_t n, int64_t vc, int64_t v0, const int32_t* targets,
                                const float* lse, float grad_scale, T* dlogits, cudaStream_t s);

}  // namespace megatrain::cuda

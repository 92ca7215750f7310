// Token embedding on the GPU (see embedding.cu for the algorithm).
//   forward   out[i, :] = float(table[tokens[i], :])                 (the residual stream is fp32)
//   backward  dtable[t, :] += sum over positions i with tokens[i] == t of dout[i, :]
// Token ids are checked on the host by the caller before they are uploaded (the CPU op's check).
// Backward is deterministic and equals the CPU op bit for bit: the caller groups positions by token
// on the host (build_token_groups), and each distinct token's row adds its positions in ascending
// order, as the CPU op does.
#pragma once

#include <vector>

#include "cuda/common.cuh"

namespace megatrain::cuda {

template <typename T>
Status embedding_forward(const int32_t* tokens, int64_t n, const T* table, int64_t hidden, float* out, cudaStream_t s);

// Positions grouped by token, in the layout embedding_backward reads: for distinct token u
// (u in [0, unique.size())), positions[offsets[u] .. offsets[u+1]) ascending.
struct TokenGroups {
  std::vector<int32_t> unique, offsets, positions;
};
TokenGroups build_token_groups(const int32_t* tokens, int64_t n);

// unique [n_unique], offsets [n_unique + 1], positions [n]: device copies of a TokenGroups.
Status embedding_backward(const int32_t* unique, const int32_t* offsets, const int32_t* positions, int64_t n_unique,
                          const float* dout, int64_t hidden, float* dtable, cudaStream_t s);

}  // namespace megatrain::cuda

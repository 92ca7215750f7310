// Token embedding: forward gathers table rows, backward scatters gradients back into the table.
//
//   forward   out[i, :]     = table[tokens[i], :]                  i in [0, n)
//   backward  dtable[t, :] += sum over i with tokens[i] == t of dout[i, :]
//
// Shapes (row-major, contiguous): tokens [n] int32, table/dtable [vocab, hidden], out/dout [n, hidden].
// Every token id is checked against [0, vocab) before anything is written: an out-of-range id (a data
// file built for another vocabulary) is an invalid_argument naming the position and the value.
// Backward is deterministic and independent of the thread count: threads split the hidden columns,
// and each thread adds the tokens in order 0..n-1, so a row used twice sums in token order. dtable
// is accumulated (+=), so micro-batches add into one gradient.
#pragma once

#include <cstdint>

#include "megatrain/core/status.h"
#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

template <typename T>
Status embedding_forward(CpuContext& ctx, const int32_t* tokens, int64_t n, const T* table, int64_t vocab,
                         int64_t hidden, T* out);

template <typename T>
Status embedding_backward(CpuContext& ctx, const int32_t* tokens, int64_t n, const T* dout, int64_t vocab,
                          int64_t hidden, T* dtable);

}  // namespace megatrain::cpu

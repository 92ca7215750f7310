// Elementwise add for the residual stream, and its backward.
//
//   forward   out = a + b                (out may alias a or b)
//   backward  da += dout, db += dout     (the residual passes its gradient to both inputs unchanged;
//             in a decoder layer one of the two is usually the same buffer as dout, so callers
//             only `accumulate` the branch's gradient into the running residual gradient)
//   accumulate dst += src
//
// n elements each. Deterministic: elementwise.
#pragma once

#include <cstdint>

#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

template <typename T>
void add(CpuContext& ctx, const T* a, const T* b, int64_t n, T* out);

template <typename T>
void accumulate(CpuContext& ctx, const T* src, int64_t n, T* dst);

}  // namespace megatrain::cpu

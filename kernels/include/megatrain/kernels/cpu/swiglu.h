// SwiGLU activation of the Llama MLP: down_proj(silu(gate_proj(x)) * up_proj(x)); this op is the
// middle part, elementwise.
//
//   forward   sig    = 1 / (1 + exp(-g))
//             out    = silu(g) * u,  silu(g) = g / (1 + exp(-g))      (torch's formula)
//   backward  dg     = dout * u * sig * (1 + g * (1 - sig))
//             du     = dout * silu(g)
//
// Shapes: gate, up, out, dout, dgate, dup: n elements each (e.g. [tokens, intermediate] flattened).
// Nothing is saved beyond gate and up. dgate/dup are overwritten and may alias gate/up respectively
// (each element is read before it is written). Deterministic: elementwise.
#pragma once

#include <cstdint>

#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

template <typename T>
void swiglu_forward(CpuContext& ctx, const T* gate, const T* up, int64_t n, T* out);

template <typename T>
void swiglu_backward(CpuContext& ctx, const T* gate, const T* up, const T* dout, int64_t n, T* dgate, T* dup);

}  // namespace megatrain::cpu

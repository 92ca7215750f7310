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

// gpt-oss's clamped SwiGLU on the interleaved output of gate_up_proj: row r of gu [rows, 2m] holds
// gate c at column 2c and up c at 2c + 1 (HF: gate_up[..., ::2], gate_up[..., 1::2]). With
// limit > 0 (0: no clamp):
//   g = min(gate, limit),  u = clamp(up, -limit, limit),  sig = 1 / (1 + exp(-(g * alpha)))
//   out[r, c] = (u + 1) * (g * sig)
//   d gate = dout * (u + 1) * (sig + g * alpha * sig * (1 - sig))  where gate <= limit, else 0
//   d up   = dout * g * sig                                        where |up| <= limit, else 0
// (torch's clamp passes the gradient where the input lies within the bounds, ends included).
// dgu [rows, 2m] is overwritten, interleaved as gu. Deterministic: elementwise.
template <typename T>
void clamped_swiglu_forward(CpuContext& ctx, const T* gu, int64_t rows, int64_t m, T alpha, T limit, T* out);
template <typename T>
void clamped_swiglu_backward(CpuContext& ctx, const T* gu, const T* dout, int64_t rows, int64_t m, T alpha, T limit, T* dgu);

}  // namespace megatrain::cpu

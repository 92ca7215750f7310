// The CUDA attention kernels' dimensions, taken from the one model shape (buffers::Shape). The
// kernels keep their own small parameter struct (cuda::AttnDims) so that kernels/ depends on nothing
// above it; this is the one place it is filled. Only code that sees the kernels' headers
// (kernels/cuda) includes it: buffers/src and the CUDA backend, never step/.
#pragma once

#include "cuda/attention_schedule.h"
#include "megatrain/buffers/shape.h"

namespace megatrain::buffers {

inline cuda::AttnDims cuda_attention_dims(const Shape& s) { return cuda::AttnDims{s.B, s.T, s.nh, s.nkv, s.hd}; }

}  // namespace megatrain::buffers

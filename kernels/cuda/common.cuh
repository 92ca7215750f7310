// Shared by every CUDA op: the bf16 type, the launch check, and the element types the launchers
// are instantiated for. Host-includable (no device code): the executor's C++ compiles against it.
//
// Conventions of every launcher in kernels/cuda/:
// - It enqueues work on the given cudaStream_t and returns at once; nothing synchronises.
// - It checks the launch (cudaGetLastError) and returns a Status naming the op on failure.
// - T is the storage type of the op's "compute" operands: float (the fp32 path) or bf16 (the
//   mixed-precision path). Arithmetic is always in fp32; the residual stream, the saved statistics
//   (rstd, log-sum-exp) and every gradient that is accumulated are fp32.
// - n == 0 (or any zero dimension) is a no-op that launches nothing.
// - Deterministic: no atomics on floating-point data; every reduction has a fixed order, so two
//   runs on the same inputs give identical bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.cuh"

namespace megatrain::cuda {

using bf16 = __nv_bfloat16;

}  // namespace megatrain::cuda

// After every kernel launch: a bad configuration or an earlier asynchronous fault is reported here
// with the op's name.
#define MT_CUDA_LAUNCH_CHECK(op_name)                                                              \
  do {                                                                                             \
    cudaError_t mt_launch_err_ = cudaGetLastError();                                               \
    if (mt_launch_err_ != cudaSuccess)                                                             \
      return ::megatrain::cuda::detail::cuda_status(mt_launch_err_, "launch of " op_name, __FILE__, __LINE__); \
  } while (0)

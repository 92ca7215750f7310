// MT_CUDA_CHECK / MT_CUDA_RETURN: every CUDA runtime call is checked, and a failure carries the
// statement, file and line. RETURN turns it into a Status; CHECK aborts (for broken invariants).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "megatrain/core/status.h"

namespace megatrain::cuda::detail {
inline Status cuda_status(cudaError_t err, const char* stmt, const char* file, int line) {
  return internal_error(std::string(stmt) + " failed at " + file + ":" + std::to_string(line) + ": " +
                        cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}
}  // namespace megatrain::cuda::detail

#define MT_CUDA_RETURN(stmt)                                                                   \
  do {                                                                                         \
    cudaError_t mt_err_ = (stmt);                                                              \
    if (mt_err_ != cudaSuccess) return ::megatrain::cuda::detail::cuda_status(mt_err_, #stmt, __FILE__, __LINE__); \
  } while (0)

#define MT_CUDA_CHECK(stmt)                                                                    \
  do {                                                                                         \
    cudaError_t mt_err_ = (stmt);                                                              \
    if (mt_err_ != cudaSuccess)                                                                \
      ::megatrain::die_on_bad_result_access(::megatrain::cuda::detail::cuda_status(mt_err_, #stmt, __FILE__, __LINE__)); \
  } while (0)

// MT_CUDA_CHECK / MT_CUDA_RETURN: every CUDA runtime call is checked, and a failure carries the
// statement, file and line. RETURN turns it into a Status; CHECK aborts (for broken invariants).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "megatrain/core/status.h"

namespace megatrain::cuda::detail {
// Errors a kernel raises while it runs. They are reported by whatever call next waits on the device
// (often a copy stream's synchronize on another thread), not by the launch, and they are sticky:
// the context is unusable afterwards and every later CUDA call in the process fails the same way.
inline bool is_asynchronous_fault(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorMisalignedAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidPc:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
      return true;
    default:
      return false;
  }
}
inline Status cuda_status(cudaError_t err, const char* stmt, const char* file, int line) {
  std::string msg = std::string(stmt) + " failed at " + file + ":" + std::to_string(line) + ": " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")";
  if (is_asynchronous_fault(err))
    msg += ". This is a fault of a kernel that ran before this call, on any stream, not necessarily of this statement; "
           "the CUDA context is now unusable and every later CUDA call in this process fails. To find the kernel, rerun "
           "with CUDA_LAUNCH_BLOCKING=1 (each launch then reports its own fault) or under compute-sanitizer --tool memcheck";
  return internal_error(msg);
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

// A scoped NVTX range, so that Nsight Systems shows the pipeline's stages (the CUDA backend marks
// its ops and copies; the trainer marks the optimizer). NVTX is header-only and costs nothing
// without a profiler attached; builds without CUDA compile the range away.
#pragma once

#if defined(MEGATRAIN_HAVE_CUDA)
#include <nvtx3/nvToolsExt.h>
#endif

namespace megatrain::exec {

struct NvtxRange {
#if defined(MEGATRAIN_HAVE_CUDA)
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
#else
  explicit NvtxRange(const char*) {}
#endif
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace megatrain::exec

// Sums between the ranks' GPUs with NCCL (plan parallel.collective nccl, docs/data-parallel.md).
// NCCL's library is loaded when first asked for (dlopen of libnccl.so.2, which the CUDA toolkit
// ships in /usr/local/cuda/lib), so a build compiled against nccl.h still runs, and trains with
// collective mpi, on a machine without it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "megatrain/core/status.h"
#include "megatrain/executor/communicator.h"

namespace megatrain::exec::cuda_nccl {

class NcclSum {
 public:
  virtual ~NcclSum() = default;
  // In place on `stream`: data (n floats of device memory) becomes the sum over the job's ranks,
  // the same bits on every rank (NCCL's ring or tree order is fixed for a communicator and size).
  virtual Status sum(float* data, int64_t n, cudaStream_t stream) = 0;
  virtual std::string description() const = 0;
};

// NCCL's communicator over `comm`'s ranks, this rank on CUDA device `device` (the caller has made
// it current): rank 0 makes the unique id and sends it through `comm` (MPI). Collective over every
// rank. Errors: no libnccl.so.2 (naming what was tried), NCCL's own (its message).
Result<std::unique_ptr<NcclSum>> make_nccl_sum(Communicator& comm, int device);

// The NCCL library's version ("2.27.3"), or why it cannot be loaded.
Result<std::string> nccl_version();

}  // namespace megatrain::exec::cuda_nccl

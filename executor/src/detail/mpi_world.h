// MPI's world as a Communicator (src/mpi/communicator_mpi.cpp, in builds with MPI).
#pragma once

#include <memory>

#include "megatrain/executor/communicator.h"

namespace megatrain::exec::detail {

// Initialises MPI (thread level MPI_THREAD_MULTIPLE, which the trainer's two channels need) and
// returns its world; MPI is finalised when the process exits.
Result<std::unique_ptr<Communicator>> mpi_world();

}  // namespace megatrain::exec::detail

// Why a task started late: shared by the step report and the trace writer so both name a stall
// the same way. Internal to simulator/.
#pragma once

#include <string>

#include "megatrain/simulator/engine.h"

namespace megatrain::sim::detail {

// "buffer" when it waited for memory after its dependencies; otherwise by the dependency that
// ended last, looking through a weight transfer to what held the transfer back (an update of the
// previous step shows as "optimizer", not as "weights").
std::string stall_reason(const Engine& e, TaskId t);

}  // namespace megatrain::sim::detail

// CUDA device discovery. "No GPU" (no driver, no device) is a normal answer, reported as
// StatusCode::kUnavailable with the reason, so callers and tests can skip or explain.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int64_t total_memory_bytes = 0;
  int64_t free_memory_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
  int multiprocessors = 0;
  int pci_bus_id = 0;
};

// All visible devices, or kUnavailable naming why there are none (no driver, no device).
Result<std::vector<DeviceInfo>> list_devices();

// Copies `bytes` host->device->host through pinned memory and checks the data comes back intact;
// returns the measured H2D and D2H bandwidth in bytes/s. A smoke test that the runtime really works.
struct RoundTrip {
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
};
Result<RoundTrip> pinned_round_trip(int device, size_t bytes);

}  // namespace megatrain::cuda

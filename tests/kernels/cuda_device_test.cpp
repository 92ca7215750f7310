// CUDA device discovery: skips with the reason on machines without a GPU; on a GPU it checks the
// device is described and that data survives a pinned host->device->host round trip.
#include <gtest/gtest.h>

#include "megatrain/kernels/cuda_device.h"

namespace megatrain::cuda {
namespace {

TEST(CudaDevice, ListsDevicesOrSaysWhyNot) {
  auto devices = list_devices();
  if (!devices.ok()) {
    ASSERT_EQ(devices.status().code(), StatusCode::kUnavailable) << devices.status().to_string();
    EXPECT_NE(devices.status().message().find("no CUDA GPU"), std::string::npos);
    GTEST_SKIP() << "no GPU here: " << devices.status().message();
  }
  ASSERT_FALSE(devices->empty());
  for (const auto& d : *devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.total_memory_bytes, int64_t{1} << 30);
    EXPECT_GT(d.free_memory_bytes, 0);
    EXPECT_LE(d.free_memory_bytes, d.total_memory_bytes);
    EXPECT_GE(d.compute_major, 7);
    EXPECT_GT(d.multiprocessors, 0);
  }
}

TEST(CudaDevice, PinnedRoundTripKeepsData) {
  auto devices = list_devices();
  if (!devices.ok()) GTEST_SKIP() << "no GPU here: " << devices.status().message();
  auto rt = pinned_round_trip(0, size_t{64} << 20);
  ASSERT_TRUE(rt.ok()) << rt.status().to_string();
  EXPECT_GT(rt->h2d_bytes_per_s, 1e9);  // any working PCIe link moves 64 MiB faster than 1 GB/s
  EXPECT_GT(rt->d2h_bytes_per_s, 1e9);
}

}  // namespace
}  // namespace megatrain::cuda

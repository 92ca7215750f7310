// CUDA device discovery and a pinned-memory round trip that proves the runtime works.
// Without a driver, cudaGetDeviceCount returns cudaErrorInsufficientDriver and leaves the count
// unwritten (see ENVIRONMENT.md), so the count is initialised and the error mapped to kUnavailable.
#include "megatrain/kernels/cuda_device.h"

#include <chrono>
#include <cstring>

#include "cuda/cuda_check.cuh"

namespace megatrain::cuda {

Result<std::vector<DeviceInfo>> list_devices() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice || err == cudaErrorInitializationError) {
    cudaGetLastError();  // clear the sticky error
    return unavailable(std::string("no CUDA GPU: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
  MT_CUDA_RETURN(err);
  if (count <= 0) return unavailable("no CUDA GPU: the driver reports 0 devices");
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    MT_CUDA_RETURN(cudaGetDeviceProperties(&prop, i));
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    d.compute_major = prop.major;
    d.compute_minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    d.pci_bus_id = prop.pciBusID;
    MT_CUDA_RETURN(cudaSetDevice(i));
    size_t free_b = 0, total_b = 0;
    MT_CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b));
    d.free_memory_bytes = static_cast<int64_t>(free_b);
    out.push_back(d);
  }
  return out;
}

namespace {
// Frees what it owns on every path, so an error in the middle leaks nothing.
struct Buffers {
  unsigned char* h_src = nullptr;
  unsigned char* h_dst = nullptr;
  unsigned char* d_buf = nullptr;
  cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
  ~Buffers() {
    if (h_src) cudaFreeHost(h_src);
    if (h_dst) cudaFreeHost(h_dst);
    if (d_buf) cudaFree(d_buf);
    for (auto e : ev)
      if (e) cudaEventDestroy(e);
  }
};
}  // namespace

Result<RoundTrip> pinned_round_trip(int device, size_t bytes) {
  MT_CUDA_RETURN(cudaSetDevice(device));
  Buffers b;
  MT_CUDA_RETURN(cudaMallocHost(&b.h_src, bytes));
  MT_CUDA_RETURN(cudaMallocHost(&b.h_dst, bytes));
  MT_CUDA_RETURN(cudaMalloc(&b.d_buf, bytes));
  for (size_t i = 0; i < bytes; ++i) b.h_src[i] = static_cast<unsigned char>((i * 2654435761u) >> 13);
  std::memset(b.h_dst, 0, bytes);
  for (auto& e : b.ev) MT_CUDA_RETURN(cudaEventCreate(&e));
  MT_CUDA_RETURN(cudaEventRecord(b.ev[0]));
  MT_CUDA_RETURN(cudaMemcpyAsync(b.d_buf, b.h_src, bytes, cudaMemcpyHostToDevice));
  MT_CUDA_RETURN(cudaEventRecord(b.ev[1]));
  MT_CUDA_RETURN(cudaMemcpyAsync(b.h_dst, b.d_buf, bytes, cudaMemcpyDeviceToHost));
  MT_CUDA_RETURN(cudaEventRecord(b.ev[2]));
  MT_CUDA_RETURN(cudaEventSynchronize(b.ev[2]));
  float h2d_ms = 0, d2h_ms = 0;
  MT_CUDA_RETURN(cudaEventElapsedTime(&h2d_ms, b.ev[0], b.ev[1]));
  MT_CUDA_RETURN(cudaEventElapsedTime(&d2h_ms, b.ev[1], b.ev[2]));
  if (std::memcmp(b.h_src, b.h_dst, bytes) != 0)
    return internal_error("pinned round trip: the data that came back differs from what was sent");
  RoundTrip r;
  r.h2d_bytes_per_s = h2d_ms > 0 ? static_cast<double>(bytes) / (h2d_ms * 1e-3) : 0;
  r.d2h_bytes_per_s = d2h_ms > 0 ? static_cast<double>(bytes) / (d2h_ms * 1e-3) : 0;
  return r;
}

}  // namespace megatrain::cuda

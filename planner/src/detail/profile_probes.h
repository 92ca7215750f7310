// Internal: the profiler's probes. Each one runs the executor's own building block and returns raw
// timings; profile.cpp turns them into fits and a HardwareProfile. Not a public header.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/status.h"
#include "megatrain/planner/profile.h"

namespace megatrain::planner::detail {

using Progress = std::function<void(const std::string&)>;

struct HostInfo {
  std::string cpu;        // /proc/cpuinfo "model name" (or the architecture when absent)
  std::string hostname;
  int64_t cores = 1;      // CPUs in this process's affinity mask
  double ram_bytes = 0;   // physical memory (sysconf)
  double memlock_bytes = -1;  // RLIMIT_MEMLOCK soft limit; -1 = unlimited
};
HostInfo host_info();

// Times `call` (one operation) in batches that together last at least min_time_s: a warm-up call
// (a batch of one, first in the result), then at least min_batches batches sized to a fifth of
// min_time_s; the per-call time of each.
template <typename F>
inline std::vector<double> per_call_times(F&& call, double min_time_s, size_t min_batches) {
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); };
  auto t0 = Clock::now();
  call();
  std::vector<double> times = {seconds_since(t0)};
  const double batch_target = std::max(min_time_s / 5, 1e-4);
  const int64_t batch = std::clamp<int64_t>(static_cast<int64_t>(batch_target / std::max(times[0], 1e-9)), 1, 1 << 20);
  double total = times[0];
  while ((times.size() <= min_batches || total < min_time_s) && times.size() <= 1001) {
    t0 = Clock::now();
    for (int64_t i = 0; i < batch; ++i) call();
    const double dt = seconds_since(t0);
    total += dt;
    times.push_back(dt / static_cast<double>(batch));
  }
  return times;
}

// The best per-call time of per_call_times (the warm-up call included, at least one batch).
template <typename F>
inline double best_per_call(F&& call, double min_time_s) {
  const std::vector<double> t = per_call_times(call, min_time_s, 1);
  return *std::min_element(t.begin(), t.end());
}

// Times `call` as a training step's span is measured: the median per-call time of at least 5
// batches (the warm-up call left out). The layer and head probes use it: a run's step is the
// median of its steps, and the best batch of a probe is its luckiest one (on a shared VM 2-4%
// below its median, so that every prediction that leaned on it was that much too fast;
// bench/README.md, issue 50).
template <typename F>
inline double median_per_call(F&& call, double min_time_s) {
  std::vector<double> t = per_call_times(call, min_time_s, 5);
  t.erase(t.begin());
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  return n % 2 == 1 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

// Thread counts a probe sweeps: 1, 2, 4, ... up to `cores`, and `cores` itself.
std::vector<int> thread_counts(int64_t cores);

// CPU time other processes used over wall time x cores while it lived (from /proc/stat and getrusage):
// measurements taken under a large share are noisy, and the report says so.
class OtherLoad {
 public:
  OtherLoad();
  double share() const;

 private:
  std::chrono::steady_clock::time_point wall0_;
  double busy0_ = 0, self0_ = 0;
};

// STREAM triad a[i] = b[i] + s * c[i] over three arrays of `bytes` each, on the kernels' thread pool;
// bytes per pass counted as STREAM does (3 x bytes). Best of `reps` per thread count.
struct TriadPoint {
  int threads = 1;
  double bytes_per_s = 0;
};
std::vector<TriadPoint> measure_triad(int64_t bytes, int reps, int64_t cores);

// exec::adamw_update on `params` fp32 parameters (fp32 m and v), without a streaming copy (an fp32
// transfer: the master itself is streamed) and, at the largest thread count, with the bf16 streaming
// copy of a bf16 transfer. Then the fused pass exec::adamw_update_moments with m and v both in each
// other state format (bf16, q8, q4, q3, q2; block 128), no streaming copy, at the largest thread
// count, or at every thread count when `formats_all_threads`. Best of `reps` after a warm-up pass
// (which also moves the moments off zero).
struct AdamPoint {
  StateFormat format = StateFormat::kFp32;
  int threads = 1;
  bool bf16_stream = false;
  double params_per_s = 0;
};
std::vector<AdamPoint> measure_adam(int64_t params, int reps, int64_t cores, bool formats_all_threads);

// The layer shapes the profile times: for each H, (rows, H -> H), (rows, H -> H/4), (rows, H -> 8H/3
// rounded to 64), each rows in `rows`, skipping those above `max_flops`. m = rows, n = out, k = H.
std::vector<GemmSample> gemm_shapes(const std::vector<int64_t>& rows, const std::vector<int64_t>& hidden, double max_flops);

// cpu::linear_forward<float> (the CPU backend's GEMM path) on every shape with `threads` threads;
// fills `seconds` per call with the best batch of at least min_time_s in all.
std::vector<GemmSample> measure_gemm(std::vector<GemmSample> shapes, int threads, double min_time_s, const Progress& progress);

// The GEMM shape grid: cpu::linear_forward (op 0), cpu::linear_backward with only dX (op 1) and
// with only dW (op 2) at every (tokens, in, out) of tokens x sizes x sizes whose FLOPs (2 tokens
// in out) are at most max_flops and whose operands each hold at most max_elems floats: seconds per
// call, [tokens][in][out] row-major per op, 0 for a cell not timed.
struct LinearGrid {
  std::vector<int64_t> tokens, sizes;
  std::vector<double> seconds[3];
};
// Whether the probe times cell (tokens, in, out): 2 tokens in out FLOPs at most max_flops, and
// each operand (x, y, W) at most max_elems elements. The CPU and GPU grids share the rule.
inline bool grid_cell_timed(int64_t tokens, int64_t in, int64_t out, double max_flops, int64_t max_elems) {
  const double t = static_cast<double>(tokens), i = static_cast<double>(in), o = static_cast<double>(out);
  const double m = static_cast<double>(max_elems);
  return 2 * t * i * o <= max_flops && t * i <= m && t * o <= m && i * o <= m;
}
LinearGrid measure_linear_grid(const std::vector<int64_t>& tokens, const std::vector<int64_t>& sizes, double max_flops,
                               int64_t max_elems, int threads, double min_time_s, const Progress& progress);
// gpu.gemm_shapes from a grid: each timed cell's efficiency FLOPs / seconds / peak (at most 1),
// and each untimed cell the best of the cells one step smaller on an axis (filled in order of
// size, so an untimed large cell takes the best of the timed ones below it). Fails when no cell
// was timed or peak <= 0.
Result<GemmShapes> gemm_shapes_from_grid(const LinearGrid& grid, double peak_flops_per_s);

// The grouped-GEMM probe's shapes: for each rows r, the gate/up projection (experts, r, n =
// intermediate, k = hidden) and the down projection (experts, r, n = hidden, k = intermediate),
// skipping those above `max_flops`.
std::vector<GroupedGemmSample> grouped_gemm_shapes(const std::vector<int64_t>& rows, int64_t experts, int64_t hidden,
                                                   int64_t intermediate, double max_flops);

// An expert shape (hidden, intermediate) scaled down, both by one factor and rounded down to a
// multiple of 64 (at least 64), until a grouped call of `experts` experts x `max_rows` rows is at
// most `max_flops`; unchanged when it already is.
std::pair<int64_t, int64_t> scaled_expert_shape(int64_t hidden, int64_t intermediate, int64_t experts, int64_t max_rows,
                                                double max_flops);

// The CPU backend's MoE expert GEMMs: one cpu::grouped_linear_forward<float> call (the executor's
// CPU MoE block's, one GEMM per expert, each expert with its own weights and its own rows), with
// `threads` threads; fills `seconds` per call (all experts), best batch of at least min_time_s in all.
std::vector<GroupedGemmSample> measure_grouped_gemm(std::vector<GroupedGemmSample> shapes, int threads, double min_time_s,
                                                    const Progress& progress);

// The CPU backend's transfer copies on one thread: kind "memcpy" (fp32 H2D and D2H: std::memcpy) or
// "bf16" (H2D of a bf16 transfer: bf16 -> fp32 expansion, exec::bf16_to_fp32; x = bf16 bytes).
// Sources and destinations rotate through buffers larger than the caches. (bytes, seconds per copy).
std::vector<std::pair<double, double>> measure_copy(const std::string& kind, const std::vector<int64_t>& sizes,
                                                    double min_time_s);

// Two copies of `bytes` at once on two threads (H2D and D2H together): the rate of each relative to
// one copy alone (1 = no interference, 0.5 = they share one bandwidth).
double measure_copy_duplex(int64_t bytes, double min_time_s);

// O_DIRECT + io_uring probe of one directory: write then read a temp file at every (block, depth).
struct StorageResult {
  NvmeSpec spec;
  std::string device;   // "/dev/vda"
  std::string fs_type;  // "ext4"
  std::string mount;    // "/"
};
Result<StorageResult> measure_storage(const std::string& dir, const ProfileSizes& sizes, const Progress& progress);

// ---- GPU (profile_cuda.cu; a build without CUDA reports kUnavailable) ----------------------------
struct GpuProbe {
  std::string name;
  double free_memory_bytes = 0;
  double memory_bandwidth = 0;  // device-to-device copy, 2 x bytes / time
  double matmul_fp32 = 0, matmul_tf32 = 0, matmul_bf16 = 0;
  std::vector<GemmSample> bf16_samples;  // cuBLAS bf16 GEMMs (fp32 accumulate) at the layer shapes
  // cuBLAS strided-batched bf16 GEMMs (one call per projection over every expert) at MoE shapes.
  std::vector<GroupedGemmSample> grouped_bf16;
  // cuBLAS bf16 linears by shape (forward, dX, dW as the CUDA backend lays them out) over the
  // grid probe_gpu was given (gpu.gemm_shapes); empty axes: not measured.
  LinearGrid grid;
  // (bytes, seconds per transfer)
  std::vector<std::pair<double, double>> h2d_pinned, h2d_pageable, d2h_pinned, d2h_pageable;
  double duplex_ratio = 0;      // each direction's pinned rate with both running / alone
};
// The first CUDA device's name, or kUnavailable with the reason (no driver, no device, no CUDA build).
Result<std::string> gpu_present();
// grid_tokens x grid_sizes x grid_sizes: the GEMM shape grid's axes (empty: no grid); its cells up
// to kGpuGridMaxFlops FLOPs with operands of at most kGpuGridMaxElems elements are timed.
inline constexpr double kGpuGridMaxFlops = 2e12;
inline constexpr int64_t kGpuGridMaxElems = int64_t{1} << 28;
Result<GpuProbe> probe_gpu(const ProfileSizes& sizes, const std::vector<GemmSample>& shapes,
                           const std::vector<GroupedGemmSample>& grouped, const std::vector<int64_t>& grid_tokens,
                           const std::vector<int64_t>& grid_sizes, const Progress& progress);

}  // namespace megatrain::planner::detail

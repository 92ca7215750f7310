// `megatrain-plan profile`: measures this machine with the executor's own building blocks (the CPU
// backend's GEMM path megatrain::cpu::linear_forward, the AdamW kernel exec::adamw_update, the CPU
// backend's H2D/D2H copies, O_DIRECT io_uring reads and writes) and writes a HardwareProfile whose
// figures are all `measured` (or an `estimate` whose basis is spelled out). Latency-plus-bandwidth
// models and GEMM efficiency curves are fitted by least squares; the residuals are reported.
// docs/profiling.md describes every probe, its sizes, the fits and how to read the residuals.
//
// Threads: run_profile() uses every core of this process's affinity mask; run one at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"

namespace megatrain::planner {

// ---- least-squares fits (pure functions, tested on synthetic data) -------------------------------

// t(x) = latency_s + x / bandwidth, fitted by least squares on the relative error (each equation is
// divided by its measured t, so a 64 KiB copy weighs as much as a 256 MiB one). A negative
// intercept is refitted through the origin (latency 0). rms_rel / max_rel: RMS and largest
// |predicted - measured| / measured time over the points.
struct LatencyBandwidthFit {
  double latency_s = 0;
  double bandwidth = 0;  // units of x per second
  double rms_rel = 0;
  double max_rel = 0;
  int64_t points = 0;
  // Effective rate x / t(x) of the fitted model.
  double rate_at(double x) const { return x / (latency_s + x / bandwidth); }
};
// `x` and `t` have the same length >= 2, x > 0, t > 0, and at least two distinct x.
Result<LatencyBandwidthFit> fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& t);

// One timed GEMM shape: C[m, n] = A[m, k] * B[k, n]^T, `seconds` per call.
struct GemmSample {
  int64_t m = 0, n = 0, k = 0;
  double seconds = 0;
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

// The rig's gemm_efficiency curve from timed shapes: peak = the best FLOP/s among the large shapes
// (within 16x of the largest FLOP count; a small cache-resident GEMM that beats it is clamped to it);
// samples of equal FLOPs are averaged; the rates are made non-decreasing in FLOPs by pooling
// adjacent violators (least-squares isotonic regression), and divided by the peak, so x increases
// strictly and y is in (0, 1]. `overhead` fits t = t0 + F / R over all samples (t0: per-call overhead,
// R: asymptotic rate); curve_rms_rel / curve_max_rel compare peak x curve(F) with every sample's
// measured rate (what the curve misses because it only knows FLOPs, not the shape).
struct GemmEfficiencyFit {
  std::vector<std::pair<double, double>> points;  // (FLOPs, fraction of peak)
  double peak_flops_per_s = 0;
  LatencyBandwidthFit overhead;
  double curve_rms_rel = 0;
  double curve_max_rel = 0;
};
// At least two samples with distinct FLOPs, all with seconds > 0.
Result<GemmEfficiencyFit> fit_gemm_efficiency(const std::vector<GemmSample>& samples);

// One timed grouped GEMM (a Mixture-of-Experts projection): `experts` GEMMs in one call, expert e
// computing C_e[rows, n] = A_e[rows, k] * B_e[n, k]^T with its own weights and rows; `seconds` per
// call (all experts).
struct GroupedGemmSample {
  int64_t experts = 0, rows = 0, n = 0, k = 0;
  double seconds = 0;
  double flops() const {
    return 2.0 * static_cast<double>(experts) * static_cast<double>(rows) * static_cast<double>(n) * static_cast<double>(k);
  }
};

// The rig's grouped_gemm_efficiency curve: x = rows per expert, y = the call's rate / `peak` (the
// dense GEMM peak of the same dtype). Samples of equal rows are averaged (each rate clamped to the
// peak), the rates made non-decreasing in rows by pooling adjacent violators (least squares), and
// divided by the peak. curve_rms_rel / curve_max_rel compare peak x curve(rows) with every sample's
// measured rate (what the curve misses because it knows only rows, not n and k).
struct GroupedGemmFit {
  std::vector<std::pair<double, double>> points;  // (rows per expert, fraction of peak)
  double curve_rms_rel = 0;
  double curve_max_rel = 0;
};
// At least two samples with distinct rows, all with positive sizes and seconds; peak > 0.
Result<GroupedGemmFit> fit_grouped_gemm_efficiency(const std::vector<GroupedGemmSample>& samples, double peak_flops_per_s);

// ---- the profile ---------------------------------------------------------------------------------

// Sizes of every probe. quick() and full() are the CLI's modes; tests pass smaller ones.
struct ProfileSizes {
  int64_t triad_bytes = 0;               // bytes of each of the triad's three arrays
  int triad_reps = 5;                    // best of
  int64_t adam_params = 0;               // parameters of the AdamW tensor (4 fp32 arrays)
  int adam_reps = 3;                     // best of
  bool adam_formats_all_threads = false;  // non-fp32 state formats at every thread count (else all CPUs only)
  std::vector<int64_t> gemm_rows;        // tokens per GEMM (m)
  std::vector<int64_t> gemm_hidden;      // hidden sizes H; per H the layer's shapes H->H, H->H/4, H->8H/3
  double gemm_max_flops = 0;             // shapes above this many FLOPs are skipped
  double gemm_min_time_s = 0;            // each shape is timed for at least this long (best batch)
  // The GEMM shape grid (gpu.gemm_shapes): a linear's forward, dX and dW at every (tokens, in,
  // out) of these axes whose FLOPs are at most grid_max_flops and whose operands each hold at most
  // grid_max_elems floats (the other cells take the best of the smaller ones). With --model the
  // axes are the model's own: its sizes (hidden, q, kv, intermediate, router, vocabulary) and 1,
  // 2, 4, 8 and 16 sequences. No tokens: the grid is skipped.
  std::vector<int64_t> grid_tokens, grid_sizes;
  double grid_max_flops = 0;
  int64_t grid_max_elems = 0;
  // The grouped-GEMM probe (MoE experts, CPU backend): rows per expert, experts per call, and the
  // generic expert shape (hidden, intermediate), replaced by the model's MoE shape with --model;
  // either is scaled down until the largest call fits gemm_max_flops. No rows: the probe is skipped.
  std::vector<int64_t> grouped_rows;
  int64_t grouped_experts = 8;
  int64_t grouped_hidden = 1024, grouped_intermediate = 1024;
  std::vector<int64_t> copy_bytes;       // transfer sizes of the link probe
  double copy_min_time_s = 0;            // each size is timed for at least this long
  int64_t storage_file_bytes = 0;        // temp file per --storage directory
  std::vector<int64_t> storage_blocks;   // bytes per request (multiples of 4096)
  std::vector<int64_t> storage_depths;   // requests in flight
  double storage_point_max_s = 0;        // a point stops after this long (once 32 MiB are done)
  static ProfileSizes quick();
  static ProfileSizes full();
};

struct ProfileOptions {
  std::vector<std::string> storage_dirs;  // each gets a storage[] entry; checked before measuring
  ProfileSizes sizes = ProfileSizes::quick();
  std::string mode = "quick";             // recorded in provenance ("quick" | "full" | free text)
  bool use_gpu = true;                    // false: describe the CPU backend even when a GPU is present
  // Optional: the model the profile is for. Its layer GEMMs (forward, dX and dW shapes at
  // micro-batches 1, 2, 4, 8 of `seq` tokens) join the GEMM curve, and the attention and element-wise
  // probes run at its head and layer sizes. Without it they run at a generic set of shapes.
  std::optional<ModelConfig> model;
  std::shared_ptr<const ModelSpec> model_spec;  // the same model, for the layer probe
  int64_t seq = 0;                        // 0: min(the model's max_position_embeddings, 2048)
  // Called before each probe (step counts from 1) and with finer detail within long ones.
  std::function<void(int step, int steps, const std::string& what)> progress;
};

// A fitted model with its parameters and residuals, for the report and --json "fits".
struct FitReport {
  std::string name;                                    // "h2d", "gemm_overhead", ...
  std::string model;                                   // "t = latency + bytes / bandwidth"
  std::vector<std::pair<std::string, double>> params;  // ("latency_s", 2.1e-6), ...
  double rms_rel = 0;
  double max_rel = 0;
  int64_t points = 0;
};

// A raw measurement table (for the human report and --json "measurements").
struct MeasurementTable {
  std::string name;                       // "triad", "adam", "gemm", "h2d", "storage /tmp read", ...
  std::vector<std::string> columns;       // column names with units
  std::vector<std::vector<double>> rows;
};

struct ProfileReport {
  HardwareProfile rig;
  std::vector<FitReport> fits;
  std::vector<MeasurementTable> measurements;
  std::vector<std::string> notes;  // what was measured how, and what was estimated
  double elapsed_s = 0;
  double other_load = 0;           // share of the machine's CPU time used by other processes meanwhile
};

// Checks that `dir` can hold an O_DIRECT temp file (exists, is a directory, is writable, supports
// O_DIRECT) by creating and deleting one; the error names the directory and the errno text.
Status check_storage_dir(const std::string& dir);

// Measures this machine. Storage directories are checked first, so a bad one fails in milliseconds.
Result<ProfileReport> run_profile(const ProfileOptions& options);

// {"rig": {...}, "fits": {...}, "measurements": {...}, "notes": [...], "elapsed_s": ...}, with a trailing newline.
std::string profile_json(const ProfileReport& report);
// A readable report for a terminal.
std::string profile_table(const ProfileReport& report);

// The `megatrain-plan profile` command: progress on stderr, the report (or --json) on stdout, the
// rig written atomically to `output` when set (its name is then the file's stem). Returns the exit
// code; errors go to stderr naming what was wrong.
struct ProfileCommand {
  std::vector<std::string> storage_dirs;
  bool quick = false;
  std::string model;   // --model: name or path (optional)
  int64_t seq = 0;     // --seq
  double storage_gib = 0;  // --storage-gib: the storage probe's file size (0: the mode's)
  std::string output;
  bool json = false;
};
int profile_command(const ProfileCommand& cmd);

}  // namespace megatrain::planner

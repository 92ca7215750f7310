// `megatrain-plan profile`: runs the probes (profile_probes.cpp, profile_storage.cpp, profile_cuda.cu),
// fits their models (profile_fit.cpp) and assembles a measured HardwareProfile with its report.
#include "megatrain/planner/profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include "detail/attention_probe.h"
#include "detail/profile_probes.h"
#include "megatrain/core/units.h"

namespace megatrain::planner {

#ifndef MEGATRAIN_PROFILE_CUDA
namespace detail {
Result<std::string> gpu_present() { return unavailable("this megatrain-plan was built without CUDA (MEGATRAIN_CUDA=OFF)"); }
Result<GpuProbe> probe_gpu(const ProfileSizes&, const std::vector<GemmSample>&, const std::vector<GroupedGemmSample>&,
                           const std::vector<int64_t>&, const std::vector<int64_t>&, const Progress&) {
  return unavailable("this megatrain-plan was built without CUDA (MEGATRAIN_CUDA=OFF)");
}
}  // namespace detail
#endif

ProfileSizes ProfileSizes::quick() {
  ProfileSizes s;
  s.triad_bytes = 64ll << 20;
  s.triad_reps = 5;
  s.adam_params = 16ll << 20;
  s.adam_reps = 3;
  s.gemm_rows = {64, 256, 1024, 2048};
  s.gemm_hidden = {128, 512, 2048};
  s.gemm_max_flops = 2e10;
  s.gemm_min_time_s = 0.04;
  s.grid_tokens = {128, 1024, 8192};
  s.grid_sizes = {64, 512, 4096, 32768};
  s.grid_max_flops = 2e9;
  s.grid_max_elems = int64_t{32} << 20;
  s.grouped_rows = {16, 64, 256, 1024};
  s.copy_bytes = {64ll << 10, 256ll << 10, 1ll << 20, 4ll << 20, 16ll << 20, 64ll << 20};
  s.copy_min_time_s = 0.04;
  s.storage_file_bytes = 256ll << 20;
  s.storage_blocks = {128ll << 10, 1ll << 20, 4ll << 20};
  s.storage_depths = {1, 32};
  s.storage_point_max_s = 0.25;
  return s;
}

ProfileSizes ProfileSizes::full() {
  ProfileSizes s;
  s.triad_bytes = 256ll << 20;
  s.triad_reps = 10;
  s.adam_params = 64ll << 20;
  s.adam_reps = 5;
  s.adam_formats_all_threads = true;
  s.gemm_rows = {64, 128, 256, 512, 1024, 2048, 4096};
  s.gemm_hidden = {128, 256, 512, 1024, 2048, 4096};
  s.gemm_max_flops = 1.5e11;
  s.gemm_min_time_s = 0.15;
  s.grid_tokens = {32, 128, 512, 2048, 8192, 32768};
  s.grid_sizes = {64, 256, 1024, 4096, 16384, 65536, 262144};
  s.grid_max_flops = 4e10;
  s.grid_max_elems = int64_t{128} << 20;
  s.grouped_rows = {16, 32, 64, 128, 256, 512, 1024, 2048};
  s.copy_bytes = {4ll << 10, 16ll << 10, 64ll << 10, 256ll << 10, 1ll << 20, 4ll << 20, 16ll << 20, 64ll << 20, 256ll << 20};
  s.copy_min_time_s = 0.1;
  s.storage_file_bytes = 1ll << 30;
  s.storage_blocks = {128ll << 10, 1ll << 20, 4ll << 20};
  s.storage_depths = {1, 4, 16, 32};
  s.storage_point_max_s = 0.8;
  return s;
}

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

std::string iso_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string fmt(double v, int digits = 3) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  return buf;
}

std::string pct(double v) { return fmt(100 * v, 2) + "%"; }

std::string threads_text(int64_t n) { return std::to_string(n) + (n == 1 ? " thread" : " threads"); }

// Shared by every measured figure of one run.
struct Stamp {
  std::string when, machine, mode;
  Provenance measured(const std::string& source) const {
    return {Provenance::Kind::kMeasured, "megatrain-plan profile (" + mode + "): " + source, when, machine};
  }
  static Provenance estimate(const std::string& basis) { return {Provenance::Kind::kEstimate, basis, "", ""}; }
};

std::string load_note(double share) {
  return share >= 0.05 ? "; other processes used " + pct(share) + " of the CPUs meanwhile" : "";
}

FitReport lb_report(const std::string& name, const std::string& x_name, const LatencyBandwidthFit& f) {
  return {name, "t = latency_s + " + x_name + " / bandwidth (least squares on relative error)",
          {{"latency_s", f.latency_s}, {"bandwidth", f.bandwidth}}, f.rms_rel, f.max_rel, f.points};
}

std::string fit_text(const LatencyBandwidthFit& f, const std::string& unit) {
  return "fit t = " + format_duration(f.latency_s) + " + x / " + fmt(f.bandwidth) + " " + unit + ", RMS residual " +
         pct(f.rms_rel) + " (max " + pct(f.max_rel) + ") over " + std::to_string(f.points) + " sizes";
}

Curve rate_curve(const std::vector<std::pair<double, double>>& bytes_seconds, Provenance p) {
  Curve c;
  for (const auto& [b, t] : bytes_seconds) c.points.emplace_back(b, b / t);
  c.provenance = std::move(p);
  return c;
}

Result<LatencyBandwidthFit> fit_of(const std::vector<std::pair<double, double>>& bytes_seconds) {
  std::vector<double> x, t;
  for (const auto& [b, s] : bytes_seconds) {
    x.push_back(b);
    t.push_back(s);
  }
  return fit_latency_bandwidth(x, t);
}

std::string sizes_text(const std::vector<int64_t>& v) {
  if (v.empty()) return "";
  return format_bytes(static_cast<double>(v.front())) + " .. " + format_bytes(static_cast<double>(v.back())) + " (" +
         std::to_string(v.size()) + " sizes)";
}

// One run of `megatrain-plan profile`, section by section: run_profile calls them in order. Each
// section measures one part of the rig and writes it, with its provenance, fits and raw tables,
// into the report.
class Profiler {
 public:
  explicit Profiler(const ProfileOptions& opts)
      : options(opts), sz(opts.sizes), rig(rep.rig), host(detail::host_info()),
        st{iso_now(), host.hostname + " (" + host.cpu + ")", opts.mode},
        model(opts.model ? &*opts.model : nullptr),
        model_seq(model == nullptr ? 0 : (opts.seq > 0 ? opts.seq : std::min<int64_t>(model->max_position_embeddings, 2048))) {}
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  Status check_storage_dirs();
  void find_gpu();
  void host_section();
  void triad();
  void adam();
  Status gpu();
  Status cpu_gemm();
  Status cpu_gemm_grid();
  void grid_axes_of_model(std::vector<int64_t>& tokens, std::vector<int64_t>& sizes) const;
  void record_grid(const detail::LinearGrid& grid, const GemmShapes& shapes);
  void cpu_grouped_gemm();
  Status cpu_attention();
  Status cpu_elementwise();
  void cpu_layer();
  Status cpu_transfers();
  Status storage();
  Result<ProfileReport> finish();
  bool has_gpu() const { return have_gpu; }

 private:
  void progress(const std::string& what) {
    if (options.progress) options.progress(++step, steps, what);
  }

  const ProfileOptions& options;
  const ProfileSizes& sz;
  const Clock::time_point start = Clock::now();
  ProfileReport rep;
  HardwareProfile& rig;
  std::optional<detail::OtherLoad> total_load;
  const detail::HostInfo host;
  const Stamp st;
  Result<std::string> gpu_name = unavailable("not probed: the caller asked for the CPU backend");
  bool have_gpu = false;
  std::string gpu_why;
  bool grouped_probe = false;
  int steps = 0, step = 0;
  const ModelConfig* model = nullptr;
  const int64_t model_seq = 0;
  double gemm_peak = 0;  // the CPU backend's GEMM peak, which the grouped GEMM and attention curves are relative to
  const detail::Progress detail_cb = [this](const std::string& what) {
    if (options.progress) options.progress(step, steps, "  " + what);
  };
};

// Storage directories first: a wrong one should fail before a minute of measuring.
Status Profiler::check_storage_dirs() {
  std::set<std::string> seen;
  for (const std::string& dir : options.storage_dirs) {
    std::error_code ec;
    const std::string canonical = std::filesystem::weakly_canonical(dir, ec).string();
    if (!seen.insert(canonical.empty() ? dir : canonical).second)
      return invalid_argument("--storage " + dir + ": given twice (as " + canonical + "); expected each directory once");
    MT_RETURN_IF_ERROR(check_storage_dir(dir));
  }
  return {};
}

// The GPU is probed only when one is there (and the caller allows it); the step count follows.
void Profiler::find_gpu() {
  total_load.emplace();
  if (options.use_gpu) gpu_name = detail::gpu_present();
  have_gpu = gpu_name.ok();
  gpu_why = have_gpu ? "" : gpu_name.status().message();
  grouped_probe = !sz.grouped_rows.empty();
  const bool grid = !sz.grid_tokens.empty() && !sz.grid_sizes.empty();
  steps = 4 + (have_gpu ? 0 : 3 + (grouped_probe ? 1 : 0) + (grid ? 1 : 0)) + (!have_gpu && options.model_spec ? 1 : 0) +
          static_cast<int>(options.storage_dirs.size());
}

// The host: CPU, cores, RAM and what may be page-locked.
void Profiler::host_section() {
  progress("host: " + host.cpu + ", " + format_bytes(host.ram_bytes) + " RAM");
  rig.name = host.hostname + "-measured";
  rig.host.cpu = host.cpu;
  rig.host.cores = host.cores;
  rig.host.ram_bytes = {host.ram_bytes, st.measured("sysconf(_SC_PHYS_PAGES) x page size")};
  const double half_ram = std::floor(host.ram_bytes / 2 / static_cast<double>(kGiB)) * static_cast<double>(kGiB);
  rig.host.pinnable_bytes = {std::max(half_ram, static_cast<double>(kGiB) / 2),
                             Stamp::estimate("half of RAM rounded down to a GiB (" + format_bytes(host.ram_bytes) +
                                             " / 2): the rest stays with the OS, page cache and data loader" +
                                             (host.memlock_bytes >= 0 ? "; RLIMIT_MEMLOCK is " + format_bytes(host.memlock_bytes) +
                                                                            " (cudaMallocHost does not count against it)"
                                                                      : ""))};
}

// Memory bandwidth: the STREAM triad at each thread count.
void Profiler::triad() {
  progress("memory bandwidth: triad, 3 x " + format_bytes(static_cast<double>(sz.triad_bytes)) + ", best of " +
           std::to_string(sz.triad_reps));
  detail::OtherLoad load;
  const auto pts = detail::measure_triad(sz.triad_bytes, sz.triad_reps, host.cores);
  MeasurementTable t{"triad", {"threads", "bytes_per_s"}, {}};
  double best = 0;
  int best_threads = 1;
  for (const auto& p : pts) {
    t.rows.push_back({static_cast<double>(p.threads), p.bytes_per_s});
    if (p.bytes_per_s > best) {
      best = p.bytes_per_s;
      best_threads = p.threads;
    }
  }
  rep.measurements.push_back(t);
  rig.host.memory_bandwidth = {best, st.measured("STREAM triad a = b + s c over 3 x " +
                                                 format_bytes(static_cast<double>(sz.triad_bytes)) + " double arrays, " +
                                                 threads_text(best_threads) + ", best of " +
                                                 std::to_string(sz.triad_reps) + " (24 B per element)" +
                                                 load_note(load.share()))};
}

// AdamW in every state format.
void Profiler::adam() {
  progress("AdamW: exec::adamw_update, " + format_count(static_cast<double>(sz.adam_params)) +
           " params, fp32 and every other state format, best of " + std::to_string(sz.adam_reps));
  detail::OtherLoad load;
  const auto pts = detail::measure_adam(sz.adam_params, sz.adam_reps, host.cores, sz.adam_formats_all_threads);
  const std::string note = load_note(load.share());
  // state_bits: bits per stored element of m and v (32 fp32, 16 bf16, 8 q8, 4 q4, 3 q3, 2 q2).
  MeasurementTable t{"adam", {"state_bits", "threads", "bf16_stream", "params_per_s"}, {}};
  for (const auto& p : pts) {
    const int bits = p.format == StateFormat::kFp32 ? 32 : p.format == StateFormat::kBf16 ? 16 : p.format == StateFormat::kQ8 ? 8
                     : p.format == StateFormat::kQ4 ? 4 : p.format == StateFormat::kQ3 ? 3 : 2;
    t.rows.push_back({static_cast<double>(bits), static_cast<double>(p.threads), p.bf16_stream ? 1.0 : 0.0, p.params_per_s});
    if (p.bf16_stream) {
      rep.notes.push_back("AdamW with the bf16 streaming copy (a bf16-transfer plan), " + std::to_string(p.threads) +
                          " threads: " + format_count(p.params_per_s) + " params/s (fp32 states); the rig's host.adam lists the "
                          "fp32-transfer pass, which writes no streaming copy");
      continue;
    }
    AdamThroughput a;
    a.state_format = state_format_name(p.format);
    a.threads = p.threads;
    const double bytes = 4 + 8 + 4 * state_format_bytes_per_element(p.format, 128);
    const std::string what =
        p.format == StateFormat::kFp32
            ? "exec::adamw_update, fp32 master/m/v, no streaming copy (28 B per parameter), "
            : "exec::adamw_update_moments, fp32 master, m and v in " + std::string(state_format_name(p.format)) +
                  (p.format != StateFormat::kBf16 ? " (blocks of 128, one fp32 scale each)" : "") + ", no streaming copy (" +
                  fmt(bytes, 5) + " B per parameter), ";
    a.params_per_s = {p.params_per_s, st.measured(what + format_count(static_cast<double>(sz.adam_params)) + " parameters, " +
                                                  threads_text(p.threads) + ", best of " + std::to_string(sz.adam_reps) + note)};
    rig.host.adam.push_back(a);
  }
  rep.measurements.push_back(t);
  if (!sz.adam_formats_all_threads)
    rep.notes.push_back("host.adam: fp32 at every thread count; bf16, q8, q4, q3 and q2 (m and v both in the format) at " +
                        threads_text(static_cast<int>(host.cores)) +
                        " only (quick mode; the cost model scales a rate by threads from the nearest measured count)");
}

// A GPU: transfers, device bandwidth, cuBLAS GEMMs (dense and grouped) and the link.
Status Profiler::gpu() {
  progress("GPU: " + *gpu_name + ": transfers, device bandwidth, cuBLAS GEMMs");
  const std::vector<GemmSample> gpu_shapes = detail::gemm_shapes({256, 1024, 4096, 16384}, {1024, 4096, 8192}, 1e13);
  // MoE expert shapes: gpt-oss (hidden 2880, expert intermediate 2880) and Qwen3-235B-A22B
  // (4096, 1536), 32 experts per call, 16 to 4096 rows per expert.
  std::vector<GroupedGemmSample> grouped_shapes;
  for (const auto& [h, i] : {std::pair<int64_t, int64_t>{2880, 2880}, {4096, 1536}})
    for (const GroupedGemmSample& g : detail::grouped_gemm_shapes({16, 32, 64, 128, 256, 512, 1024, 2048, 4096}, 32, h, i, 1e13))
      grouped_shapes.push_back(g);
  // The GEMM shape grid: the model's sizes and 1 to 16 sequences with --model, else generic ones.
  std::vector<int64_t> grid_tokens = {128, 512, 2048, 8192, 32768}, grid_sizes = {256, 1024, 4096, 16384, 65536, 262144};
  if (model != nullptr) grid_axes_of_model(grid_tokens, grid_sizes);
  MT_ASSIGN_OR_RETURN(const detail::GpuProbe g,
                      detail::probe_gpu(sz, gpu_shapes, grouped_shapes, grid_tokens, grid_sizes, detail_cb));
  rig.gpu.name = g.name;
  rig.gpu.memory_bytes = {g.free_memory_bytes, st.measured("cudaMemGetInfo free bytes at profile time")};
  rig.gpu.memory_bandwidth = {g.memory_bandwidth, st.measured("cudaMemcpy device to device, 2 x bytes / time")};
  rig.gpu.matmul_fp32 = {g.matmul_fp32, st.measured("cublasGemmEx fp32 (CUBLAS_COMPUTE_32F) at the largest layer shape")};
  rig.gpu.matmul_tf32 = {g.matmul_tf32, st.measured("cublasGemmEx fp32 with CUBLAS_COMPUTE_32F_FAST_TF32 at the largest layer shape")};
  MT_ASSIGN_OR_RETURN(GemmEfficiencyFit ef, fit_gemm_efficiency(g.bf16_samples));
  rig.gpu.matmul_bf16 = {ef.peak_flops_per_s, st.measured("cublasGemmEx bf16 with fp32 accumulate: best of " +
                                                          std::to_string(g.bf16_samples.size()) + " layer shapes")};
  rig.gpu.gemm_efficiency.points = ef.points;
  rig.gpu.gemm_efficiency.provenance = st.measured(
      "cuBLAS bf16 GEMMs at " + std::to_string(g.bf16_samples.size()) + " layer shapes, rate / best rate, made monotone "
      "(isotonic least squares); curve vs samples RMS residual " + pct(ef.curve_rms_rel));
  rep.fits.push_back(lb_report("gemm_overhead", "FLOPs", ef.overhead));
  rep.fits.push_back({"gemm_efficiency_curve", "rate(F) = peak x curve(F), monotone in F (isotonic least squares)",
                      {{"peak_flops_per_s", ef.peak_flops_per_s}, {"curve_points", static_cast<double>(ef.points.size())}},
                      ef.curve_rms_rel, ef.curve_max_rel, static_cast<int64_t>(g.bf16_samples.size())});
  MeasurementTable gt{"gemm", {"m", "n", "k", "flops", "seconds", "flops_per_s"}, {}};
  for (const auto& s : g.bf16_samples)
    gt.rows.push_back({double(s.m), double(s.n), double(s.k), s.flops(), s.seconds, s.flops() / s.seconds});
  rep.measurements.push_back(gt);
  if (!g.grid.tokens.empty()) {
    MT_ASSIGN_OR_RETURN(GemmShapes shapes, detail::gemm_shapes_from_grid(g.grid, ef.peak_flops_per_s));
    shapes.provenance = st.measured(
        "cublasGemmEx bf16 with fp32 accumulate as the CUDA backend's linear_forward, linear_backward_data and "
        "linear_backward_weight lay them out, at (tokens, in, out) cells " +
        std::string(model != nullptr ? "of the model's sizes at seq " + std::to_string(model_seq) : "of generic sizes") +
        " up to " + format_flops(detail::kGpuGridMaxFlops) + "; the others take the best of the smaller cells; efficiency = "
        "FLOPs / seconds / the bf16 peak");
    record_grid(g.grid, shapes);
    rig.gpu.gemm_shapes = std::move(shapes);
  }
  if (!g.grouped_bf16.empty()) {
    MT_ASSIGN_OR_RETURN(GroupedGemmFit gf, fit_grouped_gemm_efficiency(g.grouped_bf16, ef.peak_flops_per_s));
    rig.gpu.grouped_gemm_efficiency = Curve{
        gf.points, st.measured("cublasGemmStridedBatchedEx bf16 with fp32 accumulate, one call per projection over 32 "
                               "experts, gate/up and down of hidden 2880 x expert intermediate 2880 and 4096 x 1536, " +
                               std::to_string(g.grouped_bf16.size()) + " shapes; rate / the dense bf16 peak, made monotone "
                               "in rows (isotonic least squares); curve vs samples RMS residual " + pct(gf.curve_rms_rel))};
    rep.fits.push_back({"grouped_gemm_curve", "rate(rows) = dense peak x curve(rows per expert), monotone in rows",
                        {{"curve_points", static_cast<double>(gf.points.size())}}, gf.curve_rms_rel, gf.curve_max_rel,
                        static_cast<int64_t>(g.grouped_bf16.size())});
    MeasurementTable ggt{"grouped_gemm", {"experts", "rows", "n", "k", "flops", "seconds", "flops_per_s"}, {}};
    for (const auto& s : g.grouped_bf16)
      ggt.rows.push_back({double(s.experts), double(s.rows), double(s.n), double(s.k), s.flops(), s.seconds, s.flops() / s.seconds});
    rep.measurements.push_back(ggt);
  }

  rig.links.kind = "measured host-device link";
  rig.links.full_duplex = g.duplex_ratio >= 0.9;
  rep.notes.push_back("H2D and D2H at once ran at " + pct(g.duplex_ratio) + " of their rates alone: full_duplex " +
                      (rig.links.full_duplex ? "true" : "false") + " (threshold 90%)");
  struct Dir {
    const char* name;
    LinkSpec* spec;
    const std::vector<std::pair<double, double>>* pinned;
    const std::vector<std::pair<double, double>>* pageable;
  };
  for (const Dir& d : {Dir{"h2d", &rig.links.h2d, &g.h2d_pinned, &g.h2d_pageable},
                       Dir{"d2h", &rig.links.d2h, &g.d2h_pinned, &g.d2h_pageable}}) {
    MT_ASSIGN_OR_RETURN(LatencyBandwidthFit fp, fit_of(*d.pinned));
    MT_ASSIGN_OR_RETURN(LatencyBandwidthFit fq, fit_of(*d.pageable));
    const std::string what = std::string("cudaMemcpyAsync ") + d.name + ", CUDA events, best of 5 batches; ";
    d.spec->latency_s = {fp.latency_s, st.measured(what + "intercept of the pinned " + fit_text(fp, "B/s"))};
    d.spec->pinned_bandwidth = rate_curve(*d.pinned, st.measured(what + "pinned (cudaMallocHost); " + fit_text(fp, "B/s")));
    d.spec->pageable_bandwidth = rate_curve(*d.pageable, st.measured(what + "pageable (malloc); " + fit_text(fq, "B/s")));
    rep.fits.push_back(lb_report(std::string(d.name) + "_pinned", "bytes", fp));
    rep.fits.push_back(lb_report(std::string(d.name) + "_pageable", "bytes", fq));
    MeasurementTable t{std::string(d.name), {"bytes", "pinned_seconds", "pageable_seconds"}, {}};
    for (size_t i = 0; i < d.pinned->size(); ++i)
      t.rows.push_back({(*d.pinned)[i].first, (*d.pinned)[i].second, (*d.pageable)[i].second});
    rep.measurements.push_back(t);
  }
  return {};
}

// No GPU: the gpu and links sections describe the CPU backend, starting with its GEMM.
Status Profiler::cpu_gemm() {
  rep.notes.push_back("no GPU (" + gpu_why + "): the gpu and links sections describe the CPU backend");
  // ---- CPU backend GEMM ----------------------------------------------------------------------------
  std::vector<GemmSample> shapes = detail::gemm_shapes(sz.gemm_rows, sz.gemm_hidden, sz.gemm_max_flops);
  if (model != nullptr) {
    // The model's own layer GEMMs: forward (N, out, in), dX (N, in, out) and dW (out, in, N).
    const int64_t H = model->hidden_size, q = model->num_heads * model->head_dim,
                  kv = model->num_kv_heads * model->head_dim, I = model->intermediate_size;
    const std::vector<std::pair<int64_t, int64_t>> projections = {{H, q}, {H, kv}, {q, H}, {H, I}, {I, H}};
    for (int64_t mb : {1, 2, 4, 8}) {
      const int64_t N = mb * model_seq;
      for (const auto& [in, out] : projections)
        for (const GemmSample& g : {GemmSample{N, out, in, 0}, GemmSample{N, in, out, 0}, GemmSample{out, in, N, 0}})
          if (g.flops() <= std::max(sz.gemm_max_flops, 4e10)) shapes.push_back(g);
    }
  }
  progress("GEMM efficiency: cpu::linear_forward<float>, " + std::to_string(shapes.size()) + " shapes, " +
           std::to_string(host.cores) + " threads");
  detail::OtherLoad load;
  const auto samples = detail::measure_gemm(shapes, static_cast<int>(host.cores), sz.gemm_min_time_s, detail_cb);
  const std::string note = load_note(load.share());
  MT_ASSIGN_OR_RETURN(GemmEfficiencyFit ef, fit_gemm_efficiency(samples));
  const GemmSample* top = &samples.front();
  int above_peak = 0;
  double fastest = 0;
  for (const auto& s : samples) {
    const double rate = s.flops() / s.seconds;
    if (std::abs(rate - ef.peak_flops_per_s) < std::abs(top->flops() / top->seconds - ef.peak_flops_per_s)) top = &s;
    if (rate > ef.peak_flops_per_s * 1.0001) ++above_peak;
    fastest = std::max(fastest, rate);
  }
  if (above_peak > 0)
    rep.notes.push_back(std::to_string(above_peak) + " smaller GEMM shapes ran faster than the large-shape peak (up to " +
                        format_flop_rate(fastest) + "); their efficiency is clamped to 1. On a quiet machine large "
                        "GEMMs are the fastest: this usually means other processes took cores while the large ones ran");
  const std::string top_shape = std::to_string(top->m) + "x" + std::to_string(top->k) + " -> " + std::to_string(top->n);
  rig.gpu.name = "CPU backend (" + std::to_string(host.cores) + " threads, Eigen fp32 GEMM via megatrain::cpu::linear_forward)";
  // The CPU backend page-locks nothing: its "pinned" tier (gradients, staging, host checkpoints)
  // is ordinary RAM, so it may use RAM as the CUDA backend may use page-locked memory.
  rig.host.pinnable_bytes = {std::floor(0.9 * host.ram_bytes / static_cast<double>(kGiB)) * static_cast<double>(kGiB),
                             Stamp::estimate("the CPU backend page-locks nothing; its pinned buffers are ordinary RAM: 90% of " +
                                             format_bytes(host.ram_bytes) + " rounded down to a GiB")};
  const double ram_sixth = std::floor(host.ram_bytes / 6 / static_cast<double>(kGiB)) * static_cast<double>(kGiB);
  rig.gpu.memory_bytes = {std::max(ram_sixth, static_cast<double>(kGiB)),
                          Stamp::estimate("device budget of the CPU backend: a sixth of RAM (" + format_bytes(host.ram_bytes) +
                                          " / 6) rounded down to a GiB, at least 1 GiB; the rest stays with the host tiers")};
  rig.gpu.memory_bandwidth = rig.host.memory_bandwidth;
  rig.gpu.matmul_fp32 = {ef.peak_flops_per_s, st.measured("cpu::linear_forward<float> (Eigen, " + std::to_string(host.cores) +
                                                          " threads): best of " + std::to_string(samples.size()) +
                                                          " shapes, at " + top_shape + note)};
  rig.gpu.matmul_tf32 = {ef.peak_flops_per_s, Stamp::estimate("no TF32 on a CPU: the measured fp32 GEMM peak")};
  rig.gpu.matmul_bf16 = {ef.peak_flops_per_s,
                         Stamp::estimate("the CPU backend computes in fp32 (bf16 operands are expanded to fp32 first): "
                                         "the measured fp32 GEMM peak")};
  rig.gpu.gemm_efficiency.points = ef.points;
  rig.gpu.gemm_efficiency.provenance = st.measured(
      "cpu::linear_forward<float> at " + std::to_string(samples.size()) + " layer shapes (rows " +
      std::to_string(sz.gemm_rows.front()) + ".." + std::to_string(sz.gemm_rows.back()) + ", H " +
      std::to_string(sz.gemm_hidden.front()) + ".." + std::to_string(sz.gemm_hidden.back()) +
      ", out H, H/4, 8H/3), best batch of >= " + format_duration(sz.gemm_min_time_s) +
      "; rate / peak made monotone in FLOPs (isotonic least squares); curve vs samples RMS residual " +
      pct(ef.curve_rms_rel) + "; overhead fit t = " + format_duration(ef.overhead.latency_s) + " + F / " +
      format_flop_rate(ef.overhead.bandwidth) + note);
  rep.fits.push_back(lb_report("gemm_overhead", "FLOPs", ef.overhead));
  rep.fits.push_back({"gemm_efficiency_curve", "rate(F) = peak x curve(F), monotone in F (isotonic least squares)",
                      {{"peak_flops_per_s", ef.peak_flops_per_s}, {"curve_points", static_cast<double>(ef.points.size())}},
                      ef.curve_rms_rel, ef.curve_max_rel, static_cast<int64_t>(samples.size())});
  MeasurementTable gt{"gemm", {"m", "n", "k", "flops", "seconds", "flops_per_s"}, {}};
  for (const auto& s : samples)
    gt.rows.push_back({double(s.m), double(s.n), double(s.k), s.flops(), s.seconds, s.flops() / s.seconds});
  rep.measurements.push_back(gt);
  gemm_peak = ef.peak_flops_per_s;
  return cpu_gemm_grid();
}

// The GEMM shape grid (gpu.gemm_shapes) of the CPU backend's linear layers.
Status Profiler::cpu_gemm_grid() {
  std::vector<int64_t> tokens = sz.grid_tokens, sizes = sz.grid_sizes;
  if (tokens.empty() || sizes.empty()) return {};
  if (model != nullptr) grid_axes_of_model(tokens, sizes);
  progress("GEMM shapes: forward, dX and dW at " + std::to_string(tokens.size()) + " x " + std::to_string(sizes.size()) +
           " x " + std::to_string(sizes.size()) + " (tokens, in, out), up to " + format_flops(sz.grid_max_flops));
  detail::OtherLoad load;
  const detail::LinearGrid grid = detail::measure_linear_grid(tokens, sizes, sz.grid_max_flops, sz.grid_max_elems,
                                                              static_cast<int>(host.cores), sz.gemm_min_time_s, detail_cb);
  MT_ASSIGN_OR_RETURN(GemmShapes shapes, detail::gemm_shapes_from_grid(grid, gemm_peak));
  int64_t timed = 0;
  for (double t : grid.seconds[0]) timed += t > 0 ? 1 : 0;
  shapes.provenance = st.measured(
      "cpu::linear_forward / linear_backward<float> (dX only, dW only), " + std::to_string(host.cores) + " threads, at " +
      std::to_string(timed) + " of " + std::to_string(grid.seconds[0].size()) + " (tokens, in, out) cells per op" +
      (model != nullptr ? " of the model's sizes at seq " + std::to_string(model_seq) : std::string(" (generic sizes)")) +
      ", up to " + format_flops(sz.grid_max_flops) + " each; the others take the best of the smaller cells; best batch of >= " +
      format_duration(sz.gemm_min_time_s) + "; efficiency = FLOPs / seconds / the GEMM peak" + load_note(load.share()));
  record_grid(grid, shapes);
  rig.gpu.gemm_shapes = std::move(shapes);
  return {};
}

// The model's own sizes (hidden, q, kv, intermediate, experts, vocabulary) and 1, 2, 4, 8 and 16
// sequences as the grid's axes, so that its plans' linears fall on cells.
void Profiler::grid_axes_of_model(std::vector<int64_t>& tokens, std::vector<int64_t>& sizes) const {
  tokens.clear();
  for (int64_t mb : {1, 2, 4, 8, 16}) tokens.push_back(mb * model_seq);
  sizes = {model->hidden_size, model->num_heads * model->head_dim, model->num_kv_heads * model->head_dim,
           model->intermediate_size, model->vocab_size};
  if (model->num_experts > 0) sizes.push_back(model->num_experts);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
}

// The grid's timed cells as a measurement table of the report (op 0 forward, 1 dX, 2 dW).
void Profiler::record_grid(const detail::LinearGrid& grid, const GemmShapes& shapes) {
  MeasurementTable mt{"gemm_shapes", {"op", "tokens", "in", "out", "flops", "seconds", "efficiency"}, {}};
  for (int op = 0; op < 3; ++op)
    for (size_t a = 0; a < grid.tokens.size(); ++a)
      for (size_t b = 0; b < grid.sizes.size(); ++b)
        for (size_t c = 0; c < grid.sizes.size(); ++c) {
          const size_t cell = (a * grid.sizes.size() + b) * grid.sizes.size() + c;
          const double t = grid.seconds[op][cell];
          if (t <= 0) continue;
          const double f = 2.0 * static_cast<double>(grid.tokens[a] * grid.sizes[b]) * static_cast<double>(grid.sizes[c]);
          mt.rows.push_back({double(op), double(grid.tokens[a]), double(grid.sizes[b]), double(grid.sizes[c]), f, t,
                             shapes.efficiency[op][cell]});
        }
  rep.measurements.push_back(mt);
}

// The CPU backend's grouped GEMMs (MoE experts).
void Profiler::cpu_grouped_gemm() {
  if (!grouped_probe) return;
  // The model's expert shape when it has one, else the generic one; scaled so that the largest
  // call stays within the GEMM probe's FLOP limit.
  const bool moe_model = model != nullptr && model->is_moe() && model->moe_intermediate_size > 0;
  const int64_t experts = moe_model ? std::min(model->num_experts, sz.grouped_experts) : sz.grouped_experts;
  const int64_t h0 = moe_model ? model->hidden_size : sz.grouped_hidden;
  const int64_t i0 = moe_model ? model->moe_intermediate_size : sz.grouped_intermediate;
  const int64_t max_rows = *std::max_element(sz.grouped_rows.begin(), sz.grouped_rows.end());
  const auto [gh, gi] = detail::scaled_expert_shape(h0, i0, experts, max_rows, sz.gemm_max_flops);
  const std::string shape_text = std::to_string(experts) + " experts of hidden " + std::to_string(gh) +
                                 " x intermediate " + std::to_string(gi) +
                                 (moe_model ? " (the model's " + std::to_string(h0) + " x " + std::to_string(i0) +
                                                  (gh != h0 || gi != i0 ? ", scaled to the probe's FLOP limit)" : ")")
                                            : std::string(" (generic)"));
  const auto gshapes = detail::grouped_gemm_shapes(sz.grouped_rows, experts, gh, gi, sz.gemm_max_flops);
  progress("grouped GEMM (MoE experts): cpu::grouped_linear_forward<float> (one GEMM per expert), " + shape_text + ", rows " +
           std::to_string(sz.grouped_rows.front()) + ".." + std::to_string(max_rows));
  detail::OtherLoad gload;
  const auto gsamples = detail::measure_grouped_gemm(gshapes, static_cast<int>(host.cores), sz.gemm_min_time_s, detail_cb);
  auto gf = fit_grouped_gemm_efficiency(gsamples, gemm_peak);
  if (gf.ok()) {
    rig.gpu.grouped_gemm_efficiency = Curve{
        gf->points, st.measured("cpu::grouped_linear_forward<float> (the CPU MoE block's expert GEMMs: one GEMM per "
                                "expert, each with its own weights and rows), " + shape_text + ", gate/up and down, " + std::to_string(gsamples.size()) +
                                " shapes, " + std::to_string(host.cores) + " threads, best batch of >= " +
                                format_duration(sz.gemm_min_time_s) + "; rate / the dense GEMM peak, made monotone in rows "
                                "(isotonic least squares); curve vs samples RMS residual " + pct(gf->curve_rms_rel) +
                                load_note(gload.share()))};
    rep.fits.push_back({"grouped_gemm_curve", "rate(rows) = dense peak x curve(rows per expert), monotone in rows",
                        {{"curve_points", static_cast<double>(gf->points.size())}}, gf->curve_rms_rel, gf->curve_max_rel,
                        static_cast<int64_t>(gsamples.size())});
  } else {
    rep.notes.push_back("grouped GEMM curve not written: " + gf.status().message());
  }
  MeasurementTable ggt{"grouped_gemm", {"experts", "rows", "n", "k", "flops", "seconds", "flops_per_s"}, {}};
  for (const auto& s : gsamples)
    ggt.rows.push_back({double(s.experts), double(s.rows), double(s.n), double(s.k), s.flops(), s.seconds, s.flops() / s.seconds});
  rep.measurements.push_back(ggt);
}

// The CPU backend's attention, forward and backward.
Status Profiler::cpu_attention() {
  const bool quick = sz.gemm_min_time_s < 0.1;
  const auto ashapes = detail::attention_shapes(model, model_seq, quick, std::min<int64_t>(1ll << 30, sz.triad_bytes * 4));
  progress("attention: cpu::attention_forward/backward<float>, " + std::to_string(ashapes.size()) + " shapes" +
           (model != nullptr ? " of the model's heads at seq " + std::to_string(model_seq) : std::string(", generic heads")));
  detail::OtherLoad aload;
  MT_ASSIGN_OR_RETURN(auto asamples, detail::measure_attention(ashapes, static_cast<int>(host.cores),
                                                               sz.gemm_min_time_s, detail_cb));
  const std::string anote = load_note(aload.share());
  MT_ASSIGN_OR_RETURN(detail::AttentionFit af, detail::fit_attention(asamples, gemm_peak));
  Curve ac;
  ac.points = af.points;
  ac.provenance = st.measured("cpu::attention_forward<float> (" + std::to_string(host.cores) + " threads) at " +
                              std::to_string(asamples.size()) +
                              " shapes; x = 2 x tokens x seq x heads x head_dim (the causal half of Q.K^T and P.V), "
                              "y = that / time / the GEMM peak" + anote);
  rig.gpu.attention_efficiency = ac;
  rig.gpu.attention_backward_ratio = {
      af.backward_ratio, st.measured("cpu::attention_backward / cpu::attention_forward time, median of " +
                                     std::to_string(asamples.size()) + " shapes (range " + fmt(af.ratio_min, 3) + ".." +
                                     fmt(af.ratio_max, 3) + ")" + anote)};
  MeasurementTable at{"attention", {"batch", "seq", "heads", "kv_heads", "head_dim", "flops", "forward_s", "backward_s"}, {}};
  for (const auto& a : asamples)
    at.rows.push_back({double(a.shape.batch), double(a.shape.seq), double(a.shape.n_heads), double(a.shape.n_kv_heads),
                       double(a.shape.head_dim), a.flops(), a.forward_s, a.backward_s});
  rep.measurements.push_back(at);
  // Residuals of the one ratio against each shape's own: how well a single figure describes them.
  double sq = 0, worst = 0;
  for (const auto& a : asamples) {
    const double e = std::abs(a.backward_s / a.forward_s - af.backward_ratio) / (a.backward_s / a.forward_s);
    sq += e * e;
    worst = std::max(worst, e);
  }
  rep.fits.push_back({"attention_backward_ratio", "backward time = ratio x forward time (median over shapes)",
                      {{"ratio", af.backward_ratio}}, std::sqrt(sq / static_cast<double>(asamples.size())), worst,
                      static_cast<int64_t>(asamples.size())});
  return {};
}

// The CPU backend's element-wise work.
Status Profiler::cpu_elementwise() {
  // Element-wise: the layer's norms, RoPE, SwiGLU and residual adds, as an effective bandwidth in
  // the cost model's byte accounting.
  int64_t tokens = 2048, eh = 1024, enh = 16, enkv = 8, ehd = 64, ei = 2816;
  if (model != nullptr) {
    tokens = 4 * model_seq;
    eh = model->hidden_size;
    enh = model->num_heads;
    enkv = model->num_kv_heads;
    ehd = model->head_dim;
    ei = model->intermediate_size;
  }
  progress("element-wise: a layer's RMSNorms, RoPE, SwiGLU and adds, forward and backward, " + std::to_string(tokens) +
           " tokens x hidden " + std::to_string(eh));
  detail::OtherLoad eload;
  MT_ASSIGN_OR_RETURN(detail::ElementwiseSample es, detail::measure_elementwise(tokens, eh, enh, enkv, ehd, ei,
                                                                                static_cast<int>(host.cores),
                                                                                sz.gemm_min_time_s));
  rig.gpu.memory_bandwidth = {
      es.effective_bandwidth(),
      st.measured("the CPU backend's element-wise ops of one layer (rmsnorm, rope, swiglu, add; forward " +
                  format_duration(es.forward_s) + ", backward " + format_duration(es.backward_s) + ", " +
                  std::to_string(host.cores) + " threads, " + std::to_string(tokens) + " tokens, hidden " +
                  std::to_string(eh) + ") as an effective bandwidth: the cost model's bytes for them (forward 4 T (10 H "
                  "+ 2 q + 2 kv + 3 I), backward twice that) / their time. On a CPU they are bound by exp, sin and cos "
                  "as much as by memory, so this is well below the triad" + load_note(eload.share()))};
  MeasurementTable et{"elementwise", {"tokens", "hidden", "forward_s", "backward_s", "effective_bytes_per_s"}, {}};
  et.rows.push_back({double(tokens), double(eh), es.forward_s, es.backward_s, es.effective_bandwidth()});
  rep.measurements.push_back(et);
  return {};
}

// The CPU backend: the model's whole layer.
void Profiler::cpu_layer() {
  if (!options.model_spec) return;
  const ModelSpec& spec = *options.model_spec;
  progress("layer: " + spec.name() + " decoder layer forward and backward (exec LayerMath on the CPU backend), "
           "micro-batch 1, 2, 4, 8 at seq " + std::to_string(model_seq));
  detail::OtherLoad lload;
  // The probe builds the model's RAM tier (16 B per parameter): at most a quarter of RAM.
  auto layer = detail::measure_layer(spec, model_seq, {1, 2, 4, 8}, static_cast<int>(host.cores), sz.gemm_min_time_s,
                                     static_cast<int64_t>(host.ram_bytes / 64));
  if (layer.ok()) {
    LayerTimes lt;
    const ModelConfig& mc = spec.config();
    lt.model = spec.name();
    lt.hidden = mc.hidden_size;
    lt.intermediate = mc.intermediate_size;
    lt.heads = mc.num_heads;
    lt.kv_heads = mc.num_kv_heads;
    lt.head_dim = mc.head_dim;
    lt.seq = model_seq;
    if (mc.is_moe_layer(0)) {  // the probe times decoder layer 0
      lt.experts = mc.num_experts;
      lt.experts_per_token = mc.experts_per_token;
      lt.moe_intermediate = mc.moe_intermediate_size;
    }
    if (mc.is_sliding_layer(0) && mc.sliding_window < model_seq) lt.window = mc.sliding_window;
    lt.vocab = mc.vocab_size;  // the points hold the head's time too
    MeasurementTable lt_table{"layer", {"micro_batch", "forward_s", "backward_s", "head_s"}, {}};
    for (const auto& p : *layer) {
      lt.points.push_back({p.micro_batch, p.forward_s, p.backward_s, p.head_s});
      lt_table.rows.push_back({double(p.micro_batch), p.forward_s, p.backward_s, p.head_s});
    }
    lt.provenance = st.measured("one decoder layer of " + spec.name() + " forward and backward, and its head (final "
                                "norm, LM head, cross-entropy, backward), through the CPU backend's table (exec::LayerMath), " + std::to_string(host.cores) +
                                " threads, the median batch of >= 5 and >= " + format_duration(sz.gemm_min_time_s) + " per point" +
                                load_note(lload.share()));
    rig.gpu.layer_times = std::move(lt);
    rep.measurements.push_back(lt_table);
  } else {
    rep.notes.push_back("layer probe skipped: " + layer.status().message());
  }
}

// The CPU backend's transfers.
Status Profiler::cpu_transfers() {
  progress("H2D/D2H: the CPU backend's copies (memcpy, bf16 -> fp32), " + sizes_text(sz.copy_bytes));
  detail::OtherLoad cload;
  const auto h2d = detail::measure_copy("memcpy", sz.copy_bytes, sz.copy_min_time_s);
  detail_cb("d2h");
  const auto d2h = detail::measure_copy("memcpy", sz.copy_bytes, sz.copy_min_time_s);
  detail_cb("bf16 -> fp32 expansion");
  const auto bf16 = detail::measure_copy("bf16", sz.copy_bytes, sz.copy_min_time_s);
  detail_cb("both at once");
  const double duplex = detail::measure_copy_duplex(sz.copy_bytes.back(), std::max(0.05, sz.copy_min_time_s));
  const std::string cnote = load_note(cload.share());
  MT_ASSIGN_OR_RETURN(LatencyBandwidthFit fh, fit_of(h2d));
  MT_ASSIGN_OR_RETURN(LatencyBandwidthFit fd, fit_of(d2h));
  MT_ASSIGN_OR_RETURN(LatencyBandwidthFit fb, fit_of(bf16));
  rig.links.kind = "host-memcpy";
  rig.links.full_duplex = false;
  rep.notes.push_back("two copies at once each ran at " + pct(duplex) + " of one alone; full_duplex is false for the CPU "
                      "backend all the same: its copy threads share the cores and memory with the compute");
  const std::string what = "the CPU backend's fp32 H2D/D2H (std::memcpy on one thread, as Trainer::copy_in and the "
                           "gradient copy do), sources and destinations rotating through >= 64 MiB, best batch of >= " +
                           format_duration(sz.copy_min_time_s) + "; ";
  for (auto [spec, fit, pts] : {std::tuple{&rig.links.h2d, &fh, &h2d}, std::tuple{&rig.links.d2h, &fd, &d2h}}) {
    spec->latency_s = {fit->latency_s, st.measured(what + "intercept of the " + fit_text(*fit, "B/s") + cnote)};
    spec->pinned_bandwidth = rate_curve(*pts, st.measured(what + fit_text(*fit, "B/s") + cnote));
    spec->pageable_bandwidth = rate_curve(
        *pts, st.measured(what + "the CPU backend has no page-locked memory, so pageable = pinned; " + fit_text(*fit, "B/s") + cnote));
  }
  rep.fits.push_back(lb_report("h2d", "bytes", fh));
  rep.fits.push_back(lb_report("d2h", "bytes", fd));
  rep.fits.push_back(lb_report("h2d_bf16_expand", "bf16 bytes", fb));
  rep.notes.push_back("H2D of a bf16 transfer on the CPU backend expands bf16 to fp32 (exec::bf16_to_fp32): " +
                      format_bandwidth(fb.bandwidth) + " of bf16 bytes at large sizes vs " + format_bandwidth(fh.bandwidth) +
                      " for the fp32 memcpy; the rig's link curves are the fp32 memcpy (the CPU backend's default)");
  MeasurementTable t{"h2d", {"bytes", "memcpy_seconds", "d2h_memcpy_seconds", "bf16_expand_seconds"}, {}};
  for (size_t i = 0; i < h2d.size(); ++i) t.rows.push_back({h2d[i].first, h2d[i].second, d2h[i].second, bf16[i].second});
  rep.measurements.push_back(t);
  return {};
}

// Each storage directory: O_DIRECT io_uring reads and writes.
Status Profiler::storage() {
  for (const std::string& dir : options.storage_dirs) {
    progress("storage " + dir + ": O_DIRECT io_uring, " + format_bytes(static_cast<double>(sz.storage_file_bytes)) + " file, " +
             std::to_string(sz.storage_blocks.size() * sz.storage_depths.size()) + " points each way");
    detail::OtherLoad load;
    MT_ASSIGN_OR_RETURN(detail::StorageResult sres, detail::measure_storage(dir, sz, detail_cb));
    NvmeSpec d = std::move(sres.spec);
    d.capacity_bytes.provenance = st.measured(d.capacity_bytes.provenance.source);
    std::string fits_text;
    for (bool write : {false, true}) {
      // Per-request latency and streaming bandwidth from the queue-depth-1 points across block sizes.
      std::vector<std::pair<double, double>> qd1;
      for (const IoPoint& p : write ? d.write : d.read)
        if (p.queue_depth == 1) qd1.emplace_back(static_cast<double>(p.block_bytes), static_cast<double>(p.block_bytes) / p.bytes_per_s);
      if (qd1.size() >= 2) {
        auto f = fit_of(qd1);
        if (f.ok()) {
          rep.fits.push_back(lb_report("storage " + d.path + (write ? " write" : " read") + " qd1", "block bytes", *f));
          fits_text += std::string("; ") + (write ? "write" : "read") + " QD1 " + fit_text(*f, "B/s");
        }
      }
      MeasurementTable t{"storage " + d.path + (write ? " write" : " read"), {"block_bytes", "queue_depth", "bytes_per_s"}, {}};
      for (const IoPoint& p : write ? d.write : d.read)
        t.rows.push_back({static_cast<double>(p.block_bytes), static_cast<double>(p.queue_depth), p.bytes_per_s});
      rep.measurements.push_back(t);
    }
    d.io_provenance = st.measured("O_DIRECT io_uring sequential writes then reads of a " +
                                  format_bytes(static_cast<double>(sz.storage_file_bytes)) + " temp file in " + d.path +
                                  " (filled first; overwritten in place), up to " + format_duration(sz.storage_point_max_s) +
                                  " per point" + fits_text + load_note(load.share()));
    rig.storage.push_back(std::move(d));
  }
  return {};
}

// The report: elapsed time, other load, the description, and a check that the rig loads back.
Result<ProfileReport> Profiler::finish() {
  rep.elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();
  rep.other_load = total_load->share();
  rig.description = "Measured by megatrain-plan profile (" + options.mode + ") on " + host.hostname + " at " + st.when + " in " +
                    fmt(rep.elapsed_s, 3) + " s" + (have_gpu ? "" : "; no GPU, so gpu and links describe the CPU backend") +
                    (rep.other_load >= 0.05 ? "; other processes used " + pct(rep.other_load) + " of the CPUs meanwhile" : "") + ".";
  // What would not load back is an error here, not in the simulator later.
  auto check = HardwareProfile::from_json_text(rig.to_json_text(), "measured rig");
  if (!check.ok()) return check.status();
  return rep;
}

}  // namespace

Result<ProfileReport> run_profile(const ProfileOptions& options) {
  Profiler p(options);
  MT_RETURN_IF_ERROR(p.check_storage_dirs());
  p.find_gpu();
  p.host_section();
  p.triad();
  p.adam();
  if (p.has_gpu()) {
    MT_RETURN_IF_ERROR(p.gpu());
  } else {
    MT_RETURN_IF_ERROR(p.cpu_gemm());
    p.cpu_grouped_gemm();
    MT_RETURN_IF_ERROR(p.cpu_attention());
    MT_RETURN_IF_ERROR(p.cpu_elementwise());
    p.cpu_layer();
    MT_RETURN_IF_ERROR(p.cpu_transfers());
  }
  MT_RETURN_IF_ERROR(p.storage());
  return p.finish();
}

std::string profile_json(const ProfileReport& r) {
  Json j;
  j["rig"] = Json::parse(r.rig.to_json_text());
  Json fits = Json::object();
  for (const FitReport& f : r.fits) {
    Json o;
    o["model"] = f.model;
    for (const auto& [k, v] : f.params) o[k] = v;
    o["rms_rel_residual"] = f.rms_rel;
    o["max_rel_residual"] = f.max_rel;
    o["points"] = f.points;
    fits[f.name] = o;
  }
  j["fits"] = fits;
  Json m = Json::object();
  for (const MeasurementTable& t : r.measurements) {
    Json o;
    o["columns"] = t.columns;
    o["rows"] = t.rows;
    m[t.name] = o;
  }
  j["measurements"] = m;
  j["notes"] = r.notes;
  j["elapsed_s"] = r.elapsed_s;
  j["other_load"] = r.other_load;
  return j.dump(2) + "\n";
}

std::string profile_table(const ProfileReport& r) {
  const HardwareProfile& g = r.rig;
  std::ostringstream o;
  o << "rig '" << g.name << "': measured in " << fmt(r.elapsed_s, 3) << " s";
  if (r.other_load >= 0.05) o << " (other processes used " << pct(r.other_load) << " of the CPUs meanwhile: figures are noisy)";
  o << "\n\nhost        " << g.host.cpu << ", " << format_bytes(g.host.ram_bytes.value) << " RAM\n";
  o << "memory      " << format_bandwidth(g.host.memory_bandwidth.value) << " (triad)\n";
  for (const MeasurementTable& t : r.measurements)
    if (t.name == "triad") {
      o << "            ";
      for (const auto& row : t.rows) o << static_cast<int>(row[0]) << " thr " << format_bandwidth(row[1]) << "   ";
      o << "\n";
    }
  for (const char* f : {"fp32", "bf16", "q8", "q4", "q3", "q2"}) {
    bool any = false;
    for (const auto& a : g.host.adam)
      if (a.state_format == f) {
        if (!any) o << "adam " << f << std::string(6 - std::string(f).size(), ' ');
        any = true;
        o << " " << a.threads << " thr " << format_count(a.params_per_s.value) << " params/s ";
      }
    if (any) o << "\n";
  }
  o << "\ngpu         " << g.gpu.name << "\n";
  o << "  matmul    fp32 " << format_flop_rate(g.gpu.matmul_fp32.value) << ", bf16 " << format_flop_rate(g.gpu.matmul_bf16.value)
    << " (" << provenance_kind_name(g.gpu.matmul_bf16.provenance.kind) << ")\n";
  o << "  gemm efficiency by FLOPs:";
  for (const auto& [x, y] : g.gpu.gemm_efficiency.points) o << " " << format_flops(x) << " " << fmt(y, 2) << ";";
  if (g.gpu.grouped_gemm_efficiency) {
    o << "\n  grouped gemm efficiency by rows per expert:";
    for (const auto& [x, y] : g.gpu.grouped_gemm_efficiency->points) o << " " << fmt(x, 5) << " " << fmt(y, 2) << ";";
  }
  o << "\nlinks       " << g.links.kind << (g.links.full_duplex ? ", full duplex" : ", half duplex") << "\n";
  auto link = [&](const char* n, const LinkSpec& l) {
    o << "  " << n << "       latency " << format_duration(l.latency_s.value) << ";";
    for (const auto& [x, y] : l.pinned_bandwidth.points) o << " " << format_bytes(x) << " " << format_bandwidth(y) << ";";
    o << "\n";
  };
  link("h2d", g.links.h2d);
  link("d2h", g.links.d2h);
  for (const NvmeSpec& d : g.storage) {
    o << "\nstorage     " << d.name << ", " << format_bytes(d.capacity_bytes.value) << " free\n";
    o << "  block       QD   read         write\n";
    for (size_t i = 0; i < d.read.size(); ++i) {
      char line[160];
      std::snprintf(line, sizeof(line), "  %-10s %4lld   %-12s %-12s\n", format_bytes(static_cast<double>(d.read[i].block_bytes)).c_str(),
                    static_cast<long long>(d.read[i].queue_depth), format_bandwidth(d.read[i].bytes_per_s).c_str(),
                    i < d.write.size() ? format_bandwidth(d.write[i].bytes_per_s).c_str() : "");
      o << line;
    }
  }
  o << "\nfits (RMS / max relative residual)\n";
  for (const FitReport& f : r.fits) {
    char line[256];
    std::snprintf(line, sizeof(line), "  %-28s %7s / %-7s ", f.name.c_str(), pct(f.rms_rel).c_str(), pct(f.max_rel).c_str());
    o << line;
    for (const auto& [k, v] : f.params) o << " " << k << " " << fmt(v);
    o << "  (" << f.points << " points)\n";
  }
  if (!r.notes.empty()) o << "\nnotes\n";
  for (const auto& n : r.notes) o << "  - " << n << "\n";
  return o.str();
}

int profile_command(const ProfileCommand& cmd) {
  ProfileOptions opt;
  opt.storage_dirs = cmd.storage_dirs;
  opt.sizes = cmd.quick ? ProfileSizes::quick() : ProfileSizes::full();
  if (cmd.storage_gib > 0) opt.sizes.storage_file_bytes = static_cast<int64_t>(cmd.storage_gib * static_cast<double>(kGiB));
  opt.mode = cmd.quick ? "quick" : "full";
  if (!cmd.model.empty()) {
    auto spec = ModelSpec::load(cmd.model);
    if (!spec.ok()) {
      std::fprintf(stderr, "megatrain-plan: error: --model: %s\n", spec.status().to_string().c_str());
      return 1;
    }
    opt.model = spec->config();
    opt.model_spec = std::make_shared<const ModelSpec>(*spec);
    opt.seq = cmd.seq;
    opt.mode += ", shapes of " + spec->name() + " at seq " +
                std::to_string(cmd.seq > 0 ? cmd.seq : std::min<int64_t>(spec->config().max_position_embeddings, 2048));
  }
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  bool open_line = false;  // a detail line on a terminal, to be overwritten
  opt.progress = [&](int step, int steps, const std::string& what) {
    const bool sub = !what.empty() && what[0] == ' ';
    if (sub && !tty) return;  // details only where they can be overwritten in place
    if (sub) {
      std::fprintf(stderr, "\r\033[K      %s", what.c_str() + 2);
      open_line = true;
    } else {
      std::fprintf(stderr, "%s[%d/%d] %s\n", open_line ? "\r\033[K" : "", step, steps, what.c_str());
      open_line = false;
    }
    std::fflush(stderr);
  };
  auto r = run_profile(opt);
  if (open_line) std::fprintf(stderr, "\r\033[K");
  if (!r.ok()) {
    std::fprintf(stderr, "megatrain-plan: error: %s\n", r.status().to_string().c_str());
    return 1;
  }
  if (!cmd.output.empty()) {
    const std::filesystem::path out(cmd.output);
    if (!out.stem().empty()) r->rig.name = out.stem().string();
    Status s = r->rig.save(out);
    if (!s.ok()) {
      std::fprintf(stderr, "megatrain-plan: error: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  std::fprintf(stderr, "profiled in %.1f s\n", r->elapsed_s);
  if (cmd.json) {
    std::fputs(profile_json(*r).c_str(), stdout);
  } else {
    std::fputs(profile_table(*r).c_str(), stdout);
    if (!cmd.output.empty()) std::printf("\nrig written to %s\n", cmd.output.c_str());
  }
  return 0;
}

}  // namespace megatrain::planner

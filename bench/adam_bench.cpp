// megatrain-bench adam: the fused AdamW pass (exec::adamw_update_moments) for every moment state
// format, each as a fraction of the machine's memory bandwidth (a STREAM triad measured in the same
// run) and against PyTorch's CPU AdamW and DeepSpeed's CPU Adam on the same parameter count (a
// subprocess of the project's Python, MEGATRAIN_PYTHON).
//
// megatrain-bench codec: the byte-plane codec (exec::compress_fp32) on real Adam moments, m and v
// of a small Llama trained for a few steps in-process, against zstd on the raw bytes.
//
// megatrain-bench norm: the clipping norm's pass (exec::sums_of_squares) at 1 and T threads as a
// fraction of the triad measured in the same run, against one running sum on one thread (what the
// pass was before 2026-12-07).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "megatrain/core/model_spec.h"
#include "bench_flags.h"
#include "bench_util.h"
#include "megatrain/core/output_path.h"
#include "megatrain/core/plan.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/moments.h"
#include "megatrain/executor/optimizer.h"
#include "megatrain/executor/plane_codec.h"
#include "megatrain/executor/trainer.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace exec = megatrain::exec;
using megatrain::StateFormat;

double seconds_since(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size();
  return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

using megatrain::bench::OtherLoad;

// Runs f(i) for i in [0, threads) on `threads` threads (the calling one included), as the fused pass
// itself splits its work.
template <typename F>
void parallel(int threads, F&& f) {
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back([&f, i] { f(i); });
  f(0);
  for (auto& t : pool) t.join();
}

// ---- adam ---------------------------------------------------------------------------------------

// STREAM triad a = b + s c over float arrays of n elements, 12 bytes per element counted (as STREAM
// counts: the write-allocate read of a is not). Median of reps after a warm-up pass. GB/s (1e9).
double triad_gbps(int64_t n, int threads, int reps) {
  exec::AlignedArray<float> a(n), b(n), c(n);  // zeroed by one thread, then written by all below
  parallel(threads, [&](int i) {
    const int64_t lo = n * i / threads, hi = n * (i + 1) / threads;
    for (int64_t j = lo; j < hi; ++j) b[j] = 1.0f + static_cast<float>(j & 7), c[j] = 2.0f;
  });
  const float s = 3.0f;
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    parallel(threads, [&](int i) {
      const int64_t lo = n * i / threads, hi = n * (i + 1) / threads;
      float* __restrict pa = a.data();
      const float* __restrict pb = b.data();
      const float* __restrict pc = c.data();
      for (int64_t j = lo; j < hi; ++j) pa[j] = pb[j] + s * pc[j];
    });
    if (r > 0) t.push_back(seconds_since(t0));
  }
  volatile float sink = a[n / 2];
  (void)sink;
  return 12.0 * static_cast<double>(n) / median(t) * 1e-9;
}

// The fused pass over n parameters with m and v in `format`: median params/s of `reps` passes after
// two warm-up passes (the first from zero moments).
struct AdamArrays {
  exec::AlignedArray<float> w, g;
  explicit AdamArrays(int64_t n) : w(n), g(n) {
    uint32_t x = 12345;
    for (int64_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      const float u = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
      w[i] = 0.04f * u;
      g[i] = 2e-3f * (u + 0.1f * static_cast<float>(i % 7) - 0.3f);
    }
  }
};

double adam_params_per_s(AdamArrays& arr, int64_t n, StateFormat f, int threads, int reps, exec::Isa isa) {
  exec::MomentStore m = exec::MomentStore::create(f, false, {n}, 128);
  exec::MomentStore v = exec::MomentStore::create(f, true, {n}, 128);
  const exec::MomentRef mr = m.tensor(0), vr = v.tensor(0);
  exec::AdamWStep s;
  s.lr = 1e-4;
  s.weight_decay = 0.1;
  s.t = 1;
  std::vector<double> t;
  for (int r = 0; r < reps + 2; ++r, ++s.t) {
    const auto t0 = Clock::now();
    exec::adamw_update_moments(arr.w.data(), arr.g.data(), mr, vr, n, s, nullptr, nullptr, threads, isa);
    if (r >= 2) t.push_back(seconds_since(t0));
  }
  return static_cast<double>(n) / median(t);
}

// Bytes the fused pass moves per parameter: read g, read and write w, read and write m and v.
double adam_bytes_per_param(StateFormat f) { return 4 + 8 + 2 * 2 * megatrain::state_format_bytes_per_element(f, 128); }

// torch.optim.AdamW (default foreach) on one fp32 tensor of n parameters with `threads` threads;
// median of `reps` steps after two warm-up steps. nullopt (and why) when torch cannot be imported.
const char* kTorchScript = R"PY(
import sys, time, json
try:
    import torch
except Exception as e:
    print(json.dumps({"error": "import torch: " + str(e)}))
    sys.exit(0)
n, threads, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)

def params_per_s(make):
    """n / the median time of `reps` steps of the optimizer make(p) builds, after two warm-up steps."""
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    opt = make(p)
    opt.step(); opt.step()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); opt.step(); ts.append(time.perf_counter() - t0)
    ts.sort()
    med = ts[len(ts) // 2] if len(ts) % 2 else 0.5 * (ts[len(ts) // 2 - 1] + ts[len(ts) // 2])
    return n / med, opt

rate, opt = params_per_s(lambda p: torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
out = {"params_per_s": rate, "version": torch.__version__, "foreach": opt.defaults.get("foreach"),
       "threads": torch.get_num_threads()}
# DeepSpeed's CPU Adam (ZeRO-Offload's optimizer), AdamW mode, on the same tensor and threads
# (OpenMP: OMP_NUM_THREADS, set by the caller); its C++ op is built on first use.
try:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    out["deepspeed_params_per_s"], _ = params_per_s(lambda p: DeepSpeedCPUAdam(
        [p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=True))
    out["deepspeed_version"] = deepspeed.__version__
except Exception as e:
    out["deepspeed_error"] = type(e).__name__ + ": " + str(e).splitlines()[0][:160] if str(e) else type(e).__name__
print(json.dumps(out))
)PY";

struct TorchResult {
  std::optional<double> params_per_s;
  std::string what;  // version and path, or why there is no figure
  std::optional<double> deepspeed_params_per_s;  // DeepSpeedCPUAdam, when deepspeed imports
  std::string deepspeed_what;
};

TorchResult torch_adamw(int64_t n, int threads, int reps) {
  TorchResult r;
  char path[] = "/tmp/megatrain-bench-torch-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) {
    r.what = "cannot write the torch script to /tmp";
    return r;
  }
  const size_t len = std::strlen(kTorchScript);
  const bool wrote = write(fd, kTorchScript, len) == static_cast<ssize_t>(len);
  close(fd);
  if (!wrote) {
    unlink(path);
    r.what = "cannot write the torch script to /tmp";
    return r;
  }
  // The project's Python (its venv: MEGATRAIN_PYTHON=build/venv/bin/python), else python3.
  const char* py = std::getenv("MEGATRAIN_PYTHON");
  const std::string cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " " + std::string(py && *py ? py : "python3") + " " +
                          std::string(path) + " " + std::to_string(n) + " " + std::to_string(threads) + " " + std::to_string(reps) +
                          " 2>/dev/null";
  std::string out;
  if (std::FILE* p = popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  unlink(path);
  auto field = [&](const std::string& key) -> std::string {
    const auto k = out.find("\"" + key + "\": ");
    if (k == std::string::npos) return "";
    size_t a = k + key.size() + 4, b = a;
    if (a < out.size() && out[a] == '"') {
      b = out.find('"', a + 1);
      return b == std::string::npos ? "" : out.substr(a + 1, b - a - 1);
    }
    while (b < out.size() && out[b] != ',' && out[b] != '}') ++b;
    return out.substr(a, b - a);
  };
  const std::string rate = field("params_per_s");
  if (!rate.empty()) {
    r.params_per_s = std::atof(rate.c_str());
    r.what = "torch " + field("version") + ", torch.optim.AdamW(foreach=" + field("foreach") + ": " +
             (field("foreach") == "true" ? "multi-tensor" : "single-tensor") + " path), " + field("threads") + " threads";
  } else {
    const std::string err = field("error");
    r.what = err.empty() ? "no result from the Python (MEGATRAIN_PYTHON)" : err;
  }
  if (const std::string ds = field("deepspeed_params_per_s"); !ds.empty()) {
    r.deepspeed_params_per_s = std::atof(ds.c_str());
    r.deepspeed_what = "deepspeed " + field("deepspeed_version") + ", DeepSpeedCPUAdam(adamw_mode=True)";
  } else {
    r.deepspeed_what = field("deepspeed_error").empty() ? "deepspeed not run" : field("deepspeed_error");
  }
  return r;
}

const std::vector<StateFormat> kFormats = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kQ8,
                                           StateFormat::kQ4,   StateFormat::kQ3,   StateFormat::kQ2};

constexpr const char* kAdam = "megatrain-bench adam";
constexpr const char* kCodec = "megatrain-bench codec";

int adam(int argc, char** argv) {
  bool json = false;
  int64_t params = 32ll << 20;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int reps = 5;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "--params") params = megatrain::bench::int_arg(kAdam, argc, argv, i, int64_t{1} << 16, int64_t{1} << 32);
    else if (a == "--threads") threads = static_cast<int>(megatrain::bench::int_arg(kAdam, argc, argv, i, 1, 1024));
    else if (a == "--repeat") reps = static_cast<int>(megatrain::bench::int_arg(kAdam, argc, argv, i, 1, 1000));
    else {
      std::fprintf(stderr, "megatrain-bench adam: unknown argument '%s'; accepted: --params N, --threads T, --repeat N, "
                           "--json\n", a.c_str());
      return 1;
    }
  }
  const OtherLoad load;
  // The triad's arrays are as large as the Adam pass's: far beyond any cache. A pass is short (a few
  // ms), so it takes three times the passes for a steady median.
  const double triad = triad_gbps(params, threads, 3 * reps);

  struct FormatRow {
    StateFormat f;
    double params_per_s = 0, fraction = 0;
  };
  std::vector<FormatRow> rows;
  struct IsaRow {
    StateFormat f;
    exec::Isa isa;
    double params_per_s = 0;
  };
  std::vector<IsaRow> isa_rows;
  const exec::Isa best = exec::best_isa();
  {
    AdamArrays arr(params);
    for (StateFormat f : kFormats) {
      FormatRow r{f};
      r.params_per_s = adam_params_per_s(arr, params, f, threads, reps, exec::Isa::kAuto);
      r.fraction = r.params_per_s * adam_bytes_per_param(f) / (triad * 1e9);
      rows.push_back(r);
    }
    for (StateFormat f : {StateFormat::kFp32, StateFormat::kQ4})
      for (exec::Isa isa : {exec::Isa::kScalar, exec::Isa::kAvx2, exec::Isa::kAvx512}) {
        if (!exec::resolve_isa(isa).ok()) continue;
        isa_rows.push_back({f, isa, adam_params_per_s(arr, params, f, threads, reps, isa)});
      }
  }
  const double other = load.share();
  const TorchResult torch = torch_adamw(params, threads, reps);
  const double fp32 = rows[0].params_per_s;
  const double torch_rate = torch.params_per_s.value_or(0.0);
  const double speedup = torch_rate > 0 ? fp32 / torch_rate : 0.0;  // 0: no torch figure

  if (json) {
    std::printf("{\"triad_gbps\": %.3f, \"torch_params_per_s\": ", triad);
    if (torch_rate > 0) std::printf("%.0f", torch_rate);
    else std::printf("null");
    std::printf(", \"formats\": {");
    for (size_t i = 0; i < rows.size(); ++i)
      std::printf("%s\"%s\": {\"params_per_s\": %.0f, \"bandwidth_fraction\": %.4f}", i ? ", " : "",
                  megatrain::state_format_name(rows[i].f), rows[i].params_per_s, rows[i].fraction);
    std::printf("}, \"bytes_per_param\": {");
    for (size_t i = 0; i < rows.size(); ++i)
      std::printf("%s\"%s\": %.6g", i ? ", " : "", megatrain::state_format_name(rows[i].f), adam_bytes_per_param(rows[i].f));
    std::printf("}, \"isa\": {");
    bool first = true;
    for (StateFormat f : {StateFormat::kFp32, StateFormat::kQ4}) {
      std::printf("%s\"%s\": {", first ? "" : ", ", megatrain::state_format_name(f));
      first = false;
      bool inner = true;
      for (const IsaRow& r : isa_rows)
        if (r.f == f) {
          std::printf("%s\"%s\": %.0f", inner ? "" : ", ", exec::isa_name(r.isa), r.params_per_s);
          inner = false;
        }
      std::printf("}");
    }
    std::printf("}, \"speedup_vs_torch\": ");
    if (speedup > 0) std::printf("%.3f", speedup);
    else std::printf("null");
    std::printf(", \"deepspeed_params_per_s\": ");
    if (torch.deepspeed_params_per_s) std::printf("%.0f", *torch.deepspeed_params_per_s);
    else std::printf("null");
    std::printf(", \"threads\": %d, \"params\": %lld, \"auto_isa\": \"%s\", \"other_load\": %.3f}\n", threads,
                static_cast<long long>(params), exec::isa_name(best), other);
    return 0;
  }
  std::printf("megatrain-bench adam: exec::adamw_update_moments over %lld parameters (m and v in the format, block 128),\n"
              "  %d thread(s), median of %d passes; bandwidth fraction = params/s x bytes per parameter / triad\n",
              static_cast<long long>(params), threads, reps);
  std::printf("  STREAM triad (float, 3 x %.0f MB, 12 B per element, median of %d): %.2f GB/s\n",
              4.0 * static_cast<double>(params) / 1e6, 3 * reps, triad);
  std::printf("  %-8s %14s %10s %12s\n", "format", "params/s", "B/param", "of triad");
  for (const FormatRow& r : rows)
    std::printf("  %-8s %14.4g %10.4g %11.1f%%\n", megatrain::state_format_name(r.f), r.params_per_s,
                adam_bytes_per_param(r.f), 100 * r.fraction);
  std::printf("  instruction sets (auto = %s):\n", exec::isa_name(best));
  for (const IsaRow& r : isa_rows) {
    double ref = 0;
    for (const IsaRow& s : isa_rows)
      if (s.f == r.f && s.isa == exec::Isa::kScalar) ref = s.params_per_s;
    std::printf("    %-5s %-7s %14.4g params/s  %6.2fx scalar\n", megatrain::state_format_name(r.f), exec::isa_name(r.isa),
                r.params_per_s, ref > 0 ? r.params_per_s / ref : 0.0);
  }
  if (torch_rate > 0)
    std::printf("  PyTorch (%s): %.4g params/s; fp32 fused pass / torch = %.2fx\n", torch.what.c_str(), torch_rate,
                speedup);
  else
    std::printf("  PyTorch: no figure (%s)\n", torch.what.c_str());
  if (torch.deepspeed_params_per_s)
    std::printf("  DeepSpeed (%s): %.4g params/s; fp32 fused pass / DeepSpeed = %.2fx\n", torch.deepspeed_what.c_str(),
                *torch.deepspeed_params_per_s, fp32 / *torch.deepspeed_params_per_s);
  else
    std::printf("  DeepSpeed: no figure (%s)\n", torch.deepspeed_what.c_str());
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other,
              other > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  return 0;
}

// ---- norm ---------------------------------------------------------------------------------------

// One running sum on one thread: the pass before 2026-12-07, the reference. Not inlined, so the
// compiler cannot fold repeated calls on the same array.
[[gnu::noipa]] double one_running_sum(const float* g, int64_t n) {
  double total = 0;
  for (int64_t b = 0; b < n; b += 4096) {
    double part = 0;
    for (int64_t i = b; i < std::min(n, b + 4096); ++i) part += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    total += part;
  }
  return total;
}

int norm(int argc, char** argv) {
  constexpr const char* kNorm = "megatrain-bench norm";
  bool json = false;
  int64_t params = 64ll << 20;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int reps = 7;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "--params") params = megatrain::bench::int_arg(kNorm, argc, argv, i, int64_t{1} << 16, int64_t{1} << 32);
    else if (a == "--threads") threads = static_cast<int>(megatrain::bench::int_arg(kNorm, argc, argv, i, 1, 1024));
    else if (a == "--repeat") reps = static_cast<int>(megatrain::bench::int_arg(kNorm, argc, argv, i, 1, 1000));
    else {
      std::fprintf(stderr, "megatrain-bench norm: unknown argument '%s'; accepted: --params N, --threads T, --repeat N, --json\n",
                   a.c_str());
      return 1;
    }
  }
  const OtherLoad load;
  const double triad = triad_gbps(params, threads, 3 * reps);
  AdamArrays arr(params);
  const std::vector<exec::SquaresRange> ranges = {{arr.g.data(), params}};
  // Median elements/s of reps passes after one warm-up; every pass's sum must be the first's.
  auto rate = [&](auto&& pass) {
    const double first = pass();
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      const double v = pass();
      t.push_back(seconds_since(t0));
      if (v != first) {
        std::fprintf(stderr, "megatrain-bench norm: a pass gave %.17g after %.17g\n", v, first);
        std::exit(1);
      }
    }
    return static_cast<double>(params) / median(t);
  };
  const double one_sum = rate([&] { return one_running_sum(arr.g.data(), params); });
  const double one_thread = rate([&] { return exec::sum_of_squares(arr.g.data(), params); });
  const double all_threads = rate([&] {
    double out = 0;
    exec::sums_of_squares(ranges, &out, threads);
    return out;
  });
  const double other = load.share();
  auto of_triad = [&](double elems_per_s) { return 4 * elems_per_s / (triad * 1e9); };
  if (json) {
    std::printf("{\"triad_gbps\": %.3f, \"one_running_sum\": %.0f, \"one_thread\": %.0f, \"threads\": %d, "
                "\"all_threads\": %.0f, \"all_threads_of_triad\": %.4f, \"params\": %lld, \"other_load\": %.3f}\n",
                triad, one_sum, one_thread, threads, all_threads, of_triad(all_threads), static_cast<long long>(params), other);
    return 0;
  }
  std::printf("megatrain-bench norm: the clipping norm's sum of squares over %lld fp32 gradients, median of %d passes\n",
              static_cast<long long>(params), reps);
  std::printf("  STREAM triad (float, %d thread(s)): %.2f GB/s; fraction = 4 B x elements/s / triad\n", threads, triad);
  std::printf("  one running sum, 1 thread (before)   %8.3g elements/s  %5.1f%% of triad\n", one_sum, 100 * of_triad(one_sum));
  std::printf("  sum_of_squares, 1 thread              %8.3g elements/s  %5.1f%% of triad  %5.2fx before\n", one_thread,
              100 * of_triad(one_thread), one_thread / one_sum);
  std::printf("  sums_of_squares, %2d thread(s)         %8.3g elements/s  %5.1f%% of triad  %5.2fx before\n", threads, all_threads,
              100 * of_triad(all_threads), all_threads / one_sum);
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other,
              other > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  return 0;
}

// ---- codec --------------------------------------------------------------------------------------

[[noreturn]] void die(const std::string& what, const megatrain::Status& s) {
  std::fprintf(stderr, "megatrain-bench codec: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}

std::string plan_text(int64_t steps) {
  return R"({"schema": "megatrain.plan/1", "model": "small-llama", "rig": "cpu-dev-2core",
    "training": {"seq_len": 128, "micro_batch": 4, "grad_accum": 1, "steps": )" +
         std::to_string(steps) + R"(, "seed": 1, "lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": )" +
         std::to_string(std::min<int64_t>(3, steps - 1)) + R"(,
                 "min_lr": 1e-4, "clip_grad_norm": 1.0, "data_order": "sequential"},
    "precision": {"compute": "fp32", "master": "fp32", "transfer": "fp32"},
    "schedule": {"order": "layer-major", "prefetch_depth": 2, "device_layer_buffers": 3,
                 "checkpoint_every": 1, "checkpoint_location": "device"},
    "placement": {"master_weights": "ram", "optimizer_states": "ram", "device_budget_bytes": 1073741824},
    "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "threads": 2}
  })";
}

using megatrain::bench::make_tokens;

struct CodecRow {
  std::string tensor, codec;
  int level = 0;
  int threads = 1;
  double raw_bytes = 0, packed_bytes = 0, compress_s = 1e30, decompress_s = 1e30;
  double plane_bytes[4] = {};  // byte planes only: compressed bytes of each plane, over all units
  bool exact = true;
};

int codec(int argc, char** argv) {
  bool json = false;
  int64_t steps = 30;
  int reps = 3;
  std::vector<int> levels = {1, 3};
  std::string dir = std::filesystem::temp_directory_path().string();
  const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else if (a == "--steps") steps = megatrain::bench::int_arg(kCodec, argc, argv, i, 1, 100000);
    else if (a == "--repeat") reps = static_cast<int>(megatrain::bench::int_arg(kCodec, argc, argv, i, 1, 1000));
    else if (a == "--level") levels = {static_cast<int>(megatrain::bench::int_arg(kCodec, argc, argv, i, 1, 22))};  // zstd's levels
    else {
      std::fprintf(stderr, "megatrain-bench codec: unknown argument '%s'; accepted: --steps N, --repeat N, --level L, "
                           "--dir D, --json\n", a.c_str());
      return 1;
    }
  }
  // The checkpoints it times go to --dir: probed before the training run that makes the moments.
  if (megatrain::Status s = megatrain::check_output("--dir", dir, megatrain::OutputKind::kExistingFolder); !s.ok())
    die("--dir", s);
  // A short training run for real moments.
  auto plan = megatrain::Plan::from_json_text(plan_text(steps), "bench plan");
  if (!plan.ok()) die("plan", plan.status());
  auto model = plan->resolve_model();
  if (!model.ok()) die("model", model.status());
  exec::HostState state = exec::HostState::create(*model, plan->precision.transfer);
  (void)state.init_random(1, 0.02);  // RAM only: cannot fail
  auto tokens = std::make_shared<const exec::TokenFile>(exec::TokenFile::from_tokens(make_tokens(1 << 20, 256)));
  auto loader = exec::DataLoader::create(tokens, plan->training.seq_len, plan->training.micro_batch,
                                         plan->training.grad_accum, exec::DataOrder::kSequential, 1,
                                         model->config().vocab_size);
  if (!loader.ok()) die("data", loader.status());
  exec::TrainerOptions o;
  o.threads = 2;
  const auto t_train = Clock::now();
  double first_loss = 0, last_loss = 0;
  {
    auto trainer = exec::Trainer::create(*plan, *model, state, *loader, o);
    if (!trainer.ok()) die("trainer", trainer.status());
    for (int64_t s = 0; s < steps; ++s) {
      auto r = (*trainer)->run_step(s);
      if (!r.ok()) die("step " + std::to_string(s), r.status());
      if (s == 0) first_loss = r->loss;
      last_loss = r->loss;
    }
    (*trainer)->wait_for_updates();
  }
  const double train_s = seconds_since(t_train);

  // Each unit's m and v (and master weights) compressed on their own, as a unit is stored.
  struct Tensor {
    std::string name;
    std::vector<std::pair<const float*, int64_t>> parts;
  };
  std::vector<Tensor> tensors = {{"m", {}}, {"v", {}}, {"master", {}}};
  int64_t params = 0;
  for (const exec::UnitState& u : state.units()) {
    tensors[0].parts.push_back({u.m.data(), u.m.numel()});
    tensors[1].parts.push_back({u.v.data(), u.v.numel()});
    tensors[2].parts.push_back({u.master.data(), u.numel});
    params += u.numel;
  }
  const OtherLoad load;
  std::vector<CodecRow> rows;
  for (const Tensor& t : tensors)
    for (int level : levels)
      for (const auto& [split, th] : {std::pair{exec::PlaneSplit::kBytePlanes, 1}, std::pair{exec::PlaneSplit::kBytePlanes, threads},
                                      std::pair{exec::PlaneSplit::kNone, 1}}) {
        if (split == exec::PlaneSplit::kBytePlanes && th == threads && threads == 1) continue;  // the row above
        CodecRow r{t.name, split == exec::PlaneSplit::kBytePlanes ? "byte-planes+zstd" : "zstd", level, th};
        for (int rep = 0; rep < reps; ++rep) {
          double c_s = 0, d_s = 0, packed = 0, raw = 0, planes[4] = {};
          for (const auto& [p, n] : t.parts) {
            auto a = Clock::now();
            const std::vector<uint8_t> enc = exec::compress_fp32(p, n, level, split, th);
            c_s += seconds_since(a);
            std::vector<float> back(static_cast<size_t>(n));
            a = Clock::now();
            const megatrain::Status st = exec::decompress_fp32(enc, back.data(), n);
            d_s += seconds_since(a);
            if (!st.ok()) die("decompress " + t.name, st);
            r.exact = r.exact && std::memcmp(back.data(), p, sizeof(float) * static_cast<size_t>(n)) == 0;
            raw += 4.0 * static_cast<double>(n);
            packed += static_cast<double>(enc.size());
            if (split == exec::PlaneSplit::kBytePlanes)
              for (int k = 0; k < 4; ++k) {
                uint64_t sz = 0;
                for (int b = 0; b < 8; ++b) sz |= static_cast<uint64_t>(enc[16 + 8 * k + b]) << (8 * b);
                planes[k] += static_cast<double>(sz);
              }
          }
          r.raw_bytes = raw;
          r.packed_bytes = packed;
          for (int k = 0; k < 4; ++k) r.plane_bytes[k] = planes[k];
          r.compress_s = std::min(r.compress_s, c_s);
          r.decompress_s = std::min(r.decompress_s, d_s);
        }
        rows.push_back(r);
      }
  // Whole checkpoints of this state (master weights, fp32 m and v) to `dir`, plain and with the
  // fp32 moments compressed (megatrain-exec --checkpoint-compress), alternating, best of reps:
  // the time includes the fsyncs, so it is the time a run waits for a checkpoint.
  struct SaveRow {
    double seconds = 1e30, optimizer_bytes = 0;
  } saves[2];
  {
    exec::CheckpointInfo info;
    info.next_step = steps;
    info.model_name = model->name();
    info.parameters = params;
    info.plan_json = plan->to_json_text();
    info.data = exec::data_position(*loader);
    info.seed = 1;
    const std::filesystem::path root =
        std::filesystem::path(dir) / ("megatrain-bench-codec-" + std::to_string(::getpid()));
    for (int rep = 0; rep < reps; ++rep)
      for (int c = 0; c < 2; ++c) {
        std::error_code ec;
        std::filesystem::remove_all(root, ec);
        exec::SaveOptions so;
        so.compress_fp32_moments = c == 1;
        so.threads = threads;
        const auto a = Clock::now();
        const megatrain::Status st = exec::save_checkpoint(root, state, info, so);
        const double t = seconds_since(a);
        if (!st.ok()) die("checkpoint into " + dir, st);
        saves[c].seconds = std::min(saves[c].seconds, t);
        const std::filesystem::path step = exec::checkpoint_step_dir(root, steps);
        saves[c].optimizer_bytes = static_cast<double>(std::filesystem::file_size(step / "optimizer.safetensors"));
      }
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  const double other = load.share();
  bool all_exact = true;
  for (const CodecRow& r : rows) all_exact = all_exact && r.exact;

  if (json) {
    std::printf("{\"model\": \"small-llama\", \"steps\": %lld, \"params\": %lld, \"units\": %zu, \"final_loss\": %.5f, "
                "\"results\": [",
                static_cast<long long>(steps), static_cast<long long>(params), state.units().size(), last_loss);
    for (size_t i = 0; i < rows.size(); ++i) {
      const CodecRow& r = rows[i];
      std::printf("%s{\"tensor\": \"%s\", \"codec\": \"%s\", \"level\": %d, \"threads\": %d, \"ratio\": %.4f, "
                  "\"compress_mb_s\": %.1f, \"decompress_mb_s\": %.1f, \"bit_exact\": %s",
                  i ? ", " : "", r.tensor.c_str(), r.codec.c_str(), r.level, r.threads, r.raw_bytes / r.packed_bytes,
                  r.raw_bytes / r.compress_s * 1e-6, r.raw_bytes / r.decompress_s * 1e-6, r.exact ? "true" : "false");
      if (r.codec == "byte-planes+zstd")
        std::printf(", \"plane_ratios\": [%.3f, %.3f, %.3f, %.3f]", r.raw_bytes / 4 / r.plane_bytes[0],
                    r.raw_bytes / 4 / r.plane_bytes[1], r.raw_bytes / 4 / r.plane_bytes[2], r.raw_bytes / 4 / r.plane_bytes[3]);
      std::printf("}");
    }
    std::printf("], \"checkpoint\": {\"dir\": \"%s\", \"plain_s\": %.4f, \"compressed_s\": %.4f, "
                "\"plain_optimizer_bytes\": %.0f, \"compressed_optimizer_bytes\": %.0f}",
                dir.c_str(), saves[0].seconds, saves[1].seconds, saves[0].optimizer_bytes, saves[1].optimizer_bytes);
    std::printf(", \"other_load\": %.3f}\n", other);
    return all_exact ? 0 : 2;
  }
  std::printf("megatrain-bench codec: small-llama (%lld parameters, %zu units) trained %lld steps in %.1f s (loss %.3f -> "
              "%.3f);\n  each unit's fp32 m, v and master weights compressed on its own, best of %d;\n"
              "  MB/s of raw fp32 bytes (1e6); plane ratios: byte 0 (low mantissa) .. byte 3 (sign, exponent)\n",
              static_cast<long long>(params), state.units().size(), static_cast<long long>(steps), train_s, first_loss,
              last_loss, reps);
  std::printf("  %-7s %-17s %5s %7s %8s %14s %16s   %s\n", "tensor", "codec", "level", "threads", "ratio", "compress MB/s",
              "decompress MB/s", "plane ratios");
  for (const CodecRow& r : rows) {
    std::printf("  %-7s %-17s %5d %7d %7.3fx %14.0f %16.0f", r.tensor.c_str(), r.codec.c_str(), r.level, r.threads,
                r.raw_bytes / r.packed_bytes, r.raw_bytes / r.compress_s * 1e-6, r.raw_bytes / r.decompress_s * 1e-6);
    if (r.codec == "byte-planes+zstd")
      std::printf("   %.2f %.2f %.2f %.2f", r.raw_bytes / 4 / r.plane_bytes[0], r.raw_bytes / 4 / r.plane_bytes[1],
                  r.raw_bytes / 4 / r.plane_bytes[2], r.raw_bytes / 4 / r.plane_bytes[3]);
    std::printf("\n");
  }
  std::printf("  round trips %s\n", all_exact ? "bit-exact" : "NOT BIT-EXACT (a correctness bug)");
  std::printf("  whole checkpoint into %s (fsynced, best of %d): plain %.3f s, optimizer file %.1f MB;\n"
              "    --checkpoint-compress (%d threads) %.3f s (%.2fx the plain time), optimizer file %.1f MB (%.3fx smaller)\n",
              dir.c_str(), reps, saves[0].seconds, saves[0].optimizer_bytes * 1e-6, threads, saves[1].seconds,
              saves[1].seconds / saves[0].seconds, saves[1].optimizer_bytes * 1e-6,
              saves[0].optimizer_bytes / saves[1].optimizer_bytes);
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other,
              other > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  return all_exact ? 0 : 2;
}

}  // namespace

int adam_bench_main(int argc, char** argv) { return adam(argc, argv); }
int codec_bench_main(int argc, char** argv) { return codec(argc, argv); }
int norm_bench_main(int argc, char** argv) { return norm(argc, argv); }

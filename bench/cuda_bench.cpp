// megatrain-bench-cuda: the two GPU speeds that streamed training rests on, each reported as a ratio
// against a reference measured in the same run (bench/README.md):
//   bandwidth  pinned host<->device copies by size: H2D alone, D2H alone and both at once on two
//              streams; reference: a pageable (malloc) H2D copy of the largest size
//   gemm       the bf16 GEMMs of a model's decoder layer (q/k/v/o, gate/up/down) and LM head at
//              N = micro-batch x seq tokens, forward (x W^T) and both backward GEMMs (dy W, and
//              dy^T x accumulated in fp32), through megatrain::cuda::linear_*; reference: a square
//              8192^3 bf16 GEMM, the practical peak
// Times are cudaEvent intervals on the device; every figure is the median of --repeat measurements.
// Without a GPU it says why on stderr and exits 2.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/gemm.cuh"
#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/units.h"
#include "megatrain/kernels/cuda_device.h"

namespace {

using megatrain::cuda::bf16;
using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "megatrain-bench-cuda: %s\n", what.c_str());
  std::exit(1);
}

#define BENCH_CUDA(stmt)                                                                                \
  do {                                                                                                  \
    const cudaError_t bench_err_ = (stmt);                                                              \
    if (bench_err_ != cudaSuccess)                                                                      \
      die(std::string(#stmt) + ": " + cudaGetErrorName(bench_err_) + " (" + cudaGetErrorString(bench_err_) + ")"); \
  } while (0)

void check(const megatrain::Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// Seconds between two recorded events.
double elapsed_s(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
  return 1e-3 * static_cast<double>(ms);
}

// The device, or exit 2 saying why there is none.
megatrain::cuda::DeviceInfo device_or_exit() {
  auto devices = megatrain::cuda::list_devices();
  if (!devices.ok()) {
    std::fprintf(stderr, "megatrain-bench-cuda: no GPU: %s\n", devices.status().message().c_str());
    std::exit(2);
  }
  if (devices->empty()) {
    std::fprintf(stderr, "megatrain-bench-cuda: no GPU: no device listed\n");
    std::exit(2);
  }
  BENCH_CUDA(cudaSetDevice(devices->front().index));
  return devices->front();
}

// ---- bandwidth ----------------------------------------------------------------------------------

struct Events {
  cudaEvent_t start = nullptr, stop1 = nullptr, stop2 = nullptr;
  Events() {
    BENCH_CUDA(cudaEventCreate(&start));
    BENCH_CUDA(cudaEventCreate(&stop1));
    BENCH_CUDA(cudaEventCreate(&stop2));
  }
  ~Events() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop1);
    cudaEventDestroy(stop2);
  }
};

struct BandwidthRow {
  uint64_t bytes = 0;
  double h2d = 0, d2h = 0;          // GB/s, one direction alone
  double both_h2d = 0, both_d2h = 0;  // GB/s of each direction while the other runs
  double both_sum() const { return both_h2d + both_d2h; }
};

int bandwidth(const std::vector<uint64_t>& sizes, int repeat, bool json) {
  const megatrain::cuda::DeviceInfo dev = device_or_exit();
  const uint64_t max_bytes = *std::max_element(sizes.begin(), sizes.end());
  void *h_src = nullptr, *h_dst = nullptr, *d_a = nullptr, *d_b = nullptr;
  BENCH_CUDA(cudaMallocHost(&h_src, max_bytes));
  BENCH_CUDA(cudaMallocHost(&h_dst, max_bytes));
  BENCH_CUDA(cudaMalloc(&d_a, max_bytes));
  BENCH_CUDA(cudaMalloc(&d_b, max_bytes));
  std::memset(h_src, 0x5a, max_bytes);
  std::memset(h_dst, 0, max_bytes);
  BENCH_CUDA(cudaMemset(d_a, 0, max_bytes));
  BENCH_CUDA(cudaMemset(d_b, 0x33, max_bytes));
  cudaStream_t s1 = nullptr, s2 = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  BENCH_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  BENCH_CUDA(cudaDeviceSynchronize());
  Events ev;

  // One direction alone on s1: seconds of one copy.
  auto one_way = [&](void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind) {
    BENCH_CUDA(cudaEventRecord(ev.start, s1));
    BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, s1));
    BENCH_CUDA(cudaEventRecord(ev.stop1, s1));
    BENCH_CUDA(cudaEventSynchronize(ev.stop1));
    return elapsed_s(ev.start, ev.stop1);
  };

  std::vector<BandwidthRow> rows;
  for (const uint64_t bytes : sizes) {
    const double gb = static_cast<double>(bytes) / megatrain::kGB;
    one_way(d_a, h_src, bytes, cudaMemcpyHostToDevice);  // warm-up
    one_way(h_dst, d_b, bytes, cudaMemcpyDeviceToHost);
    std::vector<double> h2d, d2h, both_h2d, both_d2h;
    for (int r = 0; r < repeat; ++r) {
      h2d.push_back(gb / one_way(d_a, h_src, bytes, cudaMemcpyHostToDevice));
      d2h.push_back(gb / one_way(h_dst, d_b, bytes, cudaMemcpyDeviceToHost));
      // Both at once: H2D on s1, D2H on s2, released by one event; each direction's time runs from
      // that common start to its own end.
      BENCH_CUDA(cudaEventRecord(ev.start, s1));
      BENCH_CUDA(cudaStreamWaitEvent(s2, ev.start, 0));
      BENCH_CUDA(cudaMemcpyAsync(d_a, h_src, bytes, cudaMemcpyHostToDevice, s1));
      BENCH_CUDA(cudaMemcpyAsync(h_dst, d_b, bytes, cudaMemcpyDeviceToHost, s2));
      BENCH_CUDA(cudaEventRecord(ev.stop1, s1));
      BENCH_CUDA(cudaEventRecord(ev.stop2, s2));
      BENCH_CUDA(cudaEventSynchronize(ev.stop1));
      BENCH_CUDA(cudaEventSynchronize(ev.stop2));
      both_h2d.push_back(gb / elapsed_s(ev.start, ev.stop1));
      both_d2h.push_back(gb / elapsed_s(ev.start, ev.stop2));
    }
    rows.push_back({bytes, median(h2d), median(d2h), median(both_h2d), median(both_d2h)});
  }

  // Reference: a pageable H2D copy of the largest size (pages touched first), timed on the host clock
  // around the synchronous cudaMemcpy, as a program that skips pinning sees it.
  std::vector<unsigned char> pageable(max_bytes, 0x5a);
  BENCH_CUDA(cudaMemcpy(d_a, pageable.data(), max_bytes, cudaMemcpyHostToDevice));  // warm-up
  std::vector<double> pg;
  for (int r = 0; r < repeat; ++r) {
    BENCH_CUDA(cudaDeviceSynchronize());
    const auto t0 = Clock::now();
    BENCH_CUDA(cudaMemcpy(d_a, pageable.data(), max_bytes, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaDeviceSynchronize());
    pg.push_back(static_cast<double>(max_bytes) / megatrain::kGB /
                 std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double pageable_gbs = median(pg);
  const BandwidthRow& largest = *std::find_if(rows.begin(), rows.end(), [&](const BandwidthRow& r) { return r.bytes == max_bytes; });
  const double ratio = largest.h2d / pageable_gbs;

  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  cudaFree(d_a);
  cudaFree(d_b);
  cudaFreeHost(h_src);
  cudaFreeHost(h_dst);

  if (json) {
    nlohmann::json j;
    j["benchmark"] = "bandwidth";
    j["device"] = dev.name;
    j["repeat"] = repeat;
    j["timing"] = "median, cudaEvent";
    j["sizes"] = nlohmann::json::array();
    for (const BandwidthRow& r : rows)
      j["sizes"].push_back({{"bytes", r.bytes}, {"h2d_gbs", r.h2d}, {"d2h_gbs", r.d2h},
                            {"bidirectional_h2d_gbs", r.both_h2d}, {"bidirectional_d2h_gbs", r.both_d2h},
                            {"bidirectional_sum_gbs", r.both_sum()}});
    j["pageable_h2d"] = {{"bytes", max_bytes}, {"gbs", pageable_gbs}, {"timing", "median, host clock"}};
    j["pinned_over_pageable_h2d"] = ratio;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("megatrain-bench-cuda bandwidth: %s, pinned host memory, GB/s (1e9 B/s), median of %d (cudaEvent)\n",
              dev.name.c_str(), repeat);
  std::printf("  %10s | %9s | %9s | %-30s\n", "", "alone", "alone", "both directions at once");
  std::printf("  %10s | %9s | %9s | %9s %9s %9s\n", "size", "H2D", "D2H", "H2D", "D2H", "sum");
  for (const BandwidthRow& r : rows)
    std::printf("  %10s | %9.2f | %9.2f | %9.2f %9.2f %9.2f\n",
                megatrain::format_bytes(static_cast<double>(r.bytes)).c_str(), r.h2d, r.d2h, r.both_h2d, r.both_d2h,
                r.both_sum());
  std::printf("  reference: pageable (malloc) H2D of %s: %.2f GB/s (median of %d, host clock)\n",
              megatrain::format_bytes(static_cast<double>(max_bytes)).c_str(), pageable_gbs, repeat);
  std::printf("  verdict: pinned H2D / pageable H2D at %s = %.2fx; both directions at once reach %.2fx of H2D alone\n",
              megatrain::format_bytes(static_cast<double>(max_bytes)).c_str(), ratio, largest.both_sum() / largest.h2d);
  return 0;
}

// ---- gemm ---------------------------------------------------------------------------------------

// Device memory that frees itself.
template <typename T>
struct DeviceArray {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceArray(size_t count) : n(count) {
    BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// Fills device bf16 memory with copies of a random pool: real data, so that the tensor cores draw
// the power (and clock) they draw in training, unlike zeros.
class RandomFill {
 public:
  explicit RandomFill(cudaStream_t s) : s_(s), pool_(kPool) {
    std::mt19937 g(1);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<bf16> host(kPool);
    for (bf16& v : host) v = __float2bfloat16(d(g));
    BENCH_CUDA(cudaMemcpy(pool_.p, host.data(), kPool * sizeof(bf16), cudaMemcpyHostToDevice));
  }
  void operator()(bf16* dst, size_t n) const {
    for (size_t i = 0; i < n; i += kPool)
      BENCH_CUDA(cudaMemcpyAsync(dst + i, pool_.p, std::min(kPool, n - i) * sizeof(bf16), cudaMemcpyDeviceToDevice, s_));
  }

 private:
  static constexpr size_t kPool = size_t{1} << 22;
  cudaStream_t s_;
  DeviceArray<bf16> pool_;
};

// Median seconds per call of f: two warm-up calls, then `repeat` measurements of as many calls as
// fill about 20 ms each.
template <typename F>
double time_per_call(cudaStream_t s, int repeat, F&& f) {
  cudaEvent_t a = nullptr, b = nullptr;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  f();
  f();
  BENCH_CUDA(cudaEventRecord(a, s));
  f();
  BENCH_CUDA(cudaEventRecord(b, s));
  BENCH_CUDA(cudaEventSynchronize(b));
  const int iters = static_cast<int>(std::clamp(0.02 / std::max(elapsed_s(a, b), 1e-7), 1.0, 1000.0));
  std::vector<double> t;
  for (int r = 0; r < repeat; ++r) {
    BENCH_CUDA(cudaEventRecord(a, s));
    for (int i = 0; i < iters; ++i) f();
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    t.push_back(elapsed_s(a, b) / iters);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

struct GemmRow {
  std::string name;
  int64_t in = 0, out = 0;
  bool head = false;
  double flops = 0;  // of one of the three GEMMs: 2 N in out
  double fwd_s = 0, bwd_data_s = 0, bwd_weight_s = 0;
};

double tflops(double flops, double s) { return s > 0 ? flops / s * 1e-12 : 0; }

int gemm(const megatrain::ModelSpec& model, int64_t seq, int64_t micro_batch, int repeat, bool json) {
  const megatrain::cuda::DeviceInfo dev = device_or_exit();
  const auto& c = model.config();
  const int64_t n = micro_batch * seq;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  std::vector<GemmRow> rows = {{"q_proj", c.hidden_size, q},
                               {"k_proj", c.hidden_size, kv},
                               {"v_proj", c.hidden_size, kv},
                               {"o_proj", q, c.hidden_size},
                               {"gate_proj", c.hidden_size, c.intermediate_size},
                               {"up_proj", c.hidden_size, c.intermediate_size},
                               {"down_proj", c.intermediate_size, c.hidden_size},
                               {"lm_head", c.hidden_size, c.vocab_size, true}};

  cudaStream_t s = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) die("cublasCreate failed");
  if (cublasSetStream(h, s) != CUBLAS_STATUS_SUCCESS) die("cublasSetStream failed");
  const RandomFill fill(s);

  for (GemmRow& r : rows) {
    const size_t nin = static_cast<size_t>(n * r.in), nout = static_cast<size_t>(n * r.out),
                 wsz = static_cast<size_t>(r.in * r.out);
    DeviceArray<bf16> x(nin), w(wsz), y(nout), dy(nout), dx(nin);
    DeviceArray<float> dw(wsz);
    fill(x.p, nin);
    fill(w.p, wsz);
    fill(dy.p, nout);
    BENCH_CUDA(cudaMemsetAsync(dw.p, 0, wsz * sizeof(float), s));
    r.flops = 2.0 * static_cast<double>(n) * static_cast<double>(r.in) * static_cast<double>(r.out);
    r.fwd_s = time_per_call(s, repeat, [&] {
      check(megatrain::cuda::linear_forward<bf16, bf16>(h, x.p, w.p, n, r.in, r.out, y.p, 0.f), "linear_forward");
    });
    r.bwd_data_s = time_per_call(s, repeat, [&] {
      check(megatrain::cuda::linear_backward_data<bf16, bf16>(h, dy.p, w.p, n, r.in, r.out, dx.p, false),
            "linear_backward_data");
    });
    r.bwd_weight_s = time_per_call(s, repeat, [&] {
      check(megatrain::cuda::linear_backward_weight<bf16>(h, dy.p, x.p, n, r.in, r.out, dw.p), "linear_backward_weight");
    });
    BENCH_CUDA(cudaStreamSynchronize(s));  // before the buffers go
  }

  // Reference: a square bf16 GEMM, C = A B with 8192^3, bf16 out.
  const int64_t sq = 8192;
  double peak_s = 0;
  {
    const size_t e = static_cast<size_t>(sq * sq);
    DeviceArray<bf16> a(e), b(e), cm(e);
    fill(a.p, e);
    fill(b.p, e);
    peak_s = time_per_call(s, repeat, [&] {
      check(megatrain::cuda::gemm<bf16, bf16>(h, false, false, sq, sq, sq, 1.f, a.p, sq, b.p, sq, 0.f, cm.p, sq),
            "gemm 8192^3");
    });
    BENCH_CUDA(cudaStreamSynchronize(s));
  }
  const double peak = tflops(2.0 * static_cast<double>(sq * sq) * static_cast<double>(sq), peak_s);
  cublasDestroy(h);
  cudaStreamDestroy(s);

  // A layer's seven projections, weighted by FLOPs (time-weighted sums): forward, backward, both.
  double fl = 0, t_fwd = 0, t_bwd = 0;
  for (const GemmRow& r : rows) {
    if (r.head) continue;
    fl += r.flops;
    t_fwd += r.fwd_s;
    t_bwd += r.bwd_data_s + r.bwd_weight_s;
  }
  const double layer_fwd = tflops(fl, t_fwd), layer_bwd = tflops(2 * fl, t_bwd), layer = tflops(3 * fl, t_fwd + t_bwd);
  const GemmRow& head = rows.back();
  const double head_all = tflops(3 * head.flops, head.fwd_s + head.bwd_data_s + head.bwd_weight_s);

  if (json) {
    nlohmann::json j;
    j["benchmark"] = "gemm";
    j["device"] = dev.name;
    j["model"] = model.name();
    j["seq"] = seq;
    j["micro_batch"] = micro_batch;
    j["tokens"] = n;
    j["repeat"] = repeat;
    j["timing"] = "median, cudaEvent";
    j["shapes"] = nlohmann::json::array();
    for (const GemmRow& r : rows)
      j["shapes"].push_back({{"name", r.name}, {"in", r.in}, {"out", r.out}, {"gflop", r.flops * 1e-9},
                             {"forward_tflops", tflops(r.flops, r.fwd_s)},
                             {"backward_data_tflops", tflops(r.flops, r.bwd_data_s)},
                             {"backward_weight_tflops", tflops(r.flops, r.bwd_weight_s)},
                             {"forward_s", r.fwd_s}, {"backward_data_s", r.bwd_data_s},
                             {"backward_weight_s", r.bwd_weight_s}});
    j["layer"] = {{"forward_tflops", layer_fwd}, {"backward_tflops", layer_bwd}, {"forward_backward_tflops", layer}};
    j["lm_head_forward_backward_tflops"] = head_all;
    j["reference"] = {{"what", "bf16 gemm 8192^3"}, {"tflops", peak}};
    j["layer_over_reference"] = layer / peak;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("megatrain-bench-cuda gemm: %s on %s, N = micro-batch %lld x seq %lld = %lld tokens,\n"
              "  bf16 inputs, fp32 accumulation (dW in fp32, +=), TFLOP/s, median of %d (cudaEvent)\n",
              model.name().c_str(), dev.name.c_str(), static_cast<long long>(micro_batch),
              static_cast<long long>(seq), static_cast<long long>(n), repeat);
  std::printf("  %-10s %7s %7s | %11s | %11s | %15s\n", "", "in", "out", "fwd x W^T", "bwd dy W", "bwd dy^T x (W)");
  for (const GemmRow& r : rows)
    std::printf("  %-10s %7lld %7lld | %11.2f | %11.2f | %15.2f\n", r.name.c_str(), static_cast<long long>(r.in),
                static_cast<long long>(r.out), tflops(r.flops, r.fwd_s), tflops(r.flops, r.bwd_data_s),
                tflops(r.flops, r.bwd_weight_s));
  std::printf("  layer (7 projections, FLOP-weighted): forward %.1f, backward %.1f, forward+backward %.1f TFLOP/s\n",
              layer_fwd, layer_bwd, layer);
  std::printf("  lm_head forward+backward: %.1f TFLOP/s\n", head_all);
  std::printf("  reference: square bf16 GEMM 8192^3: %.1f TFLOP/s\n", peak);
  std::printf("  verdict: a layer's GEMMs run at %.2fx of the square GEMM (the LM head at %.2fx)\n", layer / peak,
              head_all / peak);
  return 0;
}

std::vector<uint64_t> parse_sizes(const std::string& text) {
  std::vector<uint64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto b = megatrain::parse_bytes(item);
    if (!b.ok()) die("--sizes: " + b.status().message());
    if (*b == 0) die("--sizes: '" + item + "' is zero bytes");
    out.push_back(*b);
  }
  if (out.empty()) die("--sizes: no sizes given");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = megatrain::cli;
  CLI::App app{"megatrain-bench-cuda: host<->device bandwidth and a model's GEMM throughput on the GPU"};
  app.require_subcommand(1);

  auto* bw = app.add_subcommand("bandwidth", "pinned H2D, D2H and both at once by size, against a pageable copy");
  std::string sizes_text = "1M,4M,16M,64M,256M,1G";
  int bw_repeat = 5;
  bool bw_json = false;
  bw->add_option("--sizes", sizes_text, "copy sizes, comma-separated (K/M/G are binary: 1M = 1 MiB)")
      ->capture_default_str();
  bw->add_option("--repeat", bw_repeat, "measurements per figure (the median is reported)")
      ->capture_default_str()
      ->check(cli::int_range(1, 1000));
  bw->add_flag("--json", bw_json, "print one JSON object on stdout");

  auto* gm = app.add_subcommand("gemm", "bf16 GEMMs at a model's layer shapes, against a square 8192^3 GEMM");
  std::string model_name;
  int64_t seq = 0, micro_batch = 1;
  int gm_repeat = 5;
  bool gm_json = false;
  gm->add_option("--model,-m", model_name, "config.json, a folder holding one, or a name in profiles/models/")->required();
  gm->add_option("--seq", seq, "sequence length (default: min(4096, the model's max))")
      ->check(cli::int_range(1, int64_t{1} << 20));
  gm->add_option("--micro-batch", micro_batch, "sequences per micro-batch")
      ->capture_default_str()
      ->check(cli::int_range(1, int64_t{1} << 12));
  gm->add_option("--repeat", gm_repeat, "measurements per figure (the median is reported)")
      ->capture_default_str()
      ->check(cli::int_range(1, 1000));
  gm->add_flag("--json", gm_json, "print one JSON object on stdout");

  if (const int rc = cli::parse(app, argc, argv, "megatrain-bench-cuda"); rc >= 0) return rc;

  // Arguments are checked before the GPU is looked for, so a typo is reported as such everywhere.
  if (bw->parsed()) return bandwidth(parse_sizes(sizes_text), bw_repeat, bw_json);
  auto model = megatrain::ModelSpec::load(model_name);
  if (!model.ok()) die("--model: " + model.status().to_string());
  if (seq == 0) seq = std::min<int64_t>(4096, std::max<int64_t>(1, model->config().max_position_embeddings));
  return gemm(*model, seq, micro_batch, gm_repeat, gm_json);
}

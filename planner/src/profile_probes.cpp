// The profiler's CPU probes: host facts, memory bandwidth (triad), the executor's AdamW kernel, the
// CPU backend's GEMM path and transfer copies. Each probe calls the code the executor runs.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

#include "detail/profile_probes.h"
#include "megatrain/executor/bf16.h"
#include "megatrain/executor/moments.h"
#include "megatrain/executor/optimizer.h"
#include "megatrain/kernels/cpu/context.h"
#include "megatrain/kernels/cpu/linear.h"
#include "megatrain/kernels/cpu/moe.h"

namespace megatrain::planner::detail {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

// A page-aligned array that is not value-initialised (the probes touch it themselves, so the first
// touch happens on the thread that later uses each part).
template <typename T>
struct RawArray {
  T* p = nullptr;
  explicit RawArray(int64_t n) {
    void* q = nullptr;
    const size_t bytes = std::max<size_t>(64, sizeof(T) * static_cast<size_t>(n));
    if (posix_memalign(&q, 4096, bytes) != 0) MT_CHECK(false, "out of memory allocating " + std::to_string(bytes) + " bytes");
    p = static_cast<T*>(q);
  }
  ~RawArray() { std::free(p); }
  T& operator[](int64_t i) { return p[i]; }
  RawArray(const RawArray&) = delete;
  RawArray& operator=(const RawArray&) = delete;
};

// The GEMM probes' operands: small, non-zero, not all equal (no denormals, no trivially cheap
// values), the output cleared.
void fill_gemm_operands(RawArray<float>& x, int64_t xs, RawArray<float>& w, int64_t ws, RawArray<float>& y, int64_t ys) {
  for (int64_t i = 0; i < xs; ++i) x[i] = 1e-3f * static_cast<float>(i % 113);
  for (int64_t i = 0; i < ws; ++i) w[i] = 1e-3f * static_cast<float>(i % 127) - 0.06f;
  std::memset(y.p, 0, sizeof(float) * static_cast<size_t>(ys));
}

double machine_busy_s() {
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return 0;
  unsigned long long v[8] = {};
  const int got = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                              &v[6], &v[7]);
  std::fclose(f);
  if (got < 5) return 0;
  // user nice system [idle iowait] irq softirq steal
  return static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double self_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return s(u.ru_utime) + s(u.ru_stime);
}

}  // namespace

OtherLoad::OtherLoad() : wall0_(Clock::now()), busy0_(machine_busy_s()), self0_(self_cpu_s()) {}

double OtherLoad::share() const {
  const double wall = seconds_since(wall0_);
  if (wall <= 0) return 0;
  const double cores = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
  const double other = (machine_busy_s() - busy0_) - (self_cpu_s() - self0_);
  return std::clamp(other / (wall * cores), 0.0, 1.0);
}

HostInfo host_info() {
  HostInfo h;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) h.cores = std::max(1, CPU_COUNT(&set));
  else h.cores = std::max(1u, std::thread::hardware_concurrency());
  h.ram_bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0 || line.rfind("Model name", 0) == 0 || line.rfind("cpu model", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) {
        h.cpu = line.substr(colon + 1);
        h.cpu.erase(0, h.cpu.find_first_not_of(" \t"));
        break;
      }
    }
  }
  if (h.cpu.empty()) h.cpu = "unknown CPU";
  h.cpu += " (" + std::to_string(h.cores) + " CPUs usable)";
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0]) h.hostname = name;
  else h.hostname = "unknown-host";
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) h.memlock_bytes = static_cast<double>(rl.rlim_cur);
  return h;
}

std::vector<int> thread_counts(int64_t cores) {
  std::set<int> s;
  for (int64_t t = 1; t < cores; t *= 2) s.insert(static_cast<int>(t));
  s.insert(static_cast<int>(std::max<int64_t>(1, cores)));
  return {s.begin(), s.end()};
}

std::vector<TriadPoint> measure_triad(int64_t bytes, int reps, int64_t cores) {
  const int64_t n = std::max<int64_t>(1024, bytes / static_cast<int64_t>(sizeof(double)));
  RawArray<double> a(n), b(n), c(n);
  const int max_threads = static_cast<int>(std::max<int64_t>(1, cores));
  cpu::CpuContext first_touch(max_threads);
  auto chunk = [n](int i, int parts, int64_t& lo, int64_t& hi) {
    lo = n * i / parts;
    hi = n * (i + 1) / parts;
  };
  first_touch.run(max_threads, [&](int i) {
    int64_t lo, hi;
    chunk(i, max_threads, lo, hi);
    for (int64_t j = lo; j < hi; ++j) {
      a[j] = 0.0;
      b[j] = 1.0 + static_cast<double>(j & 7);
      c[j] = 2.0;
    }
  });
  const double scalar = 3.0;
  std::vector<TriadPoint> out;
  for (int threads : thread_counts(cores)) {
    cpu::CpuContext ctx(threads);
    double best = 1e300;
    for (int r = 0; r < std::max(1, reps) + 1; ++r) {  // the first pass warms the pool and the TLB
      const auto t0 = Clock::now();
      ctx.run(threads, [&](int i) {
        int64_t lo, hi;
        chunk(i, threads, lo, hi);
        double* __restrict pa = a.p;
        const double* __restrict pb = b.p;
        const double* __restrict pc = c.p;
        for (int64_t j = lo; j < hi; ++j) pa[j] = pb[j] + scalar * pc[j];
      });
      const double dt = seconds_since(t0);
      if (r > 0) best = std::min(best, dt);
    }
    out.push_back({threads, 3.0 * static_cast<double>(n) * sizeof(double) / best});
  }
  // Keep the result observable so the passes are not optimised away.
  volatile double sink = a[n / 2];
  (void)sink;
  return out;
}

std::vector<AdamPoint> measure_adam(int64_t params, int reps, int64_t cores, bool formats_all_threads) {
  const int64_t n = std::max<int64_t>(65536, params);
  RawArray<float> w(n), g(n), m(n), v(n);
  RawArray<uint16_t> stream(n);
  for (int64_t i = 0; i < n; ++i) {
    w[i] = 0.01f * static_cast<float>(i % 97) - 0.5f;
    g[i] = 1e-3f * static_cast<float>(i % 31) - 0.015f;
    m[i] = 0.0f;
    v[i] = 0.0f;
    stream[i] = 0;
  }
  exec::AdamWStep s;
  s.lr = 1e-4;
  s.weight_decay = 0.1;
  std::vector<AdamPoint> out;
  const std::vector<int> counts = thread_counts(cores);
  auto run = [&](int threads, bool bf16) {
    double best = 1e300;
    for (int r = 0; r < std::max(1, reps) + 1; ++r) {  // the first pass is a warm-up
      const auto t0 = Clock::now();
      exec::adamw_update(w.p, g.p, m.p, v.p, n, s, nullptr, bf16 ? stream.p : nullptr, threads);
      const double dt = seconds_since(t0);
      ++s.t;
      if (r > 0) best = std::min(best, dt);
    }
    out.push_back({StateFormat::kFp32, threads, bf16, static_cast<double>(n) / best});
  };
  for (int threads : counts) run(threads, false);
  run(counts.back(), true);

  // The other state formats: m and v both in the format, through the same fused pass.
  for (StateFormat f : {StateFormat::kBf16, StateFormat::kQ8, StateFormat::kQ4, StateFormat::kQ3, StateFormat::kQ2}) {
    exec::MomentStore ms = exec::MomentStore::create(f, false, {n}, 128);
    exec::MomentStore vs = exec::MomentStore::create(f, true, {n}, 128);
    const exec::MomentRef mr = ms.tensor(0), vr = vs.tensor(0);
    exec::AdamWStep fs = s;
    fs.t = 1;
    auto run_format = [&](int threads) {
      double best = 1e300;
      for (int r = 0; r < std::max(1, reps) + 1; ++r) {  // the first pass is a warm-up
        const auto t0 = Clock::now();
        exec::adamw_update_moments(w.p, g.p, mr, vr, n, fs, nullptr, nullptr, threads);
        const double dt = seconds_since(t0);
        ++fs.t;
        if (r > 0) best = std::min(best, dt);
      }
      out.push_back({f, threads, false, static_cast<double>(n) / best});
    };
    if (formats_all_threads)
      for (int threads : counts) run_format(threads);
    else
      run_format(counts.back());
  }
  return out;
}

std::vector<GemmSample> gemm_shapes(const std::vector<int64_t>& rows, const std::vector<int64_t>& hidden, double max_flops) {
  std::vector<GemmSample> out;
  for (int64_t h : hidden) {
    const int64_t mlp = std::max<int64_t>(64, (8 * h / 3 + 63) / 64 * 64);
    for (int64_t o : {h, std::max<int64_t>(16, h / 4), mlp}) {
      for (int64_t r : rows) {
        GemmSample s{r, o, h, 0};
        if (s.flops() <= max_flops) out.push_back(s);
      }
    }
  }
  return out;
}

std::vector<GemmSample> measure_gemm(std::vector<GemmSample> shapes, int threads, double min_time_s,
                                     const Progress& progress) {
  int64_t xs = 1, ws = 1, ys = 1;
  for (const GemmSample& s : shapes) {
    xs = std::max(xs, s.m * s.k);
    ws = std::max(ws, s.n * s.k);
    ys = std::max(ys, s.m * s.n);
  }
  RawArray<float> x(xs), w(ws), y(ys);
  fill_gemm_operands(x, xs, w, ws, y, ys);
  cpu::CpuContext ctx(threads);
  // Two passes over all shapes, half the time each, keeping the better: a burst of load from other
  // processes then spoils one pass of a shape, not the shape.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      GemmSample& s = shapes[i];
      if (progress && (i % 4 == 0 || i + 1 == shapes.size()))
        progress("pass " + std::to_string(pass + 1) + "/2, shape " + std::to_string(i + 1) + "/" +
                 std::to_string(shapes.size()) + ": " + std::to_string(s.m) + "x" + std::to_string(s.k) + " -> " +
                 std::to_string(s.n));
      const double t =
          best_per_call([&] { cpu::linear_forward<float>(ctx, x.p, w.p, nullptr, s.m, s.k, s.n, y.p); }, min_time_s / 2);
      s.seconds = pass == 0 ? t : std::min(s.seconds, t);
    }
  }
  return shapes;
}

LinearGrid measure_linear_grid(const std::vector<int64_t>& tokens, const std::vector<int64_t>& sizes, double max_flops,
                               int64_t max_elems, int threads, double min_time_s, const Progress& progress) {
  LinearGrid g;
  g.tokens = tokens;
  g.sizes = sizes;
  const size_t n = tokens.size() * sizes.size() * sizes.size();
  for (auto& s : g.seconds) s.assign(n, 0.0);
  auto timed = [&](size_t a, size_t b, size_t c) { return grid_cell_timed(tokens[a], sizes[b], sizes[c], max_flops, max_elems); };
  int64_t xs = 1, ws = 1, ys = 1;
  for (size_t a = 0; a < tokens.size(); ++a)
    for (size_t b = 0; b < sizes.size(); ++b)
      for (size_t c = 0; c < sizes.size(); ++c)
        if (timed(a, b, c)) {
          xs = std::max(xs, tokens[a] * sizes[b]);
          ws = std::max(ws, sizes[b] * sizes[c]);
          ys = std::max(ys, tokens[a] * sizes[c]);
        }
  RawArray<float> x(xs), w(ws), y(ys), dx(xs), dw(ws);
  fill_gemm_operands(x, xs, w, ws, y, ys);
  std::memset(dx.p, 0, sizeof(float) * static_cast<size_t>(xs));
  std::memset(dw.p, 0, sizeof(float) * static_cast<size_t>(ws));
  cpu::CpuContext ctx(threads);
  // As measure_gemm: two passes, half the time each, the better kept.
  for (int pass = 0; pass < 2; ++pass)
    for (int op = 0; op < 3; ++op)
      for (size_t a = 0; a < tokens.size(); ++a)
        for (size_t b = 0; b < sizes.size(); ++b)
          for (size_t c = 0; c < sizes.size(); ++c) {
            if (!timed(a, b, c)) continue;
            const int64_t t = tokens[a], in = sizes[b], out = sizes[c];
            const size_t cell = (a * sizes.size() + b) * sizes.size() + c;
            if (progress && cell % 8 == 0)
              progress("pass " + std::to_string(pass + 1) + "/2, " + GemmShapes::kOpNames[op] + " " + std::to_string(t) + " x " +
                       std::to_string(in) + " -> " + std::to_string(out));
            double sec = 0;
            if (op == 0)
              sec = best_per_call([&] { cpu::linear_forward<float>(ctx, x.p, w.p, nullptr, t, in, out, y.p); }, min_time_s / 2);
            else if (op == 1)  // y stands for dy
              sec = best_per_call([&] { cpu::linear_backward<float>(ctx, y.p, x.p, w.p, t, in, out, dx.p, false, nullptr, nullptr); },
                                  min_time_s / 2);
            else
              sec = best_per_call([&] { cpu::linear_backward<float>(ctx, y.p, x.p, w.p, t, in, out, nullptr, false, dw.p, nullptr); },
                                  min_time_s / 2);
            double& s = g.seconds[op][cell];
            s = pass == 0 ? sec : std::min(s, sec);
          }
  return g;
}

Result<GemmShapes> gemm_shapes_from_grid(const LinearGrid& grid, double peak_flops_per_s) {
  if (!(peak_flops_per_s > 0)) return invalid_argument("GEMM shape grid: the peak must be > 0");
  const size_t nt = grid.tokens.size(), ns = grid.sizes.size();
  if (nt == 0 || ns == 0) return invalid_argument("GEMM shape grid: no axes");
  GemmShapes out;
  for (int64_t t : grid.tokens) out.tokens.push_back(static_cast<double>(t));
  for (int64_t s : grid.sizes) out.in.push_back(static_cast<double>(s));
  out.out = out.in;
  for (int op = 0; op < 3; ++op) {
    if (grid.seconds[op].size() != nt * ns * ns) return invalid_argument("GEMM shape grid: a table of the wrong size");
    auto& e = out.efficiency[op];
    e.assign(nt * ns * ns, 0.0);
    bool any = false;
    for (size_t a = 0; a < nt; ++a)
      for (size_t b = 0; b < ns; ++b)
        for (size_t c = 0; c < ns; ++c) {
          const size_t cell = (a * ns + b) * ns + c;
          const double sec = grid.seconds[op][cell];
          if (sec > 0) {
            const double f = 2.0 * static_cast<double>(grid.tokens[a]) * static_cast<double>(grid.sizes[b]) *
                             static_cast<double>(grid.sizes[c]);
            e[cell] = std::min(1.0, f / sec / peak_flops_per_s);
            any = true;
          } else {  // filled in index order: the cells one step smaller are done
            double best = 0;
            if (a > 0) best = std::max(best, e[((a - 1) * ns + b) * ns + c]);
            if (b > 0) best = std::max(best, e[(a * ns + b - 1) * ns + c]);
            if (c > 0) best = std::max(best, e[(a * ns + b) * ns + c - 1]);
            e[cell] = best;
          }
        }
    if (!any) return invalid_argument(std::string("GEMM shape grid: no cell of ") + GemmShapes::kOpNames[op] + " was timed");
    double lowest = 1;  // a cell with no timed smaller neighbour: the lowest timed efficiency
    for (double v : e)
      if (v > 0) lowest = std::min(lowest, v);
    for (double& v : e)
      if (v <= 0) v = lowest;
  }
  return out;
}

std::vector<GroupedGemmSample> grouped_gemm_shapes(const std::vector<int64_t>& rows, int64_t experts, int64_t hidden,
                                                   int64_t intermediate, double max_flops) {
  std::vector<GroupedGemmSample> out;
  for (int64_t r : rows)
    for (const auto& [n, k] : {std::pair{intermediate, hidden}, std::pair{hidden, intermediate}}) {
      GroupedGemmSample g{experts, r, n, k, 0};
      if (g.flops() <= max_flops) out.push_back(g);
    }
  return out;
}

std::pair<int64_t, int64_t> scaled_expert_shape(int64_t hidden, int64_t intermediate, int64_t experts, int64_t max_rows,
                                                double max_flops) {
  const double call = 2.0 * static_cast<double>(experts) * static_cast<double>(max_rows) * static_cast<double>(hidden) *
                      static_cast<double>(intermediate);
  if (call <= max_flops) return {hidden, intermediate};
  const double f = std::sqrt(max_flops / call);
  auto down = [f](int64_t v) { return std::max<int64_t>(64, static_cast<int64_t>(static_cast<double>(v) * f) / 64 * 64); };
  return {down(hidden), down(intermediate)};
}

std::vector<GroupedGemmSample> measure_grouped_gemm(std::vector<GroupedGemmSample> shapes, int threads, double min_time_s,
                                                    const Progress& progress) {
  int64_t xs = 1, ws = 1, ys = 1;
  for (const GroupedGemmSample& s : shapes) {
    xs = std::max(xs, s.experts * s.rows * s.k);
    ws = std::max(ws, s.experts * s.n * s.k);
    ys = std::max(ys, s.experts * s.rows * s.n);
  }
  RawArray<float> x(xs), w(ws), y(ys);
  fill_gemm_operands(x, xs, w, ws, y, ys);
  cpu::CpuContext ctx(threads);
  // As measure_gemm: two passes, half the time each, the better kept.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      GroupedGemmSample& s = shapes[i];
      if (progress && (i % 4 == 0 || i + 1 == shapes.size()))
        progress("pass " + std::to_string(pass + 1) + "/2, shape " + std::to_string(i + 1) + "/" + std::to_string(shapes.size()) +
                 ": " + std::to_string(s.experts) + " experts x " + std::to_string(s.rows) + "x" + std::to_string(s.k) + " -> " +
                 std::to_string(s.n));
      // Every expert gets the same rows (uniform routing); the executor's offsets after its sort.
      std::vector<int32_t> offsets(static_cast<size_t>(s.experts + 1));
      for (int64_t e = 0; e <= s.experts; ++e) offsets[static_cast<size_t>(e)] = static_cast<int32_t>(e * s.rows);
      const double t = best_per_call(
          [&] {
            cpu::grouped_linear_forward<float>(ctx, x.p, w.p, s.n * s.k, nullptr, 0, offsets.data(), s.experts, s.k, s.n,
                                               y.p);
          },
          min_time_s / 2);
      s.seconds = pass == 0 ? t : std::min(s.seconds, t);
    }
  }
  return shapes;
}

std::vector<std::pair<double, double>> measure_copy(const std::string& kind, const std::vector<int64_t>& sizes,
                                                    double min_time_s) {
  const bool bf16 = kind == "bf16";
  int64_t largest = 0;
  for (int64_t s : sizes) largest = std::max(largest, s);
  // Rotate through 64 MiB or more so that no copy finds its data in a cache, as a layer's weights never do.
  const int64_t region = std::max<int64_t>(largest, 64ll << 20);
  RawArray<unsigned char> src(region);
  RawArray<unsigned char> dst(bf16 ? 2 * region : region);
  for (int64_t i = 0; i < region; ++i) src[i] = static_cast<unsigned char>((i * 131) >> 3);
  std::memset(dst.p, 0, static_cast<size_t>(bf16 ? 2 * region : region));
  std::vector<std::pair<double, double>> out;
  for (int64_t bytes : sizes) {
    const int64_t slots = std::max<int64_t>(1, region / bytes);
    int64_t slot = 0;
    auto call = [&] {
      const int64_t off = (slot++ % slots) * bytes;
      if (bf16) {
        const auto* s = reinterpret_cast<const uint16_t*>(src.p + off);
        float* d = reinterpret_cast<float*>(dst.p + 2 * off);
        const int64_t n = bytes / 2;
        for (int64_t i = 0; i < n; ++i) d[i] = exec::bf16_to_fp32(s[i]);
      } else {
        std::memcpy(dst.p + off, src.p + off, static_cast<size_t>(bytes));
      }
    };
    out.emplace_back(static_cast<double>(bytes), best_per_call(call, min_time_s));
  }
  return out;
}

double measure_copy_duplex(int64_t bytes, double min_time_s) {
  const int64_t region = std::max<int64_t>(bytes, 64ll << 20);
  RawArray<unsigned char> a(region), b(region), c(region), d(region);
  for (auto* p : {a.p, b.p, c.p, d.p}) std::memset(p, 1, static_cast<size_t>(region));
  const int64_t slots = std::max<int64_t>(1, region / bytes);
  auto copier = [&](unsigned char* dst, const unsigned char* src, const std::atomic<bool>* stop, double* rate) {
    int64_t done = 0;
    const auto t0 = Clock::now();
    while (seconds_since(t0) < min_time_s && !(stop && stop->load())) {
      const int64_t off = (done % slots) * bytes;
      std::memcpy(dst + off, src + off, static_cast<size_t>(bytes));
      ++done;
    }
    *rate = static_cast<double>(done) * static_cast<double>(bytes) / seconds_since(t0);
  };
  double alone = 0;
  copier(b.p, a.p, nullptr, &alone);
  double r1 = 0, r2 = 0;
  std::thread t([&] { copier(d.p, c.p, nullptr, &r2); });
  copier(b.p, a.p, nullptr, &r1);
  t.join();
  return alone > 0 ? 0.5 * (r1 + r2) / alone : 0;
}

}  // namespace megatrain::planner::detail

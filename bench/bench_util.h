// What the benchmarks share: OtherLoad (how much of the machine other processes used while a
// benchmark ran) and make_tokens (training data with some structure).
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <thread>
#include <vector>

namespace megatrain::bench {

// How much of the machine other processes used while a benchmark ran: the CPU time all cores spent
// busy (/proc/stat) less this process's own (getrusage), over wall time x cores. On these shared
// 2-core machines a run with a large share is noise, not a result.
class OtherLoad {
 public:
  OtherLoad() : wall0_(std::chrono::steady_clock::now()), busy0_(machine_busy_s()), self0_(self_cpu_s()) {}
  double share() const {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0_).count();
    const double cores = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
    const double other = (machine_busy_s() - busy0_) - (self_cpu_s() - self0_);
    return std::clamp(other / (wall * cores), 0.0, 1.0);
  }

 private:
  static double machine_busy_s() {
    std::FILE* f = std::fopen("/proc/stat", "r");
    if (!f) return 0;
    unsigned long long v[8] = {};
    const int got = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
                                &v[5], &v[6], &v[7]);
    std::fclose(f);
    if (got < 5) return 0;
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    // user nice system [idle iowait] irq softirq steal
    return static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / ticks;
  }
  static double self_cpu_s() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
    return s(u.ru_utime) + s(u.ru_stime);
  }
  std::chrono::steady_clock::time_point wall0_;
  double busy0_, self0_;
};

// Tokens with some structure (a noisy repeating pattern) so a model has something to learn.
inline std::vector<uint32_t> make_tokens(size_t n, uint32_t vocab) {
  std::vector<uint32_t> t(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t[i] = (x % 8 == 0) ? static_cast<uint32_t>(x >> 20) % vocab : static_cast<uint32_t>((i * 7 + i / 64) % vocab);
  }
  return t;
}

}  // namespace megatrain::bench

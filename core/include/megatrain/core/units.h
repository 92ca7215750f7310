// Units and their human formatting: bytes (binary: KiB, MiB, GiB), bandwidth (decimal: GB/s, as
// datasheets quote it), durations (ns .. h), FLOP counts and rates, and large counts (68.98B).
// Parsing accepts what a user types on a command line: "8GiB", "512 MB", "1.5TB", "4096".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "megatrain/core/status.h"

namespace megatrain {

inline constexpr uint64_t kKiB = 1024ull;
inline constexpr uint64_t kMiB = 1024ull * kKiB;
inline constexpr uint64_t kGiB = 1024ull * kMiB;
inline constexpr uint64_t kTiB = 1024ull * kGiB;
inline constexpr double kGB = 1e9;

// 0 B, 512 B, 1.50 KiB, 3.25 GiB, 1.40 TiB (three significant digits).
std::string format_bytes(double bytes);
// 25.0 GB/s, 780 MB/s (decimal units, like datasheets).
std::string format_bandwidth(double bytes_per_second);
// 850 ns, 12.3 us, 4.56 ms, 1.23 s, 2.5 min, 3.1 h.
std::string format_duration(double seconds);
// 1.23 GFLOP, 4.56 TFLOP, 7.89 PFLOP.
std::string format_flops(double flops);
// 989 TFLOP/s.
std::string format_flop_rate(double flops_per_second);
// 6.74B, 131.07M, 12.3K, 512.
std::string format_count(double count);
// 6,738,415,616.
std::string format_thousands(uint64_t value);

// "4096", "8GiB", "8 GiB", "1.5TB", "512MB", "64K" (K/M/G/T alone are binary, as in dd and fio).
Result<uint64_t> parse_bytes(std::string_view text);

}  // namespace megatrain

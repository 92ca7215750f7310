// Human formatting and parsing of bytes, bandwidth, durations, FLOPs and counts.
#include "megatrain/core/units.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

namespace megatrain {
namespace {

// Three significant digits: 1.23, 12.3, 123.
std::string three_digits(double v) {
  char buf[64];
  double a = std::fabs(v);
  if (a >= 100 || a == 0) std::snprintf(buf, sizeof buf, "%.0f", v);
  else if (a >= 10) std::snprintf(buf, sizeof buf, "%.1f", v);
  else std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

// Scales v by `base` until it is below base; returns mantissa and the unit index.
std::string scaled(double v, double base, const char* const* units, size_t n_units) {
  size_t i = 0;
  double a = std::fabs(v);
  while (i + 1 < n_units && a >= base * 0.9995) {
    v /= base;
    a /= base;
    ++i;
  }
  return three_digits(v) + " " + units[i];
}

}  // namespace

std::string format_bytes(double bytes) {
  if (std::fabs(bytes) < 1024) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
    return buf;
  }
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  return scaled(bytes, 1024.0, units, 7);
}

std::string format_bandwidth(double bps) {
  static const char* const units[] = {"B/s", "kB/s", "MB/s", "GB/s", "TB/s", "PB/s"};
  return scaled(bps, 1000.0, units, 6);
}

std::string format_duration(double s) {
  double a = std::fabs(s);
  if (a == 0) return "0 s";
  if (a < 1e-6) return three_digits(s * 1e9) + " ns";
  if (a < 1e-3) return three_digits(s * 1e6) + " us";
  if (a < 1) return three_digits(s * 1e3) + " ms";
  if (a < 120) return three_digits(s) + " s";
  if (a < 7200) return three_digits(s / 60) + " min";
  return three_digits(s / 3600) + " h";
}

std::string format_flops(double flops) {
  static const char* const units[] = {"FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"};
  return scaled(flops, 1000.0, units, 7);
}

std::string format_flop_rate(double fps) {
  static const char* const units[] = {"FLOP/s", "kFLOP/s", "MFLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s", "EFLOP/s"};
  return scaled(fps, 1000.0, units, 7);
}

std::string format_count(double count) {
  static const char* const units[] = {"", "K", "M", "B", "T"};
  size_t i = 0;
  double v = count;
  while (i + 1 < 5 && std::fabs(v) >= 999.995) {
    v /= 1000;
    ++i;
  }
  char buf[64];
  if (i == 0) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.2f%s", v, units[i]);
  return buf;
}

std::string format_thousands(uint64_t value) {
  std::string digits = std::to_string(value);
  std::string out;
  int n = static_cast<int>(digits.size());
  for (int i = 0; i < n; ++i) {
    out += digits[i];
    int left = n - 1 - i;
    if (left > 0 && left % 3 == 0) out += ',';
  }
  return out;
}

Result<uint64_t> parse_bytes(std::string_view text) {
  std::string t(text);
  auto bad = [&]() {
    return invalid_argument("'" + t + "' is not a byte size; accepted: a number with an optional unit, "
                            "e.g. 4096, 64K, 512MB, 8GiB, 1.5TB (K/M/G/T and KiB/MiB/GiB/TiB are powers "
                            "of 1024, kB/MB/GB/TB powers of 1000)");
  };
  size_t i = 0;
  while (i < t.size() && std::isspace(static_cast<unsigned char>(t[i]))) ++i;
  size_t num_start = i;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  if (i == num_start) return bad();
  double number = 0;
  try {
    number = std::stod(t.substr(num_start, i - num_start));
  } catch (...) {
    return bad();
  }
  while (i < t.size() && std::isspace(static_cast<unsigned char>(t[i]))) ++i;
  std::string unit = t.substr(i);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  struct U { const char* name; double mult; };
  static const std::array<U, 17> units = {{
      {"", 1}, {"B", 1},
      {"K", 1024.0}, {"KiB", 1024.0}, {"kB", 1e3}, {"KB", 1e3},
      {"M", 1024.0 * 1024}, {"MiB", 1024.0 * 1024}, {"MB", 1e6},
      {"G", 1024.0 * 1024 * 1024}, {"GiB", 1024.0 * 1024 * 1024}, {"GB", 1e9},
      {"T", 1024.0 * 1024 * 1024 * 1024}, {"TiB", 1024.0 * 1024 * 1024 * 1024}, {"TB", 1e12},
      {"PiB", 1024.0 * 1024 * 1024 * 1024 * 1024}, {"PB", 1e15},
  }};
  for (const auto& u : units) {
    if (unit == u.name) {
      double v = number * u.mult;
      if (v > 1.8e19) return bad();
      double r = std::round(v);
      if (std::fabs(v - r) > 1e-6 * std::max(1.0, v)) return bad();  // fractional bytes
      return static_cast<uint64_t>(r);
    }
  }
  return bad();
}

}  // namespace megatrain

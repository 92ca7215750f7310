// Numeric flag values: strict parsing (the whole text, no silent clamping) and range messages.
#include "megatrain/core/flags.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace megatrain {
namespace {

std::string quoted(std::string_view text) { return "'" + std::string(text) + "'"; }

std::string out_of_range(std::string_view text, bool below, const std::string& lo, const std::string& hi) {
  return below ? "must be at least " + lo + " (got " + std::string(text) + ")"
               : "must be at most " + hi + " (got " + std::string(text) + ")";
}

}  // namespace

std::string format_flag_bound(double v) {
  if (std::abs(v) < 9.007199254740992e15 && v == std::floor(v)) return std::to_string(static_cast<int64_t>(v));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

std::string int_flag_error(std::string_view text, int64_t lo, int64_t hi) {
  const std::string range = "expected a whole number from " + std::to_string(lo) + " to " + std::to_string(hi);
  std::string_view digits = text;
  if (digits.size() > 1 && digits[0] == '+' && digits[1] != '-') digits.remove_prefix(1);  // from_chars takes no '+'
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (digits.empty() || end != digits.data() + digits.size() || (ec != std::errc() && ec != std::errc::result_out_of_range))
    return range + " (got " + quoted(text) + ")";
  if (ec == std::errc::result_out_of_range || v < lo || v > hi)
    return out_of_range(text, ec == std::errc() ? v < lo : digits.front() == '-', std::to_string(lo), std::to_string(hi));
  return {};
}

std::string number_flag_error(std::string_view text, double lo, double hi) {
  const std::string s(text);
  char* end = nullptr;
  const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    return "expected a number from " + format_flag_bound(lo) + " to " + format_flag_bound(hi) + " (got " + quoted(text) + ")";
  if (v < lo || v > hi) return out_of_range(text, v < lo, format_flag_bound(lo), format_flag_bound(hi));
  return {};
}

Result<int64_t> parse_int_flag(std::string_view flag, std::string_view text, int64_t lo, int64_t hi) {
  if (std::string why = int_flag_error(text, lo, hi); !why.empty()) return invalid_argument(std::string(flag) + ": " + why);
  int64_t v = 0;
  const std::string_view digits = text.front() == '+' ? text.substr(1) : text;
  std::from_chars(digits.data(), digits.data() + digits.size(), v);
  return v;
}

Result<double> parse_number_flag(std::string_view flag, std::string_view text, double lo, double hi) {
  if (std::string why = number_flag_error(text, lo, hi); !why.empty()) return invalid_argument(std::string(flag) + ": " + why);
  return std::strtod(std::string(text).c_str(), nullptr);
}

}  // namespace megatrain

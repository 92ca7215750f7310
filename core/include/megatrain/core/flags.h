// Numeric command-line values: one parser and one message form for every program's flags, so that
// `--steps 0` says "--steps: must be at least 1 (got 0)" everywhere. Free of CLI11 (the bench
// programs parse by hand and the GUI with Qt); detail/cli11_flags.h adapts it to CLI11.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "megatrain/core/status.h"

namespace megatrain {

// Why `text` is not a whole number in [lo, hi], or empty when it is:
//   "must be at least 1 (got 0)", "must be at most 256 (got 1000)",
//   "expected a whole number from 1 to 256 (got 'abc')".
std::string int_flag_error(std::string_view text, int64_t lo, int64_t hi);
// The same for a real number (decimal or exponent form, finite) in [lo, hi].
std::string number_flag_error(std::string_view text, double lo, double hi);

// The value of `text`, or invalid_argument("<flag>: <reason>") with the reason above.
Result<int64_t> parse_int_flag(std::string_view flag, std::string_view text, int64_t lo, int64_t hi);
Result<double> parse_number_flag(std::string_view flag, std::string_view text, double lo, double hi);

// A bound as the messages print it: integers in full (1000000000), others in %g form (0.01, 1e+15).
std::string format_flag_bound(double v);

}  // namespace megatrain

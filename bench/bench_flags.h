// Numeric flags of the benchmarks' hand-written parsers, with core/flags.h's ranges and messages:
// a bad value is refused (exit 1), never clamped or read as 0 the way atoi would.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "megatrain/core/flags.h"

namespace megatrain::bench {

// The whole number after the flag at argv[i] (i moves past it). A missing value or one outside
// [lo, hi] prints "<program>: error: <flag>: <reason>" on stderr and exits 1.
inline int64_t int_arg(const char* program, int argc, char** argv, int& i, int64_t lo, int64_t hi) {
  const char* flag = argv[i];
  const char* text = i + 1 < argc ? argv[++i] : "";
  auto v = parse_int_flag(flag, text, lo, hi);
  if (!v.ok()) {
    std::fprintf(stderr, "%s: error: %s\n", program, v.status().message().c_str());
    std::exit(1);
  }
  return *v;
}

}  // namespace megatrain::bench

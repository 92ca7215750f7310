// The CLI11 side of core/flags.h, for the programs' main() only: range validators that give the
// project's message form, and one parse step with one exit-code rule (0 for --help/--version, 1
// for every other parse error, instead of CLI11's 105, 106, ...).
//
// Why a header-only detail header: it includes CLI/CLI.hpp, which costs seconds per include on two
// cores (STYLE.md). No library header includes this one, so only the translation units that parse
// command lines with CLI11 (and link CLI11::CLI11 already) pay for it; the parsing and messages
// themselves live in core/flags.cpp, compiled once and shared with the hand-written bench parsers.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <string>

#include "megatrain/core/flags.h"

namespace megatrain::cli {

// A whole number in [lo, hi]; `--steps 0` fails as "--steps: must be at least 1 (got 0)".
inline CLI::Validator int_range(int64_t lo, int64_t hi) {
  return CLI::Validator([lo, hi](std::string& text) { return int_flag_error(text, lo, hi); },
                        "[" + std::to_string(lo) + " .. " + std::to_string(hi) + "]", "int_range");
}

// A finite real number in [lo, hi].
inline CLI::Validator number_range(double lo, double hi) {
  return CLI::Validator([lo, hi](std::string& text) { return number_flag_error(text, lo, hi); },
                        "[" + format_flag_bound(lo) + " .. " + format_flag_bound(hi) + "]", "number_range");
}

// Parses the command line. Returns -1 when the program should go on, else its exit code: 0 after
// printing --help or --version, 1 after printing "<program>: error: <what>" on stderr.
inline int parse(CLI::App& app, int argc, char** argv, const char* program) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
  return -1;
}

}  // namespace megatrain::cli

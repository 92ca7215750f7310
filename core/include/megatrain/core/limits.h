// Budgets for what users' files may ask of MegaTrain (issue 49): how deep their nesting may go and
// how much work a chat template may do. A file that reaches one is refused with an error naming the
// file, the limit and how to raise it; nothing it asks for runs without a bound.
//
// Defaults are far above what shipped models' files and real datasets use (docs/reliability.md,
// "Budgets"); MEGATRAIN_LIMITS raises or lowers them for one process:
//   MEGATRAIN_LIMITS="nesting=1000,template_steps=1000000000"
#pragma once

#include <cstdint>
#include <stdexcept>
#include <filesystem>
#include <string>
#include <string_view>

#include "megatrain/core/status.h"

namespace megatrain {

struct Limits {
  // Nesting depth of any structure a user's file describes: JSON objects and arrays (tokenizer.json,
  // dataset records, configs), a chat template's expressions and statements, a tokenizer's
  // Sequence normalizers and pre-tokenizers.
  int64_t nesting = 256;
  // Work of one chat-template render: expression evaluations, loop iterations and list elements
  // built (range(), list concatenation), together.
  int64_t template_steps = 100'000'000;
  // Bytes of a template's rendered text, and of any one string it builds.
  int64_t template_output_bytes = int64_t{256} << 20;
  // Macro calls in progress at once (a macro calling itself).
  int64_t template_macro_depth = 64;
  // Bytes of a file read whole and parsed (a plan, config.json, a rig, tokenizer.json,
  // tokenizer_config.json, a chat template, a .json dataset): a JSON document takes 10 to 20 times
  // its text in memory once parsed.
  int64_t file_bytes = int64_t{1} << 30;
  // Bytes of one record (line) of a JSON Lines dataset.
  int64_t record_bytes = int64_t{64} << 20;
};

// The defaults with MEGATRAIN_LIMITS applied; a malformed variable is an error naming it, the
// limit and the accepted names. Read once per process.
Result<Limits> limits();
// The defaults with "name=value,name=value" applied (MEGATRAIN_LIMITS's form).
Result<Limits> parse_limits(std::string_view text);

// OK when `path` holds at most limits().file_bytes bytes (or cannot be measured: the read that
// follows says why); otherwise an error naming `what`, the path, its size and the limit.
Status check_file_bytes(const std::filesystem::path& path, const std::string& what);

// "<what>: more than <value> <unit> (limit <name>; raise it with MEGATRAIN_LIMITS=<name>=N)".
std::string limit_message(const std::string& what, const char* name, int64_t value, const std::string& unit);

// Thrown by json_nesting_limit's callback to stop a parse: its what() is limit_message's text.
struct JsonTooDeep : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A parser callback for nlohmann's Json::parse(text, callback) that stops, by throwing JsonTooDeep,
// as soon as the text opens more than `max_depth` nested objects and arrays: nothing is built
// from it, and no reader after it walks a deeper tree. The parser itself keeps no stack frames
// per level, so the text is read in bounded stack at any depth.
template <typename J>
typename J::parser_callback_t json_nesting_limit(int64_t max_depth) {
  return [max_depth](int depth, typename J::parse_event_t event, J&) {
    if ((event == J::parse_event_t::object_start || event == J::parse_event_t::array_start) && depth >= max_depth)
      throw JsonTooDeep(limit_message("JSON nested too deep", "nesting", max_depth, "levels"));
    return true;
  };
}

}  // namespace megatrain

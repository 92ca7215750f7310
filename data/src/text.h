// Text helpers of the tokenizers (text.cpp): UTF-8, Unicode normalization forms, and regexes.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megatrain/core/status.h"
#include "megatrain/data/tokenizer.h"

namespace megatrain::data {

std::string utf8_of(uint32_t codepoint);
// Bytes of the UTF-8 character that starts with `lead` (valid UTF-8 only).
size_t utf8_length(unsigned char lead);

// The bytes of a file; kNotFound naming it when it cannot be opened.
Result<std::string> read_file(const std::filesystem::path& path);

// Every occurrence of `from` (not empty) in `s` replaced by `to`, left to right.
void replace_all(std::string& s, const std::string& from, const std::string& to);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// `s` (valid UTF-8) in a Unicode normalization form.
std::string normalize(std::string_view s, NormalForm form);

// A regex with Unicode properties (PCRE2, UTF and UCP), JIT-compiled where the platform allows.
// Regex::find_all calls that ended on a match error on this thread so far, and the last error's text.
int64_t regex_errors();
std::string last_regex_error();

class Regex {
 public:
  Regex() = default;
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  static Result<Regex> compile(std::string_view pattern);
  // The [begin, end) byte ranges of the non-overlapping matches in `s` (valid UTF-8), left to right,
  // into `out` (cleared first): no allocation once `out` has grown.
  // A match that fails with an error other than "no match" (a resource limit, which the JIT's own
  // stack and then the interpreter with a 1 GiB heap limit are tried against first) leaves the rest
  // of `s` unmatched, returns false and counts in regex_errors(): a caller that can report an error
  // must (a tokenizer reading it as "no match" tokenized such text differently, issue 49).
  bool find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace megatrain::data

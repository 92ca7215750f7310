// Text helpers of the tokenizers: valid UTF-8, Unicode normalization forms (utf8proc), and
// regexes with Unicode properties (PCRE2).
#include "text.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utf8proc.h>

namespace megatrain::data {

namespace {
// The bytes of the valid sequence at i (1-4), or 0 where the maximal invalid subpart `*bad` begins.
size_t valid_sequence_at(const unsigned char* p, size_t n, size_t i, size_t* bad) {
  const unsigned char b = p[i];
  if (b < 0x80) return 1;
  int need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *bad = 1;
    return 0;
  }
  // The maximal subpart: the lead byte and the continuation bytes that may follow it.
  size_t j = i + 1;
  int got = 0;
  while (got < need && j < n && p[j] >= lo && p[j] <= hi) {
    lo = 0x80;
    hi = 0xBF;
    ++j;
    ++got;
  }
  if (got == need) return j - i;
  *bad = j - i;
  return 0;
}
}  // namespace

size_t valid_utf8_prefix(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const size_t len = valid_sequence_at(p, s.size(), i, &bad);
    if (len == 0) return i;
    i += len;
  }
  return i;
}

std::string valid_utf8(std::string_view s) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t run = valid_utf8_prefix(s.substr(i));
    out.append(s.data() + i, run);
    i += run;
    if (i == s.size()) break;
    size_t bad = 0;
    valid_sequence_at(p, s.size(), i, &bad);
    out += kReplacement;
    i += bad;
  }
  return out;
}

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

Result<std::string> read_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
    return invalid_argument(path.string() + ": not a regular file (a FIFO, device or folder would never end or not be text); expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(path.string() + ": cannot be read");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t at = 0;
  for (size_t f; (f = s.find(from, at)) != std::string::npos; at = f + from.size()) out.append(s, at, f - at) += to;
  out.append(s, at);
  s = std::move(out);
}

size_t utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

namespace {
std::string normalize_all(std::string_view s, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::kNfd: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                                          &out, static_cast<utf8proc_option_t>(options));
  if (n < 0) return std::string(s);  // only on invalid UTF-8, which callers never pass
  std::string r(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}
bool ascii(char c) { return static_cast<unsigned char>(c) < 0x80; }
}  // namespace

// ASCII is left as it is by every normal form, and no ASCII character combines with the character
// before it, so only the runs of other characters are normalized, each with the one ASCII
// character before it (a base that a combining mark may compose with): exactly the whole text's
// normalization, without running it over mostly-ASCII text.
std::string normalize(std::string_view s, NormalForm form) {
  size_t i = 0;
  while (i < s.size() && ascii(s[i])) ++i;
  if (i == s.size()) return std::string(s);
  std::string out;
  out.reserve(s.size() + s.size() / 8);
  size_t done = 0;
  while (i < s.size()) {
    const size_t from = i > done ? i - 1 : i;
    out.append(s.data() + done, from - done);
    size_t end = i;
    while (end < s.size() && !ascii(s[end])) ++end;
    out += normalize_all(s.substr(from, end - from), form);
    done = end;
    i = end;
    while (i < s.size() && ascii(s[i])) ++i;
  }
  out.append(s.data() + done, s.size() - done);
  return out;
}

// ---- regexes ---------------------------------------------------------------------------------------

Regex::~Regex() {
  if (code_) pcre2_code_free(code_);
}
Regex::Regex(Regex&& o) noexcept : code_(o.code_), jit_(o.jit_) { o.code_ = nullptr; }
Regex& Regex::operator=(Regex&& o) noexcept {
  std::swap(code_, o.code_);
  std::swap(jit_, o.jit_);
  return *this;
}

Result<Regex> Regex::compile(std::string_view pattern) {
  int err = 0;
  PCRE2_SIZE at = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &at,
                                   nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return invalid_argument("the regex /" + std::string(pattern) + "/ does not compile at offset " + std::to_string(at) + ": " +
                            reinterpret_cast<const char*>(msg));
  }
  Regex r;
  r.code_ = code;
  r.jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return r;
}

namespace {
// Each thread's match data (only the whole match's offsets are read, so one pair fits any pattern),
// the JIT's stack (32 KiB growing to 64 MiB, where PCRE2's default is 32 KiB on the machine stack)
// and a match context that hands it over and lets the interpreter use up to 1 GiB of heap.
struct MatchData {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
  pcre2_match_context* ctx = [this] {
    pcre2_match_context* c = pcre2_match_context_create(nullptr);
    if (c != nullptr) {
      if (stack != nullptr) pcre2_jit_stack_assign(c, nullptr, stack);
      pcre2_set_heap_limit(c, 1024 * 1024);  // KiB
    }
    return c;
  }();
  int64_t errors = 0;
  std::string last_error;
  ~MatchData() {
    pcre2_match_context_free(ctx);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(md);
  }
};
thread_local MatchData t_match;
}  // namespace

int64_t regex_errors() { return t_match.errors; }
std::string last_regex_error() { return t_match.last_error; }

bool Regex::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  out.clear();
  MatchData& data = t_match;
  pcre2_match_data* md = data.md;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t start = 0;
  while (start <= s.size()) {
    int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), start, 0, md, data.ctx)
                  : pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, md, data.ctx);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH && jit_)  // the JIT's stack ran out: the interpreter
      rc = pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, data.ctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      data.last_error = "PCRE2 error " + std::to_string(rc) + " at byte " + std::to_string(start) + " of a " + std::to_string(s.size()) +
                        "-byte text: " + reinterpret_cast<const char*>(msg);
      ++data.errors;
      return false;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      start = e;
    } else {
      // An empty match: step over one character, as an iterator over matches does.
      if (b >= s.size()) break;
      start = b + utf8_length(static_cast<unsigned char>(s[b]));
    }
  }
  return true;
}

}  // namespace megatrain::data

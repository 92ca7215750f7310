// Status formatting and the one place a misused Result aborts.
#include "megatrain/core/status.h"

#include <cstdio>

namespace megatrain {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kParseError: return "parse error";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kIoError: return "I/O error";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kResourceExhausted: return "does not fit";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok() || context.empty()) return *this;
  return Status(code_, context + ": " + message_);
}

void die_on_bad_result_access(const Status& s) {
  std::fprintf(stderr, "megatrain: fatal: %s\n", s.to_string().c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace megatrain

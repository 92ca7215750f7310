// Status and Result<T>: how every function that reads user input, files or devices reports failure.
// No exceptions cross module boundaries; a Status carries a code and a message that names what
// was wrong and what would have been accepted. Values are cheap to move; not thread-shared.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace megatrain {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // a value is present but not acceptable (range, type, unknown key)
  kNotFound,           // a file, model name, rig name or key does not exist
  kParseError,         // text that does not parse (truncated JSON, not a number)
  kUnsupported,        // understood but not supported (an architecture we do not implement)
  kIoError,            // the operating system refused (read, write, fsync, rename)
  kCorrupt,            // a file exists but its content is not what it claims to be
  kResourceExhausted,  // a plan that does not fit, a full disk
  kUnavailable,        // hardware that is not there (no GPU, no driver)
  kInternal,           // a broken invariant inside MegaTrain
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code>: <message>", or "ok".
  std::string to_string() const;
  // Prefixes the message with where it happened: "plan.json: training.seq_len: ...".
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status parse_error(std::string m) { return {StatusCode::kParseError, std::move(m)}; }
inline Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Either a T or a non-ok Status. Accessing the value of an error aborts with the message: that is a
// programming error, and the check stays on in release builds.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { check(); return std::get<T>(v_); }
  const T& value() const& { check(); return std::get<T>(v_); }
  T&& value() && { check(); return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  void check() const;
  std::variant<T, Status> v_;
};

[[noreturn]] void die_on_bad_result_access(const Status& s);

template <typename T>
void Result<T>::check() const {
  if (!ok()) die_on_bad_result_access(std::get<Status>(v_));
}

}  // namespace megatrain

#define MT_CONCAT_INNER_(a, b) a##b
#define MT_CONCAT_(a, b) MT_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function when `expr` (a Status) is not ok.
#define MT_RETURN_IF_ERROR(expr)                    \
  do {                                              \
    ::megatrain::Status mt_status_ = (expr);        \
    if (!mt_status_.ok()) return mt_status_;        \
  } while (0)

// `lhs = value of expr` (a Result), or return its Status.
#define MT_ASSIGN_OR_RETURN(lhs, expr) MT_ASSIGN_OR_RETURN_IMPL_(MT_CONCAT_(mt_result_, __LINE__), lhs, expr)
#define MT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

// An invariant that stays checked in release builds.
#define MT_CHECK(cond, msg)                                                               \
  do {                                                                                    \
    if (!(cond)) ::megatrain::die_on_bad_result_access(::megatrain::internal_error(       \
        std::string("check failed: ") + #cond + " (" + __FILE__ + ":" +                   \
        std::to_string(__LINE__) + "): " + (msg)));                                        \
  } while (0)

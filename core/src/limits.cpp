#include "megatrain/core/limits.h"

#include <cstdlib>
#include <mutex>
#include <string_view>

#include "megatrain/core/flags.h"

namespace megatrain {
namespace {

struct Entry {
  const char* name;
  int64_t Limits::*field;
};
constexpr Entry kEntries[] = {{"nesting", &Limits::nesting},
                              {"template_steps", &Limits::template_steps},
                              {"template_output_bytes", &Limits::template_output_bytes},
                              {"template_macro_depth", &Limits::template_macro_depth},
                              {"file_bytes", &Limits::file_bytes},
                              {"record_bytes", &Limits::record_bytes}};

std::string accepted_names() {
  std::string s;
  for (const Entry& e : kEntries) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

}  // namespace

Result<Limits> parse_limits(std::string_view text) {
  Limits l;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(at, end - at);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    at = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      return invalid_argument("MEGATRAIN_LIMITS: '" + std::string(item) + "' is not name=value (names: " + accepted_names() + ")");
    const std::string_view name = item.substr(0, eq);
    const Entry* found = nullptr;
    for (const Entry& e : kEntries)
      if (name == e.name) found = &e;
    if (!found)
      return invalid_argument("MEGATRAIN_LIMITS: unknown limit '" + std::string(name) + "' (names: " + accepted_names() + ")");
    MT_ASSIGN_OR_RETURN(l.*(found->field),
                        parse_int_flag("MEGATRAIN_LIMITS " + std::string(name), item.substr(eq + 1), 1, int64_t{1} << 62));
  }
  return l;
}

Result<Limits> limits() {
  static const Result<Limits> cached = [] {
    const char* env = std::getenv("MEGATRAIN_LIMITS");
    return env ? parse_limits(env) : Result<Limits>(Limits{});
  }();
  return cached;
}

Status check_file_bytes(const std::filesystem::path& path, const std::string& what) {
  MT_ASSIGN_OR_RETURN(const Limits lim, limits());
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size <= static_cast<uintmax_t>(lim.file_bytes)) return {};
  return resource_exhausted(limit_message(what + " '" + path.string() + "' holds " + std::to_string(size) + " bytes, read whole and parsed",
                                          "file_bytes", lim.file_bytes, "bytes"));
}

std::string limit_message(const std::string& what, const char* name, int64_t value, const std::string& unit) {
  return what + ": more than " + std::to_string(value) + " " + unit + " (limit " + name + "; raise it with MEGATRAIN_LIMITS=" + name +
         "=N)";
}

}  // namespace megatrain

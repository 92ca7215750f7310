// Locating profiles/models and profiles/hardware by name or path.
#include "megatrain/core/profiles.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "detail/json_reader.h"

namespace megatrain {
namespace fs = std::filesystem;

Result<fs::path> profiles_dir() {
  std::error_code ec;
  if (const char* env = std::getenv("MEGATRAIN_PROFILES_DIR"); env && *env) {
    if (fs::is_directory(env, ec)) return fs::path(env);
    return not_found(std::string("MEGATRAIN_PROFILES_DIR='") + env + "' is not a directory");
  }
#ifdef MEGATRAIN_PROFILES_DIR
  if (fs::is_directory(MEGATRAIN_PROFILES_DIR, ec)) return fs::path(MEGATRAIN_PROFILES_DIR);
#endif
  // A build carried to another machine: look upwards from the executable.
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path p = exe.parent_path(); !p.empty(); p = p.parent_path()) {
      if (fs::is_directory(p / "profiles" / "models", ec)) return p / "profiles";
      if (p == p.root_path()) break;
    }
  }
  return not_found("cannot find the profiles/ folder; set MEGATRAIN_PROFILES_DIR to the project's profiles/ folder");
}

std::vector<std::string> list_profiles(const std::string& kind) {
  std::vector<std::string> names;
  auto dir = profiles_dir();
  if (!dir.ok()) return names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(*dir / kind, ec)) {
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<fs::path> resolve_profile(const std::string& kind, const std::string& spec) {
  const std::string what = kind == "models" ? "model" : "rig";
  if (spec.empty()) return invalid_argument("empty " + what + " name; give a name from profiles/" + kind + "/ or a path");
  std::error_code ec;
  fs::path p(spec);
  if (fs::exists(p, ec)) {
    if (fs::is_directory(p, ec)) {
      if (kind == "models" && fs::exists(p / "config.json", ec)) return p / "config.json";
      return invalid_argument(what + " '" + spec + "' is a folder without a config.json");
    }
    return p;
  }
  bool looks_like_path = spec.find('/') != std::string::npos || p.extension() == ".json";
  MT_ASSIGN_OR_RETURN(fs::path dir, profiles_dir());
  fs::path candidate = dir / kind / (spec + ".json");
  if (!looks_like_path && fs::exists(candidate, ec)) return candidate;
  std::vector<std::string> known = list_profiles(kind);
  std::string list;
  for (size_t i = 0; i < known.size(); ++i) list += (i ? ", " : "") + known[i];
  std::string hint = detail::did_you_mean(spec, known);
  if (looks_like_path) return not_found(what + " file '" + spec + "' does not exist");
  return not_found("no " + what + " named '" + spec + "': not a file, and not in " + (dir / kind).string() + "; " +
                   (hint.empty() ? "" : hint + " ") + "known " + what + "s: " + list);
}

}  // namespace megatrain

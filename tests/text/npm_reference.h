// Where the npm references of the text tests live (scripts/npm-references.sh installs them; test.sh
// into build/npm), and why they cannot run here, if they cannot.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace megatrain::test {

inline std::filesystem::path npm_dir() {
  if (const char* e = std::getenv("MEGATRAIN_NPM_DIR"); e && *e) return e;
  return std::filesystem::path(MEGATRAIN_BINARY_DIR) / "npm";
}

// Empty when node and the package `package` (under node_modules) are there.
inline std::string why_no_npm_reference(const std::string& package) {
  if (std::system("node --version >/dev/null 2>&1") != 0) return "node is not installed";
  if (!std::filesystem::exists(npm_dir() / "node_modules" / package))
    return package + " is not in " + npm_dir().string() + " (run scripts/npm-references.sh " + npm_dir().string() + ")";
  return "";
}

}  // namespace megatrain::test

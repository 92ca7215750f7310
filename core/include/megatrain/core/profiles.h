// Finding the files in profiles/: models/<name>.json and hardware/<name>.json.
// The directory is $MEGATRAIN_PROFILES_DIR when set, else the source tree's profiles/ compiled in,
// else a profiles/ folder found by walking up from the running executable.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain {

Result<std::filesystem::path> profiles_dir();
// Names (file stems) of the profiles in profiles/<kind>/, sorted. kind: "models" | "hardware".
std::vector<std::string> list_profiles(const std::string& kind);
// A path that exists (a file, or a folder holding config.json for models) is used as is; otherwise
// `spec` is looked up as profiles/<kind>/<spec>.json. The error lists the known names.
Result<std::filesystem::path> resolve_profile(const std::string& kind, const std::string& spec);

}  // namespace megatrain

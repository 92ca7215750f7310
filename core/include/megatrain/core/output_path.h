// Checks that an output (a file or a folder a program will write) can be written, so that a
// program refuses a bad path before it spends minutes or hours on the work, not after.
#pragma once

#include <filesystem>
#include <string>

#include "megatrain/core/status.h"

namespace megatrain {

enum class OutputKind {
  kFile,            // a file to write: its folder must exist and take a new file; it must not be a folder
  kFolder,          // a folder to write into: created (with its parents) when missing, then probed
  kExistingFolder,  // a folder that must already exist (a scratch folder on a chosen drive): probed only
};

// Ok when `path` can be written as `kind`. The probe creates a uniquely named empty file in the
// folder that would hold the output and removes it at once; nothing else is written, and an existing
// file at `path` is left alone (writers that replace it atomically, temp + rename, need only the
// folder). An error names `flag` and the path and says why: "--trace /a/x.mtrace: the folder /a does
// not exist", "--checkpoint-dir /etc/passwd: exists and is not a folder", "...: the folder /sys is
// not writable (Permission denied)". `flag` may be empty (the message then starts with the path).
// Safe to call from any thread; the answer can change if the filesystem changes afterwards.
Status check_output(const std::string& flag, const std::filesystem::path& path, OutputKind kind);

}  // namespace megatrain

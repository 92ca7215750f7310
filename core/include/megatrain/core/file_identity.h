// What identifies a file's contents cheaply between two looks: its size and modification time, as
// stat reports them. A data file that is mapped and read all run long is checked against the
// identity it had when opened, so that a file truncated or rewritten under a run is reported by
// name instead of ending the process with SIGBUS.
#pragma once

#include <cstdint>
#include <string>

#include "megatrain/core/status.h"

namespace megatrain {

struct FileIdentity {
  int64_t bytes = -1;        // -1: not a file (memory), always unchanged
  int64_t modified_ns = 0;   // st_mtim
};

// The identity of the file at `path` now (stat follows links), or of an open descriptor.
Result<FileIdentity> file_identity(const std::string& path);
Result<FileIdentity> file_identity(int fd);

// OK while the file at `path` still has identity `was`; otherwise an error that names the file and
// both sizes.
Status check_file_unchanged(const std::string& path, const FileIdentity& was);

}  // namespace megatrain

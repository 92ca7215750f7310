// Internal to the checkpoint code: the hex spelling of an XXH64 digest as manifests store it, and
// the size and XXH64 of a whole file (the hash itself, Xxh64 and xxh64(), is public in
// checkpoint.h). Not a public header.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "megatrain/core/status.h"

namespace megatrain::exec::detail {

// 16 lower-case hex digits.
std::string hex64(uint64_t v);

struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

// Reads the whole file once: its size and XXH64. A missing file is kNotFound.
Result<FileDigest> digest_file(const std::filesystem::path& path);

}  // namespace megatrain::exec::detail

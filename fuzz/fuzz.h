// The fuzz targets (targets.cpp) and the mutator (mutator.cpp) of megatrain-fuzz.
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace megatrain::fuzz {

// One reader of hostile input. `run` must return (whatever the bytes) without a crash, a hang, a
// leak or undefined behaviour; errors are the expected outcome for most inputs.
struct Target {
  const char* name;
  const char* what;
  // Valid inputs to start from (written into `scratch` where a reader needs a file first).
  std::vector<std::string> (*seeds)(const std::filesystem::path& scratch);
  void (*run)(const std::string& bytes, const std::filesystem::path& scratch);
};
const std::vector<Target>& targets();

// One mutation of `in` (bit flips, interesting bytes and numbers, insertions, deletions, copies,
// splices with another seed, truncation), deterministic for the generator's state.
std::string mutate(const std::string& in, const std::vector<std::string>& seeds, std::mt19937_64& rng);

}  // namespace megatrain::fuzz

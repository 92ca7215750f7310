// megatrain-libfuzz: the targets of megatrain-fuzz (fuzz.h) under libFuzzer, coverage-guided
// (issue 49). Built with clang by -DMEGATRAIN_LIBFUZZER=ON (with AddressSanitizer and
// UndefinedBehaviorSanitizer); scripts/test.sh runs each target for a fixed number of runs.
//
//   MEGATRAIN_FUZZ_TARGET=template megatrain-libfuzz CORPUS_DIR -runs=N -seed=1 [libFuzzer flags]
//   MEGATRAIN_FUZZ_TARGET=list megatrain-libfuzz          (the targets' names)
//
// The target is named by the environment (libFuzzer owns the command line). An empty corpus
// folder is first filled with the target's seeds (the valid inputs megatrain-fuzz starts from), so
// the search starts from real files. A crash leaves libFuzzer's crash-<sha1> file; replay it with
// `megatrain-libfuzz FILE` or `megatrain-fuzz TARGET --input FILE`.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "fuzz.h"

namespace {

namespace fs = std::filesystem;
const megatrain::fuzz::Target* g_target = nullptr;
fs::path g_scratch;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  using megatrain::fuzz::Target;
  const char* name = std::getenv("MEGATRAIN_FUZZ_TARGET");
  if (name != nullptr && std::strcmp(name, "list") == 0) {  // the targets' names, one a line
    for (const Target& t : megatrain::fuzz::targets()) std::printf("%s\n", t.name);
    std::exit(0);
  }
  std::string known;
  for (const Target& t : megatrain::fuzz::targets()) {
    known += std::string(known.empty() ? "" : ", ") + t.name;
    if (name != nullptr && std::strcmp(name, t.name) == 0) g_target = &t;
  }
  if (g_target == nullptr) {
    std::fprintf(stderr, "megatrain-libfuzz: %s; accepted: MEGATRAIN_FUZZ_TARGET=one of %s\n",
                 name == nullptr ? "no target named (MEGATRAIN_FUZZ_TARGET is not set)" : "unknown MEGATRAIN_FUZZ_TARGET",
                 known.c_str());
    std::exit(2);
  }
  g_scratch = fs::temp_directory_path() / ("megatrain-libfuzz-" + std::to_string(::getpid()));
  fs::create_directories(g_scratch);
  // The first argument that is not a flag: an empty folder gets the seeds.
  for (int i = 1; i < *argc; ++i) {
    const char* a = (*argv)[i];
    if (a[0] == '-') continue;
    std::error_code ec;
    if (fs::is_directory(a, ec) && fs::is_empty(a, ec)) {
      int k = 0;
      for (const std::string& seed : g_target->seeds(g_scratch))
        std::ofstream(fs::path(a) / ("seed-" + std::to_string(k++)), std::ios::binary) << seed;
      std::fprintf(stderr, "megatrain-libfuzz: %s: %d seed(s) written to %s\n", g_target->name, k, a);
    }
    break;
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g_target->run(std::string(reinterpret_cast<const char*>(data), size), g_scratch);
  return 0;
}

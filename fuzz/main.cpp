// megatrain-fuzz TARGET [--iterations N] [--seed S] [--input FILE]: runs a reader of hostile input
// (fuzz.h) on its seeds, then on N inputs mutated from them by a generator seeded with S, so that a
// run is the same on every machine. Built with MEGATRAIN_SANITIZE, AddressSanitizer and
// UndefinedBehaviorSanitizer abort on any report; before each input runs it is kept in memory, and
// a report or a crash writes it to fuzz-<target>-crash.bin (in the current folder) to replay with
// --input. `megatrain-fuzz list` names the targets.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "fuzz.h"

#if defined(MEGATRAIN_SANITIZE) && __has_include(<sanitizer/common_interface_defs.h>)
#include <sanitizer/common_interface_defs.h>
#define MEGATRAIN_HAVE_DEATH_CALLBACK 1
#endif

namespace {

namespace fs = std::filesystem;
using megatrain::fuzz::Target;

const std::string* g_input = nullptr;
const char* g_target = "";

// Writes the input that was running (async-signal-safe calls only: open, write, close).
void dump_input() {
  if (g_input == nullptr) return;
  char name[128];
  std::snprintf(name, sizeof name, "fuzz-%s-crash.bin", g_target);
  const int fd = ::open(name, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  size_t done = 0;
  while (done < g_input->size()) {
    const ssize_t n = ::write(fd, g_input->data() + done, g_input->size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  const char msg[] = "megatrain-fuzz: the failing input is in fuzz-<target>-crash.bin (replay it with --input)\n";
  (void)!::write(2, msg, sizeof msg - 1);
}

void on_signal(int sig) {
  dump_input();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

int usage(const char* why) {
  std::fprintf(stderr, "megatrain-fuzz: %s\nusage: megatrain-fuzz TARGET [--iterations N] [--seed S] [--input FILE] | list\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace megatrain::fuzz;
  if (argc < 2) return usage("no target given");
  const std::string name = argv[1];
  if (name == "list") {
    for (const Target& t : targets()) std::printf("%-12s %s\n", t.name, t.what);
    return 0;
  }
  const Target* target = nullptr;
  for (const Target& t : targets())
    if (name == t.name) target = &t;
  if (target == nullptr) {
    std::string known;
    for (const Target& t : targets()) known += std::string(known.empty() ? "" : ", ") + t.name;
    return usage(("unknown target '" + name + "'; accepted: " + known).c_str());
  }
  long long iterations = 1000;
  unsigned long long seed = 1;
  std::string replay;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage((a + " needs a value").c_str());
    char* end = nullptr;
    if (a == "--iterations") {
      iterations = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0' || iterations < 0 || iterations > 100000000) return usage("--iterations: expected 0 to 100000000");
    } else if (a == "--seed") {
      seed = std::strtoull(argv[++i], &end, 10);
      if (*end != '\0') return usage("--seed: expected a non-negative integer");
    } else if (a == "--input") {
      replay = argv[++i];
    } else {
      return usage(("unknown option " + a).c_str());
    }
  }
  g_target = target->name;
#ifdef MEGATRAIN_HAVE_DEATH_CALLBACK
  __sanitizer_set_death_callback(dump_input);
#endif
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_signal);

  const fs::path scratch = fs::temp_directory_path() / ("megatrain-fuzz-" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  auto run_one = [&](const std::string& bytes) {
    g_input = &bytes;
    target->run(bytes, scratch);
    g_input = nullptr;
  };
  const auto t0 = std::chrono::steady_clock::now();
  long long runs = 0;
  if (!replay.empty()) {
    std::ifstream in(replay, std::ios::binary);
    if (!in) return usage(("--input: cannot read " + replay).c_str());
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    run_one(bytes);
    runs = 1;
  } else {
    const std::vector<std::string> seeds = target->seeds(scratch);
    if (seeds.empty()) {
      std::fprintf(stderr, "megatrain-fuzz: target %s has no seeds (its seed files or writer failed)\n", target->name);
      return 1;
    }
    for (const std::string& s : seeds) run_one(s);
    std::mt19937_64 rng(seed);
    std::string current = seeds[0];
    for (long long i = 0; i < iterations; ++i) {
      // Mostly mutate the last input further; now and then start again from a seed.
      if (i % 16 == 0) current = seeds[static_cast<size_t>(rng() % seeds.size())];
      current = mutate(current, seeds, rng);
      if (current.size() > (size_t{1} << 20)) current.resize(size_t{1} << 20);
      run_one(current);
    }
    runs = static_cast<long long>(seeds.size()) + iterations;
  }
  std::error_code ec;
  fs::remove_all(scratch, ec);
  std::printf("megatrain-fuzz %s: %lld inputs in %.1f s, no failure\n", target->name, runs,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

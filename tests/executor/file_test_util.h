// Helpers for the executor's file tests: a self-deleting scratch folder, raw byte files, and running
// the project's Python (its venv) as an independent reference.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace megatrain::test {

// A fresh folder under the system temp dir, removed with everything in it at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("megatrain-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

template <typename T>
void append_pod(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Files in `dir` whose name contains `needle` (left-over temporaries, say).
inline std::vector<std::string> files_containing(const std::filesystem::path& dir, const std::string& needle) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find(needle) != std::string::npos) out.push_back(e.path().filename().string());
  return out;
}

// The interpreter of the Python references: the project's venv (scripts/python-env.sh), as
// configured (tests/CMakeLists.txt).
inline const char* python() { return MEGATRAIN_TEST_PYTHON; }
inline bool have_python3() {
  const std::string p = python();
  return p.find('/') == std::string::npos || ::access(p.c_str(), X_OK) == 0;
}

struct PythonRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `script` (written to a file in `dir`) with python() and the given arguments.
inline PythonRun run_python(const std::filesystem::path& dir, const std::string& script, const std::string& args = "") {
  const auto file = dir / "check.py";
  write_bytes(file, script);
  const std::string cmd = std::string(python()) + " '" + file.string() + "' " + args + " 2>&1";
  PythonRun r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A tmpfs mounted over a fresh folder for the test's lifetime (the tests run as root; a container
// may refuse, and mounted() then says so).
class TmpfsMount {
 public:
  TmpfsMount(const std::filesystem::path& dir, const std::string& opts) : dir_(dir) {
    std::filesystem::create_directories(dir_);
    const std::string cmd = "mount -t tmpfs -o " + opts + " tmpfs '" + dir_.string() + "' 2>/dev/null";
    mounted_ = std::system(cmd.c_str()) == 0;
  }
  ~TmpfsMount() {
    if (mounted_) {
      const std::string cmd = "umount '" + dir_.string() + "'";
      if (std::system(cmd.c_str()) != 0) ADD_FAILURE() << "could not unmount " << dir_;
    }
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
  bool mounted() const { return mounted_; }

 private:
  std::filesystem::path dir_;
  bool mounted_ = false;
};

}  // namespace megatrain::test

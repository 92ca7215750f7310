// The tokenizer's parts on small hand-made tokenizer.json files, without the npm references:
// valid UTF-8 by the standard's maximal subparts, BPE merge order by hand, byte-level mapping,
// byte fallback, added tokens, decoding, and the errors that name what is not supported.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megatrain/data/tokenizer.h"

namespace {

using megatrain::data::Tokenizer;
using megatrain::data::valid_utf8;
using Json = nlohmann::json;

TEST(ValidUtf8, EachMaximalSubpartBecomesOneReplacement) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(valid_utf8("abc"), "abc");
  EXPECT_EQ(valid_utf8("\xC3\xA9"), "\xC3\xA9");
  EXPECT_EQ(valid_utf8("\xFF"), r);
  EXPECT_EQ(valid_utf8("\xC3"), r) << "a truncated sequence at the end";
  EXPECT_EQ(valid_utf8("\xE2\x82"), r) << "a lead and one continuation: one subpart";
  EXPECT_EQ(valid_utf8("\xE2\x82x"), r + "x");
  EXPECT_EQ(valid_utf8("\xED\xA0\x80"), r + r + r) << "a surrogate: the lead cannot take A0";
  EXPECT_EQ(valid_utf8("\xF0\x80\x80"), r + r + r) << "an overlong 4-byte form";
  EXPECT_EQ(valid_utf8("\xC0\xAF"), r + r);
  EXPECT_EQ(valid_utf8("\xF4\x90\x80\x80"), r + r + r + r) << "above U+10FFFF";
  EXPECT_EQ(valid_utf8("\xF0\x9F\xA4\x97"), "\xF0\x9F\xA4\x97");
  EXPECT_EQ(valid_utf8(std::string("a\0b", 3)), std::string("a\0b", 3));
}

// Normalizers see only the runs of non-ASCII characters (with the ASCII character before each):
// the result must be the whole text's normal form, including marks that compose with an ASCII base.
// A tokenizer of byte tokens only (byte fallback) gives back the normalized bytes.
TEST(Tokenizer, NormalFormsOfMixedTextByHand) {
  auto normalized = [](const char* form, const std::string& text) {
    Json vocab = Json::object();
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      vocab[name] = b;
    }
    const Json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array()}, {"byte_fallback", true}}},
                    {"normalizer", {{"type", form}}},
                    {"decoder", {{"type", "ByteFallback"}}}};
    auto tok = Tokenizer::from_json(j.dump());
    if (!tok.ok()) return tok.status().message();
    auto back = tok->decode(tok->encode(text));
    return back.ok() ? *back : back.status().message();
  };
  EXPECT_EQ(normalized("NFC", "plain ascii"), "plain ascii");
  EXPECT_EQ(normalized("NFC", "cafe\xCC\x81 x"), "caf\xC3\xA9 x") << "e + U+0301 across the ASCII boundary";
  EXPECT_EQ(normalized("NFC", "a<\xCC\xB8" "b"), "a\xE2\x89\xAE" "b") << "< + U+0338 is U+226E";
  EXPECT_EQ(normalized("NFC", "xa\xCC\x81\xCC\xA3y"), "x\xE1\xBA\xA1\xCC\x81y") << "marks reordered: a + dot below, then acute";
  EXPECT_EQ(normalized("NFC", "\xE1\x84\x80\xE1\x85\xA1" "a"), "\xEA\xB0\x80" "a") << "Hangul jamo compose";
  EXPECT_EQ(normalized("NFD", "\xC3\xA9t\xC3\xA9"), "e\xCC\x81te\xCC\x81");
  EXPECT_EQ(normalized("NFKC", "\xEF\xBC\xA1" "1\xEF\xBC\x92"), "A12") << "fullwidth letters and digits";
  EXPECT_EQ(normalized("NFKD", "\xEF\xAC\x81" "x"), "fix") << "the fi ligature";
}

// A byte-level BPE over "abc" and spaces: the merges' ranks decide the order by hand.
Json byte_level() {
  Json vocab = Json::object();
  int id = 0;
  for (const char* t : {"a", "b", "c", "\xC4\xA0", "ab", "bc", "abc", "\xC4\xA0" "a", "x"}) vocab[t] = id++;
  return Json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"b c", "a b", "ab c", "\xC4\xA0 a"}}}},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"added_tokens", Json::array({{{"id", 9}, {"content", "<|end|>"}, {"special", true}}})},
              {"post_processor", {{"type", "TemplateProcessing"},
                                  {"single", Json::array({{{"SpecialToken", {{"id", "<|end|>"}}}}, {{"Sequence", {{"id", "A"}}}}})},
                                  {"special_tokens", {{"<|end|>", {{"id", "<|end|>"}, {"ids", {9}}}}}}}}};
}

TEST(Tokenizer, MergesTheLowestRankFirst) {
  auto t = Tokenizer::from_json(byte_level().dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  // "abc": "b c" (rank 0) before "a b" (rank 1), so a + bc, which no merge joins.
  EXPECT_EQ(t->encode("abc"), (std::vector<int32_t>{0, 5}));
  // "ab": only "a b".
  EXPECT_EQ(t->encode("ab"), (std::vector<int32_t>{4}));
  // " a b": the regex splits " a" and " b"; the space is Ġ (U+0120) and "Ġ a" merges.
  EXPECT_EQ(t->encode(" a b"), (std::vector<int32_t>{7, 3, 1}));
  EXPECT_EQ(t->encode("ab<|end|>c"), (std::vector<int32_t>{4, 9, 2}));
  EXPECT_EQ(t->encode("c", true), (std::vector<int32_t>{9, 2}));
  auto d = t->decode({7, 3, 1, 9, 2});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, " a b<|end|>c");
  EXPECT_EQ(*t->decode({7, 9, 2}, true), " ac");
  EXPECT_FALSE(t->decode({99}).ok());
  EXPECT_EQ(t->vocab_size(), 10);
  EXPECT_EQ(t->token_to_id("<|end|>"), 9);
  EXPECT_TRUE(t->is_special(9));
}

TEST(Tokenizer, ByteFallbackSpellsUnknownCharactersInBytes) {
  Json vocab = {{"<unk>", 0}, {"\xE2\x96\x81", 1}, {"h", 2}, {"i", 3}, {"hi", 4}, {"\xE2\x96\x81hi", 5}};
  int id = 6;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = id++;
  }
  const Json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h i", "\xE2\x96\x81 hi"}}, {"byte_fallback", true},
                             {"unk_token", "<unk>"}, {"fuse_unk", true}}},
                  {"normalizer", {{"type", "Sequence"}, {"normalizers", Json::array({{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
                                                                                    {{"type", "Replace"}, {"pattern", {{"String", " "}}},
                                                                                     {"content", "\xE2\x96\x81"}}})}}},
                  {"decoder", {{"type", "Sequence"}, {"decoders", Json::array({{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}},
                                                                                {"content", " "}},
                                                                               {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                                                               {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}}};
  auto t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  // "hi é": ▁hi ▁ then é as its two bytes C3 A9.
  const std::vector<int32_t> ids = t->encode("hi \xC3\xA9");
  EXPECT_EQ(ids, (std::vector<int32_t>{5, 1, 6 + 0xC3, 6 + 0xA9}));
  EXPECT_EQ(*t->decode(ids), "hi \xC3\xA9");
}

TEST(Tokenizer, WhatIsNotSupportedIsNamedWithItsPath) {
  Json j = byte_level();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", Json::array({{{"type", "Digits"}, {"individual_digits", true}}})}};
  auto t = Tokenizer::from_json(j.dump(), "model/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("model/tokenizer.json: pre_tokenizer.pretokenizers[0]"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("'Digits' is not supported"), std::string::npos) << t.status().message();
  j = byte_level();
  j["model"]["type"] = "WordPiece";
  t = Tokenizer::from_json(j.dump());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("model.type"), std::string::npos) << t.status().message();
  j = byte_level();
  j["model"]["merges"][1] = "a q";
  t = Tokenizer::from_json(j.dump());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("model.merges[1]"), std::string::npos) << t.status().message();
  EXPECT_FALSE(Tokenizer::from_json("{not json").ok());
  EXPECT_FALSE(Tokenizer::load("/nonexistent/model").ok());
}

// Kimi-K2's folder has a tiktoken vocabulary and no tokenizer.json (issue 47): refused naming the
// file and what is accepted instead, not as a missing tokenizer.json.
TEST(Tokenizer, ATiktokenFolderIsRefusedNamingWhatToProvide) {
  const auto dir = std::filesystem::temp_directory_path() / ("megatrain_tiktoken_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tiktoken.model") << "IQ== 0\nIg== 1\n";
  auto t = Tokenizer::load(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), megatrain::StatusCode::kUnsupported) << t.status().to_string();
  EXPECT_NE(t.status().message().find((dir / "tiktoken.model").string() + ": a tiktoken vocabulary"), std::string::npos)
      << t.status().message();
  EXPECT_NE(t.status().message().find("accepted: a Hugging Face tokenizer.json"), std::string::npos) << t.status().message();
  std::ofstream(dir / "tokenizer.json") << byte_level().dump();  // with a tokenizer.json beside it, that one is read
  EXPECT_TRUE(Tokenizer::load(dir).ok());
  std::filesystem::remove_all(dir);
}

// A tokenizer.json nested 100,000 deep (Sequence normalizers inside each other: 1.7 MB) overflowed
// the stack, and 20,000 levels took over 5 GB (issue 49): the parse stops at Limits::nesting.
TEST(Tokenizer, NestingPastTheBudgetIsRefusedAtTheParse) {
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += R"({"type": "Sequence", "normalizers": [)";
  deep += R"({"type": "NFC"})";
  for (int i = 0; i < 100000; ++i) deep += "]}";
  Json j = byte_level();
  std::string text = j.dump();
  text.insert(text.size() - 1, R"(, "normalizer": )" + deep);
  auto t = Tokenizer::from_json(text, "model/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("model/tokenizer.json: JSON nested too deep: more than 256 levels (limit nesting; raise it with "
                                      "MEGATRAIN_LIMITS=nesting=N)"),
            std::string::npos)
      << t.status().message().substr(0, 300);
  // Within the budget the same Sequence loads.
  std::string ok;
  for (int i = 0; i < 50; ++i) ok += R"({"type": "Sequence", "normalizers": [)";
  ok += R"({"type": "NFC"})";
  for (int i = 0; i < 50; ++i) ok += "]}";
  text = j.dump();
  text.insert(text.size() - 1, R"(, "normalizer": )" + ok);
  EXPECT_TRUE(Tokenizer::from_json(text).ok());
}

// A Strip decoder with empty content and a large start decoded forever (issue 49): Hugging Face's
// Strip removes one character, so anything else is refused naming the key.
TEST(Tokenizer, AStripDecoderStripsOneCharacterOrIsRefused) {
  for (const Json& content : {Json(""), Json("ab"), Json("\xff")}) {
    Json j = byte_level();
    j["decoder"] = {{"type", "Strip"}, {"content", content}, {"start", int64_t{1} << 62}, {"stop", 0}};
    auto t = Tokenizer::from_json(j.dump(-1, ' ', false, Json::error_handler_t::ignore), "tok.json");
    ASSERT_FALSE(t.ok()) << content;
    EXPECT_NE(t.status().message().find("decoder.content"), std::string::npos) << t.status().message();
  }
  Json j = byte_level();
  j["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", -1}, {"stop", 0}};
  auto t = Tokenizer::from_json(j.dump());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("decoder.start: -1 is not a count"), std::string::npos) << t.status().message();
  // One character and a huge count: decodes at once.
  j["decoder"] = {{"type", "Strip"}, {"content", "a"}, {"start", int64_t{1} << 62}, {"stop", int64_t{1} << 62}};
  t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  (void)t->decode(t->encode("aaa"));
}

// Added tokens are matched through a trie (issue 49: 50,000 of them were scanned one by one at
// every position, 39 s for 1.4 MB): at each position the longest content that may stand there,
// by hand, and the same ids as a plain longest-first scan over 2,000 tokens that share prefixes.
TEST(Tokenizer, AddedTokensMatchTheLongestThatMayStandThere) {
  Json j = byte_level();
  j["added_tokens"] = Json::array({{{"id", 9}, {"content", "<|end|>"}, {"special", true}},
                                   {{"id", 10}, {"content", "<a"}},
                                   {{"id", 11}, {"content", "<ab"}, {"single_word", true}},
                                   {{"id", 12}, {"content", "<abc>"}}});
  auto t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  // "<abc>" is the longest; "<ab" may stand only as a word of its own (not before "c"), so "<abx"
  // takes "<a" then b, x; " <ab" stands alone and takes "<ab".
  EXPECT_EQ(t->encode("<abc>"), (std::vector<int32_t>{12}));
  EXPECT_EQ(t->encode("<abx"), (std::vector<int32_t>{10, 1, 8}));
  EXPECT_EQ(t->encode("c<ab"), (std::vector<int32_t>{2, 10, 1}));
  EXPECT_EQ(t->encode("<ab<|end|>"), (std::vector<int32_t>{11, 9}));
  // 2,000 contents: <t0>, <t00>, <t000>, ... prefixes of each other, against a longest-first scan.
  Json many = Json::array();
  std::vector<std::string> contents;
  for (int k = 0; k < 2000; ++k) {
    std::string c = "<t" + std::to_string(k % 50) + std::string(static_cast<size_t>(k / 50), 'q');
    contents.push_back(c);
    many.push_back({{"id", 9 + k}, {"content", c}});
  }
  j["added_tokens"] = many;
  j["post_processor"] = nullptr;
  t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  std::string text;
  for (int k = 0; k < 3000; ++k) text += contents[static_cast<size_t>((k * 7919) % 2000)].substr(0, static_cast<size_t>(2 + k % 9)) + "a";
  std::vector<int32_t> want;
  std::string plain;
  auto flush = [&] {
    const std::vector<int32_t> p = t->encode(plain);
    want.insert(want.end(), p.begin(), p.end());
    plain.clear();
  };
  for (size_t i = 0; i < text.size();) {
    int best = -1;
    for (int k = 0; k < 2000; ++k)
      if (text.compare(i, contents[static_cast<size_t>(k)].size(), contents[static_cast<size_t>(k)]) == 0 &&
          (best < 0 || contents[static_cast<size_t>(k)].size() > contents[static_cast<size_t>(best)].size()))
        best = k;
    if (best < 0) {
      plain += text[i++];
      continue;
    }
    flush();
    want.push_back(9 + best);
    i += contents[static_cast<size_t>(best)].size();
  }
  flush();
  EXPECT_EQ(t->encode(text), want);
}

// A pre-tokenizer regex that reaches PCRE2's match limit (catastrophic backtracking) was read as
// "no match", so the text was tokenized as one gap, unlike the reference (issue 49): it is an
// error wherever the caller can report one, naming PCRE2's reason.
TEST(Tokenizer, ARegexThatFailsToMatchIsAnErrorNotAGap) {
  Json j = byte_level();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(*NO_START_OPT)(a|aa)*c"}}}, {"behavior", "Isolated"}, {"invert", false}};
  auto t = Tokenizer::from_json(j.dump());
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  std::vector<size_t> at;
  auto fine = t->encode_with_cuts("aac ab", {}, at);
  ASSERT_TRUE(fine.ok()) << fine.status().to_string();
  auto bad = t->encode_with_cuts(std::string(64, 'a'), {}, at);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("regex could not be matched"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("PCRE2 error"), std::string::npos) << bad.status().message();
  // encode_checked (megatrain-data encode's path) likewise; a text that matches is encode's ids.
  auto checked = t->encode_checked(std::string(64, 'a'));
  ASSERT_FALSE(checked.ok());
  EXPECT_NE(checked.status().message().find("PCRE2 error"), std::string::npos) << checked.status().message();
  auto ok = t->encode_checked("aac ab", true);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(*ok, t->encode("aac ab", true));
}

// Ids that would size the id table past reason, or wrap when narrowed, are refused naming the key
// (found by megatrain-fuzz: an added token's id of 2^31 became a resize to 2^64 - 2^31 and aborted).
TEST(Tokenizer, IdsOutOfRangeAreNamed) {
  auto error_of = [](const Json& j) {
    auto t = Tokenizer::from_json(j.dump());
    return t.ok() ? std::string("accepted") : t.status().message();
  };
  Json j = byte_level();
  j["added_tokens"] = Json::array({{{"id", int64_t{1} << 31}, {"content", "<s>"}, {"special", true}}});
  EXPECT_NE(error_of(j).find("added_tokens[0].id: 2147483648 is not an id from 0 to 16777215"), std::string::npos) << error_of(j);
  j["added_tokens"][0]["id"] = -1;
  EXPECT_NE(error_of(j).find("added_tokens[0].id: -1 is not an id"), std::string::npos) << error_of(j);
  j = byte_level();
  j["model"]["vocab"]["zz"] = int64_t{1} << 24;
  EXPECT_NE(error_of(j).find("model.vocab[\"zz\"]: expected an integer id from 0 to 16777215"), std::string::npos) << error_of(j);
  j = byte_level();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", Json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}}}}})},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", Json::array({999999})}}}}}};
  EXPECT_NE(error_of(j).find("post_processor.special_tokens.<s>.ids: 999999 is not an id of the vocabulary"), std::string::npos)
      << error_of(j);
}

}  // namespace

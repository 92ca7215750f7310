// Hugging Face tokenizer.json, read and run (tokenizer.h gives what is supported and the order).
#include "megatrain/data/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>
#include <span>
#include <unordered_map>

#include "megatrain/core/limits.h"
#include "text.h"

namespace megatrain::data {

namespace {

using Json = nlohmann::json;

// ---- the pipeline's parts, as data --------------------------------------------------------------

struct NormalizerStep {
  enum Kind { kForm, kPrepend, kReplace } kind = kForm;
  NormalForm form = NormalForm::kNfc;
  std::string a, b;  // Prepend: a; Replace: a -> b
};

struct PreTokenizerStep {
  enum Kind { kSplit, kByteLevel } kind = kSplit;
  enum Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext } behavior = kIsolated;
  std::shared_ptr<Regex> regex;  // Split (a literal is compiled quoted); ByteLevel with use_regex
  bool add_prefix_space = false;
};

struct DecoderStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip } kind = kByteLevel;
  std::string a, b;  // Replace: a -> b; Strip: a is the character
  int64_t start = 0, stop = 0;
};

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false, single_word = false;
};

// GPT-2's bytes-to-characters table: the printable bytes stand for themselves, the others for
// code points from 256 up, in byte order.
struct ByteTable {
  std::string to_char[256];
  std::unordered_map<std::string, unsigned char> to_byte;
  ByteTable() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = utf8_of(static_cast<uint32_t>(printable ? b : next++));
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};
const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

// Token ids are below 2^24: the largest vocabularies have a few hundred thousand, and an id sizes
// the id -> token table.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// SentencePiece's word boundary, U+2581 (▁).
const std::string kMeta = "\xE2\x96\x81";
// Whether the ▁ at byte p (> 0) of s follows another character than ▁.
bool meta_after_other(std::string_view s, size_t p) {
  return p < kMeta.size() || s.substr(p - kMeta.size(), kMeta.size()) != kMeta;
}

// Lets the maps keyed by std::string be searched with a std::string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// GPT-2's pre-tokenizer regex (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string quote_regex(std::string_view literal) {
  std::string out = "\\Q";
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal.compare(i, 2, "\\E") == 0) {
      out += "\\E\\\\E\\Q";
      ++i;
    } else {
      out.push_back(literal[i]);
    }
  }
  return out + "\\E";
}

}  // namespace

namespace {
std::atomic<uint64_t> g_tokenizers{0};  // Impl serials
}  // namespace

struct Tokenizer::Impl {
  std::string what;
  const uint64_t serial = ++g_tokenizers;  // tells a thread's word cache which tokenizer filled it
  // model
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab;
  std::vector<std::string> tokens;  // id -> text (vocabulary and added tokens)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk = -1;
  int32_t byte_ids[256];
  // pipeline
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::vector<DecoderStep> decoders;
  std::vector<int32_t> prefix, suffix;  // the post-processor's template around the sequence
  std::vector<AddedToken> added;        // longest first
  bool added_first_byte[256] = {};      // whether an added token starts with this byte
  // The added tokens' contents as a byte trie: node 0 is the root, an edge is (node << 8 | byte)
  // -> child, and a node where a content ends holds that token's index in `added` (the first of
  // equal contents), else -1. Matching at a position walks it once: the longest match in time of
  // its length, not of the number of added tokens (50,000 of them took 39 s for 1.4 MB).
  std::unordered_map<uint64_t, int32_t> added_edges;
  std::vector<int32_t> added_end;
  std::vector<char> special;            // by id
  // SentencePiece-style vocabularies without a pre-tokenizer (Llama-2) make the whole normalized
  // text one word. When no token has a ▁ after another character, no merge can join across the
  // place before such a ▁, so the word is cut there first: the same ids, found word by word.
  bool cut_at_metaspace = false;
  int32_t bos = -1, eos = -1, pad = -1;  // tokenizer_config.json
  std::string chat_template;

  Status fail(const std::string& path, const std::string& msg) const { return invalid_argument(what + ": " + path + ": " + msg); }

  Status load_model(const Json& m);
  Status load_normalizer(const Json& j, const std::string& path);
  Status load_pre_tokenizer(const Json& j, const std::string& path);
  Status load_decoder(const Json& j, const std::string& path);
  Status load_post_processor(const Json& j, const std::string& path);
  Status load_added(const Json& j);

  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  struct Scratch;
  // The piece after the normalizers: the piece itself when there are none, else in sc.norm.
  std::string_view normalized(std::string_view piece, Scratch& sc) const;
  // Splits `text` into words (left in sc.words as spans) and returns the text they index: `text`,
  // or one of sc's buffers when a ByteLevel step mapped the bytes.
  std::string_view pre_tokenized(std::string_view text, Scratch& sc) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
};

// ---- loading -------------------------------------------------------------------------------------

namespace {
std::string type_of(const Json& j) { return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : ""; }
bool flag(const Json& j, const char* key, bool fallback = false) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : fallback;
}
}  // namespace

Status Tokenizer::Impl::load_model(const Json& m) {
  if (type_of(m) != "BPE")
    return fail("model.type", "'" + type_of(m) + "' is not supported; supported: BPE (byte-level, or SentencePiece-style with byte_fallback)");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    return fail("model.dropout", "BPE dropout is for training tokenizers; accepted: null or 0");
  if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string() && !m["end_of_word_suffix"].get<std::string>().empty())
    return fail("model.end_of_word_suffix", "not supported; accepted: null or \"\"");
  if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string() &&
      !m["continuing_subword_prefix"].get<std::string>().empty())
    return fail("model.continuing_subword_prefix", "not supported; accepted: null or \"\"");
  if (!m.contains("vocab") || !m["vocab"].is_object()) return fail("model.vocab", "missing; expected an object of token: id");
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= kMaxTokenId)
      return fail("model.vocab[\"" + it.key() + "\"]", "expected an integer id from 0 to " + std::to_string(kMaxTokenId - 1));
    const auto id = it.value().get<int32_t>();
    vocab[it.key()] = id;
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(static_cast<size_t>(id) + 1);
    tokens[static_cast<size_t>(id)] = it.key();
  }
  ignore_merges = flag(m, "ignore_merges");
  byte_fallback = flag(m, "byte_fallback");
  fuse_unk = flag(m, "fuse_unk");
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    const auto u = vocab.find(m["unk_token"].get<std::string>());
    if (u == vocab.end()) return fail("model.unk_token", "'" + m["unk_token"].get<std::string>() + "' is not in the vocabulary");
    unk = u->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    const auto f = vocab.find(name);
    byte_ids[b] = f == vocab.end() ? -1 : f->second;
  }
  if (!m.contains("merges") || !m["merges"].is_array()) return fail("model.merges", "missing; expected an array");
  const Json& ms = m["merges"];
  merges.reserve(ms.size());
  for (size_t r = 0; r < ms.size(); ++r) {
    std::string a, b;
    if (ms[r].is_string()) {
      const std::string s = ms[r].get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        return fail("model.merges[" + std::to_string(r) + "]", "'" + s + "': expected two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (ms[r].is_array() && ms[r].size() == 2 && ms[r][0].is_string() && ms[r][1].is_string()) {
      a = ms[r][0].get<std::string>();
      b = ms[r][1].get<std::string>();
    } else {
      return fail("model.merges[" + std::to_string(r) + "]", "expected \"a b\" or [\"a\", \"b\"]");
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end())
      return fail("model.merges[" + std::to_string(r) + "]", "'" + a + "' + '" + b + "': a part or the merged token is not in the vocabulary");
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) | static_cast<uint32_t>(ib->second);
    merges.try_emplace(key, static_cast<int32_t>(r), iab->second);  // the first (lowest) rank wins
  }
  return {};
}

Status Tokenizer::Impl::load_normalizer(const Json& j, const std::string& path) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  NormalizerStep s;
  if (t == "Sequence") {
    if (!j.contains("normalizers") || !j["normalizers"].is_array()) return fail(path + ".normalizers", "missing; expected an array");
    for (size_t i = 0; i < j["normalizers"].size(); ++i)
      MT_RETURN_IF_ERROR(load_normalizer(j["normalizers"][i], path + ".normalizers[" + std::to_string(i) + "]"));
    return {};
  }
  if (t == "NFC" || t == "NFD" || t == "NFKC" || t == "NFKD") {
    s.form = t == "NFC" ? NormalForm::kNfc : t == "NFD" ? NormalForm::kNfd : t == "NFKC" ? NormalForm::kNfkc : NormalForm::kNfkd;
  } else if (t == "Prepend" && j.contains("prepend") && j["prepend"].is_string()) {
    s.kind = NormalizerStep::kPrepend;
    s.a = j["prepend"].get<std::string>();
  } else if (t == "Replace" && j.contains("pattern") && j["pattern"].contains("String") && j.contains("content")) {
    s.kind = NormalizerStep::kReplace;
    s.a = j["pattern"]["String"].get<std::string>();
    s.b = j["content"].get<std::string>();
  } else {
    return fail(path, "the normalizer '" + (t.empty() ? j.dump() : t) +
                          "' is not supported; supported: NFC, NFD, NFKC, NFKD, Prepend, Replace (a String pattern), Sequence");
  }
  normalizers.push_back(std::move(s));
  return {};
}

Status Tokenizer::Impl::load_pre_tokenizer(const Json& j, const std::string& path) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  PreTokenizerStep s;
  if (t == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array()) return fail(path + ".pretokenizers", "missing; expected an array");
    for (size_t i = 0; i < j["pretokenizers"].size(); ++i)
      MT_RETURN_IF_ERROR(load_pre_tokenizer(j["pretokenizers"][i], path + ".pretokenizers[" + std::to_string(i) + "]"));
    return {};
  }
  if (t == "Split") {
    if (flag(j, "invert")) return fail(path + ".invert", "an inverted Split is not supported; accepted: false");
    std::string pattern;
    if (j.contains("pattern") && j["pattern"].contains("Regex") && j["pattern"]["Regex"].is_string())
      pattern = j["pattern"]["Regex"].get<std::string>();
    else if (j.contains("pattern") && j["pattern"].contains("String") && j["pattern"]["String"].is_string())
      pattern = quote_regex(j["pattern"]["String"].get<std::string>());
    else
      return fail(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    auto re = Regex::compile(pattern);
    if (!re.ok()) return fail(path + ".pattern", re.status().message());
    s.regex = std::make_shared<Regex>(std::move(*re));
    const std::string b = j.contains("behavior") && j["behavior"].is_string() ? j["behavior"].get<std::string>() : "";
    if (b == "Isolated") s.behavior = PreTokenizerStep::kIsolated;
    else if (b == "Removed") s.behavior = PreTokenizerStep::kRemoved;
    else if (b == "MergedWithPrevious") s.behavior = PreTokenizerStep::kMergedWithPrevious;
    else if (b == "MergedWithNext") s.behavior = PreTokenizerStep::kMergedWithNext;
    else return fail(path + ".behavior", "'" + b + "' is not supported; supported: Isolated, Removed, MergedWithPrevious, MergedWithNext");
  } else if (t == "ByteLevel") {
    s.kind = PreTokenizerStep::kByteLevel;
    s.add_prefix_space = flag(j, "add_prefix_space", true);
    if (flag(j, "use_regex", true)) {
      auto re = Regex::compile(kGpt2Pattern);
      if (!re.ok()) return re.status();
      s.regex = std::make_shared<Regex>(std::move(*re));
    }
  } else {
    return fail(path, "the pre-tokenizer '" + (t.empty() ? j.dump() : t) + "' is not supported; supported: Split, ByteLevel, Sequence");
  }
  pre_tokenizers.push_back(std::move(s));
  return {};
}

Status Tokenizer::Impl::load_decoder(const Json& j, const std::string& path) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  DecoderStep s;
  if (t == "Sequence") {
    if (!j.contains("decoders") || !j["decoders"].is_array()) return fail(path + ".decoders", "missing; expected an array");
    for (size_t i = 0; i < j["decoders"].size(); ++i)
      MT_RETURN_IF_ERROR(load_decoder(j["decoders"][i], path + ".decoders[" + std::to_string(i) + "]"));
    return {};
  }
  if (t == "ByteLevel") {
    s.kind = DecoderStep::kByteLevel;
  } else if (t == "Replace" && j.contains("pattern") && j["pattern"].contains("String") && j.contains("content")) {
    s.kind = DecoderStep::kReplace;
    s.a = j["pattern"]["String"].get<std::string>();
    s.b = j["content"].get<std::string>();
  } else if (t == "ByteFallback") {
    s.kind = DecoderStep::kByteFallback;
  } else if (t == "Fuse") {
    s.kind = DecoderStep::kFuse;
  } else if (t == "Strip" && j.contains("content") && j["content"].is_string()) {
    s.kind = DecoderStep::kStrip;
    s.a = j["content"].get<std::string>();
    // Hugging Face's Strip removes one character (a Rust char) up to start and stop times: an
    // empty content "matched" forever (a decode that never ended).
    if (s.a.empty() || utf8_length(static_cast<unsigned char>(s.a[0])) != s.a.size() || valid_utf8_prefix(s.a) != s.a.size())
      return fail(path + ".content", "'" + s.a + "' is not one character; Strip removes one character");
    for (const char* key : {"start", "stop"})
      if (j.contains(key) && (!j[key].is_number_unsigned() && !(j[key].is_number_integer() && j[key].get<int64_t>() >= 0)))
        return fail(path + "." + key, j[key].dump() + " is not a count; expected an integer >= 0");
    s.start = j.value("start", int64_t{0});
    s.stop = j.value("stop", int64_t{0});
  } else {
    return fail(path, "the decoder '" + (t.empty() ? j.dump() : t) +
                          "' is not supported; supported: ByteLevel, Replace (a String pattern), ByteFallback, Fuse, Strip, Sequence");
  }
  decoders.push_back(std::move(s));
  return {};
}

Status Tokenizer::Impl::load_post_processor(const Json& j, const std::string& path) {
  if (j.is_null()) return {};
  const std::string t = type_of(j);
  if (t == "Sequence") {
    if (!j.contains("processors") || !j["processors"].is_array()) return fail(path + ".processors", "missing; expected an array");
    for (size_t i = 0; i < j["processors"].size(); ++i)
      MT_RETURN_IF_ERROR(load_post_processor(j["processors"][i], path + ".processors[" + std::to_string(i) + "]"));
    return {};
  }
  if (t == "ByteLevel") return {};  // offsets only: the ids are unchanged
  if (t != "TemplateProcessing")
    return fail(path, "the post-processor '" + (t.empty() ? j.dump() : t) + "' is not supported; supported: TemplateProcessing, ByteLevel, Sequence");
  if (!j.contains("single") || !j["single"].is_array()) return fail(path + ".single", "missing; expected an array");
  bool seen_sequence = false;
  for (size_t i = 0; i < j["single"].size(); ++i) {
    const Json& piece = j["single"][i];
    const std::string at = path + ".single[" + std::to_string(i) + "]";
    if (piece.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    if (!piece.contains("SpecialToken") || !piece["SpecialToken"].contains("id")) return fail(at, "expected a SpecialToken or the Sequence");
    const std::string name = piece["SpecialToken"]["id"].get<std::string>();
    if (!j.contains("special_tokens") || !j["special_tokens"].contains(name) || !j["special_tokens"][name].contains("ids"))
      return fail(path + ".special_tokens", "'" + name + "' has no ids");
    for (const Json& id : j["special_tokens"][name]["ids"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= static_cast<int64_t>(tokens.size()))
        return fail(path + ".special_tokens." + name + ".ids", id.dump() + " is not an id of the vocabulary (0 to " +
                                                                 std::to_string(static_cast<int64_t>(tokens.size()) - 1) + ")");
      (seen_sequence ? suffix : prefix).push_back(id.get<int32_t>());
    }
  }
  return {};
}

Status Tokenizer::Impl::load_added(const Json& j) {
  if (j.is_null()) return {};
  if (!j.is_array()) return fail("added_tokens", "expected an array");
  for (size_t i = 0; i < j.size(); ++i) {
    const Json& a = j[i];
    if (!a.contains("id") || !a.contains("content") || !a["content"].is_string() || !a["id"].is_number_integer())
      return fail("added_tokens[" + std::to_string(i) + "]", "expected an id and a content");
    if (a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() >= kMaxTokenId)
      return fail("added_tokens[" + std::to_string(i) + "].id", std::to_string(a["id"].get<int64_t>()) + " is not an id from 0 to " +
                                                                std::to_string(kMaxTokenId - 1));
    AddedToken t;
    t.content = a["content"].get<std::string>();
    t.id = a["id"].get<int32_t>();
    t.special = flag(a, "special");
    t.lstrip = flag(a, "lstrip");
    t.rstrip = flag(a, "rstrip");
    t.single_word = flag(a, "single_word");
    if (t.content.empty()) return fail("added_tokens[" + std::to_string(i) + "].content", "empty");
    if (static_cast<size_t>(t.id) >= tokens.size()) tokens.resize(static_cast<size_t>(t.id) + 1);
    tokens[static_cast<size_t>(t.id)] = t.content;
    vocab[t.content] = t.id;
    added.push_back(std::move(t));
  }
  std::stable_sort(added.begin(), added.end(), [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  for (const AddedToken& a : added) added_first_byte[static_cast<unsigned char>(a.content[0])] = true;
  added_end.assign(1, -1);
  for (size_t k = 0; k < added.size(); ++k) {
    int32_t node = 0;
    for (const char c : added[k].content) {
      const uint64_t edge = static_cast<uint64_t>(node) << 8 | static_cast<unsigned char>(c);
      auto [it, fresh] = added_edges.try_emplace(edge, static_cast<int32_t>(added_end.size()));
      if (fresh) added_end.push_back(-1);
      node = it->second;
    }
    if (added_end[static_cast<size_t>(node)] < 0) added_end[static_cast<size_t>(node)] = static_cast<int32_t>(k);
  }
  return {};
}

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Result<Tokenizer> Tokenizer::from_json(std::string_view text, const std::string& what) {
  Json j;
  MT_ASSIGN_OR_RETURN(const Limits lim, limits());
  try {
    j = Json::parse(text, json_nesting_limit<Json>(lim.nesting));
  } catch (const JsonTooDeep& e) {
    return invalid_argument(what + ": " + e.what());
  } catch (const Json::exception& e) {
    return invalid_argument(what + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) return invalid_argument(what + ": expected a JSON object (a Hugging Face tokenizer.json)");
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>();
  Impl& I = *t.impl_;
  I.what = what;
  try {
    if (!j.contains("model")) return I.fail("model", "missing");
    MT_RETURN_IF_ERROR(I.load_model(j["model"]));
    MT_RETURN_IF_ERROR(I.load_added(j.value("added_tokens", Json())));
    MT_RETURN_IF_ERROR(I.load_normalizer(j.value("normalizer", Json()), "normalizer"));
    MT_RETURN_IF_ERROR(I.load_pre_tokenizer(j.value("pre_tokenizer", Json()), "pre_tokenizer"));
    MT_RETURN_IF_ERROR(I.load_post_processor(j.value("post_processor", Json()), "post_processor"));
    MT_RETURN_IF_ERROR(I.load_decoder(j.value("decoder", Json()), "decoder"));
  } catch (const Json::exception& e) {
    return invalid_argument(what + ": a field of the wrong type: " + e.what());
  }
  if (I.pre_tokenizers.empty()) {
    bool inner = false;
    for (const auto& [token, id] : I.vocab) {
      for (size_t p = token.find(kMeta, 1); p != std::string::npos && !inner; p = token.find(kMeta, p + 1))
        inner = meta_after_other(token, p);
      if (inner) break;
    }
    I.cut_at_metaspace = !inner;
  }
  I.special.assign(I.tokens.size(), 0);
  for (const AddedToken& a : I.added) I.special[static_cast<size_t>(a.id)] = a.special;
  return t;
}

Result<Tokenizer> Tokenizer::load(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    file = path / "tokenizer.json";
    // Kimi-K2 ships its vocabulary as a tiktoken BPE file (tiktoken.model) and no tokenizer.json.
    if (!std::filesystem::exists(file, ec))
      for (const char* tiktoken : {"tiktoken.model", "tokenizer.tiktoken"})
        if (std::filesystem::exists(path / tiktoken, ec))
          return unsupported((path / tiktoken).string() +
                             ": a tiktoken vocabulary (Kimi-K2's form), which MegaTrain does not read; accepted: a Hugging Face "
                             "tokenizer.json in " + path.string() +
                             " (a fast tokenizer converted from this file, for example with transformers' "
                             "convert_slow_tokenizer.TikTokenConverter), or data already tokenized (a token file for --data)");
  }
  MT_RETURN_IF_ERROR(check_file_bytes(file, "tokenizer.json"));
  auto json_text = read_file(file);
  if (!json_text.ok()) return not_found(json_text.status().message() + "; expected a model folder with tokenizer.json, or the file itself");
  MT_ASSIGN_OR_RETURN(Tokenizer t, from_json(*json_text, file.string()));
  // A chat_template.jinja beside it (where transformers saves the template since 4.43) comes first.
  const std::filesystem::path jinja = file.parent_path() / "chat_template.jinja";
  if (std::filesystem::exists(jinja, ec)) {
    MT_RETURN_IF_ERROR(check_file_bytes(jinja, "the chat template"));
    MT_ASSIGN_OR_RETURN(t.impl_->chat_template, read_file(jinja));
  }
  const std::filesystem::path config = file.parent_path() / "tokenizer_config.json";
  MT_RETURN_IF_ERROR(check_file_bytes(config, "tokenizer_config.json"));
  if (!std::filesystem::exists(config, ec)) return t;  // no tokenizer_config.json: no BOS, EOS or padding
  auto config_text = read_file(config);  // one that is there but cannot be read (a FIFO) is an error
  if (!config_text.ok()) return config_text.status();
  Json c;
  MT_ASSIGN_OR_RETURN(const Limits lim, limits());
  try {
    c = Json::parse(*config_text, json_nesting_limit<Json>(lim.nesting));
  } catch (const JsonTooDeep& e) {
    return invalid_argument(config.string() + ": " + e.what());
  } catch (const Json::exception& e) {
    return invalid_argument(config.string() + ": not valid JSON: " + e.what());
  }
  if (!c.is_object()) return invalid_argument(config.string() + ": expected a JSON object");
  Impl& I = *t.impl_;
  auto token_of = [&](const char* key, int32_t& id) -> Status {
    if (!c.contains(key) || c[key].is_null()) return {};
    const Json& v = c[key];
    const std::string text = v.is_string() ? v.get<std::string>() : v.is_object() && v.contains("content") && v["content"].is_string()
                                                                          ? v["content"].get<std::string>()
                                                                          : std::string();
    if (text.empty()) return invalid_argument(config.string() + ": " + key + ": expected a token (a string, or {\"content\": ...})");
    const auto f = I.vocab.find(text);
    if (f == I.vocab.end()) return invalid_argument(config.string() + ": " + key + " '" + text + "' is not a token of " + file.string());
    id = f->second;
    return {};
  };
  MT_RETURN_IF_ERROR(token_of("bos_token", I.bos));
  MT_RETURN_IF_ERROR(token_of("eos_token", I.eos));
  MT_RETURN_IF_ERROR(token_of("pad_token", I.pad));
  if (c.contains("chat_template") && I.chat_template.empty()) {
    const Json& ct = c["chat_template"];
    if (ct.is_string()) {
      I.chat_template = ct.get<std::string>();
    } else if (ct.is_array()) {
      for (const Json& e : ct)
        if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
          I.chat_template = e["template"].get<std::string>();
    }
  }
  return t;
}

// ---- encoding ------------------------------------------------------------------------------------

// BPE over one word: its characters (or their byte tokens), then the lowest-ranked adjacent pair
// merged, the leftmost of equal ranks first, until no pair has a merge.
void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    if (const auto f = vocab.find(word); f != vocab.end()) {
      out.push_back(f->second);
      return;
    }
  }
  struct Sym {
    int32_t id;
    int32_t prev, next;
  };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  for (size_t i = 0; i < word.size();) {
    const size_t len = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    const std::string_view ch = word.substr(i, len);
    i += len;
    if (const auto f = vocab.find(ch); f != vocab.end()) {
      syms.push_back({f->second, 0, 0});
      continue;
    }
    bool bytes = byte_fallback;
    for (char c : ch) bytes = bytes && byte_ids[static_cast<unsigned char>(c)] >= 0;
    if (bytes) {
      for (char c : ch) syms.push_back({byte_ids[static_cast<unsigned char>(c)], 0, 0});
    } else if (unk >= 0) {
      if (!(fuse_unk && !syms.empty() && syms.back().id == unk)) syms.push_back({unk, 0, 0});
    }
  }
  const auto n = static_cast<int32_t>(syms.size());
  for (int32_t i = 0; i < n; ++i) {
    syms[static_cast<size_t>(i)].prev = i - 1;
    syms[static_cast<size_t>(i)].next = i + 1 < n ? i + 1 : -1;
  }
  auto merge_of = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
    const auto f = merges.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b));
    return f == merges.end() ? nullptr : &f->second;
  };
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  for (int32_t i = 0; i + 1 < n; ++i)
    if (const auto* m = merge_of(syms[static_cast<size_t>(i)].id, syms[static_cast<size_t>(i + 1)].id))
      heap.push({m->first, i, syms[static_cast<size_t>(i)].id, syms[static_cast<size_t>(i + 1)].id});
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& l = syms[static_cast<size_t>(c.pos)];
    if (l.id != c.left || l.next < 0 || syms[static_cast<size_t>(l.next)].id != c.right) continue;  // stale
    const auto* m = merge_of(l.id, syms[static_cast<size_t>(l.next)].id);
    Sym& r = syms[static_cast<size_t>(l.next)];
    l.id = m->second;
    r.id = -1;  // gone
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = c.pos;
    if (l.prev >= 0)
      if (const auto* pm = merge_of(syms[static_cast<size_t>(l.prev)].id, l.id))
        heap.push({pm->first, l.prev, syms[static_cast<size_t>(l.prev)].id, l.id});
    if (l.next >= 0)
      if (const auto* nm = merge_of(l.id, syms[static_cast<size_t>(l.next)].id))
        heap.push({nm->first, c.pos, l.id, syms[static_cast<size_t>(l.next)].id});
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = syms[static_cast<size_t>(i)].next) out.push_back(syms[static_cast<size_t>(i)].id);
}

// The words of one piece: spans over a text that is the piece itself, or a thread's buffer when a
// step rewrote the bytes. Each thread reuses its buffers, so encoding allocates only for new words.
struct WordSpan {
  uint32_t begin, end;
};
struct Tokenizer::Impl::Scratch {
  std::string norm, text[2], prefixed;
  std::vector<WordSpan> words, next;
  std::vector<std::pair<size_t, size_t>> matches;
};

std::string_view Tokenizer::Impl::normalized(std::string_view piece, Scratch& sc) const {
  if (normalizers.empty()) return piece;
  std::string& s = sc.norm;
  s.assign(piece);
  for (const NormalizerStep& n : normalizers) {
    switch (n.kind) {
      case NormalizerStep::kForm: s = normalize(s, n.form); break;
      case NormalizerStep::kPrepend:
        if (!s.empty()) s.insert(0, n.a);
        break;
      case NormalizerStep::kReplace:
        if (s.find(n.a) != std::string::npos) replace_all(s, n.a, n.b);
        break;
    }
  }
  return s;
}

std::string_view Tokenizer::Impl::pre_tokenized(std::string_view text, Scratch& sc) const {
  std::vector<WordSpan>& words = sc.words;
  std::vector<WordSpan>& next = sc.next;
  words.clear();
  if (!text.empty()) words.push_back({0, static_cast<uint32_t>(text.size())});
  const ByteTable& bt = byte_table();
  int out_buffer = 0;
  for (const PreTokenizerStep& s : pre_tokenizers) {
    next.clear();
    // ByteLevel writes its words' mapped bytes to a fresh buffer (not the one `text` may be in).
    std::string* out = nullptr;
    if (s.kind == PreTokenizerStep::kByteLevel) {
      if (text.data() == sc.text[out_buffer].data()) out_buffer ^= 1;
      out = &sc.text[out_buffer];
      out->clear();
    }
    auto emit = [&](std::string_view w, size_t b, size_t e) {  // bytes [b, e) of the word w as a word of the output
      if (out == nullptr) {
        const auto base = static_cast<size_t>(w.data() - text.data());
        next.push_back({static_cast<uint32_t>(base + b), static_cast<uint32_t>(base + e)});
        return;
      }
      const auto begin = static_cast<uint32_t>(out->size());
      for (size_t i = b; i < e; ++i) *out += bt.to_char[static_cast<unsigned char>(w[i])];
      next.push_back({begin, static_cast<uint32_t>(out->size())});
    };
    for (const WordSpan& span : words) {
      std::string_view w = text.substr(span.begin, span.end - span.begin);
      if (s.kind == PreTokenizerStep::kByteLevel && s.add_prefix_space && w[0] != ' ') {
        sc.prefixed.assign(1, ' ');
        sc.prefixed += w;
        w = sc.prefixed;
      }
      if (!s.regex) {
        emit(w, 0, w.size());
        continue;
      }
      (void)s.regex->find_all(w, sc.matches);  // an error counts in regex_errors(), which callers check
      const auto behavior = s.kind == PreTokenizerStep::kByteLevel ? PreTokenizerStep::kIsolated : s.behavior;
      size_t at = 0;
      size_t pending = std::string_view::npos;  // MergedWithNext: where the match waiting for its gap begins
      for (const auto& [b, e] : sc.matches) {
        switch (behavior) {
          case PreTokenizerStep::kIsolated:
            if (b > at) emit(w, at, b);
            emit(w, b, e);
            break;
          case PreTokenizerStep::kRemoved:
            if (b > at) emit(w, at, b);
            break;
          case PreTokenizerStep::kMergedWithPrevious: emit(w, at, e); break;
          case PreTokenizerStep::kMergedWithNext:
            if (pending != std::string_view::npos || b > at) emit(w, pending != std::string_view::npos ? pending : at, b);
            pending = b;
            break;
        }
        at = e;
      }
      if (behavior == PreTokenizerStep::kMergedWithNext && pending != std::string_view::npos) at = pending;
      if (w.size() > at) emit(w, at, w.size());
    }
    std::swap(words, next);
    if (out != nullptr) text = *out;
  }
  return text;
}

// Words repeat, so each thread keeps the ids of the words it has seen, for one tokenizer at a time
// (bounded: it starts again when full). An open-addressing table whose slots hold a word's hash,
// where its bytes and ids lie in two arenas, and a one-token word's id inline: a lookup touches
// one slot and the word's bytes, and filling it allocates only when an arena grows.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 64;  // longer words are rare and would crowd the cache

  // The ids of `word` (at most kMaxWordBytes), computed by `fill` on the first lookup.
  template <typename Fill>
  std::span<const int32_t> ids(uint64_t owner, std::string_view word, Fill&& fill) {
    if (owner != owner_ || (count_ >= slots_.size() / 2 && slots_.size() == kMaxSlots)) reset(owner);
    else if (count_ >= slots_.size() / 2) grow();
    const uint64_t h = hash(word) | 1;  // 0 marks an empty slot
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    for (;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.hash == 0) break;
      if (s.hash == h && s.length == word.size() && std::memcmp(bytes_.data() + s.bytes, word.data(), word.size()) == 0)
        return s.count == 1 ? std::span<const int32_t>(&s.id, 1) : std::span<const int32_t>(ids_.data() + s.id, s.count);
    }
    scratch_.clear();
    fill(word, scratch_);
    Slot& s = slots_[i];
    s.hash = h;
    s.bytes = static_cast<uint32_t>(bytes_.size());
    s.length = static_cast<uint16_t>(word.size());
    s.count = static_cast<uint16_t>(scratch_.size());  // at most one per byte
    bytes_.insert(bytes_.end(), word.begin(), word.end());
    if (scratch_.size() == 1) {
      s.id = scratch_[0];
    } else {
      s.id = static_cast<int32_t>(ids_.size());
      ids_.insert(ids_.end(), scratch_.begin(), scratch_.end());
    }
    ++count_;
    return scratch_;
  }

 private:
  static constexpr size_t kMinSlots = size_t{1} << 12, kMaxSlots = size_t{1} << 19;
  struct Slot {
    uint64_t hash = 0;
    uint32_t bytes = 0;  // offset in bytes_
    uint16_t length = 0, count = 0;
    int32_t id = 0;  // the id (count 1) or the offset of the ids in ids_
  };
  static uint64_t hash(std::string_view w) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ w.size();
    size_t i = 0;
    for (; i + 8 <= w.size(); i += 8) {
      uint64_t v;
      std::memcpy(&v, w.data() + i, 8);
      h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
    }
    uint64_t v = 0;
    std::memcpy(&v, w.data() + i, w.size() - i);
    h = (h ^ v) * 0x94D049BB133111EBull;
    return h ^ (h >> 29);
  }
  void reset(uint64_t owner) {
    slots_.assign(kMinSlots, Slot{});
    bytes_.clear();
    ids_.clear();
    count_ = 0;
    owner_ = owner;
  }
  void grow() {  // twice the slots, the words placed again by the hashes they keep
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    const size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.hash == 0) continue;
      size_t i = s.hash & mask;
      while (slots_[i].hash != 0) i = (i + 1) & mask;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  std::vector<char> bytes_;
  std::vector<int32_t> ids_;
  std::vector<int32_t> scratch_;
  size_t count_ = 0;
  uint64_t owner_ = 0;  // Impl::serial: never reused, unlike an address
};

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  thread_local WordCache cache;
  thread_local Scratch sc;
  const std::string_view text = pre_tokenized(normalized(piece, sc), sc);
  auto encode_word = [&](std::string_view w) {
    if (w.size() > WordCache::kMaxWordBytes) {
      bpe(w, out);
      return;
    }
    const auto ids = cache.ids(serial, w, [this](std::string_view word, std::vector<int32_t>& to) { bpe(word, to); });
    out.insert(out.end(), ids.begin(), ids.end());
  };
  for (const WordSpan& span : sc.words) {
    const std::string_view w = text.substr(span.begin, span.end - span.begin);
    if (!cut_at_metaspace) {
      encode_word(w);
      continue;
    }
    size_t begin = 0;
    for (size_t p = w.find(kMeta, 1); p != std::string_view::npos; p = w.find(kMeta, p + 1))
      if (meta_after_other(w, p)) {
        encode_word(w.substr(begin, p - begin));
        begin = p;
      }
    encode_word(w.substr(begin));
  }
}

namespace {
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_word_char(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }
}  // namespace

// One stretch of the text and the ids it became: a plain piece (normalized, pre-tokenized, BPE) or
// an added token (with the whitespace its lstrip and rstrip took).
struct Tokenizer::Region {
  size_t begin = 0, end = 0;     // bytes of the text
  size_t first = 0, last = 0;    // ids [first, last)
  bool piece = false;
};

std::vector<int32_t> Tokenizer::encode_regions(std::string_view text, std::vector<Region>* regions) const {
  const Impl& I = *impl_;
  std::vector<int32_t> out;
  auto plain = [&](size_t begin, size_t end) {
    const size_t first = out.size();
    I.encode_piece(text.substr(begin, end - begin), out);
    if (regions != nullptr && end > begin) regions->push_back(Region{begin, end, first, out.size(), true});
  };
  // Added tokens first: at each position the longest one that matches (the list is longest first).
  size_t piece = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    if (!I.added_first_byte[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    // The contents that match here, from the trie (shortest first); the longest that may stand here
    // wins, as a scan of the longest-first list would find it.
    int32_t ends[64];
    size_t n_ends = 0;
    std::vector<int32_t> more;  // beyond 64 matching contents at one position
    for (size_t k = i, node = 0; k < text.size(); ++k) {
      const auto e = I.added_edges.find(static_cast<uint64_t>(node) << 8 | static_cast<unsigned char>(text[k]));
      if (e == I.added_edges.end()) break;
      node = static_cast<size_t>(e->second);
      if (const int32_t a = I.added_end[node]; a >= 0) {
        if (n_ends < 64) ends[n_ends++] = a;
        else more.push_back(a);
      }
    }
    for (size_t m = more.size() + n_ends; m-- > 0;) {
      const AddedToken& a = I.added[static_cast<size_t>(m >= n_ends ? more[m - n_ends] : ends[m])];
      if (a.single_word && ((i > 0 && is_word_char(static_cast<unsigned char>(text[i - 1]))) ||
                            (i + a.content.size() < text.size() && is_word_char(static_cast<unsigned char>(text[i + a.content.size()])))))
        continue;
      hit = &a;
      break;
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size();
    if (hit->lstrip)
      while (begin > piece && is_space(text[begin - 1])) --begin;
    if (hit->rstrip)
      while (end < text.size() && is_space(text[end])) ++end;
    plain(piece, begin);
    if (regions != nullptr) regions->push_back(Region{begin, end, out.size(), out.size() + 1, false});
    out.push_back(hit->id);
    piece = i = end;
  }
  plain(piece, text.size());
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view raw, bool add_special_tokens) const {
  std::vector<int32_t> ids = valid_utf8_prefix(raw) == raw.size() ? encode_regions(raw, nullptr) : encode_regions(valid_utf8(raw), nullptr);
  if (!add_special_tokens) return ids;
  std::vector<int32_t> out = impl_->prefix;
  out.insert(out.end(), ids.begin(), ids.end());
  out.insert(out.end(), impl_->suffix.begin(), impl_->suffix.end());
  return out;
}

namespace {
// An error when the pre-tokenizer's regex failed on this thread since regex_errors() was `before`.
Status regex_failures_since(int64_t before) {
  if (regex_errors() == before) return {};
  return invalid_argument("the pre-tokenizer's regex could not be matched over this text (" + last_regex_error() +
                          "), so it cannot be tokenized as the reference would");
}
}  // namespace

Result<std::vector<int32_t>> Tokenizer::encode_checked(std::string_view text, bool add_special_tokens) const {
  const int64_t regex_errors_before = regex_errors();
  std::vector<int32_t> ids = encode(text, add_special_tokens);
  MT_RETURN_IF_ERROR(regex_failures_since(regex_errors_before));
  return ids;
}

Result<std::vector<int32_t>> Tokenizer::encode_with_cuts(std::string_view text, const std::vector<size_t>& cuts,
                                                         std::vector<size_t>& token_at) const {
  if (valid_utf8_prefix(text) != text.size()) return invalid_argument("encode_with_cuts: the text is not valid UTF-8, so its byte offsets would move");
  std::vector<Region> regions;
  const int64_t regex_errors_before = regex_errors();
  std::vector<int32_t> ids = encode_regions(text, &regions);
  MT_RETURN_IF_ERROR(regex_failures_since(regex_errors_before));
  token_at.clear();
  std::vector<int32_t> head;
  auto r = regions.begin();
  for (size_t k = 0; k < cuts.size(); ++k) {
    const size_t c = cuts[k];
    if (c > text.size()) return invalid_argument("encode_with_cuts: a cut at byte " + std::to_string(c) + " of a text of " +
                                                  std::to_string(text.size()) + " bytes");
    if (k > 0 && c < cuts[k - 1]) return invalid_argument("encode_with_cuts: the cuts must be in order");
    // The first region that ends after the cut (cuts come in order, so the walk goes on from the
    // last one); none: the cut is at the end.
    while (r != regions.end() && r->end <= c) ++r;
    if (r == regions.end()) {
      token_at.push_back(ids.size());
      continue;
    }
    if (c <= r->begin || !r->piece) {  // before the region, or inside an added token's stretch
      token_at.push_back(r->first);
      continue;
    }
    // Inside a piece: the ids of the piece's head, compared with the piece's ids. BPE within one
    // pre-tokenized word may merge across the cut: such a token goes to the side after the cut.
    head.clear();
    impl_->encode_piece(text.substr(r->begin, c - r->begin), head);
    size_t same = 0;
    while (same < head.size() && r->first + same < r->last && ids[r->first + same] == head[same]) ++same;
    // The head of a word may merge differently from the whole word (and agree with it less than a
    // shorter head did): ids that lay before an earlier cut still lie before this one.
    token_at.push_back(std::max(r->first + same, token_at.empty() ? size_t{0} : token_at.back()));
  }
  return ids;
}

int64_t Tokenizer::special_token_at(std::string_view text, size_t pos) const {
  for (const AddedToken& a : impl_->added)
    if (a.special && text.size() >= pos + a.content.size() && text.compare(pos, a.content.size(), a.content) == 0)
      return static_cast<int64_t>(a.content.size());
  return 0;
}

// ---- decoding ------------------------------------------------------------------------------------

Result<std::string> Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const Impl& I = *impl_;
  std::vector<std::string> toks;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= I.tokens.size() || I.tokens[static_cast<size_t>(id)].empty())
      return invalid_argument("decode: id " + std::to_string(id) + " is not in the vocabulary of " + I.what + " (" +
                              std::to_string(I.tokens.size()) + " ids)");
    if (skip_special_tokens && I.special[static_cast<size_t>(id)]) continue;
    toks.push_back(I.tokens[static_cast<size_t>(id)]);
  }
  if (I.decoders.empty()) {
    std::string s;
    for (size_t k = 0; k < toks.size(); ++k) s += (k ? " " : "") + toks[k];
    return s;
  }
  const ByteTable& bt = byte_table();
  for (const DecoderStep& d : I.decoders) {
    switch (d.kind) {
      case DecoderStep::kByteLevel: {
        std::string bytes;
        for (const std::string& t : toks)
          for (size_t i = 0; i < t.size();) {
            const size_t len = utf8_length(static_cast<unsigned char>(t[i]));
            const auto f = bt.to_byte.find(t.substr(i, len));
            if (f != bt.to_byte.end()) bytes.push_back(static_cast<char>(f->second));
            else bytes.append(t, i, len);
            i += len;
          }
        toks = {valid_utf8(bytes)};
        break;
      }
      case DecoderStep::kReplace:
        for (std::string& t : toks) replace_all(t, d.a, d.b);
        break;
      case DecoderStep::kByteFallback: {
        std::vector<std::string> next;
        std::string run;  // consecutive byte tokens
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (valid_utf8(run) == run) next.push_back(run);
          else
            for (size_t k = 0; k < run_tokens; ++k) next.push_back("\xEF\xBF\xBD");
          run.clear();
          run_tokens = 0;
        };
        for (const std::string& t : toks) {
          unsigned v = 0;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::sscanf(t.c_str() + 3, "%2X", &v) == 1) {
            run.push_back(static_cast<char>(v));
            ++run_tokens;
          } else {
            flush();
            next.push_back(t);
          }
        }
        flush();
        toks = std::move(next);
        break;
      }
      case DecoderStep::kFuse: {
        std::string s;
        for (const std::string& t : toks) s += t;
        toks = {s};
        break;
      }
      case DecoderStep::kStrip:
        for (std::string& t : toks) {
          for (int64_t k = 0; k < d.start && !t.empty() && t.compare(0, d.a.size(), d.a) == 0; ++k) t.erase(0, d.a.size());
          for (int64_t k = 0; k < d.stop && !t.empty() && t.size() >= d.a.size() && t.compare(t.size() - d.a.size(), d.a.size(), d.a) == 0; ++k)
            t.erase(t.size() - d.a.size());
        }
        break;
    }
  }
  std::string s;
  for (const std::string& t : toks) s += t;
  return s;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->tokens.size()); }
int32_t Tokenizer::token_to_id(std::string_view token) const {
  const auto f = impl_->vocab.find(token);
  return f == impl_->vocab.end() ? -1 : f->second;
}
std::string Tokenizer::id_to_token(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->tokens.size() ? impl_->tokens[static_cast<size_t>(id)] : std::string();
}
const std::vector<int32_t>& Tokenizer::special_prefix() const { return impl_->prefix; }
int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }
const std::string& Tokenizer::source() const { return impl_->what; }
bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[static_cast<size_t>(id)];
}

}  // namespace megatrain::data

// Tokenizers read from a model folder's Hugging Face tokenizer.json (issue 19), encoding to the same
// ids as Hugging Face's tokenizers library.
//
// Supported, by tokenizer.json section (anything else is refused by name, with its JSON path):
//   model           BPE: vocab, merges ("a b" strings or [a, b] pairs), ignore_merges,
//                   byte_fallback, unk_token, fuse_unk, continuing_subword_prefix
//   normalizer      null, NFC, NFD, NFKC, NFKD (utf8proc), Prepend, Replace (a literal), Sequence
//   pre_tokenizer   null, Split (a regex or a literal; Isolated, Removed, MergedWithPrevious,
//                   MergedWithNext; not inverted), ByteLevel, Sequence. Regexes run on PCRE2 with
//                   Unicode properties (UTF and UCP), as Hugging Face's Oniguruma does.
//   post_processor  null, ByteLevel, TemplateProcessing (the single-sequence template), Sequence
//   decoder         null, ByteLevel, Replace (a literal), ByteFallback, Fuse, Strip, Sequence
//   added_tokens    split out of the text before anything else (leftmost, then longest), with
//                   their lstrip, rstrip and single_word flags
// The pipeline per encode: the text is made valid UTF-8 (each maximal invalid subpart becomes
// U+FFFD, as a JavaScript or Rust lossy decode does); added tokens are split out; each remaining
// piece is normalized, pre-tokenized into words, and each word is run through BPE (the lowest
// merge rank first, the leftmost of equal ranks first); with add_special_tokens the
// post-processor's template wraps the ids.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::data {

class Tokenizer {
 public:
  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // A model folder holding tokenizer.json, or the path of a tokenizer.json. A tokenizer_config.json
  // beside it gives the BOS, EOS and padding tokens and the chat template.
  static Result<Tokenizer> load(const std::filesystem::path& path);
  // `what` names the source in error messages.
  static Result<Tokenizer> from_json(std::string_view json_text, const std::string& what = "tokenizer.json");

  // The ids of `text` (any bytes). add_special_tokens: wrap them in the post-processor's template
  // (a BOS token, for example), as tokenizers' encode(text, add_special_tokens=True) does.
  // A text the pre-tokenizer's regex cannot finish (PCRE2's match or depth limit) leaves the rest
  // of its span one piece here; encode_checked says so instead (issue 49).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // encode, or an error when the pre-tokenizer's regex failed on the text (naming PCRE2's reason).
  Result<std::vector<int32_t>> encode_checked(std::string_view text, bool add_special_tokens = false) const;
  // encode(text) without special tokens, and for each byte offset in `cuts` (in order) the index of
  // the first id at or after it: the ids [0, token_at[k]) cover text[0, cuts[k]). A token that spans
  // a cut (BPE merged across it inside one word) counts as after the cut. `text` must be valid UTF-8.
  Result<std::vector<int32_t>> encode_with_cuts(std::string_view text, const std::vector<size_t>& cuts,
                                                std::vector<size_t>& token_at) const;
  // The length in bytes of the special added token that starts at text[pos], or 0.
  int64_t special_token_at(std::string_view text, size_t pos) const;
  // The text of `ids` through the decoder; skip_special_tokens leaves out the special added tokens.
  // Unknown ids are refused.
  Result<std::string> decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // Ids span [0, vocab_size()): the model's vocabulary and the added tokens.
  int64_t vocab_size() const;
  // The id of a token's text (a vocabulary entry or an added token); -1 when there is none.
  int32_t token_to_id(std::string_view token) const;
  // The text of an id; empty for an id out of range.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // The ids the post-processor's template puts before a sequence (a BOS token, say).
  const std::vector<int32_t>& special_prefix() const;
  // From tokenizer_config.json (bos_token, eos_token, pad_token); -1 when it names none.
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  // The chat template: chat_template.jinja beside tokenizer.json, else tokenizer_config.json's
  // chat_template (the "default" one of a list); empty when there is none.
  const std::string& chat_template() const;
  // Where the tokenizer was read from.
  const std::string& source() const;

 private:
  struct Impl;
  struct Region;
  std::vector<int32_t> encode_regions(std::string_view text, std::vector<Region>* regions) const;
  std::unique_ptr<Impl> impl_;
};

// `text` as valid UTF-8: each maximal subpart of an ill-formed sequence becomes U+FFFD (the
// Unicode standard's recommended practice, which WHATWG's and Rust's lossy decoders follow).
std::string valid_utf8(std::string_view text);
// The length of the longest prefix of `text` that is valid UTF-8 (text.size() when all of it is).
size_t valid_utf8_prefix(std::string_view text);

}  // namespace megatrain::data

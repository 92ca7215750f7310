// Conversations (issue 19): the messages of a chat dataset rendered through the model's chat
// template, as transformers' apply_chat_template(messages, tokenize=False) renders them for
// training (no generation prompt), and the bytes of the rendering that are the assistant's turns.
//
// An assistant turn (message i) is found without knowing the template:
//   start  the length of the conversation before it rendered with the generation prompt
//          (messages[:i], add_generation_prompt=true), which must be a prefix of the whole
//          rendering: the turn is what the model writes after that prompt (Qwen3's empty
//          <think></think>, gpt-oss's channels, the content). A template that renders earlier
//          turns by what follows them (Mistral-Nemo puts the system prompt into the last user
//          turn) fails that; then the turn starts the template's turn header (learned from a
//          probe: what follows the generation prompt before the content) before its content,
//          found with a marker U+E002 n U+E001 before it, when that header is there (a template
//          that also trims the content's start gets no such fallback);
//   end    the first end-of-turn token after the message's content: the content's place in the
//          rendering is found by rendering it again with a marker (U+E000 n U+E001) after each
//          message's content (before its trailing whitespace, so that trim and strip work as
//          before), and the end-of-turn tokens are learned once per template from probe
//          conversations: the special tokens that follow an assistant's content (<|eot_id|>,
//          <|im_end|>, </s>, <|end|>, <|return|>, ...). The end token is part of the turn. A turn
//          with no such token (gpt-oss's tool call ends with <|call|>) ends where the
//          conversation up to it, rendered alone, ends, when that is a prefix of the whole.
// When a template breaks these rules (the prefix differs, a content is rewritten, no end token
// follows), the conversation is refused by name: train it with train_on all, or fix the template.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/status.h"
#include "megatrain/data/chat_template.h"
#include "megatrain/data/tokenizer.h"

namespace megatrain::data {

struct RenderedConversation {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant;  // byte ranges [begin, end) of the assistant turns, in order
};

class ConversationRenderer {
 public:
  // The tokenizer's chat template, or `template_source` when it is not empty. The context holds
  // bos_token, eos_token, pad_token and unk_token as tokenizer_config.json names them.
  static Result<ConversationRenderer> create(const Tokenizer& tok, const std::string& template_source = "");

  // `messages` ([{"role", "content", ...}]) go to the template as they are, with `tools` when it
  // is not null. With `spans`, the assistant turns are found too.
  Result<RenderedConversation> render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools, bool spans) const;

  // The end-of-turn tokens learned from the template.
  const std::vector<std::string>& end_tokens() const { return ends_; }

 private:
  Result<std::string> render_text(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools, bool generation) const;
  // Where each message's content starts in `text` (npos where it cannot be traced), rendered once.
  Result<std::vector<size_t>> content_starts(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                             const std::string& text, std::optional<std::vector<size_t>>& cache) const;
  // Where the known turn header stands before message i's content in `text` (`starts`: from
  // content_starts), or npos when the header is unknown or not there.
  size_t header_start(const nlohmann::ordered_json& messages, size_t i, const std::string& text, const std::vector<size_t>& starts) const;
  // Where assistant message i's turn starts in `text` (`at`: where each content ends), from the
  // conversation before it rendered with the generation prompt; `which` names it in errors.
  Result<size_t> turn_start_by_prompt(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools, const std::string& text,
                                      const std::vector<size_t>& at, size_t i, const std::string& which,
                                      std::optional<std::vector<size_t>>& starts_cache) const;
  ChatTemplate template_;
  std::string header_;
  bool header_known_ = false;
  nlohmann::ordered_json context_;
  std::vector<std::string> ends_;
};

}  // namespace megatrain::data

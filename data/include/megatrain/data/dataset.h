// Datasets in (issue 19): documents read from JSON Lines, JSON or plain text files, tokenized in
// parallel, and laid into training rows with a mask of the counted targets (sequence_file.h).
//
// Formats (format "auto" decides from the extension and the first record's fields):
//   text     {"text": ...}                                   every token counts
//   alpaca   {"instruction": ..., "input": ..., "output": ...} the prompt is the instruction, then
//            the input after a blank line when there is one, then a blank line; the answer is the
//            output. With train_on "assistant" (alpaca's default) only the answer's tokens and the EOS
//            after it count.
//   messages {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}  (OpenAI style)
//   sharegpt {"conversations": [{"from": ..., "value": ...}, ...]}; from human/user -> user,
//            gpt/assistant/model/bot -> assistant, system -> system, observation/tool/function ->
//            tool, function_call -> assistant
//            Both are rendered through the model's chat template (conversation.h) and tokenized
//            whole, as transformers' apply_chat_template(tokenize=True) does (no BOS added: the
//            template writes it). With train_on "assistant" (their default) only the assistant
//            turns count, each with its end-of-turn token.
//   plain    a text file is one document
// Field names can be mapped (FieldNames). Each text or alpaca document is the post-processor's
// prefix (BOS), the prompt, the answer, and EOS; a conversation is its rendering as it is (the
// template's turn tokens and BOS separate conversations; no EOS is added). Packing lays the
// documents end to end and cuts rows of seq_len + 1 tokens (the last row padded); padding gives
// each document its own row, padded, and a longer document is cut (truncated) or, with
// split_long, continued on further rows. Padding never counts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <nlohmann/json.hpp>
#include <vector>

#include "megatrain/core/status.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/data/tokenizer.h"

namespace megatrain::data {

struct FieldNames {
  std::string text = "text", instruction = "instruction", input = "input", output = "output";
  // Empty: the format's own (messages/role/content, conversations/from/value).
  std::string messages, role, content;
};

struct Document {
  std::string prompt;  // not counted with train_on "assistant"
  std::string answer;
  // A conversation: messages ([{"role", "content", ...}], sharegpt's already mapped), tools (null
  // when none) and where it was read (for errors).
  nlohmann::ordered_json messages, tools;
  std::string where;
  bool chat() const { return messages.is_array(); }
};

// The documents of one file. format: auto | text | alpaca | messages | sharegpt | plain (the
// format found is written back). Errors name the file, the line (JSON Lines) or record (JSON), and
// the field; with several bad lines, the first. JSON Lines are parsed on `threads` threads (0: every
// core).
Result<std::vector<Document>> read_documents(const std::filesystem::path& path, std::string& format, const FieldNames& fields,
                                             int threads = 0);

struct PrepareOptions {
  int64_t seq_len = 0;
  bool pack = true;
  // With pack: each document attends only to itself ("neat": its first token marked
  // kMaskDocStart; the default); false: plain packing, documents attending to the ones before them
  // in the row.
  bool neat = true;
  bool split_long = false;    // padding: a document longer than a row continues on further rows
  std::string train_on;       // all | assistant ("answer" is the same); empty: assistant for alpaca and chat, all otherwise
  std::string chat_template;  // a template's source to use instead of the tokenizer's
  int threads = 0;            // 0: every core
  std::string cache_key;      // written into the header (SequenceHeader::cache_key); "" : none
  std::function<void(int64_t done, int64_t total)> progress;  // documents tokenized so far
};

// Tokenizes `docs` and lays them into rows; fills the header's counts (not its sources).
Result<SequenceRows> build_rows(const Tokenizer& tok, const std::vector<Document>& docs, const std::string& format,
                                const PrepareOptions& options, SequenceHeader& header);

// The whole of `megatrain-data prepare`: every input read (one format for all of them), the rows
// built, and `out` written atomically. Returns the header written, the format found and the bytes of
// text read.
struct PrepareResult {
  SequenceHeader header;
  std::string format;
  int64_t text_bytes = 0;
};
Result<PrepareResult> prepare_dataset(const Tokenizer& tok, const std::vector<std::string>& inputs, const std::string& format,
                                      const FieldNames& fields, const PrepareOptions& options, const std::filesystem::path& out);

}  // namespace megatrain::data

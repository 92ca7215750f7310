// Datasets in (issue 19): documents read from JSON Lines, JSON or plain text files, tokenized in
// parallel, and laid into training rows with a mask of the counted targets (sequence_file.h).
//
// Formats (format "auto" decides from the extension and the first record's fields):
//   text     {"text": ...}                                   every token counts
//   alpaca   {"instruction": ..., "input": ..., "output": ...} the prompt is the instruction, then
//            the input after a blank line when there is one, then a blank line; the answer is the
//            output. With train_on "answer" (alpaca's default) only the answer's tokens and the EOS
//            after it count.
//   plain    a text file is one document
// Field names can be mapped (FieldNames). Each document is the post-processor's prefix (BOS), the
// prompt, the answer, and EOS. Packing lays the documents end to end and cuts rows of seq_len + 1
// tokens (the last row padded); padding gives each document its own row, padded, and a longer
// document is cut (truncated) or, with split_long, continued on further rows. Padding never counts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "megatrain/core/status.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/data/tokenizer.h"

namespace megatrain::data {

struct FieldNames {
  std::string text = "text", instruction = "instruction", input = "input", output = "output";
};

struct Document {
  std::string prompt;  // not counted with train_on "answer"
  std::string answer;
};

// The documents of one file. format: auto | text | alpaca | plain (the format found is written
// back). Errors name the file, the line (JSON Lines) or record (JSON), and the field.
Result<std::vector<Document>> read_documents(const std::filesystem::path& path, std::string& format, const FieldNames& fields);

struct PrepareOptions {
  int64_t seq_len = 0;
  bool pack = true;
  bool split_long = false;    // padding: a document longer than a row continues on further rows
  std::string train_on;       // all | answer; empty: answer for alpaca, all otherwise
  int threads = 0;            // 0: every core
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

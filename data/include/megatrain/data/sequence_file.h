// A prepared dataset (issue 19): training rows of seq_len + 1 tokens, each with a mask of the
// positions whose token counts as a target, written by `megatrain-data prepare` and read by
// megatrain-exec's loader. Row k gives inputs tok[k][0, T) and targets tok[k][1, T] where the mask
// is set, -1 (not counted) elsewhere.
//
// The file (docs/data.md):
//   bytes 0-7      "MTSEQ001"
//   bytes 8-15     the header's length in bytes, uint64 little-endian
//   bytes 16-      the header: one JSON object (SequenceHeader), then zeros up to byte 4096
//   4096-          tokens: rows x (seq_len + 1) uint32 little-endian
//   then           mask:   rows x (seq_len + 1) uint8: bit 0 (kMaskCounted) where the token is a
//                  counted target; bit 1 (kMaskDocStart), in files packed "neat", where a document
//                  begins (each document then attends only to itself: fill_row's starts)
// The header's xxh64 covers the tokens and the mask, and its sizes fix the file's length: a file
// cut short, grown or changed is refused by name. The writer publishes it atomically (a temporary
// beside it, fsync, rename), so a partial write never looks complete.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/core/file_identity.h"
#include "megatrain/core/status.h"

namespace megatrain::data {

inline constexpr char kSequenceMagic[8] = {'M', 'T', 'S', 'E', 'Q', '0', '0', '1'};
inline constexpr int64_t kSequenceDataOffset = 4096;
inline constexpr uint8_t kMaskCounted = 1;   // the token is a counted target
inline constexpr uint8_t kMaskDocStart = 2;  // a document begins at the token ("neat" packing)

struct SequenceHeader {
  int64_t rows = 0;
  int64_t seq_len = 0;     // T: a row holds T + 1 tokens
  int64_t vocab_size = 0;  // the tokenizer's: every token is below it
  int32_t eos_id = -1, pad_id = -1;
  // neat: documents end to end, each attending only to itself (the mask's kMaskDocStart bits);
  // pack: end to end, each attending to the ones before it in its row (plain packing; what files
  // written before 2026-12-07 hold); pad: one document per row.
  std::string packing = "pack";
  std::string train_on = "all";   // all | answer
  int64_t documents = 0;          // documents read
  int64_t truncated = 0;          // documents cut at the row length (pad) ...
  int64_t split = 0;              // ... or split over several rows (pad with split)
  int64_t tokens = 0;             // real tokens in the rows (no padding)
  int64_t counted = 0;            // counted targets
  // Packing "neat": the length-weighted mean length of the documents as the rows' inputs hold them
  // (a document cut by a row's end counts as two pieces), sum(length^2) / (rows x seq_len): the
  // keys per query the attention costs as if unmasked (a plan's training.document_tokens). 0
  // otherwise. Written for reading; open() computes it from the mask.
  double document_tokens = 0;
  std::string tokenizer;          // where the tokenizer came from
  std::vector<std::string> sources;
  // A file prepared on the fly into megatrain-exec's cache: the key its name carries (16 hex
  // digits, the XXH64 of its inputs' contents and options), checked when the file is reused so
  // that a file put there under that name is not trained on. Optional in the header ("" : absent).
  std::string cache_key;
  uint64_t xxh64 = 0;             // of the tokens, then the mask
};

// Rows to write: tokens and mask, rows x (seq_len + 1) each.
struct SequenceRows {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
};

// SequenceHeader::document_tokens of `rows` rows of seq_len + 1 mask bytes packed "neat".
double neat_document_tokens(const uint8_t* mask, int64_t rows, int64_t seq_len);

// Writes `rows` with `header` to `path`, atomically, filling in the header's rows, xxh64 and
// document_tokens (so the caller holds the header as written).
Status write_sequence_file(const std::filesystem::path& path, SequenceHeader& header, const SequenceRows& rows);

// A prepared dataset, memory-mapped read-only. open() checks the magic, the header, the length and
// the checksum; errors name the file and what was expected.
class SequenceFile {
 public:
  static Result<SequenceFile> open(const std::filesystem::path& path);
  // Whether `path` starts with the magic (a cheap test for the loader's format detection).
  static bool is_sequence_file(const std::filesystem::path& path);
  SequenceFile(SequenceFile&&) noexcept;
  SequenceFile& operator=(SequenceFile&&) noexcept;
  SequenceFile(const SequenceFile&) = delete;
  SequenceFile& operator=(const SequenceFile&) = delete;
  ~SequenceFile();

  const SequenceHeader& header() const { return header_; }
  const std::string& name() const { return name_; }
  // OK while the file on disk is the one opened (same size and modification time).
  Status check_unchanged() const;
  int64_t rows() const { return header_.rows; }
  int64_t seq_len() const { return header_.seq_len; }
  const uint32_t* row_tokens(int64_t row) const { return tokens_ + row * (header_.seq_len + 1); }
  const uint8_t* row_mask(int64_t row) const { return mask_ + row * (header_.seq_len + 1); }
  // inputs[t] = token t, targets[t] = token t + 1 where counted, else -1; t < seq_len. With
  // `starts` (seq_len int32): the first position of token t's document in the row, for a "neat"
  // file; 0 everywhere otherwise (the row is one context).
  void fill_row(int64_t row, int32_t* inputs, int32_t* targets, int32_t* starts = nullptr) const;
  // The rows' documents attend only to themselves (packing "neat").
  bool document_masked() const { return header_.packing == "neat"; }
  // Packing "neat": the documents' length-weighted mean length (SequenceHeader::document_tokens,
  // computed from the mask when the file is opened). 0 otherwise.
  double document_tokens() const { return header_.document_tokens; }

 private:
  SequenceFile() = default;
  std::string name_;
  SequenceHeader header_;
  const uint32_t* tokens_ = nullptr;
  const uint8_t* mask_ = nullptr;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  FileIdentity identity_;
};

}  // namespace megatrain::data

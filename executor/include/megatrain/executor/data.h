// Token data for training: token files (llm.c, raw uint16/uint32, text as bytes) and the loader
// that turns (step, micro-batch) into input/target rows. Formats and rules: docs/data-and-checkpoints.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/core/file_identity.h"
#include "megatrain/core/status.h"
#include "megatrain/data/sequence_file.h"

namespace megatrain::exec {

// How the bytes of a token file are read. kAuto decides from the extension and the first bytes.
enum class TokenFormat {
  kAuto,
  kLlmc,    // 256 x int32 header; magic 20240520 v1 (uint16 tokens) or 20240801 v7 (uint32 tokens)
  kRawU16,  // little-endian uint16 tokens, nothing else
  kRawU32,  // little-endian uint32 tokens, nothing else
  kText,    // every byte is a token (vocab 256)
};

const char* token_format_name(TokenFormat f);  // "auto" | "llmc" | "u16" | "u32" | "text"
Result<TokenFormat> parse_token_format(const std::string& s);

inline constexpr int32_t kLlmcMagicU16 = 20240520;  // llm.c GPT-2 files, version 1
inline constexpr int32_t kLlmcMagicU32 = 20240801;  // llm.c Llama-3 files, version 7
inline constexpr int64_t kLlmcHeaderInts = 256;

// A read-only, memory-mapped token file (or an in-memory token list). Move-only; the mapping is
// released on destruction. All const members are safe to call from several threads at once.
class TokenFile {
 public:
  // Opens and validates `path`: the llm.c magic/version, header token count against the file size,
  // a raw file whose size is not a whole number of tokens. Errors name the file and what was expected.
  static Result<TokenFile> open(const std::filesystem::path& path, TokenFormat format = TokenFormat::kAuto);
  // Tokens held in memory (tests, generated data); `name` stands in for the path in messages.
  static TokenFile from_tokens(std::vector<uint32_t> tokens, std::string name = "<memory>");

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  int64_t size() const { return count_; }      // number of tokens
  TokenFormat format() const { return format_; }  // the resolved format, never kAuto
  const std::string& name() const { return name_; }  // the path as given, for messages
  // The largest vocabulary the format can express: 256 (text), 65536 (u16), 2^32 (u32).
  int64_t format_vocab_limit() const;

  uint32_t token(int64_t i) const;  // 0 <= i < size(); checked (MT_CHECK), a caller bug otherwise
  // The tokens as the file stores them: size() * token_width() bytes (little-endian).
  const uint8_t* token_bytes() const { return tokens_; }
  int token_width() const { return width_; }
  // Copies tokens [begin, begin+count) to `out` as int32, failing with kInvalidArgument (naming
  // the file, the position, the value and `vocab_size`) on the first token >= vocab_size.
  // vocab_size 0 means "no model limit"; tokens above INT32_MAX are refused either way.
  Status copy_tokens(int64_t begin, int64_t count, int64_t vocab_size, int32_t* out) const;
  // One pass over the whole file, the same check as copy_tokens. Optional: the loader checks
  // every batch it builds; this lets a run refuse bad data before its first step.
  Status check_vocab(int64_t vocab_size) const;
  // OK while the file on disk is the one opened (same size and modification time); a file that was
  // truncated or rewritten since is reported by name (it is mapped: reading it could crash).
  Status check_unchanged() const;

 private:
  TokenFile() = default;
  void release();

  std::string name_;
  TokenFormat format_ = TokenFormat::kText;
  int64_t count_ = 0;
  int width_ = 1;                  // bytes per token
  const uint8_t* tokens_ = nullptr;  // first token byte (inside the mapping or memory_)
  void* map_ = nullptr;            // mmap base, or null
  size_t map_bytes_ = 0;
  std::vector<uint32_t> memory_;   // from_tokens storage
  FileIdentity identity_;          // the file's size and time when opened (bytes -1: memory)
};

using DataOrder = ::megatrain::DataOrder;  // the plan's training.data_order (core/plan.h)
const char* data_order_name(DataOrder o);  // "sequential" | "shuffled"
Result<DataOrder> parse_data_order(const std::string& s);

struct DataLoaderOptions {
  int64_t seq_len = 0;      // T
  int64_t micro_batch = 1;  // B: rows per micro-batch
  int64_t grad_accum = 1;   // micro-batches per step
  DataOrder order = DataOrder::kSequential;
  uint64_t seed = 1;        // shuffled only
  int64_t vocab_size = 0;   // every batch's tokens must be < vocab_size; 0 = no check beyond INT32_MAX
  // Data parallelism: this process is rank `rank` of `ranks`, and reads every ranks-th row of the
  // one-process order with grad_accum x ranks micro-batches per step, starting at row `rank`
  // (docs/data-parallel.md). 1 and 0: the one-process order.
  int64_t ranks = 1;
  int64_t rank = 0;
};

// Where one row of a batch came from.
struct RowSource {
  int64_t global_row = 0;  // r = ((step * grad_accum + j) * micro_batch + b) * ranks + rank
  int64_t epoch = 0;       // r / rows_per_epoch
  int64_t file_row = 0;    // row k of the file: inputs [k*T, k*T+T), targets [k*T+1, k*T+T+1)
};

struct Batch {
  int64_t step = 0, micro = 0;
  int64_t micro_batch = 0, seq_len = 0;
  std::vector<int32_t> inputs;   // [micro_batch, seq_len] row-major
  std::vector<int32_t> targets;  // [micro_batch, seq_len] row-major, inputs shifted by one token
  std::vector<RowSource> rows;   // one per row b
};

// Turns (step, j) into micro-batch j of step `step`. It has no cursor: every batch is a pure
// function of (step, j, options, file), so a resumed run sees exactly the batches an uninterrupted
// run would, whatever was drawn before. Row numbering, wrap-around and shuffling are defined in
// docs/data-and-checkpoints.md. Thread-safe: batch()/fill() may run concurrently (the shuffled
// order caches the permutations of the last two epochs behind a mutex).
class DataLoader {
 public:
  // Fails (kInvalidArgument) when the file holds fewer than seq_len + 1 tokens, saying how many are
  // needed, or when a size is not positive.
  static Result<DataLoader> create(std::shared_ptr<const TokenFile> tokens, const DataLoaderOptions& options);
  static Result<DataLoader> create(std::shared_ptr<const TokenFile> tokens, int64_t seq_len, int64_t micro_batch,
                                   int64_t grad_accum, DataOrder order, uint64_t seed, int64_t vocab_size = 0);
  // A prepared dataset (megatrain-data prepare, data/sequence_file.h): its rows are the file's rows,
  // each with its own T + 1 tokens, and a target that does not count is -1 (the loss leaves it
  // out). Refused when its seq_len is not options.seq_len or its vocabulary is larger than
  // options.vocab_size, naming both numbers.
  static Result<DataLoader> create(std::shared_ptr<const data::SequenceFile> rows, const DataLoaderOptions& options);

  DataLoader(DataLoader&&) noexcept;
  DataLoader& operator=(DataLoader&&) noexcept;
  ~DataLoader();

  const DataLoaderOptions& options() const { return options_; }
  const TokenFile& tokens() const { return *tokens_; }  // a token file's loader only
  bool prepared() const { return sequences_ != nullptr; }
  const data::SequenceFile& sequences() const { return *sequences_; }  // a prepared dataset's loader only
  // The data as it was named, and its size in tokens (a checkpoint records both).
  const std::string& source_name() const;
  int64_t source_tokens() const;
  // The source's content fingerprint (content_fingerprint of the tokens as stored, and of a prepared
  // dataset's loss mask after them): computed once, on the first call (it reads the file), then kept.
  const std::string& source_fingerprint() const;
  // The source file is still the one opened (TokenFile/SequenceFile::check_unchanged).
  Status check_unchanged() const;
  // Whole rows in the file: a row needs T+1 tokens starting at k*T, so floor((N - 1) / T).
  int64_t rows_per_epoch() const { return rows_per_epoch_; }
  int64_t tokens_per_step() const { return options_.micro_batch * options_.grad_accum * options_.seq_len; }
  // The file row that global row r reads (epoch wrap and, when shuffled, the epoch's permutation).
  RowSource row_source(int64_t global_row) const;

  Result<Batch> batch(int64_t step, int64_t micro) const;
  // The same rows into caller buffers of micro_batch * seq_len int32 each (pinned staging, say);
  // with `starts`, each token's document start within its row (SequenceFile::fill_row; 0 when the
  // data is not document_masked()).
  Status fill(int64_t step, int64_t micro, int32_t* inputs, int32_t* targets, int32_t* starts = nullptr) const;
  // The rows pack documents that attend only to themselves (a prepared dataset packed "neat"): the
  // trainer then passes each micro-batch's document starts to every layer.
  bool document_masked() const { return sequences_ != nullptr && sequences_->document_masked(); }
  // Their documents' length-weighted mean length (SequenceFile::document_tokens; 0 when not
  // document_masked()): what a plan's training.document_tokens should say.
  double document_tokens() const { return sequences_ != nullptr ? sequences_->document_tokens() : 0; }

 private:
  struct PermutationCache;
  DataLoader() = default;
  Status check_position(int64_t step, int64_t micro) const;
  int64_t first_row(int64_t step, int64_t micro) const;  // the global row of row 0 of (step, micro)

  std::shared_ptr<const TokenFile> tokens_;
  std::shared_ptr<const data::SequenceFile> sequences_;
  DataLoaderOptions options_;
  int64_t rows_per_epoch_ = 0;
  std::unique_ptr<PermutationCache> cache_;
};

// What a checkpoint records of its data's content, so that a resume on other data of the same
// size is refused (docs/checkpoints.md): the XXH64 of the parts' bytes in order, "xxh64:<16 hex>",
// when they hold at most `whole_limit` bytes; above that, of 64 windows of 64 KiB spread evenly
// over them (the first at the start, the last at the end) and the total size,
// "xxh64-sampled-64x64KiB:<16 hex>", so that a many-GB file costs 4 MiB of reads.
inline constexpr uint64_t kFingerprintWholeLimit = uint64_t{1} << 30;
struct ByteRange {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
};
std::string content_fingerprint(const std::vector<ByteRange>& parts, uint64_t whole_limit = kFingerprintWholeLimit);

// The permutation of [0, n) that the shuffled order uses for `epoch` (Fisher-Yates driven by
// xoshiro256** seeded through splitmix64; see the doc). Exposed so tests and tools can reproduce it.
std::vector<uint32_t> shuffled_rows(uint64_t seed, uint64_t epoch, uint32_t n);

}  // namespace megatrain::exec

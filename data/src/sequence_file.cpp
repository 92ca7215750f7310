// Prepared datasets on disk (sequence_file.h).
#include "megatrain/data/sequence_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "megatrain/core/durable_file.h"
#include "megatrain/core/xxh64.h"

namespace megatrain::data {

namespace {

using Json = nlohmann::ordered_json;

std::string hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof(b), "%016" PRIx64, v);
  return b;
}

Json header_json(const SequenceHeader& h) {
  Json j{{"format", "megatrain.sequences/1"},
              {"rows", h.rows},
              {"seq_len", h.seq_len},
              {"vocab_size", h.vocab_size},
              {"eos_id", h.eos_id},
              {"pad_id", h.pad_id},
              {"packing", h.packing},
              {"train_on", h.train_on},
              {"documents", h.documents},
              {"truncated", h.truncated},
              {"split", h.split},
              {"tokens", h.tokens},
              {"counted", h.counted},
              {"document_tokens", h.document_tokens},
              {"tokenizer", h.tokenizer},
              {"sources", h.sources},
              {"xxh64", hex(h.xxh64)}};
  if (!h.cache_key.empty()) j["cache_key"] = h.cache_key;
  return j;
}

}  // namespace

double neat_document_tokens(const uint8_t* mask, int64_t rows, int64_t seq_len) {
  if (rows <= 0 || seq_len <= 0) return 0;
  double squares = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* m = mask + r * (seq_len + 1);
    int64_t begin = 0;  // a row's first input begins a piece (fill_row's starts)
    for (int64_t t = 1; t <= seq_len; ++t)
      if (t == seq_len || (m[t] & kMaskDocStart)) {
        squares += static_cast<double>(t - begin) * static_cast<double>(t - begin);
        begin = t;
      }
  }
  return squares / (static_cast<double>(rows) * static_cast<double>(seq_len));
}

Status write_sequence_file(const std::filesystem::path& path, SequenceHeader& header, const SequenceRows& rows) {
  const int64_t width = header.seq_len + 1;
  if (header.seq_len < 1) return invalid_argument("a prepared dataset needs seq_len >= 1");
  if (rows.tokens.size() != rows.mask.size() || static_cast<int64_t>(rows.tokens.size()) % width != 0)
    return internal_error("write_sequence_file: tokens and mask must be whole rows of seq_len + 1");
  header.rows = static_cast<int64_t>(rows.tokens.size()) / width;
  header.document_tokens = header.packing == "neat" ? neat_document_tokens(rows.mask.data(), header.rows, header.seq_len) : 0;
  Xxh64 x;
  x.update(rows.tokens.data(), rows.tokens.size() * sizeof(uint32_t));
  x.update(rows.mask.data(), rows.mask.size());
  header.xxh64 = x.digest();
  const std::string text = header_json(header).dump(1) + "\n";
  if (16 + static_cast<int64_t>(text.size()) > kSequenceDataOffset)
    return invalid_argument(path.string() + ": the header (" + std::to_string(text.size()) +
                            " bytes: too many source files named?) does not fit in 4080 bytes");
  MT_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::create(path));
  std::string head(static_cast<size_t>(kSequenceDataOffset), '\0');
  std::memcpy(head.data(), kSequenceMagic, 8);
  const uint64_t n = text.size();
  std::memcpy(head.data() + 8, &n, 8);
  std::memcpy(head.data() + 16, text.data(), text.size());
  MT_RETURN_IF_ERROR(f.write(head.data(), head.size()));
  MT_RETURN_IF_ERROR(f.write(rows.tokens.data(), rows.tokens.size() * sizeof(uint32_t)));
  MT_RETURN_IF_ERROR(f.write(rows.mask.data(), rows.mask.size()));
  return f.commit();
}

bool SequenceFile::is_sequence_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;  // a FIFO's open would wait for a writer
  std::ifstream in(path, std::ios::binary);
  char m[8] = {};
  return in.read(m, 8) && std::memcmp(m, kSequenceMagic, 8) == 0;
}

Status SequenceFile::check_unchanged() const { return check_file_unchanged(name_, identity_); }

Result<SequenceFile> SequenceFile::open(const std::filesystem::path& path) {
  const std::string name = path.string();
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO must not block the open
  if (fd < 0) return not_found(name + ": cannot be opened: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(name + ": not a regular file; expected a dataset written by megatrain-data prepare");
  }
  const auto size = static_cast<size_t>(st.st_size);
  const Result<FileIdentity> identity = file_identity(fd);
  if (!identity.ok()) {
    ::close(fd);
    return identity.status();
  }
  if (size < static_cast<size_t>(kSequenceDataOffset)) {
    ::close(fd);
    return invalid_argument(name + ": " + std::to_string(size) + " bytes, shorter than a prepared dataset's 4096-byte header");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return invalid_argument(name + ": cannot be mapped: " + std::strerror(errno));
  SequenceFile f;
  f.name_ = name;
  f.map_ = map;
  f.map_bytes_ = size;
  f.identity_ = *identity;
  const auto* base = static_cast<const char*>(map);
  if (std::memcmp(base, kSequenceMagic, 8) != 0)
    return invalid_argument(name + ": not a prepared dataset (no MTSEQ001 magic); expected the output of megatrain-data prepare");
  uint64_t n = 0;
  std::memcpy(&n, base + 8, 8);
  if (n == 0 || n > static_cast<uint64_t>(kSequenceDataOffset - 16))
    return invalid_argument(name + ": the header length " + std::to_string(n) + " is not in [1, 4080]");
  Json j;
  try {
    j = Json::parse(std::string(base + 16, n));
    SequenceHeader& h = f.header_;
    if (j.at("format").get<std::string>() != "megatrain.sequences/1")
      return invalid_argument(name + ": format '" + j.at("format").get<std::string>() + "'; this build reads megatrain.sequences/1");
    h.rows = j.at("rows").get<int64_t>();
    h.seq_len = j.at("seq_len").get<int64_t>();
    h.vocab_size = j.at("vocab_size").get<int64_t>();
    // Read wide and checked below: get<int32_t>() of 2^40 is 0.
    const int64_t eos = j.at("eos_id").get<int64_t>(), pad = j.at("pad_id").get<int64_t>();
    if (!j.at("eos_id").is_number_integer() || !j.at("pad_id").is_number_integer())
      return invalid_argument(name + ": the header's eos_id and pad_id must be integers");
    for (const auto& [key, v] : {std::pair<const char*, int64_t>{"eos_id", eos}, {"pad_id", pad}})
      if (v < -1 || v > std::numeric_limits<int32_t>::max())
        return invalid_argument(name + ": the header's " + key + " " + std::to_string(v) + " is not a token id (-1 for none, else 0 .. 2^31-1)");
    h.eos_id = static_cast<int32_t>(eos);
    h.pad_id = static_cast<int32_t>(pad);
    h.packing = j.at("packing").get<std::string>();
    h.train_on = j.at("train_on").get<std::string>();
    h.documents = j.at("documents").get<int64_t>();
    h.truncated = j.at("truncated").get<int64_t>();
    h.split = j.at("split").get<int64_t>();
    h.tokens = j.at("tokens").get<int64_t>();
    h.counted = j.at("counted").get<int64_t>();
    h.tokenizer = j.at("tokenizer").get<std::string>();
    h.sources = j.at("sources").get<std::vector<std::string>>();
    if (j.contains("cache_key")) h.cache_key = j.at("cache_key").get<std::string>();
    h.xxh64 = std::stoull(j.at("xxh64").get<std::string>(), nullptr, 16);
  } catch (const std::exception& e) {
    return invalid_argument(name + ": the header is damaged: " + e.what());
  }
  const SequenceHeader& h = f.header_;
  if (h.rows < 0 || h.seq_len < 1 || h.seq_len > (int64_t{1} << 24) || h.rows > (int64_t{1} << 40))
    return invalid_argument(name + ": rows " + std::to_string(h.rows) + " and seq_len " + std::to_string(h.seq_len) +
                            " are out of range (rows 0 .. 2^40, seq_len 1 .. 2^24)");
  if (h.vocab_size < 1 || h.vocab_size > (int64_t{1} << 32))
    return invalid_argument(name + ": the header's vocab_size " + std::to_string(h.vocab_size) + " is out of range (1 .. 2^32)");
  for (const auto& [key, id] : {std::pair<const char*, int64_t>{"eos_id", h.eos_id}, {"pad_id", h.pad_id}})
    if (id >= h.vocab_size)
      return invalid_argument(name + ": the header's " + key + " " + std::to_string(id) + " is not below its vocab_size " +
                              std::to_string(h.vocab_size));
  if (h.packing != "pack" && h.packing != "neat" && h.packing != "pad")
    return invalid_argument(name + ": the header's packing '" + h.packing + "' is none of pack, neat, pad");
  // Every product of header fields in checked arithmetic: rows x (seq_len + 1) x 5 bytes can pass
  // 2^64 within the ranges above, and a wrapped size would pass the size and checksum checks.
  int64_t cells_i = 0, data_bytes = 0, want_i = 0;
  if (__builtin_mul_overflow(h.rows, h.seq_len + 1, &cells_i) || __builtin_mul_overflow(cells_i, int64_t{5}, &data_bytes) ||
      __builtin_add_overflow(data_bytes, kSequenceDataOffset, &want_i) || static_cast<uint64_t>(want_i) != size)
    return invalid_argument(name + ": " + std::to_string(size) + " bytes, but its header's " + std::to_string(h.rows) + " rows of " +
                            std::to_string(h.seq_len + 1) + " tokens make " +
                            (want_i > 0 && cells_i > 0 ? std::to_string(want_i) : std::string("more than 2^63")) +
                            " (a file cut short or grown: prepare it again)");
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"documents", h.documents}, {"truncated", h.truncated},
                               {"split", h.split}, {"tokens", h.tokens}, {"counted", h.counted}})
    if (v < 0 || ((key == std::string("tokens") || key == std::string("counted")) && v > cells_i))
      return invalid_argument(name + ": the header's " + key + " " + std::to_string(v) + " is out of range (0 .. rows x (seq_len + 1) = " +
                              std::to_string(cells_i) + ")");
  const auto cells = static_cast<size_t>(cells_i);
  const size_t want = static_cast<size_t>(want_i);
  if (size != want)
    return invalid_argument(name + ": " + std::to_string(size) + " bytes, but its header's " + std::to_string(h.rows) + " rows of " +
                            std::to_string(h.seq_len + 1) + " tokens make " + std::to_string(want) +
                            " (a file cut short or grown: prepare it again)");
  f.tokens_ = reinterpret_cast<const uint32_t*>(base + kSequenceDataOffset);
  f.mask_ = reinterpret_cast<const uint8_t*>(base + kSequenceDataOffset + cells * 4);
  Xxh64 x;
  x.update(f.tokens_, cells * 4);
  x.update(f.mask_, cells);
  if (x.digest() != h.xxh64)
    return invalid_argument(name + ": the checksum of its rows is " + hex(x.digest()) + ", the header says " + hex(h.xxh64) +
                            " (the file was changed or damaged: prepare it again)");
  for (size_t i = 0; i < cells; ++i)
    if (f.tokens_[i] >= static_cast<uint64_t>(h.vocab_size))
      return invalid_argument(name + ": token " + std::to_string(f.tokens_[i]) + " at row " + std::to_string(i / (h.seq_len + 1)) +
                              " is not below the vocabulary size " + std::to_string(h.vocab_size));
  f.header_.document_tokens = f.document_masked() ? neat_document_tokens(f.mask_, h.rows, h.seq_len) : 0;
  return f;
}

SequenceFile::SequenceFile(SequenceFile&& o) noexcept
    : name_(std::move(o.name_)),
      header_(std::move(o.header_)),
      tokens_(o.tokens_),
      mask_(o.mask_),
      map_(o.map_),
      map_bytes_(o.map_bytes_),
      identity_(o.identity_) {
  o.map_ = nullptr;
  o.map_bytes_ = 0;
}
SequenceFile& SequenceFile::operator=(SequenceFile&& o) noexcept {
  std::swap(name_, o.name_);
  std::swap(header_, o.header_);
  std::swap(tokens_, o.tokens_);
  std::swap(mask_, o.mask_);
  std::swap(map_, o.map_);
  std::swap(map_bytes_, o.map_bytes_);
  std::swap(identity_, o.identity_);
  return *this;
}
SequenceFile::~SequenceFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

void SequenceFile::fill_row(int64_t row, int32_t* inputs, int32_t* targets, int32_t* starts) const {
  const uint32_t* t = row_tokens(row);
  const uint8_t* m = row_mask(row);
  for (int64_t i = 0; i < header_.seq_len; ++i) {
    inputs[i] = static_cast<int32_t>(t[i]);
    // In a "neat" row the first token of a document is no one's target (the token before it is in
    // another document); prepare never marks it counted, and a file that does is read the same way.
    const bool counted = (m[i + 1] & kMaskCounted) && !(m[i + 1] & kMaskDocStart);
    targets[i] = counted ? static_cast<int32_t>(t[i + 1]) : -1;
  }
  if (starts == nullptr) return;
  // A document continued from the row before begins again at position 0 here (rows never attend
  // to each other).
  const bool neat = document_masked();
  int32_t at = 0;
  for (int64_t i = 0; i < header_.seq_len; ++i) {
    if (neat && (m[i] & kMaskDocStart)) at = static_cast<int32_t>(i);
    starts[i] = at;
  }
}

}  // namespace megatrain::data

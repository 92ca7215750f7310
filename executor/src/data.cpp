// Token files (memory-mapped, validated against their headers and sizes) and the stateless
// (step, micro-batch) -> rows loader, with the seeded per-epoch shuffle written out by hand.
#include "megatrain/executor/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cctype>
#include <climits>
#include <cstring>
#include <mutex>

#include "detail/checkpoint_hash.h"
#include "megatrain/core/xxh64.h"

namespace megatrain::exec {

// Token files are little-endian by definition; reading them with plain loads needs a
// little-endian host (x86-64 and AArch64 Linux both are).
static_assert(std::endian::native == std::endian::little, "token files are read as little-endian");

const char* token_format_name(TokenFormat f) {
  switch (f) {
    case TokenFormat::kAuto: return "auto";
    case TokenFormat::kLlmc: return "llmc";
    case TokenFormat::kRawU16: return "u16";
    case TokenFormat::kRawU32: return "u32";
    case TokenFormat::kText: return "text";
  }
  return "?";
}

Result<TokenFormat> parse_token_format(const std::string& s) {
  for (TokenFormat f : {TokenFormat::kAuto, TokenFormat::kLlmc, TokenFormat::kRawU16, TokenFormat::kRawU32,
                        TokenFormat::kText})
    if (s == token_format_name(f)) return f;
  return invalid_argument("token format '" + s + "' is not accepted; accepted: auto, llmc, u16, u32, text");
}

const char* data_order_name(DataOrder o) { return name(o); }

Result<DataOrder> parse_data_order(const std::string& s) {
  if (s == "sequential") return DataOrder::kSequential;
  if (s == "shuffled") return DataOrder::kShuffled;
  return invalid_argument("data_order '" + s + "' is not accepted; accepted: shuffled, sequential");
}

// ---- TokenFile --------------------------------------------------------------------------------

namespace {

// Closes a descriptor on every return path of open().
struct FdCloser {
  int fd = -1;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

std::string lower_extension(const std::filesystem::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e;
}

int32_t read_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;

}  // namespace

TokenFile::TokenFile(TokenFile&& o) noexcept { *this = std::move(o); }

TokenFile& TokenFile::operator=(TokenFile&& o) noexcept {
  if (this == &o) return *this;
  release();
  name_ = std::move(o.name_);
  format_ = o.format_;
  count_ = o.count_;
  width_ = o.width_;
  map_ = o.map_;
  map_bytes_ = o.map_bytes_;
  identity_ = o.identity_;
  memory_ = std::move(o.memory_);
  // A moved vector keeps its buffer, so a pointer into memory_ stays valid; recompute it anyway
  // so the invariant does not depend on that guarantee.
  tokens_ = map_ ? o.tokens_ : reinterpret_cast<const uint8_t*>(memory_.data());
  o.map_ = nullptr;
  o.map_bytes_ = 0;
  o.tokens_ = nullptr;
  o.count_ = 0;
  return *this;
}

TokenFile::~TokenFile() { release(); }

void TokenFile::release() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
}

TokenFile TokenFile::from_tokens(std::vector<uint32_t> tokens, std::string name) {
  TokenFile f;
  f.name_ = std::move(name);
  f.format_ = TokenFormat::kRawU32;
  f.width_ = 4;
  f.count_ = static_cast<int64_t>(tokens.size());
  f.memory_ = std::move(tokens);
  f.tokens_ = reinterpret_cast<const uint8_t*>(f.memory_.data());
  return f;
}

namespace {
// What a file that is not regular is, for messages.
std::string file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  return "a special file";
}
}  // namespace

Result<TokenFile> TokenFile::open(const std::filesystem::path& path, TokenFormat format) {
  const std::string name = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found("token file '" + name + "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument("token file '" + name + "' is a directory; expected a file of tokens");

  // O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read.
  FdCloser fd{::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
  if (fd.fd < 0) return io_error("cannot open token file '" + name + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) return io_error("cannot stat token file '" + name + "': " + std::strerror(errno));
  MT_ASSIGN_OR_RETURN(const FileIdentity identity, file_identity(fd.fd));
  if (!S_ISREG(st.st_mode))
    return invalid_argument("token file '" + name + "' is " + file_kind(st.st_mode) +
                            ", not a regular file; expected a file of tokens (llm.c .bin, raw .u16/.u32, or text)");
  // /proc and /sys files report 0 bytes whatever they hold: they would read as no tokens.
  if (st.st_size == 0 && (name.rfind("/proc/", 0) == 0 || name.rfind("/sys/", 0) == 0))
    return invalid_argument("token file '" + name + "' reports 0 bytes, as /proc and /sys files do whatever they hold; expected a file "
                            "of tokens (copy it to a regular file first)");
  const int64_t file_bytes = st.st_size;

  void* map = nullptr;
  if (file_bytes > 0) {
    map = ::mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_SHARED, fd.fd, 0);
    if (map == MAP_FAILED) return io_error("cannot map token file '" + name + "': " + std::strerror(errno));
  }
  TokenFile f;
  f.name_ = name;
  f.map_ = map;
  f.map_bytes_ = static_cast<size_t>(file_bytes);
  f.identity_ = identity;
  const auto* bytes = static_cast<const uint8_t*>(map);
  // From here on `f` owns the mapping, so every error return unmaps it.

  const bool has_llmc_magic = file_bytes >= 4 && (read_i32(bytes) == kLlmcMagicU16 || read_i32(bytes) == kLlmcMagicU32);
  if (format == TokenFormat::kAuto) {
    const std::string ext = lower_extension(path);
    if (ext == ".u16") format = TokenFormat::kRawU16;
    else if (ext == ".u32") format = TokenFormat::kRawU32;
    else if (ext == ".bin" || has_llmc_magic) format = TokenFormat::kLlmc;
    else format = TokenFormat::kText;
  }
  f.format_ = format;

  switch (format) {
    case TokenFormat::kLlmc: {
      if (file_bytes < kLlmcHeaderBytes)
        return corrupt("token file '" + name + "': " + std::to_string(file_bytes) +
                       " bytes is shorter than the llm.c header (256 int32 = 1024 bytes): truncated, or not an "
                       "llm.c file (raw tokens: name it .u16/.u32 or choose the format explicitly)");
      const int32_t magic = read_i32(bytes);
      const int32_t version = read_i32(bytes + 4);
      const int32_t header_count = read_i32(bytes + 8);
      int expected_version = 0;
      if (magic == kLlmcMagicU16) {
        expected_version = 1;
        f.width_ = 2;
      } else if (magic == kLlmcMagicU32) {
        expected_version = 7;
        f.width_ = 4;
      } else {
        return corrupt("token file '" + name + "': magic " + std::to_string(magic) +
                       " is not an llm.c token file's (expected 20240520 for uint16 tokens or 20240801 for "
                       "uint32 tokens); raw tokens: name the file .u16/.u32 or choose the format explicitly");
      }
      if (version != expected_version)
        return unsupported("token file '" + name + "': llm.c version " + std::to_string(version) +
                           " with magic " + std::to_string(magic) + "; expected version " +
                           std::to_string(expected_version) + (f.width_ == 2 ? " (uint16 tokens)" : " (uint32 tokens)"));
      if (header_count < 0)
        return corrupt("token file '" + name + "': the header's token count is negative (" +
                       std::to_string(header_count) + ")");
      const int64_t data_bytes = file_bytes - kLlmcHeaderBytes;
      const int64_t expected_bytes = static_cast<int64_t>(header_count) * f.width_;
      if (data_bytes < expected_bytes)
        return corrupt("token file '" + name + "' is truncated: the header announces " + std::to_string(header_count) +
                       " tokens (" + std::to_string(expected_bytes) + " bytes after the 1024-byte header) but the file "
                       "holds " + std::to_string(data_bytes) + " bytes after the header");
      if (data_bytes > expected_bytes)
        return corrupt("token file '" + name + "': the header announces " + std::to_string(header_count) +
                       " tokens (" + std::to_string(expected_bytes) + " bytes) but " + std::to_string(data_bytes) +
                       " bytes follow the header; the file size must be 1024 + " + std::to_string(f.width_) +
                       " x count");
      f.count_ = header_count;
      f.tokens_ = bytes + kLlmcHeaderBytes;
      break;
    }
    case TokenFormat::kRawU16:
    case TokenFormat::kRawU32: {
      f.width_ = format == TokenFormat::kRawU16 ? 2 : 4;
      if (file_bytes % f.width_ != 0)
        return corrupt("token file '" + name + "': " + std::to_string(file_bytes) + " bytes is not a whole number of " +
                       (f.width_ == 2 ? "uint16" : "uint32") + " tokens (a multiple of " + std::to_string(f.width_) +
                       " bytes): truncated?");
      f.count_ = file_bytes / f.width_;
      f.tokens_ = bytes;
      break;
    }
    case TokenFormat::kText:
      f.width_ = 1;
      f.count_ = file_bytes;
      f.tokens_ = bytes;
      break;
    case TokenFormat::kAuto:
      return internal_error("token format left unresolved");
  }
  return f;
}

int64_t TokenFile::format_vocab_limit() const {
  if (format_ == TokenFormat::kText) return 256;
  return width_ == 2 ? 65536 : (int64_t{1} << 32);
}

uint32_t TokenFile::token(int64_t i) const {
  MT_CHECK(i >= 0 && i < count_, "token index " + std::to_string(i) + " outside [0, " + std::to_string(count_) + ")");
  const uint8_t* p = tokens_ + i * width_;
  switch (width_) {
    case 1: return *p;
    case 2: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    default: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
  }
}

Status TokenFile::copy_tokens(int64_t begin, int64_t count, int64_t vocab_size, int32_t* out) const {
  if (begin < 0 || count < 0 || begin > count_ - count)
    return internal_error("token range [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                          ") is outside '" + name_ + "' (" + std::to_string(count_) + " tokens)");
  // Token ids travel as int32 (the embedding lookup's index type), so INT32_MAX bounds them too.
  const uint64_t limit = vocab_size > 0 ? std::min<uint64_t>(static_cast<uint64_t>(vocab_size), uint64_t{INT32_MAX} + 1)
                                        : uint64_t{INT32_MAX} + 1;
  const uint8_t* p = tokens_ + begin * width_;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t t;
    if (width_ == 1) {
      t = p[i];
    } else if (width_ == 2) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      t = v;
    } else {
      std::memcpy(&t, p + 4 * i, 4);
    }
    if (t >= limit) {
      std::string bound = vocab_size > 0 ? "the model's vocab_size " + std::to_string(vocab_size)
                                          : std::string("2^31 (token ids are int32)");
      return invalid_argument("token file '" + name_ + "': token " + std::to_string(t) + " at position " +
                              std::to_string(begin + i) + " is not below " + bound +
                              "; expected ids in [0, " + std::to_string(limit) + ") (data tokenised for another model?)");
    }
    out[i] = static_cast<int32_t>(t);
  }
  return {};
}

Status TokenFile::check_vocab(int64_t vocab_size) const {
  constexpr int64_t kChunk = 1 << 16;
  std::vector<int32_t> scratch(static_cast<size_t>(std::min<int64_t>(kChunk, std::max<int64_t>(count_, 1))));
  for (int64_t b = 0; b < count_; b += kChunk) {
    MT_RETURN_IF_ERROR(copy_tokens(b, std::min(kChunk, count_ - b), vocab_size, scratch.data()));
  }
  return {};
}

// ---- shuffling ---------------------------------------------------------------------------------

namespace {

// splitmix64 (Steele, Lea, Flood 2014; Vigna's reference constants). Used only to seed xoshiro.
uint64_t splitmix64_next(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// xoshiro256** 1.0 (Blackman and Vigna). Written here rather than std::mt19937_64 + std::shuffle
// because std::shuffle and the std distributions are implementation-defined: a checkpoint taken
// with one standard library must resume on another with the same batches.
class Xoshiro256ss {
 public:
  Xoshiro256ss(uint64_t seed, uint64_t epoch) {
    uint64_t sm = seed;
    uint64_t key = splitmix64_next(sm);  // decorrelates nearby seeds before the epoch is mixed in
    uint64_t st = key ^ epoch;
    for (auto& w : s_) w = splitmix64_next(st);
  }
  uint64_t next() {
    const uint64_t result = std::rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = std::rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, bound) without modulo bias: reject the lowest (2^64 mod bound) values.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      uint64_t x = next();
      if (x >= threshold) return x % bound;
    }
  }

 private:
  uint64_t s_[4];
};

}  // namespace

std::vector<uint32_t> shuffled_rows(uint64_t seed, uint64_t epoch, uint32_t n) {
  std::vector<uint32_t> perm(n);
  for (uint32_t i = 0; i < n; ++i) perm[i] = i;
  Xoshiro256ss rng(seed, epoch);
  // Durstenfeld's Fisher-Yates, from the last position down.
  for (uint32_t i = n; i > 1; --i) {
    uint32_t j = static_cast<uint32_t>(rng.below(i));
    std::swap(perm[i - 1], perm[j]);
  }
  return perm;
}

// ---- DataLoader --------------------------------------------------------------------------------

// Rows of one batch are consecutive global rows, so a batch touches at most two epochs when
// micro_batch <= rows_per_epoch; two slots keep each permutation built once per epoch.
struct DataLoader::PermutationCache {
  std::mutex mu;
  struct Slot {
    int64_t epoch = -1;
    std::shared_ptr<const std::vector<uint32_t>> perm;
    uint64_t last_use = 0;
  };
  Slot slots[2];
  uint64_t tick = 0;
  std::once_flag fingerprinted;  // source_fingerprint, computed on the first call
  std::string fingerprint;
};

DataLoader::DataLoader(DataLoader&&) noexcept = default;
DataLoader& DataLoader::operator=(DataLoader&&) noexcept = default;
DataLoader::~DataLoader() = default;

Status TokenFile::check_unchanged() const { return check_file_unchanged(name_, identity_); }

std::string content_fingerprint(const std::vector<ByteRange>& parts, uint64_t whole_limit) {
  uint64_t total = 0;
  for (const ByteRange& p : parts) total += p.size;
  Xxh64 h;
  // Bytes [begin, begin + n) of the parts laid end to end.
  auto hash_range = [&](uint64_t begin, uint64_t n) {
    for (const ByteRange& p : parts) {
      if (n == 0) break;
      if (begin >= p.size) {
        begin -= p.size;
        continue;
      }
      const uint64_t take = std::min(n, p.size - begin);
      h.update(p.data + begin, static_cast<size_t>(take));
      n -= take;
      begin = 0;
    }
  };
  if (total <= whole_limit) {
    hash_range(0, total);
    return "xxh64:" + detail::hex64(h.digest());
  }
  constexpr uint64_t kWindows = 64, kWindow = 64 << 10;
  const uint64_t window = std::min(kWindow, total), span = total - window;
  for (uint64_t w = 0; w < kWindows; ++w) hash_range(span / (kWindows - 1) * w + (span % (kWindows - 1)) * w / (kWindows - 1), window);
  h.update(&total, sizeof total);
  return "xxh64-sampled-64x64KiB:" + detail::hex64(h.digest());
}

const std::string& DataLoader::source_fingerprint() const {
  std::call_once(cache_->fingerprinted, [this] {
    if (sequences_) {  // its header's XXH64 already covers the tokens, then the mask (checked when opened)
      cache_->fingerprint = "xxh64:" + detail::hex64(sequences_->header().xxh64);
      return;
    }
    cache_->fingerprint = content_fingerprint({{tokens_->token_bytes(), static_cast<uint64_t>(tokens_->size()) *
                                                                          static_cast<uint64_t>(tokens_->token_width())}});
  });
  return cache_->fingerprint;
}

Status DataLoader::check_unchanged() const { return sequences_ ? sequences_->check_unchanged() : tokens_->check_unchanged(); }

Result<DataLoader> DataLoader::create(std::shared_ptr<const TokenFile> tokens, int64_t seq_len, int64_t micro_batch,
                                      int64_t grad_accum, DataOrder order, uint64_t seed, int64_t vocab_size) {
  DataLoaderOptions o;
  o.seq_len = seq_len;
  o.micro_batch = micro_batch;
  o.grad_accum = grad_accum;
  o.order = order;
  o.seed = seed;
  o.vocab_size = vocab_size;
  return create(std::move(tokens), o);
}

Result<DataLoader> DataLoader::create(std::shared_ptr<const TokenFile> tokens, const DataLoaderOptions& options) {
  if (!tokens) return invalid_argument("data loader: no token file");
  if (options.seq_len <= 0)
    return invalid_argument("data loader: seq_len " + std::to_string(options.seq_len) + " must be positive");
  if (options.micro_batch <= 0)
    return invalid_argument("data loader: micro_batch " + std::to_string(options.micro_batch) + " must be positive");
  if (options.grad_accum <= 0)
    return invalid_argument("data loader: grad_accum " + std::to_string(options.grad_accum) + " must be positive");
  if (options.vocab_size < 0)
    return invalid_argument("data loader: vocab_size " + std::to_string(options.vocab_size) + " must be >= 0");
  const int64_t n = tokens->size();
  if (n < options.seq_len + 1)
    return invalid_argument("token file '" + tokens->name() + "' holds " + std::to_string(n) +
                            " tokens; seq_len " + std::to_string(options.seq_len) + " needs at least " +
                            std::to_string(options.seq_len + 1) + " (one row of inputs plus the shifted target)");
  if (options.ranks < 1 || options.rank < 0 || options.rank >= options.ranks)
    return invalid_argument("data loader: rank " + std::to_string(options.rank) + " of " + std::to_string(options.ranks) +
                            "; accepted: ranks >= 1 and 0 <= rank < ranks");
  if (options.micro_batch > INT64_MAX / options.grad_accum / options.seq_len)
    return invalid_argument("data loader: micro_batch x grad_accum x seq_len overflows 64 bits");
  DataLoader d;
  d.tokens_ = std::move(tokens);
  d.options_ = options;
  d.rows_per_epoch_ = (n - 1) / options.seq_len;
  if (options.order == DataOrder::kShuffled && d.rows_per_epoch_ > int64_t{UINT32_MAX})
    return unsupported("token file '" + d.tokens_->name() + "' has " + std::to_string(d.rows_per_epoch_) +
                       " rows of seq_len " + std::to_string(options.seq_len) +
                       "; the shuffled order supports at most 2^32 - 1 rows (use sequential or a longer seq_len)");
  d.cache_ = std::make_unique<PermutationCache>();
  return d;
}

Result<DataLoader> DataLoader::create(std::shared_ptr<const data::SequenceFile> rows, const DataLoaderOptions& options) {
  if (!rows) return invalid_argument("data loader: no prepared dataset");
  if (options.micro_batch <= 0 || options.grad_accum <= 0 || options.vocab_size < 0)
    return invalid_argument("data loader: micro_batch and grad_accum must be positive, vocab_size >= 0");
  if (rows->seq_len() != options.seq_len)
    return invalid_argument("prepared dataset '" + rows->name() + "' has rows of seq_len " + std::to_string(rows->seq_len()) +
                            ", the plan's training.seq_len is " + std::to_string(options.seq_len) +
                            "; prepare it again with --seq " + std::to_string(options.seq_len));
  if (options.vocab_size > 0 && rows->header().vocab_size > options.vocab_size)
    return invalid_argument("prepared dataset '" + rows->name() + "' was tokenized with a vocabulary of " +
                            std::to_string(rows->header().vocab_size) + " tokens (" + rows->header().tokenizer + "), the model has " +
                            std::to_string(options.vocab_size) + "; accepted: a tokenizer of this model");
  if (rows->rows() < 1) return invalid_argument("prepared dataset '" + rows->name() + "' has no rows");
  if (options.ranks < 1 || options.rank < 0 || options.rank >= options.ranks)
    return invalid_argument("data loader: rank " + std::to_string(options.rank) + " of " + std::to_string(options.ranks) +
                            "; accepted: ranks >= 1 and 0 <= rank < ranks");
  if (options.micro_batch > INT64_MAX / options.grad_accum / options.seq_len)
    return invalid_argument("data loader: micro_batch x grad_accum x seq_len overflows 64 bits");
  DataLoader d;
  d.sequences_ = std::move(rows);
  d.options_ = options;
  d.rows_per_epoch_ = d.sequences_->rows();
  if (options.order == DataOrder::kShuffled && d.rows_per_epoch_ > int64_t{UINT32_MAX})
    return unsupported("prepared dataset '" + d.sequences_->name() + "' has more than 2^32 - 1 rows; the shuffled order supports fewer");
  d.cache_ = std::make_unique<PermutationCache>();
  return d;
}

const std::string& DataLoader::source_name() const { return sequences_ ? sequences_->name() : tokens_->name(); }
int64_t DataLoader::source_tokens() const {
  return sequences_ ? sequences_->rows() * (sequences_->seq_len() + 1) : tokens_->size();
}

RowSource DataLoader::row_source(int64_t global_row) const {
  MT_CHECK(global_row >= 0, "negative global row");
  RowSource s;
  s.global_row = global_row;
  s.epoch = global_row / rows_per_epoch_;
  const int64_t pos = global_row % rows_per_epoch_;
  if (options_.order == DataOrder::kSequential) {
    s.file_row = pos;
    return s;
  }
  std::shared_ptr<const std::vector<uint32_t>> perm;
  {
    std::lock_guard<std::mutex> lock(cache_->mu);
    auto& c = *cache_;
    ++c.tick;
    for (auto& slot : c.slots)
      if (slot.epoch == s.epoch) {
        slot.last_use = c.tick;
        perm = slot.perm;
      }
    if (!perm) {
      auto& victim = c.slots[0].last_use <= c.slots[1].last_use ? c.slots[0] : c.slots[1];
      victim.epoch = s.epoch;
      victim.perm = std::make_shared<const std::vector<uint32_t>>(
          shuffled_rows(options_.seed, static_cast<uint64_t>(s.epoch), static_cast<uint32_t>(rows_per_epoch_)));
      victim.last_use = c.tick;
      perm = victim.perm;
    }
  }
  s.file_row = (*perm)[static_cast<size_t>(pos)];
  return s;
}

Status DataLoader::check_position(int64_t step, int64_t micro) const {
  if (step < 0) return invalid_argument("data loader: step " + std::to_string(step) + " must be >= 0");
  if (micro < 0 || micro >= options_.grad_accum)
    return invalid_argument("data loader: micro-batch " + std::to_string(micro) + " is outside [0, grad_accum = " +
                            std::to_string(options_.grad_accum) + ")");
  // The last row index ((step*G + micro + 1)*B - 1)*ranks + rank must fit in int64.
  if (step > (INT64_MAX / options_.micro_batch / options_.ranks - 1 - micro) / options_.grad_accum)
    return invalid_argument("data loader: step " + std::to_string(step) + " is too large (row index overflows)");
  return {};
}

int64_t DataLoader::first_row(int64_t step, int64_t micro) const {
  return (step * options_.grad_accum + micro) * options_.micro_batch * options_.ranks + options_.rank;
}

Status DataLoader::fill(int64_t step, int64_t micro, int32_t* inputs, int32_t* targets, int32_t* starts) const {
  MT_RETURN_IF_ERROR(check_position(step, micro));
  const int64_t t_len = options_.seq_len;
  const int64_t first = first_row(step, micro);
  for (int64_t b = 0; b < options_.micro_batch; ++b) {
    const RowSource src = row_source(first + b * options_.ranks);
    if (sequences_) {
      sequences_->fill_row(src.file_row, inputs + b * t_len, targets + b * t_len, starts ? starts + b * t_len : nullptr);
      continue;
    }
    if (starts) std::fill(starts + b * t_len, starts + (b + 1) * t_len, 0);
    const int64_t start = src.file_row * t_len;
    int32_t* in = inputs + b * t_len;
    int32_t* tg = targets + b * t_len;
    MT_RETURN_IF_ERROR(tokens_->copy_tokens(start, t_len, options_.vocab_size, in));
    // Targets are the inputs shifted by one, plus the token after the row.
    std::memcpy(tg, in + 1, static_cast<size_t>(t_len - 1) * sizeof(int32_t));
    MT_RETURN_IF_ERROR(tokens_->copy_tokens(start + t_len, 1, options_.vocab_size, tg + t_len - 1));
  }
  return {};
}

Result<Batch> DataLoader::batch(int64_t step, int64_t micro) const {
  MT_RETURN_IF_ERROR(check_position(step, micro));
  Batch b;
  b.step = step;
  b.micro = micro;
  b.micro_batch = options_.micro_batch;
  b.seq_len = options_.seq_len;
  const size_t n = static_cast<size_t>(options_.micro_batch * options_.seq_len);
  b.inputs.resize(n);
  b.targets.resize(n);
  MT_RETURN_IF_ERROR(fill(step, micro, b.inputs.data(), b.targets.data()));
  const int64_t first = first_row(step, micro);
  for (int64_t r = 0; r < options_.micro_batch; ++r) b.rows.push_back(row_source(first + r * options_.ranks));
  return b;
}

}  // namespace megatrain::exec

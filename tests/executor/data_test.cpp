// Token files and the data loader: hand-computed sequential rows (shift, wrap-around), the shuffled
// order against an independent Python implementation, resumability, every format and every error.
#include "megatrain/executor/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <set>
#include <sstream>

#include "executor/file_test_util.h"
#include "megatrain/core/xxh64.h"

namespace megatrain::exec {
namespace {

using test::append_pod;
using test::ScratchDir;
using test::write_bytes;

// An llm.c token file as llm.c's write_datafile writes it: 256 int32 header, then the tokens.
std::string llmc_bytes(const std::vector<uint32_t>& tokens, int32_t magic = kLlmcMagicU16, int32_t version = 1,
                       int64_t header_count = -1, bool wide = false) {
  std::string s;
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(header_count >= 0 ? header_count : static_cast<int64_t>(tokens.size()));
  s.append(reinterpret_cast<const char*>(header), sizeof header);
  for (uint32_t t : tokens) {
    if (wide) append_pod(s, t);
    else append_pod(s, static_cast<uint16_t>(t));
  }
  return s;
}

std::vector<uint32_t> iota_tokens(uint32_t n, uint32_t first = 0) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::shared_ptr<const TokenFile> open_shared(const std::filesystem::path& p, TokenFormat f = TokenFormat::kAuto) {
  auto r = TokenFile::open(p, f);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return nullptr;
  return std::make_shared<const TokenFile>(std::move(r).value());
}

std::vector<int32_t> range_i32(int32_t begin, int32_t end) {
  std::vector<int32_t> v;
  for (int32_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

// Row b of a batch's inputs or targets.
std::vector<int32_t> row(const std::vector<int32_t>& flat, int64_t b, int64_t t_len) {
  return {flat.begin() + b * t_len, flat.begin() + (b + 1) * t_len};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

class DataFixture : public ::testing::Test {
 protected:
  ScratchDir dir{"data"};
};

// ---- sequential rows, by hand ------------------------------------------------------------------

TEST_F(DataFixture, SequentialRowsFollowTheLlmcNumbering) {
  // Tokens 0..999, T = 10, B = 2, G = 3: rows r = (step*3 + j)*2 + b read [10r, 10r+10), targets +1.
  write_bytes(dir / "t.bin", llmc_bytes(iota_tokens(1000)));
  auto file = open_shared(dir / "t.bin");
  ASSERT_TRUE(file);
  EXPECT_EQ(file->format(), TokenFormat::kLlmc);
  EXPECT_EQ(file->size(), 1000);
  auto dl = DataLoader::create(file, 10, 2, 3, DataOrder::kSequential, 1);
  ASSERT_TRUE(dl.ok()) << dl.status().to_string();
  EXPECT_EQ(dl->rows_per_epoch(), 99);  // floor((1000 - 1) / 10): row 99 would need token 1000
  EXPECT_EQ(dl->tokens_per_step(), 60);

  auto b00 = dl->batch(0, 0);
  ASSERT_TRUE(b00.ok()) << b00.status().to_string();
  EXPECT_EQ(row(b00->inputs, 0, 10), range_i32(0, 10));
  EXPECT_EQ(row(b00->targets, 0, 10), range_i32(1, 11));
  EXPECT_EQ(row(b00->inputs, 1, 10), range_i32(10, 20));
  EXPECT_EQ(row(b00->targets, 1, 10), range_i32(11, 21));

  // step 1, j = 2: r = (1*3 + 2)*2 = 10 and 11.
  auto b12 = dl->batch(1, 2);
  ASSERT_TRUE(b12.ok());
  EXPECT_EQ(b12->rows[0].global_row, 10);
  EXPECT_EQ(row(b12->inputs, 0, 10), range_i32(100, 110));
  EXPECT_EQ(row(b12->targets, 0, 10), range_i32(101, 111));
  EXPECT_EQ(row(b12->inputs, 1, 10), range_i32(110, 120));
  EXPECT_EQ(row(b12->targets, 1, 10), range_i32(111, 121));
}

TEST_F(DataFixture, SequentialWrapsAroundAfterTheLastWholeRow) {
  write_bytes(dir / "t.bin", llmc_bytes(iota_tokens(1000)));
  auto dl = DataLoader::create(open_shared(dir / "t.bin"), 10, 2, 3, DataOrder::kSequential, 1);
  ASSERT_TRUE(dl.ok());
  // r = 98 and 99 are (step 16, j 1): (16*3 + 1)*2 = 98. Row 98 is the file's last whole row
  // (targets end at token 990); r = 99 wraps to file row 0 of epoch 1. Tokens 991..999 are never read.
  auto b = dl->batch(16, 1);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->rows[0].global_row, 98);
  EXPECT_EQ(b->rows[0].epoch, 0);
  EXPECT_EQ(b->rows[0].file_row, 98);
  EXPECT_EQ(row(b->inputs, 0, 10), range_i32(980, 990));
  EXPECT_EQ(row(b->targets, 0, 10), range_i32(981, 991));
  EXPECT_EQ(b->rows[1].global_row, 99);
  EXPECT_EQ(b->rows[1].epoch, 1);
  EXPECT_EQ(b->rows[1].file_row, 0);
  EXPECT_EQ(row(b->inputs, 1, 10), range_i32(0, 10));
  EXPECT_EQ(row(b->targets, 1, 10), range_i32(1, 11));
  // Epoch 2 starts at r = 198 = (step 33, j 0, b 0).
  auto c = dl->batch(33, 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rows[0].epoch, 2);
  EXPECT_EQ(row(c->inputs, 0, 10), range_i32(0, 10));
}

TEST_F(DataFixture, ExactMultipleUsesTheLastToken) {
  // 1001 tokens, T = 10: 100 rows; row 99's last target is token 1000.
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(1001)));
  auto dl = DataLoader::create(file, 10, 1, 1, DataOrder::kSequential, 1);
  ASSERT_TRUE(dl.ok());
  EXPECT_EQ(dl->rows_per_epoch(), 100);
  auto b = dl->batch(99, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->inputs, range_i32(990, 1000));
  EXPECT_EQ(b->targets, range_i32(991, 1001));
  auto w = dl->batch(100, 0);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->inputs, range_i32(0, 10));
}

TEST_F(DataFixture, MinimalFileHasOneRowRepeated) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(5, 7)));
  auto dl = DataLoader::create(file, 4, 3, 2, DataOrder::kShuffled, 9);
  ASSERT_TRUE(dl.ok()) << dl.status().to_string();
  EXPECT_EQ(dl->rows_per_epoch(), 1);
  auto b = dl->batch(5, 1);
  ASSERT_TRUE(b.ok());
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(row(b->inputs, r, 4), range_i32(7, 11));
    EXPECT_EQ(row(b->targets, r, 4), range_i32(8, 12));
  }
}

TEST_F(DataFixture, FillMatchesBatch) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(500)));
  auto dl = DataLoader::create(file, 7, 3, 2, DataOrder::kShuffled, 5);
  ASSERT_TRUE(dl.ok());
  std::vector<int32_t> in(21), tg(21);
  ASSERT_TRUE(dl->fill(4, 1, in.data(), tg.data()).ok());
  auto b = dl->batch(4, 1);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(in, b->inputs);
  EXPECT_EQ(tg, b->targets);
}

// ---- shuffled order ----------------------------------------------------------------------------

TEST_F(DataFixture, ShuffledEpochIsAPermutationOfRows) {
  write_bytes(dir / "t.bin", llmc_bytes(iota_tokens(1000)));
  auto dl = DataLoader::create(open_shared(dir / "t.bin"), 10, 3, 1, DataOrder::kShuffled, 1234);
  ASSERT_TRUE(dl.ok());
  // 99 rows, 3 per step: steps 0..32 cover exactly epoch 0, steps 33..65 epoch 1.
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int64_t> seen;
    for (int step = epoch * 33; step < (epoch + 1) * 33; ++step) {
      auto b = dl->batch(step, 0);
      ASSERT_TRUE(b.ok());
      for (int r = 0; r < 3; ++r) {
        const auto& src = b->rows[static_cast<size_t>(r)];
        EXPECT_EQ(src.epoch, epoch);
        const int32_t k = static_cast<int32_t>(src.file_row);
        EXPECT_EQ(row(b->inputs, r, 10), range_i32(10 * k, 10 * k + 10));
        EXPECT_EQ(row(b->targets, r, 10), range_i32(10 * k + 1, 10 * k + 11));
        seen.push_back(src.file_row);
      }
    }
    std::vector<int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(99);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all) << "epoch " << epoch << " is not a permutation of the 99 rows";
    std::vector<int64_t> identity(all);
    EXPECT_NE(seen, identity) << "epoch " << epoch << " was not shuffled";
  }
  EXPECT_NE(shuffled_rows(1234, 0, 99), shuffled_rows(1234, 1, 99)) << "each epoch has its own permutation";
}

// Data parallelism: N ranks x grad_accum A read, between them, exactly the rows of one process with
// grad_accum N x A, rank k taking rows k, k + N, ... of each step (hand-written for N = 3, B = 2, A = 2).
TEST_F(DataFixture, RanksShareEachStepsRowsAsOneProcessWithTheirAccumulation) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(2000)));
  for (DataOrder order : {DataOrder::kSequential, DataOrder::kShuffled}) {
    DataLoaderOptions one{8, 2, 6, order, 11, 0};
    auto single = DataLoader::create(file, one);
    ASSERT_TRUE(single.ok()) << single.status().to_string();
    for (int64_t step : {0, 1, 9, 40}) {  // 249 rows: step 40 is in a later epoch
      std::vector<RowSource> whole;
      for (int64_t j = 0; j < 6; ++j) {
        auto b = single->batch(step, j);
        ASSERT_TRUE(b.ok());
        whole.insert(whole.end(), b->rows.begin(), b->rows.end());
      }
      for (int64_t k = 0; k < 3; ++k) {
        DataLoaderOptions o{8, 2, 2, order, 11, 0};
        o.ranks = 3;
        o.rank = k;
        auto rank = DataLoader::create(file, o);
        ASSERT_TRUE(rank.ok()) << rank.status().to_string();
        for (int64_t j = 0; j < 2; ++j) {
          auto b = rank->batch(step, j);
          ASSERT_TRUE(b.ok());
          for (int64_t r = 0; r < 2; ++r) {
            const RowSource& want = whole[static_cast<size_t>((j * 2 + r) * 3 + k)];
            EXPECT_EQ(b->rows[static_cast<size_t>(r)].global_row, want.global_row) << "step " << step << " rank " << k;
            EXPECT_EQ(b->rows[static_cast<size_t>(r)].file_row, want.file_row) << "step " << step << " rank " << k;
            EXPECT_EQ(row(b->inputs, r, 8), range_i32(static_cast<int32_t>(8 * want.file_row), static_cast<int32_t>(8 * want.file_row + 8)));
          }
        }
      }
    }
  }
  DataLoaderOptions bad{8, 2, 2, DataOrder::kSequential, 1, 0};
  bad.ranks = 2;
  bad.rank = 2;
  auto r = DataLoader::create(file, bad);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "rank 2 of 2")) << r.status().message();
}

TEST_F(DataFixture, ShuffledIsDeterministicPerSeed) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(5000)));
  auto a = DataLoader::create(file, 16, 4, 2, DataOrder::kShuffled, 7);
  auto b = DataLoader::create(file, 16, 4, 2, DataOrder::kShuffled, 7);
  auto c = DataLoader::create(file, 16, 4, 2, DataOrder::kShuffled, 8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  bool any_difference = false;
  for (int step = 0; step < 60; ++step)  // 312 rows per epoch, 8 per step: crosses an epoch boundary
    for (int j = 0; j < 2; ++j) {
      auto ba = a->batch(step, j), bb = b->batch(step, j), bc = c->batch(step, j);
      ASSERT_TRUE(ba.ok() && bb.ok() && bc.ok());
      EXPECT_EQ(ba->inputs, bb->inputs);
      EXPECT_EQ(ba->targets, bb->targets);
      any_difference = any_difference || ba->inputs != bc->inputs;
    }
  EXPECT_TRUE(any_difference) << "seeds 7 and 8 gave the same batches";
}

// The permutation is defined by the algorithm in docs/data-and-checkpoints.md; an independent
// Python implementation of that text must produce the same rows (so no C++ library detail leaks in).
TEST_F(DataFixture, ShufflePermutationMatchesIndependentPython) {
  if (!test::have_python3()) FAIL() << "the project's Python (" << test::python() << ") is missing (run scripts/python-env.sh): cannot cross-check the shuffle";
  const char* script = R"PY(
import sys
M = (1 << 64) - 1
def splitmix(state):
    state = (state + 0x9E3779B97F4A7C15) & M
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return state, z ^ (z >> 31)
def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M
def perm(seed, epoch, n):
    _, key = splitmix(seed & M)
    st = key ^ epoch
    s = []
    for _ in range(4):
        st, v = splitmix(st)
        s.append(v)
    def nxt():
        result = (rotl((s[1] * 5) & M, 7) * 9) & M
        t = (s[1] << 17) & M
        s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result
    def below(bound):
        threshold = ((1 << 64) - bound) % bound
        while True:
            x = nxt()
            if x >= threshold:
                return x % bound
    p = list(range(n))
    for i in range(n, 1, -1):
        j = below(i)
        p[i - 1], p[j] = p[j], p[i - 1]
    return p
for arg in sys.argv[1:]:
    seed, epoch, n = (int(x) for x in arg.split(","))
    print(" ".join(str(x) for x in perm(seed, epoch, n)))
)PY";
  struct Case {
    uint64_t seed, epoch;
    uint32_t n;
  };
  const std::vector<Case> cases = {{1, 0, 99}, {1, 1, 99}, {42, 3, 1000}, {0xFFFFFFFFFFFFFFFFull, 7, 2}, {5, 0, 1}};
  std::string args;
  for (const auto& c : cases) args += std::to_string(c.seed) + "," + std::to_string(c.epoch) + "," + std::to_string(c.n) + " ";
  auto run = test::run_python(dir.path(), script, args);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::istringstream lines(run.output);
  for (const auto& c : cases) {
    std::string line;
    ASSERT_TRUE(std::getline(lines, line)) << run.output;
    std::istringstream nums(line);
    std::vector<uint32_t> expected;
    uint32_t v;
    while (nums >> v) expected.push_back(v);
    EXPECT_EQ(shuffled_rows(c.seed, c.epoch, c.n), expected) << "seed " << c.seed << " epoch " << c.epoch;
  }
}

// ---- resumability ------------------------------------------------------------------------------

TEST_F(DataFixture, BatchesDependOnlyOnStepAndMicroBatch) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(3000)));
  for (DataOrder order : {DataOrder::kSequential, DataOrder::kShuffled}) {
    // An uninterrupted run draws every batch in order, crossing several epochs (187 rows per epoch).
    auto full = DataLoader::create(file, 16, 3, 4, order, 99);
    ASSERT_TRUE(full.ok());
    std::vector<Batch> drawn;
    for (int step = 0; step < 40; ++step)
      for (int j = 0; j < 4; ++j) {
        auto b = full->batch(step, j);
        ASSERT_TRUE(b.ok());
        drawn.push_back(std::move(b).value());
      }
    // A resumed run starts cold at step 23; another draws backwards; both see the same batches.
    auto resumed = DataLoader::create(file, 16, 3, 4, order, 99);
    auto backwards = DataLoader::create(file, 16, 3, 4, order, 99);
    ASSERT_TRUE(resumed.ok() && backwards.ok());
    for (int step = 23; step < 40; ++step)
      for (int j = 0; j < 4; ++j) {
        auto b = resumed->batch(step, j);
        ASSERT_TRUE(b.ok());
        EXPECT_EQ(b->inputs, drawn[static_cast<size_t>(step * 4 + j)].inputs) << data_order_name(order) << " " << step;
        EXPECT_EQ(b->targets, drawn[static_cast<size_t>(step * 4 + j)].targets);
      }
    for (int step = 39; step >= 0; step -= 3) {
      auto b = backwards->batch(step, 3 - step % 4);
      ASSERT_TRUE(b.ok());
      EXPECT_EQ(b->inputs, drawn[static_cast<size_t>(step * 4 + 3 - step % 4)].inputs);
    }
  }
}

TEST_F(DataFixture, HugeStepNumbersWrapWithoutOverflow) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(101)));
  auto dl = DataLoader::create(file, 10, 2, 2, DataOrder::kSequential, 1);
  ASSERT_TRUE(dl.ok());
  const int64_t step = 1'000'000'000'000'000;  // r = (4e15 + 2)*... well within int64
  auto b = dl->batch(step, 1);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const int64_t r = (step * 2 + 1) * 2;
  EXPECT_EQ(b->rows[0].file_row, r % 10);
  EXPECT_FALSE(dl->batch(INT64_MAX / 2, 0).ok());
}

// ---- formats -----------------------------------------------------------------------------------

TEST_F(DataFixture, RawU16ByExtension) {
  std::string s;
  for (uint16_t t = 0; t < 300; ++t) append_pod(s, static_cast<uint16_t>(t * 200));  // up to 59800
  write_bytes(dir / "tok.u16", s);
  auto f = TokenFile::open(dir / "tok.u16");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->format(), TokenFormat::kRawU16);
  EXPECT_EQ(f->size(), 300);
  EXPECT_EQ(f->token(299), 59800u);
  EXPECT_EQ(f->format_vocab_limit(), 65536);
}

TEST_F(DataFixture, RawU32ByExtensionAndExplicitFormat) {
  std::string s;
  for (uint32_t t = 0; t < 64; ++t) append_pod(s, 100000u + t);  // ids above 16 bits (Llama 3: 128256)
  write_bytes(dir / "tok.u32", s);
  write_bytes(dir / "tok.dat", s);
  auto f = TokenFile::open(dir / "tok.u32");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->format(), TokenFormat::kRawU32);
  EXPECT_EQ(f->token(5), 100005u);
  auto g = TokenFile::open(dir / "tok.dat", TokenFormat::kRawU32);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->size(), 64);
  auto dl = DataLoader::create(std::make_shared<const TokenFile>(std::move(g).value()), 8, 1, 1,
                               DataOrder::kSequential, 1, 128256);
  ASSERT_TRUE(dl.ok());
  auto b = dl->batch(1, 0);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->inputs, range_i32(100008, 100016));
  EXPECT_EQ(b->targets, range_i32(100009, 100017));
  // The same bytes read as u16 are another token stream: the explicit format wins over the extension.
  auto h = TokenFile::open(dir / "tok.u32", TokenFormat::kRawU16);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->size(), 128);
}

TEST_F(DataFixture, LlmcUint32Variant) {
  write_bytes(dir / "llama3.bin", llmc_bytes(iota_tokens(50, 128000), kLlmcMagicU32, 7, -1, true));
  auto f = TokenFile::open(dir / "llama3.bin");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->size(), 50);
  EXPECT_EQ(f->token(49), 128049u);
}

TEST_F(DataFixture, LlmcDetectedByMagicWithoutBinExtension) {
  write_bytes(dir / "shard_000", llmc_bytes(iota_tokens(20)));
  auto f = TokenFile::open(dir / "shard_000");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->format(), TokenFormat::kLlmc);
  EXPECT_EQ(f->size(), 20);
}

TEST_F(DataFixture, TextFileIsBytes) {
  write_bytes(dir / "LICENSE", "Hello, world!\n\xc3\xa9");  // UTF-8 é is two byte tokens
  auto f = TokenFile::open(dir / "LICENSE");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->format(), TokenFormat::kText);
  EXPECT_EQ(f->size(), 16);
  EXPECT_EQ(f->format_vocab_limit(), 256);
  EXPECT_EQ(f->token(0), static_cast<uint32_t>('H'));
  EXPECT_EQ(f->token(14), 0xC3u);
  EXPECT_EQ(f->token(15), 0xA9u);
  auto dl = DataLoader::create(std::make_shared<const TokenFile>(std::move(f).value()), 5, 1, 1,
                               DataOrder::kSequential, 1, 256);
  ASSERT_TRUE(dl.ok());
  auto b = dl->batch(0, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->inputs, (std::vector<int32_t>{'H', 'e', 'l', 'l', 'o'}));
  EXPECT_EQ(b->targets, (std::vector<int32_t>{'e', 'l', 'l', 'o', ','}));
}

TEST_F(DataFixture, FormatNamesParse) {
  for (auto f : {TokenFormat::kAuto, TokenFormat::kLlmc, TokenFormat::kRawU16, TokenFormat::kRawU32, TokenFormat::kText}) {
    auto p = parse_token_format(token_format_name(f));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, f);
  }
  EXPECT_FALSE(parse_token_format("uint16").ok());
  EXPECT_EQ(*parse_data_order("sequential"), DataOrder::kSequential);
  EXPECT_EQ(*parse_data_order("shuffled"), DataOrder::kShuffled);
  auto bad = parse_data_order("random");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(contains(bad.status().message(), "shuffled, sequential"));
}

// ---- errors ------------------------------------------------------------------------------------

TEST_F(DataFixture, BadMagicIsCorrupt) {
  write_bytes(dir / "bad.bin", llmc_bytes(iota_tokens(10), 12345));
  auto f = TokenFile::open(dir / "bad.bin");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(f.status().message(), "bad.bin")) << f.status().message();
  EXPECT_TRUE(contains(f.status().message(), "20240520")) << f.status().message();
  // An explicit llmc format refuses a file without the magic, whatever its name.
  write_bytes(dir / "plain.txt", std::string(2000, 'a'));
  EXPECT_EQ(TokenFile::open(dir / "plain.txt", TokenFormat::kLlmc).status().code(), StatusCode::kCorrupt);
}

TEST_F(DataFixture, BadVersionIsUnsupported) {
  write_bytes(dir / "v2.bin", llmc_bytes(iota_tokens(10), kLlmcMagicU16, 2));
  auto f = TokenFile::open(dir / "v2.bin");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnsupported);
  EXPECT_TRUE(contains(f.status().message(), "v2.bin"));
  EXPECT_TRUE(contains(f.status().message(), "expected version 1")) << f.status().message();
}

TEST_F(DataFixture, HeaderCountDisagreeingWithSizeIsCorrupt) {
  // The header claims more tokens than the file holds: a truncated file.
  write_bytes(dir / "short.bin", llmc_bytes(iota_tokens(999), kLlmcMagicU16, 1, 1000));
  auto f = TokenFile::open(dir / "short.bin");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(f.status().message(), "truncated")) << f.status().message();
  EXPECT_TRUE(contains(f.status().message(), "1000 tokens")) << f.status().message();
  // Fewer tokens claimed than present.
  write_bytes(dir / "long.bin", llmc_bytes(iota_tokens(1000), kLlmcMagicU16, 1, 500));
  auto g = TokenFile::open(dir / "long.bin");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(g.status().message(), "long.bin"));
  // A negative count.
  write_bytes(dir / "neg.bin", llmc_bytes({}, kLlmcMagicU16, 1, 0x80000000ll));
  EXPECT_EQ(TokenFile::open(dir / "neg.bin").status().code(), StatusCode::kCorrupt);
}

TEST_F(DataFixture, TruncatedHeaderIsCorrupt) {
  std::string s = llmc_bytes(iota_tokens(10));
  write_bytes(dir / "cut.bin", s.substr(0, 600));
  auto f = TokenFile::open(dir / "cut.bin");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(f.status().message(), "1024 bytes")) << f.status().message();
}

TEST_F(DataFixture, RawFileWithPartialTokenIsCorrupt) {
  write_bytes(dir / "odd.u16", std::string(7, '\0'));
  auto f = TokenFile::open(dir / "odd.u16");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(f.status().message(), "odd.u16"));
  write_bytes(dir / "odd.u32", std::string(10, '\0'));
  EXPECT_EQ(TokenFile::open(dir / "odd.u32").status().code(), StatusCode::kCorrupt);
}

TEST_F(DataFixture, TokenAtOrAboveVocabIsRefused) {
  std::vector<uint32_t> tokens = iota_tokens(100);
  tokens[57] = 5000;
  write_bytes(dir / "vocab.bin", llmc_bytes(tokens));
  auto file = open_shared(dir / "vocab.bin");
  ASSERT_TRUE(file);
  // Eager check over the whole file.
  Status eager = file->check_vocab(1000);
  ASSERT_FALSE(eager.ok());
  EXPECT_EQ(eager.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(eager.message(), "vocab.bin")) << eager.message();
  EXPECT_TRUE(contains(eager.message(), "5000")) << eager.message();
  EXPECT_TRUE(contains(eager.message(), "position 57")) << eager.message();
  EXPECT_TRUE(contains(eager.message(), "vocab_size 1000")) << eager.message();
  EXPECT_TRUE(file->check_vocab(5001).ok());
  EXPECT_FALSE(file->check_vocab(5000).ok());  // ids must be < vocab_size
  // Per batch: only the batch that reads position 57 fails (inputs of row 5 or target of row 4).
  auto dl = DataLoader::create(file, 10, 1, 1, DataOrder::kSequential, 1, 1000);
  ASSERT_TRUE(dl.ok());
  EXPECT_TRUE(dl->batch(4, 0).ok());  // row 4: tokens 40..50
  auto bad = dl->batch(5, 0);         // row 5: tokens 50..60
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(contains(bad.status().message(), "position 57"));
  // A row whose only bad token is its last target is refused too.
  tokens = iota_tokens(100);
  tokens[60] = 1000;
  auto mem = std::make_shared<const TokenFile>(TokenFile::from_tokens(tokens, "mem"));
  auto dl2 = DataLoader::create(mem, 10, 1, 1, DataOrder::kSequential, 1, 1000);
  ASSERT_TRUE(dl2.ok());
  EXPECT_FALSE(dl2->batch(5, 0).ok());
  // Text bytes against a model smaller than 256.
  write_bytes(dir / "hi.txt", "zzzzzzzz");
  auto txt = DataLoader::create(open_shared(dir / "hi.txt"), 4, 1, 1, DataOrder::kSequential, 1, 100);
  ASSERT_TRUE(txt.ok());
  EXPECT_FALSE(txt->batch(0, 0).ok());
}

TEST_F(DataFixture, U32TokensBeyondInt32AreRefusedWithoutVocab) {
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens({1, 2, 0x80000000u, 4}, "big"));
  auto dl = DataLoader::create(file, 2, 1, 1, DataOrder::kSequential, 1);
  ASSERT_TRUE(dl.ok());
  EXPECT_FALSE(dl->batch(1, 0).ok());
}

TEST_F(DataFixture, TooSmallDataSaysHowManyTokensAreNeeded) {
  write_bytes(dir / "tiny.txt", "0123456789");  // 10 tokens
  auto file = open_shared(dir / "tiny.txt");
  auto dl = DataLoader::create(file, 10, 1, 1, DataOrder::kSequential, 1);
  ASSERT_FALSE(dl.ok());
  EXPECT_EQ(dl.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(dl.status().message(), "tiny.txt")) << dl.status().message();
  EXPECT_TRUE(contains(dl.status().message(), "holds 10 tokens")) << dl.status().message();
  EXPECT_TRUE(contains(dl.status().message(), "at least 11")) << dl.status().message();
  EXPECT_TRUE(DataLoader::create(file, 9, 1, 1, DataOrder::kSequential, 1).ok());
  write_bytes(dir / "empty.txt", "");
  auto empty = open_shared(dir / "empty.txt");
  ASSERT_TRUE(empty);
  EXPECT_EQ(empty->size(), 0);
  EXPECT_FALSE(DataLoader::create(empty, 1, 1, 1, DataOrder::kShuffled, 1).ok());
}

TEST_F(DataFixture, MissingFileAndBadArguments) {
  auto f = TokenFile::open(dir / "nope.bin");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(f.status().message(), "nope.bin"));
  EXPECT_EQ(TokenFile::open(dir.path()).status().code(), StatusCode::kInvalidArgument);

  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(iota_tokens(100)));
  EXPECT_FALSE(DataLoader::create(file, 0, 1, 1, DataOrder::kSequential, 1).ok());
  EXPECT_FALSE(DataLoader::create(file, 4, 0, 1, DataOrder::kSequential, 1).ok());
  EXPECT_FALSE(DataLoader::create(file, 4, 1, 0, DataOrder::kSequential, 1).ok());
  EXPECT_FALSE(DataLoader::create(nullptr, 4, 1, 1, DataOrder::kSequential, 1).ok());
  auto dl = DataLoader::create(file, 4, 1, 2, DataOrder::kSequential, 1);
  ASSERT_TRUE(dl.ok());
  EXPECT_EQ(dl->batch(0, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dl->batch(-1, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dl->batch(0, -1).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(DataFixture, TokenFileMovesKeepTheirTokens) {
  write_bytes(dir / "m.bin", llmc_bytes(iota_tokens(30)));
  auto f = TokenFile::open(dir / "m.bin");
  ASSERT_TRUE(f.ok());
  TokenFile a = std::move(f).value();
  TokenFile b = TokenFile::from_tokens({9, 8, 7});
  b = std::move(a);
  EXPECT_EQ(b.size(), 30);
  EXPECT_EQ(b.token(29), 29u);
  TokenFile c = TokenFile::from_tokens({9, 8, 7});
  TokenFile d = std::move(c);
  EXPECT_EQ(d.token(2), 7u);
}

// ---- the content fingerprint a checkpoint records --------------------------------------------

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

TEST_F(DataFixture, AFingerprintIsTheXxh64OfTheTokensAsStoredAndOfAPreparedDatasetsTokensThenMask) {
  // A u16 token file: 2 bytes per token, as on disk (the llm.c header is not part of it).
  const auto toks = iota_tokens(5000, 7);
  write_bytes(dir / "f.bin", llmc_bytes(toks));
  auto f = TokenFile::open(dir / "f.bin");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::vector<uint16_t> u16(toks.begin(), toks.end());
  auto loader = DataLoader::create(std::make_shared<const TokenFile>(std::move(*f)), 16, 2, 1, DataOrder::kSequential, 1);
  ASSERT_TRUE(loader.ok());
  EXPECT_EQ(loader->source_fingerprint(), "xxh64:" + hex(xxh64(u16.data(), 2 * u16.size())));
  // One token changed: another fingerprint; the same tokens in memory as uint32: the uint32 bytes.
  auto changed = toks;
  changed[4321] += 1;
  auto other = DataLoader::create(std::make_shared<const TokenFile>(TokenFile::from_tokens(changed)), 16, 2, 1,
                                  DataOrder::kSequential, 1);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->source_fingerprint(), "xxh64:" + hex(xxh64(changed.data(), 4 * changed.size())));

  // A prepared dataset: its tokens (uint32), then its mask (one byte per token), hashed in one stream.
  data::SequenceRows rows;
  for (int k = 0; k < 3 * 17; ++k) {
    rows.tokens.push_back(static_cast<uint32_t>(k * 37 % 256));
    rows.mask.push_back(k % 3 != 0);
  }
  data::SequenceHeader h;
  h.seq_len = 16;
  h.vocab_size = 256;
  h.packing = "pad";
  h.train_on = "answer";
  ASSERT_TRUE(data::write_sequence_file(dir / "p.mtseq", h, rows).ok());
  auto seq = data::SequenceFile::open(dir / "p.mtseq");
  ASSERT_TRUE(seq.ok()) << seq.status().to_string();
  DataLoaderOptions o;
  o.seq_len = 16;
  auto prepared = DataLoader::create(std::make_shared<const data::SequenceFile>(std::move(*seq)), o);
  ASSERT_TRUE(prepared.ok()) << prepared.status().to_string();
  Xxh64 x;
  x.update(rows.tokens.data(), 4 * rows.tokens.size());
  x.update(rows.mask.data(), rows.mask.size());
  EXPECT_EQ(prepared->source_fingerprint(), "xxh64:" + hex(x.digest()));
  EXPECT_EQ(content_fingerprint({{reinterpret_cast<const uint8_t*>(rows.tokens.data()), 4 * rows.tokens.size()},
                                 {rows.mask.data(), rows.mask.size()}}),
            prepared->source_fingerprint());
}

TEST_F(DataFixture, AboveTheWholeLimitAFingerprintSamples64WindowsAndTheSize) {
  // 8 MiB in two parts, fingerprinted as if the whole-content limit were 1 MiB: 64 windows of
  // 64 KiB about 129 KiB apart.
  std::vector<uint8_t> bytes(8 << 20);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  const std::vector<ByteRange> parts = {{bytes.data(), 1000003}, {bytes.data() + 1000003, bytes.size() - 1000003}};
  const uint64_t total = bytes.size(), window = 64 << 10, span = total - window;
  Xxh64 x;  // by hand: window w starts at floor(span * w / 63)
  for (uint64_t w = 0; w < 64; ++w) x.update(bytes.data() + span * w / 63, window);
  x.update(&total, 8);
  const std::string fp = content_fingerprint(parts, 1 << 20);
  EXPECT_EQ(fp, "xxh64-sampled-64x64KiB:" + hex(x.digest()));
  // Within the limit: the whole content, in order across the parts.
  EXPECT_EQ(content_fingerprint(parts, total), "xxh64:" + hex(xxh64(bytes.data(), bytes.size())));
  // A byte in a window (the last, which ends at the last byte) changes it; one between windows does not.
  bytes.back() ^= 1;
  EXPECT_NE(content_fingerprint(parts, 1 << 20), fp);
  bytes.back() ^= 1;
  const uint64_t gap = window + (span / 63 - window) / 2;  // between window 0's end and window 1's start
  ASSERT_LT(window, gap);
  ASSERT_LT(gap, span / 63);
  bytes[gap] ^= 1;
  EXPECT_EQ(content_fingerprint(parts, 1 << 20), fp);
}

}  // namespace
}  // namespace megatrain::exec

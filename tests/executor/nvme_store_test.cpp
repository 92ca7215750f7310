// exec::NvmeStore: round trips on both engines, the striping formula checked on the files, several
// threads at once, and the failures the header promises to name (a flipped byte, a truncated file,
// bad directories, a file-size limit, a full drive).
#include "megatrain/executor/nvme_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "executor/faulty_io.h"
#include "executor/file_test_util.h"

namespace megatrain::exec {
namespace {

namespace fs = std::filesystem;
using test::ScratchDir;

constexpr int64_t KiB = 1024, MiB = 1024 * 1024;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buf = std::unique_ptr<uint8_t, FreeDeleter>;

Buf aligned(int64_t bytes) {
  const int64_t n = std::max<int64_t>(kNvmeAlignment, (bytes + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment);
  return Buf(static_cast<uint8_t*>(std::aligned_alloc(static_cast<size_t>(kNvmeAlignment), static_cast<size_t>(n))));
}

// A buffer of region r's capacity, every byte (the padding after region_bytes too) from `seed`.
Buf random_region(const NvmeStore& s, int64_t r, uint64_t seed) {
  const int64_t cap = s.region_capacity(r);
  Buf b = aligned(cap);
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i + 8 <= cap; i += 8) {
    const uint64_t x = g();
    std::memcpy(b.get() + i, &x, 8);
  }
  return b;
}

Buf filled(const NvmeStore& s, int64_t r, uint8_t byte) {
  Buf b = aligned(s.region_capacity(r));
  std::memset(b.get(), byte, static_cast<size_t>(s.region_capacity(r)));
  return b;
}

bool all_zero(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (p[i] != 0) return false;
  return true;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

NvmeStoreOptions options(std::vector<fs::path> dirs, int64_t block, int qd, bool pool) {
  NvmeStoreOptions o;
  o.dirs = std::move(dirs);
  o.block_bytes = block;
  o.queue_depth = qd;
  o.force_thread_pool = pool;
  return o;
}

std::unique_ptr<NvmeStore> make_store(const NvmeStoreOptions& o, const std::vector<int64_t>& regions) {
  auto s = NvmeStore::create(o, regions);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(s).value() : nullptr;
}

// The first logical block of region r: the regions lie end to end, each in whole blocks.
int64_t first_block(const NvmeStore& s, int64_t r) {
  int64_t k = 0;
  for (int64_t i = 0; i < r; ++i) k += s.region_capacity(i) / s.block_bytes();
  return k;
}

// Where the byte at `offset` in region r lives: the file (k % D) and the offset in it ((k / D) x block).
struct Place {
  fs::path file;
  int64_t offset;
};
Place place_of(const NvmeStore& s, int64_t r, int64_t offset) {
  const int64_t D = static_cast<int64_t>(s.files().size());
  const int64_t k = first_block(s, r) + offset / s.block_bytes();
  return {s.files()[static_cast<size_t>(k % D)], (k / D) * s.block_bytes() + offset % s.block_bytes()};
}

// Flips one byte on the drive under the page cache: O_DIRECT read of its aligned 4 KiB, flip, O_DIRECT write.
void flip_byte_on_disk(const fs::path& file, int64_t offset) {
  const int fd = ::open(file.c_str(), O_RDWR | O_DIRECT);
  ASSERT_GE(fd, 0) << file << ": " << std::strerror(errno);
  const int64_t base = offset / kNvmeAlignment * kNvmeAlignment;
  Buf b = aligned(kNvmeAlignment);
  ASSERT_EQ(::pread(fd, b.get(), kNvmeAlignment, base), kNvmeAlignment) << std::strerror(errno);
  b.get()[offset - base] ^= 0x20;
  ASSERT_EQ(::pwrite(fd, b.get(), kNvmeAlignment, base), kNvmeAlignment) << std::strerror(errno);
  ::close(fd);
}

using test::TmpfsMount;

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  return out;
}

// ---- round trips ---------------------------------------------------------------------------------

TEST(NvmeStore, RoundTripsOddRegionsOnBothEnginesAtEveryBlockSizeAndQueueDepth) {
  const std::vector<int64_t> sizes = {5000, 3 * MiB + 17, 1 * MiB, 12345};  // the last is never written
  for (bool pool : {false, true})
    for (int64_t block : {64 * KiB, 1 * MiB})
      for (int qd : {1, 8}) {
        SCOPED_TRACE((pool ? "thread pool" : "io_uring") + std::string(", block ") + std::to_string(block) + ", qd " +
                     std::to_string(qd));
        ScratchDir dir("nvme-rt");
        auto s = make_store(options({dir.path()}, block, qd, pool), sizes);
        ASSERT_TRUE(s);
        ASSERT_EQ(s->regions(), 4);
        for (int64_t r = 0; r < 4; ++r) {
          EXPECT_EQ(s->region_bytes(r), sizes[static_cast<size_t>(r)]);
          EXPECT_EQ(s->region_capacity(r), (sizes[static_cast<size_t>(r)] + block - 1) / block * block);
        }
        EXPECT_EQ(s->block_bytes(), block);
        EXPECT_EQ(s->queue_depth(), qd);
        ASSERT_EQ(s->files().size(), 1u);
        EXPECT_TRUE(fs::exists(s->files()[0]));

        std::vector<Buf> written;
        for (int64_t r = 0; r < 3; ++r) {
          written.push_back(random_region(*s, r, 100 + static_cast<uint64_t>(r)));
          ASSERT_TRUE(s->write(r, written.back().get()).ok());
        }
        for (int64_t r = 0; r < 3; ++r) {
          Buf got = filled(*s, r, 0xAB);
          const Status st = s->read(r, got.get());
          ASSERT_TRUE(st.ok()) << st.to_string();
          EXPECT_EQ(std::memcmp(got.get(), written[static_cast<size_t>(r)].get(), static_cast<size_t>(s->region_bytes(r))), 0)
              << "region " << r;
        }
        // Never written: zeros over the whole capacity (the buffer held 0xAB).
        Buf never = filled(*s, 3, 0xAB);
        ASSERT_TRUE(s->read(3, never.get()).ok());
        EXPECT_TRUE(all_zero(never.get(), s->region_capacity(3)));
        // reset: zeros again, the other regions untouched; a new write after it reads back.
        s->reset(1);
        Buf after = filled(*s, 1, 0xCD);
        ASSERT_TRUE(s->read(1, after.get()).ok());
        EXPECT_TRUE(all_zero(after.get(), s->region_capacity(1)));
        Buf zero_again = filled(*s, 0, 0xCD);
        ASSERT_TRUE(s->read(0, zero_again.get()).ok());
        EXPECT_EQ(std::memcmp(zero_again.get(), written[0].get(), 5000), 0);
        Buf fresh = random_region(*s, 1, 999);
        ASSERT_TRUE(s->write(1, fresh.get()).ok());
        ASSERT_TRUE(s->read(1, after.get()).ok());
        EXPECT_EQ(std::memcmp(after.get(), fresh.get(), static_cast<size_t>(s->region_bytes(1))), 0);
      }
}

TEST(NvmeStore, FilesAreRemovedByTheDestructor) {
  ScratchDir dir("nvme-rm");
  fs::path file;
  {
    auto s = make_store(options({dir.path()}, 64 * KiB, 4, false), {100000});
    ASSERT_TRUE(s);
    file = s->files()[0];
    EXPECT_EQ(file.parent_path(), dir.path());
    EXPECT_TRUE(fs::exists(file));
  }
  EXPECT_FALSE(fs::exists(file));
  EXPECT_TRUE(entries(dir.path()).empty());
}

// Two stores of one process over one directory (the same file prefix): neither may truncate,
// overwrite or remove the other's file.
TEST(NvmeStore, TwoStoresInOneDirectoryKeepSeparateFiles) {
  ScratchDir dir("nvme-two");
  auto a = make_store(options({dir.path()}, 64 * KiB, 4, false), {300000});
  ASSERT_TRUE(a);
  Buf wa = random_region(*a, 0, 11);
  ASSERT_TRUE(a->write(0, wa.get()).ok());
  {
    auto b = make_store(options({dir.path()}, 64 * KiB, 4, false), {300000});
    ASSERT_TRUE(b);
    EXPECT_NE(a->files()[0], b->files()[0]) << "both stores use " << a->files()[0];
    Buf wb = random_region(*b, 0, 12);
    ASSERT_TRUE(b->write(0, wb.get()).ok());
  }
  EXPECT_TRUE(fs::exists(a->files()[0])) << "destroying the second store removed the first one's file";
  Buf got = filled(*a, 0, 0);
  const Status st = a->read(0, got.get());
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(std::memcmp(got.get(), wa.get(), 300000), 0);
}

TEST(NvmeStore, EmptyRegionsTransferNothing) {
  ScratchDir dir("nvme-empty");
  for (bool pool : {false, true}) {
    auto s = make_store(options({dir.path()}, 64 * KiB, 4, pool), {0, 5000, 0});
    ASSERT_TRUE(s);
    EXPECT_EQ(s->region_capacity(0), 0);
    EXPECT_EQ(s->region_capacity(1), 64 * KiB);
    Buf b = random_region(*s, 1, 5);
    EXPECT_TRUE(s->write(0, b.get()).ok());
    EXPECT_TRUE(s->read(2, b.get()).ok());
    ASSERT_TRUE(s->write(1, b.get()).ok());
    Buf got = filled(*s, 1, 0);
    ASSERT_TRUE(s->read(1, got.get()).ok());
    EXPECT_EQ(std::memcmp(got.get(), b.get(), 5000), 0);
  }
}

TEST(NvmeStore, RejectsUnalignedBuffersAndUnknownRegions) {
  ScratchDir dir("nvme-args");
  auto s = make_store(options({dir.path()}, 64 * KiB, 4, false), {100000});
  ASSERT_TRUE(s);
  Buf b = aligned(s->region_capacity(0) + kNvmeAlignment);
  EXPECT_EQ(s->write(0, b.get() + 512).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->read(0, b.get() + 512).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->read(1, b.get()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->write(-1, b.get()).code(), StatusCode::kInvalidArgument);
}

TEST(NvmeStore, RejectsBadOptions) {
  ScratchDir dir("nvme-opt");
  EXPECT_EQ(NvmeStore::create(options({}, 64 * KiB, 4, false), {4096}).status().code(), StatusCode::kInvalidArgument);
  const Status block = NvmeStore::create(options({dir.path()}, 1000, 4, false), {4096}).status();
  EXPECT_EQ(block.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(block.message(), "4096")) << block.message();
  EXPECT_EQ(NvmeStore::create(options({dir.path()}, 64 * KiB, 0, false), {4096}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(entries(dir.path()).empty());
}

// ---- striping ------------------------------------------------------------------------------------

TEST(NvmeStore, StripesLogicalBlockKToFileKModDAtOffsetKDivDTimesBlock) {
  const int64_t block = 64 * KiB;
  const std::vector<int64_t> sizes = {MiB + 100, 700000, 2 * MiB, 3 * block};
  for (int D : {2, 3}) {
    SCOPED_TRACE(std::to_string(D) + " directories");
    std::vector<std::unique_ptr<ScratchDir>> dirs;
    std::vector<fs::path> paths;
    for (int d = 0; d < D; ++d) {
      dirs.push_back(std::make_unique<ScratchDir>("nvme-stripe"));
      paths.push_back(dirs.back()->path());
    }
    auto s = make_store(options(paths, block, 8, false), sizes);
    ASSERT_TRUE(s);
    ASSERT_EQ(s->files().size(), static_cast<size_t>(D));
    for (int d = 0; d < D; ++d) {
      EXPECT_EQ(s->files()[static_cast<size_t>(d)].parent_path(), paths[static_cast<size_t>(d)]);
      EXPECT_EQ(entries(paths[static_cast<size_t>(d)]).size(), 1u);
    }
    int64_t blocks = 0;
    for (int64_t r = 0; r < s->regions(); ++r) blocks += s->region_capacity(r) / block;
    EXPECT_EQ(s->total_bytes(), blocks * block);
    for (int d = 0; d < D; ++d) {
      // File d holds blocks d, d + D, d + 2D, ...: ceil((blocks - d) / D) of them.
      const auto size = static_cast<int64_t>(fs::file_size(s->files()[static_cast<size_t>(d)]));
      EXPECT_EQ(size, (blocks - d + D - 1) / D * block) << s->files()[static_cast<size_t>(d)];
      EXPECT_LE(std::abs(size - s->total_bytes() / D), block);
    }

    std::vector<Buf> written;
    for (int64_t r = 0; r < s->regions(); ++r) {
      written.push_back(random_region(*s, r, 7000 + static_cast<uint64_t>(r) + 100 * static_cast<uint64_t>(D)));
      ASSERT_TRUE(s->write(r, written.back().get()).ok());
    }
    std::vector<uint8_t> raw(static_cast<size_t>(block));
    for (int64_t r = 0; r < s->regions(); ++r) {
      Buf got = filled(*s, r, 0);
      ASSERT_TRUE(s->read(r, got.get()).ok());
      EXPECT_EQ(std::memcmp(got.get(), written[static_cast<size_t>(r)].get(), static_cast<size_t>(s->region_bytes(r))), 0);
      // Every block of the region, read straight from the file the formula names.
      for (int64_t i = 0; i < s->region_capacity(r) / block; ++i) {
        const Place p = place_of(*s, r, i * block);
        const int fd = ::open(p.file.c_str(), O_RDONLY);
        ASSERT_GE(fd, 0) << p.file;
        const ssize_t n = ::pread(fd, raw.data(), static_cast<size_t>(block), p.offset);
        ::close(fd);
        ASSERT_EQ(n, block) << p.file << " at " << p.offset;
        EXPECT_EQ(std::memcmp(raw.data(), written[static_cast<size_t>(r)].get() + i * block, static_cast<size_t>(block)), 0)
            << "region " << r << " block " << i << " is not in " << p.file << " at byte " << p.offset;
      }
    }
  }
}

// ---- engines -------------------------------------------------------------------------------------

TEST(NvmeStore, ThreadPoolWritesTheSameBytesAsIoUring) {
  const std::vector<int64_t> sizes = {300000, 2 * MiB + 5, 4096};
  ScratchDir a1("nvme-uring"), a2("nvme-uring"), b1("nvme-pool"), b2("nvme-pool");
  auto uring = make_store(options({a1.path(), a2.path()}, 64 * KiB, 8, false), sizes);
  auto pool = make_store(options({b1.path(), b2.path()}, 64 * KiB, 8, true), sizes);
  ASSERT_TRUE(uring && pool);
  EXPECT_FALSE(pool->uses_io_uring());
  EXPECT_TRUE(contains(pool->engine(), "thread pool")) << pool->engine();
  if (uring->uses_io_uring()) {
    EXPECT_TRUE(contains(uring->engine(), "io_uring")) << uring->engine();
    EXPECT_FALSE(contains(uring->engine(), "thread pool")) << uring->engine();
  } else {
    // io_uring refused here (an old kernel, a seccomp filter): the engine must say so and why.
    EXPECT_TRUE(contains(uring->engine(), "thread pool")) << uring->engine();
    EXPECT_TRUE(contains(uring->engine(), "io_uring")) << uring->engine();
  }
  for (int64_t r = 0; r < 3; ++r) {
    Buf b = random_region(*uring, r, 31 + static_cast<uint64_t>(r));
    ASSERT_TRUE(uring->write(r, b.get()).ok());
    ASSERT_TRUE(pool->write(r, b.get()).ok());
  }
  for (size_t f = 0; f < 2; ++f)
    EXPECT_TRUE(test::read_bytes(uring->files()[f]) == test::read_bytes(pool->files()[f])) << "file " << f << " differs";
  for (int64_t r = 0; r < 3; ++r) {
    Buf x = filled(*uring, r, 1), y = filled(*pool, r, 2);
    ASSERT_TRUE(uring->read(r, x.get()).ok());
    ASSERT_TRUE(pool->read(r, y.get()).ok());
    EXPECT_EQ(std::memcmp(x.get(), y.get(), static_cast<size_t>(uring->region_capacity(r))), 0) << "region " << r;
  }
}

// ---- concurrency ---------------------------------------------------------------------------------

TEST(NvmeStore, FourThreadsTransferTheirOwnRegionsAtOnce) {
  constexpr int kThreads = 4, kPerThread = 3, kRounds = 4;
  std::vector<int64_t> sizes;
  for (int i = 0; i < kThreads * kPerThread; ++i) sizes.push_back(MiB + 4096 * i + 3 * i);
  for (bool pool : {false, true}) {
    SCOPED_TRACE(pool ? "thread pool" : "io_uring");
    ScratchDir d1("nvme-mt"), d2("nvme-mt");
    auto s = make_store(options({d1.path(), d2.path()}, 64 * KiB, 8, pool), sizes);
    ASSERT_TRUE(s);
    std::atomic<int> bad_status{0}, bad_bytes{0};
    std::vector<std::string> first_error(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        for (int round = 0; round < kRounds; ++round)
          for (int j = 0; j < kPerThread; ++j) {
            const int64_t r = t * kPerThread + j;
            Buf w = random_region(*s, r, static_cast<uint64_t>(1000 * round + r));
            Buf got = filled(*s, r, 0x55);
            const Status ws = s->write(r, w.get());
            const Status rs = ws.ok() ? s->read(r, got.get()) : ws;
            if (!rs.ok()) {
              ++bad_status;
              if (first_error[static_cast<size_t>(t)].empty()) first_error[static_cast<size_t>(t)] = rs.to_string() + "\n";
              continue;
            }
            if (std::memcmp(w.get(), got.get(), static_cast<size_t>(s->region_bytes(r))) != 0) ++bad_bytes;
          }
      });
    for (auto& th : threads) th.join();
    EXPECT_EQ(bad_status.load(), 0) << first_error[0] << first_error[1] << first_error[2] << first_error[3];
    EXPECT_EQ(bad_bytes.load(), 0);
  }
}

// ---- damage on the drive -------------------------------------------------------------------------

TEST(NvmeStore, FlippedByteOnTheDriveFailsTheReadAsCorrupt) {
  for (bool pool : {false, true}) {
    SCOPED_TRACE(pool ? "thread pool" : "io_uring");
    ScratchDir dir("nvme-flip");
    auto s = make_store(options({dir.path()}, 64 * KiB, 8, pool), {200000, 300000});
    ASSERT_TRUE(s);
    Buf a = random_region(*s, 0, 1), b = random_region(*s, 1, 2);
    ASSERT_TRUE(s->write(0, a.get()).ok());
    ASSERT_TRUE(s->write(1, b.get()).ok());
    const Place p = place_of(*s, 1, 150001);
    flip_byte_on_disk(p.file, p.offset);
    Buf got = filled(*s, 1, 0);
    const Status st = s->read(1, got.get());
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
    EXPECT_TRUE(contains(st.message(), p.file.string())) << st.message();
    EXPECT_TRUE(contains(st.message(), "checksum")) << st.message();
    EXPECT_TRUE(contains(st.message(), "region 1")) << st.message();
    // The damage is that block's alone: region 0 still reads back.
    Buf other = filled(*s, 0, 0);
    ASSERT_TRUE(s->read(0, other.get()).ok());
    EXPECT_EQ(std::memcmp(other.get(), a.get(), 200000), 0);
  }
}

TEST(NvmeStore, TruncatedFileFailsTheReadNamingTheFile) {
  for (bool pool : {false, true}) {
    SCOPED_TRACE(pool ? "thread pool" : "io_uring");
    ScratchDir dir("nvme-trunc");
    auto s = make_store(options({dir.path()}, 64 * KiB, 8, pool), {MiB, MiB});
    ASSERT_TRUE(s);
    for (int64_t r = 0; r < 2; ++r) {
      Buf b = random_region(*s, r, 50 + static_cast<uint64_t>(r));
      ASSERT_TRUE(s->write(r, b.get()).ok());
    }
    const fs::path file = s->files()[0];
    const int fd = ::open(file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, MiB + 100000), 0);  // region 1 loses most of its blocks, one partly
    ::close(fd);
    Buf got = filled(*s, 1, 0);
    const Status st = s->read(1, got.get());
    EXPECT_TRUE(st.code() == StatusCode::kCorrupt || st.code() == StatusCode::kIoError) << st.to_string();
    EXPECT_TRUE(contains(st.message(), file.string())) << st.message();
    EXPECT_TRUE(contains(st.message(), "region 1")) << st.message();
    Buf first = filled(*s, 0, 0);
    EXPECT_TRUE(s->read(0, first.get()).ok());
  }
}

// ---- bad directories -----------------------------------------------------------------------------

TEST(NvmeStore, RefusesAMissingDirectoryOrARegularFileBeforeCreatingAnything) {
  ScratchDir good("nvme-good");
  const fs::path missing = good.path() / "no-such-dir";
  auto r = NvmeStore::create(options({good.path(), missing}, 64 * KiB, 4, false), {MiB});
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), missing.string())) << r.status().to_string();
  EXPECT_TRUE(entries(good.path()).empty()) << "a file was created before every directory was checked";

  const fs::path file = good.path() / "a-file";
  test::write_bytes(file, "not a directory");
  auto f = NvmeStore::create(options({file}, 64 * KiB, 4, false), {MiB});
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(contains(f.status().message(), file.string())) << f.status().to_string();
  EXPECT_TRUE(contains(f.status().message(), "directory")) << f.status().to_string();
}

TEST(NvmeStore, TmpfsEitherRoundTripsOrSaysODirectIsUnsupported) {
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm here";
  const fs::path dir = fs::path("/dev/shm") / ("megatrain-nvme-shm-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    auto s = NvmeStore::create(options({dir}, 64 * KiB, 4, false), {300000});
    if (s.ok()) {
      Buf w = random_region(**s, 0, 3), got = filled(**s, 0, 0);
      ASSERT_TRUE((*s)->write(0, w.get()).ok());
      ASSERT_TRUE((*s)->read(0, got.get()).ok());
      EXPECT_EQ(std::memcmp(w.get(), got.get(), 300000), 0);
    } else {
      EXPECT_TRUE(contains(s.status().message(), "O_DIRECT")) << s.status().to_string();
      EXPECT_TRUE(contains(s.status().message(), dir.string())) << s.status().to_string();
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(NvmeStore, RefusesAReadOnlyFileSystemNamingTheDirectory) {
  ScratchDir base("nvme-ro");
  const fs::path dir = base.path() / "mnt";
  TmpfsMount m(dir, "ro,size=1m");
  if (!m.mounted()) GTEST_SKIP() << "cannot mount a read-only tmpfs here (mount refused: not root, or a container)";
  auto s = NvmeStore::create(options({dir}, 64 * KiB, 4, false), {MiB});
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.status().message(), dir.string())) << s.status().to_string();
  EXPECT_TRUE(contains(s.status().message(), "read-only")) << s.status().to_string();
}

// ---- no room -------------------------------------------------------------------------------------

TEST(NvmeStore, FileSizeLimitFailsCreateNotTheFirstWrite) {
  ScratchDir dir("nvme-fsize");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    // The child: a 4 MiB file-size limit, a 16 MiB store. Exit 0: refused as it should be.
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{4 * MiB, 4 * MiB};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) ::_exit(3);
    int code = 0;
    {
      auto s = NvmeStore::create(options({dir.path()}, 64 * KiB, 4, false), {16 * MiB});
      if (s.ok()) {
        std::fprintf(stderr, "create() succeeded under a 4 MiB file-size limit for a 16 MiB store\n");
        code = 1;
      } else {
        const Status& st = s.status();
        std::fprintf(stderr, "create() said: %s\n", st.to_string().c_str());
        const bool right_code = st.code() == StatusCode::kResourceExhausted || st.code() == StatusCode::kIoError;
        const bool says_what = contains(st.message(), dir.path().string()) &&
                               (contains(st.message(), "size") || contains(st.message(), "space"));
        code = right_code && says_what ? 0 : 2;
      }
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << " (SIGXFSZ is " << SIGXFSZ << ")";
  EXPECT_NE(WEXITSTATUS(status), 3) << "setrlimit failed in the child";
  EXPECT_NE(WEXITSTATUS(status), 1) << "create() succeeded under a file-size limit smaller than the store";
  EXPECT_NE(WEXITSTATUS(status), 2) << "create() failed without the right code, directory or 'size'/'space' (see stderr)";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(entries(dir.path()).empty()) << "the failed create() left its file behind";
}

TEST(NvmeStore, SmallDriveFailsCreateWithTheSpaceNeededAndAvailable) {
  ScratchDir base("nvme-full");
  const fs::path dir = base.path() / "mnt";
  TmpfsMount m(dir, "size=4m");
  if (!m.mounted()) GTEST_SKIP() << "cannot mount a 4 MiB tmpfs here (mount refused: not root, or a container)";
  auto s = NvmeStore::create(options({dir}, 64 * KiB, 4, false), {16 * MiB});
  ASSERT_FALSE(s.ok()) << "a 16 MiB store fitted on a 4 MiB drive";
  const std::string& msg = s.status().message();
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().to_string();
  EXPECT_TRUE(contains(msg, dir.string())) << msg;
  EXPECT_TRUE(contains(msg, "16777216") || contains(msg, "16 MiB") || contains(msg, "16.0 MiB")) << "no space needed: " << msg;
  EXPECT_TRUE(contains(msg, "free") || contains(msg, "available")) << "no space available: " << msg;
  EXPECT_TRUE(entries(dir).empty()) << "the failed create() left a file behind";
}

// Faults on the drive (issue 32; tests/executor/faulty_io.h): EIO and a short transfer at every
// block of a write and of a read, on both engines (io_uring completions; the thread pool's pwrite
// and pread). Each fails the transfer naming the store's file and what went wrong, and the store
// stays usable: the region written again reads back, the read again gives the bytes.
TEST(NvmeStore, EioAndShortTransfersAtEveryBlockFailNamingTheFileAndTheStoreGoesOn) {
  using Op = test::FaultyIo::Op;
  using Mode = test::FaultyIo::Mode;
  constexpr int64_t kBlock = 64 * KiB, kBlocks = 4;
  int faults = 0;
  for (bool pool : {false, true})
    for (Mode mode : {Mode::kErrno, Mode::kShort})
      for (bool write : {true, false})
        for (int k = 1; k <= kBlocks; ++k) {
          SCOPED_TRACE(std::string(pool ? "thread pool" : "io_uring") + (write ? ", write" : ", read") + " block " + std::to_string(k) +
                       (mode == Mode::kErrno ? ": EIO" : ": short"));
          ScratchDir dir("nvme-fault");
          auto s = make_store(options({dir.path()}, kBlock, pool ? 2 : 1, pool), {kBlocks * kBlock});
          ASSERT_TRUE(s);
          Buf data = random_region(*s, 0, 7 + static_cast<uint64_t>(k));
          if (!write) ASSERT_TRUE(s->write(0, data.get()).ok());
          test::FaultyIo io(dir.path());
          io.inject(pool ? (write ? Op::kWrite : Op::kRead) : Op::kCompletion, k, mode, EIO);
          Buf got = filled(*s, 0, 0);
          Status st;
          {
            ScopedFileIo use(io);
            st = write ? s->write(0, data.get()) : s->read(0, got.get());
          }
          if (pool && mode == Mode::kShort) {  // pwrite and pread that come back short are retried
            EXPECT_TRUE(st.ok()) << st.to_string();
          } else {
            ASSERT_TRUE(io.fired());
            ASSERT_FALSE(st.ok());
            ++faults;
            EXPECT_TRUE(contains(st.message(), s->files()[0].string())) << st.message();
            EXPECT_TRUE(contains(st.message(), mode == Mode::kErrno ? "Input/output error" : "short")) << st.message();
          }
          ASSERT_TRUE(s->write(0, data.get()).ok());
          ASSERT_TRUE(s->read(0, got.get()).ok());
          EXPECT_EQ(std::memcmp(got.get(), data.get(), static_cast<size_t>(s->region_bytes(0))), 0);
        }
  EXPECT_EQ(faults, 3 * 2 * kBlocks);
}

}  // namespace
}  // namespace megatrain::exec

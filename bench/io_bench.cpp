// megatrain-bench io: the NVMe tier's store (exec::NvmeStore) writing and reading its whole state in
// sequence, region after region, as the trainer streams it; GB/s (1e9) of each direction, median of
// R passes. The reference is fio on the same drive with the same block size and queue depth, run by
// bench/compare-fio.sh (which calls this with --json), so the ratio is measured in one run.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "megatrain/core/flags.h"
#include "megatrain/core/output_path.h"
#include "megatrain/executor/nvme_store.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace exec = megatrain::exec;

constexpr const char* kAccepted =
    "accepted: --dir D (one or more, one per drive), --file-mib N (default 2048), --block-kib K (a multiple of 4, "
    "default 1024), --queue-depth Q (1 to 4096, default 32), --thread-pool, --repeat R (default 3), --json";

double seconds_since(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size();
  return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += c;
  }
  return out;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedBuf aligned_buffer(int64_t bytes) {
  const auto n = static_cast<size_t>((bytes + exec::kNvmeAlignment - 1) / exec::kNvmeAlignment * exec::kNvmeAlignment);
  return AlignedBuf(static_cast<uint8_t*>(std::aligned_alloc(static_cast<size_t>(exec::kNvmeAlignment), std::max<size_t>(n, 4096))));
}

// The data written: an xorshift stream (nothing a drive or file system could compress or dedupe),
// with region r's number stamped into the first word of every block so no two regions are alike.
void fill(uint8_t* p, int64_t bytes) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

void tag_region(uint8_t* p, int64_t bytes, int64_t block, int64_t r) {
  for (int64_t b = 0; b + 8 <= bytes; b += block) {
    const uint64_t tag = static_cast<uint64_t>(r) * 0x100000001B3ull + static_cast<uint64_t>(b);
    std::memcpy(p + b, &tag, 8);
  }
}

int fail(const std::string& what) {
  std::fprintf(stderr, "megatrain-bench io: %s\n", what.c_str());
  return 1;
}

int io(int argc, char** argv) {
  std::vector<std::filesystem::path> dirs;
  int64_t file_mib = 2048, block_kib = 1024, queue_depth = 32, repeat = 3;
  bool thread_pool = false, json = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto number = [&](int64_t lo, int64_t hi, int64_t& out) -> bool {
      const auto v = megatrain::parse_int_flag(a, i + 1 < argc ? argv[++i] : "", lo, hi);
      if (!v.ok()) {
        std::fprintf(stderr, "megatrain-bench io: error: %s; %s\n", v.status().message().c_str(), kAccepted);
        return false;
      }
      out = *v;
      return true;
    };
    if (a == "--json") json = true;
    else if (a == "--thread-pool") thread_pool = true;
    else if (a == "--dir") {
      if (i + 1 >= argc) return fail("--dir needs a directory; " + std::string(kAccepted));
      dirs.emplace_back(argv[++i]);
    } else if (a == "--file-mib") {
      if (!number(1, int64_t{1} << 24, file_mib)) return 1;
    } else if (a == "--block-kib") {
      if (!number(4, int64_t{1} << 20, block_kib)) return 1;
      if (block_kib % 4 != 0)
        return fail("--block-kib " + std::to_string(block_kib) + " is not a multiple of 4 KiB (O_DIRECT); " + kAccepted);
    } else if (a == "--queue-depth") {
      if (!number(1, 4096, queue_depth)) return 1;
    } else if (a == "--repeat") {
      if (!number(1, 1000, repeat)) return 1;
    } else {
      return fail("unknown argument '" + a + "'; " + kAccepted);
    }
  }
  if (dirs.empty()) return fail("no --dir given; " + std::string(kAccepted));
  for (const auto& d : dirs) {
    if (megatrain::Status s = megatrain::check_output("--dir", d, megatrain::OutputKind::kExistingFolder); !s.ok())
      return fail(s.message() + "; accepted: an existing, writable directory");
  }

  // Regions of 64 MiB (rounded to whole blocks so none is padded), the last one shorter.
  const int64_t file_bytes = file_mib << 20, block = block_kib << 10;
  const int64_t region = std::max(block, ((int64_t{64} << 20) + block - 1) / block * block);
  std::vector<int64_t> sizes;
  for (int64_t left = file_bytes; left > 0; left -= region) sizes.push_back(std::min(region, left));

  exec::NvmeStoreOptions o;
  o.dirs = dirs;
  o.block_bytes = block;
  o.queue_depth = static_cast<int>(queue_depth);
  o.force_thread_pool = thread_pool;
  o.file_prefix = "megatrain-bench-io";
  auto created = exec::NvmeStore::create(o, sizes);
  if (!created.ok()) return fail(created.status().to_string());
  exec::NvmeStore& store = **created;
  const int64_t n = store.regions();
  int64_t cap = 0;
  for (int64_t r = 0; r < n; ++r) cap = std::max(cap, store.region_capacity(r));
  AlignedBuf wbuf = aligned_buffer(cap), rbuf = aligned_buffer(cap);
  if (!wbuf || !rbuf) return fail("cannot allocate two buffers of " + std::to_string(cap) + " bytes");
  fill(wbuf.get(), cap);
  std::memset(rbuf.get(), 0, static_cast<size_t>(cap));

  auto write_all = [&]() -> megatrain::Status {
    for (int64_t r = 0; r < n; ++r) {
      tag_region(wbuf.get(), store.region_capacity(r), block, r);
      megatrain::Status s = store.write(r, wbuf.get());
      if (!s.ok()) return s;
    }
    return {};
  };
  auto read_all = [&]() -> megatrain::Status {
    for (int64_t r = 0; r < n; ++r) {
      megatrain::Status s = store.read(r, rbuf.get());
      if (!s.ok()) return s;
    }
    return {};
  };

  const megatrain::bench::OtherLoad load;
  if (megatrain::Status s = write_all(); !s.ok()) return fail("warm-up write: " + s.to_string());
  std::vector<double> write_s, read_s;
  for (int64_t p = 0; p < repeat; ++p) {
    auto t0 = Clock::now();
    if (megatrain::Status s = write_all(); !s.ok()) return fail("write pass: " + s.to_string());
    write_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    if (megatrain::Status s = read_all(); !s.ok()) return fail("read pass: " + s.to_string());
    read_s.push_back(seconds_since(t0));
  }
  const double other = load.share();
  // The store verified every block's checksum; this checks the bytes themselves on the last region.
  tag_region(wbuf.get(), store.region_capacity(n - 1), block, n - 1);
  if (std::memcmp(rbuf.get(), wbuf.get(), static_cast<size_t>(store.region_bytes(n - 1))) != 0)
    return fail("region " + std::to_string(n - 1) + " read back different bytes than were written (a correctness bug)");

  const double moved = static_cast<double>(store.total_bytes());
  const double write_gbps = moved / median(write_s) * 1e-9, read_gbps = moved / median(read_s) * 1e-9;
  const std::string engine = store.engine();
  if (json) {
    std::printf("{\"read_gbps\": %.4f, \"write_gbps\": %.4f, \"file_bytes\": %lld, \"block_bytes\": %lld, "
                "\"queue_depth\": %lld, \"engine\": \"%s\", \"dirs\": %zu, \"repeat\": %lld, \"other_load\": %.3f}\n",
                read_gbps, write_gbps, static_cast<long long>(file_bytes), static_cast<long long>(block),
                static_cast<long long>(queue_depth), json_escape(engine).c_str(), dirs.size(), static_cast<long long>(repeat),
                other);
    return 0;
  }
  std::printf("megatrain-bench io: exec::NvmeStore over %zu director%s, %lld regions of up to %lld MiB written then read\n"
              "  whole, in order, one at a time; median of %lld passes after one warm-up write; GB/s = 1e9 bytes/s\n",
              dirs.size(), dirs.size() == 1 ? "y" : "ies", static_cast<long long>(n), static_cast<long long>(region >> 20),
              static_cast<long long>(repeat));
  for (const auto& f : store.files()) std::printf("  file %s\n", f.string().c_str());
  std::printf("  %-14s %10s %12s  %-40s %10s %10s\n", "bytes", "block", "queue depth", "engine", "read GB/s", "write GB/s");
  std::printf("  %-14lld %9lldK %12lld  %-40s %10.3f %10.3f\n", static_cast<long long>(file_bytes),
              static_cast<long long>(block_kib), static_cast<long long>(queue_depth), engine.c_str(), read_gbps, write_gbps);
  std::printf("  passes: read %.3f-%.3f GB/s, write %.3f-%.3f GB/s\n", moved / *std::max_element(read_s.begin(), read_s.end()) * 1e-9,
              moved / *std::min_element(read_s.begin(), read_s.end()) * 1e-9,
              moved / *std::max_element(write_s.begin(), write_s.end()) * 1e-9,
              moved / *std::min_element(write_s.begin(), write_s.end()) * 1e-9);
  std::printf("  reference: fio on the same drive, same block size and queue depth: bench/compare-fio.sh DIR\n");
  std::printf("  other processes used %.0f%% of the machine during the run%s\n", 100 * other,
              other > 0.05 ? ": the numbers are noisy, rerun when the machine is quiet" : "");
  return 0;
}

}  // namespace

int io_bench_main(int argc, char** argv) { return io(argc, argv); }

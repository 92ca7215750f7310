// The byte-plane codec for fp32 tensors (plane_codec.h): split, then zstd per plane.
#include "megatrain/executor/plane_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <zstd.h>

namespace megatrain::exec {

namespace {

static_assert(std::endian::native == std::endian::little, "the plane codec assumes a little-endian host");

constexpr uint8_t kMagic[4] = {'M', 'T', 'P', 'C'};
constexpr uint8_t kVersion = 1;
constexpr size_t kFixedHeader = 16;  // magic, version, planes, reserved, n

size_t header_bytes(int planes) { return kFixedHeader + 8 * static_cast<size_t>(planes); }

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

struct CctxFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DctxFree {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

// Splits n floats into 4 planes of n bytes each (plane k: byte k of every float).
void split_planes(const float* data, int64_t n, uint8_t* planes) {
  uint8_t* __restrict p0 = planes;
  uint8_t* __restrict p1 = planes + n;
  uint8_t* __restrict p2 = planes + 2 * n;
  uint8_t* __restrict p3 = planes + 3 * n;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, data + i, 4);
    p0[i] = static_cast<uint8_t>(u);
    p1[i] = static_cast<uint8_t>(u >> 8);
    p2[i] = static_cast<uint8_t>(u >> 16);
    p3[i] = static_cast<uint8_t>(u >> 24);
  }
}

void merge_planes(const uint8_t* planes, int64_t n, float* out) {
  const uint8_t* __restrict p0 = planes;
  const uint8_t* __restrict p1 = planes + n;
  const uint8_t* __restrict p2 = planes + 2 * n;
  const uint8_t* __restrict p3 = planes + 3 * n;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(p0[i]) | static_cast<uint32_t>(p1[i]) << 8 |
                       static_cast<uint32_t>(p2[i]) << 16 | static_cast<uint32_t>(p3[i]) << 24;
    std::memcpy(out + i, &u, 4);
  }
}

struct Header {
  int planes = 0;
  int64_t n = 0;
  uint64_t sizes[4] = {};
};

Result<Header> parse_header(const uint8_t* bytes, size_t size) {
  if (bytes == nullptr && size > 0) return invalid_argument("plane codec: null input");
  if (size < kFixedHeader)
    return corrupt("plane codec: " + std::to_string(size) + " bytes is shorter than the " + std::to_string(kFixedHeader) +
                   "-byte header (truncated)");
  if (std::memcmp(bytes, kMagic, 4) != 0) return corrupt("plane codec: bad magic (expected \"MTPC\")");
  if (bytes[4] != kVersion)
    return corrupt("plane codec: version " + std::to_string(bytes[4]) + " (this build reads version " +
                   std::to_string(kVersion) + ")");
  Header h;
  h.planes = bytes[5];
  if (h.planes != 4 && h.planes != 1)
    return corrupt("plane codec: " + std::to_string(h.planes) + " planes in the header (accepted: 4 or 1)");
  if (bytes[6] != 0 || bytes[7] != 0) return corrupt("plane codec: reserved header bytes are not zero");
  const uint64_t n = get_u64(bytes + 8);
  if (n > (uint64_t{1} << 60)) return corrupt("plane codec: element count " + std::to_string(n) + " is implausible");
  h.n = static_cast<int64_t>(n);
  const size_t head = header_bytes(h.planes);
  if (size < head)
    return corrupt("plane codec: " + std::to_string(size) + " bytes is shorter than the " + std::to_string(head) +
                   "-byte header (truncated)");
  uint64_t total = head;
  for (int k = 0; k < h.planes; ++k) {
    h.sizes[k] = get_u64(bytes + kFixedHeader + 8 * static_cast<size_t>(k));
    if (h.sizes[k] > size) return corrupt("plane codec: plane " + std::to_string(k) + " size " + std::to_string(h.sizes[k]) +
                                          " exceeds the input (" + std::to_string(size) + " bytes)");
    total += h.sizes[k];
  }
  if (total != size)
    return corrupt("plane codec: header and plane sizes add up to " + std::to_string(total) + " bytes but the input has " +
                   std::to_string(size) + (total > size ? " (truncated)" : " (trailing bytes)"));
  return h;
}

// Decompresses one frame of exactly `want` bytes into dst.
Status decode_plane(ZSTD_DCtx* d, const uint8_t* src, size_t size, uint8_t* dst, size_t want, int k) {
  const std::string which = "plane codec: plane " + std::to_string(k) + ": ";
  const size_t frame = ZSTD_findFrameCompressedSize(src, size);
  if (ZSTD_isError(frame)) return corrupt(which + "not a zstd frame (" + ZSTD_getErrorName(frame) + ")");
  if (frame != size)
    return corrupt(which + "the zstd frame is " + std::to_string(frame) + " bytes but the header gives " +
                   std::to_string(size));
  const unsigned long long content = ZSTD_getFrameContentSize(src, size);
  if (content == ZSTD_CONTENTSIZE_ERROR) return corrupt(which + "unreadable zstd frame header");
  if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != want)
    return corrupt(which + "holds " + std::to_string(content) + " bytes, expected " + std::to_string(want));
  const size_t got = ZSTD_decompressDCtx(d, dst, want, src, size);
  if (ZSTD_isError(got)) return corrupt(which + "zstd: " + ZSTD_getErrorName(got));
  if (got != want)
    return corrupt(which + "decoded to " + std::to_string(got) + " bytes, expected " + std::to_string(want));
  return {};
}

}  // namespace

size_t compress_fp32_bound(int64_t n, PlaneSplit split) {
  if (n < 0) n = 0;
  const int planes = split == PlaneSplit::kBytePlanes ? 4 : 1;
  const size_t plane_bytes = static_cast<size_t>(n) * (planes == 4 ? 1 : 4);
  return header_bytes(planes) + ZSTD_compressBound(plane_bytes) * static_cast<size_t>(planes);
}

std::vector<uint8_t> compress_fp32(const float* data, int64_t n, int level, PlaneSplit split, int threads) {
  if (n < 0) n = 0;
  const int planes = split == PlaneSplit::kBytePlanes ? 4 : 1;
  const size_t plane_bytes = static_cast<size_t>(n) * (planes == 4 ? 1 : 4);
  std::unique_ptr<uint8_t[]> split_buf;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(data);
  if (planes == 4 && n > 0) {
    split_buf.reset(new uint8_t[static_cast<size_t>(n) * 4]);
    split_planes(data, n, split_buf.get());
    src = split_buf.get();
  }
  // Each plane is one zstd frame of its own, so planes compress on separate threads, each into its
  // own bound-sized region of the output; the frames are the same whichever thread makes them.
  // Then the frames are moved together. One allocation: fresh buffers per plane cost more in page
  // faults and zeroing than zstd's level 1 takes to compress.
  const size_t bound = ZSTD_compressBound(plane_bytes);
  const size_t head = header_bytes(planes);
  std::vector<uint8_t> out(head + bound * static_cast<size_t>(planes));
  size_t frame_bytes[4] = {};
  auto compress_plane = [&](int k) {
    std::unique_ptr<ZSTD_CCtx, CctxFree> c(ZSTD_createCCtx());
    ZSTD_CCtx_setParameter(c.get(), ZSTD_c_compressionLevel, level);
    ZSTD_CCtx_setParameter(c.get(), ZSTD_c_checksumFlag, 1);
    ZSTD_CCtx_setParameter(c.get(), ZSTD_c_contentSizeFlag, 1);
    uint8_t* dst = out.data() + head + static_cast<size_t>(k) * bound;
    const uint8_t* p = src ? src + static_cast<size_t>(k) * plane_bytes : nullptr;
    size_t r = ZSTD_compress2(c.get(), dst, bound, p, plane_bytes);
    if (ZSTD_isError(r)) {
      // Cannot happen with a bound-sized buffer; a level the library rejects falls back to its default.
      ZSTD_CCtx_reset(c.get(), ZSTD_reset_session_and_parameters);
      ZSTD_CCtx_setParameter(c.get(), ZSTD_c_checksumFlag, 1);
      r = ZSTD_compress2(c.get(), dst, bound, p, plane_bytes);
    }
    frame_bytes[k] = r;
  };
  const int workers = std::max(1, std::min(threads, planes));
  if (workers == 1) {
    for (int k = 0; k < planes; ++k) compress_plane(k);
  } else {
    std::vector<std::thread> pool;
    for (int t = 1; t < workers; ++t)
      pool.emplace_back([&, t] {
        for (int k = t; k < planes; k += workers) compress_plane(k);
      });
    for (int k = 0; k < planes; k += workers) compress_plane(k);
    for (auto& th : pool) th.join();
  }
  std::memcpy(out.data(), kMagic, 4);
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(planes);
  out[6] = out[7] = 0;
  put_u64(out.data() + 8, static_cast<uint64_t>(n));
  size_t pos = head;
  for (int k = 0; k < planes; ++k) {
    put_u64(out.data() + kFixedHeader + 8 * static_cast<size_t>(k), frame_bytes[k]);
    const size_t from = head + static_cast<size_t>(k) * bound;
    if (from != pos) std::memmove(out.data() + pos, out.data() + from, frame_bytes[k]);
    pos += frame_bytes[k];
  }
  out.resize(pos);
  return out;
}

Result<int64_t> plane_codec_count(const uint8_t* bytes, size_t size) {
  MT_ASSIGN_OR_RETURN(const Header h, parse_header(bytes, size));
  return h.n;
}

Status decompress_fp32(const uint8_t* bytes, size_t size, float* out, int64_t n) {
  MT_ASSIGN_OR_RETURN(const Header h, parse_header(bytes, size));
  if (h.n != n)
    return invalid_argument("plane codec: the encoding holds " + std::to_string(h.n) + " floats, the caller expects " +
                            std::to_string(n));
  if (n > 0 && out == nullptr) return invalid_argument("plane codec: null output");
  std::unique_ptr<ZSTD_DCtx, DctxFree> d(ZSTD_createDCtx());
  const size_t head = header_bytes(h.planes);
  if (h.planes == 1) {
    // Zero-length frames still decode (to nothing) so that damage to them is caught.
    uint8_t dummy = 0;
    return decode_plane(d.get(), bytes + head, h.sizes[0], n > 0 ? reinterpret_cast<uint8_t*>(out) : &dummy,
                        static_cast<size_t>(n) * 4, 0);
  }
  std::unique_ptr<uint8_t[]> planes(new uint8_t[static_cast<size_t>(n) * 4 + 1]);
  size_t pos = head;
  for (int k = 0; k < 4; ++k) {
    MT_RETURN_IF_ERROR(decode_plane(d.get(), bytes + pos, h.sizes[k], planes.get() + static_cast<size_t>(k) * static_cast<size_t>(n),
                                    static_cast<size_t>(n), k));
    pos += h.sizes[k];
  }
  merge_planes(planes.get(), n, out);
  return {};
}

}  // namespace megatrain::exec

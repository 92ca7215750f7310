// The byte-plane codec for fp32 tensors (plane_codec.h): split, then zstd per plane.
#include "megatrain/executor/plane_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>
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

// Per-thread scratch of compress_fp32: two buffers that grow as needed and are kept between calls
// up to kKeepBytes each.
class Scratch {
 public:
  uint8_t* planes(size_t bytes) { return grow(planes_, planes_size_, bytes); }
  uint8_t* frames(size_t bytes) { return grow(frames_, frames_size_, bytes); }
  std::unique_ptr<ZSTD_CCtx, CctxFree>& context() {
    if (!ctx_) ctx_.reset(ZSTD_createCCtx());
    return ctx_;
  }
  void trim() {
    if (planes_size_ > kKeepBytes) planes_.reset(), planes_size_ = 0;
    if (frames_size_ > kKeepBytes) frames_.reset(), frames_size_ = 0;
  }
  void release() {
    planes_.reset(), frames_.reset(), ctx_.reset();
    planes_size_ = frames_size_ = 0;
  }

 private:
  static constexpr size_t kKeepBytes = size_t{64} << 20;
  static uint8_t* grow(std::unique_ptr<uint8_t[]>& buf, size_t& size, size_t bytes) {
    if (bytes > size) {
      buf.reset(new uint8_t[bytes]);  // not zeroed: every byte read is written first
      size = bytes;
    }
    return buf.get();
  }
  std::unique_ptr<uint8_t[]> planes_, frames_;
  size_t planes_size_ = 0, frames_size_ = 0;
  std::unique_ptr<ZSTD_CCtx, CctxFree> ctx_;
};

Scratch& this_thread_scratch() {
  thread_local Scratch s;
  return s;
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
  // The split planes and the frames go to this thread's scratch, kept from call to call: fresh
  // memory for every tensor cost more in page faults and zeroing than zstd took to compress
  // (measured on the dev VM). Scratch over kKeepBytes is released after the call, the rest by
  // release_plane_codec_scratch().
  Scratch& scratch = this_thread_scratch();
  struct Release {
    Scratch& s;
    ~Release() { s.trim(); }
  } release{scratch};
  const uint8_t* src = reinterpret_cast<const uint8_t*>(data);
  if (planes == 4 && n > 0) {
    uint8_t* split_buf = scratch.planes(static_cast<size_t>(n) * 4);
    split_planes(data, n, split_buf);
    src = split_buf;
  }
  // Each plane is one zstd frame. A plane of kSplitBytes or more is compressed by zstd's own
  // worker threads, cut into jobs of kJobBytes that compress in parallel: most of the time goes to
  // the sign/exponent plane (the others are noise, which zstd passes through quickly), so threads
  // must split a plane, not share out the planes. zstd makes the same frame for every number of
  // workers from 1 up, so such planes always use workers, even for threads = 1, and the bytes do
  // not depend on the thread count. Smaller planes are compressed on this thread, where workers
  // would only add their start-up.
  constexpr size_t kJobBytes = size_t{1} << 20, kSplitBytes = 2 * kJobBytes;
  const int workers = plane_bytes >= kSplitBytes ? std::max(1, threads) : 0;
  const size_t head = header_bytes(planes);
  const size_t room = compress_fp32_bound(n, split);
  uint8_t* frames = scratch.frames(room);
  // The context too is this thread's, kept between calls: with workers it holds their threads and
  // job buffers, which would otherwise be made afresh for every tensor.
  std::unique_ptr<ZSTD_CCtx, CctxFree>& c = scratch.context();
  auto configure = [&](int lvl) {
    ZSTD_CCtx_reset(c.get(), ZSTD_reset_session_and_parameters);
    ZSTD_CCtx_setParameter(c.get(), ZSTD_c_compressionLevel, lvl);
    ZSTD_CCtx_setParameter(c.get(), ZSTD_c_checksumFlag, 1);
    ZSTD_CCtx_setParameter(c.get(), ZSTD_c_contentSizeFlag, 1);
    // A library built without threads refuses workers and compresses on the caller's thread.
    if (workers > 0 && !ZSTD_isError(ZSTD_CCtx_setParameter(c.get(), ZSTD_c_nbWorkers, workers)))
      ZSTD_CCtx_setParameter(c.get(), ZSTD_c_jobSize, static_cast<int>(kJobBytes));
  };
  configure(level);
  size_t pos = head;
  for (int k = 0; k < planes; ++k) {
    const uint8_t* p = src ? src + static_cast<size_t>(k) * plane_bytes : nullptr;
    size_t r = ZSTD_compress2(c.get(), frames + pos, room - pos, p, plane_bytes);
    if (ZSTD_isError(r)) {
      // Cannot happen with a bound-sized buffer; a level the library rejects falls back to its default.
      configure(ZSTD_CLEVEL_DEFAULT);
      r = ZSTD_compress2(c.get(), frames + pos, room - pos, p, plane_bytes);
    }
    put_u64(frames + kFixedHeader + 8 * static_cast<size_t>(k), r);
    pos += r;
  }
  std::memcpy(frames, kMagic, 4);
  frames[4] = kVersion;
  frames[5] = static_cast<uint8_t>(planes);
  frames[6] = frames[7] = 0;
  put_u64(frames + 8, static_cast<uint64_t>(n));
  return std::vector<uint8_t>(frames, frames + pos);
}

void release_plane_codec_scratch() { this_thread_scratch().release(); }

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

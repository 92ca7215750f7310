// Lossless compression of fp32 tensors at rest (Adam's fp32 moments, master weights): the 4 bytes
// of every float are split into 4 byte planes (all first bytes, then all second bytes, ...), and
// each plane is compressed by zstd on its own. The planes of the sign and exponent bits are nearly
// constant within a tensor and compress well; the low mantissa bytes are close to random and
// barely compress, so the split gains over zstd on the raw bytes, which sees the 4 bytes of each
// float interleaved. Decoding gives the input back bit for bit.
//
// Encoding (all integers little-endian):
//   offset 0   magic "MTPC"
//   offset 4   u8 version (1), u8 planes (4: byte planes; 1: no split, zstd on the raw bytes),
//              u16 zero
//   offset 8   u64 n, the number of floats
//   offset 16  u64 compressed size of each plane, `planes` of them
//   then       the planes' zstd frames, in order (plane 0 holds byte 0 of each float, the least
//              significant byte on this little-endian host); each frame records its content size
//              and a checksum, so damage anywhere is caught.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::exec {

enum class PlaneSplit {
  kBytePlanes,  // the codec: 4 byte planes, each compressed on its own
  kNone,        // zstd on the raw bytes (a reference for the split; the same container)
};

// Compresses n floats at zstd `level` (1..19; the library's default is 3). Never fails: a plane
// that does not compress is stored at its zstd size (a few bytes over the raw size). `threads`
// is the number of zstd workers that compress a plane of 2 MiB or more (n >= 2^21 floats) in
// parallel jobs of 1 MiB; smaller planes compress on the caller's thread. The output is the same
// bytes for every thread count with a given libzstd; a libzstd built without threads compresses
// on the caller's thread and may differ.
std::vector<uint8_t> compress_fp32(const float* data, int64_t n, int level = 3,
                                   PlaneSplit split = PlaneSplit::kBytePlanes, int threads = 1);
// compress_fp32 keeps per-thread scratch between calls (up to 64 MiB per buffer, and its zstd
// context with any worker threads); this frees the calling thread's. Call it after a batch of
// compressions (a checkpoint) so that memory does not stay held while training.
void release_plane_codec_scratch();
// The largest encoding compress_fp32 can make of n floats.
size_t compress_fp32_bound(int64_t n, PlaneSplit split = PlaneSplit::kBytePlanes);

// The number of floats an encoding holds, read from its header (checks the magic, version, plane
// count and that the sizes add up to `size`).
Result<int64_t> plane_codec_count(const uint8_t* bytes, size_t size);

// Decodes into out[0..n). Fails with a status naming the problem (kCorrupt: bad magic, version,
// plane count or sizes, a zstd error, a checksum mismatch, a plane of the wrong length;
// kInvalidArgument: an encoding of a different n than the caller expects). `out` may be partly
// written when it fails.
Status decompress_fp32(const uint8_t* bytes, size_t size, float* out, int64_t n);
inline Status decompress_fp32(const std::vector<uint8_t>& bytes, float* out, int64_t n) {
  return decompress_fp32(bytes.data(), bytes.size(), out, n);
}

}  // namespace megatrain::exec

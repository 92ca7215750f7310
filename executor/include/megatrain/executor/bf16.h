// fp32 <-> bf16 with round-to-nearest-even (NaN stays a quiet NaN), inline because the optimizer's
// fused pass converts every parameter it writes.
#pragma once

#include <bit>
#include <cstdint>

namespace megatrain::exec {

inline uint16_t fp32_to_bf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_fp32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

}  // namespace megatrain::exec

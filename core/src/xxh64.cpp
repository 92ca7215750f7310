// XXH64, xxHash's 64-bit hash (the xxHash specification, doc/xxhash_spec.md): the checksum of
// checkpoint files, manifests and prepared datasets.
#include "megatrain/core/xxh64.h"

#include <algorithm>
#include <cstring>

namespace megatrain {

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

constexpr uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian host (x86-64)
  return v;
}
uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t xxh_round(uint64_t acc, uint64_t lane) { return rotl64(acc + lane * kP2, 31) * kP1; }
uint64_t xxh_merge(uint64_t acc, uint64_t v) { return (acc ^ xxh_round(0, v)) * kP1 + kP4; }

}  // namespace

Xxh64::Xxh64(uint64_t seed) : acc_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, seed_(seed), buf_{} {}

void Xxh64::update(const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += len;
  if (buffered_ > 0) {
    const size_t take = std::min(len, 32 - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    len -= take;
    if (buffered_ < 32) return;
    for (int i = 0; i < 4; ++i) acc_[i] = xxh_round(acc_[i], read64(buf_ + 8 * i));
    buffered_ = 0;
  }
  uint64_t a0 = acc_[0], a1 = acc_[1], a2 = acc_[2], a3 = acc_[3];
  for (; len >= 32; p += 32, len -= 32) {
    a0 = xxh_round(a0, read64(p));
    a1 = xxh_round(a1, read64(p + 8));
    a2 = xxh_round(a2, read64(p + 16));
    a3 = xxh_round(a3, read64(p + 24));
  }
  acc_[0] = a0, acc_[1] = a1, acc_[2] = a2, acc_[3] = a3;
  std::memcpy(buf_, p, len);
  buffered_ = len;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl64(acc_[0], 1) + rotl64(acc_[1], 7) + rotl64(acc_[2], 12) + rotl64(acc_[3], 18);
    for (uint64_t a : acc_) h = xxh_merge(h, a);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const unsigned char* p = buf_;
  size_t len = buffered_;
  for (; len >= 8; p += 8, len -= 8) h = rotl64(h ^ xxh_round(0, read64(p)), 27) * kP1 + kP4;
  if (len >= 4) {
    h = rotl64(h ^ (static_cast<uint64_t>(read32(p)) * kP1), 23) * kP2 + kP3;
    p += 4;
    len -= 4;
  }
  for (; len > 0; ++p, --len) h = rotl64(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t len, uint64_t seed) {
  Xxh64 x(seed);
  x.update(data, len);
  return x.digest();
}

}  // namespace megatrain

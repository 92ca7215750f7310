// XXH64 (xxHash's 64-bit hash, seed 0 by default): the checksum of every checkpoint file, of the
// checkpoint manifest and of a prepared dataset's arrays. Incremental (update, then digest) or in
// one call.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megatrain {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t len);
  uint64_t digest() const;

 private:
  uint64_t acc_[4];
  uint64_t seed_;
  uint64_t total_ = 0;
  unsigned char buf_[32];
  size_t buffered_ = 0;
};
uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

}  // namespace megatrain

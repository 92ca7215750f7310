// AlignedArray: the RAM tier's arrays, aligned so that SIMD loads and page-locking work on them.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace megatrain::exec {

// Bytes held by every live AlignedArray (and the CPU backend's arena) in this process: the
// allocations themselves, counted where they are made, against which the compiled step's RAM
// footprint is tested.
inline std::atomic<int64_t>& aligned_bytes_in_use() {
  static std::atomic<int64_t> bytes{0};
  return bytes;
}

// 64-byte (page, from 64 KiB) aligned array that never copies implicitly. It may instead be a view
// of memory it does not own (the NVMe tier's staging buffers, host_state.h): view() starts one,
// release() or resize() ends it.
template <typename T>
class AlignedArray {
 public:
  AlignedArray() = default;
  explicit AlignedArray(int64_t n) { resize(n); }
  void resize(int64_t n) {
    n_ = n;
    // Arrays of 64 KiB or more own whole pages, so that the CUDA backend can page-lock each one
    // (cudaHostRegister) without two registrations sharing a page.
    const size_t raw = static_cast<size_t>(n) * sizeof(T);
    const size_t align = raw >= (size_t{64} << 10) ? 4096 : 64;
    const size_t bytes = (raw + align - 1) / align * align;
    view_ = nullptr;
    p_.reset(bytes ? static_cast<T*>(std::aligned_alloc(align, bytes)) : nullptr);
    p_.get_deleter().bytes = p_ ? static_cast<int64_t>(bytes) : 0;
    aligned_bytes_in_use() += p_.get_deleter().bytes;
    for (int64_t i = 0; i < n; ++i) p_.get()[i] = T{};
  }
  void view(T* p, int64_t n) {
    p_.reset();
    view_ = p;
    n_ = n;
  }
  void release() {
    p_.reset();
    view_ = nullptr;
    n_ = 0;
  }
  T* data() { return view_ ? view_ : p_.get(); }
  const T* data() const { return view_ ? view_ : p_.get(); }
  int64_t size() const { return n_; }
  T& operator[](int64_t i) { return data()[i]; }
  const T& operator[](int64_t i) const { return data()[i]; }

 private:
  struct Free {
    int64_t bytes = 0;
    void operator()(T* p) const {
      aligned_bytes_in_use() -= bytes;
      std::free(p);
    }
  };
  std::unique_ptr<T, Free> p_;
  T* view_ = nullptr;
  int64_t n_ = 0;
};

}  // namespace megatrain::exec

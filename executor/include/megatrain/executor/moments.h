// Adam's moments m and v in a storage format (ARCHITECTURE.md section 5; issue 8), and the fused
// AdamW pass over them.
//
// Formats. fp32 and bf16 (round to nearest even) store each element. The quantised formats q8, q4,
// q3 and q2 split every tensor, from its first element, into blocks of `block_size` elements (the
// last block of a tensor may be shorter), each with one fp32 scale. q8 and q4 codes are linear in
// the square root of the normalised magnitude, so that small elements keep relative precision
// (Adam divides m by sqrt(v), so a small element's step matters as much as a large one's); q3 and
// q2, with 8 and 4 levels, are linear in the magnitude, which measured better at so few levels
// (docs/optimizer-states.md):
//   m (signed):    scale = max |m|;        x = |m| / scale;          r = sqrt(x) (q8, q4) or x
//                  c = sign(m) round(L r), L = 2^(bits-1) - 1;       m = sign(c) f(|c| / L) scale
//   v (unsigned):  scale = max sqrt(v);    x = sqrt(v) / scale;      r = sqrt(x) (q8, q4) or x
//                  c = round(2^bits r) - 1, clamped to [0, 2^bits - 1];  sqrt(v) = f((c + 1) / 2^bits) scale
// with f(q) = q^2 for q8/q4 and q for q3/q2.
// v's code has no zero ("Memory Efficient Optimizers with 4-bit States", Li et al. 2023): a
// second moment rounded to zero would turn the step m / (sqrt(v) + eps) into m / eps. q2's m is
// ternary (-1, 0, 1) x scale. Encoding rounds to nearest (ties to even) and clamps. Every block,
// also a short last one, takes block_size * bits / 8 bytes of codes, so a tensor's codes and scales
// start at fixed offsets. Nothing about the quantised formats is lossless.
//
// The fused pass (adamw_update_moments) reads the gradient, the master weight and both moments,
// dequantises the moments of a block, makes torch.optim.AdamW's update in fp32, writes the master
// weight and the streamed copy, and requantises the new moments from their fp32 values. It is
// SIMD (AVX-512 or AVX2, chosen at run time, or scalar) and multi-threaded over whole blocks, with
// the same operations in the same order on every path and no FMA contraction, so its results are
// identical for every instruction set and thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/aligned_array.h"
#include "megatrain/executor/optimizer.h"

namespace megatrain::exec {

enum class Isa { kAuto, kScalar, kAvx2, kAvx512 };
const char* isa_name(Isa isa);
// The best instruction set this CPU runs (kAvx512 needs AVX-512F and BW, kAvx2 needs AVX2), at
// most the one the CPU kernels were built for (CMake's MEGATRAIN_CPU_ISA: avx2 caps it at kAvx2,
// baseline at kScalar), so that a build for an AVX2 machine behaves as on one.
Isa best_isa();
// The instruction set forced by the environment variable MEGATRAIN_ISA: unset, empty or "auto"
// give kAuto; "scalar", "avx2" or "avx512" that path, refused when this CPU or build cannot run it;
// anything else is refused naming the accepted values. Programs check it before they start work.
Result<Isa> isa_from_environment();
// kAuto resolves to MEGATRAIN_ISA when it names a path this CPU runs, else to best_isa(); an
// explicit instruction set the CPU lacks is refused.
Result<Isa> resolve_isa(Isa isa);

using megatrain::state_format_bits;  // core/model_spec.h: the bits per code of a quantised format
bool is_quantised(StateFormat f);

// A moment's storage for one range of elements (a whole tensor, from its first element): exactly
// one of f32 / bf16 / codes is set, by format; scales goes with codes.
struct MomentRef {
  StateFormat format = StateFormat::kFp32;
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  int64_t block_size = 128;
};

// One moment of one unit: the storage of every tensor in its format.
class MomentStore {
 public:
  MomentStore() = default;
  // Zeros (m and v start at zero); second = true for v (the unsigned code).
  // The unit's tensors are given by their sizes, in order (they are contiguous in the unit).
  // With allocate = false the arrays stay empty until attach() (the NVMe tier's units).
  static MomentStore create(StateFormat format, bool second, const std::vector<int64_t>& tensor_numels,
                            int64_t block_size, bool allocate = true);
  // Bytes of each whole-unit array, in order: the fp32 or bf16 elements, or the codes then the scales.
  std::vector<int64_t> array_bytes() const;
  // Points the arrays at memory the store does not own (one pointer per array_bytes() entry, each
  // holding that many bytes), or lets go of it; the NVMe tier pages units in and out this way.
  void attach(const std::vector<void*>& arrays);
  void detach();
  StateFormat format() const { return format_; }
  bool second() const { return second_; }
  int64_t block_size() const { return block_; }
  int64_t numel() const { return numel_; }
  // Bytes held (codes, scales or elements).
  int64_t bytes() const;
  // Bytes the arrays take when allocated (also while they are not: the NVMe tier's units).
  int64_t bytes_if_allocated() const;
  // The storage of tensor `index` of the unit (tensors in the order given to create()).
  MomentRef tensor(size_t index);
  // Whole-unit arrays, for checkpoints: fp32 elements, bf16 elements, or codes and scales.
  AlignedArray<float>& f32() { return f32_; }
  AlignedArray<uint16_t>& bf16() { return bf16_; }
  AlignedArray<uint8_t>& codes() { return codes_; }
  AlignedArray<float>& scales() { return scales_; }
  const AlignedArray<float>& f32() const { return f32_; }
  const AlignedArray<uint16_t>& bf16() const { return bf16_; }
  const AlignedArray<uint8_t>& codes() const { return codes_; }
  const AlignedArray<float>& scales() const { return scales_; }
  // fp32 storage as a plain array (fp32 format only; null otherwise).
  float* data() { return f32_.data(); }
  const float* data() const { return f32_.data(); }
  float& operator[](int64_t i) { return f32_[i]; }
  const float& operator[](int64_t i) const { return f32_[i]; }
  // Tensor `tensor_index` decoded to fp32.
  void decode(size_t tensor_index, float* out) const;
  // Sets tensor `tensor_index` from fp32 values (encoding them in the format).
  void encode(size_t tensor_index, const float* in);
  int64_t tensor_numel(size_t tensor_index) const { return tensor_numel_[tensor_index]; }
  int64_t tensor_count() const { return static_cast<int64_t>(tensor_numel_.size()); }

 private:
  StateFormat format_ = StateFormat::kFp32;
  bool second_ = false;
  int64_t block_ = 128, numel_ = 0, blocks_ = 0;
  std::vector<int64_t> tensor_offset_, tensor_numel_, tensor_block_;  // element offset, size, first block
  AlignedArray<float> f32_;
  AlignedArray<uint16_t> bf16_;
  AlignedArray<uint8_t> codes_;
  AlignedArray<float> scales_;
};

// The constants of one AdamW step (from AdamWStep), as the fused pass uses them.
struct StepConsts {
  float grad_scale, decay, b1, b2, omb1, omb2, step_size, bc2_sqrt, eps;
};
StepConsts step_consts(const AdamWStep& s);

// Decode / encode one range with a MomentRef (n elements from the range's first, blocks from there).
void decode_moment(const MomentRef& r, bool second, int64_t n, float* out);
void encode_moment(const MomentRef& r, bool second, int64_t n, const float* in);

// The fused AdamW pass over n elements: w, g fp32; m and v in their formats; the new weights also
// to stream_f32 / stream_bf16 when set. Threads split whole blocks (of the quantised block size,
// or 4096 elements for fp32/bf16), so the result is the same for every thread count and ISA.
void adamw_update_moments(float* w, const float* g, const MomentRef& m, const MomentRef& v, int64_t n,
                          const AdamWStep& s, float* stream_f32, uint16_t* stream_bf16, int threads,
                          Isa isa = Isa::kAuto);

}  // namespace megatrain::exec

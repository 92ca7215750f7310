// The fused AdamW pass over one range of blocks, written once as plain loops over a block and
// compiled three times: adamw_scalar.cpp (the baseline x86-64 instruction set), adamw_avx2.cpp
// (-mavx2) and adamw_avx512.cpp (-mavx512f -mavx512bw), where the compiler vectorises the loops
// for that instruction set. moments.cpp picks one at run time.
//
// Why the paths give identical bits: every loop is element-wise IEEE arithmetic (+, *, /, sqrt,
// round to nearest even), compiled without FMA contraction (-ffp-contract=off) and without
// reassociation (no -ffast-math); -fno-math-errno only lets sqrt and rint vectorise. The block
// maxima are taken on the bit patterns of |x| (an integer max of non-negative floats equals the
// float max), which is exact in any order. So a vector lane computes exactly what the scalar loop
// computes for that element.
//
// Per block: decode m and v into fp32 scratch (or use fp32 storage in place), then
//   g = g * grad_scale; p = w * (1 - lr wd)
//   m = m b1 + (1 - b1) g;  v = v b2 + ((1 - b2) g) g          (torch.optim.AdamW's order)
//   p = p - (lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))
// write w and the streamed copy, and encode the new m and v from their fp32 values.
//
// Each including file defines MT_ADAMW_NS (a namespace of its own) first: everything here has
// internal linkage in that namespace, and nothing here instantiates a std:: template, so no copy
// compiled for one instruction set can be picked by the linker for another.
#ifndef MT_ADAMW_NS
#error "define MT_ADAMW_NS before including adamw_kernel.h"
#endif

#include <cstdint>
#include <cstring>

#include "megatrain/executor/moments.h"

#if defined(MT_ADAMW_AVX512) || defined(MT_ADAMW_AVX2)
#include <immintrin.h>
#endif

namespace megatrain::exec::MT_ADAMW_NS {
namespace {

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline uint16_t to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  const bool nan = (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((bits >> 16) | 0x0040u) : rounded);
}

// Largest |x| of n floats, exactly (on the bit patterns).
inline float abs_max(const float* x, int64_t n) {
  uint32_t mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= 0x7fffffffu;
    mx = b > mx ? b : mx;
  }
  return bits_to_float(mx);
}

// Codes of one block (n <= block elements) unpacked to integers / packed from integers, a whole
// byte (q8, q4, q2) or 3 bytes (q3) at a time so that the loops vectorise; codes are little-endian
// within their bytes. The tail of a short block goes code by code.
inline int32_t code_at(const uint8_t* in, int bits, int64_t i) {
  const int64_t bit = static_cast<int64_t>(bits) * i;
  uint32_t word = in[bit >> 3];
  if ((bit & 7) + bits > 8) word |= static_cast<uint32_t>(in[(bit >> 3) + 1]) << 8;
  return static_cast<int32_t>((word >> (bit & 7)) & ((1u << bits) - 1));
}

__attribute__((always_inline)) inline void unpack(const uint8_t* __restrict in, int bits, int64_t n, int32_t* __restrict c) {
  int64_t done = 0;
  switch (bits) {
    case 8:
      for (int64_t i = 0; i < n; ++i) c[i] = in[i];
      return;
    case 4:
      for (int64_t j = 0; j < n / 2; ++j) {
        const int32_t b = in[j];
        c[2 * j] = b & 15;
        c[2 * j + 1] = b >> 4;
      }
      done = n / 2 * 2;
      break;
    case 2:
      for (int64_t j = 0; j < n / 4; ++j) {
        const int32_t b = in[j];
        c[4 * j] = b & 3;
        c[4 * j + 1] = (b >> 2) & 3;
        c[4 * j + 2] = (b >> 4) & 3;
        c[4 * j + 3] = b >> 6;
      }
      done = n / 4 * 4;
      break;
    default:  // 3: 8 codes in 3 bytes
      for (int64_t j = 0; j < n / 8; ++j) {
        const uint32_t w = static_cast<uint32_t>(in[3 * j]) | (static_cast<uint32_t>(in[3 * j + 1]) << 8) |
                           (static_cast<uint32_t>(in[3 * j + 2]) << 16);
        for (int k = 0; k < 8; ++k) c[8 * j + k] = static_cast<int32_t>((w >> (3 * k)) & 7u);
      }
      done = n / 8 * 8;
  }
  for (int64_t i = done; i < n; ++i) c[i] = code_at(in, bits, i);
}

__attribute__((always_inline)) inline void pack(const int32_t* __restrict c, int bits, int64_t n, int64_t block_bytes, uint8_t* __restrict out) {
  std::memset(out, 0, static_cast<size_t>(block_bytes));
  int64_t done = 0;
  switch (bits) {
    case 8:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(c[i]);
      return;
    case 4:
      for (int64_t j = 0; j < n / 2; ++j) out[j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
      done = n / 2 * 2;
      break;
    case 2:
      for (int64_t j = 0; j < n / 4; ++j)
        out[j] = static_cast<uint8_t>(c[4 * j] | (c[4 * j + 1] << 2) | (c[4 * j + 2] << 4) | (c[4 * j + 3] << 6));
      done = n / 4 * 4;
      break;
    default:
      for (int64_t j = 0; j < n / 8; ++j) {
        uint32_t w = 0;
        for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(c[8 * j + k]) << (3 * k);
        out[3 * j] = static_cast<uint8_t>(w);
        out[3 * j + 1] = static_cast<uint8_t>(w >> 8);
        out[3 * j + 2] = static_cast<uint8_t>(w >> 16);
      }
      done = n / 8 * 8;
  }
  for (int64_t i = done; i < n; ++i) {
    const int64_t bit = static_cast<int64_t>(bits) * i;
    const uint32_t v = static_cast<uint32_t>(c[i]) << (bit & 7);
    out[bit >> 3] = static_cast<uint8_t>(out[bit >> 3] | (v & 0xffu));
    if ((bit & 7) + bits > 8) out[(bit >> 3) + 1] = static_cast<uint8_t>(out[(bit >> 3) + 1] | (v >> 8));
  }
}

// Signed codes of m are stored offset by L (c + L in [0, 2L]); v's codes are stored as they are.
inline void decode_block(const MomentRef& r, bool second, int64_t first, int64_t n, float* out, int32_t* scratch) {
  switch (r.format) {
    case StateFormat::kFp32:
      std::memcpy(out, r.f32 + first, sizeof(float) * static_cast<size_t>(n));
      return;
    case StateFormat::kBf16:
      for (int64_t i = 0; i < n; ++i) out[i] = bits_to_float(static_cast<uint32_t>(r.bf16[first + i]) << 16);
      return;
    default: break;
  }
  const int bits = state_format_bits(r.format);
  const int64_t block = first / r.block_size;
  const uint8_t* codes = r.codes + block * (r.block_size * bits / 8);
  const float scale = r.scales[block];
  unpack(codes, bits, n, scratch);
  // q8 and q4 codes are linear in the square root of the normalised magnitude, q3 and q2 codes in
  // the magnitude itself (see moments.h).
  const bool root = bits >= 4;
  if (second) {  // sqrt(v) = ((c + 1) / 2^bits)^2 scale (root) or (c + 1) / 2^bits scale; v = sqrt(v)^2
    const float inv_levels = 1.0f / static_cast<float>(1 << bits);
    for (int64_t i = 0; i < n; ++i) {
      const float q = static_cast<float>(scratch[i] + 1) * inv_levels;
      const float u = (root ? q * q : q) * scale;
      out[i] = u * u;
    }
  } else {  // m = sign(c) (|c| / L)^2 scale (root) or c / L scale
    const int32_t levels = (1 << (bits - 1)) - 1;
    const float inv_levels = 1.0f / static_cast<float>(levels);
    for (int64_t i = 0; i < n; ++i) {
      const float q = static_cast<float>(scratch[i] - levels) * inv_levels;
      out[i] = (root ? q * (q < 0.0f ? -q : q) : q) * scale;
    }
  }
}

// root_in: sqrt(in[i]) when the caller has it (the update computes sqrt(v) anyway), else null.
inline void encode_block(const MomentRef& r, bool second, int64_t first, int64_t n, const float* in, int32_t* scratch,
                         const float* root_in = nullptr) {
  switch (r.format) {
    case StateFormat::kFp32:
      std::memcpy(r.f32 + first, in, sizeof(float) * static_cast<size_t>(n));
      return;
    case StateFormat::kBf16:
      for (int64_t i = 0; i < n; ++i) r.bf16[first + i] = to_bf16(in[i]);
      return;
    default: break;
  }
  const int bits = state_format_bits(r.format);
  const int64_t block = first / r.block_size;
  const int64_t block_bytes = r.block_size * bits / 8;
  // m: the block's largest |m|. v: the largest sqrt(v) (sqrt is monotonic, so this is exact).
  // (sqrt is monotonic and correctly rounded, so max sqrt(v) == sqrt(max v) exactly.)
  const float scale = second ? (root_in ? abs_max(root_in, n) : __builtin_sqrtf(abs_max(in, n))) : abs_max(in, n);
  r.scales[block] = scale;
  const float inv_scale = scale > 0.0f ? 1.0f / scale : 0.0f;
  const bool root = bits >= 4;
  if (second) {  // c = round(2^bits r) - 1, r = sqrt(sqrt(v) / scale) (root) or sqrt(v) / scale
    const int32_t top = (1 << bits) - 1;
    const float levels = static_cast<float>(1 << bits);
    for (int64_t i = 0; i < n; ++i) {
      const float lin = (root_in ? root_in[i] : __builtin_sqrtf(in[i])) * inv_scale;
      const float x = root ? __builtin_sqrtf(lin) : lin;
      const int32_t c = static_cast<int32_t>(__builtin_nearbyintf(x * levels)) - 1;
      scratch[i] = c < 0 ? 0 : (c > top ? top : c);
    }
  } else {  // c = sign(m) round(L r), r = sqrt(|m| / scale) (root) or |m| / scale
    const int32_t levels = (1 << (bits - 1)) - 1;
    const float fl = static_cast<float>(levels);
    for (int64_t i = 0; i < n; ++i) {
      const float a = in[i] < 0.0f ? -in[i] : in[i];
      const float lin = a * inv_scale;
      const float q = __builtin_nearbyintf((root ? __builtin_sqrtf(lin) : lin) * fl);
      const int32_t c = static_cast<int32_t>(in[i] < 0.0f ? -q : q);
      scratch[i] = (c < -levels ? -levels : (c > levels ? levels : c)) + levels;
    }
  }
  pack(scratch, bits, n, block_bytes, r.codes + block * block_bytes);
}

// The update of n elements whose moments are in fp32 scratch (or fp32 storage) tm/tv.
// su receives sqrt(v) for the encoder. The arrays never overlap (__restrict lets the loop vectorise).
inline void update(const StepConsts& k, float* __restrict w, const float* __restrict g, float* __restrict tm,
                   float* __restrict tv, int64_t n, float* stream_f32, uint16_t* stream_bf16, float* __restrict su) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * k.grad_scale;
    const float p0 = w[i] * k.decay;
    const float mi = tm[i] * k.b1 + k.omb1 * gi;
    const float vi = tv[i] * k.b2 + (k.omb2 * gi) * gi;
    const float sv = __builtin_sqrtf(vi);
    su[i] = sv;
    const float denom = sv / k.bc2_sqrt + k.eps;
    const float p = p0 - k.step_size * (mi / denom);
    tm[i] = mi;
    tv[i] = vi;
    w[i] = p;
  }
  if (stream_f32) std::memcpy(stream_f32, w, sizeof(float) * static_cast<size_t>(n));
  if (stream_bf16)
    for (int64_t i = 0; i < n; ++i) stream_bf16[i] = to_bf16(w[i]);
}

// The same pass with the moments' formats known at compile time: MB and VB are 16 (bf16) or the
// bits of a quantised code (8, 4, 3, 2). The generic path above spends most of its time on its
// own structure (a pass over the block per step, each branching on the format), not on the
// arithmetic; here decoding, the update, the new scales' maxima and the streamed copy share one
// loop, and encoding both moments shares another. The operations and their order are those of
// decode_block, update and encode_block, so the bits are the same.
template <int MB, int VB, int64_t N>
inline void fast_block(const StepConsts& k, float* __restrict w, const float* __restrict g, const MomentRef& m,
                       const MomentRef& v, int64_t b0, int64_t n_, float* __restrict stream_f32,
                       uint16_t* __restrict stream_bf16, float* __restrict tm, float* __restrict su,
                       int32_t* __restrict cm, int32_t* __restrict cv) {
  static_assert((MB == 16) == (VB == 16), "the fast path takes both moments bf16 or both quantised");
  const int64_t n = N > 0 ? N : n_;  // N > 0: a whole block of a size known at compile time
  constexpr bool mq = MB != 16, vq = VB != 16;
  constexpr bool mroot = MB >= 4 && mq, vroot = VB >= 4 && vq;
  constexpr int32_t ml = mq ? (1 << (MB - 1)) - 1 : 1;
  const float m_inv = 1.0f / static_cast<float>(ml);
  const float v_inv = 1.0f / static_cast<float>(vq ? 1 << VB : 1);
  const int64_t block = b0 / m.block_size;
  float m_scale = 0.0f, v_scale = 0.0f;
  if constexpr (mq) {
    m_scale = m.scales[block];
    unpack(m.codes + block * (m.block_size * MB / 8), MB, n, cm);
  }
  if constexpr (vq) {
    v_scale = v.scales[block];
    unpack(v.codes + block * (v.block_size * VB / 8), VB, n, cv);
  }
  uint16_t* __restrict mb = mq ? nullptr : m.bf16 + b0;  // bf16 moments: read, then written in place
  uint16_t* __restrict vb = vq ? nullptr : v.bf16 + b0;
  uint32_t m_max = 0, s_max = 0;
  w += b0;
  g += b0;
  for (int64_t i = 0; i < n; ++i) {
    float m0, v0;
    if constexpr (mq) {
      const float q = static_cast<float>(cm[i] - ml) * m_inv;
      m0 = (mroot ? q * (q < 0.0f ? -q : q) : q) * m_scale;
    } else {
      m0 = bits_to_float(static_cast<uint32_t>(mb[i]) << 16);
    }
    if constexpr (vq) {
      const float q = static_cast<float>(cv[i] + 1) * v_inv;
      const float u = (vroot ? q * q : q) * v_scale;
      v0 = u * u;
    } else {
      v0 = bits_to_float(static_cast<uint32_t>(vb[i]) << 16);
    }
    const float gi = g[i] * k.grad_scale;
    const float p0 = w[i] * k.decay;
    const float mi = m0 * k.b1 + k.omb1 * gi;
    const float vi = v0 * k.b2 + (k.omb2 * gi) * gi;
    const float sv = __builtin_sqrtf(vi);
    const float denom = sv / k.bc2_sqrt + k.eps;
    const float p = p0 - k.step_size * (mi / denom);
    w[i] = p;
    if constexpr (mq) {
      tm[i] = mi;
      const uint32_t b = float_to_bits(mi) & 0x7fffffffu;
      m_max = b > m_max ? b : m_max;
    } else {
      mb[i] = to_bf16(mi);
    }
    if constexpr (vq) {
      su[i] = sv;
      const uint32_t b = float_to_bits(sv) & 0x7fffffffu;
      s_max = b > s_max ? b : s_max;
    } else {
      vb[i] = to_bf16(vi);
    }
  }
  if (stream_f32) std::memcpy(stream_f32 + b0, w, sizeof(float) * static_cast<size_t>(n));
  if (stream_bf16)
    for (int64_t i = 0; i < n; ++i) stream_bf16[b0 + i] = to_bf16(w[i]);
  if constexpr (mq) {
    // Both moments' codes in one loop: the two chains of square roots overlap.
    const float m_sc = bits_to_float(m_max), v_sc = bits_to_float(s_max);
    m.scales[block] = m_sc;
    v.scales[block] = v_sc;
    const float m_inv_sc = m_sc > 0.0f ? 1.0f / m_sc : 0.0f, v_inv_sc = v_sc > 0.0f ? 1.0f / v_sc : 0.0f;
    const float fl = static_cast<float>(ml);
    constexpr int32_t top = (1 << VB) - 1;
    const float levels = static_cast<float>(1 << VB);
    for (int64_t i = 0; i < n; ++i) {
      // |m| by its bits: the same magnitude as encode_block's select (-0 and NaN give the same
      // codes), without the select that made the compiler take the square root twice.
      const float a = bits_to_float(float_to_bits(tm[i]) & 0x7fffffffu);
      const float lin = a * m_inv_sc;
      const float q = __builtin_nearbyintf((mroot ? __builtin_sqrtf(lin) : lin) * fl);
      const int32_t c = static_cast<int32_t>(tm[i] < 0.0f ? -q : q);
      cm[i] = (c < -ml ? -ml : (c > ml ? ml : c)) + ml;
      const float vlin = su[i] * v_inv_sc;
      const float x = vroot ? __builtin_sqrtf(vlin) : vlin;
      const int32_t cvi = static_cast<int32_t>(__builtin_nearbyintf(x * levels)) - 1;
      cv[i] = cvi < 0 ? 0 : (cvi > top ? top : cvi);
    }
    pack(cm, MB, n, m.block_size * MB / 8, m.codes + block * (m.block_size * MB / 8));
    pack(cv, VB, n, v.block_size * VB / 8, v.codes + block * (v.block_size * VB / 8));
  }
}

// Blocks of 128 with intrinsics, in the copies whose instruction set has them: q4/q4 and q8/q8
// on AVX-512, q4/q4 on AVX2.
#if defined(MT_ADAMW_AVX512)
#include "adamw_q_avx512.h"
#elif defined(MT_ADAMW_AVX2)
#include "adamw_q4_avx2.h"
#endif

template <int MB, int VB>
inline void run_fast(const StepConsts& k, float* w, const float* g, const MomentRef& m, const MomentRef& v,
                     int64_t begin, int64_t end, int64_t block, float* stream_f32, uint16_t* stream_bf16, float* fm,
                     float* fv, int32_t* ci) {
  for (int64_t b0 = begin; b0 < end; b0 += block) {
    const int64_t n = min64(block, end - b0);
    // The default block with trip counts known to the compiler: measured 9% faster for q4 and q2,
    // but slower for q8 and q3, whose loops the compiler then unrolls worse.
    constexpr bool fixed = (MB == 4 || MB == 2) && (VB == 4 || VB == 2);
#if defined(MT_ADAMW_AVX512)
    if constexpr (MB == VB && (MB == 4 || MB == 8)) {
      if (n == kQBlock && m.block_size == kQBlock && v.block_size == kQBlock) {
        q_block_avx512<MB>(k, w, g, m, v, b0, stream_f32, stream_bf16);
        continue;
      }
    }
#elif defined(MT_ADAMW_AVX2)
    if constexpr (MB == 4 && VB == 4) {
      if (n == kQBlock && m.block_size == kQBlock && v.block_size == kQBlock) {
        q4_block_avx2(k, w, g, m, v, b0, stream_f32, stream_bf16);
        continue;
      }
    }
#endif
    if (fixed && n == 128)
      fast_block<MB, VB, 128>(k, w, g, m, v, b0, n, stream_f32, stream_bf16, fm, fv + block, ci, ci + block);
    else
      fast_block<MB, VB, 0>(k, w, g, m, v, b0, n, stream_f32, stream_bf16, fm, fv + block, ci, ci + block);
  }
}

// MB for a format: 16 for bf16, the code's bits when quantised, 0 otherwise (no fast path).
inline int fast_tag(const MomentRef& r) {
  if (r.format == StateFormat::kBf16) return 16;
  return is_quantised(r.format) ? state_format_bits(r.format) : 0;
}

// Elements [begin, end) (block-aligned except at the end of the range). Scratch: fm of block
// floats, fv of 2 * block floats (v, then sqrt(v)), ci of 2 * block int32s.
inline void run_generic(const StepConsts& k, float* w, const float* g, const MomentRef& m, const MomentRef& v, int64_t begin,
                int64_t end, int64_t block, float* stream_f32, uint16_t* stream_bf16, float* fm, float* fv, int32_t* ci) {
  for (int64_t b0 = begin; b0 < end; b0 += block) {
    const int64_t n = min64(block, end - b0);
    float* tm = m.format == StateFormat::kFp32 ? m.f32 + b0 : fm;
    float* tv = v.format == StateFormat::kFp32 ? v.f32 + b0 : fv;
    if (m.format != StateFormat::kFp32) decode_block(m, false, b0, n, tm, ci);
    if (v.format != StateFormat::kFp32) decode_block(v, true, b0, n, tv, ci);
    float* su = fv + block;  // sqrt(v), shared with the encoder
    update(k, w + b0, g + b0, tm, tv, n, stream_f32 ? stream_f32 + b0 : nullptr, stream_bf16 ? stream_bf16 + b0 : nullptr, su);
    if (m.format != StateFormat::kFp32) encode_block(m, false, b0, n, tm, ci);
    if (v.format != StateFormat::kFp32) encode_block(v, true, b0, n, tv, ci, is_quantised(v.format) ? su : nullptr);
  }
}

}  // namespace

// The entry point of this instruction set's copy: the fast path when both moments are bf16 or
// both quantised (with one block size), else the generic one.
void adamw_run(const StepConsts& k, float* w, const float* g, const MomentRef& m, const MomentRef& v, int64_t begin,
               int64_t end, int64_t block, float* stream_f32, uint16_t* stream_bf16, float* fm, float* fv, int32_t* ci) {
  const int mt = fast_tag(m), vt = fast_tag(v);
  const bool both_q = mt != 0 && mt != 16 && vt != 0 && vt != 16 && m.block_size == v.block_size;
#define MT_FAST(MB, VB)                                                                     \
  if (mt == MB && vt == VB) {                                                               \
    run_fast<MB, VB>(k, w, g, m, v, begin, end, block, stream_f32, stream_bf16, fm, fv, ci); \
    return;                                                                                 \
  }
  if (mt == 16 && vt == 16) {
    run_fast<16, 16>(k, w, g, m, v, begin, end, block, stream_f32, stream_bf16, fm, fv, ci);
    return;
  }
  if (both_q) {
    MT_FAST(8, 8) MT_FAST(8, 4) MT_FAST(8, 3) MT_FAST(8, 2)
    MT_FAST(4, 8) MT_FAST(4, 4) MT_FAST(4, 3) MT_FAST(4, 2)
    MT_FAST(3, 8) MT_FAST(3, 4) MT_FAST(3, 3) MT_FAST(3, 2)
    MT_FAST(2, 8) MT_FAST(2, 4) MT_FAST(2, 3) MT_FAST(2, 2)
  }
#undef MT_FAST
  run_generic(k, w, g, m, v, begin, end, block, stream_f32, stream_bf16, fm, fv, ci);
}

// A moment's n elements decoded to / encoded from fp32, block by block (checkpoints, tests).
void moment_decode(const MomentRef& r, bool second, int64_t n, float* out, int32_t* ci) {
  const int64_t block = r.block_size;
  for (int64_t b0 = 0; b0 < n; b0 += block) decode_block(r, second, b0, min64(block, n - b0), out + b0, ci);
}
void moment_encode(const MomentRef& r, bool second, int64_t n, const float* in, int32_t* ci) {
  const int64_t block = r.block_size;
  for (int64_t b0 = 0; b0 < n; b0 += block) encode_block(r, second, b0, min64(block, n - b0), in + b0, ci);
}

}  // namespace megatrain::exec::MT_ADAMW_NS

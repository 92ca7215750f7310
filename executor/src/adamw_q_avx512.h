// The fast path's block for q4 or q8 m and v (the same format for both) in blocks of 128, written
// with AVX-512 intrinsics (included by adamw_kernel.h inside its namespace, only in the AVX-512
// copy: adamw_avx512.cpp defines MT_ADAMW_AVX512). The compiler's vectorisation of the plain loops
// spends much of its time moving codes through int32 scratch. Here:
//   q4: a block's 16 possible decoded values of each moment are computed once into a register, and
//       each element's value is a permute of its nibble; nibbles are packed in registers;
//   q8: bytes widen to int32 lanes and decode by the generic arithmetic; codes narrow back with
//       one instruction.
// The arithmetic is fast_block's, operation for operation and lane for lane (L = 2^(bits-1) - 1):
//   decode  m = (q |q|) scale, q = (c - L) / L;   v = u u, u = (q q) scale, q = (c + 1) / 2^bits
//   update  torch.optim.AdamW's order (adamw_kernel.h)
//   encode  m: c = sign(m) rint(L sqrt(|m| / scale)) clamped to [-L, L], + L;
//           v: c = rint(2^bits sqrt(sqrt(v) / scale)) - 1 clamped to [0, 2^bits - 1]
// so the results are the generic path's bits (Moments.FusedPassIsDecodeThenUpdateThenEncode,
// Moments.EveryInstructionSetGivesTheSameBits).
#ifndef MT_ADAMW_AVX512
#error "adamw_q_avx512.h is for the AVX-512 copy only"
#endif

constexpr int64_t kQBlock = 128;

// Lane i shifts by 4 (i & 1): the low nibble for even elements, the high one for odd ones.
inline __m512i nibble_shifts() { return _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0); }

// q4: the decoded values of 16 elements from 8 bytes of codes, each nibble looked up in `table`
// (permutexvar reads only the low 4 bits of each index).
inline __m512 q4_decode16(const uint8_t* codes, __m512 table) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, x)), nibble_shifts());
  return _mm512_permutexvar_ps(idx, table);
}

// q4: 16 codes (int32 lanes, 0..15) packed into 8 bytes, two per byte, the even element low.
inline void q4_pack16(__m512i c, uint8_t* out) {
  const __m512i s = _mm512_sllv_epi32(c, nibble_shifts());
  const __m512i pairs = _mm512_or_si512(s, _mm512_srli_epi64(s, 32));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pairs));
}

// q8: 16 codes as int32 lanes, and back to 16 bytes.
inline __m512i q8_load16(const uint8_t* codes) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
inline void q8_store16(__m512i c, uint8_t* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
}

// to_bf16 on 16 lanes: round to nearest even, a NaN stays a quiet NaN.
inline __m256i to_bf16_16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, exp_mask), exp_mask) &
                        _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x007fffff));
  const __m512i hi = _mm512_srli_epi32(b, 16);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
  const __m512i r = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 abs_ps(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

// m and v decoded from codes as int32 lanes (the generic decoder's operations).
inline __m512 decode_m(__m512i c, __m512i levels, __m512 inv_levels, __m512 scale) {
  const __m512 q = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c, levels)), inv_levels);
  return _mm512_mul_ps(_mm512_mul_ps(q, abs_ps(q)), scale);
}
inline __m512 decode_v(__m512i c, __m512 inv_levels, __m512 scale) {
  const __m512 q = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c, _mm512_set1_epi32(1))), inv_levels);
  const __m512 u = _mm512_mul_ps(_mm512_mul_ps(q, q), scale);
  return _mm512_mul_ps(u, u);
}

// One whole block of 128 elements starting at b0; m and v both in q<Bits> (4 or 8), block_size 128.
template <int Bits>
inline void q_block_avx512(const StepConsts& k, float* __restrict w, const float* __restrict g, const MomentRef& m,
                           const MomentRef& v, int64_t b0, float* __restrict stream_f32,
                           uint16_t* __restrict stream_bf16) {
  static_assert(Bits == 4 || Bits == 8);
  constexpr int32_t L = (1 << (Bits - 1)) - 1, top = (1 << Bits) - 1;
  constexpr int64_t step_bytes = 16 * Bits / 8;  // code bytes of 16 elements
  const int64_t block = b0 / kQBlock;
  uint8_t* mc = m.codes + block * (kQBlock * Bits / 8);
  uint8_t* vc = v.codes + block * (kQBlock * Bits / 8);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i m_levels = _mm512_set1_epi32(L);
  const __m512 m_inv_levels = _mm512_set1_ps(1.0f / static_cast<float>(L));
  const __m512 v_inv_levels = _mm512_set1_ps(1.0f / static_cast<float>(1 << Bits));
  const __m512 m_scale = _mm512_set1_ps(m.scales[block]), v_scale = _mm512_set1_ps(v.scales[block]);
  __m512 m_table = _mm512_setzero_ps(), v_table = _mm512_setzero_ps();
  if constexpr (Bits == 4) {  // the 16 values a code can decode to
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    m_table = decode_m(lane, m_levels, m_inv_levels, m_scale);
    v_table = decode_v(lane, v_inv_levels, v_scale);
  }
  const __m512 gs = _mm512_set1_ps(k.grad_scale), decay = _mm512_set1_ps(k.decay), b1 = _mm512_set1_ps(k.b1),
               b2 = _mm512_set1_ps(k.b2), omb1 = _mm512_set1_ps(k.omb1), omb2 = _mm512_set1_ps(k.omb2),
               step = _mm512_set1_ps(k.step_size), bc2 = _mm512_set1_ps(k.bc2_sqrt), eps = _mm512_set1_ps(k.eps);
  __m512 new_m[kQBlock / 16], root_v[kQBlock / 16];
  __m512i m_max = _mm512_setzero_si512(), s_max = _mm512_setzero_si512();
  w += b0;
  g += b0;
  for (int j = 0; j < kQBlock / 16; ++j) {
    __m512 m0, v0;
    if constexpr (Bits == 4) {
      m0 = q4_decode16(mc + step_bytes * j, m_table);
      v0 = q4_decode16(vc + step_bytes * j, v_table);
    } else {
      m0 = decode_m(q8_load16(mc + step_bytes * j), m_levels, m_inv_levels, m_scale);
      v0 = decode_v(q8_load16(vc + step_bytes * j), v_inv_levels, v_scale);
    }
    const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + 16 * j), gs);
    const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(w + 16 * j), decay);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(m0, b1), _mm512_mul_ps(omb1, gi));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(v0, b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    const __m512 sv = _mm512_sqrt_ps(vi);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(sv, bc2), eps);
    const __m512 p = _mm512_sub_ps(p0, _mm512_mul_ps(step, _mm512_div_ps(mi, denom)));
    _mm512_storeu_ps(w + 16 * j, p);
    if (stream_f32) _mm512_storeu_ps(stream_f32 + b0 + 16 * j, p);
    if (stream_bf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(stream_bf16 + b0 + 16 * j), to_bf16_16(p));
    new_m[j] = mi;
    root_v[j] = sv;
    m_max = _mm512_max_epu32(m_max, _mm512_and_si512(_mm512_castps_si512(mi), abs_mask));
    s_max = _mm512_max_epu32(s_max, _mm512_and_si512(_mm512_castps_si512(sv), abs_mask));
  }
  const float m_sc = bits_to_float(_mm512_reduce_max_epu32(m_max));
  const float v_sc = bits_to_float(_mm512_reduce_max_epu32(s_max));
  m.scales[block] = m_sc;
  v.scales[block] = v_sc;
  const __m512 m_inv = _mm512_set1_ps(m_sc > 0.0f ? 1.0f / m_sc : 0.0f);
  const __m512 v_inv = _mm512_set1_ps(v_sc > 0.0f ? 1.0f / v_sc : 0.0f);
  const __m512 m_fl = _mm512_set1_ps(static_cast<float>(L)), v_fl = _mm512_set1_ps(static_cast<float>(1 << Bits));
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int j = 0; j < kQBlock / 16; ++j) {
    const __m512 mi = new_m[j];
    const __m512 lin = _mm512_mul_ps(abs_ps(mi), m_inv);
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sqrt_ps(lin), m_fl), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 neg = _mm512_cmp_ps_mask(mi, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 qs = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(q), neg, _mm512_castps_si512(q), sign));
    const __m512i c = _mm512_add_epi32(
        _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(qs), _mm512_set1_epi32(-L)), m_levels), m_levels);
    const __m512 x = _mm512_sqrt_ps(_mm512_mul_ps(root_v[j], v_inv));
    __m512i cv = _mm512_sub_epi32(
        _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x, v_fl), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
        _mm512_set1_epi32(1));
    cv = _mm512_min_epi32(_mm512_max_epi32(cv, _mm512_setzero_si512()), _mm512_set1_epi32(top));
    if constexpr (Bits == 4) {
      q4_pack16(c, mc + step_bytes * j);
      q4_pack16(cv, vc + step_bytes * j);
    } else {
      q8_store16(c, mc + step_bytes * j);
      q8_store16(cv, vc + step_bytes * j);
    }
  }
}

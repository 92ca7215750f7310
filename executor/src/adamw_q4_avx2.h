// The AVX2 copy's block for q4 m and q4 v in blocks of 128 (included by adamw_kernel.h inside its
// namespace, only in adamw_avx2.cpp, which defines MT_ADAMW_AVX2). The same scheme as
// adamw_q_avx512.h (its q4 part) on 8 lanes: a block's 16 possible decoded values of each moment are computed
// once, with the generic decoder's operations, into two registers of 8; an element's value is a
// permute of its nibble's low 3 bits in both, blended by its 4th bit. The arithmetic is
// fast_block's, operation for operation and lane for lane, so the bits are the generic path's.
#ifndef MT_ADAMW_AVX2
#error "adamw_q4_avx2.h is for the AVX2 copy only"
#endif

constexpr int64_t kQBlock = 128;

// Lane i shifts by 4 (i & 1): the low nibble for even elements, the high one for odd ones.
inline __m256i nibble_shifts8() { return _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0); }

// The decoded values of 8 elements from 4 bytes of codes: (lo, hi) hold the values of codes 0-7
// and 8-15.
inline __m256 q4_decode8(const uint8_t* codes, __m256 lo, __m256 hi) {
  int32_t word;
  std::memcpy(&word, codes, 4);
  const __m128i x = _mm_cvtsi32_si128(word);
  const __m256i idx = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(x, x)), nibble_shifts8());
  // permutevar8x32 reads the low 3 bits of each index; bit 3 moved to the sign bit picks the table.
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// 8 codes (int32 lanes, 0..15) packed into 4 bytes, two per byte, the even element low.
inline void q4_pack8(__m256i c, uint8_t* out) {
  const __m256i split = _mm256_permutevar8x32_epi32(c, _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0));
  const __m128i pairs = _mm_or_si128(_mm256_castsi256_si128(split), _mm_slli_epi32(_mm256_extracti128_si256(split, 1), 4));
  const __m128i bytes = _mm_packus_epi16(_mm_packus_epi32(pairs, pairs), _mm_setzero_si128());
  const int32_t word = _mm_cvtsi128_si32(bytes);
  std::memcpy(out, &word, 4);
}

// to_bf16 on 8 lanes: round to nearest even, a NaN stays a quiet NaN.
inline __m128i to_bf16_8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
  const __m256i all_exp = _mm256_cmpeq_epi32(_mm256_and_si256(b, exp_mask), exp_mask);
  const __m256i no_mant = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x007fffff)), _mm256_setzero_si256());
  const __m256i nan = _mm256_andnot_si256(no_mant, all_exp);
  const __m256i hi = _mm256_srli_epi32(b, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(hi, _mm256_set1_epi32(1))), 16);
  const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  // Values fit 16 bits, so the unsigned saturating pack is exact; it works within 128-bit halves.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}

inline uint32_t reduce_max_epu32(__m256i x) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// One whole block of 128 elements starting at b0; m and v both q4 with block_size 128.
inline void q4_block_avx2(const StepConsts& k, float* __restrict w, const float* __restrict g, const MomentRef& m,
                          const MomentRef& v, int64_t b0, float* __restrict stream_f32, uint16_t* __restrict stream_bf16) {
  const int64_t block = b0 / kQBlock;
  uint8_t* mc = m.codes + block * (kQBlock / 2);
  uint8_t* vc = v.codes + block * (kQBlock / 2);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256 m_table[2], v_table[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i lane = _mm256_add_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(8 * h));
    const __m256 qm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lane, _mm256_set1_epi32(7))),
                                    _mm256_set1_ps(1.0f / 7.0f));
    const __m256 qm_abs = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(qm), abs_mask));
    m_table[h] = _mm256_mul_ps(_mm256_mul_ps(qm, qm_abs), _mm256_set1_ps(m.scales[block]));
    const __m256 qv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lane, _mm256_set1_epi32(1))),
                                    _mm256_set1_ps(1.0f / 16.0f));
    const __m256 u = _mm256_mul_ps(_mm256_mul_ps(qv, qv), _mm256_set1_ps(v.scales[block]));
    v_table[h] = _mm256_mul_ps(u, u);
  }
  const __m256 gs = _mm256_set1_ps(k.grad_scale), decay = _mm256_set1_ps(k.decay), b1 = _mm256_set1_ps(k.b1),
               b2 = _mm256_set1_ps(k.b2), omb1 = _mm256_set1_ps(k.omb1), omb2 = _mm256_set1_ps(k.omb2),
               step = _mm256_set1_ps(k.step_size), bc2 = _mm256_set1_ps(k.bc2_sqrt), eps = _mm256_set1_ps(k.eps);
  __m256 new_m[kQBlock / 8], root_v[kQBlock / 8];
  __m256i m_max = _mm256_setzero_si256(), s_max = _mm256_setzero_si256();
  w += b0;
  g += b0;
  for (int j = 0; j < kQBlock / 8; ++j) {
    const __m256 m0 = q4_decode8(mc + 4 * j, m_table[0], m_table[1]);
    const __m256 v0 = q4_decode8(vc + 4 * j, v_table[0], v_table[1]);
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + 8 * j), gs);
    const __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(w + 8 * j), decay);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(m0, b1), _mm256_mul_ps(omb1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(v0, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    const __m256 sv = _mm256_sqrt_ps(vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(sv, bc2), eps);
    const __m256 p = _mm256_sub_ps(p0, _mm256_mul_ps(step, _mm256_div_ps(mi, denom)));
    _mm256_storeu_ps(w + 8 * j, p);
    if (stream_f32) _mm256_storeu_ps(stream_f32 + b0 + 8 * j, p);
    if (stream_bf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(stream_bf16 + b0 + 8 * j), to_bf16_8(p));
    new_m[j] = mi;
    root_v[j] = sv;
    m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(mi), abs_mask));
    s_max = _mm256_max_epu32(s_max, _mm256_and_si256(_mm256_castps_si256(sv), abs_mask));
  }
  const float m_sc = bits_to_float(reduce_max_epu32(m_max));
  const float v_sc = bits_to_float(reduce_max_epu32(s_max));
  m.scales[block] = m_sc;
  v.scales[block] = v_sc;
  const __m256 m_inv = _mm256_set1_ps(m_sc > 0.0f ? 1.0f / m_sc : 0.0f);
  const __m256 v_inv = _mm256_set1_ps(v_sc > 0.0f ? 1.0f / v_sc : 0.0f);
  const __m256 seven = _mm256_set1_ps(7.0f), sixteen = _mm256_set1_ps(16.0f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
  for (int j = 0; j < kQBlock / 8; ++j) {
    const __m256 mi = new_m[j];
    const __m256 lin = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(mi), abs_mask)), m_inv);
    const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_sqrt_ps(lin), seven), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 neg = _mm256_cmp_ps(mi, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256i c = _mm256_cvttps_epi32(_mm256_xor_ps(q, _mm256_and_ps(neg, sign)));
    c = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(c, _mm256_set1_epi32(-7)), _mm256_set1_epi32(7)),
                         _mm256_set1_epi32(7));
    q4_pack8(c, mc + 4 * j);
    const __m256 x = _mm256_sqrt_ps(_mm256_mul_ps(root_v[j], v_inv));
    __m256i cv = _mm256_sub_epi32(
        _mm256_cvttps_epi32(_mm256_round_ps(_mm256_mul_ps(x, sixteen), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
        _mm256_set1_epi32(1));
    cv = _mm256_min_epi32(_mm256_max_epi32(cv, _mm256_setzero_si256()), _mm256_set1_epi32(15));
    q4_pack8(cv, vc + 4 * j);
  }
}

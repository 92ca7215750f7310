// The per-token and per-chunk arithmetic of the MoE kernels (moe.cu), as host-and-device inline
// functions: the kernels call them on the GPU, and tests/kernels/cuda_ops_test.cpp runs them on the
// host, chunk by chunk and token by token as the grid would, against the CPU ops (kernels/cpu/moe.h)
// on machines without a GPU. Plain C++ when the host compiler includes it (no CUDA headers).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MT_HD __host__ __device__ __forceinline__
#else
#define MT_HD inline
#endif

namespace megatrain::cuda::moe_math {

// Slots per chunk of the counting sort (one block of this many threads per chunk on the GPU).
inline constexpr int kChunk = 256;

// One IEEE operation each, never contracted into an FMA (the __f*_rn intrinsics on the device;
// the host compiler does not contract in ISO C++ mode).
MT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MT_HD float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

// Token t's routing: p = softmax(z) over the e experts (in index order), the k largest by repeated
// selection (the lower index on a tie) into ex[0..k) and w[0..k), divided by their sum when renorm.
// The CPU op's sequence of operations (cpu::moe_route_forward).
MT_HD void route_forward_token(const float* z, int e, int k, bool renorm, int32_t* ex, float* w, float* p) {
  float mx = z[0];
  for (int x = 1; x < e; ++x) mx = mx < z[x] ? z[x] : mx;  // std::max(mx, z[x])
  float sum = 0.0f;
  for (int x = 0; x < e; ++x) {
    const float v = exp_f(sub_rn(z[x], mx));
    p[x] = v;
    sum = add_rn(sum, v);
  }
  for (int x = 0; x < e; ++x) p[x] = div_rn(p[x], sum);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int x = 0; x < e; ++x) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || ex[i] == x;
      if (!taken && (best < 0 || p[x] > p[best])) best = x;
    }
    ex[j] = best;
    w[j] = p[best];
  }
  if (renorm) {
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s = add_rn(s, w[j]);
    for (int j = 0; j < k; ++j) w[j] = div_rn(w[j], s);
  }
}

// Token t's logit gradient dz[0..e) from the combine weights' gradient dw[0..k), through the
// renormalisation (w_j = p_j / S: d p_j = (dw_j - sum_i dw_i w_i) / S) and the softmax, plus c[x]
// (the load-balancing term) on every probability when c is not null (cpu::moe_route_backward).
MT_HD void route_backward_token(const float* p, const int32_t* ex, const float* w, const float* dw, const float* c, int e, int k,
                                bool renorm, float* dz) {
  float S = 0.0f, dot = 0.0f;
  if (renorm) {
    for (int j = 0; j < k; ++j) S = add_rn(S, p[ex[j]]);
    for (int j = 0; j < k; ++j) dot = add_rn(dot, mul_rn(dw[j], w[j]));
  }
  float s = 0.0f;
  for (int pass = 0; pass < 2; ++pass)
    for (int x = 0; x < e; ++x) {
      // d p[x]: the constant term, plus the chosen slot's term when x was chosen (experts are distinct)
      float dp = c ? c[x] : 0.0f;
      for (int j = 0; j < k; ++j)
        if (ex[j] == x) dp = add_rn(dp, renorm ? div_rn(sub_rn(dw[j], dot), S) : dw[j]);
      if (pass == 0)
        s = add_rn(s, mul_rn(p[x], dp));
      else
        dz[x] = mul_rn(p[x], sub_rn(dp, s));
    }
}

// The counting sort over chunks of kChunk slots. `chunk` holds the chunk's experts, -1 past the
// last slot. Step 1: the chunk's count of expert x.
MT_HD int32_t chunk_count(const int32_t* chunk, int32_t x) {
  int32_t c = 0;
  for (int j = 0; j < kChunk; ++j) c += chunk[j] == x ? 1 : 0;
  return c;
}
// Step 2, for expert x: its total over the chunks' counts[b * e + x].
MT_HD int32_t expert_total(const int32_t* counts, int64_t chunks, int e, int x) {
  int32_t total = 0;
  for (int64_t b = 0; b < chunks; ++b) total += counts[b * e + x];
  return total;
}
// ... then (one thread) the exclusive scan of the totals into offsets[0..e] (first[x] = offsets[x]) ...
MT_HD void scan_totals(int32_t* first, int e, int64_t slots, int32_t* offsets) {
  int32_t run = 0;
  for (int x = 0; x < e; ++x) {
    const int32_t total = first[x];
    offsets[x] = run;
    first[x] = run;
    run += total;
  }
  offsets[e] = static_cast<int32_t>(slots);
}
// ... and, for expert x, each chunk's first sorted row of x (counts rewritten in place).
MT_HD void first_rows(int32_t* counts, int64_t chunks, int e, int x, int32_t first_x) {
  int32_t run = first_x;
  for (int64_t b = 0; b < chunks; ++b) {
    const int32_t c = counts[b * e + x];
    counts[b * e + x] = run;
    run += c;
  }
}
// Step 3: slot i of the chunk goes to its (chunk, expert)'s first row plus the number of earlier
// slots of the chunk with the same expert.
MT_HD int32_t rank_in_chunk(const int32_t* chunk, int i) {
  int32_t r = 0;
  for (int j = 0; j < i; ++j) r += chunk[j] == chunk[i] ? 1 : 0;
  return r;
}

}  // namespace megatrain::cuda::moe_math

#undef MT_HD

// Rotary position embedding (HF rotate_half layout), in place, on the GPU.
//
// One thread per rotation pair: the flat index q in [0, n_tokens * n_heads * d/2) maps to
// i = q % (d/2), th = q / (d/2) (token * n_heads + head), token = th / n_heads; a grid-stride loop
// over q (int64) covers any size with a capped grid. The thread reads x[i] and x[i + d/2] of its
// (token, head) row, computes angle = float(positions[token]) * inv_freq[i] in fp32, cos/sin with
// the accurate sincosf (not the __sinf/__cosf intrinsics), multiplies both by `scale` (yarn's
// attention factor, as the CPU op does; 1 otherwise), and writes both elements back:
//   forward   x[i] = a cos + (-b) sin;   x[i+d/2] = b cos + a sin
//   backward  x[i] = a cos + b sin;      x[i+d/2] = b cos + (-a) sin       (rotation by -angle)
// Each element is read and written by exactly one thread, so in place is safe and the result is
// deterministic. Products and sums use __fmul_rn / __fadd_rn, rounded separately as the CPU op
// rounds them (no FMA contraction). In bf16, the rotation is done in fp32 and rounded once.
#include "cuda/rope.cuh"

#include "cuda/device_util.cuh"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(T* x, const int32_t* positions, int64_t n_heads, int64_t head_dim, const float* inv_freq, float scale,
                int64_t total) {
  const int64_t half = head_dim / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; q < total; q += stride) {
    const int64_t i = q % half;
    const int64_t th = q / half;  // token * n_heads + head
    const int64_t token = th / n_heads;
    const float angle = __fmul_rn(static_cast<float>(positions[token]), inv_freq[i]);
    float sn, cs;
    sincosf(angle, &sn, &cs);
    sn = __fmul_rn(sn, scale);  // yarn's attention factor on cos and sin (1: exact, no change)
    cs = __fmul_rn(cs, scale);
    T* xa = x + th * head_dim + i;
    T* xb = xa + half;
    const float a = to_f(*xa);
    const float b = to_f(*xb);
    float oa, ob;
    if constexpr (!kBackward) {
      oa = __fadd_rn(__fmul_rn(a, cs), __fmul_rn(-b, sn));
      ob = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
    } else {
      oa = __fadd_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
      ob = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(-a, sn));
    }
    *xa = from_f<T>(oa);
    *xb = from_f<T>(ob);
  }
}

// rope_forward (kBackward false) and rope_backward (true): the rotation of every pair of x, in place.
// head_dim is even (rope_inv_freq refuses odd ones); an odd last element would be left untouched.
template <typename T, bool kBackward>
Status rope_apply(T* x, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                  const float* inv_freq, float scale, cudaStream_t s) {
  if (n_tokens <= 0 || n_heads <= 0 || head_dim < 2) return {};
  const int64_t total = n_tokens * n_heads * (head_dim / 2);
  rope_kernel<T, kBackward><<<stride_grid<kThreads>(total), kThreads, 0, s>>>(x, positions, n_heads, head_dim, inv_freq,
                                                                             scale, total);
  if constexpr (kBackward)
    MT_CUDA_LAUNCH_CHECK("rope_backward");
  else
    MT_CUDA_LAUNCH_CHECK("rope_forward");
  return {};
}

}  // namespace

template <typename T>
Status rope_forward(T* x, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                    const float* inv_freq, cudaStream_t s, float scale) {
  return rope_apply<T, false>(x, positions, n_tokens, n_heads, head_dim, inv_freq, scale, s);
}

template <typename T>
Status rope_backward(T* dx, const int32_t* positions, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                     const float* inv_freq, cudaStream_t s, float scale) {
  return rope_apply<T, true>(dx, positions, n_tokens, n_heads, head_dim, inv_freq, scale, s);
}

#define MT_INSTANTIATE(T)                                                                                       \
  template Status rope_forward<T>(T*, const int32_t*, int64_t, int64_t, int64_t, const float*, cudaStream_t, float); \
  template Status rope_backward<T>(T*, const int32_t*, int64_t, int64_t, int64_t, const float*, cudaStream_t, float);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace megatrain::cuda

// RoPE forward/backward and HF's inv_freq rules (default, linear, llama3, yarn).
#include "megatrain/kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "detail.h"

namespace megatrain::cpu {

Result<RopeScaling> parse_rope_scaling_type(std::string_view type) {
  if (type.empty() || type == "default") return RopeScaling::kNone;
  if (type == "linear") return RopeScaling::kLinear;
  if (type == "llama3") return RopeScaling::kLlama3;
  if (type == "yarn") return RopeScaling::kYarn;
  return unsupported("rope_scaling type \"" + std::string(type) +
                     "\" is not supported by the CPU kernels (accepted: none, \"default\", \"linear\", \"llama3\", \"yarn\")");
}

template <typename T>
Result<std::vector<T>> rope_inv_freq(const RopeConfig& c) {
  if (c.head_dim <= 0 || c.head_dim % 2 != 0)
    return invalid_argument("rope: head_dim must be even and positive, got " + detail::str(c.head_dim));
  if (!(c.theta > 0)) return invalid_argument("rope: rope_theta must be positive");
  if (c.scaling != RopeScaling::kNone && !(c.factor > 0))
    return invalid_argument("rope: rope_scaling.factor must be positive");
  if (c.scaling == RopeScaling::kLlama3 &&
      (!(c.high_freq_factor > c.low_freq_factor) || !(c.low_freq_factor > 0) ||
       !(c.original_max_position_embeddings > 0)))
    return invalid_argument(
        "rope: llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0 and "
        "original_max_position_embeddings > 0");

  if (c.scaling == RopeScaling::kYarn && (!(c.original_max_position_embeddings > 0) || !(c.beta_fast > 0) || !(c.beta_slow > 0)))
    return invalid_argument("rope: yarn rope_scaling needs original_max_position_embeddings, beta_fast and beta_slow > 0");

  const int64_t half = c.head_dim / 2;
  std::vector<T> inv(static_cast<size_t>(half));
  // HF: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), each step an fp32 tensor op when T = float.
  for (int64_t i = 0; i < half; ++i) {
    const T expo = static_cast<T>(2 * i) / static_cast<T>(c.head_dim);
    inv[static_cast<size_t>(i)] = T(1) / std::pow(static_cast<T>(c.theta), expo);
  }
  const T factor = static_cast<T>(c.factor);
  if (c.scaling == RopeScaling::kYarn) {
    // HF _compute_yarn_parameters: the correction range in Python doubles, the ramp and the blend
    // as T tensors. inv currently holds 1 / pos_freqs (the extrapolated frequencies).
    const double dim = static_cast<double>(c.head_dim), two_pi = 2 * std::numbers::pi;
    auto correction_dim = [&](double rotations) {
      return dim * std::log(c.original_max_position_embeddings / (rotations * two_pi)) / (2 * std::log(c.theta));
    };
    double low = correction_dim(c.beta_fast), high = correction_dim(c.beta_slow);
    if (c.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high) high += 0.001;  // HF: prevent a singular ramp
    const T low_t = static_cast<T>(low), span = static_cast<T>(high - low);
    for (int64_t i = 0; i < half; ++i) {
      T& f = inv[static_cast<size_t>(i)];
      const T pos_freq = std::pow(static_cast<T>(c.theta), static_cast<T>(2 * i) / static_cast<T>(c.head_dim));
      const T extrapolation = T(1) / pos_freq;
      const T interpolation = T(1) / (factor * pos_freq);
      const T ramp = std::clamp((static_cast<T>(i) - low_t) / span, T(0), T(1));
      const T extra_factor = T(1) - ramp;
      f = interpolation * (T(1) - extra_factor) + extrapolation * extra_factor;
    }
  } else if (c.scaling == RopeScaling::kLinear) {
    for (T& f : inv) f = f / factor;
  } else if (c.scaling == RopeScaling::kLlama3) {
    // Python scalars (double) where HF computes them in Python, rounded to T where they meet a tensor.
    const double old_ctx = c.original_max_position_embeddings;
    const T low_wavelen = static_cast<T>(old_ctx / c.low_freq_factor);
    const T high_wavelen = static_cast<T>(old_ctx / c.high_freq_factor);
    const T two_pi = static_cast<T>(2 * std::numbers::pi);
    const T old_ctx_t = static_cast<T>(old_ctx);
    const T low_t = static_cast<T>(c.low_freq_factor);
    const T span = static_cast<T>(c.high_freq_factor - c.low_freq_factor);
    for (T& f : inv) {
      const T wavelen = two_pi / f;
      const T scaled = wavelen > low_wavelen ? f / factor : f;
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (medium) {
        const T smooth = (old_ctx_t / wavelen - low_t) / span;
        f = (T(1) - smooth) * scaled / factor + smooth * scaled;
      } else {
        f = scaled;
      }
    }
  }
  return inv;
}

double rope_attention_scaling(const RopeConfig& c) {
  if (c.scaling != RopeScaling::kYarn) return 1.0;
  if (c.attention_factor > 0) return c.attention_factor;
  return c.factor <= 1 ? 1.0 : 0.1 * std::log(c.factor) + 1.0;
}

namespace {

// sign = +1: forward rotation by +angle; sign = -1: its transpose (rotation by -angle).
template <typename T>
void rope_apply(CpuContext& ctx, const T* x, T* out, const int32_t* positions, int64_t n_tokens, int64_t n_heads,
                int64_t head_dim, const T* inv_freq, T scale, bool transpose) {
  MT_CHECK(n_tokens >= 0 && n_heads > 0 && head_dim > 0 && head_dim % 2 == 0, "rope: bad sizes");
  const ProfiledOp op(transpose ? "rope backward" : "rope forward", 3 * detail::dbl(n_tokens * n_heads * head_dim),
                      static_cast<double>(sizeof(T)) * 2 * detail::dbl(n_tokens * n_heads * head_dim));
  const int64_t half = head_dim / 2;
  detail::parallel_for(ctx, n_tokens, 4, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> cs(static_cast<size_t>(2 * half));
    T* cos_v = cs.data();
    T* sin_v = cs.data() + half;
    for (int64_t t = t0; t < t1; ++t) {
      const T p = static_cast<T>(positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const T angle = p * inv_freq[i];
        cos_v[i] = std::cos(angle);
        sin_v[i] = std::sin(angle);
        if (scale != T(1)) {  // HF: cos and sin times the attention scaling (yarn)
          cos_v[i] *= scale;
          sin_v[i] *= scale;
        }
      }
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t off = (t * n_heads + h) * head_dim;
        const T* xa = x + off;
        const T* xb = xa + half;
        T* oa = out + off;
        T* ob = oa + half;
        for (int64_t i = 0; i < half; ++i) {
          const T a = xa[i];
          const T b = xb[i];
          if (!transpose) {
            // HF: x * cos + rotate_half(x) * sin, with rotate_half = cat(-x2, x1).
            oa[i] = a * cos_v[i] + (-b) * sin_v[i];
            ob[i] = b * cos_v[i] + a * sin_v[i];
          } else {
            oa[i] = a * cos_v[i] + b * sin_v[i];
            ob[i] = b * cos_v[i] + (-a) * sin_v[i];
          }
        }
      }
    }
  });
}

}  // namespace

template <typename T>
void rope_forward(CpuContext& ctx, const T* x, T* out, const int32_t* positions, int64_t n_tokens, int64_t n_heads,
                  int64_t head_dim, const T* inv_freq, T scale) {
  rope_apply(ctx, x, out, positions, n_tokens, n_heads, head_dim, inv_freq, scale, false);
}

template <typename T>
void rope_backward(CpuContext& ctx, const T* dout, T* dx, const int32_t* positions, int64_t n_tokens,
                   int64_t n_heads, int64_t head_dim, const T* inv_freq, T scale) {
  rope_apply(ctx, dout, dx, positions, n_tokens, n_heads, head_dim, inv_freq, scale, true);
}

#define MT_INSTANTIATE(T)                                                                                    \
  template Result<std::vector<T>> rope_inv_freq<T>(const RopeConfig&);                                      \
  template void rope_forward<T>(CpuContext&, const T*, T*, const int32_t*, int64_t, int64_t, int64_t, const T*, T); \
  template void rope_backward<T>(CpuContext&, const T*, T*, const int32_t*, int64_t, int64_t, int64_t, const T*, T);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

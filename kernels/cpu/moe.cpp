// The Mixture-of-Experts ops: routing, the sort by expert, gather, grouped GEMMs, combine, and
// their backward (moe.h).
#include "megatrain/kernels/cpu/moe.h"

#include <algorithm>
#include <limits>
#include <cmath>
#include <cstring>
#include <vector>

#include "detail.h"
#include "megatrain/kernels/cpu/linear.h"

namespace megatrain::cpu {
namespace {
constexpr int64_t kRowChunk = 64;  // tokens per thread at least
}

template <typename T>
void moe_route_forward(CpuContext& ctx, const T* logits, int64_t n, int64_t e, int64_t k, bool renorm, int32_t* expert,
                       T* weight, T* probs) {
  MT_CHECK(n >= 0 && e >= 1 && k >= 1 && k <= e, "moe_route_forward: bad sizes");
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* z = logits + t * e;
      T* p = probs + t * e;
      T mx = z[0];
      for (int64_t x = 1; x < e; ++x) mx = std::max(mx, z[x]);
      T sum = 0;
      for (int64_t x = 0; x < e; ++x) sum += (p[x] = std::exp(z[x] - mx));
      for (int64_t x = 0; x < e; ++x) p[x] /= sum;
      // Top-k by repeated selection: the largest remaining p, the lower index on a tie.
      int32_t* ex = expert + t * k;
      T* w = weight + t * k;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t x = 0; x < e; ++x) {
          bool taken = false;
          for (int64_t i = 0; i < j; ++i) taken = taken || ex[i] == x;
          if (!taken && (best < 0 || p[x] > p[best])) best = x;
        }
        ex[j] = static_cast<int32_t>(best);
        w[j] = p[best];
      }
      if (renorm) {
        T s = 0;
        for (int64_t j = 0; j < k; ++j) s += w[j];
        for (int64_t j = 0; j < k; ++j) w[j] /= s;
      }
    }
  });
}

template <typename T>
void moe_route_backward(CpuContext& ctx, const T* probs, const int32_t* expert, const T* weight, const T* d_weight,
                        const T* d_probs_const, int64_t n, int64_t e, int64_t k, bool renorm, T* dlogits) {
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> dp(static_cast<size_t>(e));
    for (int64_t t = t0; t < t1; ++t) {
      const T* p = probs + t * e;
      const int32_t* ex = expert + t * k;
      const T* w = weight + t * k;
      const T* dw = d_weight + t * k;
      for (int64_t x = 0; x < e; ++x) dp[static_cast<size_t>(x)] = d_probs_const ? d_probs_const[x] : T(0);
      if (renorm) {
        // w_j = p_j / S with S the sum of the chosen p: d p_j = (dw_j - sum_i dw_i w_i) / S.
        T S = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) S += p[ex[j]];
        for (int64_t j = 0; j < k; ++j) dot += dw[j] * w[j];
        for (int64_t j = 0; j < k; ++j) dp[static_cast<size_t>(ex[j])] += (dw[j] - dot) / S;
      } else {
        for (int64_t j = 0; j < k; ++j) dp[static_cast<size_t>(ex[j])] += dw[j];
      }
      T s = 0;
      for (int64_t x = 0; x < e; ++x) s += p[x] * dp[static_cast<size_t>(x)];
      T* dz = dlogits + t * e;
      for (int64_t x = 0; x < e; ++x) dz[x] = p[x] * (dp[static_cast<size_t>(x)] - s);
    }
  });
}

template <typename T>
void moe_sigmoid_route_forward(CpuContext& ctx, const T* logits, const T* bias, int64_t n, int64_t e, int64_t k,
                               const SigmoidRoute& r, int32_t* expert, T* weight, T* scores) {
  const int64_t G = r.n_group, per = G >= 1 ? e / G : 0;
  MT_CHECK(n >= 0 && e >= 1 && k >= 1 && k <= e && G >= 1 && e % G == 0 && (G == 1 || per >= 2) && r.topk_group >= 1 &&
               r.topk_group <= G && r.topk_group * per >= k,
           "moe_sigmoid_route_forward: bad sizes (n_group must divide the experts into groups of >= 2, and topk_group "
           "groups must hold k experts)");
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> biased(static_cast<size_t>(e)), group(static_cast<size_t>(G));
    std::vector<char> open(static_cast<size_t>(e)), group_open(static_cast<size_t>(G));
    for (int64_t t = t0; t < t1; ++t) {
      const T* z = logits + t * e;
      T* s = scores + t * e;
      for (int64_t x = 0; x < e; ++x) {
        s[x] = T(1) / (T(1) + std::exp(-z[x]));
        biased[static_cast<size_t>(x)] = s[x] + (bias ? bias[x] : T(0));
      }
      // Each group's two largest biased scores, summed (one group: every expert is open).
      std::fill(group_open.begin(), group_open.end(), char(G == 1));
      if (G > 1) {
        for (int64_t g = 0; g < G; ++g) {
          T a = -std::numeric_limits<T>::infinity(), b = a;  // the largest two
          for (int64_t x = g * per; x < (g + 1) * per; ++x) {
            const T v = biased[static_cast<size_t>(x)];
            if (v > a) {
              b = a;
              a = v;
            } else if (v > b) {
              b = v;
            }
          }
          group[static_cast<size_t>(g)] = a + b;
        }
        for (int64_t j = 0; j < r.topk_group; ++j) {  // the best groups, the lower index on a tie
          int64_t best = -1;
          for (int64_t g = 0; g < G; ++g)
            if (!group_open[static_cast<size_t>(g)] && (best < 0 || group[static_cast<size_t>(g)] > group[static_cast<size_t>(best)]))
              best = g;
          group_open[static_cast<size_t>(best)] = 1;
        }
      }
      for (int64_t x = 0; x < e; ++x) open[static_cast<size_t>(x)] = group_open[static_cast<size_t>(x / per)];
      int32_t* ex = expert + t * k;
      T* w = weight + t * k;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t x = 0; x < e; ++x)
          if (open[static_cast<size_t>(x)] && (best < 0 || biased[static_cast<size_t>(x)] > biased[static_cast<size_t>(best)]))
            best = x;
        open[static_cast<size_t>(best)] = 0;
        ex[j] = static_cast<int32_t>(best);
        w[j] = s[best];
      }
      if (r.renorm) {
        T sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += w[j];
        sum += static_cast<T>(1e-20);
        for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      }
      for (int64_t j = 0; j < k; ++j) w[j] *= static_cast<T>(r.scale);
    }
  });
}

template <typename T>
void moe_sigmoid_route_backward(CpuContext& ctx, const T* scores, const int32_t* expert, const T* d_weight, int64_t n,
                                int64_t e, int64_t k, const SigmoidRoute& r, T* dlogits) {
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* s = scores + t * e;
      const int32_t* ex = expert + t * k;
      const T* dw = d_weight + t * k;
      T* dz = dlogits + t * e;
      std::fill(dz, dz + e, T(0));
      const T c = static_cast<T>(r.scale);
      if (r.renorm) {
        // w_j = c s_j / S, S = sum_i s_i + 1e-20: d s_j = c (dw_j - sum_i dw_i s_i / S) / S.
        T S = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) S += s[ex[j]];
        S += static_cast<T>(1e-20);
        for (int64_t j = 0; j < k; ++j) dot += dw[j] * s[ex[j]];
        for (int64_t j = 0; j < k; ++j) {
          const T sj = s[ex[j]];
          dz[ex[j]] = c * (dw[j] - dot / S) / S * sj * (T(1) - sj);
        }
      } else {
        for (int64_t j = 0; j < k; ++j) {
          const T sj = s[ex[j]];
          dz[ex[j]] = c * dw[j] * sj * (T(1) - sj);
        }
      }
    }
  });
}

void moe_permute(const int32_t* expert, int64_t n, int64_t k, int64_t e, int32_t* offsets, int32_t* perm) {
  const int64_t slots = n * k;
  std::fill(offsets, offsets + e + 1, 0);
  for (int64_t s = 0; s < slots; ++s) {
    MT_CHECK(expert[s] >= 0 && expert[s] < e, "moe_permute: expert index out of range");
    ++offsets[expert[s] + 1];
  }
  for (int64_t x = 0; x < e; ++x) offsets[x + 1] += offsets[x];
  std::vector<int32_t> next(offsets, offsets + e);
  for (int64_t s = 0; s < slots; ++s) perm[next[static_cast<size_t>(expert[s])]++] = static_cast<int32_t>(s);
}

template <typename T>
void moe_gather(CpuContext& ctx, const T* x, const int32_t* perm, int64_t rows, int64_t k, int64_t h, T* xp) {
  detail::parallel_for(ctx, rows, kRowChunk, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(xp + r * h, x + static_cast<int64_t>(perm[r] / k) * h, sizeof(T) * static_cast<size_t>(h));
  });
}

template <typename T>
void grouped_linear_forward(CpuContext& ctx, const T* x, const T* w, int64_t w_stride, const T* bias, int64_t b_stride,
                            const int32_t* offsets, int64_t e, int64_t in, int64_t out, T* y) {
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows == 0) continue;
    linear_forward<T>(ctx, x + r0 * in, w + g * w_stride, bias ? bias + g * b_stride : nullptr, rows, in, out, y + r0 * out);
  }
}

template <typename T>
void grouped_linear_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, int64_t w_stride, const int32_t* offsets,
                             int64_t e, int64_t in, int64_t out, T* dx, T* dw, T* db, int64_t b_stride) {
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows == 0) continue;
    linear_backward<T>(ctx, dy + r0 * out, x + r0 * in, w + g * w_stride, rows, in, out, dx ? dx + r0 * in : nullptr, false,
                       dw ? dw + g * w_stride : nullptr, db ? db + g * b_stride : nullptr);
  }
}

template <typename T>
void grouped_matmul_forward(CpuContext& ctx, const T* x, const T* w, int64_t w_stride, const T* bias, int64_t b_stride,
                            const int32_t* offsets, int64_t e, int64_t in, int64_t out, T* y) {
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows == 0) continue;
    T* yg = y + r0 * out;
    T beta = 0;
    if (bias) {  // the bias is the GEMM's initial C, as torch's addmm has it
      for (int64_t r = 0; r < rows; ++r) std::copy(bias + g * b_stride, bias + g * b_stride + out, yg + r * out);
      beta = 1;
    }
    gemm<T>(ctx, false, false, rows, out, in, T(1), x + r0 * in, in, w + g * w_stride, out, beta, yg, out);
  }
}

template <typename T>
void grouped_matmul_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, int64_t w_stride, const int32_t* offsets,
                             int64_t e, int64_t in, int64_t out, T* dx, T* dw, T* db, int64_t b_stride) {
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
    if (rows == 0) continue;
    const T* dyg = dy + r0 * out;
    if (dx) gemm<T>(ctx, false, true, rows, in, out, T(1), dyg, out, w + g * w_stride, out, T(0), dx + r0 * in, in);
    if (dw) gemm<T>(ctx, true, false, in, out, rows, T(1), x + r0 * in, in, dyg, out, T(1), dw + g * w_stride, out);
    if (db) {
      T* b = db + g * b_stride;
      detail::parallel_for(ctx, out, 256, 16, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          T acc = 0;
          for (int64_t r = 0; r < rows; ++r) acc += dyg[r * out + c];
          b[c] += acc;
        }
      });
    }
  }
}

template <typename T>
void moe_combine_forward(CpuContext& ctx, const T* yp, const T* weight, const int32_t* row_of_slot, int64_t n, int64_t k,
                         int64_t h, T* out) {
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* o = out + t * h;
      for (int64_t c = 0; c < h; ++c) o[c] = 0;
      for (int64_t j = 0; j < k; ++j) {
        const T wj = weight[t * k + j];
        const T* y = yp + static_cast<int64_t>(row_of_slot[t * k + j]) * h;
        for (int64_t c = 0; c < h; ++c) o[c] += wj * y[c];
      }
    }
  });
}

template <typename T>
void moe_combine_backward(CpuContext& ctx, const T* yp, const T* weight, const int32_t* row_of_slot, const T* dout,
                          int64_t n, int64_t k, int64_t h, T* dyp, T* d_weight) {
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* d = dout + t * h;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = t * k + j, r = row_of_slot[s];
        const T* y = yp + r * h;
        T* dy = dyp + r * h;
        T dot = 0;
        for (int64_t c = 0; c < h; ++c) {
          dy[c] = weight[s] * d[c];
          dot += d[c] * y[c];
        }
        d_weight[s] = dot;
      }
    }
  });
}

template <typename T>
void moe_scatter_add(CpuContext& ctx, const T* dxp, const int32_t* row_of_slot, int64_t n, int64_t k, int64_t h, T* dx) {
  detail::parallel_for(ctx, n, kRowChunk, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* o = dx + t * h;
      std::memcpy(o, dxp + static_cast<int64_t>(row_of_slot[t * k]) * h, sizeof(T) * static_cast<size_t>(h));
      for (int64_t j = 1; j < k; ++j) {
        const T* src = dxp + static_cast<int64_t>(row_of_slot[t * k + j]) * h;
        for (int64_t c = 0; c < h; ++c) o[c] += src[c];
      }
    }
  });
}

template <typename T>
void moe_aux_stats(const T* probs, const int32_t* expert, int64_t n, int64_t e, int64_t k, double* count, double* prob_sum) {
  for (int64_t s = 0; s < n * k; ++s) count[expert[s]] += 1.0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t x = 0; x < e; ++x) prob_sum[x] += static_cast<double>(probs[t * e + x]);
}

#define MT_INSTANTIATE(T)                                                                                              \
  template void moe_sigmoid_route_forward<T>(CpuContext&, const T*, const T*, int64_t, int64_t, int64_t, const SigmoidRoute&, \
                                             int32_t*, T*, T*);                                                          \
  template void moe_sigmoid_route_backward<T>(CpuContext&, const T*, const int32_t*, const T*, int64_t, int64_t, int64_t,  \
                                              const SigmoidRoute&, T*);                                                  \
  template void moe_route_forward<T>(CpuContext&, const T*, int64_t, int64_t, int64_t, bool, int32_t*, T*, T*);       \
  template void moe_route_backward<T>(CpuContext&, const T*, const int32_t*, const T*, const T*, const T*, int64_t,    \
                                      int64_t, int64_t, bool, T*);                                                     \
  template void moe_gather<T>(CpuContext&, const T*, const int32_t*, int64_t, int64_t, int64_t, T*);                   \
  template void grouped_linear_forward<T>(CpuContext&, const T*, const T*, int64_t, const T*, int64_t, const int32_t*, \
                                          int64_t, int64_t, int64_t, T*);                                              \
  template void grouped_linear_backward<T>(CpuContext&, const T*, const T*, const T*, int64_t, const int32_t*, int64_t, \
                                           int64_t, int64_t, T*, T*, T*, int64_t);                                     \
  template void grouped_matmul_forward<T>(CpuContext&, const T*, const T*, int64_t, const T*, int64_t, const int32_t*, \
                                          int64_t, int64_t, int64_t, T*);                                              \
  template void grouped_matmul_backward<T>(CpuContext&, const T*, const T*, const T*, int64_t, const int32_t*, int64_t, \
                                           int64_t, int64_t, T*, T*, T*, int64_t);                                     \
  template void moe_combine_forward<T>(CpuContext&, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, T*); \
  template void moe_combine_backward<T>(CpuContext&, const T*, const T*, const int32_t*, const T*, int64_t, int64_t,   \
                                        int64_t, T*, T*);                                                              \
  template void moe_scatter_add<T>(CpuContext&, const T*, const int32_t*, int64_t, int64_t, int64_t, T*);              \
  template void moe_aux_stats<T>(const T*, const int32_t*, int64_t, int64_t, int64_t, double*, double*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

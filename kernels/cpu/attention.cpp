// Causal GQA attention (with gpt-oss's sinks and sliding windows): forward keeps the softmax
// probabilities, backward works row by row for dq and key row by key row for dk/dv, so no two
// threads ever add into the same element.
#include "megatrain/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "detail.h"

namespace megatrain::cpu {

Status check_attention_shape(const AttentionShape& s) {
  if (s.batch <= 0 || s.seq <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0)
    return invalid_argument("attention: batch, seq, n_heads, n_kv_heads and head_dim must be positive (got " +
                            detail::str(s.batch) + ", " + detail::str(s.seq) + ", " + detail::str(s.n_heads) +
                            ", " + detail::str(s.n_kv_heads) + ", " + detail::str(s.head_dim) + ")");
  if (s.n_heads % s.n_kv_heads != 0)
    return invalid_argument("attention: n_kv_heads " + detail::str(s.n_kv_heads) + " does not divide n_heads " +
                            detail::str(s.n_heads));
  return {};
}

int64_t attention_probs_elems(const AttentionShape& s) { return s.batch * s.n_heads * s.seq * s.seq; }

namespace {

// The first key query row i sees: 0, or i - window + 1 within a sliding window (HF's mask keeps
// key j when j > i - window).
int64_t first_key(const AttentionShape& s, int64_t i) { return s.window > 0 ? std::max<int64_t>(0, i - s.window + 1) : 0; }

// HF: self.scaling = head_dim ** -0.5 (a Python double), rounded to T when it meets the tensor.
template <typename T>
T attention_scale(int64_t head_dim) {
  return static_cast<T>(std::pow(static_cast<double>(head_dim), -0.5));
}

}  // namespace

template <typename T>
Status attention_forward(CpuContext& ctx, const AttentionShape& s, const T* q, const T* k, const T* v, T* out,
                         T* probs, const T* sinks, T* sink_probs) {
  MT_RETURN_IF_ERROR(check_attention_shape(s));
  if ((sinks == nullptr) != (sink_probs == nullptr))
    return invalid_argument("attention: sinks and sink_probs go together (both null or both set)");
  const int64_t seq = s.seq, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim, rep = nh / nkv;
  const T scale = attention_scale<T>(hd);
  // One item = one query row (b, h, i), numbered in that order.
  detail::parallel_for(ctx, s.batch * nh * seq, 16, 1, [&](int64_t r0, int64_t r1) {
    std::vector<T> acc(static_cast<size_t>(hd));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r % seq, h = (r / seq) % nh, b = r / (seq * nh), g = h / rep;
      const int64_t j0 = first_key(s, i);
      const T* qi = q + ((b * seq + i) * nh + h) * hd;
      T* p = probs + r * seq;
      std::fill(p, p + j0, T(0));
      T mx = sinks ? sinks[h] : -std::numeric_limits<T>::infinity();
      for (int64_t j = j0; j <= i; ++j) {
        p[j] = detail::dot(qi, k + ((b * seq + j) * nkv + g) * hd, hd) * scale;
        mx = std::max(mx, p[j]);
      }
      T sum = 0;
      for (int64_t j = j0; j <= i; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      T sink_e = 0;
      if (sinks) {  // the sink's logit joins the softmax's denominator, after the keys (HF: cat([s, sink]))
        sink_e = std::exp(sinks[h] - mx);
        sum += sink_e;
        sink_probs[r] = sink_e / sum;
      }
      for (int64_t j = j0; j <= i; ++j) p[j] /= sum;
      std::fill(p + i + 1, p + seq, T(0));
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t j = j0; j <= i; ++j) detail::axpy(p[j], v + ((b * seq + j) * nkv + g) * hd, acc.data(), hd);
      std::copy(acc.begin(), acc.end(), out + ((b * seq + i) * nh + h) * hd);
    }
  });
  return {};
}

template <typename T>
Status attention_backward(CpuContext& ctx, const AttentionShape& s, const T* q, const T* k, const T* v,
                          const T* probs, const T* dout, T* dq, T* dk, T* dv, T* workspace, const T* sink_probs,
                          T* d_sinks, T* sink_rows) {
  MT_RETURN_IF_ERROR(check_attention_shape(s));
  if (sink_probs != nullptr && (d_sinks == nullptr || sink_rows == nullptr))
    return invalid_argument("attention_backward: sink_probs needs d_sinks and the sink_rows workspace");
  const int64_t seq = s.seq, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim, rep = nh / nkv;
  const T scale = attention_scale<T>(hd);
  // Pass 1, per query row (b, h, i): ds into the workspace, and dq.
  detail::parallel_for(ctx, s.batch * nh * seq, 16, 1, [&](int64_t r0, int64_t r1) {
    std::vector<T> acc(static_cast<size_t>(hd));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r % seq, h = (r / seq) % nh, b = r / (seq * nh), g = h / rep;
      const T* doi = dout + ((b * seq + i) * nh + h) * hd;
      const T* p = probs + r * seq;
      T* ds = workspace + r * seq;
      const int64_t j0 = first_key(s, i);
      T dsum = 0;
      std::fill(ds, ds + j0, T(0));
      for (int64_t j = j0; j <= i; ++j) {
        ds[j] = detail::dot(doi, v + ((b * seq + j) * nkv + g) * hd, hd);  // dp[j]
        dsum += p[j] * ds[j];
      }
      // The sink has no value row (dp = 0): its logit's gradient is p_sink * (0 - D).
      if (sink_probs) sink_rows[r] = -sink_probs[r] * dsum;
      for (int64_t j = j0; j <= i; ++j) ds[j] = p[j] * (ds[j] - dsum) * scale;
      std::fill(ds + i + 1, ds + seq, T(0));
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t j = j0; j <= i; ++j) detail::axpy(ds[j], k + ((b * seq + j) * nkv + g) * hd, acc.data(), hd);
      std::copy(acc.begin(), acc.end(), dq + ((b * seq + i) * nh + h) * hd);
    }
  });
  // Pass 2, per key row (b, g, j): dk and dv, over the group's heads in order, then i ascending.
  detail::parallel_for(ctx, s.batch * nkv * seq, 16, 1, [&](int64_t r0, int64_t r1) {
    std::vector<T> acc_k(static_cast<size_t>(hd)), acc_v(static_cast<size_t>(hd));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t j = r % seq, g = (r / seq) % nkv, b = r / (seq * nkv);
      std::fill(acc_k.begin(), acc_k.end(), T(0));
      std::fill(acc_v.begin(), acc_v.end(), T(0));
      for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
        const int64_t row0 = (b * nh + h) * seq;  // row (b, h, 0) of probs / workspace
        const int64_t i1 = s.window > 0 ? std::min(seq, j + s.window) : seq;  // the last query that sees key j, + 1
        for (int64_t i = j; i < i1; ++i) {
          const int64_t qoff = ((b * seq + i) * nh + h) * hd;
          detail::axpy(probs[(row0 + i) * seq + j], dout + qoff, acc_v.data(), hd);
          detail::axpy(workspace[(row0 + i) * seq + j], q + qoff, acc_k.data(), hd);
        }
      }
      const int64_t kv = ((b * seq + j) * nkv + g) * hd;
      std::copy(acc_k.begin(), acc_k.end(), dk + kv);
      std::copy(acc_v.begin(), acc_v.end(), dv + kv);
    }
  });
  // The sinks' gradients: per head, the rows (b, i) in order; accumulated into d_sinks.
  if (sink_probs) {
    for (int64_t h = 0; h < nh; ++h) {
      T acc = 0;
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t i = 0; i < seq; ++i) acc += sink_rows[(b * nh + h) * seq + i];
      d_sinks[h] += acc;
    }
  }
  return {};
}

#define MT_INSTANTIATE(T)                                                                                         \
  template Status attention_forward<T>(CpuContext&, const AttentionShape&, const T*, const T*, const T*, T*, T*, \
                                       const T*, T*);                                                          \
  template Status attention_backward<T>(CpuContext&, const AttentionShape&, const T*, const T*, const T*,        \
                                        const T*, const T*, T*, T*, T*, T*, const T*, T*, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

// Causal GQA attention (with gpt-oss's sinks and sliding windows) through small GEMMs: forward
// keeps the softmax probabilities; both passes work on blocks of kRows query rows of one head (the
// scores and the output as Eigen products over the keys the block can see), and backward's dk/dv
// on blocks of key rows of one kv head, summing its query heads in order, so no two threads ever
// add into the same element and the split does not depend on the thread count.
#include "megatrain/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "detail.h"
#include "eigen_maps.h"

namespace megatrain::cpu {

Status check_attention_shape(const AttentionShape& s) {
  if (s.batch <= 0 || s.seq <= 0 || s.n_heads <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0)
    return invalid_argument("attention: batch, seq, n_heads, n_kv_heads and head_dim must be positive (got " +
                            detail::str(s.batch) + ", " + detail::str(s.seq) + ", " + detail::str(s.n_heads) +
                            ", " + detail::str(s.n_kv_heads) + ", " + detail::str(s.head_dim) + ")");
  if (s.n_heads % s.n_kv_heads != 0)
    return invalid_argument("attention: n_kv_heads " + detail::str(s.n_kv_heads) + " does not divide n_heads " +
                            detail::str(s.n_heads));
  if (s.starts)  // contiguous documents: each token's start is its own index or its predecessor's start
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < s.seq; ++i) {
        const int64_t st = s.starts[b * s.seq + i];
        if (!(st == i || (i > 0 && st == s.starts[b * s.seq + i - 1])))
          return invalid_argument("attention: document start " + detail::str(st) + " of row " + detail::str(b) + ", token " +
                                  detail::str(i) + " is neither the token itself nor its predecessor's start");
      }
  return {};
}

int64_t attention_probs_elems(const AttentionShape& s) { return s.batch * s.n_heads * s.seq * s.seq; }

namespace {

// The first key query row i of batch row b sees: 0, or i - window + 1 within a sliding window
// (HF's mask keeps key j when j > i - window), and not before its document's first token.
int64_t first_key(const AttentionShape& s, int64_t b, int64_t i) {
  const int64_t w = s.window > 0 ? std::max<int64_t>(0, i - s.window + 1) : 0;
  return s.starts ? std::max<int64_t>(w, s.starts[b * s.seq + i]) : w;
}

// HF: self.scaling = head_dim ** -0.5 (a Python double), rounded to T when it meets the tensor.
template <typename T>
T attention_scale(int64_t head_dim) {
  return static_cast<T>(std::pow(static_cast<double>(head_dim), -0.5));
}

using detail::CMap;
using detail::MMap;

// Query rows per block: a block of rows [i0, i1) sees keys [first_key(i0), i1), so the products
// skip most of the masked upper triangle; the block is one task.
constexpr int64_t kRows = 32;

// Rows [i0, i1) of head h's (or kv head g's) slice of a [B, T, heads, head_dim] array, as a matrix.
// Task t of a pass over blocks of query rows, numbered (b, h, block) in that order: its batch row,
// head, kv head, rows [i0, i1) and the first key any of them sees.
struct QueryBlock {
  int64_t b, h, g, i0, i1, jlo;
};
QueryBlock query_block(const AttentionShape& s, int64_t t) {
  const int64_t blocks = (s.seq + kRows - 1) / kRows, blk = t % blocks, h = (t / blocks) % s.n_heads;
  const int64_t i0 = blk * kRows, b = t / (blocks * s.n_heads);
  return {b, h, h / (s.n_heads / s.n_kv_heads), i0, std::min(s.seq, i0 + kRows), first_key(s, b, i0)};
}

template <typename P>
auto rows_of(P* base, int64_t b, int64_t i0, int64_t i1, int64_t seq, int64_t heads, int64_t h, int64_t hd) {
  using M = std::conditional_t<std::is_const_v<P>, CMap<std::remove_const_t<P>>, MMap<P>>;
  return M(base + ((b * seq + i0) * heads + h) * hd, i1 - i0, hd, Eigen::OuterStride<>(heads * hd));
}
}  // namespace

template <typename T>
Status attention_forward(CpuContext& ctx, const AttentionShape& s, const T* q, const T* k, const T* v, T* out,
                         T* probs, const T* sinks, T* sink_probs) {
  MT_RETURN_IF_ERROR(check_attention_shape(s));
  if ((sinks == nullptr) != (sink_probs == nullptr))
    return invalid_argument("attention: sinks and sink_probs go together (both null or both set)");
  // Causal: about T^2/2 scores per head, each a dot of head_dim and a multiply-add into the output.
  const double pairs = detail::dbl(s.batch * s.n_heads) * detail::dbl(s.seq) * detail::dbl(s.seq + 1) / 2;
  const ProfiledOp op("attention forward", 4 * pairs * detail::dbl(s.head_dim),
                      static_cast<double>(sizeof(T)) * (detail::dbl(s.batch * s.seq * (2 * s.n_heads + 2 * s.n_kv_heads) * s.head_dim) +
                                    detail::dbl(s.batch * s.n_heads * s.seq * s.seq)));
  const int64_t seq = s.seq, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  const T scale = attention_scale<T>(hd);
  const int64_t blocks = (seq + kRows - 1) / kRows;
  // One item = one block of query rows of one head (b, h, block), numbered in that order.
  detail::parallel_for(ctx, s.batch * nh * blocks, 1, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, h, g, i0, i1, jlo] = query_block(s, t);
      T* p0 = probs + ((b * nh + h) * seq + i0) * seq;  // row (b, h, i0)
      MMap<T>(p0 + jlo, i1 - i0, i1 - jlo, Eigen::OuterStride<>(seq)).noalias() =
          rows_of(q, b, i0, i1, seq, nh, h, hd) * rows_of(k, b, jlo, i1, seq, nkv, g, hd).transpose();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = (b * nh + h) * seq + i, j0 = first_key(s, b, i);
        T* p = p0 + (i - i0) * seq;
        std::fill(p, p + j0, T(0));
        T mx = sinks ? sinks[h] : -std::numeric_limits<T>::infinity();
        for (int64_t j = j0; j <= i; ++j) {
          p[j] *= scale;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = j0; j <= i; ++j) p[j] = detail::exp_of(p[j] - mx);  // vectorised
        T sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += p[j];  // keys in order
        if (sinks) {  // the sink's logit joins the softmax's denominator, after the keys (HF: cat([s, sink]))
          const T sink_e = detail::exp_of(sinks[h] - mx);
          sum += sink_e;
          sink_probs[r] = sink_e / sum;
        }
        for (int64_t j = j0; j <= i; ++j) p[j] /= sum;
        std::fill(p + i + 1, p + seq, T(0));
      }
      rows_of(out, b, i0, i1, seq, nh, h, hd).noalias() =
          CMap<T>(p0 + jlo, i1 - i0, i1 - jlo, Eigen::OuterStride<>(seq)) * rows_of(v, b, jlo, i1, seq, nkv, g, hd);
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
  // dP = dO V^T, dS, dQ = dS K, dK = dS^T Q, dV = P^T dO: four products per score.
  const double pairs = detail::dbl(s.batch * s.n_heads) * detail::dbl(s.seq) * detail::dbl(s.seq + 1) / 2;
  const ProfiledOp op("attention backward", 8 * pairs * detail::dbl(s.head_dim),
                      static_cast<double>(sizeof(T)) * (detail::dbl(s.batch * s.seq * (4 * s.n_heads + 4 * s.n_kv_heads) * s.head_dim) +
                                    2 * detail::dbl(s.batch * s.n_heads * s.seq * s.seq)));
  const int64_t seq = s.seq, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim, rep = nh / nkv;
  const T scale = attention_scale<T>(hd);
  const int64_t blocks = (seq + kRows - 1) / kRows;
  // Pass 1, per block of query rows of one head (b, h, block): ds into the workspace, and dq.
  detail::parallel_for(ctx, s.batch * nh * blocks, 1, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, h, g, i0, i1, jlo] = query_block(s, t);
      T* w0 = workspace + ((b * nh + h) * seq + i0) * seq;  // row (b, h, i0)
      MMap<T>(w0 + jlo, i1 - i0, i1 - jlo, Eigen::OuterStride<>(seq)).noalias() =  // dp
          rows_of(dout, b, i0, i1, seq, nh, h, hd) * rows_of(v, b, jlo, i1, seq, nkv, g, hd).transpose();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = (b * nh + h) * seq + i, j0 = first_key(s, b, i);
        const T* p = probs + r * seq;
        T* ds = w0 + (i - i0) * seq;
        T dsum = 0;
        for (int64_t j = j0; j <= i; ++j) dsum += p[j] * ds[j];
        // The sink has no value row (dp = 0): its logit's gradient is p_sink * (0 - D).
        if (sink_probs) sink_rows[r] = -sink_probs[r] * dsum;
        std::fill(ds, ds + j0, T(0));
        for (int64_t j = j0; j <= i; ++j) ds[j] = p[j] * (ds[j] - dsum) * scale;
        std::fill(ds + i + 1, ds + seq, T(0));
      }
      rows_of(dq, b, i0, i1, seq, nh, h, hd).noalias() =
          CMap<T>(w0 + jlo, i1 - i0, i1 - jlo, Eigen::OuterStride<>(seq)) * rows_of(k, b, jlo, i1, seq, nkv, g, hd);
    }
  });
  // Pass 2, per block of key rows of one kv head (b, g, block): dk and dv over the queries that see
  // the block, the group's heads added in order.
  detail::parallel_for(ctx, s.batch * nkv * blocks, 1, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t blk = t % blocks, g = (t / blocks) % nkv, b = t / (blocks * nkv);
      const int64_t j0 = blk * kRows, j1 = std::min(seq, j0 + kRows);
      const int64_t iend = s.window > 0 ? std::min(seq, j1 - 1 + s.window) : seq;  // the last query that sees the block, + 1
      auto dk_blk = rows_of(dk, b, j0, j1, seq, nkv, g, hd);
      auto dv_blk = rows_of(dv, b, j0, j1, seq, nkv, g, hd);
      dk_blk.setZero();
      dv_blk.setZero();
      for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
        const int64_t row = ((b * nh + h) * seq + j0) * seq + j0;  // (b, h, i = j0), column j0
        const CMap<T> pt(probs + row, iend - j0, j1 - j0, Eigen::OuterStride<>(seq));
        const CMap<T> dst(workspace + row, iend - j0, j1 - j0, Eigen::OuterStride<>(seq));
        dv_blk.noalias() += pt.transpose() * rows_of(dout, b, j0, iend, seq, nh, h, hd);
        dk_blk.noalias() += dst.transpose() * rows_of(q, b, j0, iend, seq, nh, h, hd);
      }
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

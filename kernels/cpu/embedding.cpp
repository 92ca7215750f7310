// Token embedding forward (gather) and backward (ordered scatter-add).
#include "megatrain/kernels/cpu/embedding.h"

#include <algorithm>

#include "detail.h"

namespace megatrain::cpu {
namespace {

Status check_tokens(const int32_t* tokens, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab)
      return invalid_argument("embedding: tokens[" + detail::str(i) + "] = " + detail::str(tokens[i]) +
                              " is outside the vocabulary [0, " + detail::str(vocab) + ")");
  }
  return {};
}

}  // namespace

template <typename T>
Status embedding_forward(CpuContext& ctx, const int32_t* tokens, int64_t n, const T* table, int64_t vocab,
                         int64_t hidden, T* out) {
  MT_CHECK(n >= 0 && vocab > 0 && hidden > 0, "embedding_forward: bad sizes");
  const ProfiledOp op("embedding forward", 0, static_cast<double>(sizeof(T)) * 2 * detail::dbl(n * hidden));
  MT_RETURN_IF_ERROR(check_tokens(tokens, n, vocab));
  detail::parallel_for(ctx, n, 64, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i)
      std::copy_n(table + static_cast<int64_t>(tokens[i]) * hidden, hidden, out + i * hidden);
  });
  return {};
}

template <typename T>
Status embedding_backward(CpuContext& ctx, const int32_t* tokens, int64_t n, const T* dout, int64_t vocab,
                          int64_t hidden, T* dtable) {
  MT_CHECK(n >= 0 && vocab > 0 && hidden > 0, "embedding_backward: bad sizes");
  const ProfiledOp op("embedding backward", detail::dbl(n * hidden), static_cast<double>(sizeof(T)) * 3 * detail::dbl(n * hidden));
  MT_RETURN_IF_ERROR(check_tokens(tokens, n, vocab));
  // Columns, not rows, are split: two tokens may share a table row, and each column must see the
  // tokens in order. 16 columns = one cache line of fp32, so threads never share a line.
  detail::parallel_for(ctx, hidden, 64, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < n; ++i) {
      T* dst = dtable + static_cast<int64_t>(tokens[i]) * hidden;
      const T* src = dout + i * hidden;
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  });
  return {};
}

#define MT_INSTANTIATE(T)                                                                               \
  template Status embedding_forward<T>(CpuContext&, const int32_t*, int64_t, const T*, int64_t, int64_t, T*); \
  template Status embedding_backward<T>(CpuContext&, const int32_t*, int64_t, const T*, int64_t, int64_t, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

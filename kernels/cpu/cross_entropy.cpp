// Cross-entropy forward (log-sum-exp per row) and backward (softmax minus one-hot).
#include "megatrain/kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "detail.h"

namespace megatrain::cpu {
namespace {

Status check_targets(const int32_t* targets, int64_t n, int64_t vocab, int32_t ignore_index) {
  for (int64_t r = 0; r < n; ++r) {
    const int32_t t = targets[r];
    if (t != ignore_index && (t < 0 || t >= vocab))
      return invalid_argument("cross_entropy: targets[" + detail::str(r) + "] = " + detail::str(t) +
                              " is outside [0, " + detail::str(vocab) + ") and is not the ignore index " +
                              detail::str(ignore_index));
  }
  return {};
}

}  // namespace

template <typename T>
Status cross_entropy_forward(CpuContext& ctx, const T* logits, const int32_t* targets, int64_t n, int64_t vocab,
                             T* lse, T* row_loss, CrossEntropyStats* stats, int32_t ignore_index) {
  MT_CHECK(n >= 0 && vocab > 0 && lse != nullptr, "cross_entropy_forward: bad arguments");
  const ProfiledOp op("cross-entropy forward", 3 * detail::dbl(n * vocab), static_cast<double>(sizeof(T)) * detail::dbl(n * vocab + 2 * n));
  MT_RETURN_IF_ERROR(check_targets(targets, n, vocab, ignore_index));
  std::vector<T> own_loss;
  if (!row_loss) {
    own_loss.resize(static_cast<size_t>(n));
    row_loss = own_loss.data();
  }
  detail::parallel_for(ctx, n, 1, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = logits + r * vocab;
      const T mx = *std::max_element(x, x + vocab);
      T acc[detail::kLanes] = {};
      int64_t j = 0;
      for (; j + detail::kLanes <= vocab; j += detail::kLanes)
        for (int l = 0; l < detail::kLanes; ++l) acc[l] += detail::exp_of(x[j + l] - mx);
      for (int l = 0; j < vocab; ++j, ++l) acc[l] += detail::exp_of(x[j] - mx);
      const T log_sum = std::log(detail::reduce_lanes(acc));
      lse[r] = mx + log_sum;
      // torch: nll of log_softmax, log_softmax(x)[t] = (x[t] - max) - log(sum).
      row_loss[r] = targets[r] == ignore_index ? T(0) : -((x[targets[r]] - mx) - log_sum);
    }
  });
  if (stats) {
    CrossEntropyStats st;
    for (int64_t r = 0; r < n; ++r) {
      if (targets[r] == ignore_index) continue;
      st.loss_sum += static_cast<double>(row_loss[r]);
      ++st.count;
    }
    *stats = st;
  }
  return {};
}

template <typename T>
Status cross_entropy_backward(CpuContext& ctx, const T* logits, const int32_t* targets, const T* lse, int64_t n,
                              int64_t vocab, T grad_scale, T* dlogits, int32_t ignore_index) {
  MT_CHECK(n >= 0 && vocab > 0, "cross_entropy_backward: bad sizes");
  const ProfiledOp op("cross-entropy backward", 3 * detail::dbl(n * vocab), static_cast<double>(sizeof(T)) * detail::dbl(2 * n * vocab + n));
  MT_RETURN_IF_ERROR(check_targets(targets, n, vocab, ignore_index));
  detail::parallel_for(ctx, n, 1, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = logits + r * vocab;
      T* dx = dlogits + r * vocab;
      const int32_t t = targets[r];
      if (t == ignore_index) {
        std::fill(dx, dx + vocab, T(0));
        continue;
      }
      const T l = lse[r];
      const T xt = x[t];  // read before the loop: dx may alias x
      for (int64_t j = 0; j < vocab; ++j) dx[j] = detail::exp_of(x[j] - l) * grad_scale;
      dx[t] = (detail::exp_of(xt - l) - T(1)) * grad_scale;
    }
  });
  return {};
}

#define MT_INSTANTIATE(T)                                                                                     \
  template Status cross_entropy_forward<T>(CpuContext&, const T*, const int32_t*, int64_t, int64_t, T*, T*,   \
                                           CrossEntropyStats*, int32_t);                                    \
  template Status cross_entropy_backward<T>(CpuContext&, const T*, const int32_t*, const T*, int64_t, int64_t, \
                                            T, T*, int32_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu

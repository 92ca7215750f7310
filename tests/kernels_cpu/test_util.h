// Shared helpers of the CPU op tests: seeded random inputs and the finite-difference gradient check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace megatrain::cpu::testing {

// Uniform values in [lo, hi), reproducible from the seed.
inline std::vector<double> random_vec(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

inline std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

// <a, b> in double, in order.
template <typename T>
double inner(const std::vector<T>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Central differences of `loss` with respect to every element of x, compared with `analytic`.
//
// Every op test uses loss(x) = <forward(x), g> for a fixed random g, so that the analytic gradient
// is backward(dout = g). Error budget with h = 1e-6 in double: truncation h^2/6 * |f'''| ~ 1e-13;
// rounding eps * |loss| / h ~ 2.2e-16 * 10 / 1e-6 ~ 2e-9. The gradients are of order 0.1..10, so a
// correct backward lands near 1e-8 relative to the largest gradient entry; the bound 1e-6 leaves
// a margin of 100 while a wrong term (missing factor, sign, index, transposition) is off by ~1e-1.
inline constexpr double kFdStep = 1e-6;
inline constexpr double kFdTolerance = 1e-6;

inline void expect_gradient_matches(const std::string& what, std::vector<double>& x,
                                    const std::vector<double>& analytic, const std::function<double()>& loss) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  std::vector<double> fd(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + kFdStep;
    const double up = loss();
    x[i] = keep - kFdStep;
    const double down = loss();
    x[i] = keep;
    fd[i] = (up - down) / (2 * kFdStep);
  }
  const double scale = max_abs(fd);
  ASSERT_GT(scale, 1e-3) << what << ": the gradient is (nearly) zero; the check would prove nothing";
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double e = std::abs(analytic[i] - fd[i]);
    if (e > worst) {
      worst = e;
      worst_i = i;
    }
  }
  if (std::getenv("MEGATRAIN_FD_VERBOSE"))
    std::printf("[fd] %-24s max |analytic - fd| / max |fd| = %.2e over %zu elements\n", what.c_str(), worst / scale,
                x.size());
  EXPECT_LE(worst / scale, kFdTolerance)
      << what << ": element " << worst_i << " analytic " << analytic[worst_i] << " finite difference " << fd[worst_i]
      << " (max |gradient| " << scale << ")";
}

// Largest |a - b| / max(|b|_inf, floor): the error measure for float vs double and torch comparisons.
template <typename A, typename B>
double max_rel_error(const std::vector<A>& a, const std::vector<B>& b, double floor = 1e-30) {
  double scale = floor, err = 0;
  for (size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  for (size_t i = 0; i < a.size(); ++i)
    err = std::max(err, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return err / scale;
}

}  // namespace megatrain::cpu::testing

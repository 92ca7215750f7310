// Residual add and accumulate: values, aliasing, and the (identity) backward by finite differences.
#include "megatrain/kernels/cpu/add.h"

#include "test_util.h"

namespace megatrain::cpu {
namespace {

TEST(Add, AddsAndAccumulatesInPlace) {
  CpuContext ctx(2);
  const int64_t n = 100000;
  auto a = testing::random_vec(n, 1), b = testing::random_vec(n, 2);
  std::vector<double> out(n);
  add(ctx, a.data(), b.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  auto acc = a;
  accumulate(ctx, b.data(), n, acc.data());
  EXPECT_EQ(acc, out);
  add(ctx, a.data(), b.data(), n, a.data());  // out aliases a
  EXPECT_EQ(a, out);
}

TEST(Add, BackwardMatchesFiniteDifferences) {
  // d<a + b, g>/da = d/db = g: the residual passes dout unchanged to both inputs.
  CpuContext ctx;
  const int64_t n = 12;
  auto a = testing::random_vec(n, 3), b = testing::random_vec(n, 4), g = testing::random_vec(n, 5);
  std::vector<double> out(n), da(n, 0), db(n, 0);
  accumulate(ctx, g.data(), n, da.data());
  accumulate(ctx, g.data(), n, db.data());
  auto loss = [&] {
    add(ctx, a.data(), b.data(), n, out.data());
    return testing::inner(out, g);
  };
  testing::expect_gradient_matches("add da", a, da, loss);
  testing::expect_gradient_matches("add db", b, db, loss);
}

}  // namespace
}  // namespace megatrain::cpu

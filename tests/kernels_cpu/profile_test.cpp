// cpu::OpProfile, the breakdown behind `megatrain-bench-exec ops`: what an attached profile records
// for an op (its name by use, one call, the FLOPs and bytes of its shape), that an op inside another
// counts as part of the outer one, and that nothing is recorded once it is detached.
#include "megatrain/kernels/cpu/profile.h"

#include "megatrain/kernels/cpu/add.h"
#include "megatrain/kernels/cpu/linear.h"
#include "test_util.h"

namespace megatrain::cpu {
namespace {

// Detaches the profile whatever the test's outcome, so no other test in the binary records into it.
struct Attached {
  explicit Attached(OpProfile* p) { attach_op_profile(p); }
  ~Attached() { attach_op_profile(nullptr); }
};

TEST(OpProfile, RecordsEachOpByUseWithItsFlopsAndBytes) {
  CpuContext ctx(2);
  const int64_t n = 48, in = 40, out = 24;  // y[n, out] = x[n, in] W[out, in]^T
  const auto x = testing::to_float(testing::random_vec(n * in, 1)), w = testing::to_float(testing::random_vec(out * in, 2));
  std::vector<float> y(n * out);
  OpProfile profile;
  {
    const Attached attached(&profile);
    EXPECT_EQ(attached_op_profile(), &profile);
    linear_forward<float>(ctx, x.data(), w.data(), nullptr, n, in, out, y.data());
    linear_forward<float>(ctx, x.data(), w.data(), nullptr, n, in, out, y.data());
  }
  EXPECT_EQ(attached_op_profile(), nullptr);
  const auto tallies = profile.tallies();
  ASSERT_EQ(tallies.size(), 1u);
  const auto& [name, t] = *tallies.begin();
  EXPECT_EQ(name, "gemm x.W^T (forward)");
  EXPECT_EQ(t.calls, 2);
  EXPECT_EQ(t.flops, 2 * 2.0 * n * in * out);                    // a multiply and an add per term
  EXPECT_EQ(t.bytes, 2 * 4.0 * (n * in + in * out + n * out));  // x and W read, y written once
  EXPECT_GT(t.seconds, 0);

  // Detached: the same op records nothing.
  linear_forward<float>(ctx, x.data(), w.data(), nullptr, n, in, out, y.data());
  EXPECT_EQ(profile.tallies().at(name).calls, 2);
  profile.clear();
  EXPECT_TRUE(profile.tallies().empty());
}

TEST(OpProfile, AnOpInsideAnotherCountsAsPartOfTheOuterOne) {
  CpuContext ctx(2);
  const int64_t n = 1000;
  auto a = testing::to_float(testing::random_vec(n, 3)), b = testing::to_float(testing::random_vec(n, 4));
  OpProfile profile;
  {
    const Attached attached(&profile);
    const ProfiledOp outer("outer", 7, 11);
    add<float>(ctx, a.data(), b.data(), n, a.data());
    accumulate<float>(ctx, b.data(), n, a.data());
  }
  const auto tallies = profile.tallies();
  ASSERT_EQ(tallies.size(), 1u);
  EXPECT_EQ(tallies.at("outer").calls, 1);
  EXPECT_EQ(tallies.at("outer").flops, 7);
  EXPECT_EQ(tallies.at("outer").bytes, 11);

  // After the outer op ends, an op on its own is recorded under its name again.
  {
    const Attached attached(&profile);
    add<float>(ctx, a.data(), b.data(), n, a.data());
  }
  EXPECT_EQ(profile.tallies().at("add").calls, 1);
  EXPECT_EQ(profile.tallies().at("add").flops, n);
}

}  // namespace
}  // namespace megatrain::cpu

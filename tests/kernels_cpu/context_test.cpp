// CpuContext: every task runs exactly once on its own thread, calls can repeat and come from
// several threads, and 1 thread runs inline.
#include "megatrain/kernels/cpu/context.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

namespace megatrain::cpu {
namespace {

TEST(CpuContext, RunsEachTaskOnceOnItsOwnThread) {
  CpuContext ctx(3);
  EXPECT_EQ(ctx.threads(), 3);
  for (int round = 0; round < 200; ++round) {
    const int n = 1 + round % 3;
    std::vector<int> hits(3, 0);
    std::vector<std::thread::id> ids(3);
    ctx.run(n, [&](int i) {
      ++hits[i];
      ids[i] = std::this_thread::get_id();
    });
    for (int i = 0; i < 3; ++i) ASSERT_EQ(hits[i], i < n ? 1 : 0) << "round " << round;
    EXPECT_EQ(ids[0], std::this_thread::get_id());  // task 0 runs on the caller
    EXPECT_EQ(std::set<std::thread::id>(ids.begin(), ids.begin() + n).size(), static_cast<size_t>(n));
  }
}

TEST(CpuContext, OneThreadRunsInlineAndBadCountsClamp) {
  CpuContext one(0);
  EXPECT_EQ(one.threads(), 1);
  std::thread::id id;
  one.run(1, [&](int) { id = std::this_thread::get_id(); });
  EXPECT_EQ(id, std::this_thread::get_id());
}

TEST(CpuContext, ConcurrentCallersAreSerialised) {
  CpuContext ctx(2);
  std::atomic<int> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int r = 0; r < 100; ++r) ctx.run(2, [&](int) { total.fetch_add(1); });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 100 * 2);
}

}  // namespace
}  // namespace megatrain::cpu

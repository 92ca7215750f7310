// build_token_groups (host code of the CUDA embedding backward): positions grouped by token id,
// distinct ids ascending, positions ascending within each id, every position exactly once.
// Runs without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/embedding.cuh"

namespace megatrain::cuda {
namespace {

void expect_groups(const std::vector<int32_t>& tokens, const std::vector<int32_t>& unique,
                   const std::vector<int32_t>& offsets, const std::vector<int32_t>& positions) {
  const TokenGroups g = build_token_groups(tokens.data(), static_cast<int64_t>(tokens.size()));
  EXPECT_EQ(g.unique, unique);
  EXPECT_EQ(g.offsets, offsets);
  EXPECT_EQ(g.positions, positions);
}

// The invariants, for inputs whose expected groups are not spelled out.
void check_invariants(const std::vector<int32_t>& tokens) {
  const TokenGroups g = build_token_groups(tokens.data(), static_cast<int64_t>(tokens.size()));
  ASSERT_EQ(g.offsets.size(), g.unique.size() + 1);
  ASSERT_EQ(g.positions.size(), tokens.size());
  EXPECT_EQ(g.offsets.front(), 0);
  EXPECT_EQ(g.offsets.back(), static_cast<int32_t>(tokens.size()));
  std::vector<int> seen(tokens.size(), 0);
  for (size_t u = 0; u < g.unique.size(); ++u) {
    if (u > 0) {
      EXPECT_LT(g.unique[u - 1], g.unique[u]);
    }
    EXPECT_LT(g.offsets[u], g.offsets[u + 1]) << "empty group " << u;
    for (int32_t k = g.offsets[u]; k < g.offsets[u + 1]; ++k) {
      const int32_t p = g.positions[static_cast<size_t>(k)];
      ASSERT_GE(p, 0);
      ASSERT_LT(p, static_cast<int32_t>(tokens.size()));
      EXPECT_EQ(tokens[static_cast<size_t>(p)], g.unique[u]);
      if (k > g.offsets[u]) {
        EXPECT_LT(g.positions[static_cast<size_t>(k - 1)], p);
      }
      ++seen[static_cast<size_t>(p)];
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "position " << i;
}

TEST(TokenGroups, EmptyInput) {
  const TokenGroups g = build_token_groups(nullptr, 0);
  EXPECT_TRUE(g.unique.empty());
  EXPECT_EQ(g.offsets, std::vector<int32_t>{0});
  EXPECT_TRUE(g.positions.empty());
}

TEST(TokenGroups, SingleToken) { expect_groups({7}, {7}, {0, 1}, {0}); }

TEST(TokenGroups, AllDistinctUnsorted) { expect_groups({5, 2, 9, 0}, {0, 2, 5, 9}, {0, 1, 2, 3, 4}, {3, 1, 0, 2}); }

TEST(TokenGroups, RepeatsKeepPositionsAscending) {
  // token 3 at 1, 4; token 5 at 0, 2, 5; token 8 at 3.
  expect_groups({5, 3, 5, 8, 3, 5}, {3, 5, 8}, {0, 2, 5, 6}, {1, 4, 0, 2, 5, 3});
}

TEST(TokenGroups, AllSameToken) { expect_groups({4, 4, 4, 4}, {4}, {0, 4}, {0, 1, 2, 3}); }

TEST(TokenGroups, InvariantsOnLargerInput) {
  std::vector<int32_t> tokens;
  uint32_t state = 12345;
  for (int i = 0; i < 5000; ++i) {
    state = state * 1664525u + 1013904223u;
    tokens.push_back(static_cast<int32_t>((state >> 8) % 97));
  }
  check_invariants(tokens);
  check_invariants({0, 0, 1, 1, 0, 2, 32000, 1, 0});
}

}  // namespace
}  // namespace megatrain::cuda

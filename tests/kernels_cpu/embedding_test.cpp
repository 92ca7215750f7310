// Embedding: gather, ordered scatter-add with repeated tokens, finite differences, bad token ids.
#include "megatrain/kernels/cpu/embedding.h"

#include "test_util.h"

namespace megatrain::cpu {
namespace {

TEST(Embedding, ForwardCopiesRows) {
  CpuContext ctx;
  const std::vector<double> table = {0, 1, 10, 11, 20, 21};  // vocab 3, hidden 2
  const std::vector<int32_t> tok = {2, 0, 2};
  std::vector<double> out(6);
  ASSERT_TRUE(embedding_forward(ctx, tok.data(), 3, table.data(), 3, 2, out.data()).ok());
  EXPECT_EQ(out, (std::vector<double>{20, 21, 0, 1, 20, 21}));
}

TEST(Embedding, BackwardAccumulatesRepeatedTokensInOrder) {
  CpuContext ctx(2);
  const std::vector<int32_t> tok = {1, 1, 0, 1};
  const std::vector<float> dout = {1e8f, 1, 2, 2, 3, 3, -1e8f, 4};  // hidden 2
  std::vector<float> dtable = {100, 100, 0.5f, 0.5f};
  ASSERT_TRUE(embedding_backward(ctx, tok.data(), 4, dout.data(), 2, 2, dtable.data()).ok());
  EXPECT_EQ(dtable[0], 103.0f);
  EXPECT_EQ(dtable[1], 103.0f);
  // Column 0 of row 1, in token order: ((0.5 + 1e8) + 2) + -1e8 in fp32 = 0 (the 2.5 is lost to
  // rounding at 1e8, exactly as a sequential sum loses it); column 1: 0.5 + 1 + 2 + 4.
  EXPECT_EQ(dtable[2], 0.0f);
  EXPECT_EQ(dtable[3], 7.5f);
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  CpuContext ctx;
  const int64_t vocab = 7, hidden = 5, n = 9;
  const std::vector<int32_t> tok = {3, 0, 3, 6, 1, 3, 6, 2, 0};
  std::vector<double> table = testing::random_vec(vocab * hidden, 1), g = testing::random_vec(n * hidden, 2);
  std::vector<double> out(n * hidden), dtable(vocab * hidden);
  ASSERT_TRUE(embedding_backward(ctx, tok.data(), n, g.data(), vocab, hidden, dtable.data()).ok());
  testing::expect_gradient_matches("embedding dtable", table, dtable, [&] {
    EXPECT_TRUE(embedding_forward(ctx, tok.data(), n, table.data(), vocab, hidden, out.data()).ok());
    return testing::inner(out, g);
  });
}

TEST(Embedding, RefusesTokensOutsideTheVocabulary) {
  CpuContext ctx;
  const std::vector<double> table(6, 1);
  std::vector<double> out(4, 42), dtable(6, 0);
  for (int32_t bad : {3, -1}) {
    const std::vector<int32_t> tok = {0, bad};
    Status s = embedding_forward(ctx, tok.data(), 2, table.data(), 3, 2, out.data());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("tokens[1] = " + std::to_string(bad)), std::string::npos) << s.message();
    EXPECT_EQ(out, std::vector<double>(4, 42));  // nothing written
    EXPECT_FALSE(embedding_backward(ctx, tok.data(), 2, out.data(), 3, 2, dtable.data()).ok());
    EXPECT_EQ(dtable, std::vector<double>(6, 0));
  }
}

}  // namespace
}  // namespace megatrain::cpu

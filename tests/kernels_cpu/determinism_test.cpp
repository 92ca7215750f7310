// Determinism: every op, in fp32 (the production type), run twice gives bit-identical results, and
// with 1, 2 and 3 threads gives bit-identical results too (each output element is produced by one
// thread with a fixed summation order; the GEMM blocks are aligned to Eigen's register blocks).
// Sizes are chosen so that every op really splits its work at 2 and 3 threads.
#include <cstring>

#include "megatrain/kernels/cpu/ops.h"
#include "test_util.h"

namespace megatrain::cpu {
namespace {

using testing::random_vec;
using testing::to_float;
using Outputs = std::vector<std::vector<float>>;

void expect_bit_identical(const Outputs& a, const Outputs& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size());
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)), 0)
        << what << ": output " << i << " differs";
  }
}

// Runs `op` with threads 1, 2, 3, twice each, and compares every result bit for bit with the first.
void check(const std::string& what, const std::function<Outputs(CpuContext&)>& op) {
  CpuContext one(1);
  const Outputs ref = op(one);
  expect_bit_identical(op(one), ref, what + " (threads 1, second run)");
  for (int threads : {2, 3}) {
    CpuContext ctx(threads);
    expect_bit_identical(op(ctx), ref, what + " (threads " + std::to_string(threads) + ")");
    expect_bit_identical(op(ctx), ref, what + " (threads " + std::to_string(threads) + ", second run)");
  }
}

TEST(Determinism, Embedding) {
  const int64_t vocab = 50, hidden = 256, n = 200;
  std::vector<int32_t> tok(n);
  for (int64_t i = 0; i < n; ++i) tok[i] = static_cast<int32_t>((i * 7) % vocab);
  const auto table = to_float(random_vec(vocab * hidden, 1)), g = to_float(random_vec(n * hidden, 2));
  check("embedding", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(n * hidden), std::vector<float>(vocab * hidden, 0.25f)};
    EXPECT_TRUE(embedding_forward(ctx, tok.data(), n, table.data(), vocab, hidden, o[0].data()).ok());
    EXPECT_TRUE(embedding_backward(ctx, tok.data(), n, g.data(), vocab, hidden, o[1].data()).ok());
    return o;
  });
}

TEST(Determinism, RmsNorm) {
  const int64_t n = 64, dim = 320;
  const auto x = to_float(random_vec(n * dim, 3)), w = to_float(random_vec(dim, 4)), g = to_float(random_vec(n * dim, 5));
  check("rmsnorm", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(n * dim), std::vector<float>(n), std::vector<float>(n * dim),
                 std::vector<float>(dim, 1)};
    rmsnorm_forward(ctx, x.data(), w.data(), n, dim, 1e-5, o[0].data(), o[1].data());
    rmsnorm_backward(ctx, g.data(), x.data(), w.data(), o[1].data(), n, dim, o[2].data(), o[3].data());
    return o;
  });
}

TEST(Determinism, Rope) {
  const int64_t n = 64, heads = 4, hd = 64;
  RopeConfig c;
  c.head_dim = hd;
  c.theta = 500000;
  const auto inv = rope_inv_freq<float>(c).value();
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = static_cast<int32_t>(i % 32);
  const auto x = to_float(random_vec(n * heads * hd, 6));
  check("rope", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(x.size()), std::vector<float>(x.size())};
    rope_forward(ctx, x.data(), o[0].data(), pos.data(), n, heads, hd, inv.data());
    rope_backward(ctx, x.data(), o[1].data(), pos.data(), n, heads, hd, inv.data());
    return o;
  });
}

TEST(Determinism, LinearAndGemm) {
  // (n, in, out): row split, column split, a single token (GEMV), a wide head.
  for (auto [n, in, out] : {std::tuple<int64_t, int64_t, int64_t>{300, 200, 250}, {50, 64, 300}, {1, 64, 300},
                            {7, 33, 1000}, {197, 130, 97}}) {
    const auto x = to_float(random_vec(n * in, 7)), w = to_float(random_vec(out * in, 8)),
               b = to_float(random_vec(out, 9)), g = to_float(random_vec(n * out, 10));
    check("linear " + std::to_string(n) + "x" + std::to_string(in) + "x" + std::to_string(out), [&](CpuContext& ctx) {
      Outputs o = {std::vector<float>(n * out), std::vector<float>(n * in), std::vector<float>(out * in, 0.5f),
                   std::vector<float>(out, 0.5f)};
      linear_forward(ctx, x.data(), w.data(), b.data(), n, in, out, o[0].data());
      linear_backward(ctx, g.data(), x.data(), w.data(), n, in, out, o[1].data(), false, o[2].data(), o[3].data());
      return o;
    });
  }
}

TEST(Determinism, Attention) {
  const AttentionShape s{2, 40, 4, 2, 16};
  const size_t nq = static_cast<size_t>(2 * 40 * 4 * 16), nkv = nq / 2;
  const auto q = to_float(random_vec(nq, 11)), k = to_float(random_vec(nkv, 12)), v = to_float(random_vec(nkv, 13)),
             g = to_float(random_vec(nq, 14));
  const size_t np = static_cast<size_t>(attention_probs_elems(s));
  check("attention", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(nq), std::vector<float>(np), std::vector<float>(nq), std::vector<float>(nkv),
                 std::vector<float>(nkv)};
    std::vector<float> ws(np);
    EXPECT_TRUE(attention_forward(ctx, s, q.data(), k.data(), v.data(), o[0].data(), o[1].data()).ok());
    EXPECT_TRUE(attention_backward(ctx, s, q.data(), k.data(), v.data(), o[1].data(), g.data(), o[2].data(),
                                   o[3].data(), o[4].data(), ws.data())
                    .ok());
    return o;
  });
}

TEST(Determinism, SwiGlu) {
  const int64_t n = 100000;
  const auto gate = to_float(random_vec(n, 15, -5, 5)), up = to_float(random_vec(n, 16)), d = to_float(random_vec(n, 17));
  check("swiglu", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
    swiglu_forward(ctx, gate.data(), up.data(), n, o[0].data());
    swiglu_backward(ctx, gate.data(), up.data(), d.data(), n, o[1].data(), o[2].data());
    return o;
  });
}

TEST(Determinism, CrossEntropy) {
  const int64_t n = 33, vocab = 500;
  const auto x = to_float(random_vec(n * vocab, 18, -6, 6));
  std::vector<int32_t> t(n);
  for (int64_t r = 0; r < n; ++r) t[r] = r % 5 == 4 ? kIgnoreIndex : static_cast<int32_t>((r * 37) % vocab);
  check("cross_entropy", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(n), std::vector<float>(n), std::vector<float>(n * vocab), std::vector<float>(1)};
    CrossEntropyStats st;
    EXPECT_TRUE(cross_entropy_forward(ctx, x.data(), t.data(), n, vocab, o[0].data(), o[1].data(), &st).ok());
    EXPECT_TRUE(cross_entropy_backward(ctx, x.data(), t.data(), o[0].data(), n, vocab,
                                       1.0f / static_cast<float>(st.count), o[2].data()).ok());
    o[3][0] = static_cast<float>(st.loss_sum);
    return o;
  });
}

TEST(Determinism, Add) {
  const int64_t n = 200000;
  const auto a = to_float(random_vec(n, 19)), b = to_float(random_vec(n, 20));
  check("add", [&](CpuContext& ctx) {
    Outputs o = {std::vector<float>(n), a};
    add(ctx, a.data(), b.data(), n, o[0].data());
    accumulate(ctx, b.data(), n, o[1].data());
    return o;
  });
}

}  // namespace
}  // namespace megatrain::cpu

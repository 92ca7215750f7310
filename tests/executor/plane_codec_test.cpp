// The byte-plane codec for fp32 tensors at rest: bit-exact round trips (random data, Adam moments
// after a few steps, special values, empty input, both container modes) and every kind of damage
// (truncation, bad header, flipped bytes in a frame, wrong count) reported as an error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "megatrain/executor/optimizer.h"
#include "megatrain/executor/plane_codec.h"

namespace megatrain::exec {
namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> round_trip(const std::vector<float>& x, int level, PlaneSplit split) {
  const auto enc = compress_fp32(x.data(), static_cast<int64_t>(x.size()), level, split);
  auto n = plane_codec_count(enc.data(), enc.size());
  EXPECT_TRUE(n.ok()) << n.status().to_string();
  if (n.ok()) {
    EXPECT_EQ(*n, static_cast<int64_t>(x.size()));
  }
  std::vector<float> y(x.size(), -7.0f);
  const Status s = decompress_fp32(enc, y.data(), static_cast<int64_t>(y.size()));
  EXPECT_TRUE(s.ok()) << s.to_string();
  return y;
}

// Adam's m and v after `steps` AdamW steps on random gradients (what the codec is for).
void adam_moments(int64_t n, int steps, std::vector<float>& m, std::vector<float>& v) {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> w(n), g(n);
  m.assign(n, 0.0f);
  v.assign(n, 0.0f);
  for (auto& x : w) x = 0.02f * d(rng);
  for (int t = 1; t <= steps; ++t) {
    for (auto& x : g) x = 1e-3f * d(rng);
    adamw_update(w.data(), g.data(), m.data(), v.data(), n, AdamWStep{1e-3, 0.9, 0.95, 1e-8, 0.1, t, 1.0f}, nullptr,
                 nullptr, 1);
  }
}

TEST(PlaneCodec, RandomDataRoundTripsBitExactly) {
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> x(100003);
  for (size_t i = 0; i < x.size(); ++i) {
    if (i % 3 == 0) {
      const uint32_t u = bits(rng);  // any bit pattern, NaNs included
      std::memcpy(&x[i], &u, 4);
    } else {
      x[i] = d(rng);
    }
  }
  for (PlaneSplit split : {PlaneSplit::kBytePlanes, PlaneSplit::kNone})
    for (int level : {1, 3, 9}) EXPECT_TRUE(same_bits(round_trip(x, level, split), x)) << "level " << level;
}

TEST(PlaneCodec, SpecialValuesRoundTrip) {
  std::vector<float> x = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::max(), std::numeric_limits<float>::lowest(), 1.0f};
  EXPECT_TRUE(same_bits(round_trip(x, 3, PlaneSplit::kBytePlanes), x));
  EXPECT_TRUE(same_bits(round_trip(x, 3, PlaneSplit::kNone), x));
}

TEST(PlaneCodec, AdamMomentsRoundTripAndTheSplitHelps) {
  const int64_t n = 1 << 18;
  std::vector<float> m, v;
  adam_moments(n, 5, m, v);
  for (const auto* x : {&m, &v}) {
    EXPECT_TRUE(same_bits(round_trip(*x, 3, PlaneSplit::kBytePlanes), *x));
    const auto split = compress_fp32(x->data(), n, 3, PlaneSplit::kBytePlanes);
    const auto plain = compress_fp32(x->data(), n, 3, PlaneSplit::kNone);
    // The sign/exponent planes of moments are nearly constant: the split must beat zstd on raw bytes
    // and shrink the tensor.
    EXPECT_LT(split.size(), plain.size());
    EXPECT_LT(split.size(), static_cast<size_t>(n) * 4);
  }
}

// zstd's workers cut a plane into jobs; the encoding must not depend on how many there are, so
// a checkpoint's bytes are the same on any machine with this build. 6M floats make planes of 6 MB,
// several jobs each at level 1.
TEST(PlaneCodec, EveryThreadCountGivesTheSameBytes) {
  const int64_t n = 6 << 20;
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& e : x) e = 1e-3f * d(rng) * std::exp(d(rng));
  const auto one = compress_fp32(x.data(), n, 1, PlaneSplit::kBytePlanes, 1);
  for (int threads : {2, 3, 8}) {
    const auto many = compress_fp32(x.data(), n, 1, PlaneSplit::kBytePlanes, threads);
    EXPECT_TRUE(many == one) << threads << " threads: " << many.size() << " bytes against " << one.size();
  }
  std::vector<float> y(x.size());
  ASSERT_TRUE(decompress_fp32(one, y.data(), n).ok());
  EXPECT_TRUE(same_bits(x, y));
}

TEST(PlaneCodec, EmptyInputRoundTrips) {
  for (PlaneSplit split : {PlaneSplit::kBytePlanes, PlaneSplit::kNone}) {
    const auto enc = compress_fp32(nullptr, 0, 3, split);
    auto n = plane_codec_count(enc.data(), enc.size());
    ASSERT_TRUE(n.ok()) << n.status().to_string();
    EXPECT_EQ(*n, 0);
    EXPECT_TRUE(decompress_fp32(enc, nullptr, 0).ok());
    float one = 0;
    EXPECT_EQ(decompress_fp32(enc, &one, 1).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(decompress_fp32(nullptr, 0, nullptr, 0).code(), StatusCode::kCorrupt);  // no header at all
}

TEST(PlaneCodec, TruncatedInputIsAnError) {
  std::vector<float> m, v;
  adam_moments(4096, 3, m, v);
  const auto enc = compress_fp32(v.data(), 4096, 3);
  std::vector<float> out(4096);
  for (size_t cut : {size_t{0}, size_t{3}, size_t{15}, size_t{20}, size_t{47}, size_t{48}, enc.size() / 2, enc.size() - 1}) {
    const Status s = decompress_fp32(enc.data(), cut, out.data(), 4096);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << "cut at " << cut << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
  }
  // Trailing bytes are damage too.
  auto longer = enc;
  longer.push_back(0);
  const Status s = decompress_fp32(longer, out.data(), 4096);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("trailing"), std::string::npos) << s.message();
}

TEST(PlaneCodec, DamagedHeaderIsNamed) {
  std::vector<float> x(1000, 0.5f);
  const auto enc = compress_fp32(x.data(), 1000, 3);
  std::vector<float> out(1000);
  auto expect = [&](std::vector<uint8_t> bad, const char* word) {
    const Status s = decompress_fp32(bad, out.data(), 1000);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << word;
    EXPECT_NE(s.message().find(word), std::string::npos) << s.message();
  };
  auto bad = enc;
  bad[0] = 'X';
  expect(bad, "magic");
  bad = enc;
  bad[4] = 9;
  expect(bad, "version");
  bad = enc;
  bad[5] = 3;
  expect(bad, "planes");
  bad = enc;
  bad[16] ^= 1;  // plane 0's size
  expect(bad, "size");
  // An encoding of another count is the caller's mistake, not damage.
  EXPECT_EQ(decompress_fp32(enc, out.data(), 999).code(), StatusCode::kInvalidArgument);
}

TEST(PlaneCodec, FlippedBytesInsideTheFramesAreCaught) {
  std::vector<float> m, v;
  adam_moments(20000, 3, m, v);
  for (PlaneSplit split : {PlaneSplit::kBytePlanes, PlaneSplit::kNone}) {
    const auto enc = compress_fp32(m.data(), 20000, 3, split);
    const size_t head = split == PlaneSplit::kBytePlanes ? 48 : 24;
    std::vector<float> out(20000);
    int caught = 0, tries = 0;
    // Every 37th byte of the payload, one at a time: zstd's frame checks and the content checksum
    // must catch each flip (a flip that still decodes to the same bits would not be damage).
    for (size_t pos = head; pos < enc.size(); pos += 37) {
      auto bad = enc;
      bad[pos] ^= 0x5A;
      const Status s = decompress_fp32(bad, out.data(), 20000);
      ++tries;
      if (!s.ok()) {
        EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
        ++caught;
      } else {
        EXPECT_TRUE(same_bits(out, m)) << "a flip at byte " << pos << " decoded silently to different values";
      }
    }
    EXPECT_GT(caught, 0);
    EXPECT_GE(caught, tries * 9 / 10) << caught << " of " << tries;
  }
}

}  // namespace
}  // namespace megatrain::exec

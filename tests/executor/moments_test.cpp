// Moment storage formats and the fused AdamW pass (moments.h): round-trip error bounds per format
// (from the format's definition: half a step for m, one step for v, bf16's half ulp), v's code
// never decoding to zero, the SIMD copies (AVX-512, AVX2) and the scalar copy giving identical
// bits for every format, thread counts giving identical bits, and the fp32 pass equal to the
// plain torch-order formula.
#include <gtest/gtest.h>

#include <cstdlib>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/executor/bf16.h"
#include "megatrain/executor/moments.h"

namespace megatrain::exec {
namespace {

const StateFormat kAll[] = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kQ8,
                            StateFormat::kQ4,   StateFormat::kQ3,   StateFormat::kQ2};

std::vector<float> random_values(int64_t n, bool positive, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const float y = d(g) * std::exp(d(g));  // spread over magnitudes, as moments are
    x = positive ? y * y * 1e-4f : y * 1e-2f;
  }
  return v;
}

TEST(Moments, RoundTripWithinTheFormatsStep) {
  const std::vector<int64_t> sizes = {1, 37, 128, 300, 1000};  // tensors, with short last blocks
  for (StateFormat f : kAll) {
    for (bool second : {false, true}) {
      SCOPED_TRACE(std::string(state_format_name(f)) + (second ? " v" : " m"));
      MomentStore s = MomentStore::create(f, second, sizes, 64);
      for (size_t t = 0; t < sizes.size(); ++t) {
        const int64_t n = sizes[t];
        const std::vector<float> in = random_values(n, second, static_cast<uint32_t>(t + 11));
        s.encode(t, in.data());
        std::vector<float> out(static_cast<size_t>(n));
        s.decode(t, out.data());
        const int bits = state_format_bits(f);
        for (int64_t b0 = 0; b0 < n; b0 += 64) {
          float mx = 0;
          for (int64_t i = b0; i < std::min(n, b0 + 64); ++i) mx = std::max(mx, std::fabs(in[static_cast<size_t>(i)]));
          for (int64_t i = b0; i < std::min(n, b0 + 64); ++i) {
            const float x = in[static_cast<size_t>(i)], y = out[static_cast<size_t>(i)];
            double bound = 0;  // fp32: exact
            if (f == StateFormat::kBf16) {
              bound = std::fabs(x) * std::ldexp(1.0, -8);
            } else if (is_quantised(f)) {
              // Codes are linear in r = x / scale (q3, q2) or its square root (q8, q4), of |m| or
              // of sqrt(v): r is off by at most half a step for m, one step for v (its lowest code
              // is one step, not 0); the value then by dr (2 r + dr) scale (root) or dr scale.
              const bool root = bits >= 4;
              if (!second) {
                const double dr = 0.5 / ((1 << (bits - 1)) - 1), r = std::sqrt(std::fabs(x) / mx);
                bound = (root ? mx * dr * (2 * r + dr) : mx * dr) * (1 + 1e-5) + 1e-12;
              } else {
                const double S = std::sqrt(mx), dr = 1.0 / (1 << bits), u = std::sqrt(std::fabs(x)), r = std::sqrt(u / S);
                const double du = root ? S * dr * (2 * r + dr) : S * dr;
                bound = du * (2 * u + du) * (1 + 1e-5) + 1e-12;
              }
            }
            ASSERT_LE(std::fabs(static_cast<double>(y) - x), bound) << "element " << i << ": " << x << " -> " << y;
            if (second && is_quantised(f) && mx > 0) {
              ASSERT_GT(y, 0.0f) << "v decoded to zero";
            }
          }
        }
      }
    }
  }
}

TEST(Moments, BytesFollowTheFormat) {
  const std::vector<int64_t> sizes = {1000, 24};
  EXPECT_EQ(MomentStore::create(StateFormat::kFp32, false, sizes, 128).bytes(), 4 * 1024);
  EXPECT_EQ(MomentStore::create(StateFormat::kBf16, false, sizes, 128).bytes(), 2 * 1024);
  // q4: blocks of 128 take 64 bytes; 1000 -> 8 blocks, 24 -> 1 block; one fp32 scale each
  EXPECT_EQ(MomentStore::create(StateFormat::kQ4, false, sizes, 128).bytes(), 9 * 64 + 9 * 4);
  EXPECT_EQ(MomentStore::create(StateFormat::kQ3, true, sizes, 128).bytes(), 9 * 48 + 9 * 4);
}

struct PassRun {
  std::vector<float> w, stream_f32;
  std::vector<uint16_t> stream_bf16;
  MomentStore m, v;
};

// Three AdamW steps on one tensor of n elements, from the same start, on `isa` with `threads`.
PassRun three_steps(StateFormat f, int64_t n, Isa isa, int threads) {
  PassRun r;
  r.w = random_values(n, false, 1);
  r.stream_f32.assign(static_cast<size_t>(n), 0.0f);
  r.stream_bf16.assign(static_cast<size_t>(n), 0);
  r.m = MomentStore::create(f, false, {n}, 128);
  r.v = MomentStore::create(f, true, {n}, 128);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = random_values(n, false, static_cast<uint32_t>(100 + t));
    AdamWStep s{1e-3, 0.9, 0.95, 1e-8, 0.1, t, t == 2 ? 0.5f : 1.0f};
    adamw_update_moments(r.w.data(), g.data(), r.m.tensor(0), r.v.tensor(0), n, s, r.stream_f32.data(), r.stream_bf16.data(),
                         threads, isa);
  }
  return r;
}

template <typename T>
bool same_bits(const T* a, const T* b, int64_t n) {
  return std::memcmp(a, b, sizeof(T) * static_cast<size_t>(n)) == 0;
}

void expect_identical(const PassRun& a, const PassRun& b, int64_t n) {
  EXPECT_TRUE(same_bits(a.w.data(), b.w.data(), n)) << "weights differ";
  EXPECT_TRUE(same_bits(a.stream_f32.data(), b.stream_f32.data(), n));
  EXPECT_TRUE(same_bits(a.stream_bf16.data(), b.stream_bf16.data(), n));
  for (const auto* pair : {&a.m, &a.v}) {
    const MomentStore& x = *pair;
    const MomentStore& y = pair == &a.m ? b.m : b.v;
    EXPECT_TRUE(same_bits(x.f32().data(), y.f32().data(), x.f32().size()));
    EXPECT_TRUE(same_bits(x.bf16().data(), y.bf16().data(), x.bf16().size()));
    EXPECT_TRUE(same_bits(x.codes().data(), y.codes().data(), x.codes().size())) << "codes differ";
    EXPECT_TRUE(same_bits(x.scales().data(), y.scales().data(), x.scales().size())) << "scales differ";
  }
}

TEST(Moments, EveryInstructionSetGivesTheSameBits) {
  const int64_t n = 100003;  // not a multiple of any vector width or block
  std::vector<Isa> isas = {Isa::kScalar};
  for (Isa i : {Isa::kAvx2, Isa::kAvx512})
    if (resolve_isa(i).ok()) isas.push_back(i);
  if (isas.size() == 1) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512: only the scalar copy runs";
  for (StateFormat f : kAll) {
    SCOPED_TRACE(state_format_name(f));
    const PassRun ref = three_steps(f, n, Isa::kScalar, 1);
    for (Isa i : isas) {
      SCOPED_TRACE(isa_name(i));
      expect_identical(three_steps(f, n, i, 1), ref, n);
    }
  }
}

// MEGATRAIN_ISA forces the path that kAuto takes (scripts/test.sh runs the numeric tests under each);
// a path this CPU lacks, or a word that names none, is refused naming the accepted values.
TEST(Moments, TheEnvironmentForcesTheInstructionSet) {
  const char* before = std::getenv("MEGATRAIN_ISA");
  const std::string saved = before ? before : "";
  ::unsetenv("MEGATRAIN_ISA");
  ASSERT_TRUE(isa_from_environment().ok());
  EXPECT_EQ(*isa_from_environment(), Isa::kAuto);
  EXPECT_EQ(*resolve_isa(Isa::kAuto), best_isa());
  ::setenv("MEGATRAIN_ISA", "scalar", 1);
  EXPECT_EQ(*isa_from_environment(), Isa::kScalar);
  EXPECT_EQ(*resolve_isa(Isa::kAuto), Isa::kScalar);
  EXPECT_EQ(*resolve_isa(Isa::kScalar), Isa::kScalar);  // an explicit choice is not overridden
  ::setenv("MEGATRAIN_ISA", "sse9", 1);
  auto bad = isa_from_environment();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("MEGATRAIN_ISA=sse9"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("accepted: auto, scalar"), std::string::npos) << bad.status().message();
  if (best_isa() != Isa::kAvx512) {
    ::setenv("MEGATRAIN_ISA", "avx512", 1);
    auto missing = isa_from_environment();
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.status().message().find("has no avx512"), std::string::npos) << missing.status().message();
  }
  if (saved.empty()) ::unsetenv("MEGATRAIN_ISA");
  else ::setenv("MEGATRAIN_ISA", saved.c_str(), 1);
}

// A diverged step (NaN and infinite gradients) still gives the same bits on every instruction set:
// the encoders' handling of NaN, of infinities and of the int32 conversion that overflows is
// written to match lane for lane.
TEST(Moments, NonFiniteGradientsGiveTheSameBitsOnEveryInstructionSet) {
  const int64_t n = 5 * 128 + 77;
  std::vector<float> g0 = random_values(n, false, 21);
  const float inf = std::numeric_limits<float>::infinity();
  g0[3] = std::numeric_limits<float>::quiet_NaN();
  g0[130] = inf;
  g0[131] = -inf;
  g0[300] = -std::numeric_limits<float>::quiet_NaN();
  g0[400] = 1e30f;  // v overflows to inf
  for (StateFormat f : kAll) {
    SCOPED_TRACE(state_format_name(f));
    std::vector<std::vector<uint8_t>> runs;
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (!resolve_isa(isa).ok()) continue;
      std::vector<float> w = random_values(n, false, 22);
      std::vector<uint16_t> bf(static_cast<size_t>(n));
      MomentStore m = MomentStore::create(f, false, {n}, 128), v = MomentStore::create(f, true, {n}, 128);
      m.encode(0, random_values(n, false, 23).data());
      v.encode(0, random_values(n, true, 24).data());
      for (int t = 1; t <= 2; ++t)
        adamw_update_moments(w.data(), g0.data(), m.tensor(0), v.tensor(0), n, AdamWStep{1e-3, 0.9, 0.95, 1e-8, 0.1, t, 1.0f},
                             nullptr, bf.data(), 1, isa);
      std::vector<uint8_t> bytes;
      auto add = [&bytes](const void* p, size_t size) {
        bytes.insert(bytes.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + size);
      };
      add(w.data(), w.size() * 4);
      add(bf.data(), bf.size() * 2);
      for (const MomentStore* x : {&m, &v}) {
        add(x->f32().data(), static_cast<size_t>(x->f32().size()) * 4);
        add(x->bf16().data(), static_cast<size_t>(x->bf16().size()) * 2);
        add(x->codes().data(), static_cast<size_t>(x->codes().size()));
        add(x->scales().data(), static_cast<size_t>(x->scales().size()) * 4);
      }
      runs.push_back(std::move(bytes));
    }
    for (size_t i = 1; i < runs.size(); ++i) EXPECT_TRUE(runs[i] == runs[0]) << "instruction set " << i << " differs";
  }
}

TEST(Moments, EveryThreadCountGivesTheSameBits) {
  const int64_t n = 200001;
  for (StateFormat f : kAll) {
    SCOPED_TRACE(state_format_name(f));
    const PassRun ref = three_steps(f, n, Isa::kAuto, 1);
    for (int t : {2, 3, 5}) expect_identical(three_steps(f, n, Isa::kAuto, t), ref, n);
  }
}

TEST(Moments, Fp32PassIsTorchsFormula) {
  const int64_t n = 4099;
  std::vector<float> w = random_values(n, false, 3), g = random_values(n, false, 4);
  std::vector<float> m = random_values(n, false, 5), v = random_values(n, true, 6);
  std::vector<float> w2 = w, m2 = m, v2 = v;
  const AdamWStep s{2e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.75f};
  MomentRef mr, vr;
  mr.f32 = m.data();
  vr.f32 = v.data();
  adamw_update_moments(w.data(), g.data(), mr, vr, n, s, nullptr, nullptr, 2);
  // torch.optim.AdamW, operation by operation in fp32
  const float decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  const float step_size = static_cast<float>(s.lr / (1.0 - std::pow(s.beta1, 7.0)));
  const float bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, 7.0)));
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[static_cast<size_t>(i)] * s.grad_scale;
    const float mi = m2[static_cast<size_t>(i)] * 0.9f + 0.1f * gi;
    const float vi = v2[static_cast<size_t>(i)] * 0.999f + static_cast<float>(1.0 - 0.999) * gi * gi;
    const float p = w2[static_cast<size_t>(i)] * decay - step_size * (mi / (std::sqrt(vi) / bc2 + 1e-8f));
    ASSERT_EQ(m[static_cast<size_t>(i)], mi) << i;
    ASSERT_EQ(v[static_cast<size_t>(i)], vi) << i;
    ASSERT_EQ(w[static_cast<size_t>(i)], p) << i;
  }
}

// The fused pass is, bit for bit, its definition taken apart: decode both moments (decode_moment),
// make torch's update operation by operation here, and encode the new moments (encode_moment). For
// every pair of m and v formats (the pass has a fast path per pair of bf16 or quantised formats and
// a generic one for the rest), a block size other than the default, a tensor whose last block is
// short, and a gradient scale.
TEST(Moments, FusedPassIsDecodeThenUpdateThenEncode) {
  for (int64_t block : {128, 64}) {
    const int64_t n = 7 * block + block / 2 + 3;
    for (StateFormat fm : kAll) {
      for (StateFormat fv : kAll) {
        SCOPED_TRACE(std::string(state_format_name(fm)) + "/" + state_format_name(fv) + " block " + std::to_string(block));
        std::vector<float> w = random_values(n, false, 11), g = random_values(n, false, 12);
        const std::vector<float> w0 = w;
        // The moments before the step (encoding is deterministic, so every call makes the same).
        auto start = [&](bool second) {
          MomentStore x = MomentStore::create(second ? fv : fm, second, {n}, block);
          x.encode(0, random_values(n, second, second ? 14 : 13).data());
          return x;
        };
        const MomentStore m = start(false), v = start(true);
        // The reference, from the stored moments as they decode.
        std::vector<float> m_old(static_cast<size_t>(n)), v_old(static_cast<size_t>(n));
        m.decode(0, m_old.data());
        v.decode(0, v_old.data());
        const AdamWStep s{3e-3, 0.9, 0.95, 1e-8, 0.1, 4, 0.625f};
        const StepConsts k = step_consts(s);
        std::vector<float> w_ref(static_cast<size_t>(n)), m_new(static_cast<size_t>(n)), v_new(static_cast<size_t>(n));
        std::vector<uint16_t> bf_ref(static_cast<size_t>(n));
        for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
          const float gi = g[i] * k.grad_scale;
          const float p0 = w0[i] * k.decay;
          m_new[i] = m_old[i] * k.b1 + k.omb1 * gi;
          v_new[i] = v_old[i] * k.b2 + (k.omb2 * gi) * gi;
          w_ref[i] = p0 - k.step_size * (m_new[i] / (std::sqrt(v_new[i]) / k.bc2_sqrt + k.eps));
          bf_ref[i] = fp32_to_bf16(w_ref[i]);
        }
        MomentStore m_ref = MomentStore::create(fm, false, {n}, block), v_ref = MomentStore::create(fv, true, {n}, block);
        m_ref.encode(0, m_new.data());
        v_ref.encode(0, v_new.data());
        for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
          if (!resolve_isa(isa).ok()) continue;  // the CPU lacks it (EveryInstructionSet... says so)
          SCOPED_TRACE(isa_name(isa));
          std::vector<float> w1 = w0;
          std::vector<uint16_t> bf(static_cast<size_t>(n));
          MomentStore m1 = start(false), v1 = start(true);
          adamw_update_moments(w1.data(), g.data(), m1.tensor(0), v1.tensor(0), n, s, nullptr, bf.data(), 2, isa);
          ASSERT_TRUE(same_bits(w1.data(), w_ref.data(), n)) << "weights";
          ASSERT_TRUE(same_bits(bf.data(), bf_ref.data(), n)) << "streamed bf16 copy";
          for (const auto& [got, want] : {std::pair{&m1, &m_ref}, std::pair{&v1, &v_ref}}) {
            ASSERT_TRUE(same_bits(got->f32().data(), want->f32().data(), got->f32().size()));
            ASSERT_TRUE(same_bits(got->bf16().data(), want->bf16().data(), got->bf16().size()));
            ASSERT_TRUE(same_bits(got->codes().data(), want->codes().data(), got->codes().size())) << "codes";
            ASSERT_TRUE(same_bits(got->scales().data(), want->scales().data(), got->scales().size())) << "scales";
          }
        }
      }
    }
  }
}

// The quantised passes follow the fp32 pass: the update they make differs from fp32's by an error
// that shrinks with more bits.
TEST(Moments, QuantisedUpdatesApproachFp32WithMoreBits) {
  const int64_t n = 50000;
  const PassRun ref = three_steps(StateFormat::kFp32, n, Isa::kAuto, 1);
  const std::vector<float> w0 = random_values(n, false, 1);
  double prev = 0;
  for (StateFormat f : {StateFormat::kQ2, StateFormat::kQ3, StateFormat::kQ4, StateFormat::kQ8, StateFormat::kBf16}) {
    const PassRun r = three_steps(f, n, Isa::kAuto, 1);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double du = (static_cast<double>(r.w[static_cast<size_t>(i)]) - w0[static_cast<size_t>(i)]) -
                        (static_cast<double>(ref.w[static_cast<size_t>(i)]) - w0[static_cast<size_t>(i)]);
      const double dr = static_cast<double>(ref.w[static_cast<size_t>(i)]) - w0[static_cast<size_t>(i)];
      num += du * du;
      den += dr * dr;
    }
    const double e = std::sqrt(num / den);
    std::printf("relative update error after 3 steps, %s: %.4f\n", state_format_name(f), e);
    if (prev > 0) {
      EXPECT_LT(e, prev) << state_format_name(f);
    }
    prev = e;
  }
  EXPECT_LT(prev, 0.01);  // bf16
}

}  // namespace
}  // namespace megatrain::exec

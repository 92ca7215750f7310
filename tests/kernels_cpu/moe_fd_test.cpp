// Central finite differences, in double, of the whole Mixture-of-Experts block's backward (main's
// cpu::moe_* ops composed as LayerMathT::moe_forward/moe_backward compose them; moe_block.h): dx, the
// router (and a router bias), and every expert's gate/up/down (Mixtral/Qwen3-MoE's, and gpt-oss's
// stacked biased gate_up/down with the clamped SwiGLU), with top-k renormalised and not, with
// one expert no token chose (its gradient exactly zero, never written), and the load-balancing loss's
// gradient on its own (dout = 0: only moe_route_backward's d_probs_const path feeds dlogits).
//
// Tolerance, from a measured error rather than a guess. For each element the central difference is
// taken at two steps, D(h) and D(h/2). Their truncation errors are c h^2 and c h^2 / 4, so
// |D(h) - D(h/2)| = 3/4 c h^2 plus the rounding noise of both; the largest such difference over the
// array, e_meas, bounds the truncation error of D(h/2) (a third of it) and is at least of the size of
// the rounding noise. An analytic gradient is accepted when max |analytic - D(h/2)| <= 10 e_meas +
// 1e-13 max |D| (the floor covers an array whose two estimates agree to the last bit). The test also
// asserts that e_meas is small (<= 1e-6 of the gradient's size; observed 1e-10 .. 1e-9 with
// MEGATRAIN_FD_VERBOSE=1), so the bound is tight, while a wrong term (factor, sign, index, transpose)
// is off by ~1e-1 of the gradient's size.
//
// Routing: top-k is piecewise constant, and a finite difference across a change of the chosen set
// would be meaningless. Every case asserts a routing margin (the smallest gap, over tokens, between
// the k-th and the (k+1)-th probability) above 1e-3, far above what a step of 1e-5 on one input can
// move a probability (|dp/dtheta| <= |x| + |w| < 4 here), and every perturbed forward is checked to
// choose exactly the experts of the unperturbed one. The clamped SwiGLU has kinks at its limits
// too: the gpt-oss cases assert that no gate/up value lies within 1e-4 of one, that both clamps
// are active somewhere, and that no perturbed forward changes which values are clamped.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "moe_block.h"
#include "test_util.h"

namespace megatrain::cpu {
namespace {

using testing::MoeBlock;
using testing::MoeCase;
using testing::MoeParams;

constexpr double kStep = 1e-5;
constexpr double kMinMargin = 1e-3;

struct FdResult {
  double scale = 0, measured = 0, worst = 0;
};

// Two-step central differences of loss() over every element of x, against analytic. loss() also
// reports whether its forward chose the reference experts.
FdResult check_fd(const std::string& what, std::vector<double>& x, const std::vector<double>& analytic,
                  const std::function<double(bool*)>& loss) {
  FdResult r;
  EXPECT_EQ(x.size(), analytic.size()) << what;
  std::vector<double> d1(x.size()), d2(x.size());
  bool routed_same = true;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    auto diff = [&](double s) {
      bool same = true;
      x[i] = keep + s;
      const double up = loss(&same);
      routed_same = routed_same && same;
      x[i] = keep - s;
      const double down = loss(&same);
      routed_same = routed_same && same;
      x[i] = keep;
      return (up - down) / (2 * s);
    };
    d1[i] = diff(kStep);
    d2[i] = diff(kStep / 2);
  }
  EXPECT_TRUE(routed_same) << what << ": a perturbed forward chose other experts (routing margin too small)";
  size_t worst_i = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    r.scale = std::max(r.scale, std::abs(d2[i]));
    r.measured = std::max(r.measured, std::abs(d1[i] - d2[i]));
    const double e = std::abs(analytic[i] - d2[i]);
    if (e > r.worst) r.worst = e, worst_i = i;
  }
  const double tol = 10 * r.measured + 1e-13 * r.scale;
  if (std::getenv("MEGATRAIN_FD_VERBOSE"))
    std::printf("[fd] %-44s n %4zu  max|D| %.3e  |D(h)-D(h/2)| %.2e  |analytic-D(h/2)| %.2e  (bound %.2e)\n",
                what.c_str(), x.size(), r.scale, r.measured / std::max(r.scale, 1e-300),
                r.worst / std::max(r.scale, 1e-300), tol / std::max(r.scale, 1e-300));
  EXPECT_GT(r.scale, 1e-3) << what << ": the gradient is (nearly) zero; the check would prove nothing";
  EXPECT_LE(r.measured, 1e-6 * r.scale) << what << ": the finite differences are too noisy to check anything";
  EXPECT_LE(r.worst, tol) << what << ": element " << worst_i << " analytic " << analytic[worst_i]
                          << " finite difference " << d2[worst_i] << " (max |gradient| " << r.scale << ")";
  return r;
}

// Smallest gap between the k-th and (k+1)-th router probability over the tokens.
double routing_margin(const MoeBlock<double>& b) {
  const MoeCase& c = b.config();
  double m = 1e30;
  for (int64_t t = 0; t < c.n; ++t) {
    std::vector<double> v(b.probs.begin() + t * c.e, b.probs.begin() + (t + 1) * c.e);
    std::sort(v.rbegin(), v.rend());
    m = std::min(m, v[static_cast<size_t>(c.k - 1)] - v[static_cast<size_t>(c.k)]);
  }
  return m;
}

// Which gate/up values the clamped SwiGLU clamps (gpt-oss), and their smallest distance to a limit.
std::vector<char> clamp_pattern(const MoeBlock<double>& b) {
  std::vector<char> m;
  if (!b.config().gpt_oss) return m;
  const double lim = b.config().limit;
  for (size_t j = 0; j < b.gate.size(); j += 2) m.push_back(static_cast<char>((b.gate[j] > lim) | ((std::abs(b.gate[j + 1]) > lim) << 1)));
  return m;
}
double clamp_margin(const MoeBlock<double>& b) {
  double m = 1e30;
  const double lim = b.config().limit;
  for (size_t j = 0; j < b.gate.size(); j += 2)
    m = std::min({m, std::abs(b.gate[j] - lim), std::abs(b.gate[j + 1] - lim), std::abs(b.gate[j + 1] + lim)});
  return m;
}

// The per-expert parameter arrays (their expert stride is size / e).
std::vector<std::vector<double>*> expert_arrays(MoeParams<double>& g) {
  std::vector<std::vector<double>*> v;
  for (auto* a : {&g.wg, &g.wu, &g.wd, &g.bgu, &g.bd})
    if (!a->empty()) v.push_back(a);
  return v;
}

int experts_used(const MoeBlock<double>& b) {
  int used = 0;
  for (int64_t x = 0; x < b.config().e; ++x) used += b.offsets[static_cast<size_t>(x + 1)] > b.offsets[static_cast<size_t>(x)];
  return used;
}

std::vector<MoeCase> cases() {
  MoeCase mixtral;
  mixtral.name = "softmax-topk, renorm (Mixtral)";
  MoeCase qwen = mixtral;
  qwen.name = "softmax-topk, no renorm (Qwen3-MoE)";
  qwen.renorm = false;
  MoeCase k3 = mixtral;
  k3.name = "renorm, k 3, router bias";
  k3.k = 3;
  k3.router_bias = true;
  MoeCase k3q = k3;
  k3q.name = "no renorm, k 3, router bias";
  k3q.renorm = false;
  MoeCase gpt = mixtral;
  gpt.name = "gpt-oss (stacked biased experts, clamped SwiGLU)";
  gpt.gpt_oss = true;
  MoeCase gpt3 = gpt;
  gpt3.name = "gpt-oss, k 3";
  gpt3.k = 3;
  return {mixtral, qwen, k3, k3q, gpt, gpt3};
}

// FD of every array of the block; `unused` (or -1) is an expert no token may choose.
void check_block(const MoeCase& c, uint64_t seed, int64_t unused) {
  CpuContext ctx(2);
  MoeParams<double> p = testing::make_moe_params<double>(c, seed, unused);
  MoeBlock<double> block(c);
  block.forward(ctx, p);
  ASSERT_GT(routing_margin(block), kMinMargin) << c.name << ": a near-tie in the routing; choose another seed";
  EXPECT_GE(experts_used(block), unused >= 0 ? c.e - 1 : c.e) << c.name << ": the routing does not spread";
  if (unused >= 0) {
    ASSERT_EQ(block.offsets[static_cast<size_t>(unused + 1)], block.offsets[static_cast<size_t>(unused)])
        << c.name << ": expert " << unused << " should be unchosen";
  }
  const std::vector<int32_t> ref_expert = block.expert;
  const std::vector<char> ref_clamp = clamp_pattern(block);
  if (c.gpt_oss) {
    ASSERT_GT(clamp_margin(block), 1e-4) << c.name << ": a value sits on a clamp limit; choose another seed";
    int gates = 0, ups = 0;
    for (char m : ref_clamp) gates += m & 1, ups += (m >> 1) & 1;
    EXPECT_GT(gates, 0) << c.name << ": the gate clamp is not exercised";
    EXPECT_GT(ups, 0) << c.name << ": the up clamp is not exercised";
  }

  // Gradients into buffers prefilled with -0.0: an expert's slice that is never written keeps the sign
  // bit, while any "+= 0" would make it +0.0.
  MoeParams<double> g = testing::zero_like(p, -0.0);
  block.backward(ctx, p, g);
  if (unused >= 0) {
    for (auto* w : expert_arrays(g))
      for (int64_t s = static_cast<int64_t>(w->size()) / c.e, j = 0; j < s; ++j) {
        const double v = (*w)[static_cast<size_t>(unused * s + j)];
        ASSERT_EQ(v, 0.0) << c.name << ": the unchosen expert has a gradient";
        ASSERT_TRUE(std::signbit(v)) << c.name << ": the unchosen expert's gradient was written";
      }
  }
  auto loss = [&](bool* same) {
    MoeBlock<double> b(c);
    const double l = b.forward(ctx, p);
    *same = b.expert == ref_expert && clamp_pattern(b) == ref_clamp;
    return l;
  };
  auto ps = p.arrays();
  auto gs = g.arrays();
  for (size_t a = 0; a < ps.size(); ++a) check_fd(c.name + " d" + ps[a].first, *ps[a].second, *gs[a].second, loss);
}

TEST(MoeBlockFd, EveryArrayWithAnUnchosenExpert) {
  for (const MoeCase& c : cases()) check_block(c, 7, /*unused=*/3);
}

TEST(MoeBlockFd, EveryArrayEveryExpertChosen) {
  for (MoeCase c : cases()) {
    c.n = 20;
    check_block(c, 11, /*unused=*/-1);
  }
}

TEST(MoeBlockFd, LoadBalancingLossAlone) {
  // dout = 0: the loss is coef * aux, whose only path to the parameters is d_probs_const through
  // moe_route_backward (d weight is zero), then the router's linear.
  for (MoeCase c : cases()) {
    c.coef = 1.0;
    CpuContext ctx(1);
    MoeParams<double> p = testing::make_moe_params<double>(c, 7, 3);
    std::fill(p.dout.begin(), p.dout.end(), 0.0);
    MoeBlock<double> block(c);
    const double l = block.forward(ctx, p);
    ASSERT_GT(routing_margin(block), kMinMargin) << c.name;
    EXPECT_DOUBLE_EQ(l, block.aux) << c.name;
    // HF's value by its definition: E * sum over experts of (fraction of slots) * (mean probability).
    double want = 0;
    for (int64_t x = 0; x < c.e; ++x) {
      double f = 0, pr = 0;
      for (int64_t s = 0; s < c.n * c.k; ++s) f += block.expert[static_cast<size_t>(s)] == x;
      for (int64_t t = 0; t < c.n; ++t) pr += block.probs[static_cast<size_t>(t * c.e + x)];
      want += (f / c.n) * (pr / c.n);
    }
    EXPECT_NEAR(block.aux, c.e * want, 1e-14) << c.name;
    const std::vector<int32_t> ref_expert = block.expert;
    MoeParams<double> g = testing::zero_like(p);
    block.backward(ctx, p, g);
    for (double v : block.d_weight) ASSERT_EQ(v, 0.0);
    auto loss = [&](bool* same) {
      MoeBlock<double> b(c);
      const double v = b.forward(ctx, p);
      *same = b.expert == ref_expert;
      return v;
    };
    check_fd(c.name + " aux alone dx", p.x, g.x, loss);
    check_fd(c.name + " aux alone drouter", p.wr, g.wr, loss);
    if (!p.br.empty()) check_fd(c.name + " aux alone drouter_bias", p.br, g.br, loss);
    for (auto* w : expert_arrays(g))
      for (double v : *w) ASSERT_EQ(v, 0.0) << c.name << ": the aux loss does not reach the experts";
  }
}

TEST(MoeBlockFd, AuxGradientOfRouteBackwardAgainstDefinition) {
  // moe_route_backward with d weight = 0 and d_probs_const = c: dlogits[t, x] = p_x (c_x - sum_y p_y c_y),
  // the softmax's Jacobian applied to c, the same for renorm on and off.
  CpuContext ctx(1);
  const int64_t n = 3, e = 4, k = 2;
  const std::vector<double> logits = {0.3, -1.0, 2.0, 0.7, 1.1, 0.2, -0.4, 0.9, -2.0, 0.5, 0.1, 1.6};
  const std::vector<double> cst = {0.25, -0.5, 1.0, 0.125};
  for (bool renorm : {false, true}) {
    std::vector<int32_t> ex(n * k);
    std::vector<double> w(n * k), p(n * e), dw(n * k, 0.0), dl(n * e, 99.0);
    moe_route_forward<double>(ctx, logits.data(), n, e, k, renorm, ex.data(), w.data(), p.data());
    moe_route_backward<double>(ctx, p.data(), ex.data(), w.data(), dw.data(), cst.data(), n, e, k, renorm, dl.data());
    for (int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (int64_t x = 0; x < e; ++x) s += p[t * e + x] * cst[x];
      for (int64_t x = 0; x < e; ++x) EXPECT_NEAR(dl[t * e + x], p[t * e + x] * (cst[x] - s), 1e-15);
    }
  }
}

TEST(MoeBlock, FloatMatchesDouble) {
  for (const MoeCase& c : cases()) {
    CpuContext ctx(2);
    const MoeParams<double> pd = testing::make_moe_params<double>(c, 7, 3);
    const MoeParams<float> pf = testing::make_moe_params<float>(c, 7, 3);
    MoeBlock<double> bd(c);
    MoeBlock<float> bf(c);
    bd.forward(ctx, pd);
    bf.forward(ctx, pf);
    ASSERT_EQ(bd.expert, bf.expert) << c.name;
    EXPECT_LE(testing::max_rel_error(bf.out, bd.out), 1e-5) << c.name;
    EXPECT_NEAR(bf.aux, bd.aux, 1e-6 * bd.aux) << c.name;
    MoeParams<double> gd = testing::zero_like(pd);
    MoeParams<float> gf = testing::zero_like(pf);
    bd.backward(ctx, pd, gd);
    bf.backward(ctx, pf, gf);
    auto ad = gd.arrays();
    auto af = gf.arrays();
    for (size_t a = 0; a < ad.size(); ++a)
      EXPECT_LE(testing::max_rel_error(*af[a].second, *ad[a].second), 1e-5) << c.name << " d" << ad[a].first;
  }
}

TEST(MoeBlock, ThreadCountDoesNotChangeBits) {
  // A size where every op really splits (n * k rows >= 3 chunks of 64 tokens).
  MoeCase c;
  c.name = "determinism";
  c.n = 200, c.h = 64, c.e = 6, c.k = 2, c.im = 96;
  const MoeParams<float> p = testing::make_moe_params<float>(c, 5, -1);
  std::vector<float> first_out, first_gx, first_gwd, first_gwr;
  for (int threads : {1, 2, 3}) {
    CpuContext ctx(threads);
    MoeBlock<float> b(c);
    b.forward(ctx, p);
    MoeParams<float> g = testing::zero_like(p);
    b.backward(ctx, p, g);
    if (threads == 1) {
      first_out = b.out, first_gx = g.x, first_gwd = g.wd, first_gwr = g.wr;
      continue;
    }
    EXPECT_EQ(b.out, first_out) << threads << " threads";
    EXPECT_EQ(g.x, first_gx) << threads << " threads";
    EXPECT_EQ(g.wd, first_gwd) << threads << " threads";
    EXPECT_EQ(g.wr, first_gwr) << threads << " threads";
  }
}

}  // namespace
}  // namespace megatrain::cpu

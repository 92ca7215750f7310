// The Mixture-of-Experts block of Mixtral and Qwen3-MoE built from main's cpu::moe_* ops in the
// order executor/src/model.cpp (LayerMathT::moe_forward / moe_backward) calls them, forward and
// backward, for the finite-difference and float-vs-double tests:
//   logits = x Wr^T (+ br) -> softmax, top-k (renormalised or not) -> stable sort of the slots by
//   expert -> gather -> per expert gate = xp Wg^T, up = xp Wu^T [E, Im, H] -> SwiGLU ->
//   yp = act Wd^T [E, H, Im] -> out[t] = sum_j weight[t, j] * yp[slot (t, j)]
// plus HF's load-balancing term of this one layer, coef * aux with
//   aux = E * sum_x (count_x / n) * (P_x / n)   (count_x: slots choosing x, P_x: sum_t p[t, x]),
// whose gradient with respect to p[t, x] is the constant coef * E * count_x / n^2 (top-k is piecewise
// constant), the d_probs_const of moe_route_backward. The scalar the tests differentiate is
//   loss = <out, dout> + coef * aux.
// gpt_oss = true builds gpt-oss's experts instead, as model.cpp does: stacked gate_up [E, H, 2Im]
// (x @ W, gate and up interleaved in the columns) and down [E, Im, H] with biases, the clamped
// SwiGLU (alpha, limit), and the router with a bias; its top-k-then-softmax routing equals
// softmax-top-k with renormalisation, which is how the executor computes it.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/kernels/cpu/linear.h"
#include "megatrain/kernels/cpu/moe.h"
#include "megatrain/kernels/cpu/swiglu.h"

namespace megatrain::cpu::testing {

struct MoeCase {
  std::string name;
  bool renorm = true;       // Mixtral always; Qwen3-MoE when norm_topk_prob
  bool router_bias = false; // not in Mixtral/Qwen3-MoE; linear_forward's bias path, for coverage
  bool gpt_oss = false;
  double alpha = 1.702, limit = 0.7;  // gpt-oss's clamped SwiGLU; a small limit so the clamps bite
  int64_t n = 12, h = 8, e = 5, k = 2, im = 6;
  double coef = 0.5;        // large, so that a wrong aux gradient shows
};

template <typename T>
struct MoeParams {
  std::vector<T> x, wr, br;  // x [n, h]; router [e, h], bias [e]
  std::vector<T> wg, wu;     // experts' gate_proj, up_proj [e, im, h]; gpt-oss: wg = gate_up_proj [e, h, 2im]
  std::vector<T> wd;         // experts' down_proj [e, h, im]; gpt-oss: [e, im, h]
  std::vector<T> bgu, bd;    // gpt-oss: gate_up_proj_bias [e, 2im], down_proj_bias [e, h]
  std::vector<T> dout;       // [n, h]: the direction of <out, dout>

  std::vector<std::pair<std::string, std::vector<T>*>> arrays() {
    std::vector<std::pair<std::string, std::vector<T>*>> a = {{"x", &x}, {"router", &wr}};
    if (!br.empty()) a.push_back({"router_bias", &br});
    a.push_back({wu.empty() ? "gate_up_proj" : "gate_proj", &wg});
    if (!wu.empty()) a.push_back({"up_proj", &wu});
    a.push_back({"down_proj", &wd});
    if (!bgu.empty()) a.push_back({"gate_up_proj_bias", &bgu});
    if (!bd.empty()) a.push_back({"down_proj_bias", &bd});
    return a;
  }
};

template <typename T>
class MoeBlock {
 public:
  explicit MoeBlock(MoeCase c) : c_(std::move(c)) {}
  const MoeCase& config() const { return c_; }
  int64_t in_stride() const { return c_.im * c_.h; }  // one expert's gate/up or down matrix

  // Runs the forward, keeping what the backward needs; returns <out, dout> + coef * aux in double.
  double forward(CpuContext& ctx, const MoeParams<T>& p) {
    const int64_t n = c_.n, h = c_.h, e = c_.e, k = c_.k, im = c_.im, slots = n * k;
    logits.assign(static_cast<size_t>(n * e), T(0));
    linear_forward<T>(ctx, p.x.data(), p.wr.data(), p.br.empty() ? nullptr : p.br.data(), n, h, e, logits.data());
    expert.assign(static_cast<size_t>(slots), -1);
    weight.assign(static_cast<size_t>(slots), T(0));
    probs.assign(static_cast<size_t>(n * e), T(0));
    moe_route_forward<T>(ctx, logits.data(), n, e, k, c_.renorm, expert.data(), weight.data(), probs.data());
    offsets.assign(static_cast<size_t>(e + 1), 0);
    perm.assign(static_cast<size_t>(slots), 0);
    row_of_slot.assign(static_cast<size_t>(slots), 0);
    moe_permute(expert.data(), n, k, e, offsets.data(), perm.data());
    for (int64_t r = 0; r < slots; ++r) row_of_slot[static_cast<size_t>(perm[static_cast<size_t>(r)])] = static_cast<int32_t>(r);
    xp.assign(static_cast<size_t>(slots * h), T(0));
    moe_gather<T>(ctx, p.x.data(), perm.data(), slots, k, h, xp.data());
    act.assign(static_cast<size_t>(slots * im), T(0));
    yp.assign(static_cast<size_t>(slots * h), T(0));
    if (c_.gpt_oss) {
      gate.assign(static_cast<size_t>(slots * 2 * im), T(0));  // the interleaved gate_up
      grouped_matmul_forward<T>(ctx, xp.data(), p.wg.data(), 2 * in_stride(), p.bgu.data(), 2 * im, offsets.data(), e, h,
                                2 * im, gate.data());
      clamped_swiglu_forward<T>(ctx, gate.data(), slots, im, T(c_.alpha), T(c_.limit), act.data());
      grouped_matmul_forward<T>(ctx, act.data(), p.wd.data(), in_stride(), p.bd.data(), h, offsets.data(), e, im, h,
                                yp.data());
    } else {
      gate.assign(static_cast<size_t>(slots * im), T(0));
      up = gate;
      grouped_linear_forward<T>(ctx, xp.data(), p.wg.data(), in_stride(), nullptr, 0, offsets.data(), e, h, im, gate.data());
      grouped_linear_forward<T>(ctx, xp.data(), p.wu.data(), in_stride(), nullptr, 0, offsets.data(), e, h, im, up.data());
      swiglu_forward<T>(ctx, gate.data(), up.data(), slots * im, act.data());
      grouped_linear_forward<T>(ctx, act.data(), p.wd.data(), in_stride(), nullptr, 0, offsets.data(), e, im, h, yp.data());
    }
    out.assign(static_cast<size_t>(n * h), T(0));
    moe_combine_forward<T>(ctx, yp.data(), weight.data(), row_of_slot.data(), n, k, h, out.data());
    count.assign(static_cast<size_t>(e), 0.0);
    prob_sum.assign(static_cast<size_t>(e), 0.0);
    moe_aux_stats<T>(probs.data(), expert.data(), n, e, k, count.data(), prob_sum.data());
    aux = 0;
    for (int64_t x = 0; x < e; ++x)
      aux += (count[static_cast<size_t>(x)] / static_cast<double>(n)) * (prob_sum[static_cast<size_t>(x)] / static_cast<double>(n));
    aux *= static_cast<double>(e);
    double loss = 0;
    for (size_t j = 0; j < out.size(); ++j) loss += static_cast<double>(out[j]) * static_cast<double>(p.dout[j]);
    return loss + c_.coef * aux;
  }

  // After forward: the loss's gradients. Parameter gradients accumulate into g (sized by the
  // caller: zero_like); g.x is overwritten.
  void backward(CpuContext& ctx, const MoeParams<T>& p, MoeParams<T>& g) {
    const int64_t n = c_.n, h = c_.h, e = c_.e, k = c_.k, im = c_.im, slots = n * k;
    dyp.assign(static_cast<size_t>(slots * h), T(0));
    d_weight.assign(static_cast<size_t>(slots), T(0));
    moe_combine_backward<T>(ctx, yp.data(), weight.data(), row_of_slot.data(), p.dout.data(), n, k, h, dyp.data(),
                            d_weight.data());
    dact.assign(static_cast<size_t>(slots * im), T(0));
    dxp.assign(static_cast<size_t>(slots * h), T(0));
    if (c_.gpt_oss) {
      grouped_matmul_backward<T>(ctx, dyp.data(), act.data(), p.wd.data(), in_stride(), offsets.data(), e, im, h,
                                 dact.data(), g.wd.data(), g.bd.data(), h);
      dgate.assign(static_cast<size_t>(slots * 2 * im), T(0));
      clamped_swiglu_backward<T>(ctx, gate.data(), dact.data(), slots, im, T(c_.alpha), T(c_.limit), dgate.data());
      grouped_matmul_backward<T>(ctx, dgate.data(), xp.data(), p.wg.data(), 2 * in_stride(), offsets.data(), e, h, 2 * im,
                                 dxp.data(), g.wg.data(), g.bgu.data(), 2 * im);
    } else {
      grouped_linear_backward<T>(ctx, dyp.data(), act.data(), p.wd.data(), in_stride(), offsets.data(), e, im, h, dact.data(),
                                 g.wd.data(), nullptr, 0);
      dgate.assign(static_cast<size_t>(slots * im), T(0));
      dup = dgate;
      swiglu_backward<T>(ctx, gate.data(), up.data(), dact.data(), slots * im, dgate.data(), dup.data());
      dxp_up = dxp;
      grouped_linear_backward<T>(ctx, dgate.data(), xp.data(), p.wg.data(), in_stride(), offsets.data(), e, h, im, dxp.data(),
                                 g.wg.data(), nullptr, 0);
      grouped_linear_backward<T>(ctx, dup.data(), xp.data(), p.wu.data(), in_stride(), offsets.data(), e, h, im,
                                 dxp_up.data(), g.wu.data(), nullptr, 0);
      for (size_t j = 0; j < dxp.size(); ++j) dxp[j] += dxp_up[j];
    }
    g.x.assign(static_cast<size_t>(n * h), T(0));
    moe_scatter_add<T>(ctx, dxp.data(), row_of_slot.data(), n, k, h, g.x.data());
    d_probs_const.assign(static_cast<size_t>(e), T(0));
    for (int64_t x = 0; x < e; ++x)
      d_probs_const[static_cast<size_t>(x)] =
          static_cast<T>(c_.coef * static_cast<double>(e) * count[static_cast<size_t>(x)] / (static_cast<double>(n) * n));
    dlogits.assign(static_cast<size_t>(n * e), T(0));
    moe_route_backward<T>(ctx, probs.data(), expert.data(), weight.data(), d_weight.data(),
                          c_.coef != 0 ? d_probs_const.data() : nullptr, n, e, k, c_.renorm, dlogits.data());
    linear_backward<T>(ctx, dlogits.data(), p.x.data(), p.wr.data(), n, h, e, g.x.data(), true, g.wr.data(),
                       g.br.empty() ? nullptr : g.br.data());
  }

  // Saved by forward.
  std::vector<T> logits, weight, probs, xp, gate, up, act, yp, out;
  std::vector<int32_t> expert, offsets, perm, row_of_slot;
  std::vector<double> count, prob_sum;
  double aux = 0;
  // Backward's intermediates.
  std::vector<T> dyp, d_weight, dact, dgate, dup, dxp, dxp_up, d_probs_const, dlogits;

 private:
  MoeCase c_;
};

// Seeded uniform parameters. With unused in [0, e): feature 0 of every token is in [1.5, 2.5] and
// the router gives expert `unused` a weight of -6 on it, so that no token chooses that expert.
template <typename T>
MoeParams<T> make_moe_params(const MoeCase& c, uint64_t seed, int64_t unused) {
  auto rv = [&](int64_t count, uint64_t stream, double lo, double hi) {
    std::mt19937_64 rng(seed * 1000 + stream);
    std::uniform_real_distribution<double> dist(lo, hi);
    std::vector<T> v(static_cast<size_t>(count));
    for (T& x : v) x = static_cast<T>(dist(rng));
    return v;
  };
  MoeParams<T> p;
  p.x = rv(c.n * c.h, 1, -1, 1);
  p.wr = rv(c.e * c.h, 3, -1, 1);
  if (unused >= 0 && unused < c.e) {
    const auto x0 = rv(c.n, 2, 1.5, 2.5);
    for (int64_t t = 0; t < c.n; ++t) p.x[static_cast<size_t>(t * c.h)] = x0[static_cast<size_t>(t)];
    p.wr[static_cast<size_t>(unused * c.h)] = T(-6);
  }
  if (c.router_bias || c.gpt_oss) p.br = rv(c.e, 4, -0.5, 0.5);
  if (c.gpt_oss) {
    p.wg = rv(c.e * c.h * 2 * c.im, 5, -0.6, 0.6);
    p.bgu = rv(c.e * 2 * c.im, 6, -0.3, 0.3);
    p.wd = rv(c.e * c.im * c.h, 7, -0.6, 0.6);
    p.bd = rv(c.e * c.h, 8, -0.3, 0.3);
  } else {
    p.wg = rv(c.e * c.im * c.h, 5, -0.6, 0.6);
    p.wu = rv(c.e * c.im * c.h, 6, -0.6, 0.6);
    p.wd = rv(c.e * c.h * c.im, 7, -0.6, 0.6);
  }
  p.dout = rv(c.n * c.h, 9, -1, 1);
  return p;
}

template <typename T>
MoeParams<T> zero_like(const MoeParams<T>& p, T fill = T(0)) {
  auto z = [fill](const std::vector<T>& v) { return std::vector<T>(v.size(), fill); };
  MoeParams<T> g;
  g.x = z(p.x), g.wr = z(p.wr), g.br = z(p.br), g.wg = z(p.wg), g.wu = z(p.wu), g.wd = z(p.wd), g.dout = z(p.dout);
  g.bgu = z(p.bgu), g.bd = z(p.bd);
  return g;
}

}  // namespace megatrain::cpu::testing

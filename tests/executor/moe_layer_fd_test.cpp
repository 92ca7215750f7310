// Central finite differences, in double, of a whole MoE decoder layer as the executor computes it
// (LayerMathT<double>::forward/backward, executor/src/model.cpp): attention, the MoE block, both
// residuals, and the load-balancing term, for tiny-mixtral (top-k renormalised), tiny-qwen3-moe
// with norm_topk_prob false (not renormalised, q/k norms) and tiny-gpt-oss (sinks, a sliding window
// shorter than the sequence, biases everywhere, stacked experts, the clamped SwiGLU). The kernels' own block test is
// tests/kernels_cpu/moe_fd_test.cpp; this one checks the composition that trains.
//
// loss = <layer(x), g> + coef * aux, aux = E * sum_e (c_e / N) * (P_e / N) from the statistics the
// forward adds (aux_count, aux_prob); the backward gets aux_grad[e] = coef * E * c_e / N^2, the
// contract trainer.cpp follows (there with R = moe_layers * N rows).
//
// Tolerance from a measured error, as in moe_fd_test.cpp: D(h) and D(h/2) at h = 1e-5, accepted
// |analytic - D(h/2)| <= 10 max|D(h) - D(h/2)| + 1e-13 max|D| over the sampled elements of each
// tensor; every perturbed forward must choose the experts of the unperturbed one, and the routing
// margin (the gap between the k-th and (k+1)-th probability) is asserted above 1e-3; for gpt-oss
// also which gate/up values are clamped, and their distance to a clamp limit above 1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "megatrain/executor/host_state.h"
#include "megatrain/executor/model.h"

namespace megatrain::exec {
namespace {

constexpr double kStep = 1e-5;
constexpr double kCoef = 0.5;

ModelSpec load_spec(const std::string& profile, bool renorm_override, bool renorm) {
  std::ifstream in(std::string(MEGATRAIN_PROFILES_DIR) + "/models/" + profile + ".json");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json c = nlohmann::json::parse(ss.str());
  if (renorm_override) c["norm_topk_prob"] = renorm;
  auto spec = ModelSpec::from_config_json(c.dump(), profile);
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  return *spec;
}

struct LayerCase {
  Dims d;
  UnitState layout;  // the MoE layer's tensors
  std::vector<double> w, x, g;
  std::unique_ptr<LayerMathT<double>> math;
  cpu::CpuContext ctx{1};
  std::vector<double> acts, ws, out, count, prob;

  // gpt-oss: which interleaved gate/up values the clamped SwiGLU clamps, and the smallest distance
  // of any to a limit.
  std::vector<char> clamp_pattern(const LayerActsT<double>& a, double* margin = nullptr) const {
    std::vector<char> m;
    if (!d.gpt_oss || d.swiglu_limit <= 0) return m;
    const double lim = d.swiglu_limit;
    double mg = 1e30;
    for (int64_t j = 0; j < 2 * d.N * d.k * d.Im; j += 2) {
      const double gate = a.gate[j], up = a.gate[j + 1];
      m.push_back(static_cast<char>((gate > lim) | ((std::abs(up) > lim) << 1)));
      mg = std::min({mg, std::abs(gate - lim), std::abs(up - lim), std::abs(up + lim)});
    }
    if (margin) *margin = mg;
    return m;
  }

  // One forward; returns the loss and the experts chosen (and, for gpt-oss, the clamp pattern
  // appended as -1-separated values).
  double forward(std::vector<int32_t>* chosen = nullptr, LayerActsT<double>* keep = nullptr) {
    LayerActsT<double> a = bind_layer_acts(d, acts.data());
    std::fill(count.begin(), count.end(), 0.0);
    std::fill(prob.begin(), prob.end(), 0.0);
    a.aux_count = count.data();
    a.aux_prob = prob.data();
    EXPECT_TRUE(math->forward(view_unit(layout, w.data()), x.data(), out.data(), a).ok());
    double loss = 0, aux = 0;
    for (size_t i = 0; i < out.size(); ++i) loss += out[i] * g[i];
    const double n = static_cast<double>(d.N);
    for (int64_t e = 0; e < d.E; ++e) aux += (count[static_cast<size_t>(e)] / n) * (prob[static_cast<size_t>(e)] / n);
    if (chosen) {
      chosen->assign(a.rexpert, a.rexpert + d.N * d.k);
      chosen->push_back(-1);
      for (char m : clamp_pattern(a)) chosen->push_back(m);
    }
    if (keep) *keep = a;
    return loss + kCoef * static_cast<double>(d.E) * aux;
  }
};

std::unique_ptr<LayerCase> make_case(const ModelSpec& spec, uint64_t seed, int64_t seq) {
  auto c = std::make_unique<LayerCase>();
  auto dims = make_dims(spec, 1, seq);
  EXPECT_TRUE(dims.ok()) << dims.status().to_string();
  c->d = *dims;
  HostState hs = HostState::create(spec, DType::kFp32);
  for (const UnitState& us : hs.units())
    if (us.find(TensorRole::kRouter) != nullptr) {
      c->layout.tensors = us.tensors;
      c->layout.numel = us.numel;
      break;
    }
  EXPECT_GT(c->layout.numel, 0) << "no MoE layer";
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  c->w.assign(static_cast<size_t>(c->layout.numel), 0.0);
  for (const TensorSlot& t : c->layout.tensors) {
    const bool norm = t.role == TensorRole::kAttnNorm || t.role == TensorRole::kMlpNorm ||
                      t.role == TensorRole::kQNorm || t.role == TensorRole::kKNorm;
    const double scale = t.role == TensorRole::kRouter ? 1.0 : 0.25;
    for (int64_t i = 0; i < t.numel; ++i) c->w[static_cast<size_t>(t.offset + i)] = norm ? 1 + 0.1 * u(rng) : scale * u(rng);
  }
  const int64_t NH = c->d.N * c->d.H;
  c->x.resize(static_cast<size_t>(NH));
  c->g.resize(static_cast<size_t>(NH));
  for (double& v : c->x) v = u(rng);
  for (double& v : c->g) v = u(rng);
  auto inv = rope_inv_freq_for<double>(spec);
  EXPECT_TRUE(inv.ok());
  c->math = std::make_unique<LayerMathT<double>>(c->ctx, c->d, *inv);
  c->acts.assign(static_cast<size_t>(layer_act_floats(c->d)), 0.0);
  c->ws.assign(static_cast<size_t>(layer_workspace_floats(c->d)), 0.0);
  c->out.assign(static_cast<size_t>(NH), 0.0);
  c->count.assign(static_cast<size_t>(c->d.E), 0.0);
  c->prob.assign(static_cast<size_t>(c->d.E), 0.0);
  return c;
}

double routing_margin(const LayerActsT<double>& a, const Dims& d) {
  double m = 1e30;
  for (int64_t t = 0; t < d.N; ++t) {
    std::vector<double> p(a.rprobs + t * d.E, a.rprobs + (t + 1) * d.E);
    std::sort(p.rbegin(), p.rend());
    m = std::min(m, p[static_cast<size_t>(d.k - 1)] - p[static_cast<size_t>(d.k)]);
  }
  return m;
}

void check_layer(const std::string& what, const ModelSpec& spec, int64_t seq = 6) {
  // The first seed whose routing has a margin above 1e-3 and whose clamped values (gpt-oss) lie
  // 1e-4 or more from a limit (deterministic).
  std::unique_ptr<LayerCase> c;
  LayerActsT<double> a{};
  for (uint64_t seed = 1; seed < 50; ++seed) {
    c = make_case(spec, seed, seq);
    c->forward(nullptr, &a);
    double clamp_margin = 1e30;
    c->clamp_pattern(a, &clamp_margin);
    if (routing_margin(a, c->d) > 1e-3 && clamp_margin > 1e-4) break;
    c.reset();
  }
  ASSERT_TRUE(c) << what << ": no seed below 50 gives a routing margin above 1e-3 (and clamp margin above 1e-4)";
  const Dims& d = c->d;
  std::vector<int32_t> ref_chosen;
  c->forward(&ref_chosen, &a);
  if (d.gpt_oss) {
    int gates = 0, ups = 0;
    for (char m : c->clamp_pattern(a)) gates += m & 1, ups += (m >> 1) & 1;
    EXPECT_GT(gates, 0) << what << ": the gate clamp is not exercised";
    EXPECT_GT(ups, 0) << what << ": the up clamp is not exercised";
  }
  std::vector<int64_t> rows(static_cast<size_t>(d.E), 0);
  for (int64_t s = 0; s < d.N * d.k; ++s) ++rows[static_cast<size_t>(ref_chosen[static_cast<size_t>(s)])];
  int used = 0;
  for (int64_t r : rows) used += r > 0;
  EXPECT_GE(used, 4) << what << ": the routing should spread over several experts";

  std::vector<double> grad(c->w.size(), 0.0), dx(c->x.size(), 0.0);
  std::vector<double> agrad(static_cast<size_t>(d.E));
  for (int64_t e = 0; e < d.E; ++e)
    agrad[static_cast<size_t>(e)] = kCoef * static_cast<double>(d.E) * c->count[static_cast<size_t>(e)] /
                                    (static_cast<double>(d.N) * static_cast<double>(d.N));
  a.aux_grad = agrad.data();
  a.aux_count = a.aux_prob = nullptr;
  ASSERT_TRUE(c->math->backward(view_unit(c->layout, c->w.data()), a, c->g.data(), dx.data(),
                                grad_unit(c->layout, grad.data()), c->ws.data()).ok());

  // FD over `idx` of `v`, against `an` at the same indices.
  auto fd = [&](const std::string& name, std::vector<double>& v, const std::vector<double>& an,
                const std::vector<int64_t>& idx) {
    double scale = 0, measured = 0, worst = 0;
    int64_t worst_i = -1;
    bool same = true;
    std::vector<double> d2(idx.size());
    for (size_t s = 0; s < idx.size(); ++s) {
      const size_t i = static_cast<size_t>(idx[s]);
      const double keep = v[i];
      auto diff = [&](double h) {
        std::vector<int32_t> ch;
        v[i] = keep + h;
        const double up = c->forward(&ch);
        same = same && ch == ref_chosen;
        v[i] = keep - h;
        const double down = c->forward(&ch);
        same = same && ch == ref_chosen;
        v[i] = keep;
        return (up - down) / (2 * h);
      };
      const double d1 = diff(kStep);
      d2[s] = diff(kStep / 2);
      scale = std::max(scale, std::abs(d2[s]));
      measured = std::max(measured, std::abs(d1 - d2[s]));
      if (std::abs(an[i] - d2[s]) > worst) worst = std::abs(an[i] - d2[s]), worst_i = static_cast<int64_t>(s);
    }
    const double tol = 10 * measured + 1e-13 * scale;
    if (std::getenv("MEGATRAIN_FD_VERBOSE"))
      std::printf("[fd] %-48s %3zu el  max|D| %.2e  |D(h)-D(h/2)| %.1e  |an-D| %.1e\n", name.c_str(), idx.size(), scale,
                  measured / std::max(scale, 1e-300), worst / std::max(scale, 1e-300));
    EXPECT_TRUE(same) << name << ": a perturbed forward chose other experts";
    EXPECT_GT(scale, 1e-4) << name << ": (nearly) zero gradient; the check proves nothing";
    EXPECT_LE(measured, 1e-6 * scale) << name << ": finite differences too noisy";
    if (worst_i >= 0) {
      EXPECT_LE(worst, tol) << name << ": element " << idx[static_cast<size_t>(worst_i)] << " analytic "
                            << an[static_cast<size_t>(idx[static_cast<size_t>(worst_i)])] << " fd "
                            << d2[static_cast<size_t>(worst_i)];
    }
  };
  // dx: every element.
  std::vector<int64_t> all_x(c->x.size());
  for (size_t i = 0; i < all_x.size(); ++i) all_x[i] = static_cast<int64_t>(i);
  fd(what + " dx", c->x, dx, all_x);
  // Each tensor: up to 24 elements spread over it (all of a small one).
  for (const TensorSlot& t : c->layout.tensors) {
    const bool unchosen = t.expert >= 0 && t.role != TensorRole::kRouter && rows[static_cast<size_t>(t.expert)] == 0;
    if (unchosen) {
      for (int64_t i = 0; i < t.numel; ++i) {
        ASSERT_EQ(grad[static_cast<size_t>(t.offset + i)], 0.0) << t.name << ": an expert no token chose has a gradient";
      }
      continue;
    }
    const bool stacked = t.role == TensorRole::kExpertGateUp || t.role == TensorRole::kExpertGateUpBias ||
                         t.role == TensorRole::kExpertDown || t.role == TensorRole::kExpertDownBias;
    if (d.gpt_oss && stacked) {  // gpt-oss's stacked tensors: an unchosen expert's slice stays exactly 0
      const int64_t per = t.numel / d.E;
      for (int64_t e = 0; e < d.E; ++e) {
        if (rows[static_cast<size_t>(e)] != 0) continue;
        for (int64_t i = 0; i < per; ++i) {
          ASSERT_EQ(grad[static_cast<size_t>(t.offset + e * per + i)], 0.0) << t.name << " expert " << e;
        }
      }
    }
    std::vector<int64_t> idx;
    const int64_t step = std::max<int64_t>(1, t.numel / 24);
    for (int64_t i = 0; i < t.numel; i += step) idx.push_back(t.offset + (i * 7919 + 13) % t.numel);
    fd(what + " " + t.name, c->w, grad, idx);
  }
}

TEST(MoeLayerFd, MixtralRenormalised) { check_layer("tiny-mixtral", load_spec("tiny-mixtral", false, true)); }

TEST(MoeLayerFd, GptOssSinksWindowClampedExperts) {
  // 20 tokens: past layer 0's sliding window of 16.
  check_layer("tiny-gpt-oss", load_spec("tiny-gpt-oss", false, true), 20);
}

TEST(MoeLayerFd, Qwen3MoeNotRenormalised) {
  check_layer("tiny-qwen3-moe (norm_topk_prob false)", load_spec("tiny-qwen3-moe", true, false));
}

}  // namespace
}  // namespace megatrain::exec

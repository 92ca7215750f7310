// MegaTrain's training against an independent PyTorch implementation of the same model
// (tests/python/torch_train_ref.py, run with the project's venv Python, PyTorch 2.13): the same initial
// safetensors, the same sequential batches, AdamW for 10 steps, on both sides twice:
//   - in float64: our layer templates (LayerMathT<double>, the same code the pipeline runs in
//     float) in a plain in-memory loop, against PyTorch in float64. Rounding cannot hide a slip
//     there, so the bound is tight (docs/testing.md gives the measured figures);
//   - in fp32: the real streamed Trainer against PyTorch in fp32. Each side's error is measured
//     against its own float64 run, and ours must stay within a multiple of PyTorch's own fp32
//     error: a bound derived from the rounding spread measured in the same run, so that another
//     CPU, BLAS kernel or instruction-set path moves the bound with the error.
// A third test shows that the comparison fails on real semantic slips: the reference is rerun
// with one slip at a time (RoPE offset, norm epsilon, a missing bias, no Adam bias correction, ...)
// and every one must be reported. Skips with a message when torch is missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/core/plan.h"
#include "megatrain/executor/model.h"
#include "megatrain/executor/optimizer.h"
#include "megatrain/executor/safetensors.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/executor/weights_io.h"
#include "megatrain/kernels/cpu/add.h"

namespace megatrain::exec {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

bool torch_available() {
  return std::system((std::string(MEGATRAIN_TEST_PYTHON) + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
}

// The same training as the Trainer's plain in-memory loop, in float64 from the float64 instance of
// the layer templates: embedding, layers, head and loss, backward, the tied head's gradient added to
// the embedding's, clipping as torch.nn.utils.clip_grad_norm_, and AdamW as torch.optim.AdamW
// (decoupled weight decay on the tensors HostState marks, bias-corrected moments) in double.
struct Float64Run {
  std::vector<double> losses;
  std::vector<double> aux_losses;  // MoE: the load-balancing loss of each step (mean over micro-batches)
  std::vector<std::vector<double>> w;  // per unit, laid out as UnitState::tensors
};

Result<Float64Run> train_float64(const Plan& plan, const ModelSpec& model, const HostState& init,
                                 const DataLoader& data) {
  const TrainingConfig& tc = plan.training;
  const OptimizerConfig& o = plan.optimizer;
  MT_ASSIGN_OR_RETURN(Dims d, make_dims(model, tc.micro_batch, tc.seq_len));
  MT_ASSIGN_OR_RETURN(std::vector<double> inv_freq, rope_inv_freq_for<double>(model));
  cpu::CpuContext ctx(1);
  LayerMathT<double> math(ctx, d, std::move(inv_freq));
  const auto& units = init.units();
  const int64_t U = static_cast<int64_t>(units.size()), L = d.L, A = tc.grad_accum;
  Float64Run run;
  std::vector<std::vector<double>> g(units.size()), m(units.size()), v(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    run.w.emplace_back(units[u].master.data(), units[u].master.data() + units[u].numel);
    g[u].assign(static_cast<size_t>(units[u].numel), 0.0);
    m[u] = v[u] = g[u];
  }
  const int64_t NH = d.N * d.H;
  std::vector<std::vector<double>> x(static_cast<size_t>(L + 1), std::vector<double>(static_cast<size_t>(NH)));
  std::vector<std::vector<double>> acts(static_cast<size_t>(L), std::vector<double>(static_cast<size_t>(layer_act_floats(d))));
  std::vector<double> ws(static_cast<size_t>(std::max(layer_workspace_floats(d), head_workspace_floats(d))));
  std::vector<double> dx(static_cast<size_t>(NH)), dtied(d.tied ? static_cast<size_t>(d.V * d.H) : 0);
  std::vector<int32_t> inputs(static_cast<size_t>(d.N)), targets(static_cast<size_t>(d.N));
  const UnitState& hu = units[static_cast<size_t>(L + 1)];
  const int64_t fn_off = hu.find(TensorRole::kFinalNorm)->offset;
  // MoE (as the Trainer does it, trainer.cpp): routing statistics per micro-batch and layer, HF's
  // load-balancing loss over the MoE layers, its gradient when output_router_logits, and per
  // expert the AdamW count of the experts some token chose.
  const ModelConfig& mc = model.config();
  const int64_t E = d.E;
  auto is_moe = [&](int64_t l) { return d.moe && units[static_cast<size_t>(l)].find(TensorRole::kRouter) != nullptr; };
  std::vector<std::vector<int64_t>> expert_steps(units.size());
  for (size_t u = 0; u < units.size(); ++u) expert_steps[u] = units[u].expert_steps;
  for (int64_t step = 0; step < tc.steps; ++step) {
    std::vector<double> count(static_cast<size_t>(A * L * E), 0.0), prob(count.size(), 0.0), agrad(static_cast<size_t>(E));
    double aux_sum = 0;
    for (auto& gu : g) std::fill(gu.begin(), gu.end(), 0.0);
    std::fill(dtied.begin(), dtied.end(), 0.0);
    const double* lm = d.tied ? run.w[0].data() : run.w[static_cast<size_t>(L + 1)].data() + hu.find(TensorRole::kHead)->offset;
    double* dlm = d.tied ? dtied.data() : g[static_cast<size_t>(L + 1)].data() + hu.find(TensorRole::kHead)->offset;
    double loss_sum = 0;
    int64_t tokens = 0;
    // The mean is over the step's counted targets (a prepared dataset's mask leaves some out).
    int64_t counted = 0;
    for (int64_t j = 0; j < A; ++j) {
      MT_RETURN_IF_ERROR(data.fill(step, j, inputs.data(), targets.data()));
      for (int32_t t : targets) counted += t >= 0;
    }
    for (int64_t j = 0; j < A; ++j) {
      MT_RETURN_IF_ERROR(data.fill(step, j, inputs.data(), targets.data()));
      MT_RETURN_IF_ERROR(math.embed(run.w[0].data(), inputs.data(), x[0].data()));
      for (int64_t l = 1; l <= L; ++l) {
        LayerActsT<double> a = bind_layer_acts(d, acts[static_cast<size_t>(l - 1)].data());
        if (is_moe(l)) {
          a.aux_count = count.data() + (j * L + l - 1) * E;
          a.aux_prob = prob.data() + (j * L + l - 1) * E;
        }
        MT_RETURN_IF_ERROR(math.forward(view_unit(units[static_cast<size_t>(l)], run.w[static_cast<size_t>(l)].data()),
                                        x[static_cast<size_t>(l - 1)].data(), x[static_cast<size_t>(l)].data(), a));
      }
      if (d.moe) {
        std::vector<double> c(static_cast<size_t>(E), 0.0), p(static_cast<size_t>(E), 0.0);
        for (int64_t l = 1; l <= L; ++l)
          if (is_moe(l))
            for (int64_t e = 0; e < E; ++e) {
              c[static_cast<size_t>(e)] += count[static_cast<size_t>((j * L + l - 1) * E + e)];
              p[static_cast<size_t>(e)] += prob[static_cast<size_t>((j * L + l - 1) * E + e)];
            }
        const double R = static_cast<double>(d.moe_layers * d.N);
        double aux = 0;
        for (int64_t e = 0; e < E; ++e) aux += (c[static_cast<size_t>(e)] / R) * (p[static_cast<size_t>(e)] / R);
        aux_sum += static_cast<double>(E) * aux;
        const double coef = mc.output_router_logits ? mc.router_aux_loss_coef : 0.0;
        for (int64_t e = 0; e < E; ++e)
          agrad[static_cast<size_t>(e)] = coef * static_cast<double>(E) * c[static_cast<size_t>(e)] / (R * R);
      }
      MT_RETURN_IF_ERROR(math.head(run.w[static_cast<size_t>(L + 1)].data() + fn_off, lm, x[static_cast<size_t>(L)].data(),
                                   targets.data(), 1.0 / static_cast<double>(counted), dx.data(),
                                   g[static_cast<size_t>(L + 1)].data() + fn_off, dlm, &loss_sum, &tokens, ws.data()));
      for (int64_t l = L; l >= 1; --l) {
        LayerActsT<double> a = bind_layer_acts(d, acts[static_cast<size_t>(l - 1)].data());
        if (is_moe(l) && mc.output_router_logits && mc.router_aux_loss_coef != 0) a.aux_grad = agrad.data();
        MT_RETURN_IF_ERROR(math.backward(view_unit(units[static_cast<size_t>(l)], run.w[static_cast<size_t>(l)].data()), a,
                                         dx.data(), dx.data(),
                                         grad_unit(units[static_cast<size_t>(l)], g[static_cast<size_t>(l)].data()), ws.data()));
      }
      MT_RETURN_IF_ERROR(math.embed_backward(inputs.data(), dx.data(), g[0].data()));
    }
    if (d.tied) cpu::accumulate<double>(ctx, dtied.data(), d.V * d.H, g[0].data());
    run.losses.push_back(loss_sum / static_cast<double>(tokens));
    if (d.moe) run.aux_losses.push_back(aux_sum / static_cast<double>(A));
    double scale = 1.0;
    if (tc.clip_grad_norm > 0) {
      double sq = 0;
      for (const auto& gu : g)
        for (double e : gu) sq += e * e;
      const double s = tc.clip_grad_norm / (std::sqrt(sq) + 1e-6);
      if (s < 1.0) scale = s;
    }
    const double lr = learning_rate(tc, step);
    for (int64_t u = 0; u < U; ++u) {
      // An expert no token of the step chose has no gradient: torch's AdamW skips it.
      std::vector<char> chosen(static_cast<size_t>(E), 1);
      if (is_moe(u) && u >= 1 && u <= L && !expert_steps[static_cast<size_t>(u)].empty())
        for (int64_t e = 0; e < E; ++e) {
          double c = 0;
          for (int64_t j = 0; j < A; ++j) c += count[static_cast<size_t>((j * L + u - 1) * E + e)];
          chosen[static_cast<size_t>(e)] = c > 0;
        }
      for (const TensorSlot& ts : units[static_cast<size_t>(u)].tensors) {
        const bool per_expert = ts.expert >= 0 && !expert_steps[static_cast<size_t>(u)].empty();
        if (per_expert && !chosen[static_cast<size_t>(ts.expert)]) continue;
        const double t = static_cast<double>(per_expert ? expert_steps[static_cast<size_t>(u)][static_cast<size_t>(ts.expert)] + 1 : step + 1);
        const double bc1 = 1.0 - std::pow(o.beta1, t), bc2 = 1.0 - std::pow(o.beta2, t);
        const double wd = ts.decay ? o.weight_decay : 0.0;
        for (int64_t i = ts.offset; i < ts.offset + ts.numel; ++i) {
          double& p = run.w[static_cast<size_t>(u)][static_cast<size_t>(i)];
          double& mi = m[static_cast<size_t>(u)][static_cast<size_t>(i)];
          double& vi = v[static_cast<size_t>(u)][static_cast<size_t>(i)];
          const double gi = g[static_cast<size_t>(u)][static_cast<size_t>(i)] * scale;
          p *= 1.0 - lr * wd;
          mi = o.beta1 * mi + (1.0 - o.beta1) * gi;
          vi = o.beta2 * vi + (1.0 - o.beta2) * gi * gi;
          p -= lr / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + o.eps);
        }
      }
      for (size_t e = 0; e < expert_steps[static_cast<size_t>(u)].size(); ++e)
        if (chosen[e]) ++expert_steps[static_cast<size_t>(u)][e];
    }
  }
  return run;
}

Status save_float64(const HostState& layout, const Float64Run& run, const fs::path& path) {
  std::vector<TensorToWrite> tensors;
  for (size_t u = 0; u < layout.units().size(); ++u)
    for (const TensorSlot& t : layout.units()[u].tensors)
      tensors.push_back(raw_tensor(t.name, t.shape, run.w[u].data() + t.offset, "F64"));
  return write_safetensors(path, tensors);
}

std::string run_command(const std::string& cmd, int* rc) {
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *rc = -1;
    return "popen failed";
  }
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  *rc = pclose(p);
  return out;
}

// Trains `model_name` on both sides and returns the reference script's command line without the
// mutation argument (the files stay in `dir` until the caller removes it).
// The batch shape: 32 x 2 x 2 by default; a smaller one leaves some experts unchosen in a step.
struct Shape {
  int64_t seq = 32, micro_batch = 2, grad_accum = 2;
  bool masked = false;  // supervised fine-tuning: a prepared dataset whose mask leaves prompts and padding out
};

// Rows of seq + 1 tokens as megatrain-data prepare lays out padded SFT data: a prompt of 3 to 12
// tokens that does not count, an answer that does, then padding that does not (none in every third
// row), for every row the run reads.
std::shared_ptr<const data::SequenceFile> masked_rows(const fs::path& dir, int64_t seq, int64_t rows, int64_t vocab) {
  data::SequenceRows r;
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t prompt = 3 + (k * 5) % 10, end = k % 3 == 0 ? seq + 1 : seq + 1 - (k % 7) - 2;
    for (int64_t t = 0; t <= seq; ++t) {
      r.tokens.push_back(static_cast<uint32_t>(((k * 131 + t) * 2654435761u >> 9) % static_cast<uint64_t>(vocab)));
      r.mask.push_back(t >= prompt && t < end ? 1 : 0);
    }
  }
  data::SequenceHeader h;
  h.seq_len = seq;
  h.vocab_size = vocab;
  h.packing = "pad";
  h.train_on = "answer";
  EXPECT_TRUE(data::write_sequence_file(dir / "sft.mtseq", h, r).ok());
  auto f = data::SequenceFile::open(dir / "sft.mtseq");
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  return std::make_shared<const data::SequenceFile>(std::move(*f));
}

std::string train_ours(const std::string& model_name, double clip, const fs::path& dir, Shape shape = {}) {
  fs::create_directories(dir);
  Json pj = {{"schema", "megatrain.plan/1"}, {"model", model_name}, {"rig", "cpu-dev-2core"},
             {"training", {{"seq_len", shape.seq}, {"micro_batch", shape.micro_batch}, {"grad_accum", shape.grad_accum},
                           {"steps", 10}, {"lr", 2e-3},
                           {"warmup_steps", 2}, {"min_lr", 2e-4}, {"clip_grad_norm", clip}, {"data_order", "sequential"}}},
             {"precision", {{"compute", "fp32"}, {"transfer", "fp32"}}},
             {"schedule", {{"prefetch_depth", 2}, {"device_layer_buffers", 3}, {"checkpoint_every", 1},
                           {"checkpoint_location", "device"}}},
             {"optimizer", {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"threads", 1}}}};
  auto plan = Plan::from_json_text(pj.dump());
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  if (!plan.ok()) return "";
  auto model = plan->resolve_model();
  EXPECT_TRUE(model.ok());
  if (!model.ok()) return "";
  HostState hs = HostState::create(*model, DType::kFp32);
  // MEGATRAIN_REF_SEED draws other initial weights: how the fp32 bound was measured (docs/testing.md).
  const char* seed = std::getenv("MEGATRAIN_REF_SEED");
  EXPECT_TRUE(hs.init_random(seed && *seed ? std::strtoull(seed, nullptr, 10) : 11, 0.02).ok());
  EXPECT_TRUE(save_weights(hs, dir / "init.safetensors").ok());
  // Round trip through our own reader first: --init must reproduce the same state.
  HostState again = HostState::create(*model, DType::kFp32);
  EXPECT_TRUE(load_weights(again, dir / "init.safetensors").ok());
  for (size_t u = 0; u < hs.units().size(); ++u)
    for (int64_t i = 0; i < hs.units()[u].numel; ++i) EXPECT_EQ(hs.units()[u].master[i], again.units()[u].master[i]);

  Result<DataLoader> loader = invalid_argument("no data");
  if (shape.masked) {
    DataLoaderOptions lo;
    lo.seq_len = shape.seq;
    lo.micro_batch = shape.micro_batch;
    lo.grad_accum = shape.grad_accum;
    lo.vocab_size = model->config().vocab_size;
    loader = DataLoader::create(masked_rows(dir, shape.seq, 10 * shape.micro_batch * shape.grad_accum, model->config().vocab_size), lo);
    EXPECT_TRUE(loader.ok()) << loader.status().to_string();
    if (!loader.ok()) return "";
    // The reference reads the very batches (inputs, then targets with -1 where not counted).
    std::ofstream f(dir / "batches.i32", std::ios::binary);
    std::vector<int32_t> in(static_cast<size_t>(shape.micro_batch * shape.seq)), tg(in.size());
    for (int64_t s = 0; s < 10; ++s)
      for (int64_t j = 0; j < shape.grad_accum; ++j) {
        EXPECT_TRUE(loader->fill(s, j, in.data(), tg.data()).ok());
        f.write(reinterpret_cast<const char*>(in.data()), static_cast<std::streamsize>(in.size() * 4));
        f.write(reinterpret_cast<const char*>(tg.data()), static_cast<std::streamsize>(tg.size() * 4));
      }
  } else {
    std::vector<uint32_t> toks;
    for (uint32_t i = 0; i < 2000; ++i) toks.push_back((i * 2654435761u >> 9) % 97 + (i % 7) * 20);
    {
      std::ofstream f(dir / "tokens.u32", std::ios::binary);
      f.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 4));
    }
    auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks));
    loader = DataLoader::create(file, shape.seq, shape.micro_batch, shape.grad_accum, DataOrder::kSequential, 1,
                                model->config().vocab_size);
    EXPECT_TRUE(loader.ok()) << loader.status().to_string();
    if (!loader.ok()) return "";
  }

  // float64: the layer templates in double, from the same initial weights.
  auto f64 = train_float64(*plan, *model, hs, *loader);
  EXPECT_TRUE(f64.ok()) << f64.status().to_string();
  if (!f64.ok()) return "";
  EXPECT_TRUE(save_float64(hs, *f64, dir / "final64.safetensors").ok());

  // fp32: the streamed pipeline, as megatrain-exec runs it.
  auto trainer = Trainer::create(*plan, *model, hs, *loader, TrainerOptions{});
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  if (!trainer.ok()) return "";
  Json ours = {{"losses", Json::array()}, {"losses64", f64->losses}};
  const bool moe = model->config().is_moe();
  if (moe) ours["aux_losses"] = Json::array(), ours["aux_losses64"] = f64->aux_losses, ours["unused_experts"] = Json::array();
  for (int s = 0; s < 10; ++s) {
    auto r = (*trainer)->run_step(s);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return "";
    ours["losses"].push_back(r->loss);
    if (moe) ours["aux_losses"].push_back(r->aux_loss), ours["unused_experts"].push_back(r->unused_experts);
  }
  (*trainer)->wait_for_updates();
  EXPECT_TRUE(save_weights(hs, dir / "final.safetensors").ok());
  std::ofstream(dir / "ours.json") << ours.dump();
  Json spec = pj["training"];
  spec.update(pj["optimizer"]);
  std::ofstream(dir / "spec.json") << spec.dump();
  fs::copy_file(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / (model_name + ".json"), dir / "config.json",
                fs::copy_options::overwrite_existing);
  // tests/data may not exist in a fresh checkout, so the script's path is built, not resolved.
  // Qwen3 and the MoE architectures have their own reference (torch_moe_ref.py).
  const bool own = model->config().is_moe() || model->config().qk_norm;
  const fs::path script =
      fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "python" / (own ? "torch_moe_ref.py" : "torch_train_ref.py");
  return std::string(MEGATRAIN_TEST_PYTHON) + " " + script.string() + " " + dir.string();
}

fs::path scratch_dir(const std::string& name) {
  return fs::temp_directory_path() / ("mt_torch_" + name + "_" + std::to_string(::getpid()));
}

void run_against_torch(const std::string& model_name, double clip, Shape shape = {}) {
  if (!torch_available())
    FAIL() << "PyTorch is missing for " << MEGATRAIN_TEST_PYTHON << " (run scripts/python-env.sh: requirements.txt)";
  const fs::path dir = scratch_dir(model_name);
  const std::string cmd = train_ours(model_name, clip, dir, shape);
  if (cmd.empty()) return;
  int rc = 0;
  const std::string out = run_command(cmd + " 2>&1", &rc);
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0) << out;
  std::printf("%s", out.c_str());
}

TEST(TorchReference, LlamaWithGqaTrainsLikePyTorch) { run_against_torch("tiny-llama-gqa", 0.0); }
// Issue 19: supervised fine-tuning on a prepared dataset, the loss over the counted targets only
// (prompts and padding masked), normalised by their number in the whole step, with clipping.
TEST(TorchReference, SupervisedFineTuningWithMasksTrainsLikePyTorch) {
  run_against_torch("tiny-qwen2", 0.5, Shape{32, 2, 2, true});
}
TEST(TorchReference, Qwen2WithBiasesTiedHeadAndClippingTrainsLikePyTorch) { run_against_torch("tiny-qwen2", 0.5); }
TEST(TorchReference, Qwen3WithQkNormsTrainsLikePyTorch) { run_against_torch("tiny-qwen3", 0.0); }
TEST(TorchReference, Qwen3MoeWithADenseLayerAndTheAuxLossTrainsLikePyTorch) { run_against_torch("tiny-qwen3-moe", 0.5); }
TEST(TorchReference, MixtralTrainsLikePyTorch) { run_against_torch("tiny-mixtral", 0.0); }
// Sinks, a sliding layer (window 16 < seq 32), yarn RoPE, q/k/v/o biases, the biased router and the
// stacked, biased experts with the clamped SwiGLU, and the aux loss in the objective.
TEST(TorchReference, GptOssTrainsLikePyTorch) { run_against_torch("tiny-gpt-oss", 0.5); }
TEST(TorchReference, GptOssWithUnchosenExpertsTrainsLikePyTorch) { run_against_torch("tiny-gpt-oss", 0.0, Shape{4, 1, 1}); }
// 4 tokens a step choose k of 8 experts: most steps leave experts unchosen, which AdamW must skip.
TEST(TorchReference, MixtralWithUnchosenExpertsTrainsLikePyTorch) { run_against_torch("tiny-mixtral", 0.0, Shape{4, 1, 1}); }
TEST(TorchReference, Qwen3MoeWithUnchosenExpertsTrainsLikePyTorch) { run_against_torch("tiny-qwen3-moe", 0.5, Shape{4, 1, 1}); }

// The comparison can fail. Each semantic slip that a port of these models gets wrong
// (torch_train_ref.py documents each) is put in twice: into both PyTorch runs, which the float64
// check must report; and into a PyTorch fp32 run that stands in for our fp32 results, which the
// fp32 check must report (a slip in the streamed pipeline alone, say in the fused AdamW pass, shows
// there as our fp32 run leaving our float64 run far behind). Qwen2 has q/k/v biases, a tied head
// and clipping, so every slip has something to act on. gpt-oss's own semantics (and the router's
// renormalisation) are slipped into the float64 reference, which the float64 check must report.
// Each slip is a test of its own, so that ctest spreads the catalogue over the cores; the
// unmutated runs are Qwen2WithBiasesTiedHeadAndClippingTrainsLikePyTorch and GptOssTrainsLikePyTorch.
struct Slip {
  const char* model;
  const char* slip;
  const char* side;  // "reference" or "fp32" (--slip-in), or "" for the float64 reference alone
};
void PrintTo(const Slip& c, std::ostream* os) { *os << c.model << ": " << c.slip << (*c.side ? std::string(" in ") + c.side : ""); }
std::string slip_name(const testing::TestParamInfo<Slip>& info) {
  return std::string(info.param.slip) + (*info.param.side ? std::string("_in_") + info.param.side : "");
}

// Our side is trained for each slip (a second on these models). The PyTorch runs are cached: in
// the test run's cache (scripts/test.sh), or else in the build folder, so that the unmutated runs
// the slips compare against train once for the whole catalogue (tests/python/ref_cache.py).
void expect_slip_caught(const Slip& c) {
  if (!torch_available())
    FAIL() << "PyTorch is missing for " << MEGATRAIN_TEST_PYTHON << " (run scripts/python-env.sh: requirements.txt)";
  const std::string side = c.side;
  const fs::path dir = scratch_dir(std::string(c.model) + "_slip_" + c.slip + (side.empty() ? "" : "_" + side));
  std::string cmd = train_ours(c.model, 0.5, dir);
  if (cmd.empty()) return;
  const char* set = std::getenv("MEGATRAIN_TORCH_CACHE");
  if (!(set && *set)) cmd = "MEGATRAIN_TORCH_CACHE=" + (fs::path(MEGATRAIN_BINARY_DIR) / "torch-cache-slips").string() + " " + cmd;
  int rc = 0;
  const std::string out = run_command(cmd + " --mutate " + c.slip + (side.empty() ? "" : " --slip-in " + side) + " 2>&1", &rc);
  fs::remove_all(dir);
  EXPECT_NE(out.find("mutation: " + std::string(c.slip)), std::string::npos) << out;
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << "not caught:\n" << out;
  const bool fp32 = side == "fp32";
  const std::string check = fp32 ? "fp32 mismatch: " : "float64 mismatch: ";
  EXPECT_NE(out.find(check), std::string::npos) << "the " << check << "check did not report it:\n" << out;
  // One line for the log: which check caught it, and by how much.
  const size_t worst = out.find(fp32 ? "fp32: PyTorch's error" : "float64: worst");
  std::printf("slip %-18s %-13s: %s\n", c.slip, side.empty() ? "" : ("in " + side).c_str(),
              worst == std::string::npos ? "?" : out.substr(worst, out.find('\n', worst) - worst).c_str());
}

std::vector<Slip> qwen2_slips() {
  std::vector<Slip> v;
  for (const char* slip : {"rope_offset", "rope_interleaved", "rope_theta", "norm_eps", "no_qkv_bias", "attention_scale",
                           "no_bias_correction", "decay_norms", "untied_head_grad"})
    for (const char* side : {"reference", "fp32"}) v.push_back({"tiny-qwen2", slip, side});
  return v;
}
std::vector<Slip> gpt_oss_slips() {
  std::vector<Slip> v;
  for (const char* slip : {"no_sinks", "no_window", "window_off_by_one", "yarn_no_scale", "yarn_no_ramp", "no_clamp",
                           "gate_up_halves", "no_expert_bias", "no_o_bias", "no_renorm", "sinks_no_decay", "aux_on_weights"})
    v.push_back({"tiny-gpt-oss", slip, ""});
  return v;
}

class Qwen2Slip : public testing::TestWithParam<Slip> {};
TEST_P(Qwen2Slip, IsCaught) { expect_slip_caught(GetParam()); }
INSTANTIATE_TEST_SUITE_P(TorchReference, Qwen2Slip, testing::ValuesIn(qwen2_slips()), slip_name);

class GptOssSlip : public testing::TestWithParam<Slip> {};
TEST_P(GptOssSlip, IsCaught) { expect_slip_caught(GetParam()); }
INSTANTIATE_TEST_SUITE_P(TorchReference, GptOssSlip, testing::ValuesIn(gpt_oss_slips()), slip_name);

}  // namespace
}  // namespace megatrain::exec

// The attention probe (detail/attention_probe.h).
#include "detail/attention_probe.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>

#include "detail/profile_probes.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/host_state.h"
#include "megatrain/executor/model.h"
#include "megatrain/kernels/cpu/add.h"
#include "megatrain/kernels/cpu/context.h"
#include "megatrain/kernels/cpu/rmsnorm.h"
#include "megatrain/kernels/cpu/rope.h"
#include "megatrain/kernels/cpu/swiglu.h"

namespace megatrain::planner::detail {
namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float, FreeDeleter>;

Buffer make_buffer(int64_t n, float scale) {
  const size_t bytes = ((static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64) * 64;
  Buffer b(static_cast<float*>(std::aligned_alloc(64, bytes)));
  for (int64_t i = 0; i < n; ++i) b.get()[i] = scale * static_cast<float>((i * 37) % 101 - 50);
  return b;
}

}  // namespace

std::vector<cpu::AttentionShape> attention_shapes(const ModelConfig* model, int64_t seq, bool quick,
                                                  int64_t max_probs_bytes) {
  std::vector<cpu::AttentionShape> out;
  auto add = [&](int64_t b, int64_t s, int64_t nh, int64_t nkv, int64_t hd) {
    cpu::AttentionShape a{b, s, nh, nkv, hd};
    if (4 * cpu::attention_probs_elems(a) <= max_probs_bytes) out.push_back(a);
  };
  if (model != nullptr) {
    const int64_t s = seq > 0 ? seq : std::min<int64_t>(model->max_position_embeddings, 2048);
    for (int64_t b : {1, 2, 4, 8}) add(b, s, model->num_heads, model->num_kv_heads, model->head_dim);
    return out;
  }
  const std::vector<int64_t> seqs = quick ? std::vector<int64_t>{128, 512, 1024} : std::vector<int64_t>{128, 256, 512, 1024, 2048};
  for (int64_t s : seqs) add(1, s, 8, 4, 64);
  add(1, 1024, 8, 8, 128);
  if (!quick) add(1, 512, 16, 4, 32);
  return out;
}

Result<std::vector<AttentionSample>> measure_attention(const std::vector<cpu::AttentionShape>& shapes, int threads,
                                                       double min_time_s,
                                                       const std::function<void(const std::string&)>& progress) {
  cpu::CpuContext ctx(threads);
  std::vector<AttentionSample> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const cpu::AttentionShape& s = shapes[i];
    MT_RETURN_IF_ERROR(cpu::check_attention_shape(s));
    if (progress)
      progress("attention " + std::to_string(i + 1) + "/" + std::to_string(shapes.size()) + ": batch " +
               std::to_string(s.batch) + ", seq " + std::to_string(s.seq) + ", heads " + std::to_string(s.n_heads) + "/" +
               std::to_string(s.n_kv_heads) + " x " + std::to_string(s.head_dim));
    const int64_t nq = s.batch * s.seq * s.n_heads * s.head_dim, nk = s.batch * s.seq * s.n_kv_heads * s.head_dim;
    const int64_t np = cpu::attention_probs_elems(s);
    Buffer q = make_buffer(nq, 1e-2f), k = make_buffer(nk, 1e-2f), v = make_buffer(nk, 1e-2f);
    Buffer o = make_buffer(nq, 0), probs = make_buffer(np, 0), dout = make_buffer(nq, 1e-3f);
    Buffer dq = make_buffer(nq, 0), dk = make_buffer(nk, 0), dv = make_buffer(nk, 0), ws = make_buffer(np, 0);
    Status st;
    AttentionSample a;
    a.shape = s;
    a.forward_s = best_per_call(
        [&] {
          if (st.ok()) st = cpu::attention_forward<float>(ctx, s, q.get(), k.get(), v.get(), o.get(), probs.get());
        },
        min_time_s);
    a.backward_s = best_per_call(
        [&] {
          if (st.ok())
            st = cpu::attention_backward<float>(ctx, s, q.get(), k.get(), v.get(), probs.get(), dout.get(), dq.get(), dk.get(),
                                                dv.get(), ws.get());
        },
        min_time_s);
    MT_RETURN_IF_ERROR(st);
    out.push_back(a);
  }
  return out;
}

Result<AttentionFit> fit_attention(const std::vector<AttentionSample>& samples, double peak_flops_per_s) {
  if (samples.empty()) return invalid_argument("attention fit: no samples; accepted: at least one timed shape");
  if (!(peak_flops_per_s > 0)) return invalid_argument("attention fit: the GEMM peak must be > 0");
  std::map<double, std::pair<double, int>> by_flops;  // FLOPs -> (sum of efficiencies, count)
  std::vector<double> ratios;
  for (const AttentionSample& s : samples) {
    if (!(s.forward_s > 0) || !(s.backward_s > 0))
      return invalid_argument("attention fit: a sample has a non-positive time; accepted: forward_s, backward_s > 0");
    auto& e = by_flops[s.flops()];
    e.first += s.flops() / s.forward_s / peak_flops_per_s;
    e.second += 1;
    ratios.push_back(s.backward_s / s.forward_s);
  }
  AttentionFit fit;
  for (const auto& [x, e] : by_flops) fit.points.emplace_back(x, std::clamp(e.first / e.second, 1e-6, 1.0));
  std::sort(ratios.begin(), ratios.end());
  const size_t n = ratios.size();
  fit.backward_ratio = n % 2 ? ratios[n / 2] : 0.5 * (ratios[n / 2 - 1] + ratios[n / 2]);
  fit.ratio_min = ratios.front();
  fit.ratio_max = ratios.back();
  return fit;
}

Result<ElementwiseSample> measure_elementwise(int64_t tokens, int64_t hidden, int64_t n_heads, int64_t n_kv_heads,
                                              int64_t head_dim, int64_t intermediate, int threads, double min_time_s) {
  if (tokens <= 0 || hidden <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || head_dim % 2 || intermediate <= 0)
    return invalid_argument("element-wise probe: every size must be positive and head_dim even");
  cpu::CpuContext ctx(threads);
  const int64_t N = tokens, H = hidden, q = n_heads * head_dim, kv = n_kv_heads * head_dim, I = intermediate;
  cpu::RopeConfig rc;
  rc.head_dim = head_dim;
  MT_ASSIGN_OR_RETURN(std::vector<float> inv_freq, cpu::rope_inv_freq<float>(rc));
  std::vector<int32_t> pos(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % 4096);
  Buffer x = make_buffer(N * H, 1e-2f), xn = make_buffer(N * H, 0), h = make_buffer(N * H, 1e-2f), rstd = make_buffer(N, 0);
  Buffer w = make_buffer(H, 1e-2f), dw = make_buffer(H, 0), tmp = make_buffer(N * H, 0), dx = make_buffer(N * H, 1e-3f);
  Buffer qb = make_buffer(N * q, 1e-2f), kb = make_buffer(N * kv, 1e-2f);
  Buffer gate = make_buffer(N * I, 1e-2f), up = make_buffer(N * I, 1e-2f), act = make_buffer(N * I, 0);
  Buffer dgate = make_buffer(N * I, 0), dup = make_buffer(N * I, 0);
  ElementwiseSample e{N, H, q, kv, I, 0, 0};
  // The forward's element-wise ops, in the order LayerMath::forward runs them.
  e.forward_s = best_per_call(
      [&] {
        cpu::rmsnorm_forward<float>(ctx, x.get(), w.get(), N, H, 1e-5, xn.get(), rstd.get());
        cpu::rope_forward<float>(ctx, qb.get(), qb.get(), pos.data(), N, n_heads, head_dim, inv_freq.data());
        cpu::rope_forward<float>(ctx, kb.get(), kb.get(), pos.data(), N, n_kv_heads, head_dim, inv_freq.data());
        cpu::add<float>(ctx, x.get(), h.get(), N * H, h.get());
        cpu::rmsnorm_forward<float>(ctx, h.get(), w.get(), N, H, 1e-5, xn.get(), rstd.get());
        cpu::swiglu_forward<float>(ctx, gate.get(), up.get(), N * I, act.get());
        cpu::add<float>(ctx, h.get(), tmp.get(), N * H, tmp.get());
      },
      min_time_s);
  // The backward's, in LayerMath::backward's order.
  e.backward_s = best_per_call(
      [&] {
        cpu::swiglu_backward<float>(ctx, gate.get(), up.get(), act.get(), N * I, dgate.get(), dup.get());
        cpu::rmsnorm_backward<float>(ctx, dx.get(), h.get(), w.get(), rstd.get(), N, H, tmp.get(), dw.get());
        cpu::add<float>(ctx, dx.get(), tmp.get(), N * H, xn.get());
        cpu::rope_backward<float>(ctx, qb.get(), qb.get(), pos.data(), N, n_heads, head_dim, inv_freq.data());
        cpu::rope_backward<float>(ctx, kb.get(), kb.get(), pos.data(), N, n_kv_heads, head_dim, inv_freq.data());
        cpu::rmsnorm_backward<float>(ctx, xn.get(), x.get(), w.get(), rstd.get(), N, H, tmp.get(), dw.get());
        cpu::add<float>(ctx, xn.get(), tmp.get(), N * H, dx.get());
      },
      min_time_s);
  return e;
}

Result<std::vector<LayerSample>> measure_layer(const ModelSpec& model, int64_t seq, const std::vector<int64_t>& micro_batches,
                                               int threads, double min_time_s, int64_t max_params) {
  if (model.parameter_counts().total > max_params)
    return resource_exhausted("layer probe: " + model.name() + " has " + std::to_string(model.parameter_counts().total) +
                              " parameters; the probe builds the whole RAM tier and accepts up to " +
                              std::to_string(max_params));
  if (model.config().num_layers < 1) return invalid_argument("layer probe: the model has no decoder layer");
  exec::HostState hs = exec::HostState::create(model, DType::kFp32);
  (void)hs.init_random(1, 0.02);  // RAM only: cannot fail
  const exec::UnitState& unit = hs.units()[1];
  std::vector<LayerSample> out;
  for (int64_t mb : micro_batches) {
    MT_ASSIGN_OR_RETURN(exec::Dims d, exec::make_dims(model, mb, seq));
    exec::BackendOptions bo;
    bo.threads = threads;
    MT_ASSIGN_OR_RETURN(std::unique_ptr<exec::Backend> be, exec::make_cpu_backend(model, d, bo));
    const int64_t NH = d.N * d.H;
    // As in the pipeline, each call finds its weights, activations and hidden states in other
    // buffers than the call before, and the sets rotate as the pipeline's few device layer buffers
    // do (prefetch depth + 1, 2 to 4): 4 sets. A layer whose 4 sets fit in the last-level cache
    // then runs from it, as a small model's layers do in training (tiny-mixtral: 8 MB; a probe
    // through 64 MiB of sets timed its layer 15% slower than its training steps ran it), and a
    // larger one from memory.
    struct Set {
      Buffer w, x, y, dout, dx, acts, grads;
    };
    const int64_t n_sets = 4;
    std::vector<Set> sets;
    for (int64_t k = 0; k < n_sets; ++k) {
      Set st{make_buffer(unit.numel, 0), make_buffer(NH, 1e-2f), make_buffer(NH, 0), make_buffer(NH, 1e-4f),
             make_buffer(NH, 0),         make_buffer(be->layer_act_floats(), 0), make_buffer(unit.numel, 0)};
      std::copy(unit.master.data(), unit.master.data() + unit.numel, st.w.get());
      sets.push_back(std::move(st));
    }
    Buffer ws = make_buffer(be->layer_workspace_floats(), 0);
    Status status;
    LayerSample s;
    s.micro_batch = mb;
    size_t next = 0;
    s.forward_s = median_per_call(
        [&] {
          Set& st = sets[next++ % sets.size()];
          if (status.ok())
            status = be->layer_forward(exec::view_unit(unit, st.w.get()), st.x.get(), st.y.get(),
                                       exec::bind_layer_acts(d, st.acts.get()));
        },
        min_time_s);
    // Every set's activations now hold a forward's; backward reads them, rotating the same way.
    for (Set& st : sets)
      if (status.ok())
        status = be->layer_forward(exec::view_unit(unit, st.w.get()), st.x.get(), st.y.get(), exec::bind_layer_acts(d, st.acts.get()));
    next = 0;
    s.backward_s = median_per_call(
        [&] {
          Set& st = sets[next++ % sets.size()];
          if (status.ok())
            status = be->layer_backward(exec::view_unit(unit, st.w.get()), exec::bind_layer_acts(d, st.acts.get()),
                                        st.dout.get(), st.dx.get(), exec::grad_unit(unit, st.grads.get()), ws.get());
        },
        min_time_s);
    MT_RETURN_IF_ERROR(status);
    // The head as the trainer runs it once per micro-batch: every target counted.
    {
      const exec::UnitState& hu = hs.units().back();
      const float* fn = hu.master.data() + hu.find(TensorRole::kFinalNorm)->offset;
      const float* lm = d.tied ? hs.units().front().master.data() : hu.master.data() + hu.find(TensorRole::kHead)->offset;
      std::vector<int32_t> targets(static_cast<size_t>(d.N));
      for (int64_t i = 0; i < d.N; ++i) targets[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % d.V);
      Buffer x = make_buffer(NH, 1e-2f), dx = make_buffer(NH, 0), dfn = make_buffer(d.H, 0), dlm = make_buffer(d.V * d.H, 0),
             hws = make_buffer(be->head_workspace_floats(), 0);
      double loss = 0;
      int64_t count = 0;
      s.head_s = median_per_call(
          [&] {
            if (status.ok())
              status = be->head(fn, lm, x.get(), targets.data(), 1.0f / static_cast<float>(d.N), dx.get(), dfn.get(), dlm.get(),
                                &loss, &count, hws.get());
          },
          // A head over a large vocabulary takes tens of milliseconds: at least 0.2 s, so that the
          // median batch is one of several calls.
          std::max(min_time_s * 5, 0.2));
      MT_RETURN_IF_ERROR(status);
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace megatrain::planner::detail

// The streamed layer-major pipeline on the CPU backend and the plain in-memory reference loop.
//
// Streams of the CPU backend are threads: the caller's thread is the compute stream; an H2D
// thread copies units from the RAM tier into device buffer slots (the arena), at most
// prefetch_depth units ahead of the unit being computed; a D2H thread copies each unit's
// accumulated gradient back; an optimizer thread runs AdamW per unit as soon as its gradient is
// final (without clipping) or after the global norm (with clipping). The next step's copy of a
// unit waits for that unit's update, so updates are exact, never stale.
#include "megatrain/executor/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "megatrain/core/units.h"
#include "megatrain/executor/model.h"
#include "megatrain/executor/optimizer.h"
#include "megatrain/kernels/cpu/ops.h"

namespace megatrain::exec {
namespace {

using Clock = std::chrono::steady_clock;

// One in-order queue served by its own thread: the CPU backend's notion of a stream.
class Stream {
 public:
  Stream() : thread_([this] { loop(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(m_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
  void synchronize() {
    std::unique_lock<std::mutex> l(m_);
    idle_cv_.wait(l, [&] { return jobs_.empty() && !busy_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    while (true) {
      cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty() && stop_) return;
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      l.unlock();
      job();
      l.lock();
      busy_ = false;
      idle_cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false, busy_ = false;
  std::thread thread_;
};

struct Span {
  int lane;
  std::string name, kind;
  int64_t step, layer, mb, start_ns, end_ns, bytes;
  double flops;
};

enum Lane { kLaneCompute, kLaneH2D, kLaneD2H, kLaneOptimizer, kLaneCount };

}  // namespace

struct Trainer::Impl {
  Plan plan;
  const ModelSpec* model = nullptr;
  HostState* state = nullptr;
  const DataLoader* data = nullptr;
  TrainerOptions opt;
  Dims d;
  DeviceBudget budget;
  std::unique_ptr<cpu::CpuContext> ctx;
  std::unique_ptr<LayerMath> math;
  int64_t L = 0, U = 0, A = 0, K = 1, B = 2, c = 1;
  bool clip = false;

  // The device arena: one allocation of the plan's budget, carved at startup.
  AlignedArray<float> arena;
  std::vector<float*> slots;           // B weight buffers of the largest unit
  std::vector<float*> hid[2];          // A hidden states, ping-pong
  std::vector<float*> dhid;            // A gradients of the hidden state
  std::vector<std::vector<float*>> ckpt;  // [checkpoint index][mb] layer inputs kept on the device
  bool host_ckpt = false;              // checkpoints live in host memory (D2H, then H2D back)
  AlignedArray<float> host_ckpt_store; // [checkpoint index][mb] in RAM
  std::vector<float*> acts;            // activations: c layers (recompute) or L*A (keep all)
  std::vector<float*> grad_bufs;       // per-unit gradient accumulators (c + 1 layers in flight)
  float* embed_grad = nullptr;         // embedding gradient accumulator
  float* head_grad = nullptr;          // head (final norm + untied lm_head) accumulator
  float* tied_grad = nullptr;          // the head's share of a tied table
  float* ws = nullptr;                 // layer backward / head workspace
  float* x_scratch = nullptr;          // forward output of the last layer per micro-batch
  std::vector<std::vector<int32_t>> inputs, targets;
  std::vector<float> reference_x;      // the in-memory loop's working buffers
  // The in-memory loop's weights as the device would see them (the bf16 copy expanded), one array
  // per unit, allocated once so that each step only refills them.
  std::vector<std::vector<float>> reference_w;

  // Pipeline state, guarded by mu.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> free_slots;
  std::vector<int64_t> updated_step;   // last step whose update of unit u has finished
  std::vector<char> grad_buf_free;
  bool aborting = false;  // an error mid-step: queued jobs give up instead of waiting forever
  std::unique_ptr<Stream> h2d, d2h, optim;

  // Trace.
  std::mutex trace_mu;
  std::vector<Span> spans;
  std::vector<TraceStep> steps;
  Clock::time_point t0 = Clock::now();

  int64_t ns(Clock::time_point t) const { return std::chrono::duration_cast<std::chrono::nanoseconds>(t - t0).count(); }
  void record(int lane, std::string name, const char* kind, int64_t step, int64_t layer, int64_t mb, Clock::time_point a,
              Clock::time_point b, int64_t bytes = 0, double flops = 0) {
    if (!opt.record_trace) return;
    std::lock_guard<std::mutex> g(trace_mu);
    spans.push_back(Span{lane, std::move(name), kind, step, layer, mb, ns(a), ns(b), bytes, flops});
  }
  // Copies unit u from the RAM tier into slot s (H2D). bf16 is expanded to fp32 on arrival.
  void copy_in(int64_t u, float* dst) {
    UnitState& us = state->units()[static_cast<size_t>(u)];
    if (state->transfer() == DType::kBf16) {
      for (int64_t i = 0; i < us.numel; ++i) dst[i] = bf16_to_fp32(us.stream_bf16[i]);
    } else {
      std::memcpy(dst, us.master.data(), sizeof(float) * static_cast<size_t>(us.numel));
    }
  }
};

namespace {

int64_t floats_to_bytes(int64_t n) { return n * static_cast<int64_t>(sizeof(float)); }

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::create(const Plan& plan, const ModelSpec& model, HostState& state,
                                                 const DataLoader& data, const TrainerOptions& options) {
  auto impl = std::make_unique<Impl>();
  Impl& I = *impl;
  I.plan = plan;
  I.model = &model;
  I.state = &state;
  I.data = &data;
  I.opt = options;
  MT_ASSIGN_OR_RETURN(I.d, make_dims(model, plan.training.micro_batch, plan.training.seq_len));
  if (plan.precision.compute != DType::kFp32)
    return unsupported("precision.compute: the CPU backend computes in fp32; accepted: fp32 (bf16 compute is the CUDA backend's)");
  if (plan.placement.master_weights != "ram" || plan.placement.optimizer_states != "ram")
    return unsupported("placement: the CPU executor keeps all state in RAM so far; accepted: ram for master_weights and optimizer_states");
  if (plan.optimizer.m_format != StateFormat::kFp32 || plan.optimizer.v_format != StateFormat::kFp32)
    return unsupported("optimizer.m_format/v_format: the CPU executor keeps fp32 moments so far; accepted: fp32");
  I.L = I.d.L;
  I.U = I.L + 2;
  I.A = plan.training.grad_accum;
  I.K = plan.schedule.prefetch_depth;
  I.B = plan.schedule.device_layer_buffers;
  I.c = plan.schedule.checkpoint_every;
  I.clip = plan.training.clip_grad_norm > 0;
  I.host_ckpt = plan.schedule.checkpoint_location == "host" && I.c > 0;
  I.ctx = std::make_unique<cpu::CpuContext>(options.threads);
  const ModelConfig& mc = model.config();
  cpu::RopeConfig rc;
  rc.head_dim = mc.head_dim;
  rc.theta = mc.rope_theta;
  MT_ASSIGN_OR_RETURN(rc.scaling, cpu::parse_rope_scaling_type(mc.rope_scaling_type));
  rc.factor = mc.rope_scaling_factor;
  rc.low_freq_factor = mc.rope_low_freq_factor;
  rc.high_freq_factor = mc.rope_high_freq_factor;
  rc.original_max_position_embeddings = mc.rope_original_max_position;
  // The CPU attention is full causal; a sliding window changes nothing while the sequence fits it.
  if (mc.sliding_window > 0 && plan.training.seq_len > mc.sliding_window)
    return unsupported("training.seq_len " + std::to_string(plan.training.seq_len) + " exceeds the model's sliding_window " +
                       std::to_string(mc.sliding_window) + ", and the CPU attention has no window; accepted: seq_len <= " +
                       std::to_string(mc.sliding_window));
  MT_ASSIGN_OR_RETURN(std::vector<float> inv_freq, cpu::rope_inv_freq<float>(rc));
  I.math = std::make_unique<LayerMath>(*I.ctx, I.d, std::move(inv_freq));

  const Dims& d = I.d;
  const int64_t NH = d.N * d.H;
  int64_t max_unit = 0, max_layer = 0;
  for (int64_t u = 0; u < I.U; ++u) max_unit = std::max(max_unit, state.units()[static_cast<size_t>(u)].numel);
  max_layer = I.L > 0 ? state.units()[1].numel : 0;
  const int64_t n_ckpt = I.c > 0 ? (I.L + I.c - 1) / I.c : 0;
  const int64_t A_dev = plan.schedule.order == "layer-major" ? I.A : 1;  // micro-batches on the device at once
  const int64_t act_sets = I.c > 0 ? I.c : I.L * A_dev;
  const int64_t grad_sets = (I.c > 0 ? I.c : 1) + 1;
  const int64_t ws_floats = std::max(layer_workspace_floats(d), head_workspace_floats(d));
  DeviceBudget& b = I.budget;
  if (options.streamed) {
    if (I.c > 0 && I.B < I.c + 1)
      return resource_exhausted("schedule.device_layer_buffers " + std::to_string(I.B) + " cannot hold the " +
                                std::to_string(I.c) + " layers a checkpoint block recomputes plus one in flight; accepted: >= " +
                                std::to_string(I.c + 1));
    b.slots = floats_to_bytes(I.B * max_unit);
    b.hidden = floats_to_bytes(3 * A_dev * NH);
    b.checkpoints = I.host_ckpt ? 0 : floats_to_bytes(n_ckpt * A_dev * NH);
    b.activations = floats_to_bytes(act_sets * layer_act_floats(d));
    b.gradients = floats_to_bytes(grad_sets * max_layer + state.units()[0].numel +
                                  state.units()[static_cast<size_t>(I.L + 1)].numel + (d.tied ? d.V * d.H : 0));
    b.workspace = floats_to_bytes(ws_floats + NH);
    const int64_t budget = plan.placement.device_budget_bytes;
    if (budget > 0 && b.total() > budget)
      return resource_exhausted(
          "placement.device_budget_bytes " + format_bytes(static_cast<double>(budget)) + " (" + std::to_string(budget) +
          " bytes) cannot hold the pipeline's buffers: needs " + std::to_string(b.total()) + " bytes (" +
          format_bytes(static_cast<double>(b.total())) + ": layer buffers " + format_bytes(static_cast<double>(b.slots)) +
          ", hidden states " + format_bytes(static_cast<double>(b.hidden)) + ", checkpoints " +
          format_bytes(static_cast<double>(b.checkpoints)) + ", activations " + format_bytes(static_cast<double>(b.activations)) +
          ", gradients " + format_bytes(static_cast<double>(b.gradients)) + ", workspace " +
          format_bytes(static_cast<double>(b.workspace)) + ")");
    I.arena.resize(b.total() / static_cast<int64_t>(sizeof(float)));
    float* p = I.arena.data();
    auto take = [&](int64_t n) {
      float* r = p;
      p += n;
      return r;
    };
    for (int64_t s = 0; s < I.B; ++s) I.slots.push_back(take(max_unit));
    for (int k = 0; k < 2; ++k)
      for (int64_t j = 0; j < A_dev; ++j) I.hid[k].push_back(take(NH));
    for (int64_t j = 0; j < A_dev; ++j) I.dhid.push_back(take(NH));
    I.ckpt.resize(static_cast<size_t>(n_ckpt));
    if (I.host_ckpt) {
      I.host_ckpt_store.resize(n_ckpt * A_dev * NH);
      for (int64_t k = 0; k < n_ckpt; ++k)
        for (int64_t j = 0; j < A_dev; ++j) I.ckpt[static_cast<size_t>(k)].push_back(I.host_ckpt_store.data() + (k * A_dev + j) * NH);
    } else {
      for (auto& v : I.ckpt)
        for (int64_t j = 0; j < A_dev; ++j) v.push_back(take(NH));
    }
    for (int64_t k = 0; k < act_sets; ++k) I.acts.push_back(take(layer_act_floats(d)));
    for (int64_t k = 0; k < grad_sets; ++k) I.grad_bufs.push_back(take(max_layer));
    I.embed_grad = take(state.units()[0].numel);
    I.head_grad = take(state.units()[static_cast<size_t>(I.L + 1)].numel);
    if (d.tied) I.tied_grad = take(d.V * d.H);
    I.ws = take(ws_floats);
    I.x_scratch = take(NH);
    for (int64_t s = 0; s < I.B; ++s) I.free_slots.push_back(static_cast<int>(s));
    I.grad_buf_free.assign(static_cast<size_t>(grad_sets), 1);
    I.h2d = std::make_unique<Stream>();
    I.d2h = std::make_unique<Stream>();
    I.optim = std::make_unique<Stream>();
  } else {
    // The in-memory loop keeps every activation of every micro-batch; it is the reference, not a
    // way to train big models.
    I.reference_x.resize(static_cast<size_t>(I.A * (I.L + 1) * NH + I.A * I.L * layer_act_floats(d) + ws_floats + 2 * NH));
    if (d.tied) I.reference_x.resize(I.reference_x.size() + static_cast<size_t>(d.V * d.H));
    I.reference_w.resize(static_cast<size_t>(I.U));
    for (int64_t u = 0; u < I.U; ++u)
      I.reference_w[static_cast<size_t>(u)].resize(static_cast<size_t>(state.units()[static_cast<size_t>(u)].numel));
  }
  I.updated_step.assign(static_cast<size_t>(I.U), -1);
  I.inputs.assign(static_cast<size_t>(I.A), std::vector<int32_t>(static_cast<size_t>(d.N)));
  I.targets.assign(static_cast<size_t>(I.A), std::vector<int32_t>(static_cast<size_t>(d.N)));
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;
const DeviceBudget& Trainer::budget() const { return impl_->budget; }

namespace {

// AdamW for one unit, tensor by tensor (weight decay only on matrices and the embedding).
void update_unit(Trainer::Impl& I, int64_t u, int64_t step, float grad_scale) {
  UnitState& us = I.state->units()[static_cast<size_t>(u)];
  const OptimizerConfig& o = I.plan.optimizer;
  const double lr = learning_rate(I.plan.training, step);
  const int threads = o.threads > 0 ? static_cast<int>(o.threads) : 1;
  for (const TensorSlot& t : us.tensors) {
    AdamWStep s{lr, o.beta1, o.beta2, o.eps, t.decay ? o.weight_decay : 0.0, step + 1, grad_scale};
    adamw_update(us.master.data() + t.offset, us.grad.data() + t.offset, us.m.data() + t.offset, us.v.data() + t.offset,
                 t.numel, s, nullptr, I.state->transfer() == DType::kBf16 ? us.stream_bf16.data() + t.offset : nullptr,
                 threads);
  }
}

// torch.nn.utils.clip_grad_norm_: scale = max_norm / (norm + 1e-6), applied only when below 1.
float clip_scale(const Trainer::Impl& I, double norm) {
  if (!I.clip) return 1.0f;
  const double s = I.plan.training.clip_grad_norm / (norm + 1e-6);
  return s < 1.0 ? static_cast<float>(s) : 1.0f;
}

double global_norm(Trainer::Impl& I) {
  double total = 0;
  for (int64_t u = 0; u < I.U; ++u) {
    UnitState& us = I.state->units()[static_cast<size_t>(u)];
    total += sum_of_squares(us.grad.data(), us.numel);
  }
  return std::sqrt(total);
}

}  // namespace

Result<StepResult> Trainer::run_step(int64_t step) {
  Impl& I = *impl_;
  const Dims& d = I.d;
  const int64_t NH = d.N * d.H;
  const auto step_start = Clock::now();
  StepResult res;
  res.step = step;
  {
    // A step returns only once all its updates are done, so every unit is up to date for `step`
    // whatever ran before: a fresh Trainer may start at any step (a resumed run).
    std::lock_guard<std::mutex> g(I.mu);
    for (int64_t& u : I.updated_step) u = std::max(u, step - 1);
  }
  for (int64_t j = 0; j < I.A; ++j)
    MT_RETURN_IF_ERROR(I.data->fill(step, j, I.inputs[static_cast<size_t>(j)].data(), I.targets[static_cast<size_t>(j)].data()));
  const float grad_scale = 1.0f / static_cast<float>(d.N * I.A);
  double loss_sum = 0;
  int64_t count = 0;
  auto units = [&](int64_t u) -> UnitState& { return I.state->units()[static_cast<size_t>(u)]; };

  if (!I.opt.streamed) {
    // ---- the plain in-memory loop -------------------------------------------------------------
    float* p = I.reference_x.data();
    std::vector<float*> xs;  // [mb][layer 0..L] hidden states
    for (int64_t k = 0; k < I.A * (I.L + 1); ++k, p += NH) xs.push_back(p);
    std::vector<float*> act_buf;
    for (int64_t k = 0; k < I.A * I.L; ++k, p += layer_act_floats(d)) act_buf.push_back(p);
    float* ws = p;
    p += std::max(layer_workspace_floats(d), head_workspace_floats(d));
    float* dx = p;
    p += NH;
    float* tied = d.tied ? p + NH : nullptr;
    // Weights as the device would see them (the bf16 copy expanded), then fresh gradients.
    std::vector<std::vector<float>>& w = I.reference_w;
    for (int64_t u = 0; u < I.U; ++u) {
      I.copy_in(u, w[static_cast<size_t>(u)].data());
      std::fill(units(u).grad.data(), units(u).grad.data() + units(u).numel, 0.0f);
    }
    if (tied) std::fill(tied, tied + d.V * d.H, 0.0f);
    const UnitState& head_u = units(I.L + 1);
    const float* lm = d.tied ? w[0].data() : w[static_cast<size_t>(I.L + 1)].data() + head_u.find(TensorRole::kHead)->offset;
    float* dlm = d.tied ? tied : units(I.L + 1).grad.data() + head_u.find(TensorRole::kHead)->offset;
    for (int64_t j = 0; j < I.A; ++j) {
      float** x = &xs[static_cast<size_t>(j * (I.L + 1))];
      MT_RETURN_IF_ERROR(I.math->embed(w[0].data(), I.inputs[static_cast<size_t>(j)].data(), x[0]));
      for (int64_t l = 1; l <= I.L; ++l) {
        const LayerActs a = bind_layer_acts(d, act_buf[static_cast<size_t>(j * I.L + l - 1)]);
        MT_RETURN_IF_ERROR(I.math->forward(view_unit(units(l), w[static_cast<size_t>(l)].data()), x[l - 1], x[l], a));
      }
      const float* fn = w[static_cast<size_t>(I.L + 1)].data() + head_u.find(TensorRole::kFinalNorm)->offset;
      float* dfn = units(I.L + 1).grad.data() + head_u.find(TensorRole::kFinalNorm)->offset;
      MT_RETURN_IF_ERROR(I.math->head(fn, lm, x[I.L], I.targets[static_cast<size_t>(j)].data(), grad_scale, dx, dfn, dlm,
                                      &loss_sum, &count, ws));
      for (int64_t l = I.L; l >= 1; --l) {
        const LayerActs a = bind_layer_acts(d, act_buf[static_cast<size_t>(j * I.L + l - 1)]);
        MT_RETURN_IF_ERROR(I.math->backward(view_unit(units(l), w[static_cast<size_t>(l)].data()), a, dx, dx,
                                            grad_unit(units(l), units(l).grad.data()), ws));
      }
      MT_RETURN_IF_ERROR(I.math->embed_backward(I.inputs[static_cast<size_t>(j)].data(), dx, units(0).grad.data()));
    }
    if (tied) cpu::accumulate<float>(*I.ctx, tied, d.V * d.H, units(0).grad.data());
    if (I.clip) res.grad_norm = global_norm(I);
    const float scale = clip_scale(I, res.grad_norm);
    for (int64_t u = 0; u < I.U; ++u) update_unit(I, u, step, scale);
    res.loss = loss_sum / static_cast<double>(count);
    res.tokens = count;
    res.time_s = std::chrono::duration<double>(Clock::now() - step_start).count();
    return res;
  }

  // ---- the streamed pipeline -----------------------------------------------------------------------
  // layer-major: one round with every micro-batch, weights cross the link twice per step.
  // microbatch-major: one round per micro-batch, weights cross twice per micro-batch, gradients are
  // summed on the host, and the updates wait for the last round.
  const bool layer_major = I.plan.schedule.order == "layer-major";
  double stall = 0;
  if (!layer_major)
    for (int64_t u = 0; u < I.U; ++u) std::fill(units(u).grad.data(), units(u).grad.data() + units(u).numel, 0.0f);
  const int64_t rounds = layer_major ? 1 : I.A;
  for (int64_t round = 0; round < rounds; ++round) {
  const int64_t AR = layer_major ? I.A : 1;   // micro-batches in this round
  const int64_t j0 = layer_major ? 0 : round;  // the round's first micro-batch of the step
  const bool last_round = round == rounds - 1;
  // Loads of this step in issue order: the forward pass streams every unit (and the shared table
  // again for a tied head); the backward pass streams the layers block by block from the last.
  struct Load {
    int64_t unit;
    int slot = -1;
    bool ready = false;
  };
  std::vector<Load> loads;
  for (int64_t u = 0; u < I.U; ++u) loads.push_back({u});
  if (d.tied) loads.push_back({0});
  const size_t backward_first = loads.size();
  std::vector<std::pair<int64_t, int64_t>> blocks;
  const int64_t cb = I.c > 0 ? I.c : 1;
  for (int64_t lo = 1; lo <= I.L; lo += cb) blocks.push_back({lo, std::min(I.L, lo + cb - 1)});
  std::reverse(blocks.begin(), blocks.end());
  for (auto [lo, hi] : blocks) {
    if (I.c > 0)
      for (int64_t l = lo; l <= hi; ++l) loads.push_back({l});
    else
      for (int64_t l = hi; l >= lo; --l) loads.push_back({l});
  }
  int64_t compute_at = -1;  // index of the load the compute stream has begun
  // Host checkpoints: copied out during forward (D2H), restored into hid[0][mb] during backward
  // (H2D, queued after each block's weights, as the executor issues them).
  const int64_t n_ck = static_cast<int64_t>(I.ckpt.size());
  std::vector<char> ckpt_copied(static_cast<size_t>(std::max<int64_t>(1, n_ck * AR)), 0);
  std::vector<char> restored(static_cast<size_t>(blocks.size() * static_cast<size_t>(AR)), 0);
  std::vector<int64_t> consumed_upto(static_cast<size_t>(AR), -1);
  bool backward_begun = false;
  // On an early return (an op's error), stop the queued jobs and wait for them: they refer to
  // this frame's locals.
  struct Drain {
    Impl& I;
    bool armed = true;
    ~Drain() {
      if (!armed) return;
      {
        std::lock_guard<std::mutex> g(I.mu);
        I.aborting = true;
      }
      I.cv.notify_all();
      I.h2d->synchronize();
      I.d2h->synchronize();
      I.optim->synchronize();
      std::lock_guard<std::mutex> g(I.mu);
      I.aborting = false;
      I.free_slots.clear();
      for (int64_t s = 0; s < I.B; ++s) I.free_slots.push_back(static_cast<int>(s));
      std::fill(I.grad_buf_free.begin(), I.grad_buf_free.end(), 1);
    }
  } drain{I};

  // H2D: each load waits for a free slot, for the prefetch window and for the unit's update of
  // the previous step, then copies. A checkpoint restore waits until backward has begun and the
  // previous block's recompute of that micro-batch has read the buffer it overwrites.
  auto post_load = [&](size_t i) {
    I.h2d->post([&I, &loads, &compute_at, i, step] {
      Load& ld = loads[i];
      {
        std::unique_lock<std::mutex> l(I.mu);
        I.cv.wait(l, [&] {
          return I.aborting || (!I.free_slots.empty() && compute_at >= static_cast<int64_t>(i) - I.K &&
                                I.updated_step[static_cast<size_t>(ld.unit)] >= step - 1);
        });
        if (I.aborting) return;
        ld.slot = I.free_slots.back();
        I.free_slots.pop_back();
      }
      const auto a = Clock::now();
      I.copy_in(ld.unit, I.slots[static_cast<size_t>(ld.slot)]);
      const auto b = Clock::now();
      I.record(kLaneH2D, "h2d L" + std::to_string(ld.unit), "h2d", step, ld.unit, -1, a, b,
               I.state->units()[static_cast<size_t>(ld.unit)].numel * (I.state->transfer() == DType::kBf16 ? 2 : 4));
      {
        std::lock_guard<std::mutex> g(I.mu);
        ld.ready = true;
      }
      I.cv.notify_all();
    });
  };
  auto post_restore = [&](size_t bi, int64_t j, int64_t lo) {
    I.h2d->post([&I, &restored, &consumed_upto, &backward_begun, &ckpt_copied, bi, j, lo, step, NH, AR] {
      const size_t ck = static_cast<size_t>((lo - 1) / I.c);
      {
        std::unique_lock<std::mutex> l(I.mu);
        I.cv.wait(l, [&] {
          return I.aborting || (backward_begun && consumed_upto[static_cast<size_t>(j)] >= static_cast<int64_t>(bi) - 1 &&
                                ckpt_copied[ck * static_cast<size_t>(AR) + static_cast<size_t>(j)]);
        });
        if (I.aborting) return;
      }
      const auto a = Clock::now();
      std::memcpy(I.hid[0][static_cast<size_t>(j)], I.ckpt[ck][static_cast<size_t>(j)], sizeof(float) * static_cast<size_t>(NH));
      I.record(kLaneH2D, "h2d checkpoint L" + std::to_string(lo) + " mb" + std::to_string(j), "h2d_checkpoint", step, lo, j, a,
               Clock::now(), NH * 4);
      {
        std::lock_guard<std::mutex> g(I.mu);
        restored[bi * static_cast<size_t>(AR) + static_cast<size_t>(j)] = 1;
      }
      I.cv.notify_all();
    });
  };
  for (size_t i = 0; i < backward_first; ++i) post_load(i);
  {
    size_t i = backward_first;
    for (size_t bi = 0; bi < blocks.size(); ++bi) {
      const auto [lo, hi] = blocks[bi];
      const int64_t n_loads = I.c > 0 ? hi - lo + 1 : 1;
      for (int64_t k = 0; k < n_loads; ++k) post_load(i++);
      if (I.host_ckpt)
        for (int64_t j = 0; j < AR; ++j) post_restore(bi, j, lo);
    }
  }
  // Compute side: wait for load i (a late prefetch is a stall), and give slots back.
  auto acquire = [&](size_t i) -> const float* {
    {
      std::lock_guard<std::mutex> g(I.mu);
      compute_at = static_cast<int64_t>(i);
    }
    I.cv.notify_all();
    const auto a = Clock::now();
    std::unique_lock<std::mutex> l(I.mu);
    I.cv.wait(l, [&] { return loads[i].ready; });  // loads never fail on the CPU backend
    const auto b = Clock::now();
    const double waited = std::chrono::duration<double>(b - a).count();
    if (waited > 20e-6) {
      stall += waited;
      l.unlock();
      I.record(kLaneCompute, "stall: weights", "stall", step, loads[i].unit, -1, a, b);
      l.lock();
    }
    return I.slots[static_cast<size_t>(loads[i].slot)];
  };
  auto release = [&](size_t i) {
    {
      std::lock_guard<std::mutex> g(I.mu);
      I.free_slots.push_back(loads[i].slot);
    }
    I.cv.notify_all();
  };
  auto compute_span = [&](const std::string& name, const char* kind, int64_t layer, int64_t mb, Clock::time_point a) {
    I.record(kLaneCompute, name, kind, step, layer, mb, a, Clock::now());
  };
  // A unit's gradient is final: copy it to the RAM tier, then (without clipping) update it.
  auto finish_unit = [&](int64_t u, float* grad_buf, int grad_index) {
    I.d2h->post([&I, u, grad_buf, grad_index, step, layer_major, last_round] {
      UnitState& us = I.state->units()[static_cast<size_t>(u)];
      const auto a = Clock::now();
      if (layer_major) {
        std::memcpy(us.grad.data(), grad_buf, sizeof(float) * static_cast<size_t>(us.numel));
      } else {
        // microbatch-major: every micro-batch's gradient is summed into the RAM tier in fp32.
        for (int64_t k = 0; k < us.numel; ++k) us.grad[k] += grad_buf[k];
      }
      I.record(kLaneD2H, "d2h grad L" + std::to_string(u), "d2h", step, u, -1, a, Clock::now(), us.numel * 4);
      if (grad_index >= 0) {
        std::lock_guard<std::mutex> g(I.mu);
        I.grad_buf_free[static_cast<size_t>(grad_index)] = 1;
      }
      I.cv.notify_all();
      if (I.clip || !last_round) return;
      I.optim->post([&I, u, step] {
        const auto b = Clock::now();
        update_unit(I, u, step, 1.0f);
        I.record(kLaneOptimizer, "adam L" + std::to_string(u), "optimizer", step, u, -1, b, Clock::now());
        {
          std::lock_guard<std::mutex> g(I.mu);
          I.updated_step[static_cast<size_t>(u)] = step;
        }
        I.cv.notify_all();
      });
    });
  };
  auto take_grad_buf = [&](int64_t numel) -> std::pair<float*, int> {
    std::unique_lock<std::mutex> l(I.mu);
    I.cv.wait(l, [&] { return std::find(I.grad_buf_free.begin(), I.grad_buf_free.end(), 1) != I.grad_buf_free.end(); });
    const auto k = static_cast<int>(std::find(I.grad_buf_free.begin(), I.grad_buf_free.end(), 1) - I.grad_buf_free.begin());
    I.grad_buf_free[static_cast<size_t>(k)] = 0;
    l.unlock();
    float* g = I.grad_bufs[static_cast<size_t>(k)];
    std::fill(g, g + numel, 0.0f);
    return {g, k};
  };

  // Forward.
  size_t li = 0;
  const float* w_embed = acquire(li);
  for (int64_t j = 0; j < AR; ++j) {
    const auto a = Clock::now();
    MT_RETURN_IF_ERROR(I.math->embed(w_embed, I.inputs[static_cast<size_t>(j0 + j)].data(), I.hid[0][static_cast<size_t>(j)]));
    compute_span("embed mb" + std::to_string(j0 + j), "embed_forward", 0, j0 + j, a);
  }
  release(li++);
  int cur = 0;
  for (int64_t l = 1; l <= I.L; ++l, ++li) {
    const float* w = acquire(li);
    const UnitView v = view_unit(units(l), w);
    const bool keep_input = I.c > 0 && (l - 1) % I.c == 0;
    for (int64_t j = 0; j < AR; ++j) {
      const auto a = Clock::now();
      float* x_in = I.hid[cur][static_cast<size_t>(j)];
      float* x_out = I.hid[1 - cur][static_cast<size_t>(j)];
      if (I.host_ckpt && l >= 2 && (l - 2) % I.c == 0) {
        // This layer overwrites the previous layer's input: its copy to the host must be done.
        const size_t ck = static_cast<size_t>((l - 2) / I.c) * static_cast<size_t>(AR) + static_cast<size_t>(j);
        std::unique_lock<std::mutex> lk(I.mu);
        I.cv.wait(lk, [&] { return ckpt_copied[ck] != 0; });
      }
      if (keep_input && !I.host_ckpt) {
        std::memcpy(I.ckpt[static_cast<size_t>((l - 1) / I.c)][static_cast<size_t>(j)], x_in, sizeof(float) * static_cast<size_t>(NH));
      } else if (keep_input) {
        const size_t ck = static_cast<size_t>((l - 1) / I.c);
        I.d2h->post([&I, &ckpt_copied, ck, j, j0, x_in, l, step, NH, AR] {
          const auto t_copy = Clock::now();
          std::memcpy(I.ckpt[ck][static_cast<size_t>(j)], x_in, sizeof(float) * static_cast<size_t>(NH));
          I.record(kLaneD2H, "d2h checkpoint L" + std::to_string(l) + " mb" + std::to_string(j0 + j), "d2h_checkpoint", step, l,
                   j0 + j, t_copy, Clock::now(), NH * 4);
          {
            std::lock_guard<std::mutex> g(I.mu);
            ckpt_copied[ck * static_cast<size_t>(AR) + static_cast<size_t>(j)] = 1;
          }
          I.cv.notify_all();
        });
      }
      float* act = I.c > 0 ? I.acts[0] : I.acts[static_cast<size_t>((l - 1) * AR + j)];
      MT_RETURN_IF_ERROR(I.math->forward(v, x_in, x_out, bind_layer_acts(d, act)));
      compute_span("fwd L" + std::to_string(l) + " mb" + std::to_string(j0 + j), "forward", l, j0 + j, a);
    }
    release(li);
    cur = 1 - cur;
  }
  // Head: forward, loss and backward per micro-batch; dhid receives the gradient at the top.
  {
    const size_t head_load = li++;
    const float* w_head = acquire(head_load);
    const float* table = nullptr;
    size_t table_load = 0;
    if (d.tied) {
      table_load = li++;
      table = acquire(table_load);
    }
    const UnitState& hu = units(I.L + 1);
    std::fill(I.head_grad, I.head_grad + hu.numel, 0.0f);
    if (d.tied) std::fill(I.tied_grad, I.tied_grad + d.V * d.H, 0.0f);
    const float* lm = d.tied ? table : w_head + hu.find(TensorRole::kHead)->offset;
    float* dlm = d.tied ? I.tied_grad : I.head_grad + hu.find(TensorRole::kHead)->offset;
    for (int64_t j = 0; j < AR; ++j) {
      const auto a = Clock::now();
      MT_RETURN_IF_ERROR(I.math->head(w_head + hu.find(TensorRole::kFinalNorm)->offset, lm, I.hid[cur][static_cast<size_t>(j)],
                                      I.targets[static_cast<size_t>(j0 + j)].data(), grad_scale, I.dhid[static_cast<size_t>(j)],
                                      I.head_grad + hu.find(TensorRole::kFinalNorm)->offset, dlm, &loss_sum, &count, I.ws));
      compute_span("head mb" + std::to_string(j0 + j), "head", I.L + 1, j0 + j, a);
    }
    release(head_load);
    if (d.tied) release(table_load);
    finish_unit(I.L + 1, I.head_grad, -1);
  }
  {
    std::lock_guard<std::mutex> g(I.mu);
    backward_begun = true;
  }
  I.cv.notify_all();
  // Backward: block by block from the last; recompute from the checkpoint, then backward.
  std::fill(I.embed_grad, I.embed_grad + units(0).numel, 0.0f);
  li = backward_first;
  for (size_t bi = 0; bi < blocks.size(); ++bi) {
    const auto [lo, hi] = blocks[bi];
    std::vector<const float*> w(static_cast<size_t>(hi - lo + 1));
    std::vector<size_t> load_of(static_cast<size_t>(hi - lo + 1));
    std::vector<std::pair<float*, int>> gb(static_cast<size_t>(hi - lo + 1));
    if (I.c > 0) {
      for (int64_t l = lo; l <= hi; ++l, ++li) {
        load_of[static_cast<size_t>(l - lo)] = li;
        w[static_cast<size_t>(l - lo)] = acquire(li);
      }
    } else {
      load_of[0] = li;
      w[0] = acquire(li++);
    }
    for (int64_t l = lo; l <= hi; ++l) gb[static_cast<size_t>(l - lo)] = take_grad_buf(units(l).numel);
    for (int64_t j = 0; j < AR; ++j) {
      if (I.c > 0) {
        const float* x = I.ckpt[static_cast<size_t>((lo - 1) / I.c)][static_cast<size_t>(j)];
        if (I.host_ckpt) {
          const size_t r = bi * static_cast<size_t>(AR) + static_cast<size_t>(j);
          const auto a = Clock::now();
          std::unique_lock<std::mutex> lk(I.mu);
          I.cv.wait(lk, [&] { return restored[r] != 0; });
          const auto b2 = Clock::now();
          lk.unlock();
          const double waited = std::chrono::duration<double>(b2 - a).count();
          if (waited > 20e-6) {
            stall += waited;
            I.record(kLaneCompute, "stall: activations", "stall", step, lo, j, a, b2);
          }
          x = I.hid[0][static_cast<size_t>(j)];
        }
        for (int64_t l = lo; l <= hi; ++l) {
          const auto a = Clock::now();
          float* out = l == hi ? I.x_scratch : I.acts[static_cast<size_t>(l - lo + 1)];  // next layer's acts.x
          const LayerActs acts = bind_layer_acts(d, I.acts[static_cast<size_t>(l - lo)]);
          MT_RETURN_IF_ERROR(I.math->forward(view_unit(units(l), w[static_cast<size_t>(l - lo)]), l == lo ? x : acts.x, out, acts));
          if (l == lo && I.host_ckpt) {
            {
              std::lock_guard<std::mutex> g(I.mu);
              consumed_upto[static_cast<size_t>(j)] = static_cast<int64_t>(bi);
            }
            I.cv.notify_all();
          }
          compute_span("recompute L" + std::to_string(l) + " mb" + std::to_string(j0 + j), "recompute", l, j0 + j, a);
        }
      }
      for (int64_t l = hi; l >= lo; --l) {
        const auto a = Clock::now();
        float* act = I.c > 0 ? I.acts[static_cast<size_t>(l - lo)] : I.acts[static_cast<size_t>((l - 1) * AR + j)];
        float* dx = I.dhid[static_cast<size_t>(j)];
        MT_RETURN_IF_ERROR(I.math->backward(view_unit(units(l), w[static_cast<size_t>(l - lo)]), bind_layer_acts(d, act), dx, dx,
                                            grad_unit(units(l), gb[static_cast<size_t>(l - lo)].first), I.ws));
        compute_span("bwd L" + std::to_string(l) + " mb" + std::to_string(j0 + j), "backward", l, j0 + j, a);
      }
    }
    for (int64_t l = hi; l >= lo; --l) {
      release(load_of[I.c > 0 ? static_cast<size_t>(l - lo) : 0]);
      finish_unit(l, gb[static_cast<size_t>(l - lo)].first, gb[static_cast<size_t>(l - lo)].second);
      if (I.c == 0) break;
    }
  }
  for (int64_t j = 0; j < AR; ++j) {
    const auto a = Clock::now();
    MT_RETURN_IF_ERROR(I.math->embed_backward(I.inputs[static_cast<size_t>(j0 + j)].data(), I.dhid[static_cast<size_t>(j)], I.embed_grad));
    compute_span("embed bwd mb" + std::to_string(j0 + j), "embed_backward", 0, j0 + j, a);
  }
  if (d.tied) cpu::accumulate<float>(*I.ctx, I.tied_grad, d.V * d.H, I.embed_grad);
  finish_unit(0, I.embed_grad, -1);
  // The round's buffers are reused by the next: wait for its copies.
  I.h2d->synchronize();
  I.d2h->synchronize();
  drain.armed = false;
  }  // rounds
  I.h2d->synchronize();
  I.d2h->synchronize();
  if (I.clip) {
    // Every update waits for the global norm: the cost of clipping is losing the overlap of the
    // optimizer with backward (docs/executor.md).
    res.grad_norm = global_norm(I);
    const float scale = clip_scale(I, res.grad_norm);
    for (int64_t u = 0; u < I.U; ++u) {
      I.optim->post([&I, u, step, scale] {
        const auto b = Clock::now();
        update_unit(I, u, step, scale);
        I.record(kLaneOptimizer, "adam L" + std::to_string(u), "optimizer", step, u, -1, b, Clock::now());
        {
          std::lock_guard<std::mutex> g(I.mu);
          I.updated_step[static_cast<size_t>(u)] = step;
        }
        I.cv.notify_all();
      });
    }
  }
  // The next step's forward waits per unit on updated_step; a step returns once all its work is
  // done so that its loss and state are final.
  I.optim->synchronize();
  res.loss = loss_sum / static_cast<double>(count);
  res.tokens = count;
  res.stall_s = stall;
  res.time_s = std::chrono::duration<double>(Clock::now() - step_start).count();
  if (I.opt.record_trace) {
    std::lock_guard<std::mutex> g(I.trace_mu);
    I.steps.push_back(TraceStep{step, res.loss, res.tokens, res.time_s});
  }
  return res;
}

Status Trainer::write_trace(const std::filesystem::path& path, const std::string& plan_json) const {
  const Impl& I = *impl_;
  MT_ASSIGN_OR_RETURN(auto w, TraceWriter::create(path, {{"source", "measured"}, {"plan", plan_json}, {"backend", "cpu"}}));
  const char* names[kLaneCount] = {"GPU compute", "H2D", "D2H", "CPU optimizer"};
  const char* kinds[kLaneCount] = {"gpu", "h2d", "d2h", "cpu"};
  std::vector<int64_t> lane(kLaneCount);
  for (int k = 0; k < kLaneCount; ++k) {
    MT_ASSIGN_OR_RETURN(lane[static_cast<size_t>(k)], w->add_lane(names[k], kinds[k]));
  }
  for (const Span& s : I.spans)
    MT_RETURN_IF_ERROR(w->add_span(TraceSpan{lane[static_cast<size_t>(s.lane)], s.name, s.kind, s.step, s.layer, s.mb,
                                             s.start_ns, std::max(s.start_ns, s.end_ns), s.bytes, s.flops}));
  for (const TraceStep& s : I.steps) MT_RETURN_IF_ERROR(w->add_step(s));
  // Device memory is carved once at startup; RAM holds the whole state.
  const int64_t end = I.spans.empty() ? 0 : I.spans.back().end_ns;
  for (int64_t t : {int64_t{0}, end}) {
    MT_RETURN_IF_ERROR(w->add_counter({"bytes.device", t, static_cast<double>(I.budget.total())}));
    MT_RETURN_IF_ERROR(w->add_counter({"bytes.ram", t, static_cast<double>(I.state->bytes())}));
  }
  return w->close();
}

}  // namespace megatrain::exec

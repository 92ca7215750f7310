// What each backend keeps per micro-batch, in the order it carves it. The CPU layout is the one
// executor/src/model.cpp binds (its layer_act_floats and workspaces call these); the CUDA layout
// follows the carves of executor/src/cuda/cuda_backend.cpp, and the trainer refuses to start when a
// backend's own figures differ from the layout's, so the two cannot drift silently.
#include <algorithm>

#include "cuda/attention_schedule.h"
#include "megatrain/step/schedule.h"

namespace megatrain::step {
namespace {

struct Shape {
  int64_t B, T, N, H, I, nh, nkv, hd, q, kv, V;
  bool qk_norm, moe, sinks, gpt_oss;  // gpt_oss: the experts' gate and up interleaved in one gate_up
  int64_t E, k, mlp;  // experts, chosen per token, elements of each MLP intermediate (gate, up, act)
};
Shape shape_of(const ModelSpec& model, int64_t micro_batch, int64_t seq_len) {
  const ModelConfig& c = model.config();
  Shape s{};
  s.B = micro_batch;
  s.T = seq_len;
  s.N = micro_batch * seq_len;
  s.H = c.hidden_size;
  s.I = c.intermediate_size;
  s.nh = c.num_heads;
  s.nkv = c.num_kv_heads;
  s.hd = c.head_dim;
  s.q = s.nh * s.hd;
  s.kv = s.nkv * s.hd;
  s.V = c.vocab_size;
  s.qk_norm = c.qk_norm;
  s.sinks = c.attention_sinks;
  s.moe = c.is_moe();
  s.gpt_oss = c.moe == "gpt_oss";
  s.E = s.moe ? c.num_experts : 0;
  s.k = s.moe ? c.experts_per_token : 0;
  // Dims::mlp_floats: the dense MLP's N*I when some layer has it, the experts' N*k*Im when some has them.
  bool dense = !s.moe;
  for (int64_t l = 0; s.moe && l < c.num_layers; ++l) dense = dense || !c.is_moe_layer(l);
  s.mlp = std::max(dense ? s.N * s.I : 0, s.moe ? s.N * s.k * c.moe_intermediate_size : 0);
  return s;
}

// int32 cells in floats, as the CPU backend keeps routing indices among its activations.
int64_t int_cells(int64_t n) { return n; }

// The CUDA backend's carver: every buffer rounded up to 256 bytes.
struct Sizer {
  int64_t bytes = 0;
  void take(int64_t n, int64_t elem) { bytes += (n * elem + 255) / 256 * 256; }
  int64_t floats() const { return (bytes + 3) / 4; }
};

constexpr int64_t kCudaBlasWorkspace = int64_t{32} << 20;     // cuBLAS's recommendation for Hopper
constexpr int64_t kCudaAttentionBudget = int64_t{256} << 20;  // attention score blocks
constexpr int64_t kCudaLogitElems = int64_t{16} << 20;        // logits of one vocabulary chunk

}  // namespace

ActivationLayout cpu_layout(const ModelSpec& model, int64_t micro_batch, int64_t seq_len) {
  const Shape d = shape_of(model, micro_batch, seq_len);
  const int64_t probs = d.B * d.nh * d.T * d.T;
  ActivationLayout a;
  a.backend = BackendKind::kCpu;
  a.hidden_floats = d.N * d.H;
  // x, rstd1, xn1, q, k, v, probs, attn, h, rstd2, xn2, gate, up, act; Qwen3's q/k before their
  // norms and the norms' rstd; MoE: logits, probs [N,E], weight [N*k], xp, yp [N*k,H], expert,
  // perm, row_of_slot [N*k] and offsets [E+1] (int32)
  a.layer_act_floats = d.N * (d.H + 1 + d.H + d.q + 2 * d.kv + d.q + d.H + 1 + d.H) + 3 * d.mlp + probs;
  if (d.qk_norm) a.layer_act_floats += d.N * (d.q + d.kv + d.nh + d.nkv);
  const int64_t slots = d.N * d.k;
  if (d.moe) a.layer_act_floats += 2 * d.N * d.E + slots + 2 * slots * d.H + 3 * int_cells(slots) + int_cells(d.E + 1);
  const int64_t sink_rows = d.sinks ? d.B * d.nh * d.T : 0;  // gpt-oss: each attention row's sink probability
  a.layer_act_floats += sink_rows;
  // da, dgate, dup [MLP]; dxn, dh [N,H]; dattn, dq [N,q]; dk, dv [N,kv]; attention ds [probs]; one
  // more [N,H]; then the larger of the MoE block's dxp, dyp, d weight, d logits and the q/k norms'
  // input gradients and the attention sinks' per-row gradients
  a.layer_workspace_floats = 3 * d.mlp + 2 * d.N * d.H + 2 * d.N * d.q + 2 * d.N * d.kv + probs + d.N * d.H +
                             std::max({d.moe ? 2 * slots * d.H + slots + d.N * d.E : 0, d.qk_norm ? d.N * (d.q + d.kv) : 0,
                                       sink_rows});
  a.head_workspace_floats = d.N * d.V + 2 * d.N + 2 * d.N * d.H;
  a.private_bytes = 0;
  a.eager_attention = true;
  a.arena_in_ram = true;
  a.carve_align = 64;
  a.arena_align = 64;
  return a;
}

ActivationLayout cuda_layout(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, DType compute) {
  const Shape d = shape_of(model, micro_batch, seq_len);
  const int64_t t = compute == DType::kBf16 ? 2 : 4;  // the compute dtype's bytes
  const bool cast = t != 4;
  ActivationLayout a;
  a.backend = BackendKind::kCuda;
  a.hidden_floats = d.N * d.H;
  {
    Sizer c;  // x, rstd1, xn1, q, k, v, attn, lse, h, rstd2, xn2, gate, up, act
    c.take(d.N * d.H, 4);
    c.take(d.N, 4);
    c.take(d.N * d.H, t);
    c.take(d.N * d.q, t);
    c.take(d.N * d.kv, t);
    c.take(d.N * d.kv, t);
    c.take(d.N * d.q, t);
    c.take(d.B * d.nh * d.T, 4);
    c.take(d.N * d.H, 4);
    c.take(d.N, 4);
    c.take(d.N * d.H, t);
    if (d.gpt_oss) {
      c.take(2 * d.mlp, t);  // gpt-oss: gate_up in one piece (gate and up adjacent)
    } else {
      c.take(d.mlp, t);
      c.take(d.mlp, t);
    }
    c.take(d.mlp, t);
    // gpt-oss's sinks need nothing more: each row's lse includes its sink (exp(sink - lse) is
    // its probability). Qwen3: q and k before their norms (fp32) and the norms' rstd; MoE: router logits and
    // probabilities, combine weights, expert / perm / row_of_slot (int32), offsets, then the
    // gathered inputs and the expert outputs (T)
    if (d.qk_norm) {
      c.take(d.N * d.q, 4);
      c.take(d.N * d.kv, 4);
      c.take(d.N * d.nh, 4);
      c.take(d.N * d.nkv, 4);
    }
    if (d.moe) {
      const int64_t slots = d.N * d.k;
      c.take(d.N * d.E, 4);
      c.take(d.N * d.E, 4);
      c.take(slots, 4);
      for (int k = 0; k < 3; ++k) c.take(slots, 4);
      c.take(d.E + 1, 4);
      c.take(slots * d.H, t);
      c.take(slots * d.H, t);
    }
    a.layer_act_floats = c.floats();
  }
  {
    Sizer c;  // dout_t, dact, dgate, dup, dh_t, dattn, dq_t, dk_t, dv_t, dxn, tmp, dh, dq, dk, dv
    c.take(cast ? d.N * d.H : 0, t);
    c.take(d.mlp, t);
    if (d.gpt_oss) {
      c.take(2 * d.mlp, t);  // d gate_up in one piece
    } else {
      c.take(d.mlp, t);
      c.take(d.mlp, t);
    }
    c.take(cast ? d.N * d.H : 0, t);
    c.take(d.N * d.q, t);
    c.take(cast ? d.N * d.q : 0, t);
    c.take(cast ? d.N * d.kv : 0, t);
    c.take(cast ? d.N * d.kv : 0, t);
    for (int64_t n : {d.N * d.H, d.N * d.H, d.N * d.H, d.N * d.q, d.N * d.kv, d.N * d.kv}) c.take(n, 4);
    if (d.moe) {  // d xp (fp32), d yp (T), d weight, d logits, d logits in T (bf16 only)
      c.take(d.N * d.k * d.H, 4);
      c.take(d.N * d.k * d.H, t);
      c.take(d.N * d.k, 4);
      c.take(d.N * d.E, 4);
      c.take(cast ? d.N * d.E : 0, t);
    }
    a.layer_workspace_floats = c.floats();
  }
  {
    const int64_t chunk = std::clamp<int64_t>(kCudaLogitElems / std::max<int64_t>(d.N, 1) / 128 * 128, 128, d.V);
    Sizer c;  // xn, rstd, dxn, run_max, run_sum, target_logit, lse, logits, dlogits (bf16 only)
    c.take(d.N * d.H, t);
    c.take(d.N, 4);
    c.take(d.N * d.H, 4);
    for (int k = 0; k < 4; ++k) c.take(d.N, 4);
    c.take(d.N * chunk, 4);
    if (cast) c.take(d.N * chunk, t);
    a.head_workspace_floats = c.floats();
  }
  {
    const cuda::AttnDims ad{d.B, d.T, d.nh, d.nkv, d.hd};
    Sizer c;  // cuBLAS workspace, attention blocks, tokens, targets, positions, unique, offsets, gpos, inv_freq, loss, count
    c.take(kCudaBlasWorkspace, 1);
    c.take(cuda::attention_workspace_bytes(ad, cuda::attention_block_rows(ad, kCudaAttentionBudget)), 1);
    for (int k = 0; k < 4; ++k) c.take(d.N, 4);
    c.take(d.N + 1, 4);
    c.take(d.N, 4);
    c.take(d.hd / 2, 4);
    c.take(1, 8);
    c.take(1, 8);
    // MoE: the counting sort's per-chunk counts (chunks of 256 slots), the grouped GEMMs' A/B/C
    // pointer arrays, the routing statistics (2E doubles) and the load-balancing gradient (E floats)
    const int64_t E = d.moe ? d.E : 0;
    c.take(d.moe ? (d.N * d.k + 255) / 256 * E : 0, 4);
    c.take(3 * E, 8);
    c.take(2 * E, 8);
    c.take(E, 4);
    a.private_bytes = c.bytes;
  }
  a.eager_attention = false;
  a.arena_in_ram = false;
  a.carve_align = 64;
  a.arena_align = 256;
  return a;
}

ActivationLayout layout_for(BackendKind backend, const ModelSpec& model, const Plan& plan) {
  return backend == BackendKind::kCpu ? cpu_layout(model, plan.training.micro_batch, plan.training.seq_len)
                                      : cuda_layout(model, plan.training.micro_batch, plan.training.seq_len, plan.precision.compute);
}

int64_t device_context_reserve(BackendKind backend, int64_t device_memory_bytes) {
  if (backend == BackendKind::kCpu) return 0;
  return std::min<int64_t>(int64_t{1} << 30, device_memory_bytes / 16);
}

int64_t usable_device_bytes(const HardwareProfile& rig) {
  const auto total = static_cast<int64_t>(rig.gpu.memory_bytes.value);
  return total - device_context_reserve(backend_of_rig(rig), total);
}

int64_t device_budget_of(const Plan& plan, const HardwareProfile& rig) {
  return plan.placement.device_budget_bytes > 0 ? plan.placement.device_budget_bytes : usable_device_bytes(rig);
}

}  // namespace megatrain::step

// What each backend keeps per micro-batch: the sums of its buffer lists (megatrain/buffers), the
// same lists the backends carve their arenas by.
#include <algorithm>

#include "megatrain/buffers/buffers.h"
#include "megatrain/step/schedule.h"

namespace megatrain::step {

ActivationLayout cpu_layout(const ModelSpec& model, int64_t micro_batch, int64_t seq_len) {
  const buffers::Shape s = buffers::shape_of(model.config(), micro_batch, seq_len);
  ActivationLayout a;
  a.backend = BackendKind::kCpu;
  a.hidden_floats = s.N * s.H;
  a.layer_act_floats = buffers::cpu_layer_acts(s).floats();
  a.layer_workspace_floats = buffers::cpu_layer_workspace(s).floats();
  a.head_workspace_floats = buffers::cpu_head_workspace(s).floats();
  a.private_bytes = 0;
  a.eager_attention = true;
  a.arena_in_ram = true;
  a.carve_align = buffers::kPipelineCarveAlign;
  a.arena_align = buffers::kPipelineCarveAlign;
  return a;
}

ActivationLayout cuda_layout(const ModelSpec& model, int64_t micro_batch, int64_t seq_len, DType compute,
                             const buffers::BlockCaps& caps) {
  buffers::Shape s = buffers::shape_of(model.config(), micro_batch, seq_len);
  s.caps = caps;
  const int32_t t = compute == DType::kBf16 ? 2 : 4;  // the compute dtype's bytes
  ActivationLayout a;
  a.backend = BackendKind::kCuda;
  a.hidden_floats = s.N * s.H;
  a.layer_act_floats = buffers::cuda_layer_acts(s, t).floats();
  a.layer_workspace_floats = buffers::cuda_layer_workspace(s, t).floats();
  a.head_workspace_floats = buffers::cuda_head_workspace(s, t).floats();
  a.private_bytes = buffers::cuda_private(s).bytes();
  a.eager_attention = false;
  a.arena_in_ram = false;
  a.carve_align = buffers::kPipelineCarveAlign;
  a.arena_align = buffers::kCudaCarveAlign;
  return a;
}

ActivationLayout layout_for(BackendKind backend, const ModelSpec& model, const Plan& plan, const buffers::BlockCaps& caps) {
  return backend == BackendKind::kCpu
             ? cpu_layout(model, plan.training.micro_batch, plan.training.seq_len)
             : cuda_layout(model, plan.training.micro_batch, plan.training.seq_len, plan.precision.compute, caps);
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

// HF safetensors <-> the RAM tier's master weights.
#include "megatrain/executor/weights_io.h"

#include "megatrain/executor/safetensors.h"

namespace megatrain::exec {

Status save_weights(const HostState& state, const std::filesystem::path& path) {
  // Master weights on NVMe are paged in one unit at a time as the file is written.
  auto pager = std::make_shared<UnitPager>(const_cast<HostState&>(state));
  std::vector<TensorToWrite> tensors;
  for (size_t u = 0; u < state.units().size(); ++u) {
    for (const TensorSlot& t : state.units()[u].tensors) {
      TensorToWrite w{t.name, t.shape, state.units()[u].master.data() + t.offset, DType::kFp32, DType::kFp32};
      if (state.master_on_nvme()) {
        w.data = nullptr;
        w.fetch = [&state, pager, u, off = t.offset]() -> Result<const void*> {
          MT_RETURN_IF_ERROR(pager->get(static_cast<int64_t>(u)).status());
          return static_cast<const void*>(state.units()[u].master.data() + off);
        };
      }
      tensors.push_back(std::move(w));
    }
  }
  Status s = write_safetensors(path, tensors, {{"writer", "megatrain"}});
  Status done = pager->finish();
  return s.ok() ? done : s;
}

Status load_weights(HostState& state, const std::filesystem::path& checkpoint) {
  MT_ASSIGN_OR_RETURN(HfCheckpoint ckpt, HfCheckpoint::open(checkpoint));
  UnitPager pager(state);  // master weights on NVMe: one unit at a time, set and written back
  for (size_t u = 0; u < state.units().size(); ++u) {
    UnitState& us = state.units()[u];
    if (state.master_on_nvme()) MT_RETURN_IF_ERROR(pager.get(static_cast<int64_t>(u), true).status());
    for (const TensorSlot& t : us.tensors) {
      if (!ckpt.contains(t.name))
        return not_found(checkpoint.string() + ": the model's tensor " + t.name + " is not in the checkpoint");
      MT_RETURN_IF_ERROR(ckpt.load_fp32(t.name, t.shape, us.master.data() + t.offset).with_context(checkpoint.string()));
    }
  }
  MT_RETURN_IF_ERROR(pager.finish());
  return state.refresh_stream();
}

}  // namespace megatrain::exec

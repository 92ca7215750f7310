// HF safetensors <-> the RAM tier's master weights.
#include "megatrain/executor/weights_io.h"

#include "megatrain/executor/safetensors.h"

namespace megatrain::exec {

Status save_weights(const HostState& state, const std::filesystem::path& path) {
  std::vector<TensorToWrite> tensors;
  for (const UnitState& us : state.units())
    for (const TensorSlot& t : us.tensors)
      tensors.push_back(TensorToWrite{t.name, t.shape, us.master.data() + t.offset, DType::kFp32, DType::kFp32});
  return write_safetensors(path, tensors, {{"writer", "megatrain"}});
}

Status load_weights(HostState& state, const std::filesystem::path& checkpoint) {
  MT_ASSIGN_OR_RETURN(HfCheckpoint ckpt, HfCheckpoint::open(checkpoint));
  for (UnitState& us : state.units()) {
    for (const TensorSlot& t : us.tensors) {
      if (!ckpt.contains(t.name))
        return not_found(checkpoint.string() + ": the model's tensor " + t.name + " is not in the checkpoint");
      MT_RETURN_IF_ERROR(ckpt.load_fp32(t.name, t.shape, us.master.data() + t.offset).with_context(checkpoint.string()));
    }
  }
  state.refresh_stream();
  return {};
}

}  // namespace megatrain::exec

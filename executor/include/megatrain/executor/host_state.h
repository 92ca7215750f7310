// The RAM tier (ARCHITECTURE.md section 6): the training state of every unit (embedding, each
// decoder layer, head) laid out per unit so that one unit is one contiguous transfer: fp32 master
// weights, fp32 gradients, Adam m and v, and the streaming copy in the transfer dtype. Tensors
// keep their HF names, shapes and state-dict order inside their unit.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/aligned_array.h"
#include "megatrain/executor/moments.h"

namespace megatrain::exec {

struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  TensorRole role = TensorRole::kEmbedding;
  int64_t offset = 0;  // elements from the start of the unit
  int64_t numel = 0;
  bool decay = true;   // AdamW weight decay applies (not to norms and biases, as HF Trainer does)
};

struct UnitState {
  std::vector<TensorSlot> tensors;
  int64_t numel = 0;
  AlignedArray<float> master, grad;
  MomentStore m, v;  // Adam's moments in the plan's state formats (moments.h)
  AlignedArray<uint16_t> stream_bf16;  // the copy streamed to the device when transfer is bf16
  const TensorSlot* find(TensorRole role) const;
};

class HostState {
 public:
  // Units: 0 = embedding, 1..L = decoder layers, L+1 = head (final norm, and lm_head unless tied).
  // m and v are kept in the given state formats (moments.h), quantised in blocks of block_size.
  static HostState create(const ModelSpec& model, DType transfer, StateFormat m_format = StateFormat::kFp32,
                          StateFormat v_format = StateFormat::kFp32, int64_t block_size = 128);
  // HF initialisation: matrices and the embedding ~ N(0, std), norms 1, biases 0; a counter-based
  // generator keyed by (seed, tensor name) makes it independent of thread count and layout.
  void init_random(uint64_t seed, double std);
  // Refreshes the streaming copy from the master weights (after init or load).
  void refresh_stream();

  std::vector<UnitState>& units() { return units_; }
  const std::vector<UnitState>& units() const { return units_; }
  int64_t num_layers() const { return static_cast<int64_t>(units_.size()) - 2; }
  DType transfer() const { return transfer_; }
  bool tied() const { return tied_; }
  // Bytes of host memory this state occupies.
  int64_t bytes() const;

 private:
  std::vector<UnitState> units_;
  DType transfer_ = DType::kFp32;
  bool tied_ = false;
};

}  // namespace megatrain::exec

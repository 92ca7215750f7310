// Each backend's device buffers as data, written once (docs/compiled-step.md). A backend's layer
// activations, layer workspace, head workspace and private region are each a BufferList: the
// buffers in carve order, with their element counts, element sizes and the rounding between them.
// The backend carves its arena by walking the list (Carving), and the compiled step's footprint
// sums the same list, so the two cannot disagree.
#pragma once

#include <cstdint>
#include <vector>

#include "megatrain/buffers/shape.h"
#include "megatrain/core/status.h"

namespace megatrain::buffers {

enum class Buf : int16_t {
  // a layer's kept activations
  kX, kRstd1, kXn1, kQ, kK, kV, kProbs, kAttn, kLse, kH, kRstd2, kXn2, kGate, kUp, kGateUp, kAct,
  kQPre, kKPre, kRstdQ, kRstdK, kSinkProbs,
  kRouterLogits, kRouterProbs, kRouteWeight, kRouteExpert, kPerm, kRowOfSlot, kExpertOffsets, kXp, kYp,
  // a layer's backward workspace
  kDoutT, kDact, kDgate, kDup, kDgateUp, kDhT, kDattn, kDqT, kDkT, kDvT, kDxn, kTmp, kDh, kDq, kDk, kDv,
  kDscores, kMore, kDxp, kDyp, kDweight, kDlogits, kDlogitsT,
  // the head's workspace
  kHeadXn, kHeadRstd, kHeadDxn, kRunMax, kRunSum, kTargetLogit, kHeadLse, kLogits, kDlogitsHead,
  // the CUDA backend's private region
  kBlasWorkspace, kAttentionWorkspace, kTokens, kTargets, kPositions, kUniqueTokens, kTokenOffsets, kTokenPositions,
  kInvFreq, kLossSum, kTokenCount, kColumnPartials, kSortScratch, kGemmPointers, kAuxStats, kAuxGrad, kDocuments,
  kCount
};
const char* buf_name(Buf b);

struct BufferSpec {
  Buf id;
  int64_t count;       // elements
  int32_t elem_bytes;  // bytes per element
};

struct BufferList {
  int64_t align = 4;  // every buffer's bytes are rounded up to a multiple of this
  std::vector<BufferSpec> items;
  void add(Buf id, int64_t count, int32_t elem_bytes) { items.push_back({id, count, elem_bytes}); }
  int64_t rounded(int64_t bytes) const { return (bytes + align - 1) / align * align; }
  int64_t bytes() const;                              // the sum of the rounded sizes
  int64_t floats() const { return (bytes() + 3) / 4; }  // in 4-byte cells (what the pipeline carves)
};

// A list laid out from `base` (or sized only, with base null): the address of each buffer.
class Carving {
 public:
  Carving(const BufferList& list, void* base);
  bool has(Buf id) const { return offset_[static_cast<size_t>(id)] >= 0; }
  // Buffer `id` as U: it must be in the list with elements of sizeof(U) bytes (a programming error
  // otherwise, which aborts naming the buffer). Null when the carving has no base.
  template <typename U>
  U* get(Buf id) const {
    check(id, static_cast<int32_t>(sizeof(U)));
    return base_ ? reinterpret_cast<U*>(base_ + offset_[static_cast<size_t>(id)]) : nullptr;
  }
  void* raw(Buf id) const {
    check(id, 0);
    return base_ ? base_ + offset_[static_cast<size_t>(id)] : nullptr;
  }
  int64_t bytes() const { return bytes_; }

 private:
  void check(Buf id, int32_t elem_bytes) const;
  char* base_;
  int64_t bytes_ = 0;
  std::vector<int64_t> offset_;  // by Buf, -1 when absent
  std::vector<int32_t> elem_;
};

// ---- the CPU backend (executor/src/model.cpp) ---------------------------------------------------
// In elements of `elem` bytes (4: float, 8: the double instantiation the reference checks use), with
// int32 routing indices rounded up to whole elements, and no other padding.
BufferList cpu_layer_acts(const Shape& s, int32_t elem = 4);
BufferList cpu_layer_workspace(const Shape& s, int32_t elem = 4);
BufferList cpu_head_workspace(const Shape& s, int32_t elem = 4);

// ---- the pipeline's buffers (executor/src/trainer.cpp) -----------------------------------------
// Each buffer the trainer carves from the device arena (Arena::take_floats: weight slots, hidden
// states, checkpoints, activations, gradients, workspaces) starts on a 64-byte boundary, and the
// CPU backend rounds the pipeline's part of its arena to the same (step::ActivationLayout).
inline constexpr int64_t kPipelineCarveAlign = 64;

// ---- the CUDA backend (executor/src/cuda/cuda_backend.cpp) -------------------------------------
// `t` is the compute dtype's bytes (4: fp32, 2: bf16). Every buffer is rounded up to 256 bytes.
inline constexpr int64_t kCudaCarveAlign = 256;
inline constexpr int64_t kCudaBlasWorkspaceBytes = int64_t{32} << 20;     // cuBLAS's recommendation for Hopper
inline constexpr int64_t kCudaAttentionBudgetBytes = int64_t{256} << 20;  // attention score blocks
inline constexpr int64_t kCudaLogitElems = int64_t{16} << 20;            // logits of one vocabulary chunk
int64_t cuda_attention_rows(const Shape& s);  // query rows per attention block (at most s.caps.attention_rows)
// The widest column sum the CUDA backend makes (its partials' buffer holds that many columns):
// RMSNorm weights (hidden, head_dim), the q/k/v/o biases, the router's bias and the routing
// statistics (experts). The backend refuses a wider one.
int64_t cuda_column_sum_cols(const Shape& s);
int64_t cuda_vocab_chunk(const Shape& s);     // vocabulary columns per logit chunk (at most s.caps.vocab_chunk)
BufferList cuda_layer_acts(const Shape& s, int32_t t);
BufferList cuda_layer_workspace(const Shape& s, int32_t t);
BufferList cuda_head_workspace(const Shape& s, int32_t t);
BufferList cuda_private(const Shape& s);

}  // namespace megatrain::buffers

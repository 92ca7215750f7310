#include "megatrain/core/trace_vocab.h"

#include <array>

namespace megatrain {
namespace {

constexpr std::array<const char*, kLaneCount> kLaneNames = {"GPU compute", "H2D", "D2H", "CPU optimizer", "NVMe read",
                                                            "NVMe write"};
constexpr std::array<const char*, kLaneCount> kLaneKinds = {"gpu", "h2d", "d2h", "cpu", "nvme_read", "nvme_write"};
constexpr std::array<const char*, kSpanKindCount> kKindNames = {
    "embed_forward", "forward", "head", "recompute", "backward", "embed_backward", "h2d", "h2d_checkpoint",
    "d2h", "d2h_checkpoint", "optimizer", "grad_norm", "nvme_read", "nvme_write", "stall", "grad_sum",
    "weight_gather"};
// The words a span name starts with, per kind.
constexpr std::array<const char*, kSpanKindCount> kNameStems = {
    "embed", "fwd", "head", "recompute", "bwd", "embed bwd", "h2d", "h2d checkpoint",
    "d2h grad", "d2h checkpoint", "adam", "grad norm", "nvme read", "nvme write", "stall", "grad sum",
    "weight gather"};

}  // namespace

const char* lane_name(Lane lane) { return kLaneNames[static_cast<size_t>(lane)]; }
const char* lane_kind(Lane lane) { return kLaneKinds[static_cast<size_t>(lane)]; }
const char* lane_bottleneck(Lane lane) { return kLaneKinds[static_cast<size_t>(lane)]; }

std::optional<Lane> lane_from_kind(std::string_view kind) {
  for (int k = 0; k < kLaneCount; ++k)
    if (kind == kLaneKinds[static_cast<size_t>(k)]) return static_cast<Lane>(k);
  return std::nullopt;
}

const char* span_kind_name(SpanKind kind) { return kKindNames[static_cast<size_t>(kind)]; }

std::optional<SpanKind> span_kind_from_name(std::string_view name) {
  for (int k = 0; k < kSpanKindCount; ++k)
    if (name == kKindNames[static_cast<size_t>(k)]) return static_cast<SpanKind>(k);
  return std::nullopt;
}

bool is_compute(SpanKind kind) { return kind <= SpanKind::kEmbedBackward; }

Lane lane_of(SpanKind kind) {
  switch (kind) {
    case SpanKind::kH2D: case SpanKind::kH2DCheckpoint: return Lane::kH2D;
    case SpanKind::kD2H: case SpanKind::kD2HCheckpoint: case SpanKind::kGradSum: return Lane::kD2H;
    case SpanKind::kOptimizer: case SpanKind::kGradNorm: case SpanKind::kWeightGather: return Lane::kOptimizer;
    case SpanKind::kNvmeRead: return Lane::kNvmeRead;
    case SpanKind::kNvmeWrite: return Lane::kNvmeWrite;
    default: return Lane::kCompute;
  }
}

std::string span_name(SpanKind kind, int64_t layer, int64_t micro_batch) {
  std::string n = kNameStems[static_cast<size_t>(kind)];
  // The embedding and the head are named by their kind alone; their layer field still says 0 / L+1.
  const bool named_unit = kind == SpanKind::kEmbedForward || kind == SpanKind::kEmbedBackward || kind == SpanKind::kHead;
  if (layer >= 0 && !named_unit) n += " L" + std::to_string(layer);
  if (micro_batch >= 0) n += " mb" + std::to_string(micro_batch);
  return n;
}

std::string stall_name(std::string_view reason) { return "stall: " + std::string(reason); }

}  // namespace megatrain

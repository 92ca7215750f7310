// The trace vocabulary: the lanes a step's work runs on and the kinds of span it is made of, as
// enums that the simulator, the executor and the GUI share, and the one function that names a
// span. A predicted and a measured trace of the same plan therefore line up span for span: the
// same lanes, the same kinds, the same names (ARCHITECTURE.md section 8, trace store tables).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace megatrain {

// Where work runs: the device's compute stream, the two copy directions, the host optimizer and
// the NVMe tier's reads and writes.
enum class Lane : int8_t { kCompute, kH2D, kD2H, kOptimizer, kNvmeRead, kNvmeWrite };
inline constexpr int kLaneCount = 6;
const char* lane_name(Lane lane);  // "GPU compute", "H2D", "D2H", "CPU optimizer", "NVMe read", "NVMe write"
const char* lane_kind(Lane lane);  // the trace's lanes.kind: gpu, h2d, d2h, cpu, nvme_read, nvme_write
std::optional<Lane> lane_from_kind(std::string_view kind);
// The bottleneck name of work on a lane (plan_bottleneck_names): gpu, h2d, d2h, cpu, nvme_read, nvme_write.
const char* lane_bottleneck(Lane lane);

enum class SpanKind : int8_t {
  kEmbedForward, kForward, kHead, kRecompute, kBackward, kEmbedBackward,  // compute
  kH2D, kH2DCheckpoint,                                                    // weights, checkpoint restores
  kD2H, kD2HCheckpoint,                                                    // gradients, checkpoint saves
  kOptimizer, kGradNorm,                                                   // host optimizer
  kNvmeRead, kNvmeWrite,                                                   // NVMe tier
  kStall,                                                                  // a lane waiting (name says why)
  kGradSum,                                                                // a gradient summed over the ranks
  kWeightGather,                                                           // sharded states: new weights from their owners
};
inline constexpr int kSpanKindCount = 17;
// The trace's spans.kind: embed_forward, forward, head, recompute, backward, embed_backward, h2d,
// h2d_checkpoint, d2h, d2h_checkpoint, optimizer, grad_norm, nvme_read, nvme_write, stall, grad_sum,
// weight_gather.
const char* span_kind_name(SpanKind kind);
std::optional<SpanKind> span_kind_from_name(std::string_view name);
// The lane a span kind runs on (stalls: the lane that waits, so none is implied: kCompute).
Lane lane_of(SpanKind kind);
bool is_compute(SpanKind kind);

// The span's name in both traces: "embed mb0", "fwd L3 mb1", "head mb0", "recompute L3 mb1",
// "bwd L3 mb1", "embed bwd mb0", "h2d L4", "h2d checkpoint L5 mb0", "d2h grad L3" (" mb1" when a
// round's gradient is summed per micro-batch), "d2h checkpoint L5 mb0", "adam L12", "grad norm",
// "nvme read L3", "nvme write L3", "grad sum L3". Layer and micro-batch are omitted when negative, and the
// layer is omitted for the embedding and the head (units 0 and L+1).
std::string span_name(SpanKind kind, int64_t layer, int64_t micro_batch);
// A stall span's name: "stall: weights", "stall: activations", ...
std::string stall_name(std::string_view reason);

}  // namespace megatrain

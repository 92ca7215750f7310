// HardwareProfile: what a rig can do, as the simulator and planner need it (ARCHITECTURE.md
// section 3). Read from and written to JSON ("schema": "megatrain.rig/1"). Every figure carries
// its provenance: measured (probe, when, machine), datasheet (source), or estimate (basis: how it
// was derived from other figures), so a user can tell a measured rig from a paper one.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain {

inline constexpr const char* kRigSchema = "megatrain.rig/1";

struct Provenance {
  enum class Kind { kDatasheet, kMeasured, kEstimate };
  Kind kind = Kind::kDatasheet;
  std::string source;   // datasheet: document or URL; measured: probe name; estimate: the basis
  std::string when;     // measured: ISO-8601 date/time
  std::string machine;  // measured: host name / description
  bool operator==(const Provenance&) const = default;
};

const char* provenance_kind_name(Provenance::Kind k);

// A scalar with its provenance.
struct Figure {
  double value = 0;
  Provenance provenance;
  bool operator==(const Figure&) const = default;
};

// y as a function of x, piecewise linear in log(x) between points, clamped at the ends.
// Points are sorted by x, x > 0, and there is at least one.
struct Curve {
  std::vector<std::pair<double, double>> points;
  Provenance provenance;
  double at(double x) const;
  bool operator==(const Curve&) const = default;
};

// Measured time of one decoder layer of one model shape on this device, by micro-batch (the
// profiler's layer probe, `megatrain-plan profile --model`). Used by the cost model instead of the
// sum of its op-level terms when a plan's model and sequence length match exactly.
// The probe times decoder layer 0; what kind of layer that was is recorded too (the MoE block and
// the attention window), so that the figures apply only to layers of the same kind.
struct LayerTimes {
  std::string model;  // the model's name, for the reader
  int64_t hidden = 0, intermediate = 0, heads = 0, kv_heads = 0, head_dim = 0, seq = 0;
  struct Point {
    int64_t micro_batch = 0;
    double forward_s = 0, backward_s = 0;
    // The head of one micro-batch (final norm, LM head, cross-entropy and their backward), when the
    // probe timed it (a 4th value in JSON; 0: not timed). Applies to plans of the same vocabulary.
    double head_s = 0;
    bool operator==(const Point&) const = default;
  };
  std::vector<Point> points;  // micro_batch strictly increasing
  Provenance provenance;
  // The probed layer's MoE block (all 0: a dense MLP of `intermediate`) and attention window (0:
  // the whole causal prefix). Optional in JSON; absent means 0.
  int64_t experts = 0, experts_per_token = 0, moe_intermediate = 0, window = 0;
  int64_t vocab = 0;  // the model's vocabulary, when the points hold head times (optional; 0: none)
  bool operator==(const LayerTimes&) const = default;
};

// GEMMs by shape (issue 50): a linear layer's three GEMMs, measured over a grid of its (tokens,
// in, out), each as the fraction of the peak it reaches (2 tokens in out FLOPs / seconds / peak):
//   forward          y[tokens, out] = x[tokens, in] W[out, in]^T
//   backward_data    dx[tokens, in] = dy[tokens, out] W[out, in]
//   backward_weight  dW[out, in]   += dy^T x
// A thin GEMM (one sequence's tokens against a 32k-256k vocabulary, a few rows) is costed by its
// own shape, not like a square one of the same FLOPs. Every cell of the grid holds a value: cells
// the profiler did not time (over its FLOPs or memory cap) take the best of the smaller cells
// before them. at() interpolates linearly in log(tokens), log(in), log(out), clamped at the ends.
struct GemmShapes {
  enum Op { kForward = 0, kBackwardData = 1, kBackwardWeight = 2 };
  static constexpr const char* kOpNames[3] = {"forward", "backward_data", "backward_weight"};
  std::vector<double> tokens, in, out;  // each strictly increasing and > 0
  // Per op, [tokens][in][out] row-major: fractions of peak in (0, 1].
  std::vector<double> efficiency[3];
  Provenance provenance;
  double at(Op op, double tokens, double in, double out) const;
  bool operator==(const GemmShapes&) const = default;
};

struct GpuSpec {
  std::string name;                 // "NVIDIA H200"
  Figure memory_bytes;              // device memory usable by the process
  Figure memory_bandwidth;          // bytes/s (HBM)
  Figure matmul_fp32;               // dense FLOP/s without TF32
  Figure matmul_tf32;               // dense FLOP/s
  Figure matmul_bf16;               // dense FLOP/s (no sparsity)
  Curve gemm_efficiency;            // x: FLOPs of one GEMM (2mnk), y: fraction of peak in 0..1
  // Optional, for backends whose attention kernel is not GEMM-like (the CPU backend's): its own
  // rate. x: FLOPs of one causal attention forward over a micro-batch (the lower triangle of Q.K^T
  // and P.V, 2 * tokens * seq * heads * head_dim), y: fraction of the compute dtype's peak. When
  // absent, attention costs what GEMMs of the same FLOPs cost.
  std::optional<Curve> attention_efficiency;
  std::optional<Figure> attention_backward_ratio;  // backward time / forward time (absent: 2.5)
  // Optional: the experts' grouped GEMMs of a Mixture-of-Experts layer (one call per projection
  // over every expert, each expert with its own rows). x: rows per expert (tokens routed to one
  // expert), y: the call's FLOP rate as a fraction of the compute dtype's peak, in (0, 1]. When
  // absent, the cost model takes the dense curve at the FLOPs of the whole call scaled by a
  // small-GEMM efficiency (docs/cost-model.md).
  std::optional<Curve> grouped_gemm_efficiency;
  std::optional<LayerTimes> layer_times;           // optional, model-specific
  // Optional: GEMMs by shape; when present the cost model takes linear layers' GEMMs from it
  // instead of gemm_efficiency (indexed by FLOPs only).
  std::optional<GemmShapes> gemm_shapes;
  bool operator==(const GpuSpec&) const = default;
};

// One direction of the host<->device link. The bandwidth curves are effective rates measured end
// to end (a transfer of x bytes takes x / y(x) seconds), so they already include latency_s; the
// latency is kept separately for the smallest transfers (events, flags) and for fitting.
struct LinkSpec {
  Figure latency_s;                 // fixed cost of one transfer (a tiny cudaMemcpyAsync), seconds
  Curve pinned_bandwidth;           // x: transfer bytes, y: bytes/s from/to page-locked memory
  Curve pageable_bandwidth;         // x: transfer bytes, y: bytes/s from/to pageable memory
  bool operator==(const LinkSpec&) const = default;
};

struct LinksSpec {
  std::string kind;                 // "pcie-gen4-x16" | "pcie-gen5-x16" | "nvlink-c2c" | free text
  LinkSpec h2d;
  LinkSpec d2h;
  bool full_duplex = true;          // H2D and D2H run at once at full rate each
  bool operator==(const LinksSpec&) const = default;
};

struct AdamThroughput {
  std::string state_format;         // fp32 | bf16 | q8 | q4 | q3 | q2
  int64_t threads = 1;
  Figure params_per_s;              // parameters updated per second (whole fused pass)
  bool operator==(const AdamThroughput&) const = default;
};

struct HostSpec {
  std::string cpu;                  // "2x Intel Xeon Platinum 8480+"
  Figure ram_bytes;
  Figure memory_bandwidth;          // bytes/s, all channels
  int64_t cores = 1;                // physical cores usable for the optimizer
  Figure pinnable_bytes;            // how much RAM may be page-locked
  std::vector<AdamThroughput> adam;
  bool operator==(const HostSpec&) const = default;
};

// Bandwidth of one drive for one access pattern.
struct IoPoint {
  int64_t block_bytes = 0;
  int64_t queue_depth = 1;
  double bytes_per_s = 0;
  bool operator==(const IoPoint&) const = default;
};

struct NvmeSpec {
  std::string name;                 // "Samsung PM1743 7.68 TB"
  std::string path;                 // mount point used for state files ("/mnt/nvme0")
  Figure capacity_bytes;
  std::vector<IoPoint> read;        // sorted by (block_bytes, queue_depth)
  std::vector<IoPoint> write;
  Provenance io_provenance;         // for the read/write tables
  // Bandwidth at this block size and queue depth: nearest measured queue depth at or below (the
  // smallest measured one when all are above), log-interpolated in block size among that queue
  // depth's points and clamped outside them; 0 when the table is empty.
  double read_bandwidth(int64_t block_bytes, int64_t queue_depth) const;
  double write_bandwidth(int64_t block_bytes, int64_t queue_depth) const;
  bool operator==(const NvmeSpec&) const = default;
};

// Several GPUs (optional; absent: one GPU, the rig above): `gpus_per_node` GPUs like `gpu`, each on
// a link like `links`, share one node's host (`host`: its RAM, memory bandwidth, cores and drives),
// and `nodes` such nodes form a cluster. GPUs that share a PCIe switch share its uplink to the host;
// nodes reach each other over the network at `inter_node_bandwidth` (per node, per direction).
// The simulator's multi-GPU model (docs/cost-model.md, "Data parallelism") reads it.
struct ClusterSpec {
  int64_t gpus_per_node = 1;
  int64_t nodes = 1;
  int64_t gpus_per_switch = 1;                  // GPUs behind one PCIe switch (1: each its own uplink)
  std::optional<Figure> switch_uplink_bandwidth;  // bytes/s per direction; required when gpus_per_switch > 1
  std::optional<Figure> inter_node_bandwidth;     // bytes/s per node per direction; required when nodes > 1
  std::optional<Figure> inter_node_latency_s;     // one message between nodes; required when nodes > 1
  // bytes/s per GPU per direction between the GPUs of a node (NVLink, NVSwitch); absent: peer traffic
  // (parallel.collective nccl) goes over each GPU's PCIe link.
  std::optional<Figure> gpu_peer_bandwidth;
  bool operator==(const ClusterSpec&) const = default;
};

struct HardwareProfile {
  std::string name;                 // "h200-1.5tb"
  std::string description;
  GpuSpec gpu;
  LinksSpec links;
  HostSpec host;
  std::vector<NvmeSpec> storage;    // may be empty (RAM-only rig)
  std::optional<ClusterSpec> cluster;  // several GPUs per node, several nodes (absent: one GPU)
  int64_t gpus_per_node() const { return cluster ? cluster->gpus_per_node : 1; }
  int64_t nodes() const { return cluster ? cluster->nodes : 1; }
  bool operator==(const HardwareProfile&) const = default;

  // Parses and validates; every error names the key path and what is accepted.
  static Result<HardwareProfile> from_json_text(const std::string& text, const std::string& what = "rig");
  // `name_or_path`: a path to a JSON file, or the name of a file in profiles/hardware/.
  static Result<HardwareProfile> load(const std::string& name_or_path);
  std::string to_json_text() const;  // pretty JSON; from_json_text(to_json_text()) == *this
  Status save(const std::filesystem::path& path) const;  // atomic (temp + fsync + rename)
};

}  // namespace megatrain

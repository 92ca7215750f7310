// TraceData: one opened trace held in memory in the shape the GUI paints and measures: spans per
// lane as sorted columns, a coverage pyramid per lane (busy nanoseconds per span category in bins
// at several widths, so a zoomed-out repaint touches a few bins per pixel instead of every span),
// counters per tier, steps and the step summary. Built once on a worker thread, then shared
// read-only (std::shared_ptr<const TraceData>) with the GUI thread. No Qt in this header.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/core/trace_store.h"

namespace megatrain::gui {

// What a span is drawn as. Kinds from docs/trace-format.md map onto these.
enum class SpanCategory : uint8_t { Forward, Backward, Recompute, Transfer, Optimizer, Stall, Other };
inline constexpr int kCategoryCount = 7;
SpanCategory categoryOfKind(const std::string& kind);
const char* categoryName(SpanCategory c);

using CategoryCover = std::array<float, kCategoryCount>;

// Busy nanoseconds per category in bins of binNs[level] nanoseconds starting at origin.
// Level 0 is the finest; each level above sums pairs of bins of the level below.
struct CoveragePyramid {
  int64_t origin = 0;
  std::vector<double> binNs;
  std::vector<std::vector<CategoryCover>> levels;
  bool empty() const { return levels.empty(); }
};

struct LaneData {
  TraceLane lane;
  // One entry per span, ordered by start.
  std::vector<int64_t> start, end;
  std::vector<int64_t> maxEnd;  // maxEnd[i] = max(end[0..i]): finds spans that began earlier and overlap
  std::vector<SpanCategory> category;
  std::vector<uint32_t> nameId, kindId;  // into TraceData::strings
  std::vector<int32_t> step, layer, microBatch;
  std::vector<int64_t> bytes;
  std::vector<double> flops;
  CoveragePyramid pyramid;

  size_t size() const { return start.size(); }
  // Indices [first, last) that may overlap [t0, t1): every overlapping span is inside; spans in
  // between that end before t0 are possible when lane spans overlap each other.
  std::pair<size_t, size_t> candidates(int64_t t0, int64_t t1) const;
  // The span under time t (within `slack` ns), preferring the shortest one that contains t.
  std::optional<size_t> spanAt(int64_t t, int64_t slack) const;
};

struct CounterSeries {
  std::string name;  // bytes.device, bytes.pinned, bytes.ram, bytes.nvme, queue.*
  std::vector<int64_t> t;
  std::vector<double> v;
  double peak = 0;
  double capacity = 0;  // 0: unknown
};

struct StepSummary {
  std::string source;         // simulated | measured
  bool fromSimulator = false; // figures taken from the simulator's own result
  int64_t step = -1;          // the reported step (-1: the whole trace)
  int64_t windowStart = 0, windowEnd = 0;  // its time window in the trace
  double stepTimeS = 0;
  double tokensPerS = 0;
  double tflops = 0;
  double mfu = -1;            // < 0: unknown (no rig to compare against)
  std::string bottleneck;     // gpu | h2d | d2h | cpu | host_memory | nvme_read | nvme_write | none
  std::vector<std::pair<std::string, double>> busy;    // resource -> fraction of the step
  std::vector<std::pair<std::string, double>> stalls;  // reason -> seconds in the step
};

class TraceData {
 public:
  std::string path;         // the file opened (a plan file for a simulated plan)
  std::string tracePath;    // the .mtrace behind the data, when it still exists (for exports)
  std::string displayName;
  std::map<std::string, std::string> meta;
  std::vector<LaneData> lanes;
  std::vector<std::string> strings;
  std::vector<CounterSeries> counters;
  std::vector<TraceStep> steps;
  int64_t startNs = 0, endNs = 1;
  size_t spanCount = 0;
  StepSummary summary;
  std::string planJson;     // meta "plan", or the plan file's own text
  bool openedFromPlan = false;
  // A data-parallel job's other ranks (docs/data-parallel.md): rank 0's trace is the file opened,
  // rank k's lies beside it as <stem>.rank<k><extension>; loadTraceFile reads them with it, and the
  // timeline shows the ranks side by side. Empty for a single-process trace.
  std::vector<std::shared_ptr<const TraceData>> otherRanks;

  const std::string& str(uint32_t id) const { return strings[id]; }
  const CounterSeries* counter(const std::string& name) const;
};

// Assembles a TraceData from rows; sorts, indexes, builds pyramids and the summary.
class TraceDataBuilder {
 public:
  TraceDataBuilder();
  // Returns the lane index.
  size_t addLane(const TraceLane& lane);
  void addSpan(const TraceSpan& span);  // span.lane is an index returned by addLane
  void addCounter(const TraceCounter& c);
  void addStep(const TraceStep& s);
  void setMeta(std::map<std::string, std::string> meta);
  void setPath(const std::string& path, const std::string& displayName);
  void setTracePath(const std::string& path);
  std::shared_ptr<TraceData> finish();

 private:
  uint32_t intern(const std::string& s);
  std::shared_ptr<TraceData> data_;
  std::map<std::string, uint32_t> ids_;
};

// Reads a .mtrace file, and with it the traces of a data-parallel job's other ranks that lie beside
// it (<stem>.rank1<ext>, .rank2, ... up to the first missing one; TraceData::otherRanks). Errors come
// from TraceReader (missing, not SQLite, no trace tables, corrupt), for a rank's file too, naming it.
Result<std::shared_ptr<const TraceData>> loadTraceFile(const std::filesystem::path& path);
// Simulates a plan and loads its timeline. The trace is written to `tracePath` and kept there
// (TraceData::tracePath, for exporting it later), or to a temporary file that is removed when
// `tracePath` is empty. `path` is what TraceData::path reports (the plan file, if any).
Result<std::shared_ptr<const TraceData>> simulatePlan(const Plan& plan, const std::string& displayName,
                                                      const std::string& path = {},
                                                      const std::filesystem::path& tracePath = {});
// A trace, or a plan (JSON) that is simulated (its trace kept at `simulatedTracePath` when given).
// A file that is neither is an error saying what was expected.
Result<std::shared_ptr<const TraceData>> loadAnyFile(const std::filesystem::path& path,
                                                     const std::filesystem::path& simulatedTracePath = {});

// ---- analysis ----------------------------------------------------------------------------------

// Union of the non-stall spans of a lane clipped to [t0, t1), in ns.
int64_t busyNs(const LaneData& lane, int64_t t0, int64_t t1);

struct LaneRangeStats {
  std::string lane;
  std::string kind;
  int64_t spans = 0;       // spans overlapping the range (stalls excluded)
  double busyFraction = 0; // union of spans / range length
  double bytes = 0;        // bytes of the overlapping spans, prorated by the overlap
  double flops = 0;        // likewise
  double bandwidth = 0;    // bytes / busy time (bytes/s); 0 when idle
  double stallNs = 0;      // stall spans in the range
};
std::vector<LaneRangeStats> rangeStats(const TraceData& data, int64_t t0, int64_t t1);

// Two traces side by side over their reported step windows.
struct ResourceDiff {
  std::string resource;  // a lane kind: gpu, h2d, d2h, cpu, nvme_read, nvme_write, data
  double aSeconds = 0, bSeconds = 0;  // busy time in the step
};
struct LayerDiff {
  int layer = 0;
  double aCompute = 0, bCompute = 0;    // forward + backward + recompute on compute lanes, seconds
  double aTransfer = 0, bTransfer = 0;  // H2D + D2H + NVMe spans of the layer, seconds
};
std::vector<ResourceDiff> compareResources(const TraceData& a, const TraceData& b);
std::vector<LayerDiff> compareLayers(const TraceData& a, const TraceData& b);

// What the what-if panel can change in a plan. Unset fields keep the plan's value.
struct WhatIfEdits {
  std::optional<int64_t> prefetchDepth;
  std::optional<std::string> mFormat, vFormat;  // fp32 | bf16 | q8 | q4 | q3 | q2
  std::optional<std::string> masterWeights;     // ram | nvme
  std::optional<std::string> optimizerStates;   // ram | nvme
  std::optional<int64_t> microBatch;
  std::optional<std::string> order;             // layer-major | microbatch-major
};
// Applies the edits and validates the result as a plan file would be validated. Device layer
// buffers grow to prefetch depth + 1 when needed; the old prediction is dropped.
Result<Plan> applyWhatIf(const Plan& base, const WhatIfEdits& edits);

// Human-readable figures shared by models and tooltips.
std::string formatDuration(double seconds);
std::string formatBytes(double bytes);

}  // namespace megatrain::gui

// TraceStore: one SQLite file (.mtrace) for predicted (simulated) and measured runs, with the
// schema of ARCHITECTURE.md section 8, readers for the GUI and tests, and an export to Chrome
// Trace Event JSON that Perfetto and chrome://tracing open.
//
// Threads: a TraceWriter or TraceReader is used by one thread at a time. Writers buffer rows and
// insert them in transactions (flush() or every `batch_rows`), so a million spans take seconds.
// A writer creates the file under a temporary name and renames it into place on close(), so a
// reader never sees a half-written trace.
#pragma once

#include <cstdint>
#include <limits>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain {

inline constexpr const char* kTraceSchemaVersion = "megatrain.trace/1";
// Times in a trace are nanoseconds from the run's start, 0 to 2^53 (104 days): every one of them is
// exact as a double, so a viewer zoomed in anywhere can still tell them apart. Indices (step,
// layer, micro-batch) are -1 or in [0, 2^31); lanes are numbered from 0, fewer than 2^20 of them.
inline constexpr int64_t kTraceMaxNs = int64_t{1} << 53;
inline constexpr int64_t kTraceMaxIndex = int64_t{1} << 31;
inline constexpr int64_t kTraceMaxLanes = int64_t{1} << 20;

struct TraceLane {
  int64_t id = 0;
  std::string name;  // "GPU compute", "H2D", "D2H", "CPU optimizer 0", "NVMe read", ...
  std::string kind;  // "gpu" | "h2d" | "d2h" | "cpu" | "nvme_read" | "nvme_write" | "data" | free text
};

struct TraceSpan {
  int64_t lane = 0;
  std::string name;  // "fwd L3 mb0", "h2d L4", "adam L12"
  std::string kind;  // "forward" | "backward" | "recompute" | "h2d" | "d2h" | "optimizer" | "stall" | ...
  int64_t step = -1;
  int64_t layer = -1;        // -1 when not tied to a layer
  int64_t micro_batch = -1;  // -1 when not tied to a micro-batch
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t bytes = 0;
  double flops = 0;
};

struct TraceCounter {
  std::string name;  // "bytes.device", "bytes.pinned", "bytes.ram", "bytes.nvme", "queue.nvme_read"
  int64_t t_ns = 0;
  double value = 0;
};

struct TraceStep {
  int64_t step = 0;
  double loss = 0;
  int64_t tokens = 0;
  double time_s = 0;
  // Mixture-of-Experts: the router's load-balancing loss (StepResult::aux_loss); NaN (NULL in the
  // table) for dense models and in traces written before the column existed.
  double aux_loss = std::numeric_limits<double>::quiet_NaN();
  // The evaluation loss after this step's update (--eval-data, the Python Trainer's eval_steps);
  // NaN (NULL) for steps without an evaluation and in traces written before the column existed.
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
};

class TraceWriter {
 public:
  // Creates `path` (replacing an existing file only when close() succeeds). `meta` must hold
  // "source" ("simulated" | "measured"); "plan" is recommended. The schema version is added.
  static Result<std::unique_ptr<TraceWriter>> create(const std::filesystem::path& path,
                                                     const std::map<std::string, std::string>& meta,
                                                     size_t batch_rows = 100000);
  ~TraceWriter();  // without close(), the temporary file is removed and nothing is published
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  Status set_meta(const std::string& key, const std::string& value);
  // Returns the lane id (assigned in order from 0).
  Result<int64_t> add_lane(const std::string& name, const std::string& kind);
  Status add_span(const TraceSpan& span);
  Status add_counter(const TraceCounter& counter);
  Status add_step(const TraceStep& step);
  Status flush();
  // Flushes, writes indexes, closes the database, fsyncs and renames it into place.
  Status close();

 private:
  struct Impl;
  explicit TraceWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct TraceSummary {
  int64_t span_count = 0;
  int64_t counter_count = 0;
  int64_t start_ns = 0;  // earliest span start
  int64_t end_ns = 0;    // latest span end
};

class TraceReader {
 public:
  // Opens read-only. A missing file, a file that is not SQLite, a SQLite file without the trace
  // tables, or a corrupt one is an error that says which.
  static Result<std::unique_ptr<TraceReader>> open(const std::filesystem::path& path);
  ~TraceReader();
  TraceReader(const TraceReader&) = delete;
  TraceReader& operator=(const TraceReader&) = delete;

  const std::map<std::string, std::string>& meta() const;
  const std::vector<TraceLane>& lanes() const;
  Result<TraceSummary> summary() const;
  // Spans ordered by start time; restricted to a lane and/or a time window when given
  // (a span is returned when it overlaps [t0, t1)).
  Result<std::vector<TraceSpan>> spans(std::optional<int64_t> lane = std::nullopt,
                                       std::optional<int64_t> t0_ns = std::nullopt,
                                       std::optional<int64_t> t1_ns = std::nullopt) const;
  Result<std::vector<std::string>> counter_names() const;
  // Ordered by time; all counters when `name` is empty.
  Result<std::vector<TraceCounter>> counters(const std::string& name = {}) const;
  Result<std::vector<TraceStep>> steps() const;

 private:
  struct Impl;
  explicit TraceReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes Chrome Trace Event JSON: one process, one tid per lane with `M` thread_name events,
// `X` events for spans (ts/dur in microseconds, args: step, layer, micro_batch, bytes, flops, kind),
// `C` events for counters, and the trace meta under "metadata". Written to a temporary file and
// renamed, so a failed export leaves no partial file.
Status export_chrome_trace(const TraceReader& trace, const std::filesystem::path& out_json);

}  // namespace megatrain

// Turning a simulation into the outputs users read: the `simulate --json` object and a
// TraceStore timeline (one lane per resource, stall spans, bytes-in-use counters per tier).
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "detail/stall.h"
#include "megatrain/core/trace_store.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::sim {
namespace {

using Json = nlohmann::ordered_json;

std::string span_name(const TaskSpec& t) { return megatrain::span_name(span_kind_of(t), t.layer, t.micro_batch); }

Json peak_json(const PeakBytes& p) {
  return Json{{"device", p.device}, {"pinned", p.pinned}, {"ram", p.ram}, {"nvme", p.nvme}};
}

}  // namespace

std::string result_json(const SimResult& r) {
  Json j;
  j["feasible"] = r.feasible;
  if (!r.feasible) j["reason"] = r.reason;
  j["step_time_s"] = r.step_time_s;
  j["tokens_per_s"] = r.tokens_per_s;
  j["tflops"] = r.tflops;
  j["mfu"] = r.mfu;
  j["bottleneck"] = r.feasible ? r.bottleneck : "none";
  Json busy = Json::object();
  for (const auto& [k, v] : r.busy) busy[k] = v;
  j["busy"] = busy;
  Json stalls = Json::object();
  for (const auto& [k, v] : r.stalls) stalls[k] = v;
  j["stalls"] = stalls;
  j["peak_bytes"] = peak_json(r.peak_bytes);
  j["capacity_bytes"] = peak_json(r.capacity_bytes);
  Json cp = Json::object();
  for (const auto& [k, v] : r.critical_path) cp[k] = v;
  j["critical_path"] = cp;
  j["ranks"] = r.ranks;  // data-parallel ranks: tokens and FLOPs are the job's, bytes one rank's
  j["tokens_per_step"] = r.tokens_per_step;
  j["flops_per_step"] = r.flops_per_step;
  j["weight_bytes_per_step"] = r.weight_bytes_per_step;
  j["gradient_bytes_per_step"] = r.gradient_bytes_per_step;
  j["tasks"] = r.tasks;
  j["assumptions"] = r.assumptions;
  return j.dump(2) + "\n";
}

Status write_trace(const SimResult& r, const Plan& plan, const std::filesystem::path& path) {
  if (!r.engine) return internal_error("write_trace: the simulation was run without keep_engine");
  const Engine& e = *r.engine;
  std::map<std::string, std::string> meta = {{"source", "simulated"}, {"plan", plan.to_json_text()},
                                             {"result", result_json(r)},
                                             {"step_window_ns", std::to_string(std::llround(r.step_start_s * 1e9)) + "," +
                                                                    std::to_string(std::llround((r.step_start_s + r.step_time_s) * 1e9))}};
  MT_ASSIGN_OR_RETURN(auto writer, TraceWriter::create(path, meta));
  std::vector<int64_t> lane(e.resources().size());
  for (size_t i = 0; i < e.resources().size(); ++i) {
    MT_ASSIGN_OR_RETURN(lane[i], writer->add_lane(e.resources()[i].name, e.resources()[i].kind));
  }
  auto ns = [](double s) { return static_cast<int64_t>(std::llround(s * 1e9)); };
  for (size_t t = 0; t < e.task_count(); ++t) {
    const TaskSpec& ts = e.task(static_cast<TaskId>(t));
    const TaskTimes& tt = e.times(static_cast<TaskId>(t));
    TraceSpan span;
    span.lane = lane[static_cast<size_t>(ts.resource)];
    span.name = span_name(ts);
    span.kind = span_kind_name(span_kind_of(ts));
    span.step = ts.step;
    span.layer = ts.layer;
    span.micro_batch = ts.micro_batch;
    span.start_ns = ns(tt.start);
    span.end_ns = ns(tt.end);
    span.bytes = ts.bytes;
    span.flops = ts.flops;
    MT_RETURN_IF_ERROR(writer->add_span(span));
    // A wait for a free buffer shows as a stall span before the task on its own lane.
    if (tt.start > tt.ready + 1e-9) {
      TraceSpan stall = span;
      stall.name = stall_name("buffer");
      stall.kind = span_kind_name(SpanKind::kStall);
      stall.start_ns = ns(tt.ready);
      stall.end_ns = ns(tt.start);
      stall.bytes = 0;
      stall.flops = 0;
      MT_RETURN_IF_ERROR(writer->add_span(stall));
    }
  }
  // GPU idle gaps, named by what the next task waited for.
  const auto gpu = static_cast<int32_t>(Lane::kCompute);
  double prev_end = -1;
  for (TaskId t : e.queue(gpu)) {
    const TaskTimes& tt = e.times(t);
    if (prev_end >= 0 && tt.start > prev_end + 1e-9) {
      const std::string why = detail::stall_reason(e, t);
      TraceSpan stall;
      stall.lane = lane[gpu];
      stall.name = stall_name(why);
      stall.kind = span_kind_name(SpanKind::kStall);
      stall.step = e.task(t).step;
      stall.layer = e.task(t).layer;
      stall.micro_batch = e.task(t).micro_batch;
      stall.start_ns = ns(prev_end);
      stall.end_ns = ns(tt.start);
      MT_RETURN_IF_ERROR(writer->add_span(stall));
    }
    prev_end = tt.end;
  }
  // Bytes in use per tier: the executor allocates its footprint once, at start-up, so each tier is
  // flat at its peak (written at the start and the end, as the measured trace writes them).
  const std::pair<const char*, int64_t> tiers[] = {{"bytes.device", r.peak_bytes.device}, {"bytes.pinned", r.peak_bytes.pinned},
                                                   {"bytes.ram", r.peak_bytes.ram}, {"bytes.nvme", r.peak_bytes.nvme}};
  for (const auto& [counter, v] : tiers) {
    if (v <= 0 && std::string(counter) == "bytes.nvme") continue;  // as the executor: only with an NVMe tier
    for (double t : {0.0, r.simulated_s}) MT_RETURN_IF_ERROR(writer->add_counter({counter, ns(t), static_cast<double>(v)}));
  }
  // Simulated steps: tokens and duration; the loss is unknown to a simulation (NaN).
  double prev = 0;
  std::vector<double> ends;
  for (size_t t = 0; t < e.task_count(); ++t) {
    const auto st = static_cast<size_t>(e.task(static_cast<TaskId>(t)).step);
    if (ends.size() <= st) ends.resize(st + 1, 0.0);
    ends[st] = std::max(ends[st], e.times(static_cast<TaskId>(t)).end);
  }
  for (size_t st = 0; st < ends.size(); ++st) {
    MT_RETURN_IF_ERROR(writer->add_step({static_cast<int64_t>(st), std::numeric_limits<double>::quiet_NaN(),
                                         static_cast<int64_t>(r.tokens_per_step), ends[st] - prev}));
    prev = ends[st];
  }
  return writer->close();
}

}  // namespace megatrain::sim

namespace megatrain::sim::detail {

std::string stall_reason(const Engine& e, TaskId t) {
  const TaskTimes& tt = e.times(t);
  if (tt.start > tt.ready + 1e-12) return "buffer";
  TaskId b = tt.binding;
  if (b < 0) return "other";
  const SpanKind bk = span_kind_of(e.task(b));
  if (bk == SpanKind::kH2D) {
    const TaskId root = e.times(b).binding;
    if (root >= 0) {
      const SpanKind k = span_kind_of(e.task(root));
      if (k == SpanKind::kOptimizer || k == SpanKind::kNvmeWrite || k == SpanKind::kGradNorm) return "optimizer";
    }
    return "weights";
  }
  switch (bk) {
    case SpanKind::kH2DCheckpoint: return "activations";
    case SpanKind::kD2HCheckpoint: return "checkpoint_copy";
    case SpanKind::kD2H: case SpanKind::kGradSum: return "gradients";
    case SpanKind::kOptimizer: case SpanKind::kNvmeWrite: case SpanKind::kGradNorm: case SpanKind::kNvmeRead:
    case SpanKind::kWeightGather: return "optimizer";
    default: return "other";
  }
}

}  // namespace megatrain::sim::detail

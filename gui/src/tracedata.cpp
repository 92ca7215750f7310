// TraceData: loading a trace or a plan into sorted per-lane columns, the coverage pyramids the
// painter uses when zoomed out, and the analyses the panels show (summary, range statistics,
// comparison, what-if edits). Runs on worker threads; nothing here touches Qt.
#include "megatrain/gui/tracedata.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <unistd.h>

#include "megatrain/core/trace_vocab.h"

#include <nlohmann/json.hpp>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/simulator/step_model.h"

namespace megatrain::gui {
namespace {

using Json = nlohmann::json;

bool startsWith(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

void buildPyramid(LaneData& lane, int64_t origin, int64_t total) {
  CoveragePyramid& p = lane.pyramid;
  p = {};
  if (lane.size() == 0) return;
  const size_t wanted = std::bit_ceil(std::max<size_t>(lane.size() * 2, 256));
  const size_t bins = std::min<size_t>(wanted, 65536);
  const double binNs = std::max(1.0, static_cast<double>(std::max<int64_t>(total, 1)) / static_cast<double>(bins));
  p.origin = origin;
  std::vector<CategoryCover> level(bins, CategoryCover{});
  const auto last = static_cast<int64_t>(bins) - 1;
  for (size_t i = 0; i < lane.size(); ++i) {
    const double s = static_cast<double>(lane.start[i] - origin);
    const double e = static_cast<double>(lane.end[i] - origin);
    if (e <= s) continue;
    const int c = static_cast<int>(lane.category[i]);
    const int64_t b0 = std::clamp<int64_t>(static_cast<int64_t>(s / binNs), 0, last);
    const int64_t b1 = std::clamp<int64_t>(static_cast<int64_t>(e / binNs), 0, last);
    if (b0 == b1) {
      level[static_cast<size_t>(b0)][c] += static_cast<float>(e - s);
      continue;
    }
    level[static_cast<size_t>(b0)][c] += static_cast<float>(static_cast<double>(b0 + 1) * binNs - s);
    for (int64_t b = b0 + 1; b < b1; ++b) level[static_cast<size_t>(b)][c] += static_cast<float>(binNs);
    level[static_cast<size_t>(b1)][c] += static_cast<float>(std::max(0.0, e - static_cast<double>(b1) * binNs));
  }
  p.binNs.push_back(binNs);
  p.levels.push_back(std::move(level));
  while (p.levels.back().size() > 64) {
    const auto& below = p.levels.back();
    std::vector<CategoryCover> up(below.size() / 2);
    for (size_t i = 0; i < up.size(); ++i)
      for (int c = 0; c < kCategoryCount; ++c) up[i][c] = below[2 * i][c] + below[2 * i + 1][c];
    p.binNs.push_back(p.binNs.back() * 2);
    p.levels.push_back(std::move(up));
  }
}

// Spans of a lane with a given step (or any step when step < 0) inside [t0, t1): sum of f(i, overlap).
template <typename F>
void forEachOverlap(const LaneData& lane, int64_t t0, int64_t t1, F&& f) {
  auto [first, last] = lane.candidates(t0, t1);
  for (size_t i = first; i < last; ++i) {
    const int64_t s = std::max(lane.start[i], t0);
    const int64_t e = std::min(lane.end[i], t1);
    if (e > s || (lane.start[i] == lane.end[i] && lane.start[i] >= t0 && lane.start[i] < t1)) f(i, std::max<int64_t>(0, e - s));
  }
}

std::optional<Json> parseJson(const std::string& text) {
  Json j = Json::parse(text, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

void fillCapacities(TraceData& d, const std::optional<Json>& result) {
  std::map<std::string, double> cap;
  if (result && result->contains("capacity_bytes") && (*result)["capacity_bytes"].is_object()) {
    for (auto& [k, v] : (*result)["capacity_bytes"].items())
      if (v.is_number()) cap["bytes." + k] = v.get<double>();
  } else if (!d.planJson.empty()) {
    auto plan = Plan::from_json_text(d.planJson, "the trace's plan");
    if (plan.ok()) {
      auto rig = plan->resolve_rig();
      if (rig.ok()) {
        cap["bytes.device"] = plan->placement.device_budget_bytes > 0 ? static_cast<double>(plan->placement.device_budget_bytes)
                                                                      : rig->gpu.memory_bytes.value;
        cap["bytes.pinned"] = rig->host.pinnable_bytes.value;
        cap["bytes.ram"] = rig->host.ram_bytes.value;
        double nvme = 0;
        for (const auto& s : rig->storage) nvme += s.capacity_bytes.value;
        cap["bytes.nvme"] = nvme;
      }
    }
  }
  for (auto& c : d.counters) {
    auto it = cap.find(c.name);
    if (it != cap.end()) c.capacity = it->second;
  }
}

std::string laneResource(const TraceLane& l) { return l.kind.empty() ? l.name : l.kind; }

void computeSummary(TraceData& d) {
  StepSummary& s = d.summary;
  s = {};
  auto src = d.meta.find("source");
  s.source = src == d.meta.end() ? "unknown" : src->second;

  // The reported step's window: the simulator names it; otherwise the last step's spans.
  bool haveWindow = false;
  if (auto w = d.meta.find("step_window_ns"); w != d.meta.end()) {
    long long a = 0, b = 0;
    if (std::sscanf(w->second.c_str(), "%lld,%lld", &a, &b) == 2 && b > a) {
      s.windowStart = a;
      s.windowEnd = b;
      haveWindow = true;
    }
  }
  int64_t lastStep = -1;
  for (const auto& lane : d.lanes)
    for (int32_t st : lane.step) lastStep = std::max<int64_t>(lastStep, st);
  if (!d.steps.empty()) lastStep = std::max(lastStep, d.steps.back().step);
  if (!haveWindow && lastStep >= 0) {
    int64_t a = INT64_MAX, b = INT64_MIN;
    for (const auto& lane : d.lanes)
      for (size_t i = 0; i < lane.size(); ++i)
        if (lane.step[i] == lastStep) {
          a = std::min(a, lane.start[i]);
          b = std::max(b, lane.end[i]);
        }
    if (b > a) {
      s.windowStart = a;
      s.windowEnd = b;
      s.step = lastStep;
      haveWindow = true;
    }
  }
  if (!haveWindow) {
    s.windowStart = d.startNs;
    s.windowEnd = std::max(d.endNs, d.startNs + 1);
  }
  if (s.step < 0 && haveWindow) s.step = lastStep;
  const double windowS = static_cast<double>(s.windowEnd - s.windowStart) * 1e-9;

  // Stalls in the window, by reason.
  std::map<std::string, double> stalls;
  for (const auto& lane : d.lanes)
    forEachOverlap(lane, s.windowStart, s.windowEnd, [&](size_t i, int64_t ov) {
      if (lane.category[i] != SpanCategory::Stall) return;
      std::string reason = d.str(lane.nameId[i]);
      if (startsWith(reason, "stall: ")) reason = reason.substr(7);
      stalls[reason] += static_cast<double>(ov) * 1e-9;
    });

  auto result = d.meta.count("result") ? parseJson(d.meta.at("result")) : std::nullopt;
  fillCapacities(d, result);
  if (result && result->is_object() && result->value("feasible", true)) {
    const Json& r = *result;
    s.fromSimulator = true;
    s.stepTimeS = r.value("step_time_s", 0.0);
    s.tokensPerS = r.value("tokens_per_s", 0.0);
    s.tflops = r.value("tflops", 0.0);
    s.mfu = r.value("mfu", -1.0);
    s.bottleneck = r.value("bottleneck", std::string("none"));
    if (r.contains("busy") && r["busy"].is_object())
      for (auto& [k, v] : r["busy"].items()) if (v.is_number()) s.busy.emplace_back(k, v.get<double>());
    if (r.contains("stalls") && r["stalls"].is_object())
      for (auto& [k, v] : r["stalls"].items()) if (v.is_number()) s.stalls.emplace_back(k, v.get<double>());
    return;
  }

  // Measured (or a simulated trace without its result): from the spans themselves.
  std::map<std::string, double> busy;
  for (const auto& lane : d.lanes) {
    const double f = static_cast<double>(busyNs(lane, s.windowStart, s.windowEnd)) / static_cast<double>(s.windowEnd - s.windowStart);
    double& slot = busy[laneResource(lane.lane)];
    slot = std::max(slot, f);
  }
  s.busy.assign(busy.begin(), busy.end());
  s.stalls.assign(stalls.begin(), stalls.end());
  s.stepTimeS = windowS;
  double tokens = 0;
  for (const auto& st : d.steps)
    if (st.step == s.step) {
      if (st.time_s > 0) s.stepTimeS = st.time_s;
      tokens = static_cast<double>(st.tokens);
    }
  double flops = 0;
  for (const auto& lane : d.lanes)
    forEachOverlap(lane, s.windowStart, s.windowEnd, [&](size_t i, int64_t) {
      if (lane.category[i] == SpanCategory::Forward || lane.category[i] == SpanCategory::Backward) flops += lane.flops[i];
    });
  s.mfu = -1;
  double peak = 0;
  if (!d.planJson.empty()) {
    auto plan = Plan::from_json_text(d.planJson, "the trace's plan");
    if (plan.ok()) {
      auto model = plan->resolve_model();
      auto rig = plan->resolve_rig();
      // A measured trace may not record FLOPs per span (the executor's does not): then the step's
      // model FLOPs are the model's training FLOPs per token (no recompute, as MFU counts them)
      // times the step's tokens.
      if (model.ok() && flops <= 0) flops = model->flops_per_token(plan->training.seq_len, plan->training.attention_span()).training() * tokens;
      if (model.ok() && rig.ok()) peak = sim::CostModel(*plan, *model, *rig).matmul_peak();
    }
  }
  if (s.stepTimeS > 0) {
    s.tokensPerS = tokens / s.stepTimeS;
    s.tflops = flops / s.stepTimeS * 1e-12;
  }
  if (peak > 0) s.mfu = s.tflops * 1e12 / peak;
  s.bottleneck = "none";
  double best = 0;
  for (const auto& [k, v] : s.busy)
    if (v > best) {
      best = v;
      s.bottleneck = k;
    }
}

double laneBusySeconds(const TraceData& d, const std::string& kind) {
  double best = 0;
  for (const auto& lane : d.lanes)
    if (laneResource(lane.lane) == kind)
      best += static_cast<double>(busyNs(lane, d.summary.windowStart, d.summary.windowEnd)) * 1e-9;
  return best;
}

}  // namespace

SpanCategory categoryOfKind(const std::string& k) {
  // The span kinds both programs write (megatrain/core/trace_vocab.h); traces written before it
  // may also hold grad_accumulate (the simulator's host-side gradient sum) and data.
  if (const std::optional<SpanKind> kind = span_kind_from_name(k)) {
    switch (*kind) {
      case SpanKind::kStall: return SpanCategory::Stall;
      case SpanKind::kEmbedForward: case SpanKind::kForward: case SpanKind::kHead: return SpanCategory::Forward;
      case SpanKind::kBackward: case SpanKind::kEmbedBackward: return SpanCategory::Backward;
      case SpanKind::kRecompute: return SpanCategory::Recompute;
      case SpanKind::kOptimizer: case SpanKind::kGradNorm: return SpanCategory::Optimizer;
      case SpanKind::kH2D: case SpanKind::kH2DCheckpoint: case SpanKind::kD2H: case SpanKind::kD2HCheckpoint:
      case SpanKind::kNvmeRead: case SpanKind::kNvmeWrite: case SpanKind::kGradSum: case SpanKind::kWeightGather:
        return SpanCategory::Transfer;
    }
  }
  if (k == "grad_accumulate") return SpanCategory::Backward;
  if (k == "data") return SpanCategory::Transfer;
  return SpanCategory::Other;
}

const char* categoryName(SpanCategory c) {
  switch (c) {
    case SpanCategory::Forward: return "forward";
    case SpanCategory::Backward: return "backward";
    case SpanCategory::Recompute: return "recompute";
    case SpanCategory::Transfer: return "transfer";
    case SpanCategory::Optimizer: return "optimizer";
    case SpanCategory::Stall: return "stall";
    case SpanCategory::Other: return "other";
  }
  return "other";
}

std::pair<size_t, size_t> LaneData::candidates(int64_t t0, int64_t t1) const {
  const size_t last = static_cast<size_t>(std::lower_bound(start.begin(), start.end(), t1) - start.begin());
  // maxEnd is non-decreasing: the first span that can reach t0.
  size_t first = static_cast<size_t>(std::upper_bound(maxEnd.begin(), maxEnd.end(), t0) - maxEnd.begin());
  // Zero-length spans exactly at t0 count as overlapping.
  while (first > 0 && maxEnd[first - 1] == t0 && start[first - 1] == t0) --first;
  return {std::min(first, last), last};
}

std::optional<size_t> LaneData::spanAt(int64_t t, int64_t slack) const {
  auto [first, last] = candidates(t - slack, t + slack + 1);
  std::optional<size_t> best;
  int64_t bestDur = INT64_MAX;
  int64_t bestDist = INT64_MAX;
  for (size_t i = first; i < last; ++i) {
    const int64_t dist = t < start[i] ? start[i] - t : (t >= end[i] ? t - end[i] : 0);
    if (dist > slack) continue;
    const int64_t dur = end[i] - start[i];
    // Inside beats near; among those, the shortest (a compute span beats the stall around it).
    if (dist < bestDist || (dist == bestDist && dur < bestDur)) {
      best = i;
      bestDist = dist;
      bestDur = dur;
    }
  }
  return best;
}

const CounterSeries* TraceData::counter(const std::string& name) const {
  for (const auto& c : counters)
    if (c.name == name) return &c;
  return nullptr;
}

TraceDataBuilder::TraceDataBuilder() : data_(std::make_shared<TraceData>()) {}

uint32_t TraceDataBuilder::intern(const std::string& s) {
  auto [it, inserted] = ids_.emplace(s, static_cast<uint32_t>(data_->strings.size()));
  if (inserted) data_->strings.push_back(s);
  return it->second;
}

size_t TraceDataBuilder::addLane(const TraceLane& lane) {
  LaneData l;
  l.lane = lane;
  data_->lanes.push_back(std::move(l));
  return data_->lanes.size() - 1;
}

void TraceDataBuilder::addSpan(const TraceSpan& s) {
  if (s.lane < 0 || static_cast<size_t>(s.lane) >= data_->lanes.size()) return;
  LaneData& l = data_->lanes[static_cast<size_t>(s.lane)];
  l.start.push_back(s.start_ns);
  l.end.push_back(std::max(s.end_ns, s.start_ns));
  l.category.push_back(categoryOfKind(s.kind));
  l.nameId.push_back(intern(s.name));
  l.kindId.push_back(intern(s.kind));
  l.step.push_back(static_cast<int32_t>(s.step));
  l.layer.push_back(static_cast<int32_t>(s.layer));
  l.microBatch.push_back(static_cast<int32_t>(s.micro_batch));
  l.bytes.push_back(s.bytes);
  l.flops.push_back(s.flops);
}

void TraceDataBuilder::addCounter(const TraceCounter& c) {
  CounterSeries* series = nullptr;
  for (auto& cs : data_->counters)
    if (cs.name == c.name) series = &cs;
  if (!series) {
    data_->counters.push_back({});
    series = &data_->counters.back();
    series->name = c.name;
  }
  series->t.push_back(c.t_ns);
  series->v.push_back(std::isfinite(c.value) ? c.value : 0.0);
}

void TraceDataBuilder::addStep(const TraceStep& s) { data_->steps.push_back(s); }

void TraceDataBuilder::setMeta(std::map<std::string, std::string> meta) {
  data_->meta = std::move(meta);
  if (auto it = data_->meta.find("plan"); it != data_->meta.end()) data_->planJson = it->second;
}

void TraceDataBuilder::setTracePath(const std::string& p) { data_->tracePath = p; }

void TraceDataBuilder::setPath(const std::string& path, const std::string& displayName) {
  data_->path = path;
  data_->displayName = displayName;
}

std::shared_ptr<TraceData> TraceDataBuilder::finish() {
  TraceData& d = *data_;
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  d.spanCount = 0;
  for (auto& l : d.lanes) {
    // Sort every column by start (readers return spans in start order; the builder may not be fed so).
    if (!std::is_sorted(l.start.begin(), l.start.end())) {
      std::vector<size_t> order(l.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return l.start[a] < l.start[b]; });
      auto permute = [&](auto& v) {
        std::remove_reference_t<decltype(v)> out;
        out.reserve(v.size());
        for (size_t i : order) out.push_back(v[i]);
        v.swap(out);
      };
      permute(l.start); permute(l.end); permute(l.category); permute(l.nameId); permute(l.kindId);
      permute(l.step); permute(l.layer); permute(l.microBatch); permute(l.bytes); permute(l.flops);
    }
    l.maxEnd.resize(l.size());
    int64_t m = INT64_MIN;
    for (size_t i = 0; i < l.size(); ++i) {
      m = std::max(m, l.end[i]);
      l.maxEnd[i] = m;
    }
    if (l.size()) {
      lo = std::min(lo, l.start.front());
      hi = std::max(hi, l.maxEnd.back());
    }
    d.spanCount += l.size();
  }
  for (auto& c : d.counters) {
    c.peak = c.v.empty() ? 0 : *std::max_element(c.v.begin(), c.v.end());
    if (!c.t.empty()) {
      lo = std::min(lo, c.t.front());
      hi = std::max(hi, c.t.back());
    }
  }
  if (lo > hi) lo = hi = 0;
  d.startNs = std::min<int64_t>(lo, 0);  // traces count from the start of the run
  d.endNs = std::max(hi, d.startNs + 1);
  for (auto& l : d.lanes) buildPyramid(l, d.startNs, d.endNs - d.startNs);
  computeSummary(d);
  return data_;
}

namespace {
Result<std::shared_ptr<TraceData>> loadOneTrace(const std::filesystem::path& path);
}  // namespace

Result<std::shared_ptr<const TraceData>> loadTraceFile(const std::filesystem::path& path) {
  MT_ASSIGN_OR_RETURN(std::shared_ptr<TraceData> d, loadOneTrace(path));
  // A data-parallel job's rank k > 0 writes <stem>.rank<k><ext> beside rank 0's trace (megatrain-exec
  // --trace); a file that is itself such a rank's trace has no group of its own.
  const std::string stem = path.stem().string();
  if (stem.find(".rank") == std::string::npos) {
    for (int k = 1;; ++k) {
      const std::filesystem::path rank = path.parent_path() / (stem + ".rank" + std::to_string(k) + path.extension().string());
      std::error_code ec;
      if (!std::filesystem::exists(rank, ec)) break;
      auto r = loadOneTrace(rank);
      if (!r.ok())
        return Status(r.status().code(), "rank " + std::to_string(k) + "'s trace beside " + path.filename().string() + ": " +
                                             r.status().message());
      d->otherRanks.push_back(*r);
    }
    if (!d->otherRanks.empty())
      d->displayName += " (" + std::to_string(d->otherRanks.size() + 1) + " ranks)";
  }
  return std::shared_ptr<const TraceData>(std::move(d));
}

namespace {
Result<std::shared_ptr<TraceData>> loadOneTrace(const std::filesystem::path& path) {
  MT_ASSIGN_OR_RETURN(auto reader, TraceReader::open(path));
  TraceDataBuilder b;
  b.setPath(path.string(), path.filename().string());
  b.setTracePath(path.string());
  b.setMeta(reader->meta());
  std::map<int64_t, size_t> laneIndex;
  for (const auto& l : reader->lanes()) laneIndex[l.id] = b.addLane(l);
  // Lane by lane keeps the transient row vector to one lane's spans.
  for (const auto& l : reader->lanes()) {
    auto spans = reader->spans(l.id);
    if (!spans.ok()) return spans.status().with_context(path.string());
    for (auto& s : *spans) {
      s.lane = static_cast<int64_t>(laneIndex[l.id]);
      b.addSpan(s);
    }
  }
  auto counters = reader->counters();
  if (!counters.ok()) return counters.status().with_context(path.string());
  for (const auto& c : *counters) b.addCounter(c);
  auto steps = reader->steps();
  if (!steps.ok()) return steps.status().with_context(path.string());
  for (const auto& s : *steps) b.addStep(s);
  return b.finish();
}
}  // namespace

Result<std::shared_ptr<const TraceData>> simulatePlan(const Plan& plan, const std::string& displayName,
                                                      const std::string& path, const std::filesystem::path& tracePath) {
  sim::SimOptions opt;
  opt.keep_engine = true;
  MT_ASSIGN_OR_RETURN(auto result, sim::simulate(plan, opt));
  if (!result.feasible)
    return resource_exhausted("the plan does not fit: " + result.reason +
                              " (change placement, micro-batch or prefetch depth in the what-if panel)");
  static std::atomic<int> counter{0};
  const bool keep = !tracePath.empty();
  const auto tmp = keep ? tracePath
                        : std::filesystem::temp_directory_path() /
                              ("megatrain-gui-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".mtrace");
  Status st = sim::write_trace(result, plan, tmp);
  if (!st.ok()) return st.with_context("writing the simulated timeline");
  auto loaded = loadTraceFile(tmp);
  std::error_code ec;
  if (!keep) std::filesystem::remove(tmp, ec);
  if (!loaded.ok()) return loaded.status();
  auto d = std::const_pointer_cast<TraceData>(loaded.value());
  d->tracePath = keep ? tmp.string() : std::string();
  d->path = path;
  d->displayName = displayName;
  d->openedFromPlan = true;
  std::shared_ptr<const TraceData> out = d;
  return out;
}

Result<std::shared_ptr<const TraceData>> loadAnyFile(const std::filesystem::path& path,
                                                     const std::filesystem::path& simulatedTracePath) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found(path.string() + ": no such file (expected a .mtrace trace or a plan .json)");
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument(path.string() + " is a folder; open a .mtrace trace or a plan .json file");
  std::ifstream in(path, std::ios::binary);
  char head[16] = {};
  in.read(head, sizeof head);
  const std::string magic(head, static_cast<size_t>(in.gcount()));
  if (magic.rfind("SQLite format 3", 0) == 0) return loadTraceFile(path);
  const auto first = magic.find_first_not_of(" \t\r\n");
  const bool looksJson = first != std::string::npos && magic[first] == '{';
  if (looksJson || path.extension() == ".json") {
    auto plan = Plan::load(path);
    if (!plan.ok())
      return Status(plan.status().code(), plan.status().message() +
                                              " (expected a plan file with \"schema\": \"megatrain.plan/1\", or a .mtrace trace)");
    return simulatePlan(*plan, path.filename().string() + " (simulated)", path.string(), simulatedTracePath);
  }
  if (path.extension() == ".mtrace") return loadTraceFile(path);
  return corrupt(path.string() + " is neither a MegaTrain trace (.mtrace, an SQLite file) nor a plan (JSON with \"schema\": \"megatrain.plan/1\")");
}

int64_t busyNs(const LaneData& lane, int64_t t0, int64_t t1) {
  int64_t total = 0, curS = 0, curE = INT64_MIN;
  auto [first, last] = lane.candidates(t0, t1);
  for (size_t i = first; i < last; ++i) {
    if (lane.category[i] == SpanCategory::Stall) continue;
    const int64_t s = std::max(lane.start[i], t0), e = std::min(lane.end[i], t1);
    if (e <= s) continue;
    if (s > curE) {
      if (curE > curS) total += curE - curS;
      curS = s;
      curE = e;
    } else {
      curE = std::max(curE, e);
    }
  }
  if (curE > curS) total += curE - curS;
  return total;
}

std::vector<LaneRangeStats> rangeStats(const TraceData& d, int64_t t0, int64_t t1) {
  std::vector<LaneRangeStats> out;
  if (t1 <= t0) t1 = t0 + 1;
  for (const auto& lane : d.lanes) {
    LaneRangeStats r;
    r.lane = lane.lane.name;
    r.kind = lane.lane.kind;
    forEachOverlap(lane, t0, t1, [&](size_t i, int64_t ov) {
      if (lane.category[i] == SpanCategory::Stall) {
        r.stallNs += static_cast<double>(ov);
        return;
      }
      ++r.spans;
      const int64_t dur = lane.end[i] - lane.start[i];
      const double share = dur > 0 ? static_cast<double>(ov) / static_cast<double>(dur) : 1.0;
      r.bytes += share * static_cast<double>(lane.bytes[i]);
      r.flops += share * lane.flops[i];
    });
    const int64_t busy = busyNs(lane, t0, t1);
    r.busyFraction = static_cast<double>(busy) / static_cast<double>(t1 - t0);
    r.bandwidth = busy > 0 ? r.bytes / (static_cast<double>(busy) * 1e-9) : 0;
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<ResourceDiff> compareResources(const TraceData& a, const TraceData& b) {
  std::vector<std::string> kinds;
  for (const auto* d : {&a, &b})
    for (const auto& l : d->lanes)
      if (std::find(kinds.begin(), kinds.end(), laneResource(l.lane)) == kinds.end()) kinds.push_back(laneResource(l.lane));
  std::vector<ResourceDiff> out;
  for (const auto& k : kinds) out.push_back({k, laneBusySeconds(a, k), laneBusySeconds(b, k)});
  return out;
}

std::vector<LayerDiff> compareLayers(const TraceData& a, const TraceData& b) {
  std::map<int, LayerDiff> rows;
  auto add = [&](const TraceData& d, bool isA) {
    for (const auto& lane : d.lanes)
      forEachOverlap(lane, d.summary.windowStart, d.summary.windowEnd, [&](size_t i, int64_t ov) {
        if (lane.layer[i] < 0) return;
        const SpanCategory c = lane.category[i];
        const double sec = static_cast<double>(ov) * 1e-9;
        LayerDiff& r = rows[lane.layer[i]];
        r.layer = lane.layer[i];
        if (c == SpanCategory::Forward || c == SpanCategory::Backward || c == SpanCategory::Recompute)
          (isA ? r.aCompute : r.bCompute) += sec;
        else if (c == SpanCategory::Transfer)
          (isA ? r.aTransfer : r.bTransfer) += sec;
      });
  };
  add(a, true);
  add(b, false);
  std::vector<LayerDiff> out;
  for (auto& [k, v] : rows) out.push_back(v);
  return out;
}

Result<Plan> applyWhatIf(const Plan& base, const WhatIfEdits& e) {
  Plan p = base;
  if (e.prefetchDepth) {
    // The buffers the planner would give this prefetch depth (layer_buffer_range): the whole
    // window has slots, in the backward's checkpoint blocks too.
    p.schedule.prefetch_depth = *e.prefetchDepth;
    p.schedule.device_layer_buffers = layer_buffer_range(*e.prefetchDepth, p.schedule.checkpoint_every).most;
  }
  if (e.mFormat) {
    MT_ASSIGN_OR_RETURN(p.optimizer.m_format, parse_state_format(*e.mFormat));
  }
  if (e.vFormat) {
    MT_ASSIGN_OR_RETURN(p.optimizer.v_format, parse_state_format(*e.vFormat));
  }
  if (e.masterWeights) {
    MT_ASSIGN_OR_RETURN(p.placement.master_weights, parse_tier(*e.masterWeights, "placement.master_weights"));
  }
  if (e.optimizerStates) {
    MT_ASSIGN_OR_RETURN(p.placement.optimizer_states, parse_tier(*e.optimizerStates, "placement.optimizer_states"));
  }
  if (e.microBatch) {
    p.training.micro_batch = *e.microBatch;
  }
  if (e.order) {
    MT_ASSIGN_OR_RETURN(p.schedule.order, parse_schedule_order(*e.order));
  }
  p.predicted.reset();
  // Validate exactly as a plan file is validated (names the field and the accepted values).
  auto checked = Plan::from_json_text(p.to_json_text(), "edited plan", base.base_dir);
  if (!checked.ok()) return checked.status();
  Plan out = std::move(checked).value();
  out.base_dir = base.base_dir;
  return out;
}

std::string formatDuration(double s) {
  char buf[64];
  const double a = std::fabs(s);
  if (a >= 120) std::snprintf(buf, sizeof buf, "%.2f min", s / 60);
  else if (a >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (a >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else if (a >= 1e-6) std::snprintf(buf, sizeof buf, "%.3f us", s * 1e6);
  else std::snprintf(buf, sizeof buf, "%.0f ns", s * 1e9);
  return buf;
}

std::string formatBytes(double b) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = b;
  while (std::fabs(v) >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace megatrain::gui

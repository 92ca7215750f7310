// megatrain-bench-gui: the timeline's paint path on a million spans, zoomed all the way out (issue 6:
// a full repaint under 50 ms). Every figure is a ratio against references measured in the same run:
// the naive path (one fillRect per span, what a painter without culling or aggregation does) and a
// plain QImage fill of the same size (the floor: touching every pixel once).
//
// With --open it also writes the spans to an .mtrace and times opening it as the GUI does against
// reading the same spans with core's TraceReader alone.
//
//   megatrain-bench-gui [--spans N] [--width PX] [--repeat R] [--open] [--json]
#include <QApplication>
#include <QImage>
#include <QPainter>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "bench_flags.h"
#include "megatrain/core/trace_store.h"

#include "megatrain/gui/lanepainter.h"
#include "megatrain/gui/timelinewidget.h"
#include "megatrain/gui/tracedata.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace megatrain::gui;

double bestOf(int repeat, const std::function<void()>& f) {
  double best = 1e300;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

struct Synthetic {
  std::vector<megatrain::TraceLane> lanes;
  std::vector<megatrain::TraceSpan> spans;
  std::vector<megatrain::TraceCounter> counters;
};

// Six lanes shaped like a streamed step: compute dense, copies and optimizer sparser, short spans.
Synthetic synthetic(int64_t total) {
  struct LaneShape { const char* name; const char* kind; const char* spanKind; double share; };
  const LaneShape shapes[] = {{"GPU compute", "gpu", "forward", 0.40}, {"H2D", "h2d", "h2d", 0.20},
                              {"D2H", "d2h", "d2h", 0.15}, {"CPU optimizer", "cpu", "optimizer", 0.15},
                              {"NVMe read", "nvme_read", "nvme_read", 0.05}, {"NVMe write", "nvme_write", "nvme_write", 0.05}};
  Synthetic out;
  std::mt19937_64 rng(42);
  const int64_t horizon = 600'000'000'000;  // ten minutes, as a 70B step trace
  for (const auto& s : shapes) {
    const auto lane = static_cast<int64_t>(out.lanes.size());
    out.lanes.push_back({lane, s.name, s.kind});
    const auto n = static_cast<int64_t>(static_cast<double>(total) * s.share);
    const int64_t slot = horizon / std::max<int64_t>(1, n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t start = i * slot + static_cast<int64_t>(rng() % static_cast<uint64_t>(slot / 4 + 1));
      const int64_t dur = slot / 4 + static_cast<int64_t>(rng() % static_cast<uint64_t>(slot / 2 + 1));
      const bool stall = rng() % 50 == 0;
      out.spans.push_back({lane, stall ? "stall: buffer" : "span", stall ? "stall" : s.spanKind, 0,
                           static_cast<int64_t>(i % 80), 0, start, start + dur, 1 << 20, 1e9});
    }
  }
  for (int64_t t = 0; t <= horizon; t += horizon / 20000)
    out.counters.push_back({"bytes.device", t, static_cast<double>(t % 7919) * 1e6});
  return out;
}

std::shared_ptr<const TraceData> build(const Synthetic& s) {
  TraceDataBuilder b;
  b.setMeta({{"source", "measured"}});
  for (const auto& l : s.lanes) b.addLane(l);
  for (const auto& sp : s.spans) b.addSpan(sp);
  for (const auto& c : s.counters) b.addCounter(c);
  return b.finish();
}

// Opening the trace as the GUI does (loadTraceFile: read, sort, index, pyramids, summary) against
// only reading every span through core's TraceReader. Returns {gui seconds, reader seconds}.
std::pair<double, double> timeOpen(const Synthetic& s, int repeat) {
  const auto path = std::filesystem::temp_directory_path() / ("megatrain-bench-gui-" + std::to_string(::getpid()) + ".mtrace");
  auto w = megatrain::TraceWriter::create(path, {{"source", "measured"}});
  if (!w.ok()) return {-1, -1};
  for (const auto& l : s.lanes) (void)(*w)->add_lane(l.name, l.kind);
  for (const auto& sp : s.spans) (void)(*w)->add_span(sp);
  for (const auto& c : s.counters) (void)(*w)->add_counter(c);
  if (!(*w)->close().ok()) return {-1, -1};
  size_t sink = 0;
  const double gui = bestOf(repeat, [&] {
    auto d = loadTraceFile(path);
    if (d.ok()) sink += (*d)->spanCount;
  });
  const double reader = bestOf(repeat, [&] {
    auto r = megatrain::TraceReader::open(path);
    if (!r.ok()) return;
    for (const auto& l : (*r)->lanes()) {
      auto sp = (*r)->spans(l.id);
      if (sp.ok()) sink += sp->size();
    }
  });
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (sink == 0) return {-1, -1};
  return {gui, reader};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t spans = 1'000'000;
  int width = 1600, repeat = 15;
  bool json = false, open = false;
  constexpr const char* kProgram = "megatrain-bench-gui";
  for (int i = 1; i < argc; ++i) {
    using megatrain::bench::int_arg;
    if (!std::strcmp(argv[i], "--spans")) spans = int_arg(kProgram, argc, argv, i, 1, 100'000'000);
    else if (!std::strcmp(argv[i], "--width")) width = static_cast<int>(int_arg(kProgram, argc, argv, i, 100, 16384));
    else if (!std::strcmp(argv[i], "--repeat")) repeat = static_cast<int>(int_arg(kProgram, argc, argv, i, 1, 1000));
    else if (!std::strcmp(argv[i], "--json")) json = true;
    else if (!std::strcmp(argv[i], "--open")) open = true;
    else {
      std::fprintf(stderr, "megatrain-bench-gui: unknown argument '%s' (accepted: --spans N, --width PX, --repeat R, --open, --json)\n", argv[i]);
      return 1;
    }
  }
  if (!qEnvironmentVariableIsSet("QT_QPA_PLATFORM")) qputenv("QT_QPA_PLATFORM", "offscreen");
  QApplication app(argc, argv);

  const Synthetic rows = synthetic(spans);
  const auto t0 = Clock::now();
  const auto data = build(rows);
  const double buildS = std::chrono::duration<double>(Clock::now() - t0).count();

  const int laneH = TimelineWidget::kLaneHeight, gap = TimelineWidget::kLaneGap;
  const int lanes = static_cast<int>(data->lanes.size());
  QImage img(width, lanes * (laneH + gap), QImage::Format_RGB32);
  const TimeMapping m{data->startNs, data->endNs, static_cast<double>(width)};
  auto paintAll = [&](RasterPath path, bool naive, int* prims) {
    img.fill(Qt::white);
    QPainter p(&img);
    int n = 0;
    for (int l = 0; l < lanes; ++l) {
      const QRect r(0, l * (laneH + gap), width, laneH);
      n += naive ? paintLaneNaive(p, data->lanes[static_cast<size_t>(l)], m, r)
                 : paintLane(p, *data, data->lanes[static_cast<size_t>(l)], m, r, {}, path);
    }
    if (prims) *prims = n;
  };
  int primsAuto = 0, primsExact = 0, primsNaive = 0;
  const double fillS = bestOf(repeat * 4, [&] { img.fill(QColor(0xf7, 0xf8, 0xfa)); });
  const double autoS = bestOf(repeat, [&] { paintAll(RasterPath::Auto, false, &primsAuto); });
  const double exactS = bestOf(repeat, [&] { paintAll(RasterPath::Exact, false, &primsExact); });
  const double naiveS = bestOf(std::max(1, repeat / 5), [&] { paintAll(RasterPath::Auto, true, &primsNaive); });

  // The whole widget (axis, lane names, memory chart), zoomed out.
  TimelineWidget w;
  w.resize(TimelineWidget::kGutter + width, w.contentHeight() + 40);
  w.setTrace(data);
  w.resize(TimelineWidget::kGutter + width, w.contentHeight());
  QImage wimg(w.size(), QImage::Format_RGB32);
  const double widgetS = bestOf(repeat, [&] { w.render(&wimg); });
  const double wfillS = bestOf(repeat * 4, [&] { wimg.fill(Qt::white); });
  std::pair<double, double> openS{0, 0};
  if (open) openS = timeOpen(rows, 2);

  if (json) {
    std::printf("{\"spans\": %lld, \"width\": %d, \"lanes\": %d, \"build_s\": %.4f, \"fill_ms\": %.4f, "
                "\"paint_ms\": %.3f, \"exact_ms\": %.3f, \"naive_ms\": %.3f, \"widget_ms\": %.3f, "
                "\"paint_vs_fill\": %.2f, \"naive_vs_paint\": %.2f, \"exact_vs_paint\": %.2f, \"widget_vs_fill\": %.2f, "
                "\"primitives\": %d, \"naive_primitives\": %d, \"open_s\": %.3f, \"reader_s\": %.3f}\n",
                static_cast<long long>(data->spanCount), width, lanes, buildS, fillS * 1e3, autoS * 1e3, exactS * 1e3,
                naiveS * 1e3, widgetS * 1e3, autoS / fillS, naiveS / autoS, exactS / autoS, widgetS / wfillS, primsAuto,
                primsNaive, openS.first, openS.second);
    return 0;
  }
  std::printf("megatrain-bench-gui: %lld spans on %d lanes, %d px wide, zoomed all the way out (best of %d)\n",
              static_cast<long long>(data->spanCount), lanes, width, repeat);
  std::printf("  load into memory (sort, index, pyramids, summary): %.2f s\n", buildS);
  std::printf("  %-44s %9s %12s %12s\n", "path", "ms", "vs fill", "primitives");
  std::printf("  %-44s %9.3f %11.1fx %12s\n", "reference: QImage fill of the lanes' image", fillS * 1e3, 1.0, "-");
  std::printf("  %-44s %9.3f %11.1fx %12d\n", "lane painter, auto (coverage pyramid)", autoS * 1e3, autoS / fillS, primsAuto);
  std::printf("  %-44s %9.3f %11.1fx %12d\n", "lane painter, exact per-span rasterisation", exactS * 1e3, exactS / fillS, primsExact);
  std::printf("  %-44s %9.3f %11.1fx %12d\n", "reference: naive, one fillRect per span", naiveS * 1e3, naiveS / fillS, primsNaive);
  std::printf("  %-44s %9.3f %11.1fx %12s\n", "whole TimelineWidget render (vs its own fill)", widgetS * 1e3, widgetS / wfillS, "-");
  std::printf("  naive / pyramid painter: %.0fx faster; exact / pyramid: %.1fx\n", naiveS / autoS, exactS / autoS);
  if (open)
    std::printf("  open the .mtrace as the GUI does (on a worker thread): %.2f s = %.2fx reading its spans with TraceReader alone (%.2f s)\n",
                openS.first, openS.first / openS.second, openS.second);
  return 0;
}

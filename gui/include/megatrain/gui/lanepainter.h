// The lane delegate: paints one lane (or one counter) of a trace into a rectangle through a
// TimeMapping. Spans are first rasterised into per-pixel-column coverage (per category), then each
// run of equal columns is one fillRect, so a lane costs at most one primitive per pixel however
// many spans it holds. Off-screen spans are never visited (binary search on sorted starts); when
// many spans share each pixel the lane's coverage pyramid is read instead of the spans.
#pragma once

#include <QColor>
#include <QRect>

#include <vector>

#include "megatrain/gui/timemapping.h"
#include "megatrain/gui/tracedata.h"

class QPainter;

namespace megatrain::gui {

enum class RasterPath { Auto, Exact, Pyramid };

struct LanePaintOptions {
  bool highlighted = false;  // the bottleneck's lane, or a lane the user clicked
  bool labels = true;        // span names when zoomed in far enough to read them
  int minBarHeight = 2;      // a column with any coverage is at least this tall
};

QColor categoryColor(SpanCategory c);

// The path Auto picks: the pyramid when there are several level-0 bins per pixel and more spans
// in view than a few per pixel; otherwise the spans themselves.
RasterPath chooseRasterPath(const LaneData& lane, const TimeMapping& m);

// Fraction of each column's time covered by spans, per category (columns.size() == width after).
// Pixel column c covers times [m.toTime(c), m.toTime(c + 1)).
RasterPath rasterizeLane(const LaneData& lane, const TimeMapping& m, int width, std::vector<CategoryCover>& columns,
                         RasterPath path = RasterPath::Auto);

// Paints the lane into `rect` (m.width == rect.width(), x = 0 at rect.left()). Returns the number
// of primitives drawn.
int paintLane(QPainter& p, const TraceData& data, const LaneData& lane, const TimeMapping& m, const QRect& rect,
              const LanePaintOptions& options = {}, RasterPath path = RasterPath::Auto);

// The reference the benchmark compares against: one fillRect per visible span, no aggregation.
int paintLaneNaive(QPainter& p, const LaneData& lane, const TimeMapping& m, const QRect& rect);

// A counter as a step function (the value holds until the next sample): per column the maximum in
// the column, filled from the bottom, and the capacity as a line. `scaleMax` is the value at the top.
int paintCounter(QPainter& p, const CounterSeries& c, const TimeMapping& m, const QRect& rect, double scaleMax);

}  // namespace megatrain::gui

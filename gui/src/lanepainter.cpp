// The lane delegate (see the header): rasterise spans to per-column coverage, then paint runs.
#include "megatrain/gui/lanepainter.h"

#include <QFontMetrics>
#include <QPainter>

#include <algorithm>
#include <cmath>

namespace megatrain::gui {

QColor categoryColor(SpanCategory c) {
  switch (c) {
    case SpanCategory::Forward: return QColor(0x3a, 0x7b, 0xd5);
    case SpanCategory::Backward: return QColor(0x2e, 0x9e, 0x6b);
    case SpanCategory::Recompute: return QColor(0x8a, 0x6f, 0xd1);
    case SpanCategory::Transfer: return QColor(0xe0, 0x8e, 0x2b);
    case SpanCategory::Optimizer: return QColor(0x1f, 0xa8, 0xb5);
    case SpanCategory::Stall: return QColor(0xee, 0x96, 0x98);  // pale: drawn hanging from the lane's top
    case SpanCategory::Other: return QColor(0x80, 0x80, 0x80);
  }
  return Qt::gray;
}

RasterPath chooseRasterPath(const LaneData& lane, const TimeMapping& m) {
  if (lane.pyramid.empty() || lane.pyramid.binNs[0] * 2 > m.nsPerPixel()) return RasterPath::Exact;
  auto [first, last] = lane.candidates(m.t0, m.t1);
  return (last - first) > static_cast<size_t>(4 * std::max(1.0, m.width)) ? RasterPath::Pyramid : RasterPath::Exact;
}

namespace {

void rasterExact(const LaneData& lane, const TimeMapping& m, int width, std::vector<CategoryCover>& cols) {
  auto [first, last] = lane.candidates(m.t0, m.t1);
  const double w = width;
  for (size_t i = first; i < last; ++i) {
    double x0 = m.toX(lane.start[i]);
    double x1 = m.toX(lane.end[i]);
    if (x1 < 0 || x0 >= w) continue;
    const int c = static_cast<int>(lane.category[i]);
    x0 = std::max(x0, 0.0);
    x1 = std::min(x1, w);
    if (x1 <= x0) {  // zero-length: mark its column so that it stays visible
      const int col = std::min(width - 1, static_cast<int>(x0));
      cols[static_cast<size_t>(col)][c] += 1e-3f;
      continue;
    }
    const int c0 = static_cast<int>(x0);
    const int c1 = std::min(width, static_cast<int>(std::ceil(x1)));
    for (int col = c0; col < c1; ++col) {
      const double ov = std::min(x1, col + 1.0) - std::max(x0, static_cast<double>(col));
      if (ov > 0) cols[static_cast<size_t>(col)][c] += static_cast<float>(ov);
    }
  }
}

void rasterPyramid(const LaneData& lane, const TimeMapping& m, int width, std::vector<CategoryCover>& cols) {
  const CoveragePyramid& p = lane.pyramid;
  const double nsPerPx = m.nsPerPixel();
  size_t level = 0;
  while (level + 1 < p.levels.size() && p.binNs[level + 1] * 2 <= nsPerPx) ++level;
  const auto& bins = p.levels[level];
  const double binNs = p.binNs[level];
  const double w = width;
  const auto nb = static_cast<int64_t>(bins.size());
  const int64_t b0 = std::clamp<int64_t>(static_cast<int64_t>(std::floor(static_cast<double>(m.t0 - p.origin) / binNs)), 0, nb);
  const int64_t b1 = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(static_cast<double>(m.t1 - p.origin) / binNs)) + 1, 0, nb);
  const double binPx = binNs / nsPerPx;
  for (int64_t b = b0; b < b1; ++b) {
    const CategoryCover& bin = bins[static_cast<size_t>(b)];
    float sum = 0;
    for (float v : bin) sum += v;
    if (sum <= 0) continue;
    const double xa = m.toX(static_cast<double>(p.origin) + static_cast<double>(b) * binNs);
    const double xb = xa + binPx;
    const double ca = std::max(xa, 0.0), cb = std::min(xb, w);
    if (cb <= ca) continue;
    // A bin is at most half a pixel wide here, so it touches one or two columns.
    for (int col = static_cast<int>(ca); col < std::min(width, static_cast<int>(std::ceil(cb))); ++col) {
      const double ov = std::min(cb, col + 1.0) - std::max(ca, static_cast<double>(col));
      if (ov <= 0) continue;
      // The bin's busy ns are spread evenly over it; this column gets its share, as a fraction
      // of the column's own nanoseconds.
      const auto share = static_cast<float>(ov / binPx / nsPerPx);
      for (int k = 0; k < kCategoryCount; ++k) cols[static_cast<size_t>(col)][k] += bin[k] * share;
    }
  }
}

}  // namespace

RasterPath rasterizeLane(const LaneData& lane, const TimeMapping& m, int width, std::vector<CategoryCover>& columns,
                         RasterPath path) {
  columns.assign(static_cast<size_t>(std::max(0, width)), CategoryCover{});
  if (width <= 0 || lane.size() == 0) return RasterPath::Exact;
  if (path == RasterPath::Auto) path = chooseRasterPath(lane, m);
  if (path == RasterPath::Pyramid && lane.pyramid.empty()) path = RasterPath::Exact;
  if (path == RasterPath::Pyramid) rasterPyramid(lane, m, width, columns);
  else rasterExact(lane, m, width, columns);
  return path;
}

int paintLane(QPainter& p, const TraceData& data, const LaneData& lane, const TimeMapping& m, const QRect& rect,
              const LanePaintOptions& o, RasterPath path) {
  thread_local std::vector<CategoryCover> cols;
  const int width = rect.width();
  const RasterPath used = rasterizeLane(lane, m, width, cols, path);
  const int h = rect.height();
  int primitives = 0;
  int runStart = -1, runHeight = 0, runCat = -1;
  constexpr int kStall = static_cast<int>(SpanCategory::Stall);
  auto flush = [&](int endCol) {
    if (runStart >= 0 && runHeight > 0) {
      QColor c = categoryColor(static_cast<SpanCategory>(runCat));
      if (o.highlighted) c = c.lighter(135);
      if (runCat == kStall) {
        // Waiting is not work: a pale bar hanging from the top, so that a lane that mostly waits
        // does not read as busy.
        p.fillRect(QRect(rect.left() + runStart, rect.top(), endCol - runStart, runHeight), c);
      } else {
        p.fillRect(QRect(rect.left() + runStart, rect.bottom() + 1 - runHeight, endCol - runStart, runHeight), c);
      }
      ++primitives;
    }
    runStart = -1;
  };
  for (int col = 0; col < width; ++col) {
    const CategoryCover& cc = cols[static_cast<size_t>(col)];
    float total = 0;
    int dom = 0;
    for (int k = 0; k < kCategoryCount; ++k) {
      total += cc[k];
      if (cc[k] > cc[dom]) dom = k;
    }
    int height = 0;
    if (total > 0) {
      // A stall-dominated column shows how much of it was waited, up to half the lane.
      const float frac = dom == kStall ? std::min(1.0f, cc[kStall]) * 0.5f : std::min(1.0f, total);
      const int maxH = dom == kStall ? std::max(o.minBarHeight, h / 2) : h;
      height = std::clamp(static_cast<int>(std::lround(frac * static_cast<float>(h))), o.minBarHeight, maxH);
    }
    if (height != runHeight || dom != runCat || runStart < 0) {
      flush(col);
      if (height > 0) {
        runStart = col;
        runHeight = height;
        runCat = dom;
      } else {
        runHeight = 0;
      }
    }
  }
  flush(width);

  if (o.labels && used == RasterPath::Exact) {
    auto [first, last] = lane.candidates(m.t0, m.t1);
    if (last - first <= 600) {
      const QFontMetrics fm = p.fontMetrics();
      for (size_t i = first; i < last; ++i) {
        const double x0 = std::max(0.0, m.toX(lane.start[i]));
        const double x1 = std::min(static_cast<double>(width), m.toX(lane.end[i]));
        if (x1 - x0 < 36) continue;
        const bool stall = lane.category[i] == SpanCategory::Stall;
        p.setPen(stall ? QColor(0x8a, 0x10, 0x14) : QColor(Qt::white));
        const QRect r(rect.left() + static_cast<int>(x0) + 2, rect.top(), static_cast<int>(x1 - x0) - 4, stall ? std::max(fm.height(), h / 2) : h);
        p.drawText(r, Qt::AlignVCenter | Qt::AlignLeft, fm.elidedText(QString::fromStdString(data.str(lane.nameId[i])), Qt::ElideRight, r.width()));
        ++primitives;
      }
    }
  }
  return primitives;
}

int paintLaneNaive(QPainter& p, const LaneData& lane, const TimeMapping& m, const QRect& rect) {
  auto [first, last] = lane.candidates(m.t0, m.t1);
  int n = 0;
  for (size_t i = first; i < last; ++i) {
    const double x0 = m.toX(lane.start[i]);
    const double x1 = m.toX(lane.end[i]);
    p.fillRect(QRectF(rect.left() + x0, rect.top(), std::max(1.0, x1 - x0), rect.height()),
               categoryColor(lane.category[i]));
    ++n;
  }
  return n;
}

int paintCounter(QPainter& p, const CounterSeries& c, const TimeMapping& m, const QRect& rect, double scaleMax) {
  const int width = rect.width();
  const int h = rect.height();
  if (c.t.empty() || width <= 0 || scaleMax <= 0) return 0;
  auto yOf = [&](double v) { return std::clamp(static_cast<int>(std::lround(v / scaleMax * h)), 0, h); };
  int primitives = 0;
  const QColor fill(0x3a, 0x7b, 0xd5, 150);
  // Index of the sample in force at time t (the last one at or before t).
  auto at = [&](int64_t t) -> std::ptrdiff_t {
    return (std::upper_bound(c.t.begin(), c.t.end(), t) - c.t.begin()) - 1;
  };
  std::ptrdiff_t j = at(m.toTime(0));
  int runStart = -1, runH = 0;
  auto flush = [&](int endCol) {
    if (runStart >= 0 && runH > 0) {
      p.fillRect(QRect(rect.left() + runStart, rect.bottom() + 1 - runH, endCol - runStart, runH), fill);
      ++primitives;
    }
    runStart = -1;
  };
  const auto n = static_cast<std::ptrdiff_t>(c.t.size());
  for (int col = 0; col < width; ++col) {
    const int64_t colEnd = m.toTime(col + 1);
    double maxV = j >= 0 ? c.v[static_cast<size_t>(j)] : -1;
    bool any = j >= 0;
    while (j + 1 < n && c.t[static_cast<size_t>(j + 1)] < colEnd) {
      ++j;
      maxV = std::max(maxV, c.v[static_cast<size_t>(j)]);
      any = true;
    }
    // After the last sample the series has ended.
    if (j == n - 1 && c.t.back() < m.toTime(col) && n > 1) any = false;
    const int hh = any && maxV > 0 ? std::max(1, yOf(maxV)) : 0;
    if (hh != runH || runStart < 0) {
      flush(col);
      if (hh > 0) {
        runStart = col;
        runH = hh;
      } else {
        runH = 0;
      }
    }
  }
  flush(width);
  if (c.capacity > 0 && c.capacity <= scaleMax) {
    const int y = rect.bottom() + 1 - yOf(c.capacity);
    p.setPen(QPen(QColor(0xd6, 0x36, 0x3b), 1, Qt::DashLine));
    p.drawLine(rect.left(), y, rect.right(), y);
    ++primitives;
  }
  return primitives;
}

}  // namespace megatrain::gui

// TimeMapping: the pure mapping between trace time (integer nanoseconds) and horizontal pixels that
// every painter, hit test and tooltip of the GUI goes through. A value type without Qt, so tests can
// check zoom, pan and x<->time on data rows and the benchmark can drive the painter without a window.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace megatrain::gui {

struct TimeMapping {
  int64_t t0 = 0;      // time at x = 0
  int64_t t1 = 1;      // time at x = width (exclusive end of the visible window)
  double width = 1;    // pixels

  int64_t duration() const { return std::max<int64_t>(1, t1 - t0); }
  double nsPerPixel() const { return static_cast<double>(duration()) / std::max(1.0, width); }
  // Unclamped: times outside the window map outside [0, width).
  double toX(int64_t t) const { return static_cast<double>(t - t0) / nsPerPixel(); }
  double toX(double t) const { return (t - static_cast<double>(t0)) / nsPerPixel(); }
  int64_t toTime(double x) const { return t0 + static_cast<int64_t>(std::llround(x * nsPerPixel())); }

  // factor > 1 zooms in, < 1 zooms out; the time under `anchorX` stays under it. The window never
  // shrinks below `minDuration` nanoseconds.
  TimeMapping zoomed(double factor, double anchorX, int64_t minDuration = 10) const {
    if (!(factor > 0) || !std::isfinite(factor)) return *this;
    const double anchorT = static_cast<double>(t0) + anchorX * nsPerPixel();
    double newDur = static_cast<double>(duration()) / factor;
    newDur = std::max(newDur, static_cast<double>(std::max<int64_t>(1, minDuration)));
    const double frac = anchorX / std::max(1.0, width);
    TimeMapping m = *this;
    m.t0 = static_cast<int64_t>(std::llround(anchorT - frac * newDur));
    m.t1 = m.t0 + static_cast<int64_t>(std::llround(newDur));
    return m;
  }

  // Dragging the content right by dx pixels shows earlier times.
  TimeMapping panned(double dx) const {
    const int64_t shift = static_cast<int64_t>(std::llround(dx * nsPerPixel()));
    TimeMapping m = *this;
    m.t0 -= shift;
    m.t1 -= shift;
    return m;
  }

  // Keeps the window inside [lo, hi] when it fits (shifting it, keeping its duration), and no wider
  // than hi - lo.
  TimeMapping clampedTo(int64_t lo, int64_t hi) const {
    if (hi <= lo) return *this;
    TimeMapping m = *this;
    const int64_t dur = std::min(duration(), hi - lo);
    if (m.t0 < lo) m.t0 = lo;
    if (m.t0 + dur > hi) m.t0 = hi - dur;
    m.t1 = m.t0 + dur;
    return m;
  }

  bool operator==(const TimeMapping&) const = default;
};

}  // namespace megatrain::gui

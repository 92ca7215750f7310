// TimelineWidget: lanes and memory charts on one time axis (see the header).
#include "megatrain/gui/timelinewidget.h"

#include <QHelpEvent>
#include <QKeyEvent>
#include <QMouseEvent>
#include <QPainter>
#include <QToolTip>
#include <QWheelEvent>

#include <algorithm>
#include <cmath>

#include "megatrain/gui/lanepainter.h"
#include "megatrain/gui/models.h"

namespace megatrain::gui {
namespace {

QString tierLabel(const std::string& counter) {
  if (counter == "bytes.device") return QStringLiteral("Memory: device");
  if (counter == "bytes.pinned") return QStringLiteral("Memory: pinned");
  if (counter == "bytes.ram") return QStringLiteral("Memory: RAM");
  if (counter == "bytes.nvme") return QStringLiteral("Memory: NVMe");
  return QString::fromStdString(counter);
}

int tierOrder(const std::string& n) {
  static const char* order[] = {"bytes.device", "bytes.pinned", "bytes.ram", "bytes.nvme"};
  for (int i = 0; i < 4; ++i)
    if (n == order[i]) return i;
  return 4;
}

// A step of 1, 2 or 5 times a power of ten nanoseconds giving ticks about `px` apart.
int64_t niceStep(double nsPerPx, double px) {
  const double raw = nsPerPx * px;
  double p10 = std::pow(10.0, std::floor(std::log10(std::max(1.0, raw))));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (p10 * m >= raw) return std::max<int64_t>(1, static_cast<int64_t>(p10 * m));
  return std::max<int64_t>(1, static_cast<int64_t>(p10 * 10));
}

// A tick label in the unit of the tick step, with only the digits the step needs.
QString axisLabel(int64_t t, int64_t step) {
  struct Unit { double ns; const char* name; };
  static const Unit units[] = {{60e9, "min"}, {1e9, "s"}, {1e6, "ms"}, {1e3, "us"}, {1, "ns"}};
  for (const Unit& u : units) {
    if (static_cast<double>(step) >= u.ns || u.ns == 1) {
      const double v = static_cast<double>(t) / u.ns;
      const double s = static_cast<double>(step) / u.ns;
      const int decimals = s >= 1 ? 0 : std::min(3, static_cast<int>(std::ceil(-std::log10(s))));
      return QStringLiteral("%1 %2").arg(v, 0, 'f', decimals).arg(QLatin1String(u.name));
    }
  }
  return QString::number(t);
}

}  // namespace

TimelineWidget::TimelineWidget(QWidget* parent) : QWidget(parent), zoom_(new ZoomStack(this)) {
  setMouseTracking(true);
  setFocusPolicy(Qt::StrongFocus);
  setAttribute(Qt::WA_OpaquePaintEvent);
  connect(zoom_, &ZoomStack::changed, this, [this] { update(); });
}

void TimelineWidget::setTrace(const TraceDataPtr& trace) {
  QVector<Track> t;
  if (trace) t.push_back({trace, 0, QString::fromStdString(trace->displayName)});
  setTracks(t);
}

void TimelineWidget::setTracks(const QVector<Track>& tracks) {
  tracks_ = tracks;
  selection_.reset();
  highlight_ = {-1, -1};
  auto [lo, hi] = fullRange();
  zoom_->reset({lo, hi});
  updateGeometry();
  update();
}

std::pair<int64_t, int64_t> TimelineWidget::fullRange() const {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (const auto& t : tracks_) {
    if (!t.data) continue;
    lo = std::min(lo, t.data->startNs + t.offset);
    hi = std::max(hi, t.data->endNs + t.offset);
  }
  if (lo >= hi) return {0, 1};
  return {lo, hi};
}

TimeMapping TimelineWidget::mapping() const {
  const TimeRange r = zoom_->current();
  return TimeMapping{r.start, r.end, static_cast<double>(std::max(1, width() - kGutter))};
}

QVector<int> TimelineWidget::chartedCounters(int track) const {
  QVector<int> out;
  if (track < 0 || track >= tracks_.size() || !tracks_[track].data) return out;
  const auto& cs = tracks_[track].data->counters;
  for (int i = 0; i < static_cast<int>(cs.size()); ++i)
    if (cs[static_cast<size_t>(i)].name.rfind("bytes.", 0) == 0) out.push_back(i);
  std::stable_sort(out.begin(), out.end(), [&](int a, int b) {
    return tierOrder(cs[static_cast<size_t>(a)].name) < tierOrder(cs[static_cast<size_t>(b)].name);
  });
  return out;
}

int TimelineWidget::trackTop(int track) const {
  int y = kAxisHeight;
  for (int t = 0; t < track && t < tracks_.size(); ++t) {
    if (tracks_.size() > 1) y += kTrackHeader;
    const auto& d = tracks_[t].data;
    y += static_cast<int>(d ? d->lanes.size() : 0) * (kLaneHeight + kLaneGap);
    y += static_cast<int>(chartedCounters(t).size()) * (kCounterHeight + kLaneGap);
  }
  return y;
}

QRect TimelineWidget::laneRect(int track, int lane) const {
  if (track < 0 || track >= tracks_.size() || !tracks_[track].data) return {};
  if (lane < 0 || lane >= static_cast<int>(tracks_[track].data->lanes.size())) return {};
  int y = trackTop(track) + (tracks_.size() > 1 ? kTrackHeader : 0) + lane * (kLaneHeight + kLaneGap);
  return QRect(kGutter, y, std::max(1, width() - kGutter), kLaneHeight);
}

QRect TimelineWidget::counterRect(int track, int counter) const {
  if (track < 0 || track >= tracks_.size() || !tracks_[track].data) return {};
  const int lanes = static_cast<int>(tracks_[track].data->lanes.size());
  int y = trackTop(track) + (tracks_.size() > 1 ? kTrackHeader : 0) + lanes * (kLaneHeight + kLaneGap) +
          counter * (kCounterHeight + kLaneGap);
  return QRect(kGutter, y, std::max(1, width() - kGutter), kCounterHeight);
}

int TimelineWidget::contentHeight() const { return trackTop(static_cast<int>(tracks_.size())) + 4; }

QSize TimelineWidget::sizeHint() const { return QSize(1200, std::max(200, contentHeight())); }
QSize TimelineWidget::minimumSizeHint() const { return QSize(kGutter + 200, std::max(120, contentHeight())); }

void TimelineWidget::setSelection(int64_t t0, int64_t t1) {
  if (t1 < t0) std::swap(t0, t1);
  selection_ = std::make_pair(t0, t1);
  update();
  emit selectionChanged(t0, t1);
}

void TimelineWidget::clearSelection() {
  if (!selection_) return;
  selection_.reset();
  update();
  emit selectionCleared();
}

void TimelineWidget::setHighlightedLane(int track, int lane) {
  highlight_ = {track, lane};
  update();
}

void TimelineWidget::applyMapping(const TimeMapping& m, bool push) {
  auto [lo, hi] = fullRange();
  // Allow a little room around the trace, never a window wider than it.
  const int64_t margin = (hi - lo) / 50;
  TimeMapping c = m.clampedTo(lo - margin, hi + margin);
  if (push) zoom_->push({c.t0, c.t1});
  else zoom_->setCurrent({c.t0, c.t1});
}

void TimelineWidget::zoomToSelection() {
  if (!selection_ || selection_->second <= selection_->first) return;
  zoom_->push({selection_->first, selection_->second});
}

void TimelineWidget::zoomOut() { zoom_->zoomOut(); }

void TimelineWidget::resetZoom() {
  auto [lo, hi] = fullRange();
  zoom_->reset({lo, hi});
}

void TimelineWidget::paintAxis(QPainter& p, const TimeMapping& m) {
  p.fillRect(QRect(0, 0, width(), kAxisHeight), QColor(0xf3, 0xf3, 0xf3));
  // The reported step of each track (the one the summary describes), as a band on the axis.
  for (const auto& t : tracks_) {
    if (!t.data) continue;
    const double a = std::max(0.0, m.toX(t.data->summary.windowStart + t.offset));
    const double b = std::min(m.width, m.toX(t.data->summary.windowEnd + t.offset));
    if (b > a) p.fillRect(QRectF(kGutter + a, kAxisHeight - 5, b - a, 4), QColor(0xf0, 0xb4, 0x29));
  }
  p.setPen(QColor(0x60, 0x60, 0x60));
  const int64_t step = niceStep(m.nsPerPixel(), 110);
  const int64_t first = (m.t0 / step) * step;
  for (int64_t t = first; t <= m.t1; t += step) {
    const double x = m.toX(t);
    if (x < 0) continue;
    const int xi = kGutter + static_cast<int>(x);
    p.drawLine(xi, kAxisHeight - 6, xi, kAxisHeight);
    p.drawText(xi + 3, kAxisHeight - 8, axisLabel(t, step));
  }
  p.drawLine(0, kAxisHeight - 1, width(), kAxisHeight - 1);
  p.drawText(QRect(4, 0, kGutter - 8, kAxisHeight), Qt::AlignVCenter | Qt::AlignLeft,
             tracks_.size() > 1 ? tr("time from step start") : tr("time"));
}

void TimelineWidget::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), Qt::white);
  const TimeMapping m = mapping();
  if (tracks_.isEmpty()) {
    p.setPen(QColor(0x70, 0x70, 0x70));
    p.drawText(rect(), Qt::AlignCenter, tr("Open a trace (.mtrace) or a plan (.json): File > Open, drag and drop, or the command line"));
    return;
  }
  paintAxis(p, m);
  const QColor gutterBg(0xfa, 0xfa, 0xfa);
  for (int t = 0; t < tracks_.size(); ++t) {
    const auto& tr_ = tracks_[t];
    if (!tr_.data) continue;
    const TraceData& d = *tr_.data;
    TimeMapping lm = m;  // the track's own times
    lm.t0 -= tr_.offset;
    lm.t1 -= tr_.offset;
    if (tracks_.size() > 1) {
      const int y = trackTop(t);
      p.fillRect(QRect(0, y, width(), kTrackHeader), QColor(0xe4, 0xe9, 0xf2));
      p.setPen(Qt::black);
      p.drawText(QRect(4, y, width() - 8, kTrackHeader), Qt::AlignVCenter | Qt::AlignLeft, tr_.label);
    }
    for (int l = 0; l < static_cast<int>(d.lanes.size()); ++l) {
      const QRect r = laneRect(t, l);
      const bool hl = highlight_ == std::make_pair(t, l);
      p.fillRect(QRect(0, r.top(), kGutter, r.height()), hl ? QColor(0xff, 0xf1, 0xc4) : gutterBg);
      p.fillRect(r, hl ? QColor(0xff, 0xfa, 0xe6) : QColor(0xf7, 0xf8, 0xfa));
      p.setPen(Qt::black);
      p.drawText(QRect(6, r.top(), kGutter - 10, r.height()), Qt::AlignVCenter | Qt::AlignLeft,
                 QString::fromStdString(d.lanes[static_cast<size_t>(l)].lane.name));
      p.save();
      p.setClipRect(r);
      LanePaintOptions o;
      o.highlighted = hl;
      paintLane(p, d, d.lanes[static_cast<size_t>(l)], lm, r, o);
      p.restore();
    }
    const QVector<int> cs = chartedCounters(t);
    for (int k = 0; k < cs.size(); ++k) {
      const CounterSeries& c = d.counters[static_cast<size_t>(cs[k])];
      const QRect r = counterRect(t, k);
      p.fillRect(QRect(0, r.top(), kGutter, r.height()), gutterBg);
      p.fillRect(r, QColor(0xfb, 0xfb, 0xfd));
      p.setPen(Qt::black);
      p.drawText(QRect(6, r.top() + 2, kGutter - 10, r.height() / 2), Qt::AlignTop | Qt::AlignLeft, tierLabel(c.name));
      p.setPen(QColor(0x60, 0x60, 0x60));
      const QString capText = c.capacity > 0 ? tr("peak %1 / %2").arg(qFormatBytes(c.peak), qFormatBytes(c.capacity))
                                             : tr("peak %1").arg(qFormatBytes(c.peak));
      p.drawText(QRect(6, r.top() + r.height() / 2, kGutter - 10, r.height() / 2), Qt::AlignTop | Qt::AlignLeft, capText);
      const double scale = std::max(c.peak, c.capacity) * 1.05;
      p.save();
      p.setClipRect(r);
      paintCounter(p, c, lm, r, scale);
      p.restore();
    }
  }
  if (selection_) {
    const double x0 = m.toX(selection_->first), x1 = m.toX(selection_->second);
    const int a = kGutter + static_cast<int>(std::clamp(x0, -1.0, m.width + 1));
    const int b = kGutter + static_cast<int>(std::clamp(x1, -1.0, m.width + 1));
    const QRect sel(a, kAxisHeight, std::max(1, b - a), height() - kAxisHeight);
    p.fillRect(sel, QColor(0x30, 0x60, 0xc0, 40));
    p.setPen(QColor(0x30, 0x60, 0xc0));
    p.drawLine(sel.topLeft(), sel.bottomLeft());
    p.drawLine(sel.topRight(), sel.bottomRight());
    p.drawText(QRect(a + 4, 2, 400, kAxisHeight - 4), Qt::AlignLeft | Qt::AlignVCenter,
               qFormatDuration(static_cast<double>(selection_->second - selection_->first) * 1e-9));
  }
  if (hoverX_ >= kGutter) {
    p.setPen(QColor(0, 0, 0, 70));
    p.drawLine(hoverX_, kAxisHeight, hoverX_, height());
  }
}

std::pair<int, int> TimelineWidget::laneAt(const QPoint& pos) const {
  for (int t = 0; t < tracks_.size(); ++t) {
    if (!tracks_[t].data) continue;
    for (int l = 0; l < static_cast<int>(tracks_[t].data->lanes.size()); ++l) {
      QRect r = laneRect(t, l);
      r.setLeft(0);
      if (r.contains(pos)) return {t, l};
    }
  }
  return {-1, -1};
}

QString TimelineWidget::toolTipAt(const QPoint& pos) const {
  // A memory chart: the counter's value at that time.
  for (int tk = 0; tk < tracks_.size() && pos.x() >= kGutter; ++tk) {
    const QVector<int> cs = chartedCounters(tk);
    for (int k = 0; k < cs.size(); ++k) {
      if (!counterRect(tk, k).contains(pos)) continue;
      const CounterSeries& c = tracks_[tk].data->counters[static_cast<size_t>(cs[k])];
      const int64_t at = mapping().toTime(pos.x() - kGutter) - tracks_[tk].offset;
      const auto it = std::upper_bound(c.t.begin(), c.t.end(), at);
      if (it == c.t.begin()) return {};
      const double v = c.v[static_cast<size_t>(it - c.t.begin() - 1)];
      QString tip = QStringLiteral("<b>%1</b><br>%2 at %3").arg(QString::fromStdString(c.name).toHtmlEscaped(), qFormatBytes(v),
                                                                 qFormatDuration(static_cast<double>(at) * 1e-9));
      if (c.capacity > 0) tip += tr("<br>%1 % of the capacity (%2)").arg(v / c.capacity * 100, 0, 'f', 1).arg(qFormatBytes(c.capacity));
      return tip;
    }
  }
  auto [t, l] = laneAt(pos);
  if (t < 0 || pos.x() < kGutter) return {};
  const TraceData& d = *tracks_[t].data;
  const LaneData& lane = d.lanes[static_cast<size_t>(l)];
  const TimeMapping m = mapping();
  const int64_t at = m.toTime(pos.x() - kGutter) - tracks_[t].offset;
  const auto i = lane.spanAt(at, static_cast<int64_t>(m.nsPerPixel() * 2));
  if (!i) return {};
  auto idx = [](int32_t v) { return v < 0 ? QStringLiteral("-") : QString::number(v); };
  const double dur = static_cast<double>(lane.end[*i] - lane.start[*i]) * 1e-9;
  QString tip = QStringLiteral("<b>%1</b><br>kind: %2<br>step %3, layer %4, micro-batch %5<br>start %6, duration %7")
                    .arg(QString::fromStdString(d.str(lane.nameId[*i])).toHtmlEscaped(),
                         QString::fromStdString(d.str(lane.kindId[*i])).toHtmlEscaped(), idx(lane.step[*i]),
                         idx(lane.layer[*i]), idx(lane.microBatch[*i]),
                         qFormatDuration(static_cast<double>(lane.start[*i]) * 1e-9), qFormatDuration(dur));
  if (lane.bytes[*i] > 0) {
    tip += QStringLiteral("<br>bytes: %1").arg(qFormatBytes(static_cast<double>(lane.bytes[*i])));
    if (dur > 0) tip += QStringLiteral(" (%1/s)").arg(qFormatBytes(static_cast<double>(lane.bytes[*i]) / dur));
  }
  if (lane.flops[*i] > 0) tip += QStringLiteral("<br>FLOPs: %1").arg(lane.flops[*i], 0, 'g', 4);
  if (lane.category[*i] == SpanCategory::Stall) tip += tr("<br><i>the lane waited here</i>");
  return tip;
}

bool TimelineWidget::event(QEvent* e) {
  if (e->type() == QEvent::ToolTip) {
    auto* he = static_cast<QHelpEvent*>(e);
    const QString tip = toolTipAt(he->pos());
    if (tip.isEmpty()) QToolTip::hideText();
    else QToolTip::showText(he->globalPos(), tip, this);
    return true;
  }
  return QWidget::event(e);
}

void TimelineWidget::wheelEvent(QWheelEvent* e) {
  const double steps = e->angleDelta().y() / 120.0;
  if (steps == 0 || tracks_.isEmpty()) return;
  const double x = std::max(0.0, e->position().x() - kGutter);
  applyMapping(mapping().zoomed(std::pow(1.25, steps), x), false);
  e->accept();
}

void TimelineWidget::mousePressEvent(QMouseEvent* e) {
  dragStart_ = e->pos();
  dragMapping_ = mapping();
  dragMoved_ = false;
  const bool select = e->button() == Qt::RightButton || (e->button() == Qt::LeftButton && (e->modifiers() & Qt::ShiftModifier));
  if (select) {
    drag_ = Drag::Select;
    selectAnchor_ = dragMapping_.toTime(std::max(0, e->pos().x() - kGutter));
  } else if (e->button() == Qt::LeftButton) {
    drag_ = Drag::Pan;
    setCursor(Qt::ClosedHandCursor);
  }
}

void TimelineWidget::mouseMoveEvent(QMouseEvent* e) {
  hoverX_ = e->pos().x();
  if ((e->pos() - dragStart_).manhattanLength() > 3) dragMoved_ = true;
  if (drag_ == Drag::Pan && dragMoved_) {
    applyMapping(dragMapping_.panned(e->pos().x() - dragStart_.x()), false);
  } else if (drag_ == Drag::Select && dragMoved_) {
    const int64_t t = dragMapping_.toTime(std::max(0, e->pos().x() - kGutter));
    setSelection(std::min(selectAnchor_, t), std::max(selectAnchor_, t));
  }
  update();
}

void TimelineWidget::mouseReleaseEvent(QMouseEvent* e) {
  if (!dragMoved_ && drag_ != Drag::None) {
    auto [t, l] = laneAt(e->pos());
    if (t >= 0) {
      setHighlightedLane(t, l);
      emit laneClicked(t, l);
    } else if (drag_ == Drag::Pan) {
      clearSelection();
    }
  }
  drag_ = Drag::None;
  unsetCursor();
}

void TimelineWidget::mouseDoubleClickEvent(QMouseEvent*) { zoomToSelection(); }

void TimelineWidget::keyPressEvent(QKeyEvent* e) {
  switch (e->key()) {
    case Qt::Key_Backspace: zoomOut(); break;
    case Qt::Key_Home: resetZoom(); break;
    case Qt::Key_Plus: case Qt::Key_Equal: applyMapping(mapping().zoomed(1.5, mapping().width / 2), false); break;
    case Qt::Key_Minus: applyMapping(mapping().zoomed(1 / 1.5, mapping().width / 2), false); break;
    case Qt::Key_Left: applyMapping(mapping().panned(mapping().width / 8), false); break;
    case Qt::Key_Right: applyMapping(mapping().panned(-mapping().width / 8), false); break;
    case Qt::Key_Escape: clearSelection(); break;
    default: QWidget::keyPressEvent(e);
  }
}

}  // namespace megatrain::gui

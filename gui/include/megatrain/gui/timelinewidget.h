// TimelineWidget: the time axis, one row per lane and one memory chart per tier of one or more
// traces ("tracks", each shifted by an offset so that two traces can be aligned), all through the
// same TimeMapping. Wheel zooms around the cursor, dragging pans, Shift+drag (or the right button)
// selects a range, double-click zooms to it, Backspace zooms out, Home shows everything. Hovering
// a span shows its name, kind, step, layer, micro-batch, duration and bytes.
#pragma once

#include <QVector>
#include <QWidget>

#include <optional>
#include <utility>

#include "megatrain/gui/loader.h"
#include "megatrain/gui/timemapping.h"
#include "megatrain/gui/zoomstack.h"

namespace megatrain::gui {

class TimelineWidget : public QWidget {
  Q_OBJECT
 public:
  struct Track {
    TraceDataPtr data;
    int64_t offset = 0;  // added to the trace's times to place it on the shared axis
    QString label;       // shown above the track's lanes when there are several tracks
  };

  explicit TimelineWidget(QWidget* parent = nullptr);

  void setTrace(const TraceDataPtr& trace);
  void setTracks(const QVector<Track>& tracks);
  const QVector<Track>& tracks() const { return tracks_; }
  ZoomStack* zoomStack() const { return zoom_; }

  static constexpr int kGutter = 200;    // lane names
  static constexpr int kAxisHeight = 24;
  static constexpr int kLaneHeight = 30;
  static constexpr int kLaneGap = 3;
  static constexpr int kTrackHeader = 18;
  static constexpr int kCounterHeight = 64;

  // The mapping of the content area (x = 0 at kGutter), on the shared (offset) axis.
  TimeMapping mapping() const;
  QRect laneRect(int track, int lane) const;
  QRect counterRect(int track, int counter) const;  // counter: index into the track's chartable counters
  QVector<int> chartedCounters(int track) const;      // indices into TraceData::counters
  int contentHeight() const;

  // Selection on the shared axis.
  std::optional<std::pair<int64_t, int64_t>> selection() const { return selection_; }
  void setSelection(int64_t t0, int64_t t1);
  void clearSelection();
  void setHighlightedLane(int track, int lane);  // -1 clears
  std::pair<int, int> highlightedLane() const { return highlight_; }

  // What the tooltip at `pos` says (empty when nothing is there).
  QString toolTipAt(const QPoint& pos) const;
  QSize sizeHint() const override;
  QSize minimumSizeHint() const override;

 public slots:
  void zoomToSelection();
  void zoomOut();
  void resetZoom();

 signals:
  void selectionChanged(qint64 t0, qint64 t1);
  void selectionCleared();
  void laneClicked(int track, int lane);

 protected:
  void paintEvent(QPaintEvent* e) override;
  void wheelEvent(QWheelEvent* e) override;
  void mousePressEvent(QMouseEvent* e) override;
  void mouseMoveEvent(QMouseEvent* e) override;
  void mouseReleaseEvent(QMouseEvent* e) override;
  void mouseDoubleClickEvent(QMouseEvent* e) override;
  void keyPressEvent(QKeyEvent* e) override;
  bool event(QEvent* e) override;

 private:
  void applyMapping(const TimeMapping& m, bool push);
  std::pair<int64_t, int64_t> fullRange() const;
  void paintAxis(class QPainter& p, const TimeMapping& m);
  // Track and lane under a point; lane -1 for none.
  std::pair<int, int> laneAt(const QPoint& pos) const;
  int trackTop(int track) const;

  QVector<Track> tracks_;
  ZoomStack* zoom_;
  std::optional<std::pair<int64_t, int64_t>> selection_;
  std::pair<int, int> highlight_{-1, -1};
  enum class Drag { None, Pan, Select } drag_ = Drag::None;
  QPoint dragStart_;
  TimeMapping dragMapping_;
  int64_t selectAnchor_ = 0;
  bool dragMoved_ = false;
  int hoverX_ = -1;
};

}  // namespace megatrain::gui

// ZoomStack: the visible time window and the history of zoom-ins that "zoom out" returns through.
// Wheel zoom and panning replace the top entry; zooming to a selection pushes one; zoomOut() pops.
// Lives on the GUI thread.
#pragma once

#include <QObject>
#include <QVector>

#include <cstdint>

namespace megatrain::gui {

struct TimeRange {
  int64_t start = 0;
  int64_t end = 1;
  bool operator==(const TimeRange&) const = default;
};

class ZoomStack : public QObject {
  Q_OBJECT
 public:
  explicit ZoomStack(QObject* parent = nullptr);

  TimeRange current() const { return stack_.back(); }
  TimeRange full() const { return full_; }
  int depth() const { return static_cast<int>(stack_.size()); }

  // Forgets the history; the window becomes `full`.
  void reset(TimeRange full);
  // Replaces the top entry (wheel zoom, pan).
  void setCurrent(TimeRange range);
  // Pushes a new window (zoom to a selection).
  void push(TimeRange range);
  // Returns to the previous window; false when already at the bottom.
  bool zoomOut();

 signals:
  void changed(megatrain::gui::TimeRange range);

 private:
  static TimeRange normalised(TimeRange r);
  TimeRange full_;
  QVector<TimeRange> stack_;
};

}  // namespace megatrain::gui

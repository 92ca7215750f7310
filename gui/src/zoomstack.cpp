// ZoomStack: history of visible windows (see the header).
#include "megatrain/gui/zoomstack.h"

namespace megatrain::gui {

ZoomStack::ZoomStack(QObject* parent) : QObject(parent) { stack_.push_back(full_); }

TimeRange ZoomStack::normalised(TimeRange r) {
  if (r.end < r.start) std::swap(r.start, r.end);
  if (r.end == r.start) r.end = r.start + 1;
  return r;
}

void ZoomStack::reset(TimeRange full) {
  full_ = normalised(full);
  stack_.clear();
  stack_.push_back(full_);
  emit changed(full_);
}

void ZoomStack::setCurrent(TimeRange range) {
  range = normalised(range);
  if (stack_.back() == range) return;
  stack_.back() = range;
  emit changed(range);
}

void ZoomStack::push(TimeRange range) {
  range = normalised(range);
  stack_.push_back(range);
  emit changed(range);
}

bool ZoomStack::zoomOut() {
  if (stack_.size() <= 1) {
    if (stack_.back() == full_) return false;
    stack_.back() = full_;
    emit changed(full_);
    return true;
  }
  stack_.pop_back();
  emit changed(stack_.back());
  return true;
}

}  // namespace megatrain::gui

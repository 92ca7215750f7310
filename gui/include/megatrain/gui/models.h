// The item models behind the panels: summary, lanes, spans, stalls, memory, range statistics and
// the two comparison tables. Each is a flat table model filled from a TraceData on the GUI thread.
// Qt::DisplayRole gives formatted text, Qt::UserRole the raw number (for sorting and tests), and
// RecordModel::rowKey() a stable key per row ("bottleneck", a lane name, a resource).
#pragma once

#include <QAbstractTableModel>
#include <QStringList>
#include <QVector>

#include "megatrain/gui/loader.h"
#include "megatrain/gui/tracedata.h"

namespace megatrain::gui {

class RecordModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  explicit RecordModel(QStringList headers, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation orientation, int role = Qt::DisplayRole) const override;
  QString rowKey(int row) const;
  int rowOfKey(const QString& key) const;  // -1 when absent

 protected:
  struct Cell {
    QString text;
    QVariant value;  // the raw number or text behind `text`
  };
  struct Row {
    QString key;
    QVector<Cell> cells;
    QString toolTip;
  };
  void setRows(QVector<Row> rows);
  static Cell text(const QString& s) { return {s, s}; }
  static Cell number(double v, const QString& shown) { return {shown, v}; }

 private:
  QStringList headers_;
  QVector<Row> rows_;
};

// Step time, tokens/s, TFLOP/s, MFU, busy fraction per resource, the bottleneck, stalls by reason.
class SummaryModel : public RecordModel {
  Q_OBJECT
 public:
  explicit SummaryModel(QObject* parent = nullptr);
  void setTrace(const TraceDataPtr& data);
};

// One row per training step of a measured trace: the loss, the Mixture-of-Experts load-balancing
// loss ("-" for dense models, whose traces leave it NULL), tokens, time and tokens/s.
class StepModel : public RecordModel {
  Q_OBJECT
 public:
  explicit StepModel(QObject* parent = nullptr);
  void setTrace(const TraceDataPtr& data);
};

// One row per lane: name, kind, spans, busy in the reported step.
class LaneModel : public RecordModel {
  Q_OBJECT
 public:
  explicit LaneModel(QObject* parent = nullptr);
  void setTrace(const TraceDataPtr& data);
};

// Stall reasons: count, seconds in the reported step, seconds in the whole trace.
class StallModel : public RecordModel {
  Q_OBJECT
 public:
  explicit StallModel(QObject* parent = nullptr);
  void setTrace(const TraceDataPtr& data);
};

// Bytes in use per tier: samples, peak, capacity, peak / capacity.
class MemoryModel : public RecordModel {
  Q_OBJECT
 public:
  explicit MemoryModel(QObject* parent = nullptr);
  void setTrace(const TraceDataPtr& data);
};

// Per lane over a selected time range: busy %, spans, bytes, FLOPs, achieved bandwidth and FLOP rate.
class RangeStatsModel : public RecordModel {
  Q_OBJECT
 public:
  explicit RangeStatsModel(QObject* parent = nullptr);
  void setRange(const TraceDataPtr& data, int64_t t0, int64_t t1);
  void clear();
};

// A vs B busy seconds per resource in each trace's reported step.
class CompareResourceModel : public RecordModel {
  Q_OBJECT
 public:
  explicit CompareResourceModel(QObject* parent = nullptr);
  void setTraces(const TraceDataPtr& a, const TraceDataPtr& b);
};

// A vs B per layer: compute and transfer seconds in each trace's reported step.
class CompareLayerModel : public RecordModel {
  Q_OBJECT
 public:
  explicit CompareLayerModel(QObject* parent = nullptr);
  void setTraces(const TraceDataPtr& a, const TraceDataPtr& b);
};

// The spans of one lane inside a time window, read directly from the lane's columns (a million
// rows cost nothing until shown).
class SpanListModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  explicit SpanListModel(QObject* parent = nullptr);
  void setLane(const TraceDataPtr& data, int lane, int64_t t0, int64_t t1);
  void clear();
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation orientation, int role = Qt::DisplayRole) const override;
  size_t spanIndex(int row) const { return first_ + static_cast<size_t>(row); }

 private:
  TraceDataPtr data_;
  int lane_ = -1;
  size_t first_ = 0, count_ = 0;
};

QString qFormatDuration(double seconds);
QString qFormatBytes(double bytes);

}  // namespace megatrain::gui

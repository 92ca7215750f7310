// The panels' item models (see the header).
#include "megatrain/gui/models.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace megatrain::gui {

QString qFormatDuration(double s) { return QString::fromStdString(formatDuration(s)); }
QString qFormatBytes(double b) { return QString::fromStdString(formatBytes(b)); }

namespace {

QString percent(double f) { return QStringLiteral("%1 %").arg(f * 100, 0, 'f', 1); }
QString flopsText(double f) {
  if (f >= 1e12) return QStringLiteral("%1 TFLOP").arg(f / 1e12, 0, 'f', 2);
  if (f >= 1e9) return QStringLiteral("%1 GFLOP").arg(f / 1e9, 0, 'f', 2);
  return QStringLiteral("%1 MFLOP").arg(f / 1e6, 0, 'f', 2);
}
QString signedSeconds(double s) { return (s > 0 ? QStringLiteral("+") : QString()) + qFormatDuration(s); }

}  // namespace

// ---- RecordModel -------------------------------------------------------------------------------

RecordModel::RecordModel(QStringList headers, QObject* parent) : QAbstractTableModel(parent), headers_(std::move(headers)) {}

int RecordModel::rowCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : static_cast<int>(rows_.size()); }
int RecordModel::columnCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : static_cast<int>(headers_.size()); }

QVariant RecordModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid)) return {};
  const Row& r = rows_[index.row()];
  if (index.column() >= r.cells.size()) return {};
  const Cell& c = r.cells[index.column()];
  switch (role) {
    case Qt::DisplayRole: return c.text;
    case Qt::UserRole: return c.value;
    case Qt::ToolTipRole: return r.toolTip.isEmpty() ? QVariant() : QVariant(r.toolTip);
    case Qt::TextAlignmentRole:
      return index.column() == 0 ? QVariant(int(Qt::AlignLeft | Qt::AlignVCenter)) : QVariant(int(Qt::AlignRight | Qt::AlignVCenter));
    default: return {};
  }
}

QVariant RecordModel::headerData(int section, Qt::Orientation orientation, int role) const {
  if (role != Qt::DisplayRole) return {};
  if (orientation == Qt::Horizontal) return section >= 0 && section < headers_.size() ? QVariant(headers_[section]) : QVariant();
  return section + 1;
}

QString RecordModel::rowKey(int row) const { return row >= 0 && row < rows_.size() ? rows_[row].key : QString(); }

int RecordModel::rowOfKey(const QString& key) const {
  for (int i = 0; i < rows_.size(); ++i)
    if (rows_[i].key == key) return i;
  return -1;
}

void RecordModel::setRows(QVector<Row> rows) {
  beginResetModel();
  rows_ = std::move(rows);
  endResetModel();
}

// ---- SummaryModel ------------------------------------------------------------------------------

SummaryModel::SummaryModel(QObject* parent) : RecordModel({tr("Metric"), tr("Value")}, parent) {}

namespace {
// A step's loss as shown: a simulation computes none (its steps table holds NaN), and a measured
// run's non-finite loss is said in words rather than printed as "nan".
QString lossText(double loss, const std::string& source) {
  if (std::isfinite(loss)) return QString::number(loss, 'f', 4);
  if (source == "simulated") return QObject::tr("none (a simulation has no loss)");
  return std::isnan(loss) ? QObject::tr("not a number (the run diverged)") : QObject::tr("infinite (the run diverged)");
}
}  // namespace

void SummaryModel::setTrace(const TraceDataPtr& d) {
  QVector<Row> rows;
  if (!d) {
    setRows({});
    return;
  }
  const StepSummary& s = d->summary;
  auto add = [&](const QString& key, const QString& label, double v, const QString& shown, const QString& tip = {}) {
    rows.push_back({key, {text(label), number(v, shown)}, tip});
  };
  rows.push_back({QStringLiteral("source"), {text(tr("Source")), text(QString::fromStdString(s.source) +
                  (s.fromSimulator ? tr(" (simulator's result)") : QString()))}, {}});
  add(QStringLiteral("step"), tr("Reported step"), static_cast<double>(s.step), s.step >= 0 ? QString::number(s.step) : tr("whole trace"));
  add(QStringLiteral("step_time"), tr("Step time"), s.stepTimeS, qFormatDuration(s.stepTimeS));
  add(QStringLiteral("tokens_per_s"), tr("Tokens/s"), s.tokensPerS, QString::number(s.tokensPerS, 'f', 0));
  add(QStringLiteral("tflops"), tr("TFLOP/s"), s.tflops, QString::number(s.tflops, 'f', 3));
  add(QStringLiteral("mfu"), tr("MFU"), s.mfu, s.mfu >= 0 ? percent(s.mfu) : tr("unknown (needs the trace's plan with a rig from profiles/)"));
  for (const auto& st : d->steps)
    if (st.step == s.step) {
      add(QStringLiteral("loss"), tr("Loss"), st.loss, lossText(st.loss, s.source));
      if (std::isfinite(st.aux_loss))
        add(QStringLiteral("aux_loss"), tr("Aux loss (load balancing)"), st.aux_loss, QString::number(st.aux_loss, 'f', 4));
      if (std::isfinite(st.eval_loss))
        add(QStringLiteral("eval_loss"), tr("Eval loss (after this step)"), st.eval_loss, QString::number(st.eval_loss, 'f', 4));
    }
  rows.push_back({QStringLiteral("bottleneck"), {text(tr("Bottleneck")), text(QString::fromStdString(s.bottleneck))},
                  tr("Click to select this resource's lane and the reported step")});
  for (const auto& [k, v] : s.busy)
    add(QStringLiteral("busy.") + QString::fromStdString(k), tr("Busy: %1").arg(QString::fromStdString(k)), v, percent(v));
  // The largest stall reasons by name; a long tail (a trace with free-text stall names) is summed.
  auto stalls = s.stalls;
  std::stable_sort(stalls.begin(), stalls.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  constexpr size_t kShown = 8;
  double stallTotal = 0, rest = 0;
  for (size_t i = 0; i < stalls.size(); ++i) {
    const auto& [k, v] = stalls[i];
    stallTotal += v;
    if (i < kShown) add(QStringLiteral("stall.") + QString::fromStdString(k), tr("Stall: %1").arg(QString::fromStdString(k)), v, qFormatDuration(v));
    else rest += v;
  }
  if (stalls.size() > kShown)
    add(QStringLiteral("stall.other"), tr("Stall: %n other reason(s)", nullptr, static_cast<int>(stalls.size() - kShown)), rest, qFormatDuration(rest));
  add(QStringLiteral("stall_total"), tr("Stall time (all reasons)"), stallTotal, qFormatDuration(stallTotal));
  add(QStringLiteral("spans"), tr("Spans in trace"), static_cast<double>(d->spanCount), QString::number(d->spanCount));
  setRows(std::move(rows));
}

// ---- StepModel ---------------------------------------------------------------------------------

StepModel::StepModel(QObject* parent)
    : RecordModel({tr("Step"), tr("Loss"), tr("Aux loss"), tr("Tokens"), tr("Time"), tr("Tokens/s"), tr("Eval loss")}, parent) {}

void StepModel::setTrace(const TraceDataPtr& d) {
  QVector<Row> rows;
  if (d) {
    for (const auto& s : d->steps) {
      const bool aux = std::isfinite(s.aux_loss);
      const double rate = s.time_s > 0 ? static_cast<double>(s.tokens) / s.time_s : 0;
      rows.push_back({QString::number(s.step),
                      {number(static_cast<double>(s.step), QString::number(s.step)), number(s.loss, lossText(s.loss, d->summary.source)),
                       aux ? number(s.aux_loss, QString::number(s.aux_loss, 'f', 4)) : Cell{QStringLiteral("-"), QVariant()},
                       number(static_cast<double>(s.tokens), QString::number(s.tokens)), number(s.time_s, qFormatDuration(s.time_s)),
                       number(rate, QString::number(rate, 'f', 0)),
                       std::isfinite(s.eval_loss) ? number(s.eval_loss, QString::number(s.eval_loss, 'f', 4)) : Cell{QStringLiteral("-"), QVariant()}},
                      aux ? tr("Aux loss: the routers' load-balancing loss (HF load_balancing_loss_func), mean over the step's micro-batches")
                          : QString()});
    }
  }
  setRows(std::move(rows));
}

// ---- LaneModel ---------------------------------------------------------------------------------

LaneModel::LaneModel(QObject* parent) : RecordModel({tr("Lane"), tr("Kind"), tr("Spans"), tr("Busy in step")}, parent) {}

void LaneModel::setTrace(const TraceDataPtr& d) {
  QVector<Row> rows;
  if (d) {
    const auto& s = d->summary;
    for (const auto& l : d->lanes) {
      const double f = static_cast<double>(busyNs(l, s.windowStart, s.windowEnd)) / static_cast<double>(std::max<int64_t>(1, s.windowEnd - s.windowStart));
      rows.push_back({QString::fromStdString(l.lane.name),
                      {text(QString::fromStdString(l.lane.name)), text(QString::fromStdString(l.lane.kind)),
                       number(static_cast<double>(l.size()), QString::number(l.size())), number(f, percent(f))},
                      {}});
    }
  }
  setRows(std::move(rows));
}

// ---- StallModel --------------------------------------------------------------------------------

StallModel::StallModel(QObject* parent) : RecordModel({tr("Reason"), tr("Count"), tr("In step"), tr("In trace")}, parent) {}

void StallModel::setTrace(const TraceDataPtr& d) {
  QVector<Row> rows;
  if (d) {
    struct Agg { int64_t count = 0; double total = 0; };
    std::map<std::string, Agg> agg;
    for (const auto& l : d->lanes)
      for (size_t i = 0; i < l.size(); ++i)
        if (l.category[i] == SpanCategory::Stall) {
          std::string r = d->str(l.nameId[i]);
          if (r.rfind("stall: ", 0) == 0) r = r.substr(7);
          auto& a = agg[r];
          ++a.count;
          a.total += static_cast<double>(l.end[i] - l.start[i]) * 1e-9;
        }
    std::map<std::string, double> inStep(d->summary.stalls.begin(), d->summary.stalls.end());
    for (const auto& [k, v] : inStep) agg.try_emplace(k);
    for (const auto& [k, a] : agg) {
      const double st = inStep.count(k) ? inStep[k] : 0.0;
      rows.push_back({QString::fromStdString(k),
                      {text(QString::fromStdString(k)), number(static_cast<double>(a.count), QString::number(a.count)),
                       number(st, qFormatDuration(st)), number(a.total, qFormatDuration(a.total))},
                      {}});
    }
  }
  setRows(std::move(rows));
}

// ---- MemoryModel -------------------------------------------------------------------------------

MemoryModel::MemoryModel(QObject* parent)
    : RecordModel({tr("Counter"), tr("Samples"), tr("Peak"), tr("Capacity"), tr("Peak / capacity")}, parent) {}

void MemoryModel::setTrace(const TraceDataPtr& d) {
  QVector<Row> rows;
  if (d) {
    for (const auto& c : d->counters) {
      const bool isBytes = c.name.rfind("bytes.", 0) == 0;
      auto fmt = [&](double v) { return isBytes ? qFormatBytes(v) : QString::number(v, 'g', 6); };
      const double ratio = c.capacity > 0 ? c.peak / c.capacity : -1;
      rows.push_back({QString::fromStdString(c.name),
                      {text(QString::fromStdString(c.name)), number(static_cast<double>(c.t.size()), QString::number(c.t.size())),
                       number(c.peak, fmt(c.peak)), number(c.capacity, c.capacity > 0 ? fmt(c.capacity) : tr("unknown")),
                       number(ratio, ratio >= 0 ? percent(ratio) : QStringLiteral("-"))},
                      {}});
    }
  }
  setRows(std::move(rows));
}

// ---- RangeStatsModel ---------------------------------------------------------------------------

RangeStatsModel::RangeStatsModel(QObject* parent)
    : RecordModel({tr("Lane"), tr("Busy"), tr("Spans"), tr("Bytes"), tr("Bandwidth"), tr("FLOPs"), tr("FLOP rate"), tr("Stalled")}, parent) {}

void RangeStatsModel::clear() { setRows({}); }

void RangeStatsModel::setRange(const TraceDataPtr& d, int64_t t0, int64_t t1) {
  QVector<Row> rows;
  if (d) {
    const double len = static_cast<double>(std::max<int64_t>(1, t1 - t0)) * 1e-9;
    for (const auto& r : rangeStats(*d, t0, t1)) {
      const double busyS = r.busyFraction * len;
      const double rate = busyS > 0 ? r.flops / busyS : 0;
      rows.push_back({QString::fromStdString(r.lane),
                      {text(QString::fromStdString(r.lane)), number(r.busyFraction, percent(r.busyFraction)),
                       number(static_cast<double>(r.spans), QString::number(r.spans)), number(r.bytes, qFormatBytes(r.bytes)),
                       number(r.bandwidth, r.bandwidth > 0 ? qFormatBytes(r.bandwidth) + QStringLiteral("/s") : QStringLiteral("-")),
                       number(r.flops, r.flops > 0 ? flopsText(r.flops) : QStringLiteral("-")),
                       number(rate, rate > 0 ? QStringLiteral("%1 TFLOP/s").arg(rate / 1e12, 0, 'f', 2) : QStringLiteral("-")),
                       number(r.stallNs * 1e-9, qFormatDuration(r.stallNs * 1e-9))},
                      tr("Bandwidth and FLOP rate are per busy second of the lane inside the range")});
    }
  }
  setRows(std::move(rows));
}

// ---- CompareResourceModel ----------------------------------------------------------------------

CompareResourceModel::CompareResourceModel(QObject* parent)
    : RecordModel({tr("Resource"), tr("A busy"), tr("B busy"), tr("B - A"), tr("B / A")}, parent) {}

void CompareResourceModel::setTraces(const TraceDataPtr& a, const TraceDataPtr& b) {
  QVector<Row> rows;
  if (a && b) {
    for (const auto& r : compareResources(*a, *b)) {
      const double ratio = r.aSeconds > 0 ? r.bSeconds / r.aSeconds : -1;
      rows.push_back({QString::fromStdString(r.resource),
                      {text(QString::fromStdString(r.resource)), number(r.aSeconds, qFormatDuration(r.aSeconds)),
                       number(r.bSeconds, qFormatDuration(r.bSeconds)), number(r.bSeconds - r.aSeconds, signedSeconds(r.bSeconds - r.aSeconds)),
                       number(ratio, ratio >= 0 ? QStringLiteral("%1x").arg(ratio, 0, 'f', 3) : QStringLiteral("-"))},
                      {}});
    }
  }
  setRows(std::move(rows));
}

// ---- CompareLayerModel -------------------------------------------------------------------------

CompareLayerModel::CompareLayerModel(QObject* parent)
    : RecordModel({tr("Layer"), tr("A compute"), tr("B compute"), tr("Compute B - A"), tr("A transfer"), tr("B transfer"),
                   tr("Transfer B - A")}, parent) {}

void CompareLayerModel::setTraces(const TraceDataPtr& a, const TraceDataPtr& b) {
  QVector<Row> rows;
  if (a && b) {
    for (const auto& r : compareLayers(*a, *b)) {
      rows.push_back({QString::number(r.layer),
                      {number(r.layer, QString::number(r.layer)), number(r.aCompute, qFormatDuration(r.aCompute)),
                       number(r.bCompute, qFormatDuration(r.bCompute)), number(r.bCompute - r.aCompute, signedSeconds(r.bCompute - r.aCompute)),
                       number(r.aTransfer, qFormatDuration(r.aTransfer)), number(r.bTransfer, qFormatDuration(r.bTransfer)),
                       number(r.bTransfer - r.aTransfer, signedSeconds(r.bTransfer - r.aTransfer))},
                      {}});
    }
  }
  setRows(std::move(rows));
}

// ---- SpanListModel -----------------------------------------------------------------------------

SpanListModel::SpanListModel(QObject* parent) : QAbstractTableModel(parent) {}

void SpanListModel::clear() {
  beginResetModel();
  data_.reset();
  lane_ = -1;
  first_ = count_ = 0;
  endResetModel();
}

void SpanListModel::setLane(const TraceDataPtr& d, int lane, int64_t t0, int64_t t1) {
  beginResetModel();
  data_ = d;
  lane_ = lane;
  first_ = count_ = 0;
  if (d && lane >= 0 && static_cast<size_t>(lane) < d->lanes.size()) {
    auto [f, l] = d->lanes[static_cast<size_t>(lane)].candidates(t0, t1);
    first_ = f;
    count_ = l - f;
  } else {
    data_.reset();
    lane_ = -1;
  }
  endResetModel();
}

int SpanListModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : static_cast<int>(std::min<size_t>(count_, static_cast<size_t>(INT32_MAX)));
}
int SpanListModel::columnCount(const QModelIndex& parent) const { return parent.isValid() ? 0 : 8; }

QVariant SpanListModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid) || !data_) return {};
  if (role != Qt::DisplayRole && role != Qt::UserRole) return {};
  const LaneData& l = data_->lanes[static_cast<size_t>(lane_)];
  const size_t i = spanIndex(index.row());
  const bool raw = role == Qt::UserRole;
  auto idx = [&](int32_t v) -> QVariant { return raw ? QVariant(v) : (v < 0 ? QVariant(QStringLiteral("-")) : QVariant(v)); };
  switch (index.column()) {
    case 0: return QString::fromStdString(data_->str(l.nameId[i]));
    case 1: return QString::fromStdString(data_->str(l.kindId[i]));
    case 2: return idx(l.step[i]);
    case 3: return idx(l.layer[i]);
    case 4: return idx(l.microBatch[i]);
    case 5: return raw ? QVariant(static_cast<qlonglong>(l.start[i])) : QVariant(qFormatDuration(static_cast<double>(l.start[i]) * 1e-9));
    case 6: {
      const double dur = static_cast<double>(l.end[i] - l.start[i]) * 1e-9;
      return raw ? QVariant(dur) : QVariant(qFormatDuration(dur));
    }
    case 7: return raw ? QVariant(static_cast<qlonglong>(l.bytes[i])) : QVariant(qFormatBytes(static_cast<double>(l.bytes[i])));
    default: return {};
  }
}

QVariant SpanListModel::headerData(int section, Qt::Orientation orientation, int role) const {
  if (role != Qt::DisplayRole) return {};
  if (orientation == Qt::Vertical) return section + 1;
  static const char* names[] = {"Name", "Kind", "Step", "Layer", "Micro-batch", "Start", "Duration", "Bytes"};
  return section >= 0 && section < 8 ? QVariant(tr(names[section])) : QVariant();
}

}  // namespace megatrain::gui

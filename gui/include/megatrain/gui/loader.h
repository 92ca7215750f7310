// TraceLoader: opens traces and plans (simulating the plan) on a worker thread with QtConcurrent,
// so the window keeps painting while a million spans load. Results come back as signals on the
// loader's own (GUI) thread; any failure, including an exception from a library, becomes `failed`
// with a message, never a crash. A simulated plan's trace stays in a temporary folder owned by the
// loader (removed with it) so that it can be exported.
#pragma once

#include <QFutureWatcher>
#include <QObject>
#include <QString>
#include <QTemporaryDir>

#include <memory>

#include "megatrain/core/plan.h"
#include "megatrain/gui/tracedata.h"

namespace megatrain::gui {

using TraceDataPtr = std::shared_ptr<const TraceData>;

struct LoadOutcome {
  TraceDataPtr data;
  QString error;
};

class TraceLoader : public QObject {
  Q_OBJECT
 public:
  explicit TraceLoader(QObject* parent = nullptr);
  ~TraceLoader() override;

  // A .mtrace trace or a plan .json (simulated). Returns at once.
  void open(const QString& path);
  // Simulates an edited plan; `path` is what `loaded` reports (the plan's file, if any).
  void simulate(const Plan& plan, const QString& label, const QString& path);
  int pending() const { return pending_; }
  // Blocks until every started load has finished (used before exiting and by tests).
  void waitForAll();

 signals:
  void loaded(const QString& path, megatrain::gui::TraceDataPtr data);
  void failed(const QString& path, const QString& message);
  void idle();

 private:
  void watch(const QString& path, QFuture<LoadOutcome> future);
  std::string nextTracePath();
  int pending_ = 0;
  int serial_ = 0;
  QTemporaryDir tempDir_;  // simulated plans' traces, kept for export until the loader goes
  QList<QFutureWatcher<LoadOutcome>*> watchers_;
};

}  // namespace megatrain::gui

Q_DECLARE_METATYPE(megatrain::gui::TraceDataPtr)

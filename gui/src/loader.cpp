// TraceLoader: background loading (see the header).
#include "megatrain/gui/loader.h"

#include <QtConcurrent/QtConcurrentRun>

#include <exception>
#include <new>

namespace megatrain::gui {
namespace {

LoadOutcome fromResult(Result<TraceDataPtr> r) {
  LoadOutcome out;
  if (r.ok()) out.data = std::move(r).value();
  else out.error = QString::fromStdString(r.status().message());
  return out;
}

template <typename F>
LoadOutcome guarded(F&& f) {
  try {
    return fromResult(f());
  } catch (const std::bad_alloc&) {
    return {nullptr, QStringLiteral("out of memory while loading; the file is too large for this machine's RAM")};
  } catch (const std::exception& e) {
    return {nullptr, QStringLiteral("failed while loading: %1").arg(QString::fromUtf8(e.what()))};
  }
}

}  // namespace

TraceLoader::TraceLoader(QObject* parent) : QObject(parent) { qRegisterMetaType<TraceDataPtr>(); }

TraceLoader::~TraceLoader() { waitForAll(); }

std::string TraceLoader::nextTracePath() {
  if (!tempDir_.isValid()) return {};  // then the simulated trace is a removed temporary file
  return tempDir_.filePath(QStringLiteral("simulated-%1.mtrace").arg(serial_++)).toStdString();
}

void TraceLoader::open(const QString& path) {
  const std::string p = path.toStdString(), t = nextTracePath();
  watch(path, QtConcurrent::run([p, t] { return guarded([&] { return loadAnyFile(p, t); }); }));
}

void TraceLoader::simulate(const Plan& plan, const QString& label, const QString& path) {
  const std::string l = label.toStdString(), p = path.toStdString(), t = nextTracePath();
  watch(path, QtConcurrent::run([plan, l, p, t] { return guarded([&] { return simulatePlan(plan, l, p, t); }); }));
}

void TraceLoader::waitForAll() {
  for (auto* w : watchers_) w->waitForFinished();
}

void TraceLoader::watch(const QString& path, QFuture<LoadOutcome> future) {
  auto* w = new QFutureWatcher<LoadOutcome>(this);
  ++pending_;
  watchers_.push_back(w);
  connect(w, &QFutureWatcher<LoadOutcome>::finished, this, [this, w, path] {
    const LoadOutcome out = w->result();
    watchers_.removeOne(w);
    w->deleteLater();
    --pending_;
    if (out.data) emit loaded(path, out.data);
    else emit failed(path, out.error.isEmpty() ? QStringLiteral("could not be opened") : out.error);
    if (pending_ == 0) emit idle();
  });
  w->setFuture(std::move(future));
}

}  // namespace megatrain::gui

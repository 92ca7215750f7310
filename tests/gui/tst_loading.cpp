// Bad input never crashes or freezes: corrupt, truncated, empty and foreign files give an error
// that names the problem, through the library, the background loader and the window's banner.
// Loading happens off the GUI thread: the event loop keeps turning while a large trace loads.
#include <QFile>
#include <QSignalSpy>
#include <QStandardPaths>
#include <QTemporaryDir>
#include <QTest>
#include <QTimer>

#include <sqlite3.h>

#include <fstream>

#include "fixture.h"
#include "megatrain/gui/loader.h"
#include "megatrain/gui/mainwindow.h"
#include "megatrain/gui/timelinewidget.h"

using namespace megatrain::gui;

namespace {

std::filesystem::path writeBytes(const QTemporaryDir& dir, const char* name, const std::string& bytes) {
  const std::filesystem::path p = dir.filePath(QString::fromLatin1(name)).toStdString();
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

}  // namespace

class TestLoading : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() { QStandardPaths::setTestModeEnabled(true); }

  void badFilesAreErrors_data() {
    QTest::addColumn<QString>("name");
    QTest::addColumn<QByteArray>("bytes");
    QTest::addColumn<QString>("expected");  // a fragment of the message
    QTest::newRow("random bytes") << "noise.mtrace" << QByteArray("\x01\x02garbage\xff\xfe not sqlite at all", 30) << "not a MegaTrain trace";
    QTest::newRow("empty trace") << "empty.mtrace" << QByteArray() << "";
    QTest::newRow("text file") << "notes.txt" << QByteArray("hello world\n") << "neither a MegaTrain trace";
    QTest::newRow("json, not a plan") << "other.json" << QByteArray("{\"hello\": 1}") << "megatrain.plan/1";
    QTest::newRow("truncated json") << "cut.json" << QByteArray("{\"schema\": \"megatrain.plan/1\", \"model\": ") << "megatrain.plan/1";
  }
  void badFilesAreErrors() {
    QFETCH(QString, name);
    QFETCH(QByteArray, bytes);
    QFETCH(QString, expected);
    QTemporaryDir dir;
    const auto p = writeBytes(dir, name.toLatin1().constData(), bytes.toStdString());
    auto r = loadAnyFile(p);
    QVERIFY(!r.ok());
    QVERIFY(!r.status().message().empty());
    QVERIFY2(r.status().message().find(expected.toStdString()) != std::string::npos, r.status().message().c_str());
  }

  void missingAndFolder() {
    QTemporaryDir dir;
    auto missing = loadAnyFile(dir.filePath(QStringLiteral("nope.mtrace")).toStdString());
    QVERIFY(!missing.ok());
    QCOMPARE(missing.status().code(), megatrain::StatusCode::kNotFound);
    auto folder = loadAnyFile(dir.path().toStdString());
    QVERIFY(!folder.ok());
  }

  void truncatedTrace() {
    QTemporaryDir dir;
    const std::filesystem::path good = dir.filePath(QStringLiteral("good.mtrace")).toStdString();
    QVERIFY(fixture::write(good, 20000).ok());
    QFile f(QString::fromStdString(good.string()));
    QVERIFY(f.open(QIODevice::ReadOnly));
    const QByteArray all = f.readAll();
    // Cut at several places: each gives an error or (if the cut spared every page read) data.
    for (double frac : {0.1, 0.5, 0.9}) {
      const auto p = writeBytes(dir, "cut.mtrace", all.left(static_cast<int>(all.size() * frac)).toStdString());
      auto r = loadAnyFile(p);
      if (!r.ok()) QVERIFY(!r.status().message().empty());
    }
    // Overwritten pages in the middle.
    QByteArray damaged = all;
    for (qsizetype i = damaged.size() / 3; i < damaged.size() / 3 + 8192 && i < damaged.size(); ++i) damaged[i] = char(0xA5);
    auto r = loadAnyFile(writeBytes(dir, "damaged.mtrace", damaged.toStdString()));
    if (!r.ok()) QVERIFY(!r.status().message().empty());
  }

  // Traces the writer never writes (issue 32 row 16): before, a span from INT64_MIN to INT64_MAX
  // or a lane id of INT64_MAX overflowed, and a view that recurses without end hung the loader.
  void hostileTracesAreErrors_data() {
    QTest::addColumn<QString>("sql");
    QTest::addColumn<QString>("expected");
    QTest::newRow("widest span") << "UPDATE spans SET start_ns = -9223372036854775808, end_ns = 9223372036854775807 WHERE rowid = 1"
                                 << "spans row 1";
    QTest::newRow("huge lane id") << "UPDATE lanes SET id = 9223372036854775807 WHERE id = 0" << "lanes row";
    QTest::newRow("recursive view") << "DROP TABLE spans; CREATE VIEW spans AS WITH RECURSIVE c(x) AS (SELECT 0 UNION ALL SELECT x + 1 "
                                       "FROM c) SELECT 0 AS lane, 'f' AS name, 'forward' AS kind, 0 AS step, 0 AS layer, 0 AS "
                                       "micro_batch, x AS start_ns, x AS end_ns, 0 AS bytes, 0.0 AS flops FROM c"
                                    << "spans is a view";
  }
  void hostileTracesAreErrors() {
    QFETCH(QString, sql);
    QFETCH(QString, expected);
    QTemporaryDir dir;
    const std::filesystem::path p = dir.filePath(QStringLiteral("hostile.mtrace")).toStdString();
    QVERIFY(fixture::write(p, 100).ok());
    sqlite3* db = nullptr;
    QCOMPARE(sqlite3_open(p.c_str(), &db), SQLITE_OK);
    QCOMPARE(sqlite3_exec(db, sql.toStdString().c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
    auto r = loadAnyFile(p);
    QVERIFY(!r.ok());
    QVERIFY2(r.status().message().find(expected.toStdString()) != std::string::npos, r.status().message().c_str());
  }

  void loaderReportsFailureAsSignal() {
    QTemporaryDir dir;
    const auto p = writeBytes(dir, "bad.mtrace", "this is not a trace");
    TraceLoader loader;
    QSignalSpy failed(&loader, &TraceLoader::failed);
    QSignalSpy loaded(&loader, &TraceLoader::loaded);
    loader.open(QString::fromStdString(p.string()));
    QTRY_COMPARE(failed.count(), 1);
    QCOMPARE(loaded.count(), 0);
    QVERIFY(failed.at(0).at(1).toString().contains(QStringLiteral("not a MegaTrain trace")));
  }

  void windowShowsErrorAndKeepsWorking() {
    QTemporaryDir dir;
    const auto bad = writeBytes(dir, "bad.mtrace", std::string(4096, '\x7f'));
    const std::filesystem::path good = dir.filePath(QStringLiteral("good.mtrace")).toStdString();
    QVERIFY(fixture::write(good).ok());
    MainWindow w;
    w.show();
    w.openFiles({QString::fromStdString(bad.string())});
    QTRY_VERIFY(w.errorBannerVisible());
    QVERIFY(w.errorBannerText().contains(QStringLiteral("bad.mtrace")));
    QCOMPARE(w.documentCount(), 0);
    w.openFiles({QString::fromStdString(good.string())});
    QTRY_COMPARE(w.documentCount(), 1);
    QVERIFY(w.currentDocument() != nullptr);
    QCOMPARE(w.currentDocument()->data->spanCount, size_t{6});
    QVERIFY(MainWindow::recentFiles().value(0).endsWith(QStringLiteral("good.mtrace")));
    // Clicking the bottleneck (the GPU here) selects its lane and the reported step.
    QVERIFY(w.selectBottleneck());
    QCOMPARE(w.timeline()->highlightedLane(), std::make_pair(0, 0));
    QCOMPARE(w.timeline()->selection()->first, int64_t{0});
    QCOMPARE(w.timeline()->selection()->second, int64_t{850});
    // Exports of the opened trace.
    const QString json = dir.filePath(QStringLiteral("out.json"));
    QCOMPARE(w.exportPerfetto(json), QString());
    QVERIFY(QFile::exists(json));
    const QString png = dir.filePath(QStringLiteral("out.png"));
    QCOMPARE(w.saveScreenshot(png), QString());
    QVERIFY(QImage(png).width() > 0);
    QVERIFY(!w.saveScreenshot(dir.filePath(QStringLiteral("no/such/folder/x.png"))).isEmpty());
  }

  void filesKeepTheirOrderAndTheFirstIsShown() {
    QTemporaryDir dir;
    // The first file is the slower one to load; it still comes first and is the one shown.
    const std::filesystem::path a = dir.filePath(QStringLiteral("a.mtrace")).toStdString();
    const std::filesystem::path b = dir.filePath(QStringLiteral("b.mtrace")).toStdString();
    QVERIFY(fixture::write(a, 100000).ok());
    QVERIFY(fixture::write(b).ok());
    MainWindow w;
    w.show();
    w.openFiles({QString::fromStdString(a.string()), QString::fromStdString(b.string())});
    QTRY_COMPARE_WITH_TIMEOUT(w.documentCount(), 2, 30000);
    QVERIFY(w.currentDocument()->path.endsWith(QStringLiteral("a.mtrace")));
    w.setCurrentDocument(1);
    QVERIFY(w.currentDocument()->path.endsWith(QStringLiteral("b.mtrace")));
  }

  // A data-parallel job's traces: rank 0's file opened, rank k's beside it as <stem>.rank<k>.mtrace;
  // the timeline shows one track per rank, labelled, and a corrupt rank file is an error naming it.
  void dataParallelRanksSideBySide() {
    QTemporaryDir dir;
    const std::filesystem::path r0 = dir.filePath(QStringLiteral("dp.mtrace")).toStdString();
    QVERIFY(fixture::write(r0).ok());
    QVERIFY(fixture::write(dir.filePath(QStringLiteral("dp.rank1.mtrace")).toStdString()).ok());
    QVERIFY(fixture::write(dir.filePath(QStringLiteral("dp.rank2.mtrace")).toStdString(), 10).ok());
    QVERIFY(fixture::write(dir.filePath(QStringLiteral("dp.rank4.mtrace")).toStdString()).ok());  // after a gap: not a rank of it
    auto t = loadTraceFile(r0);
    QVERIFY2(t.ok(), t.status().message().c_str());
    QCOMPARE((*t)->otherRanks.size(), size_t{2});
    QVERIFY((*t)->displayName.find("(3 ranks)") != std::string::npos);
    QVERIFY((*t)->otherRanks[1]->spanCount > (*t)->spanCount);  // rank 2's own file
    auto one = loadTraceFile(dir.filePath(QStringLiteral("dp.rank1.mtrace")).toStdString());
    QVERIFY(one.ok() && (*one)->otherRanks.empty());  // a rank's own file opens alone
    MainWindow w;
    w.show();
    w.openFiles({QString::fromStdString(r0.string())});
    QTRY_COMPARE_WITH_TIMEOUT(w.documentCount(), 1, 30000);
    const auto& tracks = w.timeline()->tracks();
    QCOMPARE(tracks.size(), 3);
    QCOMPARE(tracks[0].label, QStringLiteral("rank 0"));
    QCOMPARE(tracks[2].label, QStringLiteral("rank 2"));
    QCOMPARE(tracks[0].offset, int64_t{0});
    writeBytes(dir, "dp.rank1.mtrace", "not a trace");
    auto bad = loadTraceFile(r0);
    QVERIFY(!bad.ok());
    QVERIFY2(bad.status().message().find("rank 1's trace beside dp.mtrace") != std::string::npos, bad.status().message().c_str());
  }

  void planIsSimulatedOnOpenAndWhatIfResimulates() {
    MainWindow w;
    w.show();
    const QString plan = QStringLiteral(MEGATRAIN_PROFILES_DIR "/plans/tiny-cpu.json");
    w.openFiles({plan});
    QTRY_COMPARE_WITH_TIMEOUT(w.documentCount(), 1, 20000);
    QVERIFY(w.currentDocument()->data->openedFromPlan);
    QVERIFY(w.currentDocument()->data->spanCount > 0);
    QSignalSpy done(&w, &MainWindow::whatIfFinished);
    WhatIfEdits e;
    e.prefetchDepth = 2;
    e.microBatch = 2;
    QCOMPARE(w.applyWhatIf(e), QString());
    QTRY_COMPARE_WITH_TIMEOUT(done.count(), 1, 20000);
    QCOMPARE(done.at(0).at(0).toBool(), true);
    QVERIFY(w.currentDocument()->edited);
    QCOMPARE(w.currentDocument()->plan->training.micro_batch, 2);
    // An edit the plan rejects is an error message, nothing is simulated.
    WhatIfEdits bad;
    bad.order = "sideways";
    QVERIFY(w.applyWhatIf(bad).contains(QStringLiteral("sideways")));
    WhatIfEdits none;
    none.prefetchDepth = 0;  // the plan format accepts 1 .. 1024
    QVERIFY(w.applyWhatIf(none).contains(QStringLiteral("prefetch_depth")));
  }

  void largeTraceLoadsOffTheGuiThread() {
    QTemporaryDir dir;
    const std::filesystem::path big = dir.filePath(QStringLiteral("big.mtrace")).toStdString();
    QVERIFY(fixture::write(big, 300000).ok());
    TraceLoader loader;
    QSignalSpy loaded(&loader, &TraceLoader::loaded);
    int ticks = 0;
    int ticksAtLoad = -1;
    QTimer timer;
    connect(&timer, &QTimer::timeout, [&] { ++ticks; });
    connect(&loader, &TraceLoader::loaded, [&] { ticksAtLoad = ticks; });
    timer.start(5);
    loader.open(QString::fromStdString(big.string()));
    QCOMPARE(loader.pending(), 1);  // open() returned before the trace was read
    QTRY_COMPARE_WITH_TIMEOUT(loaded.count(), 1, 60000);
    // The GUI thread's timers kept firing while the worker read 300k spans.
    QVERIFY2(ticksAtLoad > 0, "the event loop did not run during the load");
    const auto data = loaded.at(0).at(1).value<TraceDataPtr>();
    QVERIFY(data);
    QCOMPARE(data->spanCount, size_t{300006});
  }
};

QTEST_MAIN(TestLoading)
#include "tst_loading.moc"

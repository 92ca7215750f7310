// Every panel model under QAbstractItemModelTester, with the figures checked on the fixture trace;
// plus the analyses behind them (range statistics, comparison, what-if edits).
#include <limits>
#include <memory>

#include <QAbstractItemModelTester>
#include <QTest>

#include <cmath>
#include <filesystem>

#include "fixture.h"
#include "megatrain/gui/models.h"

using namespace megatrain::gui;

namespace {

double value(const RecordModel& m, const QString& key, int column) {
  const int row = m.rowOfKey(key);
  if (row < 0) return std::nan("");
  return m.data(m.index(row, column), Qt::UserRole).toDouble();
}

}  // namespace

class TestModels : public QObject {
  Q_OBJECT
 private slots:
  void summary() {
    SummaryModel m;
    QAbstractItemModelTester tester(&m, QAbstractItemModelTester::FailureReportingMode::QtTest);
    m.setTrace(fixture::build());
    // Measured trace: the reported step is step 0 (window [0, 850)); the step took 900 ns.
    QCOMPARE(value(m, "step_time", 1), 900e-9);
    QCOMPARE(value(m, "tokens_per_s", 1), 512 / 900e-9);
    // GPU busy 200 of 850 ns (the stall is not busy); H2D 180; CPU 150.
    QCOMPARE(value(m, "busy.gpu", 1), 200.0 / 850.0);
    QCOMPARE(value(m, "busy.h2d", 1), 180.0 / 850.0);
    QCOMPARE(m.data(m.index(m.rowOfKey("bottleneck"), 1)).toString(), QStringLiteral("gpu"));
    QCOMPARE(value(m, "stall.buffer", 1), 50e-9);
    // FLOPs of forward and backward over the step time.
    QCOMPARE(value(m, "tflops", 1), 6e6 / 900e-9 * 1e-12);
    m.setTrace(nullptr);
    QCOMPARE(m.rowCount(), 0);
  }

  // A simulated trace has no loss: the summary and the steps table say so, not "nan" (issue 32
  // row 19); a measured run's NaN loss is said in words.
  void lossOfASimulation() {
    auto sim = std::make_shared<TraceData>(*fixture::build());
    sim->summary.source = "simulated";
    for (auto& st : sim->steps) st.loss = std::numeric_limits<double>::quiet_NaN();
    sim->summary.step = sim->steps.empty() ? -1 : sim->steps.front().step;
    SummaryModel m;
    m.setTrace(sim);
    QVERIFY(m.rowOfKey("loss") >= 0);
    QCOMPARE(m.data(m.index(m.rowOfKey("loss"), 1)).toString(), QStringLiteral("none (a simulation has no loss)"));
    StepModel steps;
    steps.setTrace(sim);
    QVERIFY(steps.rowCount() > 0);
    QCOMPARE(steps.data(steps.index(0, 1)).toString(), QStringLiteral("none (a simulation has no loss)"));
    sim->summary.source = "measured";
    steps.setTrace(sim);
    QCOMPARE(steps.data(steps.index(0, 1)).toString(), QStringLiteral("not a number (the run diverged)"));
  }

  void lanesStallsMemory() {
    LaneModel lanes;
    StallModel stalls;
    MemoryModel memory;
    QAbstractItemModelTester t1(&lanes, QAbstractItemModelTester::FailureReportingMode::QtTest);
    QAbstractItemModelTester t2(&stalls, QAbstractItemModelTester::FailureReportingMode::QtTest);
    QAbstractItemModelTester t3(&memory, QAbstractItemModelTester::FailureReportingMode::QtTest);
    const auto d = fixture::build();
    lanes.setTrace(d);
    stalls.setTrace(d);
    memory.setTrace(d);
    QCOMPARE(lanes.rowCount(), 3);
    QCOMPARE(lanes.data(lanes.index(1, 0)).toString(), QStringLiteral("H2D"));
    QCOMPARE(value(lanes, "GPU compute", 2), 3.0);  // two spans and the stall
    QCOMPARE(stalls.rowCount(), 1);
    QCOMPARE(stalls.rowKey(0), QStringLiteral("buffer"));
    QCOMPARE(value(stalls, "buffer", 1), 1.0);
    QCOMPARE(memory.rowCount(), 1);
    QCOMPARE(value(memory, "bytes.device", 2), 300.0);
    lanes.setTrace(nullptr);
    QCOMPARE(lanes.rowCount(), 0);
  }

  void rangeStats() {
    RangeStatsModel m;
    QAbstractItemModelTester tester(&m, QAbstractItemModelTester::FailureReportingMode::QtTest);
    m.setRange(fixture::build(), 0, 500);
    QCOMPARE(m.rowCount(), 3);
    QCOMPARE(value(m, "GPU compute", 1), 200.0 / 500.0);
    // H2D: [0, 80) and half of [450, 550): 130 ns busy; 400 bytes + half of 1000.
    QCOMPARE(value(m, "H2D", 1), 130.0 / 500.0);
    QCOMPARE(value(m, "H2D", 3), 900.0);
    QCOMPARE(value(m, "H2D", 4), 900.0 / 130e-9);
    QCOMPARE(value(m, "GPU compute", 5), 6e6);
    QCOMPARE(value(m, "CPU optimizer", 1), 0.0);
    m.clear();
    QCOMPARE(m.rowCount(), 0);
  }

  void spanList() {
    SpanListModel m;
    QAbstractItemModelTester tester(&m, QAbstractItemModelTester::FailureReportingMode::QtTest);
    const auto d = fixture::build();
    m.setLane(d, 1, 0, 1000);
    QCOMPARE(m.rowCount(), 2);
    QCOMPARE(m.data(m.index(1, 0)).toString(), QStringLiteral("h2d L1"));
    QCOMPARE(m.data(m.index(1, 7), Qt::UserRole).toLongLong(), 1000LL);
    m.setLane(d, 0, 250, 320);  // only the backward span overlaps
    QCOMPARE(m.rowCount(), 1);
    m.setLane(d, 7, 0, 1000);  // no such lane
    QCOMPARE(m.rowCount(), 0);
    m.clear();
  }

  void compare() {
    CompareResourceModel res;
    CompareLayerModel layers;
    QAbstractItemModelTester t1(&res, QAbstractItemModelTester::FailureReportingMode::QtTest);
    QAbstractItemModelTester t2(&layers, QAbstractItemModelTester::FailureReportingMode::QtTest);
    const auto a = fixture::build(), b = fixture::build(1.5);
    res.setTraces(a, b);
    layers.setTraces(a, b);
    QCOMPARE(res.rowCount(), 3);
    QCOMPARE(value(res, "gpu", 1), 200e-9);
    QCOMPARE(value(res, "gpu", 2), 300e-9);
    QCOMPARE(value(res, "gpu", 3), 100e-9);
    QCOMPARE(value(res, "h2d", 3), 0.0);
    // Layer 0: compute fwd + bwd; layer 1: the second copy.
    QCOMPARE(layers.rowCount(), 2);
    QCOMPARE(value(layers, "0", 1), 200e-9);
    QCOMPARE(value(layers, "0", 2), 300e-9);
    QCOMPARE(value(layers, "1", 4), 100e-9);
    res.setTraces(a, nullptr);
    QCOMPARE(res.rowCount(), 0);
  }

  void whatIf() {
    auto base = megatrain::Plan::load(std::filesystem::path(MEGATRAIN_PROFILES_DIR) / "plans" / "tiny-cpu.json");
    QVERIFY2(base.ok(), base.status().message().c_str());
    WhatIfEdits e;
    e.prefetchDepth = 3;
    e.mFormat = "q8";
    e.microBatch = 2;
    e.order = "microbatch-major";
    auto edited = applyWhatIf(*base, e);
    QVERIFY2(edited.ok(), edited.status().message().c_str());
    QCOMPARE(edited->schedule.prefetch_depth, 3);
    QVERIFY(edited->schedule.device_layer_buffers >= 4);
    QCOMPARE(edited->optimizer.m_format, megatrain::StateFormat::kQ8);
    QCOMPARE(edited->training.micro_batch, 2);
    QCOMPARE(edited->schedule.order, megatrain::ScheduleOrder::kMicrobatchMajor);
    WhatIfEdits bad;
    bad.vFormat = "q5";
    auto rejected = applyWhatIf(*base, bad);
    QVERIFY(!rejected.ok());
    QVERIFY2(rejected.status().message().find("q5") != std::string::npos, rejected.status().message().c_str());
    // The edited plan simulates, and its summary comes from the simulator.
    auto sim = simulatePlan(*edited, "edited");
    QVERIFY2(sim.ok(), sim.status().message().c_str());
    QVERIFY((*sim)->spanCount > 0);
    QVERIFY((*sim)->summary.fromSimulator);
    QVERIFY((*sim)->summary.stepTimeS > 0);
    SummaryModel m;
    QAbstractItemModelTester tester(&m, QAbstractItemModelTester::FailureReportingMode::QtTest);
    m.setTrace(*sim);
    QVERIFY(value(m, "step_time", 1) > 0);
  }

  // The steps panel and the summary's loss rows: a Mixture-of-Experts trace carries the aux loss
  // per step, a dense one leaves it NULL (NaN) and the panel shows "-". Written through the real
  // trace store and read back by the loader, so the column survives the file.
  void stepsWithTheAuxLoss() {
    const auto path = std::filesystem::temp_directory_path() / ("mt_gui_steps_" + std::to_string(QCoreApplication::applicationPid()) + ".mtrace");
    std::filesystem::remove(path);
    {
      auto w = megatrain::TraceWriter::create(path, fixture::meta());
      QVERIFY(w.ok());
      for (const auto& l : fixture::lanes()) QVERIFY((*w)->add_lane(l.name, l.kind).ok());
      for (const auto& sp : fixture::spans())  // the spans are step 1's, the step the summary reports
        QVERIFY((*w)->add_span({sp.lane, sp.name, sp.kind, 1, sp.layer, 0, sp.start, sp.end, sp.bytes, sp.flops}).ok());
      QVERIFY((*w)->add_step({0, 2.25, 512, 800e-9}).ok());  // no aux loss: NULL in the table
      megatrain::TraceStep moe{1, 2.5, 512, 900e-9};
      moe.aux_loss = 1.0625;
      moe.eval_loss = 2.75;  // evaluated after step 1
      QVERIFY((*w)->add_step(moe).ok());
      QVERIFY((*w)->close().ok());
    }
    auto d = loadTraceFile(path);
    std::filesystem::remove(path);
    QVERIFY2(d.ok(), d.status().message().c_str());
    StepModel steps;
    QAbstractItemModelTester tester(&steps, QAbstractItemModelTester::FailureReportingMode::QtTest);
    steps.setTrace(*d);
    QCOMPARE(steps.rowCount(), 2);
    QCOMPARE(value(steps, "1", 1), 2.5);
    QCOMPARE(value(steps, "1", 2), 1.0625);
    QCOMPARE(steps.data(steps.index(1, 2)).toString(), QStringLiteral("1.0625"));
    QCOMPARE(steps.data(steps.index(0, 2)).toString(), QStringLiteral("-"));
    QVERIFY(!steps.data(steps.index(0, 2), Qt::UserRole).isValid());
    QCOMPARE(value(steps, "0", 5), 512 / 800e-9);
    QCOMPARE(value(steps, "1", 6), 2.75);
    QCOMPARE(steps.data(steps.index(0, 6)).toString(), QStringLiteral("-"));
    // The summary reports step 1 (the last one): its loss and aux loss.
    SummaryModel m;
    m.setTrace(*d);
    QCOMPARE(value(m, "step", 1), 1.0);
    QCOMPARE(value(m, "loss", 1), 2.5);
    QCOMPARE(value(m, "aux_loss", 1), 1.0625);
    QCOMPARE(value(m, "eval_loss", 1), 2.75);
    // The dense fixture has no aux row.
    m.setTrace(fixture::build());
    QCOMPARE(value(m, "loss", 1), 2.5);
    QCOMPARE(m.rowOfKey("aux_loss"), -1);
    steps.setTrace(nullptr);
    QCOMPARE(steps.rowCount(), 0);
  }
};

QTEST_GUILESS_MAIN(TestModels)
#include "tst_models.moc"

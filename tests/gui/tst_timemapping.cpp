// Data-driven tests of the pure time <-> x mapping (zoom, pan, clamp) and of the zoom stack.
#include <QSignalSpy>
#include <QTest>

#include "megatrain/gui/timemapping.h"
#include "megatrain/gui/zoomstack.h"

using megatrain::gui::TimeMapping;
using megatrain::gui::TimeRange;
using megatrain::gui::ZoomStack;

class TestTimeMapping : public QObject {
  Q_OBJECT
 private slots:
  void toX_data() {
    QTest::addColumn<qint64>("t0");
    QTest::addColumn<qint64>("t1");
    QTest::addColumn<double>("width");
    QTest::addColumn<qint64>("t");
    QTest::addColumn<double>("x");
    QTest::newRow("start") << qint64(0) << qint64(1000) << 100.0 << qint64(0) << 0.0;
    QTest::newRow("end") << qint64(0) << qint64(1000) << 100.0 << qint64(1000) << 100.0;
    QTest::newRow("middle") << qint64(0) << qint64(1000) << 100.0 << qint64(250) << 25.0;
    QTest::newRow("offset window") << qint64(5000) << qint64(6000) << 200.0 << qint64(5500) << 100.0;
    QTest::newRow("left of window") << qint64(5000) << qint64(6000) << 200.0 << qint64(4000) << -200.0;
    QTest::newRow("negative times") << qint64(-1000) << qint64(1000) << 400.0 << qint64(0) << 200.0;
    QTest::newRow("minutes in ns") << qint64(0) << qint64(600'000'000'000) << 1500.0 << qint64(300'000'000'000) << 750.0;
  }
  void toX() {
    QFETCH(qint64, t0);
    QFETCH(qint64, t1);
    QFETCH(double, width);
    QFETCH(qint64, t);
    QFETCH(double, x);
    const TimeMapping m{t0, t1, width};
    QCOMPARE(m.toX(static_cast<int64_t>(t)), x);
    // x -> time is the inverse, to the nanosecond.
    QCOMPARE(m.toTime(x), static_cast<int64_t>(t));
  }

  void zoom_data() {
    QTest::addColumn<qint64>("t0");
    QTest::addColumn<qint64>("t1");
    QTest::addColumn<double>("factor");
    QTest::addColumn<double>("anchorX");
    QTest::addColumn<qint64>("newT0");
    QTest::addColumn<qint64>("newT1");
    QTest::newRow("in 2x at centre") << qint64(0) << qint64(1000) << 2.0 << 50.0 << qint64(250) << qint64(750);
    QTest::newRow("in 2x at left edge") << qint64(0) << qint64(1000) << 2.0 << 0.0 << qint64(0) << qint64(500);
    QTest::newRow("in 2x at right edge") << qint64(0) << qint64(1000) << 2.0 << 100.0 << qint64(500) << qint64(1000);
    QTest::newRow("out 2x at quarter") << qint64(0) << qint64(1000) << 0.5 << 25.0 << qint64(-250) << qint64(1750);
    QTest::newRow("clamped to minimum") << qint64(0) << qint64(1000) << 1e6 << 50.0 << qint64(495) << qint64(505);
    QTest::newRow("bad factor ignored") << qint64(0) << qint64(1000) << 0.0 << 50.0 << qint64(0) << qint64(1000);
  }
  void zoom() {
    QFETCH(qint64, t0);
    QFETCH(qint64, t1);
    QFETCH(double, factor);
    QFETCH(double, anchorX);
    QFETCH(qint64, newT0);
    QFETCH(qint64, newT1);
    const TimeMapping m{t0, t1, 100.0};
    const TimeMapping z = m.zoomed(factor, anchorX, 10);
    QCOMPARE(z.t0, static_cast<int64_t>(newT0));
    QCOMPARE(z.t1, static_cast<int64_t>(newT1));
    QCOMPARE(z.width, m.width);
    // The time under the cursor stays under the cursor.
    if (factor > 0 && factor < 1e3) QCOMPARE(z.toTime(anchorX), m.toTime(anchorX));
  }

  void pan_data() {
    QTest::addColumn<double>("dx");
    QTest::addColumn<qint64>("newT0");
    QTest::newRow("drag right shows earlier") << 10.0 << qint64(-100);
    QTest::newRow("drag left shows later") << -25.0 << qint64(250);
    QTest::newRow("no drag") << 0.0 << qint64(0);
  }
  void pan() {
    QFETCH(double, dx);
    QFETCH(qint64, newT0);
    const TimeMapping m{0, 1000, 100.0};
    const TimeMapping p = m.panned(dx);
    QCOMPARE(p.t0, static_cast<int64_t>(newT0));
    QCOMPARE(p.duration(), m.duration());
  }

  void clamp_data() {
    QTest::addColumn<qint64>("t0");
    QTest::addColumn<qint64>("t1");
    QTest::addColumn<qint64>("newT0");
    QTest::addColumn<qint64>("newT1");
    QTest::newRow("inside stays") << qint64(100) << qint64(200) << qint64(100) << qint64(200);
    QTest::newRow("left shifted in") << qint64(-50) << qint64(50) << qint64(0) << qint64(100);
    QTest::newRow("right shifted in") << qint64(950) << qint64(1100) << qint64(850) << qint64(1000);
    QTest::newRow("too wide shrinks") << qint64(-500) << qint64(2000) << qint64(0) << qint64(1000);
  }
  void clamp() {
    QFETCH(qint64, t0);
    QFETCH(qint64, t1);
    QFETCH(qint64, newT0);
    QFETCH(qint64, newT1);
    const TimeMapping c = TimeMapping{t0, t1, 100.0}.clampedTo(0, 1000);
    QCOMPARE(c.t0, static_cast<int64_t>(newT0));
    QCOMPARE(c.t1, static_cast<int64_t>(newT1));
  }

  void zoomStack() {
    ZoomStack z;
    QSignalSpy spy(&z, &ZoomStack::changed);
    z.reset({0, 1000});
    QCOMPARE(spy.count(), 1);
    QCOMPARE(z.depth(), 1);
    z.setCurrent({100, 900});  // wheel zoom replaces the top
    QCOMPARE(z.depth(), 1);
    z.push({200, 300});  // zoom to selection pushes
    QCOMPARE(z.depth(), 2);
    QCOMPARE(z.current(), (TimeRange{200, 300}));
    QVERIFY(z.zoomOut());
    QCOMPARE(z.current(), (TimeRange{100, 900}));
    QVERIFY(z.zoomOut());  // at the bottom: back to everything
    QCOMPARE(z.current(), (TimeRange{0, 1000}));
    QVERIFY(!z.zoomOut());
    QCOMPARE(spy.count(), 5);
    z.push({50, 40});  // reversed ranges are normalised
    QCOMPARE(z.current(), (TimeRange{40, 50}));
    z.setCurrent({7, 7});  // never empty
    QCOMPARE(z.current(), (TimeRange{7, 8}));
  }
};

QTEST_GUILESS_MAIN(TestTimeMapping)
#include "tst_timemapping.moc"

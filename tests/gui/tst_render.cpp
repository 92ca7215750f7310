// Offscreen rendering: the fixture trace drawn by the real TimelineWidget must have painted pixels
// in each lane exactly where that lane has spans (and none elsewhere); the pyramid path used when
// zoomed out must agree with the exact per-span path; the memory chart follows its counter.
#include <QImage>
#include <QPainter>
#include <QTemporaryDir>
#include <QSignalSpy>
#include <QTest>
#include <QWheelEvent>

#include <random>

#include "fixture.h"
#include "megatrain/gui/lanepainter.h"
#include "megatrain/gui/timelinewidget.h"

using namespace megatrain::gui;

namespace {

bool columnPainted(const QImage& img, const QRect& r, int x, QRgb background) {
  for (int y = r.top(); y <= r.bottom(); ++y)
    if (img.pixel(x, y) != background) return true;
  return false;
}

}  // namespace

class TestRender : public QObject {
  Q_OBJECT
 private slots:
  void lanesPaintWhereTheirSpansAre() {
    QTemporaryDir dir;
    QVERIFY(dir.isValid());
    const std::filesystem::path path = dir.filePath(QStringLiteral("fixture.mtrace")).toStdString();
    auto st = fixture::write(path);
    QVERIFY2(st.ok(), st.message().c_str());
    auto loaded = loadTraceFile(path);
    QVERIFY2(loaded.ok(), loaded.status().message().c_str());

    TimelineWidget w;
    // 1000 px of content for [0, 1000) ns: one nanosecond per pixel.
    w.resize(TimelineWidget::kGutter + 1000, 400);
    w.setTrace(*loaded);
    QCOMPARE(w.mapping().t0, int64_t{0});
    QCOMPARE(w.mapping().t1, int64_t{1000});
    QImage img(w.size(), QImage::Format_RGB32);
    img.fill(Qt::black);
    w.render(&img);

    const QRgb laneBg = QColor(0xf7, 0xf8, 0xfa).rgb();
    const auto spans = fixture::spans();
    for (int lane = 0; lane < 3; ++lane) {
      const QRect r = w.laneRect(0, lane);
      QVERIFY(!r.isEmpty());
      int painted = 0;
      for (int x = r.left(); x <= r.right(); ++x) {
        const double t = w.mapping().toTime(x - r.left()) + 0.5;  // the column's centre
        bool inside = false, nearEdge = false;
        for (const auto& s : spans) {
          if (s.lane != lane) continue;
          if (t > s.start && t < s.end) inside = true;
          if (std::abs(t - s.start) < 2 || std::abs(t - s.end) < 2) nearEdge = true;
        }
        if (nearEdge) continue;  // anti-aliasing of an edge may go either way
        const bool p = columnPainted(img, r, x, laneBg);
        if (inside) ++painted;
        QVERIFY2(p == inside, qPrintable(QStringLiteral("lane %1 column t=%2: painted=%3, span there=%4")
                                             .arg(lane).arg(t).arg(p).arg(inside)));
      }
      QVERIFY(painted > 0);
    }

    // The device-memory chart: filled under 100 B on [0, 500), under 300 B on [500, 1000).
    const QVector<int> charts = w.chartedCounters(0);
    QCOMPARE(charts.size(), 1);
    const QRect cr = w.counterRect(0, 0);
    auto filledHeight = [&](int x) {
      int n = 0;
      for (int y = cr.top(); y <= cr.bottom(); ++y)
        if (img.pixel(x, y) != QColor(0xfb, 0xfb, 0xfd).rgb()) ++n;
      return n;
    };
    const int low = filledHeight(cr.left() + 250), high = filledHeight(cr.left() + 750);
    QVERIFY2(low > 0 && high > 2 * low, qPrintable(QStringLiteral("chart heights %1 and %2").arg(low).arg(high)));
  }

  void wheelDragSelectAndTooltip() {
    TimelineWidget w;
    w.resize(TimelineWidget::kGutter + 1000, 400);
    w.setTrace(fixture::build());
    const QRect gpu = w.laneRect(0, 0);
    // Hovering the forward span [100, 200) names it with its kind and layer.
    const QString tip = w.toolTipAt(QPoint(gpu.left() + 150, gpu.center().y()));
    QVERIFY2(tip.contains(QStringLiteral("fwd L0 mb0")) && tip.contains(QStringLiteral("forward")), qPrintable(tip));
    QVERIFY(w.toolTipAt(QPoint(gpu.left() + 250, gpu.center().y())).isEmpty());  // a gap
    QVERIFY(w.toolTipAt(QPoint(gpu.left() + 625, gpu.center().y())).contains(QStringLiteral("stall: buffer")));

    // Hovering the memory chart gives the counter's value then.
    const QRect chart = w.counterRect(0, 0);
    QVERIFY(w.toolTipAt(QPoint(chart.left() + 700, chart.center().y())).contains(QStringLiteral("300 B")));

    // Wheel up over t = 250 zooms in around it.
    const QPointF at(gpu.left() + 250, gpu.center().y());
    QWheelEvent wheel(at, w.mapToGlobal(at), QPoint(), QPoint(0, 120), Qt::NoButton, Qt::NoModifier, Qt::NoScrollPhase, false);
    QApplication::sendEvent(&w, &wheel);
    QVERIFY(w.mapping().duration() < 1000);
    QCOMPARE(w.mapping().toTime(250), int64_t{250});

    // Shift+drag selects a range; the signal carries it.
    w.resetZoom();
    QSignalSpy sel(&w, &TimelineWidget::selectionChanged);
    QTest::mousePress(&w, Qt::LeftButton, Qt::ShiftModifier, QPoint(gpu.left() + 100, gpu.center().y()));
    QTest::mouseMove(&w, QPoint(gpu.left() + 300, gpu.center().y()));
    QTest::mouseRelease(&w, Qt::LeftButton, Qt::ShiftModifier, QPoint(gpu.left() + 300, gpu.center().y()));
    QVERIFY(sel.count() >= 1);
    QCOMPARE(w.selection()->first, int64_t{100});
    QCOMPARE(w.selection()->second, int64_t{300});
    // Zoom to it, then back out.
    w.zoomToSelection();
    QCOMPARE(w.mapping().t0, int64_t{100});
    QCOMPARE(w.mapping().t1, int64_t{300});
    QCOMPARE(w.zoomStack()->depth(), 2);
    w.zoomOut();
    QCOMPARE(w.mapping().t1 - w.mapping().t0, int64_t{1000});

    // Dragging pans: 100 px to the left shows 100 ns later.
    w.clearSelection();
    w.zoomStack()->setCurrent({0, 500});
    QTest::mousePress(&w, Qt::LeftButton, Qt::NoModifier, QPoint(gpu.left() + 400, gpu.center().y()));
    QTest::mouseMove(&w, QPoint(gpu.left() + 300, gpu.center().y()));
    QTest::mouseRelease(&w, Qt::LeftButton, Qt::NoModifier, QPoint(gpu.left() + 300, gpu.center().y()));
    QCOMPARE(w.mapping().t0, int64_t{50});  // 100 px to the left at 0.5 ns per px: 50 ns later
  }

  void pyramidAgreesWithExactPath() {
    // 200k short spans of two kinds on one lane, viewed whole on 800 px: the pyramid is chosen
    // and its per-column coverage matches the exact rasterisation.
    TraceDataBuilder b;
    b.setMeta({{"source", "measured"}});
    b.addLane({0, "GPU compute", "gpu"});
    std::mt19937 rng(7);
    int64_t t = 0;
    for (int i = 0; i < 200000; ++i) {
      const int64_t gap = rng() % 400, dur = 50 + rng() % 900;
      t += gap;
      b.addSpan({0, "s", i % 3 ? "forward" : "h2d", 0, -1, -1, t, t + dur, 0, 0});
      t += dur;
    }
    const auto d = b.finish();
    const LaneData& lane = d->lanes[0];
    const TimeMapping m{d->startNs, d->endNs, 800.0};
    QCOMPARE(chooseRasterPath(lane, m), RasterPath::Pyramid);
    std::vector<CategoryCover> exact, pyr;
    rasterizeLane(lane, m, 800, exact, RasterPath::Exact);
    rasterizeLane(lane, m, 800, pyr, RasterPath::Pyramid);
    for (int c = 0; c < 800; ++c)
      for (int k = 0; k < kCategoryCount; ++k)
        QVERIFY2(std::abs(exact[c][k] - pyr[c][k]) < 0.02,
                 qPrintable(QStringLiteral("column %1 category %2: exact %3, pyramid %4").arg(c).arg(k).arg(exact[c][k]).arg(pyr[c][k])));
    // Zoomed in on a few spans, the exact path is used.
    const TimeMapping in{lane.start[1000], lane.start[1010], 800.0};
    QCOMPARE(chooseRasterPath(lane, in), RasterPath::Exact);
    // At most one primitive per pixel column when zoomed out.
    QImage img(800, 30, QImage::Format_RGB32);
    QPainter p(&img);
    const int prims = paintLane(p, *d, lane, m, QRect(0, 0, 800, 30));
    QVERIFY(prims <= 800);
  }
};

QTEST_MAIN(TestRender)
#include "tst_render.moc"

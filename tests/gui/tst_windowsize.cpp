// megatrain-gui's --size value and its screenshot errors (issue 16): a size past the bound is
// refused naming the bound instead of painting 1,741 QPainter warnings, and a screenshot that
// cannot be written says why (the folder is missing, the path is a folder) instead of guessing at
// permissions.
#include <QDir>
#include <QFileInfo>
#include <QTemporaryDir>
#include <QTest>

#include "megatrain/gui/mainwindow.h"
#include "megatrain/gui/windowsize.h"

using namespace megatrain::gui;

class TestWindowSize : public QObject {
  Q_OBJECT
 private slots:
  void parses_data() {
    QTest::addColumn<QString>("text");
    QTest::addColumn<QSize>("size");
    QTest::addColumn<QString>("error");
    const QString accepted = QStringLiteral("; accepted: WIDTHxHEIGHT, each side 200 to 16384 pixels");
    QTest::newRow("default") << "1600x1000" << QSize(1600, 1000) << QString();
    QTest::newRow("smallest") << "200x200" << QSize(200, 200) << QString();
    QTest::newRow("largest") << "16384x16384" << QSize(16384, 16384) << QString();
    QTest::newRow("too wide") << "100000x100000" << QSize()
                              << QStringLiteral("--size: width must be at most 16384 (got 100000)") + accepted;
    QTest::newRow("too tall") << "800x16385" << QSize() << QStringLiteral("--size: height must be at most 16384 (got 16385)") + accepted;
    QTest::newRow("too small") << "199x800" << QSize() << QStringLiteral("--size: width must be at least 200 (got 199)") + accepted;
    QTest::newRow("past int") << "99999999999x800" << QSize()
                              << QStringLiteral("--size: width must be at most 16384 (got 99999999999)") + accepted;
    QTest::newRow("no x") << "1600" << QSize() << QStringLiteral("--size: expected WIDTHxHEIGHT (got '1600')") + accepted;
    QTest::newRow("three sides") << "1x2x3" << QSize() << QStringLiteral("--size: expected WIDTHxHEIGHT (got '1x2x3')") + accepted;
    QTest::newRow("not a number") << "wide x800" << QSize()
                                  << QStringLiteral("--size: width expected a whole number from 200 to 16384 (got 'wide ')") + accepted;
  }
  void parses() {
    QFETCH(QString, text);
    QFETCH(QSize, size);
    QFETCH(QString, error);
    QString why;
    const QSize got = parseWindowSize(text, &why);
    QCOMPARE(got, size);
    if (size.isValid()) QVERIFY(got.isValid());
    else QCOMPARE(why, error);
  }

  void screenshotSaysWhyItFailed() {
    QTemporaryDir dir;
    QVERIFY(dir.isValid());
    MainWindow w;
    w.resize(400, 300);
    const QString missing = dir.filePath(QStringLiteral("missing/x.png"));
    const QString err = w.saveScreenshot(missing);
    QCOMPARE(err, QStringLiteral("%1: the folder %2 does not exist").arg(missing, dir.filePath(QStringLiteral("missing"))));
    QVERIFY(!err.contains(QStringLiteral("writable")));
    const QString folder = w.saveScreenshot(dir.path());
    QVERIFY2(folder.contains(QStringLiteral("is a folder")), qPrintable(folder));
    const QString good = dir.filePath(QStringLiteral("ok.png"));
    QCOMPARE(w.saveScreenshot(good), QString());
    QVERIFY(QFileInfo(good).size() > 0);
  }
};

QTEST_MAIN(TestWindowSize)
#include "tst_windowsize.moc"

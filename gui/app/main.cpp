// megatrain-gui [FILE.mtrace|PLAN.json ...] [--screenshot out.png]: the inspector. With
// --screenshot it opens the files, waits for them to load, writes a PNG of the window and exits
// (headless: QT_QPA_PLATFORM=offscreen, chosen automatically when there is no display).
#include <QApplication>
#include <QCommandLineParser>
#include <QTimer>

#include <cstdio>
#include <cstring>

#include "megatrain/core/output_path.h"
#include "megatrain/gui/mainwindow.h"
#include "megatrain/gui/windowsize.h"

namespace {

QtMessageHandler g_defaultHandler = nullptr;

// The offscreen platform warns that it cannot propagate size hints each time a window is laid out;
// that says nothing about the program, so it is dropped. Everything else goes through.
void messageHandler(QtMsgType type, const QMessageLogContext& context, const QString& message) {
  if (message.contains(QLatin1String("does not support propagateSizeHints"))) return;
  if (g_defaultHandler) g_defaultHandler(type, context, message);
}

}  // namespace

int main(int argc, char** argv) {
  g_defaultHandler = qInstallMessageHandler(messageHandler);
  bool screenshot = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--screenshot", 12) == 0) screenshot = true;
  if (screenshot && !qEnvironmentVariableIsSet("QT_QPA_PLATFORM") && !qEnvironmentVariableIsSet("DISPLAY") &&
      !qEnvironmentVariableIsSet("WAYLAND_DISPLAY"))
    qputenv("QT_QPA_PLATFORM", "offscreen");

  QApplication app(argc, argv);
  QApplication::setOrganizationName(QStringLiteral("MegaTrain"));
  QApplication::setApplicationName(QStringLiteral("megatrain-gui"));
  QApplication::setApplicationVersion(QStringLiteral("0.1.0"));

  QCommandLineParser parser;
  parser.setApplicationDescription(QStringLiteral("MegaTrain inspector: timelines of simulated and measured training steps"));
  parser.addHelpOption();
  parser.addVersionOption();
  parser.addPositionalArgument(QStringLiteral("files"), QStringLiteral("Traces (.mtrace) and plans (.json) to open; plans are simulated"),
                               QStringLiteral("[FILE.mtrace|PLAN.json ...]"));
  QCommandLineOption shot(QStringLiteral("screenshot"), QStringLiteral("Write a PNG of the window once the files are loaded, then exit"),
                          QStringLiteral("out.png"));
  QCommandLineOption size(QStringLiteral("size"), QStringLiteral("Window size for the screenshot (default 1600x1000)"),
                          QStringLiteral("WxH"), QStringLiteral("1600x1000"));
  QCommandLineOption tab(QStringLiteral("tab"), QStringLiteral("Main tab to show: timeline (default) or compare (the first two files)"),
                         QStringLiteral("name"), QStringLiteral("timeline"));
  parser.addOption(shot);
  parser.addOption(tab);
  parser.addOption(size);
  parser.process(app);

  // Arguments and the screenshot's path are checked before any file is opened or simulated.
  QString sizeError;
  const QSize windowSize = megatrain::gui::parseWindowSize(parser.value(size), &sizeError);
  if (!windowSize.isValid()) {
    std::fprintf(stderr, "megatrain-gui: error: %s\n", qPrintable(sizeError));
    return 1;
  }
  if (parser.isSet(shot)) {
    const megatrain::Status s =
        megatrain::check_output("--screenshot", parser.value(shot).toStdString(), megatrain::OutputKind::kFile);
    if (!s.ok()) {
      std::fprintf(stderr, "megatrain-gui: error: %s\n", s.message().c_str());
      return 1;
    }
  }
  megatrain::gui::MainWindow w;
  w.resize(windowSize);
  if (!w.showTab(parser.value(tab))) {
    std::fprintf(stderr, "megatrain-gui: error: --tab takes timeline or compare (got '%s')\n", qPrintable(parser.value(tab)));
    return 1;
  }
  if (parser.isSet(shot)) w.setAttribute(Qt::WA_DontShowOnScreen);
  w.show();
  w.openFiles(parser.positionalArguments());

  if (!parser.isSet(shot)) return app.exec();

  const QString out = parser.value(shot);
  auto finish = [&] {
    const QString err = w.saveScreenshot(out);
    if (!err.isEmpty()) {
      std::fprintf(stderr, "megatrain-gui: screenshot not written: %s\n", qPrintable(err));
      app.exit(1);
      return;
    }
    for (const QString& e : w.errors()) std::fprintf(stderr, "megatrain-gui: %s\n", qPrintable(e));
    std::fprintf(stderr, "megatrain-gui: screenshot written to %s\n", qPrintable(out));
    app.exit(w.errors().isEmpty() ? 0 : 1);
  };
  if (w.loader()->pending() == 0) QTimer::singleShot(0, &app, finish);
  else QObject::connect(w.loader(), &megatrain::gui::TraceLoader::idle, &app, [&] { QTimer::singleShot(50, &app, finish); });
  return app.exec();
}

// MainWindow: the inspector. Open traces and plans (menu, recent files, drag and drop, command
// line); a timeline of the current one with memory charts; panels for the summary, the selected
// range, stalls, memory and lanes; a comparison of two open files aligned on their reported steps;
// and a what-if editor that re-simulates a plan in the background and saves the edited plan.
// Errors (a corrupt trace, a bad plan) appear in a banner in the window.
#pragma once

#include <QMainWindow>
#include <QStringList>

#include <optional>

#include "megatrain/core/plan.h"
#include "megatrain/gui/loader.h"

class QComboBox;
class QLabel;
class QFrame;
class QMenu;
class QSpinBox;
class QTabWidget;
class QTableView;
class QTimer;
class QPushButton;

namespace megatrain::gui {

class TimelineWidget;
class SummaryModel;
class LaneModel;
class StallModel;
class MemoryModel;
class StepModel;
class RangeStatsModel;
class CompareResourceModel;
class CompareLayerModel;
class SpanListModel;

class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  explicit MainWindow(QWidget* parent = nullptr);
  ~MainWindow() override;

  struct Document {
    QString path;
    TraceDataPtr data;
    std::optional<Plan> plan;      // the plan behind it (what-if), once parsed
    std::optional<Plan> original;  // the plan as opened, for "Reset"
    bool edited = false;
  };

  // Starts loading each file in the background.
  void openFiles(const QStringList& paths);
  TraceLoader* loader() const { return loader_; }
  int documentCount() const { return static_cast<int>(docs_.size()); }
  const Document* currentDocument() const;
  void setCurrentDocument(int index);
  QStringList errors() const { return errors_; }
  bool errorBannerVisible() const;
  QString errorBannerText() const;
  TimelineWidget* timeline() const { return timeline_; }

  // PNG of the whole window; returns an empty string or the error.
  QString saveScreenshot(const QString& path);
  // Perfetto / Chrome Trace Event JSON of the current document (core's export_chrome_trace);
  // returns an empty string or the error.
  QString exportPerfetto(const QString& path);
  // Applies what-if edits to the current document's plan and re-simulates in the background.
  QString applyWhatIf(const WhatIfEdits& edits);

  static QStringList recentFiles();
  // What clicking the summary's bottleneck row does: highlights the bottleneck's lane, selects the
  // reported step and lists the lane's spans in it. False when the bottleneck has no lane.
  bool selectBottleneck();
  // Shows the main tab named "timeline" or "compare"; false for another name.
  bool showTab(const QString& name);

 signals:
  void documentChanged();
  void whatIfFinished(bool ok);

 protected:
  void dragEnterEvent(class QDragEnterEvent* e) override;
  void dropEvent(class QDropEvent* e) override;
  void closeEvent(class QCloseEvent* e) override;

 private slots:
  void onLoaded(const QString& path, megatrain::gui::TraceDataPtr data);
  void onFailed(const QString& path, const QString& message);
  void onWhatIfLoaded(const QString& path, megatrain::gui::TraceDataPtr data);
  void onWhatIfFailed(const QString& path, const QString& message);

 private:
  void buildMenus();
  QWidget* buildCompareTab();
  QWidget* buildWhatIfTab();
  void showError(const QString& message);
  void refreshCurrent();
  void refreshCompare();
  void refreshWhatIfEditors();
  void updateLoadingLabel();
  void addRecent(const QString& path);
  void ensurePlan(Document& d);
  void scheduleWhatIf();
  void runWhatIf();
  WhatIfEdits editsFromEditors() const;

  TraceLoader* loader_;
  TraceLoader* whatIfLoader_;
  QVector<Document> docs_;     // in the order the files were asked for
  QStringList requested_;      // every path asked for, oldest first
  QString preferred_;          // the first file of the latest openFiles(): shown when it arrives
  int current_ = -1;
  QStringList errors_;

  QComboBox* docCombo_ = nullptr;
  QLabel* loadingLabel_ = nullptr;
  QFrame* errorBanner_ = nullptr;
  QLabel* errorLabel_ = nullptr;
  QTabWidget* mainTabs_ = nullptr;
  QTabWidget* sideTabs_ = nullptr;
  TimelineWidget* timeline_ = nullptr;
  QMenu* recentMenu_ = nullptr;

  SummaryModel* summaryModel_;
  LaneModel* laneModel_;
  StallModel* stallModel_;
  MemoryModel* memoryModel_;
  StepModel* stepModel_;
  RangeStatsModel* rangeModel_;
  SpanListModel* spanModel_;
  QTableView* summaryView_ = nullptr;
  QLabel* rangeLabel_ = nullptr;

  QComboBox* compareA_ = nullptr;
  QComboBox* compareB_ = nullptr;
  TimelineWidget* compareTimeline_ = nullptr;
  CompareResourceModel* compareResourceModel_;
  CompareLayerModel* compareLayerModel_;
  QLabel* compareLabel_ = nullptr;

  QSpinBox* wiPrefetch_ = nullptr;
  QComboBox* wiMFormat_ = nullptr;
  QComboBox* wiVFormat_ = nullptr;
  QComboBox* wiMaster_ = nullptr;
  QComboBox* wiStates_ = nullptr;
  QSpinBox* wiMicroBatch_ = nullptr;
  QComboBox* wiOrder_ = nullptr;
  QLabel* wiStatus_ = nullptr;
  QPushButton* wiSave_ = nullptr;
  QTimer* wiTimer_ = nullptr;
  bool wiUpdating_ = false;
  int wiDoc_ = -1;
  double wiBaseStepS_ = 0;
};

}  // namespace megatrain::gui

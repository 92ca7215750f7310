// MainWindow: the inspector's window (see the header).
#include "megatrain/gui/mainwindow.h"

#include <QAction>
#include <QApplication>
#include <QCloseEvent>
#include <QComboBox>
#include <QDragEnterEvent>
#include <QDropEvent>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QFrame>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QImageWriter>
#include <QLabel>
#include <QMenuBar>
#include <QMimeData>
#include <QPushButton>
#include <QScrollArea>
#include <QSettings>
#include <QSpinBox>
#include <QSplitter>
#include <QStatusBar>
#include <QTabWidget>
#include <QTableView>
#include <QTimer>
#include <QVBoxLayout>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/output_path.h"
#include "megatrain/core/trace_store.h"
#include "megatrain/gui/lanepainter.h"
#include "megatrain/gui/models.h"
#include "megatrain/gui/timelinewidget.h"

namespace megatrain::gui {
namespace {

constexpr int kMaxRecent = 10;

QTableView* makeTable(QAbstractItemModel* model, QWidget* parent) {
  auto* v = new QTableView(parent);
  v->setModel(model);
  v->setSelectionBehavior(QAbstractItemView::SelectRows);
  v->setEditTriggers(QAbstractItemView::NoEditTriggers);
  v->verticalHeader()->setVisible(false);
  v->verticalHeader()->setDefaultSectionSize(22);
  v->horizontalHeader()->setStretchLastSection(true);
  v->setAlternatingRowColors(true);
  v->setWordWrap(false);
  QObject::connect(model, &QAbstractItemModel::modelReset, v, [v] { v->resizeColumnsToContents(); });
  return v;
}

QString legendHtml() {
  QString html;
  for (int c = 0; c < kCategoryCount; ++c) {
    const auto cat = static_cast<SpanCategory>(c);
    html += QStringLiteral("<span style='color:%1'>&#9632;</span>&nbsp;%2&nbsp;&nbsp;")
                .arg(categoryColor(cat).name(), QString::fromLatin1(categoryName(cat)));
  }
  html += QStringLiteral("<span style='color:#d6363b'>- - -</span>&nbsp;capacity&nbsp;&nbsp;"
                         "<span style='color:#f0b429'>&#9644;</span>&nbsp;reported step");
  return html;
}

QComboBox* makeCombo(const QStringList& items, QWidget* parent) {
  auto* c = new QComboBox(parent);
  c->addItems(items);
  return c;
}

// A plan enum's words (core/plan.h), for a combo box.
QStringList wordList(const std::vector<std::string>& names) {
  QStringList l;
  for (const std::string& n : names) l << QString::fromStdString(n);
  return l;
}

}  // namespace

MainWindow::MainWindow(QWidget* parent)
    : QMainWindow(parent),
      loader_(new TraceLoader(this)),
      whatIfLoader_(new TraceLoader(this)),
      summaryModel_(new SummaryModel(this)),
      laneModel_(new LaneModel(this)),
      stallModel_(new StallModel(this)),
      memoryModel_(new MemoryModel(this)),
      stepModel_(new StepModel(this)),
      rangeModel_(new RangeStatsModel(this)),
      spanModel_(new SpanListModel(this)),
      compareResourceModel_(new CompareResourceModel(this)),
      compareLayerModel_(new CompareLayerModel(this)) {
  setWindowTitle(tr("MegaTrain inspector"));
  setAcceptDrops(true);
  connect(loader_, &TraceLoader::loaded, this, &MainWindow::onLoaded);
  connect(loader_, &TraceLoader::failed, this, &MainWindow::onFailed);
  connect(loader_, &TraceLoader::idle, this, &MainWindow::updateLoadingLabel);
  connect(whatIfLoader_, &TraceLoader::loaded, this, &MainWindow::onWhatIfLoaded);
  connect(whatIfLoader_, &TraceLoader::failed, this, &MainWindow::onWhatIfFailed);

  auto* central = new QWidget(this);
  auto* outer = new QVBoxLayout(central);
  outer->setContentsMargins(6, 6, 6, 6);

  auto* top = new QHBoxLayout;
  top->addWidget(new QLabel(tr("File:"), central));
  docCombo_ = new QComboBox(central);
  docCombo_->setMinimumWidth(320);
  top->addWidget(docCombo_);
  loadingLabel_ = new QLabel(central);
  top->addWidget(loadingLabel_);
  top->addStretch(1);
  auto* legend = new QLabel(legendHtml(), central);
  legend->setTextFormat(Qt::RichText);
  top->addWidget(legend);
  outer->addLayout(top);
  connect(docCombo_, qOverload<int>(&QComboBox::currentIndexChanged), this, [this](int i) { setCurrentDocument(i); });

  errorBanner_ = new QFrame(central);
  errorBanner_->setObjectName(QStringLiteral("errorBanner"));
  errorBanner_->setStyleSheet(QStringLiteral("#errorBanner { background: #fde2e1; border: 1px solid #d6363b; border-radius: 3px; }"));
  auto* eb = new QHBoxLayout(errorBanner_);
  errorLabel_ = new QLabel(errorBanner_);
  errorLabel_->setWordWrap(true);
  errorLabel_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  eb->addWidget(errorLabel_, 1);
  auto* dismiss = new QPushButton(tr("Dismiss"), errorBanner_);
  eb->addWidget(dismiss);
  connect(dismiss, &QPushButton::clicked, this, [this] {
    errorBanner_->hide();
    errors_.clear();
  });
  errorBanner_->hide();
  outer->addWidget(errorBanner_);

  auto* split = new QSplitter(Qt::Horizontal, central);
  mainTabs_ = new QTabWidget(split);
  timeline_ = new TimelineWidget;
  auto* scroll = new QScrollArea;
  scroll->setWidget(timeline_);
  scroll->setWidgetResizable(true);
  scroll->setFrameShape(QFrame::NoFrame);
  mainTabs_->addTab(scroll, tr("Timeline"));
  mainTabs_->addTab(buildCompareTab(), tr("Compare"));

  sideTabs_ = new QTabWidget(split);
  summaryView_ = makeTable(summaryModel_, sideTabs_);
  sideTabs_->addTab(summaryView_, tr("Summary"));
  auto* rangePage = new QWidget;
  auto* rl = new QVBoxLayout(rangePage);
  rl->setContentsMargins(2, 2, 2, 2);
  rangeLabel_ = new QLabel(tr("Shift+drag (or right-drag) on the timeline to select a range; click a lane to list its spans."), rangePage);
  rangeLabel_->setWordWrap(true);
  rl->addWidget(rangeLabel_);
  auto* rangeSplit = new QSplitter(Qt::Vertical, rangePage);
  makeTable(rangeModel_, rangeSplit);
  makeTable(spanModel_, rangeSplit);
  rl->addWidget(rangeSplit, 1);
  sideTabs_->addTab(rangePage, tr("Selection"));
  sideTabs_->addTab(makeTable(stallModel_, sideTabs_), tr("Stalls"));
  sideTabs_->addTab(makeTable(memoryModel_, sideTabs_), tr("Memory"));
  sideTabs_->addTab(makeTable(stepModel_, sideTabs_), tr("Steps"));
  sideTabs_->addTab(makeTable(laneModel_, sideTabs_), tr("Lanes"));
  sideTabs_->addTab(buildWhatIfTab(), tr("What-if"));
  split->addWidget(mainTabs_);
  split->addWidget(sideTabs_);
  split->setStretchFactor(0, 3);
  split->setStretchFactor(1, 1);
  split->setSizes({1100, 460});
  outer->addWidget(split, 1);
  setCentralWidget(central);

  connect(summaryView_, &QTableView::clicked, this, [this](const QModelIndex& idx) {
    if (summaryModel_->rowKey(idx.row()) == QStringLiteral("bottleneck")) selectBottleneck();
  });
  connect(timeline_, &TimelineWidget::selectionChanged, this, [this](qint64 t0, qint64 t1) {
    const Document* d = currentDocument();
    if (!d) return;
    rangeModel_->setRange(d->data, t0, t1);
    rangeLabel_->setText(tr("Range %1 .. %2 (%3)").arg(qFormatDuration(static_cast<double>(t0) * 1e-9),
                                                        qFormatDuration(static_cast<double>(t1) * 1e-9),
                                                        qFormatDuration(static_cast<double>(t1 - t0) * 1e-9)));
    auto [tr_, lane] = timeline_->highlightedLane();
    if (lane >= 0) spanModel_->setLane(d->data, lane, t0, t1);
  });
  connect(timeline_, &TimelineWidget::laneClicked, this, [this](int, int lane) {
    const Document* d = currentDocument();
    if (!d) return;
    const auto sel = timeline_->selection();
    const TimeMapping m = timeline_->mapping();
    spanModel_->setLane(d->data, lane, sel ? sel->first : m.t0, sel ? sel->second : m.t1);
  });

  buildMenus();
  statusBar()->showMessage(tr("Wheel: zoom   Drag: pan   Shift+drag: select   Double-click: zoom to selection   Backspace: zoom out"));
  resize(1600, 1000);
}

MainWindow::~MainWindow() {
  loader_->waitForAll();
  whatIfLoader_->waitForAll();
}

void MainWindow::buildMenus() {
  QMenu* file = menuBar()->addMenu(tr("&File"));
  file->addAction(tr("&Open..."), QKeySequence::Open, this, [this] {
    const QStringList files = QFileDialog::getOpenFileNames(this, tr("Open traces or plans"), QString(),
                                                            tr("Traces and plans (*.mtrace *.json);;All files (*)"));
    openFiles(files);
  });
  recentMenu_ = file->addMenu(tr("Open &Recent"));
  connect(recentMenu_, &QMenu::aboutToShow, this, [this] {
    recentMenu_->clear();
    const QStringList recent = recentFiles();
    if (recent.isEmpty()) recentMenu_->addAction(tr("(no recent files)"))->setEnabled(false);
    for (const QString& f : recent) recentMenu_->addAction(f, this, [this, f] { openFiles({f}); });
  });
  file->addSeparator();
  file->addAction(tr("Save &Screenshot (PNG)..."), this, [this] {
    const QString f = QFileDialog::getSaveFileName(this, tr("Save screenshot"), QStringLiteral("megatrain.png"), tr("PNG (*.png)"));
    if (f.isEmpty()) return;
    const QString err = saveScreenshot(f);
    if (!err.isEmpty()) showError(err);
    else statusBar()->showMessage(tr("Screenshot written to %1").arg(f), 5000);
  });
  file->addAction(tr("Export &Perfetto JSON..."), this, [this] {
    const QString f = QFileDialog::getSaveFileName(this, tr("Export Chrome Trace Event JSON"), QStringLiteral("trace.json"), tr("JSON (*.json)"));
    if (f.isEmpty()) return;
    const QString err = exportPerfetto(f);
    if (!err.isEmpty()) showError(err);
    else statusBar()->showMessage(tr("Perfetto JSON written to %1 (open it at ui.perfetto.dev)").arg(f), 5000);
  });
  file->addSeparator();
  file->addAction(tr("&Quit"), QKeySequence::Quit, this, &QWidget::close);
  QMenu* view = menuBar()->addMenu(tr("&View"));
  view->addAction(tr("Zoom to selection"), this, [this] { timeline_->zoomToSelection(); });
  view->addAction(tr("Zoom out"), QKeySequence(Qt::Key_Backspace), this, [this] { timeline_->zoomOut(); });
  view->addAction(tr("Show everything"), QKeySequence(Qt::Key_Home), this, [this] { timeline_->resetZoom(); });
}

QWidget* MainWindow::buildCompareTab() {
  auto* page = new QWidget;
  auto* l = new QVBoxLayout(page);
  auto* row = new QHBoxLayout;
  row->addWidget(new QLabel(tr("A:"), page));
  compareA_ = new QComboBox(page);
  compareA_->setMinimumWidth(240);
  row->addWidget(compareA_);
  row->addWidget(new QLabel(tr("B:"), page));
  compareB_ = new QComboBox(page);
  compareB_->setMinimumWidth(240);
  row->addWidget(compareB_);
  compareLabel_ = new QLabel(page);
  row->addWidget(compareLabel_, 1);
  l->addLayout(row);
  auto* split = new QSplitter(Qt::Vertical, page);
  compareTimeline_ = new TimelineWidget;
  auto* scroll = new QScrollArea;
  scroll->setWidget(compareTimeline_);
  scroll->setWidgetResizable(true);
  split->addWidget(scroll);
  auto* tables = new QSplitter(Qt::Horizontal, split);
  makeTable(compareResourceModel_, tables);
  makeTable(compareLayerModel_, tables);
  split->addWidget(tables);
  split->setSizes({600, 300});
  l->addWidget(split, 1);
  connect(compareA_, qOverload<int>(&QComboBox::currentIndexChanged), this, [this] { refreshCompare(); });
  connect(compareB_, qOverload<int>(&QComboBox::currentIndexChanged), this, [this] { refreshCompare(); });
  return page;
}

QWidget* MainWindow::buildWhatIfTab() {
  auto* page = new QWidget;
  auto* form = new QFormLayout(page);
  const QStringList formats = {QStringLiteral("fp32"), QStringLiteral("bf16"), QStringLiteral("q8"), QStringLiteral("q4"),
                               QStringLiteral("q3"), QStringLiteral("q2")};
  const QStringList tiers = wordList(tier_names());
  wiPrefetch_ = new QSpinBox(page);
  wiPrefetch_->setRange(1, 64);  // the plan format accepts 1 .. 1024
  wiMFormat_ = makeCombo(formats, page);
  wiVFormat_ = makeCombo(formats, page);
  wiMaster_ = makeCombo(tiers, page);
  wiStates_ = makeCombo(tiers, page);
  wiMicroBatch_ = new QSpinBox(page);
  wiMicroBatch_->setRange(1, 65536);
  wiOrder_ = makeCombo(wordList(schedule_order_names()), page);
  form->addRow(tr("Prefetch depth"), wiPrefetch_);
  form->addRow(tr("Adam m format"), wiMFormat_);
  form->addRow(tr("Adam v format"), wiVFormat_);
  form->addRow(tr("Master weights on"), wiMaster_);
  form->addRow(tr("Optimizer states on"), wiStates_);
  form->addRow(tr("Micro-batch"), wiMicroBatch_);
  form->addRow(tr("Schedule order"), wiOrder_);
  auto* buttons = new QHBoxLayout;
  auto* reset = new QPushButton(tr("Reset"), page);
  wiSave_ = new QPushButton(tr("Save plan as..."), page);
  buttons->addWidget(reset);
  buttons->addWidget(wiSave_);
  form->addRow(buttons);
  wiStatus_ = new QLabel(tr("Open a plan, or a trace that carries its plan, to edit it here."), page);
  wiStatus_->setWordWrap(true);
  form->addRow(wiStatus_);
  page->setEnabled(false);

  wiTimer_ = new QTimer(this);
  wiTimer_->setSingleShot(true);
  wiTimer_->setInterval(350);
  connect(wiTimer_, &QTimer::timeout, this, &MainWindow::runWhatIf);
  connect(wiPrefetch_, qOverload<int>(&QSpinBox::valueChanged), this, &MainWindow::scheduleWhatIf);
  connect(wiMicroBatch_, qOverload<int>(&QSpinBox::valueChanged), this, &MainWindow::scheduleWhatIf);
  for (QComboBox* c : {wiMFormat_, wiVFormat_, wiMaster_, wiStates_, wiOrder_})
    connect(c, qOverload<int>(&QComboBox::currentIndexChanged), this, &MainWindow::scheduleWhatIf);
  connect(reset, &QPushButton::clicked, this, [this] {
    if (current_ < 0 || !docs_[current_].original) return;
    docs_[current_].plan = docs_[current_].original;
    refreshWhatIfEditors();
    runWhatIf();
  });
  connect(wiSave_, &QPushButton::clicked, this, [this] {
    const Document* d = currentDocument();
    if (!d || !d->plan) return;
    const QString f = QFileDialog::getSaveFileName(this, tr("Save edited plan"), QStringLiteral("plan-edited.json"), tr("Plan (*.json)"));
    if (f.isEmpty()) return;
    Status st = d->plan->save(f.toStdString());
    if (!st.ok()) showError(tr("Could not save the plan to %1: %2").arg(f, QString::fromStdString(st.message())));
    else statusBar()->showMessage(tr("Plan written to %1").arg(f), 5000);
  });
  return page;
}

void MainWindow::openFiles(const QStringList& paths) {
  bool first = true;
  for (const QString& p : paths) {
    if (p.isEmpty()) continue;
    requested_.removeAll(p);
    requested_.push_back(p);
    if (first) preferred_ = p;
    first = false;
    loader_->open(p);
  }
  updateLoadingLabel();
}

void MainWindow::updateLoadingLabel() {
  const int n = loader_->pending() + whatIfLoader_->pending();
  loadingLabel_->setText(n > 0 ? tr("loading %n file(s)...", nullptr, n) : QString());
}

const MainWindow::Document* MainWindow::currentDocument() const {
  return current_ >= 0 && current_ < docs_.size() ? &docs_[current_] : nullptr;
}

void MainWindow::onLoaded(const QString& path, TraceDataPtr trace) {
  int index = -1;
  for (int i = 0; i < docs_.size(); ++i)
    if (docs_[i].path == path) index = i;
  if (index < 0) {
    // Files keep the order they were asked for, however the loads finish.
    const qsizetype order = requested_.indexOf(path);
    index = 0;
    while (index < docs_.size() && requested_.indexOf(docs_[index].path) < order) ++index;
    docs_.insert(index, {path, trace, std::nullopt, std::nullopt, false});
    if (current_ >= index) ++current_;
    if (wiDoc_ >= index) ++wiDoc_;
    QSignalBlocker block(docCombo_);
    docCombo_->insertItem(index, QString::fromStdString(trace->displayName), path);
    docCombo_->setItemData(index, path, Qt::ToolTipRole);
    if (current_ >= 0) docCombo_->setCurrentIndex(current_);
  } else {
    docs_[index] = {path, trace, std::nullopt, std::nullopt, false};
    docCombo_->setItemText(index, QString::fromStdString(trace->displayName));
  }
  addRecent(QFileInfo(path).absoluteFilePath());
  updateLoadingLabel();
  // The first file of the latest batch opened becomes current (the others wait in the File list),
  // and any file while nothing is shown.
  if (current_ < 0 || path == preferred_) {
    if (docCombo_->currentIndex() != index) docCombo_->setCurrentIndex(index);
    else setCurrentDocument(index);
  } else if (current_ == index) {
    refreshCurrent();  // the current file was reloaded
  }
  refreshCompare();
}

void MainWindow::onFailed(const QString& path, const QString& message) {
  updateLoadingLabel();
  showError(tr("Could not open %1: %2").arg(path, message));
}

void MainWindow::showError(const QString& message) {
  errors_.push_back(message);
  QStringList shown = errors_.mid(std::max<qsizetype>(0, errors_.size() - 4));
  for (QString& s : shown) s = s.toHtmlEscaped();
  errorLabel_->setText(QStringLiteral("<b>%1</b><br>%2").arg(tr("Error"), shown.join(QStringLiteral("<br>"))));
  errorBanner_->show();
}

bool MainWindow::errorBannerVisible() const { return !errorBanner_->isHidden(); }
QString MainWindow::errorBannerText() const { return errorLabel_->text(); }

void MainWindow::setCurrentDocument(int index) {
  if (index < 0 || index >= docs_.size()) return;
  current_ = index;
  if (docCombo_->currentIndex() != index) {
    docCombo_->setCurrentIndex(index);  // re-enters with the same index
    return;
  }
  refreshCurrent();
}

void MainWindow::refreshCurrent() {
  const Document* d = currentDocument();
  const TraceDataPtr trace = d ? d->data : nullptr;
  if (trace && !trace->otherRanks.empty()) {
    // A data-parallel job: its ranks side by side on rank 0's time axis, each other rank shifted so
    // that its reported step starts where rank 0's does (each rank's trace has its own clock; the
    // ranks meet in every collective). Selections and the tables stay rank 0's.
    QVector<TimelineWidget::Track> tracks = {{trace, 0, tr("rank 0")}};
    for (size_t k = 0; k < trace->otherRanks.size(); ++k) {
      const TraceDataPtr& r = trace->otherRanks[k];
      tracks.push_back({r, trace->summary.windowStart - r->summary.windowStart, tr("rank %1").arg(k + 1)});
    }
    timeline_->setTracks(tracks);
  } else {
    timeline_->setTrace(trace);
  }
  summaryModel_->setTrace(trace);
  laneModel_->setTrace(trace);
  stallModel_->setTrace(trace);
  memoryModel_->setTrace(trace);
  stepModel_->setTrace(trace);
  rangeModel_->clear();
  spanModel_->clear();
  refreshWhatIfEditors();
  if (trace)
    setWindowTitle(tr("%1 - MegaTrain inspector").arg(QString::fromStdString(trace->displayName)));
  emit documentChanged();
}

void MainWindow::refreshCompare() {
  const auto fill = [this](QComboBox* c, int preferred) {
    const QString keep = c->currentData().toString();
    QSignalBlocker block(c);
    c->clear();
    for (const auto& d : docs_) c->addItem(QString::fromStdString(d.data->displayName), d.path);
    int i = c->findData(keep);
    c->setCurrentIndex(i >= 0 ? i : std::min(preferred, c->count() - 1));
  };
  fill(compareA_, 0);
  fill(compareB_, 1);
  if (compareA_->currentIndex() == compareB_->currentIndex() && compareB_->count() >= 2) {
    // A file against itself says nothing: B becomes another open file.
    QSignalBlocker block(compareB_);
    compareB_->setCurrentIndex(compareA_->currentIndex() == 0 ? 1 : 0);
  }
  const int a = compareA_->currentIndex(), b = compareB_->currentIndex();
  if (a < 0 || b < 0 || a >= docs_.size() || b >= docs_.size()) {
    compareTimeline_->setTracks({});
    compareResourceModel_->setTraces(nullptr, nullptr);
    compareLayerModel_->setTraces(nullptr, nullptr);
    compareLabel_->setText(tr("Open two files (a predicted and a measured trace, or two plans) to compare them."));
    return;
  }
  const TraceDataPtr A = docs_[a].data, B = docs_[b].data;
  // Both traces shifted so that their reported steps start at 0.
  compareTimeline_->setTracks({{A, -A->summary.windowStart, QStringLiteral("A: ") + QString::fromStdString(A->displayName)},
                               {B, -B->summary.windowStart, QStringLiteral("B: ") + QString::fromStdString(B->displayName)}});
  // Start on the two reported steps; Home shows everything.
  const int64_t longest = std::max(A->summary.windowEnd - A->summary.windowStart, B->summary.windowEnd - B->summary.windowStart);
  compareTimeline_->zoomStack()->setCurrent({-longest / 50, longest + longest / 50});
  compareResourceModel_->setTraces(A, B);
  compareLayerModel_->setTraces(A, B);
  const double sa = A->summary.stepTimeS, sb = B->summary.stepTimeS;
  compareLabel_->setText(tr("step A %1, B %2 (B/A %3x)").arg(qFormatDuration(sa), qFormatDuration(sb))
                             .arg(sa > 0 ? sb / sa : 0.0, 0, 'f', 3));
}

bool MainWindow::selectBottleneck() {
  const Document* d = currentDocument();
  if (!d) return false;
  const std::string& b = d->data->summary.bottleneck;
  for (int l = 0; l < static_cast<int>(d->data->lanes.size()); ++l) {
    if (d->data->lanes[static_cast<size_t>(l)].lane.kind != b) continue;
    timeline_->setHighlightedLane(0, l);
    timeline_->setSelection(d->data->summary.windowStart, d->data->summary.windowEnd);
    spanModel_->setLane(d->data, l, d->data->summary.windowStart, d->data->summary.windowEnd);
    sideTabs_->setCurrentIndex(1);
    statusBar()->showMessage(tr("Bottleneck %1: lane %2, spans of the reported step listed under Selection")
                                 .arg(QString::fromStdString(b), QString::fromStdString(d->data->lanes[static_cast<size_t>(l)].lane.name)), 8000);
    return true;
  }
  statusBar()->showMessage(tr("The bottleneck '%1' has no lane of its own in this trace (host memory bandwidth is shared by copies and the optimizer)")
                               .arg(QString::fromStdString(b)), 8000);
  return false;
}

// ---- what-if -----------------------------------------------------------------------------------

void MainWindow::ensurePlan(Document& d) {
  if (d.plan || !d.data) return;
  Result<Plan> p = d.data->openedFromPlan ? Plan::load(d.path.toStdString())
                                          : Plan::from_json_text(d.data->planJson, "the trace's plan");
  if (p.ok()) {
    d.plan = *p;
    d.original = *p;
  }
}

void MainWindow::refreshWhatIfEditors() {
  QWidget* page = wiStatus_->parentWidget();
  if (current_ < 0) {
    page->setEnabled(false);
    return;
  }
  Document& d = docs_[current_];
  ensurePlan(d);
  page->setEnabled(d.plan.has_value());
  if (!d.plan) {
    wiStatus_->setText(d.data->planJson.empty() ? tr("This trace carries no plan; open the plan file to edit it.")
                                                : tr("The trace's plan could not be read (its model or rig is not in profiles/)."));
    return;
  }
  wiUpdating_ = true;
  const Plan& p = *d.plan;
  wiPrefetch_->setValue(static_cast<int>(p.schedule.prefetch_depth));
  wiMFormat_->setCurrentText(QString::fromLatin1(state_format_name(p.optimizer.m_format)));
  wiVFormat_->setCurrentText(QString::fromLatin1(state_format_name(p.optimizer.v_format)));
  wiMaster_->setCurrentText(QString::fromLatin1(megatrain::name(p.placement.master_weights)));
  wiStates_->setCurrentText(QString::fromLatin1(megatrain::name(p.placement.optimizer_states)));
  wiMicroBatch_->setValue(static_cast<int>(p.training.micro_batch));
  wiOrder_->setCurrentText(QString::fromLatin1(megatrain::name(p.schedule.order)));
  wiUpdating_ = false;
  if (!d.edited)
    wiStatus_->setText(tr("Change a setting: the plan is re-simulated in the background and the timeline and summary update."));
}

WhatIfEdits MainWindow::editsFromEditors() const {
  WhatIfEdits e;
  e.prefetchDepth = wiPrefetch_->value();
  e.mFormat = wiMFormat_->currentText().toStdString();
  e.vFormat = wiVFormat_->currentText().toStdString();
  e.masterWeights = wiMaster_->currentText().toStdString();
  e.optimizerStates = wiStates_->currentText().toStdString();
  e.microBatch = wiMicroBatch_->value();
  e.order = wiOrder_->currentText().toStdString();
  return e;
}

void MainWindow::scheduleWhatIf() {
  if (!wiUpdating_) wiTimer_->start();
}

void MainWindow::runWhatIf() {
  const QString err = applyWhatIf(editsFromEditors());
  if (!err.isEmpty()) wiStatus_->setText(tr("Not simulated: %1").arg(err));
}

QString MainWindow::applyWhatIf(const WhatIfEdits& edits) {
  if (current_ < 0) return tr("no file is open");
  Document& d = docs_[current_];
  ensurePlan(d);
  if (!d.plan) return tr("this file carries no plan that could be read");
  Result<Plan> edited = gui::applyWhatIf(*d.original, edits);
  if (!edited.ok()) return QString::fromStdString(edited.status().message());
  d.plan = *edited;
  wiDoc_ = current_;
  wiBaseStepS_ = d.data->summary.stepTimeS;
  whatIfLoader_->simulate(*edited, QString::fromStdString(QFileInfo(d.path).fileName().toStdString() + " (what-if)"), d.path);
  wiStatus_->setText(tr("Simulating the edited plan..."));
  updateLoadingLabel();
  return {};
}

void MainWindow::onWhatIfLoaded(const QString&, TraceDataPtr trace) {
  updateLoadingLabel();
  if (whatIfLoader_->pending() > 0 || wiDoc_ < 0 || wiDoc_ >= docs_.size()) return;  // a newer edit is on its way
  Document& d = docs_[wiDoc_];
  d.data = trace;
  d.edited = true;
  docCombo_->setItemText(wiDoc_, QString::fromStdString(trace->displayName));
  const double now = trace->summary.stepTimeS;
  wiStatus_->setText(tr("Step time %1 -> %2 (%3%4 %), bottleneck %5. Save the plan to keep it.")
                         .arg(qFormatDuration(wiBaseStepS_), qFormatDuration(now), now >= wiBaseStepS_ ? QStringLiteral("+") : QString())
                         .arg(wiBaseStepS_ > 0 ? (now / wiBaseStepS_ - 1) * 100 : 0.0, 0, 'f', 1)
                         .arg(QString::fromStdString(trace->summary.bottleneck)));
  if (wiDoc_ == current_) refreshCurrent();
  refreshCompare();
  emit whatIfFinished(true);
}

void MainWindow::onWhatIfFailed(const QString&, const QString& message) {
  updateLoadingLabel();
  if (whatIfLoader_->pending() > 0) return;
  wiStatus_->setText(tr("The edited plan could not be simulated: %1").arg(message));
  emit whatIfFinished(false);
}

bool MainWindow::showTab(const QString& name) {
  if (name == QLatin1String("timeline")) mainTabs_->setCurrentIndex(0);
  else if (name == QLatin1String("compare")) mainTabs_->setCurrentIndex(1);
  else return false;
  return true;
}

// ---- files, export -----------------------------------------------------------------------------

QStringList MainWindow::recentFiles() {
  QSettings s;
  return s.value(QStringLiteral("recentFiles")).toStringList();
}

void MainWindow::addRecent(const QString& path) {
  QSettings s;
  QStringList r = s.value(QStringLiteral("recentFiles")).toStringList();
  r.removeAll(path);
  r.prepend(path);
  while (r.size() > kMaxRecent) r.removeLast();
  s.setValue(QStringLiteral("recentFiles"), r);
}

QString MainWindow::saveScreenshot(const QString& path) {
  QApplication::processEvents();
  const QPixmap pm = grab();
  if (pm.isNull()) return tr("the window could not be rendered at %1x%2").arg(width()).arg(height());
  QImageWriter writer(path, "png");
  if (writer.write(pm.toImage())) return {};
  // QImageWriter's own reason is vague ("Device not writable"); the path check says which part failed.
  const Status st = check_output({}, path.toStdString(), OutputKind::kFile);
  return st.ok() ? tr("could not write %1: %2").arg(path, writer.errorString()) : QString::fromStdString(st.message());
}

QString MainWindow::exportPerfetto(const QString& path) {
  const Document* d = currentDocument();
  if (!d) return tr("no file is open to export");
  if (d->data->tracePath.empty()) return tr("%1 has no trace file behind it to export").arg(d->path);
  auto reader = TraceReader::open(d->data->tracePath);
  if (!reader.ok()) return QString::fromStdString(reader.status().message());
  Status st = export_chrome_trace(**reader, path.toStdString());
  return st.ok() ? QString() : QString::fromStdString(st.message());
}

void MainWindow::dragEnterEvent(QDragEnterEvent* e) {
  if (e->mimeData()->hasUrls()) e->acceptProposedAction();
}

void MainWindow::dropEvent(QDropEvent* e) {
  QStringList files;
  for (const QUrl& u : e->mimeData()->urls())
    if (u.isLocalFile()) files << u.toLocalFile();
  openFiles(files);
  e->acceptProposedAction();
}

void MainWindow::closeEvent(QCloseEvent* e) {
  loader_->waitForAll();
  whatIfLoader_->waitForAll();
  e->accept();
}

}  // namespace megatrain::gui

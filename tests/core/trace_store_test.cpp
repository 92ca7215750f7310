// Tests for the TraceStore: exact round trips, window queries, writer validation, atomic publish,
// reader diagnostics for damaged files, and the Chrome export read back by two JSON parsers.
#include <sqlite3.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "megatrain/core/trace_store.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;

// Each test gets its own directory so leftovers (temp files) are visible and tests never collide.
class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("megatrain-trace-" + std::to_string(::getpid()) + "-" + info->test_suite_name() + "-" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path dir_;
};

using TraceStoreTest = TraceTest;
using TraceWriterTest = TraceTest;
using TraceReaderTest = TraceTest;
using TraceExportTest = TraceTest;

std::map<std::string, std::string> simulated_meta() {
  return {{"source", "simulated"}, {"plan", R"({"schema": "megatrain.plan/1", "model": "llama-2-7b"})"}};
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `sql` on the SQLite file at `p` (created if missing); "" when it worked, else SQLite's words.
std::string run_sql(const fs::path& p, const std::string& sql) {
  sqlite3* db = nullptr;
  std::string error;
  if (sqlite3_open(p.c_str(), &db) != SQLITE_OK || sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr) != SQLITE_OK)
    error = db != nullptr ? sqlite3_errmsg(db) : "cannot open";
  sqlite3_close(db);
  return error;
}

std::vector<std::string> dir_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

::testing::AssertionResult has_substr(const std::string& text, const std::string& sub) {
  if (text.find(sub) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << sub << "\"";
}

template <typename T>
::testing::AssertionResult fails_with(const Result<T>& r, StatusCode code) {
  if (r.ok()) return ::testing::AssertionFailure() << "expected " << status_code_name(code) << ", got ok";
  if (r.status().code() != code) {
    return ::testing::AssertionFailure() << "expected " << status_code_name(code) << ", got "
                                         << r.status().to_string();
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult fails_with(const Status& s, StatusCode code) {
  if (s.ok()) return ::testing::AssertionFailure() << "expected " << status_code_name(code) << ", got ok";
  if (s.code() != code) {
    return ::testing::AssertionFailure() << "expected " << status_code_name(code) << ", got " << s.to_string();
  }
  return ::testing::AssertionSuccess();
}

std::unique_ptr<TraceWriter> make_writer(const fs::path& p,
                                         const std::map<std::string, std::string>& meta = simulated_meta(),
                                         size_t batch_rows = 100000) {
  auto w = TraceWriter::create(p, meta, batch_rows);
  EXPECT_TRUE(w.ok()) << w.status().to_string();
  return std::move(w).value();
}

std::unique_ptr<TraceReader> open_reader(const fs::path& p) {
  auto r = TraceReader::open(p);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

TraceSpan span(int64_t lane, std::string name, std::string kind, int64_t start, int64_t end) {
  TraceSpan s;
  s.lane = lane;
  s.name = std::move(name);
  s.kind = std::move(kind);
  s.start_ns = start;
  s.end_ns = end;
  return s;
}

void expect_span_eq(const TraceSpan& a, const TraceSpan& b) {
  EXPECT_EQ(a.lane, b.lane);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.layer, b.layer);
  EXPECT_EQ(a.micro_batch, b.micro_batch);
  EXPECT_EQ(a.start_ns, b.start_ns);
  EXPECT_EQ(a.end_ns, b.end_ns);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.flops, b.flops);  // exact: REAL columns hold the double bit for bit
}

// Lanes 0..2, five spans with every field set, counters on two names, steps out of order.
struct Sample {
  std::vector<TraceLane> lanes = {{0, "GPU compute", "gpu"}, {1, "H2D", "h2d"}, {2, "CPU optimizer 0 \xe2\x9c\x93", "cpu"}};
  std::vector<TraceSpan> spans;
  std::vector<TraceCounter> counters = {{"bytes.device", 0, 1073741824.0},
                                        {"bytes.ram", 500, 3.5e12},
                                        {"bytes.device", 1500, 2147483648.5},
                                        {"queue.nvme_read", 2500, 4}};
  std::vector<TraceStep> steps = {{1, 2.25, 8192, 1.5, std::nan(""), 2.5}, {0, 10.375, 8192, 1.75}};  // step 1 was evaluated

  Sample() {
    TraceSpan a = span(1, "h2d L0", "h2d", 0, 1500);
    a.step = 0, a.layer = 0, a.bytes = 402653184;
    TraceSpan b = span(0, "fwd L0 mb0", "forward", 1500, 1234567);
    b.step = 0, b.layer = 0, b.micro_batch = 0, b.flops = 1.2345678901234567e15;
    TraceSpan c = span(0, "bwd L0 mb0", "backward", 1234567, 9007199254740991);  // 2^53 - 1 ns: the latest time a trace holds
    c.step = 0, c.layer = 0, c.micro_batch = 0, c.flops = 2.5e15;
    TraceSpan d = span(2, "adam L0", "optimizer", 2000000, 2000000);  // zero-length is allowed
    d.step = 0, d.layer = 0, d.bytes = 1;
    TraceSpan e = span(1, "stall \"quoted\"\n", "stall", 999, 1001);
    spans = {a, b, c, d, e};
  }

  void write(TraceWriter& w) const {
    for (const auto& l : lanes) {
      auto id = w.add_lane(l.name, l.kind);
      ASSERT_TRUE(id.ok()) << id.status().to_string();
      ASSERT_EQ(*id, l.id);
    }
    for (const auto& s : spans) ASSERT_TRUE(w.add_span(s).ok());
    for (const auto& c : counters) ASSERT_TRUE(w.add_counter(c).ok());
    for (const auto& s : steps) ASSERT_TRUE(w.add_step(s).ok());
  }
};

fs::path write_sample(const fs::path& p) {
  auto w = make_writer(p);
  Sample().write(*w);
  Status s = w->close();
  EXPECT_TRUE(s.ok()) << s.to_string();
  return p;
}

// ---------------------------------------------------------------------------------------------

TEST_F(TraceStoreTest, RoundTripsLanesSpansCountersStepsAndMetaExactly) {
  const fs::path p = dir_ / "run.mtrace";
  {
    auto w = make_writer(p);
    Sample().write(*w);
    ASSERT_TRUE(w->set_meta("profile", "h200-1.5tb").ok());
    ASSERT_TRUE(w->add_step({2, std::nan(""), 4096, 0.5}).ok());  // a diverged loss stays NaN
    ASSERT_TRUE(w->close().ok());
  }
  auto r = open_reader(p);
  Sample want;

  std::map<std::string, std::string> meta = simulated_meta();
  meta["profile"] = "h200-1.5tb";
  meta["schema"] = "megatrain.trace/1";
  EXPECT_EQ(r->meta(), meta);

  ASSERT_EQ(r->lanes().size(), want.lanes.size());
  for (size_t i = 0; i < want.lanes.size(); ++i) {
    EXPECT_EQ(r->lanes()[i].id, want.lanes[i].id);
    EXPECT_EQ(r->lanes()[i].name, want.lanes[i].name);
    EXPECT_EQ(r->lanes()[i].kind, want.lanes[i].kind);
  }

  auto spans = r->spans();
  ASSERT_TRUE(spans.ok()) << spans.status().to_string();
  // Ordered by start: a(0), e(999), b(1500), c(1234567), d(2000000).
  std::vector<TraceSpan> ordered = {want.spans[0], want.spans[4], want.spans[1], want.spans[2], want.spans[3]};
  ASSERT_EQ(spans->size(), ordered.size());
  for (size_t i = 0; i < ordered.size(); ++i) {
    SCOPED_TRACE("span " + std::to_string(i));
    expect_span_eq((*spans)[i], ordered[i]);
  }

  auto counters = r->counters();
  ASSERT_TRUE(counters.ok());
  ASSERT_EQ(counters->size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ((*counters)[i].name, want.counters[i].name);
    EXPECT_EQ((*counters)[i].t_ns, want.counters[i].t_ns);
    EXPECT_EQ((*counters)[i].value, want.counters[i].value);
  }
  auto device = r->counters("bytes.device");
  ASSERT_TRUE(device.ok());
  ASSERT_EQ(device->size(), 2u);
  EXPECT_EQ((*device)[0].value, 1073741824.0);
  EXPECT_EQ((*device)[1].t_ns, 1500);
  EXPECT_EQ((*device)[1].value, 2147483648.5);
  auto names = r->counter_names();
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"bytes.device", "bytes.ram", "queue.nvme_read"}));

  auto steps = r->steps();
  ASSERT_TRUE(steps.ok());
  ASSERT_EQ(steps->size(), 3u);
  EXPECT_EQ((*steps)[0].step, 0);
  EXPECT_EQ((*steps)[0].loss, 10.375);
  EXPECT_EQ((*steps)[0].tokens, 8192);
  EXPECT_EQ((*steps)[0].time_s, 1.75);
  EXPECT_EQ((*steps)[1].step, 1);
  EXPECT_EQ((*steps)[1].loss, 2.25);
  EXPECT_EQ((*steps)[1].time_s, 1.5);
  EXPECT_TRUE(std::isnan((*steps)[0].eval_loss));  // NULL: no evaluation after step 0
  EXPECT_EQ((*steps)[1].eval_loss, 2.5);
  EXPECT_EQ((*steps)[2].step, 2);
  EXPECT_TRUE(std::isnan((*steps)[2].loss));
  EXPECT_EQ((*steps)[2].tokens, 4096);
}

TEST_F(TraceStoreTest, FileHasTheDocumentedSchemaAndIndexes) {
  const fs::path p = write_sample(dir_ / "run.mtrace");
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(p.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  std::map<std::string, std::string> columns;  // table -> "name type, ..."
  for (const char* table : {"meta", "lanes", "spans", "counters", "steps"}) {
    sqlite3_stmt* st = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(db, (std::string("PRAGMA table_info(") + table + ")").c_str(), -1, &st, nullptr),
              SQLITE_OK);
    std::string cols;
    while (sqlite3_step(st) == SQLITE_ROW) {
      cols += (cols.empty() ? "" : ", ") + std::string(reinterpret_cast<const char*>(sqlite3_column_text(st, 1))) +
              " " + reinterpret_cast<const char*>(sqlite3_column_text(st, 2));
      if (sqlite3_column_int(st, 5) != 0) cols += " PK";
    }
    sqlite3_finalize(st);
    columns[table] = cols;
  }
  EXPECT_EQ(columns["meta"], "key TEXT PK, value TEXT");
  EXPECT_EQ(columns["lanes"], "id INTEGER PK, name TEXT, kind TEXT");
  EXPECT_EQ(columns["spans"],
            "lane INTEGER, name TEXT, kind TEXT, step INTEGER, layer INTEGER, micro_batch INTEGER, "
            "start_ns INTEGER, end_ns INTEGER, bytes INTEGER, flops REAL");
  EXPECT_EQ(columns["counters"], "name TEXT, t_ns INTEGER, value REAL");
  EXPECT_EQ(columns["steps"], "step INTEGER, loss REAL, tokens INTEGER, time_s REAL, aux_loss REAL, eval_loss REAL");

  sqlite3_stmt* st = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "SELECT tbl_name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL",
                               -1, &st, nullptr),
            SQLITE_OK);
  std::string indexes;
  while (sqlite3_step(st) == SQLITE_ROW) indexes += reinterpret_cast<const char*>(sqlite3_column_text(st, 1)) + std::string(";");
  sqlite3_finalize(st);
  sqlite3_close(db);
  EXPECT_TRUE(has_substr(indexes, "ON spans(lane, start_ns)"));
  EXPECT_TRUE(has_substr(indexes, "ON counters(name, t_ns)"));
}

TEST_F(TraceStoreTest, SpansFilterByLaneAndOverlappingWindow) {
  const fs::path p = dir_ / "window.mtrace";
  {
    auto w = make_writer(p);
    ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
    ASSERT_TRUE(w->add_lane("H2D", "h2d").ok());
    ASSERT_TRUE(w->add_span(span(0, "A", "forward", 0, 100)).ok());
    ASSERT_TRUE(w->add_span(span(0, "B", "forward", 100, 200)).ok());
    ASSERT_TRUE(w->add_span(span(0, "C", "stall", 150, 150)).ok());  // zero-length
    ASSERT_TRUE(w->add_span(span(0, "D", "backward", 50, 1000)).ok());  // long: starts well before windows
    ASSERT_TRUE(w->add_span(span(1, "E", "h2d", 120, 130)).ok());
    ASSERT_TRUE(w->close().ok());
  }
  auto r = open_reader(p);
  auto names = [&](std::optional<int64_t> lane, std::optional<int64_t> t0, std::optional<int64_t> t1) {
    auto s = r->spans(lane, t0, t1);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    std::string out;
    if (s.ok()) {
      for (const auto& sp : *s) out += sp.name;
    }
    return out;
  };
  EXPECT_EQ(names(std::nullopt, std::nullopt, std::nullopt), "ADBEC");
  EXPECT_EQ(names(0, std::nullopt, std::nullopt), "ADBC");
  EXPECT_EQ(names(1, std::nullopt, std::nullopt), "E");
  EXPECT_EQ(names(7, std::nullopt, std::nullopt), "");
  // [100, 150): A ends at 100 (out), C starts at 150 (out), D covers the window (in).
  EXPECT_EQ(names(std::nullopt, 100, 150), "DBE");
  // [150, 151): the zero-length C at 150 is inside.
  EXPECT_EQ(names(std::nullopt, 150, 151), "DBC");
  EXPECT_EQ(names(0, 100, 150), "DB");
  EXPECT_EQ(names(1, 0, 125), "E");
  EXPECT_EQ(names(std::nullopt, std::nullopt, 100), "AD");
  // Only D (ends at 1000) is still running after 200; B ends exactly at 200.
  EXPECT_EQ(names(std::nullopt, 200, std::nullopt), "D");
  EXPECT_EQ(names(std::nullopt, 1000, std::nullopt), "");
}

TEST_F(TraceStoreTest, SummaryCountsSpansAndCountersAndBounds) {
  auto r = open_reader(write_sample(dir_ / "run.mtrace"));
  auto s = r->summary();
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->span_count, 5);
  EXPECT_EQ(s->counter_count, 4);
  EXPECT_EQ(s->start_ns, 0);
  EXPECT_EQ(s->end_ns, 9007199254740991);

  const fs::path empty = dir_ / "empty.mtrace";
  ASSERT_TRUE(make_writer(empty)->close().ok());
  auto e = open_reader(empty)->summary();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->span_count, 0);
  EXPECT_EQ(e->counter_count, 0);
  EXPECT_EQ(e->start_ns, 0);
  EXPECT_EQ(e->end_ns, 0);
}

TEST_F(TraceStoreTest, WritesTwoHundredThousandSpansAcrossSeveralBatches) {
  const fs::path p = dir_ / "big.mtrace";
  constexpr int64_t kSpans = 200000;
  {
    // A small batch forces several commits inside the run.
    auto w = make_writer(p, simulated_meta(), 30000);
    for (int l = 0; l < 4; ++l) ASSERT_TRUE(w->add_lane("lane " + std::to_string(l), "gpu").ok());
    for (int64_t i = 0; i < kSpans; ++i) {
      TraceSpan s = span(i % 4, "fwd L" + std::to_string(i % 80), "forward", i * 10, i * 10 + 25);
      s.step = i / 50000;
      s.layer = i % 80;
      s.bytes = i;
      s.flops = static_cast<double>(i) * 0.5;
      Status st = w->add_span(s);
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    ASSERT_TRUE(w->add_counter({"bytes.device", 5, 1.0}).ok());
    ASSERT_TRUE(w->flush().ok());
    ASSERT_TRUE(w->close().ok());
  }
  auto r = open_reader(p);
  auto sum = r->summary();
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(sum->span_count, kSpans);
  EXPECT_EQ(sum->counter_count, 1);
  EXPECT_EQ(sum->start_ns, 0);
  EXPECT_EQ(sum->end_ns, (kSpans - 1) * 10 + 25);
  auto lane3 = r->spans(3);
  ASSERT_TRUE(lane3.ok());
  ASSERT_EQ(lane3->size(), static_cast<size_t>(kSpans / 4));
  EXPECT_EQ(lane3->front().bytes, 3);
  EXPECT_EQ(lane3->back().bytes, kSpans - 1);
  EXPECT_EQ(lane3->back().name, "fwd L" + std::to_string((kSpans - 1) % 80));
  EXPECT_EQ(lane3->back().flops, static_cast<double>(kSpans - 1) * 0.5);
  // [1000, 1030) overlaps spans 98 (ends 1005), 99, 100, 101, 102 (starts 1020).
  auto window = r->spans(std::nullopt, 1000, 1030);
  ASSERT_TRUE(window.ok());
  ASSERT_EQ(window->size(), 5u);
  EXPECT_EQ(window->front().bytes, 98);
  EXPECT_EQ(window->back().bytes, 102);
}

// ---------------------------------------------------------------------------------------------

TEST_F(TraceWriterTest, RejectsMissingOrUnknownSourceAndCreatesNothing) {
  const fs::path p = dir_ / "bad.mtrace";
  auto bad = TraceWriter::create(p, {{"source", "simulation"}, {"plan", "{}"}});
  ASSERT_TRUE(fails_with(bad, StatusCode::kInvalidArgument));
  const std::string& m = bad.status().message();
  EXPECT_TRUE(has_substr(m, "source"));
  EXPECT_TRUE(has_substr(m, "\"simulation\""));
  EXPECT_TRUE(has_substr(m, "\"simulated\""));
  EXPECT_TRUE(has_substr(m, "\"measured\""));

  auto missing = TraceWriter::create(p, {{"plan", "{}"}});
  ASSERT_TRUE(fails_with(missing, StatusCode::kInvalidArgument));
  EXPECT_TRUE(has_substr(missing.status().message(), "source"));
  EXPECT_TRUE(dir_entries(dir_).empty());

  auto w = make_writer(p, {{"source", "measured"}});
  Status s = w->set_meta("source", "guessed");
  ASSERT_TRUE(fails_with(s, StatusCode::kInvalidArgument));
  EXPECT_TRUE(has_substr(s.message(), "\"measured\""));
  ASSERT_TRUE(w->close().ok());
  EXPECT_EQ(open_reader(p)->meta().at("source"), "measured");
}

TEST_F(TraceWriterTest, RejectsSpanThatEndsBeforeItStarts) {
  const fs::path p = dir_ / "t.mtrace";
  auto w = make_writer(p);
  ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
  Status s = w->add_span(span(0, "fwd L3 mb0", "forward", 500, 499));
  ASSERT_TRUE(fails_with(s, StatusCode::kInvalidArgument));
  EXPECT_TRUE(has_substr(s.message(), "fwd L3 mb0"));
  EXPECT_TRUE(has_substr(s.message(), "start_ns=500"));
  EXPECT_TRUE(has_substr(s.message(), "end_ns=499"));
  EXPECT_TRUE(has_substr(s.message(), "end_ns must be >= start_ns"));
  // The writer stays usable and the rejected span is not stored.
  ASSERT_TRUE(w->add_span(span(0, "ok", "forward", 500, 500)).ok());
  ASSERT_TRUE(w->close().ok());
  auto spans = open_reader(p)->spans();
  ASSERT_TRUE(spans.ok());
  ASSERT_EQ(spans->size(), 1u);
  EXPECT_EQ(spans->front().name, "ok");
}

TEST_F(TraceWriterTest, RejectsSpanOnUnknownLane) {
  auto w = make_writer(dir_ / "t.mtrace");
  Status none = w->add_span(span(0, "early", "forward", 0, 1));
  ASSERT_TRUE(fails_with(none, StatusCode::kInvalidArgument));
  EXPECT_TRUE(has_substr(none.message(), "no lanes exist"));

  ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
  ASSERT_TRUE(w->add_lane("H2D", "h2d").ok());
  Status s = w->add_span(span(2, "h2d L4", "h2d", 0, 10));
  ASSERT_TRUE(fails_with(s, StatusCode::kInvalidArgument));
  EXPECT_TRUE(has_substr(s.message(), "lane 2"));
  EXPECT_TRUE(has_substr(s.message(), "0..1"));
  EXPECT_TRUE(fails_with(w->add_span(span(-1, "x", "h2d", 0, 10)), StatusCode::kInvalidArgument));

  auto dup = w->add_lane("H2D", "h2d");
  ASSERT_TRUE(fails_with(dup, StatusCode::kInvalidArgument));
  EXPECT_TRUE(has_substr(dup.status().message(), "already exists"));
}

TEST_F(TraceWriterTest, CreateInMissingDirectoryIsNotFound) {
  const fs::path p = dir_ / "no-such-dir" / "t.mtrace";
  auto w = TraceWriter::create(p, simulated_meta());
  ASSERT_TRUE(fails_with(w, StatusCode::kNotFound));
  EXPECT_TRUE(has_substr(w.status().message(), (dir_ / "no-such-dir").string()));
}

TEST_F(TraceWriterTest, NothingIsPublishedBeforeCloseAndNoTempFileAfter) {
  const fs::path p = dir_ / "t.mtrace";
  auto w = make_writer(p);
  Sample().write(*w);
  ASSERT_TRUE(w->flush().ok());
  EXPECT_FALSE(fs::exists(p));
  ASSERT_EQ(dir_entries(dir_).size(), 1u);  // the temporary file, under another name
  EXPECT_NE(dir_entries(dir_)[0], "t.mtrace");
  ASSERT_TRUE(w->close().ok());
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"t.mtrace"});
  EXPECT_TRUE(w->close().ok());  // a second close is a no-op
  EXPECT_TRUE(fails_with(w->add_lane("late", "gpu"), StatusCode::kInvalidArgument));
}

TEST_F(TraceWriterTest, ExistingTraceSurvivesWriterDestroyedWithoutClose) {
  const fs::path p = write_sample(dir_ / "t.mtrace");
  const std::string before = read_bytes(p);
  ASSERT_FALSE(before.empty());
  {
    auto w = make_writer(p, {{"source", "measured"}});
    ASSERT_TRUE(w->add_lane("only lane", "gpu").ok());
    for (int i = 0; i < 1000; ++i) ASSERT_TRUE(w->add_span(span(0, "x", "forward", i, i + 1)).ok());
    ASSERT_TRUE(fails_with(w->add_span(span(5, "bad", "forward", 0, 1)), StatusCode::kInvalidArgument));
    ASSERT_TRUE(w->flush().ok());
    EXPECT_EQ(read_bytes(p), before);
  }  // destroyed without close()
  EXPECT_EQ(read_bytes(p), before);
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"t.mtrace"});
  auto r = open_reader(p);
  EXPECT_EQ(r->meta().at("source"), "simulated");
  EXPECT_EQ(r->lanes().size(), 3u);
}

TEST_F(TraceWriterTest, CloseReplacesAnExistingTrace) {
  const fs::path p = write_sample(dir_ / "t.mtrace");
  {
    auto w = make_writer(p, {{"source", "measured"}, {"plan", "second"}});
    ASSERT_TRUE(w->add_lane("NVMe read", "nvme_read").ok());
    ASSERT_TRUE(w->close().ok());
  }
  auto r = open_reader(p);
  EXPECT_EQ(r->meta().at("plan"), "second");
  ASSERT_EQ(r->lanes().size(), 1u);
  EXPECT_EQ(r->lanes()[0].name, "NVMe read");
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"t.mtrace"});
}

// ---------------------------------------------------------------------------------------------

TEST_F(TraceReaderTest, MissingFileIsNotFound) {
  const fs::path p = dir_ / "nope.mtrace";
  auto r = TraceReader::open(p);
  ASSERT_TRUE(fails_with(r, StatusCode::kNotFound));
  EXPECT_TRUE(has_substr(r.status().message(), p.string()));
}

TEST_F(TraceReaderTest, TextFileIsNotAnSqliteDatabase) {
  const fs::path p = dir_ / "notes.mtrace";
  write_bytes(p, "this is a text file, not a trace\nsecond line\n");
  auto r = TraceReader::open(p);
  ASSERT_TRUE(fails_with(r, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(r.status().message(), p.string() + " is not a MegaTrain trace (not an SQLite database)"));
  EXPECT_EQ(read_bytes(p), "this is a text file, not a trace\nsecond line\n");  // read-only
}

TEST_F(TraceReaderTest, RandomBytesAndEmptyFileAreNotSqliteDatabases) {
  const fs::path p = dir_ / "noise.mtrace";
  std::mt19937 rng(42);
  std::string noise(8192, '\0');
  for (auto& c : noise) c = static_cast<char>(rng() & 0xff);
  write_bytes(p, noise);
  auto r = TraceReader::open(p);
  ASSERT_TRUE(fails_with(r, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(r.status().message(), p.string()));
  EXPECT_TRUE(has_substr(r.status().message(), "not an SQLite database"));

  const fs::path e = dir_ / "empty.mtrace";
  write_bytes(e, "");
  auto re = TraceReader::open(e);
  ASSERT_TRUE(fails_with(re, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(re.status().message(), e.string()));
  EXPECT_TRUE(has_substr(re.status().message(), "not an SQLite database"));
}

TEST_F(TraceReaderTest, SqliteFileWithoutTraceTablesNamesTheMissingTable) {
  auto make_db = [](const fs::path& p, const char* sql) { ASSERT_EQ(run_sql(p, sql), ""); };
  const fs::path other = dir_ / "other.db";
  make_db(other, "CREATE TABLE photos(id INTEGER, path TEXT); INSERT INTO photos VALUES(1, 'a.jpg');");
  auto r = TraceReader::open(other);
  ASSERT_TRUE(fails_with(r, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(r.status().message(), other.string()));
  EXPECT_TRUE(has_substr(r.status().message(), "meta, lanes, spans, counters, steps are missing"));

  const fs::path nospans = dir_ / "nospans.db";
  make_db(nospans,
          "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT); CREATE TABLE lanes(id INTEGER PRIMARY KEY, name "
          "TEXT, kind TEXT); CREATE TABLE counters(name TEXT, t_ns INTEGER, value REAL); CREATE TABLE steps(step "
          "INTEGER, loss REAL, tokens INTEGER, time_s REAL);");
  auto r2 = TraceReader::open(nospans);
  ASSERT_TRUE(fails_with(r2, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(r2.status().message(), nospans.string()));
  EXPECT_TRUE(has_substr(r2.status().message(), "table spans is missing"));

  const fs::path nocol = dir_ / "nocol.db";
  make_db(nocol,
          "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT); CREATE TABLE lanes(id INTEGER PRIMARY KEY, name "
          "TEXT, kind TEXT); CREATE TABLE spans(lane INTEGER, name TEXT); CREATE TABLE counters(name TEXT, t_ns "
          "INTEGER, value REAL); CREATE TABLE steps(step INTEGER, loss REAL, tokens INTEGER, time_s REAL);");
  auto r3 = TraceReader::open(nocol);
  ASSERT_TRUE(fails_with(r3, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(r3.status().message(), "table spans has no column kind"));
}

TEST_F(TraceReaderTest, TruncatedTraceIsCorruptWithSqlitesMessage) {
  const fs::path p = dir_ / "cut.mtrace";
  {
    auto w = make_writer(p);
    ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
    for (int i = 0; i < 20000; ++i) ASSERT_TRUE(w->add_span(span(0, "fwd", "forward", i, i + 1)).ok());
    ASSERT_TRUE(w->close().ok());
  }
  const auto size = fs::file_size(p);
  ASSERT_GT(size, 64u * 1024);
  fs::resize_file(p, size / 2);
  auto r = TraceReader::open(p);
  ASSERT_TRUE(fails_with(r, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(r.status().message(), p.string()));
  EXPECT_TRUE(has_substr(r.status().message(), "database disk image is malformed"));
}

TEST_F(TraceReaderTest, GarbledPageIsCorruptWhenAQueryReachesIt) {
  const fs::path p = dir_ / "garbled.mtrace";
  {
    auto w = make_writer(p);
    ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
    for (int i = 0; i < 20000; ++i) ASSERT_TRUE(w->add_span(span(0, "fwd", "forward", i, i + 1)).ok());
    ASSERT_TRUE(w->close().ok());
  }
  // Overwrite one whole page in the middle: its header no longer names a valid b-tree page type.
  std::string bytes = read_bytes(p);
  const size_t page = 4096, at = (bytes.size() / 2) / page * page;
  ASSERT_GT(at, page);
  std::fill(bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.begin() + static_cast<std::ptrdiff_t>(at + page),
            '\xff');
  write_bytes(p, bytes);
  auto r = TraceReader::open(p);  // the first pages are intact, so opening may still succeed
  if (!r.ok()) {
    EXPECT_TRUE(fails_with(r, StatusCode::kCorrupt));
    return;
  }
  auto spans = (*r)->spans();
  ASSERT_TRUE(fails_with(spans, StatusCode::kCorrupt));
  EXPECT_TRUE(has_substr(spans.status().message(), p.string()));
  EXPECT_TRUE(has_substr(spans.status().message(), "malformed"));
}

TEST_F(TraceReaderTest, NewerSchemaIsUnsupported) {
  const fs::path p = write_sample(dir_ / "t.mtrace");
  ASSERT_EQ(run_sql(p, "UPDATE meta SET value = 'megatrain.trace/9' WHERE key = 'schema'"), "");
  auto r = TraceReader::open(p);
  ASSERT_TRUE(fails_with(r, StatusCode::kUnsupported));
  EXPECT_TRUE(has_substr(r.status().message(), "megatrain.trace/9"));
  EXPECT_TRUE(has_substr(r.status().message(), "megatrain.trace/1"));
}

// Hostile traces (issue 32 row 16): rows the writer never writes and views in place of tables are
// refused at open, naming the table, the row and the accepted range. Before, a span from INT64_MIN
// to INT64_MAX or a lane id of INT64_MAX overflowed in the export, and a view that recurses
// without end hung the reader.
TEST_F(TraceReaderTest, HostileRowsAndViewsAreRefusedAtOpen) {
  struct Case {
    const char* name;
    const char* sql;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"widest span", "UPDATE spans SET start_ns = -9223372036854775808, end_ns = 9223372036854775807 WHERE rowid = 2",
       "spans row 2 (lane 1, start_ns -9223372036854775808, end_ns 9223372036854775807"},
      {"span ends before it starts", "UPDATE spans SET start_ns = 50, end_ns = 40 WHERE rowid = 1", "spans row 1"},
      {"span past 2^53 ns", "UPDATE spans SET end_ns = 9007199254740993 WHERE rowid = 1", "end_ns 9007199254740993"},
      {"text for a time", "UPDATE spans SET start_ns = 'soon' WHERE rowid = 1", "start_ns soon"},
      {"span on a missing lane", "UPDATE spans SET lane = 7 WHERE rowid = 1", "a span is on a lane of the lanes table"},
      {"huge lane id", "UPDATE lanes SET id = 9223372036854775807 WHERE id = 1", "lanes row 9223372036854775807 (id 9223372036854775807)"},
      {"huge layer", "UPDATE spans SET layer = 4611686018427387904 WHERE rowid = 1", "layer 4611686018427387904"},
      {"negative bytes", "UPDATE spans SET bytes = -5 WHERE rowid = 1", "bytes -5"},
      {"counter before the start", "UPDATE counters SET t_ns = -1", "counters row 1 (name bytes.device, t_ns -1"},
      {"infinite time_s", "UPDATE steps SET time_s = 1e999", "steps row 1"},
      {"a recursive view for spans",
       "DROP TABLE spans; CREATE VIEW spans AS WITH RECURSIVE c(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM c) SELECT 0 AS lane, "
       "'f' AS name, 'forward' AS kind, 0 AS step, 0 AS layer, 0 AS micro_batch, x AS start_ns, x AS end_ns, 0 AS bytes, "
       "0.0 AS flops FROM c",
       "spans is a view; a trace's meta, lanes, spans, counters and steps are plain tables"},
      {"lane ids twice",
       "CREATE TABLE l2(id INTEGER, name TEXT, kind TEXT); INSERT INTO l2 SELECT * FROM lanes; INSERT INTO l2 VALUES(0, 'again', "
       "'gpu'); DROP TABLE lanes; ALTER TABLE l2 RENAME TO lanes",
       "lane id 0 is given twice"},
  };
  for (const Case& c : cases) {
    const fs::path p = dir_ / "hostile.mtrace";
    {
      auto w = make_writer(p);
      ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
      ASSERT_TRUE(w->add_lane("H2D", "h2d").ok());
      ASSERT_TRUE(w->add_span(span(0, "fwd", "forward", 10, 20)).ok());
      ASSERT_TRUE(w->add_span(span(1, "h2d", "h2d", 5, 15)).ok());
      ASSERT_TRUE(w->add_counter({"bytes.device", 10, 1e9}).ok());
      ASSERT_TRUE(w->add_step({0, 2.5, 4096, 0.5}).ok());
      ASSERT_TRUE(w->close().ok());
    }
    ASSERT_TRUE(TraceReader::open(p).ok()) << c.name << ": the trace before the change must open";
    ASSERT_EQ(run_sql(p, c.sql), "") << c.name;
    auto r = TraceReader::open(p);
    ASSERT_TRUE(fails_with(r, StatusCode::kCorrupt)) << c.name;
    EXPECT_TRUE(has_substr(r.status().message(), p.string())) << r.status().message();
    EXPECT_TRUE(has_substr(r.status().message(), c.says)) << c.name << ": " << r.status().message();
  }
  // A diverged run's infinite loss is data, not damage.
  const fs::path p = dir_ / "diverged.mtrace";
  {
    auto w = make_writer(p);
    ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
    ASSERT_TRUE(w->add_step({0, std::numeric_limits<double>::infinity(), 4096, 0.5}).ok());
    ASSERT_TRUE(w->close().ok());
  }
  EXPECT_TRUE(TraceReader::open(p).ok());
}

TEST_F(TraceWriterTest, RefusesWhatTheReaderWouldRefuse) {
  auto w = make_writer(dir_ / "t.mtrace");
  ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
  EXPECT_TRUE(has_substr(w->add_span(span(0, "x", "forward", -1, 10)).message(), "times are 0..2^53 ns"));
  EXPECT_TRUE(has_substr(w->add_span(span(0, "x", "forward", 0, (int64_t{1} << 53) + 1)).message(), "times are 0..2^53 ns"));
  TraceSpan sp = span(0, "x", "forward", 0, 10);
  sp.layer = -2;
  EXPECT_TRUE(has_substr(w->add_span(sp).message(), "accepted: -1 (none) or 0..2^31"));
  sp = span(0, "x", "forward", 0, 10);
  sp.flops = std::nan("");
  EXPECT_TRUE(has_substr(w->add_span(sp).message(), "flops 0..1e30"));
  EXPECT_TRUE(has_substr(w->add_counter({"bytes.device", -3, 1}).message(), "accepted: 0..2^53 ns and a finite value"));
  EXPECT_TRUE(has_substr(w->add_counter({"bytes.device", 3, std::numeric_limits<double>::infinity()}).message(), "finite value"));
  EXPECT_TRUE(has_substr(w->add_step({0, 1.0, 10, -1.0}).message(), "a finite time_s >= 0"));
  EXPECT_TRUE(w->add_span(span(0, "x", "forward", 0, int64_t{1} << 53)).ok());
}

// ---------------------------------------------------------------------------------------------

std::map<std::string, int> count_by_phase(const nlohmann::json& events) {
  std::map<std::string, int> n;
  for (const auto& e : events) ++n[e.at("ph").get<std::string>()];
  return n;
}

TEST_F(TraceExportTest, ChromeTraceMapsLanesSpansAndCounters) {
  auto r = open_reader(write_sample(dir_ / "run.mtrace"));
  const fs::path out = dir_ / "run.json";
  Status s = export_chrome_trace(*r, out);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(dir_entries(dir_), (std::vector<std::string>{"run.json", "run.mtrace"}));

  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(read_bytes(out)));
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc.at("displayTimeUnit"), "ns");
  EXPECT_EQ(doc.at("metadata").at("source"), "simulated");
  EXPECT_EQ(doc.at("metadata").at("plan"), simulated_meta().at("plan"));
  EXPECT_EQ(doc.at("metadata").at("schema"), "megatrain.trace/1");
  const auto& events = doc.at("traceEvents");
  ASSERT_TRUE(events.is_array());

  Sample want;
  auto n = count_by_phase(events);
  EXPECT_EQ(n["M"], 1 + 2 * 3);  // process_name, then thread_name and thread_sort_index per lane
  EXPECT_EQ(n["X"], 5);
  EXPECT_EQ(n["C"], 4);
  EXPECT_EQ(n.size(), 3u);

  std::map<int64_t, std::string> thread_names;
  std::map<int64_t, int64_t> sort_index;
  int process_names = 0;
  for (const auto& e : events) {
    EXPECT_EQ(e.at("pid"), 1);
    if (e.at("ph") != "M") continue;
    if (e.at("name") == "thread_name") thread_names[e.at("tid").get<int64_t>()] = e.at("args").at("name");
    if (e.at("name") == "thread_sort_index") sort_index[e.at("tid").get<int64_t>()] = e.at("args").at("sort_index");
    if (e.at("name") == "process_name") {
      ++process_names;
      EXPECT_EQ(e.at("args").at("name"), "MegaTrain (simulated)");
    }
  }
  EXPECT_EQ(process_names, 1);
  // tid = lane id + 1, named after the lane (UTF-8 intact).
  EXPECT_EQ(thread_names, (std::map<int64_t, std::string>{{1, "GPU compute"}, {2, "H2D"}, {3, want.lanes[2].name}}));
  EXPECT_EQ(sort_index, (std::map<int64_t, int64_t>{{1, 0}, {2, 1}, {3, 2}}));

  // X events come in start order: a, e, b, c, d.
  std::vector<TraceSpan> ordered = {want.spans[0], want.spans[4], want.spans[1], want.spans[2], want.spans[3]};
  size_t xi = 0;
  for (const auto& e : events) {
    if (e.at("ph") != "X") continue;
    ASSERT_LT(xi, ordered.size());
    const TraceSpan& sp = ordered[xi++];
    SCOPED_TRACE(sp.name);
    EXPECT_EQ(e.at("name"), sp.name);
    EXPECT_EQ(e.at("cat"), sp.kind);
    EXPECT_EQ(e.at("tid").get<int64_t>(), sp.lane + 1);
    EXPECT_EQ(e.at("ts").get<double>(), static_cast<double>(sp.start_ns) / 1000.0);
    EXPECT_EQ(e.at("dur").get<double>(), static_cast<double>(sp.end_ns - sp.start_ns) / 1000.0);
    const auto& a = e.at("args");
    EXPECT_EQ(a.at("step").get<int64_t>(), sp.step);
    EXPECT_EQ(a.at("layer").get<int64_t>(), sp.layer);
    EXPECT_EQ(a.at("micro_batch").get<int64_t>(), sp.micro_batch);
    EXPECT_EQ(a.at("bytes").get<int64_t>(), sp.bytes);
    EXPECT_EQ(a.at("flops").get<double>(), sp.flops);
  }
  // Spot values, so a wrong unit cannot hide behind the same formula on both sides.
  const auto& b = *std::find_if(events.begin(), events.end(), [](const auto& e) { return e.at("name") == "fwd L0 mb0"; });
  EXPECT_EQ(b.at("ts").get<double>(), 1.5);
  EXPECT_EQ(b.at("dur").get<double>(), 1233.067);

  std::vector<nlohmann::json> cs;
  for (const auto& e : events) {
    if (e.at("ph") == "C") cs.push_back(e);
  }
  ASSERT_EQ(cs.size(), 4u);
  for (size_t i = 0; i < cs.size(); ++i) {
    const auto& c = want.counters[i];
    EXPECT_EQ(cs[i].at("name"), c.name);
    EXPECT_EQ(cs[i].at("ts").get<double>(), static_cast<double>(c.t_ns) / 1000.0);
    ASSERT_EQ(cs[i].at("args").size(), 1u);
    EXPECT_EQ(cs[i].at("args").at(c.name).get<double>(), c.value);
  }
}

TEST_F(TraceExportTest, IndependentPythonParserReadsTheSameEvents) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 not found; skipping the independent parse";
  auto r = open_reader(write_sample(dir_ / "run.mtrace"));
  const fs::path out = dir_ / "run.json";
  ASSERT_TRUE(export_chrome_trace(*r, out).ok());
  // parse_constant rejects NaN/Infinity, which Python would otherwise accept but JSON forbids.
  const std::string cmd =
      "/usr/bin/python3 -c '"
      "import json, sys, collections\n"
      "def bad(c): sys.exit(\"non-JSON constant \" + c)\n"
      "d = json.load(open(sys.argv[1], encoding=\"utf-8\"), parse_constant=bad)\n"
      "n = collections.Counter(e[\"ph\"] for e in d[\"traceEvents\"])\n"
      "tids = sorted({e[\"tid\"] for e in d[\"traceEvents\"] if e[\"ph\"] == \"X\"})\n"
      "print(n[\"M\"], n[\"X\"], n[\"C\"], d[\"displayTimeUnit\"], \",\".join(map(str, tids)))\n"
      "' '" + out.string() + "' 2>&1";
  std::FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[256];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) output += buf;
  int rc = ::pclose(pipe);
  ASSERT_EQ(rc, 0) << output;
  EXPECT_EQ(output, "7 5 4 ns 1,2,3\n");
}

TEST_F(TraceExportTest, ManySpansAreExportedOnceEachInStartOrder) {
  // More spans than one export slice (200k), with long spans that cross slice boundaries.
  const fs::path p = dir_ / "many.mtrace";
  constexpr int64_t kSpans = 201000;  // just over one 200k export slice
  {
    auto w = make_writer(p);
    ASSERT_TRUE(w->add_lane("GPU compute", "gpu").ok());
    ASSERT_TRUE(w->add_lane("NVMe read", "nvme_read").ok());
    for (int64_t i = 0; i < kSpans; ++i) {
      int64_t len = i % 1000 == 0 ? 50000 : (i % 7 == 0 ? 0 : 3);  // 50 us crosses a slice edge
      ASSERT_TRUE(w->add_span(span(i % 2, "s", "forward", i * 10, i * 10 + len)).ok());
    }
    ASSERT_TRUE(w->close().ok());
  }
  auto r = open_reader(p);
  const fs::path out = dir_ / "many.json";
  ASSERT_TRUE(export_chrome_trace(*r, out).ok());
  auto doc = nlohmann::json::parse(read_bytes(out));
  int64_t x = 0;
  double last_ts = -1;
  bool ordered = true;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    double ts = e.at("ts").get<double>();
    // Start times are i*10 ns, so each X event must be exactly the next one.
    if (ts != static_cast<double>(x * 10) / 1000.0) ordered = false;
    if (ts < last_ts) ordered = false;
    last_ts = ts;
    ++x;
  }
  EXPECT_EQ(x, kSpans);
  EXPECT_TRUE(ordered);
}

TEST_F(TraceExportTest, ExportIntoMissingDirectoryFailsWithoutWritingAnything) {
  auto r = open_reader(write_sample(dir_ / "run.mtrace"));
  const fs::path out = dir_ / "missing" / "run.json";
  Status s = export_chrome_trace(*r, out);
  ASSERT_TRUE(fails_with(s, StatusCode::kNotFound));
  EXPECT_TRUE(has_substr(s.message(), (dir_ / "missing").string()));
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"run.mtrace"});
}

}  // namespace
}  // namespace megatrain

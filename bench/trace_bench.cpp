// megatrain-bench-trace: TraceWriter's write rate for a million spans plus counters, as a ratio
// against a plain hand-written SQLite insert of the same rows measured in the same run.
//
// Two comparisons, each like for like:
//   insert:      TraceWriter add_* + flush()       vs  one prepared statement per table, one transaction
//   end to end:  TraceWriter add_* + close()       vs  the same insert, then the same indexes
//                (indexes, fsync, atomic rename)       (and SQLite's default commit fsyncs)
#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "megatrain/core/output_path.h"
#include "megatrain/core/trace_store.h"

namespace fs = std::filesystem;
using megatrain::Status;
using megatrain::TraceCounter;
using megatrain::TraceSpan;

namespace {

struct Options {
  int64_t spans = 1000000;
  int64_t counters = 100000;
  int64_t lanes = 8;
  int repeat = 1;
  fs::path dir = fs::temp_directory_path();
  bool json = false;
};

struct Workload {
  std::vector<std::pair<std::string, std::string>> lanes;  // name, kind
  std::vector<TraceSpan> spans;
  std::vector<TraceCounter> counters;
};

// Rows shaped like an executor trace: per-layer forward/backward spans on the GPU lane,
// transfers and optimizer spans on the others, memory counters sampled between them.
// Built before timing so both contenders insert identical, already-formatted rows.
Workload make_workload(const Options& o) {
  static const char* kKinds[] = {"forward", "backward", "recompute", "h2d", "d2h", "optimizer", "stall"};
  static const char* kLaneKinds[] = {"gpu", "h2d", "d2h", "cpu", "nvme_read", "nvme_write", "data"};
  static const char* kCounterNames[] = {"bytes.device", "bytes.pinned", "bytes.ram", "bytes.nvme", "queue.nvme_read"};
  Workload w;
  for (int64_t l = 0; l < o.lanes; ++l) {
    w.lanes.emplace_back("lane " + std::to_string(l), kLaneKinds[l % 7]);
  }
  w.spans.reserve(static_cast<size_t>(o.spans));
  for (int64_t i = 0; i < o.spans; ++i) {
    TraceSpan s;
    s.lane = i % o.lanes;
    s.kind = kKinds[i % 7];
    s.layer = (i / 8) % 80;
    s.micro_batch = (i / 640) % 4;
    s.step = i / 2560;
    s.name = std::string(s.kind.substr(0, 3)) + " L" + std::to_string(s.layer) + " mb" + std::to_string(s.micro_batch);
    s.start_ns = i * 1000;
    s.end_ns = s.start_ns + 700 + (i % 13) * 50;
    s.bytes = (i % 5) * 201326592;
    s.flops = static_cast<double>(i % 11) * 1.7e12;
    w.spans.push_back(std::move(s));
  }
  w.counters.reserve(static_cast<size_t>(o.counters));
  for (int64_t i = 0; i < o.counters; ++i) {
    w.counters.push_back({kCounterNames[i % 5], i * 10000, static_cast<double>((i * 7919) % 100003) * 1048576.0});
  }
  return w;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "megatrain-bench-trace: %s\n", what.c_str());
  std::exit(1);
}

void check(const Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}

void sql_ok(sqlite3* db, int rc, const char* what) {
  if (rc != SQLITE_OK && rc != SQLITE_DONE) die(std::string(what) + ": " + sqlite3_errmsg(db));
}

struct Timing {
  double insert_s = 0;  // rows in and committed
  double total_s = 0;   // plus indexes and the final sync/publish
  uintmax_t file_bytes = 0;
};

// The reference: what a careful programmer writes by hand with SQLite's defaults.
Timing run_reference(const Workload& w, const fs::path& path) {
  fs::remove(path);
  Timing t;
  auto t0 = std::chrono::steady_clock::now();
  sqlite3* db = nullptr;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) die("cannot open " + path.string());
  sql_ok(db,
         sqlite3_exec(db,
                      "CREATE TABLE lanes(id INTEGER PRIMARY KEY, name TEXT, kind TEXT);"
                      "CREATE TABLE spans(lane INTEGER, name TEXT, kind TEXT, step INTEGER, layer INTEGER,"
                      " micro_batch INTEGER, start_ns INTEGER, end_ns INTEGER, bytes INTEGER, flops REAL);"
                      "CREATE TABLE counters(name TEXT, t_ns INTEGER, value REAL);",
                      nullptr, nullptr, nullptr),
         "create reference tables");
  sql_ok(db, sqlite3_exec(db, "BEGIN", nullptr, nullptr, nullptr), "begin");
  sqlite3_stmt* lane = nullptr;
  sqlite3_stmt* span = nullptr;
  sqlite3_stmt* counter = nullptr;
  sql_ok(db, sqlite3_prepare_v2(db, "INSERT INTO lanes VALUES(?,?,?)", -1, &lane, nullptr), "prepare");
  sql_ok(db, sqlite3_prepare_v2(db, "INSERT INTO spans VALUES(?,?,?,?,?,?,?,?,?,?)", -1, &span, nullptr), "prepare");
  sql_ok(db, sqlite3_prepare_v2(db, "INSERT INTO counters VALUES(?,?,?)", -1, &counter, nullptr), "prepare");
  for (size_t i = 0; i < w.lanes.size(); ++i) {
    sqlite3_bind_int64(lane, 1, static_cast<int64_t>(i));
    sqlite3_bind_text(lane, 2, w.lanes[i].first.c_str(), -1, SQLITE_STATIC);
    sqlite3_bind_text(lane, 3, w.lanes[i].second.c_str(), -1, SQLITE_STATIC);
    sql_ok(db, sqlite3_step(lane), "insert lane");
    sqlite3_reset(lane);
  }
  for (const auto& s : w.spans) {
    sqlite3_bind_int64(span, 1, s.lane);
    sqlite3_bind_text(span, 2, s.name.data(), static_cast<int>(s.name.size()), SQLITE_STATIC);
    sqlite3_bind_text(span, 3, s.kind.data(), static_cast<int>(s.kind.size()), SQLITE_STATIC);
    sqlite3_bind_int64(span, 4, s.step);
    sqlite3_bind_int64(span, 5, s.layer);
    sqlite3_bind_int64(span, 6, s.micro_batch);
    sqlite3_bind_int64(span, 7, s.start_ns);
    sqlite3_bind_int64(span, 8, s.end_ns);
    sqlite3_bind_int64(span, 9, s.bytes);
    sqlite3_bind_double(span, 10, s.flops);
    sql_ok(db, sqlite3_step(span), "insert span");
    sqlite3_reset(span);
  }
  for (const auto& c : w.counters) {
    sqlite3_bind_text(counter, 1, c.name.data(), static_cast<int>(c.name.size()), SQLITE_STATIC);
    sqlite3_bind_int64(counter, 2, c.t_ns);
    sqlite3_bind_double(counter, 3, c.value);
    sql_ok(db, sqlite3_step(counter), "insert counter");
    sqlite3_reset(counter);
  }
  sql_ok(db, sqlite3_exec(db, "COMMIT", nullptr, nullptr, nullptr), "commit");
  t.insert_s = seconds_since(t0);
  // The same indexes TraceWriter::close() builds (trace_store.cpp), so the end-to-end row compares
  // equal work.
  sql_ok(db,
         sqlite3_exec(db,
                      "BEGIN;"
                      "CREATE INDEX spans_lane_start ON spans(lane, start_ns);"
                      "CREATE INDEX spans_start ON spans(start_ns);"
                      "CREATE INDEX counters_name_t ON counters(name, t_ns);"
                      "COMMIT;",
                      nullptr, nullptr, nullptr),
         "create reference indexes");
  sqlite3_finalize(lane);
  sqlite3_finalize(span);
  sqlite3_finalize(counter);
  sql_ok(db, sqlite3_close(db), "close");
  t.total_s = seconds_since(t0);
  t.file_bytes = fs::file_size(path);
  return t;
}

Timing run_writer(const Workload& w, const fs::path& path) {
  fs::remove(path);
  Timing t;
  auto t0 = std::chrono::steady_clock::now();
  auto writer = megatrain::TraceWriter::create(path, {{"source", "simulated"}, {"plan", "bench"}});
  if (!writer.ok()) die("create: " + writer.status().to_string());
  auto& tw = **writer;
  for (const auto& [name, kind] : w.lanes) {
    auto id = tw.add_lane(name, kind);
    if (!id.ok()) die("add_lane: " + id.status().to_string());
  }
  for (const auto& s : w.spans) check(tw.add_span(s), "add_span");
  for (const auto& c : w.counters) check(tw.add_counter(c), "add_counter");
  check(tw.flush(), "flush");
  t.insert_s = seconds_since(t0);
  check(tw.close(), "close");
  t.total_s = seconds_since(t0);
  t.file_bytes = fs::file_size(path);
  return t;
}

// A benchmark that wrote the wrong rows would measure nothing: read the counts back.
void verify(const fs::path& path, const Options& o) {
  auto r = megatrain::TraceReader::open(path);
  if (!r.ok()) die("reading back " + path.string() + ": " + r.status().to_string());
  auto sum = (*r)->summary();
  if (!sum.ok()) die("summary: " + sum.status().to_string());
  if (sum->span_count != o.spans || sum->counter_count != o.counters) {
    die("read back " + std::to_string(sum->span_count) + " spans and " + std::to_string(sum->counter_count) +
        " counters; wrote " + std::to_string(o.spans) + " and " + std::to_string(o.counters));
  }
}

std::string human_rate(double per_s) {
  char buf[32];
  if (per_s >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2fM/s", per_s / 1e6);
  } else if (per_s >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.1fK/s", per_s / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f/s", per_s);
  }
  return buf;
}

std::string human_bytes(uintmax_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / 1048576.0);
  return buf;
}

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: megatrain-bench-trace [--spans N] [--counters N] [--lanes N] [--repeat N] [--dir DIR] "
               "[--json]\n"
               "  Writes N spans (default 1000000) and counters (default 100000) through TraceWriter and reports\n"
               "  spans/s as a ratio against a hand-written SQLite insert of the same rows, measured in the same\n"
               "  run. --repeat takes the best of N runs of each; --dir is where the scratch files go (default:\n"
               "  the system temp directory); --json prints one JSON object on stdout.\n");
}

Options parse_args(int argc, char** argv) {
  Options o;
  auto int_arg = [&](int& i, int64_t lo, int64_t hi) {
    return megatrain::bench::int_arg("megatrain-bench-trace", argc, argv, i, lo, hi);
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--spans") {
      o.spans = int_arg(i, 1, 1'000'000'000);
    } else if (a == "--counters") {
      o.counters = int_arg(i, 0, 1'000'000'000);
    } else if (a == "--lanes") {
      o.lanes = int_arg(i, 1, 10000);
    } else if (a == "--repeat") {
      o.repeat = static_cast<int>(int_arg(i, 1, 100));
    } else if (a == "--dir") {
      if (i + 1 >= argc) die("--dir needs a value");
      o.dir = argv[++i];
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else {
      usage(stderr);
      die("unknown argument \"" + a + "\"; accepted: --spans, --counters, --lanes, --repeat, --dir, --json");
    }
  }
  // The scratch files go there: probed now, not after the first timed run.
  if (megatrain::Status s = megatrain::check_output("--dir", o.dir, megatrain::OutputKind::kExistingFolder); !s.ok()) die(s.message());
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  const Workload w = make_workload(o);
  const std::string stem = "megatrain-bench-trace-" + std::to_string(::getpid());
  const fs::path ref_path = o.dir / (stem + "-reference.db");
  const fs::path trace_path = o.dir / (stem + ".mtrace");

  Timing ref{std::numeric_limits<double>::max(), std::numeric_limits<double>::max(), 0};
  Timing tw = ref;
  // Alternate the contenders so neither always runs on a warmer page cache.
  for (int r = 0; r < o.repeat; ++r) {
    Timing a = run_reference(w, ref_path);
    Timing b = run_writer(w, trace_path);
    ref = {std::min(ref.insert_s, a.insert_s), std::min(ref.total_s, a.total_s), a.file_bytes};
    tw = {std::min(tw.insert_s, b.insert_s), std::min(tw.total_s, b.total_s), b.file_bytes};
  }
  verify(trace_path, o);
  std::error_code ec;
  fs::remove(ref_path, ec);
  fs::remove(trace_path, ec);

  const double n = static_cast<double>(o.spans);
  const double insert_ratio = ref.insert_s / tw.insert_s;  // = writer spans/s / reference spans/s
  const double total_ratio = ref.total_s / tw.total_s;

  if (o.json) {
    std::printf(
        "{\"benchmark\":\"trace_write\",\"spans\":%lld,\"counters\":%lld,\"lanes\":%lld,\"repeat\":%d,"
        "\"reference\":{\"insert_s\":%.6f,\"with_indexes_s\":%.6f,\"spans_per_s\":%.1f,\"file_bytes\":%ju},"
        "\"trace_writer\":{\"flush_s\":%.6f,\"close_s\":%.6f,\"spans_per_s\":%.1f,"
        "\"end_to_end_spans_per_s\":%.1f,\"file_bytes\":%ju},"
        "\"ratio\":{\"insert\":%.4f,\"end_to_end\":%.4f}}\n",
        static_cast<long long>(o.spans), static_cast<long long>(o.counters), static_cast<long long>(o.lanes),
        o.repeat, ref.insert_s, ref.total_s, n / ref.insert_s, ref.file_bytes, tw.insert_s, tw.total_s,
        n / tw.insert_s, n / tw.total_s, tw.file_bytes, insert_ratio, total_ratio);
    return 0;
  }
  std::printf("megatrain-bench-trace: %lld spans + %lld counters on %lld lanes, best of %d, in %s\n",
              static_cast<long long>(o.spans), static_cast<long long>(o.counters), static_cast<long long>(o.lanes),
              o.repeat, o.dir.c_str());
  std::printf("%-52s %9s %11s  %s\n", "", "time", "spans/s", "vs reference");
  auto row = [&](const char* what, double s, const std::string& ratio) {
    std::printf("%-52s %7.3f s %11s  %s\n", what, s, human_rate(n / s).c_str(), ratio.c_str());
  };
  char buf[64];
  row("reference: sqlite3 insert, 1 statement, 1 transaction", ref.insert_s, "1.00 (reference)");
  std::snprintf(buf, sizeof buf, "%.2fx", insert_ratio);
  row("TraceWriter add_* + flush()", tw.insert_s, buf);
  row("reference + the same indexes", ref.total_s, "1.00 (reference)");
  std::snprintf(buf, sizeof buf, "%.2fx", total_ratio);
  row("TraceWriter add_* + close() (indexes, fsync, rename)", tw.total_s, buf);
  std::printf("file size: reference %s, trace %s; ratio > 1 means TraceWriter is faster\n",
              human_bytes(ref.file_bytes).c_str(), human_bytes(tw.file_bytes).c_str());
  return 0;
}

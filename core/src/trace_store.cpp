// TraceStore implementation: the .mtrace SQLite schema (ARCHITECTURE.md section 8), a bulk writer
// that publishes atomically (temp file, fsync, rename, fsync dir), a read-only reader, and the
// streaming Chrome Trace Event JSON export.
#include "megatrain/core/trace_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "megatrain/core/durable_file.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;

constexpr std::array<const char*, 5> kRequiredTables = {"meta", "lanes", "spans", "counters", "steps"};

// Columns a reader needs in each table; more may exist (section 8 allows additions).
struct TableColumns {
  const char* table;
  std::vector<const char*> columns;
};
const std::vector<TableColumns>& required_columns() {
  static const std::vector<TableColumns> kColumns = {
      {"meta", {"key", "value"}},
      {"lanes", {"id", "name", "kind"}},
      {"spans", {"lane", "name", "kind", "step", "layer", "micro_batch", "start_ns", "end_ns", "bytes", "flops"}},
      {"counters", {"name", "t_ns", "value"}},
      {"steps", {"step", "loss", "tokens", "time_s"}},
  };
  return kColumns;
}

constexpr const char* kCreateSchemaSql =
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);"
    "CREATE TABLE lanes(id INTEGER PRIMARY KEY, name TEXT, kind TEXT);"
    "CREATE TABLE spans(lane INTEGER, name TEXT, kind TEXT, step INTEGER, layer INTEGER,"
    " micro_batch INTEGER, start_ns INTEGER, end_ns INTEGER, bytes INTEGER, flops REAL);"
    "CREATE TABLE counters(name TEXT, t_ns INTEGER, value REAL);"
    "CREATE TABLE steps(step INTEGER, loss REAL, tokens INTEGER, time_s REAL, aux_loss REAL, eval_loss REAL);";

// Built at close(), after the bulk insert, because maintaining them row by row would slow the
// insert several-fold. spans(start_ns) serves time-window queries across all lanes.
constexpr const char* kCreateIndexesSql =
    "CREATE INDEX spans_lane_start ON spans(lane, start_ns);"
    "CREATE INDEX spans_start ON spans(start_ns);"
    "CREATE INDEX counters_name_t ON counters(name, t_ns);"
    "CREATE INDEX steps_step ON steps(step);";

std::string in_quotes(const std::string& s) { return "\"" + s + "\""; }

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// SQLite's primary code decides the Status code; the message keeps SQLite's own words.
Status sqlite_status(sqlite3* db, int rc, const std::string& what) {
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  std::string m = what + ": " + (msg != nullptr ? msg : sqlite3_errstr(rc));
  switch (rc & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return corrupt(m);
    case SQLITE_FULL:
      return resource_exhausted(m);
    case SQLITE_NOMEM:
      return resource_exhausted(m);
    case SQLITE_CANTOPEN:
    case SQLITE_IOERR:
    case SQLITE_PERM:
    case SQLITE_READONLY:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return io_error(m);
    default:
      return internal_error(m);
  }
}

// A prepared statement that finalizes itself; every exit path of a query must release it.
class Stmt {
 public:
  Stmt() = default;
  ~Stmt() { reset_to(nullptr); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  Stmt(Stmt&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  Stmt& operator=(Stmt&& o) noexcept {
    if (this != &o) {
      reset_to(o.s_);
      o.s_ = nullptr;
    }
    return *this;
  }
  sqlite3_stmt* get() const { return s_; }
  void reset_to(sqlite3_stmt* s) {
    if (s_ != nullptr) sqlite3_finalize(s_);
    s_ = s;
  }

 private:
  sqlite3_stmt* s_ = nullptr;
};

Result<Stmt> prepare(sqlite3* db, const std::string& sql, const std::string& what) {
  sqlite3_stmt* s = nullptr;
  int rc = sqlite3_prepare_v3(db, sql.c_str(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &s,
                              nullptr);
  if (rc != SQLITE_OK) {
    if (s != nullptr) sqlite3_finalize(s);
    return sqlite_status(db, rc, what);
  }
  Stmt st;
  st.reset_to(s);
  return st;
}

Status exec(sqlite3* db, const char* sql, const std::string& what) {
  char* err = nullptr;
  int rc = sqlite3_exec(db, sql, nullptr, nullptr, &err);
  if (rc == SQLITE_OK) return {};
  std::string msg = err != nullptr ? err : sqlite3_errstr(rc);
  sqlite3_free(err);
  Status s = sqlite_status(nullptr, rc, what);
  return Status(s.code(), what + ": " + msg);
}

std::string column_text(sqlite3_stmt* s, int i) {
  const unsigned char* t = sqlite3_column_text(s, i);
  if (t == nullptr) return {};
  return std::string(reinterpret_cast<const char*>(t), static_cast<size_t>(sqlite3_column_bytes(s, i)));
}

// SQLite stores a NaN double as NULL; reading NULL back as NaN keeps a diverged loss diverged.
double column_real(sqlite3_stmt* s, int i) {
  if (sqlite3_column_type(s, i) == SQLITE_NULL) return std::numeric_limits<double>::quiet_NaN();
  return sqlite3_column_double(s, i);
}

void bind_text(sqlite3_stmt* s, int i, const std::string& v) {
  // SQLITE_STATIC: the string outlives the sqlite3_step() that reads it.
  sqlite3_bind_text(s, i, v.data(), static_cast<int>(v.size()), SQLITE_STATIC);
}

fs::path parent_dir(const fs::path& p) {
  fs::path d = p.parent_path();
  return d.empty() ? fs::path(".") : d;
}

Status check_output_path(const fs::path& path, const std::string& what) {
  if (path.empty()) return invalid_argument(what + " path is empty");
  std::error_code ec;
  fs::path dir = parent_dir(path);
  if (!fs::is_directory(dir, ec)) {
    return not_found("cannot write " + what + " " + path.string() + ": directory " + dir.string() +
                     " does not exist");
  }
  if (fs::is_directory(path, ec)) {
    return invalid_argument("cannot write " + what + " " + path.string() + ": it is a directory; give a file path");
  }
  return {};
}

Status validate_source(const std::string& value) {
  if (value == "simulated" || value == "measured") return {};
  return invalid_argument("trace meta \"source\" is " + in_quotes(value) + "; accepted: \"simulated\", \"measured\"");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TraceWriter

struct TraceWriter::Impl {
  enum class State { kOpen, kClosed, kFailed };

  fs::path path;
  fs::path tmp;
  sqlite3* db = nullptr;
  size_t batch_rows = 0;
  size_t pending = 0;  // rows inserted since the open transaction began
  bool in_txn = false;
  State state = State::kOpen;
  Status failure;  // why the writer failed, returned by every later call

  std::vector<std::string> lane_names;
  Stmt ins_meta, ins_lane, ins_span, ins_counter, ins_step;

  ~Impl() {
    // Without a successful close() nothing is published: drop the temp file, leave `path` alone.
    if (state != State::kClosed) {
      discard();
    }
  }

  void discard() {
    finalize_all();
    if (db != nullptr) {
      sqlite3_close(db);
      db = nullptr;
    }
    std::error_code ec;
    if (!tmp.empty()) fs::remove(tmp, ec);
  }

  void finalize_all() {
    ins_meta.reset_to(nullptr);
    ins_lane.reset_to(nullptr);
    ins_span.reset_to(nullptr);
    ins_counter.reset_to(nullptr);
    ins_step.reset_to(nullptr);
  }

  Status usable() const {
    if (state == State::kOpen) return {};
    if (state == State::kClosed) return invalid_argument("trace writer for " + path.string() + " is already closed");
    return failure;
  }

  // A SQLite failure mid-write leaves the temp database in an unknown state (journal_mode=OFF has
  // no rollback), so the writer stops and close() refuses to publish.
  Status fail(Status s) {
    state = State::kFailed;
    failure = s.with_context("trace " + path.string());
    return failure;
  }

  Status begin_if_needed() {
    if (in_txn) return {};
    Status s = exec(db, "BEGIN", "begin transaction");
    if (!s.ok()) return fail(s);
    in_txn = true;
    pending = 0;
    return {};
  }

  Status commit() {
    if (!in_txn) return {};
    Status s = exec(db, "COMMIT", "commit");
    if (!s.ok()) return fail(s);
    in_txn = false;
    pending = 0;
    return {};
  }

  // Steps a bound insert statement, then commits when the batch is full.
  Status step_insert(sqlite3_stmt* s, const char* what) {
    int rc = sqlite3_step(s);
    sqlite3_reset(s);
    if (rc != SQLITE_DONE) return fail(sqlite_status(db, rc, std::string("insert ") + what));
    if (++pending >= batch_rows) return commit();
    return {};
  }

  Status write_meta(const std::string& key, const std::string& value) {
    MT_RETURN_IF_ERROR(begin_if_needed());
    sqlite3_stmt* s = ins_meta.get();
    bind_text(s, 1, key);
    bind_text(s, 2, value);
    return step_insert(s, "meta");
  }
};

TraceWriter::TraceWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TraceWriter::~TraceWriter() = default;

Result<std::unique_ptr<TraceWriter>> TraceWriter::create(const fs::path& path,
                                                         const std::map<std::string, std::string>& meta,
                                                         size_t batch_rows) {
  // Validate everything before touching the filesystem, so a rejected call leaves no trace.
  auto src = meta.find("source");
  if (src == meta.end()) {
    return invalid_argument("trace meta must hold \"source\"; accepted: \"simulated\", \"measured\"");
  }
  MT_RETURN_IF_ERROR(validate_source(src->second));
  auto schema = meta.find("schema");
  if (schema != meta.end() && schema->second != kTraceSchemaVersion) {
    return invalid_argument("trace meta \"schema\" is " + in_quotes(schema->second) + "; the writer sets it to " +
                            in_quotes(kTraceSchemaVersion) + " (leave it out)");
  }
  for (const auto& [k, v] : meta) {
    if (k.empty()) return invalid_argument("trace meta has an empty key; keys must be non-empty text");
  }
  if (batch_rows == 0) return invalid_argument("trace writer batch_rows is 0; it must be at least 1");
  MT_RETURN_IF_ERROR(check_output_path(path, "trace"));

  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->tmp = temp_path_beside(path);
  impl->batch_rows = batch_rows;
  std::error_code ec;
  fs::remove(impl->tmp, ec);  // a stale file from an earlier process that had our pid

  int rc = sqlite3_open_v2(impl->tmp.c_str(), &impl->db,
                           SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    Status s = sqlite_status(impl->db, rc, "cannot create trace " + impl->tmp.string());
    return s;  // ~Impl closes the handle and removes the temp file
  }
  // The temp file is private until close() renames it, and a crash simply leaves it unpublished,
  // so durability during the write buys nothing: no journal, no syncs, one exclusive lock.
  MT_RETURN_IF_ERROR(exec(impl->db,
                          "PRAGMA journal_mode=OFF;"
                          "PRAGMA synchronous=OFF;"
                          "PRAGMA locking_mode=EXCLUSIVE;"
                          "PRAGMA temp_store=MEMORY;"
                          "PRAGMA cache_size=-65536;",
                          "configure trace " + impl->tmp.string()));
  MT_RETURN_IF_ERROR(exec(impl->db, kCreateSchemaSql, "create trace tables in " + impl->tmp.string()));

  sqlite3* db = impl->db;
  MT_ASSIGN_OR_RETURN(impl->ins_meta, prepare(db, "INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", "prepare"));
  MT_ASSIGN_OR_RETURN(impl->ins_lane, prepare(db, "INSERT INTO lanes(id, name, kind) VALUES(?, ?, ?)", "prepare"));
  MT_ASSIGN_OR_RETURN(impl->ins_span,
                      prepare(db,
                              "INSERT INTO spans(lane, name, kind, step, layer, micro_batch, start_ns, end_ns, "
                              "bytes, flops) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              "prepare"));
  MT_ASSIGN_OR_RETURN(impl->ins_counter,
                      prepare(db, "INSERT INTO counters(name, t_ns, value) VALUES(?, ?, ?)", "prepare"));
  MT_ASSIGN_OR_RETURN(impl->ins_step,
                      prepare(db, "INSERT INTO steps(step, loss, tokens, time_s, aux_loss, eval_loss) VALUES(?, ?, ?, ?, ?, ?)", "prepare"));

  for (const auto& [k, v] : meta) MT_RETURN_IF_ERROR(impl->write_meta(k, v));
  if (schema == meta.end()) MT_RETURN_IF_ERROR(impl->write_meta("schema", kTraceSchemaVersion));

  return std::unique_ptr<TraceWriter>(new TraceWriter(std::move(impl)));
}

Status TraceWriter::set_meta(const std::string& key, const std::string& value) {
  MT_RETURN_IF_ERROR(impl_->usable());
  if (key.empty()) return invalid_argument("trace meta key is empty; keys must be non-empty text");
  if (key == "source") MT_RETURN_IF_ERROR(validate_source(value));
  if (key == "schema" && value != kTraceSchemaVersion) {
    return invalid_argument("trace meta \"schema\" is set by the writer to " + in_quotes(kTraceSchemaVersion) +
                            "; " + in_quotes(value) + " is not accepted");
  }
  return impl_->write_meta(key, value);
}

Result<int64_t> TraceWriter::add_lane(const std::string& name, const std::string& kind) {
  MT_RETURN_IF_ERROR(impl_->usable());
  if (name.empty()) return invalid_argument("trace lane name is empty; give it a name such as \"GPU compute\"");
  auto& names = impl_->lane_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it != names.end()) {
    return invalid_argument("trace lane " + in_quotes(name) + " already exists (id " +
                            std::to_string(it - names.begin()) + "); lane names must be unique");
  }
  const auto id = static_cast<int64_t>(names.size());
  if (id >= kTraceMaxLanes) return invalid_argument("a trace holds at most " + std::to_string(kTraceMaxLanes) + " lanes");
  MT_RETURN_IF_ERROR(impl_->begin_if_needed());
  sqlite3_stmt* s = impl_->ins_lane.get();
  sqlite3_bind_int64(s, 1, id);
  bind_text(s, 2, name);
  bind_text(s, 3, kind);
  MT_RETURN_IF_ERROR(impl_->step_insert(s, "lane"));
  names.push_back(name);
  return id;
}

Status TraceWriter::add_span(const TraceSpan& span) {
  MT_RETURN_IF_ERROR(impl_->usable());
  const auto lane_count = static_cast<int64_t>(impl_->lane_names.size());
  if (span.lane < 0 || span.lane >= lane_count) {
    std::string accepted = lane_count == 0 ? std::string("no lanes exist yet (add them with add_lane())")
                                           : "lanes are 0.." + std::to_string(lane_count - 1);
    return invalid_argument("span " + in_quotes(span.name) + " is on lane " + std::to_string(span.lane) +
                            ", which does not exist; " + accepted);
  }
  if (span.end_ns < span.start_ns) {
    return invalid_argument("span " + in_quotes(span.name) + " ends before it starts (start_ns=" +
                            std::to_string(span.start_ns) + ", end_ns=" + std::to_string(span.end_ns) +
                            "); end_ns must be >= start_ns");
  }
  if (span.start_ns < 0 || span.end_ns > kTraceMaxNs)
    return invalid_argument("span " + in_quotes(span.name) + " is at " + std::to_string(span.start_ns) + ".." + std::to_string(span.end_ns) +
                            " ns; a trace's times are 0..2^53 ns from the run's start");
  for (const int64_t index : {span.step, span.layer, span.micro_batch})
    if (index < -1 || index >= kTraceMaxIndex)
      return invalid_argument("span " + in_quotes(span.name) + " has a step, layer or micro-batch of " + std::to_string(index) +
                              "; accepted: -1 (none) or 0..2^31");
  if (span.bytes < 0 || span.bytes > kTraceMaxNs || !(span.flops >= 0 && span.flops <= 1e30))
    return invalid_argument("span " + in_quotes(span.name) + " has bytes " + std::to_string(span.bytes) + " and flops " +
                            std::to_string(span.flops) + "; accepted: bytes 0..2^53, flops 0..1e30");
  MT_RETURN_IF_ERROR(impl_->begin_if_needed());
  sqlite3_stmt* s = impl_->ins_span.get();
  sqlite3_bind_int64(s, 1, span.lane);
  bind_text(s, 2, span.name);
  bind_text(s, 3, span.kind);
  sqlite3_bind_int64(s, 4, span.step);
  sqlite3_bind_int64(s, 5, span.layer);
  sqlite3_bind_int64(s, 6, span.micro_batch);
  sqlite3_bind_int64(s, 7, span.start_ns);
  sqlite3_bind_int64(s, 8, span.end_ns);
  sqlite3_bind_int64(s, 9, span.bytes);
  sqlite3_bind_double(s, 10, span.flops);
  return impl_->step_insert(s, "span");
}

Status TraceWriter::add_counter(const TraceCounter& counter) {
  MT_RETURN_IF_ERROR(impl_->usable());
  if (counter.name.empty()) {
    return invalid_argument("trace counter name is empty; give it a name such as \"bytes.device\"");
  }
  if (counter.t_ns < 0 || counter.t_ns > kTraceMaxNs || !(std::abs(counter.value) <= 1e300))
    return invalid_argument("trace counter " + in_quotes(counter.name) + " at " + std::to_string(counter.t_ns) + " ns is " +
                            std::to_string(counter.value) + "; accepted: 0..2^53 ns and a finite value");
  MT_RETURN_IF_ERROR(impl_->begin_if_needed());
  sqlite3_stmt* s = impl_->ins_counter.get();
  bind_text(s, 1, counter.name);
  sqlite3_bind_int64(s, 2, counter.t_ns);
  sqlite3_bind_double(s, 3, counter.value);
  return impl_->step_insert(s, "counter");
}

Status TraceWriter::add_step(const TraceStep& step) {
  MT_RETURN_IF_ERROR(impl_->usable());
  if (step.step < 0) {
    return invalid_argument("trace step number is " + std::to_string(step.step) + "; steps count from 0");
  }
  if (step.tokens < 0) {
    return invalid_argument("trace step " + std::to_string(step.step) + " has tokens=" +
                            std::to_string(step.tokens) + "; it must be >= 0");
  }
  if (step.step > kTraceMaxNs || step.tokens > kTraceMaxNs || !(step.time_s >= 0 && step.time_s <= 1e300))
    return invalid_argument("trace step " + std::to_string(step.step) + " has tokens=" + std::to_string(step.tokens) + " and time_s=" +
                            std::to_string(step.time_s) + "; accepted: a step and tokens up to 2^53, a finite time_s >= 0");
  MT_RETURN_IF_ERROR(impl_->begin_if_needed());
  sqlite3_stmt* s = impl_->ins_step.get();
  sqlite3_bind_int64(s, 1, step.step);
  sqlite3_bind_double(s, 2, step.loss);
  sqlite3_bind_int64(s, 3, step.tokens);
  sqlite3_bind_double(s, 4, step.time_s);
  if (std::isnan(step.aux_loss)) sqlite3_bind_null(s, 5);
  else sqlite3_bind_double(s, 5, step.aux_loss);
  if (std::isnan(step.eval_loss)) sqlite3_bind_null(s, 6);
  else sqlite3_bind_double(s, 6, step.eval_loss);
  return impl_->step_insert(s, "step");
}

Status TraceWriter::flush() {
  MT_RETURN_IF_ERROR(impl_->usable());
  return impl_->commit();
}

Status TraceWriter::close() {
  Impl& w = *impl_;
  if (w.state == Impl::State::kClosed) return {};
  MT_RETURN_IF_ERROR(w.usable());
  MT_RETURN_IF_ERROR(w.commit());
  Status s = exec(w.db, kCreateIndexesSql, "create trace indexes");
  if (!s.ok()) return w.fail(s);
  w.finalize_all();
  int rc = sqlite3_close(w.db);
  if (rc != SQLITE_OK) return w.fail(sqlite_status(w.db, rc, "close " + w.tmp.string()));
  w.db = nullptr;
  s = publish(w.tmp, w.path);
  if (!s.ok()) return w.fail(s);  // ~Impl removes the temp file; the old trace is still in place
  w.state = Impl::State::kClosed;
  return {};
}

// ---------------------------------------------------------------------------------------------
// TraceReader

namespace {

// The reader's state lives outside TraceReader so the helpers below can take it; Impl is private.
struct ReaderState {
  fs::path path;
  sqlite3* db = nullptr;
  std::map<std::string, std::string> meta;
  std::vector<TraceLane> lanes;
  // Longest span, so a window query can bound start_ns from below and use the index.
  mutable std::optional<int64_t> max_span_ns;
  // steps.aux_loss (Mixture-of-Experts models) came with schema additions; older traces lack it.
  bool steps_aux_loss = false;
  bool steps_eval_loss = false;  // steps.eval_loss came later still

  ReaderState() = default;
  ReaderState(const ReaderState&) = delete;
  ReaderState& operator=(const ReaderState&) = delete;
  ~ReaderState() {
    if (db != nullptr) sqlite3_close(db);
  }

  Status query_error(int rc, const std::string& what) const {
    if ((rc & 0xff) == SQLITE_NOTADB) {
      // The header looked like SQLite but SQLite disagrees (an encrypted or damaged first page).
      return corrupt(path.string() + " is not a MegaTrain trace (not an SQLite database): " + sqlite3_errmsg(db));
    }
    return sqlite_status(db, rc, path.string() + ": " + what);
  }

  // Schema damage surfaces when a statement is prepared, so prepare errors get the same words.
  Result<Stmt> prep(const std::string& sql) const {
    sqlite3_stmt* s = nullptr;
    int rc = sqlite3_prepare_v2(db, sql.c_str(), static_cast<int>(sql.size()), &s, nullptr);
    if (rc != SQLITE_OK) {
      if (s != nullptr) sqlite3_finalize(s);
      return query_error(rc, "reading the trace");
    }
    Stmt st;
    st.reset_to(s);
    return st;
  }
};

// A trace must at least look like SQLite before we let SQLite guess: its first 16 bytes.
Status check_sqlite_header(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot read trace " + path.string() + ": " + errno_text(errno));
  std::array<char, 16> head{};
  in.read(head.data(), head.size());
  static constexpr char kMagic[16] = "SQLite format 3";  // 15 chars and the NUL the format includes
  if (in.gcount() < static_cast<std::streamsize>(head.size()) || std::memcmp(head.data(), kMagic, 16) != 0) {
    std::string why = in.gcount() == 0 ? " (empty file)" : "";
    return corrupt(path.string() + " is not a MegaTrain trace (not an SQLite database)" + why);
  }
  return {};
}

Status check_tables(ReaderState& r) {
  // Reading sqlite_master is the first real read: a truncated or garbled file fails here.
  MT_ASSIGN_OR_RETURN(Stmt st, r.prep("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"));
  std::set<std::string> present;
  int rc;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) present.insert(column_text(st.get(), 0));
  if (rc != SQLITE_DONE) return r.query_error(rc, "reading the schema");

  std::vector<std::string> missing;
  for (const char* t : kRequiredTables) {
    if (present.count(t) == 0) missing.emplace_back(t);
  }
  if (!missing.empty()) {
    std::string list;
    for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
    return corrupt(r.path.string() + " is not a MegaTrain trace: table" + (missing.size() > 1 ? "s " : " ") + list +
                   (missing.size() > 1 ? " are" : " is") +
                   " missing (a trace has tables meta, lanes, spans, counters, steps)");
  }
  // The five must be tables: a view may compute anything, forever.
  {
    MT_ASSIGN_OR_RETURN(Stmt types, r.prep("SELECT name, type FROM sqlite_master WHERE name IN ('meta', 'lanes', 'spans', 'counters', "
                                           "'steps') AND type != 'table'"));
    rc = sqlite3_step(types.get());
    if (rc == SQLITE_ROW)
      return corrupt(r.path.string() + " is not a MegaTrain trace: " + column_text(types.get(), 0) + " is a " +
                     column_text(types.get(), 1) + "; a trace's meta, lanes, spans, counters and steps are plain tables");
    if (rc != SQLITE_DONE) return r.query_error(rc, "reading the schema");
  }
  for (const auto& tc : required_columns()) {
    MT_ASSIGN_OR_RETURN(Stmt info, r.prep(std::string("PRAGMA table_info(") + tc.table + ")"));
    std::set<std::string> cols;
    while ((rc = sqlite3_step(info.get())) == SQLITE_ROW) cols.insert(column_text(info.get(), 1));
    if (rc != SQLITE_DONE) return r.query_error(rc, std::string("reading the columns of ") + tc.table);
    if (std::strcmp(tc.table, "steps") == 0) {
      r.steps_aux_loss = cols.count("aux_loss") > 0;
      r.steps_eval_loss = cols.count("eval_loss") > 0;
    }
    for (const char* c : tc.columns) {
      if (cols.count(c) == 0) {
        return corrupt(r.path.string() + " is not a MegaTrain trace: table " + tc.table + " has no column " + c);
      }
    }
  }
  return {};
}

// Every row must hold what the writer writes: integers and reals in the ranges below, spans on lanes that exist. The
// checks are one scan per table, so that nothing downstream (the export, the GUI) meets a value
// whose arithmetic overflows.
Status check_rows(ReaderState& r) {
  const std::string max_ns = std::to_string(kTraceMaxNs), max_index = std::to_string(kTraceMaxIndex);
  auto integer_in = [](const std::string& col, const std::string& lo, const std::string& hi) {
    return "(typeof(" + col + ") = 'integer' AND " + col + " BETWEEN " + lo + " AND " + hi + ")";
  };
  auto real_in = [](const std::string& col, const std::string& lo, const std::string& hi) {  // NaN is stored as NULL
    return "(typeof(" + col + ") = 'null' OR (typeof(" + col + ") IN ('integer', 'real') AND " + col + " BETWEEN " + lo + " AND " + hi +
           "))";
  };
  auto any_real = [](const std::string& col) { return "typeof(" + col + ") IN ('null', 'integer', 'real')"; };
  const bool aux_loss = r.steps_aux_loss, eval_loss = r.steps_eval_loss;
  struct Check {
    std::string table, columns, valid, accepted;
  };
  const std::vector<Check> checks = {
      {"lanes", "id", integer_in("id", "0", std::to_string(kTraceMaxLanes - 1)),
       "lane ids are integers from 0 to " + std::to_string(kTraceMaxLanes - 1)},
      {"spans", "lane, start_ns, end_ns, step, layer, micro_batch, bytes, flops",
       "typeof(lane) = 'integer' AND lane IN (SELECT id FROM lanes) AND " + integer_in("start_ns", "0", max_ns) + " AND " +
           integer_in("end_ns", "start_ns", max_ns) + " AND " + integer_in("step", "-1", max_index) + " AND " +
           integer_in("layer", "-1", max_index) + " AND " + integer_in("micro_batch", "-1", max_index) + " AND " +
           integer_in("bytes", "0", max_ns) + " AND " + real_in("flops", "0", "1e30"),
       "a span is on a lane of the lanes table, 0 <= start_ns <= end_ns <= 2^53 (ns), step, layer and micro_batch are -1 or "
       "0..2^31, bytes 0..2^53 and flops 0..1e30"},
      {"counters", "name, t_ns, value", integer_in("t_ns", "0", max_ns) + " AND " + real_in("value", "-1e300", "1e300"),
       "a counter has 0 <= t_ns <= 2^53 (ns) and a finite value"},
      {"steps", std::string("step, loss, tokens, time_s") + (aux_loss ? ", aux_loss" : "") + (eval_loss ? ", eval_loss" : ""),
       integer_in("step", "0", max_ns) + " AND " + any_real("loss") + " AND " + integer_in("tokens", "0", max_ns) + " AND " +
           real_in("time_s", "0", "1e300") + (aux_loss ? " AND " + any_real("aux_loss") : "") +
           (eval_loss ? " AND " + any_real("eval_loss") : ""),
       "a step has a number 0..2^53, a loss that is a number (a diverged run's infinity too) or missing, 0..2^53 tokens and a finite "
       "time_s >= 0"},
  };
  for (const Check& c : checks) {
    MT_ASSIGN_OR_RETURN(Stmt st, r.prep("SELECT rowid, " + c.columns + " FROM " + c.table + " WHERE NOT coalesce(" + c.valid + ", 0) LIMIT 1"));
    int rc = sqlite3_step(st.get());
    if (rc == SQLITE_DONE) continue;
    if (rc != SQLITE_ROW) return r.query_error(rc, "checking " + c.table);
    std::string values;
    for (int i = 1; i < sqlite3_column_count(st.get()); ++i) {
      const auto* text = sqlite3_column_text(st.get(), i);
      values += std::string(i > 1 ? ", " : "") + sqlite3_column_name(st.get(), i) + " " +
                (text != nullptr ? reinterpret_cast<const char*>(text) : "NULL");
    }
    return corrupt(r.path.string() + ": " + c.table + " row " + std::to_string(sqlite3_column_int64(st.get(), 0)) + " (" + values +
                   ") is out of range: " + c.accepted);
  }
  {
    MT_ASSIGN_OR_RETURN(Stmt st, r.prep("SELECT id FROM lanes GROUP BY id HAVING count(*) > 1 LIMIT 1"));
    int rc = sqlite3_step(st.get());
    if (rc == SQLITE_ROW) return corrupt(r.path.string() + ": lane id " + column_text(st.get(), 0) + " is given twice; lane ids are unique");
    if (rc != SQLITE_DONE) return r.query_error(rc, "checking lanes");
  }
  return {};
}

Status load_meta_and_lanes(ReaderState& r) {
  int rc;
  {
    MT_ASSIGN_OR_RETURN(Stmt st, r.prep("SELECT key, value FROM meta"));
    while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) r.meta[column_text(st.get(), 0)] = column_text(st.get(), 1);
    if (rc != SQLITE_DONE) return r.query_error(rc, "reading meta");
  }
  {
    MT_ASSIGN_OR_RETURN(Stmt st, r.prep("SELECT id, name, kind FROM lanes ORDER BY id"));
    while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) {
      r.lanes.push_back({sqlite3_column_int64(st.get(), 0), column_text(st.get(), 1), column_text(st.get(), 2)});
    }
    if (rc != SQLITE_DONE) return r.query_error(rc, "reading lanes");
  }
  auto schema = r.meta.find("schema");
  if (schema != r.meta.end() && schema->second != kTraceSchemaVersion) {
    if (schema->second.rfind("megatrain.trace/", 0) == 0) {
      return unsupported(r.path.string() + " has trace schema " + in_quotes(schema->second) + "; this build reads " +
                         in_quotes(kTraceSchemaVersion));
    }
    return corrupt(r.path.string() + " is not a MegaTrain trace: meta schema is " + in_quotes(schema->second) +
                   ", expected " + in_quotes(kTraceSchemaVersion));
  }
  return {};
}

}  // namespace

struct TraceReader::Impl : ReaderState {};

TraceReader::TraceReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TraceReader::~TraceReader() = default;

Result<std::unique_ptr<TraceReader>> TraceReader::open(const fs::path& path) {
  std::error_code ec;
  auto st = fs::status(path, ec);
  if (!fs::exists(st)) return not_found("trace file " + path.string() + " does not exist");
  if (fs::is_directory(st)) {
    return invalid_argument("trace " + path.string() + " is a directory; give a .mtrace file");
  }
  MT_RETURN_IF_ERROR(check_sqlite_header(path));

  auto impl = std::make_unique<Impl>();
  impl->path = path;
  int rc = sqlite3_open_v2(path.c_str(), &impl->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) return impl->query_error(rc, "cannot open trace");
  // sqlite3_open is lazy; these are the first reads, and a damaged file fails in them with
  // SQLite's own words ("database disk image is malformed", "file is not a database").
  MT_RETURN_IF_ERROR(check_tables(*impl));
  MT_RETURN_IF_ERROR(load_meta_and_lanes(*impl));
  MT_RETURN_IF_ERROR(check_rows(*impl));
  return std::unique_ptr<TraceReader>(new TraceReader(std::move(impl)));
}

const std::map<std::string, std::string>& TraceReader::meta() const { return impl_->meta; }
const std::vector<TraceLane>& TraceReader::lanes() const { return impl_->lanes; }

Result<TraceSummary> TraceReader::summary() const {
  TraceSummary sum;
  {
    MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep("SELECT count(*), min(start_ns), max(end_ns) FROM spans"));
    int rc = sqlite3_step(st.get());
    if (rc != SQLITE_ROW) return impl_->query_error(rc, "summarising spans");
    sum.span_count = sqlite3_column_int64(st.get(), 0);
    sum.start_ns = sqlite3_column_int64(st.get(), 1);  // NULL (no spans) reads as 0
    sum.end_ns = sqlite3_column_int64(st.get(), 2);
  }
  {
    MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep("SELECT count(*) FROM counters"));
    int rc = sqlite3_step(st.get());
    if (rc != SQLITE_ROW) return impl_->query_error(rc, "counting counters");
    sum.counter_count = sqlite3_column_int64(st.get(), 0);
  }
  return sum;
}

Result<std::vector<TraceSpan>> TraceReader::spans(std::optional<int64_t> lane, std::optional<int64_t> t0_ns,
                                                  std::optional<int64_t> t1_ns) const {
  // A span overlaps [t0, t1) when it starts before t1 and either ends after t0 or starts inside
  // the window (so a zero-length span at t0 counts). No span starts before t0 - longest span,
  // which turns the end_ns test into an index range on start_ns.
  if (t0_ns && !impl_->max_span_ns) {
    MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep("SELECT coalesce(max(end_ns - start_ns), 0) FROM spans"));
    int rc = sqlite3_step(st.get());
    if (rc != SQLITE_ROW) return impl_->query_error(rc, "finding the longest span");
    impl_->max_span_ns = sqlite3_column_int64(st.get(), 0);
  }
  std::string sql =
      "SELECT lane, name, kind, step, layer, micro_batch, start_ns, end_ns, bytes, flops FROM spans WHERE 1";
  if (lane) sql += " AND lane = :lane";
  if (t1_ns) sql += " AND start_ns < :t1";
  if (t0_ns) sql += " AND start_ns >= :lo AND (end_ns > :t0 OR start_ns >= :t0)";
  sql += " ORDER BY start_ns, rowid";
  MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep(sql));
  sqlite3_stmt* s = st.get();
  if (lane) sqlite3_bind_int64(s, sqlite3_bind_parameter_index(s, ":lane"), *lane);
  if (t1_ns) sqlite3_bind_int64(s, sqlite3_bind_parameter_index(s, ":t1"), *t1_ns);
  if (t0_ns) {
    // Saturate: t0 near INT64_MIN minus a long span must not wrap around.
    int64_t lo = *t0_ns;
    int64_t m = *impl_->max_span_ns;
    lo = (m > 0 && lo < std::numeric_limits<int64_t>::min() + m) ? std::numeric_limits<int64_t>::min() : lo - m;
    sqlite3_bind_int64(s, sqlite3_bind_parameter_index(s, ":lo"), lo);
    sqlite3_bind_int64(s, sqlite3_bind_parameter_index(s, ":t0"), *t0_ns);
  }
  std::vector<TraceSpan> out;
  int rc;
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    TraceSpan sp;
    sp.lane = sqlite3_column_int64(s, 0);
    sp.name = column_text(s, 1);
    sp.kind = column_text(s, 2);
    sp.step = sqlite3_column_int64(s, 3);
    sp.layer = sqlite3_column_int64(s, 4);
    sp.micro_batch = sqlite3_column_int64(s, 5);
    sp.start_ns = sqlite3_column_int64(s, 6);
    sp.end_ns = sqlite3_column_int64(s, 7);
    sp.bytes = sqlite3_column_int64(s, 8);
    sp.flops = column_real(s, 9);
    out.push_back(std::move(sp));
  }
  if (rc != SQLITE_DONE) return impl_->query_error(rc, "reading spans");
  return out;
}

Result<std::vector<std::string>> TraceReader::counter_names() const {
  MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep("SELECT DISTINCT name FROM counters ORDER BY name"));
  std::vector<std::string> out;
  int rc;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) out.push_back(column_text(st.get(), 0));
  if (rc != SQLITE_DONE) return impl_->query_error(rc, "reading counter names");
  return out;
}

Result<std::vector<TraceCounter>> TraceReader::counters(const std::string& name) const {
  std::string sql = "SELECT name, t_ns, value FROM counters";
  if (!name.empty()) sql += " WHERE name = ?1";
  sql += " ORDER BY t_ns, rowid";
  MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep(sql));
  if (!name.empty()) bind_text(st.get(), 1, name);
  std::vector<TraceCounter> out;
  int rc;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) {
    out.push_back({column_text(st.get(), 0), sqlite3_column_int64(st.get(), 1), column_real(st.get(), 2)});
  }
  if (rc != SQLITE_DONE) return impl_->query_error(rc, "reading counters");
  return out;
}

Result<std::vector<TraceStep>> TraceReader::steps() const {
  // The optional columns, NULL where a trace lacks them.
  const std::string cols = std::string("step, loss, tokens, time_s, ") + (impl_->steps_aux_loss ? "aux_loss" : "NULL") + ", " +
                           (impl_->steps_eval_loss ? "eval_loss" : "NULL");
  MT_ASSIGN_OR_RETURN(Stmt st, impl_->prep("SELECT " + cols + " FROM steps ORDER BY step, rowid"));
  std::vector<TraceStep> out;
  int rc;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) {
    TraceStep t{sqlite3_column_int64(st.get(), 0), column_real(st.get(), 1), sqlite3_column_int64(st.get(), 2),
                column_real(st.get(), 3)};
    if (sqlite3_column_type(st.get(), 4) != SQLITE_NULL) t.aux_loss = sqlite3_column_double(st.get(), 4);
    if (sqlite3_column_type(st.get(), 5) != SQLITE_NULL) t.eval_loss = sqlite3_column_double(st.get(), 5);
    out.push_back(t);
  }
  if (rc != SQLITE_DONE) return impl_->query_error(rc, "reading steps");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Chrome Trace Event export

namespace {

// Streams events to a FILE with a large buffer; a trace of a million spans is a few hundred MB,
// so events are written as they are read instead of being built as one JSON document.
class JsonOut {
 public:
  explicit JsonOut(std::FILE* f) : f_(f) {}

  void raw(std::string_view s) { buf_.append(s); spill(); }
  // nlohmann's dumper escapes correctly and replaces invalid UTF-8, which strict parsers reject.
  void str(const std::string& s) {
    buf_ += nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    spill();
  }
  void i64(int64_t v) {
    char tmp[24];
    auto r = std::to_chars(tmp, tmp + sizeof tmp, v);
    buf_.append(tmp, r.ptr);
  }
  // Shortest round-trip form; JSON has no NaN or infinity, so those become null.
  void num(double v) {
    if (!std::isfinite(v)) {
      buf_ += "null";
      return;
    }
    char tmp[32];
    auto r = std::to_chars(tmp, tmp + sizeof tmp, v);
    buf_.append(tmp, r.ptr);
  }
  bool finish() {
    flush_buf();
    return ok_;
  }

 private:
  void spill() {
    if (buf_.size() >= (1u << 20)) flush_buf();
  }
  void flush_buf() {
    if (!buf_.empty() && std::fwrite(buf_.data(), 1, buf_.size(), f_) != buf_.size()) ok_ = false;
    buf_.clear();
  }
  std::FILE* f_;
  std::string buf_;
  bool ok_ = true;
};

// Lane ids map to tids 1..N: tid 0 is left free, as some viewers treat it as the process itself.
int64_t lane_tid(int64_t lane) { return lane + 1; }

Status write_chrome_events(const TraceReader& trace, JsonOut& out) {
  out.raw("{\"traceEvents\":[\n");
  bool first = true;
  auto sep = [&] {
    out.raw(first ? "" : ",\n");
    first = false;
  };

  const auto& meta = trace.meta();
  auto src = meta.find("source");
  sep();
  out.raw(R"({"name":"process_name","ph":"M","pid":1,"tid":0,"args":{"name":)");
  out.str(src != meta.end() ? "MegaTrain (" + src->second + ")" : std::string("MegaTrain"));
  out.raw("}}");
  int64_t sort_index = 0;
  for (const auto& lane : trace.lanes()) {
    sep();
    out.raw(R"({"name":"thread_name","ph":"M","pid":1,"tid":)");
    out.i64(lane_tid(lane.id));
    out.raw(R"(,"args":{"name":)");
    out.str(lane.name);
    out.raw("}}");
    sep();
    out.raw(R"({"name":"thread_sort_index","ph":"M","pid":1,"tid":)");
    out.i64(lane_tid(lane.id));
    out.raw(R"(,"args":{"sort_index":)");
    out.i64(sort_index++);
    out.raw("}}");
  }

  // Spans are read in time slices so memory stays bounded by a slice, not the whole trace.
  MT_ASSIGN_OR_RETURN(TraceSummary sum, trace.summary());
  constexpr int64_t kSpansPerSlice = 200000;
  const int64_t slices = std::max<int64_t>(1, (sum.span_count + kSpansPerSlice - 1) / kSpansPerSlice);
  // Every span starts in [start_ns, end_ns]; the slices cover [start_ns, end_ns + 1) exactly.
  const long double lo = static_cast<long double>(sum.start_ns);
  const long double width = (static_cast<long double>(sum.end_ns) + 1 - lo) / static_cast<long double>(slices);
  for (int64_t i = 0; i < slices && sum.span_count > 0; ++i) {
    // Slice i holds the spans that start in [a, b); the first has no lower and the last no upper
    // bound, so rounding at the edges cannot drop a span.
    std::optional<int64_t> a, b;
    if (i > 0) a = static_cast<int64_t>(lo + width * static_cast<long double>(i));
    if (i + 1 < slices) b = static_cast<int64_t>(lo + width * static_cast<long double>(i + 1));
    MT_ASSIGN_OR_RETURN(std::vector<TraceSpan> spans, trace.spans(std::nullopt, a, b));
    for (const auto& sp : spans) {
      // The window query also returns spans that started in an earlier slice and overlap this one.
      if (a && sp.start_ns < *a) continue;
      sep();
      out.raw(R"({"name":)");
      out.str(sp.name);
      out.raw(R"(,"cat":)");
      out.str(sp.kind);
      out.raw(R"(,"ph":"X","pid":1,"tid":)");
      out.i64(lane_tid(sp.lane));
      out.raw(R"(,"ts":)");
      out.num(static_cast<double>(sp.start_ns) / 1000.0);
      out.raw(R"(,"dur":)");
      out.num(static_cast<double>(sp.end_ns - sp.start_ns) / 1000.0);
      out.raw(R"(,"args":{"step":)");
      out.i64(sp.step);
      out.raw(R"(,"layer":)");
      out.i64(sp.layer);
      out.raw(R"(,"micro_batch":)");
      out.i64(sp.micro_batch);
      out.raw(R"(,"bytes":)");
      out.i64(sp.bytes);
      out.raw(R"(,"flops":)");
      out.num(sp.flops);
      out.raw(R"(,"kind":)");
      out.str(sp.kind);
      out.raw("}}");
    }
  }

  MT_ASSIGN_OR_RETURN(std::vector<TraceCounter> counters, trace.counters());
  for (const auto& c : counters) {
    sep();
    out.raw(R"({"name":)");
    out.str(c.name);
    out.raw(R"(,"ph":"C","pid":1,"ts":)");
    out.num(static_cast<double>(c.t_ns) / 1000.0);
    out.raw(R"(,"args":{)");
    out.str(c.name);
    out.raw(":");
    out.num(c.value);
    out.raw("}}");
  }

  out.raw("\n],\"displayTimeUnit\":\"ns\",\"metadata\":{");
  bool first_meta = true;
  for (const auto& [k, v] : meta) {
    out.raw(first_meta ? "" : ",");
    first_meta = false;
    out.str(k);
    out.raw(":");
    out.str(v);
  }
  out.raw("}}\n");
  return {};
}

}  // namespace

Status export_chrome_trace(const TraceReader& trace, const fs::path& out_json) {
  MT_RETURN_IF_ERROR(check_output_path(out_json, "Chrome trace"));
  const fs::path tmp = temp_path_beside(out_json);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return io_error("cannot create " + tmp.string() + ": " + errno_text(errno));
  auto drop = [&](Status s) {
    std::error_code ec;
    fs::remove(tmp, ec);
    return s;
  };
  JsonOut out(f);
  Status s = write_chrome_events(trace, out);
  bool wrote = out.finish();
  int write_errno = errno;
  if (std::fclose(f) != 0 && wrote) {
    wrote = false;
    write_errno = errno;
  }
  if (!s.ok()) return drop(s.with_context("exporting " + out_json.string()));
  if (!wrote) return drop(io_error("writing " + tmp.string() + " failed: " + errno_text(write_errno)));
  s = publish(tmp, out_json);
  if (!s.ok()) return drop(s);
  return {};
}

}  // namespace megatrain

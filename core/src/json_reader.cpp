// Strict JSON reading with key paths in every message.
#include "detail/json_reader.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "megatrain/core/limits.h"

namespace megatrain::detail {

namespace {

// The key path of the value being parsed, kept as nlohmann's parser reports its events, with the
// keys seen so far in each open object: nlohmann keeps the last of two equal keys silently, so a
// plan with "seq_len" twice would otherwise train with whichever came second.
class DuplicateKeyFinder {
 public:
  bool on_event(nlohmann::json::parse_event_t ev, const Json& parsed) {
    using Ev = nlohmann::json::parse_event_t;
    switch (ev) {
      case Ev::object_start: open(false); break;
      case Ev::array_start: open(true); break;
      case Ev::object_end:
      case Ev::array_end: close(); break;
      case Ev::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second && duplicate_.empty()) duplicate_ = path();
        break;
      }
      case Ev::value: element_done(); break;
    }
    return true;
  }
  // The path of the first duplicated key ("training.seq_len", "storage[1].path"), or "".
  const std::string& duplicate() const { return duplicate_; }
  // The key path being read now ("training.lr"): where a parse stopped.
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) {
      if (f.array) p += "[" + std::to_string(f.index) + "]";
      else p += (p.empty() ? "" : ".") + f.key;
    }
    return p;
  }

 private:
  struct Frame {
    bool array = false;
    size_t index = 0;  // arrays: the element being read
    std::string key;   // objects: the member being read
    std::set<std::string> keys;
  };
  void open(bool array) { frames_.push_back(Frame{array, 0, {}, {}}); }
  void close() {
    if (!frames_.empty()) frames_.pop_back();
    element_done();
  }
  void element_done() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
  }
  std::vector<Frame> frames_;
  std::string duplicate_;
};

}  // namespace

Result<Json> parse_json(std::string_view text, const std::string& what) {
  MT_ASSIGN_OR_RETURN(const Limits lim, limits());
  DuplicateKeyFinder dup;
  const Json::parser_callback_t too_deep = json_nesting_limit<Json>(lim.nesting);
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), [&](int depth, nlohmann::json::parse_event_t ev, Json& parsed) {
      return too_deep(depth, ev, parsed) && dup.on_event(ev, parsed);
    });
  } catch (const JsonTooDeep& e) {
    const std::string at = dup.path();
    return invalid_argument(what + ": " + (at.size() > 80 ? at.substr(0, 80) + "..." : at) + ": " + e.what());
  } catch (const nlohmann::json::parse_error& e) {
    // Convert the byte offset to line:column so the user can find it.
    size_t byte = std::min<size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
    size_t line = 1, col = 1;
    for (size_t i = 0; i < byte; ++i) {
      if (text[i] == '\n') { ++line; col = 1; } else { ++col; }
    }
    std::string reason = e.what();
    auto pos = reason.find("syntax error");
    if (pos != std::string::npos) reason = reason.substr(pos);
    bool truncated = byte >= text.size() || reason.find("end of input") != std::string::npos;
    return parse_error(what + ": not valid JSON at line " + std::to_string(line) + ", column " +
                       std::to_string(col) + (truncated ? " (the text ends early: truncated file?)" : "") +
                       ": " + reason);
  } catch (const nlohmann::json::out_of_range& e) {
    // A number too large for a double (1e999): nlohmann names the number, not where it is.
    std::string reason = e.what();
    const size_t q = reason.find('\''), q2 = q == std::string::npos ? q : reason.find('\'', q + 1);
    const std::string number = q2 == std::string::npos ? std::string() : reason.substr(q + 1, q2 - q - 1);
    std::string where;
    if (const size_t at = number.empty() ? std::string::npos : text.find(number); at != std::string::npos) {
      const size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n'));
      where = " at line " + std::to_string(line);
    }
    const std::string key = dup.path();
    return parse_error(what + (key.empty() ? "" : ": " + key) + ": the number " + (number.empty() ? std::string("here") : number) +
                       where + " is out of range: numbers must fit a double (magnitude at most 1.8e308)");
  } catch (const nlohmann::json::exception& e) {
    const std::string key = dup.path();
    return parse_error(what + (key.empty() ? "" : ": " + key) + ": not valid JSON: " + e.what());
  }
  if (!dup.duplicate().empty())
    return invalid_argument(what + ": " + dup.duplicate() +
                            ": duplicate key; each key may appear once in an object (JSON readers disagree on "
                            "which of two would count)");
  return root;
}

Result<Json> read_json_file(const std::filesystem::path& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found(what + " '" + path.string() + "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument(what + " '" + path.string() + "' is a directory; expected a JSON file");
  // A FIFO's open would wait for a writer, and a device would never end (issue 49).
  if (!std::filesystem::is_regular_file(path, ec))
    return invalid_argument(what + " '" + path.string() + "' is not a regular file (a FIFO, socket or device); expected a JSON file");
  MT_RETURN_IF_ERROR(check_file_bytes(path, what));
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot open " + what + " '" + path.string() + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return io_error("cannot read " + what + " '" + path.string() + "'");
  std::string text = ss.str();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    return parse_error(what + " '" + path.string() + "' is empty; expected a JSON object");
  return parse_json(text, what + " '" + path.string() + "'");
}

std::string json_type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::object: return "an object";
    case Json::value_t::array: return "an array";
    case Json::value_t::string: return "a string";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    default: return "an unsupported value";
  }
}

namespace {
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

std::string show(const Json& j) {
  std::string s = j.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}
}  // namespace

std::string closest_match(std::string_view key, const std::vector<std::string>& accepted) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& a : accepted) {
    size_t d = edit_distance(key, a);
    if (d < best_d) { best_d = d; best = a; }
  }
  size_t limit = std::max<size_t>(2, key.size() / 3);
  return best_d <= limit ? best : std::string();
}

std::string did_you_mean(std::string_view key, const std::vector<std::string>& accepted) {
  std::string hint = closest_match(key, accepted);
  return hint.empty() ? hint : "did you mean \"" + hint + "\"?";
}

FieldReader::FieldReader(const Json& object, std::string path) : obj_(object), path_(std::move(path)) {
  if (!obj_.is_object())
    status_ = invalid_argument((path_.empty() ? std::string("the document") : path_) + ": expected an object, got " +
                               json_type_name(obj_));
}

FieldReader::FieldReader(const Json& object, std::string path, std::initializer_list<std::string_view> keys)
    : FieldReader(object, std::move(path)) {
  accept(keys);
  if (status_.ok()) status_ = unknown_key_error();
}

bool FieldReader::has(const std::string& key) const { return obj_.is_object() && obj_.contains(key); }

std::string FieldReader::path_of(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

void FieldReader::fail(Status s) {
  if (status_.ok() && !s.ok()) status_ = std::move(s);
}

void FieldReader::accept(std::initializer_list<std::string_view> keys) {
  for (auto k : keys) known_.emplace_back(k);
}

const Json* FieldReader::find(const std::string& key, Need need, const char* expected) {
  known_.push_back(key);
  if (!status_.ok() || !obj_.is_object()) return nullptr;
  auto it = obj_.find(key);
  if (it == obj_.end()) {
    if (need == Need::kRequired) fail(invalid_argument(path_of(key) + ": missing; expected " + expected + misspelt_as(key)));
    return nullptr;
  }
  return &*it;
}

void FieldReader::integer(const std::string& key, int64_t& out, Need need, int64_t lo, int64_t hi) {
  const Json* j = find(key, need, "an integer");
  if (!j) return;
  int64_t v = 0;
  if (j->is_number_integer() || j->is_number_unsigned()) {
    if (j->is_number_unsigned() && j->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      fail(invalid_argument(path_of(key) + ": " + show(*j) + " is too large"));
      return;
    }
    v = j->get<int64_t>();
  } else if (j->is_number_float() && std::isfinite(j->get<double>()) &&
             std::floor(j->get<double>()) == j->get<double>() && std::fabs(j->get<double>()) < 9e18) {
    v = static_cast<int64_t>(j->get<double>());  // 8e9 written in exponent form is still an integer
  } else {
    fail(invalid_argument(path_of(key) + ": expected an integer, got " + json_type_name(*j) + " " + show(*j)));
    return;
  }
  if (v < lo || v > hi) {
    fail(invalid_argument(path_of(key) + ": " + std::to_string(v) + " is out of range; accepted: " +
                          std::to_string(lo) + " .. " + std::to_string(hi)));
    return;
  }
  out = v;
}

void FieldReader::number(const std::string& key, double& out, Need need, double lo, double hi) {
  const Json* j = find(key, need, "a number");
  if (!j) return;
  if (!j->is_number()) {
    fail(invalid_argument(path_of(key) + ": expected a number, got " + json_type_name(*j) + " " + show(*j)));
    return;
  }
  double v = j->get<double>();
  if (!(v >= lo && v <= hi)) {
    std::ostringstream msg;
    msg << path_of(key) << ": " << v << " is out of range; accepted: " << lo << " .. " << hi;
    fail(invalid_argument(msg.str()));
    return;
  }
  out = v;
}

void FieldReader::boolean(const std::string& key, bool& out, Need need) {
  const Json* j = find(key, need, "true or false");
  if (!j) return;
  if (!j->is_boolean()) {
    fail(invalid_argument(path_of(key) + ": expected true or false, got " + json_type_name(*j) + " " + show(*j)));
    return;
  }
  out = j->get<bool>();
}

void FieldReader::string(const std::string& key, std::string& out, Need need) {
  const Json* j = find(key, need, "a string");
  if (!j) return;
  if (!j->is_string()) {
    fail(invalid_argument(path_of(key) + ": expected a string, got " + json_type_name(*j) + " " + show(*j)));
    return;
  }
  out = j->get<std::string>();
}

void FieldReader::choice(const std::string& key, std::string& out, Need need,
                         const std::vector<std::string>& accepted) {
  const Json* j = find(key, need, ("one of: " + join(accepted)).c_str());
  if (!j) return;
  if (!j->is_string()) {
    fail(invalid_argument(path_of(key) + ": expected one of " + join(accepted) + ", got " + json_type_name(*j) +
                          " " + show(*j)));
    return;
  }
  std::string v = j->get<std::string>();
  if (std::find(accepted.begin(), accepted.end(), v) == accepted.end()) {
    std::string hint = did_you_mean(v, accepted);
    fail(invalid_argument(path_of(key) + ": '" + v + "' is not accepted; " + (hint.empty() ? "" : hint + " ") +
                          "accepted: " + join(accepted)));
    return;
  }
  out = v;
}

void FieldReader::string_array(const std::string& key, std::vector<std::string>& out, Need need) {
  const Json* j = find(key, need, "an array of strings");
  if (!j) return;
  if (!j->is_array()) {
    fail(invalid_argument(path_of(key) + ": expected an array of strings, got " + json_type_name(*j)));
    return;
  }
  std::vector<std::string> v;
  for (size_t i = 0; i < j->size(); ++i) {
    if (!(*j)[i].is_string()) {
      fail(invalid_argument(path_of(key) + "[" + std::to_string(i) + "]: expected a string, got " +
                            json_type_name((*j)[i])));
      return;
    }
    v.push_back((*j)[i].get<std::string>());
  }
  out = std::move(v);
}

const Json* FieldReader::member(const std::string& key, Need need) { return find(key, need, "a value"); }

const Json* FieldReader::object(const std::string& key, Need need) {
  const Json* j = find(key, need, "an object");
  if (j && !j->is_object()) {
    fail(invalid_argument(path_of(key) + ": expected an object, got " + json_type_name(*j) + " " + show(*j)));
    return nullptr;
  }
  return j;
}

const Json* FieldReader::array(const std::string& key, Need need) {
  const Json* j = find(key, need, "an array");
  if (j && !j->is_array()) {
    fail(invalid_argument(path_of(key) + ": expected an array, got " + json_type_name(*j) + " " + show(*j)));
    return nullptr;
  }
  return j;
}

Status FieldReader::finish() {
  if (!status_.ok()) return status_;
  return unknown_key_error();
}

std::string FieldReader::misspelt_as(const std::string& key) const {
  // A lenient object (a config.json, whose unknown keys are allowed) cannot call a near key
  // unknown, but it can point at it.
  for (auto it = obj_.begin(); it != obj_.end(); ++it)
    if (std::find(known_.begin(), known_.end(), it.key()) == known_.end() && !closest_match(it.key(), {key}).empty())
      return "; found \"" + it.key() + "\", a misspelling?";
  return {};
}

Status FieldReader::unknown_key_error() const {
  if (!obj_.is_object()) return {};
  for (auto it = obj_.begin(); it != obj_.end(); ++it) {
    if (std::find(known_.begin(), known_.end(), it.key()) != known_.end()) continue;
    std::vector<std::string> accepted = known_;
    std::sort(accepted.begin(), accepted.end());
    accepted.erase(std::unique(accepted.begin(), accepted.end()), accepted.end());
    std::string hint = did_you_mean(it.key(), accepted);
    return invalid_argument(path_of(it.key()) + ": unknown key; " + (hint.empty() ? "" : hint + " ") + "accepted keys" +
                            (path_.empty() ? "" : " in " + path_) + ": " + join(accepted));
  }
  return {};
}

}  // namespace megatrain::detail

// HardwareProfile: reading, validating and writing rig files ("megatrain.rig/1"), and the two
// lookups the simulator uses on them (Curve::at, NvmeSpec bandwidth). The schema is in docs/hardware-profile.md.
#include "megatrain/core/hardware_profile.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <initializer_list>
#include <set>
#include <sstream>
#include <utility>

#include "detail/json_reader.h"
#include "megatrain/core/durable_file.h"
#include "megatrain/core/profiles.h"

namespace megatrain {
namespace {

using detail::FieldReader;
using detail::Json;
using detail::Need;

// Interpolation shared by Curve::at and the NVMe tables: linear in log(x) because every axis here
// (GEMM FLOPs, transfer bytes, block bytes) spans several decades and the measured quantities
// change smoothly per decade, not per byte.
double interpolate_log_x(const std::vector<std::pair<double, double>>& pts, double x) {
  if (pts.empty()) return 0;
  if (!(x > pts.front().first)) return pts.front().second;  // also catches NaN and x <= 0
  if (x >= pts.back().first) return pts.back().second;
  auto hi = std::upper_bound(pts.begin(), pts.end(), x,
                             [](double v, const std::pair<double, double>& p) { return v < p.first; });
  auto lo = hi - 1;
  double t = (std::log(x) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
  return lo->second + t * (hi->second - lo->second);
}

double io_lookup(const std::vector<IoPoint>& table, int64_t block_bytes, int64_t queue_depth) {
  if (table.empty()) return 0;
  // A deeper queue than measured is assumed no faster than the deepest one measured below it:
  // extrapolating upwards would promise bandwidth the drive was never seen to deliver.
  int64_t chosen = -1;
  int64_t smallest = table.front().queue_depth;
  for (const auto& p : table) {
    smallest = std::min(smallest, p.queue_depth);
    if (p.queue_depth <= queue_depth) chosen = std::max(chosen, p.queue_depth);
  }
  if (chosen < 0) chosen = smallest;
  std::vector<std::pair<double, double>> pts;
  for (const auto& p : table)
    if (p.queue_depth == chosen) pts.emplace_back(static_cast<double>(p.block_bytes), p.bytes_per_s);
  std::sort(pts.begin(), pts.end());  // the table is validated sorted; a hand-built one may not be
  return interpolate_log_x(pts, static_cast<double>(block_bytes));
}

// ---- reading ------------------------------------------------------------------------------------

// What a number may be. Physical quantities are positive; an efficiency is a fraction of a peak.
struct Range {
  double lo;
  bool lo_open;
  double hi;
  bool hi_open;
  const char* text;  // "> 0", "in (0, 1]", ">= 0"
  bool contains(double v) const {
    return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
};
constexpr Range kPositive{0, true, DBL_MAX, false, "> 0"};
constexpr Range kNonNegative{0, false, DBL_MAX, false, ">= 0"};
constexpr Range kFraction{0, true, 1, false, "in (0, 1]"};

std::string show_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string indexed(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

// Reports unknown keys before any value is read, so that a misspelt required key is reported as
// "unknown key ... did you mean" rather than as a missing key, which would hide the typo.
Status check_keys(const Json& obj, const std::string& path, std::initializer_list<std::string_view> keys) {
  return FieldReader(obj, path, keys).finish();
}

// The reader's first error so far, without the unknown-key check that finish() adds: used part way
// through an object, where finish() would flag the keys not read yet.
Status first_error(FieldReader& r) { return r.ok() ? Status() : r.finish(); }

void read_number_in(FieldReader& r, const std::string& key, double& out, const Range& range) {
  double v = 0;
  r.number(key, v, Need::kRequired, -DBL_MAX, DBL_MAX);
  if (!r.ok()) return;
  if (!range.contains(v)) {
    r.fail(invalid_argument(r.path_of(key) + ": " + show_number(v) + " is out of range; accepted: " + range.text));
    return;
  }
  out = v;
}

bool looks_like_iso_date(const std::string& s) {
  // YYYY-MM-DD, optionally followed by a time; enough to catch "yesterday" or a swapped field.
  if (s.size() < 10) return false;
  for (int i : {0, 1, 2, 3, 5, 6, 8, 9})
    if (s[i] < '0' || s[i] > '9') return false;
  return s[4] == '-' && s[7] == '-';
}

Status read_provenance(const Json& j, const std::string& path, Provenance& out) {
  MT_RETURN_IF_ERROR(check_keys(j, path, {"kind", "source", "when", "machine"}));
  FieldReader r(j, path);
  std::string kind;
  r.choice("kind", kind, Need::kRequired, {"datasheet", "measured", "estimate"});
  r.string("source", out.source, Need::kRequired);
  r.string("when", out.when, Need::kOptional);
  r.string("machine", out.machine, Need::kOptional);
  MT_RETURN_IF_ERROR(r.finish());
  out.kind = kind == "measured" ? Provenance::Kind::kMeasured
           : kind == "estimate" ? Provenance::Kind::kEstimate
                                : Provenance::Kind::kDatasheet;
  if (out.source.find_first_not_of(" \t\n") == std::string::npos) {
    const char* what = out.kind == Provenance::Kind::kMeasured  ? "the probe that measured it"
                       : out.kind == Provenance::Kind::kEstimate ? "the basis of the estimate"
                                                                  : "the datasheet, paper or URL";
    return invalid_argument(r.path_of("source") + ": empty; expected " + what);
  }
  if (out.kind == Provenance::Kind::kMeasured) {
    if (out.when.empty())
      return invalid_argument(r.path_of("when") + ": missing; a measured figure needs the ISO-8601 date it was measured");
    if (out.machine.empty())
      return invalid_argument(r.path_of("machine") + ": missing; a measured figure needs the machine it was measured on");
  }
  if (!out.when.empty() && !looks_like_iso_date(out.when))
    return invalid_argument(r.path_of("when") + ": '" + out.when + "' is not an ISO-8601 date; expected YYYY-MM-DD[Thh:mm:ss]");
  return {};
}

// A member that holds a provenance object (read by hand because it recurses).
Status read_provenance_member(FieldReader& r, const std::string& key, Provenance& out) {
  const Json* p = r.object(key, Need::kRequired);
  if (!p) return first_error(r);
  return read_provenance(*p, r.path_of(key), out);
}

Status read_figure(FieldReader& parent, const std::string& key, Figure& out, const Range& range) {
  const Json* j = parent.object(key, Need::kRequired);
  if (!j) return first_error(parent);
  std::string path = parent.path_of(key);
  MT_RETURN_IF_ERROR(check_keys(*j, path, {"value", "provenance"}));
  FieldReader r(*j, path);
  read_number_in(r, "value", out.value, range);
  MT_RETURN_IF_ERROR(first_error(r));
  MT_RETURN_IF_ERROR(read_provenance_member(r, "provenance", out.provenance));
  return r.finish();
}

Status read_curve(FieldReader& parent, const std::string& key, Curve& out, const Range& y_range) {
  const Json* j = parent.object(key, Need::kRequired);
  if (!j) return first_error(parent);
  std::string path = parent.path_of(key);
  MT_RETURN_IF_ERROR(check_keys(*j, path, {"points", "provenance"}));
  FieldReader r(*j, path);
  const Json* pts = r.array("points", Need::kRequired);
  if (!pts) return first_error(r);
  std::string pts_path = r.path_of("points");
  if (pts->empty()) return invalid_argument(pts_path + ": empty; expected at least one [x, y] point");
  out.points.clear();
  for (size_t i = 0; i < pts->size(); ++i) {
    const Json& p = (*pts)[i];
    std::string ppath = indexed(pts_path, i);
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number())
      return invalid_argument(ppath + ": expected [x, y] (two numbers), got " + detail::json_type_name(p) + " " +
                              p.dump().substr(0, 60));
    double x = p[0].get<double>(), y = p[1].get<double>();
    if (!(x > 0)) return invalid_argument(ppath + ": x = " + show_number(x) + " is out of range; accepted: > 0");
    if (!y_range.contains(y))
      return invalid_argument(ppath + ": y = " + show_number(y) + " is out of range; accepted: " + y_range.text);
    if (!out.points.empty() && !(x > out.points.back().first))
      return invalid_argument(ppath + ": x = " + show_number(x) + " does not follow " +
                              show_number(out.points.back().first) + "; points must be sorted by x without repeats");
    out.points.emplace_back(x, y);
  }
  MT_RETURN_IF_ERROR(read_provenance_member(r, "provenance", out.provenance));
  return r.finish();
}

// gpu.gemm_shapes: three strictly increasing positive axes and, per op, tokens x in x out
// fractions of peak in (0, 1].
Status read_gemm_shapes(FieldReader& parent, const std::string& key, GemmShapes& out) {
  const Json* j = parent.object(key, Need::kRequired);
  if (!j) return first_error(parent);
  const std::string path = parent.path_of(key);
  MT_RETURN_IF_ERROR(check_keys(*j, path, {"tokens", "in", "out", "forward", "backward_data", "backward_weight", "provenance"}));
  FieldReader r(*j, path);
  auto axis = [&](const char* name, std::vector<double>& v) -> Status {
    const Json* a = r.array(name, Need::kRequired);
    if (!a) return first_error(r);
    const std::string ap = r.path_of(name);
    if (a->empty()) return invalid_argument(ap + ": empty; expected increasing sizes > 0");
    v.clear();
    for (size_t i = 0; i < a->size(); ++i) {
      const Json& x = (*a)[i];
      if (!x.is_number() || !(x.get<double>() > 0) || (!v.empty() && x.get<double>() <= v.back()))
        return invalid_argument(indexed(ap, i) + ": " + x.dump().substr(0, 40) + "; accepted: sizes > 0, strictly increasing");
      v.push_back(x.get<double>());
    }
    return {};
  };
  MT_RETURN_IF_ERROR(axis("tokens", out.tokens));
  MT_RETURN_IF_ERROR(axis("in", out.in));
  MT_RETURN_IF_ERROR(axis("out", out.out));
  const size_t cells = out.tokens.size() * out.in.size() * out.out.size();
  for (int op = 0; op < 3; ++op) {
    const char* name = GemmShapes::kOpNames[op];
    const Json* a = r.array(name, Need::kRequired);
    if (!a) return first_error(r);
    const std::string ap = r.path_of(name);
    if (a->size() != cells)
      return invalid_argument(ap + ": " + std::to_string(a->size()) + " values; expected tokens x in x out = " +
                              std::to_string(cells));
    auto& e = out.efficiency[op];
    e.clear();
    for (size_t i = 0; i < a->size(); ++i) {
      const Json& x = (*a)[i];
      if (!x.is_number() || !(x.get<double>() > 0) || x.get<double>() > 1)
        return invalid_argument(indexed(ap, i) + ": " + x.dump().substr(0, 40) + "; accepted: a fraction of peak in (0, 1]");
      e.push_back(x.get<double>());
    }
  }
  MT_RETURN_IF_ERROR(read_provenance_member(r, "provenance", out.provenance));
  return r.finish();
}

Status read_gpu(const Json& j, const std::string& path, GpuSpec& g) {
  MT_RETURN_IF_ERROR(check_keys(j, path, {"name", "memory_bytes", "memory_bandwidth", "matmul_fp32", "matmul_tf32",
                                          "matmul_bf16", "gemm_efficiency", "attention_efficiency",
                                          "attention_backward_ratio", "layer_times", "grouped_gemm_efficiency",
                                          "gemm_shapes"}));
  FieldReader r(j, path);
  r.string("name", g.name, Need::kRequired);
  MT_RETURN_IF_ERROR(first_error(r));
  if (g.name.empty()) return invalid_argument(r.path_of("name") + ": empty; expected the GPU model (\"NVIDIA H200\")");
  MT_RETURN_IF_ERROR(read_figure(r, "memory_bytes", g.memory_bytes, kPositive));
  MT_RETURN_IF_ERROR(read_figure(r, "memory_bandwidth", g.memory_bandwidth, kPositive));
  MT_RETURN_IF_ERROR(read_figure(r, "matmul_fp32", g.matmul_fp32, kPositive));
  MT_RETURN_IF_ERROR(read_figure(r, "matmul_tf32", g.matmul_tf32, kPositive));
  MT_RETURN_IF_ERROR(read_figure(r, "matmul_bf16", g.matmul_bf16, kPositive));
  MT_RETURN_IF_ERROR(read_curve(r, "gemm_efficiency", g.gemm_efficiency, kFraction));
  if (j.contains("attention_efficiency")) {
    Curve c;
    MT_RETURN_IF_ERROR(read_curve(r, "attention_efficiency", c, kFraction));
    g.attention_efficiency = std::move(c);
  }
  if (j.contains("layer_times")) {
    const Json* lt = r.object("layer_times", Need::kRequired);
    if (!lt) return first_error(r);
    const std::string lt_path = r.path_of("layer_times");
    MT_RETURN_IF_ERROR(check_keys(*lt, lt_path, {"model", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "seq",
                                              "points", "provenance", "experts", "experts_per_token",
                                              "moe_intermediate", "window", "vocab"}));
    FieldReader lr(*lt, lt_path);
    LayerTimes t;
    lr.string("model", t.model, Need::kRequired);
    lr.integer("hidden", t.hidden, Need::kRequired, 1, int64_t{1} << 24);
    lr.integer("intermediate", t.intermediate, Need::kRequired, 1, int64_t{1} << 26);
    lr.integer("heads", t.heads, Need::kRequired, 1, 1 << 16);
    lr.integer("kv_heads", t.kv_heads, Need::kRequired, 1, 1 << 16);
    lr.integer("head_dim", t.head_dim, Need::kRequired, 1, 1 << 16);
    lr.integer("seq", t.seq, Need::kRequired, 1, int64_t{1} << 24);
    lr.integer("experts", t.experts, Need::kOptional, 0, 1 << 20);
    lr.integer("experts_per_token", t.experts_per_token, Need::kOptional, 0, 1 << 20);
    lr.integer("moe_intermediate", t.moe_intermediate, Need::kOptional, 0, int64_t{1} << 26);
    lr.integer("window", t.window, Need::kOptional, 0, int64_t{1} << 24);
    lr.integer("vocab", t.vocab, Need::kOptional, 0, int64_t{1} << 30);
    MT_RETURN_IF_ERROR(first_error(lr));
    if ((t.experts > 0) != (t.experts_per_token > 0) || (t.experts > 0) != (t.moe_intermediate > 0) ||
        t.experts_per_token > t.experts)
      return invalid_argument(lt_path + ": experts " + std::to_string(t.experts) + ", experts_per_token " +
                              std::to_string(t.experts_per_token) + ", moe_intermediate " + std::to_string(t.moe_intermediate) +
                              " do not describe one layer; accepted: all three 0 (a dense layer), or all > 0 with "
                              "experts_per_token <= experts (an MoE layer)");
    const Json* pts = lr.array("points", Need::kRequired);
    MT_RETURN_IF_ERROR(first_error(lr));
    const std::string pts_path = lr.path_of("points");
    if (pts->empty()) return invalid_argument(pts_path + ": empty; expected [micro_batch, forward_s, backward_s] points");
    for (size_t i = 0; i < pts->size(); ++i) {
      const Json& q = (*pts)[i];
      const std::string qp = indexed(pts_path, i);
      const bool with_head = t.vocab > 0;
      if (!q.is_array() || q.size() != (with_head ? 4u : 3u) || !q[0].is_number_integer() || !q[1].is_number() ||
          !q[2].is_number() || (with_head && !q[3].is_number()))
        return invalid_argument(qp + (with_head ? ": expected [micro_batch (integer), forward_s, backward_s, head_s] (vocab is set), got "
                                                : ": expected [micro_batch (integer), forward_s, backward_s], got ") +
                                q.dump().substr(0, 60));
      LayerTimes::Point pt{q[0].get<int64_t>(), q[1].get<double>(), q[2].get<double>(), with_head ? q[3].get<double>() : 0.0};
      if (pt.micro_batch < 1 || !(pt.forward_s > 0) || !(pt.backward_s > 0) || (with_head && !(pt.head_s > 0)))
        return invalid_argument(qp + ": out of range; accepted: micro_batch >= 1, forward_s > 0, backward_s > 0 (and head_s > 0)");
      if (!t.points.empty() && pt.micro_batch <= t.points.back().micro_batch)
        return invalid_argument(qp + ": micro_batch " + std::to_string(pt.micro_batch) +
                                " does not follow " + std::to_string(t.points.back().micro_batch) +
                                "; points must be sorted by micro_batch without repeats");
      t.points.push_back(pt);
    }
    MT_RETURN_IF_ERROR(read_provenance_member(lr, "provenance", t.provenance));
    MT_RETURN_IF_ERROR(lr.finish());
    g.layer_times = std::move(t);
  }
  if (j.contains("gemm_shapes")) {
    GemmShapes t;
    MT_RETURN_IF_ERROR(read_gemm_shapes(r, "gemm_shapes", t));
    g.gemm_shapes = std::move(t);
  }
  if (j.contains("grouped_gemm_efficiency")) {
    Curve c;
    MT_RETURN_IF_ERROR(read_curve(r, "grouped_gemm_efficiency", c, kFraction));
    g.grouped_gemm_efficiency = std::move(c);
  }
  if (j.contains("attention_backward_ratio")) {
    Figure f;
    MT_RETURN_IF_ERROR(read_figure(r, "attention_backward_ratio", f, kPositive));
    g.attention_backward_ratio = std::move(f);
  }
  return r.finish();
}

Status read_link(FieldReader& parent, const std::string& key, LinkSpec& l) {
  const Json* j = parent.object(key, Need::kRequired);
  if (!j) return first_error(parent);
  std::string path = parent.path_of(key);
  MT_RETURN_IF_ERROR(check_keys(*j, path, {"latency_s", "pinned_bandwidth", "pageable_bandwidth"}));
  FieldReader r(*j, path);
  MT_RETURN_IF_ERROR(read_figure(r, "latency_s", l.latency_s, kNonNegative));
  MT_RETURN_IF_ERROR(read_curve(r, "pinned_bandwidth", l.pinned_bandwidth, kPositive));
  MT_RETURN_IF_ERROR(read_curve(r, "pageable_bandwidth", l.pageable_bandwidth, kPositive));
  return r.finish();
}

Status read_links(const Json& j, const std::string& path, LinksSpec& l) {
  MT_RETURN_IF_ERROR(check_keys(j, path, {"kind", "full_duplex", "h2d", "d2h"}));
  FieldReader r(j, path);
  r.string("kind", l.kind, Need::kRequired);
  r.boolean("full_duplex", l.full_duplex, Need::kOptional);
  MT_RETURN_IF_ERROR(first_error(r));
  if (l.kind.empty())
    return invalid_argument(r.path_of("kind") + ": empty; expected pcie-gen4-x16, pcie-gen5-x16, nvlink-c2c or a description");
  MT_RETURN_IF_ERROR(read_link(r, "h2d", l.h2d));
  MT_RETURN_IF_ERROR(read_link(r, "d2h", l.d2h));
  return r.finish();
}

const std::vector<std::string>& state_formats() {
  static const std::vector<std::string> k{"fp32", "bf16", "q8", "q4", "q3", "q2"};
  return k;
}

Status read_host(const Json& j, const std::string& path, HostSpec& h) {
  MT_RETURN_IF_ERROR(check_keys(j, path, {"cpu", "cores", "ram_bytes", "memory_bandwidth", "pinnable_bytes", "adam"}));
  FieldReader r(j, path);
  r.string("cpu", h.cpu, Need::kRequired);
  r.integer("cores", h.cores, Need::kRequired, 1, 1 << 20);
  MT_RETURN_IF_ERROR(first_error(r));
  if (h.cpu.empty()) return invalid_argument(r.path_of("cpu") + ": empty; expected the CPU model (\"2x Intel Xeon Platinum 8480C\")");
  MT_RETURN_IF_ERROR(read_figure(r, "ram_bytes", h.ram_bytes, kPositive));
  MT_RETURN_IF_ERROR(read_figure(r, "memory_bandwidth", h.memory_bandwidth, kPositive));
  MT_RETURN_IF_ERROR(read_figure(r, "pinnable_bytes", h.pinnable_bytes, kPositive));
  if (h.pinnable_bytes.value > h.ram_bytes.value)
    return invalid_argument(r.path_of("pinnable_bytes") + ".value: " + show_number(h.pinnable_bytes.value) +
                            " exceeds " + r.path_of("ram_bytes") + ".value (" + show_number(h.ram_bytes.value) +
                            "); no more RAM can be page-locked than there is");
  const Json* adam = r.array("adam", Need::kRequired);
  if (!adam) return first_error(r);
  std::string apath = r.path_of("adam");
  if (adam->empty())
    return invalid_argument(apath + ": empty; expected at least one {state_format, threads, params_per_s} entry");
  h.adam.clear();
  std::set<std::pair<std::string, int64_t>> seen;
  for (size_t i = 0; i < adam->size(); ++i) {
    std::string epath = indexed(apath, i);
    const Json& e = (*adam)[i];
    MT_RETURN_IF_ERROR(check_keys(e, epath, {"state_format", "threads", "params_per_s"}));
    FieldReader er(e, epath);
    AdamThroughput a;
    er.choice("state_format", a.state_format, Need::kRequired, state_formats());
    er.integer("threads", a.threads, Need::kRequired, 1, INT64_MAX);
    MT_RETURN_IF_ERROR(first_error(er));
    // Twice the cores allows SMT siblings; beyond that the figure cannot describe this host.
    if (a.threads > h.cores * 2)
      return invalid_argument(er.path_of("threads") + ": " + std::to_string(a.threads) + " is out of range; accepted: 1 .. " +
                              std::to_string(h.cores * 2) + " (twice " + r.path_of("cores") + ")");
    if (!seen.insert({a.state_format, a.threads}).second)
      return invalid_argument(epath + ": a second entry for state_format " + a.state_format + " with " +
                              std::to_string(a.threads) + " threads; each pair may appear once");
    MT_RETURN_IF_ERROR(read_figure(er, "params_per_s", a.params_per_s, kPositive));
    MT_RETURN_IF_ERROR(er.finish());
    h.adam.push_back(std::move(a));
  }
  return r.finish();
}

Status read_io_table(FieldReader& parent, const std::string& key, std::vector<IoPoint>& out) {
  const Json* arr = parent.array(key, Need::kRequired);
  if (!arr) return first_error(parent);
  std::string path = parent.path_of(key);
  if (arr->empty()) return invalid_argument(path + ": empty; expected at least one {block_bytes, queue_depth, bytes_per_s}");
  out.clear();
  for (size_t i = 0; i < arr->size(); ++i) {
    std::string ppath = indexed(path, i);
    MT_RETURN_IF_ERROR(check_keys((*arr)[i], ppath, {"block_bytes", "queue_depth", "bytes_per_s"}));
    FieldReader r((*arr)[i], ppath);
    IoPoint p;
    r.integer("block_bytes", p.block_bytes, Need::kRequired, 1, int64_t{1} << 40);
    r.integer("queue_depth", p.queue_depth, Need::kRequired, 1, 65536);  // NVMe's largest queue
    read_number_in(r, "bytes_per_s", p.bytes_per_s, kPositive);
    MT_RETURN_IF_ERROR(r.finish());
    if (!out.empty() && !(std::pair(out.back().block_bytes, out.back().queue_depth) < std::pair(p.block_bytes, p.queue_depth)))
      return invalid_argument(ppath + ": (block_bytes " + std::to_string(p.block_bytes) + ", queue_depth " +
                              std::to_string(p.queue_depth) + ") does not follow (" + std::to_string(out.back().block_bytes) +
                              ", " + std::to_string(out.back().queue_depth) +
                              "); points must be sorted by (block_bytes, queue_depth) without repeats");
    out.push_back(p);
  }
  return {};
}

Status read_nvme(const Json& j, const std::string& path, NvmeSpec& n) {
  MT_RETURN_IF_ERROR(check_keys(j, path, {"name", "path", "capacity_bytes", "read", "write", "io_provenance"}));
  FieldReader r(j, path);
  r.string("name", n.name, Need::kRequired);
  r.string("path", n.path, Need::kRequired);
  MT_RETURN_IF_ERROR(first_error(r));
  if (n.name.empty()) return invalid_argument(r.path_of("name") + ": empty; expected the drive (\"Samsung PM1743 7.68 TB\")");
  if (n.path.empty()) return invalid_argument(r.path_of("path") + ": empty; expected the mount point for state files (\"/mnt/nvme0\")");
  MT_RETURN_IF_ERROR(read_figure(r, "capacity_bytes", n.capacity_bytes, kPositive));
  MT_RETURN_IF_ERROR(read_io_table(r, "read", n.read));
  MT_RETURN_IF_ERROR(read_io_table(r, "write", n.write));
  MT_RETURN_IF_ERROR(read_provenance_member(r, "io_provenance", n.io_provenance));
  return r.finish();
}

Status read_storage(const Json& arr, const std::string& path, std::vector<NvmeSpec>& out) {
  out.clear();
  for (size_t i = 0; i < arr.size(); ++i) {
    NvmeSpec n;
    MT_RETURN_IF_ERROR(read_nvme(arr[i], indexed(path, i), n));
    // Names identify drives in traces and plans; paths decide where state files go, so a repeat of
    // either would make two entries describe one drive and double its bandwidth.
    for (size_t k = 0; k < out.size(); ++k) {
      if (out[k].name == n.name)
        return invalid_argument(indexed(path, i) + ".name: '" + n.name + "' is already used by " + indexed(path, k) +
                                "; drive names must be unique (add the mount point or a number)");
      if (out[k].path == n.path)
        return invalid_argument(indexed(path, i) + ".path: '" + n.path + "' is already used by " + indexed(path, k) +
                                "; each drive needs its own mount point");
    }
    out.push_back(std::move(n));
  }
  return {};
}

Status read_cluster(const Json& j, const std::string& path, ClusterSpec& c) {
  MT_RETURN_IF_ERROR(check_keys(j, path, {"gpus_per_node", "nodes", "gpus_per_switch", "switch_uplink_bandwidth",
                                          "inter_node_bandwidth", "inter_node_latency_s", "gpu_peer_bandwidth"}));
  FieldReader r(j, path);
  r.integer("gpus_per_node", c.gpus_per_node, Need::kRequired, 1, 4096);
  r.integer("nodes", c.nodes, Need::kRequired, 1, 65536);
  r.integer("gpus_per_switch", c.gpus_per_switch, Need::kOptional, 1, 4096);
  MT_RETURN_IF_ERROR(first_error(r));
  if (c.gpus_per_switch > c.gpus_per_node)
    return invalid_argument(r.path_of("gpus_per_switch") + ": " + std::to_string(c.gpus_per_switch) + " is more than gpus_per_node (" +
                            std::to_string(c.gpus_per_node) + "); accepted: 1 .. gpus_per_node");
  auto optional_figure = [&](const char* key, std::optional<Figure>& out, bool needed, const char* why) -> Status {
    if (!j.contains(key)) {
      if (needed) return invalid_argument(r.path_of(key) + ": missing; " + why);
      return {};
    }
    out.emplace();
    return read_figure(r, key, *out, std::string(key) == "inter_node_latency_s" ? kNonNegative : kPositive);
  };
  MT_RETURN_IF_ERROR(optional_figure("switch_uplink_bandwidth", c.switch_uplink_bandwidth, c.gpus_per_switch > 1,
                                     "GPUs that share a PCIe switch share its uplink to the host (bytes/s per direction)"));
  MT_RETURN_IF_ERROR(optional_figure("inter_node_bandwidth", c.inter_node_bandwidth, c.nodes > 1,
                                     "a cluster of several nodes needs its network's bandwidth (bytes/s per node per direction)"));
  MT_RETURN_IF_ERROR(optional_figure("inter_node_latency_s", c.inter_node_latency_s, c.nodes > 1,
                                     "a cluster of several nodes needs its network's latency (seconds per message)"));
  MT_RETURN_IF_ERROR(optional_figure("gpu_peer_bandwidth", c.gpu_peer_bandwidth, false, ""));
  return r.finish();
}

Result<HardwareProfile> from_json(const Json& root) {
  if (!root.is_object())
    return invalid_argument("the document: expected a rig object {\"schema\": \"" + std::string(kRigSchema) +
                            "\", ...}, got " + detail::json_type_name(root));
  // The schema first: a plan or model file given as a rig should say so, not list unknown keys.
  FieldReader r(root, "");
  r.accept({"schema", "name", "description", "gpu", "links", "host", "storage", "cluster"});
  std::string schema;
  r.string("schema", schema, Need::kRequired);
  MT_RETURN_IF_ERROR(first_error(r));
  if (schema != kRigSchema) {
    std::string msg = "schema: '" + schema + "' is not accepted; expected '" + kRigSchema + "'";
    if (schema.rfind("megatrain.rig/", 0) == 0) return unsupported(msg + " (a rig file from another MegaTrain version)");
    return invalid_argument(msg + " (is this a rig profile?)");
  }
  MT_RETURN_IF_ERROR(r.finish());  // unknown top-level keys, before a misspelt one reads as missing
  HardwareProfile hw;
  r.string("name", hw.name, Need::kRequired);
  r.string("description", hw.description, Need::kOptional);
  const Json* gpu = r.object("gpu", Need::kRequired);
  const Json* links = r.object("links", Need::kRequired);
  const Json* host = r.object("host", Need::kRequired);
  const Json* storage = r.array("storage", Need::kOptional);
  const Json* cluster = r.object("cluster", Need::kOptional);
  MT_RETURN_IF_ERROR(r.finish());
  if (hw.name.empty()) return invalid_argument("name: empty; expected the rig's name (\"h200-1.5tb\")");
  MT_RETURN_IF_ERROR(read_gpu(*gpu, "gpu", hw.gpu));
  MT_RETURN_IF_ERROR(read_links(*links, "links", hw.links));
  MT_RETURN_IF_ERROR(read_host(*host, "host", hw.host));
  if (storage) MT_RETURN_IF_ERROR(read_storage(*storage, "storage", hw.storage));
  if (cluster) {
    hw.cluster.emplace();
    MT_RETURN_IF_ERROR(read_cluster(*cluster, "cluster", *hw.cluster));
  }
  return hw;
}

// ---- writing ------------------------------------------------------------------------------------

Json provenance_json(const Provenance& p) {
  Json j;
  j["kind"] = provenance_kind_name(p.kind);
  j["source"] = p.source;
  // Written whenever set (not only for measured figures) so that writing then reading is lossless.
  if (!p.when.empty()) j["when"] = p.when;
  if (!p.machine.empty()) j["machine"] = p.machine;
  return j;
}

Json figure_json(const Figure& f) {
  Json j;
  j["value"] = f.value;
  j["provenance"] = provenance_json(f.provenance);
  return j;
}

Json curve_json(const Curve& c) {
  Json pts = Json::array();
  for (const auto& [x, y] : c.points) pts.push_back(Json::array({x, y}));
  Json j;
  j["points"] = std::move(pts);
  j["provenance"] = provenance_json(c.provenance);
  return j;
}

Json link_json(const LinkSpec& l) {
  Json j;
  j["latency_s"] = figure_json(l.latency_s);
  j["pinned_bandwidth"] = curve_json(l.pinned_bandwidth);
  j["pageable_bandwidth"] = curve_json(l.pageable_bandwidth);
  return j;
}

Json io_table_json(const std::vector<IoPoint>& t) {
  Json a = Json::array();
  for (const auto& p : t) {
    Json e;
    e["block_bytes"] = p.block_bytes;
    e["queue_depth"] = p.queue_depth;
    e["bytes_per_s"] = p.bytes_per_s;
    a.push_back(std::move(e));
  }
  return a;
}

Json to_json(const HardwareProfile& hw) {
  Json root;
  root["schema"] = kRigSchema;
  root["name"] = hw.name;
  root["description"] = hw.description;

  Json gpu;
  gpu["name"] = hw.gpu.name;
  gpu["memory_bytes"] = figure_json(hw.gpu.memory_bytes);
  gpu["memory_bandwidth"] = figure_json(hw.gpu.memory_bandwidth);
  gpu["matmul_fp32"] = figure_json(hw.gpu.matmul_fp32);
  gpu["matmul_tf32"] = figure_json(hw.gpu.matmul_tf32);
  gpu["matmul_bf16"] = figure_json(hw.gpu.matmul_bf16);
  gpu["gemm_efficiency"] = curve_json(hw.gpu.gemm_efficiency);
  if (hw.gpu.attention_efficiency) gpu["attention_efficiency"] = curve_json(*hw.gpu.attention_efficiency);
  if (hw.gpu.attention_backward_ratio) gpu["attention_backward_ratio"] = figure_json(*hw.gpu.attention_backward_ratio);
  if (hw.gpu.layer_times) {
    const LayerTimes& t = *hw.gpu.layer_times;
    Json lt = Json::object();
    lt["model"] = t.model;
    lt["hidden"] = t.hidden;
    lt["intermediate"] = t.intermediate;
    lt["heads"] = t.heads;
    lt["kv_heads"] = t.kv_heads;
    lt["head_dim"] = t.head_dim;
    lt["seq"] = t.seq;
    Json pts = Json::array();
    for (const auto& p : t.points)
      pts.push_back(t.vocab > 0 ? Json::array({p.micro_batch, p.forward_s, p.backward_s, p.head_s})
                                : Json::array({p.micro_batch, p.forward_s, p.backward_s}));
    lt["points"] = std::move(pts);
    lt["provenance"] = provenance_json(t.provenance);
    // Written only when set, so that a dense probe's entry reads as it did before these keys.
    if (t.experts > 0) {
      lt["experts"] = t.experts;
      lt["experts_per_token"] = t.experts_per_token;
      lt["moe_intermediate"] = t.moe_intermediate;
    }
    if (t.window > 0) lt["window"] = t.window;
    if (t.vocab > 0) lt["vocab"] = t.vocab;
    gpu["layer_times"] = std::move(lt);
  }
  if (hw.gpu.grouped_gemm_efficiency) gpu["grouped_gemm_efficiency"] = curve_json(*hw.gpu.grouped_gemm_efficiency);
  if (hw.gpu.gemm_shapes) {
    const GemmShapes& t = *hw.gpu.gemm_shapes;
    Json gs = Json::object();
    gs["tokens"] = t.tokens;
    gs["in"] = t.in;
    gs["out"] = t.out;
    for (int op = 0; op < 3; ++op) gs[GemmShapes::kOpNames[op]] = t.efficiency[op];
    gs["provenance"] = provenance_json(t.provenance);
    gpu["gemm_shapes"] = std::move(gs);
  }
  root["gpu"] = std::move(gpu);

  Json links;
  links["kind"] = hw.links.kind;
  links["full_duplex"] = hw.links.full_duplex;
  links["h2d"] = link_json(hw.links.h2d);
  links["d2h"] = link_json(hw.links.d2h);
  root["links"] = std::move(links);

  Json host;
  host["cpu"] = hw.host.cpu;
  host["cores"] = hw.host.cores;
  host["ram_bytes"] = figure_json(hw.host.ram_bytes);
  host["memory_bandwidth"] = figure_json(hw.host.memory_bandwidth);
  host["pinnable_bytes"] = figure_json(hw.host.pinnable_bytes);
  Json adam = Json::array();
  for (const auto& a : hw.host.adam) {
    Json e;
    e["state_format"] = a.state_format;
    e["threads"] = a.threads;
    e["params_per_s"] = figure_json(a.params_per_s);
    adam.push_back(std::move(e));
  }
  host["adam"] = std::move(adam);
  root["host"] = std::move(host);

  Json storage = Json::array();
  for (const auto& n : hw.storage) {
    Json d;
    d["name"] = n.name;
    d["path"] = n.path;
    d["capacity_bytes"] = figure_json(n.capacity_bytes);
    d["read"] = io_table_json(n.read);
    d["write"] = io_table_json(n.write);
    d["io_provenance"] = provenance_json(n.io_provenance);
    storage.push_back(std::move(d));
  }
  root["storage"] = std::move(storage);
  if (hw.cluster) {
    const ClusterSpec& c = *hw.cluster;
    Json cl;
    cl["gpus_per_node"] = c.gpus_per_node;
    cl["nodes"] = c.nodes;
    cl["gpus_per_switch"] = c.gpus_per_switch;
    if (c.switch_uplink_bandwidth) cl["switch_uplink_bandwidth"] = figure_json(*c.switch_uplink_bandwidth);
    if (c.inter_node_bandwidth) cl["inter_node_bandwidth"] = figure_json(*c.inter_node_bandwidth);
    if (c.inter_node_latency_s) cl["inter_node_latency_s"] = figure_json(*c.inter_node_latency_s);
    if (c.gpu_peer_bandwidth) cl["gpu_peer_bandwidth"] = figure_json(*c.gpu_peer_bandwidth);
    root["cluster"] = std::move(cl);
  }
  return root;
}

}  // namespace

const char* provenance_kind_name(Provenance::Kind k) {
  switch (k) {
    case Provenance::Kind::kDatasheet: return "datasheet";
    case Provenance::Kind::kMeasured: return "measured";
    case Provenance::Kind::kEstimate: return "estimate";
  }
  return "unknown";
}

double Curve::at(double x) const { return interpolate_log_x(points, x); }

namespace {
// Where x falls on a log axis: the cell below it and the weight of the one above (clamped).
std::pair<size_t, double> log_bracket(const std::vector<double>& axis, double x) {
  if (axis.size() < 2 || !(x > axis.front())) return {0, 0.0};
  if (x >= axis.back()) return {axis.size() - 2, 1.0};
  size_t i = 0;
  while (x >= axis[i + 1]) ++i;
  return {i, (std::log(x) - std::log(axis[i])) / (std::log(axis[i + 1]) - std::log(axis[i]))};
}
}  // namespace

double GemmShapes::at(Op op, double t, double i, double o) const {
  const auto& e = efficiency[op];
  const auto [a, wa] = log_bracket(tokens, t);
  const auto [b, wb] = log_bracket(in, i);
  const auto [c, wc] = log_bracket(out, o);
  const size_t ni = in.size(), no = out.size();
  double v = 0;
  for (int da = 0; da < 2; ++da)
    for (int db = 0; db < 2; ++db)
      for (int dc = 0; dc < 2; ++dc) {
        const double w = (da ? wa : 1 - wa) * (db ? wb : 1 - wb) * (dc ? wc : 1 - wc);
        if (w == 0) continue;
        const size_t x = std::min(a + da, tokens.size() - 1), y = std::min(b + db, ni - 1), z = std::min(c + dc, no - 1);
        v += w * e[(x * ni + y) * no + z];
      }
  return v;
}

double NvmeSpec::read_bandwidth(int64_t block_bytes, int64_t queue_depth) const {
  return io_lookup(read, block_bytes, queue_depth);
}

double NvmeSpec::write_bandwidth(int64_t block_bytes, int64_t queue_depth) const {
  return io_lookup(write, block_bytes, queue_depth);
}

Result<HardwareProfile> HardwareProfile::from_json_text(const std::string& text, const std::string& what) {
  MT_ASSIGN_OR_RETURN(Json root, detail::parse_json(text, what));
  auto hw = from_json(root);
  if (!hw.ok()) return hw.status().with_context(what);
  return hw;
}

Result<HardwareProfile> HardwareProfile::load(const std::string& name_or_path) {
  MT_ASSIGN_OR_RETURN(std::filesystem::path path, resolve_profile("hardware", name_or_path));
  std::string what = "rig '" + path.string() + "'";
  MT_ASSIGN_OR_RETURN(Json root, detail::read_json_file(path, "rig"));
  auto hw = from_json(root);
  if (!hw.ok()) return hw.status().with_context(what);
  return hw;
}

std::string HardwareProfile::to_json_text() const {
  // nlohmann prints each double in its shortest form that reads back to the same bits, which is
  // what makes from_json_text(to_json_text()) exact. Invalid UTF-8 (say, a host name set by a
  // probe) is replaced rather than thrown on: writing a profile must not abort.
  return to_json(*this).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Status HardwareProfile::save(const std::filesystem::path& path) const {
  std::string text = to_json_text();
  // Refuse to write what could not be read back: a rig file that fails to load later is worse than
  // an error now, while the caller still knows which figure it set.
  auto check = from_json_text(text, "rig to be saved as '" + path.string() + "'");
  if (!check.ok()) return check.status();
  return write_file_atomic(path, text);
}

}  // namespace megatrain

// megatrain._megatrain: the extension module under the Python package (docs/python.md). It exposes
// the same library calls the command-line programs make, and nothing else: the planner's search,
// inspect, simulate and size with their --json texts, the model reader, the prepared-data and
// safetensors writers and readers, and run_training, the run megatrain-exec makes. The pure-Python
// package (python/megatrain) builds the Hugging Face-shaped API on these.
//
// Errors: a Status becomes _megatrain.StatusError(code, message, phase); the package turns it into
// FileNotFoundError, ValueError, OSError, mt.PlanError or mt.CheckpointError. No C++ exception
// leaves a binding: pybind11 translates std::exception to RuntimeError at worst.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <Python.h>
#include <algorithm>
#include <climits>
#include <csignal>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <streambuf>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/status.h"
#include "megatrain/data/dataset.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/data/tokenizer.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/forward.h"
#include "megatrain/executor/run.h"
#include "megatrain/executor/safetensors.h"
#include "megatrain/executor/trainer.h"
#include "megatrain/executor/weights_io.h"
#include "megatrain/planner/inspect.h"
#include "megatrain/planner/profile.h"
#include "megatrain/planner/search.h"
#include "megatrain/planner/size.h"
#include "megatrain/simulator/step_model.h"

namespace py = pybind11;
using namespace megatrain;

namespace {

const char* phase_name(exec::RunPhase p) {
  switch (p) {
    case exec::RunPhase::kChecking: return "checking";
    case exec::RunPhase::kPlan: return "plan";
    case exec::RunPhase::kData: return "data";
    case exec::RunPhase::kState: return "state";
    case exec::RunPhase::kResume: return "resume";
    case exec::RunPhase::kTraining: return "training";
  }
  return "?";
}

// A Status code as the package names it (python/megatrain/errors.py).
const char* code_key(StatusCode c) {
  switch (c) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kParseError: return "parse_error";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kIoError: return "io_error";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kResourceExhausted: return "resource_exhausted";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

// The module's StatusError class (created in PYBIND11_MODULE).
py::object& status_error_type() {
  static py::object* type = new py::object();  // never destroyed: outlives the interpreter's teardown
  return *type;
}

// A message as Python text: bytes that are not UTF-8 (a dataset line's, a file name's) appear as
// \xNN escapes instead of failing the conversion with a UnicodeDecodeError that names nothing.
py::str text_of(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// Raises StatusError(code, message, phase) for a failed Status; the message is the command line's.
[[noreturn]] void raise_status(const Status& s, const char* phase = "") {
  py::object err = status_error_type()(code_key(s.code()), text_of(s.to_string()), phase);
  PyErr_SetObject(status_error_type().ptr(), err.ptr());
  throw py::error_already_set();
}

template <typename T>
T value_or_raise(Result<T> r) {
  if (!r.ok()) raise_status(r.status());
  return std::move(*r);
}

// ---- planner ------------------------------------------------------------------------------------

std::string inspect_json(const std::string& model, int64_t seq, bool tensors) {
  ModelSpec spec = value_or_raise(ModelSpec::load(model));
  planner::InspectOptions o;
  o.seq_len = seq;
  o.list_tensors = tensors;
  return planner::inspect_json(spec, o);
}

// The planner's search, as `megatrain-plan plan --json` runs it: (feasible, the --json text, the
// per-tier reason when nothing fits).
py::tuple plan_search(const std::string& model, const std::string& rig, int64_t seq_len, int64_t tokens_per_step, int64_t micro_batch,
                      int64_t steps, const std::string& state_formats, const std::string& compute, double document_tokens) {
  std::string json, reason;
  bool feasible = false;
  {
    ModelSpec spec = value_or_raise(ModelSpec::load(model));
    HardwareProfile hw = value_or_raise(HardwareProfile::load(rig));
    planner::SearchRequest req;
    req.seq_len = seq_len;
    req.tokens_per_step = tokens_per_step;
    req.micro_batch = micro_batch;
    req.steps = steps;
    req.document_tokens = document_tokens;
    req.model_ref = planner::profile_ref(model);
    req.rig_ref = planner::profile_ref(rig);
    req.policy.state_formats = value_or_raise(planner::parse_state_format_list(state_formats));
    if (compute == "bf16") req.policy.compute = DType::kBf16;
    else if (compute == "fp32") req.policy.compute = DType::kFp32;
    else if (compute != "auto") raise_status(invalid_argument("compute '" + compute + "' is not accepted; accepted: auto, bf16, fp32"));
    Result<planner::SearchResult> res = [&] {
      py::gil_scoped_release release;
      return planner::search_plan(spec, hw, req, {});
    }();
    if (!res.ok()) raise_status(res.status());
    feasible = res->feasible;
    json = planner::search_json(*res);
    reason = res->infeasible_reason;
  }
  return py::make_tuple(feasible, json, reason);
}

py::tuple simulate_json(const std::string& plan_path) {
  Plan plan = value_or_raise(Plan::load(plan_path));
  Result<sim::SimResult> r = [&] {
    py::gil_scoped_release release;
    return sim::simulate(plan, {});
  }();
  if (!r.ok()) raise_status(r.status());
  return py::make_tuple(r->feasible, sim::result_json(*r), r->reason);
}

std::string size_json(const std::string& model, const std::string& gpu, double target, int64_t seq_len, int64_t tokens_per_step,
                      const std::string& state_formats) {
  ModelSpec spec = value_or_raise(ModelSpec::load(model));
  planner::SizeOptions o;
  o.target_tokens_per_s = target;
  o.seq_len = seq_len;
  o.tokens_per_step = tokens_per_step;
  o.policy.state_formats = value_or_raise(planner::parse_state_format_list(state_formats));
  Result<planner::SizeResult> r = [&] {
    py::gil_scoped_release release;
    return planner::size_rigs(spec, gpu, o);
  }();
  if (!r.ok()) raise_status(r.status());
  return planner::size_json(*r);
}

// A quick profile of this machine (megatrain-plan profile's quick sizes, the CPU backend), written to
// `path` as a rig file.
// With a model (and its sequence length): its GEMM shapes, layer and head probed too, so that its
// plans are predicted from its own measured shapes (megatrain-plan profile --model --seq).
void profile_rig(const std::string& path, const std::vector<std::string>& storage_dirs, const std::string& model, int64_t seq) {
  planner::ProfileOptions o;
  o.storage_dirs = storage_dirs;
  o.use_gpu = true;
  if (!model.empty()) {
    ModelSpec spec = value_or_raise(ModelSpec::load(model));
    o.model = spec.config();
    o.model_spec = std::make_shared<const ModelSpec>(std::move(spec));
    o.seq = seq;
  }
  Result<planner::ProfileReport> r = [&] {
    py::gil_scoped_release release;
    return planner::run_profile(o);
  }();
  if (!r.ok()) raise_status(r.status());
  if (Status s = r->rig.save(path); !s.ok()) raise_status(s);
}

// ---- models and files -----------------------------------------------------------------------------

py::dict model_info(const std::string& model) {
  ModelSpec spec = value_or_raise(ModelSpec::load(model));
  py::dict d;
  d["name"] = spec.name();
  d["parameters"] = spec.parameter_counts().total;
  d["config_json"] = exec::hf_checkpoint_config(spec);
  d["vocab_size"] = spec.config().vocab_size;
  d["max_position_embeddings"] = spec.config().max_position_embeddings;
  return d;
}

// A prepared dataset from rows the Python side made (tokens and mask: rows x (seq_len + 1)).
// Returns its document_tokens (SequenceHeader).
double write_sequences(const std::string& path, py::array_t<uint32_t, py::array::c_style> tokens, py::array_t<uint8_t, py::array::c_style> mask,
                     int64_t vocab_size, int32_t eos_id, int32_t pad_id, int64_t documents, int64_t truncated, int64_t real_tokens,
                     const std::string& train_on, const std::string& source, const std::string& packing) {
  if (tokens.ndim() != 2 || mask.ndim() != 2 || tokens.shape(0) != mask.shape(0) || tokens.shape(1) != mask.shape(1) || tokens.shape(1) < 2)
    raise_status(invalid_argument("write_sequences: tokens and mask must both be rows x (seq_len + 1), seq_len >= 1"));
  data::SequenceHeader h;
  h.seq_len = tokens.shape(1) - 1;
  h.vocab_size = vocab_size;
  h.eos_id = eos_id;
  h.pad_id = pad_id;
  if (packing != "pad" && packing != "pack" && packing != "neat")
    raise_status(invalid_argument("write_sequences: packing '" + packing + "': accepted: pad, pack, neat"));
  h.packing = packing;
  h.train_on = train_on;
  h.documents = documents;
  h.truncated = truncated;
  h.tokens = real_tokens;
  h.sources = {source};
  h.tokenizer = "python";
  data::SequenceRows rows;
  rows.tokens.assign(tokens.data(), tokens.data() + tokens.size());
  rows.mask.assign(mask.data(), mask.data() + mask.size());
  int64_t counted = 0;  // the targets fill_row counts: the counted bit, not at a document's first token
  for (int64_t i = 0; i < static_cast<int64_t>(rows.mask.size()); ++i)
    counted += (i % (h.seq_len + 1)) != 0 && (rows.mask[static_cast<size_t>(i)] & data::kMaskCounted) &&
               !(rows.mask[static_cast<size_t>(i)] & data::kMaskDocStart);
  h.counted = counted;
  if (Status s = data::write_sequence_file(path, h, rows); !s.ok()) raise_status(s);
  return h.document_tokens;
}

// A prepared dataset's header as the package reads it.
py::dict header_dict(const data::SequenceHeader& h) {
  py::dict d;
  d["rows"] = h.rows;
  d["seq_len"] = h.seq_len;
  d["vocab_size"] = h.vocab_size;
  d["documents"] = h.documents;
  d["tokens"] = h.tokens;
  d["counted"] = h.counted;
  d["truncated"] = h.truncated;
  d["split"] = h.split;
  d["packing"] = h.packing;
  d["train_on"] = h.train_on;
  d["document_tokens"] = h.document_tokens;  // neat rows' weighted document length (0: whole-row contexts)
  return d;
}

// megatrain-data prepare: a dataset file (or several) tokenized with a model folder's tokenizer into a
// prepared dataset at `out`. Returns the header's counts.
py::dict prepare_dataset(const std::string& tokenizer, const std::vector<std::string>& inputs, const std::string& format,
                         const std::map<std::string, std::string>& fields, int64_t seq_len, const std::string& packing, bool split_long,
                         const std::string& train_on, const std::string& chat_template, const std::string& out) {
  if (packing != "pack" && packing != "neat" && packing != "pad")
    raise_status(invalid_argument("packing '" + packing + "': accepted: pack, neat, pad"));
  data::FieldNames names;
  for (const auto& [k, v] : fields) {
    if (k == "text") names.text = v;
    else if (k == "instruction") names.instruction = v;
    else if (k == "input") names.input = v;
    else if (k == "output") names.output = v;
    else if (k == "messages") names.messages = v;
    else if (k == "role") names.role = v;
    else if (k == "content") names.content = v;
    else raise_status(invalid_argument("field '" + k + "': accepted: text, instruction, input, output, messages, role, content"));
  }
  data::PrepareOptions o;
  o.seq_len = seq_len;
  o.pack = packing != "pad";
  o.neat = packing == "neat";
  o.split_long = split_long;
  o.train_on = train_on;
  o.chat_template = chat_template;
  Result<data::PrepareResult> r = [&]() -> Result<data::PrepareResult> {
    py::gil_scoped_release release;
    MT_ASSIGN_OR_RETURN(data::Tokenizer tok, data::Tokenizer::load(tokenizer));
    return data::prepare_dataset(tok, inputs, format, names, o, out);
  }();
  if (!r.ok()) raise_status(r.status());
  py::dict d = header_dict(r->header);
  d["format"] = r->format;
  return d;
}

// The header of a prepared dataset (rows, seq_len, vocab and counts), or None for another file.
py::object sequence_header(const std::string& path) {
  if (!data::SequenceFile::is_sequence_file(path)) return py::none();
  data::SequenceFile f = value_or_raise(data::SequenceFile::open(path));
  return header_dict(f.header());
}

// Rows of seq_len + 1 tokens one epoch of a token file (or a prepared dataset) has, as the loader counts them.
int64_t rows_per_epoch(const std::string& path, int64_t seq_len) {
  if (data::SequenceFile::is_sequence_file(path)) return value_or_raise(data::SequenceFile::open(path)).rows();
  auto tokens = std::make_shared<const exec::TokenFile>(value_or_raise(exec::TokenFile::open(path)));
  exec::DataLoaderOptions o;
  o.seq_len = seq_len;
  return value_or_raise(exec::DataLoader::create(tokens, o)).rows_per_epoch();
}

// fp32 tensors to a safetensors file (atomically), in the given order.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, py::array_t<float, py::array::c_style | py::array::forcecast>>>& tensors) {
  std::vector<exec::TensorToWrite> out;
  out.reserve(tensors.size());
  for (const auto& [name, a] : tensors) {
    exec::TensorToWrite t;
    t.name = name;
    t.shape.assign(a.shape(), a.shape() + a.ndim());
    t.data = a.data();
    out.push_back(std::move(t));
  }
  Status s;
  {
    py::gil_scoped_release release;
    s = exec::write_safetensors(path, out);
  }
  if (!s.ok()) raise_status(s);
}

// Every tensor of a safetensors file as fp32 NumPy arrays (F32 as stored; BF16/F16 widened exactly).
py::dict read_safetensors(const std::string& path) {
  exec::SafetensorsFile f = value_or_raise(exec::SafetensorsFile::open(path));
  py::dict d;
  for (const exec::SafetensorsEntry& e : f.entries()) {
    std::vector<py::ssize_t> shape(e.shape.begin(), e.shape.end());
    py::array_t<float> a(shape);
    int64_t numel = 1;
    for (int64_t x : e.shape) numel *= x;
    if (Status s = f.read_fp32(e, a.mutable_data(), numel); !s.ok()) raise_status(s);
    d[py::str(e.name)] = a;
  }
  return d;
}

// Logits [rows, seq_len, vocab] of a model folder's weights (or a checkpoint folder) for token rows
// [rows, seq_len]: exec::forward_logits, the CPU backend's layers in fp32 (mt.Model.logits).
py::array_t<float> forward_logits(const std::string& model, const std::string& weights,
                                  py::array_t<int64_t, py::array::c_style | py::array::forcecast> tokens, int threads,
                                  std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>> position_ids) {
  if (tokens.ndim() != 2) raise_status(invalid_argument("logits: tokens must be a 2-D array [rows, seq_len]"));
  ModelSpec spec = value_or_raise(ModelSpec::load(model));
  exec::HostState state = exec::HostState::create(spec, DType::kFp32);
  if (Status s = exec::load_weights(state, weights, spec.config().mtp_layers); !s.ok()) raise_status(s);
  const int64_t rows = tokens.shape(0), seq = tokens.shape(1);
  std::vector<int32_t> ids(static_cast<size_t>(rows * seq));
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t t = tokens.data()[i];
    ids[i] = t < INT32_MIN || t > INT32_MAX ? -1 : static_cast<int32_t>(t);
  }
  std::vector<int32_t> pos;
  if (position_ids) {
    if (position_ids->ndim() != 2 || position_ids->shape(0) != rows || position_ids->shape(1) != seq)
      raise_status(invalid_argument("logits: position_ids must have input_ids' shape [rows, seq_len]"));
    pos.resize(ids.size());
    for (size_t i = 0; i < pos.size(); ++i) {
      const int64_t p = position_ids->data()[i];
      pos[i] = p < 0 || p > INT32_MAX ? -1 : static_cast<int32_t>(p);
    }
  }
  Result<std::vector<float>> r = invalid_argument("logits: not run");
  {
    py::gil_scoped_release release;
    r = exec::forward_logits(spec, state, ids, rows, seq, threads, position_ids ? &pos : nullptr);
  }
  if (!r.ok()) raise_status(r.status());
  const std::vector<float>& out = *r;
  const int64_t vocab = spec.config().vocab_size;
  py::array_t<float> a({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(seq), static_cast<py::ssize_t>(vocab)});
  std::copy(out.begin(), out.end(), a.mutable_data());
  return a;
}

// ---- training ------------------------------------------------------------------------------------

// An exception a Python hook raised during a run, kept until the run returns and raised again then.
// KeyboardInterrupt (Ctrl-C while Python code ran) stops the run at the next step boundary with a
// checkpoint, as a signal does; any other exception stops it at once.
struct Pending {
  std::optional<py::error_already_set> error;
  bool fatal = false;  // an exception other than KeyboardInterrupt
  void take(py::error_already_set& e) {
    const bool interrupt = e.matches(PyExc_KeyboardInterrupt);
    if (!interrupt) fatal = true;
    if (!error || (!interrupt && error->matches(PyExc_KeyboardInterrupt))) error.emplace(std::move(e));
  }
};

// megatrain-exec's lines, handed to a Python callable one whole line at a time (with the GIL).
class LineBuf : public std::streambuf {
 public:
  LineBuf(py::object sink, Pending& pending) : sink_(std::move(sink)), pending_(pending) {}
  ~LineBuf() override {
    py::gil_scoped_acquire gil;
    sink_ = py::object();
  }

 protected:
  int overflow(int c) override {
    if (c == EOF) return 0;
    if (c == '\n') flush_line();
    else line_.push_back(static_cast<char>(c));
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    for (std::streamsize i = 0; i < n; ++i) overflow(static_cast<unsigned char>(s[i]));
    return n;
  }
  int sync() override { return 0; }

 private:
  void flush_line() {
    py::gil_scoped_acquire gil;
    if (!sink_.is_none()) {
      try {
        sink_(text_of(line_));
      } catch (py::error_already_set& e) {
        pending_.take(e);
      }
    }
    line_.clear();
  }
  py::object sink_;
  Pending& pending_;
  std::string line_;
};

py::dict step_dict(const exec::StepResult& r, double lr) {
  py::dict d;
  d["step"] = r.step;
  d["loss"] = r.loss;
  d["tokens"] = r.tokens;
  d["time_s"] = r.time_s;
  d["stall_s"] = r.stall_s;
  d["grad_norm"] = r.grad_norm;
  d["learning_rate"] = lr;
  d["applied"] = r.applied;
  d["not_applied"] = r.not_applied;
  if (r.aux_loss == r.aux_loss) d["aux_loss"] = r.aux_loss;
  return d;
}

// run_training with the GIL released; `hooks` may have before_step(step), after_step(dict) ->
// (save, stop, evaluate), after_eval(next_step, loss, tokens, time_s), after_save(next_step, dir),
// and write_line(str) gets the progress lines. A Python
// exception in a hook stops the run at once; Ctrl-C (a SIGINT, which Python's handler turns into
// KeyboardInterrupt when checked after each step, or which interrupts a hook) stops it at the next
// step boundary after writing a checkpoint. The exception is raised again once the run returned.
py::dict run(const py::dict& options, const py::object& hooks, const py::object& write_line) {
  exec::RunOptions o;
  auto str = [&](const char* k, std::string& v) {
    if (options.contains(k) && !options[k].is_none()) v = py::cast<std::string>(options[k]);
  };
  str("plan", o.plan_path);
  str("data", o.data_path);
  str("tokenizer", o.tokenizer_path);
  str("init", o.init_dir);
  str("checkpoint_dir", o.checkpoint_dir);
  str("trace", o.trace_path);
  str("backend", o.backend);
  str("eval_data", o.eval_data_path);
  if (options.contains("eval_every")) o.eval_every = py::cast<int64_t>(options["eval_every"]);
  if (options.contains("eval_only")) o.eval_only = py::cast<bool>(options["eval_only"]);
  if (options.contains("steps")) o.steps = py::cast<int64_t>(options["steps"]);
  if (options.contains("checkpoint_every")) o.checkpoint_every = py::cast<int64_t>(options["checkpoint_every"]);
  if (options.contains("keep_checkpoints")) o.keep_checkpoints = py::cast<int64_t>(options["keep_checkpoints"]);
  if (options.contains("resume")) o.resume = py::cast<bool>(options["resume"]);
  if (options.contains("threads")) o.threads = py::cast<int>(options["threads"]);
  if (options.contains("in_memory")) o.in_memory = py::cast<bool>(options["in_memory"]);
  if (options.contains("skip_nonfinite_steps")) o.skip_nonfinite_steps = py::cast<bool>(options["skip_nonfinite_steps"]);

  Pending pending;
  auto hook = [&](const char* name) -> py::object {
    if (hooks.is_none() || !py::hasattr(hooks, name)) return py::none();
    return hooks.attr(name);
  };
  const py::object before = hook("before_step"), after = hook("after_step"), saved = hook("after_save"), evaluated = hook("after_eval");
  exec::RunPhase phase = exec::RunPhase::kChecking;
  exec::RunCallbacks cb;
  cb.phase = &phase;
  const Status hook_failed = invalid_argument("a Python callback raised an exception; the run stops");
  // Polled after every step: a pending KeyboardInterrupt, or a signal Python's handler turns into one.
  cb.stop_requested = [&]() -> int {
    py::gil_scoped_acquire gil;
    if (!pending.error && PyErr_CheckSignals() != 0) {
      py::error_already_set e;
      pending.take(e);
    }
    return pending.error ? SIGINT : 0;
  };
  cb.before_step = [&](int64_t step) -> Status {
    py::gil_scoped_acquire gil;
    if (pending.error) return hook_failed;  // interrupted after the last checkpoint was written
    if (before.is_none()) return {};
    try {
      before(step);
    } catch (py::error_already_set& e) {
      pending.take(e);
    }
    return pending.fatal ? hook_failed : Status{};
  };
  cb.after_step = [&](const exec::StepResult& r, double lr) -> Result<exec::StepControl> {
    py::gil_scoped_acquire gil;
    exec::StepControl control;
    if (!after.is_none() && !pending.fatal) {  // also after Ctrl-C: the step ran and counts
      try {
        py::tuple t = after(step_dict(r, lr));
        control.save = py::cast<bool>(t[0]);
        control.stop = py::cast<bool>(t[1]);
        control.evaluate = t.size() > 2 && py::cast<bool>(t[2]);
      } catch (py::error_already_set& e) {
        pending.take(e);
      }
    }
    if (pending.fatal) return hook_failed;
    return control;
  };
  cb.after_eval = [&](int64_t next_step, double loss, int64_t tokens, double time_s) -> Status {
    py::gil_scoped_acquire gil;
    if (evaluated.is_none() || pending.fatal) return pending.fatal ? hook_failed : Status{};
    try {
      evaluated(next_step, loss, tokens, time_s);
    } catch (py::error_already_set& e) {
      pending.take(e);
    }
    return pending.fatal ? hook_failed : Status{};
  };
  cb.after_save = [&](int64_t next_step, const std::string& dir) -> Status {
    py::gil_scoped_acquire gil;
    if (saved.is_none()) return {};
    try {
      saved(next_step, dir);
    } catch (py::error_already_set& e) {
      pending.take(e);
    }
    return pending.fatal ? hook_failed : Status{};
  };

  Result<exec::RunSummary> summary = exec::RunSummary{};
  {
    LineBuf buf(write_line, pending);
    std::ostream out(&buf);
    py::gil_scoped_release release;
    summary = exec::run_training(o, out, cb);
  }
  if (pending.error) {
    pending.error->restore();
    throw py::error_already_set();
  }
  if (!summary.ok()) raise_status(summary.status(), phase_name(phase));
  py::dict d;
  d["first_step"] = summary->first_step;
  d["next_step"] = summary->next_step;
  d["total_steps"] = summary->total_steps;
  d["losses_first_step"] = summary->losses_first_step;
  d["losses"] = summary->losses;
  d["stop_signal"] = summary->stop_signal;
  d["stopped_by_callback"] = summary->stopped_by_hook;
  d["skipped_steps"] = summary->skipped_steps;
  py::list evals;
  for (const exec::RunSummary::Eval& e : summary->evals) {
    py::dict x;
    x["next_step"] = e.next_step;
    x["loss"] = e.loss;
    x["tokens"] = e.tokens;
    x["time_s"] = e.time_s;
    evals.append(x);
  }
  d["evals"] = evals;
  return d;
}

py::object latest_checkpoint(const std::string& dir) {
  Result<std::filesystem::path> p = exec::find_latest_checkpoint(dir);
  if (!p.ok()) {
    if (p.status().code() == StatusCode::kNotFound) return py::none();
    raise_status(p.status());
  }
  return py::str(p->string());
}

}  // namespace

PYBIND11_MODULE(_megatrain, m) {
  m.doc() = "MegaTrain's C++ libraries (use the megatrain package, not this module)";
  py::object base = py::reinterpret_borrow<py::object>(PyExc_Exception);
  status_error_type() = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("megatrain._megatrain.StatusError", "A MegaTrain Status: args are (code, message, phase).", base.ptr(), nullptr));
  m.attr("StatusError") = status_error_type();
  m.def("inspect_json", &inspect_json, py::arg("model"), py::arg("seq") = 0, py::arg("tensors") = false);
  m.def("plan_search", &plan_search, py::arg("model"), py::arg("rig"), py::arg("seq_len"), py::arg("tokens_per_step"),
        py::arg("micro_batch"), py::arg("steps"), py::arg("state_formats"), py::arg("compute") = "auto",
        py::arg("document_tokens") = 0.0);
  m.def("simulate_json", &simulate_json, py::arg("plan"));
  m.def("size_json", &size_json, py::arg("model"), py::arg("gpu") = "", py::arg("target") = 0.0, py::arg("seq_len") = 0,
        py::arg("tokens_per_step") = 0, py::arg("state_formats") = "fp32");
  m.def("profile_rig", &profile_rig, py::arg("path"), py::arg("storage_dirs") = std::vector<std::string>{}, py::arg("model") = "",
        py::arg("seq") = 0);
  m.def("model_info", &model_info, py::arg("model"));
  m.def("write_sequences", &write_sequences, py::arg("path"), py::arg("tokens"), py::arg("mask"), py::arg("vocab_size"),
        py::arg("eos_id"), py::arg("pad_id"), py::arg("documents"), py::arg("truncated"), py::arg("real_tokens"),
        py::arg("train_on"), py::arg("source"), py::arg("packing") = "pad");
  m.def("prepare_dataset", &prepare_dataset, py::arg("tokenizer"), py::arg("inputs"), py::arg("format"), py::arg("fields"),
        py::arg("seq_len"), py::arg("packing"), py::arg("split_long"), py::arg("train_on"), py::arg("chat_template"), py::arg("out"));
  m.def("rows_per_epoch", &rows_per_epoch, py::arg("path"), py::arg("seq_len"));
  m.def("sequence_header", &sequence_header, py::arg("path"));
  m.def("write_safetensors", &write_safetensors, py::arg("path"), py::arg("tensors"));
  m.def("read_safetensors", &read_safetensors, py::arg("path"));
  m.def("forward_logits", &forward_logits, py::arg("model"), py::arg("weights"), py::arg("tokens"), py::arg("threads") = 1,
        py::arg("position_ids") = py::none());
  m.def("latest_checkpoint", &latest_checkpoint, py::arg("checkpoint_dir"));
  m.def("run", &run, py::arg("options"), py::arg("hooks") = py::none(), py::arg("write_line") = py::none());
}

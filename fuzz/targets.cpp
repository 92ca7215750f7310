// The fuzz targets of megatrain-fuzz (fuzz.h): every reader of a file a user or another program
// hands MegaTrain. Each parses the bytes and, where they are accepted, uses the result the way the
// programs do, so that a value the parser let through is exercised too.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "fuzz.h"
#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/trace_store.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/data/tokenizer.h"
#include "megatrain/executor/data.h"
#include "megatrain/executor/safetensors.h"

namespace megatrain::fuzz {
namespace {

namespace fs = std::filesystem;

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_all(const fs::path& p, const std::string& bytes) { std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes; }

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".json") paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());  // the same seeds in the same order on every machine
  std::vector<std::string> out;
  for (const fs::path& p : paths) out.push_back(read_all(p));
  return out;
}
const fs::path kProfiles = MEGATRAIN_PROFILES_DIR;

// ---- plan, config.json, rig ------------------------------------------------------------------------

void run_plan(const std::string& bytes, const fs::path&) {
  auto plan = Plan::from_json_text(bytes);
  if (!plan.ok()) return;
  (void)plan->to_json_text();
  auto model = plan->resolve_model();
  if (model.ok()) (void)model->parameter_counts();
}

void run_config(const std::string& bytes, const fs::path&) {
  auto model = ModelSpec::from_config_json(bytes);
  if (!model.ok()) return;
  (void)model->parameter_counts();
}

void run_rig(const std::string& bytes, const fs::path&) {
  auto rig = HardwareProfile::from_json_text(bytes);
  (void)rig.ok();
}

// ---- safetensors -----------------------------------------------------------------------------------

std::vector<std::string> safetensors_seeds(const fs::path& scratch) {
  const std::vector<float> a = {1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<uint16_t> b = {0x3f80, 0xc020, 0x0001, 0x7f80};
  const fs::path p = scratch / "seed.safetensors";
  exec::TensorToWrite ta{"model.layers.0.weight", {2, 3}, a.data()};
  exec::TensorToWrite tb = exec::raw_tensor("model.norm.weight", {4}, b.data(), "BF16");
  if (!exec::write_safetensors(p, {ta, tb}, {{"format", "pt"}}).ok()) return {};
  return {read_all(p)};
}

void run_safetensors(const std::string& bytes, const fs::path& scratch) {
  const fs::path p = scratch / "input.safetensors";
  write_all(p, bytes);
  auto f = exec::SafetensorsFile::open(p);
  if (!f.ok()) return;
  for (const exec::SafetensorsEntry& e : f->entries()) {
    if (e.numel > (int64_t{1} << 16)) continue;
    (void)f->read_fp32(e.name);
  }
}

// ---- token files (llm.c and prepared datasets) -------------------------------------------------------

std::vector<std::string> token_seeds(const fs::path& scratch) {
  std::vector<std::string> out;
  for (int32_t magic : {exec::kLlmcMagicU16, exec::kLlmcMagicU32}) {
    std::vector<int32_t> header(256, 0);
    header[0] = magic;
    header[1] = magic == exec::kLlmcMagicU16 ? 1 : 7;
    header[2] = 40;
    std::string s(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    for (int t = 0; t < 40; ++t) {
      const uint32_t v = static_cast<uint32_t>(t * 37 % 300);
      s.append(reinterpret_cast<const char*>(&v), magic == exec::kLlmcMagicU16 ? 2 : 4);
    }
    out.push_back(s);
  }
  data::SequenceRows rows;
  for (int t = 0; t < 3 * 9; ++t) {
    rows.tokens.push_back(static_cast<uint32_t>(t * 7 % 256));
    rows.mask.push_back(t % 3 != 0);
  }
  data::SequenceHeader h;
  h.seq_len = 8;
  h.vocab_size = 256;
  h.packing = "pad";
  h.train_on = "answer";
  if (data::write_sequence_file(scratch / "seed.mtseq", h, rows).ok()) out.push_back(read_all(scratch / "seed.mtseq"));
  return out;
}

void run_tokens(const std::string& bytes, const fs::path& scratch) {
  const fs::path bin = scratch / "input.bin";
  write_all(bin, bytes);
  if (auto f = exec::TokenFile::open(bin); f.ok()) {
    std::vector<int32_t> out(static_cast<size_t>(std::min<int64_t>(f->size(), 4096)));
    (void)f->copy_tokens(0, static_cast<int64_t>(out.size()), 256, out.data());
  }
  const fs::path seq = scratch / "input.mtseq";
  write_all(seq, bytes);
  if (auto f = data::SequenceFile::open(seq); f.ok()) {
    std::vector<int32_t> in(static_cast<size_t>(f->seq_len())), tg(in.size());
    for (int64_t r = 0; r < std::min<int64_t>(f->rows(), 64); ++r) f->fill_row(r, in.data(), tg.data());
  }
}

// ---- traces ----------------------------------------------------------------------------------------

std::vector<std::string> trace_seeds(const fs::path& scratch) {
  const fs::path p = scratch / "seed.mtrace";
  auto w = TraceWriter::create(p, {{"source", "measured"}, {"plan", "{}"}});
  if (!w.ok()) return {};
  auto gpu = (*w)->add_lane("GPU compute", "gpu");
  auto h2d = (*w)->add_lane("H2D", "h2d");
  if (!gpu.ok() || !h2d.ok()) return {};
  for (int i = 0; i < 20; ++i) {
    (void)(*w)->add_span({*gpu, "fwd L" + std::to_string(i), "forward", 0, i, 0, i * 100, i * 100 + 90, 0, 1e9});
    (void)(*w)->add_span({*h2d, "h2d L" + std::to_string(i), "h2d", 0, i, -1, i * 100 - (i > 0 ? 50 : 0), i * 100, 4096, 0});
  }
  (void)(*w)->add_counter({"bytes.device", 10, 1e9});
  (void)(*w)->add_step({0, 2.5, 4096, 0.002});
  if (!(*w)->close().ok()) return {};
  return {read_all(p)};
}

void run_trace(const std::string& bytes, const fs::path& scratch) {
  const fs::path p = scratch / "input.mtrace";
  write_all(p, bytes);
  auto r = TraceReader::open(p);
  if (!r.ok()) return;
  auto sum = (*r)->summary();
  if (sum.ok()) (void)(*r)->spans(std::nullopt, sum->start_ns + (sum->end_ns - sum->start_ns) / 2, sum->end_ns);
  (void)(*r)->spans();
  (void)(*r)->counters();
  (void)(*r)->steps();
  (void)export_chrome_trace(**r, scratch / "input.json");
}

// ---- tokenizer.json ----------------------------------------------------------------------------------

std::vector<std::string> tokenizer_seeds(const fs::path&) {
  // A byte-level BPE and a SentencePiece-style one, small enough to mutate.
  return {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġa": 4}, "merges": ["a b", "Ġ a"]},
 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
 "decoder": {"type": "ByteLevel"}, "added_tokens": [{"id": 5, "content": "<s>", "special": true}]})",
          R"({"model": {"type": "BPE", "byte_fallback": true, "vocab": {"<unk>": 0, "<0x41>": 1, "▁": 2, "a": 3, "▁a": 4},
 "merges": [["▁", "a"]], "unk_token": "<unk>"},
 "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
 "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}})"};
}

void run_tokenizer(const std::string& bytes, const fs::path&) {
  auto t = data::Tokenizer::from_json(bytes);
  if (!t.ok()) return;
  const auto ids = t->encode("a ab\xff ba  aaa <s> \xe2\x96\x81x", true);
  (void)t->decode(ids, false);
}

}  // namespace

const std::vector<Target>& targets() {
  static const std::vector<Target> kTargets = {
      {"plan", "plan files (Plan::from_json_text, then the model it names)", [](const fs::path&) { return files_in(kProfiles / "plans"); },
       run_plan},
      {"config", "Hugging Face config.json (ModelSpec::from_config_json)", [](const fs::path&) { return files_in(kProfiles / "models"); },
       run_config},
      {"rig", "hardware profiles (HardwareProfile::from_json_text)", [](const fs::path&) { return files_in(kProfiles / "hardware"); },
       run_rig},
      {"safetensors", "safetensors files: header, offsets, dtypes (SafetensorsFile)", safetensors_seeds, run_safetensors},
      {"tokens", "llm.c token files and prepared datasets (TokenFile, SequenceFile)", token_seeds, run_tokens},
      {"mtrace", "trace files (TraceReader, the Chrome export)", trace_seeds, run_trace},
      {"tokenizer", "tokenizer.json (Tokenizer::from_json, encode, decode)", tokenizer_seeds, run_tokenizer},
  };
  return kTargets;
}

}  // namespace megatrain::fuzz

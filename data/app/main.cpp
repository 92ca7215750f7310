// megatrain-data: the user's data in (issue 19). Argument parsing only; the work is in
// megatrain_data.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <chrono>

#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/core/output_path.h"
#include "megatrain/core/units.h"
#include "megatrain/data/dataset.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/data/tokenizer.h"

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "megatrain-data: error: %s\n", msg.c_str());
  return 1;
}

// The whole of a file named by `flag`; a FIFO, device or folder is refused (its read would block
// or never end).
megatrain::Result<std::string> read_input(const std::string& flag, const std::string& path, const std::string& expected) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    return megatrain::invalid_argument(flag + " " + path + ": not a regular file (a FIFO, device or folder); expected " + expected);
  std::ifstream in(path, std::ios::binary);
  if (!in) return megatrain::not_found(flag + " " + path + ": cannot be read");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string thousands(int64_t v) { return megatrain::format_thousands(static_cast<uint64_t>(v)); }

// A row of a prepared dataset as text, the parts that do not count marked ⟦like this⟧.
std::string marked_row(const megatrain::data::Tokenizer& tok, const megatrain::data::SequenceFile& f, int64_t row) {
  const uint32_t* t = f.row_tokens(row);
  const uint8_t* m = f.row_mask(row);
  std::string out;
  std::vector<int32_t> run;
  bool counted = true;
  auto flush = [&] {
    if (run.empty()) return;
    auto s = tok.decode(run);
    const std::string text = s.ok() ? *s : "<" + s.status().message() + ">";
    out += counted ? text : "\u27e6" + text + "\u27e7";
    run.clear();
  };
  for (int64_t i = 0; i <= f.seq_len(); ++i) {
    const bool c = (m[i] & megatrain::data::kMaskCounted) != 0;
    if (c != counted) flush();
    counted = c;
    run.push_back(static_cast<int32_t>(t[i]));
  }
  flush();
  return out;
}

int run_prepare(const std::string& tokenizer_path, const std::vector<std::string>& inputs, std::string format,
                const megatrain::data::FieldNames& fields, const megatrain::data::PrepareOptions& options, const std::string& out) {
  using namespace megatrain::data;
  const auto t0 = std::chrono::steady_clock::now();
  if (auto s = megatrain::check_output("--output", out, megatrain::OutputKind::kFile); !s.ok()) return fail(s.to_string());
  auto tok = Tokenizer::load(tokenizer_path);
  if (!tok.ok()) return fail(tok.status().to_string());
  PrepareOptions o = options;
  const bool tty = ::isatty(2) != 0;
  if (tty)
    o.progress = [](int64_t done, int64_t total) {
      std::fprintf(stderr, "\rprepare: %s / %s documents", thousands(done).c_str(), thousands(total).c_str());
    };
  auto done = prepare_dataset(*tok, inputs, format, fields, o, out);
  if (tty) std::fputc('\n', stderr);
  if (!done.ok()) return fail(done.status().to_string());
  const SequenceHeader& h = done->header;
  const std::string& found = done->format;
  const int64_t bytes = done->text_bytes;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: %s rows of %lld tokens (%s, train on %s)\n", out.c_str(), thousands(h.rows).c_str(),
              static_cast<long long>(o.seq_len + 1),
              !o.pack ? "padded" : o.neat ? "packed, each document attending only to itself" : "packed", h.train_on.c_str());
  std::printf("documents %s (%s format), tokens %s, counted targets %s, truncated %s, split %s\n", thousands(h.documents).c_str(),
              found.c_str(), thousands(h.tokens).c_str(), thousands(h.counted).c_str(), thousands(h.truncated).c_str(),
              thousands(h.split).c_str());
  std::printf("time %s, %s of text at %.1f MB/s\n", megatrain::format_duration(secs).c_str(),
              megatrain::format_bytes(static_cast<double>(bytes)).c_str(), static_cast<double>(bytes) / 1e6 / secs);
  return 0;
}

int run_inspect(const std::string& path, const std::string& tokenizer_path, int64_t rows_to_show) {
  using namespace megatrain::data;
  auto f = SequenceFile::open(path);
  if (!f.ok()) return fail(f.status().to_string());
  const SequenceHeader& h = f->header();
  std::printf("%s: %s rows of %lld tokens (%s), vocabulary %s\n", path.c_str(), thousands(h.rows).c_str(),
              static_cast<long long>(h.seq_len + 1), h.packing.c_str(), thousands(h.vocab_size).c_str());
  std::printf("documents %s, tokens %s, counted targets %s (train on %s), truncated %s, split %s\n", thousands(h.documents).c_str(),
              thousands(h.tokens).c_str(), thousands(h.counted).c_str(), h.train_on.c_str(), thousands(h.truncated).c_str(),
              thousands(h.split).c_str());
  if (f->document_masked())
    std::printf("documents attend only to themselves: %.1f tokens each, weighted by length (a plan's "
                "training.document_tokens; megatrain-plan plan --data %s)\n",
                h.document_tokens, path.c_str());
  std::printf("tokenizer %s; eos %d, pad %d\n", h.tokenizer.c_str(), h.eos_id, h.pad_id);
  for (const std::string& s : h.sources) std::printf("source %s\n", s.c_str());
  if (rows_to_show <= 0 || h.rows == 0) return 0;
  auto tok = Tokenizer::load(tokenizer_path.empty() ? h.tokenizer : tokenizer_path);
  if (!tok.ok()) return fail(tok.status().to_string() + " (give the tokenizer with --tokenizer to see the rows)");
  for (int64_t r = 0; r < std::min(rows_to_show, h.rows); ++r)
    std::printf("\n-- row %lld (\u27e6not counted\u27e7):\n%s\n", static_cast<long long>(r), marked_row(*tok, *f, r).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using megatrain::data::Tokenizer;
  CLI::App app{"megatrain-data: tokenize text with a model folder's tokenizer.json"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("megatrain-data ") + MEGATRAIN_VERSION);

  std::string tokenizer_path, text, text_file;
  bool json = false, add_special = false, skip_special = false;
  std::vector<int64_t> ids;
  CLI::App* encode = app.add_subcommand("encode", "Print the token ids of a text (no special tokens unless --add-special-tokens)");
  encode->add_option("--tokenizer", tokenizer_path, "A model folder with tokenizer.json, or the file")->required();
  auto* text_opt = encode->add_option("--text", text, "The text");
  auto* file_opt = encode->add_option("--text-file", text_file, "A file whose bytes are the text");
  text_opt->excludes(file_opt);
  encode->add_flag("--json", json, "Print {\"ids\": [...]} instead of the ids separated by spaces");
  encode->add_flag("--add-special-tokens", add_special, "Wrap the ids in the post-processor's template (a BOS token, say)");

  CLI::App* decode = app.add_subcommand("decode", "Print the text of token ids");
  decode->add_option("--tokenizer", tokenizer_path, "A model folder with tokenizer.json, or the file")->required();
  decode->add_option("--ids", ids, "The ids")->required()->check(megatrain::cli::int_range(0, (int64_t{1} << 31) - 1));
  decode->add_flag("--skip-special-tokens", skip_special, "Leave out the special added tokens");
  decode->add_flag("--json", json, "Print {\"text\": \"...\"}");

  std::vector<std::string> inputs;
  std::string format = "auto", out_path, train_on;
  megatrain::data::FieldNames fields;
  megatrain::data::PrepareOptions prep;
  bool pad = false;
  int64_t threads = 0, show = 1;
  CLI::App* prepare = app.add_subcommand("prepare", "Tokenize dataset files into training rows with a mask of the counted targets");
  prepare->add_option("--tokenizer", tokenizer_path, "A model folder with tokenizer.json (and tokenizer_config.json)")->required();
  prepare->add_option("--input", inputs, "Dataset files: .jsonl, .json, or plain text")->required();
  prepare->add_option("--format", format, "auto | text | alpaca | messages | sharegpt | plain");
  prepare->add_option("--seq", prep.seq_len, "Sequence length of a training row (the plan's training.seq_len)")
      ->required()
      ->check(megatrain::cli::int_range(1, int64_t{1} << 24));
  bool pack = false, neat = false;
  auto* pack_flag = prepare->add_flag("--pack", pack,
                                      "Lay the documents end to end, EOS between them, each attending to the ones before it in its row "
                                      "(plain packing, as transformers' group_texts)");
  auto* neat_flag = prepare->add_flag("--pack-neat", neat,
                                      "Lay the documents end to end, each attending only to itself with its positions from 0 "
                                      "(transformers' flattening collator, LLaMA-Factory's neat_packing; the default)");
  auto* pad_flag = prepare->add_flag("--pad", pad, "One document per row, padded; the padding never counts");
  pack_flag->excludes(pad_flag);
  neat_flag->excludes(pad_flag);
  neat_flag->excludes(pack_flag);
  prepare->add_flag("--split-long", prep.split_long, "With --pad: continue a document longer than a row on further rows");
  prepare->add_option("--train-on", train_on,
                      "all | assistant (the default for alpaca, messages and sharegpt: only the answers or assistant turns, with their "
                      "EOS or end-of-turn token, count; 'answer' is the same)");
  prepare->add_option("--text-field", fields.text, "The text field of text records");
  prepare->add_option("--instruction-field", fields.instruction, "The instruction field of alpaca records");
  prepare->add_option("--input-field", fields.input, "The input field of alpaca records");
  prepare->add_option("--output-field", fields.output, "The output field of alpaca records");
  prepare->add_option("--messages-field", fields.messages, "The list of messages (messages: 'messages', sharegpt: 'conversations')");
  prepare->add_option("--role-field", fields.role, "A message's role (messages: 'role', sharegpt: 'from')");
  prepare->add_option("--content-field", fields.content, "A message's text (messages: 'content', sharegpt: 'value')");
  std::string template_file;
  prepare->add_option("--chat-template", template_file, "A Jinja chat template file to use instead of the tokenizer's");
  prepare->add_option("--threads", threads, "Tokenizer threads (0: every core)")->check(megatrain::cli::int_range(0, 1024));
  prepare->add_option("-o,--output", out_path, "The prepared dataset to write")->required();

  std::string inspect_path;
  CLI::App* inspect = app.add_subcommand("inspect", "Counts of a prepared dataset, and its first rows decoded with what does not count marked");
  inspect->add_option("dataset", inspect_path, "A file written by prepare")->required();
  inspect->add_option("--tokenizer", tokenizer_path, "The tokenizer (default: the one the header names)");
  inspect->add_option("--rows", show, "Rows to show decoded")->check(megatrain::cli::int_range(0, 1000));

  if (const int rc = megatrain::cli::parse(app, argc, argv, "megatrain-data"); rc >= 0) return rc;
  if (prepare->parsed()) {
    prep.pack = !pad;
    prep.neat = !pad && !pack;  // neat unless plain packing or padding is asked for by name
    prep.train_on = train_on;
    prep.threads = static_cast<int>(threads);
    if (prep.split_long && prep.pack) return fail("--split-long goes with --pad (packed documents always continue on the next row)");
    if (!template_file.empty()) {
      auto source = read_input("--chat-template", template_file, "a template file");
      if (!source.ok()) return fail(source.status().message());
      prep.chat_template = std::move(*source);
      if (prep.chat_template.empty()) return fail("--chat-template " + template_file + ": the file is empty");
    }
    return run_prepare(tokenizer_path, inputs, format, fields, prep, out_path);
  }
  if (inspect->parsed()) return run_inspect(inspect_path, tokenizer_path, show);
  auto tok = Tokenizer::load(tokenizer_path);
  if (!tok.ok()) return fail(tok.status().to_string());

  if (encode->parsed()) {
    if (text_opt->count() == 0 && file_opt->count() == 0) return fail("encode: give --text or --text-file");
    if (file_opt->count() > 0) {
      auto read = read_input("--text-file", text_file, "a text file");
      if (!read.ok()) return fail(read.status().message());
      text = std::move(*read);
    }
    const auto encoded = tok->encode_checked(text, add_special);
    if (!encoded.ok()) return fail("encode: " + encoded.status().message());
    const std::vector<int32_t>& out = *encoded;
    std::string line = json ? "{\"ids\": [" : "";
    for (size_t i = 0; i < out.size(); ++i) line += (i ? (json ? ", " : " ") : "") + std::to_string(out[i]);
    line += json ? "]}" : "";
    std::puts(line.c_str());
    return 0;
  }
  std::vector<int32_t> in(ids.begin(), ids.end());
  auto s = tok->decode(in, skip_special);
  if (!s.ok()) return fail(s.status().to_string());
  if (json) std::printf("{\"text\": %s}\n", nlohmann::json(*s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  else std::printf("%s\n", s->c_str());
  return 0;
}

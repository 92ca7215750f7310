// megatrain-data: the user's data in (issue 19). Argument parsing only; the work is in
// megatrain_data.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "megatrain/core/detail/cli11_flags.h"
#include "megatrain/data/tokenizer.h"

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "megatrain-data: error: %s\n", msg.c_str());
  return 1;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out + "\"";
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

  if (const int rc = megatrain::cli::parse(app, argc, argv, "megatrain-data"); rc >= 0) return rc;
  auto tok = Tokenizer::load(tokenizer_path);
  if (!tok.ok()) return fail(tok.status().to_string());

  if (encode->parsed()) {
    if (text_opt->count() == 0 && file_opt->count() == 0) return fail("encode: give --text or --text-file");
    if (file_opt->count() > 0) {
      std::ifstream in(text_file, std::ios::binary);
      if (!in) return fail("--text-file " + text_file + ": cannot be read");
      std::ostringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    const std::vector<int32_t> out = tok->encode(text, add_special);
    std::string line = json ? "{\"ids\": [" : "";
    for (size_t i = 0; i < out.size(); ++i) line += (i ? (json ? ", " : " ") : "") + std::to_string(out[i]);
    line += json ? "]}" : "";
    std::puts(line.c_str());
    return 0;
  }
  std::vector<int32_t> in(ids.begin(), ids.end());
  auto s = tok->decode(in, skip_special);
  if (!s.ok()) return fail(s.status().to_string());
  if (json) std::printf("{\"text\": %s}\n", json_string(*s).c_str());
  else std::printf("%s\n", s->c_str());
  return 0;
}

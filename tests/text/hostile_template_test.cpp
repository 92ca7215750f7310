// Chat templates as a hostile or careless user writes them (issue 49): every case ends with an error
// that names the line and the limit, in bounded time and memory, or with Python's answer. Each of
// these crashed, hung or answered wrongly before the budgets (SIGFPE, SIGSEGV, an uncaught
// exception, gigabytes, silent wrap-around, `inf`).
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

#include "megatrain/core/limits.h"
#include "megatrain/data/chat_template.h"

namespace {

using megatrain::Limits;
using megatrain::data::ChatTemplate;
using Json = nlohmann::ordered_json;

// The rendered text, or "ERROR: " and the message.
std::string render(const std::string& source, const Limits& lim = Limits{}, const Json& ctx = Json::object()) {
  auto t = ChatTemplate::parse(source, lim);
  if (!t.ok()) return "ERROR: " + t.status().message();
  auto r = t->render(ctx, lim);
  return r.ok() ? *r : "ERROR: " + r.status().message();
}

bool refused(const std::string& out, const std::string& words) {
  return out.rfind("ERROR: chat template line ", 0) == 0 && out.find(words) != std::string::npos;
}

TEST(HostileTemplate, IntegersArePythonsOn64BitsAndOverflowIsAnError) {
  // Python's answers (floor division and a modulo with the divisor's sign), by hand.
  EXPECT_EQ(render("{{ -7 // 2 }} {{ -7 % 2 }} {{ 7 % -2 }} {{ 7 // -2 }} {{ -7 % -2 }} {{ 6 // 3 }}"), "-4 1 -1 -4 -1 2");
  EXPECT_EQ(render("{{ 7.5 % -2 }} {{ -7.5 % 2 }} {{ 7 / 2 }} {{ 7.0 // 2 }}"), "-0.5 0.5 3.5 3.0");
  // The most negative integer: % -1 is 0 in Python (it raised SIGFPE); // -1 and - of it overflow.
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_TRUE(refused(render("{{ (-9223372036854775807 - 1) // -1 }}"), "integer overflow"));
  EXPECT_TRUE(refused(render("{{ -(-9223372036854775807 - 1) }}"), "integer overflow"));
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) is divisibleby(-1) }}"), "True");
  // Wrap-around was printed as if right.
  const std::string wrap = render("{{ 9223372036854775807 + 1 }}");
  EXPECT_TRUE(refused(wrap, "integer overflow: 9223372036854775807 + 1 does not fit in 64 bits")) << wrap;
  EXPECT_TRUE(refused(render("{{ 3037000500 * 3037000500 }}"), "integer overflow"));
  EXPECT_TRUE(refused(render("{{ -9223372036854775807 - 2 }}"), "integer overflow"));
  // A literal past 64 bits was an uncaught std::out_of_range.
  EXPECT_TRUE(refused(render("{{ 99999999999999999999 }}"), "does not fit in 64 bits"));
  EXPECT_TRUE(refused(render("{{ '99999999999999999999' | int }}"), "does not fit in 64 bits"));
  EXPECT_EQ(render("{{ 'abc' | int }} {{ 3.9 | int }} {{ -3.9 | int }}"), "0 3 -3");
  // Division by zero is Python's ZeroDivisionError (1/0 printed inf).
  for (const char* e : {"1 / 0", "1 // 0", "1 % 0", "1.5 / 0", "1.5 // 0.0", "1.5 % 0"})
    EXPECT_TRUE(refused(render(std::string("{{ ") + e + " }}"), "division by zero")) << e << ": " << render(std::string("{{ ") + e + " }}");
}

TEST(HostileTemplate, SlicesRangesAndFiltersAtTheirExtremes) {
  // A step of 2^63-1 overflowed the index (SIGSEGV); Python takes the first item.
  EXPECT_EQ(render("{{ [1, 2, 3][::9223372036854775807] }} {{ 'abc'[::-9223372036854775807] }}"), "[1] c");
  EXPECT_EQ(render("{{ [1, 2, 3][1::-9223372036854775807] }} {{ [1, 2, 3][-9223372036854775807:] }}"), "[2] [1, 2, 3]");
  // A step of INT64_MIN (found by libFuzzer in CI): Python gives the last element.
  EXPECT_EQ(render("{{ [1, 2, 3][::-9223372036854775807 - 1] }} {{ 'abc'[5:0:(-9223372036854775807 - 1)] }}"), "[3] c");
  EXPECT_EQ(render("{{ range(9223372036854775800, 9223372036854775807, 3) | list }}"),
            "[9223372036854775800, 9223372036854775803, 9223372036854775806]");
  EXPECT_EQ(render("{{ range(5, -5, -4) | list }} {{ range(0) | list }} {{ range(3, 1) | list }}"), "[5, 1, -3] [] []");
  // items of a list was an uncaught exception; Jinja refuses it.
  EXPECT_TRUE(refused(render("{{ [1, 2] | items }}"), "can only get item pairs from a mapping"));
  // A negative indent is Python's json.dumps: newlines and no indentation (it threw length_error).
  EXPECT_EQ(render("{{ [1, [2]] | tojson(indent=-3) }}"), "[\n1,\n[\n2\n]\n]");
  EXPECT_EQ(render("{{ {'a': [1]} | tojson(indent=2) }}"), "{\n  \"a\": [\n    1\n  ]\n}");
  EXPECT_EQ(render("{{ 'ab' * -2 }}|{{ 'ab' * 2 }}"), "|abab");
}

TEST(HostileTemplate, WorkOutputAndRecursionAreBudgeted) {
  Limits lim;
  lim.template_steps = 100'000;
  lim.template_output_bytes = 1 << 20;
  const auto t0 = std::chrono::steady_clock::now();
  // range(10^9) allocated 10^9 items.
  EXPECT_TRUE(refused(render("{{ range(1000000000) | length }}", lim), "MEGATRAIN_LIMITS=template_steps=N")) << render("{{ range(1000000000) | length }}", lim);
  EXPECT_TRUE(refused(render("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", lim), "template_steps"));
  // Doubling a string grew to gigabytes.
  const std::string doubling = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
  EXPECT_TRUE(refused(render(doubling, lim), "template_output_bytes")) << render(doubling, lim);
  EXPECT_TRUE(refused(render("{{ 'x' * 9223372036854775807 }}", lim), "template_output_bytes"));
  EXPECT_TRUE(refused(render("{% for i in range(5000) %}{{ 'y' * 1000 }}{% endfor %}", lim), "template_output_bytes"));
  EXPECT_TRUE(refused(render("{{ 'x' | tojson(indent=100000000) }}{{ [[1]] | tojson(indent=100000000) }}", lim), "template_output_bytes"));
  // A macro calling itself twice, 40 deep: 2^40 calls, bounded by work; one calling itself alone,
  // by depth.
  EXPECT_TRUE(refused(render("{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}", lim),
                      "template_steps"));
  Limits shallow = lim;
  shallow.template_macro_depth = 10;
  const std::string deep = render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", shallow);
  EXPECT_TRUE(refused(deep, "MEGATRAIN_LIMITS=template_macro_depth=N")) << deep;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  // Within the budgets the same constructs render.
  EXPECT_EQ(render("{{ range(1000) | length }} {{ ('ab' * 1000) | length }}", lim), "1000 2000");
}

TEST(HostileTemplate, NestingIsBoundedWhereTheStackWasNot) {
  const Limits lim;  // nesting 256
  // 3,000 nested parentheses overflowed the stack.
  const std::string parens = "{{ " + std::string(3000, '(') + "1" + std::string(3000, ')') + " }}";
  EXPECT_TRUE(refused(render(parens, lim), "MEGATRAIN_LIMITS=nesting=N")) << render(parens, lim).substr(0, 200);
  for (const std::string& e : {std::string(3000, '[') + std::string(3000, ']'), std::string(3000, '-') + "1",
                               [] { std::string s; for (int i = 0; i < 3000; ++i) s += "not "; return s + "1"; }(),
                               [] { std::string s = "1"; for (int i = 0; i < 100000; ++i) s += " + 1"; return s; }(),
                               [] { std::string s = "'a'"; for (int i = 0; i < 100000; ++i) s += " | trim"; return s; }(),
                               [] { std::string s = "x"; for (int i = 0; i < 100000; ++i) s += ".a"; return s; }(),
                               [] { std::string s = "1"; for (int i = 0; i < 3000; ++i) s += " if 1 else 1"; return s; }()}) {
    const std::string out = render("{{ " + e + " }}", lim);
    EXPECT_TRUE(refused(out, "nested too deep")) << e.substr(0, 40) << ": " << out.substr(0, 200);
  }
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if 1 %}";
  for (int i = 0; i < 5000; ++i) blocks += "{% endif %}";
  EXPECT_TRUE(refused(render(blocks, lim), "statements nested too deep"));
  // A value nested deeper than the budget in the context (a JSONL message) cannot overflow the
  // printers either.
  Json deep = 1;
  for (int i = 0; i < 2000; ++i) deep = Json::array({deep});
  for (const char* t : {"{{ x }}", "{{ x | tojson }}", "{{ x | tojson(indent=1) }}", "{{ x ~ '' }}"}) {
    const std::string out = render(t, lim, {{"x", deep}});
    EXPECT_TRUE(refused(out, "nested too deep to print")) << t << ": " << out.substr(0, 200);
  }
  // At the budget's edge a deep expression still renders.
  EXPECT_EQ(render("{{ " + std::string(100, '(') + "7" + std::string(100, ')') + " }}", lim), "7");
}

TEST(HostileTemplate, TheLimitsVariableIsCheckedAndNamesWhatItAccepts) {
  auto l = megatrain::parse_limits("nesting=1000, template_steps=5");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->nesting, 1000);
  EXPECT_EQ(l->template_steps, 5);
  EXPECT_EQ(l->template_output_bytes, Limits{}.template_output_bytes);
  for (const char* bad : {"nesting", "depth=3", "nesting=0", "nesting=abc", "template_steps=-1"}) {
    auto r = megatrain::parse_limits(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("MEGATRAIN_LIMITS"), std::string::npos) << r.status().message();
  }
  EXPECT_NE(megatrain::parse_limits("depth=3").status().message().find("nesting, template_steps"), std::string::npos);
}

}  // namespace

// Chat templates: a Jinja subset (chat_template.h). Three stages: the lexer cuts the source into
// text and tags and applies Jinja's whitespace rules (trim_blocks, lstrip_blocks, and '-'); the
// parser builds statements and expressions by recursive descent with Jinja's precedence; the
// renderer walks them over JSON values.
#include "megatrain/data/chat_template.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <new>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "megatrain/core/limits.h"
#include "text.h"

namespace megatrain::data {

namespace {

using Json = nlohmann::ordered_json;

// A budget reached deep inside a helper that returns no Status (printing a nested value): thrown,
// and turned into the template's error where rendering starts (Renderer::run).
struct BudgetReached {
  std::string message;
};
// Nesting the printers accept (Limits::nesting), set by the renderer for its thread.
thread_local int64_t t_max_nesting = 256;
void check_nesting(int level) {
  if (level > t_max_nesting) throw BudgetReached{limit_message("a value nested too deep to print", "nesting", t_max_nesting, "levels")};
}

// ---- values --------------------------------------------------------------------------------------

struct Node;

struct Value {
  Json j;
  bool undefined = false;
  std::shared_ptr<Json> ns;  // a namespace(): an object that `set ns.x = ...` changes in place
  const Node* macro = nullptr;  // a {% macro %}: the node that defines it
  static Value undef() {
    Value v;
    v.undefined = true;
    return v;
  }
  static Value of(Json j) {
    Value v;
    v.j = std::move(j);
    return v;
  }
  const Json& json() const { return ns ? *ns : j; }
};

bool truthy(const Value& v) {
  if (v.undefined) return false;
  if (v.ns) return true;
  const Json& j = v.j;
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_integer()) return j.get<int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0.0;
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();
  return !j.empty();
}

std::string py_float(double d) {
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e16) {
    char b[64];
    std::snprintf(b, sizeof(b), "%.1f", d);
    return b;
  }
  char b[64];
  std::snprintf(b, sizeof(b), "%.17g", d);
  return b;
}

std::string repr(const Json& j, int level = 0);
std::string str(const Value& v) {
  if (v.undefined) return "";
  const Json& j = v.json();
  if (j.is_string()) return j.get<std::string>();
  return repr(j);
}
// Python's str() of a value, as Jinja prints it.
std::string repr(const Json& j, int level) {
  check_nesting(level);
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_integer()) return std::to_string(j.get<int64_t>());
  if (j.is_number()) return py_float(j.get<double>());
  if (j.is_string()) return "'" + j.get<std::string>() + "'";
  std::string s = j.is_array() ? "[" : "{";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    s += first ? "" : ", ";
    first = false;
    if (j.is_object()) s += "'" + it.key() + "': ";
    s += repr(*it, level + 1);
  }
  return s + (j.is_array() ? "]" : "}");
}

// ---- lexer ---------------------------------------------------------------------------------------

struct Segment {
  enum Kind { kText, kExpr, kStmt } kind = kText;
  std::string text;
  int line = 1;
};

// Where a {{ }} or {% %} tag closes: the first `close` outside string literals and outside braces
// opened in the tag ({{ "}}" }} and {{ {'a': {'b': 1}} }} close where Jinja closes them); npos if none.
size_t tag_end(const std::string& src, size_t from, const std::string& close) {
  int depth = 0;
  for (size_t j = from; j < src.size(); ++j) {
    const char c = src[j];
    if (c == '\'' || c == '"') {
      for (++j; j < src.size() && src[j] != c; ++j)
        if (src[j] == '\\') ++j;
      if (j >= src.size()) return std::string::npos;
    } else if (depth == 0 && src.compare(j, close.size(), close) == 0) {
      return j;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && depth > 0) {
      --depth;
    }
  }
  return std::string::npos;
}

Result<std::vector<Segment>> lex(const std::string& src) {
  std::vector<Segment> out;
  size_t i = 0;
  int line = 1;
  bool strip_next = false, trim_next = false;  // '-' after the last tag; trim_blocks after a block
  auto add_text = [&](std::string t) {
    if (strip_next) t.erase(0, t.find_first_not_of(" \t\r\n") == std::string::npos ? t.size() : t.find_first_not_of(" \t\r\n"));
    else if (trim_next && !t.empty() && t[0] == '\n') t.erase(0, 1);
    else if (trim_next && t.size() >= 2 && t[0] == '\r' && t[1] == '\n') t.erase(0, 2);
    strip_next = trim_next = false;
    out.push_back(Segment{Segment::kText, std::move(t), line});
  };
  while (i < src.size()) {
    size_t open = src.find('{', i);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open == std::string::npos || open + 1 >= src.size()) {
      add_text(src.substr(i));
      break;
    }
    std::string text = src.substr(i, open - i);
    const char kind = src[open + 1];
    const bool minus = open + 2 < src.size() && src[open + 2] == '-';
    const bool plus = open + 2 < src.size() && src[open + 2] == '+';
    if (minus) {
      const size_t keep = text.find_last_not_of(" \t\r\n");
      text.erase(keep == std::string::npos ? 0 : keep + 1);
    } else if ((kind == '%' || kind == '#') && !plus) {
      // lstrip_blocks: spaces and tabs from the start of the line up to a block tag.
      const size_t nl = text.find_last_of('\n');
      const size_t from = nl == std::string::npos ? 0 : nl + 1;
      // Only at the start of a line: after a newline, or at the start of the template.
      if (text.find_first_not_of(" \t", from) == std::string::npos && (nl != std::string::npos || i == 0)) text.erase(from);
    }
    for (char c : text) line += c == '\n';
    add_text(text);
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t body = open + 2 + (minus || plus ? 1 : 0);
    const size_t end = kind == '#' ? src.find(close, body) : tag_end(src, body, close);
    if (end == std::string::npos)
      return invalid_argument("chat template line " + std::to_string(line) + ": '{" + std::string(1, kind) + "' is never closed");
    std::string inner = src.substr(body, end - body);
    const bool strip_after = !inner.empty() && inner.back() == '-';
    if (strip_after || (!inner.empty() && inner.back() == '+')) inner.pop_back();
    const int tag_line = line;
    for (char c : src.substr(open, end + 2 - open)) line += c == '\n';
    if (kind != '#') out.push_back(Segment{kind == '{' ? Segment::kExpr : Segment::kStmt, inner, tag_line});
    strip_next = strip_after;
    trim_next = !strip_after && kind != '{';
    i = end + 2;
  }
  return out;
}

// ---- expressions ---------------------------------------------------------------------------------

struct Tok {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind = kEnd;
  std::string s;
  int64_t i = 0;
  double f = 0;
};

Result<std::vector<Tok>> tokenize(const std::string& s, int line) {
  std::vector<Tok> out;
  size_t i = 0;
  auto err = [&](const std::string& m) { return invalid_argument("chat template line " + std::to_string(line) + ": " + m); };
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back(Tok{Tok::kName, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        Tok t{Tok::kFloat, s.substr(i, j - i)};
        errno = 0;
        t.f = std::strtod(t.s.c_str(), nullptr);
        if (errno == ERANGE || !std::isfinite(t.f)) return err("the number " + t.s.substr(0, 40) + " is out of a double's range");
        out.push_back(t);
      } else {
        Tok t{Tok::kInt, s.substr(i, j - i)};
        errno = 0;
        t.i = std::strtoll(t.s.c_str(), nullptr, 10);
        if (errno == ERANGE)
          return err("the integer " + t.s.substr(0, 40) + (t.s.size() > 40 ? "..." : "") +
                     " does not fit in 64 bits (template integers are 64-bit, where Python's are unbounded)");
        out.push_back(t);
      }
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          v.push_back(s[j]);
          continue;
        }
        const char e = s[++j];
        v.push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e);
      }
      if (j >= s.size()) return err("a string is never closed");
      out.push_back(Tok{Tok::kString, v});
      i = j + 1;
    } else {
      static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "(", ")", "[", "]", "{", "}", ",", ":", ".",
                                         "|",  "~",  "+",  "-",  "*",  "/",  "%", "<", ">", "="};
      bool found = false;
      for (const char* op : kOps)
        if (s.compare(i, std::strlen(op), op) == 0) {
          out.push_back(Tok{Tok::kOp, op});
          i += std::strlen(op);
          found = true;
          break;
        }
      if (!found) return err(std::string("unexpected character '") + c + "'");
    }
  }
  out.push_back(Tok{});
  return out;
}

struct Expr;
using ExprP = std::shared_ptr<Expr>;
struct Expr {
  enum Kind { kLit, kName, kAttr, kItem, kSlice, kCall, kFilter, kTest, kNot, kNeg, kBinary, kCond, kList, kDict } kind = kLit;
  Json lit;
  std::string name;  // kName, kAttr, kFilter, kTest, kBinary's operator
  ExprP a, b, c;     // operands; kSlice: a[b:c:step=args[0]]
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  bool negate = false;  // kTest: is not
  int64_t depth = 1;    // nodes on the longest path down from here (the parser bounds it)
};

class Parser {
 public:
  Parser(std::vector<Tok> toks, int line, int64_t max_depth) : t_(std::move(toks)), line_(line), max_depth_(max_depth) {}
  Result<ExprP> expression() {
    return nested([&] { return conditional(); });
  }
  // An expression without `a if c else b` at its top (a for loop's iterable, before its filter).
  Result<ExprP> without_conditional() { return or_(); }
  bool at_end() const { return t_[p_].kind == Tok::kEnd; }
  bool is_name(const char* n) const { return t_[p_].kind == Tok::kName && t_[p_].s == n; }
  bool is_op(const char* o) const { return t_[p_].kind == Tok::kOp && t_[p_].s == o; }
  const Tok& peek() const { return t_[p_]; }
  Tok next() { return t_[p_].kind == Tok::kEnd ? t_[p_] : t_[p_++]; }
  Status expect_op(const char* o) {
    if (!is_op(o)) return err(std::string("expected '") + o + "', found '" + peek().s + "'");
    ++p_;
    return {};
  }
  Status err(const std::string& m) const { return invalid_argument("chat template line " + std::to_string(line_) + ": " + m); }

 private:
  Result<ExprP> conditional() {
    MT_ASSIGN_OR_RETURN(ExprP e, or_());
    if (is_name("if")) {
      ++p_;
      auto c = std::make_shared<Expr>();
      c->kind = Expr::kCond;
      c->a = e;
      MT_ASSIGN_OR_RETURN(c->b, or_());
      if (is_name("else")) {
        ++p_;
        MT_ASSIGN_OR_RETURN(c->c, nested([&] { return conditional(); }));
      }
      return seal(c);
    }
    return e;
  }
  Result<ExprP> binary(const std::string& op, ExprP a, ExprP b) {
    auto e = std::make_shared<Expr>();
    e->kind = Expr::kBinary;
    e->name = op;
    e->a = std::move(a);
    e->b = std::move(b);
    return seal(e);
  }
  Result<ExprP> or_() {
    MT_ASSIGN_OR_RETURN(ExprP e, and_());
    while (is_name("or")) {
      ++p_;
      MT_ASSIGN_OR_RETURN(ExprP r, and_());
      MT_ASSIGN_OR_RETURN(e, binary("or", e, r));
    }
    return e;
  }
  Result<ExprP> and_() {
    MT_ASSIGN_OR_RETURN(ExprP e, not_());
    while (is_name("and")) {
      ++p_;
      MT_ASSIGN_OR_RETURN(ExprP r, not_());
      MT_ASSIGN_OR_RETURN(e, binary("and", e, r));
    }
    return e;
  }
  Result<ExprP> not_() {
    if (is_name("not")) {
      ++p_;
      auto e = std::make_shared<Expr>();
      e->kind = Expr::kNot;
      MT_ASSIGN_OR_RETURN(e->a, nested([&] { return not_(); }));
      return seal(e);
    }
    return compare();
  }
  Result<ExprP> compare() {
    MT_ASSIGN_OR_RETURN(ExprP e, math1());
    for (;;) {
      std::string op;
      if (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">=")) op = next().s;
      else if (is_name("in")) op = (++p_, "in");
      else if (is_name("not") && t_[p_ + 1].kind == Tok::kName && t_[p_ + 1].s == "in") op = (p_ += 2, "not in");
      else break;
      MT_ASSIGN_OR_RETURN(ExprP r, math1());
      MT_ASSIGN_OR_RETURN(e, binary(op, e, r));
    }
    return e;
  }
  Result<ExprP> math1() {
    MT_ASSIGN_OR_RETURN(ExprP e, concat());
    while (is_op("+") || is_op("-")) {
      const std::string op = next().s;
      MT_ASSIGN_OR_RETURN(ExprP r, concat());
      MT_ASSIGN_OR_RETURN(e, binary(op, e, r));
    }
    return e;
  }
  Result<ExprP> concat() {
    MT_ASSIGN_OR_RETURN(ExprP e, math2());
    while (is_op("~")) {
      ++p_;
      MT_ASSIGN_OR_RETURN(ExprP r, math2());
      MT_ASSIGN_OR_RETURN(e, binary("~", e, r));
    }
    return e;
  }
  Result<ExprP> math2() {
    MT_ASSIGN_OR_RETURN(ExprP e, unary());
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().s;
      MT_ASSIGN_OR_RETURN(ExprP r, unary());
      MT_ASSIGN_OR_RETURN(e, binary(op, e, r));
    }
    return e;
  }
  Result<ExprP> unary() {
    if (is_op("-")) {
      ++p_;
      auto e = std::make_shared<Expr>();
      e->kind = Expr::kNeg;
      MT_ASSIGN_OR_RETURN(e->a, nested([&] { return unary(); }));
      return seal(e);
    }
    MT_ASSIGN_OR_RETURN(ExprP e, postfix());
    // Filters and tests bind to the operand before any operator.
    for (;;) {
      if (is_op("|")) {
        ++p_;
        if (peek().kind != Tok::kName) return err("expected a filter name after '|'");
        auto f = std::make_shared<Expr>();
        f->kind = Expr::kFilter;
        f->name = next().s;
        f->a = e;
        if (is_op("(")) MT_RETURN_IF_ERROR(call_args(*f));
        MT_ASSIGN_OR_RETURN(e, seal(f));
      } else if (is_name("is")) {
        ++p_;
        auto t = std::make_shared<Expr>();
        t->kind = Expr::kTest;
        if (is_name("not")) ++p_, t->negate = true;
        if (peek().kind != Tok::kName) return err("expected a test name after 'is'");
        t->name = next().s;
        t->a = e;
        // Its argument: in parentheses, or one literal (x is divisibleby 3, x is equalto 'a').
        if (is_op("(")) {
          MT_RETURN_IF_ERROR(call_args(*t));
        } else if (peek().kind == Tok::kString || peek().kind == Tok::kInt || peek().kind == Tok::kFloat) {
          MT_ASSIGN_OR_RETURN(ExprP arg, primary());
          t->args.push_back(arg);
        }
        MT_ASSIGN_OR_RETURN(e, seal(t));
      } else {
        return e;
      }
    }
  }
  Status call_args(Expr& call) {
    MT_RETURN_IF_ERROR(expect_op("("));
    while (!is_op(")")) {
      if (peek().kind == Tok::kName && t_[p_ + 1].kind == Tok::kOp && t_[p_ + 1].s == "=") {
        const std::string key = next().s;
        ++p_;
        MT_ASSIGN_OR_RETURN(ExprP v, expression());
        call.kwargs.emplace_back(key, v);
      } else {
        MT_ASSIGN_OR_RETURN(ExprP v, expression());
        call.args.push_back(v);
      }
      if (!is_op(",")) break;
      ++p_;
    }
    return expect_op(")");
  }
  Result<ExprP> postfix() {
    MT_ASSIGN_OR_RETURN(ExprP e, primary());
    for (;;) {
      if (is_op(".")) {
        ++p_;
        if (peek().kind != Tok::kName) return err("expected a name after '.'");
        auto a = std::make_shared<Expr>();
        a->kind = Expr::kAttr;
        a->name = next().s;
        a->a = e;
        MT_ASSIGN_OR_RETURN(e, seal(a));
      } else if (is_op("[")) {
        ++p_;
        auto it = std::make_shared<Expr>();
        it->a = e;
        ExprP first, second, step;
        if (!is_op(":")) {
          MT_ASSIGN_OR_RETURN(first, expression());
        }
        if (is_op(":")) {
          ++p_;
          it->kind = Expr::kSlice;
          if (!is_op(":") && !is_op("]")) {
            MT_ASSIGN_OR_RETURN(second, expression());
          }
          if (is_op(":")) {
            ++p_;
            if (!is_op("]")) {
              MT_ASSIGN_OR_RETURN(step, expression());
            }
          }
          it->b = first;
          it->c = second;
          it->args.push_back(step);
        } else {
          it->kind = Expr::kItem;
          it->b = first;
        }
        MT_RETURN_IF_ERROR(expect_op("]"));
        MT_ASSIGN_OR_RETURN(e, seal(it));
      } else if (is_op("(")) {
        auto c = std::make_shared<Expr>();
        c->kind = Expr::kCall;
        c->a = e;
        MT_RETURN_IF_ERROR(call_args(*c));
        MT_ASSIGN_OR_RETURN(e, seal(c));
      } else {
        return e;
      }
    }
  }
  Result<ExprP> primary() {
    const Tok t = next();
    auto e = std::make_shared<Expr>();
    switch (t.kind) {
      case Tok::kString: {
        std::string s = t.s;
        while (peek().kind == Tok::kString) s += next().s;  // adjacent literals join
        e->lit = s;
        return e;
      }
      case Tok::kInt: e->lit = t.i; return e;
      case Tok::kFloat: e->lit = t.f; return e;
      case Tok::kName:
        if (t.s == "true" || t.s == "True") e->lit = true;
        else if (t.s == "false" || t.s == "False") e->lit = false;
        else if (t.s == "none" || t.s == "None") e->lit = nullptr;
        else e->kind = Expr::kName, e->name = t.s;
        return e;
      case Tok::kOp:
        if (t.s == "(") {
          MT_ASSIGN_OR_RETURN(ExprP inner, expression());
          if (is_op(",")) {  // a tuple: a list here
            e->kind = Expr::kList;
            e->args.push_back(inner);
            while (is_op(",")) {
              ++p_;
              if (is_op(")")) break;
              MT_ASSIGN_OR_RETURN(ExprP x, expression());
              e->args.push_back(x);
            }
            MT_RETURN_IF_ERROR(expect_op(")"));
            return seal(e);
          }
          MT_RETURN_IF_ERROR(expect_op(")"));
          return inner;
        }
        if (t.s == "[") {
          e->kind = Expr::kList;
          while (!is_op("]")) {
            MT_ASSIGN_OR_RETURN(ExprP x, expression());
            e->args.push_back(x);
            if (!is_op(",")) break;
            ++p_;
          }
          MT_RETURN_IF_ERROR(expect_op("]"));
          return seal(e);
        }
        if (t.s == "{") {
          e->kind = Expr::kDict;
          while (!is_op("}")) {
            MT_ASSIGN_OR_RETURN(ExprP k, expression());
            MT_RETURN_IF_ERROR(expect_op(":"));
            MT_ASSIGN_OR_RETURN(ExprP v, expression());
            e->args.push_back(k);
            e->args.push_back(v);
            if (!is_op(",")) break;
            ++p_;
          }
          MT_RETURN_IF_ERROR(expect_op("}"));
          return seal(e);
        }
        break;
      case Tok::kEnd: return err("an expression ends early");
    }
    return err("unexpected '" + t.s + "'");
  }

  // A node whose children are complete: its depth, bounded by Limits::nesting, so that no chain
  // (a + a + ... or x|f|f|...) grows a tree that evaluating or freeing would recurse through.
  Result<ExprP> seal(ExprP x) {
    int64_t d = 0;
    for (const ExprP* c : {&x->a, &x->b, &x->c})
      if (*c) d = std::max(d, (*c)->depth);
    for (const ExprP& c : x->args)
      if (c) d = std::max(d, c->depth);
    for (const auto& kv : x->kwargs)
      if (kv.second) d = std::max(d, kv.second->depth);
    x->depth = d + 1;
    if (x->depth > max_depth_) return err(limit_message("an expression nested too deep", "nesting", max_depth_, "levels"));
    return x;
  }
  // Every recursion on the source's nesting (brackets, `not not`, `- -`, chained conditionals)
  // goes through here: deeper than Limits::nesting is an error, not a stack overflow.
  template <typename F>
  Result<ExprP> nested(F&& parse) {
    if (++depth_ > max_depth_) {
      --depth_;
      return err(limit_message("an expression nested too deep", "nesting", max_depth_, "levels"));
    }
    Result<ExprP> r = parse();
    --depth_;
    return r;
  }

  std::vector<Tok> t_;
  size_t p_ = 0;
  int line_;
  int64_t max_depth_;
  int64_t depth_ = 0;
};

// ---- statements ----------------------------------------------------------------------------------

struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet, kMacro } kind = kText;
  int line = 1;
  std::string text;                                        // kText; kMacro's name
  ExprP expr;                                              // kOutput, kSet's value, kFor's iterable
  ExprP filter;                                            // kFor: `for x in xs if filter`
  std::vector<ExprP> defaults;                             // kMacro: each parameter's default (null: none)
  std::vector<std::pair<ExprP, std::vector<Node>>> branches;  // kIf
  std::vector<Node> body, else_body;                       // kFor (and kIf's else)
  std::vector<std::string> targets;                        // kFor, kSet (name, or namespace + attribute); kMacro's parameters
  bool set_attr = false;
};

class Builder {
 public:
  Builder(std::vector<Segment> segs, int64_t max_depth) : s_(std::move(segs)), max_depth_(max_depth) {}
  // Nodes until a statement whose first word is one of `stops` (left for the caller); statements
  // nested deeper than Limits::nesting are an error.
  Result<std::vector<Node>> block(const std::vector<std::string>& stops, std::string* stopped) {
    if (depth_ >= max_depth_)
      return invalid_argument("chat template line " + std::to_string(i_ < s_.size() ? s_[i_].line : 0) + ": " +
                              limit_message("statements nested too deep", "nesting", max_depth_, "levels"));
    ++depth_;
    Result<std::vector<Node>> r = block_body(stops, stopped);
    --depth_;
    return r;
  }

 private:
  Result<std::vector<Node>> block_body(const std::vector<std::string>& stops, std::string* stopped) {
    std::vector<Node> out;
    while (i_ < s_.size()) {
      const Segment& g = s_[i_];
      if (g.kind == Segment::kText) {
        if (!g.text.empty()) out.push_back(Node{Node::kText, g.line, g.text});
        ++i_;
        continue;
      }
      MT_ASSIGN_OR_RETURN(std::vector<Tok> toks, tokenize(g.text, g.line));
      if (g.kind == Segment::kExpr) {
        Parser p(std::move(toks), g.line, max_depth_);
        Node n{Node::kOutput, g.line};
        MT_ASSIGN_OR_RETURN(n.expr, p.expression());
        if (!p.at_end()) return p.err("unexpected '" + p.peek().s + "' in {{ }}");
        out.push_back(std::move(n));
        ++i_;
        continue;
      }
      const std::string word = toks[0].kind == Tok::kName ? toks[0].s : "";
      if (std::find(stops.begin(), stops.end(), word) != stops.end()) {
        *stopped = word;
        return out;
      }
      ++i_;
      Parser p(std::move(toks), g.line, max_depth_);
      p.next();
      if (word == "if") {
        Node n{Node::kIf, g.line};
        MT_ASSIGN_OR_RETURN(ExprP cond, p.expression());
        for (;;) {
          std::string stop;
          MT_ASSIGN_OR_RETURN(std::vector<Node> body, block({"elif", "else", "endif"}, &stop));
          n.branches.emplace_back(cond, std::move(body));
          if (stop.empty()) return p.err("{% if %} is never closed with {% endif %}");
          MT_ASSIGN_OR_RETURN(std::vector<Tok> t2, tokenize(s_[i_].text, s_[i_].line));
          Parser q(std::move(t2), s_[i_].line, max_depth_);
          q.next();
          ++i_;
          if (stop == "endif") break;
          if (stop == "else") {
            std::string end;
            MT_ASSIGN_OR_RETURN(n.else_body, block({"endif"}, &end));
            if (end.empty()) return p.err("{% if %} is never closed with {% endif %}");
            ++i_;
            break;
          }
          MT_ASSIGN_OR_RETURN(cond, q.expression());
        }
        out.push_back(std::move(n));
      } else if (word == "for") {
        Node n{Node::kFor, g.line};
        do {
          if (p.peek().kind != Tok::kName) return p.err("expected a loop variable");
          n.targets.push_back(p.next().s);
        } while (p.is_op(",") && (p.next(), true));
        if (!p.is_name("in")) return p.err("expected 'in' in {% for %}");
        p.next();
        MT_ASSIGN_OR_RETURN(n.expr, p.without_conditional());
        if (p.is_name("if")) {
          p.next();
          MT_ASSIGN_OR_RETURN(n.filter, p.expression());
        }
        if (!p.at_end()) return p.err("unexpected '" + p.peek().s + "' in {% for %}");
        std::string stop;
        MT_ASSIGN_OR_RETURN(n.body, block({"else", "endfor"}, &stop));
        if (stop.empty()) return p.err("{% for %} is never closed with {% endfor %}");
        ++i_;
        if (stop == "else") {
          std::string end;
          MT_ASSIGN_OR_RETURN(n.else_body, block({"endfor"}, &end));
          if (end.empty()) return p.err("{% for %} is never closed with {% endfor %}");
          ++i_;
        }
        out.push_back(std::move(n));
      } else if (word == "set") {
        Node n{Node::kSet, g.line};
        if (p.peek().kind != Tok::kName) return p.err("expected a name after set");
        n.targets.push_back(p.next().s);
        if (p.is_op(".")) {
          p.next();
          n.targets.push_back(p.next().s);
          n.set_attr = true;
        }
        MT_RETURN_IF_ERROR(p.expect_op("="));
        MT_ASSIGN_OR_RETURN(n.expr, p.expression());
        out.push_back(std::move(n));
      } else if (word == "macro") {
        Node n{Node::kMacro, g.line};
        if (p.peek().kind != Tok::kName) return p.err("expected the macro's name");
        n.text = p.next().s;
        MT_RETURN_IF_ERROR(p.expect_op("("));
        while (!p.is_op(")")) {
          if (p.peek().kind != Tok::kName) return p.err("expected a parameter name in {% macro " + n.text + " %}");
          n.targets.push_back(p.next().s);
          ExprP fallback;
          if (p.is_op("=")) {
            p.next();
            MT_ASSIGN_OR_RETURN(fallback, p.expression());
          }
          n.defaults.push_back(fallback);
          if (!p.is_op(",")) break;
          p.next();
        }
        MT_RETURN_IF_ERROR(p.expect_op(")"));
        std::string stop;
        MT_ASSIGN_OR_RETURN(n.body, block({"endmacro"}, &stop));
        if (stop.empty()) return p.err("{% macro %} is never closed with {% endmacro %}");
        ++i_;
        out.push_back(std::move(n));
      } else {
        return p.err("the statement '" + word + "' is not supported (if, for, set, macro)");
      }
    }
    return out;
  }

  std::vector<Segment> s_;
  size_t i_ = 0;
  int64_t max_depth_;
  int64_t depth_ = 0;
};

// ---- rendering -----------------------------------------------------------------------------------

class Renderer {
 public:
  Renderer(const Json& context, const Limits& limits) : lim_(limits) {
    scopes_.emplace_back();
    for (auto it = context.begin(); it != context.end(); ++it) scopes_[0][it.key()] = Value::of(*it);
  }
  // The whole template: no error inside it (a budget reached where no Status reaches, a JSON
  // library exception, memory exhausted) leaves as anything but a Status naming the line.
  Status run(const std::vector<Node>& nodes, std::string& out) {
    t_max_nesting = lim_.nesting;
    try {
      return render(nodes, out);
    } catch (const BudgetReached& b) {
      return err(b.message);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("chat template line " + std::to_string(line_) + ": out of memory while rendering");
    } catch (const std::exception& e) {
      return err(std::string("cannot render: ") + e.what());
    }
  }
  Status render(const std::vector<Node>& nodes, std::string& out) {
    for (const Node& n : nodes) {
      line_ = n.line;
      switch (n.kind) {
        case Node::kText: out += n.text; break;
        case Node::kOutput: {
          MT_ASSIGN_OR_RETURN(Value v, eval(*n.expr));
          out += str(v);
          break;
        }
        case Node::kIf: {
          bool done = false;
          for (const auto& [cond, body] : n.branches) {
            MT_ASSIGN_OR_RETURN(Value c, eval(*cond));
            if (truthy(c)) {
              MT_RETURN_IF_ERROR(render(body, out));
              done = true;
              break;
            }
          }
          if (!done) MT_RETURN_IF_ERROR(render(n.else_body, out));
          break;
        }
        case Node::kFor: MT_RETURN_IF_ERROR(render_for(n, out)); break;
        case Node::kMacro: {
          Value m;
          m.macro = &n;
          scopes_.back()[n.text] = m;
          break;
        }
        case Node::kSet: {
          MT_ASSIGN_OR_RETURN(Value v, eval(*n.expr));
          if (n.set_attr) {
            Value* ns = lookup(n.targets[0]);
            if (!ns || !ns->ns) return err("'" + n.targets[0] + "' is not a namespace: set " + n.targets[0] + "." + n.targets[1]);
            (*ns->ns)[n.targets[1]] = v.json();
          } else {
            scopes_.back()[n.targets[0]] = v;
          }
          break;
        }
      }
      MT_RETURN_IF_ERROR(fits(out.size()));
    }
    return {};
  }

 private:
  Status err(const std::string& m) const { return invalid_argument("chat template line " + std::to_string(line_) + ": " + m); }
  // Budgets (Limits): work done so far, and the size of a string the template builds.
  Status tick(int64_t n = 1) {
    steps_ += n;
    if (steps_ > lim_.template_steps || n > lim_.template_steps)
      return err(limit_message("the template does too much work", "template_steps", lim_.template_steps,
                               "steps (expression evaluations, loop iterations and list elements built)"));
    return {};
  }
  Status fits(size_t bytes) const {
    if (bytes > static_cast<size_t>(lim_.template_output_bytes))
      return err(limit_message("the template builds too much text", "template_output_bytes", lim_.template_output_bytes, "bytes"));
    return {};
  }
  // Python's integer arithmetic on 64 bits: a result Python would give beyond them is an error.
  Result<Value> int_op(const std::string& op, int64_t i, int64_t k) {
    int64_t r = 0;
    auto overflow = [&] {
      return err("integer overflow: " + std::to_string(i) + " " + op + " " + std::to_string(k) +
                 " does not fit in 64 bits (template integers are 64-bit, where Python's are unbounded)");
    };
    if (op == "+") return __builtin_add_overflow(i, k, &r) ? Result<Value>(overflow()) : Value::of(r);
    if (op == "-") return __builtin_sub_overflow(i, k, &r) ? Result<Value>(overflow()) : Value::of(r);
    if (op == "*") return __builtin_mul_overflow(i, k, &r) ? Result<Value>(overflow()) : Value::of(r);
    if (k == 0) return err("division by zero: " + std::to_string(i) + " " + op + " 0");
    if (op == "/") return Value::of(static_cast<double>(i) / static_cast<double>(k));
    if (op == "//") {  // floor division
      if (i == std::numeric_limits<int64_t>::min() && k == -1) return overflow();
      int64_t q = i / k;
      if (i % k != 0 && ((i < 0) != (k < 0))) --q;
      return Value::of(q);
    }
    if (op == "%") {  // the sign of the divisor, as Python's
      if (k == -1) return Value::of(int64_t{0});
      int64_t m = i % k;
      if (m != 0 && ((m < 0) != (k < 0))) m += k;
      return Value::of(m);
    }
    return err("cannot apply '" + op + "' to integers");
  }
  // Names resolve from the innermost scope out to `floor_` (the frame of the macro being rendered),
  // then in the template's top level: a macro sees its parameters and the globals, not its caller's
  // variables, as in Jinja.
  Value* lookup(const std::string& name) {
    for (size_t k = scopes_.size(); k-- > floor_;)
      if (auto f = scopes_[k].find(name); f != scopes_[k].end()) return &f->second;
    if (floor_ > 0)
      if (auto f = scopes_[0].find(name); f != scopes_[0].end()) return &f->second;
    return nullptr;
  }
  Result<Value> call_macro(const Node& m, const Expr& call) {
    if (depth_ >= lim_.template_macro_depth)
      return err("macro '" + m.text + "': " +
                 limit_message("macro calls nested too deep", "template_macro_depth", lim_.template_macro_depth, "calls"));
    MT_ASSIGN_OR_RETURN(std::vector<Value> args, args_of(call));
    if (args.size() > m.targets.size())
      return err("macro '" + m.text + "' takes " + std::to_string(m.targets.size()) + " arguments, given " + std::to_string(args.size()));
    std::map<std::string, Value> frame;
    for (size_t k = 0; k < m.targets.size(); ++k) {
      const std::string& name = m.targets[k];
      if (k < args.size()) {
        frame[name] = args[k];
        continue;
      }
      const auto kw = std::find_if(call.kwargs.begin(), call.kwargs.end(), [&](const auto& x) { return x.first == name; });
      if (kw != call.kwargs.end()) {
        MT_ASSIGN_OR_RETURN(frame[name], eval(*kw->second));
      } else if (m.defaults[k]) {
        MT_ASSIGN_OR_RETURN(frame[name], eval(*m.defaults[k]));
      } else {
        frame[name] = Value::undef();
      }
    }
    for (const auto& [key, x] : call.kwargs)
      if (std::find(m.targets.begin(), m.targets.end(), key) == m.targets.end())
        return err("macro '" + m.text + "' has no parameter '" + key + "'");
    const size_t floor = floor_;
    const int line = line_;
    floor_ = scopes_.size();
    scopes_.push_back(std::move(frame));
    ++depth_;
    std::string out;
    const Status s = render(m.body, out);
    --depth_;
    scopes_.resize(floor_);
    floor_ = floor;
    line_ = line;
    MT_RETURN_IF_ERROR(s);
    return Value::of(out);
  }
  Status render_for(const Node& n, std::string& out) {
    MT_ASSIGN_OR_RETURN(Value it, eval(*n.expr));
    std::vector<Json> items;
    const Json& j = it.json();
    if (it.undefined || j.is_null()) items = {};
    else if (j.is_array()) items.assign(j.begin(), j.end());
    else if (j.is_object())
      for (auto e = j.begin(); e != j.end(); ++e) items.push_back(e.key());
    else if (j.is_string())
      for (char c : j.get<std::string>()) items.push_back(std::string(1, c));
    else return err("cannot loop over " + repr(j));
    auto bind = [&](std::map<std::string, Value>& sc, const Json& x) -> Status {
      if (n.targets.size() == 1) {
        sc[n.targets[0]] = Value::of(x);
        return {};
      }
      if (!x.is_array() || x.size() != n.targets.size()) return err("cannot unpack " + repr(x) + " into " + std::to_string(n.targets.size()) + " names");
      for (size_t t = 0; t < n.targets.size(); ++t) sc[n.targets[t]] = Value::of(x[t]);
      return {};
    };
    if (n.filter) {  // `for x in xs if cond`: the loop (and its loop.index, length, last) runs over what passes
      std::vector<Json> kept;
      for (const Json& x : items) {
        scopes_.emplace_back();
        Status s = bind(scopes_.back(), x);
        Result<Value> keep = s.ok() ? eval(*n.filter) : Result<Value>(s);
        scopes_.pop_back();
        if (!keep.ok()) return keep.status();
        if (truthy(*keep)) kept.push_back(x);
      }
      items = std::move(kept);
    }
    if (items.empty()) return render(n.else_body, out);
    const auto len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      MT_RETURN_IF_ERROR(tick());
      scopes_.emplace_back();
      auto& sc = scopes_.back();
      sc["loop"] = Value::of(Json{{"index", k + 1}, {"index0", k}, {"first", k == 0}, {"last", k == len - 1}, {"length", len},
                                  {"revindex", len - k}, {"revindex0", len - k - 1}});
      if (Status b = bind(sc, items[static_cast<size_t>(k)]); !b.ok()) {
        scopes_.pop_back();
        return b;
      }
      const Status s = render(n.body, out);
      scopes_.pop_back();
      MT_RETURN_IF_ERROR(s);
    }
    return {};
  }

  // An integer argument (range, slices): an integer, or a float with an integer's value in range.
  Result<int64_t> as_int(const Value& v) const {
    const Json& j = v.json();
    if (j.is_number_integer()) return j.get<int64_t>();
    if (j.is_number_float()) {
      const double d = j.get<double>();
      if (d == std::floor(d) && d >= -9.2e18 && d <= 9.2e18) return static_cast<int64_t>(d);
    }
    return err("expected an integer, got " + repr(j));
  }

  Result<Value> eval(const Expr& e) {
    MT_RETURN_IF_ERROR(tick());
    switch (e.kind) {
      case Expr::kLit: return Value::of(e.lit);
      case Expr::kName: {
        if (Value* v = lookup(e.name)) return *v;
        return Value::undef();
      }
      case Expr::kAttr: {
        MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
        const Json& j = a.json();
        if (j.is_object() && j.contains(e.name)) return Value::of(j[e.name]);
        return Value::undef();  // methods are resolved by kCall
      }
      case Expr::kItem: {
        MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
        MT_ASSIGN_OR_RETURN(Value k, eval(*e.b));
        const Json& j = a.json();
        if (j.is_object() && k.json().is_string()) return j.contains(k.json().get<std::string>()) ? Value::of(j[k.json().get<std::string>()]) : Value::undef();
        if ((j.is_array() || j.is_string()) && k.json().is_number_integer()) {
          const int64_t n = j.is_array() ? static_cast<int64_t>(j.size()) : static_cast<int64_t>(j.get_ref<const std::string&>().size());
          int64_t i = k.json().get<int64_t>();
          if (i < 0) i += n;
          if (i < 0 || i >= n) return Value::undef();
          return j.is_array() ? Value::of(j[static_cast<size_t>(i)]) : Value::of(std::string(1, j.get_ref<const std::string&>()[static_cast<size_t>(i)]));
        }
        return Value::undef();
      }
      case Expr::kSlice: return slice(e);
      case Expr::kCall: return call(e);
      case Expr::kFilter: return filter(e);
      case Expr::kTest: {
        MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
        MT_ASSIGN_OR_RETURN(std::vector<Value> args, args_of(e));
        MT_ASSIGN_OR_RETURN(bool r, test(e.name, a, args));
        return Value::of(r != e.negate);
      }
      case Expr::kNot: {
        MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
        return Value::of(!truthy(a));
      }
      case Expr::kNeg: {
        MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
        if (a.json().is_number_integer()) return int_op("-", 0, a.json().get<int64_t>());
        if (a.json().is_number()) return Value::of(-a.json().get<double>());
        return err("cannot negate " + repr(a.json()));
      }
      case Expr::kCond: {
        MT_ASSIGN_OR_RETURN(Value c, eval(*e.b));
        if (truthy(c)) return eval(*e.a);
        return e.c ? eval(*e.c) : Value::undef();
      }
      case Expr::kList: {
        Json l = Json::array();
        for (const ExprP& x : e.args) {
          MT_ASSIGN_OR_RETURN(Value v, eval(*x));
          l.push_back(v.json());
        }
        return Value::of(l);
      }
      case Expr::kDict: {
        Json d = Json::object();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          MT_ASSIGN_OR_RETURN(Value key, eval(*e.args[k]));
          MT_ASSIGN_OR_RETURN(Value v, eval(*e.args[k + 1]));
          d[str(key)] = v.json();
        }
        return Value::of(d);
      }
      case Expr::kBinary: return binary(e);
    }
    return err("an unknown expression");
  }

  Result<Value> slice(const Expr& e) {
    MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
    const Json& j = a.json();
    const bool str_ = j.is_string();
    if (!str_ && !j.is_array()) return err("cannot slice " + repr(j));
    const int64_t n = str_ ? static_cast<int64_t>(j.get_ref<const std::string&>().size()) : static_cast<int64_t>(j.size());
    int64_t step = 1;
    if (e.args[0]) {
      MT_ASSIGN_OR_RETURN(Value s, eval(*e.args[0]));
      MT_ASSIGN_OR_RETURN(step, as_int(s));
    }
    if (step == 0) return err("slice step cannot be zero");
    auto bound = [&](const ExprP& x, int64_t fallback) -> Result<int64_t> {
      if (!x) return fallback;
      MT_ASSIGN_OR_RETURN(Value v, eval(*x));
      MT_ASSIGN_OR_RETURN(int64_t i, as_int(v));
      if (i < 0) i += n;
      return step > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
    };
    MT_ASSIGN_OR_RETURN(int64_t lo, bound(e.b, step > 0 ? 0 : n - 1));
    MT_ASSIGN_OR_RETURN(int64_t hi, bound(e.c, step > 0 ? n : -1));
    Json out = Json::array();
    std::string s;
    // lo and hi lie in [-1, n]: the next index is computed without overflow for any step.
    for (int64_t i = lo; step > 0 ? i < hi : i > hi;) {
      MT_RETURN_IF_ERROR(tick());
      if (str_) s.push_back(j.get_ref<const std::string&>()[static_cast<size_t>(i)]);
      else out.push_back(j[static_cast<size_t>(i)]);
      if (step > 0 ? hi - i <= step : hi - i >= step) break;  // never -step: INT64_MIN has no negation
      i += step;
    }
    return str_ ? Value::of(s) : Value::of(out);
  }

  static bool equal(const Json& a, const Json& b) {
    if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
    return a == b;
  }

  Result<Value> binary(const Expr& e) {
    MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
    if (e.name == "and") return truthy(a) ? eval(*e.b) : a;
    if (e.name == "or") return truthy(a) ? a : eval(*e.b);
    MT_ASSIGN_OR_RETURN(Value b, eval(*e.b));
    return compare(e.name, a, b);
  }

  // A binary operator other than and/or on two values.
  Result<Value> compare(const std::string& op, const Value& a, const Value& b) {
    const Json &x = a.json(), &y = b.json();
    if (op == "~") {
      std::string l = str(a), r = str(b);
      MT_RETURN_IF_ERROR(fits(l.size() + r.size()));
      return Value::of(l + r);
    }
    if (op == "==") return Value::of(equal(x, y) && a.undefined == b.undefined);
    if (op == "!=") return Value::of(!(equal(x, y) && a.undefined == b.undefined));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (y.is_string() && x.is_string()) found = y.get<std::string>().find(x.get<std::string>()) != std::string::npos;
      else if (y.is_array()) found = std::any_of(y.begin(), y.end(), [&](const Json& z) { return equal(z, x); });
      else if (y.is_object() && x.is_string()) found = y.contains(x.get<std::string>());
      else if (!b.undefined && !y.is_null()) return err("cannot test membership in " + repr(y));
      return Value::of(op == "in" ? found : !found);
    }
    if (op == "+" && x.is_string() && y.is_string()) {
      MT_RETURN_IF_ERROR(fits(x.get_ref<const std::string&>().size() + y.get_ref<const std::string&>().size()));
      return Value::of(x.get<std::string>() + y.get<std::string>());
    }
    if (op == "+" && x.is_array() && y.is_array()) {
      MT_RETURN_IF_ERROR(tick(static_cast<int64_t>(x.size() + y.size())));
      Json l = x;
      for (const Json& z : y) l.push_back(z);
      return Value::of(l);
    }
    if (x.is_number() && y.is_number()) {
      const bool ints = x.is_number_integer() && y.is_number_integer();
      const double p = x.get<double>(), q = y.get<double>();
      if (op == "<") return Value::of(p < q);
      if (op == ">") return Value::of(p > q);
      if (op == "<=") return Value::of(p <= q);
      if (op == ">=") return Value::of(p >= q);
      if (ints && (op == "+" || op == "-" || op == "*" || op == "/" || op == "//" || op == "%"))
        return int_op(op, x.get<int64_t>(), y.get<int64_t>());
      if ((op == "/" || op == "//" || op == "%") && q == 0) return err("division by zero: " + repr(x) + " " + op + " " + repr(y));
      if (op == "+") return Value::of(p + q);
      if (op == "-") return Value::of(p - q);
      if (op == "*") return Value::of(p * q);
      if (op == "/") return Value::of(p / q);
      if (op == "//") return Value::of(std::floor(p / q));
      if (op == "%") {  // Python's float modulo: the sign of the divisor
        double m = std::fmod(p, q);
        if (m != 0 && ((m < 0) != (q < 0))) m += q;
        return Value::of(m);
      }
    }
    if ((op == "<" || op == ">" || op == "<=" || op == ">=") && x.is_string() && y.is_string()) {
      const int c = x.get<std::string>().compare(y.get<std::string>());
      return Value::of(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "*" && x.is_string() && y.is_number_integer()) {  // Python: a count below 1 gives ''
      const int64_t times = std::max<int64_t>(0, y.get<int64_t>());
      const size_t unit = x.get_ref<const std::string&>().size();
      if (unit > 0 && times > 0) MT_RETURN_IF_ERROR(fits(static_cast<size_t>(times) > static_cast<size_t>(lim_.template_output_bytes) / unit
                                                             ? static_cast<size_t>(lim_.template_output_bytes) + 1
                                                             : unit * static_cast<size_t>(times)));
      std::string s;
      s.reserve(unit * static_cast<size_t>(unit > 0 ? times : 0));
      for (int64_t k = 0; unit > 0 && k < times; ++k) s += x.get_ref<const std::string&>();
      return Value::of(s);
    }
    return err("cannot apply '" + op + "' to " + repr(x) + " and " + repr(y));
  }

  Result<bool> test(const std::string& name, const Value& a, const std::vector<Value>& args = {}) {
    const Json& j = a.json();
    if (name == "defined") return !a.undefined;
    if (name == "undefined") return a.undefined;
    // The comparison tests (selectattr('role', 'equalto', 'user'), x is ne 3, ...).
    static const std::map<std::string, std::string> comparisons = {{"equalto", "=="}, {"eq", "=="}, {"==", "=="}, {"sameas", "=="},
                                                                   {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"<", "<"},
                                                                   {"le", "<="}, {"<=", "<="}, {"gt", ">"}, {">", ">"},
                                                                   {"ge", ">="}, {">=", ">="}, {"in", "in"}};
    if (auto c = comparisons.find(name); c != comparisons.end()) {
      if (args.empty()) return err("the test '" + name + "' needs an argument");
      MT_ASSIGN_OR_RETURN(Value r, compare(c->second, a, args[0]));
      return truthy(r);
    }
    if (a.undefined) return false;
    if (name == "none") return j.is_null();
    if (name == "string") return j.is_string();
    if (name == "number") return j.is_number();
    if (name == "integer") return j.is_number_integer();
    if (name == "boolean") return j.is_boolean();
    if (name == "true") return j.is_boolean() && j.get<bool>();
    if (name == "false") return j.is_boolean() && !j.get<bool>();
    if (name == "mapping") return j.is_object() || static_cast<bool>(a.ns);
    if (name == "iterable") return j.is_array() || j.is_object() || j.is_string();
    if (name == "sequence") return j.is_array() || j.is_string();
    if (name == "divisibleby") {
      if (args.empty() || !args[0].json().is_number_integer() || !j.is_number_integer() || args[0].json().get<int64_t>() == 0)
        return err("'divisibleby' needs two integers, the second not zero");
      const int64_t d = args[0].json().get<int64_t>();
      return d == -1 || j.get<int64_t>() % d == 0;
    }
    if (name == "callable") return static_cast<bool>(a.macro);
    if (name == "lower" || name == "upper") {
      if (!j.is_string()) return false;
      const std::string& t = j.get_ref<const std::string&>();
      return std::none_of(t.begin(), t.end(), [&](char ch) { return name == "lower" ? std::isupper(static_cast<unsigned char>(ch)) : std::islower(static_cast<unsigned char>(ch)); });
    }
    if (name == "even" || name == "odd") {
      if (!j.is_number_integer()) return err("'" + name + "' needs an integer");
      return (j.get<int64_t>() % 2 == 0) == (name == "even");
    }
    return err("the test '" + name + "' is not supported");
  }

  static std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
    size_t b = 0, e = s.size();
    if (left) while (b < e && chars.find(s[b]) != std::string::npos) ++b;
    if (right) while (e > b && chars.find(s[e - 1]) != std::string::npos) --e;
    return s.substr(b, e - b);
  }
  // Python's str.title(): each run of letters starts upper case, the rest lower case.
  static std::string title(std::string s) {
    bool start = true;
    for (char& c : s) {
      const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
      if (alpha) c = static_cast<char>(start ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
      start = !alpha;
    }
    return s;
  }
  // The string operations that are both filters (x | upper) and methods (x.upper()): upper, lower,
  // capitalize, title, replace, and strip/lstrip/rstrip (the trim filter is strip). Empty when
  // `name` is none of them.
  static std::optional<std::string> string_op(const std::string& name, std::string s, const std::vector<Value>& args) {
    auto arg = [&](size_t k) { return k < args.size() ? str(args[k]) : std::string(); };
    if (name == "upper" || name == "lower") {
      for (char& c : s) c = static_cast<char>(name == "upper" ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
      return s;
    }
    if (name == "capitalize") {
      for (size_t k = 0; k < s.size(); ++k)
        s[k] = static_cast<char>(k == 0 ? std::toupper(static_cast<unsigned char>(s[k])) : std::tolower(static_cast<unsigned char>(s[k])));
      return s;
    }
    if (name == "title") return title(s);
    if (name == "replace") {
      replace_all(s, arg(0), arg(1));
      return s;
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const std::string chars = args.empty() || args[0].json().is_null() ? std::string(" \t\n\r\f\v") : arg(0);
      return strip_chars(s, chars, name != "rstrip", name != "lstrip");
    }
    return std::nullopt;
  }
  static void dump_py(const Json& j, std::string& out, int level = 0) {
    // Python's json.dumps(x, ensure_ascii=False) spacing: ", " and ": ".
    check_nesting(level);
    if (j.is_array() || j.is_object()) {
      out += j.is_array() ? "[" : "{";
      bool first = true;
      for (auto it = j.begin(); it != j.end(); ++it) {
        out += first ? "" : ", ";
        first = false;
        if (j.is_object()) out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace) + ": ";
        dump_py(*it, out, level + 1);
      }
      out += j.is_array() ? "]" : "}";
      return;
    }
    out += j.dump(-1, ' ', false, Json::error_handler_t::replace);
  }

  // Python's json.dumps(x, ensure_ascii=False, indent=n): one item per line, ",\n" between them.
  static void dump_py_indented(const Json& j, int64_t indent, int level, std::string& out, size_t max_bytes) {
    check_nesting(level);
    if ((!j.is_array() && !j.is_object()) || j.empty()) {
      dump_py(j, out);
      return;
    }
    const size_t width = static_cast<size_t>(indent) * static_cast<size_t>(level + 1);
    if (width + out.size() > max_bytes)
      throw BudgetReached{limit_message("tojson's indented text is too long", "template_output_bytes", static_cast<int64_t>(max_bytes), "bytes")};
    const std::string pad(width, ' '), end_pad(width - static_cast<size_t>(indent), ' ');
    out += j.is_array() ? "[\n" : "{\n";
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      out += first ? "" : ",\n";
      first = false;
      out += pad;
      if (j.is_object()) out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace) + ": ";
      dump_py_indented(*it, indent, level + 1, out, max_bytes);
    }
    out += "\n" + end_pad + (j.is_array() ? "]" : "}");
  }

  Result<std::vector<Value>> args_of(const Expr& e) {
    std::vector<Value> v;
    for (const ExprP& x : e.args) {
      MT_ASSIGN_OR_RETURN(Value a, eval(*x));
      v.push_back(a);
    }
    return v;
  }

  // An item's attribute by a dotted path ("function.name"; digits index lists); undefined when missing.
  static Value attribute(const Json& x, const std::string& path) {
    const Json* at = &x;
    size_t b = 0;
    while (b <= path.size()) {
      size_t e = path.find('.', b);
      if (e == std::string::npos) e = path.size();
      const std::string part = path.substr(b, e - b);
      if (at->is_object() && at->contains(part)) at = &(*at)[part];
      else if (at->is_array() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit) && std::stoul(part) < at->size())
        at = &(*at)[std::stoul(part)];
      else return Value::undef();
      b = e + 1;
    }
    return Value::of(*at);
  }

  Result<Value> filter(const Expr& e) {
    MT_ASSIGN_OR_RETURN(Value a, eval(*e.a));
    MT_ASSIGN_OR_RETURN(std::vector<Value> args, args_of(e));
    std::map<std::string, Value> kwargs;
    for (const auto& [k, x] : e.kwargs) {
      MT_ASSIGN_OR_RETURN(kwargs[k], eval(*x));
    }
    const Json& j = a.json();
    const std::string& f = e.name;
    if (f == "selectattr" || f == "rejectattr" || f == "select" || f == "reject") {
      // select(test, args...), selectattr(attribute, test, args...); no test: the value's truth.
      const bool by_attr = f == "selectattr" || f == "rejectattr", keep = f == "selectattr" || f == "select";
      if (by_attr && args.empty()) return err("'" + f + "' needs an attribute name");
      const size_t t = by_attr ? 1 : 0;
      const std::string test_name = t < args.size() ? str(args[t]) : "";
      const std::vector<Value> test_args(args.begin() + static_cast<std::ptrdiff_t>(std::min(args.size(), t + 1)), args.end());
      Json out = Json::array();
      if (a.undefined || j.is_null()) return Value::of(out);
      if (!j.is_array()) return err("'" + f + "' of " + repr(j) + ": expected a list");
      for (const Json& x : j) {
        const Value v = by_attr ? attribute(x, str(args[0])) : Value::of(x);
        bool pass = false;
        if (test_name.empty()) pass = truthy(v);
        else {
          MT_ASSIGN_OR_RETURN(pass, test(test_name, v, test_args));
        }
        if (pass == keep) out.push_back(x);
      }
      return Value::of(out);
    }
    if (f == "map") {  // map(attribute='x', default=...) or map('filter', args...)
      Json out = Json::array();
      if (a.undefined || j.is_null()) return Value::of(out);
      if (!j.is_array()) return err("'map' of " + repr(j) + ": expected a list");
      if (auto at = kwargs.find("attribute"); at != kwargs.end()) {
        const auto fallback = kwargs.find("default");
        for (const Json& x : j) {
          const Value v = attribute(x, str(at->second));
          out.push_back(v.undefined && fallback != kwargs.end() ? fallback->second.json() : v.json());
        }
        return Value::of(out);
      }
      if (args.empty()) return err("'map' needs attribute= or a filter name");
      for (const Json& x : j) {
        Expr sub;
        sub.kind = Expr::kFilter;
        sub.name = str(args[0]);
        sub.a = std::make_shared<Expr>();
        sub.a->lit = x;
        for (size_t k = 1; k < args.size(); ++k) {
          auto lit = std::make_shared<Expr>();
          lit->lit = args[k].json();
          sub.args.push_back(lit);
        }
        MT_ASSIGN_OR_RETURN(Value v, filter(sub));
        out.push_back(v.json());
      }
      return Value::of(out);
    }
    if (f == "tojson" && kwargs.count("indent") && kwargs["indent"].json().is_number_integer()) {
      // Python's json.dumps: an indent of 0 or below only breaks lines.
      const int64_t indent = std::max<int64_t>(0, kwargs["indent"].json().get<int64_t>());
      MT_RETURN_IF_ERROR(fits(static_cast<size_t>(std::min<int64_t>(indent, lim_.template_output_bytes + 1))));
      std::string s;
      dump_py_indented(j, indent, 0, s, static_cast<size_t>(lim_.template_output_bytes));
      return Value::of(s);
    }
    if (f == "replace" && args.size() < 2) return err("'replace' needs two arguments");
    if (f != "strip" && f != "lstrip" && f != "rstrip")  // methods, not filters; trim is the filter
      if (auto r = string_op(f == "trim" ? "strip" : f, str(a), args)) {
        MT_RETURN_IF_ERROR(fits(r->size()));
        return Value::of(*r);
      }
    if (f == "length" || f == "count") {
      if (j.is_string()) return Value::of(static_cast<int64_t>(j.get_ref<const std::string&>().size()));
      if (j.is_array() || j.is_object()) return Value::of(static_cast<int64_t>(j.size()));
      return err("'" + f + "' of " + repr(j));
    }
    if (f == "first" || f == "last") {
      if (j.is_array()) return j.empty() ? Value::undef() : Value::of(f == "first" ? j.front() : j.back());
      if (j.is_string()) {
        const std::string& s = j.get_ref<const std::string&>();
        return s.empty() ? Value::undef() : Value::of(std::string(1, f == "first" ? s.front() : s.back()));
      }
      return err("'" + f + "' of " + repr(j));
    }
    if (f == "join") {
      const std::string sep = args.empty() ? "" : str(args[0]);
      std::string s;
      bool first = true;
      for (const Json& x : j) {
        s += first ? "" : sep;
        first = false;
        s += str(Value::of(x));
        MT_RETURN_IF_ERROR(fits(s.size()));
      }
      return Value::of(s);
    }
    if (f == "default" || f == "d") {
      const bool boolean = args.size() > 1 && truthy(args[1]);
      if (a.undefined || (boolean && !truthy(a))) return args.empty() ? Value::of("") : args[0];
      return a;
    }
    if (f == "list") {
      if (j.is_array()) return a;
      Json l = Json::array();
      if (j.is_string()) for (char c : j.get<std::string>()) l.push_back(std::string(1, c));
      else if (j.is_object()) for (auto it = j.begin(); it != j.end(); ++it) l.push_back(it.key());
      return Value::of(l);
    }
    if (f == "reverse") {
      if (j.is_string()) return Value::of(std::string(j.get<std::string>().rbegin(), j.get<std::string>().rend()));
      Json l = Json::array();
      for (auto it = j.rbegin(); it != j.rend(); ++it) l.push_back(*it);
      return Value::of(l);
    }
    if (f == "string") return Value::of(str(a));
    if (f == "int") {  // Jinja's int: a number truncated, a string parsed, else (or out of range) 0
      if (j.is_number_integer()) return a;
      if (j.is_number_float()) {
        const double d = std::trunc(j.get<double>());
        if (!(d >= -9.2e18 && d <= 9.2e18))
          return err("int() of " + repr(j) + ": does not fit in 64 bits (template integers are 64-bit, where Python's are unbounded)");
        return Value::of(static_cast<int64_t>(d));
      }
      const std::string t = str(a);
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(t.c_str(), &end, 10);
      if (errno == ERANGE)
        return err("int() of '" + t.substr(0, 40) + "': does not fit in 64 bits (template integers are 64-bit, where Python's are unbounded)");
      return Value::of(static_cast<int64_t>(end != t.c_str() ? v : 0));
    }
    if (f == "float") return Value::of(j.is_number() ? j.get<double>() : std::atof(str(a).c_str()));
    if (f == "items") {
      if (a.undefined || j.is_null()) return Value::of(Json::array());
      if (!j.is_object()) return err("'items' of " + repr(j) + ": can only get item pairs from a mapping");
      Json l = Json::array();
      for (auto it = j.begin(); it != j.end(); ++it) l.push_back(Json::array({it.key(), *it}));
      return Value::of(l);
    }
    if (f == "tojson") {
      std::string s;
      dump_py(j, s);
      return Value::of(s);
    }
    return err("the filter '" + f + "' is not supported");
  }

  Result<Value> call(const Expr& e) {
    if (e.a->kind == Expr::kName)
      if (const Value* m = lookup(e.a->name); m != nullptr && m->macro != nullptr) return call_macro(*m->macro, e);
    MT_ASSIGN_OR_RETURN(std::vector<Value> args, args_of(e));
    if (e.a->kind == Expr::kName) {
      const std::string& f = e.a->name;
      if (f == "strftime_now") {  // transformers' global: the local time now, formatted
        const std::time_t now = std::time(nullptr);
        std::tm tm{};
        localtime_r(&now, &tm);
        char b[256];
        const size_t n = std::strftime(b, sizeof(b), args.empty() ? "" : str(args[0]).c_str(), &tm);
        return Value::of(std::string(b, n));
      }
      if (f == "namespace") {
        Value v;
        v.ns = std::make_shared<Json>(Json::object());
        for (const auto& [k, x] : e.kwargs) {
          MT_ASSIGN_OR_RETURN(Value kv, eval(*x));
          (*v.ns)[k] = kv.json();
        }
        return v;
      }
      if (f == "raise_exception") return invalid_argument("the chat template raised: " + (args.empty() ? std::string() : str(args[0])));
      if (f == "range") {
        int64_t lo = 0, hi = 0, step = 1;
        if (args.size() == 1) {
          MT_ASSIGN_OR_RETURN(hi, as_int(args[0]));
        }
        else if (args.size() >= 2) {
          MT_ASSIGN_OR_RETURN(lo, as_int(args[0]));
          MT_ASSIGN_OR_RETURN(hi, as_int(args[1]));
          if (args.size() > 2) {
            MT_ASSIGN_OR_RETURN(step, as_int(args[2]));
          }
        }
        if (step == 0) return err("range() step cannot be zero");
        // Its length first (in unsigned arithmetic, which no bounds overflow), charged as work.
        uint64_t count = 0;
        if (step > 0 && lo < hi) count = (static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) - 1) / static_cast<uint64_t>(step) + 1;
        if (step < 0 && lo > hi)
          count = (static_cast<uint64_t>(lo) - static_cast<uint64_t>(hi) - 1) / (0 - static_cast<uint64_t>(step)) + 1;
        MT_RETURN_IF_ERROR(tick(count > static_cast<uint64_t>(lim_.template_steps) ? lim_.template_steps + 1 : static_cast<int64_t>(count)));
        Json l = Json::array();
        int64_t k = lo;
        for (uint64_t n = 0; n < count; ++n, k = static_cast<int64_t>(static_cast<uint64_t>(k) + static_cast<uint64_t>(step))) l.push_back(k);
        return Value::of(l);
      }
      return err("the function '" + f + "' is not supported");
    }
    if (e.a->kind != Expr::kAttr) return err("only functions and methods can be called");
    MT_ASSIGN_OR_RETURN(Value self, eval(*e.a->a));
    const std::string& m = e.a->name;
    const Json& j = self.json();
    if (j.is_string()) {
      const std::string& s = j.get_ref<const std::string&>();
      auto arg = [&](size_t k) { return k < args.size() ? str(args[k]) : std::string(); };
      if (m == "startswith") return Value::of(s.compare(0, arg(0).size(), arg(0)) == 0);
      if (m == "endswith") return Value::of(s.size() >= arg(0).size() && s.compare(s.size() - arg(0).size(), arg(0).size(), arg(0)) == 0);
      if (auto r = string_op(m, s, args)) {
        MT_RETURN_IF_ERROR(fits(r->size()));
        return Value::of(*r);
      }
      if (m == "split") {
        Json l = Json::array();
        if (args.empty() || args[0].json().is_null()) {
          size_t k = 0;
          while (k < s.size()) {
            while (k < s.size() && std::isspace(static_cast<unsigned char>(s[k]))) ++k;
            size_t b = k;
            while (k < s.size() && !std::isspace(static_cast<unsigned char>(s[k]))) ++k;
            if (k > b) l.push_back(s.substr(b, k - b));
          }
          return Value::of(l);
        }
        const std::string sep = arg(0);
        if (sep.empty()) return err("split() separator is empty");
        size_t at = 0;
        for (size_t f; (f = s.find(sep, at)) != std::string::npos; at = f + sep.size()) l.push_back(s.substr(at, f - at));
        l.push_back(s.substr(at));
        return Value::of(l);
      }
    }
    if (j.is_object()) {
      if (m == "items") {
        Json l = Json::array();
        for (auto it = j.begin(); it != j.end(); ++it) l.push_back(Json::array({it.key(), *it}));
        return Value::of(l);
      }
      if (m == "keys" || m == "values") {
        Json l = Json::array();
        for (auto it = j.begin(); it != j.end(); ++it) l.push_back(m == "keys" ? Json(it.key()) : *it);
        return Value::of(l);
      }
      if (m == "get") {
        const std::string k = args.empty() ? "" : str(args[0]);
        if (j.contains(k)) return Value::of(j[k]);
        return args.size() > 1 ? args[1] : Value::of(nullptr);
      }
    }
    return err("the method '" + m + "' of " + repr(j) + " is not supported");
  }

  std::vector<std::map<std::string, Value>> scopes_;
  int line_ = 1;
  size_t floor_ = 0;  // the first scope of the macro being rendered (0: none)
  int depth_ = 0;     // macro calls in progress
  const Limits lim_;
  int64_t steps_ = 0;  // work done (tick)
};

}  // namespace

struct ChatTemplate::Impl {
  std::vector<Node> nodes;
};

ChatTemplate::ChatTemplate() = default;
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(const ChatTemplate&) = default;
ChatTemplate& ChatTemplate::operator=(const ChatTemplate&) = default;

Result<ChatTemplate> ChatTemplate::parse(const std::string& source) {
  MT_ASSIGN_OR_RETURN(Limits lim, limits());
  return parse(source, lim);
}

Result<ChatTemplate> ChatTemplate::parse(const std::string& source, const Limits& limits) {
  MT_ASSIGN_OR_RETURN(std::vector<Segment> segs, lex(source));
  Builder b(std::move(segs), limits.nesting);
  std::string stop;
  auto impl = std::make_shared<Impl>();
  MT_ASSIGN_OR_RETURN(impl->nodes, b.block({}, &stop));
  if (!stop.empty()) return invalid_argument("chat template: '" + stop + "' without its opening statement");
  ChatTemplate t;
  t.impl_ = std::move(impl);
  return t;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& context) const {
  MT_ASSIGN_OR_RETURN(Limits lim, limits());
  return render(context, lim);
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& context, const Limits& limits) const {
  if (!impl_) return invalid_argument("chat template: none was parsed");
  Renderer r(context, limits);
  std::string out;
  MT_RETURN_IF_ERROR(r.run(impl_->nodes, out));
  return out;
}

Result<std::string> render_chat_template(const std::string& source, const nlohmann::ordered_json& context) {
  MT_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::parse(source));
  return t.render(context);
}

}  // namespace megatrain::data

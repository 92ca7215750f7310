// Chat templates (issue 19): a model's Jinja chat_template rendered as transformers'
// apply_chat_template renders it (Jinja with trim_blocks and lstrip_blocks), for the subset of
// Jinja that the shipped models' templates use:
//   statements  {% if / elif / else / endif %}, {% for x in xs [if cond] %} (and `for a, b in ...`,
//               an else branch, loop.index/index0/first/last/length/revindex/revindex0, counted
//               over what passes the filter), {% set x = ... %} and {% set ns.attr = ... %},
//               {% macro name(a, b=default) %} (called with positional and keyword arguments; a
//               macro sees its parameters and the template's globals; 64 calls deep at most);
//               {#- comments -#}; whitespace control with - on either side. A tag closes at the
//               first }} or %} outside its string literals and braces.
//   expressions literals (strings, numbers, true/false/none, lists, dicts), names, a.b, a[b],
//               slices a[i:j:k], calls, filters (x | f(args)), tests (x is [not] t, with an
//               argument in parentheses or one literal), not/and/or, == != < > <= >=, in / not in,
//               + - * / // % ~, a if c else b
//   filters     trim, length, count, upper, lower, capitalize, title, first, last, join, default,
//               list, string, int, float, items, reverse, replace, tojson (and indent=n),
//               selectattr, rejectattr, select, reject, map (attribute= and default=, or a filter)
//   tests       defined, undefined, none, string, number, integer, mapping, iterable, sequence,
//               true, false, boolean, even, odd, divisibleby, callable, lower, upper, and the
//               comparisons equalto/eq/==/sameas, ne/!=, lt/<, le/<=, gt/>, ge/>=, in
//   functions   namespace(...), range(...), raise_exception(msg), strftime_now(format) (the local
//               time, as transformers defines it)
//   methods     strings: startswith, endswith, split, strip, lstrip, rstrip, upper, lower, replace,
//               title, capitalize; dicts: items, keys, values, get
// Values print as Python's Jinja prints them (True, None, ['a', 1]), as transformers renders.
// Anything else is an error naming the template line and what was found.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "megatrain/core/limits.h"
#include "megatrain/core/status.h"

namespace megatrain::data {

// A parsed template: parse once, render many times (render is const and safe from many threads).
class ChatTemplate {
 public:
  ChatTemplate();
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&);
  ChatTemplate& operator=(const ChatTemplate&);
  // Errors name the template's line. Statements and expressions nested deeper than
  // Limits::nesting are refused (limits(): the defaults with MEGATRAIN_LIMITS applied).
  static Result<ChatTemplate> parse(const std::string& source);
  static Result<ChatTemplate> parse(const std::string& source, const Limits& limits);
  // Renders with `context` (messages, bos_token, eos_token, add_generation_prompt, ...).
  // raise_exception's message is passed through. A render is bounded (Limits: template_steps,
  // template_output_bytes, template_macro_depth, nesting); integer arithmetic is Python's on 64
  // bits (a result beyond them is an error, as is division by zero); no error in a template ends
  // the process: each reaches the caller as a Status naming the line.
  Result<std::string> render(const nlohmann::ordered_json& context) const;
  Result<std::string> render(const nlohmann::ordered_json& context, const Limits& limits) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// Renders `source` with `context` (messages, bos_token, eos_token, add_generation_prompt, ...).
// Errors name the template's line; raise_exception's message is passed through.
Result<std::string> render_chat_template(const std::string& source, const nlohmann::ordered_json& context);

}  // namespace megatrain::data

// Conversations through the chat template, with the assistant turns found (conversation.h).
#include "megatrain/data/conversation.h"

#include <algorithm>
#include <optional>

namespace megatrain::data {

namespace {

using Json = nlohmann::ordered_json;

// Private-use characters around a message's index: U+E000 n U+E001 marks where a content ends,
// U+E002 n U+E001 where it starts.
constexpr const char* kOpen = "\xEE\x80\x80";
constexpr const char* kOpenStart = "\xEE\x80\x82";
constexpr const char* kClose = "\xEE\x80\x81";
constexpr size_t kMarkLen = 3;

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// The content with the end marker before its trailing whitespace, or the start marker before it.
std::string marked(const std::string& content, size_t k, bool start = false) {
  if (start) {  // after the leading spaces, so that a template that trims the content keeps the trace
    size_t b = 0;
    while (b < content.size() && is_ascii_space(content[b])) ++b;
    return content.substr(0, b) + kOpenStart + std::to_string(k) + kClose + content.substr(b);
  }
  size_t end = content.size();
  while (end > 0 && is_ascii_space(content[end - 1])) --end;
  return content.substr(0, end) + kOpen + std::to_string(k) + kClose + content.substr(end);
}

// Removes the markers (opened by `open`) from `text`; `at[k]` is where message k's marker was (in
// the text without markers), or npos. False when a marker is malformed or repeated.
bool strip_markers(const std::string& text, size_t messages, std::string& out, std::vector<size_t>& at, const char* open_mark = kOpen) {
  at.assign(messages, std::string::npos);
  out.clear();
  out.reserve(text.size());
  size_t i = 0;
  for (;;) {
    const size_t open = text.find(open_mark, i);
    out.append(text, i, (open == std::string::npos ? text.size() : open) - i);
    if (open == std::string::npos) return true;
    const size_t close = text.find(kClose, open + kMarkLen);
    if (close == std::string::npos) return false;
    const std::string digits = text.substr(open + kMarkLen, close - open - kMarkLen);
    if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return false;
    const size_t k = std::stoul(digits);
    if (k >= messages || at[k] != std::string::npos) return false;
    at[k] = out.size();
    i = close + kMarkLen;
  }
}

std::string list_of(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

}  // namespace

Result<ConversationRenderer> ConversationRenderer::create(const Tokenizer& tok, const std::string& template_source) {
  const std::string& source = template_source.empty() ? tok.chat_template() : template_source;
  if (source.empty())
    return invalid_argument(tok.source() +
                            ": no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template): chat datasets "
                            "(messages, conversations) are rendered through the model's template");
  ConversationRenderer r;
  MT_ASSIGN_OR_RETURN(r.template_, ChatTemplate::parse(source));
  r.context_ = Json::object();
  for (const auto& [key, id] : {std::pair<const char*, int32_t>{"bos_token", tok.bos_id()}, {"eos_token", tok.eos_id()}, {"pad_token", tok.pad_id()}})
    if (id >= 0) r.context_[key] = tok.id_to_token(id);
  if (const int32_t unk = tok.token_to_id("<unk>"); unk >= 0) r.context_["unk_token"] = "<unk>";
  // The end-of-turn tokens: what follows an assistant's content in probe conversations, as the last
  // turn and before another user turn, with and without a system prompt.
  auto msg = [](const char* role, std::string content) { return Json{{"role", role}, {"content", std::move(content)}}; };
  const Json probes[] = {
      Json::array({msg("user", "Hi"), msg("assistant", "Sure.")}),
      Json::array({msg("user", "Hi"), msg("assistant", "Sure."), msg("user", "Thanks")}),
      Json::array({msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Sure."), msg("user", "Thanks")}),
  };
  // The turn header: what stands between the generation prompt and an assistant's content.
  {
    const Json& conv = probes[0];
    auto full = r.render_text(conv, nullptr, false);
    auto prompt = r.render_text(Json::array({conv[0]}), nullptr, true);
    std::optional<std::vector<size_t>> cache;
    if (full.ok() && prompt.ok() && full->compare(0, prompt->size(), *prompt) == 0) {
      auto starts = r.content_starts(conv, nullptr, *full, cache);
      if (starts.ok() && (*starts)[1] != std::string::npos && (*starts)[1] >= prompt->size()) {
        r.header_ = full->substr(prompt->size(), (*starts)[1] - prompt->size());
        r.header_known_ = true;
      }
    }
  }
  for (const Json& probe : probes) {
    const size_t k = probe[0]["role"] == "system" ? 2 : 1;  // the assistant's message
    Json conv = probe;
    conv[k]["content"] = marked(conv[k]["content"].get<std::string>(), k);
    auto text = r.render_text(conv, nullptr, false);
    if (!text.ok()) continue;  // a template may refuse a probe (roles it does not take, say)
    std::string plain;
    std::vector<size_t> at;
    if (!strip_markers(*text, conv.size(), plain, at)) continue;
    if (at[k] == std::string::npos) continue;
    size_t p = at[k];
    while (p < plain.size() && is_ascii_space(plain[p])) ++p;
    if (const int64_t len = tok.special_token_at(plain, p); len > 0) {
      const std::string end = plain.substr(p, static_cast<size_t>(len));
      if (std::find(r.ends_.begin(), r.ends_.end(), end) == r.ends_.end()) r.ends_.push_back(end);
    }
  }
  return r;
}

// Where message i's content starts in `text`, from the position of its first non-space character
// (`first`, content_starts'): its leading spaces too where the rendering kept them.
static size_t with_leading_spaces(const Json& messages, size_t i, const std::string& text, size_t first) {
  if (first == std::string::npos || !messages[i].is_object() || !messages[i].contains("content") || !messages[i]["content"].is_string())
    return first;
  const std::string& c = messages[i]["content"].get_ref<const std::string&>();
  size_t w = 0;
  while (w < c.size() && is_ascii_space(c[w])) ++w;
  return w <= first && text.compare(first - w, w, c, 0, w) == 0 ? first - w : first;
}

size_t ConversationRenderer::header_start(const Json& messages, size_t i, const std::string& text, const std::vector<size_t>& starts) const {
  if (!header_known_) return std::string::npos;
  const size_t cs = with_leading_spaces(messages, i, text, starts[i]);
  if (cs == std::string::npos || cs < header_.size() || text.compare(cs - header_.size(), header_.size(), header_) != 0)
    return std::string::npos;
  return cs - header_.size();
}

Result<std::vector<size_t>> ConversationRenderer::content_starts(const Json& messages, const Json& tools, const std::string& text,
                                                                 std::optional<std::vector<size_t>>& cache) const {
  if (cache) return *cache;
  Json mark = messages;
  for (size_t k = 0; k < mark.size(); ++k)
    if (mark[k].is_object() && mark[k].contains("content") && mark[k]["content"].is_string())
      mark[k]["content"] = marked(mark[k]["content"].get<std::string>(), k, true);
  std::vector<size_t> at(messages.size(), std::string::npos);
  auto with_marks = render_text(mark, tools, false);
  std::string plain;
  if (!with_marks.ok() || !strip_markers(*with_marks, messages.size(), plain, at, kOpenStart) || plain != text)
    at.assign(messages.size(), std::string::npos);  // the contents cannot be traced this way: no fallback
  cache = at;
  return *cache;
}

Result<std::string> ConversationRenderer::render_text(const Json& messages, const Json& tools, bool generation) const {
  Json ctx = context_;
  ctx["messages"] = messages;
  if (!tools.is_null()) ctx["tools"] = tools;
  ctx["add_generation_prompt"] = generation;
  return template_.render(ctx);
}

Result<RenderedConversation> ConversationRenderer::render(const Json& messages, const Json& tools, bool spans) const {
  if (!messages.is_array()) return invalid_argument("expected a list of messages");
  RenderedConversation out;
  MT_ASSIGN_OR_RETURN(out.text, render_text(messages, tools, false));
  if (!spans) return out;
  if (out.text.find(kOpen) != std::string::npos || out.text.find(kOpenStart) != std::string::npos)
    return invalid_argument("the conversation holds the character U+E000 or U+E002, which finding the assistant turns needs for itself; "
                            "train it with train_on all");
  // Where each message's content lands in the rendering.
  Json mark = messages;
  for (size_t k = 0; k < mark.size(); ++k)
    if (mark[k].is_object() && mark[k].contains("content") && mark[k]["content"].is_string())
      mark[k]["content"] = marked(mark[k]["content"].get<std::string>(), k);
  MT_ASSIGN_OR_RETURN(const std::string with_marks, render_text(mark, tools, false));
  std::string plain;
  std::vector<size_t> at;
  if (!strip_markers(with_marks, messages.size(), plain, at) || plain != out.text)
    return invalid_argument("the chat template rewrites the messages' contents in a way that hides where they are, so the assistant turns "
                            "cannot be found; train this dataset with train_on all");
  size_t done = 0;  // where the previous turn ended
  std::optional<std::vector<size_t>> starts_cache;
  // Rendering the conversation before each assistant turn costs the length of that conversation,
  // quadratic over a long one (20,000 messages took over a minute). Where the template has a known
  // turn header, a turn starts that header before its content: the first kExactTurns turns are
  // found both ways, and when the two agree on all of them, the later turns take the header's
  // (one rendering with the contents' starts marked, for the whole conversation).
  constexpr int kExactTurns = 4;
  int assistant_turns = 0;
  bool header_agrees = header_known_;
  // With no more turns than are found exactly, the header is never needed: nothing to check.
  int64_t assistants = 0;
  for (const Json& m : messages) assistants += m.is_object() && m.contains("role") && m["role"] == "assistant";
  const bool check_header = assistants > kExactTurns;
  auto by_header = [&](size_t i) -> size_t {
    if (!header_known_) return std::string::npos;  // no rendering spent on it
    if (!starts_cache && !content_starts(messages, tools, out.text, starts_cache).ok()) return std::string::npos;
    return starts_cache ? header_start(messages, i, out.text, *starts_cache) : std::string::npos;
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || m["role"] != "assistant") continue;
    const std::string which = "assistant message " + std::to_string(i + 1) + " of " + std::to_string(messages.size());
    const bool exact = assistant_turns++ < kExactTurns || !header_agrees;
    size_t begin = exact ? std::string::npos : by_header(i);
    if (begin == std::string::npos) {
      MT_ASSIGN_OR_RETURN(begin, turn_start_by_prompt(messages, tools, out.text, at, i, which, starts_cache));
      if (exact && check_header && header_agrees && by_header(i) != begin) header_agrees = false;
    }
    const size_t from = at[i] != std::string::npos ? std::max(at[i], begin) : begin;
    size_t limit = out.text.size();  // no further than the next message's content
    for (size_t k = i + 1; k < messages.size(); ++k)
      if (at[k] != std::string::npos) {
        limit = at[k];
        break;
      }
    size_t end = std::string::npos;
    const std::string_view window(out.text.data(), limit);  // each search stops at the limit: linear over the turns
    for (const std::string& e : ends_) {
      const size_t f = from <= limit ? window.find(e, from) : std::string::npos;
      if (f != std::string::npos) end = std::min(end, f + e.size());
    }
    if (end == std::string::npos) {
      // A turn without the usual end (gpt-oss's tool call ends with <|call|>): the conversation up
      // to this message, rendered alone, when it is where the whole starts.
      Json upto = Json::array();
      for (size_t k = 0; k <= i; ++k) upto.push_back(messages[k]);
      auto through = render_text(upto, tools, false);
      if (through.ok() && through->size() > begin && out.text.compare(0, through->size(), *through) == 0) end = through->size();
    }
    if (end == std::string::npos)
      return invalid_argument(which + ": no end-of-turn token (" + list_of(ends_) + ") after its content, and the conversation up to it " +
                              "rendered alone is not where the whole starts, so the turn's end cannot be found; train this dataset with " +
                              "train_on all");
    if (begin < done) return invalid_argument(which + ": its turn starts inside the one before it");
    out.assistant.emplace_back(begin, end);
    done = end;
  }
  return out;
}

// Where assistant message i's turn starts: the end of the conversation before it rendered with the
// generation prompt, or (a template that renders earlier turns by what follows them) the known turn
// header before its content.
Result<size_t> ConversationRenderer::turn_start_by_prompt(const Json& messages, const Json& tools, const std::string& text,
                                                          const std::vector<size_t>& at, size_t i, const std::string& which,
                                                          std::optional<std::vector<size_t>>& starts_cache) const {
  Json before = Json::array();
  for (size_t k = 0; k < i; ++k) before.push_back(messages[k]);
  auto prompt = render_text(before, tools, true);
  if (!prompt.ok())
    return invalid_argument(which + ": the conversation before it, rendered with the generation prompt, fails: " + prompt.status().message() +
                            "; train this dataset with train_on all");
  size_t begin = prompt->size();
  if (text.compare(0, prompt->size(), *prompt) != 0) {
    // A template that renders earlier turns by what follows them (Mistral-Nemo puts the system
    // prompt into the last user turn): the turn starts the learned header before its content.
    // Only when the renderings part before the previous message's content ends: parting at the
    // turn itself means the prompt is not how this turn starts (a thinking part, say), and the
    // header would leave some of the turn out.
    const size_t parted = static_cast<size_t>(
        std::mismatch(prompt->begin(), prompt->end(), text.begin(), text.end()).first - prompt->begin());
    const bool earlier = i > 0 && at[i - 1] != std::string::npos && parted < at[i - 1];
    MT_ASSIGN_OR_RETURN(const std::vector<size_t>& starts, content_starts(messages, tools, text, starts_cache));
    begin = earlier ? header_start(messages, i, text, starts) : std::string::npos;
    if (begin == std::string::npos)
      return invalid_argument(which + ": the conversation before it rendered with the generation prompt is not where the whole conversation "
                              "starts (they part at byte " + std::to_string(parted) + "), and no known turn header precedes its content "
                              "after an earlier difference, so the turn's start cannot be found; train this dataset with train_on all");
  }
  return begin;
}

}  // namespace megatrain::data
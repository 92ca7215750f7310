// Reading datasets and laying them into training rows (dataset.h).
#include "megatrain/data/dataset.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <nlohmann/json.hpp>
#include <thread>

#include "megatrain/core/limits.h"
#include "megatrain/data/conversation.h"
#include "text.h"

namespace megatrain::data {

namespace {

using Json = nlohmann::ordered_json;

std::string keys_of(const Json& j) {
  std::string s;
  for (auto it = j.begin(); it != j.end(); ++it) s += (s.empty() ? "" : ", ") + it.key();
  return s.empty() ? "none" : s;
}

// sharegpt's speakers as chat roles.
const char* role_of_speaker(const std::string& from) {
  if (from == "human" || from == "user") return "user";
  if (from == "gpt" || from == "assistant" || from == "model" || from == "bot" || from == "function_call") return "assistant";
  if (from == "system") return "system";
  if (from == "observation" || from == "tool" || from == "function" || from == "function_response") return "tool";
  return nullptr;
}

// A messages or sharegpt record as a conversation of {role, content, ...} messages.
Result<Document> conversation_of(const Json& j, const std::string& format, const FieldNames& f, const std::string& where) {
  const bool share = format == "sharegpt";
  const std::string list = !f.messages.empty() ? f.messages : share ? "conversations" : "messages";
  const std::string role = !f.role.empty() ? f.role : share ? "from" : "role";
  const std::string content = !f.content.empty() ? f.content : share ? "value" : "content";
  if (!j.contains(list))
    return invalid_argument(where + ": no '" + list + "' field (the " + format + " format needs it; fields here: " + keys_of(j) +
                            "; map another name with --messages-field)");
  const Json& ms = j[list];
  if (!ms.is_array()) return invalid_argument(where + ": '" + list + "' is a " + ms.type_name() + "; expected a list of messages");
  Document d;
  d.where = where;
  d.messages = Json::array();
  for (size_t k = 0; k < ms.size(); ++k) {
    const Json& m = ms[k];
    const std::string at = where + ": " + list + "[" + std::to_string(k) + "]";
    if (!m.is_object()) return invalid_argument(at + ": expected an object, got " + std::string(m.type_name()));
    if (!m.contains(role) || !m[role].is_string())
      return invalid_argument(at + ": no string '" + role + "' field (fields here: " + keys_of(m) + "; map another name with --role-field)");
    const bool has_content = m.contains(content) && !m[content].is_null();
    if (has_content && !m[content].is_string() && !m[content].is_array())
      return invalid_argument(at + ": '" + content + "' is a " + m[content].type_name() + "; expected a string");
    if (!has_content && !m.contains("tool_calls"))
      return invalid_argument(at + ": no '" + content + "' field (fields here: " + keys_of(m) + "; map another name with --content-field)");
    Json out = Json::object();
    std::string r = m[role].get<std::string>();
    if (share) {
      const char* mapped = role_of_speaker(r);
      if (mapped == nullptr)
        return invalid_argument(at + ": '" + role + "' is '" + r +
                                "'; accepted: human, user, gpt, assistant, model, bot, system, observation, tool, function, function_call");
      r = mapped;
    }
    out["role"] = r;
    if (has_content) out["content"] = m[content];
    for (auto it = m.begin(); it != m.end(); ++it)  // the rest as it is (tool_calls, reasoning_content, ...)
      if (it.key() != role && it.key() != content) out[it.key()] = *it;
    d.messages.push_back(std::move(out));
  }
  if (j.contains("tools") && !j["tools"].is_null()) d.tools = j["tools"];
  return d;
}

// The document of one record; `where` is "file:line" or "file record n".
Result<Document> document_of(const Json& j, const std::string& format, const FieldNames& f, const std::string& where) {
  if (!j.is_object()) return invalid_argument(where + ": expected a JSON object, got " + std::string(j.type_name()));
  auto field = [&](const std::string& key, bool required, std::string& out) -> Status {
    if (!j.contains(key) || j[key].is_null()) {
      if (!required) return {};
      return invalid_argument(where + ": no '" + key + "' field (the " + format + " format needs it; fields here: " + keys_of(j) +
                              "; map another name with --" + (format == "text" ? "text" : key) + "-field)");
    }
    if (!j[key].is_string()) return invalid_argument(where + ": '" + key + "' is a " + j[key].type_name() + "; expected a string");
    out = j[key].get<std::string>();
    return {};
  };
  Document d;
  if (format == "messages" || format == "sharegpt") return conversation_of(j, format, f, where);
  if (format == "text") {
    MT_RETURN_IF_ERROR(field(f.text, true, d.answer));
    return d;
  }
  std::string instruction, input;
  MT_RETURN_IF_ERROR(field(f.instruction, true, instruction));
  MT_RETURN_IF_ERROR(field(f.input, false, input));
  MT_RETURN_IF_ERROR(field(f.output, true, d.answer));
  d.prompt = instruction + (input.empty() ? "" : "\n\n" + input) + "\n\n";
  return d;
}

// The format of a record, from its fields.
std::string format_of(const Json& j, const FieldNames& f) {
  if (!j.is_object()) return "";
  if (j.contains(f.messages.empty() ? "messages" : f.messages)) return "messages";
  if (j.contains(f.messages.empty() ? "conversations" : f.messages)) return "sharegpt";
  if (j.contains(f.instruction) && j.contains(f.output)) return "alpaca";
  if (j.contains(f.text)) return "text";
  return "";
}

Status check_format(const std::string& format, const std::string& where) {
  for (const char* f : {"auto", "text", "alpaca", "messages", "sharegpt", "plain"})
    if (format == f) return {};
  return invalid_argument(where + ": format '" + format + "'; accepted: auto, text, alpaca, messages, sharegpt, plain");
}

Status unknown_shape(const Json& j, const std::string& where) {
  return invalid_argument(where + ": cannot tell the format from the fields (" + (j.is_object() ? keys_of(j) : std::string(j.type_name())) +
                          "); accepted: text ({\"text\"}), alpaca ({\"instruction\", \"output\"}), messages ({\"messages\"}), sharegpt "
                          "({\"conversations\"}), or --format with the field flags");
}

// Calls body(i) for i in [0, count) on `threads` threads, the caller's among them. Consecutive
// indices are handed out in chunks, in order, to whichever thread is free, so that items of uneven
// size (documents, lines) balance. A body that returns false stops the indices after its own:
// every index before it is still visited.
template <typename Body>
void for_each_index(size_t count, size_t threads, size_t chunk, Body&& body) {
  std::atomic<size_t> next{0}, limit{count};
  auto run = [&] {
    for (size_t begin; (begin = next.fetch_add(chunk)) < limit.load();)
      for (size_t i = begin, end = std::min(begin + chunk, count); i < end && i < limit.load(); ++i)
        if (!body(i)) {
          for (size_t l = limit.load(); i < l && !limit.compare_exchange_weak(l, i);) {
          }
          return;
        }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
}

}  // namespace

Result<std::vector<Document>> read_documents(const std::filesystem::path& path, std::string& format, const FieldNames& fields, int threads) {
  const std::string name = path.string();
  MT_RETURN_IF_ERROR(check_format(format, name));
  const std::string ext = path.extension().string();
  // A .json dataset is parsed whole (a .jsonl one a record at a time): bounded before it is read.
  if (ext == ".json" && format != "plain") MT_RETURN_IF_ERROR(check_file_bytes(path, "the JSON dataset"));
  MT_ASSIGN_OR_RETURN(const std::string bytes, read_file(path));
  std::vector<Document> docs;
  if (format == "plain" || (format == "auto" && ext != ".jsonl" && ext != ".json")) {
    format = "plain";
    docs.push_back(Document{"", bytes});
    return docs;
  }
  MT_ASSIGN_OR_RETURN(const Limits lim, limits());
  if (ext == ".json") {
    Json j;
    try {
      j = Json::parse(bytes, json_nesting_limit<Json>(lim.nesting));
    } catch (const JsonTooDeep& e) {
      return invalid_argument(name + ": " + e.what());
    } catch (const Json::exception& e) {
      return invalid_argument(name + ": not valid JSON: " + e.what());
    }
    if (!j.is_array()) return invalid_argument(name + ": expected a JSON array of records (or a .jsonl file with one per line)");
    for (size_t i = 0; i < j.size(); ++i) {
      const std::string where = name + " record " + std::to_string(i);
      if (format == "auto") {
        format = format_of(j[i], fields);
        if (format.empty()) return unknown_shape(j[i], where);
      }
      MT_ASSIGN_OR_RETURN(Document d, document_of(j[i], format, fields, where));
      docs.push_back(std::move(d));
    }
    return docs;
  }
  // JSON Lines: one record per line; blank lines are skipped. The first record decides the format
  // (auto); then the lines are parsed on `threads` threads, and the first bad line (by number) is
  // the error.
  std::vector<std::pair<size_t, size_t>> lines;  // [begin, end) of each line, blank ones included
  for (size_t at = 0; at < bytes.size();) {
    size_t end = bytes.find('\n', at);
    if (end == std::string::npos) end = bytes.size();
    lines.emplace_back(at, end);
    at = end + 1;
  }
  auto blank = [&](size_t k) {
    return std::string_view(bytes.data() + lines[k].first, lines[k].second - lines[k].first).find_first_not_of(" \t\r") == std::string_view::npos;
  };
  auto parse = [&](size_t k, Json& j) -> Status {
    if (const size_t n = lines[k].second - lines[k].first; n > static_cast<size_t>(lim.record_bytes))
      return resource_exhausted(name + ":" + std::to_string(k + 1) + ": " +
                                limit_message("a record of " + std::to_string(n) + " bytes", "record_bytes", lim.record_bytes, "bytes"));
    try {
      j = Json::parse(std::string_view(bytes.data() + lines[k].first, lines[k].second - lines[k].first),
                      json_nesting_limit<Json>(lim.nesting));
    } catch (const JsonTooDeep& e) {
      return invalid_argument(name + ":" + std::to_string(k + 1) + ": " + e.what());
    } catch (const Json::exception& e) {
      return invalid_argument(name + ":" + std::to_string(k + 1) + ": not valid JSON: " + e.what());
    }
    return {};
  };
  if (format == "auto") {
    size_t k = 0;
    while (k < lines.size() && blank(k)) ++k;
    if (k == lines.size()) {
      format = "text";  // an empty file
      return docs;
    }
    Json j;
    MT_RETURN_IF_ERROR(parse(k, j));
    format = format_of(j, fields);
    if (format.empty()) return unknown_shape(j, name + ":" + std::to_string(k + 1));
  }
  std::vector<std::optional<Document>> read(lines.size());
  std::vector<Status> failed(lines.size());
  const size_t n = static_cast<size_t>(std::max(1, std::min<int>(threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency()),
                                                                   static_cast<int>(std::max<size_t>(lines.size() / 256, 1)))));
  for_each_index(lines.size(), n, 64, [&](size_t k) {
    if (blank(k)) return true;
    Json j;
    Status s = parse(k, j);
    if (s.ok()) {
      auto d = document_of(j, format, fields, name + ":" + std::to_string(k + 1));
      if (d.ok()) read[k] = std::move(*d);
      else s = d.status();
    }
    if (s.ok()) return true;
    failed[k] = std::move(s);
    return false;  // after a bad line, later ones are not needed: the first error wins anyway
  });
  for (size_t k = 0; k < lines.size(); ++k) {
    MT_RETURN_IF_ERROR(failed[k]);
    if (read[k]) docs.push_back(std::move(*read[k]));
  }
  return docs;
}

Result<SequenceRows> build_rows(const Tokenizer& tok, const std::vector<Document>& docs, const std::string& format,
                                const PrepareOptions& o, SequenceHeader& h) {
  if (o.seq_len < 1) return invalid_argument("--seq must be at least 1");
  const bool chat = format == "messages" || format == "sharegpt";
  std::string train_on = o.train_on.empty() ? (format == "alpaca" || chat ? "assistant" : "all") : o.train_on;
  if (train_on == "answer") train_on = "assistant";
  if (train_on != "all" && train_on != "assistant") return invalid_argument("--train-on '" + o.train_on + "'; accepted: all, assistant (or answer)");
  if (tok.eos_id() < 0)
    return invalid_argument(tok.source() + ": no eos_token (tokenizer_config.json): documents need one between them");
  std::optional<ConversationRenderer> renderer;
  if (std::any_of(docs.begin(), docs.end(), [](const Document& d) { return d.chat(); })) {
    MT_ASSIGN_OR_RETURN(renderer, ConversationRenderer::create(tok, o.chat_template));
  }
  const bool all = train_on == "all";
  const int32_t pad = tok.pad_id() >= 0 ? tok.pad_id() : tok.eos_id();
  const int64_t width = o.seq_len + 1;
  // Tokenize in parallel, documents handed out in order to the threads as they come free.
  std::vector<std::vector<int32_t>> ids(docs.size());
  std::vector<std::vector<uint8_t>> counted(docs.size());
  std::vector<Status> failed(docs.size());
  const int threads = std::max(1, std::min<int>(o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency()),
                                                static_cast<int>(std::max<size_t>(docs.size(), 1))));
  std::atomic<int64_t> done{0};
  auto conversation = [&](const Document& d, std::vector<int32_t>& v, std::vector<uint8_t>& m) -> Status {
    MT_ASSIGN_OR_RETURN(const RenderedConversation r, renderer->render(d.messages, d.tools, !all));
    std::vector<size_t> cuts, at;
    for (const auto& [b, e] : r.assistant) {
      cuts.push_back(b);
      cuts.push_back(e);
    }
    MT_ASSIGN_OR_RETURN(v, tok.encode_with_cuts(r.text, cuts, at));
    m.assign(v.size(), all);
    for (size_t k = 0; k + 1 < at.size(); k += 2) std::fill(m.begin() + static_cast<std::ptrdiff_t>(at[k]), m.begin() + static_cast<std::ptrdiff_t>(at[k + 1]), 1);
    return {};
  };
  auto encode = [&](size_t i) {
    std::vector<int32_t>& v = ids[i];
    std::vector<uint8_t>& m = counted[i];
    if (docs[i].chat()) {
      ++done;
      if (Status s = conversation(docs[i], v, m); !s.ok()) {
        failed[i] = invalid_argument(docs[i].where + ": " + s.message());
        return false;  // the first bad document (by index) is the error
      }
      return true;
    }
    v = tok.special_prefix();
    m.assign(v.size(), all);
    const int64_t regex_errors_before = regex_errors();
    const std::vector<int32_t> p = tok.encode(docs[i].prompt), a = tok.encode(docs[i].answer);
    if (regex_errors() != regex_errors_before) {
      failed[i] = invalid_argument(docs[i].where + ": the tokenizer's pre-tokenizer regex could not be matched over this text (" +
                                   last_regex_error() + "), so it cannot be tokenized as the reference would");
      return false;
    }
    v.insert(v.end(), p.begin(), p.end());
    m.insert(m.end(), p.size(), all);
    v.insert(v.end(), a.begin(), a.end());
    v.push_back(tok.eos_id());
    m.insert(m.end(), a.size() + 1, 1);
    ++done;
    return true;
  };
  std::thread reporter;
  std::atomic<bool> finished{false};
  if (o.progress)
    reporter = std::thread([&] {
      while (!finished) {
        o.progress(done, static_cast<int64_t>(docs.size()));
        for (int s = 0; s < 5 && !finished; ++s) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  for_each_index(docs.size(), static_cast<size_t>(threads), 16, encode);
  finished = true;
  if (reporter.joinable()) reporter.join();
  if (o.progress) o.progress(static_cast<int64_t>(docs.size()), static_cast<int64_t>(docs.size()));
  for (const Status& s : failed) MT_RETURN_IF_ERROR(s);

  SequenceRows rows;
  h = SequenceHeader{};
  h.seq_len = o.seq_len;
  h.vocab_size = tok.vocab_size();
  h.eos_id = tok.eos_id();
  h.pad_id = pad;
  h.packing = !o.pack ? "pad" : o.neat ? "neat" : "pack";
  h.train_on = train_on;
  h.tokenizer = tok.source();
  h.documents = static_cast<int64_t>(docs.size());
  auto pad_row = [&] {
    const int64_t rem = static_cast<int64_t>(rows.tokens.size()) % width;
    if (rem == 0) return;
    rows.tokens.insert(rows.tokens.end(), static_cast<size_t>(width - rem), static_cast<uint32_t>(pad));
    rows.mask.insert(rows.mask.end(), static_cast<size_t>(width - rem), 0);
  };
  for (size_t i = 0; i < docs.size(); ++i) {
    const std::vector<int32_t>& v = ids[i];
    const std::vector<uint8_t>& m = counted[i];
    size_t n = v.size();
    if (!o.pack && static_cast<int64_t>(n) > width) {
      if (o.split_long) ++h.split;
      else {
        ++h.truncated;
        n = static_cast<size_t>(width);
      }
    }
    const size_t first = rows.mask.size();
    rows.tokens.insert(rows.tokens.end(), v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
    rows.mask.insert(rows.mask.end(), m.begin(), m.begin() + static_cast<std::ptrdiff_t>(n));
    // A document's first token is no one's target: the token before it is another document's,
    // which cannot see it (transformers' flattening collator labels it -100 too).
    if (o.pack && o.neat && n > 0) rows.mask[first] = kMaskDocStart;
    h.tokens += static_cast<int64_t>(n);
    if (!o.pack) pad_row();
  }
  pad_row();
  const int64_t nrows = static_cast<int64_t>(rows.tokens.size()) / width;
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t t = 1; t < width; ++t) h.counted += rows.mask[static_cast<size_t>(r * width + t)] & kMaskCounted;
  h.rows = nrows;
  return rows;
}

Result<PrepareResult> prepare_dataset(const Tokenizer& tok, const std::vector<std::string>& inputs, const std::string& format,
                                      const FieldNames& fields, const PrepareOptions& options, const std::filesystem::path& out) {
  PrepareResult r;
  std::vector<Document> docs;
  for (const std::string& in : inputs) {
    std::string f = format;
    MT_ASSIGN_OR_RETURN(std::vector<Document> d, read_documents(in, f, fields, options.threads));
    if (!r.format.empty() && f != r.format)
      return invalid_argument(in + ": " + f + " records, but the files before it hold " + r.format + " records");
    r.format = f;
    for (Document& doc : d) {
      r.text_bytes += static_cast<int64_t>(doc.prompt.size() + doc.answer.size());
      for (const auto& m : doc.messages)
        if (m.contains("content") && m["content"].is_string()) r.text_bytes += static_cast<int64_t>(m["content"].get_ref<const std::string&>().size());
      docs.push_back(std::move(doc));
    }
  }
  MT_ASSIGN_OR_RETURN(SequenceRows rows, build_rows(tok, docs, r.format, options, r.header));
  r.header.sources = inputs;
  r.header.cache_key = options.cache_key;
  MT_RETURN_IF_ERROR(write_sequence_file(out, r.header, rows));  // fills in rows and document_tokens
  return r;
}

}  // namespace megatrain::data

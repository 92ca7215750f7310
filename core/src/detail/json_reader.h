// Strict JSON reading for MegaTrain's file contracts (plan, hardware profile, model config).
// A FieldReader walks one JSON object, records which keys were read, and turns every problem
// into a Status that names the full key path and what would be accepted. Internal to core/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/core/status.h"

namespace megatrain::detail {

using Json = nlohmann::ordered_json;

// Parses JSON text; a syntax error names `what`, the line and column, and nlohmann's reason.
Result<Json> parse_json(std::string_view text, const std::string& what);
// Reads and parses a file; a missing or unreadable file is an error naming the path.
Result<Json> read_json_file(const std::filesystem::path& path, const std::string& what);

// "a string", "an integer", "a number", "an object", "an array", "a boolean", "null".
std::string json_type_name(const Json& j);
// The closest of `accepted` to `key` by edit distance when it is a plausible typo, else "".
std::string closest_match(std::string_view key, const std::vector<std::string>& accepted);
// `did you mean "x"?` for the closest of `accepted` (closest_match), else "": the one wording of
// every suggestion (unknown keys, unknown choices, unknown profile names).
std::string did_you_mean(std::string_view key, const std::vector<std::string>& accepted);

enum class Need { kRequired, kOptional };

class FieldReader {
 public:
  // `object` must outlive the reader. `path` is the key path of `object` ("" for the root).
  // Keys are learnt as they are read, so unknown keys are found by finish().
  FieldReader(const Json& object, std::string path);
  // A strict object whose keys are all listed up front: an unknown key is the reader's first error,
  // so that a misspelt key ("trainig") is reported as unknown, with a suggestion, before the
  // consequent "training: missing" or any later value's error.
  FieldReader(const Json& object, std::string path, std::initializer_list<std::string_view> keys);

  bool has(const std::string& key) const;
  std::string path_of(const std::string& key) const;

  // Each getter leaves `out` untouched when an optional key is absent, and records the first error.
  void integer(const std::string& key, int64_t& out, Need need, int64_t lo, int64_t hi);
  void number(const std::string& key, double& out, Need need, double lo, double hi);
  void boolean(const std::string& key, bool& out, Need need);
  void string(const std::string& key, std::string& out, Need need);
  void choice(const std::string& key, std::string& out, Need need, const std::vector<std::string>& accepted);
  void string_array(const std::string& key, std::vector<std::string>& out, Need need);
  // Returns the member (of any type) or nullptr when absent; a required absent key is an error.
  const Json* member(const std::string& key, Need need);
  // Like member() but the value must be an object.
  const Json* object(const std::string& key, Need need);
  // Like member() but the value must be an array.
  const Json* array(const std::string& key, Need need);

  // Marks keys as known without reading them (for keys read by hand).
  void accept(std::initializer_list<std::string_view> keys);
  void fail(Status s);
  bool ok() const { return status_.ok(); }
  // Reports the first error, else the first key that was never read (an unknown key), naming the
  // accepted keys and the closest one when it looks like a typo.
  Status finish();

 private:
  Status unknown_key_error() const;
  // `; found "x", a misspelling?` for a key of the object not read yet that is close to `key`.
  std::string misspelt_as(const std::string& key) const;
  const Json* find(const std::string& key, Need need, const char* expected);
  const Json& obj_;
  std::string path_;
  std::vector<std::string> known_;
  Status status_;
};

}  // namespace megatrain::detail

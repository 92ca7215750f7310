// The seeded mutator of megatrain-fuzz (fuzz.h): structure-blind byte edits, plus the edits that
// find the bugs of text formats (numbers at the edges of their types, quotes and brackets).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "megatrain/core/limits.h"

namespace megatrain::fuzz {
namespace {

constexpr std::array<const char*, 16> kNumbers = {"0", "-1", "1e999", "-1e999", "9223372036854775807", "-9223372036854775808",
                                                  "18446744073709551616", "4294967296", "2147483648", "1e-320", "NaN", "nan",
                                                  "1099511627776", "65536", "0.0", "-0"};
constexpr std::array<char, 12> kBytes = {'\0', '\xff', '\x7f', '\x80', '"', '{', '}', '[', ']', ',', ':', '\\'};

size_t pick(std::mt19937_64& rng, size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng() % n); }

// The span of the decimal number around or after position p, if any.
bool number_at(const std::string& s, size_t p, size_t& b, size_t& e) {
  auto digit = [&](size_t i) { return i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.' || s[i] == '-' || s[i] == 'e'); };
  while (p < s.size() && !std::isdigit(static_cast<unsigned char>(s[p]))) ++p;
  if (p >= s.size()) return false;
  b = e = p;
  while (b > 0 && digit(b - 1)) --b;
  while (digit(e)) ++e;
  return true;
}

// For JSON inputs: one leaf (a key path of the flattened document) given a value at the edge of
// what a reader expects, another type, or removed, so that the mutant still parses and reaches the
// checks behind the parser. Returns false when `s` is not JSON.
bool mutate_json(std::string& s, std::mt19937_64& rng) {
  using Json = nlohmann::ordered_json;
  // flatten() recurses per level: a document deeper than the readers' budget (a seed that tests it)
  // is left to the byte edits.
  Json j;
  try {
    j = Json::parse(s, json_nesting_limit<Json>(Limits{}.nesting), false);
  } catch (const JsonTooDeep&) {
    return false;
  }
  if (j.is_discarded() || !j.is_structured()) return false;
  Json flat = j.flatten();
  if (flat.empty()) return false;
  auto it = flat.begin();
  std::advance(it, static_cast<std::ptrdiff_t>(pick(rng, flat.size())));
  static const std::array<Json, 22> kValues = {
      Json(0), Json(-1), Json(1), Json(2), Json(std::numeric_limits<int64_t>::max()), Json(std::numeric_limits<int64_t>::min()),
      Json(std::numeric_limits<uint64_t>::max()), Json(int64_t{1} << 40), Json(int64_t{1} << 31), Json(1e308), Json(-1e308),
      Json(1e-320), Json(0.5), Json(-0.0), Json(""), Json("x"), Json(nullptr), Json(true), Json(false), Json::array(),
      Json::object(), Json(std::string(300, 'a'))};
  switch (rng() % 4) {
    case 0:
      flat.erase(it);
      break;
    case 1:
      if (it->is_number()) *it = it->get<double>() * (rng() % 2 ? 1000.0 : -1.0);
      else *it = kValues[pick(rng, kValues.size())];
      break;
    default:
      *it = kValues[pick(rng, kValues.size())];
  }
  try {
    s = flat.unflatten().dump(rng() % 2 ? 2 : -1);
  } catch (const Json::exception&) {
    return false;
  }
  return true;
}

}  // namespace

std::string mutate(const std::string& in, const std::vector<std::string>& seeds, std::mt19937_64& rng) {
  std::string s = in;
  if (rng() % 2 == 0 && mutate_json(s, rng)) return s;  // structured half the time, where it applies
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int k = 0; k < edits; ++k) {
    const size_t n = s.size();
    switch (rng() % 9) {
      case 0:  // flip a bit
        if (n) s[pick(rng, n)] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // an interesting byte
        if (n) s[pick(rng, n)] = kBytes[pick(rng, kBytes.size())];
        break;
      case 2: {  // insert random bytes
        std::string add(1 + pick(rng, 8), '\0');
        for (char& c : add) c = static_cast<char>(rng());
        s.insert(pick(rng, n + 1), add);
        break;
      }
      case 3:  // delete a range
        if (n) {
          const size_t b = pick(rng, n);
          s.erase(b, 1 + pick(rng, std::min<size_t>(n - b, 64)));
        }
        break;
      case 4:  // copy a range elsewhere
        if (n) {
          const size_t b = pick(rng, n), len = 1 + pick(rng, std::min<size_t>(n - b, 64));
          s.insert(pick(rng, n + 1), s.substr(b, len));
        }
        break;
      case 5: {  // a number at the edge of its type
        size_t b = 0, e = 0;
        if (n && number_at(s, pick(rng, n), b, e)) s.replace(b, e - b, kNumbers[pick(rng, kNumbers.size())]);
        break;
      }
      case 6:  // truncate
        if (n) s.resize(pick(rng, n));
        break;
      case 7: {  // splice with another seed
        if (seeds.empty()) break;
        const std::string& o = seeds[pick(rng, seeds.size())];
        const size_t cut = pick(rng, n + 1), from = pick(rng, o.size() + 1);
        s = s.substr(0, cut) + o.substr(from);
        break;
      }
      default:  // overwrite 1-8 bytes with random ones
        if (n) {
          const size_t b = pick(rng, n);
          for (size_t i = b; i < std::min(n, b + 1 + pick(rng, 8)); ++i) s[i] = static_cast<char>(rng());
        }
        break;
    }
  }
  return s;
}

}  // namespace megatrain::fuzz

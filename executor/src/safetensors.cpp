// safetensors reading (strict validation, pread on demand), atomic writing (core's AtomicFile: temp
// file, fsync, rename, fsync of the directory) and resolution of Hugging Face checkpoint folders,
// single file or sharded.
#include "megatrain/executor/safetensors.h"
#include "megatrain/core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "megatrain/core/durable_file.h"

namespace megatrain::exec {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

using Json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; a larger length is corruption, and the
// limit keeps a garbage length from making us allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Element sizes of every dtype the format defines, so files holding tensors we never convert
// (an int64 buffer, say) still validate.
std::optional<size_t> element_bytes_of(std::string_view dtype) {
  static const std::pair<std::string_view, size_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  for (const auto& [name, bytes] : kSizes)
    if (name == dtype) return bytes;
  return std::nullopt;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel of a shape, or nullopt on a negative dimension or int64 overflow.
std::optional<int64_t> numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return std::nullopt;
    n *= d;
  }
  return n;
}

bool is_non_negative_integer(const Json& j) {
  return j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0);
}

Status pread_all(int fd, void* out, size_t bytes, uint64_t offset, const std::string& what) {
  auto* p = static_cast<uint8_t*>(out);
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = file_io().pread(fd, p + done, bytes - done, static_cast<int64_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("cannot read " + what + ": " + std::strerror(errno));
    }
    if (n == 0) return corrupt(what + ": the file ended early (truncated while open?)");
    done += static_cast<size_t>(n);
  }
  return {};
}

}  // namespace

// ---- scalar conversions -----------------------------------------------------------------------

// fp32 <-> bf16 are inline in bf16.h (the optimizer converts every parameter it writes).

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // Zero or subnormal: mant x 2^-24 is exact in fp32.
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const int32_t exp = static_cast<int32_t>((bits >> 23) & 0xFFu);
  const uint32_t mant = bits & 0x7FFFFFu;
  if (exp == 255) return static_cast<uint16_t>(sign | 0x7C00u | (mant ? 0x200u | (mant >> 13) : 0u));
  const int32_t e = exp - 127 + 15;  // the fp16 biased exponent
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7C00u);  // too large: infinity
  if (e >= 1) {
    uint32_t half = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry into the exponent is right
    return static_cast<uint16_t>(sign | half);
  }
  // Subnormal result: the value in units of 2^-24 is m >> (14 - e), with m the 24-bit significand.
  const int32_t shift = 14 - e;
  if (shift > 24) return sign;  // below half the smallest subnormal
  const uint32_t m = mant | 0x800000u;
  uint32_t half = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

const char* safetensors_dtype_name(DType d) {
  switch (d) {
    case DType::kFp32: return "F32";
    case DType::kBf16: return "BF16";
    case DType::kFp16: return "F16";
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  if (s == "F32") return DType::kFp32;
  if (s == "BF16") return DType::kBf16;
  if (s == "F16") return DType::kFp16;
  return std::nullopt;
}

// ---- reader -----------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this == &o) return *this;
  if (fd_ >= 0) file_io().close(fd_);
  path_ = std::move(o.path_);
  fd_ = o.fd_;
  file_bytes_ = o.file_bytes_;
  data_start_ = o.data_start_;
  entries_ = std::move(o.entries_);
  index_ = std::move(o.index_);
  metadata_ = std::move(o.metadata_);
  o.fd_ = -1;
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) file_io().close(fd_);
}

Result<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found("safetensors file '" + name + "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument("'" + name + "' is a directory; expected a .safetensors file");

  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = file_io().open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (f.fd_ < 0) return io_error("cannot open safetensors file '" + name + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0) return io_error("cannot stat '" + name + "': " + std::strerror(errno));
  f.file_bytes_ = static_cast<uint64_t>(st.st_size);
  auto bad = [&](const std::string& why) { return corrupt("safetensors file '" + name + "': " + why); };

  if (f.file_bytes_ < 8)
    return bad(std::to_string(f.file_bytes_) + " bytes; a safetensors file starts with an 8-byte header length");
  uint64_t header_len = 0;
  MT_RETURN_IF_ERROR(pread_all(f.fd_, &header_len, 8, 0, "'" + name + "'"));
  if (header_len > f.file_bytes_ - 8)
    return bad("the header length " + std::to_string(header_len) + " runs past the end of the file (" +
               std::to_string(f.file_bytes_) + " bytes): truncated or not a safetensors file");
  if (header_len > kMaxHeaderBytes)
    return bad("the header length " + std::to_string(header_len) + " exceeds the format's 100 MB limit");
  if (header_len < 2) return bad("the header is " + std::to_string(header_len) + " bytes; expected a JSON object");
  std::string header(static_cast<size_t>(header_len), '\0');
  MT_RETURN_IF_ERROR(pread_all(f.fd_, header.data(), header.size(), 8, "'" + name + "'"));
  f.data_start_ = 8 + header_len;
  const uint64_t data_bytes = f.file_bytes_ - f.data_start_;
  if (header[0] != '{') return bad("the header does not start with '{'; expected a JSON object");

  // nlohmann keeps the last of two equal keys silently; the callback sees every key of every object,
  // so duplicates (two tensors of one name) are caught here.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  Json j;
  try {
    j = Json::parse(header, [&](int, Json::parse_event_t ev, Json& parsed) {
      if (ev == Json::parse_event_t::object_start) open_objects.emplace_back();
      else if (ev == Json::parse_event_t::object_end && !open_objects.empty()) open_objects.pop_back();
      else if (ev == Json::parse_event_t::key && !open_objects.empty() &&
               !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const Json::exception& e) {
    return bad("the header is not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!duplicate.empty()) return bad("the header names '" + duplicate + "' twice");
  if (!j.is_object()) return bad("the header is not a JSON object");

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const Json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return bad("__metadata__." + m.key() + " is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto where = [&](const std::string& why) { return bad("tensor '" + key + "': " + why); };
    if (!v.is_object()) return where("expected an object with dtype, shape and data_offsets");
    for (auto m = v.begin(); m != v.end(); ++m)
      if (m.key() != "dtype" && m.key() != "shape" && m.key() != "data_offsets")
        return where("unknown field '" + m.key() + "'; expected dtype, shape, data_offsets");
    SafetensorsEntry e;
    e.name = key;
    if (!v.contains("dtype") || !v["dtype"].is_string()) return where("dtype is missing or not a string");
    e.dtype = v["dtype"].get<std::string>();
    auto eb = element_bytes_of(e.dtype);
    if (!eb)
      return unsupported("safetensors file '" + name + "': tensor '" + key + "': dtype '" + e.dtype +
                         "' is not one the format defines (F32, BF16, F16, F64, I64, I32, I16, I8, U8, ...)");
    e.element_bytes = *eb;
    if (!v.contains("shape") || !v["shape"].is_array()) return where("shape is missing or not an array");
    for (const Json& d : v["shape"]) {
      if (!is_non_negative_integer(d) || d.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()})
        return where("shape " + v["shape"].dump() + " holds something other than non-negative integers");
      e.shape.push_back(d.get<int64_t>());
    }
    auto n = numel_of(e.shape);
    if (!n) return where("shape " + shape_text(e.shape) + " has more elements than 2^63");
    e.numel = *n;
    const Json* off = v.contains("data_offsets") ? &v["data_offsets"] : nullptr;
    if (!off || !off->is_array() || off->size() != 2 || !is_non_negative_integer((*off)[0]) ||
        !is_non_negative_integer((*off)[1]))
      return where("data_offsets must be [begin, end] with non-negative integers");
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.end < e.begin)
      return where("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "] end before they begin");
    if (e.end > data_bytes)
      return where("data ends at byte " + std::to_string(e.end) + " of the data section, which holds " +
                   std::to_string(data_bytes) + " bytes (truncated file?)");
    const uint64_t want = static_cast<uint64_t>(e.numel) * e.element_bytes;
    if (e.numel > 0 && want / e.element_bytes != static_cast<uint64_t>(e.numel))
      return where("size overflows");
    if (e.end - e.begin != want)
      return where(std::to_string(e.end - e.begin) + " bytes of data, but shape " + shape_text(e.shape) + " of " +
                   e.dtype + " needs " + std::to_string(want));
    f.entries_.push_back(std::move(e));
  }

  // The reference implementation requires the tensors to tile the data section exactly; so do we.
  std::sort(f.entries_.begin(), f.entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : f.entries_) {
    if (e.begin < cursor)
      return bad("tensors '" + prev->name + "' [" + std::to_string(prev->begin) + ", " + std::to_string(prev->end) +
                 ") and '" + e.name + "' [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") overlap");
    if (e.begin > cursor)
      return bad("bytes [" + std::to_string(cursor) + ", " + std::to_string(e.begin) + ") of the data section belong "
                 "to no tensor (a hole before '" + e.name + "')");
    cursor = e.end;
    prev = &e;
  }
  if (cursor != data_bytes)
    return bad(std::to_string(data_bytes - cursor) + " bytes follow the last tensor's data; expected the file to end at "
               "byte " + std::to_string(f.data_start_ + cursor));
  for (size_t i = 0; i < f.entries_.size(); ++i) f.index_.emplace(f.entries_[i].name, i);
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

Status SafetensorsFile::read_raw(const SafetensorsEntry& e, void* out, size_t out_bytes) const {
  if (out_bytes != e.end - e.begin)
    return invalid_argument("tensor '" + e.name + "' in '" + path_.string() + "' holds " +
                            std::to_string(e.end - e.begin) + " bytes; the destination has " + std::to_string(out_bytes));
  return pread_all(fd_, out, out_bytes, data_start_ + e.begin, "tensor '" + e.name + "' of '" + path_.string() + "'");
}

Status SafetensorsFile::read_raw_range(const SafetensorsEntry& e, uint64_t offset, void* out, size_t bytes) const {
  if (offset > e.end - e.begin || bytes > e.end - e.begin - offset)
    return invalid_argument("tensor '" + e.name + "' in '" + path_.string() + "' holds " +
                            std::to_string(e.end - e.begin) + " bytes; bytes [" + std::to_string(offset) + ", " +
                            std::to_string(offset + bytes) + ") were asked for");
  return pread_all(fd_, out, bytes, data_start_ + e.begin + offset, "tensor '" + e.name + "' of '" + path_.string() + "'");
}

Status SafetensorsFile::read_fp32(const SafetensorsEntry& e, float* out, int64_t out_numel) const {
  if (out_numel != e.numel)
    return invalid_argument("tensor '" + e.name + "' in '" + path_.string() + "' has " + std::to_string(e.numel) +
                            " elements; the destination has " + std::to_string(out_numel));
  auto d = dtype_from_safetensors(e.dtype);
  if (!d)
    return unsupported("tensor '" + e.name + "' in '" + path_.string() + "' is " + e.dtype +
                       "; only F32, BF16 and F16 convert to fp32");
  const std::string what = "tensor '" + e.name + "' of '" + path_.string() + "'";
  if (*d == DType::kFp32) return pread_all(fd_, out, static_cast<size_t>(e.numel) * 4, data_start_ + e.begin, what);
  // Half-width types go through a bounded buffer so a huge tensor costs no second full copy.
  constexpr int64_t kChunk = 1 << 20;
  std::vector<uint16_t> buf(static_cast<size_t>(std::min<int64_t>(kChunk, std::max<int64_t>(e.numel, 1))));
  for (int64_t i = 0; i < e.numel; i += kChunk) {
    const int64_t n = std::min(kChunk, e.numel - i);
    MT_RETURN_IF_ERROR(pread_all(fd_, buf.data(), static_cast<size_t>(n) * 2,
                                 data_start_ + e.begin + static_cast<uint64_t>(i) * 2, what));
    if (*d == DType::kBf16)
      for (int64_t k = 0; k < n; ++k) out[i + k] = bf16_to_fp32(buf[static_cast<size_t>(k)]);
    else
      for (int64_t k = 0; k < n; ++k) out[i + k] = fp16_to_fp32(buf[static_cast<size_t>(k)]);
  }
  return {};
}

Status SafetensorsFile::read_raw(const SafetensorsEntry& e, std::string_view dtype, void* out, size_t out_bytes) const {
  if (e.dtype != dtype)
    return invalid_argument("tensor '" + e.name + "' in '" + path_.string() + "' is " + e.dtype + "; expected " +
                            std::string(dtype));
  return read_raw(e, out, out_bytes);
}

Result<std::vector<float>> SafetensorsFile::read_fp32(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) return not_found("safetensors file '" + path_.string() + "' has no tensor '" + std::string(name) + "'");
  std::vector<float> out(static_cast<size_t>(e->numel));
  MT_RETURN_IF_ERROR(read_fp32(*e, out.data(), e->numel));
  return out;
}

// ---- writer -----------------------------------------------------------------------------------

std::optional<size_t> safetensors_element_bytes(std::string_view dtype) { return element_bytes_of(dtype); }

TensorToWrite raw_tensor(std::string name, std::vector<int64_t> shape, const void* data, std::string dtype) {
  TensorToWrite t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.data = data;
  t.raw_dtype = std::move(dtype);
  return t;
}

namespace {

// Writes one tensor's values, converting through a bounded buffer when source and stored differ.
Status write_tensor_data(AtomicFile& out, const TensorToWrite& t, int64_t numel) {
  if (numel == 0) return {};
  if (!t.raw_dtype.empty())
    return out.write(t.data, static_cast<size_t>(numel) * *element_bytes_of(t.raw_dtype));
  if (t.source == t.stored)
    return out.write(t.data, static_cast<size_t>(numel) * dtype_bytes(t.stored));
  constexpr int64_t kChunk = 1 << 20;
  if (t.source == DType::kFp32) {
    const auto* src = static_cast<const float*>(t.data);
    std::vector<uint16_t> buf(static_cast<size_t>(std::min(kChunk, numel)));
    for (int64_t i = 0; i < numel; i += kChunk) {
      const int64_t n = std::min(kChunk, numel - i);
      for (int64_t k = 0; k < n; ++k)
        buf[static_cast<size_t>(k)] = t.stored == DType::kBf16 ? fp32_to_bf16(src[i + k]) : fp32_to_fp16(src[i + k]);
      MT_RETURN_IF_ERROR(out.write(buf.data(), static_cast<size_t>(n) * 2));
    }
    return {};
  }
  // Half-width source widened to fp32.
  const auto* src = static_cast<const uint16_t*>(t.data);
  std::vector<float> buf(static_cast<size_t>(std::min(kChunk, numel)));
  for (int64_t i = 0; i < numel; i += kChunk) {
    const int64_t n = std::min(kChunk, numel - i);
    for (int64_t k = 0; k < n; ++k)
      buf[static_cast<size_t>(k)] = t.source == DType::kBf16 ? bf16_to_fp32(src[i + k]) : fp16_to_fp32(src[i + k]);
    MT_RETURN_IF_ERROR(out.write(buf.data(), static_cast<size_t>(n) * 4));
  }
  return {};
}

}  // namespace

Status write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  const std::string target = path.string();
  // Everything that can be wrong with the request is checked before any file is touched.
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  if (!metadata.count("format")) meta["format"] = "pt";
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::vector<int64_t> numels;
  std::vector<uint64_t> sizes;  // bytes per tensor (a produced tensor's bound until it is made)
  std::vector<const char*> dtypes;
  std::set<std::string> names;
  bool produced = false;
  for (const auto& t : tensors) {
    const std::string where = "writing '" + target + "': tensor '" + t.name + "': ";
    if (t.name.empty() || t.name == "__metadata__")
      return invalid_argument(where + "the name is empty or reserved (__metadata__)");
    if (!names.insert(t.name).second) return invalid_argument(where + "the name appears twice");
    if (t.produce) {
      if (t.raw_dtype != "U8") return invalid_argument(where + "produced bytes must be written as raw_dtype U8");
      if (t.max_bytes > (uint64_t{1} << 62)) return invalid_argument(where + "max_bytes is implausible");
      produced = true;
      numels.push_back(static_cast<int64_t>(t.max_bytes));
      sizes.push_back(t.max_bytes);
      dtypes.push_back("U8");
      continue;
    }
    auto n = numel_of(t.shape);
    if (!n) return invalid_argument(where + "shape " + shape_text(t.shape) + " has a negative or overflowing dimension");
    if (*n > 0 && t.data == nullptr && !t.fetch) return invalid_argument(where + "no data");
    if (!t.raw_dtype.empty()) {
      const auto eb = element_bytes_of(t.raw_dtype);
      if (!eb) return invalid_argument(where + "'" + t.raw_dtype + "' is not a safetensors dtype");
      sizes.push_back(static_cast<uint64_t>(*n) * *eb);
      numels.push_back(*n);
      dtypes.push_back(t.raw_dtype.c_str());
      continue;
    }
    if (t.source != t.stored && t.source != DType::kFp32 && t.stored != DType::kFp32)
      return invalid_argument(where + std::string("cannot convert ") + dtype_name(t.source) + " to " +
                              dtype_name(t.stored) + "; supported: equal types, fp32 <-> bf16, fp32 <-> fp16");
    sizes.push_back(static_cast<uint64_t>(*n) * dtype_bytes(t.stored));
    numels.push_back(*n);
    dtypes.push_back(safetensors_dtype_name(t.stored));
  }
  // The header for the given sizes. A produced tensor's shape is [its size]; with every size at or
  // below its bound no number gets longer, so the header made from the bounds is the longest.
  auto header_text = [&](const std::vector<uint64_t>& sz) -> Result<std::string> {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    header["__metadata__"] = meta;
    uint64_t offset = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorToWrite& t = tensors[i];
      const std::vector<int64_t> shape = t.produce ? std::vector<int64_t>{static_cast<int64_t>(sz[i])} : t.shape;
      header[t.name] = {{"dtype", dtypes[i]}, {"shape", shape}, {"data_offsets", {offset, offset + sz[i]}}};
      offset += sz[i];
    }
    try {
      return header.dump();
    } catch (const nlohmann::json::exception& e) {
      return invalid_argument("writing '" + target + "': a tensor name or metadata value is not valid UTF-8 (" +
                              std::string(e.what()) + ")");
    }
  };
  MT_ASSIGN_OR_RETURN(std::string text, header_text(sizes));
  // Spaces after the JSON are allowed by the format; they make the data section start 8-byte aligned.
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  const uint64_t header_len = text.size();

  // The bytes go to a temporary beside `path` that replaces it only once complete (durable_file.h);
  // an early return discards the temporary.
  MT_ASSIGN_OR_RETURN(AtomicFile out, AtomicFile::create(path));
  MT_RETURN_IF_ERROR(out.write(&header_len, 8));
  MT_RETURN_IF_ERROR(out.write(text.data(), text.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].produce) {
      MT_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, tensors[i].produce());
      if (bytes.size() > tensors[i].max_bytes)
        return internal_error("writing '" + target + "': tensor '" + tensors[i].name + "' came to " +
                              std::to_string(bytes.size()) + " bytes, over its bound of " +
                              std::to_string(tensors[i].max_bytes));
      sizes[i] = bytes.size();
      MT_RETURN_IF_ERROR(out.write(bytes.data(), bytes.size()));
      continue;
    }
    if (!tensors[i].fetch) {
      MT_RETURN_IF_ERROR(write_tensor_data(out, tensors[i], numels[i]));
      continue;
    }
    TensorToWrite t = tensors[i];
    MT_ASSIGN_OR_RETURN(t.data, tensors[i].fetch());
    MT_RETURN_IF_ERROR(write_tensor_data(out, t, numels[i]));
  }
  if (produced) {
    // The real sizes are known: the header is rewritten in place, padded to its reserved length.
    MT_ASSIGN_OR_RETURN(std::string real, header_text(sizes));
    if (real.size() > header_len)
      return internal_error("writing '" + target + "': the final header outgrew the room reserved for it");
    real.resize(header_len, ' ');
    MT_RETURN_IF_ERROR(out.write_at(8, real.data(), real.size()));
  }
  return out.commit();
}

// ---- MXFP4 ------------------------------------------------------------------------------------

Result<Mxfp4Shapes> mxfp4_shapes(const std::string& name, const std::vector<int64_t>& shape) {
  if (shape.size() != 3 || shape[0] < 0 || shape[1] < 0 || shape[2] < 0)
    return invalid_argument("tensor '" + name + "' has shape " + shape_text(shape) +
                            "; MXFP4 storage is defined for the stacked expert tensors [experts, A, B] only");
  if (shape[1] % kMxfp4BlockValues != 0)
    return invalid_argument("tensor '" + name + "' has shape " + shape_text(shape) + ": its axis 1 (" +
                            std::to_string(shape[1]) + ") is not a multiple of the MXFP4 block of 32 values");
  const int64_t g = shape[1] / kMxfp4BlockValues;
  return Mxfp4Shapes{{shape[0], shape[2], g, kMxfp4BlockValues / 2}, {shape[0], shape[2], g}};
}

Status dequantize_mxfp4_expert(const uint8_t* blocks, const uint8_t* scales, int64_t a, int64_t b, float* out,
                               const std::string& what) {
  const int64_t groups = a / kMxfp4BlockValues;
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t s = scales[r * groups + g];
      if (s == 255)
        return invalid_argument(what + ": row " + std::to_string(r) + ", block " + std::to_string(g) +
                                ": scale byte 255 is E8M0's NaN; accepted scales are 0..254");
      const int exp = static_cast<int>(s) - 127;
      const uint8_t* q = blocks + (r * groups + g) * (kMxfp4BlockValues / 2);
      float* col = out + (g * kMxfp4BlockValues) * b + r;  // out[32 g + i, r], row stride b
      for (int64_t j = 0; j < kMxfp4BlockValues / 2; ++j) {
        const float lo = std::ldexp(kMxfp4Values[q[j] & 0x0F], exp);
        const float hi = std::ldexp(kMxfp4Values[q[j] >> 4], exp);
        if (!std::isfinite(lo) || !std::isfinite(hi))
          return invalid_argument(what + ": row " + std::to_string(r) + ", block " + std::to_string(g) + ": scale 2^" +
                                  std::to_string(exp) + " times the code's value overflows fp32");
        col[(2 * j) * b] = lo;
        col[(2 * j + 1) * b] = hi;
      }
    }
  }
  return {};
}

// ---- FP8 e4m3, block-scaled ---------------------------------------------------------------------

float fp8_e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0x0F, man = b & 0x07;
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  if (exp == 0x0F && man == 0x07) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);  // subnormal: m / 8 * 2^-6
  return sign * std::ldexp(static_cast<float>(8 + man), exp - 10);    // (1 + m / 8) * 2^(e - 7)
}

std::string fp8_scale_name(const std::string& weight) { return weight + "_scale_inv"; }

// ---- Hugging Face checkpoints -----------------------------------------------------------------

namespace {

Result<Json> read_index(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return io_error("cannot open '" + p.string() + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  try {
    return Json::parse(ss.str());
  } catch (const Json::exception& e) {
    return corrupt("checkpoint index '" + p.string() + "' is not valid JSON (" + std::string(e.what()) + ")");
  }
}

}  // namespace

Result<HfCheckpoint> HfCheckpoint::open(const std::filesystem::path& folder_or_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p = folder_or_file;
  if (!fs::exists(p, ec)) return not_found("checkpoint '" + p.string() + "' does not exist");

  fs::path single, index;
  if (fs::is_directory(p, ec)) {
    if (fs::is_regular_file(p / "model.safetensors", ec)) single = p / "model.safetensors";
    else if (fs::is_regular_file(p / "model.safetensors.index.json", ec)) index = p / "model.safetensors.index.json";
    else {
      for (const char* name : {"model.safetensors", "model.safetensors.index.json"})
        if (fs::exists(p / name, ec))
          return invalid_argument("checkpoint folder '" + p.string() + "': " + name +
                                  " is not a regular file (a FIFO, device or folder); expected the file itself");
      std::string hint;
      if (fs::exists(p / "pytorch_model.bin", ec) || fs::exists(p / "pytorch_model.bin.index.json", ec))
        hint = "; only PyTorch .bin weights are there: convert them to safetensors";
      return not_found("checkpoint folder '" + p.string() +
                       "' holds neither model.safetensors nor model.safetensors.index.json" + hint);
    }
  } else if (p.extension() == ".json") {
    index = p;
  } else {
    single = p;
  }

  HfCheckpoint c;
  if (!single.empty()) {
    MT_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(single));
    c.metadata_ = f.metadata();
    for (const auto& e : f.entries()) {
      c.tensors_[e.name] = Location{single, e};
      c.file_of_[e.name] = 0;
    }
    c.file_paths_.push_back(single);
    c.files_.push_back(std::move(f));
    return c;
  }

  MT_ASSIGN_OR_RETURN(Json j, read_index(index));
  const std::string iname = "checkpoint index '" + index.string() + "'";
  if (!j.is_object()) return corrupt(iname + " is not a JSON object");
  if (j.contains("metadata")) {
    if (!j["metadata"].is_object()) return corrupt(iname + ": metadata is not an object");
    for (auto it = j["metadata"].begin(); it != j["metadata"].end(); ++it)
      c.metadata_[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    return corrupt(iname + ": weight_map is missing or not an object of tensor name -> shard file");
  std::map<std::string, size_t> shard_index;
  const fs::path base = index.parent_path();
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) return corrupt(iname + ": weight_map." + it.key() + " is not a file name");
    const std::string shard = it.value().get<std::string>();
    const fs::path rel(shard);
    bool escapes = shard.empty() || rel.is_absolute();
    for (const auto& part : rel) escapes = escapes || part == "..";
    if (escapes)
      return corrupt(iname + ": weight_map." + it.key() + " = '" + shard +
                     "' is not a file name inside the checkpoint folder");
    auto [pos, fresh] = shard_index.emplace(shard, c.files_.size());
    if (fresh) {
      const fs::path sp = base / rel;
      if (!fs::exists(sp, ec))
        return not_found(iname + " names shard '" + shard + "', which is not in '" + base.string() + "'");
      MT_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(sp));
      c.file_paths_.push_back(sp);
      c.files_.push_back(std::move(f));
    }
    const SafetensorsFile& f = c.files_[pos->second];
    const SafetensorsEntry* e = f.find(it.key());
    if (!e)
      return corrupt(iname + " places '" + it.key() + "' in shard '" + shard + "', which has no such tensor");
    c.tensors_[it.key()] = Location{f.path(), *e};
    c.file_of_[it.key()] = pos->second;
  }
  return c;
}

Result<std::vector<float>> HfCheckpoint::load_fp32(const std::string& name) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) return not_found("the checkpoint has no tensor '" + name + "'");
  return files_[it->second].read_fp32(name);
}

Status HfCheckpoint::load_fp32(const std::string& name, const std::vector<int64_t>& expected_shape, float* out) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end())
    return not_found("the checkpoint (" + (file_paths_.empty() ? std::string("?") : file_paths_[0].string()) +
                     (file_paths_.size() > 1 ? " and other shards" : "") + ") has no tensor '" + name + "'");
  const SafetensorsFile& f = files_[it->second];
  const SafetensorsEntry* e = f.find(name);
  if (e->shape != expected_shape)
    return invalid_argument("tensor '" + name + "' in '" + f.path().string() + "' has shape " + shape_text(e->shape) +
                            "; the model expects " + shape_text(expected_shape) + " (a checkpoint of another model?)");
  return f.read_fp32(*e, out, e->numel);
}

bool HfCheckpoint::has_mxfp4(const std::string& name) const {
  return file_of_.count(name + "_blocks") != 0 || file_of_.count(name + "_scales") != 0;
}

Status HfCheckpoint::load_mxfp4_fp32(const std::string& name, const std::vector<int64_t>& expected_shape,
                                     float* out) const {
  const std::string where = file_paths_.empty() ? std::string("the checkpoint")
                                                : "the checkpoint (" + file_paths_[0].string() +
                                                      (file_paths_.size() > 1 ? " and other shards" : "") + ")";
  MT_ASSIGN_OR_RETURN(Mxfp4Shapes want, mxfp4_shapes(name, expected_shape));
  struct Part {
    std::string name;
    const std::vector<int64_t>* shape;
    const SafetensorsFile* file = nullptr;
    const SafetensorsEntry* entry = nullptr;
  };
  Part parts[2] = {{name + "_blocks", &want.blocks}, {name + "_scales", &want.scales}};
  for (Part& p : parts) {
    auto it = file_of_.find(p.name);
    if (it == file_of_.end())
      return not_found(where + " stores '" + name + "' in MXFP4 but has no tensor '" + p.name +
                       "'; MXFP4 needs both " + name + "_blocks and " + name + "_scales");
    p.file = &files_[it->second];
    p.entry = p.file->find(p.name);
    if (p.entry->dtype != "U8")
      return invalid_argument("tensor '" + p.name + "' in '" + p.file->path().string() + "' is " + p.entry->dtype +
                              "; MXFP4 blocks and scales are U8");
    if (p.entry->shape != *p.shape)
      return invalid_argument("tensor '" + p.name + "' in '" + p.file->path().string() + "' has shape " +
                              shape_text(p.entry->shape) + "; the model's " + name + " " + shape_text(expected_shape) +
                              " in MXFP4 needs " + shape_text(*p.shape) + " (a checkpoint of another model?)");
  }
  const int64_t experts = expected_shape[0], a = expected_shape[1], b = expected_shape[2];
  const size_t block_bytes = static_cast<size_t>(b * (a / kMxfp4BlockValues) * (kMxfp4BlockValues / 2));
  const size_t scale_bytes = static_cast<size_t>(b * (a / kMxfp4BlockValues));
  std::vector<uint8_t> blocks(block_bytes), scales(scale_bytes);
  for (int64_t e = 0; e < experts; ++e) {
    MT_RETURN_IF_ERROR(parts[0].file->read_raw_range(*parts[0].entry, static_cast<uint64_t>(e) * block_bytes,
                                                     blocks.data(), block_bytes));
    MT_RETURN_IF_ERROR(parts[1].file->read_raw_range(*parts[1].entry, static_cast<uint64_t>(e) * scale_bytes,
                                                     scales.data(), scale_bytes));
    MT_RETURN_IF_ERROR(dequantize_mxfp4_expert(blocks.data(), scales.data(), a, b, out + e * a * b,
                                               "MXFP4 tensor '" + name + "' in '" + parts[0].file->path().string() +
                                                   "', expert " + std::to_string(e)));
  }
  return {};
}

bool HfCheckpoint::has_fp8_blocks(const std::string& name) const {
  auto it = tensors_.find(name);
  return it != tensors_.end() && it->second.entry.dtype == "F8_E4M3" && file_of_.count(fp8_scale_name(name)) != 0;
}

Status HfCheckpoint::load_fp8_blocks_fp32(const std::string& name, const std::vector<int64_t>& expected_shape,
                                         float* out) const {
  auto wi = file_of_.find(name);
  if (wi == file_of_.end()) return not_found("the checkpoint has no tensor '" + name + "'");
  const SafetensorsFile& wf = files_[wi->second];
  const SafetensorsEntry& we = *wf.find(name);
  const std::string scale = fp8_scale_name(name);
  if (we.dtype != "F8_E4M3")
    return invalid_argument("tensor '" + name + "' in '" + wf.path().string() + "' is " + we.dtype +
                            "; block-scaled FP8 weights are F8_E4M3");
  if (expected_shape.size() != 2 || we.shape != expected_shape)
    return invalid_argument("tensor '" + name + "' in '" + wf.path().string() + "' has shape " + shape_text(we.shape) +
                            "; the model expects " + shape_text(expected_shape) +
                            (expected_shape.size() != 2 ? " (block-scaled FP8 is defined for matrices only)" : " (a checkpoint of another model?)"));
  auto si = file_of_.find(scale);
  if (si == file_of_.end())
    return not_found("tensor '" + name + "' in '" + wf.path().string() + "' is F8_E4M3 but the checkpoint has no '" + scale +
                     "' (its 128 x 128 block scales)");
  const SafetensorsFile& sf = files_[si->second];
  const SafetensorsEntry& se = *sf.find(scale);
  const int64_t rows = expected_shape[0], cols = expected_shape[1];
  const int64_t brows = (rows + kFp8Block - 1) / kFp8Block, bcols = (cols + kFp8Block - 1) / kFp8Block;
  if (se.dtype != "F32" || se.shape != std::vector<int64_t>{brows, bcols})
    return invalid_argument("tensor '" + scale + "' in '" + sf.path().string() + "' is " + se.dtype + " " + shape_text(se.shape) +
                            "; the scales of " + name + " " + shape_text(expected_shape) + " are F32 [" + std::to_string(brows) +
                            ", " + std::to_string(bcols) + "] (one per 128 x 128 block)");
  std::vector<float> scales(static_cast<size_t>(brows * bcols));
  MT_RETURN_IF_ERROR(sf.read_raw_range(se, 0, scales.data(), scales.size() * sizeof(float)));
  std::vector<uint8_t> q(static_cast<size_t>(std::min(rows, kFp8Block) * cols));
  for (int64_t br = 0; br < brows; ++br) {
    const int64_t r0 = br * kFp8Block, n = std::min(kFp8Block, rows - r0);
    MT_RETURN_IF_ERROR(wf.read_raw_range(we, static_cast<uint64_t>(r0 * cols), q.data(), static_cast<size_t>(n * cols)));
    for (int64_t bc = 0; bc < bcols; ++bc) {
      const float sc = scales[static_cast<size_t>(br * bcols + bc)];
      if (!std::isfinite(sc))
        return invalid_argument("tensor '" + scale + "' in '" + sf.path().string() + "': block [" + std::to_string(br) + ", " +
                                std::to_string(bc) + "] has a scale that is not finite");
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const uint8_t b = q[static_cast<size_t>(i * cols + j)];
        if ((b & 0x7F) == 0x7F)
          return invalid_argument("tensor '" + name + "' in '" + wf.path().string() + "': element [" + std::to_string(r0 + i) +
                                  ", " + std::to_string(j) + "] is FP8's NaN (0x" + (b == 0xFF ? "FF" : "7F") +
                                  "); training from it would give NaN losses");
        out[(r0 + i) * cols + j] = fp8_e4m3_to_float(b) * scales[static_cast<size_t>(br * bcols + j / kFp8Block)];
      }
  }
  return {};
}

}  // namespace megatrain::exec

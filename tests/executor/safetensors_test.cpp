// safetensors: bit-exact round trips, conversions, files checked by an independent Python parser (and
// torch when present) in both directions, every corruption refused, atomic writes, sharded folders.
#include "megatrain/executor/safetensors.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <thread>

#include "executor/faulty_io.h"
#include "executor/file_test_util.h"

namespace megatrain::exec {
namespace {

using test::append_pod;
using test::read_bytes;
using test::ScratchDir;
using test::write_bytes;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b;
  for (float f : v) b.push_back(std::bit_cast<uint32_t>(f));
  return b;
}

// Values that catch sloppy copies: signed zero, subnormals, extremes, infinities, NaN with a payload.
std::vector<float> awkward_floats(size_t n, uint32_t seed) {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.5f, std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::infinity(), std::bit_cast<float>(0x7FC12345u), 3.14159265f};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  while (v.size() < n) v.push_back(normal(rng));
  v.resize(n);
  return v;
}

// A safetensors file from a header text and a data section, exactly as given (for corrupt cases).
std::string raw_file(const std::string& header, const std::string& data) {
  std::string s;
  append_pod(s, static_cast<uint64_t>(header.size()));
  return s + header + data;
}

class SafetensorsFixture : public ::testing::Test {
 protected:
  ScratchDir dir{"safetensors"};

  // Writes `header`/`data` and expects open() to fail with `code`; returns the message.
  std::string expect_refused(const std::string& name, const std::string& bytes, StatusCode code = StatusCode::kCorrupt) {
    write_bytes(dir / name, bytes);
    auto f = SafetensorsFile::open(dir / name);
    EXPECT_FALSE(f.ok()) << name << " was accepted";
    if (f.ok()) return "";
    EXPECT_EQ(f.status().code(), code) << name << ": " << f.status().to_string();
    EXPECT_TRUE(contains(f.status().message(), name)) << "the message does not name the file: " << f.status().message();
    return f.status().message();
  }
};

// ---- conversions -------------------------------------------------------------------------------

TEST(Conversions, Bf16RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(fp32_to_bf16(1.0f + 0x1p-8f), 0x3F80);      // halfway, 0x3F80 is even
  EXPECT_EQ(fp32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);  // halfway between 0x3F81 and 0x3F82: even wins
  EXPECT_EQ(fp32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // just above halfway
  EXPECT_EQ(fp32_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to infinity
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(std::bit_cast<float>(0x7F800001u)))));  // NaN stays NaN
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_fp32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(fp32_to_bf16(f), h);
    }
  }
}

TEST(Conversions, Fp16RoundTripsAndRounds) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = fp16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_fp32(fp32_to_fp16(f))));
      continue;
    }
    ASSERT_EQ(fp32_to_fp16(f), h) << "fp16 pattern " << h;
  }
  EXPECT_EQ(fp16_to_fp32(0x3C00), 1.0f);
  EXPECT_EQ(fp16_to_fp32(0x0001), 0x1p-24f);
  EXPECT_EQ(fp16_to_fp32(0x7BFF), 65504.0f);
  EXPECT_EQ(fp32_to_fp16(65519.0f), 0x7BFF);   // below the midpoint to infinity
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);   // the midpoint rounds to even: infinity
  EXPECT_EQ(fp32_to_fp16(0x1p-25f), 0x0000);   // half the smallest subnormal: ties to even (0)
  EXPECT_EQ(fp32_to_fp16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(fp32_to_fp16(0x1.8p-24f), 0x0002); // 1.5 units: ties to even (2)
  EXPECT_EQ(fp32_to_fp16(1.0f + 0x1p-11f), 0x3C00);  // halfway above 1, even
  EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_fp16(0x1p-30f), 0x0000);
  EXPECT_EQ(fp32_to_fp16(0x1.ffcp-15f), 0x0400);  // rounds up out of the subnormals
}

// ---- round trips -------------------------------------------------------------------------------

TEST_F(SafetensorsFixture, F32RoundTripIsBitExact) {
  const auto a = awkward_floats(6 * 7, 1);
  const auto b = awkward_floats(5, 2);
  const auto scalar = std::vector<float>{42.5f};
  std::vector<TensorToWrite> ts = {{"model.layers.0.mlp.up_proj.weight", {6, 7}, a.data()},
                                   {"model.norm.weight", {5}, b.data()},
                                   {"scalar", {}, scalar.data()},
                                   {"empty", {0, 3}, nullptr}};
  ASSERT_TRUE(write_safetensors(dir / "m.safetensors", ts, {{"step", "12"}}).ok());
  auto f = SafetensorsFile::open(dir / "m.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->data_start() % 8, 0u);
  ASSERT_EQ(f->entries().size(), 4u);
  // entries() is in data order, which is the order we wrote.
  EXPECT_EQ(f->entries()[0].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(f->entries()[1].name, "model.norm.weight");
  const auto* e = f->find("model.layers.0.mlp.up_proj.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, "F32");
  EXPECT_EQ(e->shape, (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(e->begin, 0u);
  EXPECT_EQ(e->end, 6u * 7 * 4);
  auto ra = f->read_fp32("model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(ra.ok());
  EXPECT_EQ(bits_of(*ra), bits_of(a));
  EXPECT_EQ(bits_of(*f->read_fp32("model.norm.weight")), bits_of(b));
  EXPECT_EQ(f->find("scalar")->shape.size(), 0u);
  EXPECT_EQ(*f->read_fp32("scalar"), scalar);
  EXPECT_EQ(f->find("empty")->numel, 0);
  EXPECT_TRUE(f->read_fp32("empty")->empty());
  EXPECT_EQ(f->metadata().at("step"), "12");
  EXPECT_EQ(f->metadata().at("format"), "pt");  // added for transformers
  EXPECT_EQ(f->read_fp32("nope").status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsFixture, Bf16RoundTripIsBitExact) {
  std::vector<uint16_t> raw;
  for (uint32_t i = 0; i < 65536; i += 7) raw.push_back(static_cast<uint16_t>(i));
  const auto f32 = awkward_floats(33, 3);
  std::vector<TensorToWrite> ts = {
      {"raw", {static_cast<int64_t>(raw.size())}, raw.data(), DType::kBf16, DType::kBf16},
      {"rounded", {3, 11}, f32.data(), DType::kFp32, DType::kBf16},
      {"widened", {static_cast<int64_t>(raw.size())}, raw.data(), DType::kBf16, DType::kFp32}};
  ASSERT_TRUE(write_safetensors(dir / "b.safetensors", ts).ok());
  auto f = SafetensorsFile::open(dir / "b.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const auto* e = f->find("raw");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, "BF16");
  std::vector<uint16_t> back(raw.size());
  ASSERT_TRUE(f->read_raw(*e, back.data(), back.size() * 2).ok());
  EXPECT_EQ(back, raw);
  EXPECT_FALSE(f->read_raw(*e, back.data(), back.size()).ok());  // wrong destination size

  auto widened = f->read_fp32("raw");
  auto stored_wide = f->read_fp32("widened");
  ASSERT_TRUE(widened.ok() && stored_wide.ok());
  EXPECT_EQ(bits_of(*widened), bits_of(*stored_wide));
  for (size_t i = 0; i < raw.size(); ++i) EXPECT_EQ(std::bit_cast<uint32_t>((*widened)[i]), uint32_t{raw[i]} << 16);

  std::vector<uint16_t> rounded(33);
  ASSERT_TRUE(f->read_raw(*f->find("rounded"), rounded.data(), 66).ok());
  for (size_t i = 0; i < 33; ++i) EXPECT_EQ(rounded[i], fp32_to_bf16(f32[i])) << i;
}

TEST_F(SafetensorsFixture, F16StoredAndWidened) {
  const std::vector<float> v = {1.0f, -2.5f, 65504.0f, 0x1p-24f, 0.1f};
  ASSERT_TRUE(write_safetensors(dir / "h.safetensors", {{"h", {5}, v.data(), DType::kFp32, DType::kFp16}}).ok());
  auto f = SafetensorsFile::open(dir / "h.safetensors");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->find("h")->dtype, "F16");
  auto back = f->read_fp32("h");
  ASSERT_TRUE(back.ok());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ((*back)[i], fp16_to_fp32(fp32_to_fp16(v[i])));
  EXPECT_EQ((*back)[2], 65504.0f);
}

TEST_F(SafetensorsFixture, WriterRefusesBadRequestsBeforeTouchingDisk) {
  const std::vector<float> x = {1, 2};
  const std::vector<uint16_t> h = {1, 2};
  auto expect_invalid = [&](const std::vector<TensorToWrite>& ts) {
    Status s = write_safetensors(dir / "x.safetensors", ts);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  };
  expect_invalid({{"a", {2}, x.data()}, {"a", {2}, x.data()}});
  expect_invalid({{"", {2}, x.data()}});
  expect_invalid({{"__metadata__", {2}, x.data()}});
  expect_invalid({{"a", {-1}, x.data()}});
  expect_invalid({{"a", {2}, nullptr}});
  expect_invalid({{"a", {2}, h.data(), DType::kBf16, DType::kFp16}});
  expect_invalid({{std::string("bad\xff name"), {2}, x.data()}});
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a refused write left files behind";
}

// ---- independent parsers -----------------------------------------------------------------------

TEST_F(SafetensorsFixture, PythonReadsOurFile) {
  if (!test::have_python3()) FAIL() << "the project's Python (" << test::python() << ") is missing (run scripts/python-env.sh): cannot check with an independent parser";
  const std::vector<float> w = {0.5f, -1.25f, 3.0f, 1e-3f, -7.75f, 1e20f};
  const std::vector<float> bf = {1.0f, -2.0f, 0.1f, 300.0f};
  const std::vector<float> hf = {1.0f, -0.5f, 0.1f};
  // Conversion cases for torch: random values of every magnitude, exact ties, overflow, subnormals.
  std::vector<float> many;
  std::mt19937 rng(11);
  for (int i = 0; i < 20000; ++i) {
    uint32_t bits = rng();
    if ((bits & 0x7F800000u) == 0x7F800000u) continue;  // NaN payload rules differ by design
    many.push_back(std::bit_cast<float>(bits));
  }
  for (float x : {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65519.0f, 65520.0f,
                  0x1p-25f, 0x1.8p-25f, 0x1.8p-24f, 0x1.ffcp-15f, 1e-6f, -3e-7f, 70000.0f, 3.4e38f})
    many.push_back(x);
  for (int i = 0; i < 2000; ++i) many.push_back(std::ldexp(static_cast<float>(rng() % 4096) + 0.5f, -10 - i % 20));
  const int64_t n_many = static_cast<int64_t>(many.size());
  ASSERT_TRUE(write_safetensors(dir / "ours.safetensors",
                                {{"model.embed_tokens.weight", {2, 3}, w.data()},
                                 {"model.norm.weight", {4}, bf.data(), DType::kFp32, DType::kBf16},
                                 {"odd", {3}, hf.data(), DType::kFp32, DType::kFp16},
                                 {"after_odd", {1}, w.data()},
                                 {"many_f32", {n_many}, many.data()},
                                 {"many_bf16", {n_many}, many.data(), DType::kFp32, DType::kBf16},
                                 {"many_f16", {n_many}, many.data(), DType::kFp32, DType::kFp16}},
                                {{"step", "7"}})
                  .ok());
  const char* script = R"PY(
import json, struct, sys
path = sys.argv[1]
buf = open(path, "rb").read()
(n,) = struct.unpack("<Q", buf[:8])
assert (8 + n) % 8 == 0, "data section not 8-byte aligned"
header = json.loads(buf[8:8 + n].decode("utf-8"))
data = buf[8 + n:]
assert header["__metadata__"] == {"format": "pt", "step": "7"}, header["__metadata__"]
names = [k for k in header if k != "__metadata__"]
assert sorted(names) == ["after_odd", "many_bf16", "many_f16", "many_f32", "model.embed_tokens.weight", "model.norm.weight", "odd"], names
spans = sorted(tuple(header[k]["data_offsets"]) for k in names)
cursor = 0
for b, e in spans:
    assert b == cursor, ("hole or overlap", spans)
    cursor = e
assert cursor == len(data), "data section size"
def values(name):
    t = header[name]
    b, e = t["data_offsets"]
    raw = data[b:e]
    if t["dtype"] == "F32":
        return list(struct.unpack("<%df" % (len(raw) // 4), raw))
    if t["dtype"] == "F16":
        return list(struct.unpack("<%de" % (len(raw) // 2), raw))
    if t["dtype"] == "BF16":
        hs = struct.unpack("<%dH" % (len(raw) // 2), raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in hs]
    raise AssertionError(t["dtype"])
def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]
e = header["model.embed_tokens.weight"]
assert e["dtype"] == "F32" and e["shape"] == [2, 3], e
assert values("model.embed_tokens.weight") == [f32(x) for x in [0.5, -1.25, 3.0, 1e-3, -7.75, 1e20]]
n = header["model.norm.weight"]
assert n["dtype"] == "BF16" and n["shape"] == [4], n
assert values("model.norm.weight") == [1.0, -2.0, 0.10009765625, 300.0], values("model.norm.weight")
o = header["odd"]
assert o["dtype"] == "F16" and o["shape"] == [3]
assert values("odd") == [1.0, -0.5, struct.unpack("<e", struct.pack("<e", 0.1))[0]], values("odd")
assert header["after_odd"]["data_offsets"] == [38, 42], header["after_odd"]
try:
    import torch
except ImportError:
    print("torch: absent, struct checks only")
    sys.exit(0)
for name, dt in (("model.embed_tokens.weight", torch.float32), ("model.norm.weight", torch.bfloat16), ("odd", torch.float16)):
    t = header[name]
    b, e = t["data_offsets"]
    x = torch.frombuffer(bytearray(data[b:e]), dtype=dt).reshape(t["shape"])
    assert list(x.shape) == t["shape"]
    assert x.float().flatten().tolist() == values(name), (name, x)
def raw_of(name):
    b, e = header[name]["data_offsets"]
    return bytearray(data[b:e])
src = torch.frombuffer(raw_of("many_f32"), dtype=torch.float32)
for name, dt in (("many_bf16", torch.bfloat16), ("many_f16", torch.float16)):
    ours = torch.frombuffer(raw_of(name), dtype=torch.int16)
    theirs = src.to(dt).view(torch.int16)
    bad = (ours != theirs).nonzero().flatten().tolist()
    assert not bad, (name, len(bad), [(src[i].item(), int(ours[i]), int(theirs[i])) for i in bad[:5]])
print("torch: checked, including %d fp32->bf16/fp16 conversions" % src.numel())
)PY";
  auto run = test::run_python(dir.path(), script, "'" + (dir / "ours.safetensors").string() + "'");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::cout << "[python] " << run.output;
}

TEST_F(SafetensorsFixture, WeReadPythonsFile) {
  if (!test::have_python3()) FAIL() << "the project's Python (" << test::python() << ") is missing (run scripts/python-env.sh): cannot make an independent file";
  // Python writes the file (keys in its own order, no padding, data not in header order); we read it.
  const char* script = R"PY(
import json, struct, sys
f32 = struct.pack("<4f", 1.5, -2.25, 1e-8, 65536.0)
f16 = struct.pack("<3e", 0.5, -3.0, 6.0e-8)
bf16 = struct.pack("<2H", 0x3F80, 0xC0A0)
i64 = struct.pack("<2q", 7, -9)
data = bf16 + f32 + i64 + f16
header = {
  "f32": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 20]},
  "__metadata__": {"source": "python"},
  "f16": {"dtype": "F16", "shape": [3], "data_offsets": [36, 42]},
  "bf16": {"data_offsets": [0, 4], "shape": [1, 2], "dtype": "BF16"},
  "ids": {"dtype": "I64", "shape": [2], "data_offsets": [20, 36]},
}
h = json.dumps(header).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + data)
)PY";
  auto run = test::run_python(dir.path(), script, "'" + (dir / "py.safetensors").string() + "'");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto f = SafetensorsFile::open(dir / "py.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->metadata().at("source"), "python");
  EXPECT_EQ(*f->read_fp32("f32"), (std::vector<float>{1.5f, -2.25f, 1e-8f, 65536.0f}));
  EXPECT_EQ(*f->read_fp32("bf16"), (std::vector<float>{1.0f, -5.0f}));
  auto h = f->read_fp32("f16");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ((*h)[0], 0.5f);
  EXPECT_EQ((*h)[1], -3.0f);
  EXPECT_EQ((*h)[2], 0x1p-24f);  // Python packs 6e-8 as the subnormal 1 x 2^-24
  EXPECT_EQ(f->find("bf16")->shape, (std::vector<int64_t>{1, 2}));
  const auto* ids = f->find("ids");
  ASSERT_NE(ids, nullptr);
  EXPECT_EQ(ids->element_bytes, 8u);
  EXPECT_EQ(f->read_fp32("ids").status().code(), StatusCode::kUnsupported);
  std::vector<int64_t> raw(2);
  ASSERT_TRUE(f->read_raw(*ids, raw.data(), 16).ok());
  EXPECT_EQ(raw, (std::vector<int64_t>{7, -9}));
}

// ---- corruption --------------------------------------------------------------------------------

TEST_F(SafetensorsFixture, TruncatedDataIsCorrupt) {
  const auto v = awkward_floats(64, 4);
  ASSERT_TRUE(write_safetensors(dir / "good.safetensors", {{"a", {64}, v.data()}, {"b", {8}, v.data()}}).ok());
  const std::string good = read_bytes(dir / "good.safetensors");
  std::string m = expect_refused("cut.safetensors", good.substr(0, good.size() - 4));
  EXPECT_TRUE(contains(m, "truncated")) << m;
  expect_refused("cut_header.safetensors", good.substr(0, 20));
  expect_refused("seven.safetensors", good.substr(0, 7));
  expect_refused("empty.safetensors", "");
  m = expect_refused("trailing.safetensors", good + "xxxx");
  EXPECT_TRUE(contains(m, "follow the last tensor")) << m;
}

TEST_F(SafetensorsFixture, HeaderLengthBeyondFileIsCorrupt) {
  const std::vector<float> v = {1, 2};
  ASSERT_TRUE(write_safetensors(dir / "good.safetensors", {{"a", {2}, v.data()}}).ok());
  std::string bytes = read_bytes(dir / "good.safetensors");
  const uint64_t huge = bytes.size();  // one more than fits
  std::memcpy(bytes.data(), &huge, 8);
  std::string m = expect_refused("len.safetensors", bytes);
  EXPECT_TRUE(contains(m, "header length")) << m;
  const uint64_t absurd = ~uint64_t{0};
  std::memcpy(bytes.data(), &absurd, 8);
  expect_refused("len2.safetensors", bytes);
}

TEST_F(SafetensorsFixture, BadJsonIsCorrupt) {
  const std::string data(8, '\0');
  std::string m = expect_refused("json.safetensors",
                                 raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", data));
  EXPECT_TRUE(contains(m, "not valid JSON")) << m;
  expect_refused("garbage.safetensors", raw_file("{garbage}", data));
  expect_refused("array.safetensors", raw_file("[1, 2]", ""));
  expect_refused("notobj.safetensors", raw_file(R"({"a": 5})", ""));
  expect_refused("nodtype.safetensors", raw_file(R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", data));
  expect_refused("extra.safetensors",
                 raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})", data));
  expect_refused("negshape.safetensors", raw_file(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", data));
  expect_refused("floatshape.safetensors",
                 raw_file(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", data));
  expect_refused("offsets3.safetensors", raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}})", data));
  expect_refused("backwards.safetensors", raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", data));
  expect_refused("meta.safetensors", raw_file(R"({"__metadata__": {"step": 7}})", ""));
  m = expect_refused("dtype.safetensors", raw_file(R"({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", data),
                     StatusCode::kUnsupported);
  EXPECT_TRUE(contains(m, "Q7")) << m;
}

TEST_F(SafetensorsFixture, OverlapsHolesAndWrongSizesAreCorrupt) {
  std::string m = expect_refused(
      "overlap.safetensors",
      raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
               std::string(12, '\0')));
  EXPECT_TRUE(contains(m, "overlap")) << m;
  m = expect_refused("hole.safetensors",
                     raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                              std::string(20, '\0')));
  EXPECT_TRUE(contains(m, "hole")) << m;
  m = expect_refused("size.safetensors",
                     raw_file(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", std::string(8, '\0')));
  EXPECT_TRUE(contains(m, "needs 12")) << m;
  m = expect_refused("bf16size.safetensors",
                     raw_file(R"({"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 16]}})", std::string(16, '\0')));
  EXPECT_TRUE(contains(m, "needs 8")) << m;
  m = expect_refused("dup.safetensors",
                     raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                              std::string(16, '\0')));
  EXPECT_TRUE(contains(m, "twice")) << m;
}

TEST_F(SafetensorsFixture, OnlyMetadataIsAValidEmptyFile) {
  ASSERT_TRUE(write_safetensors(dir / "none.safetensors", {}, {{"k", "v"}}).ok());
  auto f = SafetensorsFile::open(dir / "none.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(f->entries().empty());
  EXPECT_EQ(f->metadata().at("k"), "v");
  // A caller's own "format" is kept.
  ASSERT_TRUE(write_safetensors(dir / "np.safetensors", {}, {{"format", "np"}}).ok());
  EXPECT_EQ(SafetensorsFile::open(dir / "np.safetensors")->metadata().at("format"), "np");
}

// ---- atomic writes -----------------------------------------------------------------------------

TEST_F(SafetensorsFixture, WriteIntoMissingDirectoryFailsCleanly) {
  const std::vector<float> v = {1, 2};
  Status s = write_safetensors(dir / "no" / "such" / "m.safetensors", {{"a", {2}, v.data()}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(s.message(), "does not exist")) << s.message();
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST_F(SafetensorsFixture, FailedRenameLeavesNoTemporary) {
  // The target is a non-empty directory: everything is written, then rename() refuses.
  std::filesystem::create_directories(dir / "target.safetensors" / "inside");
  const std::vector<float> v = {1, 2};
  Status s = write_safetensors(dir / "target.safetensors", {{"a", {2}, v.data()}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_TRUE(test::files_containing(dir.path(), ".tmp").empty());
  EXPECT_TRUE(std::filesystem::is_directory(dir / "target.safetensors" / "inside"));
}

// A write that fails half-way (a full disk, injected through FileIo at every write of the file: torn,
// then ENOSPC) must leave the previous checkpoint byte-identical and no temporary file.
TEST_F(SafetensorsFixture, ExistingFileSurvivesAFailedWrite) {
  const auto old_values = awkward_floats(100, 5);
  const auto path = dir / "ckpt.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"w", {100}, old_values.data()}}).ok());
  const std::string before = read_bytes(path);
  const std::vector<float> big(1 << 20, 0.25f);  // 4 MiB
  int writes = 0;
  {
    test::FaultyIo count(dir.path());
    ScopedFileIo use(count);
    ASSERT_TRUE(write_safetensors(dir / "other.safetensors", {{"w", {1 << 20}, big.data()}}).ok());
    writes = count.count(test::FaultyIo::Op::kWrite);
  }
  ASSERT_GE(writes, 2);
  for (int k = 1; k <= writes; ++k) {
    SCOPED_TRACE("write " + std::to_string(k));
    test::FaultyIo io(dir.path());
    io.inject(test::FaultyIo::Op::kWrite, k, test::FaultyIo::Mode::kTorn, ENOSPC);
    Status st;
    {
      ScopedFileIo use(io);
      st = write_safetensors(path, {{"w", {1 << 20}, big.data()}});
    }
    ASSERT_TRUE(io.fired());
    EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
    EXPECT_NE(st.message().find("the disk is full"), std::string::npos) << st.message();
    EXPECT_EQ(read_bytes(path), before);
    EXPECT_TRUE(test::files_containing(dir.path(), ".tmp").empty());
  }
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(bits_of(*f->read_fp32("w")), bits_of(old_values));
}

// A process killed while writing leaves the path holding the old file or the complete new one,
// never a mix: the bytes go to a temporary until the rename.
TEST_F(SafetensorsFixture, KilledWriterLeavesOldOrNewFile) {
  const auto path = dir / "ckpt.safetensors";
  const std::vector<float> old_values(1000, 1.0f);
  ASSERT_TRUE(write_safetensors(path, {{"w", {1000}, old_values.data()}}).ok());
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<float> big(16 << 20, 2.0f);  // 64 MiB
    Status st = write_safetensors(path, {{"w", {16 << 20}, big.data()}});
    ::_exit(st.ok() ? 0 : 1);
  }
  // Kill the writer as soon as its temporary appears (or give up after 10 s).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (test::files_containing(dir.path(), ".tmp").empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << "after a killed write: " << f.status().to_string();
  const auto* e = f->find("w");
  ASSERT_NE(e, nullptr);
  if (e->numel == 1000) {
    std::cout << "[killed writer] the path still holds the previous file\n";
    EXPECT_EQ(*f->read_fp32("w"), old_values);
  } else {
    std::cout << "[killed writer] the writer finished before the kill\n";
    ASSERT_EQ(e->numel, 16 << 20);  // the writer finished before the kill
    EXPECT_EQ((*f->read_fp32("w"))[12345], 2.0f);
  }
}

// ---- Hugging Face folders ----------------------------------------------------------------------

class HfFolderFixture : public SafetensorsFixture {
 protected:
  std::vector<float> emb = {1, 2, 3, 4, 5, 6};
  std::vector<float> q = {7, 8, 9, 10};
  std::vector<float> norm = {0.5f, 0.25f};

  void write_shards(const std::string& weight_map_extra = "") {
    ASSERT_TRUE(write_safetensors(dir / "model-00001-of-00002.safetensors",
                                  {{"model.embed_tokens.weight", {3, 2}, emb.data()}})
                    .ok());
    ASSERT_TRUE(write_safetensors(dir / "model-00002-of-00002.safetensors",
                                  {{"model.layers.0.self_attn.q_proj.weight", {2, 2}, q.data(), DType::kFp32, DType::kBf16},
                                   {"model.norm.weight", {2}, norm.data()}})
                    .ok());
    write_bytes(dir / "model.safetensors.index.json",
                R"({"metadata": {"total_size": 40},
                    "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                   "model.layers.0.self_attn.q_proj.weight": "model-00002-of-00002.safetensors",
                                   "model.norm.weight": "model-00002-of-00002.safetensors")" +
                    weight_map_extra + "}}");
  }
};

TEST_F(HfFolderFixture, ShardedIndexResolves) {
  write_shards();
  auto c = HfCheckpoint::open(dir.path());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->files().size(), 2u);
  ASSERT_EQ(c->tensors().size(), 3u);
  EXPECT_EQ(c->tensors().at("model.embed_tokens.weight").file.filename().string(), "model-00001-of-00002.safetensors");
  EXPECT_EQ(c->tensors().at("model.norm.weight").file.filename().string(), "model-00002-of-00002.safetensors");
  EXPECT_EQ(c->tensors().at("model.layers.0.self_attn.q_proj.weight").entry.dtype, "BF16");
  EXPECT_EQ(c->metadata().at("total_size"), "40");
  EXPECT_EQ(*c->load_fp32("model.embed_tokens.weight"), emb);
  EXPECT_EQ(*c->load_fp32("model.layers.0.self_attn.q_proj.weight"), q);  // small integers are exact in bf16
  std::vector<float> out(2);
  ASSERT_TRUE(c->load_fp32("model.norm.weight", {2}, out.data()).ok());
  EXPECT_EQ(out, norm);
  Status s = c->load_fp32("model.embed_tokens.weight", {2, 3}, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "[3, 2]") && contains(s.message(), "[2, 3]")) << s.message();
  EXPECT_EQ(c->load_fp32("lm_head.weight", {2}, out.data()).code(), StatusCode::kNotFound);
  EXPECT_FALSE(c->contains("lm_head.weight"));
  // The index file itself is accepted as the path.
  auto via_index = HfCheckpoint::open(dir / "model.safetensors.index.json");
  ASSERT_TRUE(via_index.ok()) << via_index.status().to_string();
  EXPECT_EQ(via_index->tensors().size(), 3u);
}

TEST_F(HfFolderFixture, SingleFileWinsAndFileMayBeGivenDirectly) {
  write_shards();
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", {{"model.norm.weight", {2}, norm.data()}}).ok());
  auto c = HfCheckpoint::open(dir.path());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->files().size(), 1u);
  EXPECT_EQ(c->tensors().size(), 1u);
  EXPECT_EQ(c->metadata().at("format"), "pt");
  auto d = HfCheckpoint::open(dir / "model-00001-of-00002.safetensors");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->contains("model.embed_tokens.weight"));
}

TEST_F(HfFolderFixture, BadIndexesAreRefused) {
  write_shards(R"(, "lm_head.weight": "model-00001-of-00002.safetensors")");
  auto c = HfCheckpoint::open(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(c.status().message(), "lm_head.weight")) << c.status().message();

  write_shards(R"(, "lm_head.weight": "model-00003-of-00002.safetensors")");
  c = HfCheckpoint::open(dir.path());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(c.status().message(), "model-00003-of-00002.safetensors")) << c.status().message();

  write_shards(R"(, "lm_head.weight": "../elsewhere.safetensors")");
  EXPECT_EQ(HfCheckpoint::open(dir.path()).status().code(), StatusCode::kCorrupt);

  write_bytes(dir / "model.safetensors.index.json", R"({"metadata": {}, "weight_map": )");
  c = HfCheckpoint::open(dir.path());
  EXPECT_EQ(c.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(c.status().message(), "model.safetensors.index.json")) << c.status().message();
  write_bytes(dir / "model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_EQ(HfCheckpoint::open(dir.path()).status().code(), StatusCode::kCorrupt);

  // A corrupt shard is refused as the shard's own corruption.
  write_shards();
  std::string shard = read_bytes(dir / "model-00002-of-00002.safetensors");
  write_bytes(dir / "model-00002-of-00002.safetensors", shard.substr(0, shard.size() - 2));
  c = HfCheckpoint::open(dir.path());
  EXPECT_EQ(c.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(c.status().message(), "model-00002-of-00002.safetensors")) << c.status().message();
}

TEST_F(HfFolderFixture, FolderWithoutSafetensorsSaysWhatIsThere) {
  auto c = HfCheckpoint::open(dir.path());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(c.status().message(), "model.safetensors.index.json")) << c.status().message();
  write_bytes(dir / "pytorch_model.bin", "not ours");
  c = HfCheckpoint::open(dir.path());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(c.status().message(), "convert")) << c.status().message();
  EXPECT_EQ(HfCheckpoint::open(dir / "missing").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace megatrain::exec

// Tests for HardwareProfile: the shipped rigs in profiles/hardware load, round-trip exactly and
// carry a source for every figure; the lookups interpolate as documented; bad files fail with the
// right code and the full key path.
#include "megatrain/core/hardware_profile.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "megatrain/core/profiles.h"
#include "megatrain/core/units.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

const std::vector<std::string> kShippedRigs = {"a100-80gb-pcie", "gh200-480gb",   "h100-sxm-80gb",   "h200-1.5tb",
                                               "rtx3090-256gb",  "rtx4090-256gb", "h200x8-2tb", "h200x8-2tb-4node"};

fs::path rig_file(const std::string& name) { return fs::path(MEGATRAIN_PROFILES_DIR) / "hardware" / (name + ".json"); }

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

HardwareProfile load_ok(const std::string& name) {
  auto r = HardwareProfile::load(name);
  EXPECT_TRUE(r.ok()) << name << ": " << r.status().to_string();
  return r.ok() ? *r : HardwareProfile{};
}

// The h200 profile as JSON, changed by `edit`, then parsed: the status says what the reader thought.
Status parse_edited(const std::function<void(Json&)>& edit) {
  Json j = Json::parse(read_text(rig_file("h200-1.5tb")));
  edit(j);
  return HardwareProfile::from_json_text(j.dump(2)).status();
}

// Renames a key in place (keeping its position) so that a test can introduce a typo.
void rename_key(Json& obj, const std::string& from, const std::string& to) {
  Json out = Json::object();
  for (auto it = obj.begin(); it != obj.end(); ++it) out[it.key() == from ? to : it.key()] = it.value();
  obj = std::move(out);
}

// Expects `status_expr` to fail with `want_code` and a message holding every one of the strings.
#define EXPECT_ERROR(status_expr, want_code, ...)                                                    \
  do {                                                                                              \
    const Status st_ = (status_expr);                                                               \
    EXPECT_EQ(st_.code(), (want_code)) << st_.to_string();                                          \
    for (const char* part_ : {__VA_ARGS__}) {                                                       \
      EXPECT_NE(st_.message().find(part_), std::string::npos) << "'" << part_ << "' not in: " << st_.message(); \
    }                                                                                               \
  } while (0)

// ---- the shipped profiles ----------------------------------------------------------------------

TEST(HardwareProfile, EveryShippedRigIsListedAndLoads) {
  std::vector<std::string> names = list_profiles("hardware");
  for (const auto& want : kShippedRigs)
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want << " missing from profiles/hardware";
  for (const auto& name : names) {
    auto r = HardwareProfile::load(name);
    ASSERT_TRUE(r.ok()) << name << ": " << r.status().to_string();
    EXPECT_EQ(r->name, name) << "a rig's name should match its file name";
    EXPECT_FALSE(r->description.empty()) << name;
    EXPECT_FALSE(r->storage.empty()) << name << ": every shipped rig has at least one NVMe drive";
  }
}

TEST(HardwareProfile, ShippedRigsRoundTripExactly) {
  for (const auto& name : list_profiles("hardware")) {
    HardwareProfile a = load_ok(name);
    std::string text = a.to_json_text();
    auto b = HardwareProfile::from_json_text(text, name);
    ASSERT_TRUE(b.ok()) << name << ": " << b.status().to_string();
    EXPECT_TRUE(a == *b) << name << ": text -> object -> text -> object changed the object";
    EXPECT_EQ(text, b->to_json_text()) << name << ": writing is not stable";
    // Loading by path gives the same object as loading by name.
    auto c = HardwareProfile::load(rig_file(name).string());
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_TRUE(a == *c) << name;
  }
}

TEST(HardwareProfile, RoundTripKeepsAwkwardValuesAndMeasuredProvenance) {
  HardwareProfile hw = load_ok("rtx3090-256gb");
  hw.gpu.memory_bytes.value = 0.1 + 0.2;  // not representable as a short decimal
  hw.gpu.memory_bytes.provenance = {Provenance::Kind::kMeasured, "cuda_mem_get_info", "2026-04-09T12:34:56Z",
                                    "lab-box \"7\" \xc3\xa9"};
  hw.links.h2d.latency_s.value = 1e-300;
  hw.links.d2h.pinned_bandwidth.points = {{1.0 / 3.0, 123456789.123456789}, {4096, 2.5e10}};
  hw.host.adam.push_back({"q4", 3, {987654321.0 / 7.0, {Provenance::Kind::kEstimate, "basis", "", ""}}});
  hw.description = "line one\nline two\ttab";
  hw.gpu.attention_efficiency = Curve{{{1e6, 0.05}, {1e9, 0.31}}, {Provenance::Kind::kEstimate, "attention basis", "", ""}};
  hw.gpu.attention_backward_ratio = Figure{2.75, {Provenance::Kind::kEstimate, "ratio basis", "", ""}};
  hw.gpu.layer_times = LayerTimes{"small", 256, 688, 8, 4, 32, 128, {{1, 1.5e-3, 3.25e-3}, {4, 5e-3, 1.1e-2}},
                                  {Provenance::Kind::kMeasured, "layer probe", "2026-12-02", "vm"}};
  auto back = HardwareProfile::from_json_text(hw.to_json_text());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(hw == *back);
  EXPECT_EQ(back->gpu.memory_bytes.value, 0.1 + 0.2);
  EXPECT_EQ(back->gpu.memory_bytes.provenance.machine, "lab-box \"7\" \xc3\xa9");
}

TEST(HardwareProfile, TheGroupedGemmCurveAndAnMoeLayerProbeRoundTrip) {
  HardwareProfile hw = load_ok("rtx3090-256gb");
  ASSERT_FALSE(hw.gpu.grouped_gemm_efficiency.has_value()) << "a rig written before the field still loads, without it";
  hw.gpu.grouped_gemm_efficiency =
      Curve{{{16, 0.0653}, {128, 1.0 / 3.0}, {4096, 0.7}}, {Provenance::Kind::kMeasured, "grouped probe", "2026-12-03", "vm"}};
  hw.gpu.layer_times = LayerTimes{"tiny-moe", 64, 128, 4, 2, 16, 32, {{1, 1e-3, 2e-3}}, {Provenance::Kind::kMeasured, "layer probe", "2026-12-03", "vm"},
                                  8, 2, 96, 16};
  const std::string text = hw.to_json_text();
  auto back = HardwareProfile::from_json_text(text);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(hw == *back);
  ASSERT_TRUE(back->gpu.grouped_gemm_efficiency.has_value());
  EXPECT_EQ(back->gpu.grouped_gemm_efficiency->points[1].second, 1.0 / 3.0);
  EXPECT_EQ(back->gpu.layer_times->experts, 8);
  EXPECT_EQ(back->gpu.layer_times->experts_per_token, 2);
  EXPECT_EQ(back->gpu.layer_times->moe_intermediate, 96);
  EXPECT_EQ(back->gpu.layer_times->window, 16);
  // A probe that timed the head: vocab set, a 4th value per point; a 3-value point is then refused.
  hw.gpu.layer_times->vocab = 512;
  hw.gpu.layer_times->points[0].head_s = 4e-3;
  auto with_head = HardwareProfile::from_json_text(hw.to_json_text());
  ASSERT_TRUE(with_head.ok()) << with_head.status().to_string();
  EXPECT_TRUE(hw == *with_head);
  Json short_point = Json::parse(hw.to_json_text());
  short_point["gpu"]["layer_times"]["points"][0].erase(3);
  auto refused = HardwareProfile::from_json_text(short_point.dump());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("head_s] (vocab is set)"), std::string::npos) << refused.status().message();
  hw.gpu.layer_times->vocab = 0;
  hw.gpu.layer_times->points[0].head_s = 0;
  // A dense probe writes none of the MoE keys, so its entry reads as before they existed.
  hw.gpu.layer_times->experts = hw.gpu.layer_times->experts_per_token = hw.gpu.layer_times->moe_intermediate = 0;
  hw.gpu.layer_times->window = 0;
  const Json dense = Json::parse(hw.to_json_text());
  for (const char* key : {"experts", "experts_per_token", "moe_intermediate", "window"})
    EXPECT_FALSE(dense["gpu"]["layer_times"].contains(key)) << key;
}

// gpu.gemm_shapes (issue 50): round trip, absent from rigs written before it, and refused by path
// when its tables do not match its axes or leave (0, 1].
TEST(HardwareProfile, TheGemmShapeGridRoundTripsAndIsChecked) {
  HardwareProfile hw = load_ok("rtx3090-256gb");
  ASSERT_FALSE(hw.gpu.gemm_shapes.has_value()) << "a rig written before the field still loads, without it";
  GemmShapes g;
  g.tokens = {128, 1024};
  g.in = {64, 4096};
  g.out = {64, 32000};
  g.efficiency[0] = {0.1, 0.2, 0.3, 1.0 / 3.0, 0.5, 0.6, 0.7, 0.8};
  g.efficiency[1] = {0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2};
  g.efficiency[2] = {0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 1.0};
  g.provenance = {Provenance::Kind::kMeasured, "grid probe", "2026-12-07", "vm"};
  hw.gpu.gemm_shapes = g;
  auto back = HardwareProfile::from_json_text(hw.to_json_text());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(hw == *back);
  EXPECT_EQ(back->gpu.gemm_shapes->efficiency[0][3], 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(back->gpu.gemm_shapes->at(GemmShapes::kForward, 1024, 4096, 32000), 0.8);
  auto refused = [&](const std::function<void(Json&)>& edit, const std::string& want) {
    Json j = Json::parse(hw.to_json_text());
    edit(j["gpu"]["gemm_shapes"]);
    auto r = HardwareProfile::from_json_text(j.dump());
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  };
  refused([](Json& t) { t["forward"].erase(0); }, "gpu.gemm_shapes.forward: 7 values; expected tokens x in x out = 8");
  refused([](Json& t) { t["backward_data"][2] = 1.5; }, "gpu.gemm_shapes.backward_data[2]: 1.5; accepted: a fraction of peak in (0, 1]");
  refused([](Json& t) { t["in"] = Json::array({4096, 64}); }, "gpu.gemm_shapes.in[1]: 64; accepted: sizes > 0, strictly increasing");
  refused([](Json& t) { t.erase("backward_weight"); }, "backward_weight");
}

TEST(HardwareProfile, OldProfilesWithoutTheGroupedCurveStillLoad) {
  // The H200 profile as it was before the field: every other figure the same.
  Json j = Json::parse(read_text(rig_file("h200-1.5tb")));
  ASSERT_TRUE(j["gpu"].contains("grouped_gemm_efficiency"));
  j["gpu"].erase("grouped_gemm_efficiency");
  auto old = HardwareProfile::from_json_text(j.dump(2), "h200 without grouped_gemm_efficiency");
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_FALSE(old->gpu.grouped_gemm_efficiency.has_value());
  HardwareProfile now = load_ok("h200-1.5tb");
  now.gpu.grouped_gemm_efficiency.reset();
  EXPECT_TRUE(now == *old);
  for (const char* name : {"a100-80gb-pcie", "h100-sxm-80gb", "rtx4090-256gb", "cpu-dev-2core"}) {
    auto r = HardwareProfile::load(name);
    ASSERT_TRUE(r.ok()) << name << ": " << r.status().to_string();
    EXPECT_FALSE(r->gpu.grouped_gemm_efficiency.has_value()) << name;
  }
}

TEST(HardwareProfile, TheH200GroupedCurveIsTheRooflineItsSourceStates) {
  const HardwareProfile hw = load_ok("h200-1.5tb");
  ASSERT_TRUE(hw.gpu.grouped_gemm_efficiency.has_value());
  const Curve& g = *hw.gpu.grouped_gemm_efficiency;
  EXPECT_EQ(g.provenance.kind, Provenance::Kind::kEstimate);
  EXPECT_NE(g.provenance.source.find("min(0.70 x 989 TFLOP/s, 0.85 x 4.8 TB/s x I(r))"), std::string::npos);
  // Recompute every point from the stated formula at n = k = 2880.
  const double n = 2880, k = 2880;
  for (const auto& [r, y] : g.points) {
    const double intensity = r * n * k / (n * k + r * k + r * n);
    const double want = std::min(0.70 * 989e12, 0.85 * 4.8e12 * intensity) / 989e12;
    EXPECT_NEAR(y, want, 5e-4) << "rows " << r;
  }
  // Never above what large dense GEMMs reach on the same profile.
  for (const auto& [r, y] : g.points) EXPECT_LE(y, hw.gpu.gemm_efficiency.points.back().second) << r;
}

TEST(HardwareProfile, H200MatchesThePaperAndTheDatasheet) {
  HardwareProfile hw = load_ok("h200-1.5tb");
  EXPECT_EQ(hw.gpu.memory_bytes.value, 141e9);
  EXPECT_EQ(hw.gpu.memory_bandwidth.value, 4.8e12);
  EXPECT_EQ(hw.gpu.matmul_bf16.value, 989e12);
  EXPECT_EQ(hw.gpu.matmul_tf32.value, 494e12);
  EXPECT_EQ(hw.gpu.matmul_fp32.value, 67e12);
  EXPECT_EQ(hw.gpu.memory_bytes.provenance.kind, Provenance::Kind::kDatasheet);
  EXPECT_NE(hw.gpu.memory_bytes.provenance.source.find("H200"), std::string::npos);
  EXPECT_EQ(hw.host.ram_bytes.value, 1536.0 * kGiB);
  EXPECT_NE(hw.host.ram_bytes.provenance.source.find("2604.05091"), std::string::npos);
  EXPECT_EQ(hw.links.kind, "pcie-gen5-x16");
  EXPECT_TRUE(hw.links.full_duplex);
  EXPECT_EQ(hw.links.h2d.pinned_bandwidth.provenance.kind, Provenance::Kind::kEstimate);
  // A large pinned copy on Gen5 x16 lands in the 50-55 GB/s band, below the 63 GB/s after encoding.
  double big = hw.links.h2d.pinned_bandwidth.at(1e9);
  EXPECT_GT(big, 50e9);
  EXPECT_LT(big, 55e9);
  ASSERT_EQ(hw.storage.size(), 2u);
  EXPECT_EQ(hw.storage[0].read_bandwidth(1 << 20, 32), 13e9);   // PM1743 sequential read
  EXPECT_EQ(hw.storage[0].write_bandwidth(1 << 20, 32), 6.6e9);  // PM1743 sequential write
  EXPECT_EQ(hw.storage[0].capacity_bytes.value, 7.68e12);
}

TEST(HardwareProfile, OtherRigsCarryTheirDatasheetFigures) {
  HardwareProfile h100 = load_ok("h100-sxm-80gb");
  EXPECT_EQ(h100.gpu.memory_bytes.value, 80e9);
  EXPECT_EQ(h100.gpu.memory_bandwidth.value, 3.35e12);
  EXPECT_EQ(h100.gpu.matmul_bf16.value, 989e12);

  HardwareProfile gh = load_ok("gh200-480gb");
  EXPECT_EQ(gh.links.kind, "nvlink-c2c");
  EXPECT_EQ(gh.gpu.memory_bytes.value, 96e9);
  EXPECT_EQ(gh.gpu.memory_bandwidth.value, 4.0e12);
  EXPECT_EQ(gh.host.ram_bytes.value, 480e9);
  EXPECT_EQ(gh.host.cores, 72);
  EXPECT_GT(gh.links.h2d.pinned_bandwidth.at(1e9), 300e9);  // C2C: far above any PCIe link
  EXPECT_LT(gh.links.h2d.pinned_bandwidth.at(1e9), 450e9);  // but not above 450 GB/s per direction

  HardwareProfile a100 = load_ok("a100-80gb-pcie");
  EXPECT_EQ(a100.gpu.memory_bandwidth.value, 1.935e12);
  EXPECT_EQ(a100.gpu.matmul_bf16.value, 312e12);
  EXPECT_EQ(a100.gpu.matmul_tf32.value, 156e12);
  EXPECT_EQ(a100.links.kind, "pcie-gen4-x16");

  HardwareProfile r4090 = load_ok("rtx4090-256gb");
  EXPECT_EQ(r4090.gpu.memory_bytes.value, 24e9);
  EXPECT_EQ(r4090.gpu.matmul_bf16.value, 165.2e12);
  EXPECT_EQ(r4090.host.ram_bytes.value, 256.0 * kGiB);

  HardwareProfile r3090 = load_ok("rtx3090-256gb");
  EXPECT_EQ(r3090.gpu.memory_bandwidth.value, 936e9);
  EXPECT_EQ(r3090.gpu.matmul_bf16.value, 71e12);
  EXPECT_EQ(r3090.host.memory_bandwidth.value, 102.4e9);
}

// Physical limits every profile must respect whatever its numbers: catches a slipped exponent.
TEST(HardwareProfile, ShippedRigsRespectPhysicalLimits) {
  for (const auto& name : list_profiles("hardware")) {
    SCOPED_TRACE(name);
    HardwareProfile hw = load_ok(name);
    double link_cap = hw.links.kind == "pcie-gen5-x16" ? 63.0e9 : hw.links.kind == "pcie-gen4-x16" ? 31.5e9 : 450e9;
    for (const LinkSpec* l : {&hw.links.h2d, &hw.links.d2h}) {
      for (const auto& [x, y] : l->pinned_bandwidth.points) {
        EXPECT_LE(y, link_cap) << "pinned bandwidth above the link's rate at " << x << " bytes";
        EXPECT_LE(l->pageable_bandwidth.at(x), y) << "pageable faster than pinned at " << x << " bytes";
        EXPECT_LE(y * l->latency_s.value, x * 1.0001) << "a transfer faster than its fixed latency allows";
      }
    }
    double prev = 0;
    for (const auto& [x, y] : hw.gpu.gemm_efficiency.points) {
      EXPECT_GE(y, prev) << "GEMM efficiency should not fall with size";
      prev = y;
    }
    EXPECT_GE(hw.gpu.matmul_bf16.value, hw.gpu.matmul_tf32.value);
    EXPECT_GE(hw.gpu.matmul_tf32.value, hw.gpu.matmul_fp32.value);
    EXPECT_LE(hw.host.pinnable_bytes.value, hw.host.ram_bytes.value);
    EXPECT_LT(hw.gpu.memory_bytes.value, hw.host.ram_bytes.value);
    for (const auto& a : hw.host.adam) {
      // Adam touches at least 20 bytes per parameter, so it cannot beat memory bandwidth / 20.
      EXPECT_LE(a.params_per_s.value, hw.host.memory_bandwidth.value / 20) << a.state_format;
      EXPECT_LE(a.threads, hw.host.cores * 2);
    }
    for (const auto& d : hw.storage) {
      EXPECT_LE(d.read_bandwidth(1 << 20, 32), 15.76e9) << "faster than PCIe Gen5 x4 after encoding";
      EXPECT_GT(d.write_bandwidth(1 << 20, 32), 0);
    }
  }
}

// Every figure, curve and I/O table in every shipped file names its source.
void walk_provenance(const Json& j, const std::string& path, int& count) {
  if (j.is_object()) {
    if (j.contains("value") || j.contains("points")) {
      EXPECT_TRUE(j.contains("provenance")) << path << " is a figure or curve without provenance";
    }
    if (j.contains("read") || j.contains("write")) {
      EXPECT_TRUE(j.contains("io_provenance")) << path << " is an I/O table without io_provenance";
    }
    for (auto it = j.begin(); it != j.end(); ++it) {
      std::string child = path + "." + it.key();
      if (it.key() == "provenance" || it.key() == "io_provenance") {
        ++count;
        ASSERT_TRUE(it->is_object()) << child;
        std::string kind = it->value("kind", "");
        std::string source = it->value("source", "");
        EXPECT_TRUE(kind == "datasheet" || kind == "estimate" || kind == "measured") << child << ": " << kind;
        EXPECT_GE(source.size(), 20u) << child << ": a source should say where the figure comes from";
      } else {
        walk_provenance(*it, child, count);
      }
    }
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) walk_provenance(j[i], path + "[" + std::to_string(i) + "]", count);
  }
}

TEST(HardwareProfile, EveryShippedFigureHasASource) {
  for (const auto& name : list_profiles("hardware")) {
    SCOPED_TRACE(name);
    Json j = Json::parse(read_text(rig_file(name)));
    int count = 0;
    walk_provenance(j, name, count);
    // 5 GPU figures + curve, 2 x (latency + 2 curves), 3 host figures + Adam entries, per drive 2.
    EXPECT_GE(count, 6 + 6 + 3 + 1 + 2) << "fewer provenance records than figures";
  }
}

// ---- lookups -----------------------------------------------------------------------------------

TEST(RigCurve, InterpolatesLinearlyInLogXAndClamps) {
  Curve c;
  c.points = {{1, 10}, {100, 30}};
  EXPECT_DOUBLE_EQ(c.at(10), 20);        // log10(10) is half way from log10(1) to log10(100)
  EXPECT_DOUBLE_EQ(c.at(1), 10);
  EXPECT_DOUBLE_EQ(c.at(100), 30);
  EXPECT_DOUBLE_EQ(c.at(0.5), 10);       // clamped below
  EXPECT_DOUBLE_EQ(c.at(-4), 10);        // and at x <= 0, where log is undefined
  EXPECT_DOUBLE_EQ(c.at(1e9), 30);       // clamped above
  EXPECT_NEAR(c.at(std::sqrt(10.0)), 15, 1e-12);

  Curve three;
  three.points = {{1e3, 1}, {1e6, 4}, {1e9, 10}};
  EXPECT_NEAR(three.at(1e4), 2, 1e-12);  // a third of the way through the first segment
  EXPECT_NEAR(three.at(1e7), 6, 1e-12);  // a third of the way through the second
  EXPECT_DOUBLE_EQ(three.at(1e6), 4);

  Curve one;
  one.points = {{4096, 7}};
  EXPECT_DOUBLE_EQ(one.at(1), 7);
  EXPECT_DOUBLE_EQ(one.at(1e12), 7);
  EXPECT_DOUBLE_EQ(Curve{}.at(5), 0);
}

TEST(RigNvme, BandwidthLookupUsesQueueDepthAtOrBelowAndLogBlockSize) {
  NvmeSpec n;
  n.read = {{4096, 1, 100e6}, {4096, 32, 1000e6}, {131072, 32, 8000e6}, {1048576, 32, 10000e6}};
  n.write = {{4096, 32, 500e6}, {131072, 32, 4000e6}};
  // 32 KiB is 3 of the 5 doublings from 4 KiB to 128 KiB: 1000 + 0.6 * 7000 MB/s.
  EXPECT_NEAR(n.read_bandwidth(32768, 32), 5200e6, 1e-3);
  // 512 KiB is 2 of the 3 doublings from 128 KiB to 1 MiB: 8000 + 2/3 * 2000 MB/s.
  EXPECT_NEAR(n.read_bandwidth(524288, 32), 8000e6 + 2000e6 * 2 / 3, 1e-3);
  EXPECT_DOUBLE_EQ(n.read_bandwidth(131072, 64), 8000e6);       // deeper than measured: use 32
  EXPECT_DOUBLE_EQ(n.read_bandwidth(16 << 20, 32), 10000e6);    // larger than measured: clamp
  EXPECT_DOUBLE_EQ(n.read_bandwidth(1 << 20, 8), 100e6);        // QD 8 falls back to QD 1's only point
  EXPECT_DOUBLE_EQ(n.read_bandwidth(4096, 1), 100e6);
  // Every measured depth is above the one asked for: the smallest measured is used.
  EXPECT_DOUBLE_EQ(n.write_bandwidth(4096, 1), 500e6);
  EXPECT_DOUBLE_EQ(n.write_bandwidth(1024, 4), 500e6);
  EXPECT_NEAR(n.write_bandwidth(23170, 32), 500e6 + 3500e6 * std::log(23170.0 / 4096) / std::log(32.0), 1e-3);
  EXPECT_DOUBLE_EQ(NvmeSpec{}.read_bandwidth(4096, 1), 0);
}

// ---- errors ------------------------------------------------------------------------------------

TEST(RigErrors, UnknownKeySaysWhereAndSuggestsTheKnownOne) {
  EXPECT_ERROR(parse_edited([](Json& j) { rename_key(j["gpu"], "memory_bandwidth", "memory_bandwith"); }),
               StatusCode::kInvalidArgument, "rig: ", "gpu.memory_bandwith", "unknown key", "did you mean \"memory_bandwidth\"");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][1]["read"][0]["latency"] = 1; }),
               StatusCode::kInvalidArgument, "storage[1].read[0].latency", "unknown key");
  EXPECT_ERROR(parse_edited([](Json& j) { j["links"]["h2d"]["pinned_bandwidth"]["provenance"]["note"] = "x"; }),
               StatusCode::kInvalidArgument, "links.h2d.pinned_bandwidth.provenance.note");
  EXPECT_ERROR(parse_edited([](Json& j) { rename_key(j, "description", "descripton"); }),
               StatusCode::kInvalidArgument, "descripton", "did you mean \"description\"");
}

TEST(RigErrors, WrongTypeNamesThePathAndTheExpectedType) {
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["memory_bytes"]["value"] = "141 GB"; }),
               StatusCode::kInvalidArgument, "gpu.memory_bytes.value", "expected a number", "a string");
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"]["cores"] = 112.5; }), StatusCode::kInvalidArgument,
               "host.cores", "expected an integer");
  EXPECT_ERROR(parse_edited([](Json& j) { j["links"]["full_duplex"] = "yes"; }), StatusCode::kInvalidArgument,
               "links.full_duplex", "true or false");
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["gemm_efficiency"]["points"][1] = Json::array({1e9}); }),
               StatusCode::kInvalidArgument, "gpu.gemm_efficiency.points[1]", "[x, y]");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"] = Json::object(); }), StatusCode::kInvalidArgument, "storage",
               "expected an array");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][0] = 5; }), StatusCode::kInvalidArgument, "storage[0]",
               "expected an object");
}

TEST(RigErrors, OutOfRangeValuesAreRefused) {
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"]["memory_bandwidth"]["value"] = 0; }),
               StatusCode::kInvalidArgument, "host.memory_bandwidth.value", "out of range", "> 0");
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["memory_bytes"]["value"] = -141e9; }),
               StatusCode::kInvalidArgument, "gpu.memory_bytes.value", "> 0");
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["gemm_efficiency"]["points"][2][1] = 1.5; }),
               StatusCode::kInvalidArgument, "gpu.gemm_efficiency.points[2]", "in (0, 1]");
  EXPECT_ERROR(parse_edited([](Json& j) { j["links"]["d2h"]["latency_s"]["value"] = -1e-6; }),
               StatusCode::kInvalidArgument, "links.d2h.latency_s.value", ">= 0");
  EXPECT_ERROR(parse_edited([](Json& j) { j["links"]["h2d"]["pageable_bandwidth"]["points"][0][0] = 0; }),
               StatusCode::kInvalidArgument, "links.h2d.pageable_bandwidth.points[0]", "x = 0");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][0]["read"][0]["queue_depth"] = 0; }),
               StatusCode::kInvalidArgument, "storage[0].read[0].queue_depth", "out of range");
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"]["adam"][0]["threads"] = 1000; }), StatusCode::kInvalidArgument,
               "host.adam[0].threads", "1 .. 224");
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"]["pinnable_bytes"]["value"] = 2e12; }),
               StatusCode::kInvalidArgument, "host.pinnable_bytes", "host.ram_bytes");
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"]["adam"][1]["state_format"] = "fp16"; }),
               StatusCode::kInvalidArgument, "host.adam[1].state_format", "'fp16' is not accepted", "q8");
}

TEST(RigErrors, MissingRequiredKeysAreNamed) {
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"].erase("cores"); }), StatusCode::kInvalidArgument,
               "host.cores: missing");
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"].erase("matmul_tf32"); }), StatusCode::kInvalidArgument,
               "gpu.matmul_tf32: missing");
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["matmul_bf16"]["provenance"].erase("source"); }),
               StatusCode::kInvalidArgument, "gpu.matmul_bf16.provenance.source: missing");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][0].erase("io_provenance"); }), StatusCode::kInvalidArgument,
               "storage[0].io_provenance: missing");
  EXPECT_ERROR(parse_edited([](Json& j) { j.erase("links"); }), StatusCode::kInvalidArgument, "links: missing");
  // Storage alone is optional: a RAM-only rig.
  Status s = parse_edited([](Json& j) { j.erase("storage"); });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// The cluster section (several GPUs per node, several nodes): read, checked and written back; the
// figures a cluster needs are required by name; the 8-GPU datasheet rigs say what DGX H200 says.
TEST(RigErrors, TheClusterSectionIsCheckedAndRoundTrips) {
  const Json fig = {{"value", 5.3e10}, {"provenance", {{"kind", "estimate"}, {"source", "a synthetic figure for this test"}}}};
  Json j = Json::parse(read_text(rig_file("h200-1.5tb")));
  j["cluster"] = {{"gpus_per_node", 8}, {"nodes", 2}, {"gpus_per_switch", 2}, {"switch_uplink_bandwidth", fig},
                  {"inter_node_bandwidth", fig}, {"inter_node_latency_s", fig}, {"gpu_peer_bandwidth", fig}};
  auto hw = HardwareProfile::from_json_text(j.dump(2));
  ASSERT_TRUE(hw.ok()) << hw.status().to_string();
  EXPECT_EQ(hw->gpus_per_node(), 8);
  EXPECT_EQ(hw->nodes(), 2);
  auto again = HardwareProfile::from_json_text(hw->to_json_text());
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again == *hw);
  EXPECT_EQ(load_ok("h200-1.5tb").gpus_per_node(), 1);  // no section: one GPU
  EXPECT_ERROR(parse_edited([&](Json& r) { r["cluster"] = {{"gpus_per_node", 8}, {"nodes", 2}}; }), StatusCode::kInvalidArgument,
               "cluster.inter_node_bandwidth: missing", "network");
  EXPECT_ERROR(parse_edited([&](Json& r) { r["cluster"] = {{"gpus_per_node", 8}, {"nodes", 1}, {"gpus_per_switch", 2}}; }),
               StatusCode::kInvalidArgument, "cluster.switch_uplink_bandwidth: missing");
  EXPECT_ERROR(parse_edited([&](Json& r) { r["cluster"] = {{"gpus_per_node", 2}, {"nodes", 1}, {"gpus_per_switch", 4}}; }),
               StatusCode::kInvalidArgument, "cluster.gpus_per_switch", "more than gpus_per_node");
  EXPECT_ERROR(parse_edited([&](Json& r) { r["cluster"] = {{"gpus_per_node", 0}, {"nodes", 1}}; }), StatusCode::kInvalidArgument,
               "cluster.gpus_per_node");
  EXPECT_ERROR(parse_edited([&](Json& r) { r["cluster"] = {{"gpus_per_node", 8}, {"nodes", 1}, {"nvlink", 1}}; }),
               StatusCode::kInvalidArgument, "cluster", "nvlink");
  const HardwareProfile node = load_ok("h200x8-2tb"), four = load_ok("h200x8-2tb-4node");
  EXPECT_EQ(node.gpus_per_node(), 8);
  EXPECT_EQ(node.nodes(), 1);
  EXPECT_EQ(node.cluster->gpus_per_switch, 2);
  EXPECT_DOUBLE_EQ(node.host.ram_bytes.value, 2048.0 * (1 << 30));  // DGX H200: 2 TB
  EXPECT_EQ(node.host.cores, 112);                                    // 2x Xeon Platinum 8480C
  EXPECT_EQ(node.storage.size(), 8u);                                 // 8x 3.84 TB NVMe U.2
  EXPECT_EQ(four.nodes(), 4);
  EXPECT_LE(four.cluster->inter_node_bandwidth->value, 8 * 400e9 / 8);  // 8x 400 Gb/s per node, at most
  ASSERT_TRUE(hw->cluster->gpu_peer_bandwidth.has_value());
  EXPECT_DOUBLE_EQ(node.cluster->gpu_peer_bandwidth->value, 450e9);  // H200 SXM NVLink: 900 GB/s both directions
  EXPECT_FALSE(load_ok("h200-1.5tb").cluster.has_value());
  EXPECT_ERROR(parse_edited([&](Json& r) {
                 r["cluster"] = {{"gpus_per_node", 8}, {"nodes", 1}, {"gpu_peer_bandwidth", {{"value", -1.0}, {"provenance", fig["provenance"]}}}};
               }),
               StatusCode::kInvalidArgument, "cluster.gpu_peer_bandwidth");
}

TEST(RigErrors, ProvenanceMustBeOneOfTheKindsWithASource) {
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["matmul_bf16"]["provenance"]["kind"] = "paper"; }),
               StatusCode::kInvalidArgument, "gpu.matmul_bf16.provenance.kind", "'paper'", "datasheet, measured, estimate");
  EXPECT_ERROR(parse_edited([](Json& j) { j["host"]["ram_bytes"]["provenance"]["source"] = ""; }),
               StatusCode::kInvalidArgument, "host.ram_bytes.provenance.source: empty");
  EXPECT_ERROR(parse_edited([](Json& j) { j["gpu"]["memory_bytes"].erase("provenance"); }),
               StatusCode::kInvalidArgument, "gpu.memory_bytes.provenance: missing");
  auto measured = [](Json& p) {
    p["kind"] = "measured";
    p["source"] = "probe_h2d";
  };
  EXPECT_ERROR(parse_edited([&](Json& j) { measured(j["gpu"]["memory_bytes"]["provenance"]); }),
               StatusCode::kInvalidArgument, "gpu.memory_bytes.provenance.when: missing");
  EXPECT_ERROR(parse_edited([&](Json& j) {
                 measured(j["gpu"]["memory_bytes"]["provenance"]);
                 j["gpu"]["memory_bytes"]["provenance"]["when"] = "2026-04-09";
               }),
               StatusCode::kInvalidArgument, "gpu.memory_bytes.provenance.machine: missing");
  EXPECT_ERROR(parse_edited([&](Json& j) {
                 measured(j["gpu"]["memory_bytes"]["provenance"]);
                 j["gpu"]["memory_bytes"]["provenance"]["when"] = "last week";
                 j["gpu"]["memory_bytes"]["provenance"]["machine"] = "box";
               }),
               StatusCode::kInvalidArgument, "gpu.memory_bytes.provenance.when", "ISO-8601");
  Status ok = parse_edited([&](Json& j) {
    measured(j["gpu"]["memory_bytes"]["provenance"]);
    j["gpu"]["memory_bytes"]["provenance"]["when"] = "2026-04-09T10:00:00Z";
    j["gpu"]["memory_bytes"]["provenance"]["machine"] = "box";
  });
  EXPECT_TRUE(ok.ok()) << ok.to_string();
}

TEST(RigErrors, TheOptionalAttentionFiguresAreCheckedLikeTheOthers) {
  EXPECT_ERROR(parse_edited([](Json& j) {
                 j["gpu"]["attention_efficiency"] = {{"points", {{1e6, 1.5}}}, {"provenance", {{"kind", "estimate"}, {"source", "x"}}}};
               }),
               StatusCode::kInvalidArgument, "gpu.attention_efficiency.points[0]", "out of range");
  EXPECT_ERROR(parse_edited([](Json& j) {
                 j["gpu"]["attention_backward_ratio"] = {{"value", -1}, {"provenance", {{"kind", "estimate"}, {"source", "x"}}}};
               }),
               StatusCode::kInvalidArgument, "gpu.attention_backward_ratio.value");
  const Json layer = {{"model", "m"},  {"hidden", 8}, {"intermediate", 16}, {"heads", 2}, {"kv_heads", 1},
                      {"head_dim", 4}, {"seq", 16}, {"points", {{2, 1e-3, 2e-3}, {1, 1e-3, 2e-3}}},
                      {"provenance", {{"kind", "estimate"}, {"source", "x"}}}};
  EXPECT_ERROR(parse_edited([&](Json& j) { j["gpu"]["layer_times"] = layer; }), StatusCode::kInvalidArgument,
               "gpu.layer_times.points[1]", "sorted by micro_batch");
  EXPECT_ERROR(parse_edited([&](Json& j) {
                 j["gpu"]["layer_times"] = layer;
                 j["gpu"]["layer_times"]["points"] = {{1, 0, 2e-3}};
               }),
               StatusCode::kInvalidArgument, "gpu.layer_times.points[0]", "forward_s > 0");
  EXPECT_ERROR(parse_edited([](Json& j) {
                 j["gpu"]["grouped_gemm_efficiency"] = {{"points", {{16, 0.1}, {128, 1.5}}},
                                                        {"provenance", {{"kind", "estimate"}, {"source", "x"}}}};
               }),
               StatusCode::kInvalidArgument, "gpu.grouped_gemm_efficiency.points[1]", "out of range", "(0, 1]");
  EXPECT_ERROR(parse_edited([](Json& j) {
                 j["gpu"]["grouped_gemm_efficiency"] = {{"points", {{0, 0.1}}}, {"provenance", {{"kind", "estimate"}, {"source", "x"}}}};
               }),
               StatusCode::kInvalidArgument, "gpu.grouped_gemm_efficiency.points[0]", "x = 0");
  EXPECT_ERROR(parse_edited([&](Json& j) {
                 j["gpu"]["layer_times"] = layer;
                 j["gpu"]["layer_times"]["points"] = {{1, 1e-3, 2e-3}};
                 j["gpu"]["layer_times"]["experts"] = 8;  // without experts_per_token and moe_intermediate
               }),
               StatusCode::kInvalidArgument, "gpu.layer_times", "do not describe one layer");
  EXPECT_ERROR(parse_edited([&](Json& j) {
                 j["gpu"]["layer_times"] = layer;
                 j["gpu"]["layer_times"]["points"] = {{1, 1e-3, 2e-3}};
                 j["gpu"]["layer_times"]["experts"] = 2;
                 j["gpu"]["layer_times"]["experts_per_token"] = 4;
                 j["gpu"]["layer_times"]["moe_intermediate"] = 32;
               }),
               StatusCode::kInvalidArgument, "experts_per_token <= experts");
  auto absent = HardwareProfile::from_json_text(read_text(rig_file("h200-1.5tb")));
  ASSERT_TRUE(absent.ok());
  EXPECT_FALSE(absent->gpu.attention_efficiency.has_value());
  EXPECT_FALSE(absent->gpu.attention_backward_ratio.has_value());
  EXPECT_FALSE(absent->gpu.layer_times.has_value());
}

TEST(RigErrors, CurvesAndIoTablesMustBeSortedAndNonEmpty) {
  EXPECT_ERROR(parse_edited([](Json& j) {
                 auto& p = j["gpu"]["gemm_efficiency"]["points"];
                 std::swap(p[1], p[2]);
               }),
               StatusCode::kInvalidArgument, "gpu.gemm_efficiency.points[2]", "sorted by x");
  EXPECT_ERROR(parse_edited([](Json& j) { j["links"]["d2h"]["pinned_bandwidth"]["points"] = Json::array(); }),
               StatusCode::kInvalidArgument, "links.d2h.pinned_bandwidth.points: empty");
  EXPECT_ERROR(parse_edited([](Json& j) {
                 auto& r = j["storage"][0]["read"];
                 std::swap(r[0], r[1]);
               }),
               StatusCode::kInvalidArgument, "storage[0].read[1]", "sorted by (block_bytes, queue_depth)");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][0]["write"] = Json::array(); }), StatusCode::kInvalidArgument,
               "storage[0].write: empty");
}

TEST(RigErrors, DrivesNeedUniqueNamesAndPaths) {
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][1]["name"] = j["storage"][0]["name"]; }),
               StatusCode::kInvalidArgument, "storage[1].name", "storage[0]", "unique");
  EXPECT_ERROR(parse_edited([](Json& j) { j["storage"][1]["path"] = "/mnt/nvme0"; }), StatusCode::kInvalidArgument,
               "storage[1].path", "/mnt/nvme0");
}

TEST(RigErrors, WrongSchemaIsRefusedFirst) {
  EXPECT_ERROR(parse_edited([](Json& j) {
                 j["schema"] = "megatrain.plan/1";
                 j["training"] = Json::object();  // a plan's key: the schema is reported, not this
               }),
               StatusCode::kInvalidArgument, "schema", "megatrain.plan/1", "megatrain.rig/1");
  EXPECT_ERROR(parse_edited([](Json& j) { j["schema"] = "megatrain.rig/2"; }), StatusCode::kUnsupported,
               "megatrain.rig/2", "another MegaTrain version");
  EXPECT_ERROR(parse_edited([](Json& j) { j.erase("schema"); }), StatusCode::kInvalidArgument, "schema: missing");
  EXPECT_ERROR(HardwareProfile::from_json_text("[1, 2]").status(), StatusCode::kInvalidArgument, "expected a rig object");
}

TEST(RigErrors, TruncatedJsonIsAParseError) {
  std::string text = read_text(rig_file("h200-1.5tb"));
  EXPECT_ERROR(HardwareProfile::from_json_text(text.substr(0, text.size() / 2), "h200.json").status(),
               StatusCode::kParseError, "h200.json", "truncated");
  EXPECT_ERROR(HardwareProfile::from_json_text("{\"schema\": \"megatrain.rig/1\",, }").status(), StatusCode::kParseError,
               "line 1");
}

TEST(RigErrors, MissingFileAndUnknownRigNameAreNotFound) {
  std::string missing = (fs::temp_directory_path() / "megatrain-no-such-dir" / "rig.json").string();
  EXPECT_ERROR(HardwareProfile::load(missing).status(), StatusCode::kNotFound, missing.c_str());
  EXPECT_ERROR(HardwareProfile::load("no-such-rig").status(), StatusCode::kNotFound, "no-such-rig", "h200-1.5tb",
               "rtx3090-256gb", "gh200-480gb");
  EXPECT_ERROR(HardwareProfile::load("h200-1.5t").status(), StatusCode::kNotFound, "did you mean \"h200-1.5tb\"");
}

TEST(RigErrors, LoadNamesTheFileInEveryValidationError) {
  fs::path dir = fs::temp_directory_path() / ("megatrain-rig-test-" + std::to_string(getpid()));
  fs::create_directories(dir);
  Json j = Json::parse(read_text(rig_file("gh200-480gb")));
  j["host"]["cores"] = 0;
  fs::path bad = dir / "bad.json";
  std::ofstream(bad) << j.dump(2);
  const std::string bad_path = bad.string();  // outlives the macro's list of C strings
  EXPECT_ERROR(HardwareProfile::load(bad_path).status(), StatusCode::kInvalidArgument, bad_path.c_str(), "host.cores");
  fs::remove_all(dir);
}

// ---- saving ------------------------------------------------------------------------------------

TEST(HardwareProfile, SaveWritesAFileThatLoadsBackAndRefusesAnInvalidProfile) {
  fs::path dir = fs::temp_directory_path() / ("megatrain-rig-save-" + std::to_string(getpid()));
  fs::create_directories(dir);
  HardwareProfile hw = load_ok("a100-80gb-pcie");
  hw.name = "my-a100";
  fs::path out = dir / "my-a100.json";
  Status s = hw.save(out);
  ASSERT_TRUE(s.ok()) << s.to_string();
  auto back = HardwareProfile::load(out.string());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(hw == *back);
  std::string text = read_text(out);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');

  HardwareProfile broken = hw;
  broken.gpu.memory_bandwidth.provenance.source.clear();
  fs::path never = dir / "broken.json";
  EXPECT_ERROR(broken.save(never), StatusCode::kInvalidArgument, "gpu.memory_bandwidth.provenance.source");
  EXPECT_FALSE(fs::exists(never)) << "an invalid profile must not be written";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace megatrain

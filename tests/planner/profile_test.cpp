// The profiler: its least-squares fits on synthetic data with known answers, a small real profile that
// must validate and round-trip through save/load, and clear refusals of unusable storage directories.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "detail/profile_probes.h"
#include "megatrain/planner/profile.h"

namespace megatrain::planner {
namespace {

namespace fs = std::filesystem;

std::vector<double> transfer_sizes() {
  std::vector<double> x;
  for (double b = 4096; b <= 268435456; b *= 4) x.push_back(b);
  return x;
}

TEST(ProfileFit, RecoversLatencyAndBandwidthFromExactData) {
  const double lat = 8e-6, bw = 25e9;
  std::vector<double> x = transfer_sizes(), t;
  for (double b : x) t.push_back(lat + b / bw);
  auto f = fit_latency_bandwidth(x, t);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_NEAR(f->latency_s, lat, lat * 1e-9);
  EXPECT_NEAR(f->bandwidth, bw, bw * 1e-9);
  EXPECT_LT(f->rms_rel, 1e-12);
  EXPECT_LT(f->max_rel, 1e-12);
  EXPECT_EQ(f->points, static_cast<int64_t>(x.size()));
  EXPECT_NEAR(f->rate_at(1e9), 1e9 / (lat + 1e9 / bw), 1.0);
}

TEST(ProfileFit, RecoversLatencyAndBandwidthFromNoisyData) {
  const double lat = 5e-6, bw = 12e9;
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> noise(-0.03, 0.03);
  std::vector<double> x, t;
  for (int rep = 0; rep < 3; ++rep)
    for (double b : transfer_sizes()) {
      x.push_back(b);
      t.push_back((lat + b / bw) * (1 + noise(gen)));
    }
  auto f = fit_latency_bandwidth(x, t);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_NEAR(f->latency_s, lat, 0.05 * lat);
  EXPECT_NEAR(f->bandwidth, bw, 0.05 * bw);
  // The residuals report the noise: about 3% / sqrt(3) RMS, never more than the 3% put in (plus the fit's own error).
  EXPECT_GT(f->rms_rel, 0.005);
  EXPECT_LT(f->rms_rel, 0.03);
  EXPECT_LT(f->max_rel, 0.05);
}

TEST(ProfileFit, NegativeInterceptIsRefittedThroughTheOrigin) {
  // Small transfers relatively faster than large ones (a cache effect) pull the intercept below zero.
  std::vector<double> x = {1e4, 1e5, 1e6, 1e7}, t = {0.5e-6, 6e-6, 70e-6, 800e-6};
  auto f = fit_latency_bandwidth(x, t);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->latency_s, 0.0);
  EXPECT_GT(f->bandwidth, 1e10);
  EXPECT_LT(f->bandwidth, 2e10);
}

TEST(ProfileFit, RejectsUnusableData) {
  EXPECT_FALSE(fit_latency_bandwidth({1, 2}, {1}).ok());
  EXPECT_FALSE(fit_latency_bandwidth({1}, {1}).ok());
  EXPECT_FALSE(fit_latency_bandwidth({5, 5, 5}, {1, 1, 1}).ok());
  EXPECT_FALSE(fit_latency_bandwidth({1, 2}, {1, 0}).ok());
  EXPECT_FALSE(fit_latency_bandwidth({1, -2}, {1, 2}).ok());
  EXPECT_FALSE(fit_latency_bandwidth({1, 2}, {1, NAN}).ok());
  auto shrinking = fit_latency_bandwidth({1e3, 1e6}, {1e-3, 1e-6});  // bigger is faster: no positive bandwidth
  ASSERT_FALSE(shrinking.ok());
  EXPECT_NE(shrinking.status().message().find("bandwidth"), std::string::npos);
}

// Samples t = t0 + F / R over layer-like shapes.
std::vector<GemmSample> synthetic_gemms(double t0, double rate) {
  std::vector<GemmSample> s;
  for (int64_t m : {64, 256, 1024, 4096})
    for (int64_t h : {128, 512, 2048}) {
      GemmSample g{m, h, h, 0};
      g.seconds = t0 + g.flops() / rate;
      s.push_back(g);
    }
  return s;
}

void expect_valid_curve(const std::vector<std::pair<double, double>>& pts) {
  ASSERT_FALSE(pts.empty());
  for (size_t i = 0; i < pts.size(); ++i) {
    EXPECT_GT(pts[i].first, 0);
    EXPECT_GT(pts[i].second, 0);
    EXPECT_LE(pts[i].second, 1.0);
    if (i > 0) {
      EXPECT_GT(pts[i].first, pts[i - 1].first) << "x must increase strictly";
      EXPECT_GE(pts[i].second, pts[i - 1].second) << "the curve is monotone";
    }
  }
}

TEST(ProfileFit, GemmEfficiencyCurveFromExactOverheadModel) {
  const double t0 = 5e-6, rate = 100e9;
  auto f = fit_gemm_efficiency(synthetic_gemms(t0, rate));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  expect_valid_curve(f->points);
  EXPECT_NEAR(f->overhead.latency_s, t0, t0 * 1e-6);
  EXPECT_NEAR(f->overhead.bandwidth, rate, rate * 1e-6);
  EXPECT_DOUBLE_EQ(f->points.back().second, 1.0);  // the largest shape is the peak
  // Efficiency of each point is the model's: F / (t0 + F / R) / peak.
  for (const auto& [x, y] : f->points) EXPECT_NEAR(y * f->peak_flops_per_s, x / (t0 + x / rate), 1e-6 * rate);
  EXPECT_LT(f->curve_rms_rel, 1e-9);
  // A rig with this curve loads.
  Curve c;
  c.points = f->points;
  EXPECT_NEAR(c.at(f->points.front().first), f->points.front().second, 1e-12);
}

TEST(ProfileFit, GemmEfficiencyIsMonotoneAndBoundedOnNoisyData) {
  auto s = synthetic_gemms(20e-6, 200e9);
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> noise(0.8, 1.25);
  for (auto& g : s) g.seconds *= noise(gen);
  s.push_back({32, 64, 64, 1e-7});  // a tiny, cache-resident GEMM far faster than the large-shape peak
  auto f = fit_gemm_efficiency(s);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  expect_valid_curve(f->points);
  EXPECT_GT(f->curve_rms_rel, 0);  // the noise shows in the residuals
  double large_best = 0, largest = 0;
  for (const auto& g : s) largest = std::max(largest, g.flops());
  for (const auto& g : s)
    if (g.flops() >= largest / 16) large_best = std::max(large_best, g.flops() / g.seconds);
  EXPECT_DOUBLE_EQ(f->peak_flops_per_s, large_best);
}

TEST(ProfileFit, GemmEfficiencyRejectsTooFewShapes) {
  EXPECT_FALSE(fit_gemm_efficiency({}).ok());
  EXPECT_FALSE(fit_gemm_efficiency({{64, 64, 64, 1e-6}, {64, 64, 64, 2e-6}}).ok());
  EXPECT_FALSE(fit_gemm_efficiency({{64, 64, 64, 1e-6}, {0, 64, 64, 2e-6}}).ok());
}

// Grouped GEMMs whose time is the sum of per-expert GEMMs of `t0 + F_e / R` (a loop over experts,
// each paying a fixed cost): the rate rises with rows per expert towards R.
std::vector<GroupedGemmSample> synthetic_grouped(double t0, double rate) {
  std::vector<GroupedGemmSample> out;
  for (int64_t rows : {16, 64, 256, 1024})
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{512, 256}, {256, 512}}) {
      GroupedGemmSample g{8, rows, n, k, 0};
      g.seconds = 8 * (t0 + 2.0 * static_cast<double>(rows * n * k) / rate);
      out.push_back(g);
    }
  return out;
}

TEST(ProfileFit, GroupedGemmCurveIsTheRateByRowsOverTheDensePeak) {
  const double t0 = 20e-6, rate = 100e9, peak = 120e9;
  const auto samples = synthetic_grouped(t0, rate);
  auto f = fit_grouped_gemm_efficiency(samples, peak);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  expect_valid_curve(f->points);
  ASSERT_EQ(f->points.size(), 4u);  // one point per row count
  for (const auto& [rows, y] : f->points) {
    // Both shapes of a row count have the same FLOPs, hence the same modelled rate.
    const double fl = 2.0 * 8 * rows * 512 * 256;
    EXPECT_NEAR(y, fl / (8 * t0 + fl / rate) / peak, 1e-12) << rows;
  }
  EXPECT_LT(f->curve_rms_rel, 1e-9);
  // A rate above the dense peak (a cache-resident call at 16 rows) counts as the peak, and the
  // larger row counts, all slower, are pooled with it: the least-squares monotone fit is flat at
  // the mean of the clamped rates.
  auto noisy = samples;
  noisy[0].seconds = noisy[0].flops() / (2 * peak);
  noisy[1].seconds = noisy[1].flops() / (2 * peak);
  auto g = fit_grouped_gemm_efficiency(noisy, peak);
  ASSERT_TRUE(g.ok());
  expect_valid_curve(g->points);
  double mean = 2.0;
  for (size_t i = 2; i < noisy.size(); ++i) mean += noisy[i].flops() / noisy[i].seconds / peak;
  mean /= static_cast<double>(noisy.size());
  ASSERT_EQ(g->points.size(), 2u);  // a flat run keeps only its ends
  for (const auto& [rows, y] : g->points) EXPECT_NEAR(y, mean, 1e-12) << rows;
  EXPECT_GT(g->curve_rms_rel, 0.1);
}

TEST(ProfileFit, GroupedGemmFitRejectsUnusableData) {
  EXPECT_FALSE(fit_grouped_gemm_efficiency({}, 1e9).ok());
  EXPECT_FALSE(fit_grouped_gemm_efficiency({{8, 16, 64, 64, 1e-6}, {8, 16, 64, 64, 2e-6}}, 1e9).ok());  // one row count
  EXPECT_FALSE(fit_grouped_gemm_efficiency({{8, 16, 64, 64, 1e-6}, {0, 32, 64, 64, 2e-6}}, 1e9).ok());
  EXPECT_FALSE(fit_grouped_gemm_efficiency(synthetic_grouped(1e-6, 1e9), 0).ok());
}

TEST(ProfileProbes, GroupedShapesAreGateUpAndDownWithinTheFlopLimit) {
  const auto shapes = detail::grouped_gemm_shapes({16, 1024}, 8, 512, 256, 2.0 * 8 * 1024 * 512 * 256 - 1);
  // 16 rows: both projections; 1024 rows: over the limit by one FLOP, skipped.
  ASSERT_EQ(shapes.size(), 2u);
  EXPECT_EQ(shapes[0].n, 256);  // gate/up: n = intermediate, k = hidden
  EXPECT_EQ(shapes[0].k, 512);
  EXPECT_EQ(shapes[1].n, 512);  // down
  EXPECT_EQ(shapes[1].k, 256);
  // gpt-oss's expert (2880 x 2880), 8 experts x 1024 rows, within 2e10 FLOPs: both scaled by one
  // factor, rounded down to 64.
  const auto [h, i] = detail::scaled_expert_shape(2880, 2880, 8, 1024, 2e10);
  EXPECT_EQ(h, 1088);
  EXPECT_EQ(i, 1088);
  EXPECT_LE(2.0 * 8 * 1024 * h * i, 2e10);
  const std::pair<int64_t, int64_t> unchanged(256, 512);
  EXPECT_EQ(detail::scaled_expert_shape(256, 512, 8, 64, 1e12), unchanged);
}

// The shape grid's efficiencies by hand: tokens {10, 20}, sizes {1, 2}; peak 100 FLOP/s. A timed
// cell's efficiency is 2 t i o / seconds / peak (at most 1); an untimed cell takes the best of the
// cells one step smaller (filled in order, so the largest takes the best below it).
TEST(ProfileProbes, ShapeGridEfficienciesAndFilledCellsByHand) {
  detail::LinearGrid g;
  g.tokens = {10, 20};
  g.sizes = {1, 2};
  // cells (t, i, o): (10,1,1) 20 FLOPs in 0.4 s: 0.5; (10,1,2) 40 in 1: 0.4; (10,2,1) 40 in 0.5: 0.8;
  // (10,2,2) untimed; (20,1,1) 40 in 0.2: 2 -> clamped to 1; (20,1,2), (20,2,1), (20,2,2) untimed.
  g.seconds[0] = {0.4, 1.0, 0.5, 0, 0.2, 0, 0, 0};
  g.seconds[1] = g.seconds[2] = g.seconds[0];
  auto r = detail::gemm_shapes_from_grid(g, 100);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // (10,2,2): max of (10,1,2) 0.4 and (10,2,1) 0.8; (20,1,2): max of (10,1,2) 0.4 and (20,1,1) 1;
  // (20,2,1): max of (10,2,1) 0.8, (20,1,1) 1; (20,2,2): 1.
  const std::vector<double> want = {0.5, 0.4, 0.8, 0.8, 1.0, 1.0, 1.0, 1.0};
  for (int op = 0; op < 3; ++op)
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(r->efficiency[op][i], want[i], 1e-12) << op << " " << i;
  g.seconds[2].assign(8, 0.0);
  EXPECT_FALSE(detail::gemm_shapes_from_grid(g, 100).ok()) << "an op with no timed cell";
  EXPECT_FALSE(detail::gemm_shapes_from_grid(g, 0).ok());
}

// A temp directory on the same file system as the build (ext4 here; /tmp may be tmpfs elsewhere).
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::path(MEGATRAIN_BINARY_DIR) / ("profile-test-" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

ProfileSizes tiny_sizes() {
  ProfileSizes s;
  s.triad_bytes = 4 << 20;
  s.triad_reps = 2;
  s.adam_params = 1 << 20;
  s.adam_reps = 1;
  s.gemm_rows = {32, 128};
  s.gemm_hidden = {64, 256};
  s.gemm_max_flops = 1e9;
  s.gemm_min_time_s = 0.003;
  s.grid_tokens = {32, 256};
  s.grid_sizes = {64, 512, 4096};
  s.grid_max_flops = 2e8;
  s.grid_max_elems = 1 << 20;
  s.grouped_rows = {16, 64};
  s.grouped_experts = 4;
  s.grouped_hidden = 128;
  s.grouped_intermediate = 64;
  s.copy_bytes = {64 << 10, 1 << 20, 4 << 20};
  s.copy_min_time_s = 0.003;
  s.storage_file_bytes = 16 << 20;
  s.storage_blocks = {128 << 10, 1 << 20};
  s.storage_depths = {1, 4};
  s.storage_point_max_s = 0.1;
  return s;
}

TEST(Profile, SmallRunGivesAValidMeasuredRigThatRoundTrips) {
  TempDir dir;
  if (Status s = check_storage_dir(dir.path.string()); !s.ok()) GTEST_SKIP() << "no O_DIRECT here: " << s.to_string();
  ProfileOptions opt;
  opt.storage_dirs = {dir.path.string()};
  opt.sizes = tiny_sizes();
  opt.mode = "test";
  opt.use_gpu = false;
  int last_step = 0, steps_seen = 0;
  opt.progress = [&](int step, int steps, const std::string& what) {
    EXPECT_GE(step, last_step);
    EXPECT_LE(step, steps);
    EXPECT_FALSE(what.empty());
    last_step = step;
    steps_seen = steps;
  };
  auto r = run_profile(opt);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(last_step, steps_seen);
  const HardwareProfile& rig = r->rig;

  // Validation: the rig as written parses back to itself.
  auto back = HardwareProfile::from_json_text(rig.to_json_text());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, rig);
  const fs::path file = dir.path / "rig.json";
  ASSERT_TRUE(rig.save(file).ok());
  auto loaded = HardwareProfile::load(file.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(*loaded, rig);

  // Measured figures say when and where.
  for (const Provenance* p : {&rig.host.memory_bandwidth.provenance, &rig.gpu.matmul_fp32.provenance,
                              &rig.gpu.gemm_efficiency.provenance, &rig.links.h2d.pinned_bandwidth.provenance,
                              &rig.storage.at(0).io_provenance}) {
    EXPECT_EQ(p->kind, Provenance::Kind::kMeasured) << p->source;
    EXPECT_FALSE(p->when.empty());
    EXPECT_FALSE(p->machine.empty());
    EXPECT_NE(p->source.find("megatrain-plan profile"), std::string::npos) << p->source;
  }
  EXPECT_GT(rig.host.memory_bandwidth.value, 1e8);
  EXPECT_GT(rig.gpu.matmul_fp32.value, 1e8);
  expect_valid_curve(rig.gpu.gemm_efficiency.points);
  ASSERT_FALSE(rig.host.adam.empty());
  // fp32 at every thread count; every other state format at least at all CPUs; each (format,
  // threads) pair once.
  std::map<std::string, std::set<int64_t>> threads;
  for (const auto& a : rig.host.adam) {
    EXPECT_GT(a.params_per_s.value, 1e6) << a.state_format;
    EXPECT_EQ(a.params_per_s.provenance.kind, Provenance::Kind::kMeasured);
    EXPECT_TRUE(threads[a.state_format].insert(a.threads).second) << a.state_format << " " << a.threads;
  }
  for (const char* f : {"fp32", "bf16", "q8", "q4", "q3", "q2"}) {
    ASSERT_EQ(threads.count(f), 1u) << "no host.adam entry for state format " << f;
    EXPECT_EQ(*threads[f].rbegin(), rig.host.cores) << f;
  }
  EXPECT_EQ(threads.size(), 6u);
  EXPECT_EQ(rig.links.h2d.pinned_bandwidth.points.size(), 3u);
  EXPECT_FALSE(rig.links.full_duplex);

  ASSERT_EQ(rig.storage.size(), 1u);
  const NvmeSpec& d = rig.storage[0];
  EXPECT_EQ(d.read.size(), 4u);
  EXPECT_EQ(d.write.size(), 4u);
  EXPECT_EQ(d.read.front().block_bytes, 128 << 10);
  EXPECT_EQ(d.read.back().block_bytes, 1 << 20);
  EXPECT_EQ(d.read.back().queue_depth, 4);
  for (const IoPoint& p : d.read) EXPECT_GT(p.bytes_per_s, 1e6);
  EXPECT_GT(d.capacity_bytes.value, 0);
  EXPECT_GT(d.read_bandwidth(1 << 20, 32), 0);

  // The temp file is gone (only the rig we saved is left).
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    EXPECT_EQ(e.path().filename(), "rig.json");
    ++entries;
  }
  EXPECT_EQ(entries, 1);

  // Fits and --json.
  std::set<std::string> fit_names;
  for (const FitReport& f : r->fits) {
    fit_names.insert(f.name);
    EXPECT_GE(f.rms_rel, 0);
    EXPECT_GE(f.max_rel, f.rms_rel);
  }
  for (const char* n : {"h2d", "d2h", "gemm_overhead", "gemm_efficiency_curve", "grouped_gemm_curve"})
    EXPECT_TRUE(fit_names.count(n)) << n;
  // The GEMM shape grid: the axes asked for, every cell of every op a fraction of peak, measured.
  ASSERT_TRUE(rig.gpu.gemm_shapes.has_value());
  const GemmShapes& gs = *rig.gpu.gemm_shapes;
  EXPECT_EQ(gs.tokens, (std::vector<double>{32, 256}));
  EXPECT_EQ(gs.in, (std::vector<double>{64, 512, 4096}));
  EXPECT_EQ(gs.out, gs.in);
  for (int op = 0; op < 3; ++op) {
    ASSERT_EQ(gs.efficiency[op].size(), 18u);
    for (double e : gs.efficiency[op]) {
      EXPECT_GT(e, 0);
      EXPECT_LE(e, 1);
    }
  }
  EXPECT_EQ(gs.provenance.kind, Provenance::Kind::kMeasured);
  EXPECT_NE(gs.provenance.source.find("(tokens, in, out) cells per op"), std::string::npos) << gs.provenance.source;
  // The grouped-GEMM probe: one point per row count, measured.
  ASSERT_TRUE(rig.gpu.grouped_gemm_efficiency.has_value());
  expect_valid_curve(rig.gpu.grouped_gemm_efficiency->points);
  EXPECT_EQ(rig.gpu.grouped_gemm_efficiency->points.front().first, 16);
  EXPECT_EQ(rig.gpu.grouped_gemm_efficiency->provenance.kind, Provenance::Kind::kMeasured);
  EXPECT_NE(rig.gpu.grouped_gemm_efficiency->provenance.source.find("4 experts of hidden 128 x intermediate 64"), std::string::npos)
      << rig.gpu.grouped_gemm_efficiency->provenance.source;
  const auto j = nlohmann::json::parse(profile_json(*r));
  ASSERT_TRUE(j.contains("rig") && j.contains("fits"));
  EXPECT_EQ(j["rig"]["schema"], "megatrain.rig/1");
  EXPECT_TRUE(j["fits"]["h2d"].contains("rms_rel_residual"));
  EXPECT_TRUE(HardwareProfile::from_json_text(j["rig"].dump()).ok());
  EXPECT_NE(profile_table(*r).find("fits"), std::string::npos);
}

TEST(Profile, MissingStorageDirIsRejectedByName) {
  const std::string missing = "/nonexistent-megatrain-dir/sub";
  Status s = check_storage_dir(missing);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(missing), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("No such file"), std::string::npos) << s.message();

  ProfileOptions opt;
  opt.storage_dirs = {missing};
  opt.sizes = tiny_sizes();
  opt.use_gpu = false;
  bool measured = false;
  opt.progress = [&](int, int, const std::string&) { measured = true; };
  auto r = run_profile(opt);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(missing), std::string::npos);
  EXPECT_FALSE(measured) << "storage directories are checked before anything is measured";
}

TEST(Profile, StorageDirThatIsAFileOrGivenTwiceIsRejected) {
  TempDir dir;
  const fs::path file = dir.path / "plain-file";
  { std::FILE* f = std::fopen(file.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  Status s = check_storage_dir(file.string());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(file.string()), std::string::npos);
  EXPECT_NE(s.message().find("not a directory"), std::string::npos);

  ProfileOptions opt;
  opt.storage_dirs = {dir.path.string(), dir.path.string()};
  opt.use_gpu = false;
  auto r = run_profile(opt);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("twice"), std::string::npos);
}

TEST(Profile, ReadOnlyStorageDirIsRejectedByName) {
  TempDir dir;
  const fs::path ro = dir.path / "read-only";
  fs::create_directories(ro);
  bool immutable = false;
  if (::geteuid() == 0) {
    // root ignores permission bits; the immutable attribute stops even root from creating files.
    const int fd = ::open(ro.c_str(), O_RDONLY | O_DIRECTORY);
    int flags = 0;
    if (fd >= 0 && ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0) {
      flags |= FS_IMMUTABLE_FL;
      immutable = ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
    }
    if (fd >= 0) ::close(fd);
    if (!immutable) GTEST_SKIP() << "running as root on a file system without the immutable attribute";
  } else {
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
  }
  Status s = check_storage_dir(ro.string());
  // Undo before asserting, so the directory can always be removed.
  if (immutable) {
    const int fd = ::open(ro.c_str(), O_RDONLY | O_DIRECTORY);
    int flags = 0;
    if (fd >= 0 && ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0) {
      flags &= ~FS_IMMUTABLE_FL;
      (void)::ioctl(fd, FS_IOC_SETFLAGS, &flags);
    }
    if (fd >= 0) ::close(fd);
  } else {
    fs::permissions(ro, fs::perms::owner_all);
  }
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(ro.string()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("writable"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace megatrain::planner

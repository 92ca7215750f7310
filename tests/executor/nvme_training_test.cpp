// Training with the NVMe tier (issue 9): master weights and/or Adam's moments in an NvmeStore,
// paged in ahead of the optimizer and written back behind it. The streamed pipeline with an NVMe
// placement gives the same losses, weights and moments as the plain in-memory loop with everything
// in RAM, bit for bit (fp32 and bf16 transfer, quantised moments, clipping, microbatch-major,
// one or several staging buffers, striping, a tied head); checkpoints written from an NVMe state
// resume bit for bit and move between NVMe and RAM placements; a corrupted block on the drive
// fails the step as kCorrupt naming the file, and later steps fail instead of hanging; a full disk
// at checkpoint time leaves the previous checkpoint loadable; bad placements are refused before
// training.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "executor/faulty_io.h"
#include "executor/file_test_util.h"
#include "megatrain/core/plan.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/trainer.h"

namespace megatrain::exec {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr int64_t kBlock = 65536;  // placement.nvme_block_bytes: small units are not padded to 1 MiB

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A fresh folder under /tmp (a real file system: O_DIRECT works there), removed at scope exit.
class TmpDir {
 public:
  explicit TmpDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    std::random_device rd;
    path_ = fs::path("/tmp") / ("megatrain-nvmetrain-" + tag + "-" + std::to_string(::getpid()) + "-" +
                                std::to_string(counter++) + "-" + std::to_string(rd() % 100000));
    std::error_code ec;
    fs::remove_all(path_, ec);
    fs::create_directories(path_);
  }
  ~TmpDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TmpDir(const TmpDir&) = delete;
  TmpDir& operator=(const TmpDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  // A subfolder, created.
  fs::path sub(const std::string& name) const {
    fs::create_directories(path_ / name);
    return path_ / name;
  }

 private:
  fs::path path_;
};

using test::TmpfsMount;

std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string join(const std::set<std::string>& s) {
  std::string out;
  for (const auto& x : s) out += (out.empty() ? "" : ", ") + x;
  return out;
}

// ---- plans and setups -----------------------------------------------------------------------------

Json base_plan(const std::string& model) {
  return Json{{"schema", "megatrain.plan/1"},
              {"model", model},
              {"rig", "cpu-dev-2core"},
              {"training", {{"seq_len", 16}, {"micro_batch", 2}, {"grad_accum", 3}, {"steps", 4}, {"seed", 7}, {"lr", 3e-3},
                            {"warmup_steps", 1}, {"min_lr", 3e-4}, {"clip_grad_norm", 0.0}, {"data_order", "sequential"}}},
              {"precision", {{"compute", "fp32"}, {"transfer", "fp32"}}},
              {"schedule", {{"prefetch_depth", 2}, {"device_layer_buffers", 3}, {"checkpoint_every", 1},
                            {"checkpoint_location", "device"}}},
              {"optimizer", {{"threads", 1}}}};
}

// One unit's NVMe transfer for the plan with these parts on NVMe: the least pinned_staging_bytes
// the plan rule accepts, which gives one staging buffer.
int64_t one_unit_staging(const Json& pj, bool master, bool states) {
  Json ram = pj;
  ram.erase("placement");
  auto plan = Plan::from_json_text(ram.dump());
  MT_CHECK(plan.ok(), plan.status().to_string());
  auto model = plan->resolve_model();
  MT_CHECK(model.ok(), model.status().to_string());
  return nvme_unit_transfer_bytes(*model, master, states, plan->optimizer.m_format, plan->optimizer.v_format,
                                  plan->optimizer.block_size);
}

// The plan with the given parts on NVMe in `dirs`; staging_bytes < 0: one unit's transfer.
Json on_nvme(Json pj, bool master, bool states, const std::vector<fs::path>& dirs, int64_t staging_bytes = -1,
             int64_t queue_depth = 8) {
  if (staging_bytes < 0) staging_bytes = one_unit_staging(pj, master, states);
  Json d = Json::array();
  for (const auto& p : dirs) d.push_back(p.string());
  pj["placement"] = {{"master_weights", master ? "nvme" : "ram"},
                     {"optimizer_states", states ? "nvme" : "ram"},
                     {"nvme_dirs", d},
                     {"pinned_staging_bytes", staging_bytes},
                     {"nvme_queue_depth", queue_depth},
                     {"nvme_block_bytes", kBlock}};
  return pj;
}

// The same plan with everything in RAM.
Json in_ram(Json pj) {
  pj.erase("placement");
  return pj;
}

struct TrainSetup {
  Plan plan;
  ModelSpec model;
  std::unique_ptr<DataLoader> loader;
  bool force_thread_pool = false;
  bool all_gradients = true;
};

TrainSetup make_setup(const Json& pj) {
  auto plan = Plan::from_json_text(pj.dump());
  MT_CHECK(plan.ok(), plan.status().to_string());
  auto model = plan->resolve_model();
  MT_CHECK(model.ok(), model.status().to_string());
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 4000; ++i) toks.push_back((i * 2654435761u >> 7) % 256);
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks, "tokens"));
  auto loader = DataLoader::create(file, plan->training.seq_len, plan->training.micro_batch, plan->training.grad_accum,
                                   plan->training.data_order,
                                   static_cast<uint64_t>(plan->training.seed), model->config().vocab_size);
  MT_CHECK(loader.ok(), loader.status().to_string());
  return TrainSetup{*plan, *model, std::make_unique<DataLoader>(std::move(loader).value())};
}

// The NVMe placement of a plan, as megatrain-exec builds it, optionally on the thread-pool I/O path.
NvmePlacement placement_of(const Plan& plan, bool force_thread_pool = false) {
  NvmePlacement nvme = nvme_placement_of(plan.placement);
  nvme.store.force_thread_pool = force_thread_pool;
  return nvme;
}

Result<HostState> make_state(const TrainSetup& su) {
  return HostState::create(su.model, su.plan.precision.transfer, su.plan.optimizer.m_format, su.plan.optimizer.v_format,
                           su.plan.optimizer.block_size, placement_of(su.plan, su.force_thread_pool), su.all_gradients);
}

CheckpointInfo info_for(const TrainSetup& su, int64_t next_step, const std::vector<double>& losses = {}) {
  CheckpointInfo info;
  info.next_step = next_step;
  info.model_name = su.model.name();
  info.parameters = su.model.parameter_counts().total;
  info.plan_json = su.plan.to_json_text();
  info.data = data_position(*su.loader);
  info.seed = static_cast<uint64_t>(su.plan.training.seed);
  info.losses = losses;
  return info;
}

// ---- what a state holds ---------------------------------------------------------------------------

// Every unit's master weights, m and v decoded tensor by tensor (MomentStore::decode), and the bf16
// streaming copy: NVMe-resident units are paged in one at a time (read only) to look at them.
struct Snapshot {
  std::vector<std::vector<float>> master;
  std::vector<std::vector<std::vector<float>>> m, v;  // [unit][tensor]
  std::vector<std::vector<uint16_t>> stream;
};

Snapshot snapshot(HostState& hs) {
  Snapshot s;
  UnitPager pager(hs);
  for (size_t u = 0; u < hs.units().size(); ++u) {
    auto got = pager.get(static_cast<int64_t>(u));
    EXPECT_TRUE(got.ok()) << "paging in unit " << u << ": " << got.status().to_string();
    if (!got.ok()) break;
    const UnitState& us = **got;
    s.master.emplace_back(us.master.data(), us.master.data() + us.numel);
    s.m.emplace_back();
    s.v.emplace_back();
    for (size_t t = 0; t < us.tensors.size(); ++t) {
      std::vector<float> m(static_cast<size_t>(us.tensors[t].numel)), v(m.size());
      us.m.decode(t, m.data());
      us.v.decode(t, v.data());
      s.m.back().push_back(std::move(m));
      s.v.back().push_back(std::move(v));
    }
    s.stream.emplace_back(us.stream_bf16.data(), us.stream_bf16.data() + us.stream_bf16.size());
  }
  const Status done = pager.finish();
  EXPECT_TRUE(done.ok()) << done.to_string();
  for (size_t u = 0; u < hs.units().size(); ++u) EXPECT_FALSE(hs.on_nvme() && hs.paged_in(static_cast<int64_t>(u)));
  return s;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void expect_same_snapshot(const Snapshot& a, const Snapshot& b) {
  ASSERT_EQ(a.master.size(), b.master.size());
  ASSERT_FALSE(a.master.empty());
  for (size_t u = 0; u < a.master.size(); ++u) {
    EXPECT_TRUE(same_bits(a.master[u], b.master[u])) << "master weights of unit " << u << " differ";
    ASSERT_EQ(a.m[u].size(), b.m[u].size());
    for (size_t t = 0; t < a.m[u].size(); ++t) {
      EXPECT_TRUE(same_bits(a.m[u][t], b.m[u][t])) << "m of unit " << u << " tensor " << t << " differs";
      EXPECT_TRUE(same_bits(a.v[u][t], b.v[u][t])) << "v of unit " << u << " tensor " << t << " differs";
    }
    EXPECT_TRUE(same_bits(a.stream[u], b.stream[u])) << "bf16 streaming copy of unit " << u << " differs";
  }
}

struct TrainRun {
  std::vector<double> losses;
  Snapshot state;
  int64_t bytes = 0;            // HostState::bytes() while training
  int64_t staging_buffers = 0;
  int64_t staging_bytes = 0;
  int64_t params = 0;
  size_t nvme_files = 0;
  int64_t unused_experts = 0;  // (layer, expert) pairs no token chose, summed over the steps
  bool ok = false;
};

// `steps` steps from a seeded initialisation with the plan's placement.
TrainRun train(const Json& pj, bool streamed, int steps = 4, bool force_thread_pool = false, bool all_gradients = true) {
  TrainRun r;
  TrainSetup su = make_setup(pj);
  su.force_thread_pool = force_thread_pool;
  su.all_gradients = all_gradients;
  auto created = make_state(su);
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  if (!created.ok()) return r;
  HostState hs = std::move(created).value();
  const Status init = hs.init_random(7, 0.02);
  EXPECT_TRUE(init.ok()) << init.to_string();
  r.bytes = hs.bytes();
  r.staging_buffers = hs.staging_buffers();
  r.staging_bytes = hs.staging_bytes();
  for (const UnitState& us : hs.units()) r.params += us.numel;
  r.nvme_files = hs.nvme_store() ? hs.nvme_store()->files().size() : 0;
  {
    TrainerOptions o;
    o.streamed = streamed;
    auto trainer = Trainer::create(su.plan, su.model, hs, *su.loader, o);
    EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
    if (!trainer.ok()) return r;
    for (int s = 0; s < steps; ++s) {
      auto res = (*trainer)->run_step(s);
      EXPECT_TRUE(res.ok()) << "step " << s << ": " << res.status().to_string();
      if (!res.ok()) return r;
      r.losses.push_back(res->loss);
      r.unused_experts += res->unused_experts;
    }
    (*trainer)->wait_for_updates();
  }
  r.state = snapshot(hs);
  r.ok = true;
  return r;
}

void expect_identical(const TrainRun& a, const TrainRun& b) {
  ASSERT_TRUE(a.ok && b.ok) << "a run failed (see above)";
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "loss of step " << i;
  expect_same_snapshot(a.state, b.state);
}

// The NVMe run (streamed, and optionally the in-memory loop with the same placement, which pages
// each unit in and out around its update) against the in-memory loop with everything in RAM.
// check_learning: the reference's loss falls over its 4 steps (not asked of a batch of a few
// tokens, whose losses are as noisy as its rows).
void expect_nvme_matches_ram(const Json& nvme_plan, bool also_in_memory = false, bool force_thread_pool = false,
                             bool check_learning = true) {
  const TrainRun reference = train(in_ram(nvme_plan), false);
  ASSERT_TRUE(reference.ok);
  if (check_learning) {
    EXPECT_LT(reference.losses.back(), reference.losses.front()) << "the reference does not learn";
  }
  {
    SCOPED_TRACE("streamed pipeline, NVMe placement");
    expect_identical(train(nvme_plan, true, 4, force_thread_pool), reference);
  }
  if (also_in_memory) {
    SCOPED_TRACE("in-memory loop, NVMe placement");
    expect_identical(train(nvme_plan, false, 4, force_thread_pool), reference);
  }
}

// ---- 1. the same numbers as in RAM ----------------------------------------------------------------

TEST(NvmeTraining, StatesOnNvmeWithFp32TransferMatchTheInMemoryLoopBitForBit) {
  TmpDir dir("a");
  expect_nvme_matches_ram(on_nvme(base_plan("tiny-llama-gqa"), false, true, {dir.path()}), true);
  {
    SCOPED_TRACE("thread-pool engine");
    expect_nvme_matches_ram(on_nvme(base_plan("tiny-llama-gqa"), false, true, {dir.path()}), false, true);
  }
  EXPECT_TRUE(entries(dir.path()).empty()) << "the store's files outlived their state: " << join(entries(dir.path()));
}

TEST(NvmeTraining, MasterAndStatesOnNvmeWithBf16TransferMatchAndTakeLessRam) {
  TmpDir dir("b");
  for (const char* model : {"tiny-llama-gqa", "tiny-qwen2"}) {  // tiny-qwen2: tied embeddings, q/k/v biases
    SCOPED_TRACE(model);
    Json pj = base_plan(model);
    pj["precision"]["transfer"] = "bf16";
    pj["schedule"]["checkpoint_location"] = "host";
    const Json nvme = on_nvme(pj, true, true, {dir.path()});
    expect_nvme_matches_ram(nvme, true);
    const TrainRun ram = train(in_ram(nvme), true, 1), on = train(nvme, true, 1);
    ASSERT_TRUE(ram.ok && on.ok);
    EXPECT_LT(on.bytes, ram.bytes) << "HostState::bytes() with master weights and moments on NVMe is not below the RAM-only state's";
    // What leaves RAM: 4 bytes of master weights and 8 of fp32 moments per parameter; the staging
    // pool (one buffer: pinned_staging_bytes of one unit's transfer) comes in.
    EXPECT_EQ(on.staging_buffers, 1);
    EXPECT_GT(on.staging_bytes, 0);
    EXPECT_EQ(ram.bytes - on.bytes, 12 * on.params - on.staging_bytes);
  }
}

TEST(NvmeTraining, QuantisedMomentsOnNvmeMatch) {
  TmpDir dir("c");
  Json pj = base_plan("tiny-llama-gqa");
  pj["optimizer"]["m_format"] = "q8";
  pj["optimizer"]["v_format"] = "q4";
  pj["optimizer"]["block_size"] = 64;
  expect_nvme_matches_ram(on_nvme(pj, false, true, {dir.path()}));
  pj["precision"]["transfer"] = "bf16";
  SCOPED_TRACE("master weights on NVMe too, bf16 transfer");
  expect_nvme_matches_ram(on_nvme(pj, true, true, {dir.path()}));
}

TEST(NvmeTraining, ClippingMatches) {
  TmpDir dir("d");
  Json pj = base_plan("tiny-llama-gqa");
  pj["training"]["clip_grad_norm"] = 1.0;
  expect_nvme_matches_ram(on_nvme(pj, false, true, {dir.path()}));
  pj["precision"]["transfer"] = "bf16";
  SCOPED_TRACE("master weights on NVMe too, bf16 transfer");
  expect_nvme_matches_ram(on_nvme(pj, true, true, {dir.path()}));
  // A tied head with clipping.
  Json q = base_plan("tiny-qwen2");
  q["training"]["clip_grad_norm"] = 1.0;
  q["precision"]["transfer"] = "bf16";
  SCOPED_TRACE("tiny-qwen2 (tied)");
  expect_nvme_matches_ram(on_nvme(q, true, true, {dir.path()}));
}

// microbatch-major sums the micro-batches' gradients on the host, so it matches the in-memory loop
// within rounding only (trainer_test.cpp); with NVMe it must match the same schedule in RAM bit for
// bit, and with one micro-batch per step the in-memory loop too.
TEST(NvmeTraining, MicrobatchMajorMatches) {
  TmpDir dir("e");
  for (bool master : {false, true}) {
    SCOPED_TRACE(master ? "master and states on NVMe, bf16" : "states on NVMe, fp32");
    Json pj = base_plan("tiny-llama-gqa");
    pj["schedule"]["order"] = "microbatch-major";
    if (master) pj["precision"]["transfer"] = "bf16";
    const Json nvme = on_nvme(pj, master, true, {dir.path()});
    {
      SCOPED_TRACE("against the streamed pipeline in RAM");
      expect_identical(train(nvme, true), train(in_ram(nvme), true));
    }
    {
      SCOPED_TRACE("in-memory loop with the NVMe placement");
      expect_identical(train(nvme, false), train(in_ram(nvme), false));
    }
    Json one = nvme;
    one["training"]["grad_accum"] = 1;
    SCOPED_TRACE("grad_accum 1, against the in-memory loop in RAM");
    expect_identical(train(one, true), train(in_ram(one), false));
  }
}

TEST(NvmeTraining, OneAndThreeStagingBuffersMatch) {
  TmpDir dir("f");
  for (bool master : {false, true}) {
    SCOPED_TRACE(master ? "master and states on NVMe, bf16" : "states on NVMe, fp32");
    Json pj = base_plan("tiny-llama-gqa");
    if (master) pj["precision"]["transfer"] = "bf16";
    // The pool holds as many buffers as pinned_staging_bytes has whole units, a unit counted at its
    // own NVMe bytes (master weights, m, v); each buffer is the largest region in whole blocks.
    int64_t unit_bytes = 0;
    {
      TrainSetup su = make_setup(on_nvme(pj, master, true, {dir.path()}));
      auto probe = make_state(su);
      ASSERT_TRUE(probe.ok()) << probe.status().to_string();
      EXPECT_EQ(probe->staging_buffers(), 1) << "pinned_staging_bytes of one unit's transfer gives one buffer";
      int64_t largest_region = 0;
      for (int64_t r = 0; r < probe->nvme_store()->regions(); ++r)
        largest_region = std::max(largest_region, probe->nvme_store()->region_capacity(r));
      EXPECT_EQ(probe->staging_bytes(), largest_region);
      for (const UnitState& us : probe->units()) {
        int64_t b = master ? 4 * us.numel : 0;
        for (int64_t a : us.m.array_bytes()) b += a;
        for (int64_t a : us.v.array_bytes()) b += a;
        unit_bytes = std::max(unit_bytes, b);
      }
      ASSERT_GT(unit_bytes, 0);
      EXPECT_EQ(unit_bytes, one_unit_staging(pj, master, true)) << "core counts a unit's NVMe bytes as the executor lays them out";
    }
    const TrainRun reference = train(in_ram(pj), false);
    for (int64_t buffers : {1, 3}) {
      // Half a unit more than `buffers` units: the pool rounds down.
      const Json nvme = on_nvme(pj, master, true, {dir.path()}, buffers * unit_bytes + unit_bytes / 2);
      SCOPED_TRACE(std::to_string(buffers) + " staging buffer(s)");
      const TrainRun r = train(nvme, true);
      EXPECT_EQ(r.staging_buffers, buffers);
      expect_identical(r, reference);
    }
  }
}

TEST(NvmeTraining, StripingOverTwoDirectoriesMatches) {
  TmpDir dir("g");
  const fs::path d0 = dir.sub("drive0"), d1 = dir.sub("drive1");
  Json pj = base_plan("tiny-llama-gqa");
  pj["precision"]["transfer"] = "bf16";
  const Json nvme = on_nvme(pj, true, true, {d0, d1}, -1, 4);
  expect_nvme_matches_ram(nvme);
  EXPECT_EQ(train(nvme, true, 1).nvme_files, 2u);
  // Each directory holds a file while the state lives.
  TrainSetup su = make_setup(nvme);
  auto st = make_state(su);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  ASSERT_EQ(st->nvme_store()->files().size(), 2u);
  EXPECT_EQ(st->nvme_store()->files()[0].parent_path(), d0);
  EXPECT_EQ(st->nvme_store()->files()[1].parent_path(), d1);
  EXPECT_EQ(entries(d0).size(), 1u);
  EXPECT_EQ(entries(d1).size(), 1u);
}

// ---- 2. checkpoints -------------------------------------------------------------------------------

struct Config {
  const char* name;
  bool master;
  const char* transfer;
  const char* m_format;
  const char* v_format;
};
const Config kCheckpointConfigs[] = {
    {"master and states on NVMe, bf16 transfer, fp32 moments", true, "bf16", "fp32", "fp32"},
    {"states on NVMe, fp32 transfer, q8/q4 moments", false, "fp32", "q8", "q4"},
};

Json checkpoint_plan(const Config& c) {
  Json pj = base_plan("tiny-llama-gqa");
  pj["training"]["grad_accum"] = 2;
  pj["training"]["data_order"] = "shuffled";
  pj["training"]["clip_grad_norm"] = 1.0;
  pj["precision"]["transfer"] = c.transfer;
  pj["optimizer"]["m_format"] = c.m_format;
  pj["optimizer"]["v_format"] = c.v_format;
  pj["optimizer"]["block_size"] = 64;
  return pj;
}

// Steps [first, end) with a fresh Trainer (a fresh process, in effect); their losses.
std::vector<double> run_steps(const TrainSetup& su, HostState& hs, int64_t first, int64_t end) {
  std::vector<double> losses;
  auto trainer = Trainer::create(su.plan, su.model, hs, *su.loader, TrainerOptions{});
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  if (!trainer.ok()) return losses;
  for (int64_t s = first; s < end; ++s) {
    auto r = (*trainer)->run_step(s);
    EXPECT_TRUE(r.ok()) << "step " << s << ": " << r.status().to_string();
    if (!r.ok()) break;
    losses.push_back(r->loss);
  }
  (*trainer)->wait_for_updates();
  return losses;
}

HostState fresh_state(const TrainSetup& su) {
  auto st = make_state(su);
  MT_CHECK(st.ok(), st.status().to_string());
  return std::move(st).value();
}

TEST(NvmeTraining, CheckpointAndResumeWithNvmeResidentStateIsBitExact) {
  for (const Config& c : kCheckpointConfigs) {
    SCOPED_TRACE(c.name);
    TmpDir dir("resume");
    const Json pj = on_nvme(checkpoint_plan(c), c.master, true, {dir.sub("nvme")});
    const TrainSetup su = make_setup(pj);
    // The uninterrupted run.
    std::vector<double> straight;
    Snapshot straight_state;
    {
      HostState hs = fresh_state(su);
      ASSERT_TRUE(hs.init_random(7, 0.02).ok());
      straight = run_steps(su, hs, 0, 4);
      straight_state = snapshot(hs);
    }
    ASSERT_EQ(straight.size(), 4u);
    // Two steps, a checkpoint, and a fresh state and Trainer for the rest.
    const fs::path ckpt = dir / "ckpt";
    std::vector<double> first;
    {
      HostState hs = fresh_state(su);
      ASSERT_TRUE(hs.init_random(7, 0.02).ok());
      first = run_steps(su, hs, 0, 2);
      ASSERT_EQ(first.size(), 2u);
      const Status saved = save_checkpoint(ckpt, hs, info_for(su, 2, first));
      ASSERT_TRUE(saved.ok()) << saved.to_string();
      for (size_t u = 0; u < hs.units().size(); ++u) EXPECT_FALSE(hs.paged_in(static_cast<int64_t>(u))) << "unit " << u;
    }
    HostState resumed = fresh_state(su);
    auto loaded = load_checkpoint(ckpt, resumed);
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->info.next_step, 2);
    const Status compatible = check_resume_compatible(loaded->info, su.plan, su.model, *su.loader);
    EXPECT_TRUE(compatible.ok()) << compatible.to_string();
    const std::vector<double> rest = run_steps(su, resumed, 2, 4);
    ASSERT_EQ(rest.size(), 2u);
    EXPECT_EQ(first[0], straight[0]);
    EXPECT_EQ(first[1], straight[1]);
    EXPECT_EQ(rest[0], straight[2]) << "loss of step 2 after the resume";
    EXPECT_EQ(rest[1], straight[3]) << "loss of step 3 after the resume";
    expect_same_snapshot(snapshot(resumed), straight_state);
  }
}

TEST(NvmeTraining, CheckpointsMoveBetweenNvmeAndRamPlacements) {
  for (const Config& c : kCheckpointConfigs) {
    SCOPED_TRACE(c.name);
    TmpDir dir("move");
    const Json nvme_pj = on_nvme(checkpoint_plan(c), c.master, true, {dir.sub("nvme")});
    const TrainSetup nvme = make_setup(nvme_pj), ram = make_setup(in_ram(nvme_pj));
    // The uninterrupted run (in RAM; the NVMe run is the same, bit for bit, by the tests above).
    std::vector<double> straight;
    Snapshot straight_state;
    {
      HostState hs = fresh_state(ram);
      ASSERT_TRUE(hs.init_random(7, 0.02).ok());
      straight = run_steps(ram, hs, 0, 4);
      straight_state = snapshot(hs);
    }
    ASSERT_EQ(straight.size(), 4u);
    // Two steps on each placement, each saved.
    const fs::path from_nvme = dir / "from-nvme", from_ram = dir / "from-ram";
    Snapshot after2_nvme, after2_ram;
    {
      HostState hs = fresh_state(nvme);
      ASSERT_TRUE(hs.on_nvme());
      ASSERT_TRUE(hs.init_random(7, 0.02).ok());
      const auto l = run_steps(nvme, hs, 0, 2);
      ASSERT_EQ(l.size(), 2u);
      ASSERT_TRUE(save_checkpoint(from_nvme, hs, info_for(nvme, 2, l)).ok());
      after2_nvme = snapshot(hs);
    }
    {
      HostState hs = fresh_state(ram);
      ASSERT_FALSE(hs.on_nvme());
      ASSERT_TRUE(hs.init_random(7, 0.02).ok());
      const auto l = run_steps(ram, hs, 0, 2);
      ASSERT_EQ(l.size(), 2u);
      ASSERT_TRUE(save_checkpoint(from_ram, hs, info_for(ram, 2, l)).ok());
      after2_ram = snapshot(hs);
    }
    expect_same_snapshot(after2_nvme, after2_ram);
    // The file format does not depend on placement: the same state gives the same bytes.
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string a = test::read_bytes(checkpoint_step_dir(from_nvme, 2) / f);
      const std::string b = test::read_bytes(checkpoint_step_dir(from_ram, 2) / f);
      EXPECT_FALSE(a.empty()) << f;
      EXPECT_TRUE(a == b) << f << " written from the NVMe state differs from the one written from the RAM state";
    }
    // NVMe checkpoint -> RAM state, and on.
    {
      SCOPED_TRACE("NVMe checkpoint into a RAM state");
      HostState hs = fresh_state(ram);
      auto loaded = load_checkpoint(from_nvme, hs);
      ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
      EXPECT_EQ(loaded->info.next_step, 2);
      const Status compatible = check_resume_compatible(loaded->info, ram.plan, ram.model, *ram.loader);
      EXPECT_TRUE(compatible.ok()) << "a change of placement is not a change of run: " << compatible.to_string();
      expect_same_snapshot(snapshot(hs), after2_nvme);
      const auto rest = run_steps(ram, hs, 2, 4);
      ASSERT_EQ(rest.size(), 2u);
      EXPECT_EQ(rest[0], straight[2]);
      EXPECT_EQ(rest[1], straight[3]);
      expect_same_snapshot(snapshot(hs), straight_state);
    }
    // RAM checkpoint -> NVMe state, and on.
    {
      SCOPED_TRACE("RAM checkpoint into an NVMe state");
      HostState hs = fresh_state(nvme);
      auto loaded = load_checkpoint(from_ram, hs);
      ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
      EXPECT_EQ(loaded->info.next_step, 2);
      const Status compatible = check_resume_compatible(loaded->info, nvme.plan, nvme.model, *nvme.loader);
      EXPECT_TRUE(compatible.ok()) << compatible.to_string();
      expect_same_snapshot(snapshot(hs), after2_ram);
      const auto rest = run_steps(nvme, hs, 2, 4);
      ASSERT_EQ(rest.size(), 2u);
      EXPECT_EQ(rest[0], straight[2]);
      EXPECT_EQ(rest[1], straight[3]);
      expect_same_snapshot(snapshot(hs), straight_state);
    }
  }
}

// ---- 3. corruption on the drive -------------------------------------------------------------------

// Flips one byte on the drive under the page cache: O_DIRECT read of its aligned 4 KiB, flip, O_DIRECT write.
void flip_byte_on_disk(const fs::path& file, int64_t offset) {
  const int fd = ::open(file.c_str(), O_RDWR | O_DIRECT);
  ASSERT_GE(fd, 0) << file << ": " << std::strerror(errno);
  const int64_t base = offset / kNvmeAlignment * kNvmeAlignment;
  void* raw = nullptr;
  ASSERT_EQ(::posix_memalign(&raw, kNvmeAlignment, kNvmeAlignment), 0);
  std::unique_ptr<unsigned char, decltype(&std::free)> page(static_cast<unsigned char*>(raw), &std::free);
  ASSERT_EQ(::pread(fd, page.get(), kNvmeAlignment, base), kNvmeAlignment) << std::strerror(errno);
  page.get()[offset - base] ^= 0x20;
  ASSERT_EQ(::pwrite(fd, page.get(), kNvmeAlignment, base), kNvmeAlignment) << std::strerror(errno);
  ::close(fd);
}

// Step 1 reads the damaged block (every block was written by step 0). The store's error (kCorrupt,
// naming the file) ends the step that meets it: step 1, or, since a step returns while its
// optimizer's tail (the embedding, read last) may still run, step 2 at the latest. Every later step
// fails too, nothing hangs, and a checkpoint of the damaged state is refused.
TEST(NvmeTraining, ACorruptBlockOnTheDriveFailsTheStepAsCorruptNamingTheFile) {
  struct Case {
    const char* name;
    bool master;
    int drives;
    size_t file;  // which drive's file to damage (at byte 100: the embedding's first blocks)
    bool save;    // after step 1: save a checkpoint instead of running more steps
  };
  for (const Case& c : {Case{"states on NVMe, one drive", false, 1, 0, false},
                        Case{"master and states on NVMe, two drives", true, 2, 1, false},
                        Case{"states on NVMe, one drive, then a checkpoint", false, 1, 0, true}}) {
    SCOPED_TRACE(c.name);
    TmpDir dir("corrupt");
    std::vector<fs::path> dirs;
    for (int k = 0; k < c.drives; ++k) dirs.push_back(dir.sub("drive" + std::to_string(k)));
    Json pj = base_plan("tiny-llama-gqa");
    if (c.master) pj["precision"]["transfer"] = "bf16";
    const TrainSetup su = make_setup(on_nvme(pj, c.master, true, dirs));
    HostState hs = fresh_state(su);
    ASSERT_TRUE(hs.init_random(7, 0.02).ok());
    auto created = Trainer::create(su.plan, su.model, hs, *su.loader, TrainerOptions{});
    ASSERT_TRUE(created.ok()) << created.status().to_string();
    std::unique_ptr<Trainer> trainer = std::move(created).value();
    auto r0 = trainer->run_step(0);
    ASSERT_TRUE(r0.ok()) << r0.status().to_string();
    trainer->wait_for_updates();  // every unit has been written back
    const fs::path ckpt = dir / "ckpt";
    if (c.save) {
      const Status saved = save_checkpoint(ckpt, hs, info_for(su, 1));
      ASSERT_TRUE(saved.ok()) << saved.to_string();
    }
    ASSERT_GT(hs.nvme_store()->files().size(), c.file);
    const fs::path victim = hs.nvme_store()->files()[c.file];
    flip_byte_on_disk(victim, 100);
    if (HasFatalFailure()) return;
    struct Outcome {
      std::vector<Status> steps;  // steps 1, 2, 3, then 1 again
      Status save;
    };
    auto fut = std::async(std::launch::async, [&]() {
      Outcome o;
      if (c.save) {
        o.steps.push_back(trainer->run_step(1).status());
        trainer->wait_for_updates();
        o.save = save_checkpoint(ckpt, hs, info_for(su, 2));
      } else {
        // Step 1's reads end after it returns (the embedding is read last): the failure is then
        // the step's or finish_updates()'s, and every later call carries it.
        o.steps.push_back(trainer->run_step(1).status());
        o.steps.push_back(trainer->finish_updates());
        for (int64_t s : {2, 3, 1}) o.steps.push_back(trainer->run_step(s).status());
      }
      trainer.reset();  // the destructor waits for the queues: it must not hang either
      return o;
    });
    if (fut.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      // The Trainer refers to this frame and the future's destructor would wait forever: stop here.
      std::fprintf(stderr, "FAILED: NvmeTraining corruption (%s): the steps after a corrupt NVMe read did not return in 60 s\n", c.name);
      std::fflush(stderr);
      std::_Exit(1);
    }
    const Outcome o = fut.get();
    if (c.save) {
      ASSERT_FALSE(o.save.ok()) << "a checkpoint of a state with a corrupt block was saved";
      EXPECT_EQ(o.save.code(), StatusCode::kCorrupt) << o.save.to_string();
      EXPECT_TRUE(contains(o.save.message(), victim.string())) << o.save.to_string();
      EXPECT_TRUE(contains(o.save.message(), "earlier checkpoints are unchanged")) << o.save.to_string();
      EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "step-00000001"})) << join(entries(ckpt));
      HostState other = fresh_state(su);
      auto loaded = load_checkpoint(ckpt, other);
      ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
      EXPECT_EQ(loaded->info.next_step, 1);
      continue;
    }
    ASSERT_EQ(o.steps.size(), 5u);
    size_t first_failed = 0;
    while (first_failed < o.steps.size() && o.steps[first_failed].ok()) ++first_failed;
    ASSERT_LT(first_failed, 2u) << "neither step 1 nor finish_updates() after it reported the corrupt block";
    const Status& e = o.steps[first_failed];
    EXPECT_EQ(e.code(), StatusCode::kCorrupt) << e.to_string();
    EXPECT_TRUE(contains(e.message(), victim.string())) << e.to_string();
    for (size_t k = first_failed + 1; k < o.steps.size(); ++k) {
      EXPECT_FALSE(o.steps[k].ok()) << "call " << k << " (a step after the NVMe tier failed) succeeded";
      EXPECT_TRUE(contains(o.steps[k].message(), victim.string())) << "the later error does not carry the cause: " << o.steps[k].to_string();
    }
  }
}

// ---- 4. a full disk at checkpoint time ------------------------------------------------------------

Json full_disk_plan(const std::vector<fs::path>& drives) {
  Json pj = base_plan("tiny-llama-gqa");
  pj["training"]["grad_accum"] = 2;
  pj["precision"]["transfer"] = "bf16";
  return on_nvme(pj, true, true, drives);
}

std::vector<std::string> temporaries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".", 0) == 0) out.push_back(n);  // .step-*.tmp-*, .latest.tmp-*, .step-*.old-*
  }
  return out;
}

// The checkpoint left after a failed save: only step-00000001 is visible, it loads and holds the
// state after step 0 (recomputed here), and a later save works and leaves no temporaries.
void expect_step1_checkpoint_intact(const fs::path& ckpt, const Json& pj) {
  EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "step-00000001"})) << join(entries(ckpt));
  EXPECT_TRUE(temporaries(ckpt).empty());
  const TrainSetup su = make_setup(pj);
  Snapshot expected;
  {
    HostState hs = fresh_state(su);
    ASSERT_TRUE(hs.init_random(7, 0.02).ok());
    ASSERT_EQ(run_steps(su, hs, 0, 1).size(), 1u);
    expected = snapshot(hs);
  }
  HostState hs = fresh_state(su);
  auto loaded = load_checkpoint(ckpt, hs);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->info.next_step, 1);
  EXPECT_EQ(loaded->dir.filename(), "step-00000001");
  expect_same_snapshot(snapshot(hs), expected);
  // Training goes on from it, and the next save succeeds cleanly.
  ASSERT_EQ(run_steps(su, hs, 1, 2).size(), 1u);
  const Status again = save_checkpoint(ckpt, hs, info_for(su, 2));
  ASSERT_TRUE(again.ok()) << again.to_string();
  EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "step-00000001", "step-00000002"})) << join(entries(ckpt));
  EXPECT_TRUE(temporaries(ckpt).empty());
}

// The full-disk tests' start: `hs` initialised from seed 7, trained one step and saved as step 1 in
// `ckpt`, then trained a second step (all its updates done); `tr` is its trainer.
void save_step1_and_train_step2(const TrainSetup& su, HostState& hs, std::unique_ptr<Trainer>& tr, const fs::path& ckpt) {
  ASSERT_TRUE(hs.init_random(7, 0.02).ok());
  auto created = Trainer::create(su.plan, su.model, hs, *su.loader, TrainerOptions{});
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  tr = std::move(created).value();
  ASSERT_TRUE(tr->run_step(0).ok());
  tr->wait_for_updates();
  const Status first = save_checkpoint(ckpt, hs, info_for(su, 1));
  ASSERT_TRUE(first.ok()) << first.to_string();
  ASSERT_TRUE(tr->run_step(1).ok());
  tr->wait_for_updates();
}

TEST(NvmeTraining, AFullDiskAtCheckpointTimeKeepsTheLastCheckpointLoadable) {
  // The disk of the checkpoints fills during the second save (ENOSPC injected through FileIo at the
  // first, the middle and the last write of the step's files), while the NVMe tier's files, elsewhere, go
  // on: each save fails naming the folder, training goes on, and step 1 stays the checkpoint.
  TmpDir dir("fsize");
  const fs::path ckpt = dir / "ckpt";
  const TrainSetup su = make_setup(full_disk_plan({dir.sub("drive")}));
  HostState hs = fresh_state(su);
  std::unique_ptr<Trainer> tr;
  ASSERT_NO_FATAL_FAILURE(save_step1_and_train_step2(su, hs, tr, ckpt));
  int writes = 0;
  {
    const fs::path scratch = dir / "count";
    test::FaultyIo count(scratch);
    ScopedFileIo use(count);
    ASSERT_TRUE(save_checkpoint(scratch, hs, info_for(su, 2)).ok());
    writes = count.count(test::FaultyIo::Op::kWrite);
  }
  ASSERT_GE(writes, 3);
  int step = 2;
  for (int k : {1, writes / 2, writes - 1}) {  // the last write is 'latest''s, after the step is published
    SCOPED_TRACE("ENOSPC at write " + std::to_string(k) + " of " + std::to_string(writes));
    test::FaultyIo io(ckpt);
    io.inject(test::FaultyIo::Op::kWrite, k, test::FaultyIo::Mode::kErrno, ENOSPC);
    Status s;
    {
      ScopedFileIo use(io);
      s = save_checkpoint(ckpt, hs, info_for(su, step));
    }
    ASSERT_TRUE(io.fired());
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
    EXPECT_TRUE(contains(s.message(), "earlier checkpoints are unchanged")) << s.to_string();
    EXPECT_TRUE(contains(s.message(), ckpt.string())) << s.to_string();
    auto r = tr->run_step(step++);
    EXPECT_TRUE(r.ok()) << "training did not go on after the failed save: " << r.status().to_string();
    tr->wait_for_updates();
  }
  EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "step-00000001"})) << join(entries(ckpt));
  EXPECT_TRUE(temporaries(ckpt).empty()) << "a failed save left a temporary behind";
  expect_step1_checkpoint_intact(ckpt, full_disk_plan({dir.sub("check-drive")}));
}

TEST(NvmeTraining, AFullCheckpointDriveKeepsTheLastCheckpointLoadable) {
  TmpDir dir("tmpfs");
  const fs::path ckpt = dir / "ckpt";
  const Json pj = full_disk_plan({dir.sub("drive")});
  const TrainSetup su = make_setup(pj);
  // One checkpoint is model (4 bytes per parameter) + optimizer (8): room for one, not two.
  const int64_t one = 12 * su.model.parameter_counts().total;
  const int64_t room = one * 3 / 2 / 4096 * 4096;
  TmpfsMount mnt(ckpt, "size=" + std::to_string(room));
  if (!mnt.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (mount refused: not root, or a container); "
                                      "AFullDiskAtCheckpointTimeKeepsTheLastCheckpointLoadable covers the case";
  {
    HostState hs = fresh_state(su);
    std::unique_ptr<Trainer> tr;
    ASSERT_NO_FATAL_FAILURE(save_step1_and_train_step2(su, hs, tr, ckpt));
    const Status s = save_checkpoint(ckpt, hs, info_for(su, 2));
    ASSERT_FALSE(s.ok()) << "a second checkpoint fitted in a tmpfs of " << room << " bytes";
    EXPECT_TRUE(s.code() == StatusCode::kIoError || s.code() == StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_TRUE(contains(s.message(), "earlier checkpoints are unchanged")) << s.to_string();
    EXPECT_TRUE(contains(s.message(), ckpt.string())) << s.to_string();
    auto r2 = tr->run_step(2);
    EXPECT_TRUE(r2.ok()) << "training did not go on after the failed save: " << r2.status().to_string();
  }
  // Only step 1's checkpoint is visible, with no temporaries, and it loads.
  EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "step-00000001"})) << join(entries(ckpt));
  EXPECT_TRUE(temporaries(ckpt).empty()) << "the failed save left a temporary behind";
  HostState hs = fresh_state(su);
  auto loaded = load_checkpoint(ckpt, hs);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->info.next_step, 1);
}

// ---- 5. bad placements ----------------------------------------------------------------------------

TEST(NvmeTraining, BadPlacementsAreRefusedBeforeTraining) {
  TmpDir dir("bad");
  const fs::path good = dir.sub("good");
  // Master weights on NVMe need a bf16 streaming copy: the plan rule refuses the plan, and
  // HostState refuses the state for callers without a plan.
  {
    auto plan = Plan::from_json_text(on_nvme(base_plan("tiny-llama-gqa"), true, true, {good}).dump());
    ASSERT_FALSE(plan.ok()) << "a plan with master weights on NVMe and an fp32 transfer was accepted";
    EXPECT_TRUE(contains(plan.status().message(), "placement.master_weights: nvme with precision.transfer fp32"))
        << plan.status().to_string();
    Json bf16 = base_plan("tiny-llama-gqa");
    bf16["precision"]["transfer"] = "bf16";
    const TrainSetup su = make_setup(on_nvme(bf16, true, true, {good}));
    auto st = HostState::create(su.model, DType::kFp32, su.plan.optimizer.m_format, su.plan.optimizer.v_format,
                                su.plan.optimizer.block_size, placement_of(su.plan), true);
    ASSERT_FALSE(st.ok()) << "master weights on NVMe with an fp32 streaming copy were accepted";
    EXPECT_EQ(st.status().code(), StatusCode::kUnsupported) << st.status().to_string();
    EXPECT_TRUE(contains(st.status().message(), "bf16")) << st.status().to_string();
    EXPECT_TRUE(entries(good).empty()) << "a refused placement left files: " << join(entries(good));
  }
  // A missing directory is named, and nothing is created in the good one.
  {
    const fs::path missing = good / "no-such-drive";
    const TrainSetup su = make_setup(on_nvme(base_plan("tiny-llama-gqa"), false, true, {good, missing}));
    auto st = make_state(su);
    ASSERT_FALSE(st.ok()) << "a missing NVMe directory was accepted";
    EXPECT_TRUE(contains(st.status().message(), missing.string())) << st.status().to_string();
    EXPECT_TRUE(entries(good).empty()) << "a refused placement left files: " << join(entries(good));
  }
  // A plan with something on NVMe names its directories.
  {
    Json pj = base_plan("tiny-llama-gqa");
    pj["placement"] = {{"optimizer_states", "nvme"}};
    auto plan = Plan::from_json_text(pj.dump());
    ASSERT_FALSE(plan.ok());
    EXPECT_TRUE(contains(plan.status().message(), "nvme_dirs")) << plan.status().to_string();
  }
  // The Trainer refuses a state whose placement is not the plan's.
  Json bf16 = base_plan("tiny-llama-gqa");
  bf16["precision"]["transfer"] = "bf16";
  struct Mismatch {
    const char* name;
    Json plan;   // what the Trainer is given
    Json state;  // what the state was created with
  };
  const Mismatch cases[] = {
      {"plan: states on NVMe; state: RAM", on_nvme(bf16, false, true, {good}), in_ram(bf16)},
      {"plan: RAM; state: states on NVMe", in_ram(bf16), on_nvme(bf16, false, true, {good})},
      {"plan: master and states on NVMe; state: states on NVMe", on_nvme(bf16, true, true, {good}), on_nvme(bf16, false, true, {good})},
      {"plan: states on NVMe; state: master and states on NVMe", on_nvme(bf16, false, true, {good}), on_nvme(bf16, true, true, {good})},
  };
  for (const Mismatch& m : cases) {
    SCOPED_TRACE(m.name);
    const TrainSetup for_state = make_setup(m.state), for_plan = make_setup(m.plan);
    HostState hs = fresh_state(for_state);
    for (bool streamed : {true, false}) {
      TrainerOptions o;
      o.streamed = streamed;
      auto t = Trainer::create(for_plan.plan, for_plan.model, hs, *for_plan.loader, o);
      ASSERT_FALSE(t.ok()) << "a Trainer was created for a state placed differently from its plan";
      EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().to_string();
      EXPECT_TRUE(contains(t.status().message(), "placement")) << t.status().to_string();
    }
  }
}

// ---- lent gradients ------------------------------------------------------------------------------

// Layer-major without clipping: units hold no gradient arrays, the trainer lends each one a pool
// buffer from its D2H copy to the end of its update. Same bits as the in-memory loop with every
// gradient in RAM, in RAM and with NVMe placement, with less RAM; refused where a gradient outlives
// its update.
TEST(NvmeTraining, LentGradientsMatchAndTakeLessRam) {
  TmpDir tmp("lent");
  const Json pj = base_plan("tiny-llama-gqa");
  const TrainRun reference = train(in_ram(pj), false);
  ASSERT_TRUE(reference.ok);
  const TrainRun all = train(in_ram(pj), true);
  for (const Json& p : {in_ram(pj), on_nvme(pj, false, true, {tmp.sub("a")})}) {
    SCOPED_TRACE(p["placement"].dump());
    const TrainRun lent = train(p, true, 4, false, false);
    expect_identical(lent, reference);
    if (!p.contains("placement")) {
      EXPECT_EQ(all.bytes - lent.bytes, 4 * lent.params) << "the gradients' RAM is not saved";
    }
  }
  for (const char* what : {"clipping", "microbatch-major"}) {
    Json bad = in_ram(pj);
    if (std::string(what) == "clipping") bad["training"]["clip_grad_norm"] = 1.0;
    else bad["schedule"]["order"] = "microbatch-major";
    TrainSetup su = make_setup(bad);
    su.all_gradients = false;
    auto hs = make_state(su);
    ASSERT_TRUE(hs.ok()) << hs.status().to_string();
    TrainerOptions o;
    auto tr = Trainer::create(su.plan, su.model, *hs, *su.loader, o);
    ASSERT_FALSE(tr.ok()) << what << " with lent gradients was accepted";
    EXPECT_TRUE(contains(tr.status().message(), "without clipping")) << tr.status().to_string();
  }
}

// The Mixture-of-Experts models (per-expert tensors: Mixtral, Qwen3-MoE with a dense layer;
// stacked: gpt-oss) on the NVMe tier and with lent gradients: the same numbers as in RAM, bit for
// bit. The small batch (one row of 4 tokens) leaves experts unchosen (checked), so the skip of
// their AdamW update (and each expert's own step count) is exercised on NVMe-resident units too.
TEST(NvmeTraining, MixtureOfExpertsModelsMatchOnNvmeAndWithLentGradients) {
  TmpDir dir("moe");
  for (const char* model : {"tiny-mixtral", "tiny-qwen3-moe", "tiny-gpt-oss"}) {
    for (const bool small : {false, true}) {
      SCOPED_TRACE(std::string(model) + (small ? ", 4 x 1 x 1 (unchosen experts)" : ", 16 x 2 x 3"));
      Json pj = base_plan(model);
      if (small) {
        pj["training"]["seq_len"] = 4;
        pj["training"]["micro_batch"] = 1;
        pj["training"]["grad_accum"] = 1;
      }
      {
        SCOPED_TRACE("states on NVMe, fp32 transfer");
        expect_nvme_matches_ram(on_nvme(pj, false, true, {dir.sub("s")}), true, false, !small);
      }
      {
        SCOPED_TRACE("master and states on NVMe, bf16 transfer");
        Json b = pj;
        b["precision"]["transfer"] = "bf16";
        b["schedule"]["checkpoint_location"] = "host";
        expect_nvme_matches_ram(on_nvme(b, true, true, {dir.sub("m")}), false, false, !small);
      }
      const TrainRun reference = train(in_ram(pj), false);
      ASSERT_TRUE(reference.ok);
      if (small) {
        EXPECT_GT(reference.unused_experts, 0) << "the small batch chose every expert; the skip is not exercised";
      }
      for (const Json& p : {in_ram(pj), on_nvme(pj, false, true, {dir.sub("l")})}) {
        SCOPED_TRACE("lent gradients, " + p.value("placement", Json::object()).dump());
        expect_identical(train(p, true, 4, false, false), reference);
      }
    }
  }
}

// ---- mixed layer sizes ------------------------------------------------------------------------------

// Qwen3-MoE with dense layers among its MoE layers, so that decoder layers differ in size: every
// per-layer buffer of the streamed pipeline (gradient accumulators, weight slots, activations,
// workspaces, NVMe staging, lent gradients) must hold the largest layer it serves, not layer 0's.
// Until the compiled step sized its gradient accumulators by the largest layer, a dense first layer
// made the streamed trainer write past them into the embedding gradient: the losses and weights
// drifted from the in-memory loop's without a word. Each variant is checked against the in-memory
// loop bit for bit, in both orders, with and without host checkpoints, in RAM and on NVMe.
Json mixed_layers_model(const std::vector<int64_t>& mlp_only, int64_t layers, int64_t sparse_step = 1) {
  std::ifstream in(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / "tiny-qwen3-moe.json");
  Json m = Json::parse(in);
  m["num_hidden_layers"] = layers;
  m["mlp_only_layers"] = mlp_only;
  m["decoder_sparse_step"] = sparse_step;
  return m;
}

TEST(NvmeTraining, MixedDenseAndMoeLayersMatchTheInMemoryLoopBitForBit) {
  TmpDir dir("mixed");
  struct Variant {
    const char* label;
    Json model;
  };
  const Variant variants[] = {
      {"dense first (mlp_only_layers [0])", mixed_layers_model({0}, 3)},
      {"dense last (mlp_only_layers [2])", mixed_layers_model({2}, 3)},
      {"dense in the middle (mlp_only_layers [1])", mixed_layers_model({1}, 3)},
      {"dense and MoE alternating (decoder_sparse_step 2, 4 layers)", mixed_layers_model({}, 4, 2)},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.label);
    Json pj = base_plan("tiny-qwen3-moe");
    pj["model"] = v.model;
    {  // the layers really differ in size, and the first is not always the largest
      TrainSetup su = make_setup(pj);
      const auto numels = unit_tensor_numels(su.model);
      std::set<int64_t> sizes;
      for (size_t u = 1; u + 1 < numels.size(); ++u) {
        int64_t n = 0;
        for (int64_t x : numels[u]) n += x;
        sizes.insert(n);
      }
      EXPECT_EQ(sizes.size(), 2u) << "dense and MoE layers of different sizes";
    }
    const TrainRun reference = train(in_ram(pj), false);
    ASSERT_TRUE(reference.ok);
    EXPECT_LT(reference.losses.back(), reference.losses.front()) << "the reference does not learn";
    struct Sched {
      int k, c;
      const char* where;
    };
    for (const Sched& s : {Sched{1, 0, "device"}, Sched{1, 1, "device"}, Sched{2, 1, "host"}, Sched{2, 2, "host"}}) {
      Json p = pj;
      p["schedule"]["prefetch_depth"] = s.k;
      p["schedule"]["device_layer_buffers"] = std::max(s.k + 1, s.c + 1);
      p["schedule"]["checkpoint_every"] = s.c;
      p["schedule"]["checkpoint_location"] = s.where;
      SCOPED_TRACE("layer-major, K=" + std::to_string(s.k) + " checkpoint_every=" + std::to_string(s.c) + " " + s.where);
      expect_identical(train(p, true), reference);
      SCOPED_TRACE("lent gradients");
      expect_identical(train(p, true, 4, false, false), reference);
    }
    {
      SCOPED_TRACE("microbatch-major, grad_accum 1, host checkpoints");
      Json p = pj;
      p["schedule"]["order"] = "microbatch-major";
      p["schedule"]["checkpoint_location"] = "host";
      p["training"]["grad_accum"] = 1;
      expect_identical(train(p, true), train(in_ram(p), false));
    }
    {
      SCOPED_TRACE("microbatch-major, grad_accum 3, against the same schedule in RAM");
      Json p = pj;
      p["schedule"]["order"] = "microbatch-major";
      p["training"]["clip_grad_norm"] = 0.5;
      expect_identical(train(on_nvme(p, false, true, {dir.sub("mb")}), true), train(in_ram(p), true));
    }
    {
      SCOPED_TRACE("master weights and states on NVMe, bf16 transfer, host checkpoints");
      Json p = pj;
      p["precision"]["transfer"] = "bf16";
      p["schedule"]["checkpoint_location"] = "host";
      expect_nvme_matches_ram(on_nvme(p, true, true, {dir.sub("m")}), true);
    }
  }
}

}  // namespace
}  // namespace megatrain::exec

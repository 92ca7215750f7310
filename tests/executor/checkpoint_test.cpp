// Training checkpoints: a resumed run matches an uninterrupted one bit for bit (losses, master
// weights, Adam moments in every storage format, the bf16 streaming copy); a checkpoint whose
// moment formats differ from the run's is refused; damaged or truncated files are refused naming
// the file, with nothing changed; a failed save and a writer killed mid-save leave the previous
// checkpoint loadable; XXH64 matches the published vectors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "executor/faulty_io.h"
#include "executor/file_test_util.h"
#include "megatrain/core/plan.h"
#include "megatrain/core/xxh64.h"
#include "megatrain/executor/checkpoint.h"
#include "megatrain/executor/safetensors.h"
#include "megatrain/executor/trainer.h"

namespace megatrain::exec {
namespace {

// The checksum line of `latest`: the XXH64 of the step's name, 16 lower-case hex digits.
std::string latest_hash(const std::string& name) {
  char b[17];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(megatrain::xxh64(name.data(), name.size())));
  return b;
}

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using test::ScratchDir;

Json plan_json(const std::string& transfer, double clip) {
  return Json{{"schema", "megatrain.plan/1"},
              {"model", "tiny-llama-gqa"},
              {"rig", "cpu-dev-2core"},
              {"training", {{"seq_len", 16}, {"micro_batch", 2}, {"grad_accum", 2}, {"steps", 6}, {"seed", 7},
                            {"lr", 3e-3}, {"lr_schedule", "cosine"}, {"warmup_steps", 2}, {"min_lr", 3e-4},
                            {"clip_grad_norm", clip}, {"data_order", "shuffled"}}},
              {"precision", {{"compute", "fp32"}, {"transfer", transfer}}},
              {"schedule", {{"prefetch_depth", 2}, {"device_layer_buffers", 3}, {"checkpoint_every", 1},
                            {"checkpoint_location", "device"}}},
              {"optimizer", {{"threads", 2}}}};
}

// The same plan with Adam's moments kept in the given formats (moments.h).
Json plan_json(const std::string& transfer, double clip, const std::string& m_format, const std::string& v_format,
               int64_t block_size) {
  Json j = plan_json(transfer, clip);
  j["optimizer"]["m_format"] = m_format;
  j["optimizer"]["v_format"] = v_format;
  j["optimizer"]["block_size"] = block_size;
  return j;
}

// One training setup: plan, model, data. Every call builds fresh objects (a fresh process, in effect).
struct TrainSetup {
  Plan plan;
  ModelSpec model;
  std::unique_ptr<DataLoader> loader;
};

TrainSetup make_setup(const Json& pj) {
  auto plan = Plan::from_json_text(pj.dump());
  MT_CHECK(plan.ok(), plan.status().to_string());
  auto model = plan->resolve_model();
  MT_CHECK(model.ok(), model.status().to_string());
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 3000; ++i) toks.push_back((i * 2654435761u >> 9) % 256);
  auto file = std::make_shared<const TokenFile>(TokenFile::from_tokens(toks, "tokens"));
  auto loader = DataLoader::create(file, plan->training.seq_len, plan->training.micro_batch, plan->training.grad_accum,
                                   plan->training.data_order, static_cast<uint64_t>(plan->training.seed), model->config().vocab_size);
  MT_CHECK(loader.ok(), loader.status().to_string());
  return TrainSetup{*plan, *model, std::make_unique<DataLoader>(std::move(loader).value())};
}

// Steps [first, end) with a fresh Trainer; their losses (and the largest gradient norm seen).
std::vector<double> run_steps(const TrainSetup& su, HostState& hs, int64_t first, int64_t end, double* max_grad_norm = nullptr) {
  auto trainer = Trainer::create(su.plan, su.model, hs, *su.loader, TrainerOptions{});
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  std::vector<double> losses;
  for (int64_t s = first; s < end; ++s) {
    auto r = (*trainer)->run_step(s);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) break;
    losses.push_back(r->loss);
    if (max_grad_norm) *max_grad_norm = std::max(*max_grad_norm, r->grad_norm);
  }
  return losses;
}

// A HostState in the plan's transfer dtype and moment formats (the trainer refuses any other).
HostState make_state(const TrainSetup& su) {
  return HostState::create(su.model, su.plan.precision.transfer, su.plan.optimizer.m_format, su.plan.optimizer.v_format,
                           su.plan.optimizer.block_size);
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

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// One moment's storage, bit for bit: its format and block size, and the array that format keeps
// (fp32 elements, bf16 bits, or codes and scales).
void expect_same_moment(const MomentStore& a, const MomentStore& b, const std::string& what) {
  ASSERT_EQ(a.format(), b.format()) << what;
  ASSERT_EQ(a.block_size(), b.block_size()) << what;
  ASSERT_EQ(a.f32().size(), b.f32().size()) << what;
  ASSERT_EQ(a.bf16().size(), b.bf16().size()) << what;
  ASSERT_EQ(a.codes().size(), b.codes().size()) << what;
  ASSERT_EQ(a.scales().size(), b.scales().size()) << what;
  EXPECT_TRUE(same_bits(a.f32().data(), b.f32().data(), static_cast<size_t>(a.f32().size()) * 4)) << what << " (fp32) differs";
  EXPECT_TRUE(same_bits(a.bf16().data(), b.bf16().data(), static_cast<size_t>(a.bf16().size()) * 2)) << what << " (bf16) differs";
  EXPECT_TRUE(same_bits(a.codes().data(), b.codes().data(), static_cast<size_t>(a.codes().size()))) << what << " codes differ";
  EXPECT_TRUE(same_bits(a.scales().data(), b.scales().data(), static_cast<size_t>(a.scales().size()) * 4))
      << what << " scales differ";
}

// Master, m, v and the streaming copy of every unit, bit for bit.
void expect_same_state(const HostState& a, const HostState& b) {
  ASSERT_EQ(a.units().size(), b.units().size());
  for (size_t u = 0; u < a.units().size(); ++u) {
    const UnitState& x = a.units()[u];
    const UnitState& y = b.units()[u];
    ASSERT_EQ(x.numel, y.numel);
    const size_t n = static_cast<size_t>(x.numel) * sizeof(float);
    EXPECT_TRUE(same_bits(x.master.data(), y.master.data(), n)) << "master of unit " << u << " differs";
    expect_same_moment(x.m, y.m, "m of unit " + std::to_string(u));
    expect_same_moment(x.v, y.v, "v of unit " + std::to_string(u));
    ASSERT_EQ(x.stream_bf16.size(), y.stream_bf16.size());
    if (x.stream_bf16.size() > 0) {
      EXPECT_TRUE(same_bits(x.stream_bf16.data(), y.stream_bf16.data(), static_cast<size_t>(x.numel) * 2))
          << "bf16 streaming copy of unit " << u << " differs";
    }
  }
}

// Every file under `dir` (relative path -> bytes): "nothing changed" means this map is equal.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out[fs::relative(e.path(), dir).string()] = e.is_regular_file() ? test::read_bytes(e.path()) : std::string("<dir>");
  return out;
}

std::vector<std::string> temporaries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".step-", 0) == 0 || n.rfind(".latest.", 0) == 0) out.push_back(n);
  }
  return out;
}

TEST(Checkpoint, Xxh64MatchesThePublishedVectors) {
  auto h = [](const std::string& s, uint64_t seed = 0) { return xxh64(s.data(), s.size(), seed); };
  EXPECT_EQ(h(""), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(h("a"), 0xD24EC4F1A98C6E5Bull);
  EXPECT_EQ(h("abc"), 0x44BC2CF5AD770999ull);
  EXPECT_EQ(h("message digest"), 0x066ED728FCEEB3BEull);
  EXPECT_EQ(h("12345678901234567890123456789012"), 0x40FD1AA52D98274Cull);  // exactly one stripe
  EXPECT_EQ(h("The quick brown fox jumps over the lazy dog"), 0x0B242D361FDA71BCull);
  EXPECT_EQ(h("Nobody inspects the spammish repetition"), 0xFBCEA83C8A378BF1ull);
  EXPECT_EQ(h("Nobody inspects the spammish repetition", 123), 0xA8BA45551F24B7AEull);
  // Streaming in pieces of every size gives the one-shot digest.
  std::string big(1000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
  for (size_t piece : {1, 3, 7, 31, 32, 33, 100, 999}) {
    Xxh64 x;
    for (size_t i = 0; i < big.size(); i += piece) x.update(big.data() + i, std::min(piece, big.size() - i));
    EXPECT_EQ(x.digest(), h(big)) << "piece " << piece;
  }
}

// The optimizer file's codes are U8 tensors: written byte for byte, and read back only as the dtype
// and byte count the reader expects; anything else names the tensor and both sides.
TEST(CheckpointSafetensors, U8TensorsRoundTripAndRawReadsCheckDtypeAndSize) {
  ScratchDir dir("ckpt-u8");
  std::vector<uint8_t> codes(37);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 71 + 3);
  const std::vector<float> scales = {0.5f, -0.0f, 3.25e-7f};
  const std::vector<uint16_t> bf16 = {0x3f80, 0xffff, 0x0001};  // a NaN and a subnormal stay as they are
  const fs::path p = dir / "raw.safetensors";
  ASSERT_TRUE(write_safetensors(p, {raw_tensor("a.codes", {37}, codes.data(), "U8"),
                                    TensorToWrite{"a.scales", {3}, scales.data(), DType::kFp32, DType::kFp32},
                                    TensorToWrite{"b", {3}, bf16.data(), DType::kBf16, DType::kBf16}})
                  .ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const SafetensorsEntry* e = f->find("a.codes");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, "U8");
  EXPECT_EQ(e->shape, std::vector<int64_t>{37});
  std::vector<uint8_t> back(37);
  ASSERT_TRUE(f->read_raw(*e, "U8", back.data(), back.size()).ok());
  EXPECT_EQ(back, codes);
  std::vector<uint16_t> bback(3);
  ASSERT_TRUE(f->read_raw(*f->find("b"), "BF16", bback.data(), 6).ok());
  EXPECT_EQ(bback, bf16);
  std::vector<float> sback(3);
  ASSERT_TRUE(f->read_raw(*f->find("a.scales"), "F32", sback.data(), 12).ok());
  EXPECT_TRUE(same_bits(sback.data(), scales.data(), 12));
  // Another dtype, or another byte count, is refused naming the tensor and both sides.
  Status s = f->read_raw(*e, "F32", back.data(), back.size());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("a.codes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("is U8; expected F32"), std::string::npos) << s.message();
  s = f->read_raw(*e, "U8", back.data(), 36);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("holds 37 bytes; the destination has 36"), std::string::npos) << s.message();
  // A U8 tensor does not convert to fp32.
  EXPECT_EQ(f->read_fp32("a.codes").status().code(), StatusCode::kUnsupported);
  // The writer refuses a dtype the format does not define, before touching the disk.
  const fs::path q = dir / "bad.safetensors";
  Status w = write_safetensors(q, {raw_tensor("x", {2}, codes.data(), "U7")});
  EXPECT_EQ(w.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.message().find("'U7' is not a safetensors dtype"), std::string::npos) << w.message();
  EXPECT_FALSE(fs::exists(q));
}

// A tensor whose bytes are made only as it is written (compressed moments): the header is written
// with room for its bound and rewritten with its real size; the file is a valid safetensors file
// whose data ends at the real sizes. A tensor over its bound, or a producer that fails, leaves no
// file and any previous one as it was.
TEST(CheckpointSafetensors, ProducedTensorsGetTheirRealSizeInTheHeader) {
  ScratchDir dir("ckpt-produce");
  const fs::path p = dir / "p.safetensors";
  const std::vector<float> before = {1.0f, 2.0f};
  const std::vector<float> after = {4.0f, 5.0f, 6.0f};
  auto produced = [](size_t n, uint64_t bound) {
    TensorToWrite t = raw_tensor("z", {}, nullptr, "U8");
    t.max_bytes = bound;
    t.produce = [n]() -> Result<std::vector<uint8_t>> {
      std::vector<uint8_t> b(n);
      for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 13 + 1);
      return b;
    };
    return t;
  };
  ASSERT_TRUE(write_safetensors(p, {TensorToWrite{"a", {2}, before.data(), DType::kFp32, DType::kFp32}, produced(37, 123456789),
                                    TensorToWrite{"b", {3}, after.data(), DType::kFp32, DType::kFp32}})
                  .ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const SafetensorsEntry* z = f->find("z");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->dtype, "U8");
  EXPECT_EQ(z->shape, std::vector<int64_t>{37});
  EXPECT_EQ(z->begin, 8u);
  EXPECT_EQ(z->end, 45u);
  EXPECT_EQ(f->data_start() % 8, 0u);
  EXPECT_EQ(f->file_bytes(), f->data_start() + 8 + 37 + 12);  // no room left for the bound
  std::vector<uint8_t> zb(37);
  ASSERT_TRUE(f->read_raw(*z, "U8", zb.data(), zb.size()).ok());
  for (size_t i = 0; i < zb.size(); ++i) ASSERT_EQ(zb[i], static_cast<uint8_t>(i * 13 + 1));
  auto b = f->read_fp32("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, after);
  const std::string good = test::read_bytes(p);

  // Over its bound: refused, and the previous file stays.
  Status s = write_safetensors(p, {produced(50, 49)});
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.to_string();
  EXPECT_NE(s.message().find("over its bound of 49"), std::string::npos) << s.message();
  // A producer that fails: its error, and the previous file stays.
  TensorToWrite failing = produced(1, 10);
  failing.produce = []() -> Result<std::vector<uint8_t>> { return io_error("the drive went away"); };
  s = write_safetensors(p, {failing});
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(test::read_bytes(p), good);
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename(), "p.safetensors") << "a temporary was left behind";
  // Produced bytes are U8 only.
  TensorToWrite f32 = produced(4, 4);
  f32.raw_dtype = "F32";
  EXPECT_EQ(write_safetensors(dir / "q.safetensors", {f32}).code(), StatusCode::kInvalidArgument);
}

// --checkpoint-compress: fp32 moments are stored as byte planes + zstd, smaller than plain fp32,
// and restored bit for bit; the run continues exactly as from an uncompressed checkpoint. With m
// in fp32 and v quantised, only m is compressed.
TEST(CheckpointResume, CompressedFp32MomentsRestoreBitForBit) {
  for (const auto& [mf, vf] : {std::pair{"fp32", "fp32"}, std::pair{"fp32", "q8"}}) {
    SCOPED_TRACE(std::string(mf) + "/" + vf);
    const Json pj = plan_json("bf16", 0.5, mf, vf, 128);
    TrainSetup su = make_setup(pj);
    HostState first = make_state(su);
    EXPECT_TRUE(first.init_random(7, 0.02).ok());
    run_steps(su, first, 0, 3);
    ScratchDir plain_dir("ckpt-plain"), packed_dir("ckpt-packed");
    ASSERT_TRUE(save_checkpoint(plain_dir.path(), first, info_for(su, 3)).ok());
    SaveOptions opts;
    opts.compress_fp32_moments = true;
    opts.threads = 3;
    ASSERT_TRUE(save_checkpoint(packed_dir.path(), first, info_for(su, 3), opts).ok());
    const fs::path plain_file = checkpoint_step_dir(plain_dir.path(), 3) / "optimizer.safetensors";
    const fs::path packed_file = checkpoint_step_dir(packed_dir.path(), 3) / "optimizer.safetensors";
    auto packed = SafetensorsFile::open(packed_file);
    ASSERT_TRUE(packed.ok()) << packed.status().to_string();
    EXPECT_EQ(packed->metadata().at("fp32_moments"), "planes_zstd");
    const std::string some = first.units()[0].tensors[0].name;
    EXPECT_EQ(packed->find(some + ".exp_avg"), nullptr);
    ASSERT_NE(packed->find(some + ".exp_avg.planes_zstd"), nullptr);
    EXPECT_EQ(packed->find(some + ".exp_avg.planes_zstd")->dtype, "U8");
    if (std::string(vf) == "q8") EXPECT_NE(packed->find(some + ".exp_avg_sq.codes"), nullptr);
    else EXPECT_NE(packed->find(some + ".exp_avg_sq.planes_zstd"), nullptr);
    const auto plain_bytes = fs::file_size(plain_file), packed_bytes = fs::file_size(packed_file);
    std::printf("%s/%s optimizer.safetensors: %ju bytes plain, %ju compressed (%.3fx)\n", mf, vf,
                static_cast<uintmax_t>(plain_bytes), static_cast<uintmax_t>(packed_bytes),
                static_cast<double>(plain_bytes) / static_cast<double>(packed_bytes));
    EXPECT_LT(packed_bytes, plain_bytes);
    // The model file is the same either way (weights stay a plain Hugging Face file).
    EXPECT_EQ(test::read_bytes(checkpoint_step_dir(plain_dir.path(), 3) / "model.safetensors"),
              test::read_bytes(checkpoint_step_dir(packed_dir.path(), 3) / "model.safetensors"));

    std::vector<double> from_plain, from_packed;
    HostState a = make_state(su), b = make_state(su);
    EXPECT_TRUE(a.init_random(99, 0.5).ok());
    EXPECT_TRUE(b.init_random(98, 0.5).ok());
    {
      TrainSetup s1 = make_setup(pj);
      auto la = load_checkpoint(plain_dir.path(), a);
      ASSERT_TRUE(la.ok()) << la.status().to_string();
      from_plain = run_steps(s1, a, 3, 6);
    }
    {
      TrainSetup s2 = make_setup(pj);
      auto lb = load_checkpoint(packed_dir.path(), b);
      ASSERT_TRUE(lb.ok()) << lb.status().to_string();
      HostState check = make_state(s2);
      ASSERT_TRUE(load_checkpoint(packed_dir.path(), check).ok());
      expect_same_state(check, first);  // restored bit for bit
      from_packed = run_steps(s2, b, 3, 6);
    }
    ASSERT_EQ(from_plain.size(), 3u);
    EXPECT_EQ(from_packed, from_plain);
    expect_same_state(a, b);
  }
}

// Train 6 steps straight; train 3, save, load into a fresh HostState and a fresh Trainer, train 3
// more: the same losses and the same final state, bit for bit.
TEST(CheckpointResume, IsBitExactAgainstAnUninterruptedRun) {
  struct Case {
    std::string transfer;
    double clip;
  };
  for (const Case& c : {Case{"fp32", 0.0}, Case{"bf16", 0.0}, Case{"fp32", 0.5}, Case{"bf16", 0.5}}) {
    SCOPED_TRACE("transfer " + c.transfer + ", clip_grad_norm " + std::to_string(c.clip));
    const Json pj = plan_json(c.transfer, c.clip);
    HostState straight;
    std::vector<double> straight_losses;
    double max_norm = 0;
    {
      TrainSetup su = make_setup(pj);
      straight = make_state(su);
      EXPECT_TRUE(straight.init_random(7, 0.02).ok());
      straight_losses = run_steps(su, straight, 0, 6, &max_norm);
      ASSERT_EQ(straight_losses.size(), 6u);
    }
    if (c.clip > 0) {
      EXPECT_GT(max_norm, c.clip) << "clipping never acted; the case tests nothing";
    }

    ScratchDir dir("ckpt-resume");
    std::vector<uint16_t> stream_before;
    {
      TrainSetup su = make_setup(pj);
      HostState first = make_state(su);
      EXPECT_TRUE(first.init_random(7, 0.02).ok());
      const std::vector<double> l = run_steps(su, first, 0, 3);
      for (size_t i = 0; i < l.size(); ++i) EXPECT_EQ(l[i], straight_losses[i]);
      ASSERT_TRUE(save_checkpoint(dir.path(), first, info_for(su, 3, l)).ok());
      for (const UnitState& u : first.units())
        stream_before.insert(stream_before.end(), u.stream_bf16.data(), u.stream_bf16.data() + u.stream_bf16.size());
    }
    TrainSetup su = make_setup(pj);
    HostState resumed = make_state(su);
    EXPECT_TRUE(resumed.init_random(12345, 0.5).ok());  // whatever was there must be overwritten
    auto loaded = load_checkpoint(dir.path(), resumed);
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->dir, checkpoint_step_dir(dir.path(), 3));
    EXPECT_EQ(loaded->info.next_step, 3);
    EXPECT_EQ(loaded->info.losses, std::vector<double>(straight_losses.begin(), straight_losses.begin() + 3));
    EXPECT_TRUE(check_resume_compatible(loaded->info, su.plan, su.model, *su.loader).ok());
    // The bf16 streaming copy is not saved: refresh_stream() rebuilds it from the master weights,
    // and it equals the copy AdamW wrote, because both are to_bf16 of the same fp32 value.
    std::vector<uint16_t> stream_after;
    for (const UnitState& u : resumed.units())
      stream_after.insert(stream_after.end(), u.stream_bf16.data(), u.stream_bf16.data() + u.stream_bf16.size());
    EXPECT_EQ(stream_after, stream_before);
    EXPECT_EQ(stream_after.empty(), c.transfer == "fp32");

    const std::vector<double> rest = run_steps(su, resumed, loaded->info.next_step, 6);
    ASSERT_EQ(rest.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest[i], straight_losses[3 + i]) << "step " << 3 + i;
    expect_same_state(resumed, straight);
  }
}

// Whatever a fresh state holds in its moments, so that a load that skipped them would show.
void scramble_moments(HostState& hs) {
  for (UnitState& u : hs.units()) {
    for (MomentStore* ms : {&u.m, &u.v}) {
      for (int64_t i = 0; i < ms->f32().size(); ++i) ms->f32()[i] = 0.125f;
      for (int64_t i = 0; i < ms->bf16().size(); ++i) ms->bf16()[i] = 0x3f80;
      for (int64_t i = 0; i < ms->codes().size(); ++i) ms->codes()[i] = 0xA5;
      for (int64_t i = 0; i < ms->scales().size(); ++i) ms->scales()[i] = 1.5f;
    }
  }
}

// The same comparison with m and v kept in bf16 or a quantised format (block 32): the optimizer file
// keeps each moment in its format (bf16 bits; codes and scales), the load restores it bit for bit,
// and the resumed run matches the uninterrupted one bit for bit.
TEST(CheckpointResume, IsBitExactWithEveryMomentFormat) {
  struct Case {
    std::string m, v;
  };
  for (const Case& c : {Case{"bf16", "bf16"}, Case{"q8", "q8"}, Case{"q4", "q4"}, Case{"q3", "q3"}, Case{"q2", "q2"},
                        Case{"q4", "q8"}, Case{"bf16", "q2"}, Case{"q3", "fp32"}}) {
    SCOPED_TRACE("m " + c.m + ", v " + c.v);
    const Json pj = plan_json("bf16", 0.5, c.m, c.v, 32);
    HostState straight;
    std::vector<double> straight_losses;
    {
      TrainSetup su = make_setup(pj);
      straight = make_state(su);
      EXPECT_TRUE(straight.init_random(7, 0.02).ok());
      straight_losses = run_steps(su, straight, 0, 6);
      ASSERT_EQ(straight_losses.size(), 6u);
    }
    // The moments moved away from zero, so the comparison below tests something.
    {
      bool nonzero = false;
      for (const UnitState& u : straight.units())
        for (const MomentStore* ms : {&u.m, &u.v}) {
          for (int64_t i = 0; i < ms->scales().size() && !nonzero; ++i) nonzero = ms->scales()[i] != 0.0f;
          for (int64_t i = 0; i < ms->bf16().size() && !nonzero; ++i) nonzero = ms->bf16()[i] != 0;
        }
      EXPECT_TRUE(nonzero);
    }

    ScratchDir dir("ckpt-resume-fmt");
    TrainSetup su1 = make_setup(pj);
    HostState first = make_state(su1);
    EXPECT_TRUE(first.init_random(7, 0.02).ok());
    const std::vector<double> l = run_steps(su1, first, 0, 3);
    for (size_t i = 0; i < l.size(); ++i) EXPECT_EQ(l[i], straight_losses[i]);
    ASSERT_TRUE(save_checkpoint(dir.path(), first, info_for(su1, 3, l)).ok());

    // The optimizer file: the formats in __metadata__, and each moment in its format.
    auto opt = SafetensorsFile::open(dir / "step-00000003" / "optimizer.safetensors");
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    EXPECT_EQ(opt->metadata().at("m_format"), c.m);
    EXPECT_EQ(opt->metadata().at("v_format"), c.v);
    EXPECT_EQ(opt->metadata().at("block_size"), "32");
    size_t expected_entries = 0;
    for (const UnitState& u : first.units()) {
      for (const TensorSlot& t : u.tensors) {
        for (const auto& [suffix, ms] : {std::pair<std::string, const MomentStore*>{".exp_avg", &u.m},
                                         std::pair<std::string, const MomentStore*>{".exp_avg_sq", &u.v}}) {
          const std::string name = t.name + suffix;
          const StateFormat f = ms->format();
          if (!is_quantised(f)) {
            ++expected_entries;
            const SafetensorsEntry* e = opt->find(name);
            ASSERT_NE(e, nullptr) << name;
            EXPECT_EQ(e->dtype, f == StateFormat::kBf16 ? "BF16" : "F32") << name;
            EXPECT_EQ(e->shape, t.shape) << name;
            continue;
          }
          expected_entries += 2;
          const int64_t blocks = (t.numel + 31) / 32;
          const SafetensorsEntry* codes = opt->find(name + ".codes");
          const SafetensorsEntry* scales = opt->find(name + ".scales");
          ASSERT_NE(codes, nullptr) << name;
          ASSERT_NE(scales, nullptr) << name;
          EXPECT_EQ(codes->dtype, "U8");
          EXPECT_EQ(codes->shape, std::vector<int64_t>{blocks * 32 * state_format_bits(f) / 8}) << name;
          EXPECT_EQ(scales->dtype, "F32");
          EXPECT_EQ(scales->shape, std::vector<int64_t>{blocks}) << name;
          EXPECT_EQ(opt->find(name), nullptr) << name;
        }
      }
    }
    EXPECT_EQ(opt->entries().size(), expected_entries);

    TrainSetup su = make_setup(pj);
    HostState resumed = make_state(su);
    EXPECT_TRUE(resumed.init_random(12345, 0.5).ok());  // whatever was there must be overwritten
    scramble_moments(resumed);
    auto loaded = load_checkpoint(dir.path(), resumed);
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    expect_same_state(resumed, first);  // restored bit for bit
    EXPECT_TRUE(check_resume_compatible(loaded->info, su.plan, su.model, *su.loader).ok());
    const std::vector<double> rest = run_steps(su, resumed, loaded->info.next_step, 6);
    ASSERT_EQ(rest.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest[i], straight_losses[3 + i]) << "step " << 3 + i;
    expect_same_state(resumed, straight);
  }
}

// A checkpoint keeps m and v in the formats of the run that wrote it; a run whose plan keeps them
// otherwise (another format, or another block size) is refused naming both, and nothing changes.
TEST(CheckpointResume, MomentFormatsThatDifferFromTheRunAreRefusedNamingBoth) {
  TrainSetup q4 = make_setup(plan_json("fp32", 0.0, "q4", "q4", 32));
  HostState saved = make_state(q4);
  EXPECT_TRUE(saved.init_random(7, 0.02).ok());
  run_steps(q4, saved, 0, 2);
  ScratchDir dir("ckpt-formats");
  ASSERT_TRUE(save_checkpoint(dir.path(), saved, info_for(q4, 2)).ok());
  const auto before = snapshot(dir.path());

  auto refused = [&](const Json& pj, const std::string& now) {
    SCOPED_TRACE(now);
    TrainSetup su = make_setup(pj);
    HostState hs = make_state(su);
    EXPECT_TRUE(hs.init_random(99, 0.02).ok());
    HostState untouched = make_state(su);
    EXPECT_TRUE(untouched.init_random(99, 0.02).ok());
    auto r = load_checkpoint(dir.path(), hs);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    const std::string& msg = r.status().message();
    EXPECT_NE(msg.find("optimizer.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the checkpoint keeps m/v in q4/q4 (block 32)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("this run's plan says " + now), std::string::npos) << msg;
    EXPECT_NE(msg.find("resume with the plan the checkpoint was written with"), std::string::npos) << msg;
    expect_same_state(hs, untouched);
  };
  refused(plan_json("fp32", 0.0), "fp32/fp32;");
  refused(plan_json("fp32", 0.0, "q4", "q4", 64), "q4/q4 (block 64)");
  refused(plan_json("fp32", 0.0, "q4", "q8", 32), "q4/q8 (block 32)");
  refused(plan_json("fp32", 0.0, "bf16", "bf16", 32), "bf16/bf16;");
  EXPECT_EQ(snapshot(dir.path()), before);

  // The reverse: an fp32 checkpoint into a q4 run.
  TrainSetup f32 = make_setup(plan_json("fp32", 0.0));
  HostState plain = make_state(f32);
  EXPECT_TRUE(plain.init_random(7, 0.02).ok());
  ScratchDir dir2("ckpt-formats-fp32");
  ASSERT_TRUE(save_checkpoint(dir2.path(), plain, info_for(f32, 0)).ok());
  HostState hs = make_state(q4);
  auto r = load_checkpoint(dir2.path(), hs);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("keeps m/v in fp32/fp32, this run's plan says q4/q4 (block 32)"), std::string::npos)
      << r.status().message();

  // The run it was written with loads it.
  HostState same = make_state(q4);
  auto ok = load_checkpoint(dir.path(), same);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  expect_same_state(same, saved);
}

TEST(CheckpointResume, APlanOrDataThatChangesTheRunIsRefusedNamingTheKey) {
  const Json pj = plan_json("fp32", 0.0);
  TrainSetup su = make_setup(pj);
  const CheckpointInfo info = info_for(su, 3);
  EXPECT_TRUE(check_resume_compatible(info, su.plan, su.model, *su.loader).ok());
  auto refused = [&](Json changed, const std::string& key) {
    TrainSetup other = make_setup(changed);
    Status s = check_resume_compatible(info, other.plan, other.model, *other.loader);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << key;
    EXPECT_NE(s.message().find(key), std::string::npos) << s.message();
  };
  Json a = pj;
  a["training"]["lr"] = 1e-3;
  refused(a, "training.lr");
  Json b = pj;
  b["training"]["seq_len"] = 32;
  refused(b, "training.seq_len");
  Json c = pj;
  c["precision"]["transfer"] = "bf16";
  refused(c, "precision.transfer");
  Json d = pj;
  d["model"] = "tiny-qwen2";
  refused(d, "model");
  // Settings that do not change the numbers may change.
  Json e = pj;
  e["schedule"]["prefetch_depth"] = 1;
  e["optimizer"]["threads"] = 1;
  TrainSetup same = make_setup(e);
  EXPECT_TRUE(check_resume_compatible(info, same.plan, same.model, *same.loader).ok());
  // Other data: a different token count.
  CheckpointInfo other_data = info;
  other_data.data.tokens += 1;
  Status s = check_resume_compatible(other_data, su.plan, su.model, *su.loader);
  EXPECT_NE(s.message().find("data.tokens"), std::string::npos) << s.message();
  // Other data of the same size: the same token count, one token changed.
  ASSERT_FALSE(info.data.fingerprint.empty());
  std::vector<uint32_t> toks;
  for (int64_t i = 0; i < su.loader->tokens().size(); ++i) toks.push_back(su.loader->tokens().token(i));
  toks[1234] = (toks[1234] + 1) % 256;
  auto edited = DataLoader::create(std::make_shared<const TokenFile>(TokenFile::from_tokens(toks, "edited")), su.loader->options());
  ASSERT_TRUE(edited.ok()) << edited.status().to_string();
  s = check_resume_compatible(info, su.plan, su.model, *edited);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("data.fingerprint"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(info.data.fingerprint), std::string::npos) << s.message();
  // A checkpoint written before the fingerprint existed is checked by size only.
  CheckpointInfo old_info = info;
  old_info.data.fingerprint.clear();
  EXPECT_TRUE(check_resume_compatible(old_info, su.plan, su.model, *edited).ok());
}

class CheckpointFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    su_ = std::make_unique<TrainSetup>(make_setup(plan_json("bf16", 0.5)));
    state_ = make_state(*su_);
    EXPECT_TRUE(state_.init_random(7, 0.02).ok());
    run_steps(*su_, state_, 0, 2);
  }
  HostState fresh() const {
    HostState hs = make_state(*su_);
    EXPECT_TRUE(hs.init_random(99, 0.02).ok());
    return hs;
  }
  std::unique_ptr<TrainSetup> su_;
  HostState state_;
};

TEST_F(CheckpointFiles, LayoutManifestAndLatest) {
  ScratchDir dir("ckpt-layout");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2, {5.5, 5.25})).ok());
  const fs::path step = dir / "step-00000002";
  EXPECT_EQ(test::read_bytes(dir / "latest"), "step-00000002\nxxh64 " + latest_hash("step-00000002") + "\n");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "manifest.json"})
    EXPECT_TRUE(fs::is_regular_file(step / f)) << f;
  EXPECT_TRUE(temporaries(dir.path()).empty());
  // model.safetensors is a plain HF weights file: every tensor under its HF name, fp32.
  auto weights = SafetensorsFile::open(step / "model.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status().to_string();
  EXPECT_NE(weights->find("model.layers.1.mlp.down_proj.weight"), nullptr);
  EXPECT_EQ(weights->find("model.embed_tokens.weight")->dtype, "F32");
  EXPECT_EQ(weights->metadata().at("format"), "pt");
  auto opt = SafetensorsFile::open(step / "optimizer.safetensors");
  ASSERT_TRUE(opt.ok());
  EXPECT_NE(opt->find("model.norm.weight.exp_avg_sq"), nullptr);
  EXPECT_EQ(opt->entries().size(), 2 * weights->entries().size());
  EXPECT_EQ(opt->find("model.norm.weight.exp_avg")->dtype, "F32");
  EXPECT_EQ(opt->metadata().at("m_format"), "fp32");
  EXPECT_EQ(opt->metadata().at("v_format"), "fp32");
  EXPECT_EQ(opt->metadata().at("block_size"), "128");
  // The manifest: the schema, the step, every file's size and XXH64, the plan and data position.
  const std::string text = test::read_bytes(step / "manifest.json");
  const Json m = Json::parse(text);
  EXPECT_EQ(m["schema"].get<std::string>(), "megatrain.checkpoint/1");
  EXPECT_EQ(m["step"], 2);
  char hex[17];
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string bytes = test::read_bytes(step / f);
    EXPECT_EQ(m["files"][f]["bytes"].get<uint64_t>(), bytes.size());
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh64(bytes.data(), bytes.size())));
    EXPECT_EQ(m["files"][f]["xxh64"].get<std::string>(), hex);
  }
  EXPECT_EQ(m["plan"]["training"]["seq_len"], 16);
  EXPECT_EQ(m["data"]["next_step"], 2);
  EXPECT_EQ(m["data"]["order"].get<std::string>(), "shuffled");
  {  // the data's fingerprint: the XXH64 of the fixture's 3000 tokens as the in-memory file holds them (uint32)
    std::vector<uint32_t> toks;
    for (int64_t i = 0; i < su_->loader->tokens().size(); ++i) toks.push_back(su_->loader->tokens().token(i));
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh64(toks.data(), 4 * toks.size())));
    EXPECT_EQ(m["data"]["fingerprint"].get<std::string>(), "xxh64:" + std::string(hex));
  }
  EXPECT_EQ(m["rng"]["seed"], 7);
  EXPECT_EQ(m["losses"]["values"][1].get<double>(), 5.25);
  // The manifest's own checksum covers every byte before its trailer.
  const size_t at = text.rfind(",\n  \"manifest_xxh64\": \"");
  ASSERT_NE(at, std::string::npos);
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh64(text.data(), at)));
  EXPECT_EQ(m["manifest_xxh64"].get<std::string>(), hex);
  // The newest wins and `latest` follows it; a step directory can be loaded directly too.
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 4)).ok());
  EXPECT_EQ(test::read_bytes(dir / "latest"), "step-00000004\nxxh64 " + latest_hash("step-00000004") + "\n");
  HostState hs = fresh();
  auto direct = load_checkpoint(step, hs);
  ASSERT_TRUE(direct.ok()) << direct.status().to_string();
  EXPECT_EQ(direct->info.next_step, 2);
  EXPECT_EQ(direct->info.model_name, "tiny-llama-gqa");
  expect_same_state(hs, state_);
}

// A checkpoint written before the moment formats were recorded has no m_format, v_format or
// block_size in its optimizer file's __metadata__: its moments are fp32, and it still loads.
TEST_F(CheckpointFiles, AnOptimizerFileWithoutFormatsHoldsFp32Moments) {
  ScratchDir dir("ckpt-old");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
  const fs::path step = dir / "step-00000002";
  const fs::path opt_path = step / "optimizer.safetensors";
  {
    auto opt = SafetensorsFile::open(opt_path);
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    std::vector<std::vector<float>> values;
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;
    for (const SafetensorsEntry& e : opt->entries()) {
      auto v = opt->read_fp32(e.name);
      ASSERT_TRUE(v.ok());
      values.push_back(std::move(v).value());
      names.push_back(e.name);
      shapes.push_back(e.shape);
    }
    std::vector<TensorToWrite> tensors;
    for (size_t i = 0; i < names.size(); ++i)
      tensors.push_back(TensorToWrite{names[i], shapes[i], values[i].data(), DType::kFp32, DType::kFp32});
    ASSERT_TRUE(write_safetensors(opt_path, tensors, {{"writer", "megatrain"}, {"optimizer", "adamw"}, {"step", "2"}}).ok());
  }
  // The manifest gets the new file's size and checksum, and its own checksum again.
  Json m = Json::parse(test::read_bytes(step / "manifest.json"));
  const std::string bytes = test::read_bytes(opt_path);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh64(bytes.data(), bytes.size())));
  m["files"]["optimizer.safetensors"] = {{"bytes", bytes.size()}, {"xxh64", hex}};
  m.erase("manifest_xxh64");
  std::string body = m.dump(2);
  body.resize(body.size() - 2);
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh64(body.data(), body.size())));
  test::write_bytes(step / "manifest.json", body + ",\n  \"manifest_xxh64\": \"" + hex + "\"\n}\n");
  ASSERT_EQ(SafetensorsFile::open(opt_path)->metadata().count("m_format"), 0u);

  HostState hs = fresh();
  auto r = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_same_state(hs, state_);
  // ... and only into fp32 moments.
  TrainSetup q8 = make_setup(plan_json("bf16", 0.5, "q8", "q8", 32));
  HostState quantised = make_state(q8);
  auto refused = load_checkpoint(dir.path(), quantised);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("keeps m/v in fp32/fp32, this run's plan says q8/q8 (block 32)"),
            std::string::npos)
      << refused.status().message();
}

TEST_F(CheckpointFiles, LatestIsFollowedAndScanningIsTheFallback) {
  ScratchDir dir("ckpt-latest");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 5)).ok());
  HostState hs = fresh();
  // `latest` is the authority on which step is newest, when intact (with its checksum, or without
  // one, as written before it had one).
  test::write_bytes(dir / "latest", "step-00000002\nxxh64 " + latest_hash("step-00000002") + "\n");
  auto a = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->info.next_step, 2);
  EXPECT_EQ(a->note, "");
  test::write_bytes(dir / "latest", "step-00000002\n");
  a = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->info.next_step, 2);
  // One flipped bit (step 5 read as step 2 after a bit flip of '5'): the checksum catches it, the
  // newest step is loaded, and the note says why.
  test::write_bytes(dir / "latest", "step-00000002\nxxh64 " + latest_hash("step-00000005") + "\n");
  a = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->info.next_step, 5);
  EXPECT_NE(a->note.find("is damaged (its checksum does not match the step it names, 'step-00000002'): resuming from the highest-numbered "
                         "step, 'step-00000005'"),
            std::string::npos)
      << a->note;
  // Without it (or when it names nothing), the highest-numbered step directory.
  fs::remove(dir / "latest");
  auto b = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->info.next_step, 5);
  test::write_bytes(dir / "latest", "step-00000009\n");
  auto c = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->info.next_step, 5);
  ScratchDir empty("ckpt-empty");
  auto none = load_checkpoint(empty.path(), hs);
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(find_latest_checkpoint(empty.path()).status().code(), StatusCode::kNotFound);
}

TEST_F(CheckpointFiles, SavingAStepAgainReplacesItWhole) {
  ScratchDir dir("ckpt-replace");
  HostState other = fresh();
  ASSERT_TRUE(save_checkpoint(dir.path(), other, info_for(*su_, 3)).ok());
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 3)).ok());
  EXPECT_TRUE(temporaries(dir.path()).empty());
  HostState hs = fresh();
  ASSERT_TRUE(load_checkpoint(dir.path(), hs).ok());
  expect_same_state(hs, state_);
}

// A truncated file or one flipped byte, in any of the three files: kCorrupt naming the file, the
// directory byte-identical afterwards and the training state untouched.
TEST_F(CheckpointFiles, CorruptOrTruncatedFilesAreRefusedAndNothingChanges) {
  ScratchDir pristine("ckpt-pristine");
  ASSERT_TRUE(save_checkpoint(pristine.path(), state_, info_for(*su_, 2)).ok());
  struct Damage {
    std::string name;
    std::function<void(std::string&)> apply;
  };
  const std::vector<Damage> damages = {
      {"truncated by one byte", [](std::string& b) { b.pop_back(); }},
      {"truncated to half", [](std::string& b) { b.resize(b.size() / 2); }},
      {"a flipped byte in the middle", [](std::string& b) { b[b.size() / 2] ^= 0x10; }},
      {"a flipped byte near the start", [](std::string& b) { b[9] ^= 0x01; }},
      {"a flipped byte near the end", [](std::string& b) { b[b.size() - 3] ^= 0x04; }},
      {"one byte too many", [](std::string& b) { b.push_back(' '); }},
  };
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "manifest.json"}) {
    for (const Damage& d : damages) {
      SCOPED_TRACE(std::string(file) + ", " + d.name);
      ScratchDir dir("ckpt-corrupt");
      fs::copy(pristine.path(), dir.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
      const fs::path victim = dir / "step-00000002" / file;
      std::string bytes = test::read_bytes(victim);
      d.apply(bytes);
      test::write_bytes(victim, bytes);
      const auto before = snapshot(dir.path());
      HostState hs = fresh();
      const HostState untouched = fresh();
      for (const fs::path& p : {dir.path(), dir / "step-00000002"}) {
        auto r = load_checkpoint(p, hs);
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().to_string();
        EXPECT_NE(r.status().message().find(file), std::string::npos) << r.status().to_string();
      }
      EXPECT_EQ(snapshot(dir.path()), before);
      expect_same_state(hs, untouched);
    }
  }
  // A missing file is corrupt too, naming it.
  ScratchDir dir("ckpt-missing");
  fs::copy(pristine.path(), dir.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::remove(dir / "step-00000002" / "optimizer.safetensors");
  HostState hs = fresh();
  auto r = load_checkpoint(dir.path(), hs);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("optimizer.safetensors"), std::string::npos) << r.status().to_string();
}

// Decision: a corrupt newest checkpoint is never skipped silently, even when an older one is fine.
TEST_F(CheckpointFiles, ACorruptNewestCheckpointIsRefusedNamingTheOlderValidOne) {
  ScratchDir dir("ckpt-newest");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 4)).ok());
  const fs::path victim = dir / "step-00000004" / "model.safetensors";
  std::string bytes = test::read_bytes(victim);
  bytes[bytes.size() - 100] ^= 0x20;
  test::write_bytes(victim, bytes);
  HostState hs = fresh();
  auto r = load_checkpoint(dir.path(), hs);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("step-00000004"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("step-00000002"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("checksum mismatch"), std::string::npos) << r.status().message();
  // Moving the corrupt one away is how a user resumes from the older one.
  fs::rename(dir / "step-00000004", dir / "bad-step-4");
  auto older = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(older.ok()) << older.status().to_string();
  EXPECT_EQ(older->info.next_step, 2);
}

TEST_F(CheckpointFiles, AFailedSaveLeavesThePreviousCheckpointLoadable) {
  ScratchDir dir("ckpt-failsave");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
  const auto before = snapshot(dir.path());
  // checkpoint_dir is a file.
  const fs::path file = dir / "a-file";
  test::write_bytes(file, "x");
  Status s = save_checkpoint(file, state_, info_for(*su_, 3));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("a-file"), std::string::npos) << s.message();
  EXPECT_EQ(test::read_bytes(file), "x");
  fs::remove(file);
  // Under a file, so it cannot be created.
  EXPECT_FALSE(save_checkpoint(dir / "step-00000002" / "manifest.json" / "sub", state_, info_for(*su_, 3)).ok());
  EXPECT_EQ(snapshot(dir.path()), before);
  // A write that fails half-way, at every write of a save: FaultsAtEveryDurableOperation... below.
  HostState hs = fresh();
  auto r = load_checkpoint(dir.path(), hs);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->info.next_step, 2);
  expect_same_state(hs, state_);
}

// Fault injection (issue 32; tests/executor/faulty_io.h): a save of step 3 over a folder holding
// step 2, with one fault at every operation of its kind, in every way it can fail, and a crash
// followed by a power cut before every durable operation and after the save returned. Each time the newest complete checkpoint
// loads, holds its own step's state, and no temporary is left; a save that reported success is
// step 3. They replace the child processes with a file size limit that stood in for a full disk;
// the SIGKILL test below still kills a real writer.
namespace {
using Op = test::FaultyIo::Op;
using Mode = test::FaultyIo::Mode;

struct FaultCase {
  std::string what;
  std::function<void(test::FaultyIo&)> arm;
};
}  // namespace

TEST_F(CheckpointFiles, FaultsAtEveryDurableOperationLeaveTheNewestCompleteCheckpointLoadable) {
  const HostState other = fresh();
  // One clean save, counted: how many calls of each kind a save of step 3 makes.
  int counts[static_cast<int>(Op::kCount)] = {};
  int durable = 0;
  {
    ScratchDir dir("ckpt-fault-count");
    ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
    test::FaultyIo io(dir.path());
    {
      ScopedFileIo use(io);
      ASSERT_TRUE(save_checkpoint(dir.path(), other, info_for(*su_, 3)).ok());
    }
    for (int k = 0; k < static_cast<int>(Op::kCount); ++k) counts[k] = io.count(static_cast<Op>(k));
    durable = io.durable_ops();
  }
  ASSERT_GT(counts[static_cast<int>(Op::kWrite)], 3);
  ASSERT_GE(counts[static_cast<int>(Op::kFsync)], 6);  // each file, the step folder, the checkpoint folder, latest
  ASSERT_GE(counts[static_cast<int>(Op::kRename)], 2);
  ASSERT_GT(durable, counts[static_cast<int>(Op::kWrite)]);

  std::vector<FaultCase> cases;
  for (Op op : {Op::kOpen, Op::kFsync, Op::kRename, Op::kMkdir})
    for (int k = 1; k <= counts[static_cast<int>(op)]; ++k)
      cases.push_back({"call " + std::to_string(k) + " of kind " + std::to_string(static_cast<int>(op)) + " fails with EIO",
                       [op, k](test::FaultyIo& io) { io.inject(op, k, Mode::kErrno, EIO); }});
  for (int k = 1; k <= counts[static_cast<int>(Op::kWrite)]; ++k) {
    cases.push_back({"write " + std::to_string(k) + ": ENOSPC", [k](test::FaultyIo& io) { io.inject(Op::kWrite, k, Mode::kErrno, ENOSPC); }});
    cases.push_back({"write " + std::to_string(k) + ": EIO", [k](test::FaultyIo& io) { io.inject(Op::kWrite, k, Mode::kErrno, EIO); }});
    cases.push_back({"write " + std::to_string(k) + ": torn", [k](test::FaultyIo& io) { io.inject(Op::kWrite, k, Mode::kTorn, EIO); }});
    cases.push_back({"write " + std::to_string(k) + ": short", [k](test::FaultyIo& io) { io.inject(Op::kWrite, k, Mode::kShort); }});
  }
  for (int k = 1; k <= durable; ++k)
    cases.push_back({"crash and power cut before durable operation " + std::to_string(k), [k](test::FaultyIo& io) { io.crash_before(k); }});
  cases.push_back({"crash and power cut once the save has returned", [](test::FaultyIo&) {}});

  int saved_anyway = 0, crashes = 0;
  for (const FaultCase& c : cases) {
    SCOPED_TRACE(c.what);
    ScratchDir dir("ckpt-fault");
    ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
    test::FaultyIo io(dir.path());
    c.arm(io);
    Status s;
    {
      ScopedFileIo use(io);
      s = save_checkpoint(dir.path(), other, info_for(*su_, 3));
    }
    const bool crash = c.what.rfind("crash", 0) == 0, after = c.what.find("returned") != std::string::npos;
    ASSERT_TRUE(io.fired() || after) << "the fault was not reached";
    if (after) {
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    if (crash) {
      ++crashes;
      io.lose_power();
    } else if (s.ok()) {
      ++saved_anyway;
    } else {
      EXPECT_NE(s.message().find(dir.path().string()), std::string::npos) << s.message();
      if (c.what.find("ENOSPC") != std::string::npos) {
        EXPECT_NE(s.message().find("the disk is full"), std::string::npos) << s.message();
      }
    }
    if (!crash) {
      EXPECT_TRUE(temporaries(dir.path()).empty()) << s.message();
    }
    HostState hs = fresh();
    auto r = load_checkpoint(dir.path(), hs);
    ASSERT_TRUE(r.ok()) << r.status().to_string() << " (the save said: " << s.to_string() << ")";
    if (s.ok()) {
      EXPECT_EQ(r->info.next_step, 3);
    }
    ASSERT_TRUE(r->info.next_step == 2 || r->info.next_step == 3) << r->info.next_step;
    expect_same_state(hs, r->info.next_step == 3 ? other : state_);
  }
  // Every short write is retried to completion; nothing else may pass as a success.
  EXPECT_EQ(saved_anyway, counts[static_cast<int>(Op::kWrite)]);
  EXPECT_EQ(crashes, durable + 1);
}

// Retention (--keep-checkpoints, save_total_limit; docs/checkpoints.md#retention).
namespace {
// The step-* directories of `dir`, in name order.
std::vector<std::string> step_dirs(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}
std::vector<std::string> names(const std::vector<fs::path>& paths) {
  std::vector<std::string> out;
  for (const fs::path& p : paths) out.push_back(p.filename().string());
  return out;
}
}  // namespace

TEST_F(CheckpointFiles, RetentionKeepsTheNewestAndNeverTouchesNewerSteps) {
  ScratchDir dir("ckpt-keep");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 1)).ok());
  // Refused without touching anything: keep 0, and a step that was not saved.
  auto r = prune_checkpoints(dir.path(), 0, 1);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  r = prune_checkpoints(dir.path(), 1, 9);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().to_string();
  EXPECT_NE(r.status().message().find("step-00000009"), std::string::npos) << r.status().message();
  EXPECT_EQ(step_dirs(dir.path()), std::vector<std::string>{"step-00000001"});

  // Keep 2 after each save of steps 1..5: the two newest stay, the older go one by one.
  const std::vector<std::vector<std::string>> expect_removed = {{}, {}, {"step-00000001"}, {"step-00000002"}, {"step-00000003"}};
  for (int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 1) {
      ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, step)).ok());
    }
    auto removed = prune_checkpoints(dir.path(), 2, step);
    ASSERT_TRUE(removed.ok()) << removed.status().to_string();
    EXPECT_EQ(names(*removed), expect_removed[static_cast<size_t>(step - 1)]);
  }
  EXPECT_EQ(step_dirs(dir.path()), (std::vector<std::string>{"step-00000004", "step-00000005"}));
  EXPECT_TRUE(temporaries(dir.path()).empty());

  // A newer step than the one saved (a run resumed from an older checkpoint, or saved out of
  // order) is never touched: saving step 7 and then step 6 with keep 1 removes 4 and 5 only.
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 7)).ok());
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 6)).ok());
  auto removed = prune_checkpoints(dir.path(), 1, 6);
  ASSERT_TRUE(removed.ok()) << removed.status().to_string();
  EXPECT_EQ(names(*removed), (std::vector<std::string>{"step-00000004", "step-00000005"}));
  EXPECT_EQ(step_dirs(dir.path()), (std::vector<std::string>{"step-00000006", "step-00000007"}));
  EXPECT_TRUE(temporaries(dir.path()).empty());
  HostState hs = fresh();
  auto loaded = load_checkpoint(dir.path(), hs);  // `latest` names step 6, the last saved
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->info.next_step, 6);
  expect_same_state(hs, state_);
}

// Pruning with steps 1, 2 and 3 saved and keep 1, with every rename failing in turn, the folder's
// fsync failing, and a crash followed by a power cut before every durable operation: each step-*
// directory left is whole (it loads), step 3 is always there, and the next save clears whatever
// was moved out of sight.
TEST_F(CheckpointFiles, FaultsWhilePruningLeaveEveryStepDirectoryWholeOrGone) {
  const HostState other = fresh();
  auto prepare = [&](const fs::path& d) {
    ASSERT_TRUE(save_checkpoint(d, other, info_for(*su_, 1)).ok());
    ASSERT_TRUE(save_checkpoint(d, other, info_for(*su_, 2)).ok());
    ASSERT_TRUE(save_checkpoint(d, state_, info_for(*su_, 3)).ok());
  };
  int renames = 0, fsyncs = 0, durable = 0;
  {
    ScratchDir dir("ckpt-prune-count");
    prepare(dir.path());
    test::FaultyIo io(dir.path());
    {
      ScopedFileIo use(io);
      auto removed = prune_checkpoints(dir.path(), 1, 3);
      ASSERT_TRUE(removed.ok()) << removed.status().to_string();
      EXPECT_EQ(names(*removed), (std::vector<std::string>{"step-00000001", "step-00000002"}));  // the oldest first
    }
    renames = io.count(Op::kRename), fsyncs = io.count(Op::kFsync), durable = io.durable_ops();
  }
  ASSERT_EQ(renames, 2);
  ASSERT_GE(fsyncs, 1);
  ASSERT_GE(durable, 3);

  std::vector<FaultCase> cases;
  for (int k = 1; k <= renames; ++k)
    cases.push_back({"rename " + std::to_string(k) + " fails with EIO", [k](test::FaultyIo& io) { io.inject(Op::kRename, k, Mode::kErrno, EIO); }});
  for (int k = 1; k <= fsyncs; ++k)
    cases.push_back({"fsync " + std::to_string(k) + " fails with EIO", [k](test::FaultyIo& io) { io.inject(Op::kFsync, k, Mode::kErrno, EIO); }});
  for (int k = 1; k <= durable; ++k)
    cases.push_back({"crash and power cut before durable operation " + std::to_string(k), [k](test::FaultyIo& io) { io.crash_before(k); }});
  for (const FaultCase& c : cases) {
    SCOPED_TRACE(c.what);
    ScratchDir dir("ckpt-prune-fault");
    prepare(dir.path());
    test::FaultyIo io(dir.path());
    c.arm(io);
    Result<std::vector<fs::path>> removed = std::vector<fs::path>{};
    {
      ScopedFileIo use(io);
      removed = prune_checkpoints(dir.path(), 1, 3);
    }
    ASSERT_TRUE(io.fired()) << "the fault was not reached";
    ASSERT_FALSE(removed.ok()) << "a failed pruning reported success";
    EXPECT_NE(removed.status().message().find(dir.path().string()), std::string::npos) << removed.status().message();
    if (c.what.rfind("crash", 0) == 0) io.lose_power();
    // Whatever is left under a step-* name is a whole checkpoint of its own step.
    const std::vector<std::string> left = step_dirs(dir.path());
    ASSERT_FALSE(left.empty());
    EXPECT_EQ(left.back(), "step-00000003");
    for (const std::string& name : left) {
      HostState hs = fresh();
      auto r = load_checkpoint(dir / name, hs);
      ASSERT_TRUE(r.ok()) << name << ": " << r.status().to_string();
      expect_same_state(hs, name == "step-00000003" ? state_ : other);
    }
    // The next save (and its pruning) leaves exactly the newest, with nothing hidden.
    ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 4)).ok());
    auto again = prune_checkpoints(dir.path(), 1, 4);
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    EXPECT_EQ(step_dirs(dir.path()), std::vector<std::string>{"step-00000004"});
    EXPECT_TRUE(temporaries(dir.path()).empty());
  }
}

// Reads that fail while a checkpoint loads (EIO at every read, a short read at every read): the
// load is refused naming the file, or goes on where it can (short reads are retried; an unreadable
// 'latest' is replaced by a scan of the folder, with a note); the files are untouched, so the next
// load succeeds.
TEST_F(CheckpointFiles, ReadFaultsAtEveryReadAreNamedAndLeaveTheCheckpointLoadable) {
  ScratchDir dir("ckpt-read-fault");
  ASSERT_TRUE(save_checkpoint(dir.path(), state_, info_for(*su_, 2)).ok());
  int reads = 0;
  {
    test::FaultyIo io(dir.path());
    ScopedFileIo use(io);
    HostState hs = fresh();
    ASSERT_TRUE(load_checkpoint(dir.path(), hs).ok());
    reads = io.count(Op::kRead);
  }
  ASSERT_GT(reads, 3);
  for (Mode mode : {Mode::kErrno, Mode::kShort})
    for (int k = 1; k <= reads; ++k) {
      SCOPED_TRACE("read " + std::to_string(k) + (mode == Mode::kErrno ? ": EIO" : ": short"));
      test::FaultyIo io(dir.path());
      io.inject(Op::kRead, k, mode, EIO);
      HostState hs = fresh();
      Result<LoadedCheckpoint> r = invalid_argument("not run");
      {
        ScopedFileIo use(io);
        r = load_checkpoint(dir.path(), hs);
      }
      ASSERT_TRUE(io.fired());
      if (mode == Mode::kShort) {
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        expect_same_state(hs, state_);
      } else if (r.ok()) {  // only 'latest' may fail to read: the folder is scanned instead, and a note says so
        EXPECT_NE(r->note.find("latest"), std::string::npos) << r->note;
        expect_same_state(hs, state_);
      } else {
        EXPECT_NE(r.status().message().find(dir.path().string()), std::string::npos) << r.status().message();
      }
      HostState again = fresh();
      ASSERT_TRUE(load_checkpoint(dir.path(), again).ok());
      expect_same_state(again, state_);
    }
}

// A writer SIGKILLed at arbitrary moments of a save loop: the newest complete step always loads,
// and its contents are those of that step (each save marks the state with its step number).
TEST(CheckpointKill, AWriterKilledDuringASaveLeavesThePreviousCheckpointLoadable) {
  Json cfg = Json::parse(test::read_bytes(fs::path(MEGATRAIN_PROFILES_DIR) / "models" / "tiny-llama-gqa.json"));
  cfg["hidden_size"] = 128;  // 1.8M parameters: 21 MB per save, long enough to be killed inside one
  cfg["intermediate_size"] = 344;
  cfg["num_hidden_layers"] = 4;
  cfg["vocab_size"] = 4096;
  auto model = ModelSpec::from_config_json(cfg.dump(), "kill-test-model");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  HostState state = HostState::create(*model, DType::kFp32);
  EXPECT_TRUE(state.init_random(3, 0.02).ok());
  auto mark = [](HostState& hs, int64_t step) {
    UnitState& u = hs.units()[1];
    u.master[0] = static_cast<float>(step);
    u.m.data()[0] = static_cast<float>(step);
    u.v.data()[u.numel - 1] = static_cast<float>(step);
  };
  auto info = [&](int64_t step) {
    CheckpointInfo i;
    i.next_step = step;
    i.model_name = model->name();
    i.parameters = model->parameter_counts().total;
    return i;
  };
  ScratchDir dir("ckpt-kill");
  mark(state, 1);
  ASSERT_TRUE(save_checkpoint(dir.path(), state, info(1)).ok());
  int64_t newest = 1;
  int killed_mid_save = 0;
  const int delays_ms[] = {1, 5, 20, 60, 150, 400};
  for (int round = 0; round < 6; ++round) {
    const int64_t first = 100 * (round + 1);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (int64_t k = first; k < first + 90; ++k) {
        mark(state, k);
        if (!save_checkpoint(dir.path(), state, info(k)).ok()) ::_exit(2);
      }
      ::_exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delays_ms[round]));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(wstatus)) << "the writer finished before it was killed; make the state bigger";
    if (!temporaries(dir.path()).empty()) ++killed_mid_save;
    HostState loaded = HostState::create(*model, DType::kFp32);
    auto r = load_checkpoint(dir.path(), loaded);
    ASSERT_TRUE(r.ok()) << "round " << round << ": " << r.status().to_string();
    const int64_t step = r->info.next_step;
    EXPECT_TRUE(step == newest || (step >= first && step < first + 90)) << "round " << round << " loaded step " << step;
    const UnitState& u = loaded.units()[1];
    EXPECT_EQ(u.master[0], static_cast<float>(step));
    EXPECT_EQ(u.m.data()[0], static_cast<float>(step));
    EXPECT_EQ(u.v.data()[u.numel - 1], static_cast<float>(step));
    newest = step;
    // Without `latest`, scanning picks the highest-numbered step directory: it must be complete too
    // (a step directory appears only by the final rename).
    fs::rename(dir / "latest", dir / "latest.kept");
    auto scanned = load_checkpoint(dir.path(), loaded);
    fs::rename(dir / "latest.kept", dir / "latest");
    ASSERT_TRUE(scanned.ok()) << "round " << round << ", without latest: " << scanned.status().to_string();
    EXPECT_GE(scanned->info.next_step, step);
    EXPECT_EQ(u.master[0], static_cast<float>(scanned->info.next_step));
    EXPECT_EQ(u.v.data()[u.numel - 1], static_cast<float>(scanned->info.next_step));
  }
  EXPECT_GT(killed_mid_save, 0) << "no kill landed inside a save";
  // The next save clears what the killed writers left behind.
  mark(state, 5000);
  ASSERT_TRUE(save_checkpoint(dir.path(), state, info(5000)).ok());
  EXPECT_TRUE(temporaries(dir.path()).empty());
}

}  // namespace
}  // namespace megatrain::exec

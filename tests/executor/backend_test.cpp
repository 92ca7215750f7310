// The backend table's building blocks (events, work queues, the arena) and the CPU backend's
// copies, checked against what the pipeline relies on: order, completion, alignment, bounds.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/executor/backend.h"
#include "megatrain/executor/bf16.h"

namespace megatrain::exec {
namespace {

ModelSpec tiny_model() {
  auto m = ModelSpec::load(std::string(MEGATRAIN_PROFILES_DIR) + "/models/tiny-llama-gqa.json");
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return std::move(m).value();
}

TEST(WorkQueue, RunsJobsInPostOrderOnOneThreadAndSynchronizeWaitsForAll) {
  WorkQueue q;
  std::vector<int> seen;
  std::thread::id worker;
  for (int i = 0; i < 200; ++i)
    q.post([&, i] {
      if (i == 0) worker = std::this_thread::get_id();
      EXPECT_EQ(std::this_thread::get_id(), worker);
      if (i % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      seen.push_back(i);
    });
  q.synchronize();
  ASSERT_EQ(seen.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], i);
  EXPECT_NE(worker, std::this_thread::get_id());
}

TEST(Event, AWaiterResumesOnlyAfterTheSignalAndResetRearms) {
  Event e;
  EXPECT_FALSE(e.ready());
  std::atomic<bool> passed{false};
  std::thread t([&] {
    e.host_wait();
    passed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(passed.load());
  e.signal();
  t.join();
  EXPECT_TRUE(passed.load());
  e.reset();
  EXPECT_FALSE(e.ready());
  Event born_ready(true);
  born_ready.host_wait();  // returns at once
  EXPECT_TRUE(born_ready.ready());
}

TEST(Arena, CarvesAlignedDisjointBuffersAndRefusesToOverrun) {
  auto be = make_cpu_backend(tiny_model(), Dims{}, BackendOptions{});
  ASSERT_TRUE(be.ok()) << be.status().to_string();
  auto arena = (*be)->create_arena(1000);
  ASSERT_TRUE(arena.ok());
  EXPECT_GE((*arena)->capacity(), 1000);
  auto a = (*arena)->take_floats(3, "a");
  auto b = (*arena)->take_floats(100, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*b) % 64, 0u);
  EXPECT_GE(*b, *a + 3);
  EXPECT_EQ((*arena)->used(), 64 + 448);
  auto c = (*arena)->take_floats(1000, "too much");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("too much"), std::string::npos) << c.status().to_string();
}

TEST(CpuBackend, UploadExpandsTheBf16StreamingCopyAndCopiesFp32Exactly) {
  const ModelSpec model = tiny_model();
  auto be = make_cpu_backend(model, Dims{}, BackendOptions{});
  ASSERT_TRUE(be.ok());
  HostState hs = HostState::create(model, DType::kBf16);
  EXPECT_TRUE(hs.init_random(7, 0.02).ok());
  EXPECT_TRUE(hs.refresh_stream().ok());
  UnitState& u = hs.units()[1];
  std::vector<float> dev(static_cast<size_t>(u.numel), -1.0f);
  (*be)->upload_unit(StreamKind::kH2D, u, DType::kBf16, dev.data());
  for (int64_t i = 0; i < u.numel; ++i) ASSERT_EQ(dev[static_cast<size_t>(i)], bf16_to_fp32(u.stream_bf16[i])) << i;
  (*be)->upload_unit(StreamKind::kH2D, u, DType::kFp32, dev.data());
  for (int64_t i = 0; i < u.numel; ++i) ASSERT_EQ(dev[static_cast<size_t>(i)], u.master[i]) << i;
}

TEST(CpuBackend, HostAccumulationAddsInIndexOrderAndRecordSignals) {
  auto be = make_cpu_backend(tiny_model(), Dims{}, BackendOptions{});
  ASSERT_TRUE(be.ok());
  std::vector<float> host = {1.0f, 2.0f, 1e8f}, dev = {0.5f, -2.0f, 1.0f};
  (*be)->add_to_host(StreamKind::kD2H, host.data(), dev.data(), 3);
  EXPECT_EQ(host, (std::vector<float>{1.5f, 0.0f, 1e8f + 1.0f}));
  Event e;
  (*be)->record(StreamKind::kCompute, e);
  EXPECT_TRUE(e.ready());
  (*be)->wait(StreamKind::kH2D, e);
}

TEST(MakeBackend, NamesTheAcceptedBackendsAndExplainsAMissingGpu) {
  const ModelSpec model = tiny_model();
  auto bogus = make_backend("tpu", model, Dims{}, BackendOptions{});
  ASSERT_FALSE(bogus.ok());
  EXPECT_NE(bogus.status().message().find("auto, cpu, cuda"), std::string::npos);
  auto cpu = make_backend("auto", model, Dims{}, BackendOptions{});
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->name(), "cpu");
  const std::string why = cuda_unavailable_reason();
  if (why.empty()) GTEST_SKIP() << "a CUDA GPU is present: the no-GPU message cannot be checked here";
  auto cuda = make_backend("cuda", model, Dims{}, BackendOptions{});
  ASSERT_FALSE(cuda.ok());
  EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(cuda.status().message().find(why), std::string::npos);
  EXPECT_NE(cuda.status().message().find("--backend cpu"), std::string::npos);
}

}  // namespace
}  // namespace megatrain::exec

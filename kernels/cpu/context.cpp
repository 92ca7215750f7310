// CpuContext: a fixed pool of worker threads; each run() hands task i to worker i.
#include "megatrain/kernels/cpu/context.h"

#include <malloc.h>

#include <climits>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::cpu {

#ifndef MEGATRAIN_CPU_ISA_NAME
#define MEGATRAIN_CPU_ISA_NAME "unknown"
#endif
const char* kernels_isa() { return MEGATRAIN_CPU_ISA_NAME; }
namespace {

// Eigen allocates its GEMM packing buffers on every product and frees them after. glibc hands
// freed memory back to the kernel (an mmap'ed block is unmapped, the top of a heap is trimmed), so
// the next product faults its pages in again, one fault per 4 KiB: measured in megatrain-exec on a
// 2-vCPU VM, 90k page faults over 4 steps of a micro-batch-2 plan and 52% more tokens/s once freed
// memory is kept. So the first CpuContext tells glibc to serve blocks up to its largest mmap
// threshold (32 MiB on 64-bit; packing buffers are cache-sized) from the heap and never to trim
// it. Process-wide, once; the memory kept is bounded by the largest packing buffers in flight.
void keep_freed_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
  });
}

}  // namespace

struct CpuContext::Pool {
  std::mutex call_mu;  // one run() at a time
  std::mutex mu;
  std::condition_variable start_cv;
  std::condition_variable done_cv;
  const std::function<void(int)>* task = nullptr;
  int n_tasks = 0;
  int pending = 0;
  uint64_t generation = 0;
  bool stop = false;
  std::vector<std::thread> workers;

  void worker_loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* t = nullptr;
      {
        std::unique_lock lock(mu);
        start_cv.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
        if (id >= n_tasks) continue;
        t = task;
      }
      (*t)(id);
      std::lock_guard lock(mu);
      if (--pending == 0) done_cv.notify_one();
    }
  }
};

CpuContext::CpuContext(int threads) : threads_(threads < 1 ? 1 : threads) {
  keep_freed_memory();
  if (threads_ == 1) return;
  pool_ = std::make_unique<Pool>();
  pool_->workers.reserve(static_cast<size_t>(threads_ - 1));
  for (int id = 1; id < threads_; ++id) pool_->workers.emplace_back([p = pool_.get(), id] { p->worker_loop(id); });
}

CpuContext::~CpuContext() {
  if (!pool_) return;
  {
    std::lock_guard lock(pool_->mu);
    pool_->stop = true;
  }
  pool_->start_cv.notify_all();
  for (auto& w : pool_->workers) w.join();
}

void CpuContext::run(int n_tasks, const std::function<void(int)>& task) {
  MT_CHECK(n_tasks >= 1 && n_tasks <= threads_,
           "n_tasks " + std::to_string(n_tasks) + " outside [1, " + std::to_string(threads_) + "]");
  if (n_tasks == 1) {
    task(0);
    return;
  }
  std::lock_guard call(pool_->call_mu);
  {
    std::lock_guard lock(pool_->mu);
    pool_->task = &task;
    pool_->n_tasks = n_tasks;
    pool_->pending = n_tasks - 1;
    ++pool_->generation;
  }
  pool_->start_cv.notify_all();
  task(0);
  std::unique_lock lock(pool_->mu);
  pool_->done_cv.wait(lock, [&] { return pool_->pending == 0; });
  pool_->task = nullptr;
}

}  // namespace megatrain::cpu

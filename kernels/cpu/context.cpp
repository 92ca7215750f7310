// CpuContext: a fixed pool of worker threads; each run() hands task i to worker i.
#include "megatrain/kernels/cpu/context.h"

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::cpu {

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

// CpuContext: the worker threads that the CPU ops (megatrain::cpu) split their work over.
//
// Every op takes a CpuContext&. An op splits its output into at most threads() contiguous chunks,
// and each output element is produced by exactly one chunk with a fixed summation order, so results
// are reproducible run to run for a given thread count. Most ops are in fact independent of the
// thread count; linear/gemm (Eigen) are the only ones where the split could matter, and the split is
// aligned so that they are not either (see docs/kernels-cpu.md, tested in determinism_test.cpp).
//
// Threads: a context owns threads()-1 workers (the caller runs chunk 0). One op at a time: run() is
// serialised by a mutex, so sharing a context between threads is safe but not concurrent; give each
// stream its own context for overlap. threads == 1 runs everything inline without any worker.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace megatrain::cpu {

// The instruction set these kernels were compiled for (CMake's MEGATRAIN_CPU_ISA: "native",
// "avx512", "avx2" or "baseline"), for logs and test reports.
const char* kernels_isa();

class CpuContext {
 public:
  // threads >= 1 (values below 1 are treated as 1).
  explicit CpuContext(int threads = 1);
  ~CpuContext();
  CpuContext(const CpuContext&) = delete;
  CpuContext& operator=(const CpuContext&) = delete;

  int threads() const { return threads_; }

  // Runs task(i) for every i in [0, n_tasks), task i on thread i (0 = the caller), and returns when
  // all have finished. n_tasks must be in [1, threads()]. Tasks must not throw.
  void run(int n_tasks, const std::function<void(int)>& task);

 private:
  struct Pool;
  int threads_;
  std::unique_ptr<Pool> pool_;
};

}  // namespace megatrain::cpu

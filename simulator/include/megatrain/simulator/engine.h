// A discrete-event engine for compiled schedules. Resources are in-order queues (a CUDA stream, a
// DMA engine, the optimizer's worker pool, an io_uring queue): each serves its tasks in the order
// they were added, up to `capacity` at once, and a task starts when its dependencies have ended,
// it is at the head of its queue, and the memory it acquires fits. Bandwidth pools (host memory,
// a shared PCIe link, one NVMe drive) are shared fluidly: when the tasks running on a pool demand
// more than its capacity, each slows down by the same factor. Memory is acquired when a task
// starts and released when a named task ends, so buffer slots really bound how far ahead a
// prefetch can run. Because queue orders are fixed, a shorter task never delays any other task
// unless pool sharing changes (the property tests check both).
//
// Not thread-safe; one Engine per simulation. Tasks are identified by dense ids from add_task().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/core/status.h"

namespace megatrain::sim {

using TaskId = int32_t;

struct ResourceInfo {
  std::string name;  // "GPU compute", "H2D", ...
  std::string kind;  // trace lane kind: gpu | h2d | d2h | cpu | nvme_read | nvme_write
  int capacity = 1;  // tasks served at once
};

struct PoolInfo {
  std::string name;       // "host memory", "PCIe", "NVMe nvme0"
  double capacity = 1.0;  // units per second (bytes/s, or 1.0 for "fraction of a device")
};

struct MemoryInfo {
  std::string name;       // "device", "pinned", "ram", "nvme", "device layer slots"
  int64_t capacity = 0;   // bytes (or slots)
  bool counted = true;    // write a bytes-in-use counter to the trace
};

// Bandwidth pools one task may draw on (host memory, a link, the CPU backend's cores).
inline constexpr int kTaskPools = 3;

// One unit of work. Plain data so that millions fit in cache-friendly arrays.
struct TaskSpec {
  int32_t resource = 0;
  double work_s = 0;          // duration when running alone at full speed
  int32_t pool[kTaskPools] = {-1, -1, -1};  // bandwidth pools used while running
  double demand[kTaskPools] = {0, 0, 0};    // units/s demanded from each pool at full speed
  // Trace metadata (not used by the engine itself).
  int16_t kind = 0;           // the caller's task kind
  int32_t step = -1, layer = -1, micro_batch = -1;
  int64_t bytes = 0;
  double flops = 0;
};

struct TaskTimes {
  double ready = 0;   // all dependencies ended and it reached the head of its queue
  double start = 0;   // started (ready + any wait for memory)
  double end = 0;
  int32_t binding = -1;  // the dependency that ended last (-1: none, or the queue predecessor)
  // When it waited for memory after it was ready: the task whose release of that memory let it
  // start (the last release of any memory it acquires); -1 otherwise.
  int32_t memory_binding = -1;
  double slowed_s[kTaskPools] = {0, 0, 0};  // time lost to sharing TaskSpec::pool[k] (the pool that limited it)
};

class Engine {
 public:
  int32_t add_resource(ResourceInfo r);
  int32_t add_pool(PoolInfo p);
  int32_t add_memory(MemoryInfo m);
  // Memory already in use before the first task (static state such as master weights).
  void preallocate(int32_t memory, int64_t bytes);

  // Forgets every resource, pool, memory and task but keeps the allocated capacity, so that the
  // planner's thousands of simulations do not pay for fresh memory (page faults) each time.
  void clear();
  // Pre-sizes the arrays when the caller knows roughly how many tasks and edges it will add.
  void reserve(size_t tasks, size_t dependencies, size_t memory_ops);
  TaskId add_task(const TaskSpec& t);
  // `after` cannot start before `before` has ended.
  void add_dependency(TaskId before, TaskId after);
  // `task` acquires `amount` of `memory` when it starts (waiting until it fits).
  void acquire(TaskId task, int32_t memory, int64_t amount);
  // `amount` of `memory` is released when `task` ends.
  void release(TaskId task, int32_t memory, int64_t amount);

  // Runs every task. Fails when a task can never start: memory larger than the capacity, or a
  // dependency cycle / deadlock (the message names the first stuck task and what it waits for).
  Status run();

  size_t task_count() const { return tasks_.size(); }
  const TaskSpec& task(TaskId id) const { return tasks_[static_cast<size_t>(id)]; }
  const TaskTimes& times(TaskId id) const { return times_[static_cast<size_t>(id)]; }
  const std::vector<ResourceInfo>& resources() const { return resources_; }
  const std::vector<PoolInfo>& pools() const { return pools_; }
  const std::vector<MemoryInfo>& memories() const { return memories_; }
  const std::vector<TaskId>& queue(int32_t resource) const { return queues_[static_cast<size_t>(resource)]; }
  // Dependencies of a task (CSR, valid after run()).
  std::vector<TaskId> dependencies(TaskId id) const;
  // Bytes in use of a memory over time: (t, bytes) at every change, valid after run().
  const std::vector<std::pair<double, int64_t>>& memory_timeline(int32_t memory) const {
    return mem_timeline_[static_cast<size_t>(memory)];
  }
  int64_t memory_peak(int32_t memory) const { return mem_peak_[static_cast<size_t>(memory)]; }
  double makespan() const { return makespan_; }

 private:
  struct Edge {
    TaskId from, to;
  };
  struct MemOp {
    TaskId task;
    int32_t memory;
    int64_t amount;
  };

  std::vector<ResourceInfo> resources_;
  std::vector<PoolInfo> pools_;
  std::vector<MemoryInfo> memories_;
  std::vector<int64_t> prealloc_;
  std::vector<TaskSpec> tasks_;
  std::vector<TaskTimes> times_;
  std::vector<std::vector<TaskId>> queues_;  // the first resources_.size() are in use
  std::vector<Edge> edges_;
  std::vector<MemOp> acquires_, releases_;

  // Built by run().
  std::vector<int32_t> dep_begin_, deps_;        // predecessors (CSR)
  std::vector<int32_t> succ_begin_, succs_;      // successors (CSR)
  std::vector<int32_t> acq_begin_, rel_begin_;   // per-task ranges into sorted acquires_/releases_
  std::vector<std::vector<std::pair<double, int64_t>>> mem_timeline_;
  std::vector<int64_t> mem_peak_;
  double makespan_ = 0;

  // Scratch state of run(), kept between runs for its capacity.
  struct TaskState {
    double remaining, speed, last_update;
    int32_t pending;
    uint32_t version;
    uint8_t ready_seen;
  };
  struct Event {
    double time;
    uint64_t seq;
    TaskId task;
    uint32_t version;
    bool operator>(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };
  std::vector<TaskState> state_;
  std::vector<Event> heap_;
  std::vector<MemOp> sort_scratch_;
  std::vector<int32_t> fill_scratch_;
};

}  // namespace megatrain::sim

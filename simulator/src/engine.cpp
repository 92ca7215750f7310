// The event loop: in-order resource queues, fluid bandwidth pools, memory acquired at start and
// released at the end of a named task. Flat arrays and a binary heap keep it at millions of tasks
// per second, because the planner runs thousands of simulations per search.
#include "megatrain/simulator/engine.h"

#include <algorithm>
#include <limits>
#include <queue>

namespace megatrain::sim {

int32_t Engine::add_resource(ResourceInfo r) {
  resources_.push_back(std::move(r));
  queues_.emplace_back();
  return static_cast<int32_t>(resources_.size() - 1);
}

int32_t Engine::add_pool(PoolInfo p) {
  pools_.push_back(std::move(p));
  return static_cast<int32_t>(pools_.size() - 1);
}

int32_t Engine::add_memory(MemoryInfo m) {
  memories_.push_back(std::move(m));
  prealloc_.push_back(0);
  return static_cast<int32_t>(memories_.size() - 1);
}

void Engine::preallocate(int32_t memory, int64_t bytes) { prealloc_[static_cast<size_t>(memory)] += bytes; }

TaskId Engine::add_task(const TaskSpec& t) {
  MT_CHECK(t.resource >= 0 && static_cast<size_t>(t.resource) < resources_.size(), "task on an unknown resource");
  tasks_.push_back(t);
  const auto id = static_cast<TaskId>(tasks_.size() - 1);
  queues_[static_cast<size_t>(t.resource)].push_back(id);
  return id;
}

void Engine::add_dependency(TaskId before, TaskId after) {
  if (before < 0 || after < 0) return;
  edges_.push_back({before, after});
}

void Engine::acquire(TaskId task, int32_t memory, int64_t amount) {
  if (amount > 0) acquires_.push_back({task, memory, amount});
}

void Engine::release(TaskId task, int32_t memory, int64_t amount) {
  if (amount > 0) releases_.push_back({task, memory, amount});
}

std::vector<TaskId> Engine::dependencies(TaskId id) const {
  const auto i = static_cast<size_t>(id);
  return std::vector<TaskId>(deps_.begin() + dep_begin_[i], deps_.begin() + dep_begin_[i + 1]);
}

namespace {

// CSR from (key, value) pairs with keys in [0, n).
template <typename Get>
void build_csr(size_t n, size_t m, Get get, std::vector<int32_t>& begin, std::vector<int32_t>& out) {
  begin.assign(n + 1, 0);
  for (size_t e = 0; e < m; ++e) ++begin[static_cast<size_t>(get(e).first) + 1];
  for (size_t i = 0; i < n; ++i) begin[i + 1] += begin[i];
  out.resize(m);
  std::vector<int32_t> fill(begin.begin(), begin.end() - 1);
  for (size_t e = 0; e < m; ++e) {
    auto [k, v] = get(e);
    out[static_cast<size_t>(fill[static_cast<size_t>(k)]++)] = v;
  }
}

struct Event {
  double time;
  uint64_t seq;
  TaskId task;
  uint32_t version;
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
};

}  // namespace

Status Engine::run() {
  const size_t n = tasks_.size();
  times_.assign(n, TaskTimes{});
  build_csr(n, edges_.size(), [&](size_t e) { return std::pair{edges_[e].to, edges_[e].from}; }, dep_begin_, deps_);
  build_csr(n, edges_.size(), [&](size_t e) { return std::pair{edges_[e].from, edges_[e].to}; }, succ_begin_, succs_);
  // Memory operations grouped by task with a counting sort (task ids are dense): O(n), stable.
  auto group = [n](std::vector<MemOp>& ops, std::vector<int32_t>& begin) {
    begin.assign(n + 1, 0);
    for (const auto& op : ops) ++begin[static_cast<size_t>(op.task) + 1];
    for (size_t i = 0; i < n; ++i) begin[i + 1] += begin[i];
    std::vector<MemOp> sorted(ops.size());
    std::vector<int32_t> fill(begin.begin(), begin.end() - 1);
    for (const auto& op : ops) sorted[static_cast<size_t>(fill[static_cast<size_t>(op.task)]++)] = op;
    ops.swap(sorted);
  };
  group(acquires_, acq_begin_);
  group(releases_, rel_begin_);

  const size_t nr = resources_.size(), np = pools_.size(), nm = memories_.size();
  std::vector<int32_t> pending(n);
  for (size_t i = 0; i < n; ++i) pending[i] = dep_begin_[i + 1] - dep_begin_[i];
  std::vector<double> remaining(n), speed(n, 1.0), last_update(n, 0.0);
  std::vector<uint32_t> version(n, 0);
  std::vector<uint8_t> ready_seen(n, 0);
  std::vector<size_t> head(nr, 0);
  std::vector<int> running(nr, 0);
  std::vector<std::vector<TaskId>> active(np);
  std::vector<double> demand_sum(np, 0.0);
  std::vector<int64_t> in_use(prealloc_.begin(), prealloc_.end());
  std::vector<std::vector<int32_t>> mem_waiters(nm);
  mem_timeline_.assign(nm, {});
  mem_peak_.assign(in_use.begin(), in_use.end());
  for (size_t m = 0; m < nm; ++m) {
    mem_timeline_[m].push_back({0.0, in_use[m]});
    if (in_use[m] > memories_[m].capacity)
      return resource_exhausted(memories_[m].name + ": " + std::to_string(in_use[m]) +
                                " bytes are needed before the first task, over the capacity of " +
                                std::to_string(memories_[m].capacity) + " by " +
                                std::to_string(in_use[m] - memories_[m].capacity));
  }

  std::priority_queue<Event, std::vector<Event>, std::greater<>> heap;
  uint64_t seq = 0;
  double now = 0;
  size_t done = 0;
  std::vector<uint8_t> dirty(nr, 1);
  std::vector<int32_t> dirty_list;
  dirty_list.reserve(nr);
  for (size_t r = 0; r < nr; ++r) dirty_list.push_back(static_cast<int32_t>(r));
  auto mark = [&](int32_t r) {
    if (!dirty[static_cast<size_t>(r)]) {
      dirty[static_cast<size_t>(r)] = 1;
      dirty_list.push_back(r);
    }
  };

  auto task_speed = [&](TaskId t) {
    double s = 1.0;
    const TaskSpec& ts = tasks_[static_cast<size_t>(t)];
    for (int k = 0; k < 2; ++k) {
      const int32_t p = ts.pool[k];
      if (p < 0) continue;
      const double sum = demand_sum[static_cast<size_t>(p)];
      const double cap = pools_[static_cast<size_t>(p)].capacity;
      if (sum > cap) s = std::min(s, cap / sum);
    }
    return s;
  };
  auto schedule_end = [&](TaskId t) {
    const auto i = static_cast<size_t>(t);
    const double end = remaining[i] <= 0 ? now : now + remaining[i] / speed[i];
    heap.push(Event{end, seq++, t, ++version[i]});
  };
  // Brings every task of a pool up to `now` before its membership changes, then re-rates them.
  auto settle_pool = [&](int32_t p) {
    for (TaskId a : active[static_cast<size_t>(p)]) {
      const auto i = static_cast<size_t>(a);
      remaining[i] -= (now - last_update[i]) * speed[i];
      if (remaining[i] < 0) remaining[i] = 0;
      last_update[i] = now;
    }
  };
  auto rerate_pool = [&](int32_t p) {
    for (TaskId a : active[static_cast<size_t>(p)]) {
      const auto i = static_cast<size_t>(a);
      const double s = task_speed(a);
      if (s != speed[i]) {
        speed[i] = s;
        schedule_end(a);
      }
    }
  };
  auto record_memory = [&](size_t m) {
    auto& tl = mem_timeline_[m];
    if (!tl.empty() && tl.back().first == now) tl.back().second = in_use[m];
    else tl.push_back({now, in_use[m]});
    mem_peak_[m] = std::max(mem_peak_[m], in_use[m]);
  };

  auto try_start = [&](int32_t r) -> Status {
    const auto ri = static_cast<size_t>(r);
    const auto& q = queues_[ri];
    while (head[ri] < q.size()) {
      const TaskId t = q[head[ri]];
      const auto ti = static_cast<size_t>(t);
      if (pending[ti] > 0) return {};
      if (!ready_seen[ti]) {
        ready_seen[ti] = 1;
        times_[ti].ready = now;
      }
      if (running[ri] >= resources_[ri].capacity) return {};
      for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k) {
        const MemOp& op = acquires_[static_cast<size_t>(k)];
        const auto m = static_cast<size_t>(op.memory);
        if (op.amount > memories_[m].capacity - prealloc_[m])
          return resource_exhausted(memories_[m].name + ": a task needs " + std::to_string(op.amount) +
                                    " but only " + std::to_string(memories_[m].capacity - prealloc_[m]) +
                                    " can ever be free (capacity " + std::to_string(memories_[m].capacity) + ")");
        if (in_use[m] + op.amount > memories_[m].capacity) {
          auto& w = mem_waiters[m];
          if (std::find(w.begin(), w.end(), r) == w.end()) w.push_back(r);
          return {};
        }
      }
      for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k) {
        const MemOp& op = acquires_[static_cast<size_t>(k)];
        in_use[static_cast<size_t>(op.memory)] += op.amount;
        record_memory(static_cast<size_t>(op.memory));
      }
      ++head[ri];
      ++running[ri];
      times_[ti].start = now;
      remaining[ti] = tasks_[ti].work_s;
      last_update[ti] = now;
      const TaskSpec& ts = tasks_[ti];
      bool pooled = false;
      for (int k = 0; k < 2; ++k) {
        if (ts.pool[k] < 0) continue;
        settle_pool(ts.pool[k]);
        active[static_cast<size_t>(ts.pool[k])].push_back(t);
        demand_sum[static_cast<size_t>(ts.pool[k])] += ts.demand[k];
        pooled = true;
      }
      if (pooled) {
        speed[ti] = task_speed(t);
        schedule_end(t);
        for (int k = 0; k < 2; ++k)
          if (ts.pool[k] >= 0) rerate_pool(ts.pool[k]);
      } else {
        speed[ti] = 1.0;
        schedule_end(t);
      }
    }
    return {};
  };

  while (true) {
    while (!dirty_list.empty()) {
      const int32_t r = dirty_list.back();
      dirty_list.pop_back();
      dirty[static_cast<size_t>(r)] = 0;
      MT_RETURN_IF_ERROR(try_start(r));
    }
    if (heap.empty()) break;
    const Event ev = heap.top();
    heap.pop();
    const auto ti = static_cast<size_t>(ev.task);
    if (ev.version != version[ti]) continue;
    now = ev.time;
    TaskTimes& tt = times_[ti];
    tt.end = now;
    ++done;
    const TaskSpec& ts = tasks_[ti];
    --running[static_cast<size_t>(ts.resource)];
    mark(ts.resource);
    for (int k = 0; k < 2; ++k) {
      const int32_t p = ts.pool[k];
      if (p < 0) continue;
      auto& act = active[static_cast<size_t>(p)];
      settle_pool(p);
      act.erase(std::find(act.begin(), act.end(), ev.task));
      demand_sum[static_cast<size_t>(p)] -= ts.demand[k];
      if (act.empty()) demand_sum[static_cast<size_t>(p)] = 0;  // no drift from float sums
      rerate_pool(p);
    }
    for (int32_t k = rel_begin_[ti]; k < rel_begin_[ti + 1]; ++k) {
      const MemOp& op = releases_[static_cast<size_t>(k)];
      const auto m = static_cast<size_t>(op.memory);
      in_use[m] -= op.amount;
      record_memory(m);
      for (int32_t w : mem_waiters[m]) mark(w);
      mem_waiters[m].clear();
    }
    for (int32_t k = succ_begin_[ti]; k < succ_begin_[ti + 1]; ++k) {
      const auto s = static_cast<size_t>(succs_[static_cast<size_t>(k)]);
      if (--pending[s] == 0) {
        times_[s].binding = ev.task;
        mark(tasks_[s].resource);
      }
    }
  }

  makespan_ = now;
  if (done == n) return {};
  // Something can never start: name the first stuck queue head and what it waits for.
  for (size_t r = 0; r < nr; ++r) {
    if (head[r] >= queues_[r].size()) continue;
    const TaskId t = queues_[r][head[r]];
    const auto ti = static_cast<size_t>(t);
    std::string why;
    if (pending[ti] > 0) {
      why = std::to_string(pending[ti]) + " dependencies that never end (a cycle, or a task queued behind it)";
    } else {
      for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k) {
        const MemOp& op = acquires_[static_cast<size_t>(k)];
        const auto m = static_cast<size_t>(op.memory);
        if (in_use[m] + op.amount > memories_[m].capacity)
          why = memories_[m].name + " (" + std::to_string(op.amount) + " needed, " +
                std::to_string(memories_[m].capacity - in_use[m]) + " free, and nothing left to release it)";
      }
    }
    return resource_exhausted("the schedule deadlocks: task " + std::to_string(t) + " on " + resources_[r].name +
                              " waits for " + why);
  }
  return internal_error("simulation ended with " + std::to_string(n - done) + " tasks not run");
}

}  // namespace megatrain::sim

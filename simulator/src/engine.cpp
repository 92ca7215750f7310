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
  if (queues_.size() < resources_.size()) queues_.emplace_back();
  queues_[resources_.size() - 1].clear();
  return static_cast<int32_t>(resources_.size() - 1);
}

void Engine::clear() {
  resources_.clear();
  pools_.clear();
  memories_.clear();
  prealloc_.clear();
  tasks_.clear();
  edges_.clear();
  acquires_.clear();
  releases_.clear();
  for (auto& q : queues_) q.clear();
  makespan_ = 0;
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

void Engine::reserve(size_t tasks, size_t dependencies, size_t memory_ops) {
  tasks_.reserve(tasks);
  edges_.reserve(dependencies);
  acquires_.reserve(memory_ops);
  releases_.reserve(memory_ops);
  for (size_t r = 0; r < resources_.size(); ++r) queues_[r].reserve(tasks / std::max<size_t>(1, resources_.size()));
}

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
void build_csr(size_t n, size_t m, Get get, std::vector<int32_t>& begin, std::vector<int32_t>& out,
               std::vector<int32_t>& fill) {
  begin.assign(n + 1, 0);
  for (size_t e = 0; e < m; ++e) ++begin[static_cast<size_t>(get(e).first) + 1];
  for (size_t i = 0; i < n; ++i) begin[i + 1] += begin[i];
  out.resize(m);
  fill.assign(begin.begin(), begin.end() - 1);
  for (size_t e = 0; e < m; ++e) {
    auto [k, v] = get(e);
    out[static_cast<size_t>(fill[static_cast<size_t>(k)]++)] = v;
  }
}

}  // namespace

Status Engine::run() {
  const size_t n = tasks_.size();
  times_.assign(n, TaskTimes{});
  build_csr(n, edges_.size(), [&](size_t e) { return std::pair{edges_[e].to, edges_[e].from}; }, dep_begin_, deps_, fill_scratch_);
  build_csr(n, edges_.size(), [&](size_t e) { return std::pair{edges_[e].from, edges_[e].to}; }, succ_begin_, succs_, fill_scratch_);
  // Memory operations grouped by task with a counting sort (task ids are dense): O(n), stable.
  auto group = [n, this](std::vector<MemOp>& ops, std::vector<int32_t>& begin) {
    begin.assign(n + 1, 0);
    for (const auto& op : ops) ++begin[static_cast<size_t>(op.task) + 1];
    for (size_t i = 0; i < n; ++i) begin[i + 1] += begin[i];
    sort_scratch_.resize(ops.size());
    fill_scratch_.assign(begin.begin(), begin.end() - 1);
    for (const auto& op : ops) sort_scratch_[static_cast<size_t>(fill_scratch_[static_cast<size_t>(op.task)]++)] = op;
    ops.swap(sort_scratch_);
  };
  group(acquires_, acq_begin_);
  group(releases_, rel_begin_);

  const size_t nr = resources_.size(), np = pools_.size(), nm = memories_.size();
  state_.resize(n);
  for (size_t i = 0; i < n; ++i) state_[i] = TaskState{0, 1.0, 0, dep_begin_[i + 1] - dep_begin_[i], 0, 0};
  std::vector<size_t> head(nr, 0);
  std::vector<int> running(nr, 0);
  std::vector<std::vector<TaskId>> active(np);
  std::vector<double> demand_sum(np, 0.0);
  std::vector<int64_t> in_use(prealloc_.begin(), prealloc_.end());
  std::vector<std::vector<int32_t>> mem_waiters(nm);
  std::vector<TaskId> last_release(nm, -1);  // per memory: the task that released it last
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

  heap_.clear();
  auto heap_push = [this](const Event& ev) {
    heap_.push_back(ev);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
  };
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
    for (int k = 0; k < kTaskPools; ++k) {
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
    const double end = state_[i].remaining <= 0 ? now : now + state_[i].remaining / state_[i].speed;
    heap_push(Event{end, seq++, t, ++state_[i].version});
  };
  // Brings every task of a pool up to `now` before its membership changes, then re-rates them.
  auto settle_pool = [&](int32_t p) {
    for (TaskId a : active[static_cast<size_t>(p)]) {
      const auto i = static_cast<size_t>(a);
      TaskState& st = state_[i];
      if (st.speed < 1.0 && now > st.last_update) {
        // Charge the lost time to the pool that set the speed, so reports can name the culprit.
        const TaskSpec& ts = tasks_[i];
        int k_min = 0;
        double best = 2.0;
        for (int k = 0; k < kTaskPools; ++k) {
          if (ts.pool[k] < 0) continue;
          const double sum = demand_sum[static_cast<size_t>(ts.pool[k])];
          const double f = sum > 0 ? pools_[static_cast<size_t>(ts.pool[k])].capacity / sum : 2.0;
          if (f < best) {
            best = f;
            k_min = k;
          }
        }
        times_[i].slowed_s[k_min] += (now - st.last_update) * (1.0 - st.speed);
      }
      st.remaining -= (now - st.last_update) * st.speed;
      if (st.remaining < 0) st.remaining = 0;
      st.last_update = now;
    }
  };
  auto rerate_pool = [&](int32_t p) {
    for (TaskId a : active[static_cast<size_t>(p)]) {
      const auto i = static_cast<size_t>(a);
      const double s = task_speed(a);
      if (s != state_[i].speed) {
        state_[i].speed = s;
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

  // All of a task's acquires of one memory: a task may acquire the same memory more than once.
  auto task_need = [&](TaskId t, int32_t memory) {
    const auto ti = static_cast<size_t>(t);
    int64_t need = 0;
    for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k)
      if (acquires_[static_cast<size_t>(k)].memory == memory) need += acquires_[static_cast<size_t>(k)].amount;
    return need;
  };

  auto try_start = [&](int32_t r) -> Status {
    const auto ri = static_cast<size_t>(r);
    const auto& q = queues_[ri];
    while (head[ri] < q.size()) {
      const TaskId t = q[head[ri]];
      const auto ti = static_cast<size_t>(t);
      if (state_[ti].pending > 0) return {};
      if (running[ri] >= resources_[ri].capacity) return {};
      // Stamped once a slot is free too, so that start - ready is only the wait for memory.
      if (!state_[ti].ready_seen) {
        state_[ti].ready_seen = 1;
        times_[ti].ready = now;
      }
      for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k) {
        const MemOp& op = acquires_[static_cast<size_t>(k)];
        const auto m = static_cast<size_t>(op.memory);
        const int64_t need = task_need(t, op.memory);
        if (need > memories_[m].capacity - prealloc_[m])
          return resource_exhausted(memories_[m].name + ": a task needs " + std::to_string(need) +
                                    " but only " + std::to_string(memories_[m].capacity - prealloc_[m]) +
                                    " can ever be free (capacity " + std::to_string(memories_[m].capacity) + ")");
        if (in_use[m] + need > memories_[m].capacity) {
          auto& w = mem_waiters[m];
          if (std::find(w.begin(), w.end(), r) == w.end()) w.push_back(r);
          return {};
        }
      }
      for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k) {
        const MemOp& op = acquires_[static_cast<size_t>(k)];
        in_use[static_cast<size_t>(op.memory)] += op.amount;
        record_memory(static_cast<size_t>(op.memory));
        // It waited for memory: the release that came last freed it.
        if (now > times_[ti].ready) {
          const TaskId by = last_release[static_cast<size_t>(op.memory)];
          if (by >= 0 && (times_[ti].memory_binding < 0 || times_[static_cast<size_t>(by)].end >=
                                                               times_[static_cast<size_t>(times_[ti].memory_binding)].end))
            times_[ti].memory_binding = by;
        }
      }
      ++head[ri];
      ++running[ri];
      times_[ti].start = now;
      state_[ti].remaining = tasks_[ti].work_s;
      state_[ti].last_update = now;
      const TaskSpec& ts = tasks_[ti];
      bool pooled = false;
      for (int k = 0; k < kTaskPools; ++k) {
        if (ts.pool[k] < 0) continue;
        settle_pool(ts.pool[k]);
        active[static_cast<size_t>(ts.pool[k])].push_back(t);
        demand_sum[static_cast<size_t>(ts.pool[k])] += ts.demand[k];
        pooled = true;
      }
      if (pooled) {
        state_[ti].speed = task_speed(t);
        schedule_end(t);
        for (int k = 0; k < kTaskPools; ++k)
          if (ts.pool[k] >= 0) rerate_pool(ts.pool[k]);
      } else {
        state_[ti].speed = 1.0;
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
    if (heap_.empty()) break;
    std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
    const Event ev = heap_.back();
    heap_.pop_back();
    const auto ti = static_cast<size_t>(ev.task);
    if (ev.version != state_[ti].version) continue;
    now = ev.time;
    TaskTimes& tt = times_[ti];
    tt.end = now;
    ++done;
    const TaskSpec& ts = tasks_[ti];
    --running[static_cast<size_t>(ts.resource)];
    mark(ts.resource);
    for (int k = 0; k < kTaskPools; ++k) {
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
      last_release[m] = ev.task;
      for (int32_t w : mem_waiters[m]) mark(w);
      mem_waiters[m].clear();
    }
    for (int32_t k = succ_begin_[ti]; k < succ_begin_[ti + 1]; ++k) {
      const auto s = static_cast<size_t>(succs_[static_cast<size_t>(k)]);
      if (--state_[s].pending == 0) {
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
    if (state_[ti].pending > 0) {
      why = std::to_string(state_[ti].pending) + " dependencies that never end (a cycle, or a task queued behind it)";
    } else {
      for (int32_t k = acq_begin_[ti]; k < acq_begin_[ti + 1]; ++k) {
        const MemOp& op = acquires_[static_cast<size_t>(k)];
        const auto m = static_cast<size_t>(op.memory);
        const int64_t need = task_need(t, op.memory);
        if (in_use[m] + need > memories_[m].capacity)
          why = memories_[m].name + " (" + std::to_string(need) + " needed, " +
                std::to_string(memories_[m].capacity - in_use[m]) + " free, and nothing left to release it)";
      }
    }
    return resource_exhausted("the schedule deadlocks: task " + std::to_string(t) + " on " + resources_[r].name +
                              " waits for " + why);
  }
  return internal_error("simulation ended with " + std::to_string(n - done) + " tasks not run");
}

}  // namespace megatrain::sim

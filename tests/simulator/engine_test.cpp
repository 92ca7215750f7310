// The discrete-event engine on synthetic graphs: hand-computed schedules (chains, in-order queues,
// memory waits, fluid bandwidth sharing, a buffered pipeline) and invariants on random DAGs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "megatrain/simulator/engine.h"

namespace megatrain::sim {
namespace {

// Exact binary fractions are used for durations wherever possible; this absorbs the rounding of
// the fluid pools, which divide by demand sums such as 3.
constexpr double kEps = 1e-12;

TaskSpec on(int32_t resource, double work_s) {
  TaskSpec t;
  t.resource = resource;
  t.work_s = work_s;
  return t;
}

TaskSpec pooled(int32_t resource, double work_s, int32_t pool, double demand) {
  TaskSpec t = on(resource, work_s);
  t.pool[0] = pool;
  t.demand[0] = demand;
  return t;
}

// ---- chains and queues -------------------------------------------------------------------------

TEST(Engine, DependentChainAcrossResourcesTakesTheSumOfDurations) {
  Engine e;
  const int32_t gpu = e.add_resource({"GPU compute", "gpu", 1});
  const int32_t h2d = e.add_resource({"H2D", "h2d", 1});
  const int32_t cpu = e.add_resource({"CPU", "cpu", 1});
  const std::vector<std::pair<int32_t, double>> chain = {{h2d, 1.5}, {gpu, 0.25}, {cpu, 2.0}, {h2d, 0.75}, {gpu, 3.0}};
  TaskId prev = -1;
  std::vector<TaskId> ids;
  for (auto [r, w] : chain) {
    const TaskId t = e.add_task(on(r, w));
    e.add_dependency(prev, t);  // -1 is ignored for the first
    ids.push_back(t);
    prev = t;
  }
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.makespan(), 1.5 + 0.25 + 2.0 + 0.75 + 3.0);
  double t = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_DOUBLE_EQ(e.times(ids[i]).start, t) << "task " << i;
    t += chain[i].second;
    EXPECT_DOUBLE_EQ(e.times(ids[i]).end, t) << "task " << i;
    if (i > 0) {
      EXPECT_EQ(e.times(ids[i]).binding, ids[i - 1]);
    }
  }
}

TEST(Engine, TaskBehindABlockedHeadWaitsInOrder) {
  Engine e;
  const int32_t r = e.add_resource({"H2D", "h2d", 1});
  const int32_t other = e.add_resource({"GPU compute", "gpu", 1});
  const TaskId slow = e.add_task(on(other, 5.0));
  const TaskId head = e.add_task(on(r, 2.0));  // waits for `slow`
  const TaskId behind = e.add_task(on(r, 1.0));  // ready at 0, but queued behind `head`
  e.add_dependency(slow, head);
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(head).start, 5.0);
  EXPECT_DOUBLE_EQ(e.times(behind).start, 7.0);
  EXPECT_DOUBLE_EQ(e.makespan(), 8.0);
}

TEST(Engine, CapacityTwoRunsTwoTasksAtOnce) {
  Engine e;
  const int32_t r = e.add_resource({"CPU optimizer", "cpu", 2});
  const TaskId a = e.add_task(on(r, 1.0));
  const TaskId b = e.add_task(on(r, 1.0));
  const TaskId c = e.add_task(on(r, 1.0));
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(a).start, 0.0);
  EXPECT_DOUBLE_EQ(e.times(b).start, 0.0);
  EXPECT_DOUBLE_EQ(e.times(c).start, 1.0);
  EXPECT_DOUBLE_EQ(e.makespan(), 2.0);
}

TEST(Engine, CapacityTwoStillServesInOrder) {
  // A free slot does not let a ready task overtake a head that waits for a dependency.
  Engine e;
  const int32_t r = e.add_resource({"CPU optimizer", "cpu", 2});
  const int32_t other = e.add_resource({"GPU compute", "gpu", 1});
  const TaskId gate = e.add_task(on(other, 3.0));
  const TaskId a = e.add_task(on(r, 1.0));
  const TaskId b = e.add_task(on(r, 1.0));
  const TaskId c = e.add_task(on(r, 0.5));
  e.add_dependency(gate, b);
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(a).start, 0.0);
  EXPECT_DOUBLE_EQ(e.times(b).start, 3.0);
  EXPECT_DOUBLE_EQ(e.times(c).start, 3.0);  // beside b: capacity 2
  EXPECT_DOUBLE_EQ(e.makespan(), 4.0);
}

// Regression: `ready` was stamped when a task reached the head of a full queue, so the wait for
// the task in front of it counted as a wait for memory (the step model's "buffer" stalls).
TEST(Engine, ReadyExcludesTheWaitForAFreeSlotButIncludesTheWaitForMemory) {
  Engine e;
  const int32_t r = e.add_resource({"H2D", "h2d", 1});
  const int32_t g = e.add_resource({"GPU compute", "gpu", 1});
  const int32_t mem = e.add_memory({"device", 100, true});
  const TaskId first = e.add_task(on(r, 2.0));
  const TaskId second = e.add_task(on(r, 1.0));
  const TaskId holder = e.add_task(on(g, 4.0));
  e.acquire(holder, mem, 80);
  e.release(holder, mem, 80);
  const TaskId waiter = e.add_task(on(g, 1.0));
  e.acquire(waiter, mem, 50);
  e.release(waiter, mem, 50);
  const TaskId blocked = e.add_task(on(r, 1.0));  // after `second` on H2D, needs memory too
  e.acquire(blocked, mem, 30);
  e.release(blocked, mem, 30);
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(first).ready, 0.0);
  EXPECT_DOUBLE_EQ(e.times(second).ready, 2.0);
  EXPECT_DOUBLE_EQ(e.times(second).start, 2.0);
  // `blocked` gets its slot at 3 but 80 + 30 > 100 until `holder` ends at 4.
  EXPECT_DOUBLE_EQ(e.times(blocked).ready, 3.0);
  EXPECT_DOUBLE_EQ(e.times(blocked).start, 4.0);
  EXPECT_DOUBLE_EQ(e.times(waiter).start, 4.0);
}

// ---- memory ------------------------------------------------------------------------------------

TEST(Engine, MemoryWaitsForAnEarlierRelease) {
  Engine e;
  const int32_t r0 = e.add_resource({"r0", "gpu", 1});
  const int32_t r1 = e.add_resource({"r1", "h2d", 1});
  const int32_t r2 = e.add_resource({"r2", "d2h", 1});
  const int32_t r3 = e.add_resource({"r3", "cpu", 1});
  const int32_t r4 = e.add_resource({"r4", "nvme_read", 1});
  const int32_t mem = e.add_memory({"device", 100, true});
  // a holds 70 from 0 until b ends at 3. From 0.25 on, d (30, until 0.75) fits beside it and c
  // (40) does not: c waits for b. (The delay keeps a ahead of c and d whatever order the engine
  // visits simultaneous queues in.)
  const TaskId a = e.add_task(on(r0, 2.0));
  const TaskId b = e.add_task(on(r1, 1.0));
  const TaskId delay = e.add_task(on(r4, 0.25));
  const TaskId c = e.add_task(on(r2, 1.0));
  const TaskId d = e.add_task(on(r3, 0.5));
  e.add_dependency(a, b);
  e.add_dependency(delay, c);
  e.add_dependency(delay, d);
  e.acquire(a, mem, 70);
  e.release(b, mem, 70);
  e.acquire(c, mem, 40);
  e.release(c, mem, 40);
  e.acquire(d, mem, 30);
  e.release(d, mem, 30);
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(d).start, 0.25);
  EXPECT_DOUBLE_EQ(e.times(c).ready, 0.25);
  EXPECT_DOUBLE_EQ(e.times(c).start, 3.0);
  EXPECT_EQ(e.times(c).binding, delay);
  // c waited for memory, and b's release at 3 let it start (d's at 0.75 did not); the others did not wait.
  EXPECT_EQ(e.times(c).memory_binding, b);
  EXPECT_EQ(e.times(d).memory_binding, -1);
  EXPECT_EQ(e.times(a).memory_binding, -1);
  EXPECT_DOUBLE_EQ(e.makespan(), 4.0);
  EXPECT_EQ(e.memory_peak(mem), 70 + 30);
  const std::vector<std::pair<double, int64_t>> want = {{0.0, 70}, {0.25, 100}, {0.75, 70}, {3.0, 40}, {4.0, 0}};
  EXPECT_EQ(e.memory_timeline(mem), want);
}

TEST(Engine, PreallocatedBytesCountTowardsThePeak) {
  Engine e;
  const int32_t r = e.add_resource({"r", "gpu", 1});
  const int32_t mem = e.add_memory({"device", 1000, true});
  e.preallocate(mem, 600);
  const TaskId a = e.add_task(on(r, 1.0));
  e.acquire(a, mem, 250);
  e.release(a, mem, 250);
  ASSERT_TRUE(e.run().ok());
  EXPECT_EQ(e.memory_peak(mem), 850);
  EXPECT_EQ(e.memory_timeline(mem).front(), (std::pair<double, int64_t>{0.0, 850}));
  EXPECT_EQ(e.memory_timeline(mem).back(), (std::pair<double, int64_t>{1.0, 600}));
}

// Regression: each acquire of a task was checked against the capacity on its own, so a task
// acquiring the same memory twice (the step model's head: logits and gradient accumulators)
// could push the bytes in use over the capacity.
TEST(Engine, TwoAcquiresOfOneTaskFitTogetherOrWait) {
  Engine e;
  const int32_t r0 = e.add_resource({"r0", "gpu", 1});
  const int32_t r1 = e.add_resource({"r1", "h2d", 1});
  const int32_t r2 = e.add_resource({"r2", "cpu", 1});
  const int32_t mem = e.add_memory({"device", 100, true});
  const TaskId holder = e.add_task(on(r0, 1.0));  // 50 over [0, 1]
  e.acquire(holder, mem, 50);
  e.release(holder, mem, 50);
  const TaskId delay = e.add_task(on(r2, 0.5));
  const TaskId both = e.add_task(on(r1, 1.0));    // ready at 0.5: 50 + 30 + 30 > 100
  e.add_dependency(delay, both);
  e.acquire(both, mem, 30);
  e.acquire(both, mem, 30);
  e.release(both, mem, 60);
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(both).ready, 0.5);
  EXPECT_DOUBLE_EQ(e.times(both).start, 1.0);
  EXPECT_EQ(e.memory_peak(mem), 60);
}

TEST(Engine, TaskLargerThanTheMemoryIsResourceExhausted) {
  {
    Engine e;
    const int32_t r = e.add_resource({"r", "gpu", 1});
    const int32_t mem = e.add_memory({"device", 100, true});
    const TaskId a = e.add_task(on(r, 1.0));
    e.acquire(a, mem, 101);
    e.release(a, mem, 101);
    const Status s = e.run();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_NE(s.message().find("device"), std::string::npos) << s.message();
  }
  {  // what is preallocated can never be freed
    Engine e;
    const int32_t r = e.add_resource({"r", "gpu", 1});
    const int32_t mem = e.add_memory({"pinned", 100, true});
    e.preallocate(mem, 80);
    const TaskId a = e.add_task(on(r, 1.0));
    e.acquire(a, mem, 30);
    e.release(a, mem, 30);
    const Status s = e.run();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_NE(s.message().find("pinned"), std::string::npos) << s.message();
  }
  {  // two acquires of one task that only fit apart
    Engine e;
    const int32_t r = e.add_resource({"r", "gpu", 1});
    const int32_t mem = e.add_memory({"device", 100, true});
    const TaskId a = e.add_task(on(r, 1.0));
    e.acquire(a, mem, 60);
    e.acquire(a, mem, 60);
    e.release(a, mem, 120);
    const Status s = e.run();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  }
  {  // preallocation alone over the capacity
    Engine e;
    e.add_resource({"r", "gpu", 1});
    const int32_t mem = e.add_memory({"ram", 100, true});
    e.preallocate(mem, 150);
    const Status s = e.run();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
    EXPECT_NE(s.message().find("ram"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("by 50"), std::string::npos) << s.message();
  }
}

TEST(Engine, ReleaseThatWaitsForTheWaiterIsADeadlockNamingTheMemory) {
  Engine e;
  const int32_t r0 = e.add_resource({"H2D", "h2d", 1});
  const int32_t r1 = e.add_resource({"GPU compute", "gpu", 1});
  const int32_t r2 = e.add_resource({"CPU", "cpu", 1});
  const int32_t slots = e.add_memory({"device layer buffers", 1, false});
  const TaskId taker = e.add_task(on(r1, 1.0));      // takes the only slot at 0
  const TaskId delay = e.add_task(on(r2, 0.5));
  const TaskId waiter = e.add_task(on(r0, 1.0));     // wants the slot from 0.5 on
  const TaskId releaser = e.add_task(on(r1, 1.0));   // would free it, but needs the waiter
  e.add_dependency(delay, waiter);
  e.add_dependency(waiter, releaser);
  e.acquire(taker, slots, 1);
  e.release(releaser, slots, 1);
  e.acquire(waiter, slots, 1);
  e.release(waiter, slots, 1);
  const Status s = e.run();
  ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  EXPECT_NE(s.message().find("deadlock"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("device layer buffers"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("H2D"), std::string::npos) << s.message();
}

TEST(Engine, DependencyOnALaterTaskOfTheSameQueueIsReported) {
  Engine e;
  const int32_t r = e.add_resource({"GPU compute", "gpu", 1});
  const TaskId a = e.add_task(on(r, 1.0));
  const TaskId b = e.add_task(on(r, 1.0));
  e.add_dependency(b, a);  // a is at the head and waits for b, which is behind it
  const Status s = e.run();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  EXPECT_NE(s.message().find("GPU compute"), std::string::npos) << s.message();
}

// ---- bandwidth pools ---------------------------------------------------------------------------

TEST(Engine, TwoTasksDemandingThePoolRunAtHalfSpeedALoneOneAtFullSpeed) {
  Engine e;
  const int32_t r0 = e.add_resource({"H2D", "h2d", 1});
  const int32_t r1 = e.add_resource({"D2H", "d2h", 1});
  const int32_t host = e.add_pool({"host memory", 10.0});
  const TaskId x = e.add_task(pooled(r0, 1.0, host, 10.0));
  const TaskId y = e.add_task(pooled(r1, 1.0, host, 10.0));
  const TaskId z = e.add_task(pooled(r0, 1.0, host, 10.0));
  e.add_dependency(y, z);
  ASSERT_TRUE(e.run().ok());
  EXPECT_NEAR(e.times(x).end, 2.0, kEps);
  EXPECT_NEAR(e.times(y).end, 2.0, kEps);
  EXPECT_NEAR(e.times(z).start, 2.0, kEps);
  EXPECT_NEAR(e.times(z).end, 3.0, kEps);
}

TEST(Engine, DemandsWithinThePoolDoNotSlowDown) {
  Engine e;
  const int32_t r0 = e.add_resource({"H2D", "h2d", 1});
  const int32_t r1 = e.add_resource({"D2H", "d2h", 1});
  const int32_t host = e.add_pool({"host memory", 10.0});
  const TaskId x = e.add_task(pooled(r0, 1.0, host, 4.0));
  const TaskId y = e.add_task(pooled(r1, 1.0, host, 6.0));
  ASSERT_TRUE(e.run().ok());
  EXPECT_DOUBLE_EQ(e.times(x).end, 1.0);
  EXPECT_DOUBLE_EQ(e.times(y).end, 1.0);
}

TEST(Engine, UnequalDemandsSlowDownByTheSameFactor) {
  // Demands 3 + 1 on a pool of 2: both run at half speed until x ends at 2 (1 s of work); y has
  // then done 1 of its 2 s and finishes alone at full speed.
  Engine e;
  const int32_t r0 = e.add_resource({"r0", "h2d", 1});
  const int32_t r1 = e.add_resource({"r1", "cpu", 1});
  const int32_t p = e.add_pool({"host memory", 2.0});
  const TaskId x = e.add_task(pooled(r0, 1.0, p, 3.0));
  const TaskId y = e.add_task(pooled(r1, 2.0, p, 1.0));
  ASSERT_TRUE(e.run().ok());
  EXPECT_NEAR(e.times(x).end, 2.0, kEps);
  EXPECT_NEAR(e.times(y).end, 3.0, kEps);
}

TEST(Engine, ThreeWaySharingWithStaggeredStarts) {
  // Pool of capacity 1, three tasks of 1 s at full demand starting at 0, 0.5 and 0.75:
  //   [0, 0.5)      x alone:      x has 0.5 left
  //   [0.5, 0.75)   x, y at 1/2:  x 0.375, y 0.875
  //   [0.75, 1.875) all at 1/3:   x ends after 0.375 * 3 = 1.125 s; y 0.5, z 0.625 left
  //   [1.875, 2.875) y, z at 1/2: y ends; z has 0.125 left
  //   [2.875, 3.0)  z alone.
  // The pool is never idle and holds 3 s of work, so the last end is 3.
  Engine e;
  const int32_t rx = e.add_resource({"rx", "h2d", 1});
  const int32_t ry = e.add_resource({"ry", "d2h", 1});
  const int32_t rz = e.add_resource({"rz", "cpu", 1});
  const int32_t rd = e.add_resource({"delays", "gpu", 2});
  const int32_t p = e.add_pool({"host memory", 1.0});
  const TaskId x = e.add_task(pooled(rx, 1.0, p, 1.0));
  const TaskId dy = e.add_task(on(rd, 0.5));
  const TaskId dz = e.add_task(on(rd, 0.75));
  const TaskId y = e.add_task(pooled(ry, 1.0, p, 1.0));
  const TaskId z = e.add_task(pooled(rz, 1.0, p, 1.0));
  e.add_dependency(dy, y);
  e.add_dependency(dz, z);
  ASSERT_TRUE(e.run().ok());
  EXPECT_NEAR(e.times(y).start, 0.5, kEps);
  EXPECT_NEAR(e.times(z).start, 0.75, kEps);
  EXPECT_NEAR(e.times(x).end, 1.875, 1e-9);
  EXPECT_NEAR(e.times(y).end, 2.875, 1e-9);
  EXPECT_NEAR(e.times(z).end, 3.0, 1e-9);
  EXPECT_NEAR(e.makespan(), 3.0, 1e-9);
}

TEST(Engine, TaskOnTwoPoolsRunsAtTheSlowerPoolsRate) {
  // x uses P and Q; w demands 3 of P (capacity 1, factor 1/4); y demands 1 of Q (factor 1/2).
  // x runs at 1/4, y at 1/2 (y ends at 2); then Q is x's alone but P still gives 1/4, so x and
  // w (0.5 s of work left each) end at 4. P carried 1 + 3 units at capacity 1: 4 s.
  Engine e;
  const int32_t r0 = e.add_resource({"r0", "h2d", 1});
  const int32_t r1 = e.add_resource({"r1", "d2h", 1});
  const int32_t r2 = e.add_resource({"r2", "cpu", 1});
  const int32_t P = e.add_pool({"P", 1.0});
  const int32_t Q = e.add_pool({"Q", 1.0});
  TaskSpec xs = on(r0, 1.0);
  xs.pool[0] = P;
  xs.demand[0] = 1.0;
  xs.pool[1] = Q;
  xs.demand[1] = 1.0;
  const TaskId x = e.add_task(xs);
  const TaskId w = e.add_task(pooled(r1, 1.0, P, 3.0));
  const TaskId y = e.add_task(pooled(r2, 1.0, Q, 1.0));
  ASSERT_TRUE(e.run().ok());
  EXPECT_NEAR(e.times(y).end, 2.0, 1e-9);
  EXPECT_NEAR(e.times(x).end, 4.0, 1e-9);
  EXPECT_NEAR(e.times(w).end, 4.0, 1e-9);
}

// Lost time is charged to the pool that set the speed: x ran 4 s for 1 s of work, limited by P
// the whole time (3 s lost to pool[0], none to Q); y lost 1 s to Q.
TEST(Engine, TimeLostToSharingIsChargedToTheLimitingPool) {
  Engine e;
  const int32_t r0 = e.add_resource({"r0", "h2d", 1});
  const int32_t r1 = e.add_resource({"r1", "d2h", 1});
  const int32_t r2 = e.add_resource({"r2", "cpu", 1});
  const int32_t P = e.add_pool({"P", 1.0});
  const int32_t Q = e.add_pool({"Q", 1.0});
  TaskSpec xs = on(r0, 1.0);
  xs.pool[0] = P;
  xs.demand[0] = 1.0;
  xs.pool[1] = Q;
  xs.demand[1] = 1.0;
  const TaskId x = e.add_task(xs);
  e.add_task(pooled(r1, 1.0, P, 3.0));
  const TaskId y = e.add_task(pooled(r2, 1.0, Q, 1.0));
  ASSERT_TRUE(e.run().ok());
  EXPECT_NEAR(e.times(x).slowed_s[0], 3.0, 1e-9);
  EXPECT_NEAR(e.times(x).slowed_s[1], 0.0, 1e-9);
  EXPECT_NEAR(e.times(y).slowed_s[0], 1.0, 1e-9);
}

// ---- a buffered pipeline -----------------------------------------------------------------------

// N transfers of a seconds feeding N computes of b seconds through K buffer slots: a slot is
// taken when a transfer starts and given back when its compute ends.
double pipeline_makespan(int n, double a, double b, int k, int64_t* slot_peak = nullptr) {
  Engine e;
  const int32_t h2d = e.add_resource({"H2D", "h2d", 1});
  const int32_t gpu = e.add_resource({"GPU compute", "gpu", 1});
  const int32_t slots = e.add_memory({"device layer buffers", k, false});
  for (int i = 0; i < n; ++i) {
    const TaskId t = e.add_task(on(h2d, a));
    const TaskId c = e.add_task(on(gpu, b));
    e.add_dependency(t, c);
    e.acquire(t, slots, 1);
    e.release(c, slots, 1);
  }
  EXPECT_TRUE(e.run().ok());
  if (slot_peak) *slot_peak = e.memory_peak(slots);
  return e.makespan();
}

TEST(Engine, PipelineWithOneSlotIsSerial) {
  const int n = 8;
  EXPECT_DOUBLE_EQ(pipeline_makespan(n, 3.0, 2.0, 1), n * (3.0 + 2.0));
  EXPECT_DOUBLE_EQ(pipeline_makespan(n, 2.0, 3.0, 1), n * (2.0 + 3.0));
}

TEST(Engine, PipelineWithTwoOrMoreSlotsIsBoundByTheSlowerStage) {
  const int n = 8;
  for (int k : {2, 3, 5}) {
    int64_t peak = 0;
    // transfer-bound: the link never idles and the last compute follows the last transfer
    EXPECT_DOUBLE_EQ(pipeline_makespan(n, 3.0, 2.0, k, &peak), n * 3.0 + 2.0) << "K=" << k;
    EXPECT_LE(peak, k);
    // compute-bound: one transfer fills the pipe, then the GPU never idles
    EXPECT_DOUBLE_EQ(pipeline_makespan(n, 2.0, 3.0, k, &peak), 2.0 + n * 3.0) << "K=" << k;
    EXPECT_LE(peak, k);
  }
  int64_t peak = 0;
  pipeline_makespan(n, 2.0, 3.0, 3, &peak);
  EXPECT_EQ(peak, 3);  // compute-bound with 3 slots: two prefetched while one computes
}

// ---- properties on random DAGs -----------------------------------------------------------------

struct Hold {
  int32_t memory;
  TaskId acquirer, releaser;
  int64_t amount;
};

// A graph as data, so that one task can be changed and the graph rebuilt.
struct Graph {
  std::vector<int> capacities;
  std::vector<TaskSpec> tasks;
  std::vector<std::pair<TaskId, TaskId>> deps;
  std::vector<int64_t> memory_capacity;
  std::vector<Hold> holds;
  bool with_pool = false;

  void build(Engine& e) const {
    for (size_t r = 0; r < capacities.size(); ++r)
      e.add_resource({"r" + std::to_string(r), "cpu", capacities[r]});
    if (with_pool) e.add_pool({"host memory", 1.0});
    for (size_t m = 0; m < memory_capacity.size(); ++m) e.add_memory({"m" + std::to_string(m), memory_capacity[m], true});
    for (const auto& t : tasks) e.add_task(t);
    for (auto [a, b] : deps) e.add_dependency(a, b);
    for (const auto& h : holds) {
      e.acquire(h.acquirer, h.memory, h.amount);
      e.release(h.releaser, h.memory, h.amount);
    }
  }
};

// Memory that cannot deadlock: every acquirer of memory m runs on resource m, and no acquirer of
// m lies strictly after another hold's acquirer and at or before its releaser (by id). Then the
// lowest unfinished task always finds its memory free (every earlier hold on its queue has been
// released), so the graph always completes; a hold can still make a later task wait.
Graph random_graph(uint32_t seed, bool with_pool) {
  std::mt19937 rng(seed);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Graph g;
  g.with_pool = with_pool;
  const int nr = pick(3, 4);
  for (int r = 0; r < nr; ++r) g.capacities.push_back(pick(1, 2));
  const int n = pick(50, 300);
  for (int i = 0; i < n; ++i) {
    TaskSpec t;
    t.resource = pick(0, nr - 1);
    t.work_s = pick(0, 9) == 0 ? 0.0 : uniform(0.01, 2.0);
    if (with_pool && pick(0, 2) == 0) {
      t.pool[0] = 0;
      t.demand[0] = uniform(0.2, 1.5);
    }
    g.tasks.push_back(t);
    const int ndeps = i == 0 ? 0 : pick(0, 3);
    for (int k = 0; k < ndeps; ++k) g.deps.push_back({pick(std::max(0, i - 20), i - 1), i});
  }
  const int nm = 2;
  std::vector<int64_t> largest(nm, 0);
  std::vector<int> free_after(nm, -1);  // the next acquirer of m must have a larger id
  for (int i = 0; i < n; ++i) {
    const int m = g.tasks[static_cast<size_t>(i)].resource;
    if (m >= nm || i <= free_after[static_cast<size_t>(m)] || pick(0, 9) >= 4) continue;
    const int64_t amount = pick(1, 5);
    int j = i;
    if (pick(0, 1) == 1) j = std::min(n - 1, i + pick(1, 10));
    if (j != i) g.deps.push_back({i, j});  // the release must follow the acquire
    g.holds.push_back({m, i, j, amount});
    free_after[static_cast<size_t>(m)] = j;
    largest[static_cast<size_t>(m)] = std::max(largest[static_cast<size_t>(m)], amount);
  }
  for (int m = 0; m < nm; ++m) g.memory_capacity.push_back(largest[static_cast<size_t>(m)] + pick(0, 4));
  return g;
}

// Largest number of tasks (or bytes) running at once, ends before starts at equal times so
// that touching intervals do not count as overlapping.
template <typename Weight>
double sweep_max(const std::vector<std::pair<double, double>>& intervals, Weight weight) {
  std::vector<std::pair<double, double>> ev;  // (time, +w / -w)
  for (size_t i = 0; i < intervals.size(); ++i) {
    if (intervals[i].second <= intervals[i].first) continue;
    ev.push_back({intervals[i].first, weight(i)});
    ev.push_back({intervals[i].second, -weight(i)});
  }
  std::sort(ev.begin(), ev.end());  // at equal times the negative (end) sorts first
  double cur = 0, best = 0;
  for (auto [t, w] : ev) {
    cur += w;
    best = std::max(best, cur);
  }
  return best;
}

void check_invariants(const Graph& g, const Engine& e, uint32_t seed) {
  const size_t n = g.tasks.size();
  double last_end = 0;
  std::vector<double> work_on(g.capacities.size(), 0.0);
  for (size_t i = 0; i < n; ++i) {
    const TaskTimes& t = e.times(static_cast<TaskId>(i));
    EXPECT_GE(t.end - t.start, g.tasks[i].work_s - 1e-9) << "seed " << seed << " task " << i;
    EXPECT_LE(t.ready, t.start) << "seed " << seed << " task " << i;
    last_end = std::max(last_end, t.end);
    work_on[static_cast<size_t>(g.tasks[i].resource)] += g.tasks[i].work_s;
  }
  EXPECT_DOUBLE_EQ(e.makespan(), last_end) << "seed " << seed;
  for (auto [a, b] : g.deps)
    EXPECT_GE(e.times(b).start, e.times(a).end - 1e-9) << "seed " << seed << " edge " << a << "->" << b;
  for (size_t r = 0; r < g.capacities.size(); ++r) {
    const auto& q = e.queue(static_cast<int32_t>(r));
    std::vector<std::pair<double, double>> spans;
    for (size_t k = 0; k < q.size(); ++k) {
      spans.push_back({e.times(q[k]).start, e.times(q[k]).end});
      if (k > 0) {
        EXPECT_GE(e.times(q[k]).start, e.times(q[k - 1]).start) << "seed " << seed << ": out of order";
      }
    }
    EXPECT_LE(sweep_max(spans, [](size_t) { return 1.0; }), g.capacities[r]) << "seed " << seed << " resource " << r;
    EXPECT_GE(e.makespan(), work_on[r] / g.capacities[r] - 1e-9) << "seed " << seed << " resource " << r;
  }
  for (size_t m = 0; m < g.memory_capacity.size(); ++m) {
    const auto& tl = e.memory_timeline(static_cast<int32_t>(m));
    int64_t tl_max = 0;
    for (size_t k = 0; k < tl.size(); ++k) {
      EXPECT_GE(tl[k].second, 0) << "seed " << seed << " memory " << m;
      EXPECT_LE(tl[k].second, g.memory_capacity[m]) << "seed " << seed << " memory " << m;
      if (k > 0) {
        EXPECT_GE(tl[k].first, tl[k - 1].first);
      }
      tl_max = std::max(tl_max, tl[k].second);
    }
    EXPECT_EQ(tl.back().second, 0) << "seed " << seed << ": every hold is released";
    EXPECT_GE(e.memory_peak(static_cast<int32_t>(m)), tl_max) << "seed " << seed;
    EXPECT_LE(e.memory_peak(static_cast<int32_t>(m)), g.memory_capacity[m]) << "seed " << seed;
    // Recomputed from the task times: held from the acquirer's start to the releaser's end.
    std::vector<std::pair<double, double>> spans;
    std::vector<double> amounts;
    for (const auto& h : g.holds) {
      if (static_cast<size_t>(h.memory) != m) continue;
      spans.push_back({e.times(h.acquirer).start, e.times(h.releaser).end});
      amounts.push_back(static_cast<double>(h.amount));
    }
    const double held = sweep_max(spans, [&](size_t i) { return amounts[i]; });
    EXPECT_LE(held, static_cast<double>(g.memory_capacity[m])) << "seed " << seed << " memory " << m;
    EXPECT_LE(held, static_cast<double>(tl_max)) << "seed " << seed << " memory " << m;
  }
}

TEST(EngineProperties, RandomGraphsKeepEveryInvariant) {
  int blocked = 0;
  for (uint32_t seed = 1; seed <= 50; ++seed) {
    const Graph g = random_graph(seed, seed % 2 == 0);
    Engine e;
    g.build(e);
    const Status s = e.run();
    ASSERT_TRUE(s.ok()) << "seed " << seed << ": " << s.to_string();
    check_invariants(g, e, seed);
    for (const auto& h : g.holds)
      if (e.times(h.acquirer).start > e.times(h.acquirer).ready + 1e-12) ++blocked;
  }
  EXPECT_GT(blocked, 0) << "the generator should make some tasks wait for memory";
}

TEST(EngineProperties, ShorteningATaskNeverDelaysAnyTaskWithoutPools) {
  // With fixed queue orders every start time is a max of earlier ends (dependencies, queue
  // slots, memory releases), so it can only move earlier when a duration shrinks.
  for (uint32_t seed = 100; seed < 150; ++seed) {
    const Graph g = random_graph(seed, false);
    Engine base;
    g.build(base);
    ASSERT_TRUE(base.run().ok()) << "seed " << seed;
    std::mt19937 rng(seed * 7919u);
    for (int trial = 0; trial < 5; ++trial) {
      Graph shorter = g;
      const size_t i = std::uniform_int_distribution<size_t>(0, g.tasks.size() - 1)(rng);
      shorter.tasks[i].work_s *= std::uniform_real_distribution<double>(0.0, 0.9)(rng);
      Engine e;
      shorter.build(e);
      ASSERT_TRUE(e.run().ok()) << "seed " << seed;
      EXPECT_LE(e.makespan(), base.makespan() + 1e-9) << "seed " << seed << " task " << i;
      for (size_t t = 0; t < g.tasks.size(); ++t)
        ASSERT_LE(e.times(static_cast<TaskId>(t)).end, base.times(static_cast<TaskId>(t)).end + 1e-9)
            << "seed " << seed << ": shortening task " << i << " delayed task " << t;
    }
  }
}

}  // namespace
}  // namespace megatrain::sim

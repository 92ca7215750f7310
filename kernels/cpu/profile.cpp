// The ops' profile (profile.h): a process-wide pointer, and per thread the depth of timed ops so that
// an op inside another is not counted twice.
#include "megatrain/kernels/cpu/profile.h"

#include <atomic>

namespace megatrain::cpu {
namespace {

std::atomic<OpProfile*> g_profile{nullptr};
thread_local int t_depth = 0;

}  // namespace

void OpProfile::add(const char* op, double seconds, double flops, double bytes) {
  std::lock_guard<std::mutex> g(m_);
  OpTally& t = ops_[op];
  ++t.calls;
  t.seconds += seconds;
  t.flops += flops;
  t.bytes += bytes;
}

std::map<std::string, OpTally> OpProfile::tallies() const {
  std::lock_guard<std::mutex> g(m_);
  return ops_;
}

void OpProfile::clear() {
  std::lock_guard<std::mutex> g(m_);
  ops_.clear();
}

void attach_op_profile(OpProfile* p) { g_profile.store(p, std::memory_order_release); }
OpProfile* attached_op_profile() { return g_profile.load(std::memory_order_acquire); }

ProfiledOp::ProfiledOp(const char* op, double flops, double bytes) : op_(op), flops_(flops), bytes_(bytes) {
  OpProfile* p = g_profile.load(std::memory_order_relaxed);
  if (p == nullptr) return;
  entered_ = true;
  if (t_depth++ > 0) return;  // inside another op: counted as part of it
  profile_ = p;
  start_ = std::chrono::steady_clock::now();
}

ProfiledOp::~ProfiledOp() {
  if (!entered_) return;
  --t_depth;
  if (profile_ != nullptr)
    profile_->add(op_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(), flops_, bytes_);
}

}  // namespace megatrain::cpu

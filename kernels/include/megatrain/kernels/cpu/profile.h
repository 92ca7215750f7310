// Where the CPU ops' time goes (issue 21's breakdown; `megatrain-bench-exec ops`).
//
// While an OpProfile is attached (process-wide; training never attaches one), every op entry point
// of megatrain::cpu adds to it, under the op's name, its wall time on the calling thread (the op's
// worker threads have joined when it returns), the FLOPs it does and the bytes it must at least
// read and write, so that a benchmark can set each op against its own roofline. An op called from
// inside another op counts as part of the outer one. Detached, an op pays one relaxed atomic load.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace megatrain::cpu {

struct OpTally {
  int64_t calls = 0;
  double seconds = 0;
  double flops = 0;
  double bytes = 0;
};

class OpProfile {
 public:
  void add(const char* op, double seconds, double flops, double bytes);
  std::map<std::string, OpTally> tallies() const;
  void clear();

 private:
  mutable std::mutex m_;
  std::map<std::string, OpTally> ops_;
};

// Attaches p (null detaches). The caller keeps p alive while it is attached.
void attach_op_profile(OpProfile* p);
OpProfile* attached_op_profile();

// One op's entry: times the op when a profile is attached and no outer op is being timed.
class ProfiledOp {
 public:
  ProfiledOp(const char* op, double flops, double bytes);
  ~ProfiledOp();
  ProfiledOp(const ProfiledOp&) = delete;
  ProfiledOp& operator=(const ProfiledOp&) = delete;

 private:
  OpProfile* profile_ = nullptr;  // set when this op is the one timed
  bool entered_ = false;          // a profile was attached when the op began
  const char* op_;
  double flops_, bytes_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace megatrain::cpu

// Moment storage formats and the dispatch of the fused AdamW pass (moments.h).
#include "megatrain/executor/moments.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/kernels/cpu/context.h"

namespace megatrain::exec {

// The three copies of the fused pass (adamw_kernel.h, one per instruction set).
#define MT_DECLARE_ADAMW(ns)                                                                                          \
  namespace ns {                                                                                                      \
  void adamw_run(const StepConsts& k, float* w, const float* g, const MomentRef& m, const MomentRef& v, int64_t begin, \
                 int64_t end, int64_t block, float* stream_f32, uint16_t* stream_bf16, float* fm, float* fv,           \
                 int32_t* ci);                                                                                        \
  void moment_decode(const MomentRef& r, bool second, int64_t n, float* out, int32_t* ci);                            \
  void moment_encode(const MomentRef& r, bool second, int64_t n, const float* in, int32_t* ci);                       \
  }
MT_DECLARE_ADAMW(adamw_scalar)
MT_DECLARE_ADAMW(adamw_avx2)
MT_DECLARE_ADAMW(adamw_avx512)
#undef MT_DECLARE_ADAMW

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

// The AdamW pass uses at most the instruction set the CPU kernels it is linked with were built for
// (cpu::kernels_isa(): native and avx512 allow AVX-512, avx2 AVX2, baseline neither), so that one
// build of the executor serves the kernels of every instruction set (scripts/test.sh).
Isa best_isa() {
  __builtin_cpu_init();
  Isa cpu = Isa::kScalar;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) cpu = Isa::kAvx512;
  else if (__builtin_cpu_supports("avx2")) cpu = Isa::kAvx2;
  const std::string built = cpu::kernels_isa();
  const Isa cap = built == "baseline" ? Isa::kScalar : built == "avx2" ? Isa::kAvx2 : Isa::kAvx512;
  return static_cast<int>(cpu) < static_cast<int>(cap) ? cpu : cap;
}

namespace {
std::string accepted_isas(Isa best) {
  return std::string("scalar") + (best >= Isa::kAvx2 ? ", avx2" : "") + (best >= Isa::kAvx512 ? ", avx512" : "");
}
Result<Isa> supported(Isa isa) {
  const Isa best = best_isa();
  if (static_cast<int>(isa) > static_cast<int>(best))
    return unsupported(std::string("this CPU (or this build's MEGATRAIN_CPU_ISA) has no ") + isa_name(isa) +
                       "; accepted: " + accepted_isas(best));
  return isa;
}
}  // namespace

Result<Isa> isa_from_environment() {
  const char* e = std::getenv("MEGATRAIN_ISA");
  const std::string v = e ? e : "";
  if (v.empty() || v == "auto") return Isa::kAuto;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
    if (v == isa_name(isa)) {
      auto r = supported(isa);
      if (!r.ok()) return invalid_argument("MEGATRAIN_ISA=" + v + ": " + r.status().message());
      return isa;
    }
  return invalid_argument("MEGATRAIN_ISA=" + v + ": unknown instruction set; accepted: auto, " + accepted_isas(best_isa()));
}

Result<Isa> resolve_isa(Isa isa) {
  if (isa == Isa::kAuto) {
    auto forced = isa_from_environment();
    return forced.ok() && *forced != Isa::kAuto ? *forced : best_isa();
  }
  return supported(isa);
}

bool is_quantised(StateFormat f) { return state_format_bits(f) > 0; }

StepConsts step_consts(const AdamWStep& s) {
  StepConsts k;
  k.grad_scale = s.grad_scale;
  k.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  k.b1 = static_cast<float>(s.beta1);
  k.b2 = static_cast<float>(s.beta2);
  k.omb1 = static_cast<float>(1.0 - s.beta1);
  k.omb2 = static_cast<float>(1.0 - s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.t));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.t));
  k.step_size = static_cast<float>(s.lr / bc1);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = static_cast<float>(s.eps);
  return k;
}

// ---- MomentStore ------------------------------------------------------------------------------

MomentStore MomentStore::create(StateFormat format, bool second, const std::vector<int64_t>& tensor_numels,
                                int64_t block_size, bool allocate) {
  MomentStore s;
  s.format_ = format;
  s.second_ = second;
  s.block_ = block_size;
  int64_t blocks = 0;
  for (int64_t n : tensor_numels) {
    s.tensor_offset_.push_back(s.numel_);
    s.tensor_numel_.push_back(n);
    s.tensor_block_.push_back(blocks);
    s.numel_ += n;
    blocks += (n + block_size - 1) / block_size;
  }
  s.blocks_ = blocks;
  if (!allocate) return s;
  switch (format) {
    case StateFormat::kFp32: s.f32_.resize(s.numel_); break;
    case StateFormat::kBf16: s.bf16_.resize(s.numel_); break;
    default: {
      const std::vector<int64_t> bytes = s.array_bytes();  // codes, then one fp32 scale per block
      s.codes_.resize(bytes[0]);
      s.scales_.resize(bytes[1] / 4);
      // Zero moments: every scale 0 decodes to 0 whatever the codes.
    }
  }
  return s;
}

std::vector<int64_t> MomentStore::array_bytes() const { return moment_array_bytes(format_, tensor_numel_, block_); }

void MomentStore::attach(const std::vector<void*>& arrays) {
  switch (format_) {
    case StateFormat::kFp32: f32_.view(static_cast<float*>(arrays.at(0)), numel_); break;
    case StateFormat::kBf16: bf16_.view(static_cast<uint16_t*>(arrays.at(0)), numel_); break;
    default:
      const std::vector<int64_t> bytes = array_bytes();
      codes_.view(static_cast<uint8_t*>(arrays.at(0)), bytes[0]);
      scales_.view(static_cast<float*>(arrays.at(1)), bytes[1] / 4);
  }
}

void MomentStore::detach() {
  f32_.release();
  bf16_.release();
  codes_.release();
  scales_.release();
}

int64_t MomentStore::bytes_if_allocated() const {
  int64_t b = 0;
  for (int64_t a : array_bytes()) b += a;
  return b;
}

int64_t MomentStore::bytes() const {
  return 4 * f32_.size() + 2 * bf16_.size() + codes_.size() + 4 * scales_.size();
}

MomentRef MomentStore::tensor(size_t index) {
  MomentRef r;
  r.format = format_;
  r.block_size = block_;
  const int64_t off = tensor_offset_[index];
  switch (format_) {
    case StateFormat::kFp32: r.f32 = f32_.data() + off; break;
    case StateFormat::kBf16: r.bf16 = bf16_.data() + off; break;
    default:
      r.codes = codes_.data() + tensor_block_[index] * block_ * state_format_bits(format_) / 8;
      r.scales = scales_.data() + tensor_block_[index];
  }
  return r;
}

void MomentStore::decode(size_t index, float* out) const {
  decode_moment(const_cast<MomentStore*>(this)->tensor(index), second_, tensor_numel_[index], out);
}

void MomentStore::encode(size_t index, const float* in) { encode_moment(tensor(index), second_, tensor_numel_[index], in); }

// ---- the fused pass -----------------------------------------------------------------------------

namespace {

using RunFn = void (*)(const StepConsts&, float*, const float*, const MomentRef&, const MomentRef&, int64_t, int64_t, int64_t,
                       float*, uint16_t*, float*, float*, int32_t*);

RunFn run_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return adamw_avx512::adamw_run;
    case Isa::kAvx2: return adamw_avx2::adamw_run;
    default: return adamw_scalar::adamw_run;
  }
}

// The block the pass works in: the quantisation block, else 4096 elements (fp32/bf16 are
// element-wise; the block only sets the unit of work and of the threads' split).
int64_t work_block(const MomentRef& m, const MomentRef& v) {
  if (is_quantised(m.format)) return m.block_size;
  if (is_quantised(v.format)) return v.block_size;
  return 4096;
}

}  // namespace

void decode_moment(const MomentRef& r, bool second, int64_t n, float* out) {
  std::vector<int32_t> ci(static_cast<size_t>(r.block_size));
  adamw_scalar::moment_decode(r, second, n, out, ci.data());
}

void encode_moment(const MomentRef& r, bool second, int64_t n, const float* in) {
  std::vector<int32_t> ci(static_cast<size_t>(r.block_size));
  adamw_scalar::moment_encode(r, second, n, in, ci.data());
}

void adamw_update_moments(float* w, const float* g, const MomentRef& m, const MomentRef& v, int64_t n, const AdamWStep& s,
                          float* stream_f32, uint16_t* stream_bf16, int threads, Isa isa) {
  if (n <= 0) return;
  const StepConsts k = step_consts(s);
  auto resolved = resolve_isa(isa);
  const RunFn fn = run_for(resolved.ok() ? *resolved : Isa::kScalar);
  const int64_t block = work_block(m, v);
  const int64_t blocks = (n + block - 1) / block;
  const int t = static_cast<int>(std::clamp<int64_t>(threads, 1, std::max<int64_t>(1, std::min<int64_t>(blocks, n / 16384 + 1))));
  auto part = [&](int i) {
    std::vector<float> fm(static_cast<size_t>(block)), fv(2 * static_cast<size_t>(block));
    std::vector<int32_t> ci(2 * static_cast<size_t>(block));
    const int64_t b0 = blocks * i / t, b1 = blocks * (i + 1) / t;
    fn(k, w, g, m, v, b0 * block, std::min(n, b1 * block), block, stream_f32, stream_bf16, fm.data(), fv.data(), ci.data());
  };
  if (t == 1) {
    part(0);
    return;
  }
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) pool.emplace_back(part, i);
  part(0);
  for (auto& th : pool) th.join();
}

}  // namespace megatrain::exec

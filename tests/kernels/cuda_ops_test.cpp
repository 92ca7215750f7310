// The CUDA ops (kernels/cuda/*.cuh) against the CPU reference ops (megatrain::cpu), forward and
// backward, on the fp32 path (T = float) and the mixed-precision path (T = bf16), on random inputs of
// odd shapes. On a machine without a GPU every test that needs one skips with the reason; the few
// host-side checks (token grouping, workspace sizing) run everywhere.
//
// How results are compared:
// - Inputs are made on the host with a fixed seed. On the bf16 path they are rounded to bf16 first
//   and the reference gets the rounded values, so the only difference left is the GPU's arithmetic.
// - The reference is the CPU op in double where it is instantiated for double (all of them are),
//   except where the contract prescribes fp32 rounding of an intermediate (RoPE's angle) or bit
//   equality with the fp32 CPU op (embedding).
// - Error: e = ||gpu - ref||_2 / ||ref||_2. fp32 outputs of fp32 arithmetic on exact inputs are held
//   to fp32-level bounds (per op below). Outputs stored in bf16 are held to c * e_ref, where
//   e_ref = ||bf16(ref) - ref|| / ||ref|| is what rounding the exact result to bf16 costs at best,
//   and never to less than the op's fp32 bound (a result bf16 holds exactly must still be right).
#include <gtest/gtest.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/attention.cuh"
#include "cuda/cast.cuh"
#include "cuda/common.cuh"
#include "cuda/cross_entropy.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/embedding.cuh"
#include "cuda/gemm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/moe_math.h"
#include "cuda/reduce.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/swiglu.cuh"
#include "megatrain/kernels/cpu/moe.h"
#include "megatrain/kernels/cpu/swiglu.h"
#include "megatrain/kernels/cpu/ops.h"
#include "megatrain/kernels/cuda_device.h"

namespace megatrain::cuda {
namespace {

// ---- bounds -------------------------------------------------------------------------------------
// fp32 bounds on e (normalised L2 error), by the kind of arithmetic between exact inputs and output.
constexpr double kElementwiseFp32 = 1e-5;  // a few fp32 operations per element (exp, division, sin/cos)
constexpr double kShortReduceFp32 = 1e-5;  // sums of at most a few thousand terms in fp32
constexpr double kStatFp32 = 2e-6;         // rstd and log-sum-exp: one reduction, then a smooth function
constexpr double kRmsNormDxFp32 = 2e-5;    // dx = rstd (g - x rstd^2 c): a cancelling difference
constexpr double kGemmFp32 = 1e-5;         // true fp32 GEMM (no TF32, gemm.cuh), k <= 257
constexpr double kGemmBf16In = 5e-5;       // bf16 products are exact in fp32; the tensor cores' fp32
                                           // accumulation may truncate rather than round
constexpr double kAttnFwdFp32 = 2e-5;      // out and lse of fp32 attention
constexpr double kAttnBwdFp32 = 1e-4;      // dq/dk/dv: several chained GEMMs and a cancelling dp - D
// Multiples of the reference's own bf16 rounding error for outputs stored in bf16 (or, for
// attention's fp32 outputs on the bf16 path, computed from bf16-rounded intermediates).
constexpr double kBf16C = 4;
constexpr double kBf16CBackward = 8;  // attention and cross-entropy backward

// ---- host bf16 ----------------------------------------------------------------------------------
// Round to nearest even, independent of the CUDA headers' conversion (which the GPU also uses).
uint16_t bf16_bits_rne(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_bits_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }
float round_bf16(float f) { return bf16_bits_to_float(bf16_bits_rne(f)); }
bf16 bf16_from_bits(uint16_t b) {
  __nv_bfloat16_raw raw;
  raw.x = b;
  return bf16(raw);
}
uint16_t bits_of(bf16 v) {
  uint16_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, bf16>;

template <typename T>
T to_storage(float f) {
  if constexpr (kIsBf16<T>)
    return bf16_from_bits(bf16_bits_rne(f));
  else
    return static_cast<T>(f);
}
inline double as_double(float v) { return v; }
inline double as_double(double v) { return v; }
inline double as_double(bf16 v) { return bf16_bits_to_float(bits_of(v)); }

template <typename T>
std::vector<double> to_doubles(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = as_double(v[i]);
  return r;
}
std::vector<float> to_floats(const std::vector<double>& v) { return {v.begin(), v.end()}; }
template <typename T>
std::vector<T> storage_of(const std::vector<double>& v) {
  std::vector<T> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = to_storage<T>(static_cast<float>(v[i]));
  return r;
}
template <typename T>
std::vector<T> nan_filled(size_t n) {
  return std::vector<T>(n, to_storage<T>(std::numeric_limits<float>::quiet_NaN()));
}

// ---- inputs -------------------------------------------------------------------------------------
// What is uploaded (in T) and the same values, exactly, for the reference.
template <typename T>
struct Input {
  std::vector<T> dev;
  std::vector<double> ref;
};

template <typename T>
Input<T> random_input(size_t n, std::mt19937& g, double stddev = 1, double mean = 0) {
  std::normal_distribution<float> d(static_cast<float>(mean), static_cast<float>(stddev));
  Input<T> in;
  in.dev.reserve(n);
  in.ref.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const T v = to_storage<T>(d(g));
    in.dev.push_back(v);
    in.ref.push_back(as_double(v));
  }
  return in;
}

// A row-major [rows, cols] matrix with leading dimension ld >= cols. The padding columns hold NaN on
// the device (a correct GEMM never reads them) and 0 in the reference.
template <typename T>
Input<T> random_matrix(int64_t rows, int64_t cols, int64_t ld, std::mt19937& g) {
  std::normal_distribution<float> d(0.f, 1.f);
  Input<T> in;
  in.dev = nan_filled<T>(static_cast<size_t>(rows * ld));
  in.ref.assign(static_cast<size_t>(rows * ld), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T v = to_storage<T>(d(g));
      in.dev[static_cast<size_t>(r * ld + c)] = v;
      in.ref[static_cast<size_t>(r * ld + c)] = as_double(v);
    }
  return in;
}

// `batch` row-major [rows, cols] matrices (leading dimension ld) `stride` elements apart; the padding
// columns and the gaps between matrices hold NaN on the device and 0 in the reference.
template <typename T>
Input<T> random_batched(int64_t batch, int64_t stride, int64_t rows, int64_t cols, int64_t ld, std::mt19937& g) {
  std::normal_distribution<float> d(0.f, 1.f);
  Input<T> in;
  in.dev = nan_filled<T>(static_cast<size_t>(batch * stride));
  in.ref.assign(in.dev.size(), 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t at = static_cast<size_t>(b * stride + r * ld + c);
        in.dev[at] = to_storage<T>(d(g));
        in.ref[at] = as_double(in.dev[at]);
      }
  return in;
}

// Token ids in [0, vocab) with repeats: every third position repeats an earlier token, and the first
// and last ids of the vocabulary occur.
std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, std::mt19937& g) {
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i % 3 == 2) ? t[static_cast<size_t>(i / 2)] : d(g);
  if (n > 1) t[static_cast<size_t>(n - 1)] = static_cast<int32_t>(vocab - 1);
  if (n > 3) t[1] = 0;
  return t;
}

// ---- comparison ---------------------------------------------------------------------------------
double l2(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

struct Cmp {
  double e = 0;       // normalised L2 error
  std::string where;  // the worst element, for the failure message
};

// e = ||got - ref|| / max(||ref||, floor). `floor` stands in for ||ref|| when the exact result is 0
// (then any scale of the problem will do; callers pass one).
Cmp compare(const std::vector<double>& got, const std::vector<double>& ref, double floor = 0) {
  Cmp c;
  if (got.size() != ref.size()) {
    c.e = std::numeric_limits<double>::infinity();
    c.where = "size " + std::to_string(got.size()) + " vs reference " + std::to_string(ref.size());
    return c;
  }
  double num = 0, den = 0, worst = -1;
  size_t wi = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    if (!(std::abs(d) <= worst)) {  // NaN counts as the worst
      worst = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::abs(d);
      wi = i;
    }
  }
  c.e = std::sqrt(num) / std::max({std::sqrt(den), floor, 1e-300});
  if (!got.empty())
    c.where = "worst element " + std::to_string(wi) + ": got " + std::to_string(got[wi]) + ", reference " +
              std::to_string(ref[wi]) + "; ||ref|| = " + std::to_string(std::sqrt(den));
  return c;
}

// What rounding the exact result to bf16 costs: the yardstick of the bf16 path.
double bf16_rounding_err(const std::vector<double>& ref) {
  std::vector<double> r(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) r[i] = round_bf16(static_cast<float>(ref[i]));
  return compare(r, ref).e;
}

// The bound of an output stored in T: fp32_bound on the fp32 path; on the bf16 path c * e_ref, never
// below fp32_bound.
template <typename T>
double bound_for(const std::vector<double>& ref, double fp32_bound, double c) {
  if constexpr (kIsBf16<T>)
    return std::max(c * bf16_rounding_err(ref), fp32_bound);
  else
    return fp32_bound;
}

#define EXPECT_REL_ERR_LE(got, ref, bound, what)                                                          \
  do {                                                                                                   \
    const Cmp cmp_ = compare((got), (ref));                                                              \
    const double bound_ = (bound);                                                                       \
    EXPECT_LE(cmp_.e, bound_) << (what) << ": normalised error e = " << cmp_.e << " > bound " << bound_ \
                              << " (" << cmp_.where << ")";                                              \
  } while (0)

// Index of the first element whose bits differ, or -1 (sizes differ: 0).
template <typename T>
int64_t first_bit_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  return -1;
}

#define EXPECT_SAME_BITS(a, b, what)                                                                    \
  do {                                                                                                 \
    const auto& a_ = (a);                                                                              \
    const int64_t at_ = first_bit_mismatch(a_, (b));                                                   \
    EXPECT_EQ(at_, -1) << (what) << ": first differing element " << at_ << " (of " << a_.size() << ")"; \
  } while (0)

// ---- device helpers -----------------------------------------------------------------------------
#define ASSERT_CUDA_OK(stmt)                                                                            \
  do {                                                                                                 \
    const cudaError_t err_ = (stmt);                                                                   \
    ASSERT_EQ(err_, cudaSuccess) << #stmt << ": " << cudaGetErrorName(err_) << " (" << cudaGetErrorString(err_) \
                                 << ")";                                                               \
  } while (0)

#define ASSERT_STATUS_OK(stmt)                                   \
  do {                                                          \
    const ::megatrain::Status st_ = (stmt);                     \
    ASSERT_TRUE(st_.ok()) << #stmt << ": " << st_.to_string(); \
  } while (0)

// Device memory of n elements: synchronous upload, download after the stream has finished.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ == 0) return;
    const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T));
    if (e != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << n_ * sizeof(T) << " bytes: " << cudaGetErrorString(e);
      p_ = nullptr;
      n_ = 0;
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }

  void upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    if (n_ > 0) ASSERT_CUDA_OK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(cudaStream_t s) const {
    std::vector<T> host(n_);
    cudaError_t e = cudaStreamSynchronize(s);
    if (e == cudaSuccess && n_ > 0) e = cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) ADD_FAILURE() << "download: " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ")";
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// The two-stage column sum's order (kernels/cuda/column_sum.cuh, workspace_sizes.h) on the host:
// out[j] += the partials of each chunk of rows, each summed from zero in row order, added in chunk
// order. Adds only, so float and double give the GPU's bits (no product for a compiler to contract).
template <typename Acc, typename F>
void column_sum_two_stage_host(F value, int64_t rows, int64_t cols, Acc* out) {
  const int64_t chunks = column_sum_chunks(rows), chunk = column_sum_chunk_rows(rows);
  std::vector<Acc> partial(static_cast<size_t>(chunks * cols), Acc(0));
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < cols; ++j) {
      Acc acc = Acc(0);
      for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) acc = acc + value(r, j);
      partial[static_cast<size_t>(c * cols + j)] = acc;
    }
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t c = 0; c < chunks; ++c) out[j] = out[j] + partial[static_cast<size_t>(c * cols + j)];
}

// Whether this machine has a GPU (asked once).
const Status& gpu_status() {
  static const Status s = [] {
    auto d = list_devices();
    return d.ok() ? Status{} : d.status();
  }();
  return s;
}

// A stream, a cuBLAS handle on it, and a CPU context for the references; skips without a GPU.
class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_status().ok()) GTEST_SKIP() << "no GPU here: " << gpu_status().message();
    ASSERT_CUDA_OK(cudaStreamCreate(&stream_));
    ASSERT_EQ(cublasCreate(&blas_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(blas_, stream_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    if (stream_) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    }
    if (blas_) cublasDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
    blas_ = nullptr;
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cpu::CpuContext ctx_{2};
};

template <typename T>
class CudaOpsT : public CudaOpsTest {};

struct ComputeTypeNames {
  template <typename T>
  static std::string GetName(int) {
    return kIsBf16<T> ? "bf16" : "fp32";
  }
};
using ComputeTypes = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(CudaOpsT, ComputeTypes, ComputeTypeNames);

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

// =================================================================================================
// Host-side parts of the launchers: no GPU needed.

TEST(CudaHostSide, TokenGroupsListEachTokensPositionsAscending) {
  std::mt19937 g(1);
  for (int64_t n : {0, 1, 7, 33, 130, 1000}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const std::vector<int32_t> tokens = random_tokens(n, n > 100 ? 17 : 50, g);
    const TokenGroups tg = build_token_groups(tokens.data(), n);
    ASSERT_EQ(tg.offsets.size(), tg.unique.size() + 1);
    ASSERT_EQ(tg.positions.size(), static_cast<size_t>(n));
    EXPECT_EQ(tg.offsets.front(), 0);
    EXPECT_EQ(tg.offsets.back(), n);
    EXPECT_EQ(std::set<int32_t>(tg.unique.begin(), tg.unique.end()).size(), tg.unique.size()) << "tokens repeat";
    EXPECT_EQ(std::set<int32_t>(tokens.begin(), tokens.end()).size(), tg.unique.size());
    std::vector<int> seen(static_cast<size_t>(n), 0);
    for (size_t u = 0; u < tg.unique.size(); ++u) {
      ASSERT_LT(tg.offsets[u], tg.offsets[u + 1]) << "empty group " << u;
      for (int32_t i = tg.offsets[u]; i < tg.offsets[u + 1]; ++i) {
        const int32_t p = tg.positions[static_cast<size_t>(i)];
        ASSERT_GE(p, 0);
        ASSERT_LT(p, n);
        EXPECT_EQ(tokens[static_cast<size_t>(p)], tg.unique[u]);
        if (i > tg.offsets[u]) {
          EXPECT_LT(tg.positions[static_cast<size_t>(i - 1)], p) << "not ascending";
        }
        ++seen[static_cast<size_t>(p)];
      }
    }
    for (int64_t p = 0; p < n; ++p) EXPECT_EQ(seen[static_cast<size_t>(p)], 1) << "position " << p;
  }
}

TEST(CudaHostSide, AttentionBlockRowsFitTheBudget) {
  for (const AttnDims d : {AttnDims{1, 1, 4, 2, 64}, AttnDims{2, 5, 6, 2, 40}, AttnDims{1, 67, 4, 2, 128},
                           AttnDims{2, 130, 3, 3, 64}, AttnDims{4, 4096, 32, 8, 128}}) {
    SCOPED_TRACE("dims " + shape_str({d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim}));
    const int64_t min_rows = std::min<int64_t>(16, d.seq);
    EXPECT_EQ(attention_block_rows(d, 0), min_rows) << "a budget below the minimum still gets the minimum";
    EXPECT_EQ(attention_block_rows(d, int64_t{1} << 50), d.seq) << "an ample budget takes the whole sequence";
    int64_t prev = 0;
    for (int64_t want : {int64_t{16}, int64_t{40}, int64_t{100}, d.seq}) {
      const int64_t budget = attention_workspace_bytes(d, std::min(want, d.seq));
      EXPECT_GE(budget, 0);
      const int64_t rows = attention_block_rows(d, budget);
      EXPECT_GE(rows, min_rows);
      EXPECT_LE(rows, d.seq);
      EXPECT_GE(rows, prev) << "more budget, fewer rows";
      EXPECT_LE(attention_workspace_bytes(d, rows), budget) << "rows " << rows << " overrun the budget";
      if (rows < d.seq) {
        EXPECT_EQ(rows % 8, 0) << "a block short of the sequence is a multiple of 8 rows";
      }
      prev = rows;
    }
  }
}

// gemm2's pointer-array call only for matrices on 16-byte boundaries at every (outer, inner) step.
TEST(CudaHostSide, TwoLevelBatchesNeedEveryMatrixAligned) {
  alignas(16) static unsigned char buf[64];
  EXPECT_TRUE(batched_operand_aligned(buf, 64, 2, 8 * 128, 128)) << "bf16 q heads of 128";
  EXPECT_TRUE(batched_operand_aligned(buf, 64, 2, 128, 0)) << "a group's shared k (inner stride 0)";
  EXPECT_TRUE(batched_operand_aligned(buf, 24, 4, 4 * 8 * 24, 8 * 24)) << "fp32 scores of 8 rows x 24 keys";
  EXPECT_FALSE(batched_operand_aligned(buf, 21, 4, 4 * 8 * 21, 8 * 21)) << "21 keys: rows 84 bytes apart";
  EXPECT_FALSE(batched_operand_aligned(buf, 64, 2, 128, 4)) << "an inner step of 4 bf16: 8 bytes";
  EXPECT_FALSE(batched_operand_aligned(buf, 64, 2, 12, 0)) << "an outer step of 12 bf16: 24 bytes";
  EXPECT_FALSE(batched_operand_aligned(buf + 8, 64, 2, 128, 0)) << "a base 8 bytes off";
}

TEST(CudaHostSide, SumOfSquaresScratchHoldsOnePartialPerChunk) {
  for (int64_t n : {int64_t{1}, int64_t{7}, kSumSquaresChunk, kSumSquaresChunk + 1, 3 * kSumSquaresChunk + 123,
                    int64_t{1} << 30}) {
    EXPECT_GE(sum_of_squares_scratch(n), (n + kSumSquaresChunk - 1) / kSumSquaresChunk) << "n = " << n;
  }
}

// =================================================================================================
// Embedding

TYPED_TEST(CudaOpsT, EmbeddingForwardCopiesRowsExactly) {
  using T = TypeParam;
  std::mt19937 g(11);
  struct Case {
    int64_t n, hidden, vocab;
  };
  for (const Case c : {Case{1, 8, 50}, Case{7, 24, 50}, Case{33, 96, 257}, Case{130, 136, 50}}) {
    SCOPED_TRACE("n x hidden x vocab = " + shape_str({c.n, c.hidden, c.vocab}));
    const std::vector<int32_t> tokens = random_tokens(c.n, c.vocab, g);
    const Input<T> table = random_input<T>(static_cast<size_t>(c.vocab * c.hidden), g);
    // The CPU op in fp32 on the same (rounded) table: a copy, so equal bit for bit.
    const std::vector<float> table_f = to_floats(table.ref);
    std::vector<float> ref(static_cast<size_t>(c.n * c.hidden));
    ASSERT_STATUS_OK(
        cpu::embedding_forward<float>(this->ctx_, tokens.data(), c.n, table_f.data(), c.vocab, c.hidden, ref.data()));

    DeviceBuffer<int32_t> d_tokens(tokens);
    DeviceBuffer<T> d_table(table.dev);
    DeviceBuffer<float> d_out(nan_filled<float>(ref.size()));
    ASSERT_STATUS_OK(embedding_forward<T>(d_tokens.get(), c.n, d_table.get(), c.hidden, d_out.get(), this->stream_));
    EXPECT_SAME_BITS(d_out.download(this->stream_), ref, "embedding forward vs cpu::embedding_forward<float>");
  }
}

TEST_F(CudaOpsTest, EmbeddingBackwardEqualsCpuBitForBit) {
  std::mt19937 g(12);
  struct Case {
    int64_t n, hidden, vocab;
  };
  // The last case repeats each of 7 tokens about 43 times: long per-token sums.
  for (const Case c : {Case{1, 8, 50}, Case{7, 24, 50}, Case{33, 96, 257}, Case{130, 136, 50}, Case{300, 40, 7}}) {
    SCOPED_TRACE("n x hidden x vocab = " + shape_str({c.n, c.hidden, c.vocab}));
    const std::vector<int32_t> tokens = random_tokens(c.n, c.vocab, g);
    const Input<float> dout = random_input<float>(static_cast<size_t>(c.n * c.hidden), g);
    const Input<float> dtable0 = random_input<float>(static_cast<size_t>(c.vocab * c.hidden), g);  // accumulated onto

    std::vector<float> ref = dtable0.dev;
    ASSERT_STATUS_OK(
        cpu::embedding_backward<float>(ctx_, tokens.data(), c.n, dout.dev.data(), c.vocab, c.hidden, ref.data()));

    const TokenGroups tg = build_token_groups(tokens.data(), c.n);
    DeviceBuffer<int32_t> d_unique(tg.unique), d_offsets(tg.offsets), d_positions(tg.positions);
    DeviceBuffer<float> d_dout(dout.dev), d_dtable(dtable0.dev);
    ASSERT_STATUS_OK(embedding_backward(d_unique.get(), d_offsets.get(), d_positions.get(),
                                        static_cast<int64_t>(tg.unique.size()), d_dout.get(), c.hidden, d_dtable.get(),
                                        stream_));
    EXPECT_SAME_BITS(d_dtable.download(stream_), ref, "embedding backward vs cpu::embedding_backward<float>");
  }
}

// =================================================================================================
// RMSNorm

TYPED_TEST(CudaOpsT, RmsNormMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(21);
  const float eps = 1e-5f;
  struct Case {
    int64_t n, dim;
  };
  bool checked_variants = false;
  for (const Case c : {Case{1, 8}, Case{7, 24}, Case{33, 96}, Case{130, 136}, Case{3, 4104}, Case{2100, 40}}) {  // 2100: 8 row chunks
    SCOPED_TRACE("n x dim = " + shape_str({c.n, c.dim}));
    const size_t nd = static_cast<size_t>(c.n * c.dim), n = static_cast<size_t>(c.n), dim = static_cast<size_t>(c.dim);
    const Input<float> x = random_input<float>(nd, g, 2.0);
    const Input<T> w = random_input<T>(dim, g, 0.2, 1.0);

    // Forward.
    std::vector<double> y_ref(nd), rstd_ref(n);
    cpu::rmsnorm_forward<double>(this->ctx_, x.ref.data(), w.ref.data(), c.n, c.dim, static_cast<double>(eps),
                                 y_ref.data(), rstd_ref.data());
    DeviceBuffer<float> d_x(x.dev), d_rstd(nan_filled<float>(n));
    DeviceBuffer<T> d_w(w.dev), d_y(nan_filled<T>(nd));
    ASSERT_STATUS_OK(
        rmsnorm_forward<T>(d_x.get(), d_w.get(), c.n, c.dim, eps, d_y.get(), d_rstd.get(), this->stream_));
    // rstd is fp32 arithmetic on fp32 x on both paths.
    EXPECT_REL_ERR_LE(to_doubles(d_rstd.download(this->stream_)), rstd_ref, kStatFp32, "rmsnorm rstd");
    EXPECT_REL_ERR_LE(to_doubles(d_y.download(this->stream_)), y_ref, bound_for<T>(y_ref, kElementwiseFp32, kBf16C),
                      "rmsnorm y");

    // Backward, from the reference's rstd rounded to fp32 (both sides get the same values); dw
    // accumulates onto nonzero values.
    const Input<float> dy = random_input<float>(nd, g);
    const Input<float> dw0 = random_input<float>(dim, g);
    const std::vector<float> rstd_in = to_floats(rstd_ref);
    const std::vector<double> rstd_in_ref = to_doubles(rstd_in);
    std::vector<double> dx_ref(nd), dw_ref = dw0.ref;
    cpu::rmsnorm_backward<double>(this->ctx_, dy.ref.data(), x.ref.data(), w.ref.data(), rstd_in_ref.data(), c.n, c.dim,
                                  dx_ref.data(), dw_ref.data());
    DeviceBuffer<float> d_dy(dy.dev), d_rstd_in(rstd_in), d_dx(nan_filled<float>(nd)), d_dw(dw0.dev);
    DeviceBuffer<char> d_cs(static_cast<size_t>(column_sum_scratch_bytes(c.dim)));  // the dw sum's partials
    ASSERT_STATUS_OK(rmsnorm_backward<T>(d_dy.get(), d_x.get(), d_w.get(), d_rstd_in.get(), c.n, c.dim, d_dx.get(),
                                         d_dw.get(), d_cs.get(), this->stream_));
    const std::vector<float> dx = d_dx.download(this->stream_), dw = d_dw.download(this->stream_);
    // dx and dw are fp32 outputs of fp32 arithmetic on exact inputs on both paths (w is only read).
    EXPECT_REL_ERR_LE(to_doubles(dx), dx_ref, kRmsNormDxFp32, "rmsnorm dx");
    EXPECT_REL_ERR_LE(to_doubles(dw), dw_ref, kShortReduceFp32, "rmsnorm dw (accumulated)");

    if (checked_variants || c.n < 7) continue;
    checked_variants = true;
    // Deterministic: the same call again gives the same bits.
    d_dw.upload(dw0.dev);
    ASSERT_STATUS_OK(rmsnorm_backward<T>(d_dy.get(), d_x.get(), d_w.get(), d_rstd_in.get(), c.n, c.dim, d_dx.get(),
                                         d_dw.get(), d_cs.get(), this->stream_));
    EXPECT_SAME_BITS(d_dx.download(this->stream_), dx, "rmsnorm dx, second run");
    EXPECT_SAME_BITS(d_dw.download(this->stream_), dw, "rmsnorm dw, second run");
    // dx may alias dy (dw must still read the original dy).
    DeviceBuffer<float> d_dy_alias(dy.dev);
    d_dw.upload(dw0.dev);
    ASSERT_STATUS_OK(rmsnorm_backward<T>(d_dy_alias.get(), d_x.get(), d_w.get(), d_rstd_in.get(), c.n, c.dim,
                                         d_dy_alias.get(), d_dw.get(), d_cs.get(), this->stream_));
    EXPECT_SAME_BITS(d_dy_alias.download(this->stream_), dx, "rmsnorm dx written over dy");
    EXPECT_SAME_BITS(d_dw.download(this->stream_), dw, "rmsnorm dw with dx aliasing dy");
    // dx or dw null skips it and leaves the other unchanged.
    d_dw.upload(dw0.dev);
    ASSERT_STATUS_OK(rmsnorm_backward<T>(d_dy.get(), d_x.get(), d_w.get(), d_rstd_in.get(), c.n, c.dim, nullptr,
                                         d_dw.get(), d_cs.get(), this->stream_));
    EXPECT_SAME_BITS(d_dw.download(this->stream_), dw, "rmsnorm dw with dx null");
    DeviceBuffer<float> d_dx2(nan_filled<float>(nd));
    ASSERT_STATUS_OK(rmsnorm_backward<T>(d_dy.get(), d_x.get(), d_w.get(), d_rstd_in.get(), c.n, c.dim, d_dx2.get(),
                                         nullptr, nullptr, this->stream_));
    EXPECT_SAME_BITS(d_dx2.download(this->stream_), dx, "rmsnorm dx with dw null");
  }
}

// =================================================================================================
// RoPE

// The reference: cpu::rope_forward/backward in double, fed the angle the contract prescribes (the
// fp32 product float(position) * inv_freq[i], as HF computes it). One call per token with position 1
// and the token's angles as inv_freq: the angle is then exact and everything after it is double.
std::vector<double> rope_reference(cpu::CpuContext& ctx, const std::vector<double>& x,
                                   const std::vector<int32_t>& positions, int64_t heads, int64_t head_dim,
                                   const std::vector<float>& inv_freq, bool backward, double scale = 1) {
  std::vector<double> out(x.size()), angle(static_cast<size_t>(head_dim / 2));
  const int32_t one = 1;
  const size_t per_token = static_cast<size_t>(heads * head_dim);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (size_t i = 0; i < angle.size(); ++i)
      angle[i] = static_cast<float>(static_cast<float>(positions[t]) * inv_freq[i]);
    if (backward)
      cpu::rope_backward<double>(ctx, x.data() + t * per_token, out.data() + t * per_token, &one, 1, heads, head_dim,
                                 angle.data(), scale);
    else
      cpu::rope_forward<double>(ctx, x.data() + t * per_token, out.data() + t * per_token, &one, 1, heads, head_dim,
                                angle.data(), scale);
  }
  return out;
}

TYPED_TEST(CudaOpsT, RopeMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(31);
  struct Case {
    int64_t batch, seq, heads, head_dim;
    bool llama3;        // theta 500000 with llama3 scaling (factor 8), else theta 10000
    int32_t first_pos;  // positions first_pos .. first_pos + seq - 1 in each sequence
  };
  for (const Case c : {Case{1, 1, 1, 64, false, 0}, Case{2, 5, 3, 40, false, 0}, Case{1, 67, 8, 128, true, 0},
                       Case{2, 130, 2, 24, false, 0}, Case{1, 130, 4, 64, true, 0}, Case{3, 33, 1, 128, false, 0},
                       Case{1, 7, 2, 64, true, 8000}}) {
    SCOPED_TRACE("batch x seq x heads x head_dim = " + shape_str({c.batch, c.seq, c.heads, c.head_dim}) +
                 (c.llama3 ? ", theta 500000 llama3" : ", theta 10000") + ", first position " +
                 std::to_string(c.first_pos));
    cpu::RopeConfig cfg;
    cfg.head_dim = c.head_dim;
    if (c.llama3) {
      cfg.theta = 500000;
      cfg.scaling = cpu::RopeScaling::kLlama3;
      cfg.factor = 8;
      cfg.low_freq_factor = 1;
      cfg.high_freq_factor = 4;
      cfg.original_max_position_embeddings = 8192;
    }
    auto inv = cpu::rope_inv_freq<float>(cfg);
    ASSERT_TRUE(inv.ok()) << inv.status().to_string();
    const int64_t n_tokens = c.batch * c.seq;
    std::vector<int32_t> positions;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t i = 0; i < c.seq; ++i) positions.push_back(c.first_pos + static_cast<int32_t>(i));
    const size_t n = static_cast<size_t>(n_tokens * c.heads * c.head_dim);
    DeviceBuffer<int32_t> d_pos(positions);
    DeviceBuffer<float> d_inv(*inv);

    const Input<T> x = random_input<T>(n, g);
    const std::vector<double> fwd_ref = rope_reference(this->ctx_, x.ref, positions, c.heads, c.head_dim, *inv, false);
    DeviceBuffer<T> d_x(x.dev);
    ASSERT_STATUS_OK(rope_forward<T>(d_x.get(), d_pos.get(), n_tokens, c.heads, c.head_dim, d_inv.get(), this->stream_));
    EXPECT_REL_ERR_LE(to_doubles(d_x.download(this->stream_)), fwd_ref,
                      bound_for<T>(fwd_ref, kElementwiseFp32, kBf16C), "rope forward");

    const Input<T> dout = random_input<T>(n, g);
    const std::vector<double> bwd_ref = rope_reference(this->ctx_, dout.ref, positions, c.heads, c.head_dim, *inv, true);
    DeviceBuffer<T> d_dx(dout.dev);
    ASSERT_STATUS_OK(
        rope_backward<T>(d_dx.get(), d_pos.get(), n_tokens, c.heads, c.head_dim, d_inv.get(), this->stream_));
    EXPECT_REL_ERR_LE(to_doubles(d_dx.download(this->stream_)), bwd_ref,
                      bound_for<T>(bwd_ref, kElementwiseFp32, kBf16C), "rope backward");
  }
}


// gpt-oss: yarn's inverse frequencies and its attention factor on cos and sin (Dims::rope_scale),
// the CPU op's scale argument; the factor makes the rotation a scaled one, so a kernel ignoring it
// is off by |scale - 1| (about 14% here).
TYPED_TEST(CudaOpsT, RopeWithYarnScaleMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(37);
  cpu::RopeConfig cfg;
  cfg.head_dim = 64;
  cfg.theta = 150000;
  cfg.scaling = cpu::RopeScaling::kYarn;
  cfg.factor = 32;
  cfg.original_max_position_embeddings = 4096;
  cfg.beta_fast = 32;
  cfg.beta_slow = 1;
  auto inv = cpu::rope_inv_freq<float>(cfg);
  ASSERT_TRUE(inv.ok()) << inv.status().to_string();
  const double scale = cpu::rope_attention_scaling(cfg);
  ASSERT_GT(std::abs(scale - 1), 0.05);
  const int64_t batch = 2, seq = 45, heads = 3, hd = cfg.head_dim, n_tokens = batch * seq;
  std::vector<int32_t> positions;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < seq; ++i) positions.push_back(static_cast<int32_t>(i * 97));  // far positions too
  const size_t n = static_cast<size_t>(n_tokens * heads * hd);
  DeviceBuffer<int32_t> d_pos(positions);
  DeviceBuffer<float> d_inv(*inv);
  for (const bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    const Input<T> x = random_input<T>(n, g);
    const std::vector<double> ref = rope_reference(this->ctx_, x.ref, positions, heads, hd, *inv, backward, scale);
    DeviceBuffer<T> d_x(x.dev);
    const float fs = static_cast<float>(scale);
    if (backward)
      ASSERT_STATUS_OK(rope_backward<T>(d_x.get(), d_pos.get(), n_tokens, heads, hd, d_inv.get(), this->stream_, fs));
    else
      ASSERT_STATUS_OK(rope_forward<T>(d_x.get(), d_pos.get(), n_tokens, heads, hd, d_inv.get(), this->stream_, fs));
    EXPECT_REL_ERR_LE(to_doubles(d_x.download(this->stream_)), ref, bound_for<T>(ref, kElementwiseFp32, kBf16C),
                      "rope with yarn's scale");
  }
}

// =================================================================================================
// SwiGLU

TYPED_TEST(CudaOpsT, SwigluMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(41);
  for (const int64_t n : {1, 7, 33, 130 * 136, 100003}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const size_t un = static_cast<size_t>(n);
    const Input<T> gate = random_input<T>(un, g, 3.0), up = random_input<T>(un, g), dout = random_input<T>(un, g);
    std::vector<double> out_ref(un), dg_ref(un), du_ref(un);
    cpu::swiglu_forward<double>(this->ctx_, gate.ref.data(), up.ref.data(), n, out_ref.data());
    cpu::swiglu_backward<double>(this->ctx_, gate.ref.data(), up.ref.data(), dout.ref.data(), n, dg_ref.data(),
                                 du_ref.data());

    DeviceBuffer<T> d_gate(gate.dev), d_up(up.dev), d_dout(dout.dev), d_out(nan_filled<T>(un)),
        d_dg(nan_filled<T>(un)), d_du(nan_filled<T>(un));
    ASSERT_STATUS_OK(swiglu_forward<T>(d_gate.get(), d_up.get(), n, d_out.get(), this->stream_));
    ASSERT_STATUS_OK(
        swiglu_backward<T>(d_gate.get(), d_up.get(), d_dout.get(), n, d_dg.get(), d_du.get(), this->stream_));
    EXPECT_REL_ERR_LE(to_doubles(d_out.download(this->stream_)), out_ref,
                      bound_for<T>(out_ref, kElementwiseFp32, kBf16C), "swiglu out");
    const std::vector<T> dg = d_dg.download(this->stream_), du = d_du.download(this->stream_);
    EXPECT_REL_ERR_LE(to_doubles(dg), dg_ref, bound_for<T>(dg_ref, kElementwiseFp32, kBf16C), "swiglu dgate");
    EXPECT_REL_ERR_LE(to_doubles(du), du_ref, bound_for<T>(du_ref, kElementwiseFp32, kBf16C), "swiglu dup");

    if (n < 1000) continue;
    // In place (dgate over gate, dup over up): the same bits.
    DeviceBuffer<T> d_gate2(gate.dev), d_up2(up.dev);
    ASSERT_STATUS_OK(
        swiglu_backward<T>(d_gate2.get(), d_up2.get(), d_dout.get(), n, d_gate2.get(), d_up2.get(), this->stream_));
    EXPECT_SAME_BITS(d_gate2.download(this->stream_), dg, "swiglu dgate in place");
    EXPECT_SAME_BITS(d_up2.download(this->stream_), du, "swiglu dup in place");
  }
}


// gpt-oss's clamped SwiGLU on interleaved gate/up against the CPU op in double: a limit that cuts
// about a third of the inputs (the clamped ones get no gradient), and no limit (0).
TYPED_TEST(CudaOpsT, ClampedSwigluMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(43);
  for (const double limit : {0.7, 0.0})
    for (const int64_t n : {1, 37, 130 * 136}) {
      SCOPED_TRACE("n = " + std::to_string(n) + ", limit " + std::to_string(limit));
      const size_t un = static_cast<size_t>(n);
      const double alpha = 1.702;
      const Input<T> gu = random_input<T>(2 * un, g), dout = random_input<T>(un, g);
      std::vector<double> out_ref(un), dgu_ref(2 * un);
      cpu::clamped_swiglu_forward<double>(this->ctx_, gu.ref.data(), n, 1, alpha, limit, out_ref.data());
      cpu::clamped_swiglu_backward<double>(this->ctx_, gu.ref.data(), dout.ref.data(), n, 1, alpha, limit, dgu_ref.data());
      DeviceBuffer<T> d_gu(gu.dev), d_dout(dout.dev), d_out(nan_filled<T>(un)), d_dgu(nan_filled<T>(2 * un));
      const float fa = static_cast<float>(alpha), fl = static_cast<float>(limit);
      ASSERT_STATUS_OK(clamped_swiglu_forward<T>(d_gu.get(), n, fa, fl, d_out.get(), this->stream_));
      ASSERT_STATUS_OK(clamped_swiglu_backward<T>(d_gu.get(), d_dout.get(), n, fa, fl, d_dgu.get(), this->stream_));
      EXPECT_REL_ERR_LE(to_doubles(d_out.download(this->stream_)), out_ref, bound_for<T>(out_ref, kElementwiseFp32, kBf16C),
                        "clamped swiglu out");
      const std::vector<T> dgu = d_dgu.download(this->stream_);
      EXPECT_REL_ERR_LE(to_doubles(dgu), dgu_ref, bound_for<T>(dgu_ref, kElementwiseFp32, kBf16C), "clamped swiglu d gate_up");
      if (limit > 0 && n > 1000) {  // the clamped inputs' gradients are exactly 0, as the reference's
        int64_t zeros = 0;
        for (size_t i = 0; i < dgu_ref.size(); ++i)
          if (dgu_ref[i] == 0) {
            ++zeros;
            ASSERT_EQ(as_double(dgu[i]), 0.0) << "element " << i;
          }
        EXPECT_GT(zeros, n / 5);
        // In place (dgu over gu): the same bits.
        DeviceBuffer<T> d_gu2(gu.dev);
        ASSERT_STATUS_OK(clamped_swiglu_backward<T>(d_gu2.get(), d_dout.get(), n, fa, fl, d_gu2.get(), this->stream_));
        EXPECT_SAME_BITS(d_gu2.download(this->stream_), dgu, "clamped swiglu in place");
      }
    }
}

// =================================================================================================
// Conversions, element-wise arithmetic, reductions

TEST_F(CudaOpsTest, ConvertRoundsToNearestEvenAndBack) {
  std::mt19937 g(51);
  // fp32 -> bf16: special values, ties both ways, overflow to inf, subnormals, then random bit patterns
  // (all exponents, NaNs among them).
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f80ffffu,
                                0x3f817fffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f800000u, 0xff800000u,
                                0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x00000001u, 0x00008000u, 0x00018000u,
                                0x807fffffu, 0x00800000u, 0x3effffffu, 0x477fe000u};
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 100003; ++i) bits.push_back(any(g));
  std::vector<float> src(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) src[i] = std::bit_cast<float>(bits[i]);
  const int64_t n = static_cast<int64_t>(src.size());
  DeviceBuffer<float> d_src(src);
  DeviceBuffer<bf16> d_bf(n);
  ASSERT_STATUS_OK((convert<float, bf16>(d_src.get(), n, d_bf.get(), stream_)));
  const std::vector<bf16> got = d_bf.download(stream_);
  int64_t bad = 0, first_bad = -1;
  for (size_t i = 0; i < src.size(); ++i) {
    const uint16_t b = bits_of(got[i]);
    const bool ok = std::isnan(src[i]) ? std::isnan(bf16_bits_to_float(b)) : b == bf16_bits_rne(src[i]);
    if (!ok && bad++ == 0) first_bad = static_cast<int64_t>(i);
  }
  EXPECT_EQ(bad, 0) << "fp32 -> bf16 differs from round-to-nearest-even; first at " << first_bad << ": 0x" << std::hex
                    << (first_bad >= 0 ? bits[static_cast<size_t>(first_bad)] : 0u) << " -> 0x"
                    << (first_bad >= 0 ? bits_of(got[static_cast<size_t>(first_bad)]) : 0) << ", expected 0x"
                    << (first_bad >= 0 ? bf16_bits_rne(src[static_cast<size_t>(first_bad)]) : 0);

  // bf16 -> fp32: every bf16 bit pattern, exactly.
  std::vector<bf16> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = bf16_from_bits(static_cast<uint16_t>(b));
  DeviceBuffer<bf16> d_all(all);
  DeviceBuffer<float> d_back(all.size());
  ASSERT_STATUS_OK((convert<bf16, float>(d_all.get(), 65536, d_back.get(), stream_)));
  const std::vector<float> back = d_back.download(stream_);
  bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float want = bf16_bits_to_float(static_cast<uint16_t>(b));
    const bool ok = std::isnan(want) ? std::isnan(back[b]) : std::bit_cast<uint32_t>(back[b]) == (b << 16);
    if (!ok && bad++ == 0) first_bad = b;
  }
  EXPECT_EQ(bad, 0) << "bf16 -> fp32 is not exact; first at bf16 bits " << first_bad;

  // fp32 -> fp32: a copy.
  DeviceBuffer<float> d_copy(src.size());
  ASSERT_STATUS_OK((convert<float, float>(d_src.get(), n, d_copy.get(), stream_)));
  const std::vector<float> copy = d_copy.download(stream_);
  bad = 0;
  for (size_t i = 0; i < src.size(); ++i)
    if (std::isnan(src[i]) ? !std::isnan(copy[i]) : std::bit_cast<uint32_t>(copy[i]) != bits[i]) ++bad;
  EXPECT_EQ(bad, 0) << "fp32 -> fp32 is not a copy";

  // Odd lengths (tails of vectorised loops) and zero.
  for (int64_t m : {1, 7, 33, 4099}) {
    DeviceBuffer<bf16> d_part(nan_filled<bf16>(static_cast<size_t>(m) + 8));
    ASSERT_STATUS_OK((convert<float, bf16>(d_src.get(), m, d_part.get(), stream_)));
    const std::vector<bf16> part = d_part.download(stream_);
    for (int64_t i = 0; i < m; ++i) {
      if (!std::isnan(src[static_cast<size_t>(i)])) {
        EXPECT_EQ(bits_of(part[static_cast<size_t>(i)]), bf16_bits_rne(src[static_cast<size_t>(i)])) << "n " << m;
      }
    }
    for (int64_t i = m; i < m + 8; ++i)
      EXPECT_EQ(bits_of(part[static_cast<size_t>(i)]), bits_of(to_storage<bf16>(NAN))) << "written past n = " << m;
  }
  ASSERT_STATUS_OK((convert<float, bf16>(nullptr, 0, nullptr, stream_)));
}

TEST_F(CudaOpsTest, AddAndAccumulateAreExact) {
  std::mt19937 g(61);
  for (const int64_t n : {1, 7, 33, 100003}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const size_t un = static_cast<size_t>(n);
    const Input<float> a = random_input<float>(un, g), b = random_input<float>(un, g, 3.0);
    std::vector<float> sum(un);
    for (size_t i = 0; i < un; ++i) sum[i] = a.dev[i] + b.dev[i];  // one fp32 addition: exact to compare

    DeviceBuffer<float> d_a(a.dev), d_b(b.dev), d_out(nan_filled<float>(un));
    ASSERT_STATUS_OK(add(d_a.get(), d_b.get(), n, d_out.get(), stream_));
    EXPECT_SAME_BITS(d_out.download(stream_), sum, "add");
    ASSERT_STATUS_OK(add(d_a.get(), d_b.get(), n, d_a.get(), stream_));  // out aliases a
    EXPECT_SAME_BITS(d_a.download(stream_), sum, "add in place");
    DeviceBuffer<float> d_dst(a.dev);
    ASSERT_STATUS_OK(accumulate(d_b.get(), n, d_dst.get(), stream_));
    EXPECT_SAME_BITS(d_dst.download(stream_), sum, "accumulate");
  }
}

TYPED_TEST(CudaOpsT, AddBiasIsExact) {
  using T = TypeParam;
  std::mt19937 g(62);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {7, 24}, {33, 96}, {130, 136}}) {
    SCOPED_TRACE("rows x cols = " + shape_str({rows, cols}));
    const Input<T> y = random_input<T>(static_cast<size_t>(rows * cols), g), bias = random_input<T>(static_cast<size_t>(cols), g);
    std::vector<T> want(y.dev.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        want[i] = to_storage<T>(static_cast<float>(y.ref[i]) + static_cast<float>(bias.ref[static_cast<size_t>(c)]));
      }
    DeviceBuffer<T> d_y(y.dev), d_bias(bias.dev);
    ASSERT_STATUS_OK(add_bias<T>(d_y.get(), d_bias.get(), rows, cols, this->stream_));
    EXPECT_SAME_BITS(d_y.download(this->stream_), want, "add_bias: T(float(y) + float(bias))");
  }
}

TEST_F(CudaOpsTest, SumOfSquaresMatchesDouble) {
  std::mt19937 g(71);
  for (const int64_t n : {int64_t{1}, int64_t{7}, kSumSquaresChunk, kSumSquaresChunk + 1, 3 * kSumSquaresChunk + 123,
                          int64_t{1000003}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const Input<float> x = random_input<float>(static_cast<size_t>(n), g, 3.0);
    double ref = 0;
    for (double v : x.ref) ref += v * v;
    DeviceBuffer<float> d_x(x.dev);
    DeviceBuffer<double> d_scratch(static_cast<size_t>(std::max<int64_t>(sum_of_squares_scratch(n), 1)));
    DeviceBuffer<double> d_out(std::vector<double>{-1.0});  // overwritten, not added to
    ASSERT_STATUS_OK(sum_of_squares(d_x.get(), n, d_scratch.get(), d_out.get(), stream_));
    const double got = d_out.download(stream_)[0];
    // Each square is at worst an fp32 product (relative error 2^-24) of positive terms summed in double.
    EXPECT_LE(std::abs(got - ref) / ref, 1e-7) << "sum of squares " << got << " vs " << ref;
    ASSERT_STATUS_OK(sum_of_squares(d_x.get(), n, d_scratch.get(), d_out.get(), stream_));
    const double again = d_out.download(stream_)[0];
    EXPECT_EQ(std::bit_cast<uint64_t>(again), std::bit_cast<uint64_t>(got)) << "not deterministic";
  }
}

TYPED_TEST(CudaOpsT, ColumnSumAccumulateMatchesDouble) {
  using T = TypeParam;
  std::mt19937 g(72);
  // 1000, 5: 3 chunks; 40000 x 3: the most chunks (128) of 312 rows and a longer last one... of 316.
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 8}, {7, 24}, {33, 96}, {130, 136}, {1000, 5}, {3, 4100}, {40000, 3}, {600, 200}}) {
    SCOPED_TRACE("rows x cols = " + shape_str({rows, cols}));
    const Input<T> dy = random_input<T>(static_cast<size_t>(rows * cols), g);
    const Input<float> db0 = random_input<float>(static_cast<size_t>(cols), g);
    std::vector<double> ref = db0.ref;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) ref[static_cast<size_t>(c)] += dy.ref[static_cast<size_t>(r * cols + c)];
    DeviceBuffer<T> d_dy(dy.dev);
    DeviceBuffer<float> d_db(db0.dev);
    DeviceBuffer<char> d_cs(static_cast<size_t>(column_sum_scratch_bytes(cols)));
    ASSERT_STATUS_OK(column_sum_accumulate<T>(d_dy.get(), rows, cols, d_db.get(), d_cs.get(), this->stream_));
    const std::vector<float> db = d_db.download(this->stream_);
    EXPECT_REL_ERR_LE(to_doubles(db), ref, kShortReduceFp32, "column_sum_accumulate (fp32 sums on both paths)");
    // Adds only (no products to contract): the host emulation of the two-stage order gives the same bits.
    std::vector<float> order = db0.dev;
    column_sum_two_stage_host<float>([&](int64_t r, int64_t c) { return static_cast<float>(dy.ref[static_cast<size_t>(r * cols + c)]); },
                                     rows, cols, order.data());
    EXPECT_SAME_BITS(db, order, "column_sum_accumulate against its order on the host");
    d_db.upload(db0.dev);
    ASSERT_STATUS_OK(column_sum_accumulate<T>(d_dy.get(), rows, cols, d_db.get(), d_cs.get(), this->stream_));
    EXPECT_SAME_BITS(d_db.download(this->stream_), db, "column_sum_accumulate, second run");
  }
}

// =================================================================================================
// Cross-entropy, chunked over the vocabulary

TYPED_TEST(CudaOpsT, CrossEntropyChunkedMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(81);
  struct Case {
    int64_t n, vocab, chunk;
  };
  for (const Case c : {Case{1, 50, 16}, Case{7, 50, 50}, Case{5, 50, 3}, Case{33, 257, 64}, Case{130, 257, 100},
                       Case{33, 1000, 384}, Case{130, 1000, 1000}}) {
    SCOPED_TRACE("n x vocab, chunk = " + shape_str({c.n, c.vocab}) + ", " + std::to_string(c.chunk));
    const size_t n = static_cast<size_t>(c.n), nv = static_cast<size_t>(c.n * c.vocab);
    Input<float> logits = random_input<float>(nv, g, 3.0);
    // A row whose maximum is far above the rest (exp would overflow without the running max) and sits
    // in the last chunk, so the running sum must be rescaled.
    logits.dev[nv - 2] = 100.f;
    logits.ref[nv - 2] = 100.0;
    std::vector<int32_t> targets(n);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab - 1));
    for (size_t r = 0; r < n; ++r) targets[r] = (r % 4 == 3) ? cpu::kIgnoreIndex : tok(g);  // some rows ignored
    targets[0] = static_cast<int32_t>(c.vocab - 1);

    std::vector<double> lse_ref(n), row_loss(n), dlogits_ref(nv);
    cpu::CrossEntropyStats stats;
    ASSERT_STATUS_OK(cpu::cross_entropy_forward<double>(this->ctx_, logits.ref.data(), targets.data(), c.n, c.vocab,
                                                        lse_ref.data(), row_loss.data(), &stats));
    ASSERT_GT(stats.count, 0);
    const float grad_scale = static_cast<float>(1.0 / static_cast<double>(stats.count));
    ASSERT_STATUS_OK(cpu::cross_entropy_backward<double>(this->ctx_, logits.ref.data(), targets.data(), lse_ref.data(),
                                                         c.n, c.vocab, static_cast<double>(grad_scale),
                                                         dlogits_ref.data()));

    // The chunks as the LM head makes them: [n, vc] with row stride vc.
    std::vector<int64_t> v0s, vcs;
    std::vector<DeviceBuffer<float>> d_chunks;
    for (int64_t v0 = 0; v0 < c.vocab; v0 += c.chunk) {
      const int64_t vc = std::min(c.chunk, c.vocab - v0);
      std::vector<float> part(static_cast<size_t>(c.n * vc));
      for (int64_t r = 0; r < c.n; ++r)
        for (int64_t j = 0; j < vc; ++j)
          part[static_cast<size_t>(r * vc + j)] = logits.dev[static_cast<size_t>(r * c.vocab + v0 + j)];
      v0s.push_back(v0);
      vcs.push_back(vc);
      d_chunks.emplace_back(part);
    }
    DeviceBuffer<int32_t> d_targets(targets);
    // NaN in the running statistics: v0 == 0 must start them afresh.
    DeviceBuffer<float> d_max(nan_filled<float>(n)), d_sum(nan_filled<float>(n)), d_tl(nan_filled<float>(n)),
        d_lse(nan_filled<float>(n));
    DeviceBuffer<double> d_loss(std::vector<double>{1.25});   // added to
    DeviceBuffer<long long> d_count(std::vector<long long>{3});  // added to
    auto forward = [&] {
      for (size_t i = 0; i < d_chunks.size(); ++i)
        ASSERT_STATUS_OK(cross_entropy_chunk_stats(d_chunks[i].get(), c.n, vcs[i], v0s[i], d_targets.get(),
                                                   d_max.get(), d_sum.get(), d_tl.get(), this->stream_));
      ASSERT_STATUS_OK(cross_entropy_finish(d_max.get(), d_sum.get(), d_tl.get(), d_targets.get(), c.n, d_lse.get(),
                                            d_loss.get(), d_count.get(), this->stream_));
    };
    ASSERT_NO_FATAL_FAILURE(forward());
    const std::vector<float> lse = d_lse.download(this->stream_);
    const double loss_total = d_loss.download(this->stream_)[0];
    const double loss_sum = loss_total - 1.25;
    EXPECT_REL_ERR_LE(to_doubles(lse), lse_ref, kStatFp32, "cross-entropy lse");
    EXPECT_LE(std::abs(loss_sum - stats.loss_sum) / std::abs(stats.loss_sum), kShortReduceFp32)
        << "loss_sum " << loss_sum << " vs " << stats.loss_sum;
    EXPECT_EQ(d_count.download(this->stream_)[0], 3 + stats.count);

    // Backward, chunk by chunk, into the full [n, vocab] gradient.
    std::vector<T> dlogits = nan_filled<T>(nv);
    for (size_t i = 0; i < d_chunks.size(); ++i) {
      DeviceBuffer<T> d_dchunk(nan_filled<T>(static_cast<size_t>(c.n * vcs[i])));
      ASSERT_STATUS_OK(cross_entropy_chunk_grad<T>(d_chunks[i].get(), c.n, vcs[i], v0s[i], d_targets.get(),
                                                   d_lse.get(), grad_scale, d_dchunk.get(), this->stream_));
      const std::vector<T> part = d_dchunk.download(this->stream_);
      for (int64_t r = 0; r < c.n; ++r)
        for (int64_t j = 0; j < vcs[i]; ++j)
          dlogits[static_cast<size_t>(r * c.vocab + v0s[i] + j)] = part[static_cast<size_t>(r * vcs[i] + j)];
    }
    const std::vector<double> dl = to_doubles(dlogits);
    EXPECT_REL_ERR_LE(dl, dlogits_ref, bound_for<T>(dlogits_ref, kElementwiseFp32, kBf16CBackward),
                      "cross-entropy dlogits");
    for (size_t r = 0; r < n; ++r) {
      if (targets[r] != cpu::kIgnoreIndex) continue;
      for (int64_t j = 0; j < c.vocab; ++j)
        ASSERT_EQ(dl[r * static_cast<size_t>(c.vocab) + static_cast<size_t>(j)], 0.0)
            << "ignored row " << r << " has a nonzero gradient at " << j;
    }

    // Deterministic: the statistics again give the same bits.
    if (c.n < 33) continue;
    d_loss.upload({1.25});
    ASSERT_NO_FATAL_FAILURE(forward());
    EXPECT_SAME_BITS(d_lse.download(this->stream_), lse, "cross-entropy lse, second run");
    EXPECT_EQ(std::bit_cast<uint64_t>(d_loss.download(this->stream_)[0]), std::bit_cast<uint64_t>(loss_total))
        << "cross-entropy loss_sum, second run";
  }
}

// =================================================================================================
// GEMM (cuBLAS): gemm, gemm_strided_batched, linear_*

template <typename In, typename Out>
struct GemmTypes {
  using A = In;
  using C = Out;
};

template <typename P>
class CudaGemmT : public CudaOpsTest {};

struct GemmTypeNames {
  template <typename P>
  static std::string GetName(int) {
    return std::string(kIsBf16<typename P::A> ? "bf16" : "fp32") + "_" + (kIsBf16<typename P::C> ? "bf16" : "fp32");
  }
};
using GemmCombos = ::testing::Types<GemmTypes<float, float>, GemmTypes<bf16, bf16>, GemmTypes<bf16, float>>;
TYPED_TEST_SUITE(CudaGemmT, GemmCombos, GemmTypeNames);

// The bound of a GEMM output: bf16 storage, else fp32 accumulation of exact bf16 products, else fp32.
template <typename In, typename Out>
double gemm_bound(const std::vector<double>& ref) {
  if constexpr (kIsBf16<Out>)
    return std::max(kBf16C * bf16_rounding_err(ref), kGemmBf16In);
  else if constexpr (kIsBf16<In>)
    return kGemmBf16In;
  else
    return kGemmFp32;
}

// The [rows, cols] part of a matrix with leading dimension ld.
template <typename T>
std::vector<double> inner(const std::vector<T>& m, int64_t rows, int64_t cols, int64_t ld, int64_t offset = 0) {
  std::vector<double> r;
  r.reserve(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) r.push_back(as_double(m[static_cast<size_t>(offset + i * ld + j)]));
  return r;
}

TYPED_TEST(CudaGemmT, GemmAllTransposesMatchesCpu) {
  using A = typename TypeParam::A;
  using C = typename TypeParam::C;
  std::mt19937 g(91);
  struct Shape {
    int64_t m, n, k;
  };
  int counter = 0;
  for (const Shape s : {Shape{1, 1, 1}, Shape{7, 33, 5}, Shape{33, 17, 130}, Shape{130, 96, 257}, Shape{67, 130, 33}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const float beta : {0.f, 1.f}) {
          const int64_t pad = (counter++ % 3 == 1) ? 5 : 0;  // leading dimensions beyond the minimum
          const float alpha = beta == 0.f ? 1.f : 0.5f;
          SCOPED_TRACE("m x n x k = " + shape_str({s.m, s.n, s.k}) + (ta ? " A^T" : " A") + (tb ? " B^T" : " B") +
                       ", alpha " + std::to_string(alpha) + ", beta " + std::to_string(beta) + ", pad " +
                       std::to_string(pad));
          const int64_t a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k, lda = a_cols + pad;
          const int64_t b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n, ldb = b_cols + pad;
          const int64_t ldc = s.n + pad;
          const Input<A> a = random_matrix<A>(a_rows, a_cols, lda, g), b = random_matrix<A>(b_rows, b_cols, ldb, g);
          // beta 0: C holds NaN, which must be ignored; beta 1: C is added to.
          Input<C> c0 = random_matrix<C>(s.m, s.n, ldc, g);
          if (beta == 0.f) {
            c0.dev = nan_filled<C>(c0.dev.size());
            std::fill(c0.ref.begin(), c0.ref.end(), 0.0);
          }
          std::vector<double> ref = c0.ref;
          cpu::gemm<double>(this->ctx_, ta, tb, s.m, s.n, s.k, alpha, a.ref.data(), lda, b.ref.data(), ldb, beta,
                            ref.data(), ldc);
          DeviceBuffer<A> d_a(a.dev), d_b(b.dev);
          DeviceBuffer<C> d_c(c0.dev);
          ASSERT_STATUS_OK((gemm<A, C>(this->blas_, ta, tb, s.m, s.n, s.k, alpha, d_a.get(), lda, d_b.get(), ldb, beta,
                                       d_c.get(), ldc)));
          const std::vector<C> got = d_c.download(this->stream_);
          const std::vector<double> want = inner(ref, s.m, s.n, ldc);
          EXPECT_REL_ERR_LE(inner(got, s.m, s.n, ldc), want, (gemm_bound<A, C>(want)), "gemm");
          for (int64_t i = 0; i < s.m; ++i)
            for (int64_t j = s.n; j < ldc; ++j) {
              const size_t at = static_cast<size_t>(i * ldc + j);
              ASSERT_EQ(std::memcmp(&got[at], &c0.dev[at], sizeof(C)), 0) << "C's padding written at " << i << "," << j;
            }
        }
}

TYPED_TEST(CudaGemmT, GemmStridedBatchedMatchesCpu) {
  using A = typename TypeParam::A;
  using C = typename TypeParam::C;
  std::mt19937 g(92);
  const int64_t batch = 3;
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape s : {Shape{7, 33, 5}, Shape{33, 17, 130}, Shape{1, 40, 64}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        SCOPED_TRACE("batch 3 of m x n x k = " + shape_str({s.m, s.n, s.k}) + (ta ? " A^T" : " A") +
                     (tb ? " B^T" : " B"));
        const int64_t a_rows = ta ? s.k : s.m, lda = (ta ? s.m : s.k) + 2;
        const int64_t b_rows = tb ? s.n : s.k, ldb = (tb ? s.k : s.n) + 1;
        const int64_t ldc = s.n + 3;
        // Gaps between the batch entries (NaN on the device) that must be neither read nor written.
        const int64_t sa = a_rows * lda + 7, sb = b_rows * ldb + 5, sc = s.m * ldc + 9;
        const Input<A> a = random_batched<A>(batch, sa, a_rows, ta ? s.m : s.k, lda, g),
                       b = random_batched<A>(batch, sb, b_rows, tb ? s.k : s.n, ldb, g);
        const Input<C> c0 = random_batched<C>(batch, sc, s.m, s.n, ldc, g);
        const float alpha = 0.75f, beta = 1.f;
        std::vector<double> ref = c0.ref;
        for (int64_t i = 0; i < batch; ++i)
          cpu::gemm<double>(this->ctx_, ta, tb, s.m, s.n, s.k, alpha, a.ref.data() + i * sa, lda,
                            b.ref.data() + i * sb, ldb, beta, ref.data() + i * sc, ldc);
        DeviceBuffer<A> d_a(a.dev), d_b(b.dev);
        DeviceBuffer<C> d_c(c0.dev);
        ASSERT_STATUS_OK((gemm_strided_batched<A, C>(this->blas_, ta, tb, s.m, s.n, s.k, alpha, d_a.get(), lda, sa,
                                                     d_b.get(), ldb, sb, beta, d_c.get(), ldc, sc, batch)));
        const std::vector<C> got = d_c.download(this->stream_);
        for (int64_t i = 0; i < batch; ++i) {
          const std::vector<double> want = inner(ref, s.m, s.n, ldc, i * sc);
          EXPECT_REL_ERR_LE(inner(got, s.m, s.n, ldc, i * sc), want, (gemm_bound<A, C>(want)),
                            "gemm_strided_batched entry " + std::to_string(i));
        }
        // Everything outside the batch entries' [m, n] parts is untouched.
        std::vector<bool> inside(got.size(), false);
        for (int64_t i = 0; i < batch; ++i)
          for (int64_t r = 0; r < s.m; ++r)
            for (int64_t j = 0; j < s.n; ++j) inside[static_cast<size_t>(i * sc + r * ldc + j)] = true;
        int64_t touched = 0;
        for (size_t i = 0; i < got.size(); ++i)
          if (!inside[i] && std::memcmp(&got[i], &c0.dev[i], sizeof(C)) != 0) ++touched;
        EXPECT_EQ(touched, 0) << "elements outside the batch entries were written";
      }
}

// gemm_batched_2d on the attention's grid: 3 groups x 4 heads, the heads of a group sharing its B
// (inner stride 0), each problem's A and C at their own two-level offsets, aligned as gemm2 requires;
// alpha scales and beta 0 overwrites (the NaN-filled C must not leak through).
TYPED_TEST(CudaGemmT, GemmBatched2dMatchesCpu) {
  using A = typename TypeParam::A;
  using C = typename TypeParam::C;
  std::mt19937 g(94);
  const int64_t n_outer = 3, n_inner = 4, m = 8, n = 24, k = 16;
  for (const bool tb : {false, true}) {
    SCOPED_TRACE(tb ? "B^T" : "B");
    const int64_t lda = k, ldb = tb ? k : n, ldc = n, b_rows = tb ? n : k;
    const int64_t sa_i = m * lda, sa_o = n_inner * sa_i, sb_o = b_rows * ldb + 8, sc_i = m * ldc, sc_o = n_inner * sc_i;
    const Input<A> a = random_batched<A>(n_outer * n_inner, sa_i, m, k, lda, g);
    const Input<A> b = random_batched<A>(n_outer, sb_o, b_rows, tb ? k : n, ldb, g);
    const std::vector<C> c0 = nan_filled<C>(static_cast<size_t>(n_outer * sc_o));
    std::vector<double> ref(c0.size(), 0.0);
    for (int64_t o = 0; o < n_outer; ++o)
      for (int64_t i = 0; i < n_inner; ++i)
        cpu::gemm<double>(this->ctx_, false, tb, m, n, k, 0.5, a.ref.data() + o * sa_o + i * sa_i, lda, b.ref.data() + o * sb_o, ldb,
                          0.0, ref.data() + o * sc_o + i * sc_i, ldc);
    ASSERT_TRUE(batched_operand_aligned(reinterpret_cast<void*>(256), lda, sizeof(A), sa_o, sa_i));
    ASSERT_TRUE(batched_operand_aligned(reinterpret_cast<void*>(256), ldb, sizeof(A), sb_o, 0));
    ASSERT_TRUE(batched_operand_aligned(reinterpret_cast<void*>(256), ldc, sizeof(C), sc_o, sc_i));
    DeviceBuffer<A> d_a(a.dev), d_b(b.dev);
    DeviceBuffer<C> d_c(c0);
    DeviceBuffer<void*> d_ptrs(static_cast<size_t>(3 * n_outer * n_inner));
    ASSERT_STATUS_OK((gemm_batched_2d<A, C>(this->blas_, this->stream_, false, tb, m, n, k, 0.5f, d_a.get(), lda, sa_o, sa_i,
                                            d_b.get(), ldb, sb_o, 0, 0.0f, d_c.get(), ldc, sc_o, sc_i, n_outer, n_inner,
                                            d_ptrs.get())));
    const std::vector<C> got = d_c.download(this->stream_);
    EXPECT_REL_ERR_LE(to_doubles(got), ref, (gemm_bound<A, C>(ref)), "gemm_batched_2d");
  }
}

TYPED_TEST(CudaGemmT, LinearMatchesCpu) {
  using A = typename TypeParam::A;
  using C = typename TypeParam::C;
  std::mt19937 g(93);
  struct Shape {
    int64_t n, in, out;
  };
  for (const Shape s : {Shape{1, 8, 24}, Shape{7, 24, 8}, Shape{33, 96, 136}, Shape{130, 136, 96}, Shape{67, 40, 257}}) {
    SCOPED_TRACE("n x in x out = " + shape_str({s.n, s.in, s.out}));
    const size_t nin = static_cast<size_t>(s.n * s.in), nout = static_cast<size_t>(s.n * s.out),
                 wsz = static_cast<size_t>(s.out * s.in);
    const Input<A> x = random_input<A>(nin, g), w = random_input<A>(wsz, g), dy = random_input<A>(nout, g);
    const Input<C> y0 = random_input<C>(nout, g), dx0 = random_input<C>(nin, g);
    const Input<float> dw0 = random_input<float>(wsz, g);
    DeviceBuffer<A> d_x(x.dev), d_w(w.dev), d_dy(dy.dev);

    // Forward, beta 0 (overwrite; NaN ignored) and beta 1 (added to y: the residual).
    std::vector<double> y_ref(nout);
    cpu::linear_forward<double>(this->ctx_, x.ref.data(), w.ref.data(), nullptr, s.n, s.in, s.out, y_ref.data());
    for (const float beta : {0.f, 1.f}) {
      std::vector<double> want = y_ref;
      if (beta != 0.f)
        for (size_t i = 0; i < nout; ++i) want[i] += y0.ref[i];
      DeviceBuffer<C> d_y(beta != 0.f ? y0.dev : nan_filled<C>(nout));
      ASSERT_STATUS_OK((linear_forward<A, C>(this->blas_, d_x.get(), d_w.get(), s.n, s.in, s.out, d_y.get(), beta)));
      EXPECT_REL_ERR_LE(to_doubles(d_y.download(this->stream_)), want, (gemm_bound<A, C>(want)),
                        "linear_forward, beta " + std::to_string(beta));
    }

    // Backward data: dx = dy W, overwritten or accumulated.
    for (const bool acc : {false, true}) {
      std::vector<double> want = acc ? dx0.ref : std::vector<double>(nin, 0.0);
      cpu::linear_backward<double>(this->ctx_, dy.ref.data(), x.ref.data(), w.ref.data(), s.n, s.in, s.out, want.data(),
                                   acc, nullptr, nullptr);
      DeviceBuffer<C> d_dx(acc ? dx0.dev : nan_filled<C>(nin));
      ASSERT_STATUS_OK(
          (linear_backward_data<A, C>(this->blas_, d_dy.get(), d_w.get(), s.n, s.in, s.out, d_dx.get(), acc)));
      EXPECT_REL_ERR_LE(to_doubles(d_dx.download(this->stream_)), want, (gemm_bound<A, C>(want)),
                        std::string("linear_backward_data, ") + (acc ? "accumulate" : "overwrite"));
    }

    // Backward weight: dW += dy^T x in fp32.
    std::vector<double> dw_ref = dw0.ref;
    cpu::linear_backward<double>(this->ctx_, dy.ref.data(), x.ref.data(), w.ref.data(), s.n, s.in, s.out, nullptr,
                                 false, dw_ref.data(), nullptr);
    DeviceBuffer<float> d_dw(dw0.dev);
    ASSERT_STATUS_OK((linear_backward_weight<A>(this->blas_, d_dy.get(), d_x.get(), s.n, s.in, s.out, d_dw.get())));
    EXPECT_REL_ERR_LE(to_doubles(d_dw.download(this->stream_)), dw_ref, (gemm_bound<A, float>(dw_ref)),
                      "linear_backward_weight (accumulated)");
  }
}

// =================================================================================================
// Attention

// log-sum-exp of each row's scaled causal scores, [B, n_heads, T], in double.
std::vector<double> attention_lse(const cpu::AttentionShape& s, const std::vector<double>& q,
                                  const std::vector<double>& k) {
  const int64_t rep = s.n_heads / s.n_kv_heads, hd = s.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> lse(static_cast<size_t>(s.batch * s.n_heads * s.seq)), sc(static_cast<size_t>(s.seq));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.n_heads; ++h)
      for (int64_t i = 0; i < s.seq; ++i) {
        const double* qi = q.data() + ((b * s.seq + i) * s.n_heads + h) * hd;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const double* kj = k.data() + ((b * s.seq + j) * s.n_kv_heads + h / rep) * hd;
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += qi[d] * kj[d];
          sc[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, sc[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[static_cast<size_t>(j)] - mx);
        lse[static_cast<size_t>((b * s.n_heads + h) * s.seq + i)] = mx + std::log(sum);
      }
  return lse;
}

TYPED_TEST(CudaOpsT, AttentionMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(101);
  // MHA, GQA 4/2 and 6/2, MQA; head_dim 40, 64, 128; seq 1 (one key), 5, 33, 67, 130.
  for (const AttnDims d : {AttnDims{1, 1, 4, 2, 64}, AttnDims{2, 5, 6, 2, 40}, AttnDims{1, 67, 4, 2, 128},
                           AttnDims{2, 130, 3, 3, 64}, AttnDims{1, 130, 6, 2, 40}, AttnDims{1, 33, 4, 1, 128}}) {
    const std::string dims = shape_str({d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim});
    const cpu::AttentionShape sh{d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim};
    const size_t nq = static_cast<size_t>(d.batch * d.seq * d.n_heads * d.head_dim),
                 nkv = static_cast<size_t>(d.batch * d.seq * d.n_kv_heads * d.head_dim),
                 nl = static_cast<size_t>(d.batch * d.n_heads * d.seq);
    const Input<T> q = random_input<T>(nq, g, 1.5), k = random_input<T>(nkv, g, 1.5), v = random_input<T>(nkv, g),
                   dout = random_input<T>(nq, g);

    // Reference in double: out, probabilities, lse; then dq/dk/dv.
    std::vector<double> out_ref(nq), probs(static_cast<size_t>(cpu::attention_probs_elems(sh)));
    ASSERT_STATUS_OK(cpu::attention_forward<double>(this->ctx_, sh, q.ref.data(), k.ref.data(), v.ref.data(),
                                                    out_ref.data(), probs.data()));
    const std::vector<double> lse_ref = attention_lse(sh, q.ref, k.ref);
    std::vector<double> dq_ref(nq), dk_ref(nkv), dv_ref(nkv), ws_ref(probs.size());
    ASSERT_STATUS_OK(cpu::attention_backward<double>(this->ctx_, sh, q.ref.data(), k.ref.data(), v.ref.data(),
                                                     probs.data(), dout.ref.data(), dq_ref.data(), dk_ref.data(),
                                                     dv_ref.data(), ws_ref.data()));
    // Backward's saved inputs: the reference's out and lse in their storage types.
    const std::vector<T> out_in = storage_of<T>(out_ref);
    const std::vector<float> lse_in = to_floats(lse_ref);
    // With one key dq and dk are exactly 0: measure them against dv's scale instead.
    const double grad_floor = l2(dv_ref);

    DeviceBuffer<T> d_q(q.dev), d_k(k.dev), d_v(v.dev), d_dout(dout.dev), d_out_in(out_in);
    DeviceBuffer<float> d_lse_in(lse_in);

    // Block rows: from small workspace budgets (fewer rows than seq, not dividing it) and all of seq.
    std::vector<int64_t> rows_list;
    for (int64_t want : {int64_t{16}, int64_t{40}}) {
      const int64_t budget = attention_workspace_bytes(d, std::min(want, d.seq));
      const int64_t rows = attention_block_rows(d, budget);
      ASSERT_GE(rows, 1);
      ASSERT_LE(rows, d.seq);
      rows_list.push_back(rows);
    }
    rows_list.push_back(d.seq);
    std::sort(rows_list.begin(), rows_list.end());
    rows_list.erase(std::unique(rows_list.begin(), rows_list.end()), rows_list.end());

    for (const int64_t rows : rows_list) {
      SCOPED_TRACE("batch x seq x heads x kv_heads x head_dim = " + dims + ", rows " + std::to_string(rows));
      DeviceBuffer<unsigned char> ws(static_cast<size_t>(attention_workspace_bytes(d, rows)));
      DeviceBuffer<T> d_out(nan_filled<T>(nq));
      DeviceBuffer<float> d_lse(nan_filled<float>(nl));
      ASSERT_STATUS_OK(attention_forward<T>(this->blas_, d, d_q.get(), d_k.get(), d_v.get(), d_out.get(), d_lse.get(),
                                            ws.get(), rows, this->stream_));
      const std::vector<T> out = d_out.download(this->stream_);
      const std::vector<float> lse = d_lse.download(this->stream_);
      EXPECT_REL_ERR_LE(to_doubles(out), out_ref, bound_for<T>(out_ref, kAttnFwdFp32, kBf16C), "attention out");
      EXPECT_REL_ERR_LE(to_doubles(lse), lse_ref, bound_for<T>(lse_ref, kAttnFwdFp32, kBf16C), "attention lse");

      // dq/dk/dv start as NaN: they are overwritten.
      DeviceBuffer<float> d_dq(nan_filled<float>(nq)), d_dk(nan_filled<float>(nkv)), d_dv(nan_filled<float>(nkv));
      auto backward = [&] {
        ASSERT_STATUS_OK(attention_backward<T>(this->blas_, d, d_q.get(), d_k.get(), d_v.get(), d_out_in.get(),
                                               d_dout.get(), d_lse_in.get(), d_dq.get(), d_dk.get(), d_dv.get(),
                                               ws.get(), rows, this->stream_));
      };
      ASSERT_NO_FATAL_FAILURE(backward());
      const std::vector<float> dq = d_dq.download(this->stream_), dk = d_dk.download(this->stream_),
                               dv = d_dv.download(this->stream_);
      const std::vector<double> dqd = to_doubles(dq), dkd = to_doubles(dk), dvd = to_doubles(dv);
      for (const auto& [name, got, ref] : {std::tuple{"dq", &dqd, &dq_ref}, std::tuple{"dk", &dkd, &dk_ref},
                                           std::tuple{"dv", &dvd, &dv_ref}}) {
        const double bound = bound_for<T>(*ref, kAttnBwdFp32, kBf16CBackward);
        const Cmp cmp = compare(*got, *ref, l2(*ref) == 0 ? grad_floor : 0);
        EXPECT_LE(cmp.e, bound) << "attention " << name << ": normalised error e = " << cmp.e << " > bound " << bound
                                << " (" << cmp.where << ")";
      }

      // Deterministic: forward and backward again give the same bits.
      if (d.seq < 33) continue;
      ASSERT_STATUS_OK(attention_forward<T>(this->blas_, d, d_q.get(), d_k.get(), d_v.get(), d_out.get(), d_lse.get(),
                                            ws.get(), rows, this->stream_));
      EXPECT_SAME_BITS(d_out.download(this->stream_), out, "attention out, second run");
      EXPECT_SAME_BITS(d_lse.download(this->stream_), lse, "attention lse, second run");
      ASSERT_NO_FATAL_FAILURE(backward());
      EXPECT_SAME_BITS(d_dq.download(this->stream_), dq, "attention dq, second run");
      EXPECT_SAME_BITS(d_dk.download(this->stream_), dk, "attention dk, second run");
      EXPECT_SAME_BITS(d_dv.download(this->stream_), dv, "attention dv, second run");
    }
  }
}


// gpt-oss's attention: sliding windows (narrower than a block, wider than the sequence) and sinks,
// against the CPU op in double (its sink probabilities give the reference lse: sink - log p_sink),
// forward and backward (d sinks accumulated onto 0.25), for several block sizes; deterministic.
TYPED_TEST(CudaOpsT, AttentionWithSinksAndWindowMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(103);
  struct Case {
    AttnDims d;
    bool sinks;
  };
  for (Case c : {Case{AttnDims{1, 67, 4, 2, 64, 16}, true}, Case{AttnDims{2, 33, 6, 2, 40, 5}, true},
                 Case{AttnDims{1, 50, 4, 1, 64, 128}, true}, Case{AttnDims{2, 40, 4, 4, 64, 0}, true},
                 Case{AttnDims{1, 130, 4, 2, 64, 7}, false}}) {
    const AttnDims d = c.d;
    const std::string dims = shape_str({d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim}) + ", window " +
                             std::to_string(d.window) + (c.sinks ? ", sinks" : "");
    const cpu::AttentionShape sh{d.batch, d.seq, d.n_heads, d.n_kv_heads, d.head_dim, d.window};
    const size_t nq = static_cast<size_t>(d.batch * d.seq * d.n_heads * d.head_dim),
                 nkv = static_cast<size_t>(d.batch * d.seq * d.n_kv_heads * d.head_dim),
                 nl = static_cast<size_t>(d.batch * d.n_heads * d.seq), nh = static_cast<size_t>(d.n_heads);
    const Input<T> q = random_input<T>(nq, g, 1.5), k = random_input<T>(nkv, g, 1.5), v = random_input<T>(nkv, g),
                   dout = random_input<T>(nq, g), sinks = random_input<T>(nh, g, 2.0);
    const double* sk = c.sinks ? sinks.ref.data() : nullptr;
    std::vector<double> out_ref(nq), probs(static_cast<size_t>(cpu::attention_probs_elems(sh))), sink_p(nl), sink_rows(nl);
    ASSERT_STATUS_OK(cpu::attention_forward<double>(this->ctx_, sh, q.ref.data(), k.ref.data(), v.ref.data(), out_ref.data(),
                                                    probs.data(), sk, c.sinks ? sink_p.data() : nullptr));
    // lse: with sinks from their probabilities; without, from the scores over the window, in double.
    std::vector<double> lse_ref(nl);
    const int64_t rep = d.n_heads / d.n_kv_heads;
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t h = 0; h < d.n_heads; ++h)
        for (int64_t t = 0; t < d.seq; ++t) {
          const size_t at = static_cast<size_t>((b * d.n_heads + h) * d.seq + t);
          if (c.sinks) {
            lse_ref[at] = sinks.ref[static_cast<size_t>(h)] - std::log(sink_p[at]);
            continue;
          }
          std::vector<double> sc;
          for (int64_t j = 0; j <= t; ++j) {
            if (d.window > 0 && j <= t - d.window) continue;
            double dot = 0;
            for (int64_t x = 0; x < d.head_dim; ++x)
              dot += q.ref[static_cast<size_t>(((b * d.seq + t) * d.n_heads + h) * d.head_dim + x)] *
                     k.ref[static_cast<size_t>(((b * d.seq + j) * d.n_kv_heads + h / rep) * d.head_dim + x)];
            sc.push_back(dot / std::sqrt(static_cast<double>(d.head_dim)));
          }
          const double mx = *std::max_element(sc.begin(), sc.end());
          double sum = 0;
          for (double e : sc) sum += std::exp(e - mx);
          lse_ref[at] = mx + std::log(sum);
        }
    std::vector<double> dq_ref(nq), dk_ref(nkv), dv_ref(nkv), ws_ref(probs.size()), dsink_ref(nh, 0.25);
    ASSERT_STATUS_OK(cpu::attention_backward<double>(this->ctx_, sh, q.ref.data(), k.ref.data(), v.ref.data(), probs.data(),
                                                     dout.ref.data(), dq_ref.data(), dk_ref.data(), dv_ref.data(),
                                                     ws_ref.data(), c.sinks ? sink_p.data() : nullptr,
                                                     c.sinks ? dsink_ref.data() : nullptr,
                                                     c.sinks ? sink_rows.data() : nullptr));
    const std::vector<T> out_in = storage_of<T>(out_ref);
    const std::vector<float> lse_in = to_floats(lse_ref);
    DeviceBuffer<T> d_q(q.dev), d_k(k.dev), d_v(v.dev), d_dout(dout.dev), d_out_in(out_in), d_sinks(sinks.dev);
    DeviceBuffer<float> d_lse_in(lse_in);
    const T* dev_sinks = c.sinks ? d_sinks.get() : nullptr;
    for (const int64_t rows : {int64_t{16}, int64_t{23}, d.seq}) {
      if (rows > d.seq) continue;
      SCOPED_TRACE(dims + ", rows " + std::to_string(rows));
      DeviceBuffer<unsigned char> ws(static_cast<size_t>(attention_workspace_bytes(d, rows)));
      DeviceBuffer<T> d_out(nan_filled<T>(nq));
      DeviceBuffer<float> d_lse(nan_filled<float>(nl));
      ASSERT_STATUS_OK(attention_forward<T>(this->blas_, d, d_q.get(), d_k.get(), d_v.get(), d_out.get(), d_lse.get(), ws.get(),
                                            rows, this->stream_, dev_sinks));
      const std::vector<T> out = d_out.download(this->stream_);
      const std::vector<float> lse = d_lse.download(this->stream_);
      EXPECT_REL_ERR_LE(to_doubles(out), out_ref, bound_for<T>(out_ref, kAttnFwdFp32, kBf16C), "attention out");
      EXPECT_REL_ERR_LE(to_doubles(lse), lse_ref, bound_for<T>(lse_ref, kAttnFwdFp32, kBf16C), "attention lse");
      DeviceBuffer<float> d_dq(nan_filled<float>(nq)), d_dk(nan_filled<float>(nkv)), d_dv(nan_filled<float>(nkv)),
          d_dsink(std::vector<float>(nh, 0.25f));
      ASSERT_STATUS_OK(attention_backward<T>(this->blas_, d, d_q.get(), d_k.get(), d_v.get(), d_out_in.get(), d_dout.get(),
                                             d_lse_in.get(), d_dq.get(), d_dk.get(), d_dv.get(), ws.get(), rows, this->stream_,
                                             dev_sinks, c.sinks ? d_dsink.get() : nullptr));
      const std::vector<float> dq = d_dq.download(this->stream_), dk = d_dk.download(this->stream_),
                               dv = d_dv.download(this->stream_), dsink = d_dsink.download(this->stream_);
      const std::vector<double> dqd = to_doubles(dq), dkd = to_doubles(dk), dvd = to_doubles(dv), dsd = to_doubles(dsink);
      for (const auto& [name, got, ref] : {std::tuple{"dq", &dqd, &dq_ref}, std::tuple{"dk", &dkd, &dk_ref},
                                           std::tuple{"dv", &dvd, &dv_ref}, std::tuple{"d sinks", &dsd, &dsink_ref}}) {
        const double bound = bound_for<T>(*ref, kAttnBwdFp32, kBf16CBackward);
        const Cmp cmp = compare(*got, *ref);
        EXPECT_LE(cmp.e, bound) << "attention " << name << ": normalised error e = " << cmp.e << " > bound " << bound << " ("
                                << cmp.where << ")";
      }
      // Deterministic: the backward again (d sinks from 0.25 again) gives the same bits.
      DeviceBuffer<float> d_dsink2(std::vector<float>(nh, 0.25f));
      ASSERT_STATUS_OK(attention_backward<T>(this->blas_, d, d_q.get(), d_k.get(), d_v.get(), d_out_in.get(), d_dout.get(),
                                             d_lse_in.get(), d_dq.get(), d_dk.get(), d_dv.get(), ws.get(), rows, this->stream_,
                                             dev_sinks, c.sinks ? d_dsink2.get() : nullptr));
      EXPECT_SAME_BITS(d_dk.download(this->stream_), dk, "attention dk, second run");
      EXPECT_SAME_BITS(d_dsink2.download(this->stream_), dsink, "attention d sinks, second run");
    }
  }
}

// =================================================================================================
// Mixture-of-Experts (moe.cuh, grouped_gemm.cuh) and Qwen3's per-head q/k norm.

TEST(CudaHostSide, MoeScratchAndPointerSlotsCoverEveryChunkAndExpert) {
  // One count per expert for every started chunk of 256 slots; three pointers (A, B, C) per expert.
  EXPECT_EQ(moe_permute_scratch_ints(0, 8), 0);
  EXPECT_EQ(moe_permute_scratch_ints(1, 8), 8);
  EXPECT_EQ(moe_permute_scratch_ints(256, 8), 8);
  EXPECT_EQ(moe_permute_scratch_ints(257, 128), 2 * 128);
  EXPECT_EQ(moe_permute_scratch_ints(8192 * 8, 128), 256 * 128);
  EXPECT_EQ(grouped_gemm_pointer_slots(8), 24);
}

// The grouped call's operands must start on 16-byte boundaries with leading dimensions a multiple of
// 16 bytes (issue 31): a bf16 expert weight behind gpt-oss's 4-element sinks (8 bytes) does not.
TEST(CudaHostSide, ColumnSumChunksCoverEveryRowOnce) {
  for (int64_t rows : {int64_t{1}, int64_t{255}, int64_t{256}, int64_t{511}, int64_t{512}, int64_t{2100}, int64_t{32768},
                       int64_t{40000}, int64_t{1} << 20, int64_t{3} << 20}) {
    const int64_t chunks = column_sum_chunks(rows), chunk = column_sum_chunk_rows(rows);
    SCOPED_TRACE("rows " + std::to_string(rows));
    EXPECT_GE(chunks, 1);
    EXPECT_LE(chunks, kColumnSumMaxChunks);
    EXPECT_GE(chunks * chunk, rows) << "every row in a chunk";
    EXPECT_LT((chunks - 1) * chunk, rows) << "the last chunk is not empty";
    EXPECT_GE(chunk, std::min<int64_t>(rows, kColumnSumMinChunkRows)) << "chunks long enough to pay for their partials";
  }
  EXPECT_EQ(column_sum_chunks(1 << 20), kColumnSumMaxChunks);
  EXPECT_EQ(column_sum_chunk_rows(1 << 20), 8192);
}

TEST(CudaHostSide, GroupedGemmOperandsMustBeOn16ByteBoundaries) {
  alignas(16) static unsigned char buf[256];
  EXPECT_TRUE(grouped_operand_aligned(buf, 2880, 2)) << "a 16-byte boundary, 2880 bf16 columns (5760 B)";
  EXPECT_TRUE(grouped_operand_aligned(buf + 64, 4, 4)) << "4 fp32 columns: 16 B";
  EXPECT_FALSE(grouped_operand_aligned(buf + 8, 2880, 2)) << "a bf16 weight after 4 bf16 sinks";
  EXPECT_FALSE(grouped_operand_aligned(buf + 4, 64, 4)) << "an fp32 matrix 4 bytes off";
  EXPECT_FALSE(grouped_operand_aligned(buf, 2884, 2)) << "rows of 5768 B: the second row is 8 bytes off";
  EXPECT_FALSE(grouped_operand_aligned(buf, 6, 2)) << "rows of 12 B";
}

// Issue 31, row 5: a kernel's fault surfaces at the next call that waits (a copy thread's
// synchronize, say), which would be blamed for it. The error says so and names the ways to find the
// kernel; an ordinary API error (a bad argument of this very call) does not.
TEST(CudaHostSide, AnAsynchronousFaultIsNotBlamedOnTheCallThatReportsIt) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorMisalignedAddress, cudaErrorLaunchFailure}) {
    const std::string m = megatrain::cuda::detail::cuda_status(e, "cudaStreamSynchronize(copy)", "x.cpp", 7).message();
    EXPECT_NE(m.find("cudaStreamSynchronize(copy) failed at x.cpp:7"), std::string::npos) << m;
    EXPECT_NE(m.find(cudaGetErrorName(e)), std::string::npos) << m;
    EXPECT_NE(m.find("a kernel that ran before this call"), std::string::npos) << m;
    EXPECT_NE(m.find("CUDA_LAUNCH_BLOCKING=1"), std::string::npos) << m;
    EXPECT_NE(m.find("compute-sanitizer"), std::string::npos) << m;
  }
  const std::string m = megatrain::cuda::detail::cuda_status(cudaErrorInvalidValue, "cudaMemcpyAsync(a)", "x.cpp", 9).message();
  EXPECT_NE(m.find("cudaErrorInvalidValue"), std::string::npos) << m;
  EXPECT_EQ(m.find("CUDA_LAUNCH_BLOCKING"), std::string::npos) << m;
}

// Expert indices with a skew: expert 0 is frequent, expert e-1 never occurs (an empty group), and a
// token's k choices are distinct, as the router makes them.
std::vector<int32_t> random_routes(int64_t n, int64_t e, int64_t k, std::mt19937& g) {
  std::vector<int32_t> ex(static_cast<size_t>(n * k));
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(e - 2));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t x;
      bool taken;
      do {
        x = (j == 0 && t % 3 == 0) ? 0 : d(g);
        taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || ex[static_cast<size_t>(t * k + i)] == x;
      } while (taken);
      ex[static_cast<size_t>(t * k + j)] = x;
    }
  return ex;
}

// The sort as the GPU's grid runs it (moe_math.h's steps, chunk by chunk), emulated on the host.
void emulate_permute(const std::vector<int32_t>& ex, int64_t e, std::vector<int32_t>& off, std::vector<int32_t>& perm,
                     std::vector<int32_t>& row) {
  namespace mm = moe_math;
  const int64_t slots = static_cast<int64_t>(ex.size()), chunks = (slots + mm::kChunk - 1) / mm::kChunk;
  const int ei = static_cast<int>(e);
  std::vector<int32_t> counts(static_cast<size_t>(chunks * e)), first(static_cast<size_t>(e));
  off.assign(static_cast<size_t>(e + 1), -7);
  perm.assign(ex.size(), -7);
  row.assign(ex.size(), -7);
  auto chunk_of = [&](int64_t b) {
    std::vector<int32_t> c(mm::kChunk);
    for (int i = 0; i < mm::kChunk; ++i) c[static_cast<size_t>(i)] = b * mm::kChunk + i < slots ? ex[static_cast<size_t>(b * mm::kChunk + i)] : -1;
    return c;
  };
  for (int64_t b = 0; b < chunks; ++b) {
    const std::vector<int32_t> c = chunk_of(b);
    for (int x = 0; x < ei; ++x) counts[static_cast<size_t>(b * e + x)] = mm::chunk_count(c.data(), x);
  }
  for (int x = 0; x < ei; ++x) first[static_cast<size_t>(x)] = mm::expert_total(counts.data(), chunks, ei, x);
  mm::scan_totals(first.data(), ei, slots, off.data());
  for (int x = 0; x < ei; ++x) mm::first_rows(counts.data(), chunks, ei, x, first[static_cast<size_t>(x)]);
  for (int64_t b = 0; b < chunks; ++b) {
    const std::vector<int32_t> c = chunk_of(b);
    for (int i = 0; i < mm::kChunk && b * mm::kChunk + i < slots; ++i) {
      const int32_t r = counts[static_cast<size_t>(b * e + c[static_cast<size_t>(i)])] + mm::rank_in_chunk(c.data(), i);
      perm[static_cast<size_t>(r)] = static_cast<int32_t>(b * mm::kChunk + i);
      row[static_cast<size_t>(b * mm::kChunk + i)] = r;
    }
  }
}

TEST(CudaHostSide, MoeSortAsTheGridRunsItEqualsTheCpuSort) {
  std::mt19937 g(75);
  for (const auto& [n, e, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 2}, {128, 8, 2}, {129, 8, 2}, {1000, 8, 2},
                               {600, 128, 8}, {5000, 60, 4}}) {
    SCOPED_TRACE("n, e, k = " + shape_str({n, e, k}));
    const std::vector<int32_t> ex = random_routes(n, e, k, g);
    std::vector<int32_t> off_ref(static_cast<size_t>(e + 1)), perm_ref(ex.size()), row_ref(ex.size());
    cpu::moe_permute(ex.data(), n, k, e, off_ref.data(), perm_ref.data());
    for (size_t r = 0; r < ex.size(); ++r) row_ref[static_cast<size_t>(perm_ref[r])] = static_cast<int32_t>(r);
    std::vector<int32_t> off, perm, row;
    emulate_permute(ex, e, off, perm, row);
    EXPECT_EQ(off, off_ref);
    EXPECT_EQ(perm, perm_ref);
    EXPECT_EQ(row, row_ref);
  }
}

// A NaN router logit (a diverged run) must not send a slot to a non-existent expert (issue 31,
// row 9): the repeated selection takes the first untaken expert before comparing, so every index
// stays in [0, e), distinct within a token, and the GPU's routing equals the CPU op's.
TEST(CudaHostSide, MoeRoutingWithNanLogitsKeepsEveryExpertIndexValid) {
  cpu::CpuContext ctx(1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t e = 8, k = 2;
  // Token 0: one NaN; token 1: all NaN; token 2: NaN first and last; token 3: an infinity.
  std::vector<float> z = {0.1f, nan, 0.3f, 0.2f, 0.0f, 0.5f, 0.4f, 0.6f,
                          nan,  nan, nan,  nan,  nan,  nan,  nan,  nan,
                          nan,  0.2f, 0.3f, 0.9f, 0.1f, 0.0f, 0.5f, nan,
                          0.1f, std::numeric_limits<float>::infinity(), 0.3f, 0.2f, 0.0f, 0.5f, 0.4f, 0.6f};
  const int64_t n = static_cast<int64_t>(z.size()) / e;
  for (bool renorm : {true, false}) {
    std::vector<int32_t> ex_ref(static_cast<size_t>(n * k)), ex(ex_ref.size());
    std::vector<float> w_ref(ex_ref.size()), p_ref(z.size()), w(ex_ref.size()), p(z.size());
    cpu::moe_route_forward<float>(ctx, z.data(), n, e, k, renorm, ex_ref.data(), w_ref.data(), p_ref.data());
    for (int64_t t = 0; t < n; ++t)
      moe_math::route_forward_token(z.data() + t * e, static_cast<int>(e), static_cast<int>(k), renorm, ex.data() + t * k,
                                    w.data() + t * k, p.data() + t * e);
    EXPECT_EQ(ex, ex_ref);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t x = ex[static_cast<size_t>(t * k + j)];
        EXPECT_GE(x, 0) << "token " << t;
        EXPECT_LT(x, e) << "token " << t;
      }
      EXPECT_NE(ex[static_cast<size_t>(t * k)], ex[static_cast<size_t>(t * k + 1)]) << "token " << t;
    }
  }
}

TEST(CudaHostSide, MoeRoutingAsTheGpuRunsItEqualsTheCpuOpBitForBit) {
  // moe_math.h's per-token functions, run on the host, against cpu::moe_route_forward/backward in
  // fp32: the same operations in the same order (only expf differs on the GPU), so the same bits.
  std::mt19937 g(76);
  cpu::CpuContext ctx(1);
  for (const auto& [n, e, k, renorm] : {std::tuple<int64_t, int64_t, int64_t, bool>{37, 8, 2, true}, {37, 8, 2, false},
                                        {50, 128, 8, true}, {9, 4, 4, false}}) {
    SCOPED_TRACE("n, e, k = " + shape_str({n, e, k}) + (renorm ? " renorm" : ""));
    const size_t ne = static_cast<size_t>(n * e), nk = static_cast<size_t>(n * k);
    Input<float> z = random_input<float>(ne, g, 2.0);
    for (int64_t x = 0; x < e; ++x) z.dev[static_cast<size_t>(x)] = 0.5f;  // token 0: all tied
    std::vector<int32_t> ex_ref(nk), ex(nk);
    std::vector<float> w_ref(nk), p_ref(ne), w(nk), p(ne);
    cpu::moe_route_forward<float>(ctx, z.dev.data(), n, e, k, renorm, ex_ref.data(), w_ref.data(), p_ref.data());
    for (int64_t t = 0; t < n; ++t)
      moe_math::route_forward_token(z.dev.data() + t * e, static_cast<int>(e), static_cast<int>(k), renorm, ex.data() + t * k,
                                    w.data() + t * k, p.data() + t * e);
    EXPECT_EQ(ex, ex_ref);
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ(ex[static_cast<size_t>(j)], j) << "ties go to the lower index";
    EXPECT_SAME_BITS(p, p_ref, "probabilities");
    EXPECT_SAME_BITS(w, w_ref, "combine weights");
    const Input<float> dw = random_input<float>(nk, g), c = random_input<float>(static_cast<size_t>(e), g, 0.1);
    for (bool with_c : {false, true}) {
      std::vector<float> dz_ref(ne), dz(ne);
      cpu::moe_route_backward<float>(ctx, p_ref.data(), ex_ref.data(), w_ref.data(), dw.dev.data(), with_c ? c.dev.data() : nullptr, n,
                                     e, k, renorm, dz_ref.data());
      for (int64_t t = 0; t < n; ++t)
        moe_math::route_backward_token(p.data() + t * e, ex.data() + t * k, w.data() + t * k, dw.dev.data() + t * k,
                                       with_c ? c.dev.data() : nullptr, static_cast<int>(e), static_cast<int>(k), renorm,
                                       dz.data() + t * e);
      EXPECT_SAME_BITS(dz, dz_ref, with_c ? "logit gradient with the load-balancing term" : "logit gradient");
    }
  }
}

TEST_F(CudaOpsTest, MoePermuteEqualsTheCpuSortExactly) {
  std::mt19937 g(71);
  struct Case {
    int64_t n, e, k;
  };
  // Slot counts below, at and across the 256-slot chunks; Qwen3-30B-A3B's 128 experts, top-8.
  for (const Case c : {Case{1, 4, 2}, Case{128, 8, 2}, Case{129, 8, 2}, Case{1000, 8, 2}, Case{600, 128, 8}}) {
    SCOPED_TRACE("n, e, k = " + shape_str({c.n, c.e, c.k}));
    const int64_t slots = c.n * c.k;
    const std::vector<int32_t> ex = random_routes(c.n, c.e, c.k, g);
    std::vector<int32_t> off_ref(static_cast<size_t>(c.e + 1)), perm_ref(static_cast<size_t>(slots));
    cpu::moe_permute(ex.data(), c.n, c.k, c.e, off_ref.data(), perm_ref.data());
    std::vector<int32_t> row_ref(static_cast<size_t>(slots));
    for (int64_t r = 0; r < slots; ++r) row_ref[static_cast<size_t>(perm_ref[static_cast<size_t>(r)])] = static_cast<int32_t>(r);
    DeviceBuffer<int32_t> d_ex(ex), d_off(std::vector<int32_t>(off_ref.size(), -7)), d_perm(std::vector<int32_t>(perm_ref.size(), -7)),
        d_row(std::vector<int32_t>(row_ref.size(), -7)),
        d_scratch(std::vector<int32_t>(static_cast<size_t>(moe_permute_scratch_ints(slots, c.e)), -7));
    ASSERT_STATUS_OK(moe_permute(d_ex.get(), slots, c.e, d_off.get(), d_perm.get(), d_row.get(), d_scratch.get(), stream_));
    EXPECT_EQ(d_off.download(stream_), off_ref);
    EXPECT_EQ(d_perm.download(stream_), perm_ref);
    EXPECT_EQ(d_row.download(stream_), row_ref);
    EXPECT_EQ(off_ref[static_cast<size_t>(c.e)] - off_ref[static_cast<size_t>(c.e - 1)], 0) << "the last expert is empty";
  }
  const std::vector<int32_t> one{0};
  DeviceBuffer<int32_t> d1(one), d_off(2), d_perm(1), d_row(1), d_scr(static_cast<size_t>(kMoeMaxExperts + 1));
  EXPECT_FALSE(moe_permute(d1.get(), 1, kMoeMaxExperts + 1, d_off.get(), d_perm.get(), d_row.get(), d_scr.get(), stream_).ok());
}

TEST_F(CudaOpsTest, MoeRoutingMatchesCpu) {
  std::mt19937 g(72);
  struct Case {
    int64_t n, e, k;
    bool renorm;
  };
  for (const Case c : {Case{37, 8, 2, true}, Case{37, 8, 2, false}, Case{50, 128, 8, true}, Case{9, 4, 4, false}}) {
    SCOPED_TRACE("n, e, k = " + shape_str({c.n, c.e, c.k}) + (c.renorm ? " renorm" : ""));
    const size_t ne = static_cast<size_t>(c.n * c.e), nk = static_cast<size_t>(c.n * c.k);
    Input<float> z = random_input<float>(ne, g, 2.0);
    // Token 0: all logits equal (every choice is a tie: the lower indices win); token 1: one tie pair.
    for (int64_t x = 0; x < c.e; ++x) z.dev[static_cast<size_t>(x)] = 0.5f, z.ref[static_cast<size_t>(x)] = 0.5;
    z.dev[static_cast<size_t>(c.e + 1)] = z.dev[static_cast<size_t>(c.e + 2)] = 9.0f;
    z.ref[static_cast<size_t>(c.e + 1)] = z.ref[static_cast<size_t>(c.e + 2)] = 9.0;
    std::vector<int32_t> ex_ref(nk);
    std::vector<double> w_ref(nk), p_ref(ne);
    cpu::moe_route_forward<double>(ctx_, z.ref.data(), c.n, c.e, c.k, c.renorm, ex_ref.data(), w_ref.data(), p_ref.data());
    DeviceBuffer<float> d_z(z.dev), d_w(nan_filled<float>(nk)), d_p(nan_filled<float>(ne));
    DeviceBuffer<int32_t> d_ex(std::vector<int32_t>(nk, -1));
    ASSERT_STATUS_OK(moe_route_forward(d_z.get(), c.n, c.e, c.k, c.renorm, d_ex.get(), d_w.get(), d_p.get(), stream_));
    EXPECT_EQ(d_ex.download(stream_), ex_ref);
    EXPECT_REL_ERR_LE(to_doubles(d_p.download(stream_)), p_ref, kElementwiseFp32, "router probabilities");
    const std::vector<float> w = d_w.download(stream_);
    EXPECT_REL_ERR_LE(to_doubles(w), w_ref, kElementwiseFp32, "combine weights");

    // Backward, with and without the load-balancing term, from the GPU's own forward values.
    const std::vector<float> p = d_p.download(stream_);
    const std::vector<double> pd = to_doubles(p), wd = to_doubles(w);
    const Input<float> dw = random_input<float>(nk, g);
    const Input<float> aux = random_input<float>(static_cast<size_t>(c.e), g, 0.1);
    for (bool with_aux : {false, true}) {
      std::vector<double> dz_ref(ne);
      cpu::moe_route_backward<double>(ctx_, pd.data(), ex_ref.data(), wd.data(), dw.ref.data(), with_aux ? aux.ref.data() : nullptr,
                                      c.n, c.e, c.k, c.renorm, dz_ref.data());
      DeviceBuffer<float> d_dw(dw.dev), d_aux(aux.dev), d_dz(nan_filled<float>(ne));
      ASSERT_STATUS_OK(moe_route_backward(d_p.get(), d_ex.get(), d_w.get(), d_dw.get(), with_aux ? d_aux.get() : nullptr, c.n, c.e,
                                          c.k, c.renorm, d_dz.get(), stream_));
      EXPECT_REL_ERR_LE(to_doubles(d_dz.download(stream_)), dz_ref, kShortReduceFp32,
                        with_aux ? "router logits' gradient (with the load-balancing term)" : "router logits' gradient");
    }

    // The load-balancing statistics add onto the running sums, in double, exactly as the CPU op.
    std::vector<int32_t> off(static_cast<size_t>(c.e + 1)), perm(nk);
    cpu::moe_permute(ex_ref.data(), c.n, c.k, c.e, off.data(), perm.data());
    std::vector<double> count_ref(static_cast<size_t>(c.e), 3.0), prob_ref(static_cast<size_t>(c.e), 0.25);
    const std::vector<double> count0 = count_ref, prob0 = prob_ref;
    cpu::moe_aux_stats<float>(p.data(), ex_ref.data(), c.n, c.e, c.k, count_ref.data(), prob_ref.data());
    DeviceBuffer<int32_t> d_off(off);
    DeviceBuffer<double> d_count(count0), d_prob(prob0);
    DeviceBuffer<char> d_cs(static_cast<size_t>(column_sum_scratch_bytes(c.e)));
    ASSERT_STATUS_OK(moe_aux_stats(d_p.get(), d_off.get(), c.n, c.e, d_count.get(), d_prob.get(), d_cs.get(), stream_));
    EXPECT_SAME_BITS(d_count.download(stream_), count_ref, "slots per expert");
    // The probabilities: the two-stage order (column_sum.cuh), emulated on the host in double (adds
    // only, so the same bits), and within double rounding of the CPU op's sequential sum.
    const std::vector<double> prob = d_prob.download(stream_);
    std::vector<double> order = prob0;
    column_sum_two_stage_host<double>([&](int64_t t, int64_t x) { return static_cast<double>(p[static_cast<size_t>(t * c.e + x)]); },
                                      c.n, c.e, order.data());
    EXPECT_SAME_BITS(prob, order, "summed probabilities against their order on the host");
    EXPECT_REL_ERR_LE(prob, prob_ref, 1e-13, "summed probabilities against the CPU op");
  }
}

// The MoE block as the CUDA backend runs it (route, sort, gather, grouped GEMMs, SwiGLU, combine,
// and the backward of each) against the CPU ops composed in double as executor/src/model.cpp
// composes them. Routing is compared exactly: the reference routes the GPU's own fp32 logits (the
// router GEMM is compared on its own), and the logits are spread wide enough (std ~2) that no two
// probabilities are within rounding of each other.
struct MoeShape {
  const char* name;
  int64_t n, h, e, k, im;
  bool renorm;
};

template <typename T>
void check_moe_block(CudaOpsTest& f, const MoeShape& m, std::mt19937& g) {
  cpu::CpuContext ctx(2);
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreate(&s));
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(blas, s), CUBLAS_STATUS_SUCCESS);
  (void)f;
  const int64_t n = m.n, h = m.h, e = m.e, k = m.k, im = m.im, slots = n * k;
  const size_t nh = static_cast<size_t>(n * h), ne = static_cast<size_t>(n * e), sh = static_cast<size_t>(slots * h),
               si = static_cast<size_t>(slots * im);
  // Weights: experts strided with gaps (NaN on the device, never read); the last expert's router
  // row is -1 against inputs of mean +1, so no token chooses it (its gradients must stay untouched).
  const int64_t gate_stride = im * h + 40, down_stride = h * im + 24;
  Input<T> xn = random_input<T>(nh, g, 1.0, 1.0);
  Input<T> router = random_input<T>(static_cast<size_t>(e * h), g, 0.35);
  for (int64_t c = 0; c < h; ++c) {
    router.dev[static_cast<size_t>((e - 1) * h + c)] = to_storage<T>(-1.0f);
    router.ref[static_cast<size_t>((e - 1) * h + c)] = -1.0;
  }
  const Input<T> wg = random_batched<T>(e, gate_stride, im, h, h, g), wu = random_batched<T>(e, gate_stride, im, h, h, g),
                 wd = random_batched<T>(e, down_stride, h, im, im, g);
  // Scale the experts' weights to 1/sqrt(in) (the products then stay of order 1).
  auto scaled = [](Input<T> in, double sc) {
    for (size_t i = 0; i < in.dev.size(); ++i) {
      const float v = static_cast<float>(as_double(in.dev[i]) * sc);
      if (std::isnan(v)) continue;
      in.dev[i] = to_storage<T>(v);
      in.ref[i] = as_double(in.dev[i]);
    }
    return in;
  };
  const Input<T> Wg = scaled(wg, 1 / std::sqrt(double(h))), Wu = scaled(wu, 1 / std::sqrt(double(h))),
                 Wd = scaled(wd, 1 / std::sqrt(double(im)));
  const Input<float> resid = random_input<float>(nh, g);

  // ---- forward on the GPU
  DeviceBuffer<T> d_xn(xn.dev), d_router(router.dev), d_wg(Wg.dev), d_wu(Wu.dev), d_wd(Wd.dev);
  DeviceBuffer<float> d_logits(nan_filled<float>(ne)), d_probs(nan_filled<float>(ne)),
      d_weight(nan_filled<float>(static_cast<size_t>(slots))), d_resid(resid.dev), d_out(nan_filled<float>(nh));
  DeviceBuffer<int32_t> d_ex(static_cast<size_t>(slots)), d_perm(static_cast<size_t>(slots)), d_row(static_cast<size_t>(slots)),
      d_off(static_cast<size_t>(e + 1)), d_scr(static_cast<size_t>(moe_permute_scratch_ints(slots, e)));
  DeviceBuffer<T> d_xp(nan_filled<T>(sh)), d_gate(nan_filled<T>(si)), d_up(nan_filled<T>(si)), d_act(nan_filled<T>(si)),
      d_yp(nan_filled<T>(sh));
  DeviceBuffer<void*> d_ptrs(static_cast<size_t>(grouped_gemm_pointer_slots(e)));
  std::vector<int32_t> off;
  auto forward = [&]() {
    ASSERT_STATUS_OK((linear_forward<T, float>(blas, d_xn.get(), d_router.get(), n, h, e, d_logits.get(), 0.0f)));
    ASSERT_STATUS_OK(moe_route_forward(d_logits.get(), n, e, k, m.renorm, d_ex.get(), d_weight.get(), d_probs.get(), s));
    ASSERT_STATUS_OK(moe_permute(d_ex.get(), slots, e, d_off.get(), d_perm.get(), d_row.get(), d_scr.get(), s));
    ASSERT_STATUS_OK(moe_gather<T>(d_xn.get(), d_perm.get(), slots, k, h, d_xp.get(), s));
    off = d_off.download(s);
    ASSERT_STATUS_OK((grouped_linear_forward<T, T>(blas, d_xp.get(), d_wg.get(), gate_stride, off.data(), e, h, im, d_gate.get(),
                                                   0.0f, d_ptrs.get())));
    ASSERT_STATUS_OK((grouped_linear_forward<T, T>(blas, d_xp.get(), d_wu.get(), gate_stride, off.data(), e, h, im, d_up.get(),
                                                   0.0f, d_ptrs.get())));
    ASSERT_STATUS_OK(swiglu_forward<T>(d_gate.get(), d_up.get(), slots * im, d_act.get(), s));
    ASSERT_STATUS_OK((grouped_linear_forward<T, T>(blas, d_act.get(), d_wd.get(), down_stride, off.data(), e, im, h, d_yp.get(),
                                                   0.0f, d_ptrs.get())));
    ASSERT_STATUS_OK(moe_combine_forward<T>(d_yp.get(), d_weight.get(), d_row.get(), d_resid.get(), n, k, h, d_out.get(), s));
  };
  ASSERT_NO_FATAL_FAILURE(forward());
  const std::vector<float> logits = d_logits.download(s), out = d_out.download(s);

  // ---- the reference forward (double), routed from the GPU's logits
  std::vector<double> logits_ref(ne);
  cpu::linear_forward<double>(ctx, xn.ref.data(), router.ref.data(), nullptr, n, h, e, logits_ref.data());
  EXPECT_REL_ERR_LE(to_doubles(logits), logits_ref, kIsBf16<T> ? kGemmBf16In : kGemmFp32, "router logits");
  const std::vector<double> z = to_doubles(logits);
  std::vector<int32_t> ex(static_cast<size_t>(slots)), perm(static_cast<size_t>(slots)), row(static_cast<size_t>(slots)),
      off_ref(static_cast<size_t>(e + 1));
  std::vector<double> w(static_cast<size_t>(slots)), p(ne);
  cpu::moe_route_forward<double>(ctx, z.data(), n, e, k, m.renorm, ex.data(), w.data(), p.data());
  ASSERT_EQ(d_ex.download(s), ex) << "the GPU chose other experts than the reference from the same logits";
  cpu::moe_permute(ex.data(), n, k, e, off_ref.data(), perm.data());
  ASSERT_EQ(off, off_ref);
  ASSERT_EQ(off_ref[static_cast<size_t>(e)] - off_ref[static_cast<size_t>(e - 1)], 0) << "the last expert should be empty";
  for (int64_t r = 0; r < slots; ++r) row[static_cast<size_t>(perm[static_cast<size_t>(r)])] = static_cast<int32_t>(r);
  std::vector<double> xp(sh), gate(si), up(si), act(si), yp(sh), moe(nh), out_ref(nh);
  cpu::moe_gather<double>(ctx, xn.ref.data(), perm.data(), slots, k, h, xp.data());
  cpu::grouped_linear_forward<double>(ctx, xp.data(), Wg.ref.data(), gate_stride, nullptr, 0, off_ref.data(), e, h, im, gate.data());
  cpu::grouped_linear_forward<double>(ctx, xp.data(), Wu.ref.data(), gate_stride, nullptr, 0, off_ref.data(), e, h, im, up.data());
  cpu::swiglu_forward<double>(ctx, gate.data(), up.data(), slots * im, act.data());
  cpu::grouped_linear_forward<double>(ctx, act.data(), Wd.ref.data(), down_stride, nullptr, 0, off_ref.data(), e, im, h, yp.data());
  cpu::moe_combine_forward<double>(ctx, yp.data(), w.data(), row.data(), n, k, h, moe.data());
  for (size_t i = 0; i < nh; ++i) out_ref[i] = resid.ref[i] + moe[i];
  // Compared without the residual (which would hide the block's error): fp32, chained GEMMs; bf16,
  // gate, up, act and the expert outputs each rounded to bf16.
  std::vector<double> moe_got(nh);
  for (size_t i = 0; i < nh; ++i) moe_got[i] = static_cast<double>(out[i]) - resid.ref[i];
  EXPECT_REL_ERR_LE(moe_got, moe, bound_for<T>(moe, 4 * kGemmFp32, kBf16CBackward), "MoE block output");
  EXPECT_REL_ERR_LE(to_doubles(out), out_ref, bound_for<T>(out_ref, kGemmFp32, kBf16C), "MoE block output + residual");

  // ---- backward
  const Input<float> dout = random_input<float>(nh, g);
  const Input<float> aux = random_input<float>(static_cast<size_t>(e), g, 0.05);
  const Input<float> g0 = random_input<float>(static_cast<size_t>(e * gate_stride), g), gd0 = random_input<float>(static_cast<size_t>(e * down_stride), g),
                     gr0 = random_input<float>(static_cast<size_t>(e * h), g);
  // The reference gradients start at the same values; the unchosen expert's stay at them.
  std::vector<double> dgw_ref = g0.ref, duw_ref = g0.ref, ddw_ref = gd0.ref, drw_ref = gr0.ref;
  std::vector<double> dyp(sh), dweight(static_cast<size_t>(slots)), da(si), dgate(si), dup(si), dxp(sh), dxp2(sh), dxn_ref(nh), dz(ne);
  cpu::moe_combine_backward<double>(ctx, yp.data(), w.data(), row.data(), dout.ref.data(), n, k, h, dyp.data(), dweight.data());
  cpu::grouped_linear_backward<double>(ctx, dyp.data(), act.data(), Wd.ref.data(), down_stride, off_ref.data(), e, im, h, da.data(),
                                       ddw_ref.data(), nullptr, 0);
  cpu::swiglu_backward<double>(ctx, gate.data(), up.data(), da.data(), slots * im, dgate.data(), dup.data());
  cpu::grouped_linear_backward<double>(ctx, dgate.data(), xp.data(), Wg.ref.data(), gate_stride, off_ref.data(), e, h, im, dxp.data(),
                                       dgw_ref.data(), nullptr, 0);
  cpu::grouped_linear_backward<double>(ctx, dup.data(), xp.data(), Wu.ref.data(), gate_stride, off_ref.data(), e, h, im, dxp2.data(),
                                       duw_ref.data(), nullptr, 0);
  for (size_t i = 0; i < sh; ++i) dxp[i] += dxp2[i];
  cpu::moe_scatter_add<double>(ctx, dxp.data(), row.data(), n, k, h, dxn_ref.data());
  cpu::moe_route_backward<double>(ctx, p.data(), ex.data(), w.data(), dweight.data(), aux.ref.data(), n, e, k, m.renorm, dz.data());
  cpu::linear_backward<double>(ctx, dz.data(), xn.ref.data(), router.ref.data(), n, h, e, dxn_ref.data(), true, drw_ref.data(), nullptr);

  constexpr bool kCast = kIsBf16<T>;
  DeviceBuffer<float> d_dout(dout.dev), d_aux(aux.dev), d_dweight(nan_filled<float>(static_cast<size_t>(slots))),
      d_dxp(nan_filled<float>(sh)), d_dxn(nan_filled<float>(nh)), d_dz(nan_filled<float>(ne)), d_dgw(g0.dev), d_duw(g0.dev),
      d_ddw(gd0.dev), d_drw(gr0.dev);
  DeviceBuffer<T> d_dyp(nan_filled<T>(sh)), d_da(nan_filled<T>(si)), d_dgate(nan_filled<T>(si)), d_dup(nan_filled<T>(si)),
      d_dz_t(nan_filled<T>(kCast ? ne : 0));
  auto backward = [&]() {
    d_dgw.upload(g0.dev);
    d_duw.upload(g0.dev);
    d_ddw.upload(gd0.dev);
    d_drw.upload(gr0.dev);
    ASSERT_STATUS_OK(moe_combine_backward<T>(d_yp.get(), d_weight.get(), d_row.get(), d_dout.get(), n, k, h, d_dyp.get(),
                                             d_dweight.get(), s));
    ASSERT_STATUS_OK((grouped_linear_backward_data<T, T>(blas, d_dyp.get(), d_wd.get(), down_stride, off.data(), e, im, h, d_da.get(),
                                                         false, d_ptrs.get())));
    ASSERT_STATUS_OK(grouped_linear_backward_weight<T>(blas, d_dyp.get(), d_act.get(), off.data(), e, im, h, d_ddw.get(), down_stride,
                                                       d_ptrs.get()));
    ASSERT_STATUS_OK(swiglu_backward<T>(d_gate.get(), d_up.get(), d_da.get(), slots * im, d_dgate.get(), d_dup.get(), s));
    ASSERT_STATUS_OK((grouped_linear_backward_data<T, float>(blas, d_dgate.get(), d_wg.get(), gate_stride, off.data(), e, h, im,
                                                             d_dxp.get(), false, d_ptrs.get())));
    ASSERT_STATUS_OK((grouped_linear_backward_data<T, float>(blas, d_dup.get(), d_wu.get(), gate_stride, off.data(), e, h, im,
                                                             d_dxp.get(), true, d_ptrs.get())));
    ASSERT_STATUS_OK(grouped_linear_backward_weight<T>(blas, d_dgate.get(), d_xp.get(), off.data(), e, h, im, d_dgw.get(), gate_stride,
                                                       d_ptrs.get()));
    ASSERT_STATUS_OK(grouped_linear_backward_weight<T>(blas, d_dup.get(), d_xp.get(), off.data(), e, h, im, d_duw.get(), gate_stride,
                                                       d_ptrs.get()));
    ASSERT_STATUS_OK(moe_scatter_add(d_dxp.get(), d_row.get(), n, k, h, d_dxn.get(), s));
    ASSERT_STATUS_OK(moe_route_backward(d_probs.get(), d_ex.get(), d_weight.get(), d_dweight.get(), d_aux.get(), n, e, k, m.renorm,
                                        d_dz.get(), s));
    const T* dz_t = nullptr;
    if constexpr (kCast) {
      ASSERT_STATUS_OK((convert<float, T>(d_dz.get(), static_cast<int64_t>(ne), d_dz_t.get(), s)));
      dz_t = d_dz_t.get();
    } else {
      dz_t = d_dz.get();
    }
    ASSERT_STATUS_OK((linear_backward_data<T, float>(blas, dz_t, d_router.get(), n, h, e, d_dxn.get(), true)));
    ASSERT_STATUS_OK(linear_backward_weight<T>(blas, dz_t, d_xn.get(), n, h, e, d_drw.get()));
  };
  ASSERT_NO_FATAL_FAILURE(backward());
  const std::vector<float> dxn = d_dxn.download(s), dgw = d_dgw.download(s), duw = d_duw.download(s), ddw = d_ddw.download(s),
                           drw = d_drw.download(s);
  // fp32: a chain of GEMMs and the softmax backward; bf16: the saved activations and the GEMM
  // inputs (dyp, dgate, dup, dlogits) are bf16, so errors of a few bf16 roundings.
  const double bwd = kIsBf16<T> ? 4e-2 : kAttnBwdFp32;
  EXPECT_REL_ERR_LE(to_doubles(dxn), dxn_ref, bwd, "d xn2");
  // The gradients are compared as their change from the initial values (which would hide errors).
  auto delta = [](const std::vector<float>& got, const std::vector<double>& init) {
    std::vector<double> r(got.size());
    for (size_t i = 0; i < got.size(); ++i) r[i] = static_cast<double>(got[i]) - init[i];
    return r;
  };
  auto delta_ref = [](const std::vector<double>& ref, const std::vector<double>& init) {
    std::vector<double> r(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) r[i] = ref[i] - init[i];
    return r;
  };
  EXPECT_REL_ERR_LE(delta(dgw, g0.ref), delta_ref(dgw_ref, g0.ref), bwd, "d expert gate weights");
  EXPECT_REL_ERR_LE(delta(duw, g0.ref), delta_ref(duw_ref, g0.ref), bwd, "d expert up weights");
  EXPECT_REL_ERR_LE(delta(ddw, gd0.ref), delta_ref(ddw_ref, gd0.ref), bwd, "d expert down weights");
  // The router's gradient goes through d weight = dout . yp and the renormalisation's difference
  // dw_j - sum_i dw_i w_i, which cancels: on the bf16 path (yp and dlogits in bf16) it gets twice
  // the others' bound. A wrong op is off by order 1.
  EXPECT_REL_ERR_LE(delta(drw, gr0.ref), delta_ref(drw_ref, gr0.ref), kIsBf16<T> ? 2 * bwd : bwd, "d router weights");
  // The unchosen expert and the gaps between experts are not touched: their bits are the initial ones.
  for (int64_t x = e - 1; x < e; ++x) {
    const size_t g_at = static_cast<size_t>(x * gate_stride), d_at = static_cast<size_t>(x * down_stride);
    EXPECT_TRUE(std::equal(dgw.begin() + static_cast<std::ptrdiff_t>(g_at), dgw.begin() + static_cast<std::ptrdiff_t>(g_at + gate_stride),
                           g0.dev.begin() + static_cast<std::ptrdiff_t>(g_at)))
        << "the unchosen expert's gate gradient changed";
    EXPECT_TRUE(std::equal(ddw.begin() + static_cast<std::ptrdiff_t>(d_at), ddw.begin() + static_cast<std::ptrdiff_t>(d_at + down_stride),
                           gd0.dev.begin() + static_cast<std::ptrdiff_t>(d_at)))
        << "the unchosen expert's down gradient changed";
  }
  for (int64_t x = 0; x < e; ++x)
    for (int64_t i = im * h; i < gate_stride; ++i)
      ASSERT_EQ(dgw[static_cast<size_t>(x * gate_stride + i)], g0.dev[static_cast<size_t>(x * gate_stride + i)]) << "a gap was written";

  // Deterministic: forward and backward again give the same bits.
  ASSERT_NO_FATAL_FAILURE(forward());
  EXPECT_SAME_BITS(d_out.download(s), out, "MoE output, second run");
  ASSERT_NO_FATAL_FAILURE(backward());
  EXPECT_SAME_BITS(d_dxn.download(s), dxn, "MoE d xn2, second run");
  EXPECT_SAME_BITS(d_dgw.download(s), dgw, "MoE d gate weights, second run");
  EXPECT_SAME_BITS(d_drw.download(s), drw, "MoE d router weights, second run");
  std::cout << "[   INFO   ] " << m.name << " " << (kIsBf16<T> ? "bf16" : "fp32") << ": grouped GEMMs T->T: "
            << grouped_gemm_path<T, T>() << "; T->fp32: " << grouped_gemm_path<T, float>() << "\n";

  // The per-expert loop (the fallback) gives the same results within the same bounds.
  force_grouped_gemm_loop(true);
  ASSERT_NO_FATAL_FAILURE(forward());
  ASSERT_NO_FATAL_FAILURE(backward());
  force_grouped_gemm_loop(false);
  std::vector<double> moe_loop(nh);
  const std::vector<float> out_loop = d_out.download(s);
  for (size_t i = 0; i < nh; ++i) moe_loop[i] = static_cast<double>(out_loop[i]) - resid.ref[i];
  EXPECT_REL_ERR_LE(moe_loop, moe, bound_for<T>(moe, 4 * kGemmFp32, kBf16CBackward), "MoE block output (per-expert loop)");
  EXPECT_REL_ERR_LE(to_doubles(d_dxn.download(s)), dxn_ref, bwd, "d xn2 (per-expert loop)");
  EXPECT_REL_ERR_LE(delta(d_dgw.download(s), g0.ref), delta_ref(dgw_ref, g0.ref), bwd, "d expert gate weights (per-expert loop)");

  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cublasDestroy(blas);
  cudaStreamDestroy(s);
}

TYPED_TEST(CudaOpsT, MoeBlockMatchesCpu) {
  std::mt19937 g(73);
  // The tiny profiles' shapes (48 tokens: 2 x 24) and one without renormalisation.
  for (const MoeShape m : {MoeShape{"tiny-qwen3-moe", 48, 64, 8, 2, 32, true}, MoeShape{"tiny-mixtral", 48, 64, 8, 2, 48, true},
                           MoeShape{"qwen3-moe norm_topk_prob false", 300, 96, 16, 4, 40, false}}) {
    SCOPED_TRACE(m.name);
    ASSERT_NO_FATAL_FAILURE(check_moe_block<TypeParam>(*this, m, g));
  }
}

// Qwen3's q/k norm as the CUDA backend runs it: the projection in fp32, RMSNorm over each head's
// head_dim (n = tokens * heads rows) into T, and the backward in place on the fp32 gradient.
TYPED_TEST(CudaOpsT, QkNormPerHeadMatchesCpu) {
  using T = TypeParam;
  std::mt19937 g(74);
  for (const auto& [tokens, hidden, heads, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{48, 64, 4, 16},
                                                 std::tuple<int64_t, int64_t, int64_t, int64_t>{37, 96, 3, 128}}) {
    SCOPED_TRACE("tokens, hidden, heads, head_dim = " + shape_str({tokens, hidden, heads, hd}));
    const int64_t q = heads * hd, rows = tokens * heads;
    const size_t nq = static_cast<size_t>(tokens * q);
    const Input<T> xn = random_input<T>(static_cast<size_t>(tokens * hidden), g);
    const Input<T> wq = random_input<T>(static_cast<size_t>(q * hidden), g, 1 / std::sqrt(double(hidden)));
    const Input<T> nw = random_input<T>(static_cast<size_t>(hd), g, 0.2, 1.0);
    std::vector<double> pre_ref(nq), y_ref(nq), rstd_ref(static_cast<size_t>(rows));
    cpu::linear_forward<double>(this->ctx_, xn.ref.data(), wq.ref.data(), nullptr, tokens, hidden, q, pre_ref.data());
    DeviceBuffer<T> d_xn(xn.dev), d_wq(wq.dev), d_nw(nw.dev), d_y(nan_filled<T>(nq));
    DeviceBuffer<float> d_pre(nan_filled<float>(nq)), d_rstd(nan_filled<float>(static_cast<size_t>(rows)));
    ASSERT_STATUS_OK((linear_forward<T, float>(this->blas_, d_xn.get(), d_wq.get(), tokens, hidden, q, d_pre.get(), 0.0f)));
    ASSERT_STATUS_OK(rmsnorm_forward<T>(d_pre.get(), d_nw.get(), rows, hd, 1e-6f, d_y.get(), d_rstd.get(), this->stream_));
    const std::vector<float> pre = d_pre.download(this->stream_);
    EXPECT_REL_ERR_LE(to_doubles(pre), pre_ref, kIsBf16<T> ? kGemmBf16In : kGemmFp32, "q before the norm (fp32)");
    // The norm's reference takes the GPU's fp32 projection (the GEMM is checked just above).
    const std::vector<double> pre_d = to_doubles(pre);
    cpu::rmsnorm_forward<double>(this->ctx_, pre_d.data(), nw.ref.data(), rows, hd, 1e-6, y_ref.data(), rstd_ref.data());
    EXPECT_REL_ERR_LE(to_doubles(d_rstd.download(this->stream_)), rstd_ref, kStatFp32, "per-head rstd");
    EXPECT_REL_ERR_LE(to_doubles(d_y.download(this->stream_)), y_ref, bound_for<T>(y_ref, kElementwiseFp32, kBf16C), "normed q");
    // Backward in place (dx over dy), the norm weight's gradient accumulated over every row.
    const Input<float> dy = random_input<float>(nq, g);
    const Input<float> dw0 = random_input<float>(static_cast<size_t>(hd), g);
    const std::vector<double> rstd_in = to_doubles(d_rstd.download(this->stream_));
    std::vector<double> dx_ref(nq), dw_ref = dw0.ref;
    cpu::rmsnorm_backward<double>(this->ctx_, dy.ref.data(), pre_d.data(), nw.ref.data(), rstd_in.data(), rows, hd, dx_ref.data(),
                                  dw_ref.data());
    DeviceBuffer<float> d_g(dy.dev), d_dw(dw0.dev);
    DeviceBuffer<char> d_cs(static_cast<size_t>(column_sum_scratch_bytes(hd)));
    ASSERT_STATUS_OK(rmsnorm_backward<T>(d_g.get(), d_pre.get(), d_nw.get(), d_rstd.get(), rows, hd, d_g.get(), d_dw.get(),
                                         d_cs.get(), this->stream_));
    EXPECT_REL_ERR_LE(to_doubles(d_g.download(this->stream_)), dx_ref, kRmsNormDxFp32, "d q before the norm (in place)");
    // dw sums tokens * heads rows in fp32: a longer sum than the other norms'
    EXPECT_REL_ERR_LE(to_doubles(d_dw.download(this->stream_)), dw_ref, 4 * kShortReduceFp32, "d q_norm weight");
  }
}


// gpt-oss's experts: stacked [E, in, out] weights (x @ W) with biases as the grouped GEMMs' initial
// C, the clamped SwiGLU on the interleaved gate_up, and the backward (data, weight and bias
// gradients, the biases' summed over each expert's rows) against cpu::grouped_matmul_* and
// cpu::clamped_swiglu_* in double. Expert 1 has no rows: its gradients must stay untouched.
TYPED_TEST(CudaOpsT, GptOssExpertsMatchCpu) {
  using T = TypeParam;
  std::mt19937 g(211);
  const int64_t E = 5, H = 48, Im = 24, C = 2 * Im;
  const std::vector<int32_t> offsets = {0, 13, 13, 50, 51, 80};
  const int64_t rows = offsets.back();
  const double alpha = 1.702, limit = 0.9;
  const size_t n_gu = static_cast<size_t>(E * H * C), n_d = static_cast<size_t>(E * Im * H);
  const Input<T> x = random_input<T>(static_cast<size_t>(rows * H), g), w_gu = random_input<T>(n_gu, g, 0.2),
                 b_gu = random_input<T>(static_cast<size_t>(E * C), g, 0.3), w_d = random_input<T>(n_d, g, 0.2),
                 b_d = random_input<T>(static_cast<size_t>(E * H), g, 0.3), dy = random_input<T>(static_cast<size_t>(rows * H), g);
  // The reference chain in double.
  std::vector<double> gu_ref(static_cast<size_t>(rows * C)), act_ref(static_cast<size_t>(rows * Im)),
      y_ref(static_cast<size_t>(rows * H));
  cpu::grouped_matmul_forward<double>(this->ctx_, x.ref.data(), w_gu.ref.data(), H * C, b_gu.ref.data(), C, offsets.data(), E,
                                      H, C, gu_ref.data());
  cpu::clamped_swiglu_forward<double>(this->ctx_, gu_ref.data(), rows, Im, alpha, limit, act_ref.data());
  cpu::grouped_matmul_forward<double>(this->ctx_, act_ref.data(), w_d.ref.data(), Im * H, b_d.ref.data(), H, offsets.data(), E,
                                      Im, H, y_ref.data());
  const double sentinel = 0.5;  // gradients start here (they accumulate)
  std::vector<double> dact_ref(act_ref.size()), dgu_ref(gu_ref.size()), dx_ref(x.ref.size()), dwd_ref(n_d, sentinel),
      dbd_ref(static_cast<size_t>(E * H), sentinel), dwgu_ref(n_gu, sentinel), dbgu_ref(static_cast<size_t>(E * C), sentinel);
  cpu::grouped_matmul_backward<double>(this->ctx_, dy.ref.data(), act_ref.data(), w_d.ref.data(), Im * H, offsets.data(), E, Im,
                                       H, dact_ref.data(), dwd_ref.data(), dbd_ref.data(), H);
  cpu::clamped_swiglu_backward<double>(this->ctx_, gu_ref.data(), dact_ref.data(), rows, Im, alpha, limit, dgu_ref.data());
  cpu::grouped_matmul_backward<double>(this->ctx_, dgu_ref.data(), x.ref.data(), w_gu.ref.data(), H * C, offsets.data(), E, H,
                                       C, dx_ref.data(), dwgu_ref.data(), dbgu_ref.data(), C);

  void** ptrs = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptrs), sizeof(void*) * grouped_gemm_pointer_slots(E)));
  DeviceBuffer<int32_t> d_off(offsets);
  DeviceBuffer<T> d_x(x.dev), d_wgu(w_gu.dev), d_bgu(b_gu.dev), d_wd(w_d.dev), d_bd(b_d.dev), d_dy(dy.dev);
  DeviceBuffer<T> d_gu(nan_filled<T>(gu_ref.size())), d_act(nan_filled<T>(act_ref.size())), d_y(nan_filled<T>(y_ref.size()));
  const float fa = static_cast<float>(alpha), fl = static_cast<float>(limit);
  cudaStream_t s = this->stream_;
  ASSERT_STATUS_OK(moe_expert_bias_fill<T>(d_gu.get(), d_bgu.get(), C, d_off.get(), E, C, s));
  ASSERT_STATUS_OK((grouped_matmul_forward<T, T>(this->blas_, d_x.get(), d_wgu.get(), H * C, offsets.data(), E, H, C, d_gu.get(),
                                                 1.0f, ptrs)));
  ASSERT_STATUS_OK(clamped_swiglu_forward<T>(d_gu.get(), rows * Im, fa, fl, d_act.get(), s));
  ASSERT_STATUS_OK(moe_expert_bias_fill<T>(d_y.get(), d_bd.get(), H, d_off.get(), E, H, s));
  ASSERT_STATUS_OK((grouped_matmul_forward<T, T>(this->blas_, d_act.get(), d_wd.get(), Im * H, offsets.data(), E, Im, H, d_y.get(),
                                                 1.0f, ptrs)));
  EXPECT_REL_ERR_LE(to_doubles(d_gu.download(s)), gu_ref, bound_for<T>(gu_ref, kGemmFp32, kBf16C), "gate_up");
  EXPECT_REL_ERR_LE(to_doubles(d_act.download(s)), act_ref, bound_for<T>(act_ref, kGemmFp32, kBf16C), "act");
  EXPECT_REL_ERR_LE(to_doubles(d_y.download(s)), y_ref, bound_for<T>(y_ref, kGemmFp32, 2 * kBf16C), "y");

  const std::vector<float> f_dwd(n_d, 0.5f), f_dbd(static_cast<size_t>(E * H), 0.5f), f_dwgu(n_gu, 0.5f),
      f_dbgu(static_cast<size_t>(E * C), 0.5f);
  DeviceBuffer<T> d_dact(nan_filled<T>(act_ref.size())), d_dgu(nan_filled<T>(gu_ref.size()));
  DeviceBuffer<float> d_dx(nan_filled<float>(x.ref.size())), d_dwd(f_dwd), d_dbd(f_dbd), d_dwgu(f_dwgu), d_dbgu(f_dbgu);
  ASSERT_STATUS_OK((grouped_matmul_backward_data<T, T>(this->blas_, d_dy.get(), d_wd.get(), Im * H, offsets.data(), E, Im, H,
                                                       d_dact.get(), false, ptrs)));
  ASSERT_STATUS_OK(grouped_matmul_backward_weight<T>(this->blas_, d_dy.get(), d_act.get(), offsets.data(), E, Im, H, d_dwd.get(),
                                                     Im * H, ptrs));
  ASSERT_STATUS_OK(moe_expert_bias_grad<T>(d_dy.get(), d_off.get(), E, H, d_dbd.get(), H, s));
  ASSERT_STATUS_OK(clamped_swiglu_backward<T>(d_gu.get(), d_dact.get(), rows * Im, fa, fl, d_dgu.get(), s));
  ASSERT_STATUS_OK((grouped_matmul_backward_data<T, float>(this->blas_, d_dgu.get(), d_wgu.get(), H * C, offsets.data(), E, H, C,
                                                           d_dx.get(), false, ptrs)));
  ASSERT_STATUS_OK(grouped_matmul_backward_weight<T>(this->blas_, d_dgu.get(), d_x.get(), offsets.data(), E, H, C, d_dwgu.get(),
                                                     H * C, ptrs));
  ASSERT_STATUS_OK(moe_expert_bias_grad<T>(d_dgu.get(), d_off.get(), E, C, d_dbgu.get(), C, s));
  // bf16: the chain's rounding compounds and a few clamps flip; fp32: GEMM-level bounds.
  const double c = kBf16CBackward;
  EXPECT_REL_ERR_LE(to_doubles(d_dact.download(s)), dact_ref, bound_for<T>(dact_ref, kGemmFp32, c), "d act");
  EXPECT_REL_ERR_LE(to_doubles(d_dgu.download(s)), dgu_ref, bound_for<T>(dgu_ref, kGemmFp32, 2 * c), "d gate_up");
  EXPECT_REL_ERR_LE(to_doubles(d_dx.download(s)), dx_ref, bound_for<T>(dx_ref, kGemmFp32, 2 * c), "d x");
  const std::vector<float> dwd = d_dwd.download(s), dbd = d_dbd.download(s), dwgu = d_dwgu.download(s), dbgu = d_dbgu.download(s);
  EXPECT_REL_ERR_LE(to_doubles(dwd), dwd_ref, bound_for<T>(dwd_ref, kGemmFp32, c), "d W_down");
  EXPECT_REL_ERR_LE(to_doubles(dbd), dbd_ref, bound_for<T>(dbd_ref, kShortReduceFp32, c), "d b_down");
  EXPECT_REL_ERR_LE(to_doubles(dwgu), dwgu_ref, bound_for<T>(dwgu_ref, kGemmFp32, 2 * c), "d W_gate_up");
  EXPECT_REL_ERR_LE(to_doubles(dbgu), dbgu_ref, bound_for<T>(dbgu_ref, kShortReduceFp32, 2 * c), "d b_gate_up");
  // Expert 1 (no rows): its slices are exactly the starting values.
  for (int64_t i = 0; i < Im * H; ++i) ASSERT_EQ(dwd[static_cast<size_t>(Im * H + i)], 0.5f) << "d W_down of expert 1";
  for (int64_t i = 0; i < H; ++i) ASSERT_EQ(dbd[static_cast<size_t>(H + i)], 0.5f) << "d b_down of expert 1";
  for (int64_t i = 0; i < H * C; ++i) ASSERT_EQ(dwgu[static_cast<size_t>(H * C + i)], 0.5f) << "d W_gate_up of expert 1";
  for (int64_t i = 0; i < C; ++i) ASSERT_EQ(dbgu[static_cast<size_t>(C + i)], 0.5f) << "d b_gate_up of expert 1";
  ASSERT_CUDA_OK(cudaFree(ptrs));
}

}  // namespace
}  // namespace megatrain::cuda

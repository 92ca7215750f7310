// Building the per-unit RAM tier from a ModelSpec, and seeded HF-style initialisation.
#include "megatrain/executor/host_state.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "megatrain/executor/optimizer.h"

namespace megatrain::exec {
namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool is_norm_or_bias(TensorRole r) {
  switch (r) {
    case TensorRole::kAttnNorm: case TensorRole::kMlpNorm: case TensorRole::kFinalNorm:
    case TensorRole::kQBias: case TensorRole::kKBias: case TensorRole::kVBias: case TensorRole::kOBias:
    case TensorRole::kGateBias: case TensorRole::kUpBias: case TensorRole::kDownBias:
      return true;
    default:
      return false;
  }
}

}  // namespace

const TensorSlot* UnitState::find(TensorRole role) const {
  for (const auto& t : tensors)
    if (t.role == role) return &t;
  return nullptr;
}

HostState HostState::create(const ModelSpec& model, DType transfer, StateFormat m_format, StateFormat v_format,
                            int64_t block_size) {
  HostState hs;
  hs.transfer_ = transfer;
  hs.tied_ = model.config().tie_word_embeddings;
  const int64_t L = model.config().num_layers;
  hs.units_.resize(static_cast<size_t>(L + 2));
  for (const TensorInfo& t : model.tensors()) {
    size_t u = 0;
    if (t.layer >= 0) u = static_cast<size_t>(t.layer + 1);
    else if (t.role == TensorRole::kEmbedding) u = 0;
    else u = static_cast<size_t>(L + 1);
    UnitState& us = hs.units_[u];
    us.tensors.push_back(TensorSlot{t.name, t.shape, t.role, us.numel, t.numel, !is_norm_or_bias(t.role)});
    us.numel += t.numel;
  }
  for (UnitState& us : hs.units_) {
    us.master.resize(us.numel);
    us.grad.resize(us.numel);
    std::vector<int64_t> sizes;
    for (const TensorSlot& t : us.tensors) sizes.push_back(t.numel);
    us.m = MomentStore::create(m_format, false, sizes, block_size);
    us.v = MomentStore::create(v_format, true, sizes, block_size);
    if (transfer == DType::kBf16) us.stream_bf16.resize(us.numel);
  }
  return hs;
}

void HostState::init_random(uint64_t seed, double std) {
  for (UnitState& us : units_) {
    for (const TensorSlot& t : us.tensors) {
      float* w = us.master.data() + t.offset;
      if (t.role == TensorRole::kAttnNorm || t.role == TensorRole::kMlpNorm || t.role == TensorRole::kFinalNorm) {
        for (int64_t i = 0; i < t.numel; ++i) w[i] = 1.0f;
        continue;
      }
      if (is_norm_or_bias(t.role)) {
        for (int64_t i = 0; i < t.numel; ++i) w[i] = 0.0f;
        continue;
      }
      // Box-Muller on a counter-based stream: element i's value depends only on (seed, name, i).
      // splitmix64 advances its state by a constant, so a thread can start anywhere in the stream:
      // pair p uses draws 2p and 2p + 1. Threads split the pairs; the values do not change.
      const uint64_t state0 = seed ^ hash_name(t.name);
      const int64_t pairs = (t.numel + 1) / 2;
      auto fill = [&, w, state0](int64_t p0, int64_t p1) {
        uint64_t state = state0 + static_cast<uint64_t>(2 * p0) * 0x9e3779b97f4a7c15ull;
        const double kTwoPi = 6.283185307179586;
        for (int64_t i = 2 * p0; i < 2 * p1; i += 2) {
          const double u1 = (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
          const double u2 = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
          const double r = std::sqrt(-2.0 * std::log(u1));
          w[i] = static_cast<float>(std * r * std::cos(kTwoPi * u2));
          if (i + 1 < t.numel) w[i + 1] = static_cast<float>(std * r * std::sin(kTwoPi * u2));
        }
      };
      const int64_t n_threads = std::clamp<int64_t>(pairs / (int64_t{1} << 20), 1, std::max(1u, std::thread::hardware_concurrency()));
      std::vector<std::thread> workers;
      for (int64_t k = 1; k < n_threads; ++k) workers.emplace_back(fill, pairs * k / n_threads, pairs * (k + 1) / n_threads);
      fill(0, pairs / n_threads);
      for (auto& th : workers) th.join();
    }
  }
  refresh_stream();
}

void HostState::refresh_stream() {
  if (transfer_ != DType::kBf16) return;
  for (UnitState& us : units_)
    for (int64_t i = 0; i < us.numel; ++i) us.stream_bf16[i] = fp32_to_bf16(us.master[i]);
}

int64_t HostState::bytes() const {
  int64_t b = 0;
  for (const UnitState& us : units_) b += us.numel * (8 + (transfer_ == DType::kBf16 ? 2 : 0)) + us.m.bytes() + us.v.bytes();
  return b;
}

}  // namespace megatrain::exec

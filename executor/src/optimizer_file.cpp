// The optimizer file of a checkpoint: Adam's m and v in their storage format (fp32, bf16 bits, or
// q8/q4/q3/q2 codes and scales; fp32 optionally compressed), its tensor names and __metadata__,
// writing it and reading it back; see detail/optimizer_file.h.
#include "detail/optimizer_file.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>

#include "megatrain/executor/plane_codec.h"

namespace megatrain::exec::detail {
namespace fs = std::filesystem;

namespace {

constexpr const char* kMomentSuffix[2] = {".exp_avg", ".exp_avg_sq"};  // m, v (torch AdamW's names)
// fp32 moments stored compressed (SaveOptions::compress_fp32_moments): the entry's suffix and the
// __metadata__ key and value that say so.
constexpr const char* kCompressedSuffix = ".planes_zstd";
constexpr const char* kCompressedKey = "fp32_moments";
constexpr const char* kCompressedValue = "planes_zstd";
// Mixture-of-Experts: each expert's AdamW update count (UnitState::expert_steps).
constexpr const char* kExpertStepsKey = "expert_steps";

// The spans of every tensor of `us` in `ms` (MomentSpan). With sharded states a tensor another rank
// owns has no moments here: its span is empty (numel 0).
std::vector<MomentSpan> moment_spans(const UnitState& us, const MomentStore& ms) {
  std::vector<MomentSpan> out;
  const int64_t bs = ms.block_size();
  const int64_t block_bytes = bs * state_format_bits(ms.format()) / 8;
  int64_t elems = 0, blocks = 0;
  for (size_t i = 0; i < us.tensors.size(); ++i) {
    const TensorSlot& t = us.tensors[i];
    MomentSpan sp;
    sp.elem_offset = elems;
    sp.numel = i < static_cast<size_t>(ms.tensor_count()) && ms.tensor_numel(i) == 0 ? 0 : t.numel;
    sp.block_offset = blocks;
    sp.blocks = is_quantised(ms.format()) ? (sp.numel + bs - 1) / bs : 0;
    sp.code_offset = blocks * block_bytes;
    sp.code_bytes = sp.blocks * block_bytes;
    elems += t.numel;
    blocks += sp.blocks;
    out.push_back(sp);
  }
  return out;
}

// The spans of `ms`, after checking that they cover its arrays exactly (they always do for a
// HostState::create'd state; anything else would make reads and writes run off the arrays).
Result<std::vector<MomentSpan>> checked_spans(const UnitState& us, const MomentStore& ms, int m_or_v) {
  std::vector<MomentSpan> spans = moment_spans(us, ms);
  int64_t elems = 0, blocks = 0, codes = 0;
  for (const MomentSpan& sp : spans) elems += sp.numel, blocks += sp.blocks, codes += sp.code_bytes;
  int64_t params = 0;  // the moments pack the tensors; us.numel also counts the gaps of unit_layout
  for (const MomentSpan& sp : spans) params += sp.numel;
  bool fits = ms.tensor_count() == static_cast<int64_t>(us.tensors.size()) && elems == params && ms.numel() == params;
  for (size_t i = 0; fits && i < spans.size(); ++i) fits = ms.tensor_numel(i) == spans[i].numel;
  // array_bytes, not the arrays: a unit on NVMe has none until it is paged in.
  const std::vector<int64_t> arrays = ms.array_bytes();
  switch (ms.format()) {
    case StateFormat::kFp32: fits = fits && arrays.at(0) == 4 * elems; break;
    case StateFormat::kBf16: fits = fits && arrays.at(0) == 2 * elems; break;
    default: fits = fits && arrays.at(0) == codes && arrays.at(1) == 4 * blocks;
  }
  if (!fits)
    return internal_error(std::string("Adam's ") + (m_or_v ? "v" : "m") + " (" + state_format_name(ms.format()) +
                          ") of a unit does not have the layout of its tensors; the state was not built by HostState::create");
  return spans;
}

}  // namespace

MomentFormats formats_of(const HostState& state) {
  MomentFormats f;
  if (state.units().empty()) return f;
  const UnitState& u = state.units()[0];
  f.m = u.m.format();
  f.v = u.v.format();
  f.block_size = u.m.block_size();
  return f;
}

Status write_optimizer(const HostState& state, const fs::path& path, int64_t updates, const SaveOptions& options) {
  // Moments on NVMe are paged in one unit at a time as the file is written (read-only: nothing
  // is written back).
  auto pager = std::make_shared<UnitPager>(const_cast<HostState&>(state));
  std::vector<TensorToWrite> tensors;
  for (size_t u = 0; u < state.units().size(); ++u) {
    const UnitState& us = state.units()[u];
    std::vector<MomentSpan> spans[2];
    for (int k = 0; k < 2; ++k) {
      MT_ASSIGN_OR_RETURN(spans[k], checked_spans(us, k ? us.v : us.m, k));
    }
    for (size_t i = 0; i < us.tensors.size(); ++i) {
      const TensorSlot& t = us.tensors[i];
      if (spans[0][i].numel == 0) continue;  // sharded: another rank's tensor, in its own file
      for (int k = 0; k < 2; ++k) {
        const StateFormat format = (k ? us.v : us.m).format();
        const MomentSpan sp = spans[k][i];
        const std::string name = t.name + kMomentSuffix[k];
        // The bytes of one array of this moment, from the unit as it is now (paged in if need be).
        auto at = [&state, pager, u, k](int array, int64_t byte_offset) -> std::function<Result<const void*>()> {
          return [&state, pager, u, k, array, byte_offset]() -> Result<const void*> {
            if (state.states_on_nvme()) MT_RETURN_IF_ERROR(pager->get(static_cast<int64_t>(u)).status());
            const MomentStore& ms = k ? state.units()[u].v : state.units()[u].m;
            const void* base = ms.format() == StateFormat::kFp32   ? static_cast<const void*>(ms.f32().data())
                               : ms.format() == StateFormat::kBf16 ? static_cast<const void*>(ms.bf16().data())
                               : array == 0                        ? static_cast<const void*>(ms.codes().data())
                                                                   : static_cast<const void*>(ms.scales().data());
            return static_cast<const void*>(static_cast<const uint8_t*>(base) + byte_offset);
          };
        };
        switch (format) {
          case StateFormat::kFp32: {
            if (options.compress_fp32_moments) {  // compressed just before it is written
              TensorToWrite w = raw_tensor(name + kCompressedSuffix, {}, nullptr, "U8");
              w.max_bytes = compress_fp32_bound(sp.numel);
              w.produce = [fetch = at(0, 4 * sp.elem_offset), n = sp.numel, options]() -> Result<std::vector<uint8_t>> {
                MT_ASSIGN_OR_RETURN(const void* p, fetch());
                return compress_fp32(static_cast<const float*>(p), n, options.zstd_level, PlaneSplit::kBytePlanes,
                                     options.threads);
              };
              tensors.push_back(std::move(w));
              break;
            }
            TensorToWrite w{name, t.shape, nullptr, DType::kFp32, DType::kFp32};
            w.fetch = at(0, 4 * sp.elem_offset);
            tensors.push_back(std::move(w));
            break;
          }
          case StateFormat::kBf16: {  // the bits as they are: equal types are copied, never rounded
            TensorToWrite w{name, t.shape, nullptr, DType::kBf16, DType::kBf16};
            w.fetch = at(0, 2 * sp.elem_offset);
            tensors.push_back(std::move(w));
            break;
          }
          default: {
            TensorToWrite codes = raw_tensor(name + ".codes", {sp.code_bytes}, nullptr, "U8");
            codes.fetch = at(0, sp.code_offset);
            tensors.push_back(std::move(codes));
            TensorToWrite scales{name + ".scales", {sp.blocks}, nullptr, DType::kFp32, DType::kFp32};
            scales.fetch = at(1, 4 * sp.block_offset);
            tensors.push_back(std::move(scales));
          }
        }
      }
    }
  }
  const MomentFormats f = formats_of(state);
  std::map<std::string, std::string> metadata = {
      {"writer", "megatrain"}, {"optimizer", "adamw"}, {"step", std::to_string(updates)},
      {"m_format", state_format_name(f.m)}, {"v_format", state_format_name(f.v)},
      {"block_size", std::to_string(f.block_size)}};
  if (options.compress_fp32_moments && (f.m == StateFormat::kFp32 || f.v == StateFormat::kFp32))
    metadata[kCompressedKey] = kCompressedValue;
  if (std::string es = expert_steps_text(state); !es.empty()) metadata[kExpertStepsKey] = es;
  if (state.sharded())
    metadata["shard"] = std::to_string(state.sharding().rank) + " of " + std::to_string(state.sharding().ranks);
  Status s = write_safetensors(path, tensors, metadata);
  if (options.compress_fp32_moments) release_plane_codec_scratch();  // nothing stays held while training
  Status done = pager->finish();
  return s.ok() ? done : s;
}


Result<std::vector<ExpectedTensor>> expected_optimizer_tensors(const HostState& state, bool compressed) {
  std::vector<ExpectedTensor> out;
  for (const UnitState& us : state.units()) {
    const MomentStore* stores[2] = {&us.m, &us.v};
    for (int k = 0; k < 2; ++k) MT_RETURN_IF_ERROR(checked_spans(us, *stores[k], k).status());
    for (size_t i = 0; i < us.tensors.size(); ++i) {
      // Every tensor of the model, also those whose moments another rank keeps (sharded states):
      // a checkpoint is whole, whichever rank reads it.
      const int64_t n = us.tensors[i].numel;
      for (int k = 0; k < 2; ++k) {
        const std::string name = us.tensors[i].name + kMomentSuffix[k];
        const int64_t bs = stores[k]->block_size();
        const int64_t blocks = (n + bs - 1) / bs;
        switch (stores[k]->format()) {
          case StateFormat::kFp32:
            if (compressed) out.push_back({name + kCompressedSuffix, "U8", {}, true});
            else out.push_back({name, "F32", us.tensors[i].shape});
            break;
          case StateFormat::kBf16: out.push_back({name, "BF16", us.tensors[i].shape}); break;
          default:
            out.push_back({name + ".codes", "U8", {blocks * bs * state_format_bits(stores[k]->format()) / 8}});
            out.push_back({name + ".scales", "F32", {blocks}});
        }
      }
    }
  }
  return out;
}


std::string expert_steps_text(const HostState& state) {
  std::string out;
  for (size_t u = 0; u < state.units().size(); ++u) {
    const std::vector<int64_t>& es = state.units()[u].expert_steps;
    if (es.empty()) continue;
    if (!out.empty()) out += ';';
    out += std::to_string(u) + ':';
    for (size_t e = 0; e < es.size(); ++e) out += (e ? "," : "") + std::to_string(es[e]);
  }
  return out;
}

Status read_expert_steps(const SafetensorsFile& f, HostState& state) {
  bool any = false;
  for (const UnitState& us : state.units()) any = any || !us.expert_steps.empty();
  const auto& md = f.metadata();
  const auto it = md.find(kExpertStepsKey);
  const std::string where = "'" + f.path().string() + "': __metadata__." + kExpertStepsKey;
  if (!any) {
    if (it != md.end()) return corrupt(where + " is set, but this model has no per-expert tensors");
    return {};
  }
  if (it == md.end())
    return corrupt(where + " is missing: a Mixture-of-Experts checkpoint records each expert's AdamW step count");
  // "<unit>:<count>,<count>,...;<unit>:..." with every unit that has per-expert tensors, in order.
  std::vector<std::vector<int64_t>> parsed(state.units().size());
  const std::string& text = it->second;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = std::min(text.find(';', pos), text.size());
    const std::string part = text.substr(pos, end - pos);
    const size_t colon = part.find(':');
    auto number = [](const std::string& t, int64_t& v) {
      if (t.empty() || t.size() > 18 || t.find_first_not_of("0123456789") != std::string::npos) return false;
      v = std::stoll(t);
      return true;
    };
    int64_t u = 0;
    if (colon == std::string::npos || !number(part.substr(0, colon), u) || u >= static_cast<int64_t>(parsed.size()))
      return corrupt(where + ": '" + part + "' is not '<unit>:<count>,...' for a unit of this model");
    std::vector<int64_t>& counts = parsed[static_cast<size_t>(u)];
    size_t p = colon + 1;
    while (p <= part.size()) {
      const size_t q = std::min(part.find(',', p), part.size());
      int64_t c = 0;
      if (!number(part.substr(p, q - p), c)) return corrupt(where + ": unit " + std::to_string(u) + " has a count that is not a whole number");
      counts.push_back(c);
      p = q + 1;
    }
    pos = end + 1;
  }
  for (size_t u = 0; u < state.units().size(); ++u) {
    UnitState& us = state.units()[u];
    if (parsed[u].size() != us.expert_steps.size())
      return corrupt(where + ": unit " + std::to_string(u) + " lists " + std::to_string(parsed[u].size()) + " experts; the model has " +
                     std::to_string(us.expert_steps.size()));
    us.expert_steps = parsed[u];
  }
  return {};
}

Result<MomentFormats> formats_in(const SafetensorsFile& f) {
  const auto& md = f.metadata();
  MomentFormats out;
  const bool any = md.count("m_format") || md.count("v_format") || md.count("block_size");
  const std::string where = "'" + f.path().string() + "': __metadata__.";
  if (auto c = md.find(kCompressedKey); c != md.end()) {
    if (c->second != kCompressedValue)
      return corrupt(where + kCompressedKey + " is '" + c->second + "'; this build reads '" + kCompressedValue + "'");
    if (!any) return corrupt(where + kCompressedKey + " is set but the optimizer formats are not recorded");
    out.compressed = true;
  }
  if (!any) return out;
  for (const char* key : {"m_format", "v_format", "block_size"})
    if (!md.count(key)) return corrupt(where + key + " is missing while the other optimizer formats are recorded");
  using Field = std::pair<const char*, StateFormat*>;
  for (const auto& [key, dst] : {Field{"m_format", &out.m}, Field{"v_format", &out.v}}) {
    auto fmt = parse_state_format(md.at(key));
    if (!fmt.ok()) return corrupt(where + key + " is '" + md.at(key) + "'; expected fp32, bf16, q8, q4, q3 or q2");
    *dst = *fmt;
  }
  const std::string& bs = md.at("block_size");
  int64_t b = 0;
  bool ok = !bs.empty() && bs.size() <= 9 && bs.find_first_not_of("0123456789") == std::string::npos;
  if (ok) b = std::stoll(bs);
  if (!ok || b < 1) return corrupt(where + "block_size is '" + bs + "'; expected a positive integer");
  out.block_size = b;
  return out;
}

Result<MomentReader> MomentReader::for_unit(const OptimizerFiles& opt, bool compressed, UnitState& us) {
  MomentReader r(opt, compressed, us);
  for (int k = 0; k < 2; ++k) {
    MT_ASSIGN_OR_RETURN(r.spans_[k], checked_spans(us, k ? us.v : us.m, k));
  }
  return r;
}

Status MomentReader::read(size_t i) {
  const TensorSlot& t = us_->tensors[i];
  MomentStore* stores[2] = {&us_->m, &us_->v};
  if (spans_[0][i].numel == 0) return {};  // sharded: another rank keeps this tensor's moments
  // Each entry from the file that holds it: the one optimizer file, or the shard of the rank that
  // kept the tensor (verify_step_dir checked that every entry is in exactly one).
  Status missing;
  auto in = [&](const std::string& entry, const SafetensorsEntry** e) -> const SafetensorsFile* {
    const SafetensorsFile* f = opt_->holder(entry);
    *e = f ? f->find(entry) : nullptr;
    if (*e == nullptr) missing = internal_error("the verified optimizer files have no entry " + entry);
    return *e ? f : nullptr;
  };
  for (int k = 0; k < 2; ++k) {
    MomentStore& ms = *stores[k];
    const MomentSpan& sp = spans_[k][i];
    const std::string name = t.name + kMomentSuffix[k];
    const SafetensorsEntry* e = nullptr;
    const SafetensorsFile* f = nullptr;
    Status s;
    switch (ms.format()) {
      case StateFormat::kFp32:
        if (compressed_) {
          if ((f = in(name + kCompressedSuffix, &e)) == nullptr) return missing;
          std::vector<uint8_t> bytes(static_cast<size_t>(e->end - e->begin));
          s = f->read_raw(*e, "U8", bytes.data(), bytes.size());
          if (s.ok()) s = decompress_fp32(bytes, ms.f32().data() + sp.elem_offset, sp.numel);
          if (!s.ok()) s = corrupt("'" + f->path().string() + "': tensor " + e->name + ": " + s.message());
          break;
        }
        if ((f = in(name, &e)) == nullptr) return missing;
        s = f->read_raw(*e, "F32", ms.f32().data() + sp.elem_offset, static_cast<size_t>(sp.numel) * 4);
        break;
      case StateFormat::kBf16:
        if ((f = in(name, &e)) == nullptr) return missing;
        s = f->read_raw(*e, "BF16", ms.bf16().data() + sp.elem_offset, static_cast<size_t>(sp.numel) * 2);
        break;
      default:
        if ((f = in(name + ".codes", &e)) == nullptr) return missing;
        s = f->read_raw(*e, "U8", ms.codes().data() + sp.code_offset, static_cast<size_t>(sp.code_bytes));
        if (s.ok()) {
          if ((f = in(name + ".scales", &e)) == nullptr) return missing;
          s = f->read_raw(*e, "F32", ms.scales().data() + sp.block_offset, static_cast<size_t>(sp.blocks) * 4);
        }
    }
    if (!s.ok()) return s;
  }
  return {};
}

}  // namespace megatrain::exec::detail

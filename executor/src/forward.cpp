#include "megatrain/executor/forward.h"

#include <string>

#include "megatrain/kernels/cpu/context.h"
#include "megatrain/kernels/cpu/linear.h"
#include "megatrain/kernels/cpu/rmsnorm.h"
#include "megatrain/executor/model.h"

namespace megatrain::exec {

Result<std::vector<float>> forward_logits(const ModelSpec& model, const HostState& state, const std::vector<int32_t>& tokens,
                                          int64_t rows, int64_t seq_len, int threads,
                                          const std::vector<int32_t>* position_ids) {
  const ModelConfig& mc = model.config();
  if (rows < 1 || seq_len < 1) return invalid_argument("forward_logits: rows and seq_len must be at least 1");
  if (seq_len > mc.max_position_embeddings)
    return invalid_argument("forward_logits: seq_len " + std::to_string(seq_len) + " is above max_position_embeddings " +
                            std::to_string(mc.max_position_embeddings));
  if (static_cast<int64_t>(tokens.size()) != rows * seq_len)
    return invalid_argument("forward_logits: " + std::to_string(tokens.size()) + " tokens for " + std::to_string(rows) + " rows of " +
                            std::to_string(seq_len));
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= mc.vocab_size)
      return invalid_argument("forward_logits: token " + std::to_string(tokens[i]) + " at row " + std::to_string(i / seq_len) +
                              ", position " + std::to_string(i % seq_len) + " is outside the vocabulary [0, " +
                              std::to_string(mc.vocab_size) + ")");
  std::vector<int32_t> starts;
  if (position_ids != nullptr) {
    if (static_cast<int64_t>(position_ids->size()) != rows * seq_len)
      return invalid_argument("forward_logits: position_ids must have the tokens' shape");
    starts.resize(position_ids->size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < seq_len; ++t) {
        const int64_t i = r * seq_len + t, p = (*position_ids)[static_cast<size_t>(i)];
        if (!(p == 0 || (t > 0 && p == (*position_ids)[static_cast<size_t>(i - 1)] + 1)))
          return invalid_argument("forward_logits: position_ids " + std::to_string(p) + " at row " + std::to_string(r) +
                                  ", position " + std::to_string(t) + " neither starts a document (0) nor continues one "
                                  "(the previous position + 1)");
        starts[static_cast<size_t>(i)] = static_cast<int32_t>(t - p);
      }
  }
  MT_ASSIGN_OR_RETURN(Dims d, make_dims(model, rows, seq_len));
  MT_ASSIGN_OR_RETURN(std::vector<float> inv_freq, rope_inv_freq_for<float>(model));
  cpu::CpuContext ctx(threads);
  LayerMathT<float> math(ctx, d, std::move(inv_freq));
  const auto& units = state.units();
  const int64_t L = d.L, NH = d.N * d.H;
  std::vector<float> x(static_cast<size_t>(NH)), y(static_cast<size_t>(NH));
  std::vector<float> acts(static_cast<size_t>(layer_act_floats(d)));
  MT_RETURN_IF_ERROR(math.embed(units[0].master.data(), tokens.data(), x.data()));
  for (int64_t l = 1; l <= L; ++l) {
    const UnitState& u = units[static_cast<size_t>(l)];
    LayerActsT<float> a = bind_layer_acts(d, acts.data());
    a.doc_starts = starts.empty() ? nullptr : starts.data();
    MT_RETURN_IF_ERROR(math.forward(view_unit(u, u.master.data()), x.data(), y.data(), a));
    x.swap(y);
  }
  const UnitState& hu = units[static_cast<size_t>(L + 1)];
  const float* final_norm = hu.master.data() + hu.find(TensorRole::kFinalNorm)->offset;
  const float* head = d.tied ? units[0].master.data() : hu.master.data() + hu.find(TensorRole::kHead)->offset;
  std::vector<float> rstd(static_cast<size_t>(d.N));
  cpu::rmsnorm_forward<float>(ctx, x.data(), final_norm, d.N, d.H, d.eps, y.data(), rstd.data());
  std::vector<float> logits(static_cast<size_t>(d.N * d.V));
  cpu::linear_forward<float>(ctx, y.data(), head, nullptr, d.N, d.H, d.V, logits.data());
  return logits;
}

}  // namespace megatrain::exec

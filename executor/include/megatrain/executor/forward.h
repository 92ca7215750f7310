// A forward pass of the whole model over token rows, giving the logits: what transformers' model(ids)
// returns, computed by the same layer templates (LayerMathT<float>) the CPU backend trains with.
// For checks against transformers (tests/transformers) and for users who want to see what a
// checkpoint predicts; not a serving path (the whole model is in RAM, one pass, no cache).
#pragma once

#include <cstdint>
#include <vector>

#include "megatrain/core/model_spec.h"
#include "megatrain/core/status.h"
#include "megatrain/executor/host_state.h"

namespace megatrain::exec {

// Logits [rows, seq_len, vocab] in fp32 for tokens [rows, seq_len] (row-major), from the master
// weights of `state`. Every row attends causally to itself only, positions 0..seq_len-1, as
// transformers' forward without an attention mask; with `position_ids` [rows, seq_len] (transformers'
// flattening collator's: 0 where a document begins, then counting up), each document of a packed
// row attends only to itself and its positions restart at 0, as transformers on each document
// alone. Errors: a token outside the vocabulary (named with its row and position), position ids
// that neither start a document nor continue one, rows or seq_len below 1, or seq_len above
// max_position_embeddings.
Result<std::vector<float>> forward_logits(const ModelSpec& model, const HostState& state, const std::vector<int32_t>& tokens,
                                          int64_t rows, int64_t seq_len, int threads = 1,
                                          const std::vector<int32_t>* position_ids = nullptr);

}  // namespace megatrain::exec

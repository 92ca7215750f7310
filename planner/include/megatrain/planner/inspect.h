// `megatrain-plan inspect`: what a model is, in numbers: parameter breakdown, FLOPs per token,
// training-state bytes per precision setup and activation bytes, as a table or as JSON.
#pragma once

#include <cstdint>
#include <string>

#include "megatrain/core/model_spec.h"

namespace megatrain::planner {

struct InspectOptions {
  int64_t seq_len = 0;          // 0: the model's max_position_embeddings
  bool list_tensors = false;    // also list every tensor with its HF name and shape
  bool list_ops = false;        // also list each kind of decoder layer's ops (arch::layer_ops)
};

// One JSON object (ARCHITECTURE.md section 8: parameters, embedding, per_layer, head, layers,
// flops_per_token, bytes, plus details), pretty-printed with a trailing newline.
std::string inspect_json(const ModelSpec& spec, const InspectOptions& opt);
// A readable report for a terminal.
std::string inspect_table(const ModelSpec& spec, const InspectOptions& opt);

}  // namespace megatrain::planner

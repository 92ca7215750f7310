#include "megatrain/buffers/shape.h"

namespace megatrain::buffers {

Shape shape_of(const ModelConfig& c, int64_t micro_batch, int64_t seq_len) {
  Shape s;
  s.B = micro_batch;
  s.T = seq_len;
  s.N = micro_batch * seq_len;
  s.H = c.hidden_size;
  s.I = c.intermediate_size;
  s.nh = c.num_heads;
  s.nkv = c.num_kv_heads;
  s.hd = c.head_dim;
  s.V = c.vocab_size;
  s.L = c.num_layers;
  s.q = s.nh * s.hd;
  s.kv = s.nkv * s.hd;
  s.qk_norm = c.qk_norm;
  s.sinks = c.attention_sinks;
  s.moe = c.is_moe();
  if (s.moe) {
    s.gpt_oss = c.moe == "gpt_oss";
    s.E = c.num_experts;
    s.k = c.experts_per_token;
    s.Im = c.moe_intermediate_size;
    s.dense_mlp = false;
    for (int64_t l = 0; l < c.num_layers; ++l) s.dense_mlp = s.dense_mlp || !c.is_moe_layer(l);
    s.moe_ops = arch::layer_ops_of_kind(c, true);
  }
  if (s.dense_mlp) s.dense_ops = arch::layer_ops_of_kind(c, false);
  return s;
}

int64_t dim_width(arch::Dim d, const Shape& s) {
  switch (d) {
    case arch::Dim::kVocab: return s.V;
    case arch::Dim::kHidden: return s.H;
    case arch::Dim::kIntermediate: return s.I;
    case arch::Dim::kQ: return s.q;
    case arch::Dim::kKv: return s.kv;
    case arch::Dim::kHeadDim: return s.hd;
    case arch::Dim::kHeads: return s.nh;
    case arch::Dim::kExperts: return s.E;
    case arch::Dim::kExpertInter: return s.Im;
    case arch::Dim::kExpertInter2: return 2 * s.Im;
    case arch::Dim::kQKv: return s.q + s.kv;
  }
  return 0;
}

}  // namespace megatrain::buffers

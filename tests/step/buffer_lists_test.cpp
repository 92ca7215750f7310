// The buffer lists (megatrain/buffers): each backend's device buffers as data, which the backends
// carve their arenas by and the compiled step's footprint sums (issue 30).
// - The figures equal those of the hand-written layouts they replaced (step/src/layout.cpp before
//   the lists, which tests/executor/cuda_trainer_test.cpp held equal to the CUDA backend's own carve
//   and compiled_step_test.cpp to the CPU backend's), for ten models, both compute dtypes and odd
//   token counts: the table below was printed by that code. Since then the CUDA private region
//   holds one more buffer, the two-stage column sums' partials (issue 31, row 6), and the attention
//   workspace the pointer arrays of its two-level batched GEMMs (row 7): both added by hand.
// - A hand-computed case: tiny-llama-gqa's CPU activations and the CUDA private region.
// - Carving lays buffers out back to back with the list's rounding, and refuses a buffer that is
//   not in the list or is taken with the wrong element size.
// - A layer size that differs between layers (a dense first layer of a MoE model) is covered: the
//   MLP buffers hold the larger of the dense and the experts' intermediates.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "megatrain/buffers/buffers.h"
#include "megatrain/step/schedule.h"

namespace {

using namespace megatrain;
using buffers::Buf;

struct Row {
  const char* model;
  const char* backend;  // "cpu", "cuda-fp32", "cuda-bf16"
  int64_t mb, seq;
  int64_t acts, workspace, head, private_bytes;
};

// Printed by the layouts this library replaced (issue 30), at 13c90a2.
const Row kBefore[] = {
    {"small-llama", "cpu", 1, 16, 63776, 59648, 12320, 0},
    {"small-llama", "cuda-fp32", 1, 16, 61952, 57600, 12608, 33573632},
    {"small-llama", "cuda-bf16", 1, 16, 35200, 47232, 12608, 33573632},
    {"small-llama", "cpu", 1, 17, 67898, 63512, 13090, 0},
    {"small-llama", "cuda-fp32", 1, 17, 65920, 61248, 13376, 33576448},
    {"small-llama", "cuda-bf16", 1, 17, 37568, 50304, 13376, 33576448},
    {"small-llama", "cpu", 1, 100, 465800, 440000, 77000, 0},
    {"small-llama", "cuda-fp32", 1, 100, 386688, 360000, 77440, 34201600},
    {"small-llama", "cuda-bf16", 1, 100, 219584, 295296, 77440, 34201600},
    {"small-llama", "cpu", 3, 16, 191328, 178944, 36960, 0},
    {"small-llama", "cuda-fp32", 3, 16, 185600, 172800, 37184, 33574656},
    {"small-llama", "cuda-bf16", 3, 16, 105344, 141696, 37184, 33574656},
    {"small-llama", "cpu", 3, 17, 203694, 190536, 39270, 0},
    {"small-llama", "cuda-fp32", 3, 17, 197376, 183744, 39488, 33577472},
    {"small-llama", "cuda-bf16", 3, 17, 112128, 150720, 39488, 33577472},
    {"small-llama", "cpu", 3, 100, 1397400, 1320000, 231000, 0},
    {"small-llama", "cuda-fp32", 3, 100, 1159872, 1080000, 232000, 34212608},
    {"small-llama", "cuda-bf16", 3, 100, 658368, 885696, 232000, 34212608},
    {"tiny-llama-gqa", "cpu", 1, 16, 15904, 14848, 6176, 0},
    {"tiny-llama-gqa", "cuda-fp32", 1, 16, 15040, 13824, 6464, 33565184},
    {"tiny-llama-gqa", "cuda-bf16", 1, 16, 8640, 11520, 8000, 33565184},
    {"tiny-llama-gqa", "cpu", 1, 17, 16966, 15844, 6562, 0},
    {"tiny-llama-gqa", "cuda-fp32", 1, 17, 16192, 14848, 6848, 33566976},
    {"tiny-llama-gqa", "cuda-bf16", 1, 17, 9600, 12672, 8512, 33566976},
    {"tiny-llama-gqa", "cpu", 1, 100, 133000, 126400, 38600, 0},
    {"tiny-llama-gqa", "cuda-fp32", 1, 100, 93504, 86400, 39040, 33880064},
    {"tiny-llama-gqa", "cuda-bf16", 1, 100, 53504, 72000, 48640, 33880064},
    {"tiny-llama-gqa", "cpu", 3, 16, 47712, 44544, 18528, 0},
    {"tiny-llama-gqa", "cuda-fp32", 3, 16, 44864, 41472, 18752, 33565696},
    {"tiny-llama-gqa", "cuda-bf16", 3, 16, 25664, 34560, 23360, 33565696},
    {"tiny-llama-gqa", "cpu", 3, 17, 50898, 47532, 19686, 0},
    {"tiny-llama-gqa", "cuda-fp32", 3, 17, 47872, 44224, 19904, 33567488},
    {"tiny-llama-gqa", "cuda-bf16", 3, 17, 27520, 36992, 24832, 33567488},
    {"tiny-llama-gqa", "cpu", 3, 100, 399000, 379200, 115800, 0},
    {"tiny-llama-gqa", "cuda-fp32", 3, 100, 280256, 259200, 116800, 33887744},
    {"tiny-llama-gqa", "cuda-bf16", 3, 100, 160256, 216000, 145600, 33887744},
    {"tiny-qwen2", "cpu", 1, 16, 14368, 13312, 6176, 0},
    {"tiny-qwen2", "cuda-fp32", 1, 16, 13504, 12288, 6464, 33565184},
    {"tiny-qwen2", "cuda-bf16", 1, 16, 7872, 10752, 8000, 33565184},
    {"tiny-qwen2", "cpu", 1, 17, 15334, 14212, 6562, 0},
    {"tiny-qwen2", "cuda-fp32", 1, 17, 14464, 13120, 6848, 33566976},
    {"tiny-qwen2", "cuda-bf16", 1, 17, 8640, 11712, 8512, 33566976},
    {"tiny-qwen2", "cpu", 1, 100, 123400, 116800, 38600, 0},
    {"tiny-qwen2", "cuda-fp32", 1, 100, 83904, 76800, 39040, 33880064},
    {"tiny-qwen2", "cuda-bf16", 1, 100, 48704, 67200, 48640, 33880064},
    {"tiny-qwen2", "cpu", 3, 16, 43104, 39936, 18528, 0},
    {"tiny-qwen2", "cuda-fp32", 3, 16, 40256, 36864, 18752, 33565696},
    {"tiny-qwen2", "cuda-bf16", 3, 16, 23360, 32256, 23360, 33565696},
    {"tiny-qwen2", "cpu", 3, 17, 46002, 42636, 19686, 0},
    {"tiny-qwen2", "cuda-fp32", 3, 17, 42880, 39232, 19904, 33567488},
    {"tiny-qwen2", "cuda-bf16", 3, 17, 25024, 34496, 24832, 33567488},
    {"tiny-qwen2", "cpu", 3, 100, 370200, 350400, 115800, 0},
    {"tiny-qwen2", "cuda-fp32", 3, 100, 251456, 230400, 116800, 33887744},
    {"tiny-qwen2", "cuda-bf16", 3, 100, 145856, 201600, 145600, 33887744},
    {"tiny-qwen3", "cpu", 1, 16, 16000, 14848, 6176, 0},
    {"tiny-qwen3", "cuda-fp32", 1, 16, 15168, 12288, 6464, 33565184},
    {"tiny-qwen3", "cuda-bf16", 1, 16, 9536, 10752, 8000, 33565184},
    {"tiny-qwen3", "cpu", 1, 17, 17068, 15844, 6562, 0},
    {"tiny-qwen3", "cuda-fp32", 1, 17, 16320, 13120, 6848, 33566976},
    {"tiny-qwen3", "cuda-bf16", 1, 17, 10496, 11712, 8512, 33566976},
    {"tiny-qwen3", "cpu", 1, 100, 133600, 126400, 38600, 0},
    {"tiny-qwen3", "cuda-fp32", 1, 100, 94208, 76800, 39040, 33880064},
    {"tiny-qwen3", "cuda-bf16", 1, 100, 59008, 67200, 48640, 33880064},
    {"tiny-qwen3", "cpu", 3, 16, 48000, 44544, 18528, 0},
    {"tiny-qwen3", "cuda-fp32", 3, 16, 45184, 36864, 18752, 33565696},
    {"tiny-qwen3", "cuda-bf16", 3, 16, 28288, 32256, 23360, 33565696},
    {"tiny-qwen3", "cpu", 3, 17, 51204, 47532, 19686, 0},
    {"tiny-qwen3", "cuda-fp32", 3, 17, 48192, 39232, 19904, 33567488},
    {"tiny-qwen3", "cuda-bf16", 3, 17, 30336, 34496, 24832, 33567488},
    {"tiny-qwen3", "cpu", 3, 100, 400800, 379200, 115800, 0},
    {"tiny-qwen3", "cuda-fp32", 3, 100, 282112, 230400, 116800, 33887744},
    {"tiny-qwen3", "cuda-bf16", 3, 100, 176512, 201600, 145600, 33887744},
    {"tiny-qwen3-moe", "cpu", 1, 16, 18953, 16032, 6176, 0},
    {"tiny-qwen3-moe", "cuda-fp32", 1, 16, 18304, 15040, 6464, 33566208},
    {"tiny-qwen3-moe", "cuda-bf16", 1, 16, 11392, 13312, 8000, 33566208},
    {"tiny-qwen3-moe", "cpu", 1, 17, 20205, 17102, 6562, 0},
    {"tiny-qwen3-moe", "cuda-fp32", 1, 17, 19840, 16192, 6848, 33568000},
    {"tiny-qwen3-moe", "cuda-bf16", 1, 17, 12608, 14592, 8512, 33568000},
    {"tiny-qwen3-moe", "cpu", 1, 100, 152009, 133800, 38600, 0},
    {"tiny-qwen3-moe", "cuda-fp32", 1, 100, 112960, 93888, 39040, 33881088},
    {"tiny-qwen3-moe", "cuda-bf16", 1, 100, 69760, 83136, 48640, 33881088},
    {"tiny-qwen3-moe", "cpu", 3, 16, 56841, 48096, 18528, 0},
    {"tiny-qwen3-moe", "cuda-fp32", 3, 16, 54208, 45056, 18752, 33566720},
    {"tiny-qwen3-moe", "cuda-bf16", 3, 16, 33472, 39872, 23360, 33566720},
    {"tiny-qwen3-moe", "cpu", 3, 17, 60597, 51306, 19686, 0},
    {"tiny-qwen3-moe", "cuda-fp32", 3, 17, 57920, 48064, 19904, 33568512},
    {"tiny-qwen3-moe", "cuda-bf16", 3, 17, 36032, 42816, 24832, 33568512},
    {"tiny-qwen3-moe", "cpu", 3, 100, 456009, 401400, 115800, 0},
    {"tiny-qwen3-moe", "cuda-fp32", 3, 100, 337600, 281472, 116800, 33888768},
    {"tiny-qwen3-moe", "cuda-bf16", 3, 100, 208000, 249088, 145600, 33888768},
    {"tiny-mixtral", "cpu", 1, 16, 17321, 16032, 6176, 0},
    {"tiny-mixtral", "cuda-fp32", 1, 16, 16640, 15040, 6464, 33566208},
    {"tiny-mixtral", "cuda-bf16", 1, 16, 9728, 13312, 8000, 33566208},
    {"tiny-mixtral", "cpu", 1, 17, 18471, 17102, 6562, 0},
    {"tiny-mixtral", "cuda-fp32", 1, 17, 17984, 16192, 6848, 33568000},
    {"tiny-mixtral", "cuda-bf16", 1, 17, 10752, 14592, 8512, 33568000},
    {"tiny-mixtral", "cpu", 1, 100, 141809, 133800, 38600, 0},
    {"tiny-mixtral", "cuda-fp32", 1, 100, 102656, 93888, 39040, 33881088},
    {"tiny-mixtral", "cuda-bf16", 1, 100, 59456, 83136, 48640, 33881088},
    {"tiny-mixtral", "cpu", 3, 16, 51945, 48096, 18528, 0},
    {"tiny-mixtral", "cuda-fp32", 3, 16, 49280, 45056, 18752, 33566720},
    {"tiny-mixtral", "cuda-bf16", 3, 16, 28544, 39872, 23360, 33566720},
    {"tiny-mixtral", "cpu", 3, 17, 55395, 51306, 19686, 0},
    {"tiny-mixtral", "cuda-fp32", 3, 17, 52608, 48064, 19904, 33568512},
    {"tiny-mixtral", "cuda-bf16", 3, 17, 30720, 42816, 24832, 33568512},
    {"tiny-mixtral", "cpu", 3, 100, 425409, 401400, 115800, 0},
    {"tiny-mixtral", "cuda-fp32", 3, 100, 306944, 281472, 116800, 33888768},
    {"tiny-mixtral", "cuda-bf16", 3, 100, 177344, 249088, 145600, 33888768},
    {"qwen3-30b-a3b", "cpu", 1, 16, 1184993, 1075328, 2496544, 0},
    {"qwen3-30b-a3b", "cuda-fp32", 1, 16, 1177472, 1067136, 2496832, 33630464},
    {"qwen3-30b-a3b", "cuda-bf16", 1, 16, 661376, 830592, 3695936, 33630464},
    {"qwen3-30b-a3b", "cpu", 1, 17, 1259591, 1143080, 2652578, 0},
    {"qwen3-30b-a3b", "cuda-fp32", 1, 17, 1251392, 1133888, 2652864, 33639424},
    {"qwen3-30b-a3b", "cuda-bf16", 1, 17, 703040, 882560, 3926912, 33639424},
    {"qwen3-30b-a3b", "cpu", 1, 100, 7674329, 6989600, 15603400, 0},
    {"qwen3-30b-a3b", "cuda-fp32", 1, 100, 7357824, 6669632, 15603840, 36138752},
    {"qwen3-30b-a3b", "cuda-bf16", 1, 100, 4132224, 5191232, 23098240, 36138752},
    {"qwen3-30b-a3b", "cpu", 3, 16, 3554721, 3225984, 7489632, 0},
    {"qwen3-30b-a3b", "cuda-fp32", 3, 16, 3531776, 3201408, 7489856, 33635072},
    {"qwen3-30b-a3b", "cuda-bf16", 3, 16, 1983488, 2491776, 11087168, 33635072},
    {"qwen3-30b-a3b", "cpu", 3, 17, 3778515, 3429240, 7957734, 0},
    {"qwen3-30b-a3b", "cuda-fp32", 3, 17, 3752768, 3401536, 7957952, 33644288},
    {"qwen3-30b-a3b", "cuda-bf16", 3, 17, 2107712, 2647552, 11780096, 33644288},
    {"qwen3-30b-a3b", "cpu", 3, 100, 23022729, 20968800, 46810200, 0},
    {"qwen3-30b-a3b", "cuda-fp32", 3, 100, 22072576, 20008832, 17972800, 36172032},
    {"qwen3-30b-a3b", "cuda-bf16", 3, 100, 12395776, 15573632, 26036800, 36172032},
    {"mixtral-8x7b", "cpu", 1, 16, 2073001, 2007200, 643104, 0},
    {"mixtral-8x7b", "cuda-fp32", 1, 16, 2065600, 1999040, 643392, 33625344},
    {"mixtral-8x7b", "cuda-bf16", 1, 16, 1098944, 1327360, 866624, 33625344},
    {"mixtral-8x7b", "cpu", 1, 17, 2203107, 2133194, 683298, 0},
    {"mixtral-8x7b", "cuda-fp32", 1, 17, 2194816, 2124032, 683584, 33634304},
    {"mixtral-8x7b", "cuda-bf16", 1, 17, 1167744, 1410432, 920768, 33634304},
    {"mixtral-8x7b", "cpu", 1, 100, 13225009, 12813800, 4019400, 0},
    {"mixtral-8x7b", "cuda-fp32", 1, 100, 12908608, 12493888, 4019840, 36132096},
    {"mixtral-8x7b", "cuda-bf16", 1, 100, 6867008, 8295936, 5415040, 36132096},
    {"mixtral-8x7b", "cpu", 3, 16, 6218985, 6021600, 1929312, 0},
    {"mixtral-8x7b", "cuda-fp32", 3, 16, 6196160, 5997056, 1929536, 33629440},
    {"mixtral-8x7b", "cuda-bf16", 3, 16, 3296192, 3982016, 2599232, 33629440},
    {"mixtral-8x7b", "cpu", 3, 17, 6609303, 6399582, 2049894, 0},
    {"mixtral-8x7b", "cuda-fp32", 3, 17, 6583488, 6371904, 2050112, 33638656},
    {"mixtral-8x7b", "cuda-bf16", 3, 17, 3502272, 4230976, 2761664, 33638656},
    {"mixtral-8x7b", "cpu", 3, 100, 39675009, 38441400, 12058200, 0},
    {"mixtral-8x7b", "cuda-fp32", 3, 100, 38724928, 37481472, 12059200, 36162304},
    {"mixtral-8x7b", "cuda-bf16", 3, 100, 20600128, 24887488, 16244800, 36162304},
    {"tiny-gpt-oss", "cpu", 1, 16, 15849, 14496, 6176, 0},
    {"tiny-gpt-oss", "cuda-fp32", 1, 16, 15104, 13504, 6464, 33566208},
    {"tiny-gpt-oss", "cuda-bf16", 1, 16, 8960, 12544, 8000, 33566208},
    {"tiny-gpt-oss", "cpu", 1, 17, 16907, 15470, 6562, 0},
    {"tiny-gpt-oss", "cuda-fp32", 1, 17, 16256, 14464, 6848, 33568000},
    {"tiny-gpt-oss", "cuda-bf16", 1, 17, 9920, 13760, 8512, 33568000},
    {"tiny-gpt-oss", "cpu", 1, 100, 132609, 124200, 38600, 0},
    {"tiny-gpt-oss", "cuda-fp32", 1, 100, 93056, 84288, 39040, 33881088},
    {"tiny-gpt-oss", "cuda-bf16", 1, 100, 54656, 78336, 48640, 33881088},
    {"tiny-gpt-oss", "cpu", 3, 16, 47529, 43488, 18528, 0},
    {"tiny-gpt-oss", "cuda-fp32", 3, 16, 44672, 40448, 18752, 33566720},
    {"tiny-gpt-oss", "cuda-bf16", 3, 16, 26240, 37568, 23360, 33566720},
    {"tiny-gpt-oss", "cpu", 3, 17, 50703, 46410, 19686, 0},
    {"tiny-gpt-oss", "cuda-fp32", 3, 17, 47616, 43072, 19904, 33568512},
    {"tiny-gpt-oss", "cuda-bf16", 3, 17, 28160, 40256, 24832, 33568512},
    {"tiny-gpt-oss", "cpu", 3, 100, 397809, 372600, 115800, 0},
    {"tiny-gpt-oss", "cuda-fp32", 3, 100, 278144, 252672, 116800, 33888768},
    {"tiny-gpt-oss", "cuda-bf16", 3, 100, 162944, 234688, 145600, 33888768},
    {"gpt-oss-20b", "cpu", 1, 16, 1272129, 1224256, 3309600, 0},
    {"gpt-oss-20b", "cuda-fp32", 1, 16, 1255872, 1207872, 3309888, 33693696},
    {"gpt-oss-20b", "cuda-bf16", 1, 16, 675264, 893760, 4895552, 33693696},
    {"gpt-oss-20b", "cpu", 1, 17, 1352723, 1301860, 3516450, 0},
    {"gpt-oss-20b", "cuda-fp32", 1, 17, 1334656, 1283456, 3516736, 33710848},
    {"gpt-oss-20b", "cuda-bf16", 1, 17, 717824, 949824, 5201536, 33710848},
    {"gpt-oss-20b", "cpu", 1, 100, 8488233, 8189200, 20685000, 0},
    {"gpt-oss-20b", "cuda-fp32", 1, 100, 7848512, 7549248, 17344640, 38705664},
    {"gpt-oss-20b", "cuda-bf16", 1, 100, 4219712, 5586048, 25584640, 38705664},
    {"gpt-oss-20b", "cpu", 3, 16, 3816321, 3672768, 9928800, 0},
    {"gpt-oss-20b", "cuda-fp32", 3, 16, 3767232, 3623616, 9929024, 33701888},
    {"gpt-oss-20b", "cuda-bf16", 3, 16, 2025408, 2681280, 14686016, 33701888},
    {"gpt-oss-20b", "cpu", 3, 17, 4058103, 3905580, 10549350, 0},
    {"gpt-oss-20b", "cuda-fp32", 3, 17, 4002944, 3850176, 10549568, 33719552},
    {"gpt-oss-20b", "cuda-bf16", 3, 17, 2152320, 2849024, 15603904, 33719552},
    {"gpt-oss-20b", "cpu", 3, 100, 25464633, 24567600, 62055000, 0},
    {"gpt-oss-20b", "cuda-fp32", 3, 100, 23544768, 22647616, 18472000, 38761984},
    {"gpt-oss-20b", "cuda-bf16", 3, 100, 12658368, 16758016, 26411200, 38761984},
};

// The CUDA private region's bytes since the table: the column sums' partials (issue 31, row 6), 128
// chunks of the widest sum's columns in doubles, the widest being the hidden size, q, k/v,
// head_dim, or the experts of a MoE model; and the attention's pointer arrays (row 7), three
// 8-byte addresses per head; and the rows' document starts and RoPE positions (data packed
// "neat", 2026-12-07), two int32 per token. Each rounded to 256 bytes.
int64_t added_private_bytes(const ModelConfig& c, int64_t tokens) {
  const int64_t cols = std::max({c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim,
                                 c.num_experts > 0 ? c.num_experts : int64_t{0}});
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  return up(128 * 8 * cols) + up(3 * 8 * c.num_heads) + up(2 * 4 * tokens);
}

TEST(BufferLists, TheFiguresEqualTheLayoutsTheyReplaced) {
  int checked = 0;
  for (const Row& r : kBefore) {
    auto model = ModelSpec::load(r.model);
    ASSERT_TRUE(model.ok()) << model.status().to_string();
    const std::string b = r.backend;
    const step::ActivationLayout l = b == "cpu" ? step::cpu_layout(*model, r.mb, r.seq)
                                                : step::cuda_layout(*model, r.mb, r.seq, b == "cuda-bf16" ? DType::kBf16 : DType::kFp32);
    SCOPED_TRACE(std::string(r.model) + " " + b + " mb " + std::to_string(r.mb) + " seq " + std::to_string(r.seq));
    EXPECT_EQ(l.layer_act_floats, r.acts);
    EXPECT_EQ(l.layer_workspace_floats, r.workspace);
    EXPECT_EQ(l.head_workspace_floats, r.head);
    EXPECT_EQ(l.private_bytes, r.private_bytes + (b == "cpu" ? 0 : added_private_bytes(model->config(), r.mb * r.seq)));
    ++checked;
  }
  EXPECT_EQ(checked, 180);
}

TEST(BufferLists, TinyLlamaByHand) {
  auto model = ModelSpec::load("tiny-llama-gqa");
  ASSERT_TRUE(model.ok());
  const ModelConfig& c = model->config();
  const int64_t B = 2, T = 16, N = B * T, H = c.hidden_size, I = c.intermediate_size, nh = c.num_heads,
                kv = c.num_kv_heads * c.head_dim, q = nh * c.head_dim;
  const buffers::Shape s = buffers::shape_of(c, B, T);
  // x, xn1, h, xn2 [N, H]; rstd1, rstd2 [N]; q, attn [N, q]; k, v [N, kv]; probs [B, nh, T, T];
  // gate, up, act [N, I].
  EXPECT_EQ(buffers::cpu_layer_acts(s).bytes(), 4 * (4 * N * H + 2 * N + 2 * N * q + 2 * N * kv + B * nh * T * T + 3 * N * I));
  // logits [N, V], lse and rstd [N], xn and dxn [N, H].
  EXPECT_EQ(buffers::cpu_head_workspace(s).bytes(), 4 * (N * c.vocab_size + 2 * N + 2 * N * H));
  // The CUDA private region of a dense model: cuBLAS's 32 MiB, the attention blocks (scores,
  // probabilities, row sums, the batched GEMMs' pointers), six token arrays (one of N + 1), the
  // document starts and positions (2 N), the inverse frequencies, two 8-byte counters, the column
  // sums' partials (128 chunks of 64 columns, the hidden size, in doubles), each rounded to 256
  // bytes; the MoE parts are empty.
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t rows = buffers::cuda_attention_rows(s);
  EXPECT_EQ(rows, T) << "a small sequence is one attention block";
  const int64_t attn = 2 * up(nh * rows * T * 4) + up(B * nh * T * 4) + up(3 * 8 * nh);
  EXPECT_EQ(buffers::cuda_private(s).bytes(),
            (int64_t{32} << 20) + attn + 5 * up(4 * N) + up(4 * (N + 1)) + up(8 * N) + up(4 * (c.head_dim / 2)) + 2 * 256 +
                128 * 64 * 8);
  EXPECT_EQ(H, 64);
}

// The CUDA head's logit chunk: 16 Mi logits over the rows, in whole 128-column steps, at least 128
// columns and at most the vocabulary, also when the vocabulary is below 128 (std::clamp's bounds
// would be the wrong way round there, which is undefined behaviour).
TEST(BufferLists, TheLogitChunkFitsEveryVocabulary) {
  auto model = ModelSpec::load("tiny-llama-gqa");
  ASSERT_TRUE(model.ok());
  ModelConfig c = model->config();
  const buffers::Shape small = buffers::shape_of(c, 2, 16);  // 32 rows: the whole vocabulary of 256
  EXPECT_EQ(buffers::cuda_vocab_chunk(small), 256);
  c.vocab_size = 100;
  EXPECT_EQ(buffers::cuda_vocab_chunk(buffers::shape_of(c, 2, 16)), 100);
  c.vocab_size = 1 << 20;  // 16 Mi logits / 4096 rows = 4096 columns
  EXPECT_EQ(buffers::cuda_vocab_chunk(buffers::shape_of(c, 4, 1024)), 4096);
  c.vocab_size = 50;  // rows beyond 16 Mi / 128 would ask for under 128 columns: the vocabulary caps it
  EXPECT_EQ(buffers::cuda_vocab_chunk(buffers::shape_of(c, 256, 1024)), 50);
}

// The tests' caps (buffers::BlockCaps) only ever lower the rule's sizes.
TEST(BufferLists, TheBlockCapsLowerTheChunkAndTheAttentionBlockOnly) {
  auto model = ModelSpec::load("tiny-llama-gqa");
  ASSERT_TRUE(model.ok());
  buffers::Shape s = buffers::shape_of(model->config(), 2, 24);
  EXPECT_EQ(buffers::cuda_vocab_chunk(s), 256);
  EXPECT_EQ(buffers::cuda_attention_rows(s), 24);
  s.caps = {96, 8};
  EXPECT_EQ(buffers::cuda_vocab_chunk(s), 96);
  EXPECT_EQ(buffers::cuda_attention_rows(s), 8);
  s.caps = {1000, 1000};  // above the rule's sizes: no effect
  EXPECT_EQ(buffers::cuda_vocab_chunk(s), 256);
  EXPECT_EQ(buffers::cuda_attention_rows(s), 24);
}

TEST(BufferLists, CarvingLaysTheListOutAndRefusesWhatItDoesNotHold) {
  buffers::BufferList l;
  l.align = 256;
  l.add(Buf::kX, 10, 4);
  l.add(Buf::kXn1, 0, 2);
  l.add(Buf::kRouteExpert, 65, 4);
  l.add(Buf::kLossSum, 1, 8);
  EXPECT_EQ(l.bytes(), 256 + 0 + 512 + 256);
  alignas(256) static char arena[1024];
  const buffers::Carving c(l, arena);
  EXPECT_EQ(c.bytes(), l.bytes());
  EXPECT_EQ(reinterpret_cast<char*>(c.get<float>(Buf::kX)), arena);
  EXPECT_EQ(reinterpret_cast<char*>(c.get<uint16_t>(Buf::kXn1)), arena + 256);
  EXPECT_EQ(reinterpret_cast<char*>(c.get<int32_t>(Buf::kRouteExpert)), arena + 256);
  EXPECT_EQ(reinterpret_cast<char*>(c.get<double>(Buf::kLossSum)), arena + 768);
  EXPECT_TRUE(c.has(Buf::kX));
  EXPECT_FALSE(c.has(Buf::kProbs));
  const buffers::Carving sized(l, nullptr);
  EXPECT_EQ(sized.get<float>(Buf::kX), nullptr);
  EXPECT_EQ(sized.bytes(), l.bytes());
  EXPECT_DEATH((void)c.get<float>(Buf::kProbs), "probs is not in this backend's list");
  EXPECT_DEATH((void)c.get<double>(Buf::kX), "x holds elements of 4 bytes, taken as 8");
  buffers::BufferList twice = l;
  twice.add(Buf::kX, 1, 4);
  EXPECT_DEATH(buffers::Carving(twice, nullptr), "x appears twice");
}

// The widths the backends and the buffer lists read from a Shape are the config's (arch::dim_value)
// for every shape symbol, on a dense, a MoE and a gpt-oss model.
TEST(BufferLists, TheShapesWidthsAreTheConfigs) {
  for (const char* name : {"tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss"}) {
    auto model = ModelSpec::load(name);
    ASSERT_TRUE(model.ok());
    const ModelConfig& c = model->config();
    const buffers::Shape s = buffers::shape_of(c, 2, 16);
    for (int d = 0; d <= static_cast<int>(megatrain::arch::Dim::kQKv); ++d) {
      const auto dim = static_cast<megatrain::arch::Dim>(d);
      EXPECT_EQ(buffers::dim_width(dim, s), megatrain::arch::dim_value(dim, c)) << name << " dim " << d;
    }
  }
}

// The activation list is the values the layer's ops write (issue 47): gpt-oss's experts write
// gate and up interleaved into one value, 2 x Im a slot, and nothing writes up alone, so the list
// has a gate of N k 2 Im and no up: the bytes the two buffers of Im held before.
TEST(BufferLists, GptOssKeepsItsInterleavedGateUpAsOneValue) {
  auto model = ModelSpec::load("tiny-gpt-oss");
  ASSERT_TRUE(model.ok());
  const ModelConfig& c = model->config();
  const buffers::Shape s = buffers::shape_of(c, 2, 16);
  ASSERT_FALSE(s.dense_mlp);
  const buffers::BufferList acts = buffers::cpu_layer_acts(s);
  int64_t gate = -1, act = -1;
  bool up = false;
  for (const auto& b : acts.items) {
    if (b.id == Buf::kGate) gate = b.count;
    if (b.id == Buf::kAct) act = b.count;
    up = up || b.id == Buf::kUp;
  }
  EXPECT_EQ(gate, s.N * c.experts_per_token * 2 * c.moe_intermediate_size);
  EXPECT_EQ(act, s.N * c.experts_per_token * c.moe_intermediate_size);
  EXPECT_FALSE(up);
}

TEST(BufferLists, TheMlpBuffersHoldTheLargerOfTheDenseAndTheExpertLayers) {
  auto model = ModelSpec::load("tiny-qwen3-moe");
  ASSERT_TRUE(model.ok());
  for (const std::vector<int64_t>& dense : {std::vector<int64_t>{0}, {1}, {2}, {}}) {
    ModelConfig c = model->config();
    c.mlp_only_layers = dense;
    const buffers::Shape s = buffers::shape_of(c, 2, 16);
    EXPECT_EQ(s.dense_mlp, !dense.empty());
    const int64_t expected = std::max(dense.empty() ? 0 : s.N * c.intermediate_size, s.N * s.k * c.moe_intermediate_size);
    EXPECT_EQ(s.mlp_floats(), expected);
    const buffers::BufferList acts = buffers::cpu_layer_acts(s);
    for (const auto& b : acts.items) {
      if (b.id == Buf::kGate || b.id == Buf::kUp || b.id == Buf::kAct) {
        EXPECT_EQ(b.count, expected) << buffers::buf_name(b.id);
      }
    }
  }
}

}  // namespace

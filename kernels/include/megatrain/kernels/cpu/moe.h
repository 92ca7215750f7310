// The Mixture-of-Experts block's CPU ops (Mixtral, Qwen3-MoE as HF transformers computes them):
// the router's softmax and top-k, the sort of token slots by expert, the gather of their inputs,
// the grouped expert GEMMs (one Eigen GEMM per expert and projection, through linear.h), the
// weighted combine of each token's k outputs, their backward, and the statistics of HF's
// load-balancing loss. Slot j of token t is row t*k + j of the routing arrays.
//
// Determinism: every output element is produced by one thread with a fixed summation order, and
// the grouped GEMMs keep linear.h's thread-independent blocking, so results do not depend on the
// thread count (determinism_test.cpp). HF sums a token's k expert outputs with index_add_ in
// expert order; here they are summed in slot order: the same value up to rounding.
#pragma once

#include <cstdint>

#include "megatrain/kernels/cpu/context.h"

namespace megatrain::cpu {

// p = softmax(logits) over the e experts of each of the n tokens; the k largest p (descending,
// ties to the lower expert index) give expert[t*k+j] and weight[t*k+j] = p, divided by the sum
// of the k chosen p when renorm. probs [n, e] receives p.
template <typename T>
void moe_route_forward(CpuContext& ctx, const T* logits, int64_t n, int64_t e, int64_t k, bool renorm, int32_t* expert,
                       T* weight, T* probs);
// dlogits [n, e] (overwritten) from d_weight [n*k] through the renormalisation and the softmax,
// plus, when d_probs_const is not null, d_probs_const[x] added to d p[t][x] for every token (the
// load-balancing loss's gradient, the same for every token).
template <typename T>
void moe_route_backward(CpuContext& ctx, const T* probs, const int32_t* expert, const T* weight, const T* d_weight,
                        const T* d_probs_const, int64_t n, int64_t e, int64_t k, bool renorm, T* dlogits);
// Sigmoid routing with a selection-only bias and group-limited top-k (DeepSeek-V3, Kimi-K2, GLM-4.5;
// MiniMax-M2 with one group), as transformers' DeepseekV3TopkRouter computes it from the router's
// logits [n, e]: scores s = sigmoid(logits) (kept, [n, e]); the choice ranks s + bias (bias [e]:
// e_score_correction_bias, which only chooses); the e experts form n_group groups of e / n_group
// in order, each group ranked by the sum of its two largest biased scores, and only the experts
// of the topk_group best groups may be chosen; the k chosen (largest biased score first, the lower
// index on a tie) weigh s, divided by their sum + 1e-20 when renorm, times `scale`
// (routed_scaling_factor). n_group must divide e, each group hold at least 2 experts (1 when
// n_group is 1), and topk_group groups hold at least k experts.
struct SigmoidRoute {
  int64_t n_group = 1, topk_group = 1;
  bool renorm = true;
  double scale = 1.0;
};
template <typename T>
void moe_sigmoid_route_forward(CpuContext& ctx, const T* logits, const T* bias, int64_t n, int64_t e, int64_t k,
                               const SigmoidRoute& r, int32_t* expert, T* weight, T* scores);
// dlogits [n, e] (overwritten) from d_weight [n*k]: through the scale, the renormalisation and the
// sigmoid of the chosen experts (the others and the bias get none: the choice is not differentiable).
template <typename T>
void moe_sigmoid_route_backward(CpuContext& ctx, const T* scores, const int32_t* expert, const T* d_weight, int64_t n,
                                int64_t e, int64_t k, const SigmoidRoute& r, T* dlogits);
// A stable counting sort of the n*k slots by expert: offsets [e+1] (offsets[0] = 0, expert x
// owns rows offsets[x] .. offsets[x+1]) and perm [n*k] (the slot of each sorted row; ascending
// within an expert). Fails (MT_CHECK) on an expert index outside [0, e).
void moe_permute(const int32_t* expert, int64_t n, int64_t k, int64_t e, int32_t* offsets, int32_t* perm);
// xp[r, :] = x[perm[r] / k, :] for the rows r < rows (= n*k), h columns.
template <typename T>
void moe_gather(CpuContext& ctx, const T* x, const int32_t* perm, int64_t rows, int64_t k, int64_t h, T* xp);
// For every expert x with rows: y[rows_x, out] = x[rows_x, in] W_x^T (+ b_x), W_x = w + x*w_stride
// laid out [out, in] as torch.nn.Linear, b_x = bias + x*b_stride (bias may be null).
template <typename T>
void grouped_linear_forward(CpuContext& ctx, const T* x, const T* w, int64_t w_stride, const T* bias, int64_t b_stride,
                            const int32_t* offsets, int64_t e, int64_t in, int64_t out, T* y);
// The backward: dx [rows, in] overwritten (null: skipped), dW_x and db_x accumulated (null:
// skipped). An expert with no rows is not touched.
template <typename T>
void grouped_linear_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, int64_t w_stride, const int32_t* offsets,
                             int64_t e, int64_t in, int64_t out, T* dx, T* dw, T* db, int64_t b_stride);
// gpt-oss's stacked experts, weights laid out [in, out] (x @ W, not nn.Linear's x W^T): for every
// expert x with rows, y[rows_x, out] = b_x + x[rows_x, in] W_x, W_x = w + x*w_stride [in, out].
template <typename T>
void grouped_matmul_forward(CpuContext& ctx, const T* x, const T* w, int64_t w_stride, const T* bias, int64_t b_stride,
                            const int32_t* offsets, int64_t e, int64_t in, int64_t out, T* y);
// dx = dy W_x^T (overwritten; null: skipped), dW_x += x^T dy, db_x += the column sums of dy (rows
// in order); an expert with no rows is not touched.
template <typename T>
void grouped_matmul_backward(CpuContext& ctx, const T* dy, const T* x, const T* w, int64_t w_stride, const int32_t* offsets,
                             int64_t e, int64_t in, int64_t out, T* dx, T* dw, T* db, int64_t b_stride);
// out[t, :] (overwritten) = sum over j = 0..k-1, in order, of weight[t*k+j] * yp[row_of_slot[t*k+j], :].
template <typename T>
void moe_combine_forward(CpuContext& ctx, const T* yp, const T* weight, const int32_t* row_of_slot, int64_t n, int64_t k,
                         int64_t h, T* out);
// dyp[row_of_slot[s], :] = weight[s] * dout[s/k, :] and d_weight[s] = dout[s/k, :] . yp[row_of_slot[s], :].
template <typename T>
void moe_combine_backward(CpuContext& ctx, const T* yp, const T* weight, const int32_t* row_of_slot, const T* dout,
                          int64_t n, int64_t k, int64_t h, T* dyp, T* d_weight);
// dx[t, :] (overwritten) = sum over j in order of dxp[row_of_slot[t*k+j], :] (moe_gather's backward).
template <typename T>
void moe_scatter_add(CpuContext& ctx, const T* dxp, const int32_t* row_of_slot, int64_t n, int64_t k, int64_t h, T* dx);
// The statistics of HF's load_balancing_loss_func for one layer, added in double: count[x] += the
// slots choosing x, prob_sum[x] += the sum over tokens (in order) of probs[t][x].
template <typename T>
void moe_aux_stats(const T* probs, const int32_t* expert, int64_t n, int64_t e, int64_t k, double* count, double* prob_sum);

}  // namespace megatrain::cpu

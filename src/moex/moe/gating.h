// GatingTopK: the MoE router. logits = x @ w_gate^T, then the top-k experts per token and their weights.
// Semantics (DESIGN.md §3): with norm_topk_prob (Mixtral) the weights are a softmax over the k chosen
// logits; without it (Qwen-MoE) they are the softmax over all E, not renormalised. Ties: lower index wins.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/base/tensor.h"

namespace moex {

enum class RouterFusion {
  kNone,         // matmul writes logits [T,E]; top-k and softmax are separate passes over memory
  kTopkSoftmax,  // matmul writes logits; one fused top-k + softmax pass
  kFull,         // per block of tokens: dot products, top-k and softmax while the logits are in L1
};
RouterFusion router_fusion_from_name(const std::string& name);  // throws Error listing valid names
const char* router_fusion_name(RouterFusion fusion);

// Which scoring the router applies to the logits (model/config.h maps each family onto one).
//   softmax:          weights from the softmax over E (or over the chosen k with norm_topk_prob), as above.
//   sigmoid_grouped:  DeepSeek-V3 / dots1 (HF DeepseekV3TopkRouter): s = sigmoid(logits); the choice uses
//                     c = s + e_score_correction_bias: groups of E/n_group experts score the sum of their two
//                     best c, the topk_group best groups stay (ties: lower group), the other experts' c are
//                     set to 0 (not -inf, as HF does), and the top-k of c are chosen; their weights are s,
//                     divided by (sum + 1e-20) with norm_topk_prob, times routed_scaling_factor.
struct RouterSpec {
  bool sigmoid_grouped = false;
  int n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.0f;
};

class GatingTopK {
 public:
  GatingTopK(int num_experts, int top_k, RouterFusion fusion, bool norm_topk_prob = true, RouterSpec spec = {});

  // x [T, d], w_gate [E, d] (BF16 or F32) -> expert_ids [T, k] (best first), expert_weights [T, k].
  // correction_bias [E] (F32 or BF16): e_score_correction_bias of the sigmoid router, required by it only.
  // The sigmoid router always takes the unfused path (router_logits, then one pass per token).
  void route(const float* x, int64_t tokens, const TensorView& w_gate, int32_t* expert_ids, float* expert_weights,
             const TensorView& correction_bias = TensorView{});

  int num_experts() const { return num_experts_; }
  int top_k() const { return top_k_; }
  RouterFusion fusion() const { return fusion_; }

 private:
  int num_experts_, top_k_;
  RouterFusion fusion_;
  bool norm_topk_prob_;
  RouterSpec spec_;
  std::vector<float> correction_;  // [E] the correction bias widened to f32
  std::vector<float> logits_;  // [T, E] for the unfused modes; grows to the largest T seen
};

namespace gating {
// Tokens handed to one thread at a time by every mode: the same split for the floor and the fused pass.
constexpr int64_t kTokensPerTask = 8;
// Experts up to which the fused pass keeps a token block's logits on the stack (beyond: per-token heap row).
constexpr int kMaxFusedExperts = 256;

// The bare gating matmul, logits [T, E] = x [T, d] @ w_gate [E, d]^T, threads split tokens (E is too
// small to split): the floor the fused router is measured against, and the first pass of the unfused modes.
// The same register kernel as route_fused (all E rows per x load), so it differs only in writing logits.
void router_logits(const float* x, int64_t tokens, const TensorView& w_gate, float* logits);

// The `full` pass over tokens [0, tokens) on the calling thread: per block of tokens, dot products in
// registers, then top-k and weights; the block's logits never leave L1. E <= kMaxFusedExperts.
// Bitwise the same logits as kernels::matmul (same lane order and reduction), so every mode agrees exactly.
void route_fused(const float* x, int64_t tokens, const TensorView& w_gate, int k, bool norm_topk_prob,
                 int32_t* expert_ids, float* expert_weights);
namespace x86 {
void router_logits_avx512(const float* x, int64_t tokens, const TensorView& w_gate, float* logits);
void route_fused_avx512(const float* x, int64_t tokens, const TensorView& w_gate, int k, bool norm_topk_prob,
                        int32_t* expert_ids, float* expert_weights);
}  // namespace x86

// Top-k of one token's E logits, best first, lower index on ties. ids [k], values [k].
void top_k(const float* logits, int num_experts, int k, int32_t* ids, float* values);
// From the chosen logits to routing weights, in place (see the header comment for both variants).
void weights_from_logits(const float* all_logits, int num_experts, int k, bool norm_topk_prob, float* values);
// The sigmoid_grouped router over one token's E logits (see RouterSpec): ids [k] in choice order (the top-k of
// the corrected, group-masked scores, best first, lower index on ties), weights [k]. scratch [2 E].
void route_sigmoid_grouped(const float* logits, const float* correction_bias, int num_experts, int k,
                           bool norm_topk_prob, const RouterSpec& spec, int32_t* ids, float* weights, float* scratch);
}  // namespace gating

}  // namespace moex

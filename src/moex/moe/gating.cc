#include "moex/moe/gating.h"

#include <algorithm>
#include <cmath>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"

namespace moex {

RouterFusion router_fusion_from_name(const std::string& name) {
  if (name == "none") return RouterFusion::kNone;
  if (name == "topk_softmax") return RouterFusion::kTopkSoftmax;
  if (name == "full") return RouterFusion::kFull;
  throw_error(ErrorKind::kInvalidInput, "unknown router fusion \"" + name + "\" (valid: none, topk_softmax, full)");
}

const char* router_fusion_name(RouterFusion fusion) {
  switch (fusion) {
    case RouterFusion::kNone: return "none";
    case RouterFusion::kTopkSoftmax: return "topk_softmax";
    case RouterFusion::kFull: return "full";
  }
  return "?";
}

namespace gating {

void top_k(const float* logits, int num_experts, int k, int32_t* ids, float* values) {
  int found = 0;
  for (int e = 0; e < num_experts; ++e) {
    const float v = logits[e];
    // Insertion into the sorted k best; strict '>' keeps the earlier (lower) index on ties.
    int pos = found;
    while (pos > 0 && v > values[pos - 1]) --pos;
    if (pos >= k) continue;
    const int last = std::min(found, k - 1);
    for (int i = last; i > pos; --i) {
      values[i] = values[i - 1];
      ids[i] = ids[i - 1];
    }
    values[pos] = v;
    ids[pos] = e;
    found = std::min(found + 1, k);
  }
}

void weights_from_logits(const float* all_logits, int num_experts, int k, bool norm_topk_prob, float* values) {
  const float max_value = values[0];  // values are sorted best first
  if (norm_topk_prob) {
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += (values[i] = std::exp(values[i] - max_value));
    for (int i = 0; i < k; ++i) values[i] /= sum;
  } else {
    float sum = 0.0f;
    for (int e = 0; e < num_experts; ++e) sum += std::exp(all_logits[e] - max_value);
    for (int i = 0; i < k; ++i) values[i] = std::exp(values[i] - max_value) / sum;
  }
}

void route_sigmoid_grouped(const float* logits, const float* correction_bias, int num_experts, int k,
                           bool norm_topk_prob, const RouterSpec& spec, int32_t* ids, float* weights, float* scratch) {
  const int E = num_experts, groups = spec.n_group, per_group = E / groups;
  float* scores = scratch;      // [E] sigmoid(logits)
  float* choice = scratch + E;  // [E] scores + correction, group-masked
  for (int e = 0; e < E; ++e) {
    scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = scores[e] + correction_bias[e];
  }
  if (groups > 1) {
    // Each group's score: the sum of its two best corrected scores. Keep the topk_group best groups.
    float group_score[kMaxFusedExperts];
    int32_t group_ids[kMaxFusedExperts];
    float best2[2];
    int32_t best2_ids[2];
    for (int g = 0; g < groups; ++g) {
      top_k(choice + g * per_group, per_group, 2, best2_ids, best2);
      group_score[g] = best2[0] + best2[1];
    }
    float kept_scores[kMaxFusedExperts];
    top_k(group_score, groups, spec.topk_group, group_ids, kept_scores);
    bool keep[kMaxFusedExperts] = {};
    for (int i = 0; i < spec.topk_group; ++i) keep[group_ids[i]] = true;
    for (int g = 0; g < groups; ++g) {
      if (keep[g]) continue;
      for (int e = g * per_group; e < (g + 1) * per_group; ++e) choice[e] = 0.0f;  // HF's masked_fill(0.0)
    }
  }
  float chosen[kMaxFusedExperts];
  top_k(choice, E, k, ids, chosen);
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += (weights[i] = scores[ids[i]]);
  const float scale = norm_topk_prob ? spec.routed_scaling_factor / (sum + 1e-20f) : spec.routed_scaling_factor;
  for (int i = 0; i < k; ++i) weights[i] *= scale;
}

void router_logits(const float* x, int64_t tokens, const TensorView& w_gate, float* logits) {
  const int64_t d = w_gate.shape[1], E = w_gate.shape[0];
  const bool simd = use_x86_kernels();
  parallel_for(tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    if (simd)
      x86::router_logits_avx512(x + begin * d, end - begin, w_gate, logits + begin * E);
    else
      kernels::matmul_single_thread(x + begin * d, end - begin, w_gate, logits + begin * E);
  });
}

void route_fused(const float* x, int64_t tokens, const TensorView& w_gate, int k, bool norm_topk_prob,
                 int32_t* expert_ids, float* expert_weights) {
  const int E = static_cast<int>(w_gate.shape[0]);
  const int64_t d = w_gate.shape[1];
  MOEX_CHECK(E <= kMaxFusedExperts, "fused router: ", E, " experts > ", kMaxFusedExperts);
  if (use_x86_kernels()) {
    x86::route_fused_avx512(x, tokens, w_gate, k, norm_topk_prob, expert_ids, expert_weights);
    return;
  }
  // Scalar path: one token's logits at a time on the stack.
  float logits[kMaxFusedExperts];
  for (int64_t t = 0; t < tokens; ++t) {
    kernels::matmul_single_thread(x + t * d, 1, w_gate, logits);
    top_k(logits, E, k, expert_ids + t * k, expert_weights + t * k);
    weights_from_logits(logits, E, k, norm_topk_prob, expert_weights + t * k);
  }
}

}  // namespace gating

GatingTopK::GatingTopK(int num_experts, int top_k, RouterFusion fusion, bool norm_topk_prob, RouterSpec spec)
    : num_experts_(num_experts), top_k_(top_k), fusion_(fusion), norm_topk_prob_(norm_topk_prob), spec_(spec) {
  MOEX_CHECK_INPUT(num_experts > 0 && top_k > 0 && top_k <= num_experts, "router: top_k ", top_k,
                   " must be in 1..", num_experts);
  if (spec.sigmoid_grouped) {
    MOEX_CHECK_INPUT(num_experts <= gating::kMaxFusedExperts, "router: the sigmoid router takes at most ",
                     gating::kMaxFusedExperts, " experts, got ", num_experts);
    MOEX_CHECK_INPUT(spec.n_group >= 1 && num_experts % spec.n_group == 0 && spec.topk_group >= 1 &&
                         spec.topk_group <= spec.n_group && (spec.n_group == 1 || num_experts / spec.n_group >= 2) &&
                         spec.topk_group * (num_experts / spec.n_group) >= top_k,
                     "router: n_group ", spec.n_group, " / topk_group ", spec.topk_group, " do not fit ", num_experts,
                     " experts top-", top_k);
    correction_.resize(num_experts);
  }
}

void GatingTopK::route(const float* x, int64_t tokens, const TensorView& w_gate, int32_t* expert_ids,
                       float* expert_weights, const TensorView& correction_bias) {
  MOEX_CHECK(w_gate.shape.rank == 2 && w_gate.shape[0] == num_experts_ &&
                 (w_gate.dtype == DType::kBF16 || w_gate.dtype == DType::kF32),
             "router gate ", w_gate.shape.str());
  if (tokens <= 0) return;
  const int64_t d = w_gate.shape[1];
  const int E = num_experts_, k = top_k_;
  if (spec_.sigmoid_grouped) {
    MOEX_CHECK(correction_bias.numel() == E && correction_bias.data != nullptr &&
                   (correction_bias.dtype == DType::kF32 || correction_bias.dtype == DType::kBF16),
               "the sigmoid router needs e_score_correction_bias [", E, "]");
    for (int e = 0; e < E; ++e) {
      correction_[e] = correction_bias.dtype == DType::kF32 ? correction_bias.as<const float>()[e]
                                                            : bf16_to_f32(correction_bias.as<const uint16_t>()[e]);
    }
    if (static_cast<int64_t>(logits_.size()) < tokens * E) logits_.resize(tokens * E);  // grows once
    gating::router_logits(x, tokens, w_gate, logits_.data());
    parallel_for(tokens, gating::kTokensPerTask, [&](int64_t begin, int64_t end) {
      float scratch[2 * gating::kMaxFusedExperts];
      for (int64_t t = begin; t < end; ++t)
        gating::route_sigmoid_grouped(logits_.data() + t * E, correction_.data(), E, k, norm_topk_prob_, spec_,
                                      expert_ids + t * k, expert_weights + t * k, scratch);
    });
    return;
  }
  if (fusion_ == RouterFusion::kFull && E <= gating::kMaxFusedExperts) {
    // Threads take blocks of tokens; T <= kTokensPerTask (decode) runs inline: no fork/join, no allocation.
    parallel_for(tokens, gating::kTokensPerTask, [&](int64_t begin, int64_t end) {
      gating::route_fused(x + begin * d, end - begin, w_gate, k, norm_topk_prob_, expert_ids + begin * k,
                          expert_weights + begin * k);
    });
    return;
  }
  if (static_cast<int64_t>(logits_.size()) < tokens * E) logits_.resize(tokens * E);  // grows once
  gating::router_logits(x, tokens, w_gate, logits_.data());
  if (fusion_ != RouterFusion::kNone) {  // kTopkSoftmax, or kFull with more experts than the stack holds
    for (int64_t t = 0; t < tokens; ++t) {
      gating::top_k(logits_.data() + t * E, E, k, expert_ids + t * k, expert_weights + t * k);
      gating::weights_from_logits(logits_.data() + t * E, E, k, norm_topk_prob_, expert_weights + t * k);
    }
    return;
  }
  // kNone: top-k over the logits in memory, then a separate softmax pass over what it wrote.
  for (int64_t t = 0; t < tokens; ++t)
    gating::top_k(logits_.data() + t * E, E, k, expert_ids + t * k, expert_weights + t * k);
  for (int64_t t = 0; t < tokens; ++t)
    gating::weights_from_logits(logits_.data() + t * E, E, k, norm_topk_prob_, expert_weights + t * k);
}

}  // namespace moex

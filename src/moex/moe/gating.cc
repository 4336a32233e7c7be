#include "moex/moe/gating.h"

#include <algorithm>
#include <cmath>

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

}  // namespace gating

GatingTopK::GatingTopK(int num_experts, int top_k, RouterFusion fusion, bool norm_topk_prob)
    : num_experts_(num_experts), top_k_(top_k), fusion_(fusion), norm_topk_prob_(norm_topk_prob) {
  MOEX_CHECK_INPUT(num_experts > 0 && top_k > 0 && top_k <= num_experts, "router: top_k ", top_k,
                   " must be in 1..", num_experts);
}

void GatingTopK::route(const float* x, int64_t tokens, const TensorView& w_gate, int32_t* expert_ids,
                       float* expert_weights) {
  MOEX_CHECK(w_gate.shape.rank == 2 && w_gate.shape[0] == num_experts_);
  const int64_t d = w_gate.shape[1];
  const int E = num_experts_, k = top_k_;
  if (fusion_ == RouterFusion::kFull) {
    // A block of tokens at a time: its [block, E] logits stay on the stack (L1) from matmul to softmax.
    constexpr int64_t kBlock = 16;
    parallel_for(tokens, kBlock, [&](int64_t begin, int64_t end) {
      float block_logits[kBlock * 256];
      const int64_t block = E <= 256 ? kBlock : 1;
      std::vector<float> wide(E > 256 ? E : 0);  // more than 256 experts: one token at a time, heap row
      for (int64_t t0 = begin; t0 < end; t0 += block) {
        const int64_t n = std::min(block, end - t0);
        float* logits = E <= 256 ? block_logits : wide.data();
        kernels::matmul_single_thread(x + t0 * d, n, w_gate, logits);
        for (int64_t t = 0; t < n; ++t) {
          int32_t* ids = expert_ids + (t0 + t) * k;
          float* weights = expert_weights + (t0 + t) * k;
          gating::top_k(logits + t * E, E, k, ids, weights);
          gating::weights_from_logits(logits + t * E, E, k, norm_topk_prob_, weights);
        }
      }
    });
    return;
  }
  if (static_cast<int64_t>(logits_.size()) < tokens * E) logits_.resize(tokens * E);
  kernels::matmul(x, tokens, w_gate, logits_.data());
  if (fusion_ == RouterFusion::kTopkSoftmax) {
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

#include "moex/model/mixtral.h"

#include <algorithm>
#include <cstring>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/ops.h"
#include "moex/profile/profile.h"

namespace moex {

KvCache::KvCache(const ModelConfig& c, int max_batch, int max_seq_len)
    : max_batch_(max_batch),
      max_seq_len_(max_seq_len),
      slot_floats_(static_cast<size_t>(c.num_key_value_heads) * max_seq_len * c.head_dim) {
  const size_t total = static_cast<size_t>(c.num_hidden_layers) * max_batch * slot_floats_;
  keys_.resize(total);
  values_.resize(total);
}

static const ModelOptions& validated(const ModelOptions& options) {
  MOEX_CHECK_INPUT(options.max_seq_len > 0 && options.max_batch > 0 && options.max_step_tokens > 0,
                   "--max-seq-len, --batch and the step size must be positive");
  return options;
}

MixtralModel::MixtralModel(const std::string& model_dir, const ModelOptions& options)
    : config_(load_model_config(model_dir + "/config.json")),
      options_(options),
      weights_(load_mixtral_weights(model_dir, config_)),
      kv_cache_(config_, validated(options).max_batch, options.max_seq_len),
      router_(config_.num_local_experts, config_.num_experts_per_tok, options.router_fusion, config_.norm_topk_prob),
      batcher_(config_.num_local_experts, config_.num_experts_per_tok, options.capacity_factor),
      moe_stats_(config_.num_hidden_layers) {
  const ModelConfig& c = config_;
  const size_t T = options.max_step_tokens, d = c.hidden_size, k = c.num_experts_per_tok;
  rope_cos_.resize(static_cast<size_t>(options.max_seq_len) * c.head_dim / 2);
  rope_sin_.resize(rope_cos_.size());
  kernels::rope_tables(options.max_seq_len, c.head_dim, c.rope_theta, rope_cos_.data(), rope_sin_.data());
  hidden_.resize(T * d);
  normed_.resize(T * d);
  q_.resize(T * c.q_dim());
  k_.resize(T * c.kv_dim());
  v_.resize(T * c.kv_dim());
  attn_out_.resize(T * c.q_dim());
  attn_scratch_.resize(static_cast<size_t>(num_threads()) * options.max_seq_len);
  expert_ids_.resize(T * k);
  expert_weights_.resize(T * k);
  gathered_.resize(T * k * d);
  hidden_gate_.resize(T * k * c.intermediate_size);
  hidden_up_.resize(T * k * c.intermediate_size);
  expert_out_.resize(T * k * d);
  final_rows_.resize(T * d);
}

int64_t MixtralModel::weight_bytes_per_token() const {
  const auto bytes = [](const TensorView& v) { return static_cast<int64_t>(v.bytes()); };
  int64_t total = bytes(weights_.embed) / config_.vocab_size + bytes(weights_.final_norm) + bytes(weights_.lm_head);
  for (const LayerWeights& l : weights_.layers) {
    total += bytes(l.input_norm) + bytes(l.wq) + bytes(l.wk) + bytes(l.wv) + bytes(l.wo) + bytes(l.post_norm) +
             bytes(l.gate);
    const ExpertWeights& e = l.experts[0];
    total += config_.num_experts_per_tok * (bytes(e.w1) + bytes(e.w3) + bytes(e.w2));
  }
  return total;
}

void MixtralModel::forward(const StepInput& step, float* logits) {
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens, d = c.hidden_size;
  MOEX_CHECK_INPUT(T > 0 && T <= options_.max_step_tokens, "a step holds 1..", options_.max_step_tokens, " tokens, got ",
                   T);
  for (int64_t t = 0; t < T; ++t) {
    MOEX_CHECK_INPUT(step.tokens[t] >= 0 && step.tokens[t] < c.vocab_size, "token id ", step.tokens[t],
                     " is outside the vocabulary (0..", c.vocab_size - 1, ")");
    MOEX_CHECK_INPUT(step.seq_slots[t] >= 0 && step.seq_slots[t] < options_.max_batch, "sequence slot ",
                     step.seq_slots[t], " >= batch size ", options_.max_batch);
    MOEX_CHECK_INPUT(step.positions[t] >= 0 && step.positions[t] < options_.max_seq_len, "position ",
                     step.positions[t], " does not fit the KV cache: increase --max-seq-len to at least ",
                     step.positions[t] + 1);
  }

  embed(step);

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    kernels::rmsnorm(hidden_.data(), T, d, lw.input_norm.data, lw.input_norm.dtype == DType::kBF16, c.rms_norm_eps,
                     normed_.data());
    attention_block(l, step);
    kernels::rmsnorm(hidden_.data(), T, d, lw.post_norm.data, lw.post_norm.dtype == DType::kBF16, c.rms_norm_eps,
                     normed_.data());
    moe_block(l, T);
  }

  // Final norm and lm_head, only for the rows whose logits are wanted.
  MOEX_ZONE(kLmHead);
  const int64_t rows = step.logit_rows ? step.num_logit_rows : T;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = step.logit_rows ? step.logit_rows[r] : r;
    MOEX_CHECK(t >= 0 && t < T, "logit row ", t);
    kernels::rmsnorm(hidden_.data() + t * d, 1, d, weights_.final_norm.data,
                     weights_.final_norm.dtype == DType::kBF16, c.rms_norm_eps, final_rows_.data() + r * d);
  }
  kernels::matmul(final_rows_.data(), rows, weights_.lm_head, logits);
}

// One row per token, widened to F32.
void MixtralModel::embed(const StepInput& step) {
  MOEX_ZONE(kEmbedding);
  const int64_t d = config_.hidden_size;
  for (int64_t t = 0; t < step.num_tokens; ++t) {
    float* row = hidden_.data() + t * d;
    if (weights_.embed.dtype == DType::kBF16) {
      const uint16_t* src = weights_.embed.as<const uint16_t>() + int64_t{step.tokens[t]} * d;
      for (int64_t i = 0; i < d; ++i) row[i] = bf16_to_f32(src[i]);
    } else {
      std::memcpy(row, weights_.embed.as<const float>() + int64_t{step.tokens[t]} * d, d * sizeof(float));
    }
  }
}

void MixtralModel::attention_block(int layer, const StepInput& step) {
  const ModelConfig& c = config_;
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t T = step.num_tokens, hd = c.head_dim, H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int64_t max_seq = options_.max_seq_len;
  MOEX_ZONE_LAYER(kAttention, layer);
  kernels::matmul(normed_.data(), T, lw.wq, q_.data());  // [T, H*hd]
  kernels::matmul(normed_.data(), T, lw.wk, k_.data());  // [T, KV*hd]
  kernels::matmul(normed_.data(), T, lw.wv, v_.data());  // [T, KV*hd]
  // RoPE, then append every token's K and V to its sequence's cache before any token attends, so a
  // prefill chunk attends causally to itself through the cache.
  for (int64_t t = 0; t < T; ++t) {
    const int32_t pos = step.positions[t];
    kernels::rope_apply(q_.data() + t * H * hd, H, hd, pos, rope_cos_.data(), rope_sin_.data());
    kernels::rope_apply(k_.data() + t * KV * hd, KV, hd, pos, rope_cos_.data(), rope_sin_.data());
    float* k_slot = kv_cache_.k(layer, step.seq_slots[t]);
    float* v_slot = kv_cache_.v(layer, step.seq_slots[t]);
    for (int64_t g = 0; g < KV; ++g) {
      std::memcpy(k_slot + (g * max_seq + pos) * hd, k_.data() + (t * KV + g) * hd, hd * sizeof(float));
      std::memcpy(v_slot + (g * max_seq + pos) * hd, v_.data() + (t * KV + g) * hd, hd * sizeof(float));
    }
  }
  parallel_for(T, 1, [&](int64_t begin, int64_t end) {
    float* scratch = attn_scratch_.data() + static_cast<size_t>(omp_get_thread_num()) * max_seq;
    for (int64_t t = begin; t < end; ++t) {
      kernels::attention_one_token(q_.data() + t * H * hd, kv_cache_.k(layer, step.seq_slots[t]),
                                   kv_cache_.v(layer, step.seq_slots[t]), H, KV, hd, max_seq,
                                   step.positions[t] + 1, attn_out_.data() + t * H * hd, scratch);
    }
  });
  kernels::matmul(attn_out_.data(), T, lw.wo, hidden_.data(), /*accumulate=*/true);  // residual add
}

void MixtralModel::moe_block(int layer, int64_t tokens) {
  const ModelConfig& c = config_;
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t d = c.hidden_size, I = c.intermediate_size;
  {
    MOEX_ZONE_LAYER(kRouter, layer);
    router_.route(normed_.data(), tokens, lw.gate, expert_ids_.data(), expert_weights_.data());
  }
  {
    MOEX_ZONE_LAYER(kDispatch, layer);
    batcher_.plan(expert_ids_.data(), tokens);
    batcher_.gather(normed_.data(), d, gathered_.data());
  }
  {
    MOEX_ZONE_LAYER(kExperts, layer);
    const auto& offsets = batcher_.expert_offsets();
    for (int e = 0; e < c.num_local_experts; ++e) {
      const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
      expert_ffn(lw.experts[e], gathered_.data() + begin * d, rows, hidden_gate_.data() + begin * I,
                 hidden_up_.data() + begin * I, expert_out_.data() + begin * d);
    }
  }
  {
    MOEX_ZONE_LAYER(kCombine, layer);
    batcher_.combine(expert_out_.data(), expert_weights_.data(), tokens, d, hidden_.data(), /*accumulate=*/true);
  }
  moe_stats_[layer] = batcher_.stats();
  profile::add_tokens_per_expert(layer, moe_stats_[layer].tokens_per_expert.data(), c.num_local_experts);
}

}  // namespace moex

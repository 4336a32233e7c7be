#include "moex/model/mixtral.h"

#include <algorithm>
#include <cstring>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/ops.h"
#include "moex/profile/profile.h"

namespace moex {

KvCache::KvCache(const ModelConfig& c, int kv_heads, int max_batch, int max_seq_len)
    : max_batch_(max_batch),
      max_seq_len_(max_seq_len),
      slot_floats_(static_cast<size_t>(kv_heads) * max_seq_len * c.head_dim) {
  const size_t total = static_cast<size_t>(c.num_hidden_layers) * max_batch * slot_floats_;
  keys_.resize(total);
  values_.resize(total);
}

static const ModelOptions& validated(const ModelOptions& options) {
  MOEX_CHECK_INPUT(options.max_seq_len > 0 && options.max_batch > 0 && options.max_step_tokens > 0,
                   "--max-seq-len, --batch and the step size must be positive");
  MOEX_CHECK(options.plan.world == 1 || (options.comm && options.comm->size() == options.plan.world),
             "the parallel plan needs a communicator of its world size");
  // The chunked all-reduce overlap splits w2 by output columns at batch 1; the fused packed down projection
  // does not take a column range yet.
  MOEX_CHECK_INPUT(!(options.expert_weights.packed && options.plan.overlap), "--weights ",
                   options.expert_weights.name(), " is not supported with --overlap yet (use --weights as-stored)");
  return options;
}

MixtralModel::MixtralModel(const std::string& model_dir, const ModelOptions& options)
    : config_(load_model_config(model_dir + "/config.json")),
      options_(options),
      weights_(load_mixtral_weights(model_dir, config_, validated(options).plan, options.expert_weights,
                                    options.dense_weights)),
      kv_cache_(config_, weights_.kv_heads_local, options.max_batch, options.max_seq_len),
      moe_(MoELayerShape{config_.hidden_size, weights_.intermediate_local, config_.num_local_experts,
                         config_.num_experts_per_tok, config_.norm_topk_prob},
           options.plan, options.comm, options.router_fusion, options.capacity_factor, options.max_step_tokens),
      moe_stats_(config_.num_hidden_layers) {
  const ModelConfig& c = config_;
  const size_t T = options.max_step_tokens, d = c.hidden_size;
  const size_t q_local = static_cast<size_t>(weights_.heads_local) * c.head_dim,
               kv_local = static_cast<size_t>(weights_.kv_heads_local) * c.head_dim;
  rope_cos_.resize(static_cast<size_t>(options.max_seq_len) * c.head_dim / 2);
  rope_sin_.resize(rope_cos_.size());
  kernels::rope_tables(options.max_seq_len, c.head_dim, c.rope_theta, rope_cos_.data(), rope_sin_.data());
  hidden_.resize(T * d);
  normed_.resize(T * d);
  q_.resize(T * q_local);
  k_.resize(T * kv_local);
  v_.resize(T * kv_local);
  attn_out_.resize(T * q_local);
  attn_scratch_.resize(static_cast<size_t>(num_threads()) * options.max_seq_len);
  if (tensor_parallel_attention())
    attn_partial_ = static_cast<float*>(options.comm->alloc_registered(T * d * sizeof(float)));
  if (options.plan.comm_dtype == comm::CommDType::kBF16) bf16_buffer_.resize(T * d);
  final_rows_.resize(T * d);
}

int64_t MixtralModel::weight_bytes_per_token() const {
  const auto bytes = [](const TensorView& v) { return static_cast<int64_t>(v.bytes()); };
  int64_t total = bytes(weights_.embed) / config_.vocab_size + bytes(weights_.final_norm) + weights_.lm_head.bytes();
  for (const LayerWeights& l : weights_.layers) {
    total += bytes(l.input_norm) + l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes() + bytes(l.post_norm) +
             bytes(l.moe.gate);
    // per rank: k experts' slices at most
    const int64_t expert_bytes =
        l.moe.packed.empty()
            ? bytes(l.moe.local[0].w1) + bytes(l.moe.local[0].w3) + bytes(l.moe.local[0].w2)
            : static_cast<int64_t>(l.moe.packed[0].w13.weight_bytes() + l.moe.packed[0].w2.weight_bytes());
    total += std::min(config_.num_experts_per_tok, l.moe.experts.count) * expert_bytes;
  }
  return total;
}

void MixtralModel::forward(const StepInput& step, float* logits) {
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens, d = c.hidden_size;
  const bool may_be_empty = options_.plan.attn == AttnParallel::kDP && !options_.plan.single();
  MOEX_CHECK_INPUT((T > 0 || may_be_empty) && T <= options_.max_step_tokens, "a step holds 1..",
                   options_.max_step_tokens, " tokens, got ", T);
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
    moe_.forward(l, lw.moe, normed_.data(), T, hidden_.data());
    moe_stats_[l] = moe_.stats();
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
  dense_matmul(final_rows_.data(), rows, weights_.lm_head, logits);
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
  const int64_t T = step.num_tokens, hd = c.head_dim, H = weights_.heads_local, KV = weights_.kv_heads_local;
  const int64_t max_seq = options_.max_seq_len;
  MOEX_ZONE_LAYER(kAttention, layer);
  dense_matmul(normed_.data(), T, lw.wq, q_.data());  // [T, H*hd]
  dense_matmul(normed_.data(), T, lw.wk, k_.data());  // [T, KV*hd]
  dense_matmul(normed_.data(), T, lw.wv, v_.data());  // [T, KV*hd]
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
  if (!tensor_parallel_attention()) {
    dense_matmul(attn_out_.data(), T, lw.wo, hidden_.data(), /*accumulate=*/true);  // residual add
    return;
  }
  // Attention TP: each rank's heads give a share of o_proj's output; one all-reduce sums them.
  const int64_t d = c.hidden_size;
  dense_matmul(attn_out_.data(), T, lw.wo, attn_partial_);
  {
    MOEX_ZONE_LAYER(kAllReduce, layer);
    comm::allreduce_f32(*options_.comm, attn_partial_, static_cast<size_t>(T * d), options_.plan.comm_dtype,
                        bf16_buffer_);
  }
  for (int64_t i = 0; i < T * d; ++i) hidden_[i] += attn_partial_[i];
}


}  // namespace moex

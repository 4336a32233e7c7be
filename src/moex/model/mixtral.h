// The Mixtral forward pass over a ragged step: any mix of sequences, each contributing one or more
// tokens (a prefill chunk is one sequence with many tokens; batched decode is B sequences with one each).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/model/config.h"
#include "moex/model/weights.h"
#include "moex/comm/communicator.h"
#include "moex/moe/dynamic_batch.h"
#include "moex/moe/gating.h"
#include "moex/moe/moe_layer.h"
#include "moex/moe/parallel_plan.h"

namespace moex {

struct ModelOptions {
  int max_seq_len = 2048;         // KV cache length per sequence
  int max_batch = 1;              // sequences with a KV cache slot
  int max_step_tokens = 512;      // tokens in one forward call (longer prompts are split by the caller)
  RouterFusion router_fusion = RouterFusion::kFull;
  float capacity_factor = 0.0f;   // <= 0: dropless
  ParallelPlan plan;              // single rank unless set
  comm::Communicator* comm = nullptr;  // required when plan.world > 1
  ExpertWeightFormat expert_weights;   // as stored, or quantized + packed at load (`--weights`)
  ExpertWeightFormat dense_weights;    // attention projections and lm_head, the same (`--dense-weights`)
};

// One forward call. Token t is tokens[t] of cache slot seq_slots[t] at position positions[t]; a slot's
// positions in one step must be consecutive and continue its cache (attention is causal through the cache).
struct StepInput {
  const int32_t* tokens = nullptr;
  const int32_t* seq_slots = nullptr;
  const int32_t* positions = nullptr;
  int64_t num_tokens = 0;
  // Rows whose logits are wanted, in order (e.g. the last prompt token). Null: every token.
  const int32_t* logit_rows = nullptr;
  int64_t num_logit_rows = 0;
};

// KV cache preallocated for max_batch x max_seq_len: [layer][slot][kv_head][position][head_dim], F32.
// Under attention TP a rank caches only its KV heads.
class KvCache {
 public:
  KvCache(const ModelConfig& config, int kv_heads, int max_batch, int max_seq_len);
  float* k(int layer, int slot) { return keys_.data() + offset(layer, slot); }
  float* v(int layer, int slot) { return values_.data() + offset(layer, slot); }
  int max_seq_len() const { return max_seq_len_; }
  int max_batch() const { return max_batch_; }
  size_t bytes() const { return (keys_.size() + values_.size()) * sizeof(float); }

 private:
  size_t offset(int layer, int slot) const { return (static_cast<size_t>(layer) * max_batch_ + slot) * slot_floats_; }
  int max_batch_, max_seq_len_;
  size_t slot_floats_;
  std::vector<float> keys_, values_;
};

class MixtralModel {
 public:
  MixtralModel(const std::string& model_dir, const ModelOptions& options);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  const MixtralWeights& weights() const { return weights_; }
  const KvCache& kv_cache() const { return kv_cache_; }

  // Runs one step; writes logits [num_logit_rows (or num_tokens), vocab] to `logits`. Under attention DP a
  // rank may pass 0 tokens (its sequences are done) and still takes part in the step's collectives.
  // Throws Error(kInvalidInput) for a token id, slot or position out of range.
  void forward(const StepInput& step, float* logits);

  // Per layer, the MoE load of the last forward call.
  const std::vector<MoELoadStats>& moe_stats() const { return moe_stats_; }
  // Bytes of weights one decode step of one token reads (the roofline numerator).
  int64_t weight_bytes_per_token() const;

 private:
  bool tensor_parallel_attention() const {
    return options_.plan.attn == AttnParallel::kTP && !options_.plan.single();
  }
  void embed(const StepInput& step);
  void attention_block(int layer, const StepInput& step);

  ModelConfig config_;
  ModelOptions options_;
  MixtralWeights weights_;
  KvCache kv_cache_;
  MoELayer moe_;
  std::vector<MoELoadStats> moe_stats_;

  // Activations, preallocated for max_step_tokens (T below): nothing on the step path allocates.
  std::vector<float> rope_cos_, rope_sin_;  // [max_seq_len, hd/2]
  std::vector<float> hidden_;       // [T, d] residual stream
  std::vector<float> normed_;       // [T, d]
  std::vector<float> q_, k_, v_;    // [T, H_local*hd], [T, KV_local*hd], [T, KV_local*hd]
  std::vector<float> attn_out_;     // [T, H_local*hd]
  std::vector<float> attn_scratch_; // [threads, max_seq_len] softmax rows
  // [T, d] this rank's o_proj share before the all-reduce (attention TP); registered memory of the
  // communicator (owned by it), so the shm all-reduce reads it in place.
  float* attn_partial_ = nullptr;
  std::vector<uint16_t> bf16_buffer_;  // [T*d] bf16 all-reduce payload
  std::vector<float> final_rows_;   // [T, d] normed rows that need logits
};

}  // namespace moex

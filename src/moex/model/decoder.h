// The decoder forward pass of every supported family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, dots1; their
// differences are ModelConfig fields) over a ragged step: any mix of sequences, each contributing one or more
// tokens (a prefill chunk is one sequence with many tokens; batched decode is B sequences with one each).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moex/model/config.h"
#include "moex/model/paged_kv_cache.h"
#include "moex/model/weights.h"
#include "moex/comm/communicator.h"
#include "moex/moe/dynamic_batch.h"
#include "moex/moe/eplb.h"
#include "moex/moe/gating.h"
#include "moex/moe/moe_layer.h"
#include "moex/moe/parallel_plan.h"

namespace moex {

struct ModelOptions {
  int max_seq_len = 2048;         // positions per sequence (RoPE tables; the longest block table)
  int max_batch = 1;              // sequences the KV pool is sized for when kv_cache_gb <= 0
  int max_step_tokens = 512;      // tokens in one forward call (longer prompts are split by the caller)
  // The paged KV pool: kv_cache_gb > 0 sizes it in decimal GB; otherwise it holds max_batch x max_seq_len
  // positions. f32 is exact (the reference tests); bf16 holds twice the positions in the same bytes.
  double kv_cache_gb = 0.0;
  KvCacheDType kv_cache_dtype = KvCacheDType::kF32;
  RouterFusion router_fusion = RouterFusion::kFull;
  float capacity_factor = 0.0f;   // <= 0: dropless
  ParallelPlan plan;              // single rank unless set
  comm::Communicator* comm = nullptr;  // required when plan.world > 1
  ExpertWeightFormat expert_weights;   // as stored, or quantized + packed at load (`--weights`)
  ExpertWeightFormat dense_weights;    // attention projections and lm_head, the same (`--dense-weights`)
  // `--panels`: the panels.moex to map (model/panels_file.h); empty: the one beside the checkpoint, if any;
  // "none": pack at load.
  std::string panels;
  // `--batch-invariant`: each row's numbers do not depend on the rest of the step (its neighbours, how many
  // rows its experts got): every packed matmul runs KernelChoice::for_rows(rows, true)'s loop (kernels/formats.h).
  // Needs dropless routing (capacity drops depend on the whole step). docs/serve.md, "Batch invariance".
  bool batch_invariant = false;
  // EPLB (moe/eplb.h, docs/moe.md "Expert load balancing"): each MoE layer's experts on the physical slots this
  // placement names (EP plans, dropless routing); null: plain EP. eplb_window > 0 keeps the tokens per expert of
  // the last eplb_window steps (expert_load()).
  std::shared_ptr<const eplb::ModelPlacement> expert_placement;
  int eplb_window = 0;
  // > 0: every eplb_interval steps between_steps() places the experts anew from the window's load (online
  // rebalancing; needs expert_placement, eplb_window > 0 and a bf16/f32 checkpoint).
  int eplb_interval = 0;
};

// One sequence's share of a step: its next `len` rows of the step (sequences in order, rows consecutive)
// at positions pos .. pos + len - 1. The cache holds its positions [0, pos); the step writes [pos, pos + len)
// through the block table (position p is row p % 16 of block block_table[p / 16]), which must cover them.
// Block tables come from a KvBlockManager (runtime/kv_block_manager.h), sized by kv_cache().num_blocks().
struct StepSeq {
  const int32_t* block_table = nullptr;
  int64_t num_blocks = 0;
  int64_t pos = 0;
  int64_t len = 0;
};

// One forward call: tokens[num_tokens], the rows of seqs[0], then seqs[1], ... (sum of len = num_tokens).
struct StepInput {
  const int32_t* tokens = nullptr;
  int64_t num_tokens = 0;
  const StepSeq* seqs = nullptr;
  int64_t num_seqs = 0;
  // Rows whose logits are wanted, in order (e.g. the last prompt token). Null: every token.
  const int32_t* logit_rows = nullptr;
  int64_t num_logit_rows = 0;
};

class DecoderModel {
 public:
  DecoderModel(const std::string& model_dir, const ModelOptions& options);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  const DecoderWeights& weights() const { return weights_; }
  const PagedKvCache& kv_cache() const { return kv_cache_; }
  // The pool a model built with `options` allocates (this rank's KV heads; num_blocks set).
  static kernels::PagedKvLayout kv_cache_layout(const ModelConfig& config, const ModelOptions& options);

  // Runs one step; writes logits [num_logit_rows (or num_tokens), vocab] to `logits`. Under attention DP a
  // rank may pass 0 tokens (its sequences are done) and still takes part in the step's collectives.
  // Throws Error(kInvalidInput) for a token id, position or block out of range, or rows that do not add up.
  void forward(const StepInput& step, float* logits);

  // The engine loop's hook, called between steps on every rank (runtime/step_protocol.h before_step; at the same
  // step: it is collective under attention DP). Every options().eplb_interval calls it computes a placement from the load window (each MoE
  // layer, placed over the EP ranks' hosts) and moves the experts that changed rank (rehome_layer_experts: read from
  // this rank's mapping of the checkpoint); profiler zone "rebalance". Returns the experts read (0: nothing moved).
  int between_steps();
  // Rebalances performed and the experts they read (on this rank), since construction.
  int64_t rebalances() const { return rebalances_; }
  int64_t experts_moved() const { return experts_moved_; }

  // Per layer, the MoE load of the last forward call.
  const std::vector<MoELoadStats>& moe_stats() const { return moe_stats_; }
  // Per layer, the last forward call's tokens per physical slot (EPLB; else per expert, as moe_stats()).
  const std::vector<MoELoadStats>& moe_slot_stats() const { return moe_slot_stats_; }
  // Tokens per expert over the last --eplb-window steps (null when eplb_window is 0).
  const eplb::LoadWindow* expert_load() const { return load_window_ ? &*load_window_ : nullptr; }
  // Bytes of weights one decode step of one token reads (the roofline numerator).
  int64_t weight_bytes_per_token() const;

 private:
  bool tensor_parallel_attention() const {
    return options_.plan.attn == AttnParallel::kTP && !options_.plan.single();
  }
  void embed(const StepInput& step);
  void attention_block(int layer, const StepInput& step);
  void whole_qk_norm_split(int layer, int64_t T);  // olmoe q/k norm when this rank holds some heads
  // The shared expert(s) of a MoE layer or the dense MLP of a dense layer over normed_, added into hidden_.
  void mlp_block(int layer, int64_t tokens);

  ModelConfig config_;
  ModelOptions options_;
  DecoderWeights weights_;
  PagedKvCache kv_cache_;
  MoELayer moe_;
  std::vector<MoELoadStats> moe_stats_;
  std::vector<MoELoadStats> moe_slot_stats_;
  std::optional<eplb::LoadWindow> load_window_;
  int64_t steps_since_rebalance_ = 0, rebalances_ = 0, experts_moved_ = 0;

  // Activations, preallocated for max_step_tokens (T below): nothing on the step path allocates.
  std::vector<float> rope_cos_, rope_sin_;  // [max_seq_len, hd/2]
  std::vector<float> hidden_;       // [T, d] residual stream
  std::vector<float> normed_;       // [T, d]
  std::vector<float> q_, k_, v_;    // [T, H_local*hd], [T, KV_local*hd], [T, KV_local*hd]
  std::vector<float> attn_out_;     // [T, H_local*hd]
  std::vector<float> attn_scratch_; // [threads, paged_attention_scratch_floats] online-softmax tiles
  std::vector<int32_t> positions_;  // [T] each row's position
  std::vector<kernels::PagedAttentionSeq> attn_seqs_;  // [T] the step's sequences for paged attention
  // [T, d] this rank's o_proj share before the all-reduce (attention TP); registered memory of the
  // communicator (owned by it), so the shm all-reduce reads it in place.
  float* attn_partial_ = nullptr;
  std::vector<uint16_t> bf16_buffer_;  // [T*d] bf16 all-reduce payload
  std::vector<float> qk_sums_;      // [2, T] olmoe under attention TP: per-token sums of q^2, k^2 (all-reduced)
  std::vector<float> final_rows_;   // [T, d] normed rows that need logits
  std::vector<float> mlp_gate_, mlp_up_;  // [T, I_mlp] shared-expert / dense-MLP hidden (I_mlp: the widest)
  std::vector<float> mlp_out_;      // [T, d]
  std::vector<float> shared_gate_;  // [T] qwen2_moe's shared_expert_gate logits
};

}  // namespace moex

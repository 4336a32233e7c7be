#include "moex/model/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/linear.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/ops.h"
#include "moex/profile/profile.h"

namespace moex {

static const ModelOptions& validated(const ModelOptions& options) {
  MOEX_CHECK_INPUT(options.max_seq_len > 0 && options.max_batch > 0 && options.max_step_tokens > 0,
                   "--max-seq-len, --batch and the step size must be positive");
  MOEX_CHECK_INPUT(std::isfinite(options.kv_cache_gb) && options.kv_cache_gb >= 0,
                   "--kv-cache-gb must be a positive number, got ", options.kv_cache_gb);
  MOEX_CHECK(options.plan.world == 1 || (options.comm && options.comm->size() == options.plan.world),
             "the parallel plan needs a communicator of its world size");
  // The chunked all-reduce overlap splits w2 by output columns at batch 1; the fused packed down projection
  // does not take a column range yet.
  MOEX_CHECK_INPUT(!(options.expert_weights.packed && options.plan.overlap), "--weights ",
                   options.expert_weights.name(), " is not supported with --overlap yet (use --weights as-stored)");
  MOEX_CHECK_INPUT(!(options.batch_invariant && options.capacity_factor > 0), "--batch-invariant needs dropless ",
                   "routing (--capacity-factor <= 0, got ", options.capacity_factor,
                   "): which assignments a capacity drops depends on the whole step");
  if (options.expert_placement) {
    MOEX_CHECK_INPUT(options.plan.moe == MoEParallel::kEP && options.plan.tp == 1, "--eplb / --expert-placement need ",
                     "--moe-parallel ep");
    MOEX_CHECK_INPUT(options.capacity_factor <= 0, "--eplb / --expert-placement need dropless routing (",
                     "--capacity-factor <= 0, got ", options.capacity_factor, "): a capacity per replica would change ",
                     "which assignments drop");
  }
  MOEX_CHECK_INPUT(options.eplb_interval <= 0 || (options.expert_placement && options.eplb_window > 0),
                   "--eplb-interval needs --eplb and --eplb-window > 0 (the load it places from)");
  return options;
}

DecoderModel::DecoderModel(const std::string& model_dir, const ModelOptions& options)
    : config_(load_checkpoint_config(model_dir)),
      options_(options),
      weights_(load_mixtral_weights(model_dir, config_, validated(options).plan, options.expert_weights,
                                    options.dense_weights, options.expert_placement.get(), options.panels)),
      kv_cache_(config_.num_hidden_layers, weights_.kv_heads_local, config_.head_dim,
                kv_cache_layout(config_, options).num_blocks, options.kv_cache_dtype),
      moe_(MoELayerShape{config_.hidden_size, weights_.intermediate_local, config_.num_local_experts,
                         config_.num_experts_per_tok, config_.norm_topk_prob,
                         RouterSpec{config_.scoring == RouterScoring::kSigmoidGrouped, config_.n_group,
                                    config_.topk_group, config_.routed_scaling_factor},
                         options.expert_placement ? options.expert_placement->ranks * options.expert_placement->slots_per_rank : 0},
           options.plan, options.comm, options.router_fusion, options.capacity_factor, options.max_step_tokens),
      moe_stats_(config_.num_hidden_layers),
      moe_slot_stats_(config_.num_hidden_layers) {
  moe_.set_batch_invariant(options.batch_invariant);
  if (options.eplb_window > 0) load_window_.emplace(config_.num_hidden_layers, config_.num_local_experts, options.eplb_window);
  MOEX_CHECK_INPUT(options.eplb_interval <= 0 || !weights_.quantized_checkpoint, "--eplb-interval: a quantized ",
                   "checkpoint's experts are not re-read at run time yet (use a static --expert-placement)");
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
  attn_scratch_.resize(static_cast<size_t>(num_threads()) *
                       kernels::paged_attention_scratch_floats(kv_cache_.layout(), weights_.heads_local));
  positions_.resize(T);
  attn_seqs_.resize(T);
  if (tensor_parallel_attention())
    attn_partial_ = static_cast<float*>(options.comm->alloc_registered(T * d * sizeof(float)));
  if (options.plan.comm_dtype == comm::CommDType::kBF16) bf16_buffer_.resize(T * d);
  final_rows_.resize(T * d);
  // olmoe normalises q and k over all heads: under attention TP a rank sums its heads' squares and one
  // all-reduce of [2, T] floats gives the whole projection's (attention_block). A KV head held by several
  // ranks (fewer KV heads than ranks) is counted once per holder, so every head must have as many holders.
  if (c.qk_norm == QkNorm::kWhole && weights_.heads_local != c.num_attention_heads) {
    MOEX_CHECK_INPUT(options.comm && (int64_t{options.comm->size()} * weights_.kv_heads_local) % c.num_key_value_heads == 0,
                     "model_type \"", c.model_type, "\": attention TP over ", options.comm ? options.comm->size() : 1,
                     " ranks splits ", c.num_key_value_heads, " KV heads unevenly for its q/k norm over all heads: ",
                     "use --attn-parallel dp (with --moe-parallel ep)");
    qk_sums_.resize(2 * T);
  }
  const size_t mlp_width = std::max(c.shared_expert_intermediate_size, c.dense_intermediate_size);
  mlp_gate_.resize(T * mlp_width);
  mlp_up_.resize(T * mlp_width);
  mlp_out_.resize(T * d);
  shared_gate_.resize(T);
}

kernels::PagedKvLayout DecoderModel::kv_cache_layout(const ModelConfig& c, const ModelOptions& o) {
  const SliceRange kv = local_kv_heads(o.plan, c.num_attention_heads, c.num_key_value_heads);
  kernels::PagedKvLayout layout;
  layout.layers = c.num_hidden_layers;
  layout.kv_heads = kv.end - kv.begin;
  layout.head_dim = c.head_dim;
  layout.elem_bytes = o.kv_cache_dtype == KvCacheDType::kF32 ? 4 : 2;
  if (o.kv_cache_gb > 0) {
    layout.num_blocks = PagedKvCache::blocks_in(layout, o.kv_cache_gb * 1e9);
    MOEX_CHECK_INPUT(layout.num_blocks >= 1, "--kv-cache-gb ", o.kv_cache_gb, " holds no KV block (one block of ",
                     layout.block_size, " positions is ", static_cast<double>(layout.block_bytes()) / 1e9,
                     " GB): increase --kv-cache-gb");
  } else {  // every sequence its longest table
    layout.num_blocks = int64_t{o.max_batch} * ((o.max_seq_len + layout.block_size - 1) / layout.block_size);
  }
  MOEX_CHECK_INPUT(layout.num_blocks <= INT32_MAX, "the KV cache of ", layout.num_blocks,
                   " blocks is more than a block table addresses: lower --kv-cache-gb");
  return layout;
}

int64_t DecoderModel::weight_bytes_per_token() const {
  const auto bytes = [](const TensorView& v) { return v.data ? static_cast<int64_t>(v.bytes()) : int64_t{0}; };
  int64_t total = bytes(weights_.embed) / config_.vocab_size + bytes(weights_.final_norm) + weights_.lm_head.bytes();
  for (const LayerWeights& l : weights_.layers) {
    total += bytes(l.input_norm) + l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes() + bytes(l.post_norm) +
             bytes(l.moe.gate) + bytes(l.bq) + bytes(l.bk) + bytes(l.bv) + bytes(l.q_norm) + bytes(l.k_norm) +
             (l.mlp.packed ? static_cast<int64_t>(l.mlp.packed->w13.weight_bytes() + l.mlp.packed->w2.weight_bytes())
                           : bytes(l.mlp.w1) + bytes(l.mlp.w3) + bytes(l.mlp.w2)) +
             bytes(l.shared_gate);
    if (!l.is_moe) continue;
    // per rank: k experts' slices at most
    const int64_t expert_bytes =
        l.moe.packed.empty()
            ? bytes(l.moe.local[0].w1) + bytes(l.moe.local[0].w3) + bytes(l.moe.local[0].w2)
            : static_cast<int64_t>(l.moe.packed[0].w13.weight_bytes() + l.moe.packed[0].w2.weight_bytes());
    total += std::min(config_.num_experts_per_tok, l.moe.experts.count) * expert_bytes;
  }
  return total;
}

void DecoderModel::forward(const StepInput& step, float* logits) {
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens, d = c.hidden_size;
  const bool may_be_empty = options_.plan.attn == AttnParallel::kDP && !options_.plan.single();
  MOEX_CHECK_INPUT((T > 0 || may_be_empty) && T <= options_.max_step_tokens, "a step holds 1..",
                   options_.max_step_tokens, " tokens, got ", T);
  for (int64_t t = 0; t < T; ++t)
    MOEX_CHECK_INPUT(step.tokens[t] >= 0 && step.tokens[t] < c.vocab_size, "token id ", step.tokens[t],
                     " is outside the vocabulary (0..", c.vocab_size - 1, ")");
  // The sequences: rows add up, positions fit the RoPE tables, tables cover them with blocks of the pool.
  MOEX_CHECK_INPUT(step.num_seqs >= 0 && step.num_seqs <= T && (step.num_seqs > 0 || T == 0),
                   "a step of ", T, " tokens has ", step.num_seqs, " sequences");
  const kernels::PagedKvLayout& kv = kv_cache_.layout();
  int64_t row = 0;
  for (int64_t s = 0; s < step.num_seqs; ++s) {
    const StepSeq& seq = step.seqs[s];
    MOEX_CHECK_INPUT(seq.len >= 1 && seq.pos >= 0 && row + seq.len <= T, "sequence ", s, " of the step has ",
                     seq.len, " tokens at position ", seq.pos, " (rows ", row, " of ", T, ")");
    MOEX_CHECK_INPUT(seq.pos + seq.len <= options_.max_seq_len, "position ", seq.pos + seq.len - 1,
                     " does not fit the KV cache: increase --max-seq-len to at least ", seq.pos + seq.len);
    const int64_t blocks = (seq.pos + seq.len + kv.block_size - 1) / kv.block_size;
    MOEX_CHECK_INPUT(seq.block_table && seq.num_blocks >= blocks, "sequence ", s, "'s block table has ",
                     seq.num_blocks, " blocks; positions up to ", seq.pos + seq.len - 1, " need ", blocks);
    for (int64_t b = 0; b < blocks; ++b)
      MOEX_CHECK_INPUT(seq.block_table[b] >= 0 && seq.block_table[b] < kv.num_blocks, "block ", seq.block_table[b],
                       " is outside the KV pool (", kv.num_blocks, " blocks)");
    attn_seqs_[s] = kernels::PagedAttentionSeq{seq.block_table, row, seq.len, seq.pos};
    for (int64_t i = 0; i < seq.len; ++i) positions_[row + i] = static_cast<int32_t>(seq.pos + i);
    row += seq.len;
  }
  MOEX_CHECK_INPUT(row == T, "the step's sequences cover ", row, " of its ", T, " tokens");

  embed(step);

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    kernels::rmsnorm(hidden_.data(), T, d, lw.input_norm.data, lw.input_norm.dtype == DType::kBF16, c.rms_norm_eps,
                     normed_.data());
    attention_block(l, step);
    kernels::rmsnorm(hidden_.data(), T, d, lw.post_norm.data, lw.post_norm.dtype == DType::kBF16, c.rms_norm_eps,
                     normed_.data());
    if (lw.is_moe) {
      moe_.forward(l, lw.moe, normed_.data(), T, hidden_.data());
      moe_stats_[l] = moe_.stats();
      moe_slot_stats_[l] = moe_.slot_stats();
      if (load_window_) load_window_->add(l, moe_stats_[l].tokens_per_expert.data());
    } else {  // a dense layer routes nothing
      moe_stats_[l] = MoELoadStats{};
      moe_stats_[l].tokens_per_expert.assign(c.num_local_experts, 0);
      moe_stats_[l].drops_per_expert.assign(c.num_local_experts, 0);
      moe_slot_stats_[l] = moe_stats_[l];
    }
    if (lw.mlp.w1.data) mlp_block(l, T);
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
  kernels::linear(final_rows_.data(), rows, weights_.lm_head, logits, false, options_.batch_invariant);
  if (load_window_) load_window_->end_step();
}

int DecoderModel::between_steps() {
  if (options_.eplb_interval <= 0 || ++steps_since_rebalance_ < options_.eplb_interval) return 0;
  steps_since_rebalance_ = 0;
  MOEX_ZONE(kRebalance);
  const ModelConfig& c = config_;
  const ParallelPlan& plan = options_.plan;
  const size_t E = c.num_local_experts;
  std::vector<float> load(c.num_hidden_layers * E, 0.0f);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::vector<double> window = load_window_->load(l);
    std::copy(window.begin(), window.end(), load.begin() + l * E);
  }
  // Under attention DP each rank counted its own tokens: the placement needs the sum, the same on every rank.
  // (f32 holds the counts exactly below 2^24 per expert and window.)
  if (plan.attn == AttnParallel::kDP && !plan.single()) comm::allreduce_f32(*options_.comm, load.data(), load.size(),
                                                                           comm::CommDType::kF32, bf16_buffer_);
  const std::vector<int> hosts = options_.comm ? options_.comm->topology().host_of_rank : std::vector<int>{};
  int reads = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!weights_.layers[l].is_moe) continue;
    const std::vector<double> layer_load(load.begin() + l * E, load.begin() + (l + 1) * E);
    const std::vector<int> rank_host = static_cast<int>(hosts.size()) == plan.ep ? hosts : std::vector<int>{};
    eplb::Placement p = eplb::place_experts(layer_load, plan.ep, options_.expert_placement->slots_per_rank, rank_host);
    // Ranks are interchangeable within a host: renumber them so experts stay where they are when they can.
    if (eplb::keep_experts_in_place(p, weights_.layers[l].moe.placement, rank_host) == 0) continue;
    reads += rehome_layer_experts(weights_, c, plan, l, p, options_.expert_weights);
  }
  ++rebalances_;
  experts_moved_ += reads;
  return reads;
}

// One row per token, widened to F32.
void DecoderModel::embed(const StepInput& step) {
  MOEX_ZONE(kEmbedding);
  const int64_t d = config_.hidden_size;
  parallel_for(step.num_tokens, 16, [&](int64_t begin, int64_t end) {  // a row of the table per token, from DRAM
    for (int64_t t = begin; t < end; ++t) {
      float* row = hidden_.data() + t * d;
      if (weights_.embed.dtype == DType::kBF16) {
        const uint16_t* src = weights_.embed.as<const uint16_t>() + int64_t{step.tokens[t]} * d;
        for (int64_t i = 0; i < d; ++i) row[i] = bf16_to_f32(src[i]);
      } else {
        std::memcpy(row, weights_.embed.as<const float>() + int64_t{step.tokens[t]} * d, d * sizeof(float));
      }
    }
  });
}

void DecoderModel::attention_block(int layer, const StepInput& step) {
  const ModelConfig& c = config_;
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t T = step.num_tokens, hd = c.head_dim, H = weights_.heads_local, KV = weights_.kv_heads_local;
  MOEX_ZONE_LAYER(kAttention, layer);
  {  // the three in one parallel region (as stored, or packed alike)
    const kernels::LinearOutput qkv[3] = {{&lw.wq, q_.data()}, {&lw.wk, k_.data()}, {&lw.wv, v_.data()}};
    kernels::linear_group(normed_.data(), T, qkv, 3, options_.batch_invariant);  // [T, H*hd], [T, KV*hd], [T, KV*hd]
  }
  // Family options, in HF's order: biases (qwen2_moe), then q/k RMSNorm per head (qwen3_moe, dots1) or over
  // the whole projection (olmoe), then RoPE.
  if (lw.bq.data) {
    const auto add_bias = [&](float* y, int64_t width, const TensorView& b) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < width; ++i)
          y[t * width + i] += b.dtype == DType::kBF16 ? bf16_to_f32(b.as<const uint16_t>()[i]) : b.as<const float>()[i];
    };
    add_bias(q_.data(), H * hd, lw.bq);
    add_bias(k_.data(), KV * hd, lw.bk);
    add_bias(v_.data(), KV * hd, lw.bv);
  }
  if (lw.q_norm.data && !qk_sums_.empty()) {
    whole_qk_norm_split(layer, T);
  } else if (lw.q_norm.data) {
    const bool per_head = c.qk_norm == QkNorm::kPerHead;
    kernels::rmsnorm(q_.data(), per_head ? T * H : T, per_head ? hd : H * hd, lw.q_norm.data,
                     lw.q_norm.dtype == DType::kBF16, c.rms_norm_eps, q_.data());  // in place: row by row
    kernels::rmsnorm(k_.data(), per_head ? T * KV : T, per_head ? hd : KV * hd, lw.k_norm.data,
                     lw.k_norm.dtype == DType::kBF16, c.rms_norm_eps, k_.data());
  }
  // RoPE, then write every token's K and V into its sequence's blocks before any token attends, so a
  // prefill chunk attends causally to itself through the cache.
  const kernels::PagedKvLayout& kv = kv_cache_.layout();
  const auto rope_and_write = [&](const kernels::PagedAttentionSeq& seq, int64_t t) {  // row t of sequence seq
    const int32_t pos = positions_[t];
    kernels::rope_apply(q_.data() + t * H * hd, H, hd, pos, rope_cos_.data(), rope_sin_.data());
    kernels::rope_apply(k_.data() + t * KV * hd, KV, hd, pos, rope_cos_.data(), rope_sin_.data());
    const float* k_row = k_.data() + t * KV * hd;
    const float* v_row = v_.data() + t * KV * hd;
    if (kv_cache_.f32()) kernels::paged_kv_write(kv, kv_cache_.f32(), layer, seq.block_table, pos, k_row, v_row);
    else kernels::paged_kv_write(kv, kv_cache_.bf16(), layer, seq.block_table, pos, k_row, v_row);
  };
  // The step's rows over the threads in one region, whatever its sequences (a prefill chunk, a decode batch of one
  // row each, or both): the sequences' rows are consecutive and in order (checked in forward), so a range of rows
  // finds its first row's sequence by bisection and walks on.
  const kernels::PagedAttentionSeq* seqs = attn_seqs_.data();
  parallel_for(step.num_tokens, 16, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    const kernels::PagedAttentionSeq* seq =
        std::upper_bound(seqs, seqs + step.num_seqs, begin,
                         [](int64_t row, const kernels::PagedAttentionSeq& q) { return row < q.q_row; }) - 1;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= seq->q_row + seq->q_len) ++seq;
      rope_and_write(*seq, t);
    }
  });
  // attn_out [T, H*hd]: every sequence's rows attend to its positions [0, pos] through its block table.
  if (kv_cache_.f32())
    kernels::paged_attention(kv, kv_cache_.f32(), layer, attn_seqs_.data(), step.num_seqs, q_.data(), H,
                             attn_out_.data(), attn_scratch_.data());
  else
    kernels::paged_attention(kv, kv_cache_.bf16(), layer, attn_seqs_.data(), step.num_seqs, q_.data(), H,
                             attn_out_.data(), attn_scratch_.data());
  if (!tensor_parallel_attention()) {
    kernels::linear(attn_out_.data(), T, lw.wo, hidden_.data(), /*accumulate=*/true, options_.batch_invariant);  // residual add
    return;
  }
  // Attention TP: each rank's heads give a share of o_proj's output; one all-reduce sums them.
  const int64_t d = c.hidden_size;
  kernels::linear(attn_out_.data(), T, lw.wo, attn_partial_, false, options_.batch_invariant);
  {
    MOEX_ZONE_LAYER(kAllReduce, layer);
    comm::allreduce_f32(*options_.comm, attn_partial_, static_cast<size_t>(T * d), options_.plan.comm_dtype,
                        bf16_buffer_);
  }
  for (int64_t i = 0; i < T * d; ++i) hidden_[i] += attn_partial_[i];
}

// olmoe's RMSNorm over the whole q (and k) projection when this rank holds only some heads (attention TP):
// the per-token sums of squares of every rank's slice, summed by one all-reduce (f32 whatever --comm-dtype:
// 2T floats), then each rank scales its slice by rsqrt(mean + eps) and its slice of the norm weight.
void DecoderModel::whole_qk_norm_split(int layer, int64_t T) {
  const ModelConfig& c = config_;
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t qw = int64_t{weights_.heads_local} * c.head_dim, kw = int64_t{weights_.kv_heads_local} * c.head_dim;
  float* sums = qk_sums_.data();  // [2, T]: q, then k
  for (int64_t t = 0; t < T; ++t) {
    float sq = 0, sk = 0;
    for (int64_t i = 0; i < qw; ++i) sq += q_[t * qw + i] * q_[t * qw + i];
    for (int64_t i = 0; i < kw; ++i) sk += k_[t * kw + i] * k_[t * kw + i];
    sums[t] = sq, sums[T + t] = sk;
  }
  {
    MOEX_ZONE_LAYER(kAllReduce, layer);
    comm::allreduce_f32(*options_.comm, sums, static_cast<size_t>(2 * T), comm::CommDType::kF32, bf16_buffer_);
  }
  // Each KV head is held by `holders` ranks (1 unless KV heads are replicated), so its squares came in that often.
  const float holders = static_cast<float>(int64_t{options_.comm->size()} * weights_.kv_heads_local / c.num_key_value_heads);
  const auto scale = [&](float* x, int64_t width, float sum, float count, const TensorView& w) {
    const float r = 1.0f / std::sqrt(sum / count + c.rms_norm_eps);
    for (int64_t i = 0; i < width; ++i)
      x[i] = x[i] * r * (w.dtype == DType::kBF16 ? bf16_to_f32(w.as<const uint16_t>()[i]) : w.as<const float>()[i]);
  };
  for (int64_t t = 0; t < T; ++t) {
    scale(q_.data() + t * qw, qw, sums[t], static_cast<float>(c.q_dim()), lw.q_norm);
    scale(k_.data() + t * kw, kw, sums[T + t] / holders, static_cast<float>(c.kv_dim()), lw.k_norm);
  }
}

void DecoderModel::mlp_block(int layer, int64_t T) {
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t d = config_.hidden_size;
  if (T == 0) return;
  MOEX_ZONE_LAYER(kExperts, layer);
  // out [T, d] = down(silu(gate x) * up x), every rank computing all of it (the weights are replicated).
  expert_ffn(lw.mlp, normed_.data(), T, mlp_gate_.data(), mlp_up_.data(), mlp_out_.data(), options_.batch_invariant);
  if (lw.shared_gate.data) {  // qwen2_moe: times sigmoid(x w_sg^T), one scalar per token
    kernels::matmul(normed_.data(), T, lw.shared_gate, shared_gate_.data());  // [T, 1]
    for (int64_t t = 0; t < T; ++t) {
      const float g = 1.0f / (1.0f + std::exp(-shared_gate_[t]));
      for (int64_t i = 0; i < d; ++i) hidden_[t * d + i] += g * mlp_out_[t * d + i];
    }
    return;
  }
  for (int64_t i = 0; i < T * d; ++i) hidden_[i] += mlp_out_[i];
}

}  // namespace moex

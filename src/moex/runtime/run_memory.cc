#include "moex/runtime/run_memory.h"

#include <algorithm>
#include <cmath>

#include "moex/base/error.h"

namespace moex {
namespace {

// Bytes of the packed copy of a [rows, cols] module: per `format` when packed at load, per the checkpoint's
// scheme when it is stored quantized, 0 when it runs from the mapping: as stored, or (`mapped`) whole on this
// rank and found in the panels file. Only bf16 is written to panels for a bf16/f16/f32 checkpoint.
double packed_copy(const ModelConfig& c, const std::string& module, const ExpertWeightFormat& format, double rows,
                   double cols, bool mapped) {
  if (const QuantScheme* s = c.quantization.quantized() ? c.quantization.scheme_for(module) : nullptr)
    return mapped ? 0 : rows * cols * kernels::packed_bytes_per_weight(s->weight_format, double(s->group), cols);
  if (!format.packed || (mapped && format.format == kernels::WeightFormat::kBF16)) return 0;
  return rows * cols * kernels::packed_bytes_per_weight(format.format, double(format.group), cols);
}

}  // namespace

RunMemory estimate_run_memory(const ModelConfig& c, const ModelOptions& o, int threads, bool panels_mapped) {
  // In double: the products of flags and config sizes are what must be checked, so they must not overflow.
  const ParallelPlan& plan = o.plan;
  const SliceRange heads = local_heads(plan, c.num_attention_heads);
  const SliceRange kv_heads = local_kv_heads(plan, c.num_attention_heads, c.num_key_value_heads);
  const double q_local = double(heads.end - heads.begin) * c.head_dim;
  const double kv_local = double(kv_heads.end - kv_heads.begin) * c.head_dim;
  const double seq = o.max_seq_len, batch = o.max_batch, T = o.max_step_tokens, d = c.hidden_size;
  const double k = c.num_experts_per_tok, E = c.num_local_experts;
  const double inter_local = double(local_intermediate(plan, c.intermediate_size).end -
                                    local_intermediate(plan, c.intermediate_size).begin);
  const double f32 = 4;
  RunMemory m;
  // The paged pool (DecoderModel::kv_cache_layout, in double): --kv-cache-gb, or every sequence's longest table.
  const double bs = kernels::kKvBlockSize, elem = o.kv_cache_dtype == KvCacheDType::kF32 ? 4 : 2;
  const double block_bytes = 2 * double(c.num_hidden_layers) * kv_local * bs * elem;
  m.kv_cache_bytes = o.kv_cache_gb > 0 ? std::floor(o.kv_cache_gb * 1e9 / block_bytes) * block_bytes
                                       : batch * std::ceil(seq / bs) * block_bytes;
  // cos+sin tables; per thread, paged attention's tiles (K, V, scores, 16 x group rows of acc, max and sum)
  const double group_rows = bs * (q_local / std::max(kv_local, 1.0));
  const double per_position = seq * c.head_dim * f32 +
                              double(threads) * (2 * bs * c.head_dim + bs + group_rows * c.head_dim + 2 * group_rows) * f32;
  double step = T * (3 * d + 2 * q_local + 2 * kv_local) * f32;                    // mixtral.cc activations
  const bool split = !plan.single();
  if (split) step += T * d * f32;  // the all-reduce partial of attention (TP) or of the MoE layer
  if (plan.comm_dtype == comm::CommDType::kBF16) step += 2 * T * d * 2;
  step += T * k * (2 + 2 * d + 2 * inter_local) * f32 + T * E * f32;  // moe_layer.cc and the router's logits
  // mixtral.cc's shared-expert / dense-MLP buffers (families with them): gate and up [T, I], out [T, d], gate [T].
  const double mlp_width = std::max(c.shared_expert_intermediate_size, c.dense_intermediate_size);
  if (mlp_width > 0) step += T * (2 * mlp_width + d + 1) * f32;
  const double logits = batch * double(c.vocab_size) * f32;         // generate(): one row per sequence
  m.buffer_bytes = per_position + step + logits;
  const double experts_local = local_experts(plan, c.num_local_experts).count;
  const double layers = c.num_hidden_layers;
  // Mapped from the panels: what this rank holds whole (the file has whole matrices; weights.cc maps the same).
  const bool experts_whole = panels_mapped && inter_local == double(c.intermediate_size);
  const bool attention_whole = panels_mapped && q_local == double(c.num_attention_heads) * c.head_dim &&
                               kv_local == double(c.num_key_value_heads) * c.head_dim;
  m.packed_bytes =
      layers * experts_local *
          (2 * packed_copy(c, "model.layers.0.block_sparse_moe.experts.0.w1", o.expert_weights, inter_local, d, experts_whole) +
           packed_copy(c, "model.layers.0.block_sparse_moe.experts.0.w2", o.expert_weights, d, inter_local, experts_whole)) +
      layers * (packed_copy(c, "model.layers.0.self_attn.q_proj", o.dense_weights, q_local, d, attention_whole) +
                2 * packed_copy(c, "model.layers.0.self_attn.k_proj", o.dense_weights, kv_local, d, attention_whole) +
                packed_copy(c, "model.layers.0.self_attn.o_proj", o.dense_weights, d, q_local, attention_whole)) +
      packed_copy(c, "lm_head", o.dense_weights, double(c.vocab_size), d, panels_mapped);
  // Shared experts and dense MLP layers (whole on every rank), packed with the attention projections under a
  // packed --dense-weights, mapped when bf16 panels are found.
  if (o.dense_weights.packed && !(panels_mapped && o.dense_weights.format == kernels::WeightFormat::kBF16))
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const double width = c.moe_layer(l) ? c.shared_expert_intermediate_size : c.dense_intermediate_size;
      if (width > 0)
        m.packed_bytes += width * d * (2 * kernels::packed_bytes_per_weight(o.dense_weights.format, o.dense_weights.group, d) +
                                       kernels::packed_bytes_per_weight(o.dense_weights.format, o.dense_weights.group, width));
    }
  return m;
}

void check_run_memory(const RunMemory& need, const ModelConfig& c, const ModelOptions& o,
                      const std::optional<AvailableMemory>& available) {
  if (!available || need.total() <= static_cast<double>(available->bytes)) return;
  const bool cache_dominates = need.kv_cache_bytes >= need.buffer_bytes;
  // The packed copy (bf16 by default) is the largest part: the weights can run from the mapped checkpoint instead.
  const bool packed_dominates = need.packed_bytes > need.kv_cache_bytes && need.packed_bytes > need.buffer_bytes;
  const bool bf16_packed = !c.quantization.quantized() &&
                           ((o.expert_weights.packed && o.expert_weights.format == kernels::WeightFormat::kBF16) ||
                            (o.dense_weights.packed && o.dense_weights.format == kernels::WeightFormat::kBF16));
  throw_error(ErrorKind::kInvalidInput,
              "the run needs " + format_bytes(need.total()) + " (KV cache " + format_bytes(need.kv_cache_bytes) +
                  (o.kv_cache_gb > 0 ? " for --kv-cache-gb " + std::to_string(o.kv_cache_gb)
                                     : " for " + std::to_string(o.max_batch) + " sequence(s) x " +
                                           std::to_string(o.max_seq_len) + " positions") +
                  " x " + std::to_string(c.num_hidden_layers) + " layers; buffers " +
                  format_bytes(need.buffer_bytes) + " for steps of " + std::to_string(o.max_step_tokens) +
                  " tokens" + (need.packed_bytes > 0 ? "; packed weights " + format_bytes(need.packed_bytes) : std::string()) +
                  ") but " + format_bytes(static_cast<double>(available->bytes)) + " is available (" +
                  available->source + "); " +
                  (packed_dominates ? std::string(
                                          bf16_packed ? "moex pack on the model writes the bf16 copy into a file that "
                                          "a load maps instead (--panels); or " : "") +
                                          "run the weights as stored, from the mapped checkpoint (--exact, or --weights "
                                          "as-stored --dense-weights as-stored), or a smaller --weights format"
                   : cache_dominates ? (o.kv_cache_gb > 0 ? "lower --kv-cache-gb" : "lower --max-seq-len or the number of sequences")
                                     : "lower --step-tokens"));
}

}  // namespace moex

// What a run allocates besides its mapped weights, computed before anything is allocated so that a KV cache
// too large for the machine is refused with the figures instead of ending in std::bad_alloc (or taking
// gigabytes without a word).
#pragma once
#include <optional>

#include "moex/base/system_memory.h"
#include "moex/model/decoder.h"

namespace moex {

struct RunMemory {
  // The paged KV pool (DecoderModel::kv_cache_layout): blocks x layers x 2 x local KV heads x 16 x head_dim.
  double kv_cache_bytes = 0;
  // The rest: RoPE tables and attention scratch (grow with max_seq_len), activations and MoE buffers (grow
  // with max_step_tokens), one row of logits per sequence.
  double buffer_bytes = 0;
  // Packed weight copies made at load (--weights / --dense-weights, or a quantized checkpoint's modules): heap
  // memory besides the mapping, whose pages of packed tensors are released again.
  double packed_bytes = 0;
  double total() const { return kv_cache_bytes + buffer_bytes + packed_bytes; }
};

// For a DecoderModel built with `options` on a team of `threads`, and generation over max_batch sequences.
// `panels_mapped`: the load finds a panels.moex of the kind it packs (model/panels_file.h, panels_present), whose
// whole matrices it maps instead of copying: they count 0 (a TP slice is still packed at load).
RunMemory estimate_run_memory(const ModelConfig& config, const ModelOptions& options, int threads,
                              bool panels_mapped = false);

// Throws Error(kInvalidInput), one line with the figures and the flag to lower, when the run needs more than
// `available` (nullopt: unknown, nothing is checked).
void check_run_memory(const RunMemory& need, const ModelConfig& config, const ModelOptions& options,
                      const std::optional<AvailableMemory>& available);

}  // namespace moex

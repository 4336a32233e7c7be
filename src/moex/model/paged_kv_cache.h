// The paged KV cache's storage: one pool of fixed-size blocks (layout in kernels/paged_attention.h), in bf16
// (serving: half the bytes per position) or f32 (exact: what the PyTorch reference tests compare), sized by
// --kv-cache-gb or by sequences x positions, and allocated once, at start-up; the step path only reads and
// writes it. Block ids and tables are the KvBlockManager's (runtime/kv_block_manager.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/kernels/paged_attention.h"

namespace moex {

enum class KvCacheDType { kBF16, kF32 };
const char* kv_cache_dtype_name(KvCacheDType dtype);
// "bf16" or "f32"; anything else is an input error naming --kv-cache-dtype.
KvCacheDType parse_kv_cache_dtype(const std::string& name);

class PagedKvCache {
 public:
  // Blocks of `layers` x `kv_heads` x `head_dim` that fit in kv_cache_gb (decimal GB). Throws
  // Error(kInvalidInput) for a size that is not positive, holds no block, or exceeds available memory.
  PagedKvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, double kv_cache_gb,
               KvCacheDType dtype = KvCacheDType::kBF16);
  // Exactly `num_blocks` blocks (>= 1).
  PagedKvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t num_blocks, KvCacheDType dtype);

  // Whole blocks of this shape (num_blocks ignored) in `bytes`.
  static int64_t blocks_in(const kernels::PagedKvLayout& shape, double bytes);

  const kernels::PagedKvLayout& layout() const { return layout_; }
  KvCacheDType dtype() const { return dtype_; }
  // The pool of the cache's dtype (the other is null).
  uint16_t* bf16() { return bf16_.empty() ? nullptr : bf16_.data(); }
  float* f32() { return f32_.empty() ? nullptr : f32_.data(); }
  const uint16_t* bf16() const { return bf16_.empty() ? nullptr : bf16_.data(); }
  const float* f32() const { return f32_.empty() ? nullptr : f32_.data(); }
  uint16_t* data() { return bf16(); }  // the bf16 pool
  const uint16_t* data() const { return bf16(); }
  int64_t num_blocks() const { return layout_.num_blocks; }
  int64_t capacity_positions() const { return layout_.num_blocks * layout_.block_size; }
  int64_t bytes() const { return layout_.num_blocks * layout_.block_bytes(); }

 private:
  void allocate();
  kernels::PagedKvLayout layout_;
  KvCacheDType dtype_;
  std::vector<uint16_t> bf16_;  // [num_blocks][layers][2][kv_heads][block_size][head_dim] bf16, or
  std::vector<float> f32_;      // the same in f32
};

}  // namespace moex

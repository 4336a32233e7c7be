// The paged KV cache's storage: one bf16 pool of fixed-size blocks (layout in kernels/paged_attention.h),
// sized by --kv-cache-gb and allocated once, at start-up; the step path only reads and writes it.
#pragma once
#include <cstdint>
#include <vector>

#include "moex/kernels/paged_attention.h"

namespace moex {

class PagedKvCache {
 public:
  // Blocks of `layers` x `kv_heads` x `head_dim` that fit in kv_cache_gb (decimal GB). Throws
  // Error(kInvalidInput) for a size that is not positive, holds no block, or exceeds available memory.
  PagedKvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, double kv_cache_gb);

  // Whole blocks of this shape (num_blocks ignored) in `bytes`.
  static int64_t blocks_in(const kernels::PagedKvLayout& shape, double bytes);

  const kernels::PagedKvLayout& layout() const { return layout_; }
  uint16_t* data() { return pool_.data(); }
  const uint16_t* data() const { return pool_.data(); }
  int64_t num_blocks() const { return layout_.num_blocks; }
  int64_t capacity_positions() const { return layout_.num_blocks * layout_.block_size; }
  int64_t bytes() const { return static_cast<int64_t>(pool_.size() * sizeof(uint16_t)); }

 private:
  kernels::PagedKvLayout layout_;
  std::vector<uint16_t> pool_;  // [num_blocks][layers][2][kv_heads][block_size][head_dim] bf16
};

}  // namespace moex

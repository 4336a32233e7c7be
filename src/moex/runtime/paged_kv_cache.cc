#include "moex/runtime/paged_kv_cache.h"

#include <cmath>

#include "moex/base/error.h"
#include "moex/base/system_memory.h"

namespace moex {

int64_t PagedKvCache::blocks_in(const kernels::PagedKvLayout& shape, double bytes) {
  return static_cast<int64_t>(std::floor(bytes / static_cast<double>(shape.block_bytes())));
}

PagedKvCache::PagedKvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, double kv_cache_gb) {
  MOEX_CHECK_INPUT(std::isfinite(kv_cache_gb) && kv_cache_gb > 0, "--kv-cache-gb must be a positive number, got ",
                   kv_cache_gb);
  MOEX_CHECK(layers > 0 && kv_heads > 0 && head_dim > 0, "KV cache shape ", layers, "x", kv_heads, "x", head_dim);
  layout_.layers = layers;
  layout_.kv_heads = kv_heads;
  layout_.head_dim = head_dim;
  const double bytes = kv_cache_gb * 1e9;
  layout_.num_blocks = blocks_in(layout_, bytes);
  MOEX_CHECK_INPUT(layout_.num_blocks >= 1, "--kv-cache-gb ", kv_cache_gb, " holds no KV block (one block of ",
                   layout_.block_size, " positions is ", format_bytes(static_cast<double>(layout_.block_bytes())),
                   "): increase --kv-cache-gb");
  // Block ids are int32 in the block tables.
  MOEX_CHECK_INPUT(layout_.num_blocks <= INT32_MAX, "--kv-cache-gb ", kv_cache_gb, " is more blocks than a table holds");
  const double total = static_cast<double>(layout_.num_blocks) * static_cast<double>(layout_.block_bytes());
  check_fits_in_memory(total, "the KV cache (--kv-cache-gb)", "lower --kv-cache-gb");
  pool_.assign(static_cast<size_t>(layout_.num_blocks * layout_.block_elems()), 0);  // touched now, not mid-step
}

}  // namespace moex

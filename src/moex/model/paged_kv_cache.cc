#include "moex/model/paged_kv_cache.h"

#include <cmath>

#include "moex/base/error.h"
#include "moex/base/system_memory.h"

namespace moex {

const char* kv_cache_dtype_name(KvCacheDType dtype) { return dtype == KvCacheDType::kF32 ? "f32" : "bf16"; }

KvCacheDType parse_kv_cache_dtype(const std::string& name) {
  if (name == "bf16") return KvCacheDType::kBF16;
  if (name == "f32") return KvCacheDType::kF32;
  throw_error(ErrorKind::kInvalidInput, "--kv-cache-dtype must be bf16 or f32, got '" + name + "'");
}

int64_t PagedKvCache::blocks_in(const kernels::PagedKvLayout& shape, double bytes) {
  return static_cast<int64_t>(std::floor(bytes / static_cast<double>(shape.block_bytes())));
}

static kernels::PagedKvLayout shape_of(int64_t layers, int64_t kv_heads, int64_t head_dim, KvCacheDType dtype) {
  MOEX_CHECK(layers > 0 && kv_heads > 0 && head_dim > 0, "KV cache shape ", layers, "x", kv_heads, "x", head_dim);
  kernels::PagedKvLayout layout;
  layout.layers = layers;
  layout.kv_heads = kv_heads;
  layout.head_dim = head_dim;
  layout.elem_bytes = dtype == KvCacheDType::kF32 ? 4 : 2;
  return layout;
}

PagedKvCache::PagedKvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, double kv_cache_gb,
                           KvCacheDType dtype)
    : layout_(shape_of(layers, kv_heads, head_dim, dtype)), dtype_(dtype) {
  MOEX_CHECK_INPUT(std::isfinite(kv_cache_gb) && kv_cache_gb > 0, "--kv-cache-gb must be a positive number, got ",
                   kv_cache_gb);
  const double bytes = kv_cache_gb * 1e9;
  layout_.num_blocks = blocks_in(layout_, bytes);
  MOEX_CHECK_INPUT(layout_.num_blocks >= 1, "--kv-cache-gb ", kv_cache_gb, " holds no KV block (one block of ",
                   layout_.block_size, " positions is ", format_bytes(static_cast<double>(layout_.block_bytes())),
                   "): increase --kv-cache-gb");
  // Block ids are int32 in the block tables.
  MOEX_CHECK_INPUT(layout_.num_blocks <= INT32_MAX, "--kv-cache-gb ", kv_cache_gb, " is more blocks than a table holds");
  allocate();
}

PagedKvCache::PagedKvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
                           KvCacheDType dtype)
    : layout_(shape_of(layers, kv_heads, head_dim, dtype)), dtype_(dtype) {
  MOEX_CHECK_INPUT(num_blocks >= 1 && num_blocks <= INT32_MAX, "a KV cache of ", num_blocks, " blocks");
  layout_.num_blocks = num_blocks;
  allocate();
}

void PagedKvCache::allocate() {
  const double total = static_cast<double>(layout_.num_blocks) * static_cast<double>(layout_.block_bytes());
  check_fits_in_memory(total, "the KV cache (--kv-cache-gb)", "lower --kv-cache-gb");
  const size_t elems = static_cast<size_t>(layout_.num_blocks * layout_.block_elems());
  // Touched now, not mid-step; on huge pages where the kernel allows them (reserve maps, madvise, then
  // assign touches): decode attention visits one 2 KB tile per (block, layer, K|V, head), every one on its
  // own 4 KB page otherwise, a TLB miss each.
  if (dtype_ == KvCacheDType::kF32) {
    f32_.reserve(elems);
    advise_huge_pages(f32_.data(), elems * sizeof(float));
    f32_.assign(elems, 0.0f);
  } else {
    bf16_.reserve(elems);
    advise_huge_pages(bf16_.data(), elems * sizeof(uint16_t));
    bf16_.assign(elems, 0);
  }
}

}  // namespace moex

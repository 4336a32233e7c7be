#include "moex/runtime/kv_block_manager.h"

#include <algorithm>

#include "moex/base/error.h"

namespace moex {

namespace {
uint64_t mix(uint64_t x) {  // splitmix64's finaliser: every input bit moves every output bit
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t KvBlockManager::chain_hash(uint64_t parent, const int32_t* tokens, int64_t count) {
  uint64_t h = mix(parent ^ 0x9e3779b97f4a7c15ull);
  for (int64_t i = 0; i < count; ++i) h = mix(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

KvBlockManager::KvBlockManager(int32_t num_blocks, int32_t block_size, bool prefix_caching)
    : num_blocks_(num_blocks), block_size_(block_size), prefix_caching_(prefix_caching) {
  MOEX_CHECK(num_blocks > 0 && block_size > 0, "blocks ", num_blocks, " of ", block_size);
  blocks_.resize(num_blocks);
  block_tokens_.resize(static_cast<size_t>(num_blocks) * block_size);
  free_list_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_list_.push_back(b);  // block 0 is taken first
  cached_.reserve(num_blocks);
}

const std::vector<int32_t>& KvBlockManager::block_table(SeqId seq) const {
  static const std::vector<int32_t> empty;
  const auto it = tables_.find(seq);
  return it == tables_.end() ? empty : it->second.table;
}

void KvBlockManager::lru_push_back(int32_t block) {
  Block& b = blocks_[block];
  b.lru_prev = lru_tail_;
  b.lru_next = -1;
  if (lru_tail_ >= 0) blocks_[lru_tail_].lru_next = block;
  else lru_head_ = block;
  lru_tail_ = block;
  ++num_evictable_;
}

void KvBlockManager::lru_remove(int32_t block) {
  Block& b = blocks_[block];
  if (b.lru_prev >= 0) blocks_[b.lru_prev].lru_next = b.lru_next;
  else lru_head_ = b.lru_next;
  if (b.lru_next >= 0) blocks_[b.lru_next].lru_prev = b.lru_prev;
  else lru_tail_ = b.lru_prev;
  b.lru_prev = b.lru_next = -1;
  --num_evictable_;
}

std::vector<int32_t> KvBlockManager::evictable_in_order() const {
  std::vector<int32_t> order;
  for (int32_t b = lru_head_; b >= 0; b = blocks_[b].lru_next) order.push_back(b);
  return order;
}

int32_t KvBlockManager::take_block() {
  int32_t block;
  if (!free_list_.empty()) {
    block = free_list_.back();
    free_list_.pop_back();
  } else {
    MOEX_CHECK(lru_head_ >= 0, "no free KV block (callers check can_allocate first)");
    block = lru_head_;
    lru_remove(block);
    cached_.erase(blocks_[block].hash);
    blocks_[block].cached = false;
  }
  blocks_[block].ref = 1;
  return block;
}

int32_t KvBlockManager::find_cached(uint64_t hash, uint64_t parent, const int32_t* tokens) const {
  const auto it = cached_.find(hash);
  if (it == cached_.end()) return -1;
  const Block& b = blocks_[it->second];
  const int32_t* stored = block_tokens_.data() + static_cast<size_t>(it->second) * block_size_;
  if (b.parent_hash != parent || !std::equal(tokens, tokens + block_size_, stored)) return -1;
  return it->second;
}

KvBlockManager::PrefixProbe KvBlockManager::probe_prefix(const int32_t* tokens, int64_t n) const {
  PrefixProbe probe;
  if (!prefix_caching_) return probe;
  uint64_t parent = kRootHash;
  for (int64_t i = 0; (i + 1) * block_size_ <= n - 1; ++i) {
    const int32_t* block_tokens = tokens + i * block_size_;
    const uint64_t hash = chain_hash(parent, block_tokens, block_size_);
    const int32_t block = find_cached(hash, parent, block_tokens);
    if (block < 0) break;
    ++probe.blocks;
    if (blocks_[block].ref == 0) ++probe.evictable;
    parent = hash;
  }
  return probe;
}

int64_t KvBlockManager::adopt_prefix(SeqId seq, const int32_t* tokens, int64_t n) {
  SeqBlocks& s = tables_[seq];
  MOEX_CHECK(s.table.empty(), "sequence ", seq, " already has blocks");
  if (!prefix_caching_) return 0;
  for (int64_t i = 0; (i + 1) * block_size_ <= n - 1; ++i) {
    const int32_t* block_tokens = tokens + i * block_size_;
    const uint64_t hash = chain_hash(s.last_hash, block_tokens, block_size_);
    const int32_t block = find_cached(hash, s.last_hash, block_tokens);
    if (block < 0) break;
    if (blocks_[block].ref++ == 0) lru_remove(block);
    s.table.push_back(block);
    s.last_hash = hash;
    ++s.hashed_blocks;
  }
  return static_cast<int64_t>(s.table.size()) * block_size_;
}

bool KvBlockManager::reserve(SeqId seq, int64_t tokens) {
  SeqBlocks& s = tables_[seq];
  const int64_t needed = blocks_for(tokens) - static_cast<int64_t>(s.table.size());
  if (needed <= 0) return true;
  if (!can_allocate(needed)) return false;
  for (int64_t i = 0; i < needed; ++i) s.table.push_back(take_block());
  return true;
}

void KvBlockManager::cache_full_blocks(SeqId seq, const int32_t* tokens, int64_t computed) {
  if (!prefix_caching_) return;
  const auto it = tables_.find(seq);
  MOEX_CHECK(it != tables_.end(), "unknown sequence ", seq);
  SeqBlocks& s = it->second;
  const int64_t full = std::min<int64_t>(computed / block_size_, static_cast<int64_t>(s.table.size()));
  for (int64_t i = s.hashed_blocks; i < full; ++i) {
    const int32_t* block_tokens = tokens + i * block_size_;
    const uint64_t hash = chain_hash(s.last_hash, block_tokens, block_size_);
    const int32_t block = s.table[i];
    // Another sequence may have cached the same content first: that copy stays the cached one.
    if (!blocks_[block].cached && cached_.find(hash) == cached_.end()) {
      Block& b = blocks_[block];
      b.cached = true;
      b.hash = hash;
      b.parent_hash = s.last_hash;
      std::copy(block_tokens, block_tokens + block_size_, block_tokens_.begin() + static_cast<size_t>(block) * block_size_);
      cached_.emplace(hash, block);
    }
    s.last_hash = hash;
    s.hashed_blocks = i + 1;
  }
}

void KvBlockManager::free(SeqId seq) {
  const auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  const std::vector<int32_t>& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend(); ++b) {
    Block& block = blocks_[*b];
    MOEX_CHECK(block.ref > 0, "block ", *b, " freed twice");
    if (--block.ref > 0) continue;
    if (block.cached) lru_push_back(*b);
    else free_list_.push_back(*b);
  }
  tables_.erase(it);
}

}  // namespace moex

// Which KV blocks belong to whom: a free list, reference counts, per-sequence block tables, and the prefix
// cache (full blocks found again by a hash chain over their tokens; when unreferenced they wait on an LRU
// list and are evicted only when a block is needed). Pure bookkeeping over block ids: the bf16 storage is
// PagedKvCache. docs/serve.md has the design.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace moex {

using SeqId = int64_t;

class KvBlockManager {
 public:
  KvBlockManager(int32_t num_blocks, int32_t block_size, bool prefix_caching = true);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  // Blocks that an allocation may take: never used, or cached with no reference (evicted on demand).
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_list_.size()) + num_evictable_; }
  int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }  // referenced by a sequence
  int32_t num_evictable_blocks() const { return num_evictable_; }
  bool can_allocate(int64_t blocks) const { return blocks <= num_free_blocks(); }
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // The cached full blocks that start tokens[0, n): whole blocks within the first n - 1 tokens (the last
  // token is always computed, for its logits). `evictable`: how many of them have no reference now
  // (adopting them takes them off the free count).
  struct PrefixProbe {
    int32_t blocks = 0;
    int32_t evictable = 0;
  };
  PrefixProbe probe_prefix(const int32_t* tokens, int64_t n) const;
  // Starts the (new or emptied) table of `seq` with the cached prefix, one reference each; returns the
  // tokens it covers (a multiple of block_size).
  int64_t adopt_prefix(SeqId seq, const int32_t* tokens, int64_t n);
  // Grows the table of `seq` to cover positions [0, tokens). Returns false, changing nothing, when the
  // free blocks do not suffice.
  bool reserve(SeqId seq, int64_t tokens);
  // After a step computed tokens[0, computed) of `seq`: its full blocks join the prefix cache.
  void cache_full_blocks(SeqId seq, const int32_t* tokens, int64_t computed);
  // Drops the references of `seq` and forgets its table. Unreferenced blocks return to the free list, or,
  // when cached, to the back of the LRU list (the table's last block first, so a prefix outlives its tail).
  void free(SeqId seq);

  bool has_sequence(SeqId seq) const { return tables_.count(seq) != 0; }
  const std::vector<int32_t>& block_table(SeqId seq) const;  // empty for an unknown sequence
  int32_t ref_count(int32_t block) const { return blocks_[block].ref; }
  // Blocks with no reference in eviction order (least recently freed first), for tests and metrics.
  std::vector<int32_t> evictable_in_order() const;

  // hash(parent hash, tokens of one full block): the key of a block in the prefix cache.
  static uint64_t chain_hash(uint64_t parent, const int32_t* tokens, int64_t count);
  static constexpr uint64_t kRootHash = 0x6d6f65782d6b7631ull;  // the parent of a sequence's first block

 private:
  struct Block {
    int32_t ref = 0;
    bool cached = false;      // in the hash map (content and parent hash below are valid)
    uint64_t hash = 0, parent_hash = 0;
    int32_t lru_prev = -1, lru_next = -1;  // links of the LRU list while ref == 0 and cached
  };
  struct SeqBlocks {
    std::vector<int32_t> table;
    int64_t hashed_blocks = 0;  // leading blocks whose chain hash is known
    uint64_t last_hash = kRootHash;
  };
  // The cached block holding these tokens after `parent`, or -1 (hash hit confirmed on the tokens).
  int32_t find_cached(uint64_t hash, uint64_t parent, const int32_t* tokens) const;
  int32_t take_block();  // a free block, evicting the least recently used cached one if needed
  void lru_push_back(int32_t block);
  void lru_remove(int32_t block);

  int32_t num_blocks_, block_size_;
  bool prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<int32_t> block_tokens_;  // [num_blocks][block_size]: the tokens of cached blocks
  std::vector<int32_t> free_list_;     // blocks with no content worth keeping
  int32_t lru_head_ = -1, lru_tail_ = -1, num_evictable_ = 0;
  std::unordered_map<uint64_t, int32_t> cached_;  // chain hash -> block
  std::unordered_map<SeqId, SeqBlocks> tables_;
};

}  // namespace moex

// Attention over a paged KV cache: K and V live in fixed-size blocks of positions, stored as bf16 (or f32,
// the exact mode the PyTorch reference tests use: every function has a `const float* pool` overload), and a
// sequence reaches its positions through a block table (position p is row p % block_size of block
// table[p / block_size]). Accumulation is fp32. docs/serve.md explains the layout.
#pragma once
#include <cstdint>

#include "moex/base/dtype.h"

namespace moex::kernels {

inline constexpr int64_t kKvBlockSize = 16;  // positions per block

// A pool element read as f32: bf16 (rounded on write, widened on read) or f32 (as is). The kernel and its scalar
// reference read the pool alike.
inline float kv_to_f32(uint16_t x) { return bf16_to_f32(x); }
inline float kv_to_f32(float x) { return x; }

// The pool, bf16: [num_blocks][layers][2 (k, v)][kv_heads][block_size][head_dim].
// (block, layer, k|v, kv head) is one contiguous tile of block_size x head_dim: attention works on one KV
// head at a time (all query heads of a GQA group share it), so each block it reads is one streamed run.
// Block outermost: a block holds every layer's K and V for its positions, so one block table serves all
// layers and a block is one contiguous unit to free, copy or swap.
struct PagedKvLayout {
  int64_t num_blocks = 0;
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = kKvBlockSize;
  int64_t elem_bytes = 2;  // 2: bf16 pool, 4: f32 pool

  int64_t tile_elems() const { return block_size * head_dim; }                  // one (k|v, head) tile
  int64_t block_elems() const { return layers * 2 * kv_heads * tile_elems(); }  // one block, all layers
  int64_t block_bytes() const { return block_elems() * elem_bytes; }
  // Element offset of tile (block, layer, kv: 0 = K, 1 = V, head).
  int64_t tile_offset(int64_t block, int64_t layer, int64_t kv, int64_t head) const {
    return ((block * layers + layer) * 2 + kv) * kv_heads * tile_elems() + head * tile_elems();
  }
};

// Writes one position's K and V rows ([kv_heads * head_dim] fp32 each, rounded to bf16) into the block the
// table maps `position` to. The table must already cover the position.
void paged_kv_write(const PagedKvLayout& layout, uint16_t* pool, int64_t layer, const int32_t* block_table,
                    int64_t position, const float* k_row, const float* v_row);
void paged_kv_write(const PagedKvLayout& layout, float* pool, int64_t layer, const int32_t* block_table,
                    int64_t position, const float* k_row, const float* v_row);

// The queries of one sequence in a step: rows q_row .. q_row + q_len - 1 of q and out, at positions
// q_pos .. q_pos + q_len - 1. Attention's view of the model's StepSeq (model/decoder.h, "a sequence's slice
// of a step"), kept apart because kernels sit below model and the kernel needs the slice's first row, which
// StepSeq leaves implicit (the sum of the lengths before it). Row i attends causally to cache positions 0 .. q_pos + i, which must all be
// written (append the step's K/V first, as the contiguous cache does).
struct PagedAttentionSeq {
  const int32_t* block_table = nullptr;
  int64_t q_row = 0;
  int64_t q_len = 0;
  int64_t q_pos = 0;
};

// q, out: [rows, heads * head_dim] fp32; heads a multiple of layout.kv_heads (GQA: query head h reads KV
// head h / (heads / kv_heads)). Scale 1/sqrt(head_dim).
// Scalar reference (the test oracle): per row and head, scores, softmax, weighted sum.
void paged_attention_ref(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                         const PagedAttentionSeq* seqs, int64_t num_seqs, const float* q, int64_t heads,
                         float* out);
void paged_attention_ref(const PagedKvLayout& layout, const float* pool, int64_t layer,
                         const PagedAttentionSeq* seqs, int64_t num_seqs, const float* q, int64_t heads,
                         float* out);

// Query rows per prefill tile: a K/V block is widened to fp32 once and used by this many rows x the group.
inline constexpr int64_t kPagedQueryTile = 16;
// fp32 scratch each thread needs for paged_attention.
int64_t paged_attention_scratch_floats(const PagedKvLayout& layout, int64_t heads);
// The fast version: online softmax block by block through the table, one work item per (sequence, KV head,
// tile of kPagedQueryTile query rows), items spread over the threads (decode: sequences x KV heads; prefill:
// also query tiles). scratch: num_threads() x paged_attention_scratch_floats(); nothing allocates.
void paged_attention(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer, const PagedAttentionSeq* seqs,
                     int64_t num_seqs, const float* q, int64_t heads, float* out, float* scratch);
void paged_attention(const PagedKvLayout& layout, const float* pool, int64_t layer, const PagedAttentionSeq* seqs,
                     int64_t num_seqs, const float* q, int64_t heads, float* out, float* scratch);

namespace x86 {
// One work item (query rows [row_begin, row_end) of seq x the `group` query heads of KV head g) on AVX-512:
// 16 query vectors per register, vertical online softmax. Needs block_size 16 and head_dim <= 128;
// paged_attention calls it when use_x86_kernels(), else the AVX2 one below, else the portable tile.
void paged_attend_tile_avx512(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                              int64_t group, const float* q, int64_t heads, float* out, float* scratch);
void paged_attend_tile_avx512(const PagedKvLayout& layout, const float* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                              int64_t group, const float* q, int64_t heads, float* out, float* scratch);
// The same on AVX2 + FMA (8 query vectors per register), called when use_avx2_kernels() and not the above.
void paged_attend_tile_avx2(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                            const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                            int64_t group, const float* q, int64_t heads, float* out, float* scratch);
void paged_attend_tile_avx2(const PagedKvLayout& layout, const float* pool, int64_t layer,
                            const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                            int64_t group, const float* q, int64_t heads, float* out, float* scratch);
}  // namespace x86

}  // namespace moex::kernels

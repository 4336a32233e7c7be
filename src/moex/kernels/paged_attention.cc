#include "moex/kernels/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/threads.h"

namespace moex::kernels {

namespace {
inline void store(uint16_t* dst, float x) { *dst = f32_to_bf16(x); }
inline void store(float* dst, float x) { *dst = x; }

template <typename Elem>
void kv_write(const PagedKvLayout& layout, Elem* pool, int64_t layer, const int32_t* block_table,
              int64_t position, const float* k_row, const float* v_row) {
  const int64_t hd = layout.head_dim, block = block_table[position / layout.block_size],
                row = position % layout.block_size;
  for (int64_t g = 0; g < layout.kv_heads; ++g) {
    Elem* k = pool + layout.tile_offset(block, layer, 0, g) + row * hd;
    Elem* v = pool + layout.tile_offset(block, layer, 1, g) + row * hd;
    for (int64_t e = 0; e < hd; ++e) {
      store(k + e, k_row[g * hd + e]);
      store(v + e, v_row[g * hd + e]);
    }
  }
}
}  // namespace

void paged_kv_write(const PagedKvLayout& layout, uint16_t* pool, int64_t layer, const int32_t* block_table,
                    int64_t position, const float* k_row, const float* v_row) {
  kv_write(layout, pool, layer, block_table, position, k_row, v_row);
}
void paged_kv_write(const PagedKvLayout& layout, float* pool, int64_t layer, const int32_t* block_table,
                    int64_t position, const float* k_row, const float* v_row) {
  kv_write(layout, pool, layer, block_table, position, k_row, v_row);
}

int64_t paged_attention_scratch_floats(const PagedKvLayout& layout, int64_t heads) {
  const int64_t rows = kPagedQueryTile * (heads / layout.kv_heads);
  // Portable tile: k [bs][hd], v [bs][hd], scores [bs], acc [rows][hd], running max and sum [rows].
  const int64_t portable = 2 * layout.block_size * layout.head_dim + layout.block_size + rows * layout.head_dim + 2 * rows;
  // AVX-512 tile: k, v [bs][hd], probabilities [bs][16], lanes [16], and per lane group of 16 query vectors
  // transposed queries [hd][16], acc [16][hd], running max, sum and positions [3][16]. The AVX2 tile's lane
  // groups of 8 take half of that each, so this size covers it too.
  const int64_t lane_groups = (rows + 15) / 16;
  const int64_t x86 = 2 * layout.block_size * layout.head_dim + 16 * layout.block_size + 16 +
                      lane_groups * (32 * layout.head_dim + 48);
  // The AVX-512 key-lane tile (few query vectors): K of up to 8 blocks transposed [8][16 C][16], p [4][16].
  const int64_t key_lane = 8 * 16 * 16 * ((layout.head_dim + 15) / 16) + 4 * 16;
  return std::max({portable, x86, key_lane});
}

namespace {

// One work item: query rows [row_begin, row_end) of `seq` x the `group` query heads of KV head g.
// Online softmax (running max m, sum l, unnormalised acc) over the blocks the last row reaches.
template <typename Elem>
void attend_tile(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
                 int64_t row_begin, int64_t row_end, int64_t g, int64_t group, const float* q, int64_t heads,
                 float* out, float* scratch) {
  const int64_t hd = layout.head_dim, bs = layout.block_size;
  const int64_t rows = (row_end - row_begin) * group;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* k = scratch;                // [bs][hd] the block's K tile, widened to fp32 once for all rows
  float* v = k + bs * hd;            // [bs][hd]
  float* scores = v + bs * hd;       // [bs]
  float* acc = scores + bs;          // [rows][hd]
  float* m = acc + rows * hd;        // [rows]
  float* l = m + rows;               // [rows]
  std::fill(acc, acc + rows * hd, 0.0f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);

  const int64_t last_position = seq.q_pos + row_end - 1;
  const int64_t blocks = last_position / bs + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * bs, valid = std::min(bs, last_position + 1 - first);
    const Elem* k_tile = pool + layout.tile_offset(seq.block_table[b], layer, 0, g);
    const Elem* v_tile = pool + layout.tile_offset(seq.block_table[b], layer, 1, g);
    for (int64_t i = 0; i < valid * hd; ++i) k[i] = kv_to_f32(k_tile[i]);
    for (int64_t i = 0; i < valid * hd; ++i) v[i] = kv_to_f32(v_tile[i]);

    for (int64_t r = 0; r < row_end - row_begin; ++r) {
      const int64_t row = seq.q_row + row_begin + r;
      const int64_t keys = std::min(valid, seq.q_pos + row_begin + r + 1 - first);  // causal
      if (keys <= 0) continue;
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = q + (row * heads + g * group + h) * hd;
        const int64_t idx = r * group + h;
        float block_max = -INFINITY;
        for (int64_t j = 0; j < keys; ++j) {
          const float* kj = k + j * hd;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)  // lets the compiler reorder the sum into vector lanes
          for (int64_t e = 0; e < hd; ++e) dot += qh[e] * kj[e];
          scores[j] = dot * scale;
          block_max = std::max(block_max, scores[j]);
        }
        const float new_max = std::max(m[idx], block_max);
        const float correction = std::exp(m[idx] - new_max);  // exp(-inf) = 0 on the first block
        float sum = 0.0f;
        for (int64_t j = 0; j < keys; ++j) {
          scores[j] = std::exp(scores[j] - new_max);
          sum += scores[j];
        }
        l[idx] = l[idx] * correction + sum;
        m[idx] = new_max;
        float* a = acc + idx * hd;
        for (int64_t e = 0; e < hd; ++e) a[e] *= correction;
        for (int64_t j = 0; j < keys; ++j) {
          const float p = scores[j];
          const float* vj = v + j * hd;
          for (int64_t e = 0; e < hd; ++e) a[e] += p * vj[e];
        }
      }
    }
  }
  for (int64_t r = 0; r < row_end - row_begin; ++r) {
    const int64_t row = seq.q_row + row_begin + r;
    for (int64_t h = 0; h < group; ++h) {
      const int64_t idx = r * group + h;
      const float inv = 1.0f / l[idx];
      float* oh = out + (row * heads + g * group + h) * hd;
      for (int64_t e = 0; e < hd; ++e) oh[e] = acc[idx * hd + e] * inv;
    }
  }
}

template <typename Elem>
void attention(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq* seqs,
               int64_t num_seqs, const float* q, int64_t heads, float* out, float* scratch) {
  const int64_t kv_heads = layout.kv_heads, group = heads / kv_heads;
  const int64_t per_thread = paged_attention_scratch_floats(layout, heads);
  int64_t max_tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    max_tiles = std::max(max_tiles, (seqs[s].q_len + kPagedQueryTile - 1) / kPagedQueryTile);
  // Items (sequence, KV head, query tile) over a dense grid; tiles past a sequence's rows are skipped.
  // Dynamic schedule: items differ by their context length. At decode (one tile a sequence) a thread takes a
  // sequence's KV heads together: a block holds the heads' tiles side by side (16 KB in bf16 at mini's shape), so
  // one thread walks them in order instead of two threads taking alternate 2 KB tiles of it (batch 64 decode
  // on the AMX Xeon: 690 -> 530 us a layer).
  const int64_t items = num_seqs * kv_heads * max_tiles;
  // Only with sequences enough to keep every thread busy: a lone sequence's heads still go to all of them.
  const int chunk = max_tiles == 1 && num_seqs >= 2 * num_threads() ? static_cast<int>(kv_heads) : 1;
  const bool tile_shape = layout.block_size == 16 && layout.head_dim <= 128;  // what the vector tiles handle
  const bool avx512_tile = tile_shape && use_x86_kernels(), avx2_tile = tile_shape && !avx512_tile && use_avx2_kernels();
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads()) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t s = item / (kv_heads * max_tiles), g = (item / max_tiles) % kv_heads, tile = item % max_tiles;
    const PagedAttentionSeq& seq = seqs[s];
    const int64_t row_begin = tile * kPagedQueryTile;
    if (row_begin >= seq.q_len) continue;
    const int64_t row_end = std::min(seq.q_len, row_begin + kPagedQueryTile);
    float* thread_scratch = scratch + static_cast<int64_t>(omp_get_thread_num()) * per_thread;
    if (avx512_tile)
      x86::paged_attend_tile_avx512(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out,
                                    thread_scratch);
    else if (avx2_tile)
      x86::paged_attend_tile_avx2(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out,
                                  thread_scratch);
    else
      attend_tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, thread_scratch);
  }
}

}  // namespace

void paged_attention(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer, const PagedAttentionSeq* seqs,
                     int64_t num_seqs, const float* q, int64_t heads, float* out, float* scratch) {
  attention(layout, pool, layer, seqs, num_seqs, q, heads, out, scratch);
}
void paged_attention(const PagedKvLayout& layout, const float* pool, int64_t layer, const PagedAttentionSeq* seqs,
                     int64_t num_seqs, const float* q, int64_t heads, float* out, float* scratch) {
  attention(layout, pool, layer, seqs, num_seqs, q, heads, out, scratch);
}

}  // namespace moex::kernels

// Scalar reference of paged attention: the test oracle for paged_attention (paged_attention.cc).
#include <cmath>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/kernels/paged_attention.h"

namespace moex::kernels {

namespace {

template <typename Elem>
void attention_ref(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq* seqs,
                   int64_t num_seqs, const float* q, int64_t heads, float* out) {
  const int64_t hd = layout.head_dim, bs = layout.block_size, group = heads / layout.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> scores;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const PagedAttentionSeq& seq = seqs[s];
    for (int64_t i = 0; i < seq.q_len; ++i) {
      const int64_t row = seq.q_row + i, length = seq.q_pos + i + 1;
      scores.assign(length, 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q + (row * heads + h) * hd;
        const int64_t g = h / group;
        // position j: row j % bs of the tile of block table[j / bs]
        auto at = [&](int64_t kv, int64_t j, int64_t e) {
          return kv_to_f32(pool[layout.tile_offset(seq.block_table[j / bs], layer, kv, g) + (j % bs) * hd + e]);
        };
        float max_score = -INFINITY;
        for (int64_t j = 0; j < length; ++j) {
          float dot = 0.0f;
          for (int64_t e = 0; e < hd; ++e) dot += qh[e] * at(0, j, e);
          scores[j] = dot * scale;
          max_score = std::max(max_score, scores[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < length; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        float* oh = out + (row * heads + h) * hd;
        for (int64_t e = 0; e < hd; ++e) {
          float acc = 0.0f;
          for (int64_t j = 0; j < length; ++j) acc += scores[j] * at(1, j, e);
          oh[e] = acc / sum;
        }
      }
    }
  }
}

}  // namespace

void paged_attention_ref(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                         const PagedAttentionSeq* seqs, int64_t num_seqs, const float* q, int64_t heads,
                         float* out) {
  attention_ref(layout, pool, layer, seqs, num_seqs, q, heads, out);
}
void paged_attention_ref(const PagedKvLayout& layout, const float* pool, int64_t layer,
                         const PagedAttentionSeq* seqs, int64_t num_seqs, const float* q, int64_t heads,
                         float* out) {
  attention_ref(layout, pool, layer, seqs, num_seqs, q, heads, out);
}

}  // namespace moex::kernels

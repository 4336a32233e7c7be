// attention_one_token on AVX-512 (kernels/ops.h). The scalar loop's dot products are one dependent chain of
// head_dim FMAs per position (latency-bound, ~4 cycles each); here a position's q.k is head_dim / 16 vector
// FMAs and one horizontal sum, the softmax runs 16 positions per instruction (exp_ps, ~2 ulp), and p.V adds
// each position's value row into head_dim / 16 accumulators. f32 sums in another order than the scalar
// loop's: the two agree to rounding (tested against a double-precision reference).
#include <immintrin.h>

#include <cmath>

#include "moex/kernels/ops.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {

void attention_one_token_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t max_seq, int64_t length, float* out,
                                float* scratch) {
  const int64_t group = heads / kv_heads, chunks = (head_dim + 15) / 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * head_dim;
    const float* keys = k_cache + (h / group) * max_seq * head_dim;     // [max_seq, hd]
    const float* values = v_cache + (h / group) * max_seq * head_dim;   // [max_seq, hd]
    __m512 qv[8];  // head_dim <= 128 (the caller checks)
    for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_maskz_loadu_ps(lane_mask(head_dim - 16 * c), qh + 16 * c);
    // Scores [length] and their max.
    __m512 max_v = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < length; ++j) {
      const float* key = keys + j * head_dim;
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(lane_mask(head_dim), key));
      for (int64_t c = 1; c < chunks; ++c)
        acc = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(lane_mask(head_dim - 16 * c), key + 16 * c), acc);
      scratch[j] = _mm512_reduce_add_ps(acc) * scale;
    }
    for (int64_t j = 0; j < length; j += 16)
      max_v = _mm512_mask_max_ps(max_v, lane_mask(length - j), max_v, _mm512_maskz_loadu_ps(lane_mask(length - j), scratch + j));
    const __m512 max_b = _mm512_set1_ps(_mm512_reduce_max_ps(max_v));
    __m512 sum_v = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; j += 16) {
      const __mmask16 m = lane_mask(length - j);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scratch + j), max_b));
      _mm512_mask_storeu_ps(scratch + j, m, e);
      sum_v = _mm512_add_ps(sum_v, _mm512_maskz_mov_ps(m, e));
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(sum_v);
    // out_h = (sum_j e_j v_j) / sum_j e_j
    __m512 acc[8];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; ++j) {
      const __m512 p = _mm512_set1_ps(scratch[j]);
      const float* value = values + j * head_dim;
      for (int64_t c = 0; c < chunks; ++c)
        acc[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(lane_mask(head_dim - 16 * c), value + 16 * c), acc[c]);
    }
    float* oh = out + h * head_dim;
    const __m512 inv_v = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_mask_storeu_ps(oh + 16 * c, lane_mask(head_dim - 16 * c), _mm512_mul_ps(acc[c], inv_v));
  }
}

}  // namespace moex::kernels::x86

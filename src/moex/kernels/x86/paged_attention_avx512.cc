// paged_attention's work item on AVX-512 (kernels/paged_attention.h). Hand-written: no Debian library runs
// attention over MoEX's paged block layout. The portable tile in paged_attention.cc walks one query vector
// at a time with scalar softmax and p.V loops; here 16 query vectors (query rows x the GQA group's heads)
// sit in the 16 lanes of a register:
// - Q is transposed once per item into qt [hd][16], so a block's 16 scores per lane come out of hd x 16
//   FMAs (qt[e] times key j's element e, broadcast), with no horizontal sums;
// - the online softmax is vertical: the block's max, exp, running max m and sum l are one register per key
//   or per lane; causal masking is a lane compare of key position against each lane's query position;
// - p.V adds key j's value row, scaled by the lane's p broadcast, into that lane's accumulator row (L1).
// A bf16 block is widened to f32 once per lane group. Sums run in another order than the scalar tile's and
// exp is exp_ps (~2 ulp): the two agree to rounding (tests/unit/kv_cache_test.cc, against fp32 references).
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "moex/kernels/paged_attention.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {

namespace {

// The f32 pool is read in place; a bf16 tile's first `count` elements are widened into dst.
const float* widen_tile(const float* src, float*, int64_t) { return src; }
const float* widen_tile(const uint16_t* src, float* dst, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = lane_mask(count - i);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src + i));
    _mm512_mask_storeu_ps(dst + i, m, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  return dst;
}

// acc[lane] = acc[lane] * correction[lane] + sum_j p[j][lane] v_j for lanes 0..n-1, C = head_dim / 16 chunks
// as a compile-time count so the lane's accumulators stay in registers.
template <int C>
void add_pv(float* acc, const float* V, const float* p, const float* correction, int64_t n, int64_t valid, int64_t hd) {
  for (int64_t lane = 0; lane < n; ++lane) {
    float* a = acc + lane * hd;
    const __m512 c = _mm512_set1_ps(correction[lane]);
    __m512 av[C];
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) av[k] = _mm512_mul_ps(c, _mm512_maskz_loadu_ps(lane_mask(hd - 16 * k), a + 16 * k));
    for (int64_t j = 0; j < valid; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j * 16 + lane]);
#pragma GCC unroll 8
      for (int k = 0; k < C; ++k)
        av[k] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(lane_mask(hd - 16 * k), V + j * hd + 16 * k), av[k]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) _mm512_mask_storeu_ps(a + 16 * k, lane_mask(hd - 16 * k), av[k]);
  }
}

// e^x for x <= 0, with x below -87 taken as -87 (e^-87 ~ 1.6e-38): exp_ps(-inf) would be NaN.
inline __m512 exp_nonpositive(__m512 x) { return exp_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }

template <typename Elem>
void tile(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
          int64_t row_begin, int64_t row_end, int64_t g, int64_t group, const float* q, int64_t heads, float* out,
          float* scratch) {
  const int64_t hd = layout.head_dim, bs = layout.block_size, chunks = (hd + 15) / 16;  // bs == 16, hd <= 128
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  float* kf = scratch;         // [bs][hd] a bf16 K tile widened
  float* vf = kf + bs * hd;    // [bs][hd]
  float* qt = vf + bs * hd;    // [hd][16] the lane group's queries, transposed
  float* acc = qt + 16 * hd;   // [16][hd] unnormalised outputs
  float* p = acc + 16 * hd;    // [bs][16] the block's probabilities, key-major
  float* lane_f = p + 16 * bs; // [16] per-lane scalars (correction, then 1 / l)
  const int64_t vectors = (row_end - row_begin) * group;  // query vector v: row v / group, head v % group

  for (int64_t base = 0; base < vectors; base += 16) {
    const int64_t n = std::min<int64_t>(16, vectors - base);
    alignas(64) int32_t qpos[16];
    int64_t last = 0;
    for (int64_t lane = 0; lane < 16; ++lane) {
      if (lane < n) {
        const int64_t r = (base + lane) / group, h = (base + lane) % group;
        const float* qh = q + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
        for (int64_t e = 0; e < hd; ++e) qt[e * 16 + lane] = qh[e];
        qpos[lane] = static_cast<int32_t>(seq.q_pos + row_begin + r);
        last = std::max<int64_t>(last, qpos[lane]);
      } else {  // idle lane: zero query, sees every key (its m stays finite), never written out
        for (int64_t e = 0; e < hd; ++e) qt[e * 16 + lane] = 0.0f;
        qpos[lane] = INT32_MAX;
      }
    }
    std::fill(acc, acc + n * hd, 0.0f);
    const __m512i qpos_v = _mm512_load_si512(qpos);
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();

    const int64_t blocks = last / bs + 1;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * bs, valid = std::min(bs, last + 1 - first);
      const float* K = widen_tile(pool + layout.tile_offset(seq.block_table[b], layer, 0, g), kf, valid * hd);
      const float* V = widen_tile(pool + layout.tile_offset(seq.block_table[b], layer, 1, g), vf, valid * hd);
      // s[j] (lanes: queries) = q . k_j; rows j >= valid hold stale or unwritten data and are masked below.
      __m512 s[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
      for (int64_t e = 0; e < hd; ++e) {
        const __m512 qe = _mm512_loadu_ps(qt + e * 16);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) s[j] = _mm512_fmadd_ps(qe, _mm512_set1_ps(K[j * hd + e]), s[j]);
      }
      __mmask16 keep[16];
      __m512 block_max = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        keep[j] = j < valid ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(first + j)), qpos_v)
                            : static_cast<__mmask16>(0);  // causal: key position <= the lane's query position
        s[j] = _mm512_mul_ps(s[j], scale);
        block_max = _mm512_mask_max_ps(block_max, keep[j], block_max, s[j]);
      }
      // Block 0 holds key 0, which every lane sees: from then on m is finite in every lane.
      const __m512 m_new = _mm512_max_ps(m, block_max);
      const __m512 correction = exp_nonpositive(_mm512_sub_ps(m, m_new));
      __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512 pj = _mm512_maskz_mov_ps(keep[j], exp_nonpositive(_mm512_sub_ps(s[j], m_new)));
        sum = _mm512_add_ps(sum, pj);
        _mm512_storeu_ps(p + j * 16, pj);
      }
      l = _mm512_fmadd_ps(l, correction, sum);
      m = m_new;
      _mm512_storeu_ps(lane_f, correction);
      switch (chunks) {
        case 1: add_pv<1>(acc, V, p, lane_f, n, valid, hd); break;
        case 2: add_pv<2>(acc, V, p, lane_f, n, valid, hd); break;
        case 3: add_pv<3>(acc, V, p, lane_f, n, valid, hd); break;
        case 4: add_pv<4>(acc, V, p, lane_f, n, valid, hd); break;
        case 5: add_pv<5>(acc, V, p, lane_f, n, valid, hd); break;
        case 6: add_pv<6>(acc, V, p, lane_f, n, valid, hd); break;
        case 7: add_pv<7>(acc, V, p, lane_f, n, valid, hd); break;
        default: add_pv<8>(acc, V, p, lane_f, n, valid, hd); break;
      }
    }
    _mm512_storeu_ps(lane_f, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t lane = 0; lane < n; ++lane) {
      const int64_t r = (base + lane) / group, h = (base + lane) % group;
      float* oh = out + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
      const __m512 inv = _mm512_set1_ps(lane_f[lane]);
      for (int64_t k = 0; k < chunks; ++k)
        _mm512_mask_storeu_ps(oh + 16 * k, lane_mask(hd - 16 * k),
                              _mm512_mul_ps(inv, _mm512_maskz_loadu_ps(lane_mask(hd - 16 * k), acc + lane * hd + 16 * k)));
    }
  }
}

}  // namespace

void paged_attend_tile_avx512(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                              int64_t group, const float* q, int64_t heads, float* out, float* scratch) {
  tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
}
void paged_attend_tile_avx512(const PagedKvLayout& layout, const float* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                              int64_t group, const float* q, int64_t heads, float* out, float* scratch) {
  tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
}

}  // namespace moex::kernels::x86

// paged_attention's work item on AVX-512 (kernels/paged_attention.h). Hand-written: no Debian library runs
// attention over MoEX's paged block layout. The portable tile in paged_attention.cc walks one query vector
// at a time with scalar softmax and p.V loops; here 16 query vectors (query rows x the GQA group's heads)
// sit in the 16 lanes of a register:
// - Q is transposed once per item into qt [hd][16], so a block's 16 scores per lane come out of hd x 16
//   FMAs (qt[e] times key j's element e, broadcast), with no horizontal sums;
// - the online softmax is vertical: the block's max, exp, running max m and sum l are one register per key
//   or per lane; causal masking is a lane compare of key position against each lane's query position;
// - p.V adds key j's value row, scaled by the lane's p broadcast, into that lane's accumulator row (L1).
// A bf16 block is widened to f32 once per work item, for all its lane groups. Sums run in another order than the scalar tile's and
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
// as a compile-time count so the accumulators stay in registers. L lanes at a time share each load of v_j (L x C
// accumulators + C values: 21 registers at head_dim 64, 25 at 128), so the loop is bound by its FMAs, not by one
// 64-byte load per FMA; per lane the sum runs over j in the same order whatever L is.
template <int C, int L>
void add_pv_lanes(float* acc, const float* V, const float* p, const float* correction, int64_t lane, int64_t valid,
                  int64_t hd) {
  __mmask16 mask[C];
  __m512 av[L][C];
#pragma GCC unroll 8
  for (int k = 0; k < C; ++k) mask[k] = lane_mask(hd - 16 * k);
#pragma GCC unroll 4
  for (int i = 0; i < L; ++i) {
    const __m512 c = _mm512_set1_ps(correction[lane + i]);
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) av[i][k] = _mm512_mul_ps(c, _mm512_maskz_loadu_ps(mask[k], acc + (lane + i) * hd + 16 * k));
  }
  for (int64_t j = 0; j < valid; ++j) {
    __m512 vj[C];
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) vj[k] = _mm512_maskz_loadu_ps(mask[k], V + j * hd + 16 * k);
#pragma GCC unroll 4
    for (int i = 0; i < L; ++i) {
      const __m512 pj = _mm512_set1_ps(p[j * 16 + lane + i]);
#pragma GCC unroll 8
      for (int k = 0; k < C; ++k) av[i][k] = _mm512_fmadd_ps(pj, vj[k], av[i][k]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < L; ++i)
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) _mm512_mask_storeu_ps(acc + (lane + i) * hd + 16 * k, mask[k], av[i][k]);
}

template <int C>
void add_pv(float* acc, const float* V, const float* p, const float* correction, int64_t n, int64_t valid, int64_t hd) {
  constexpr int L = C <= 4 ? 4 : 2;
  int64_t lane = 0;
  for (; lane + L <= n; lane += L) add_pv_lanes<C, L>(acc, V, p, correction, lane, valid, hd);
  for (; lane < n; ++lane) add_pv_lanes<C, 1>(acc, V, p, correction, lane, valid, hd);
}

// e^x for x <= 0, with x below -87 taken as -87 (e^-87 ~ 1.6e-38): exp_ps(-inf) would be NaN.
inline __m512 exp_nonpositive(__m512 x) { return exp_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }

template <typename Elem>
void tile(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
          int64_t row_begin, int64_t row_end, int64_t g, int64_t group, const float* q, int64_t heads, float* out,
          float* scratch) {
  const int64_t hd = layout.head_dim, bs = layout.block_size, chunks = (hd + 15) / 16;  // bs == 16, hd <= 128
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  const int64_t vectors = (row_end - row_begin) * group;  // query vector v: row v / group, head v % group
  const int64_t lane_groups = (vectors + 15) / 16;
  float* kf = scratch;          // [bs][hd] a bf16 K tile widened
  float* vf = kf + bs * hd;     // [bs][hd]
  float* p = vf + bs * hd;      // [bs][16] the block's probabilities, key-major
  float* lane_f = p + 16 * bs;  // [16] per-lane scalars (correction, then 1 / l)
  float* groups = lane_f + 16;  // per lane group, 32 hd + 48: qt [hd][16], acc [16][hd], m, l, qpos [16]
  const auto qt_of = [&](int64_t lg) { return groups + lg * (32 * hd + 48); };
  const auto acc_of = [&](int64_t lg) { return qt_of(lg) + 16 * hd; };
  const auto state_of = [&](int64_t lg) { return qt_of(lg) + 32 * hd; };  // m [16], l [16], qpos [16] (as floats)

  // Every lane group's queries, transposed, and its state; the blocks are then walked once, each widened once
  // and used by every lane group (before: widened once per lane group, ~a quarter of the tile's time at GQA 4).
  int64_t last = 0;
  for (int64_t lg = 0; lg < lane_groups; ++lg) {
    const int64_t base = lg * 16, n = std::min<int64_t>(16, vectors - base);
    float* qt = qt_of(lg);
    float* st = state_of(lg);
    for (int64_t lane = 0; lane < 16; ++lane) {
      if (lane < n) {
        const int64_t r = (base + lane) / group, h = (base + lane) % group;
        const float* qh = q + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
        for (int64_t e = 0; e < hd; ++e) qt[e * 16 + lane] = qh[e];
        st[32 + lane] = static_cast<float>(seq.q_pos + row_begin + r);  // positions < 2^24: exact in f32
        last = std::max<int64_t>(last, seq.q_pos + row_begin + r);
      } else {  // idle lane: zero query, sees every key (its m stays finite), never written out
        for (int64_t e = 0; e < hd; ++e) qt[e * 16 + lane] = 0.0f;
        st[32 + lane] = INFINITY;
      }
      st[lane] = -INFINITY;  // m
      st[16 + lane] = 0.0f;  // l
    }
    std::fill(acc_of(lg), acc_of(lg) + n * hd, 0.0f);
  }

  const int64_t blocks = last / bs + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * bs, valid = std::min(bs, last + 1 - first);
    const float* K = widen_tile(pool + layout.tile_offset(seq.block_table[b], layer, 0, g), kf, valid * hd);
    const float* V = widen_tile(pool + layout.tile_offset(seq.block_table[b], layer, 1, g), vf, valid * hd);
    for (int64_t lg = 0; lg < lane_groups; ++lg) {
      const int64_t n = std::min<int64_t>(16, vectors - lg * 16);
      const float* qt = qt_of(lg);
      float* st = state_of(lg);
      const __m512 qpos_v = _mm512_loadu_ps(st + 32);
      // A block past the lane group's last busy lane (its latest position) is all masked: skipped, as the
      // block loop of a lane group alone would have stopped before it.
      if (static_cast<float>(first) > st[32 + n - 1]) continue;
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
        keep[j] = j < valid ? _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(first + j)), qpos_v, _CMP_LE_OQ)
                            : static_cast<__mmask16>(0);  // causal: key position <= the lane's query position
        s[j] = _mm512_mul_ps(s[j], scale);
        block_max = _mm512_mask_max_ps(block_max, keep[j], block_max, s[j]);
      }
      // Block 0 holds key 0, which every lane sees: from then on m is finite in every lane.
      const __m512 m = _mm512_loadu_ps(st), m_new = _mm512_max_ps(m, block_max);
      const __m512 correction = exp_nonpositive(_mm512_sub_ps(m, m_new));
      __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512 pj = _mm512_maskz_mov_ps(keep[j], exp_nonpositive(_mm512_sub_ps(s[j], m_new)));
        sum = _mm512_add_ps(sum, pj);
        _mm512_storeu_ps(p + j * 16, pj);
      }
      _mm512_storeu_ps(st + 16, _mm512_fmadd_ps(_mm512_loadu_ps(st + 16), correction, sum));
      _mm512_storeu_ps(st, m_new);
      _mm512_storeu_ps(lane_f, correction);
      float* acc = acc_of(lg);
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
  }
  for (int64_t lg = 0; lg < lane_groups; ++lg) {
    const int64_t base = lg * 16, n = std::min<int64_t>(16, vectors - base);
    const float* acc = acc_of(lg);
    _mm512_storeu_ps(lane_f, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(state_of(lg) + 16)));
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

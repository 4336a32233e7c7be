// paged_attention's work item on AVX2 + FMA, for CPUs without AVX-512 (Zen 1-3, Intel client cores), which
// otherwise ran the portable tile (paged_attention.cc: one query vector at a time, scalar exp). Hand-written for
// the reason paged_attention_avx512.cc is. The same vertical scheme, in 8 lanes: 8 query vectors (query rows x
// the GQA group's heads) per register.
// - Q is transposed once per item into qt [hd][8], so a key's 8 scores (one per lane) are hd FMAs of qt[e] by
//   the key's element e, broadcast: no horizontal sums. Keys go 8 at a time (8 accumulators + 2 registers: the
//   16 keys of a block at once would need 18 of AVX2's 16).
// - Online softmax per lane: the block's max, exp, running max m and sum l are registers; the causal mask is a
//   compare of the key's position against each lane's query position, applied with blends (a masked score may
//   come from a stale row of the tile and be anything, so it is never used in arithmetic).
// - p.V: each lane's accumulator row += p[j][lane] * v_j, up to 8 chunks of 8 (head_dim 64) in registers per
//   pass, j in order, so a lane's sums do not depend on which lanes share its register (--batch-invariant).
// A bf16 block is widened to f32 once per work item, for all its lane groups. exp is exp256 (~2 ulp), sums run
// in another order than the portable tile's: the two agree to rounding (tests/unit/kv_cache_test.cc).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moex/kernels/paged_attention.h"

namespace moex::kernels::x86 {

namespace {

constexpr int64_t kLanes = 8;

// The first n (0..8) lanes set, as maskload / maskstore want them.
inline __m256i lane_mask8(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))), index);
}

// e^x for x <= 0 to ~2 ulp, x below -87 taken as -87 (e^-87 ~ 1.6e-38; exp of -inf, the first block's
// correction, must not be NaN): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (error
// < 2e-7), 2^n built in the exponent field (n in -126..0: always a normal float).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln2 split in two: r exact to ~1e-10
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The f32 pool is read in place; a bf16 tile's first `count` elements are widened into dst.
const float* widen_tile(const float* src, float*, int64_t) { return src; }
const float* widen_tile(const uint16_t* src, float* dst, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof bits);
  }
  return dst;
}

// acc[lane][c0*8 ..] = acc * correction[lane] + sum_j p[j][lane] v_j[c0*8 ..] for chunks c0 .. c0+C-1 of 8 and
// lanes 0..n-1; C a compile-time count so the accumulators stay in registers (C + 2 of 16). Ragged: the last
// chunk is partial (head_dim not a multiple of 8) and is read and written masked (vmaskmovps is slow: only there).
template <int C, bool Ragged>
void add_pv_chunks(float* acc, const float* V, const float* p, const float* correction, int64_t n, int64_t valid,
                   int64_t hd, int64_t c0) {
  const __m256i tail = lane_mask8(hd - 8 * (c0 + C - 1));
  const auto load = [&](const float* src, int k) {
    return Ragged && k == C - 1 ? _mm256_maskload_ps(src, tail) : _mm256_loadu_ps(src);
  };
  for (int64_t lane = 0; lane < n; ++lane) {
    float* a = acc + lane * hd + 8 * c0;
    const __m256 c = _mm256_set1_ps(correction[lane]);
    __m256 av[C];
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) av[k] = _mm256_mul_ps(c, load(a + 8 * k, k));
    for (int64_t j = 0; j < valid; ++j) {
      const __m256 pj = _mm256_broadcast_ss(p + j * kLanes + lane);
      const float* vj = V + j * hd + 8 * c0;
#pragma GCC unroll 8
      for (int k = 0; k < C; ++k) av[k] = _mm256_fmadd_ps(pj, load(vj + 8 * k, k), av[k]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) {
      if (Ragged && k == C - 1) _mm256_maskstore_ps(a + 8 * k, tail, av[k]);
      else _mm256_storeu_ps(a + 8 * k, av[k]);
    }
  }
}

template <int C>
void add_pv_chunks(float* acc, const float* V, const float* p, const float* correction, int64_t n, int64_t valid,
                   int64_t hd, int64_t c0) {
  if (8 * (c0 + C) > hd) add_pv_chunks<C, true>(acc, V, p, correction, n, valid, hd, c0);
  else add_pv_chunks<C, false>(acc, V, p, correction, n, valid, hd, c0);
}

void add_pv(float* acc, const float* V, const float* p, const float* correction, int64_t n, int64_t valid,
            int64_t hd) {
  const int64_t chunks = (hd + 7) / 8;
  for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
    switch (std::min<int64_t>(8, chunks - c0)) {
      case 1: add_pv_chunks<1>(acc, V, p, correction, n, valid, hd, c0); break;
      case 2: add_pv_chunks<2>(acc, V, p, correction, n, valid, hd, c0); break;
      case 3: add_pv_chunks<3>(acc, V, p, correction, n, valid, hd, c0); break;
      case 4: add_pv_chunks<4>(acc, V, p, correction, n, valid, hd, c0); break;
      case 5: add_pv_chunks<5>(acc, V, p, correction, n, valid, hd, c0); break;
      case 6: add_pv_chunks<6>(acc, V, p, correction, n, valid, hd, c0); break;
      case 7: add_pv_chunks<7>(acc, V, p, correction, n, valid, hd, c0); break;
      default: add_pv_chunks<8>(acc, V, p, correction, n, valid, hd, c0); break;
    }
  }
}

template <typename Elem>
void tile(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
          int64_t row_begin, int64_t row_end, int64_t g, int64_t group, const float* q, int64_t heads, float* out,
          float* scratch) {
  const int64_t hd = layout.head_dim, bs = layout.block_size;  // bs == 16, hd <= 128
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  const int64_t vectors = (row_end - row_begin) * group;  // query vector v: row v / group, head v % group
  const int64_t lane_groups = (vectors + kLanes - 1) / kLanes;
  // Fits paged_attention_scratch_floats' x86 size: 8-lane groups take half of a 16-lane group's floats each.
  float* kf = scratch;              // [bs][hd] a bf16 K tile widened
  float* vf = kf + bs * hd;         // [bs][hd]
  float* p = vf + bs * hd;          // [bs][8] the block's scores, then probabilities, key-major
  float* lane_f = p + kLanes * bs;  // [8] per-lane scalars (correction, then 1 / l)
  float* groups = lane_f + kLanes;  // per lane group, 16 hd + 24: qt [hd][8], acc [8][hd], m, l, qpos [8]
  const auto qt_of = [&](int64_t lg) { return groups + lg * (2 * kLanes * hd + 3 * kLanes); };
  const auto acc_of = [&](int64_t lg) { return qt_of(lg) + kLanes * hd; };
  const auto state_of = [&](int64_t lg) { return qt_of(lg) + 2 * kLanes * hd; };  // m, l, qpos (as floats)

  int64_t last = 0;
  for (int64_t lg = 0; lg < lane_groups; ++lg) {
    const int64_t base = lg * kLanes, n = std::min(kLanes, vectors - base);
    float* qt = qt_of(lg);
    float* st = state_of(lg);
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      if (lane < n) {
        const int64_t r = (base + lane) / group, h = (base + lane) % group;
        const float* qh = q + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
        for (int64_t e = 0; e < hd; ++e) qt[e * kLanes + lane] = qh[e];
        st[2 * kLanes + lane] = static_cast<float>(seq.q_pos + row_begin + r);  // positions < 2^24: exact
        last = std::max<int64_t>(last, seq.q_pos + row_begin + r);
      } else {  // idle lane: zero query, sees every key (its m stays finite), never written out
        for (int64_t e = 0; e < hd; ++e) qt[e * kLanes + lane] = 0.0f;
        st[2 * kLanes + lane] = INFINITY;
      }
      st[lane] = -INFINITY;     // m
      st[kLanes + lane] = 0.0f;  // l
    }
    std::fill(acc_of(lg), acc_of(lg) + n * hd, 0.0f);
  }

  const int64_t blocks = last / bs + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * bs, valid = std::min(bs, last + 1 - first);
    const float* K = widen_tile(pool + layout.tile_offset(seq.block_table[b], layer, 0, g), kf, valid * hd);
    const float* V = widen_tile(pool + layout.tile_offset(seq.block_table[b], layer, 1, g), vf, valid * hd);
    for (int64_t lg = 0; lg < lane_groups; ++lg) {
      const int64_t n = std::min(kLanes, vectors - lg * kLanes);
      const float* qt = qt_of(lg);
      float* st = state_of(lg);
      // A block past the lane group's latest position is all masked: skipped (a no-op for every lane anyway).
      if (static_cast<float>(first) > st[2 * kLanes + n - 1]) continue;
      // Scores of keys 0..valid-1, 8 keys per pass, into p [j][lane].
      for (int64_t j0 = 0; j0 < valid; j0 += 8) {
        __m256 s[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) s[j] = _mm256_setzero_ps();
        const float* Kj = K + j0 * hd;
        if (j0 + 8 <= valid) {
          for (int64_t e = 0; e < hd; ++e) {
            const __m256 qe = _mm256_loadu_ps(qt + e * kLanes);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) s[j] = _mm256_fmadd_ps(qe, _mm256_broadcast_ss(Kj + j * hd + e), s[j]);
          }
        } else {  // the block's last keys: only rows < valid are read (a f32 tile's other rows may be unwritten)
          for (int64_t e = 0; e < hd; ++e) {
            const __m256 qe = _mm256_loadu_ps(qt + e * kLanes);
            for (int64_t j = 0; j < valid - j0; ++j) s[j] = _mm256_fmadd_ps(qe, _mm256_broadcast_ss(Kj + j * hd + e), s[j]);
          }
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(p + (j0 + j) * kLanes, _mm256_mul_ps(s[j], scale));
      }
      const __m256 qpos = _mm256_loadu_ps(st + 2 * kLanes);
      const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
      __m256 block_max = minus_inf;
      for (int64_t j = 0; j < valid; ++j) {  // causal: key position <= the lane's query position
        const __m256 keep = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(first + j)), qpos, _CMP_LE_OQ);
        block_max = _mm256_max_ps(block_max, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(p + j * kLanes), keep));
      }
      // Block 0 holds key 0, which every lane sees: from then on m is finite in every lane.
      const __m256 m = _mm256_loadu_ps(st), m_new = _mm256_max_ps(m, block_max);
      const __m256 correction = exp_nonpositive(_mm256_sub_ps(m, m_new));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < valid; ++j) {
        const __m256 keep = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(first + j)), qpos, _CMP_LE_OQ);
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j * kLanes), m_new));
        const __m256 pj = _mm256_blendv_ps(_mm256_setzero_ps(), e, keep);
        sum = _mm256_add_ps(sum, pj);
        _mm256_storeu_ps(p + j * kLanes, pj);
      }
      _mm256_storeu_ps(st + kLanes, _mm256_fmadd_ps(_mm256_loadu_ps(st + kLanes), correction, sum));
      _mm256_storeu_ps(st, m_new);
      _mm256_storeu_ps(lane_f, correction);
      add_pv(acc_of(lg), V, p, lane_f, n, valid, hd);
    }
  }
  for (int64_t lg = 0; lg < lane_groups; ++lg) {
    const int64_t base = lg * kLanes, n = std::min(kLanes, vectors - base);
    const float* acc = acc_of(lg);
    _mm256_storeu_ps(lane_f, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_loadu_ps(state_of(lg) + kLanes)));
    for (int64_t lane = 0; lane < n; ++lane) {
      const int64_t r = (base + lane) / group, h = (base + lane) % group;
      float* oh = out + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
      const __m256 inv = _mm256_set1_ps(lane_f[lane]);
      for (int64_t k = 0; k < hd; k += 8) {
        const __m256i mask = lane_mask8(hd - k);
        _mm256_maskstore_ps(oh + k, mask, _mm256_mul_ps(inv, _mm256_maskload_ps(acc + lane * hd + k, mask)));
      }
    }
  }
}

}  // namespace

void paged_attend_tile_avx2(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                            const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                            int64_t group, const float* q, int64_t heads, float* out, float* scratch) {
  tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
}
void paged_attend_tile_avx2(const PagedKvLayout& layout, const float* pool, int64_t layer,
                            const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                            int64_t group, const float* q, int64_t heads, float* out, float* scratch) {
  tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
}

}  // namespace moex::kernels::x86

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
// An item of at most kKeyLaneMaxVectors query vectors (decode: one row x the GQA group) runs key_lane_tile
// instead, lanes along keys, which gives the same bits (see there).
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "moex/kernels/paged_attention.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {

namespace {

// One 16-element chunk of a K or V row, widened to f32 in the register (lanes past the mask read as zero).
inline __m512 row_chunk(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 row_chunk(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// The f32 pool is read in place; a bf16 tile's first `count` elements are widened into dst.
const float* widen_tile(const float* src, float*, int64_t) { return src; }
const float* widen_tile(const uint16_t* src, float* dst, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = lane_mask(count - i);
    _mm512_mask_storeu_ps(dst + i, m, row_chunk(src + i, m));
  }
  return dst;
}

// The first byte of block b's K (kv 0) or V (kv 1) tile of KV head g, through the sequence's table.
template <typename Elem>
inline const char* tile_bytes(const PagedKvLayout& layout, const Elem* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t b, int kv, int64_t g) {
  return reinterpret_cast<const char*>(pool + layout.tile_offset(seq.block_table[b], layer, kv, g));
}

// Pulls block b's K and V tiles into L1 ahead of use: a sequence's blocks lie anywhere in the pool, 2 KB
// (bf16) tiles that the hardware prefetcher does not follow from one to the next.
template <typename Elem>
inline void prefetch_block(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
                           int64_t b, int64_t g) {
  const int64_t bytes = layout.tile_elems() * static_cast<int64_t>(sizeof(Elem));
  for (int kv = 0; kv < 2; ++kv) {
    const char* t = tile_bytes(layout, pool, layer, seq, b, kv, g);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(t + i, _MM_HINT_T0);
  }
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

// r[e] lane j = r[j] lane e on return (16 x 16 transpose): pairs unpack, then quads shuffle within 128-bit
// blocks (b[4i + m] block k = rows 4i..4i+3, element 4k + m), then 128-bit blocks transpose.
inline void transpose16(__m512 r[16]) {
  __m512 a[16], b[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xee);
    b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xee);
  }
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    __m512 x[4] = {b[m], b[4 + m], b[8 + m], b[12 + m]};
    transpose_blocks(x);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) r[4 * k + m] = x[k];
  }
}

// Query vectors [v0, v0 + NV) of a work item with few of them (decode: one row x the GQA group), lanes along
// the block's 16 keys instead of along query vectors: the vertical tile below fills `vectors` of its 16 lanes
// (4 at GQA 4: a quarter of its FMAs and exps useful). Blocks go NB at a time: their K tiles are transposed
// into kt [NB][hd][16] (lanes: keys), and a (vector, block)'s 16 scores are hd FMAs of the vector's broadcast
// q[e] with kt[e], the NB x NV chains interleaved (one chain alone would wait on each FMA's latency). Then
// block by block: its probabilities are one exp_ps per vector, and each V row, widened once in registers,
// goes into the NV accumulators (NV x C registers, kept over the whole walk).
// Every step is the vertical tile's operation on the same operands in the same order (the q.k FMA chain over
// e, the scale after it, exp_nonpositive, the sum of p over j = 0..15, l = l * correction + sum, acc scaled
// then p.V over j, times 1 / l), only transposed: a row's result is the same bits whichever tile runs it, so
// how a prompt is split into chunks never changes it (PagedAttentionTest.AQueryRowsResult...).
template <int C, int NV, typename Elem>
void key_lane_vectors(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
                      int64_t row_begin, int64_t v0, int64_t g, int64_t group, const float* q, int64_t heads,
                      float* out, float* scratch) {
  constexpr int NB = std::min(8, 16 / NV);  // blocks per pass: 8 to 16 score chains (4 cycles each FMA, 2 a cycle)
  const int64_t hd = layout.head_dim, bs = layout.block_size;  // bs == 16, 16 (C - 1) < hd <= 16 C
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  float* kt = scratch;               // [NB][16 C][16] the blocks' K transposed (lanes: keys)
  float* p = kt + NB * 16 * C * 16;  // [NV][16] one block's probabilities
  __mmask16 mask[C];
#pragma GCC unroll 8
  for (int k = 0; k < C; ++k) mask[k] = lane_mask(hd - 16 * k);
  const float* qv[NV];
  int64_t pos[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t r = (v0 + v) / group, h = (v0 + v) % group;
    qv[v] = q + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
    pos[v] = seq.q_pos + row_begin + r;
  }
  float m[NV], l[NV];
  __m512 acc[NV][C];
  for (int v = 0; v < NV; ++v) {
    m[v] = -INFINITY;
    l[v] = 0.0f;
    for (int k = 0; k < C; ++k) acc[v][k] = _mm512_setzero_ps();
  }
  const __m512i key_index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t blocks = pos[NV - 1] / bs + 1;  // vectors run in row order: the last reaches furthest
  const int64_t row_bytes = hd * static_cast<int64_t>(sizeof(Elem));
  for (int64_t b = 0; b < std::min<int64_t>(NB, blocks); ++b) prefetch_block(layout, pool, layer, seq, b, g);
  for (int64_t b0 = 0; b0 < blocks; b0 += NB) {
    const int64_t nb = std::min<int64_t>(NB, blocks - b0);
    // The next pass's tiles are prefetched row by row as this pass reads its own (K while transposing, V in
    // p.V): a sequence's blocks lie anywhere in the pool (2 KB tiles the hardware prefetcher does not follow
    // from one to the next), and a whole pass's prefetches at once queue behind each other.
    const auto next_tile = [&](int64_t i, int kv) -> const char* {
      return b0 + NB + i < blocks ? tile_bytes(layout, pool, layer, seq, b0 + NB + i, kv, g) : nullptr;
    };
    // All 16 rows of each K tile: rows past the written positions hold stale or unwritten data (NaN
    // possibly), confined to their own key lane and replaced by the mask below.
    for (int64_t i = 0; i < nb; ++i) {
      const Elem* K = pool + layout.tile_offset(seq.block_table[b0 + i], layer, 0, g);  // [bs][hd]
      const char* next_k = next_tile(i, 0);
#pragma GCC unroll 8
      for (int k = 0; k < C; ++k) {
        const int64_t offset = 16 * k * static_cast<int64_t>(sizeof(Elem));  // chunk k's first byte in a row
        if (next_k && offset % 64 == 0)
          for (int j = 0; j < 16; ++j) _mm_prefetch(next_k + j * row_bytes + offset, _MM_HINT_T0);
        __m512 r[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) r[j] = row_chunk(K + j * hd + 16 * k, mask[k]);
        transpose16(r);
#pragma GCC unroll 16
        for (int e = 0; e < 16; ++e) _mm512_storeu_ps(kt + ((i * C + k) * 16 + e) * 16, r[e]);
      }
    }
    // Scores of every (block, vector) of the pass; the chains of blocks past nb read stale kt and are unused.
    __m512 sc[NB][NV];
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) sc[i][v] = _mm512_setzero_ps();
    for (int64_t e = 0; e < hd; ++e) {
      __m512 qe[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) qe[v] = _mm512_set1_ps(qv[v][e]);
#pragma GCC unroll 16
      for (int i = 0; i < NB; ++i) {
        const __m512 ke = _mm512_loadu_ps(kt + (i * 16 * C + e) * 16);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) sc[i][v] = _mm512_fmadd_ps(qe[v], ke, sc[i][v]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) {
      if (i >= nb) break;
      const int64_t first = (b0 + i) * bs, valid = std::min(bs, pos[NV - 1] + 1 - first);
      int64_t keys_max = 0;
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const int64_t keys = std::min(valid, pos[v] + 1 - first);  // causal
        if (keys <= 0) {  // this vector's walk ended in an earlier block: nothing to add
          _mm512_storeu_ps(p + 16 * v, _mm512_setzero_ps());
          continue;
        }
        keys_max = std::max(keys_max, keys);
        const __m512 s = _mm512_mul_ps(sc[i][v], scale);
        const __mmask16 keep = _mm512_cmplt_epi32_mask(key_index, _mm512_set1_epi32(static_cast<int32_t>(keys)));
        const float m_new = std::max(m[v], _mm512_mask_reduce_max_ps(keep, s));
        const __m512 pv = _mm512_maskz_mov_ps(keep, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        const __m512 cv = exp_nonpositive(_mm512_set1_ps(m[v] - m_new));
        _mm512_storeu_ps(p + 16 * v, pv);
        float sum = 0.0f;
        for (int j = 0; j < 16; ++j) sum += p[16 * v + j];
        m[v] = m_new;
        l[v] = std::fma(l[v], _mm512_cvtss_f32(cv), sum);
#pragma GCC unroll 8
        for (int k = 0; k < C; ++k) acc[v][k] = _mm512_mul_ps(cv, acc[v][k]);
      }
      // Rows below keys_max are written positions; a vector's p is zero past its own keys.
      const Elem* V = pool + layout.tile_offset(seq.block_table[b0 + i], layer, 1, g);
      if (const char* next_v = next_tile(i, 1))
        for (int64_t o = 0; o < 16 * row_bytes; o += 64) _mm_prefetch(next_v + o, _MM_HINT_T0);
      for (int64_t j = 0; j < keys_max; ++j) {
        __m512 vc[C];
#pragma GCC unroll 8
        for (int k = 0; k < C; ++k) vc[k] = row_chunk(V + j * hd + 16 * k, mask[k]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          const __m512 pj = _mm512_set1_ps(p[16 * v + j]);
#pragma GCC unroll 8
          for (int k = 0; k < C; ++k) acc[v][k] = _mm512_fmadd_ps(pj, vc[k], acc[v][k]);
        }
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t r = (v0 + v) / group, h = (v0 + v) % group;
    float* oh = out + ((seq.q_row + row_begin + r) * heads + g * group + h) * hd;
    const __m512 inv = _mm512_set1_ps(1.0f / l[v]);
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) _mm512_mask_storeu_ps(oh + 16 * k, mask[k], _mm512_mul_ps(inv, acc[v][k]));
  }
}

// Every vector of the item: up to 4 in one pass (acc: NV x C registers, so NV = 4 needs C <= 4, and 2 for
// head_dim up to 128), the rest in passes of fewer.
template <int C, typename Elem>
void key_lane_tile(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
                   int64_t row_begin, int64_t row_end, int64_t g, int64_t group, const float* q, int64_t heads,
                   float* out, float* scratch) {
  constexpr int kMaxNV = C <= 4 ? 4 : 2;
  const int64_t vectors = (row_end - row_begin) * group;
  for (int64_t v0 = 0; v0 < vectors;) {
    const int64_t n = std::min<int64_t>(kMaxNV, vectors - v0);
    const auto run = [&]<int NV>() {
      key_lane_vectors<C, NV>(layout, pool, layer, seq, row_begin, v0, g, group, q, heads, out, scratch);
    };
    if (n >= 4) {
      if constexpr (kMaxNV >= 4) run.template operator()<4>();
    } else if (n == 3) {
      if constexpr (kMaxNV >= 3) run.template operator()<3>();
    } else if (n == 2) {
      run.template operator()<2>();
    } else {
      run.template operator()<1>();
    }
    v0 += n;
  }
}

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

// Query vectors per item up to which key_lane_tile runs (in passes of up to 4). At 4 (decode at GQA 4) it
// takes 0.55-0.8x the vertical tile's time (`moex bench kernels --kernels attention_decode`, docs/kernels.md);
// 5..8 (two passes) was not measured against it; from 9 on the vertical tile fills enough of its lanes.
constexpr int64_t kKeyLaneMaxVectors = 8;

template <typename Elem>
void attend(const PagedKvLayout& layout, const Elem* pool, int64_t layer, const PagedAttentionSeq& seq,
            int64_t row_begin, int64_t row_end, int64_t g, int64_t group, const float* q, int64_t heads, float* out,
            float* scratch) {
  if ((row_end - row_begin) * group > kKeyLaneMaxVectors) {
    tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
    return;
  }
  switch ((layout.head_dim + 15) / 16) {
#define MOEX_KEY_LANE(C) \
  case C: key_lane_tile<C>(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch); break;
    MOEX_KEY_LANE(1) MOEX_KEY_LANE(2) MOEX_KEY_LANE(3) MOEX_KEY_LANE(4)
    MOEX_KEY_LANE(5) MOEX_KEY_LANE(6) MOEX_KEY_LANE(7) MOEX_KEY_LANE(8)
#undef MOEX_KEY_LANE
    default: tile(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch); break;
  }
}

}  // namespace

void paged_attend_tile_avx512(const PagedKvLayout& layout, const uint16_t* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                              int64_t group, const float* q, int64_t heads, float* out, float* scratch) {
  attend(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
}
void paged_attend_tile_avx512(const PagedKvLayout& layout, const float* pool, int64_t layer,
                              const PagedAttentionSeq& seq, int64_t row_begin, int64_t row_end, int64_t g,
                              int64_t group, const float* q, int64_t heads, float* out, float* scratch) {
  attend(layout, pool, layer, seq, row_begin, row_end, g, group, q, heads, out, scratch);
}

}  // namespace moex::kernels::x86

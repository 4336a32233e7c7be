// bf16 x bf16 -> f32 with vdpbf16ps over the VNNI-pair panels of kernels/packed.h, and int4 x bf16 the same way.
// One register tile: MT tokens x one 64-row panel = MT x 4 accumulators. Per k pair it loads the panel's
// four weight vectors (256 contiguous bytes) and broadcasts each token's pair of activations, so each weight
// load feeds MT dot products and each broadcast feeds 4. MT = 6 (24 accumulators) for prefill; decode's 1..5
// tokens run the same tile with MT = tokens, which streams each panel exactly once.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenTile = 6;
constexpr int64_t kKBlock = 2048;  // k per pass: a panel's slice (256 KB) stays in L2 while the token tiles pass

inline __m512bh load_pairs(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_load_si512(p)); }

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

// c [MT][64] (+)= x [MT][ldx] (bf16, k pairs from here) . w panel [pairs][64][2]
template <int MT>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* c, bool load_c, const void* w_end) {
  __m512 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = load_c ? _mm512_loadu_ps(c + t * kPanel + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * 2 * kPanel;
    prefetch_ahead(wp, w_end, 4);
    const __m512bh w0 = load_pairs(wp), w1 = load_pairs(wp + 32), w2 = load_pairs(wp + 64), w3 = load_pairs(wp + 96);
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = broadcast_pair(x + t * ldx + 2 * p);
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], xv, w0);
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], xv, w1);
      acc[t][2] = _mm512_dpbf16_ps(acc[t][2], xv, w2);
      acc[t][3] = _mm512_dpbf16_ps(acc[t][3], xv, w3);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + t * kPanel + 16 * v, acc[t][v]);
}

// int4 through vdpbf16ps: bf16 bits 0x4180 | q << 3 are exactly 16 + q, so two shifts and a masked OR turn a
// lane's byte (q(k), q(k+1)) into the bf16 pair (16 + q(k), 16 + q(k+1)). Per K group the dot products
// with 16 + q accumulate apart and fold in at the group's end:
//   sum x (q - zero) scale = scale * part + (offset - 16 scale) * sum x,   offset = -zero * scale.
// (16 rather than the one-shift 128 + q: the 16 * sum x that cancels costs 3 fewer bits of the f32 sums.)
// One k pair of an int4 panel row [64] as four bf16-pair vectors of 16 + q.
inline void int4_pairs(const uint8_t* row, __m512bh wv[4]) {
  const __m512i nibbles = _mm512_set1_epi32(0x00780078), bias = _mm512_set1_epi32(0x41804180);
  for (int v = 0; v < 4; ++v) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
    // (b << 3 | b << 15) & 0x00780078 | 0x41804180: q(k) in the low bf16's top mantissa bits, q(k+1) in the
    // high one's (0xea: A & B | C).
    wv[v] = reinterpret_cast<__m512bh>(
        _mm512_ternarylogic_epi32(_mm512_or_si512(_mm512_slli_epi32(b, 3), _mm512_slli_epi32(b, 15)), nibbles, bias, 0xea));
  }
}

// c [MT][64] (+)= x [MT][ldx] (bf16, k0..k1) . int4 panel [k/2][64]; k0, k1 on group boundaries (or k1 = end)
template <int MT>
void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, const float* scales, const float* offsets,
               const float* sums, int64_t ld_sums, int64_t group, int64_t k0, int64_t k1, float* c, bool load_c,
               const void* w_end) {
  __m512 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const int64_t g1 = std::min(k1, g0 + group), g = g0 / group;
    __m512 part[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) part[t][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g1; k += 2) {
      __m512bh wv[4];
      prefetch_ahead(w + (k / 2) * kPanel, w_end, 1);
      int4_pairs(w + (k / 2) * kPanel, wv);
      for (int t = 0; t < MT; ++t) {
        const __m512bh xv = broadcast_pair(x + t * ldx + k);
        for (int v = 0; v < 4; ++v) part[t][v] = _mm512_dpbf16_ps(part[t][v], xv, wv[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      const __m512 scale = _mm512_loadu_ps(scales + g * kPanel + 16 * v);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(16.0f), scale, _mm512_loadu_ps(offsets + g * kPanel + 16 * v));
      for (int t = 0; t < MT; ++t)
        acc[t][v] = _mm512_fmadd_ps(part[t][v], scale, _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[t * ld_sums + g]), acc[t][v]));
    }
  }
  for (int t = 0; t < MT; ++t) {
    for (int v = 0; v < 4; ++v) {
      float* out = c + t * kPanel + 16 * v;
      _mm512_storeu_ps(out, load_c ? _mm512_add_ps(acc[t][v], _mm512_loadu_ps(out)) : acc[t][v]);
    }
  }
}

// Prefill: c [MT][64] += x [MT][ldx] (bf16, k0..k1) . w, the K block k0.. decoded by int4_pairs
// (bf16 [(k1-k0)/2][64][2]). Only the per-group sums live in registers (MT = 6: 24 of them); each group
// folds into c, which stays in L1, so the tile is as wide as the bf16 kernel's.
template <int MT>
void int4_decoded_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, const float* scales, const float* offsets,
                       const float* sums, int64_t ld_sums, int64_t group, int64_t k0, int64_t k1, float* c) {
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const int64_t g1 = std::min(k1, g0 + group), g = g0 / group;
    __m512 part[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) part[t][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g1; k += 2) {
      const uint16_t* wp = w + (k - k0) * kPanel;
      const __m512bh w0 = load_pairs(wp), w1 = load_pairs(wp + 32), w2 = load_pairs(wp + 64), w3 = load_pairs(wp + 96);
      for (int t = 0; t < MT; ++t) {
        const __m512bh xv = broadcast_pair(x + t * ldx + k);
        part[t][0] = _mm512_dpbf16_ps(part[t][0], xv, w0);
        part[t][1] = _mm512_dpbf16_ps(part[t][1], xv, w1);
        part[t][2] = _mm512_dpbf16_ps(part[t][2], xv, w2);
        part[t][3] = _mm512_dpbf16_ps(part[t][3], xv, w3);
      }
    }
    for (int v = 0; v < 4; ++v) {
      const __m512 scale = _mm512_loadu_ps(scales + g * kPanel + 16 * v);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(16.0f), scale, _mm512_loadu_ps(offsets + g * kPanel + 16 * v));
      for (int t = 0; t < MT; ++t) {
        float* out = c + t * kPanel + 16 * v;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(part[t][v], scale,
                                              _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[t * ld_sums + g]), _mm512_loadu_ps(out))));
      }
    }
  }
}

}  // namespace

void run_panels_int4_avx512bf16(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  constexpr int kInt4TokenTile = 3;  // 2 x 12 accumulators (running and per-group) of the 32 registers
  // Many rows (job.many_rows: kernels::expert_kernel_for_rows decides): a K block is decoded once into bf16
  // (256 KB, L2) and 6-token tiles load it: the decoding, not the dot products, bounds the tiles otherwise.
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint16_t*>(job.activations);  // [T][k_padded] bf16
  const int64_t tokens = job.tokens, kp = w.k_padded, groups = (w.cols + w.group - 1) / w.group;
  const bool prefill = job.many_rows;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  if (w.cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no K block runs to write c
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint16_t, Free> decoded;  // [kKBlock/2][64][2] bf16, 64-byte aligned
  if (prefill && !decoded) decoded.reset(static_cast<uint16_t*>(std::aligned_alloc(64, kKBlock * kPanel * 2)));
  const uint8_t* w_end = w.data.as<const uint8_t>() + panel_end * (kp / 2) * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* w_panel = w.data.as<const uint8_t>() + panel * (kp / 2) * kPanel;  // [kp/2][64]
    const float* scales = w.scales.as<const float>() + panel * groups * kPanel;    // [G][64]
    const float* offsets = w.offsets.as<const float>() + panel * groups * kPanel;  // [G][64]
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {  // kKBlock is a multiple of every group size
      const int64_t k1 = std::min(kp, k0 + kKBlock);
      const bool load_c = k0 > 0;
      if (prefill) {
        for (int64_t k = k0; k < k1; k += 2) {
          __m512bh wv[4];
          prefetch_ahead(w_panel + (k / 2) * kPanel, w_end, 1);
          int4_pairs(w_panel + (k / 2) * kPanel, wv);
          for (int v = 0; v < 4; ++v)
            _mm512_store_si512(decoded.get() + (k - k0) * kPanel + 32 * v, reinterpret_cast<__m512i>(wv[v]));
        }
      }
      if (prefill) {
        if (k0 == 0) std::fill_n(c.begin(), tokens * kPanel, 0.0f);
        const auto run = [&]<int MT>(int64_t t) {
          int4_decoded_tile<MT>(x + t * kp, kp, decoded.get(), scales, offsets, job.group_sums + t * groups, groups,
                                w.group, k0, k1, c.data() + t * kPanel);
        };
        int64_t t = 0;
        for (; t + kTokenTile <= tokens; t += kTokenTile) run.template operator()<kTokenTile>(t);
        switch (tokens - t) {
          case 5: run.template operator()<5>(t); break;
          case 4: run.template operator()<4>(t); break;
          case 3: run.template operator()<3>(t); break;
          case 2: run.template operator()<2>(t); break;
          case 1: run.template operator()<1>(t); break;
          default: break;
        }
        continue;
      }
      const auto run = [&]<int MT>(int64_t t) {
        int4_tile<MT>(x + t * kp, kp, w_panel, scales, offsets, job.group_sums + t * groups, groups, w.group, k0, k1,
                      c.data() + t * kPanel, load_c, w_end);
      };
      int64_t t = 0;
      for (; t + kInt4TokenTile <= tokens; t += kInt4TokenTile) run.template operator()<kInt4TokenTile>(t);
      switch (tokens - t) {
        case 2: run.template operator()<2>(t); break;
        case 1: run.template operator()<1>(t); break;
        default: break;
      }
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

void run_panels_bf16_avx512bf16(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint16_t*>(job.activations);  // [T][k_padded] bf16
  const int64_t tokens = job.tokens, kp = w.k_padded;
  thread_local std::vector<float> c;  // [T][64]: one panel's sums across K blocks
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  if (w.cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no K block runs to write c
  const uint16_t* w_end = w.data.as<const uint16_t>() + panel_end * kp * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint16_t* w_panel = w.data.as<const uint16_t>() + panel * kp * kPanel;  // [kp/2][64][2]
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
      const int64_t pairs = (std::min(kp, k0 + kKBlock) - k0) / 2;
      const uint16_t* wk = w_panel + k0 * kPanel;
      const bool load_c = k0 > 0;
      int64_t t = 0;
      for (; t + kTokenTile <= tokens; t += kTokenTile)
        tile<kTokenTile>(x + t * kp + k0, kp, wk, pairs, c.data() + t * kPanel, load_c, w_end);
      const uint16_t* xt = x + t * kp + k0;
      float* ct = c.data() + t * kPanel;
      switch (tokens - t) {
        case 5: tile<5>(xt, kp, wk, pairs, ct, load_c, w_end); break;
        case 4: tile<4>(xt, kp, wk, pairs, ct, load_c, w_end); break;
        case 3: tile<3>(xt, kp, wk, pairs, ct, load_c, w_end); break;
        case 2: tile<2>(xt, kp, wk, pairs, ct, load_c, w_end); break;
        case 1: tile<1>(xt, kp, wk, pairs, ct, load_c, w_end); break;
        default: break;
      }
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

void round_row_bf16_avx512bf16(const float* x, int64_t k, int64_t k_padded, uint16_t* out) {
  for (int64_t i = 0; i < k_padded; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(lane_mask(k - i), x + i);
    const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_mask_storeu_epi16(out + i, lane_mask(k_padded - i), b);
  }
}

void split_row_bf16_avx512bf16(const float* x, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = lane_mask(k - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
    const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest)));
    _mm512_mask_storeu_epi32(out + 2 * i, m, _mm512_or_si512(hi, _mm512_slli_epi32(lo, 16)));
  }
}

}  // namespace moex::kernels::x86

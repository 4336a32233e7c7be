// int4 (weight-only) x bf16 activations through vdpbf16ps over int4's panels (kernels/packed.h: [kp/2][64] bytes,
// q(k) low nibble, q(k+1) high), both row loops. One register tile: MT tokens x one 64-lane panel; per k pair the
// codes are decoded once to bf16 pairs (int4_pairs) and feed MT x 4 dot products. Few rows (decode): the tile
// decodes as it streams the panel, MT up to 6, so up to 6 rows read and decode each panel once. Many rows
// (prefill on CPUs without AMX): a K block is decoded once into L2 and the 6-row tiles read it. Both run a row's
// K groups with the same operations in the same order and fold each into c, so a row gets the same bits from
// either (PackedMatmulTest.Int4Vdpbf16psLoopsGiveARowTheSameBits), and on CPUs without AMX int4 needs no
// --batch-invariant pin (row_result_depends_on_row_count); on AMX CPUs its many rows go to tiles or f32 FMAs.
// VBMI for the decode's vpmultishiftqb: the caller has checked has_avx512_bf16_vbmi_kernels().
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

constexpr int kTokenTile = 6;      // 24 group sums + 4 pair vectors + the decode's 3 constants of 32 registers
constexpr int64_t kKBlock = 2048;  // many rows: a panel's K block decoded to bf16 (256 KB, L2); a multiple of every group

// int4 through vdpbf16ps: bf16 bits 0x4180 | q << 3 are exactly 16 + q, so a lane's byte (q(k), q(k+1)) becomes
// the bf16 pair (16 + q(k), 16 + q(k+1)) by placing each nibble at bit 3 of its bf16 and a masked OR. Per K group
// the dot products with 16 + q accumulate apart and fold in at the group's end:
//   sum x (q - zero) scale = scale * part + (offset - 16 scale) * sum x,   offset = -zero * scale.
// (16 rather than the one-shift 128 + q: the 16 * sum x that cancels costs 3 fewer bits of the f32 sums.)
// One k pair of an int4 panel row [64] as four bf16-pair vectors of 16 + q. Each lane's byte b, widened to its
// 32-bit word, is placed by one vpmultishiftqb (VBMI: any 8 bits of a qword into each byte): bytes 0 and 2 of the
// word take the 8 bits from b's bit -3 and bit 1 on, so b's low nibble lands on bits 3-6 of the low bf16 and its
// high nibble on bits 3-6 of the high one; the mask and the bias 0x4180 follow in one vpternlogd. Two shifts and
// an OR did the placing before: 3-9% slower calls at 1-4 rows (bench kernels, int4-g128, AMX Xeon).
inline void int4_pairs(const uint8_t* row, __m512bh wv[4]) {
  // Control per qword (two lanes: bits 0-7 and 32-39): byte 0 <- bit 61 (b << 3 of the first lane, the bits
  // wrapped in are the zeros above the second lane's byte), byte 2 <- bit 1 (b >> 1), bytes 4, 6 <- bits 29, 33.
  const __m512i place = _mm512_set1_epi64(0x0021001d0001003dLL);
  const __m512i nibbles = _mm512_set1_epi32(0x00780078), bias = _mm512_set1_epi32(0x41804180);
  for (int v = 0; v < 4; ++v) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
    wv[v] = reinterpret_cast<__m512bh>(  // placed & 0x00780078 | 0x41804180 (0xea: A & B | C)
        _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(place, b), nibbles, bias, 0xea));
  }
}

// c [MT][64] += x [MT][ldx] (bf16, k0..k1) . the int4 panel's k0..k1, group by group: a group's dot products with
// 16 + q sum in registers (MT x 4 of them) and fold into c (which stays in L1). kDecoded: w is the K block k0..
// decoded by int4_pairs (bf16 [(k1-k0)/2][64][2], prefill); else the panel's codes [kp/2][64], decoded here once
// per k pair for all MT rows (decode). Both run the same operations in the same order, so a row's sums do not
// depend on which loop ran it nor on its tile's other rows. With `store` (codes only), the decoded pairs also go to
// store [(k1-k0)/2][64][2]: the many-row loop's first tile decodes its K block this way, so the decode overlaps that
// tile's dot products instead of running in a pass of its own.
template <int MT, bool kDecoded>
void int4_tile(const uint16_t* x, int64_t ldx, const void* w, const float* scales, const float* offsets,
               const float* sums, int64_t ld_sums, int64_t group, int64_t k0, int64_t k1, float* c, const void* w_end,
               uint16_t* store = nullptr) {
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const int64_t g1 = std::min(k1, g0 + group), g = g0 / group;
    __m512 part[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) part[t][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g1; k += 2) {
      __m512bh wv[4];
      if constexpr (kDecoded) {
        const uint16_t* wp = static_cast<const uint16_t*>(w) + (k - k0) * kPanel;
        for (int v = 0; v < 4; ++v) wv[v] = load_pairs(wp + 32 * v);
      } else {
        const uint8_t* row = static_cast<const uint8_t*>(w) + (k / 2) * kPanel;
        prefetch_ahead(row, w_end, 1);
        int4_pairs(row, wv);
        if (store)
          for (int v = 0; v < 4; ++v) _mm512_store_si512(store + (k - k0) * kPanel + 32 * v, reinterpret_cast<__m512i>(wv[v]));
      }
      for (int t = 0; t < MT; ++t) {
        const __m512bh xv = broadcast_pair(x + t * ldx + k);
        for (int v = 0; v < 4; ++v) part[t][v] = _mm512_dpbf16_ps(part[t][v], xv, wv[v]);
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

void run_panels_int4_avx512bf16vbmi(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  // Many rows (job.many_rows: the weight's KernelChoice decides): a K block is decoded once into bf16
  // (256 KB, L2) and the token tiles load it. Few rows: one pass per 6 rows decodes each k pair once for them.
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint16_t*>(job.activations);  // [T][k_padded] bf16
  const int64_t tokens = job.tokens, kp = w.k_padded, groups = (w.cols + w.group - 1) / w.group;
  const bool prefill = job.many_rows;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
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
    std::fill_n(c.begin(), tokens * kPanel, 0.0f);
    // Prefill: K blocks (kKBlock, a multiple of every group size), each decoded once; decode: the whole K.
    for (int64_t k0 = 0; k0 < kp; k0 += prefill ? kKBlock : kp) {
      const int64_t k1 = prefill ? std::min(kp, k0 + kKBlock) : kp;
      // Prefill: the first tile (up to 6 rows) decodes the block from the codes and stores it for the others.
      const int64_t first = prefill ? std::min<int64_t>(tokens, kTokenTile) : 0;
      const auto run = [&]<int MT>(int64_t t) {
        t += first;
        const float* sums = job.group_sums + t * groups;
        if (prefill)
          int4_tile<MT, true>(x + t * kp, kp, decoded.get(), scales, offsets, sums, groups, w.group, k0, k1,
                              c.data() + t * kPanel, w_end);
        else
          int4_tile<MT, false>(x + t * kp, kp, w_panel, scales, offsets, sums, groups, w.group, k0, k1,
                               c.data() + t * kPanel, w_end);
      };
      over_tokens<kTokenTile>(first, [&]<int MT>(int64_t) {  // one tile: first <= kTokenTile
        int4_tile<MT, false>(x, kp, w_panel, scales, offsets, job.group_sums, groups, w.group, k0, k1, c.data(), w_end,
                             decoded.get());
      });
      over_tokens<kTokenTile>(tokens - first, run);
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

}  // namespace moex::kernels::x86

// W4A8: int4 codes x activations quantized to s8 per token and K group, vpdpbusd (u8 x s8, four products per
// 32-bit lane).
// Why not the bf16 route of packed_bf16_avx512bf16.cc: there each weight byte (two codes) costs a widening
// load, two shifts, an OR and a vdpbf16ps per 16 lanes, ~24 instructions per 64 bytes, so batch-1 decode of
// int4 ran at about half the read roofline. Here a lane's 32 bits hold 8 k (packed.h), so one 64-byte load is
// 16 lanes x 8 k: a mask gives the k quad 8j.. as bytes 0..15, a shift and a mask the quad 8j+4.., and two
// vpdpbusd against the token's two broadcast activation quads do the products: ~5 instructions per 64 bytes (a lone
// row: `row`, below).
//
// Per K group the integer sums are exact and fold in at the group's end, per token and lane:
//   sum_k x w = sum_g xs_g * (scale_g * dot_g(q, xq) + offset_g * sum_g(xq)),   offset = -zero * scale,
// where xq are the token's codes and xs_g the scale of its group g (absmax / 127 of those K: a scale per
// group rather than per token keeps one large activation from coarsening the codes of the whole row, as
// llama.cpp's 8-bit activation blocks do). The fold runs in the same order for every row count and
// token tile, so a row's result does not depend on the other rows of its call: one tile loop for decode and
// prefill (a panel, at most ~0.5 MB for Mixtral's K, stays in L2 while the token tiles pass over it); one-row calls
// take `row`, the same sums and fold with fewer instructions. A many-row loop
// that decodes a K block once into u8 quads and runs 6-token tiles over them (as W8A8's) was measured slower:
// 44-72% of the vpdpbusd peak at 16-512 rows against this loop's 57-80% (docs/kernels.md).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenTile = 4;  // 16 integer sums in registers, beside the 8 decoded weight vectors

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof quad);
  return _mm512_set1_epi32(quad);
}

// c [MT][64] += the dot products of x [MT][ldx] (s8 codes) with one panel [kp/8][64][4], group by group.
// c [MT][64] += group g's integer sums, folded: xs_g * (scale_g * part + offset_g * sum_g(xq)).
// code_sums, act_scales [MT][ld_sums]: per token and group, the sum of its codes and their scale.
template <int MT>
void fold(const __v16si (&part)[MT][4], const float* scales, const float* offsets, const float* code_sums,
          const float* act_scales, int64_t ld_sums, int64_t g, float* c) {
  for (int v = 0; v < 4; ++v) {
    const __m512 scale = _mm512_loadu_ps(scales + g * kPanel + 16 * v);
    const __m512 offset = _mm512_loadu_ps(offsets + g * kPanel + 16 * v);
    for (int t = 0; t < MT; ++t) {
      float* out = c + t * kPanel + 16 * v;
      const __m512 group_sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(__m512i(part[t][v])), scale,
                                               _mm512_mul_ps(offset, _mm512_set1_ps(code_sums[t * ld_sums + g])));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(group_sum, _mm512_set1_ps(act_scales[t * ld_sums + g]), _mm512_loadu_ps(out)));
    }
  }
}

// The few-row loop: c [MT][64] += x [MT][ldx] . the panel's nibbles [kp/8][64][4], decoded in registers.
// Prefetch: the panel's first token tile streams it (`stream`: prefetch_ahead, but for one-row calls on AMD: see
// run_panels_int4_w4a8_avx512vnni); the later tiles read it from L2 and spread the next panel's lines over their
// k steps (`next`, one next() per 8 k).
template <int MT>
void tile(const int8_t* x, int64_t ldx, const uint8_t* w, const float* scales, const float* offsets,
          const float* code_sums, const float* act_scales, int64_t ld_sums, int64_t group, int64_t kp, float* c,
          const void* w_end, bool stream, SpreadPrefetch next) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g0 = 0, g = 0; g0 < kp; g0 += group, ++g) {
    const int64_t g1 = std::min(kp, g0 + group);
    // __v16si: see packed_w8a8_avx512vnni.cc (an __m512i array makes GCC 12 spill the sums every iteration).
    __v16si part[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) part[t][v] = __v16si{};
    for (int64_t k = g0; k < g1; k += 8) {
      const uint8_t* wk = w + (k / 8) * 4 * kPanel;
      if (stream) prefetch_ahead(wk, w_end, 4);
      else next.next();
      __m512i lo[4], hi[4];
      for (int v = 0; v < 4; ++v) {
        const __m512i b = _mm512_load_si512(wk + 64 * v);
        lo[v] = _mm512_and_si512(b, low);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i x0 = broadcast_quad(x + t * ldx + k), x1 = broadcast_quad(x + t * ldx + k + 4);
        for (int v = 0; v < 4; ++v)
          part[t][v] = __v16si(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(__m512i(part[t][v]), lo[v], x0), hi[v], x1));
      }
    }
    fold<MT>(part, scales, offsets, code_sums, act_scales, ld_sums, g, c);
  }
}

// A lone row: tile<1>'s products and fold with fewer instructions, so the out-of-order window holds more of the
// weight stream (batch-1 decode is a read of the experts' bytes). Per 64 weight bytes one load, two ANDs and two
// vpdpbusd: the quad 8j+4.. is taken as b & 0xf0, 16 times the codes, into sums of its own (hi), which an arithmetic
// shift by 4 divides back exactly at the group's end (a sum of multiples of 16, at most 16 k steps of 4 x 240 x 127
// a lane: far from 2^31), where tile<1> shifts every byte before its mask; eight independent sums rather than four
// chains of two. The sums are exact integers, so part = lo + hi / 16 is tile<1>'s, and the fold below is fold<1>'s
// operations in its order: a row's bits do not depend on its call's row count (ManyRowGemmGivesTheFewRowLoopsBits).
template <bool kPrefetch>
void row(const int8_t* x, const uint8_t* w, const float* scales, const float* offsets, const float* code_sums,
         const float* act_scales, int64_t group, int64_t kp, float* c, const void* w_end) {
  const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(static_cast<char>(0xf0));
  __m512 out[4];
  for (int v = 0; v < 4; ++v) out[v] = _mm512_loadu_ps(c + 16 * v);
  for (int64_t g0 = 0, g = 0; g0 < kp; g0 += group, ++g) {
    const int64_t steps = (std::min(kp, g0 + group) - g0) / 8;
    __v16si lo[4], hi[4];  // __v16si: see tile
    for (int v = 0; v < 4; ++v) lo[v] = hi[v] = __v16si{};
    const uint8_t* p = w + g0 * 32;  // [kp/8][64][4]: 256 bytes per 8 k
    const int8_t* xk = x + g0;
    for (int64_t s = 0; s < steps; ++s, p += 4 * kPanel, xk += 8) {
      if constexpr (kPrefetch) prefetch_ahead(p, w_end, 4);
      const __m512i x0 = broadcast_quad(xk), x1 = broadcast_quad(xk + 4);
      for (int v = 0; v < 4; ++v) {
        const __m512i b = _mm512_load_si512(p + 64 * v);
        lo[v] = __v16si(_mm512_dpbusd_epi32(__m512i(lo[v]), _mm512_and_si512(b, low), x0));
        hi[v] = __v16si(_mm512_dpbusd_epi32(__m512i(hi[v]), _mm512_and_si512(b, high), x1));
      }
    }
    const __m512 code_sum = _mm512_set1_ps(code_sums[g]), act_scale = _mm512_set1_ps(act_scales[g]);
    for (int v = 0; v < 4; ++v) {
      const __m512i part = _mm512_add_epi32(__m512i(lo[v]), _mm512_srai_epi32(__m512i(hi[v]), 4));
      const __m512 group_sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), _mm512_loadu_ps(scales + g * kPanel + 16 * v),
                                               _mm512_mul_ps(_mm512_loadu_ps(offsets + g * kPanel + 16 * v), code_sum));
      out[v] = _mm512_fmadd_ps(group_sum, act_scale, out[v]);
    }
  }
  for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + 16 * v, out[v]);
}

}  // namespace

void run_panels_int4_w4a8_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const int8_t*>(job.activations);  // [T][k_padded] s8 codes, zero tail
  const int64_t tokens = job.tokens, kp = w.k_padded, groups = (w.cols + w.group - 1) / w.group;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  const uint8_t* w_end = w.data.as<const uint8_t>() + panel_end * (kp / 2) * kPanel;  // this call's panels end
  // One row streams on the hardware prefetchers alone where the bf16 / W8A8 loops do (g_stream_prefetch false: AMD,
  // or MOEX_STREAM_PREFETCH=off): there the software lead only competes with them for the loads of the codes. From
  // two rows the prefetch stays: the tiles' arithmetic leaves the stream without it (docs/kernels.md, "Prefetch
  // distance", has both A/Bs).
  const bool stream_prefetch = g_stream_prefetch || tokens > 1;
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* w_panel = w.data.as<const uint8_t>() + panel * (kp / 2) * kPanel;  // [kp/8][64][4]
    const float* scales = w.scales.as<const float>() + panel * groups * kPanel;    // [G][64]
    const float* offsets = w.offsets.as<const float>() + panel * groups * kPanel;  // [G][64]
    std::fill_n(c.begin(), tokens * kPanel, 0.0f);
    // The next panel's lines (this call's), shared out over the token tiles after the first.
    const int64_t panel_bytes = (kp / 2) * kPanel, tiles = (tokens + kTokenTile - 1) / kTokenTile;
    const auto* next_panel = reinterpret_cast<const char*>(w_panel + panel_bytes);
    const int64_t next_lines = panel + 1 < panel_end ? panel_bytes / 64 : 0;
    const auto run = [&]<int MT>(int64_t t) {
      const int64_t i = t / kTokenTile, first_line = i == 0 ? 0 : next_lines * (i - 1) / (tiles - 1),
                    end_line = i == 0 ? 0 : next_lines * i / (tiles - 1);
      tile<MT>(x + t * kp, kp, w_panel, scales, offsets, job.group_sums + t * groups, job.token_scales + t * groups,
               groups, w.group, kp, c.data() + t * kPanel, w_end, i == 0 && stream_prefetch,
               SpreadPrefetch{next_panel + first_line * 64, end_line - first_line, kp / 8});
    };
    if (tokens == 1 && stream_prefetch)
      row<true>(x, w_panel, scales, offsets, job.group_sums, job.token_scales, w.group, kp, c.data(), w_end);
    else if (tokens == 1)
      row<false>(x, w_panel, scales, offsets, job.group_sums, job.token_scales, w.group, kp, c.data(), w_end);
    else
      over_tokens<kTokenTile>(tokens, run);
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

}  // namespace moex::kernels::x86

// bf16 x bf16 -> f32 with vdpbf16ps over the VNNI-pair panels of kernels/packed.h (int4 x bf16: packed_int4_avx512bf16vbmi.cc).
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

// c [MT][64] (+)= x [MT][ldx] (bf16, k pairs from here) . w panel [pairs][64][2]
template <int MT, bool kPrefetch>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* c, bool load_c, const void* w_end,
          int64_t lead) {
  __m512 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = load_c ? _mm512_loadu_ps(c + t * kPanel + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * 2 * kPanel;
    if constexpr (kPrefetch) prefetch_ahead(wp, w_end, 4, lead);
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

}  // namespace

namespace {
template <bool kPrefetch>
void run_panels(const PanelJob& job, int64_t panel_begin, int64_t panel_end, int64_t lead) {
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
        tile<kTokenTile, kPrefetch>(x + t * kp + k0, kp, wk, pairs, c.data() + t * kPanel, load_c, w_end, lead);
      const uint16_t* xt = x + t * kp + k0;
      float* ct = c.data() + t * kPanel;
      switch (tokens - t) {
        case 5: tile<5, kPrefetch>(xt, kp, wk, pairs, ct, load_c, w_end, lead); break;
        case 4: tile<4, kPrefetch>(xt, kp, wk, pairs, ct, load_c, w_end, lead); break;
        case 3: tile<3, kPrefetch>(xt, kp, wk, pairs, ct, load_c, w_end, lead); break;
        case 2: tile<2, kPrefetch>(xt, kp, wk, pairs, ct, load_c, w_end, lead); break;
        case 1: tile<1, kPrefetch>(xt, kp, wk, pairs, ct, load_c, w_end, lead); break;
        default: break;
      }
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}
}  // namespace

void run_panels_bf16_avx512bf16(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const int64_t lead = bf16_stream_lead(job.tokens);  // x86/prefetch.h: 32 KB on Zen 5, none on other AMD CPUs
  if (lead > 0) run_panels<true>(job, panel_begin, panel_end, lead);
  else run_panels<false>(job, panel_begin, panel_end, 0);
}

void round_row_bf16_avx512bf16(const float* x, int64_t k, int64_t k_padded, uint16_t* out) {
  for (int64_t i = 0; i < k_padded; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(lane_mask(k - i), x + i);
    const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_mask_storeu_epi16(out + i, lane_mask(k_padded - i), b);
  }
}

void split_row_bf16_avx512bf16(const float* x, int64_t k, int64_t k_padded, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < k_padded; i += 16) {
    const __mmask16 in = lane_mask(k - i), out = lane_mask(k_padded - i);  // zeros from k to k_padded
    const __m512 v = _mm512_maskz_loadu_ps(in, x + i);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16)));
    _mm256_mask_storeu_epi16(hi + i, out, reinterpret_cast<__m256i>(h));
    _mm256_mask_storeu_epi16(lo + i, out, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest)));
  }
}

}  // namespace moex::kernels::x86

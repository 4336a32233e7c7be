// W8A8: s8 weights x activations quantized per token, vpdpbusd (u8 x s8, four products per 32-bit lane).
// vpdpbusd wants one unsigned operand, so activation codes q in -127..127 are stored as q + 128 and the
// panel's column sums remove the offset: sum (q + 128) w = sum q w + 128 sum w. Integer sums are exact, so
// the result equals the reference's bit for bit: float(sum q w) * (token scale * row scale).
// Tile: MT = 6 tokens x one 64-row panel (24 int32 accumulators), as the bf16 kernel.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenTile = 6;
constexpr int64_t kKBlock = 4096;  // a panel's slice (256 KB) stays in L2 while the token tiles pass

inline __m512i broadcast_quad(const uint8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof quad);
  return _mm512_set1_epi32(quad);
}

// c [MT][64] (+)= x [MT][ldx] (u8, k quads from here) . w panel [quads][64][4]
template <int MT, bool kPrefetch>
void tile(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t quads, int32_t* c, bool load_c, const void* w_end) {
  // __v16si, the element type vpdpbusd's builtin works in: an array of __m512i (64-bit lanes) cast back and
  // forth keeps GCC 12 from holding the accumulators in registers (it spills them every iteration).
  __v16si acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = __v16si{};
  for (int64_t q = 0; q < quads; ++q) {
    const int8_t* wq = w + q * 4 * kPanel;
    if constexpr (kPrefetch) prefetch_ahead(wq, w_end, 4);
    const __m512i w0 = _mm512_load_si512(wq), w1 = _mm512_load_si512(wq + 64), w2 = _mm512_load_si512(wq + 128),
                  w3 = _mm512_load_si512(wq + 192);
    for (int t = 0; t < MT; ++t) {
      const __m512i xv = broadcast_quad(x + t * ldx + 4 * q);
      acc[t][0] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][0]), xv, w0));
      acc[t][1] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][1]), xv, w1));
      acc[t][2] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][2]), xv, w2));
      acc[t][3] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][3]), xv, w3));
    }
  }
  for (int t = 0; t < MT; ++t) {
    for (int v = 0; v < 4; ++v) {
      int32_t* out = c + t * kPanel + 16 * v;
      const __m512i sum = __m512i(acc[t][v]);
      _mm512_storeu_si512(out, load_c ? _mm512_add_epi32(sum, _mm512_loadu_si512(out)) : sum);
    }
  }
}

}  // namespace

namespace {
template <bool kPrefetch>
void run_panels(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint8_t*>(job.activations);  // [T][k_padded] q + 128
  const int64_t tokens = job.tokens, kp = w.k_padded;
  thread_local std::vector<int32_t> c;  // [T][64] integer sums
  thread_local std::vector<float> f;    // [T][64] scaled
  if (c.size() < static_cast<size_t>(tokens * kPanel)) {
    c.resize(tokens * kPanel);
    f.resize(tokens * kPanel);
  }
  if (w.cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no K block runs to write c
  const int8_t* w_end = w.data.as<const int8_t>() + panel_end * kp * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w_panel = w.data.as<const int8_t>() + panel * kp * kPanel;  // [kp/4][64][4]
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
      const int64_t quads = (std::min(kp, k0 + kKBlock) - k0) / 4;
      const int8_t* wk = w_panel + k0 * kPanel;
      const bool load_c = k0 > 0;
      int64_t t = 0;
      for (; t + kTokenTile <= tokens; t += kTokenTile)
        tile<kTokenTile, kPrefetch>(x + t * kp + k0, kp, wk, quads, c.data() + t * kPanel, load_c, w_end);
      const uint8_t* xt = x + t * kp + k0;
      int32_t* ct = c.data() + t * kPanel;
      switch (tokens - t) {
        case 5: tile<5, kPrefetch>(xt, kp, wk, quads, ct, load_c, w_end); break;
        case 4: tile<4, kPrefetch>(xt, kp, wk, quads, ct, load_c, w_end); break;
        case 3: tile<3, kPrefetch>(xt, kp, wk, quads, ct, load_c, w_end); break;
        case 2: tile<2, kPrefetch>(xt, kp, wk, quads, ct, load_c, w_end); break;
        case 1: tile<1, kPrefetch>(xt, kp, wk, quads, ct, load_c, w_end); break;
        default: break;
      }
    }
    w8a8_panel_to_f32(job, panel, c.data(), f.data());
    apply_epilogue(job.epilogue, w, panel, tokens, f.data());
  }
}
}  // namespace

void run_panels_w8a8_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  if (stream_prefetch_for(job.tokens, (panel_end - panel_begin) * job.w->k_padded * kPanel, kPrefetchShortStream))
    run_panels<true>(job, panel_begin, panel_end);
  else run_panels<false>(job, panel_begin, panel_end);
}

}  // namespace moex::kernels::x86

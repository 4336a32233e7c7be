// Vector helpers shared by the kernels/x86 files. Include only from a *_avx512*.cc or *_amx.cc file (they
// all have at least the AVX-512 flags). Everything here is in an unnamed namespace: each file gets its own
// copy compiled with its own flags, so the linker can never hand an AVX512-BF16 build of a helper to
// code that runs on a CPU without it.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels::x86 {
namespace {

// bf16 pairs (the vdpbf16ps / tdpbf16ps operand; plain AVX-512 moves, so any file here may use them): 32 of them
// from 64-byte-aligned p, and the pair at p (two activations) in every 32-bit lane.
inline __m512bh load_pairs(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_load_si512(p)); }
inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

// Runs run.operator()<MT>(t) over the tokens in balanced register tiles: ceil(T / 6) tiles of 5 or 6 rows (fewer for
// T < 6), never a 1- or 2-row tail whose weight loads feed only a few dot products.
template <typename Run>
inline void over_tokens_balanced(int64_t tokens, Run&& run) {
  const int64_t tiles = (tokens + 5) / 6, base = tokens / std::max<int64_t>(tiles, 1), longer = tokens - base * tiles;
  int64_t t = 0;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t mt = base + (i < longer ? 1 : 0);
    switch (mt) {
      case 6: run.template operator()<6>(t); break;
      case 5: run.template operator()<5>(t); break;
      case 4: run.template operator()<4>(t); break;
      case 3: run.template operator()<3>(t); break;
      case 2: run.template operator()<2>(t); break;
      case 1: run.template operator()<1>(t); break;
      default: break;
    }
    t += mt;
  }
}

// Runs run.operator()<MT>(t) over the tokens in register tiles of Full (<= 6) rows, the rest in one smaller tile.
template <int Full, typename Run>
inline void over_tokens(int64_t tokens, Run&& run) {
  static_assert(Full >= 2 && Full <= 6);
  int64_t t = 0;
  for (; t + Full <= tokens; t += Full) run.template operator()<Full>(t);
  switch (tokens - t) {
    case 5: if constexpr (Full > 5) run.template operator()<5>(t); break;
    case 4: if constexpr (Full > 4) run.template operator()<4>(t); break;
    case 3: if constexpr (Full > 3) run.template operator()<3>(t); break;
    case 2: run.template operator()<2>(t); break;
    case 1: run.template operator()<1>(t); break;
    default: break;
  }
}

// The low n (0..16) lanes.
inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// e^x to ~2 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (error < 2e-7),
// 2^n by vscalefps (which saturates to 0 / inf instead of wrapping the exponent).
inline __m512 exp_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 split in two: r exact to ~1e-10
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x[v] 128-bit block c = x[c] block v on return (4x4 transpose of 128-bit blocks; its own inverse).
inline void transpose_blocks(__m512 x[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(x[0], x[1], 0x44), t1 = _mm512_shuffle_f32x4(x[0], x[1], 0xee);
  const __m512 t2 = _mm512_shuffle_f32x4(x[2], x[3], 0x44), t3 = _mm512_shuffle_f32x4(x[2], x[3], 0xee);
  x[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  x[1] = _mm512_shuffle_f32x4(t0, t2, 0xdd);
  x[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  x[3] = _mm512_shuffle_f32x4(t1, t3, 0xdd);
}

// silu(g) = g / (1 + e^-g)
inline __m512 silu_ps(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// W8A8: one panel's integer sums c [tokens][64] of (q + 128) . w as f [tokens][64] = float(sum q w) * (token
// scale * row scale), the offset 128 * sum w taken off first. Every W8A8 row loop (VNNI few / many rows, AMX)
// ends with this, so their results agree bit for bit.
inline void w8a8_panel_to_f32(const PanelJob& job, int64_t panel, const int32_t* c, float* f) {
  const PackedWeights& w = *job.w;
  const int32_t* col_sums = w.col_sums.as<const int32_t>() + panel * kPanel;
  const float* row_scales = w.scales.as<const float>() + panel * kPanel;
  for (int64_t t = 0; t < job.tokens; ++t) {
    const __m512 token_scale = _mm512_set1_ps(job.token_scales[t]);
    for (int v = 0; v < 4; ++v) {
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(col_sums + 16 * v), 7);  // 128 * sum w
      const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(c + t * kPanel + 16 * v), offset);
      _mm512_storeu_ps(f + t * kPanel + 16 * v,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(token_scale, _mm512_loadu_ps(row_scales + 16 * v))));
    }
  }
}

// Writes one panel's results c [tokens][64] (lanes = the panel's rows) where the epilogue says.
inline void apply_epilogue(const Epilogue& e, const PackedWeights& w, int64_t panel, int64_t tokens,
                           const float* c) {
  if (w.gate_up) {  // lanes 0..31 gate, 32..63 up, for outputs 32 * panel + (0..31)
    const int64_t n0 = panel * (kPanel / 2), valid = std::min<int64_t>(kPanel / 2, w.rows - n0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int v = 0; v < 2; ++v) {
        const __mmask16 m = lane_mask(valid - 16 * v);
        if (!m) break;
        const __m512 h = _mm512_mul_ps(silu_ps(_mm512_loadu_ps(c + t * kPanel + 16 * v)),
                                       _mm512_loadu_ps(c + t * kPanel + 32 + 16 * v));
        _mm512_mask_storeu_ps(e.y + t * e.ld_y + n0 + 16 * v, m, h);
      }
    }
    return;
  }
  const int64_t n0 = panel * kPanel, valid = std::min<int64_t>(kPanel, w.rows - n0);
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = e.kind == Epilogue::kRoutedAccumulate ? e.y + e.out_rows[t] * e.ld_y : e.y + t * e.ld_y;
    const __m512 route = _mm512_set1_ps(e.kind == Epilogue::kRoutedAccumulate ? e.route_weights[t] : 1.0f);
    for (int v = 0; v < 4; ++v) {
      const __mmask16 m = lane_mask(valid - 16 * v);
      if (!m) break;
      float* out = row + n0 + 16 * v;
      const __m512 r = _mm512_loadu_ps(c + t * kPanel + 16 * v);
      switch (e.kind) {
        case Epilogue::kStore: _mm512_mask_storeu_ps(out, m, r); break;
        case Epilogue::kAccumulate:
          _mm512_mask_storeu_ps(out, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), r));
          break;
        case Epilogue::kRoutedAccumulate:
          _mm512_mask_storeu_ps(out, m, _mm512_fmadd_ps(route, r, _mm512_maskz_loadu_ps(m, out)));
          break;
        case Epilogue::kSiluMul: break;  // only with gate_up weights
      }
    }
  }
}

}  // namespace
}  // namespace moex::kernels::x86

// Weight-only int8 / int4 / fp8 matmuls: f32 activations, weights decoded to f32 in registers, f32 FMAs.
// (int4 runs here only on CPUs without AVX512-BF16; packed_bf16_avx512bf16.cc has its faster kernel.)
// Decode is memory-bound, so what matters is reading fewer bytes than bf16 and decoding them in fewer
// instructions than the memory takes to deliver them. Panels are [k][64 lanes], so one k's 64 weights are
// one contiguous run (64 B; int4: a k pair's 64 B) and the 4 f32 vectors of a k need no shuffles across k.
// The register tile is MT tokens x 4 vectors; the decode cost is shared by the tile's tokens.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenTile = 4;
constexpr int64_t kKBlock = 2048;  // a multiple of every group size (32/64/128) and of fp8's 128

struct Int8Decode {  // s8 [cols][64]; the per-row scale is applied to the sums afterwards
  static constexpr bool kGrouped = false, kOffset = false;
  const int8_t* panel;
  const void* end;  // the call's last weight byte (prefetch_ahead)
  int64_t group = 0;
  const float *scales = nullptr, *offsets = nullptr;
  void load(int64_t k, __m512 w[4]) const {
    const int8_t* p = panel + k * kPanel;
    prefetch_ahead(p, end, 1);
    for (int v = 0; v < 4; ++v)
      w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v))));
  }
};

struct Int4Decode {  // u8 [k_padded/2][64]: a lane's byte holds q(k) low, q(k+1) high; w = q * scale + offset
  static constexpr bool kGrouped = true, kOffset = true;
  const uint8_t* panel;
  const void* end;  // the call's last weight byte (prefetch_ahead)
  int64_t group;
  const float *scales, *offsets;  // [G][64]
  void load(int64_t k, __m512 w[4]) const {
    if (k % 2 == 0) prefetch_ahead(panel + (k / 2) * kPanel, end, 1);
    const __m512i b = _mm512_loadu_si512(panel + (k / 2) * kPanel);
    const __m512i q = _mm512_and_si512(k % 2 ? _mm512_srli_epi16(b, 4) : b, _mm512_set1_epi8(0x0f));
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, 0)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, 1)));
    w[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, 2)));
    w[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, 3)));
  }
};

struct Fp8Decode {  // e4m3 [cols][64]; w = fp16-bits reading * scale (the scales carry the 2^8)
  static constexpr bool kGrouped = true, kOffset = false;
  const uint8_t* panel;
  const void* end;  // the call's last weight byte (prefetch_ahead)
  int64_t group = 128;
  const float *scales, *offsets = nullptr;  // [G][64]
  // e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000: the same number times 2^-8, subnormals included (vcvtph2ps
  // turns fp16 subnormals into normal f32, so no denormal ever reaches an FMA). Shift the byte left by 7,
  // then move the sign from bit 14 to 15 by adding bit 14 to itself.
  static __m512i e4m3_to_f16_bits(__m256i bytes) {
    const __m512i a = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 7);
    return _mm512_add_epi16(a, _mm512_and_si512(a, _mm512_set1_epi16(0x4000)));
  }
  void load(int64_t k, __m512 w[4]) const {
    const uint8_t* p = panel + k * kPanel;
    prefetch_ahead(p, end, 1);
    const __m512i h0 = e4m3_to_f16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i h1 = e4m3_to_f16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h0));
    w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h0, 1));
    w[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(h1));
    w[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h1, 1));
  }
};

// c [MT][64] (+)= x [MT][ldx] (f32, columns k0..k1) . decoded panel columns k0..k1
template <class D, int MT>
void tile(const float* x, int64_t ldx, const D& d, int64_t k0, int64_t k1, float* c, bool load_c) {
  __m512 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = load_c ? _mm512_loadu_ps(c + t * kPanel + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = k0; k < k1;) {
    const int64_t g = D::kGrouped ? k / d.group : 0;
    const int64_t g_end = D::kGrouped ? std::min(k1, (g + 1) * d.group) : k1;
    __m512 scale[4], offset[4];
    if constexpr (D::kGrouped) {
      for (int v = 0; v < 4; ++v) {
        scale[v] = _mm512_loadu_ps(d.scales + g * kPanel + 16 * v);
        if constexpr (D::kOffset) offset[v] = _mm512_loadu_ps(d.offsets + g * kPanel + 16 * v);
      }
    }
    for (; k < g_end; ++k) {
      __m512 w[4];
      d.load(k, w);
      if constexpr (D::kGrouped) {
        for (int v = 0; v < 4; ++v)
          w[v] = D::kOffset ? _mm512_fmadd_ps(w[v], scale[v], offset[v]) : _mm512_mul_ps(w[v], scale[v]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512 xv = _mm512_set1_ps(x[t * ldx + k]);
        for (int v = 0; v < 4; ++v) acc[t][v] = _mm512_fmadd_ps(xv, w[v], acc[t][v]);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + t * kPanel + 16 * v, acc[t][v]);
}

template <class D>
void panel_sums(const float* x, int64_t tokens, int64_t cols, const D& d, float* c) {
  for (int64_t k0 = 0; k0 < cols; k0 += kKBlock) {
    const int64_t k1 = std::min(cols, k0 + kKBlock);
    const bool load_c = k0 > 0;
    int64_t t = 0;
    for (; t + kTokenTile <= tokens; t += kTokenTile)
      tile<D, kTokenTile>(x + t * cols, cols, d, k0, k1, c + t * kPanel, load_c);
    switch (tokens - t) {
      case 3: tile<D, 3>(x + t * cols, cols, d, k0, k1, c + t * kPanel, load_c); break;
      case 2: tile<D, 2>(x + t * cols, cols, d, k0, k1, c + t * kPanel, load_c); break;
      case 1: tile<D, 1>(x + t * cols, cols, d, k0, k1, c + t * kPanel, load_c); break;
      default: break;
    }
  }
}

// Prefill: with many token tiles per panel, decoding every weight once per tile costs more than the FMAs
// (fp8 ran at ~56% of the FMA peak). From the registry's crossover (16 rows, kernels/formats.cc) on (job.many_rows:
// the weight's KernelChoice decides), a K block of the panel is decoded once into f32 [k][64] (kept in L2) and a
// plain MT = 6 FMA tile runs over it: the same products, only the decoding is shared.
constexpr int kPrefillTile = 6;
constexpr int64_t kPrefillKBlock = 1024;  // 256 KB of decoded f32 weights; a multiple of every group size

template <int MT>
void f32_tile(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* c, bool load_c) {
  __m512 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + (k - k0) * kPanel;
    const __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16), w2 = _mm512_load_ps(wk + 32),
                 w3 = _mm512_load_ps(wk + 48);
    for (int t = 0; t < MT; ++t) {
      const __m512 xv = _mm512_set1_ps(x[t * ldx + k]);
      acc[t][0] = _mm512_fmadd_ps(xv, w0, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(xv, w1, acc[t][1]);
      acc[t][2] = _mm512_fmadd_ps(xv, w2, acc[t][2]);
      acc[t][3] = _mm512_fmadd_ps(xv, w3, acc[t][3]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    for (int v = 0; v < 4; ++v) {
      float* out = c + t * kPanel + 16 * v;
      _mm512_storeu_ps(out, load_c ? _mm512_add_ps(acc[t][v], _mm512_loadu_ps(out)) : acc[t][v]);
    }
  }
}

template <class D>
void panel_sums_prefill(const float* x, int64_t tokens, int64_t cols, const D& d, float* c) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> decoded(  // [kPrefillKBlock][64] f32, 64-byte aligned
      static_cast<float*>(std::aligned_alloc(64, kPrefillKBlock * kPanel * sizeof(float))));
  float* wbuf = decoded.get();
  for (int64_t k0 = 0; k0 < cols; k0 += kPrefillKBlock) {
    const int64_t k1 = std::min(cols, k0 + kPrefillKBlock);
    for (int64_t k = k0; k < k1; ++k) {  // decode (and dequantize, as tile() does) once
      __m512 w[4];
      d.load(k, w);
      if constexpr (D::kGrouped) {
        const int64_t g = k / d.group;
        for (int v = 0; v < 4; ++v) {
          const __m512 scale = _mm512_loadu_ps(d.scales + g * kPanel + 16 * v);
          w[v] = D::kOffset ? _mm512_fmadd_ps(w[v], scale, _mm512_loadu_ps(d.offsets + g * kPanel + 16 * v))
                            : _mm512_mul_ps(w[v], scale);
        }
      }
      for (int v = 0; v < 4; ++v) _mm512_store_ps(wbuf + (k - k0) * kPanel + 16 * v, w[v]);
    }
    const bool load_c = k0 > 0;
    int64_t t = 0;
    for (; t + kPrefillTile <= tokens; t += kPrefillTile)
      f32_tile<kPrefillTile>(x + t * cols, cols, wbuf, k0, k1, c + t * kPanel, load_c);
    const float* xt = x + t * cols;
    float* ct = c + t * kPanel;
    switch (tokens - t) {
      case 5: f32_tile<5>(xt, cols, wbuf, k0, k1, ct, load_c); break;
      case 4: f32_tile<4>(xt, cols, wbuf, k0, k1, ct, load_c); break;
      case 3: f32_tile<3>(xt, cols, wbuf, k0, k1, ct, load_c); break;
      case 2: f32_tile<2>(xt, cols, wbuf, k0, k1, ct, load_c); break;
      case 1: f32_tile<1>(xt, cols, wbuf, k0, k1, ct, load_c); break;
      default: break;
    }
  }
}

template <class D>
void panel_results(const float* x, int64_t tokens, int64_t cols, const D& d, float* c, bool many_rows) {
  if (many_rows)
    panel_sums_prefill(x, tokens, cols, d, c);
  else
    panel_sums(x, tokens, cols, d, c);
}

}  // namespace

void run_panels_weight_only_avx512(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const float*>(job.activations);  // [T][cols]
  const int64_t tokens = job.tokens, cols = w.cols;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  const int64_t groups = w.group ? (cols + w.group - 1) / w.group : 1;
  if (w.cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no K block runs to write c
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    switch (w.format) {
      case WeightFormat::kInt8: {
        panel_results(x, tokens, cols, Int8Decode{w.data.as<const int8_t>() + panel * cols * kPanel,
                                                         w.data.as<const int8_t>() + panel_end * cols * kPanel}, c.data(),
                      job.many_rows);
        const float* scale = w.scales.as<const float>() + panel * kPanel;
        for (int64_t t = 0; t < tokens; ++t)
          for (int v = 0; v < 4; ++v)
            _mm512_storeu_ps(c.data() + t * kPanel + 16 * v,
                             _mm512_mul_ps(_mm512_loadu_ps(c.data() + t * kPanel + 16 * v), _mm512_loadu_ps(scale + 16 * v)));
        break;
      }
      case WeightFormat::kInt4:
        panel_results(x, tokens, cols,
                      Int4Decode{w.data.as<const uint8_t>() + panel * (w.k_padded / 2) * kPanel,
                                 w.data.as<const uint8_t>() + panel_end * (w.k_padded / 2) * kPanel, w.group,
                              w.scales.as<const float>() + panel * groups * kPanel,
                              w.offsets.as<const float>() + panel * groups * kPanel},
                   c.data(), job.many_rows);
        break;
      case WeightFormat::kFP8E4M3:
        panel_results(x, tokens, cols,
                      Fp8Decode{w.data.as<const uint8_t>() + panel * cols * kPanel,
                                w.data.as<const uint8_t>() + panel_end * cols * kPanel, w.group,
                             w.scales.as<const float>() + panel * groups * kPanel},
                   c.data(), job.many_rows);
        break;
      default: return;  // the dispatcher sends only the three formats above here
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

// Per token, as quantize_activations_s8: the same float operations in the same order, so the same codes.
float quantize_row_u8_avx512(const float* x, int64_t k, int64_t k_padded, uint8_t* out) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lane_mask(k - i), x + i)));
  const float absmax = _mm512_reduce_max_ps(amax);
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < k_padded; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(k - i), x + i), vinv);
    __m512i q = _mm512_cvtps_epi32(v);  // round to nearest even (MXCSR default)
    q = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127)),
                         _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(out + i, lane_mask(k_padded - i), _mm512_cvtepi32_epi8(q));
  }
  return absmax > 0.0f ? absmax / 127.0f : 0.0f;
}

// out[i] = f32_to_f8e4m3(x[i] / scale) (base/dtype.h), 16 at a time: the same float operations on the same values,
// so the same codes; quantize_fp8's loop over a checkpoint (through baseline x86-64 code, 4 lanes) was ~45% of
// an fp8 load.
void f32_to_f8e4m3_row_avx512(const float* x, int64_t n, float scale, uint8_t* out) {
  const __m512 vscale = _mm512_set1_ps(scale), min_normal = _mm512_set1_ps(0.015625f), max = _mm512_set1_ps(448.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512i bits = _mm512_castps_si512(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vscale));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512 a = _mm512_castsi512_ps(abs_bits);
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(abs_bits, 23), _mm512_set1_epi32(127));
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(-6)), _mm512_set1_epi32(8));
    const __m512 magic = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(-3 + 23 + 127)), 23), _mm512_set1_epi32(1 << 22)));
    const __m512 q = _mm512_sub_ps(_mm512_add_ps(a, magic), magic);
    const __m512i normal = _mm512_sub_epi32(
        _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(q), 20), _mm512_set1_epi32(0x7ff)), _mm512_set1_epi32(120 << 3));
    const __mmask16 small = _mm512_cmp_ps_mask(q, min_normal, _CMP_LT_OQ);
    const __m512i sub = _mm512_cvttps_epu32(_mm512_mul_ps(_mm512_maskz_mov_ps(small, q), _mm512_set1_ps(512.0f)));
    __m512i code = _mm512_mask_blend_epi32(small, normal, sub);
    const __mmask16 saturate = _mm512_cmp_ps_mask(q, max, _CMP_GE_OQ) | _mm512_cmp_ps_mask(a, max, _CMP_GE_OQ);
    code = _mm512_mask_blend_epi32(saturate, code, _mm512_set1_epi32(0x7e));
    code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), code, _mm512_set1_epi32(0x7f));
    _mm_mask_storeu_epi8(out + i, m, _mm512_cvtepi32_epi8(_mm512_or_si512(sign, code)));
  }
}

}  // namespace moex::kernels::x86

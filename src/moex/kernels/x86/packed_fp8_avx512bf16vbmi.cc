// fp8 e4m3 weights x bf16 activations -> f32 with vdpbf16ps, the codes turned into bf16 by a byte table.
// Hand-written: no library has this kernel for CPUs (oneDNN's fp8 matmuls need AMX-FP16 / AVX10.2).
//
// Why a table: decoding e4m3 to f32 arithmetically (kernels/x86/packed_weight_only_avx512.cc) costs ~18
// instructions per 64 weights plus one FMA per weight and token, which bounded fp8 decode at ~50-67% of the
// read roofline. Here an e4m3 code c = s.eeee.mmm selects, through two vpermt2b lookups over its low 7 bits,
// the low and the high byte of the bf16 value of its magnitude (times 2^-8, the same convention as the
// f32 path's scales: PackedWeights keeps fp8 scales times 2^8), and one vpternlogd puts the sign bit c & 0x80
// on the high byte. Every e4m3 value, subnormals included, is a normal bf16 after the 2^-8 (the smallest is
// 2^-17), so the lookups are exact and vdpbf16ps (which treats bf16 denormals as zero) loses nothing.
//
// Layout: the panels stay fp8's [cols][64] (one k's 64 lanes in 64 bytes). A k pair's two 64-byte rows become
// the four bf16-pair vectors vdpbf16ps wants by byte- then word-unpacks, which interleave within 128-bit
// chunks: pair vector v's dword 4c + i is lane 16c + 4v + i (c, i in 0..3). Instead of shuffling that back
// per k pair, the sums stay in this order (the scales are read in it too, one 4x4 transpose of 128-bit
// blocks per K group) and one transpose per panel puts them in lane order before the epilogue.
// Per K group of 128 (the scales' block) the dot products sum apart and fold in times the group's scale.
// Requires AVX512-BF16 and AVX512-VBMI (vpermt2b): cpu_features().has_avx512_bf16_vbmi_kernels().
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int64_t kGroup = 128;   // fp8's scale block along K
constexpr int kFewTokenTile = 4;  // 16 group sums + 4 tables + 4 pair vectors + temporaries of 32 registers
constexpr int kManyTokenTile = 6;  // over a decoded K block: 24 group sums + 4 pair vectors
constexpr int64_t kKBlock = 2048;  // many rows: a K block decoded to bf16 (256 KB, L2); a multiple of kGroup

// The four 64-byte tables: bf16 low and high bytes of e4m3 magnitude m (0..127) times 2^-8, m's bit 6
// choosing the second table of each pair. m = 127 is e4m3's NaN and stays a NaN.
struct Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  Tables() {
    for (int m = 0; m < 128; ++m) {
      const uint16_t b = f32_to_bf16(f8e4m3_to_f32(static_cast<uint8_t>(m)) * (1.0f / 256.0f));
      lo[m] = static_cast<uint8_t>(b & 0xff);
      hi[m] = static_cast<uint8_t>(b >> 8);
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

struct Decoder {
  __m512i lo0, lo1, hi0, hi1;
  Decoder() {
    const Tables& t = tables();
    lo0 = _mm512_load_si512(t.lo);
    lo1 = _mm512_load_si512(t.lo + 64);
    hi0 = _mm512_load_si512(t.hi);
    hi1 = _mm512_load_si512(t.hi + 64);
  }
  // One k pair: rows r0 (k) and r1 (k + 1) of 64 codes -> four bf16-pair vectors, in the permuted lane order
  // described at the top.
  inline void pairs(__m512i r0, __m512i r1, __m512bh out[4]) const {
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i l0 = _mm512_permutex2var_epi8(lo0, r0, lo1), l1 = _mm512_permutex2var_epi8(lo0, r1, lo1);
    // hi | (code & 0x80): vpternlogd 0xf8 is A | (B & C)
    const __m512i h0 = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, r0, hi1), r0, sign, 0xf8);
    const __m512i h1 = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, r1, hi1), r1, sign, 0xf8);
    const __m512i w0lo = _mm512_unpacklo_epi8(l0, h0), w0hi = _mm512_unpackhi_epi8(l0, h0);  // k: lanes 16c+0..7, +8..15
    const __m512i w1lo = _mm512_unpacklo_epi8(l1, h1), w1hi = _mm512_unpackhi_epi8(l1, h1);  // k + 1
    out[0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(w0lo, w1lo));  // lanes 16c + 0..3
    out[1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(w0lo, w1lo));  // 16c + 4..7
    out[2] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(w0hi, w1hi));  // 16c + 8..11
    out[3] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(w0hi, w1hi));  // 16c + 12..15
  }
};

// Group g's scales [64] in the permuted order.
inline void group_scales(const float* scales, int64_t g, __m512 s[4]) {
  for (int v = 0; v < 4; ++v) s[v] = _mm512_loadu_ps(scales + g * kPanel + 16 * v);
  transpose_blocks(s);
}

// c [MT][64] (permuted order) += x [MT][ldx] (bf16, k0..k1) . the fp8 panel [K][64]; k0 on a group boundary.
// Rows past K (an odd K's last pair) read as zero codes. With `store`, the decoded pairs also go to store
// [(k1 - k0)/2][4][16][2] (decoded_tile's block): the many-row loop's first tile decodes its block this way, so the
// decode's shuffles overlap that tile's dot products instead of running in a pass of their own.
template <int MT>
void few_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t K, const float* scales, const Decoder& d,
              int64_t k0, int64_t k1, float* c, const void* w_end, uint16_t* store = nullptr) {
  for (int64_t g0 = k0; g0 < k1; g0 += kGroup) {
    const int64_t g1 = std::min(k1, g0 + kGroup);
    __m512 part[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) part[t][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g1; k += 2) {
      prefetch_ahead(w + k * kPanel, w_end, 2);
      const __m512i r0 = _mm512_load_si512(w + k * kPanel);
      const __m512i r1 = k + 1 < K ? _mm512_load_si512(w + (k + 1) * kPanel) : _mm512_setzero_si512();
      __m512bh wv[4];
      d.pairs(r0, r1, wv);
      if (store)
        for (int v = 0; v < 4; ++v)
          _mm512_store_si512(store + (k - k0) * kPanel + 32 * v, reinterpret_cast<__m512i>(wv[v]));
      for (int t = 0; t < MT; ++t) {
        const __m512bh xv = broadcast_pair(x + t * ldx + k);
        for (int v = 0; v < 4; ++v) part[t][v] = _mm512_dpbf16_ps(part[t][v], xv, wv[v]);
      }
    }
    __m512 s[4];
    group_scales(scales, g0 / kGroup, s);
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) {
        float* out = c + t * kPanel + 16 * v;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(part[t][v], s[v], _mm512_loadu_ps(out)));
      }
  }
}

// The same sums over a K block decoded once into bf16 pairs dec [(k1 - k0)/2][4][16][2] (permuted order): the
// same products in the same order as few_tile, so both loops give a row the same bits. The k pairs also
// prefetch two 64-byte lines each from `prefetch` on (into L2), prefetch_lines in all.
template <int MT>
void decoded_tile(const uint16_t* x, int64_t ldx, const uint16_t* dec, const float* scales, int64_t k0, int64_t k1,
                  float* c, const char* prefetch, int64_t prefetch_lines) {
  for (int64_t g0 = k0; g0 < k1; g0 += kGroup) {
    const int64_t g1 = std::min(k1, g0 + kGroup);
    __m512 part[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) part[t][v] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g1; k += 2) {
      if (k - k0 < prefetch_lines) {
        _mm_prefetch(prefetch + (k - k0) * 64, _MM_HINT_T1);
        _mm_prefetch(prefetch + (k - k0 + 1) * 64, _MM_HINT_T1);
      }
      const uint16_t* wp = dec + (k - k0) * kPanel;
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_load_si512(wp)),
                     w1 = reinterpret_cast<__m512bh>(_mm512_load_si512(wp + 32)),
                     w2 = reinterpret_cast<__m512bh>(_mm512_load_si512(wp + 64)),
                     w3 = reinterpret_cast<__m512bh>(_mm512_load_si512(wp + 96));
      for (int t = 0; t < MT; ++t) {
        const __m512bh xv = broadcast_pair(x + t * ldx + k);
        part[t][0] = _mm512_dpbf16_ps(part[t][0], xv, w0);
        part[t][1] = _mm512_dpbf16_ps(part[t][1], xv, w1);
        part[t][2] = _mm512_dpbf16_ps(part[t][2], xv, w2);
        part[t][3] = _mm512_dpbf16_ps(part[t][3], xv, w3);
      }
    }
    __m512 s[4];
    group_scales(scales, g0 / kGroup, s);
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) {
        float* out = c + t * kPanel + 16 * v;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(part[t][v], s[v], _mm512_loadu_ps(out)));
      }
  }
}

}  // namespace

void decode_fp8_pairs_avx512bf16vbmi(const uint8_t* codes, int64_t k_count, int64_t pair_rows, uint16_t* out) {
  const Decoder d;
  for (int64_t j = 0; j < pair_rows; ++j) {
    const int64_t k = 2 * j;
    const __m512i r0 = k < k_count ? _mm512_load_si512(codes + k * kPanel) : _mm512_setzero_si512();
    const __m512i r1 = k + 1 < k_count ? _mm512_load_si512(codes + (k + 1) * kPanel) : _mm512_setzero_si512();
    __m512bh v[4];
    d.pairs(r0, r1, v);
    __m512 lanes[4] = {reinterpret_cast<__m512>(v[0]), reinterpret_cast<__m512>(v[1]), reinterpret_cast<__m512>(v[2]),
                       reinterpret_cast<__m512>(v[3])};
    transpose_blocks(lanes);  // lanes[c]: the pairs of lanes 16c .. 16c + 15, in order
    for (int c = 0; c < 4; ++c) _mm512_store_ps(reinterpret_cast<float*>(out + j * 2 * kPanel) + 16 * c, lanes[c]);
  }
}

void run_panels_fp8_avx512bf16vbmi(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint16_t*>(job.activations);  // [T][k_padded] bf16, k_padded = round_up(K, 2)
  const int64_t tokens = job.tokens, K = w.cols, kp = w.k_padded, groups = (K + kGroup - 1) / kGroup;
  const Decoder d;
  thread_local std::vector<float> c;  // [T][64]: one panel's sums, permuted order until the transpose
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint16_t, Free> decoded;  // [kKBlock/2][64][2] bf16, 64-byte aligned
  if (job.many_rows && !decoded) decoded.reset(static_cast<uint16_t*>(std::aligned_alloc(64, kKBlock * kPanel * 2)));
  const uint8_t* w_end = w.data.as<const uint8_t>() + panel_end * K * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* w_panel = w.data.as<const uint8_t>() + panel * K * kPanel;  // [K][64] e4m3
    const float* scales = w.scales.as<const float>() + panel * groups * kPanel;  // [G][64], times 2^8
    std::fill_n(c.begin(), tokens * kPanel, 0.0f);
    if (!job.many_rows) {
      over_tokens<kFewTokenTile>(tokens, [&]<int MT>(int64_t t) {
        few_tile<MT>(x + t * kp, kp, w_panel, K, scales, d, 0, kp, c.data() + t * kPanel, w_end);
      });
    } else {
      for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
        const int64_t k1 = std::min(kp, k0 + kKBlock);
        // The first (up to) 4 rows decode the block as they go and store it for the rest.
        const int64_t first = std::min<int64_t>(tokens, kFewTokenTile);
        over_tokens<kFewTokenTile>(first, [&]<int MT>(int64_t) {  // one tile: first <= kFewTokenTile
          few_tile<MT>(x, kp, w_panel, K, scales, d, k0, k1, c.data(), w_end, decoded.get());
        });
        // What the next block decodes, pulled from DRAM into L2 while the tiles run over this one (else the
        // decode below waits on every line: at 16 rows gate_up took 1.2x the time without it, Zen 5 class):
        // this panel's next K block, else the next panel's first; one 64-byte line of codes per k.
        const int64_t next_k0 = k1 < kp ? k1 : 0;
        const uint8_t* next = k1 < kp ? w_panel + k1 * kPanel : panel + 1 < panel_end ? w_panel + K * kPanel : nullptr;
        const int64_t next_lines = next ? std::min(kKBlock, K - next_k0) : 0;
        int64_t lines_done = 0;
        over_tokens<kManyTokenTile>(tokens - first, [&]<int MT>(int64_t t) {
          t += first;
          const int64_t lines = std::max<int64_t>(0, next_lines - lines_done);
          decoded_tile<MT>(x + t * kp, kp, decoded.get(), scales, k0, k1, c.data() + t * kPanel,
                           reinterpret_cast<const char*>(next) + lines_done * 64, lines);
          lines_done += std::min(lines, k1 - k0);
        });
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {  // back to lane order
      __m512 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(c.data() + t * kPanel + 16 * i);
      transpose_blocks(v);
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(c.data() + t * kPanel + 16 * i, v[i]);
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

}  // namespace moex::kernels::x86

// int8 (weight-only) on AVX512-VNNI CPUs without AMX (Zen 4/5): s8 weights x activations as s16 codes per token
// and K group, vpdpwssd (two s16 x s16 products per 32-bit lane, exact int32 sums).
//
// Why not the f32-FMA kernel (packed_weight_only_avx512.cc): on Zen 4 vpdpwssd issues at vfmadd231ps's rate
// (3.6 G/s per core each, measured) and does two products per lane where the FMA does one, so prefill and
// batched decode, which are bound by the dot products, ran at half the machine's rate (pp512 45% of the
// vdpbf16ps roofline). The bf16 route (int4's, fp8's) would need bf16 activations; 16-bit integer codes are
// finer and need no table to decode a weight: a sign extension and a word interleave.
//
// Activations: per token and K group of kInt8ActivationGroup (128) k, q = round(x * 32767 / absmax_g),
// xs_g = absmax_g / 32767 (quantize_row_s16_avx512), so an activation is off by at most absmax_g / 65534: 2^-16
// of its group's largest, far below the weights' own error (half a step of the row's absmax / 127) and below
// bf16's 2^-9 of int4's and fp8's activations. A large activation coarsens its own group only.
// Sums: a group's |sum q w| <= 128 * 32767 * 127 < 2^31, so each group's integer sum is exact; it folds in at the
// group's end, per token and lane, c = fma(float(sum), xs_g, c), group after group, and the row's scale
// multiplies c at the end.
//
// Two row loops, one order: the few-row loop decodes each k pair of the panel in registers inside its token
// tile (up to 6 tokens); the many-row loop decodes a K block of the panel once into s16 pairs (128 KB, kept in L2),
// in its first token tile as that tile goes, and runs balanced tiles of 5-6 tokens over it (over_tokens_balanced).
// Both fold the same exact sums in the same order, so a row's result does not depend on the other rows of its call
// (no --batch-invariant pin), and both equal the scalar model of this arithmetic in the tests bit for bit.
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

constexpr int64_t kGroup = kInt8ActivationGroup;
constexpr int kFewTile = 6;                // 24 sums, 4 decoded weight vectors; a k pair decoded once per 6 tokens
constexpr int64_t kManyKBlock = 1024;      // k per decoded block: [512 pairs][64][2] s16 = 128 KB; a multiple of kGroup
static_assert(kManyKBlock % kGroup == 0 && kGroup % 2 == 0);

// vpermt2w indices interleaving two rows' words: lanes 0..15 (kLow) or 16..31 (kHigh) of a as the even words,
// of b as the odd ones: (a[i], b[i]) per 32-bit lane.
struct Interleave {
  __m512i low, high;
  Interleave() {
    alignas(64) int16_t lo[32], hi[32];
    for (int j = 0; j < 32; ++j) {
      lo[j] = static_cast<int16_t>(j % 2 ? 32 + j / 2 : j / 2);
      hi[j] = static_cast<int16_t>(j % 2 ? 48 + j / 2 : 16 + j / 2);
    }
    low = _mm512_load_si512(lo);
    high = _mm512_load_si512(hi);
  }
};

// The panel's rows k and k + 1 (64 s8 lanes each; row1 null past K: zeros) as four vectors of 16 lanes x
// (w(k), w(k + 1)) s16 pairs, lanes 16v.. in w[v].
inline void decode_pair(const Interleave& il, const int8_t* row0, const int8_t* row1, __m512i w[4]) {
  const __m512i a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0)));
  const __m512i a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0 + 32)));
  const __m512i b0 = row1 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1)))
                          : _mm512_setzero_si512();
  const __m512i b1 = row1 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1 + 32)))
                          : _mm512_setzero_si512();
  w[0] = _mm512_permutex2var_epi16(a0, il.low, b0);
  w[1] = _mm512_permutex2var_epi16(a0, il.high, b0);
  w[2] = _mm512_permutex2var_epi16(a1, il.low, b1);
  w[3] = _mm512_permutex2var_epi16(a1, il.high, b1);
}

inline __m512i broadcast_pair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}

// Where a tile's weight pairs come from: the panel, decoded in registers (few rows), or a decoded block (many).
struct PanelPairs {
  const Interleave& il;
  const int8_t* panel;  // s8 [K][64]
  int64_t K;
  const void* end;  // the call's last weight byte (prefetch_ahead)
  int16_t* store = nullptr;  // the many-row loop's first tile: the decoded pairs also go to its block from store_k0
  int64_t store_k0 = 0;
  void get(int64_t k, __m512i w[4]) const {
    const int8_t* row = panel + k * kPanel;
    prefetch_ahead(row, end, 2);
    decode_pair(il, row, k + 1 < K ? row + kPanel : nullptr, w);
    if (store)
      for (int v = 0; v < 4; ++v) _mm512_store_si512(store + (k - store_k0) * kPanel + 32 * v, w[v]);
  }
};
struct BlockPairs {
  const int16_t* block;  // s16 [pairs][64][2] from k0 on
  int64_t k0;
  void get(int64_t k, __m512i w[4]) const {
    const int16_t* p = block + (k - k0) * kPanel;  // pair (k - k0) / 2: 128 words
    for (int v = 0; v < 4; ++v) w[v] = _mm512_load_si512(p + 32 * v);
  }
};

// c [MT][64] += x [MT][ldx] (s16 codes) . the panel's columns [k0, k1) (k0 a multiple of kGroup), folded group by
// group with the tokens' group scales xs [MT][ld_xs].
template <int MT, class Pairs>
void tile(const int16_t* x, int64_t ldx, const float* xs, int64_t ld_xs, const Pairs& pairs, int64_t k0, int64_t k1,
          float* c) {
  for (int64_t g0 = k0; g0 < k1; g0 += kGroup) {
    const int64_t g1 = std::min(k1, g0 + kGroup), g = g0 / kGroup;
    // __v16si: see packed_w8a8_avx512vnni.cc (an __m512i array makes GCC 12 spill the sums every iteration).
    __v16si acc[MT][4];
    for (int t = 0; t < MT; ++t)
      for (int v = 0; v < 4; ++v) acc[t][v] = __v16si{};
    for (int64_t k = g0; k < g1; k += 2) {
      __m512i w[4];
      pairs.get(k, w);
      for (int t = 0; t < MT; ++t) {
        const __m512i xv = broadcast_pair(x + t * ldx + k);
        for (int v = 0; v < 4; ++v) acc[t][v] = __v16si(_mm512_dpwssd_epi32(__m512i(acc[t][v]), xv, w[v]));
      }
    }
    for (int t = 0; t < MT; ++t) {
      const __m512 scale = _mm512_set1_ps(xs[t * ld_xs + g]);
      for (int v = 0; v < 4; ++v) {
        float* out = c + t * kPanel + 16 * v;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(__m512i(acc[t][v])), scale, _mm512_loadu_ps(out)));
      }
    }
  }
}

// The many-row loop's decoded block, per thread: s16 [kManyKBlock / 2][64][2], 64-byte aligned.
int16_t* block_buffer() {
  struct Free {
    void operator()(int16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<int16_t, Free> buffer(
      static_cast<int16_t*>(std::aligned_alloc(64, kManyKBlock * kPanel * sizeof(int16_t))));
  return buffer.get();
}

}  // namespace

void run_panels_int8_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const int16_t*>(job.activations);  // [T][int8_activation_stride(K)] s16, zero tail
  const int64_t tokens = job.tokens, K = w.cols, ldx = int8_activation_stride(K), groups = int8_activation_groups(K);
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  static const Interleave il;
  const int8_t* w_all = w.data.as<const int8_t>();
  const int8_t* w_end = w_all + panel_end * K * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w_panel = w_all + panel * K * kPanel;  // s8 [K][64]
    std::fill_n(c.begin(), tokens * kPanel, 0.0f);
    if (!job.many_rows) {
      const PanelPairs pairs{il, w_panel, K, w_end};
      over_tokens<kFewTile>(tokens, [&]<int MT>(int64_t t) {
        tile<MT>(x + t * ldx, ldx, job.token_scales + t * groups, groups, pairs, 0, K, c.data() + t * kPanel);
      });
    } else {
      int16_t* block = block_buffer();
      for (int64_t k0 = 0; k0 < K; k0 += kManyKBlock) {
        const int64_t k1 = std::min(K, k0 + kManyKBlock);
        // The first tile (up to 6 rows) decodes the block from the codes as it goes and stores it for the others,
        // so the decode overlaps its dot products (as fp8's and int4's many-row loops do).
        const int64_t first = std::min<int64_t>(tokens, kFewTile);
        const PanelPairs decode_and_store{il, w_panel, K, w_end, block, k0};
        over_tokens<kFewTile>(first, [&]<int MT>(int64_t t) {
          tile<MT>(x + t * ldx, ldx, job.token_scales + t * groups, groups, decode_and_store, k0, k1,
                   c.data() + t * kPanel);
        });
        const BlockPairs pairs{block, k0};
        over_tokens_balanced(tokens - first, [&]<int MT>(int64_t t) {
          t += first;
          tile<MT>(x + t * ldx, ldx, job.token_scales + t * groups, groups, pairs, k0, k1, c.data() + t * kPanel);
        });
      }
    }
    const float* row_scale = w.scales.as<const float>() + panel * kPanel;
    for (int64_t t = 0; t < tokens; ++t)
      for (int v = 0; v < 4; ++v)
        _mm512_storeu_ps(c.data() + t * kPanel + 16 * v,
                         _mm512_mul_ps(_mm512_loadu_ps(c.data() + t * kPanel + 16 * v), _mm512_loadu_ps(row_scale + 16 * v)));
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

// Per K group, as the scalar model in the tests: absmax, inv = 32767 / absmax, q = round-to-nearest-even(x * inv)
// clamped to +-32767, scale = absmax / 32767 (0 and zero codes for an all-zero group).
void quantize_row_s16_avx512(const float* x, int64_t k, int16_t* out, float* scales) {
  const int64_t groups = int8_activation_groups(k), stride = int8_activation_stride(k);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * kGroup, n = std::min(k, g0 + kGroup) - g0;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lane_mask(n - i), x + g0 + i)));
    const float absmax = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? 32767.0f / absmax : 0.0f);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lane_mask(n - i);
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + g0 + i), inv));  // MXCSR: nearest even
      q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32767));
      _mm256_mask_storeu_epi16(out + g0 + i, m, _mm512_cvtepi32_epi16(q));
    }
    scales[g] = absmax > 0.0f ? absmax / 32767.0f : 0.0f;
  }
  std::fill(out + k, out + stride, int16_t{0});
}

}  // namespace moex::kernels::x86

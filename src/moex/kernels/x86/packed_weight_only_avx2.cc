// bf16 / int8 / int4 / fp8 weights on AVX2 + FMA (+ F16C): for CPUs without AVX-512 (Zen 1-3, Intel client
// cores), where every packed matmul otherwise runs the scalar loop (~1 tok/s of mini). Hand-written: the
// panels are MoEX's own layout, and no library streams them.
//
// The weights are decoded to f32 in registers and multiplied by the f32 activations with vfmadd (AVX2 has no
// bf16 or int8 dot product that keeps f32 sums; vpmaddubsw saturates). The panels are the AVX-512 kernels'
// (kernels/packed.h), read 16 lanes at a time: one 64-byte line of a k pair (bf16), 16 bytes of a k (int8,
// fp8) or of a k pair (int4). A tile is MT (1..4) tokens x 16 lanes, 2 x MT accumulators; a panel's four
// 16-lane columns are walked per K block so the block (<= 32 KB) is read from memory once and from L1 by the
// other tiles. Every lane's sum is one chain of FMAs in k order (the accumulators go to c between K blocks
// and come back), so a row's result does not depend on how many rows its call has: one loop for decode and
// prefill. int4 and fp8 sum x * code per K group and fold the group's scale (and int4's offset times the
// group's x sum) in at its end. Decoding per weight is shared by the MT tokens of a tile; the activations arrive as kernels/
// packed.h says (bf16 values for bf16 / int4 / fp8, as they are for int8), so this path computes the
// reference's products.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenTile = 4;     // 8 accumulators + 4 decoded weight vectors + a broadcast of 16 registers
constexpr int64_t kKBlock = 256;  // 32 KB of bf16 panel; a multiple of every group size (32/64/128)

// Each decoder gives lanes 16h .. 16h + 15 of a k pair (k even) as f32, dequantized: w0 for k, w1 for k + 1.
struct Bf16Decode {  // u16 [k_padded/2][64][2]: a lane's dword is (bf16 of k, bf16 of k + 1)
  const uint16_t* panel;
  void pair(int64_t k, int h, __m256 w0[2], __m256 w1[2]) const {
    const uint16_t* p = panel + ((k / 2) * kPanel + 16 * h) * 2;
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int v = 0; v < 2; ++v) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * v));
      w0[v] = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));  // a bf16 is the high half of its f32
      w1[v] = _mm256_castsi256_ps(_mm256_and_si256(d, high));
    }
  }
};

struct Int8Decode {  // s8 [cols][64]; the per-row scale multiplies the sums afterwards
  const int8_t* panel;
  int64_t cols;
  static __m256 lanes8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  void one(int64_t k, int h, __m256 w[2]) const {
    const int8_t* p = panel + k * kPanel + 16 * h;
    w[0] = lanes8(p);
    w[1] = lanes8(p + 8);
  }
  void pair(int64_t k, int h, __m256 w0[2], __m256 w1[2]) const {
    one(k, h, w0);
    if (k + 1 < cols) one(k + 1, h, w1);
    else w1[0] = w1[1] = _mm256_setzero_ps();  // odd K: the activations' k + 1 is not read either
  }
};

// The grouped formats (int4, fp8) decode the codes only (q; fp8: its fp16 reading) and sum x * code per K
// group apart; each group folds in at its end as c += scale * sum + offset * (sum of the group's x): two
// FMAs per lane and group instead of one per weight.
struct Int4Decode {  // u8 [k_padded/2][64]: q(k) low nibble, q(k + 1) high; w = q * scale + offset per group
  static constexpr bool kGrouped = true, kOffset = true;
  const uint8_t* panel;
  int64_t group;
  const float *scales, *offsets;  // [G][64]
  const float* x_sums;            // [T][G]: the activations' sum per token and group (PanelJob::group_sums)
  int64_t groups;
  void pair(int64_t k, int h, __m256 w0[2], __m256 w1[2]) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (k / 2) * kPanel + 16 * h));
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    w0[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w0[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w1[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w1[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  __m256 scale(int64_t g, int h, int v) const { return _mm256_loadu_ps(scales + g * kPanel + 16 * h + 8 * v); }
  __m256 offset(int64_t g, int h, int v) const { return _mm256_loadu_ps(offsets + g * kPanel + 16 * h + 8 * v); }
  float x_sum(int64_t t, int64_t g) const { return x_sums[t * groups + g]; }
};

struct Fp8Decode {  // e4m3 [cols][64]; w = (the code read as fp16 bits) * scale, the scales carrying the 2^8
  static constexpr bool kGrouped = true, kOffset = false;
  const uint8_t* panel;
  int64_t cols;
  const float* scales;  // [G][64], G = ceil(cols / 128)
  int64_t group = 128;
  // e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000 (the same number times 2^-8, subnormals included): shift the
  // byte left by 7, then move the sign from bit 14 to 15 by adding bit 14 to itself (as the AVX-512 kernel).
  void one(int64_t k, int h, __m256 w[2]) const {
    const __m256i a = _mm256_slli_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * kPanel + 16 * h))), 7);
    const __m256i f16 = _mm256_add_epi16(a, _mm256_and_si256(a, _mm256_set1_epi16(0x4000)));
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(f16));
    w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1));
  }
  void pair(int64_t k, int h, __m256 w0[2], __m256 w1[2]) const {
    one(k, h, w0);
    if (k + 1 < cols) one(k + 1, h, w1);
    else w1[0] = w1[1] = _mm256_setzero_ps();
  }
  __m256 scale(int64_t g, int h, int v) const { return _mm256_loadu_ps(scales + g * kPanel + 16 * h + 8 * v); }
  __m256 offset(int64_t, int, int) const { return _mm256_setzero_ps(); }
  float x_sum(int64_t, int64_t) const { return 0.0f; }
};

// A panel's bytes as a stream, for prefetch_ahead: `pair_bytes` per k pair from `panel` on; `end` the call's end.
struct Stream {
  const uint8_t* panel;
  int64_t pair_bytes;
  const void* end;
  void prefetch(int64_t k) const {
    prefetch_ahead(panel + (k / 2) * pair_bytes, end, static_cast<int>((pair_bytes + 63) / 64));
  }
};

// The end of a tile's K range: c [.][64] lanes 16h + 8v (+)= acc. Grouped formats: [k0, k1) is one group g,
// acc its sum of x * code, folded in with the group's scale (and offset times the token's x sum).
template <class D>
constexpr bool grouped() {
  if constexpr (requires { D::kGrouped; }) return D::kGrouped;
  return false;
}
template <class D>
inline void finish(const D& d, int64_t t, int h, int v, int64_t k0, __m256 acc, float* out, bool load_c) {
  if constexpr (grouped<D>()) {
    const int64_t g = k0 / d.group;
    __m256 r = _mm256_fmadd_ps(acc, d.scale(g, h, v), load_c ? _mm256_loadu_ps(out) : _mm256_setzero_ps());
    if constexpr (D::kOffset) r = _mm256_fmadd_ps(d.offset(g, h, v), _mm256_set1_ps(d.x_sum(t, g)), r);
    _mm256_storeu_ps(out, r);
  } else {
    _mm256_storeu_ps(out, acc);
  }
}
// c [MT][64] lanes 16h.. (+)= x [MT][ldx] columns [k0, k1) . the panel's lanes 16h.., k0 even.
// t0: the tile's first token (for its x sums).
template <class D, int MT>
void tile(const float* x, int64_t t0, int64_t ldx, int64_t cols, const D& d, int h, int64_t k0, int64_t k1, float* c,
          bool load_c, const Stream& stream) {
  __m256 acc[MT][2];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 2; ++v)
      acc[t][v] = load_c && !grouped<D>() ? _mm256_loadu_ps(c + t * kPanel + 16 * h + 8 * v) : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    if (h == 0) stream.prefetch(k);  // lanes 16h..: the first quarter's pass reads the panel from memory
    __m256 w0[2], w1[2];
    d.pair(k, h, w0, w1);
    const bool second = k + 1 < cols;  // odd K: the last pair has one k (its weights are zero, x has no k + 1)
    for (int t = 0; t < MT; ++t) {
      const __m256 x0 = _mm256_broadcast_ss(x + t * ldx + k);
      acc[t][0] = _mm256_fmadd_ps(x0, w0[0], acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(x0, w0[1], acc[t][1]);
      if (second) {
        const __m256 x1 = _mm256_broadcast_ss(x + t * ldx + k + 1);
        acc[t][0] = _mm256_fmadd_ps(x1, w1[0], acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(x1, w1[1], acc[t][1]);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 2; ++v) finish(d, t0 + t, h, v, k0, acc[t][v], c + t * kPanel + 16 * h + 8 * v, load_c);
}

// One token over all 64 lanes: 8 accumulators, so the FMA chains (2 per accumulator and k pair) overlap, and
// the panel is read front to back (bf16's k pair is 4 lines; the 16-lane tiles would stride across them).
// Each lane's FMAs are tile()'s, in the same order: the same bits. t: the token's index, for its x sums.
template <class D>
void tile_one_token(const float* x, int64_t t, int64_t cols, const D& d, int64_t k0, int64_t k1, float* c,
                    bool load_c, const Stream& stream) {
  __m256 acc[4][2];
  for (int h = 0; h < 4; ++h)
    for (int v = 0; v < 2; ++v)
      acc[h][v] = load_c && !grouped<D>() ? _mm256_loadu_ps(c + 16 * h + 8 * v) : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    stream.prefetch(k);
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    const bool second = k + 1 < cols;
    const __m256 x1 = second ? _mm256_broadcast_ss(x + k + 1) : _mm256_setzero_ps();
    for (int h = 0; h < 4; ++h) {
      __m256 w0[2], w1[2];
      d.pair(k, h, w0, w1);
      acc[h][0] = _mm256_fmadd_ps(x0, w0[0], acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(x0, w0[1], acc[h][1]);
      if (second) {
        acc[h][0] = _mm256_fmadd_ps(x1, w1[0], acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(x1, w1[1], acc[h][1]);
      }
    }
  }
  for (int h = 0; h < 4; ++h)
    for (int v = 0; v < 2; ++v) finish(d, t, h, v, k0, acc[h][v], c + 16 * h + 8 * v, load_c);
}

// c [T][64] = x [T][cols] . panel (every lane, every token). Grouped formats run each tile once per K group
// of the block.
template <class D>
void panel_sums(const float* x, int64_t tokens, int64_t cols, const D& d, float* c, const Stream& stream) {
  int64_t step = kKBlock;
  if constexpr (grouped<D>()) step = d.group;  // divides kKBlock
  for (int64_t k0 = 0; k0 < cols; k0 += kKBlock) {
    const int64_t k1 = std::min(cols, k0 + kKBlock);
    for (int64_t t = 0; t < tokens; t += kTokenTile) {
      const float* xt = x + t * cols;
      float* ct = c + t * kPanel;
      if (tokens - t == 1) {
        for (int64_t s = k0; s < k1; s += step) tile_one_token(xt, t, cols, d, s, std::min(k1, s + step), ct, s > 0, stream);
        break;
      }
      for (int h = 0; h < 4; ++h) {
        for (int64_t s = k0; s < k1; s += step) {
          const int64_t e = std::min(k1, s + step);
          switch (std::min<int64_t>(kTokenTile, tokens - t)) {
            case 4: tile<D, 4>(xt, t, cols, cols, d, h, s, e, ct, s > 0, stream); break;
            case 3: tile<D, 3>(xt, t, cols, cols, d, h, s, e, ct, s > 0, stream); break;
            default: tile<D, 2>(xt, t, cols, cols, d, h, s, e, ct, s > 0, stream); break;
          }
        }
      }
    }
  }
}

}  // namespace

void run_panels_weight_only_avx2(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const float*>(job.activations);  // [T][cols]
  const int64_t tokens = job.tokens, cols = w.cols;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  if (cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0.0f);  // an empty sum: no K block writes c
  const int64_t groups = w.group ? (cols + w.group - 1) / w.group : 1;
  // Bytes per k pair of a panel [k][64 lanes]: bf16 4 B a lane, int8 and fp8 2 B, int4 1 B.
  const int64_t pair_bytes = w.format == WeightFormat::kBF16 ? 4 * kPanel : w.format == WeightFormat::kInt4 ? kPanel : 2 * kPanel;
  const int64_t panel_bytes = w.format == WeightFormat::kBF16   ? w.k_padded * kPanel * 2
                              : w.format == WeightFormat::kInt4 ? w.k_padded / 2 * kPanel
                                                                : cols * kPanel;  // int8, fp8: [cols][64] bytes
  const auto* data = w.data.as<const uint8_t>();
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const Stream stream{data + panel * panel_bytes, pair_bytes, data + panel_end * panel_bytes};
    switch (w.format) {
      case WeightFormat::kBF16:
        panel_sums(x, tokens, cols, Bf16Decode{w.data.as<const uint16_t>() + panel * w.k_padded * kPanel}, c.data(), stream);
        break;
      case WeightFormat::kInt8: {
        panel_sums(x, tokens, cols, Int8Decode{w.data.as<const int8_t>() + panel * cols * kPanel, cols}, c.data(), stream);
        const float* scale = w.scales.as<const float>() + panel * kPanel;
        for (int64_t t = 0; t < tokens; ++t)
          for (int v = 0; v < kPanel / 8; ++v)
            _mm256_storeu_ps(c.data() + t * kPanel + 8 * v,
                             _mm256_mul_ps(_mm256_loadu_ps(c.data() + t * kPanel + 8 * v), _mm256_loadu_ps(scale + 8 * v)));
        break;
      }
      case WeightFormat::kInt4:
        panel_sums(x, tokens, cols,
                   Int4Decode{w.data.as<const uint8_t>() + panel * (w.k_padded / 2) * kPanel, w.group,
                              w.scales.as<const float>() + panel * groups * kPanel,
                              w.offsets.as<const float>() + panel * groups * kPanel, job.group_sums, groups},
                   c.data(), stream);
        break;
      case WeightFormat::kFP8E4M3:
        panel_sums(x, tokens, cols,
                   Fp8Decode{w.data.as<const uint8_t>() + panel * cols * kPanel, cols,
                             w.scales.as<const float>() + panel * groups * kPanel, w.group},
                   c.data(), stream);
        break;
      default: return;  // the dispatcher sends only the four formats above here
    }
    apply_epilogue_scalar(job.epilogue, w, panel, tokens, c.data());
  }
}

}  // namespace moex::kernels::x86

// The fp8 (E4M3 "fn", one power-of-two scale per 128 values) wire codec, AVX-512. Hand-written because GCC
// does not vectorise the scalar codec (codec.cc): its E4M3 rounding and the per-block max stay scalar, so
// fp8 ran at 2-5 GB/s, below the shared-memory fp32 bandwidth it is meant to save. Each lane does the same
// integer and float steps as the scalar code, so scales, codes and decoded floats are bit-identical on every
// input (tests/unit/comm_codec_test.cc compares the two).
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "moex/base/dtype.h"
#include "moex/comm/codec.h"
#include "moex/comm/codec_impl.h"

// After the includes: inline functions from the headers above stay baseline x86-64, so an out-of-line copy
// the linker may share with baseline code never holds AVX-512 instructions. comm/ has no per-ISA build
// flags; the codec is called only on CPUs with these extensions (codec.cc checks).
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
// GCC would fuse _mm512_mul_ps then _mm512_add_ps into one FMA (one rounding instead of two): the decoded
// product must round on its own, as in the scalar code, or an overflowing product added to a large dst of
// the other sign would give a finite sum here and inf there.
#pragma GCC optimize("fp-contract=off")
// GCC 12 warns about the deliberately undefined vectors inside its own intrinsics (_mm512_undefined_*;
// kernels/x86 passes -Wno-maybe-uninitialized for the same reason).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace moex::comm::x86 {
namespace {

constexpr size_t kLanes = 16;
constexpr size_t kBlockVectors = kF8BlockElems / kLanes;
// Encode works on groups of 16 blocks, one block per lane of the scale computation.
constexpr size_t kGroupBlocks = 16;
constexpr size_t kGroupElems = kGroupBlocks * kF8BlockElems;

// The first n lanes (all 16 when n >= 16).
inline __mmask16 first_lanes(size_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

// E4M3 code of each lane of v (already divided by its block's scale), in the low byte of the lane:
// f32_to_e4m3_scaled of codec.cc, step for step.
inline __m512i e4m3_codes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  // Normal range: round to nearest even at bit 20 and rebias 127 -> 7 in one add, (m + 0x7ffff + lsb -
  // (120 << 23)) >> 20, equal to the scalar ((m + 0x7ffff + lsb) >> 20) - (120 << 3) wherever this result
  // is used (m >= 2^-6, so the sum stays above 120 << 23).
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), _mm512_set1_epi32(1));
  const __m512i rebias = _mm512_set1_epi32(static_cast<int>(0x7ffffu - (120u << 23)));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(magnitude, lsb), rebias), 20);
  // Subnormal range: multiples of 2^-9; adding 2^23 rounds |v| * 512 to an integer (ties to even). Fused is
  // exact here: |v| * 512 < 8 needs no rounding, so only the sum rounds, as in the scalar code.
  const __m512 sub_sum =
      _mm512_fmadd_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(512.0f), _mm512_set1_ps(8388608.0f));
  const __m512i sub = _mm512_and_si512(_mm512_castps_si512(sub_sum), _mm512_set1_epi32(0xf));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(magnitude, _mm512_set1_epi32(0x3c800000));  // 2^-6
  const __m512i code = _mm512_min_epu32(_mm512_mask_blend_epi32(is_sub, normal, sub), _mm512_set1_epi32(0x7e));
  // code | ((bits >> 24) & 0x80): the sign bit moved to bit 7.
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), code, 0xea);
}

// fp32 value of each lane's E4M3 code (zero-extended): e4m3_to_f32 of codec.cc.
inline __m512 e4m3_values(__m512i code) {
  // Normal codes: exponent and mantissa moved up to fp32's fields and rebiased 7 -> 127.
  const __m512i fields = _mm512_and_si512(_mm512_slli_epi32(code, 20), _mm512_set1_epi32(0x7f << 20));
  const __m512i normal = _mm512_add_epi32(fields, _mm512_set1_epi32(120 << 23));
  // Subnormal codes (exponent field 0), m / 512 = (2^-6 + m * 2^-9) - 2^-6: the first term is the normal
  // pattern with bias 121, and both steps are exact, so this equals the scalar m * (1/512), +0 for m = 0.
  const __mmask16 is_sub = _mm512_testn_epi32_mask(code, _mm512_set1_epi32(0x78));
  const __m512 bias_121 = _mm512_castsi512_ps(_mm512_add_epi32(normal, _mm512_set1_epi32(1 << 23)));
  const __m512 magnitude =
      _mm512_mask_sub_ps(_mm512_castsi512_ps(normal), is_sub, bias_121, _mm512_set1_ps(1.0f / 64.0f));
  // magnitude | ((code << 24) & sign bit)
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  return _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(_mm512_castps_si512(magnitude), _mm512_slli_epi32(code, 24), sign_bit, 0xf8));
}

inline __m512i abs_bits(__m512 x) {
  return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
}

// |x| bits of one block of n <= 128 values, reduced to one vector whose max over lanes is the block's max.
// Integer max as in the scalar code: for non-negative floats integer order is float order, and NaN sorts
// above inf. Lanes past n load as zero, which leaves the max alone.
inline __m512i block_abs_max(const float* src, size_t n) {
  if (n == kF8BlockElems) {  // a pairwise tree: a short dependency chain
    const __m512i m01 = _mm512_max_epu32(abs_bits(_mm512_loadu_ps(src)), abs_bits(_mm512_loadu_ps(src + 16)));
    const __m512i m23 = _mm512_max_epu32(abs_bits(_mm512_loadu_ps(src + 32)), abs_bits(_mm512_loadu_ps(src + 48)));
    const __m512i m45 = _mm512_max_epu32(abs_bits(_mm512_loadu_ps(src + 64)), abs_bits(_mm512_loadu_ps(src + 80)));
    const __m512i m67 = _mm512_max_epu32(abs_bits(_mm512_loadu_ps(src + 96)), abs_bits(_mm512_loadu_ps(src + 112)));
    return _mm512_max_epu32(_mm512_max_epu32(m01, m23), _mm512_max_epu32(m45, m67));
  }
  __m512i m = _mm512_setzero_si512();
  for (size_t i = 0; i < n; i += kLanes) {
    m = _mm512_max_epu32(m, abs_bits(_mm512_maskz_loadu_ps(first_lanes(n - i), src + i)));
  }
  return m;
}

struct BlockScales {
  __m512 scale, inverse;
};

// Scales and their inverses from the max |x| bits of 16 blocks, one per lane: f8_block_scale of codec.cc.
inline BlockScales block_scales(__m512i absmax_bits) {
  const __m512 absmax = _mm512_castsi512_ps(absmax_bits);
  // Float compares as in the scalar code (a zero, inf or NaN max gives scale 1), so that subnormals are
  // treated the same under any MXCSR setting.
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  const __mmask16 finite_positive = _mm512_cmp_ps_mask(absmax, _mm512_setzero_ps(), _CMP_GT_OQ) &
                                    _mm512_cmp_ps_mask(absmax, largest, _CMP_LE_OQ);
  const __m512i quotient = _mm512_castps_si512(_mm512_div_ps(absmax, _mm512_set1_ps(kF8E4M3Max)));
  // Exponent rounded up unless the quotient is a power of two: adding 0x7fffff carries into the exponent
  // exactly when the mantissa is not zero. A zero quotient gives 0, and the clamp to [1, 254] makes it 1, as
  // the scalar code does. The quotient is below 2^120 (absmax is finite), so the sum cannot overflow.
  const __m512i rounded_up = _mm512_srli_epi32(_mm512_add_epi32(quotient, _mm512_set1_epi32(0x7fffff)), 23);
  const __m512i exponent = _mm512_min_epu32(_mm512_max_epu32(rounded_up, _mm512_set1_epi32(1)), _mm512_set1_epi32(254));
  const __m512i one = _mm512_castps_si512(_mm512_set1_ps(1.0f));
  const __m512i scale = _mm512_mask_slli_epi32(one, finite_positive, exponent, 23);
  // 1 / scale, exact: the exponent mirrored around the bias. The scale is at most 2^120, so the inverse is a
  // normal float.
  const __m512i inverse = _mm512_sub_epi32(_mm512_set1_epi32(254 << 23), scale);
  return {_mm512_castsi512_ps(scale), _mm512_castsi512_ps(inverse)};
}

// Codes of one block of n <= 128 values; kFull: n == 128, no masks.
template <bool kFull>
inline void encode_block(const float* src, size_t n, __m512 inverse, uint8_t* codes) {
  const size_t vectors = kFull ? kBlockVectors : (n + kLanes - 1) / kLanes;
  for (size_t j = 0; j < vectors; ++j) {
    const __mmask16 lanes = kFull ? static_cast<__mmask16>(0xffff) : first_lanes(n - j * kLanes);
    const __m512 x = kFull ? _mm512_loadu_ps(src + j * kLanes) : _mm512_maskz_loadu_ps(lanes, src + j * kLanes);
    const __m512i code = e4m3_codes(_mm512_mul_ps(x, inverse));
    if constexpr (kFull) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j * kLanes), _mm512_cvtepi32_epi8(code));
    } else {
      _mm512_mask_cvtepi32_storeu_epi8(codes + j * kLanes, lanes, code);
    }
  }
}

// Up to 16 blocks (n <= 2048 values): first the max of every block and the 16 scales at once, then the
// codes, reading the values again from L1. Two passes because a scale computed just before its block's
// conversion is a dependency chain (reduction, division, exponent arithmetic) that the conversion waits on:
// block by block, encode ran at half the speed.
template <bool kFullGroup>
inline void encode_group(const float* src, size_t n, float* scales, uint8_t* codes) {
  const size_t blocks = kFullGroup ? kGroupBlocks : (n + kF8BlockElems - 1) / kF8BlockElems;
  alignas(64) uint32_t maxima[kGroupBlocks] = {};  // blocks past n: 0, scale 1, not stored
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * kF8BlockElems;
    const size_t size = kFullGroup ? kF8BlockElems : std::min(kF8BlockElems, n - begin);
    maxima[b] = _mm512_reduce_max_epu32(block_abs_max(src + begin, size));
  }
  const BlockScales block = block_scales(_mm512_load_si512(maxima));
  _mm512_mask_storeu_ps(scales, first_lanes(blocks), block.scale);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t begin = b * kF8BlockElems;
    const __m512 inverse = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(b)), block.inverse);
    if (kFullGroup || begin + kF8BlockElems <= n) {
      encode_block<true>(src + begin, kF8BlockElems, inverse, codes + begin);
    } else {
      encode_block<false>(src + begin, n - begin, inverse, codes + begin);
    }
  }
}

// dst [n] (+)= codes [n] * scale for one block of n <= 128 values; kFull: n == 128.
template <bool kAdd, bool kFull>
inline void decode_block(float scale, const uint8_t* codes, size_t n, float* dst) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  const size_t vectors = kFull ? kBlockVectors : (n + kLanes - 1) / kLanes;
  for (size_t j = 0; j < vectors; ++j) {
    const __mmask16 lanes = kFull ? static_cast<__mmask16>(0xffff) : first_lanes(n - j * kLanes);
    const __m128i bytes = kFull ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * kLanes))
                                : _mm_maskz_loadu_epi8(lanes, codes + j * kLanes);
    __m512 value = _mm512_mul_ps(e4m3_values(_mm512_cvtepu8_epi32(bytes)), scale_v);
    float* out = dst + j * kLanes;
    if constexpr (kAdd) {
      value = _mm512_add_ps(kFull ? _mm512_loadu_ps(out) : _mm512_maskz_loadu_ps(lanes, out), value);
    }
    if constexpr (kFull) {
      _mm512_storeu_ps(out, value);
    } else {
      _mm512_mask_storeu_ps(out, lanes, value);
    }
  }
}

template <bool kAdd>
void decode(const float* scales, const uint8_t* codes, size_t count, float* dst) {
  size_t begin = 0, block = 0;
  for (; begin + kF8BlockElems <= count; begin += kF8BlockElems, ++block) {
    decode_block<kAdd, true>(scales[block], codes + begin, kF8BlockElems, dst + begin);
  }
  if (begin < count) decode_block<kAdd, false>(scales[block], codes + begin, count - begin, dst + begin);
}

}  // namespace

void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes) {
  size_t begin = 0;
  for (; begin + kGroupElems <= count; begin += kGroupElems) {
    encode_group<true>(src + begin, kGroupElems, scales + begin / kF8BlockElems, codes + begin);
  }
  if (begin < count) encode_group<false>(src + begin, count - begin, scales + begin / kF8BlockElems, codes + begin);
}

void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst) {
  decode<false>(scales, codes, count, dst);
}

void f8_block_decode_add(const float* scales, const uint8_t* codes, size_t count, float* dst) {
  decode<true>(scales, codes, count, dst);
}

}  // namespace moex::comm::x86

#include "moex/comm/codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/comm/codec_impl.h"

// The codec loops are written branch-free for the auto-vectoriser; comm/ is built for baseline x86-64, so
// each hot loop is also compiled for AVX2 and AVX-512 and picked at load time (GCC function multi-versioning).
// Every version computes the same elementwise arithmetic, so results do not depend on the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOEX_CODEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
// The avx512f clone may fuse a product and the sum it feeds into one FMA, which the other clones (no FMA)
// cannot: a product that overflows then gives a finite sum on one CPU and inf on another.
#define MOEX_CODEC_NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define MOEX_CODEC_CLONES
#define MOEX_CODEC_NO_FMA
#endif

namespace moex::comm {
namespace {

inline uint32_t float_bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float bits_float(uint32_t bits) { return std::bit_cast<float>(bits); }

// Smallest power of two s with absmax / s <= 448, so every scaled value fits E4M3 without saturating.
inline float f8_block_scale(float absmax) {
  if (!(absmax > 0.0f) || !std::isfinite(absmax)) return 1.0f;
  const uint32_t bits = float_bits(absmax / kF8E4M3Max);
  uint32_t exponent = bits >> 23;                     // absmax > 0: sign bit is 0
  if ((bits & 0x7fffffu) != 0 || exponent == 0) ++exponent;  // round up to the next power of two
  exponent = std::clamp<uint32_t>(exponent, 1, 254);
  return bits_float(exponent << 23);
}

// |v| <= ~448, round to nearest even, E4M3 "fn" encoding. Branch-free so the loop vectorises.
inline uint8_t f32_to_e4m3_scaled(float v) {
  const uint32_t bits = float_bits(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  // Normal range (|v| >= 2^-6): drop 20 mantissa bits with round-to-nearest-even, rebias 127 -> 7.
  const uint32_t rounded = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
  const uint32_t normal_code = rounded - (120u << 3);
  // Subnormal range: multiples of 2^-9; adding 2^23 rounds |v|*512 to an integer (ties to even).
  const float sub = bits_float(magnitude) * 512.0f + 8388608.0f;
  const uint32_t sub_code = float_bits(sub) & 0xfu;  // 0..8; 8 is the smallest normal, same code
  uint32_t code = magnitude < 0x3c800000u ? sub_code : normal_code;  // 0x3c800000 = 2^-6
  code = std::min<uint32_t>(code, 0x7eu);                              // saturate at 448
  return static_cast<uint8_t>(sign | code);
}

inline float e4m3_to_f32(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t magnitude = code & 0x7fu;
  const float normal = bits_float((magnitude << 20) + (120u << 23));
  const float sub = static_cast<float>(magnitude & 7u) * (1.0f / 512.0f);
  const float value = (magnitude >> 3) == 0 ? sub : normal;
  return bits_float(float_bits(value) | sign);
}

size_t num_blocks(size_t count) { return (count + kF8BlockElems - 1) / kF8BlockElems; }

// The AVX-512 fp8 codec (x86/codec_avx512.cc) gives the same bytes and floats as ref::, several times
// faster. use_x86_kernels() is false under MOEX_ISA=ref; the x86 codec needs AVX-512 F, BW, VL and FMA.
bool use_avx512_f8() {
  static const bool yes = use_x86_kernels() && cpu_features().has_avx512_kernels();
  return yes;
}

}  // namespace

WireFormat wire_format_for(CommDType dtype) {
  switch (dtype) {
    case CommDType::kF32: return WireFormat::kF32;
    case CommDType::kBF16: return WireFormat::kBF16;
    case CommDType::kF8: return WireFormat::kF8;
  }
  return WireFormat::kF32;
}

size_t wire_bytes(WireFormat format, size_t count) {
  switch (format) {
    case WireFormat::kF32: return count * 4;
    case WireFormat::kBF16: return count * 2;
    case WireFormat::kF8: return count + 4 * num_blocks(count);
  }
  return 0;
}

namespace ref {

MOEX_CODEC_CLONES void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes) {
  for (size_t block = 0; block * kF8BlockElems < count; ++block) {
    const size_t begin = block * kF8BlockElems, end = std::min(count, begin + kF8BlockElems);
    // |x| as bits: for non-negative floats integer order is float order, and an integer max reduction
    // vectorises where a float one (NaN rules) does not. A NaN or inf in the block makes the scale 1.
    uint32_t absmax_bits = 0;
    for (size_t i = begin; i < end; ++i) absmax_bits = std::max(absmax_bits, float_bits(src[i]) & 0x7fffffffu);
    const float absmax = bits_float(absmax_bits);
    const float scale = f8_block_scale(absmax), inverse = 1.0f / scale;  // exact: powers of two
    scales[block] = scale;
    for (size_t i = begin; i < end; ++i) codes[i] = f32_to_e4m3_scaled(src[i] * inverse);
  }
}

MOEX_CODEC_CLONES void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst) {
  for (size_t block = 0; block * kF8BlockElems < count; ++block) {
    const size_t begin = block * kF8BlockElems, end = std::min(count, begin + kF8BlockElems);
    const float scale = scales[block];
    for (size_t i = begin; i < end; ++i) dst[i] = e4m3_to_f32(codes[i]) * scale;
  }
}

MOEX_CODEC_CLONES MOEX_CODEC_NO_FMA void f8_block_decode_add(const float* scales, const uint8_t* codes, size_t count,
                                                             float* dst) {
  for (size_t block = 0; block * kF8BlockElems < count; ++block) {
    const size_t begin = block * kF8BlockElems, end = std::min(count, begin + kF8BlockElems);
    const float scale = scales[block];
    for (size_t i = begin; i < end; ++i) dst[i] += e4m3_to_f32(codes[i]) * scale;
  }
}

}  // namespace ref

void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes) {
  if (use_avx512_f8()) return x86::f8_block_encode(src, count, scales, codes);
  ref::f8_block_encode(src, count, scales, codes);
}

void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst) {
  if (use_avx512_f8()) return x86::f8_block_decode(scales, codes, count, dst);
  ref::f8_block_decode(scales, codes, count, dst);
}

static void f8_block_decode_add(const float* scales, const uint8_t* codes, size_t count, float* dst) {
  if (use_avx512_f8()) return x86::f8_block_decode_add(scales, codes, count, dst);
  ref::f8_block_decode_add(scales, codes, count, dst);
}

MOEX_CODEC_CLONES void add_f32(const float* __restrict src, size_t count, float* __restrict dst) {
  for (size_t i = 0; i < count; ++i) dst[i] += src[i];
}

MOEX_CODEC_CLONES void add_f32_publish(const float* __restrict src, size_t count, float* __restrict dst, float* __restrict copy) {
  for (size_t i = 0; i < count; ++i) copy[i] = dst[i] += src[i];
}

MOEX_CODEC_CLONES void sum_to_all_f32(float* const* buffers, int p, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float sum = buffers[0][i];
    for (int j = 1; j < p; ++j) sum += buffers[j][i];
    for (int j = 0; j < p; ++j) buffers[j][i] = sum;
  }
}

MOEX_CODEC_CLONES static void bf16_decode_add(const uint16_t* __restrict src, size_t count, float* __restrict dst) {
  for (size_t i = 0; i < count; ++i) dst[i] += bf16_to_f32(src[i]);
}

MOEX_CODEC_CLONES void bf16_to_f32_span(const uint16_t* src, size_t count, float* dst) {
  for (size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(src[i]);
}

MOEX_CODEC_CLONES void f32_to_bf16_span(const float* src, size_t count, uint16_t* dst) {
  for (size_t i = 0; i < count; ++i) dst[i] = f32_to_bf16(src[i]);
}

void wire_encode(WireFormat format, const float* src, size_t count, void* dst) {
  switch (format) {
    case WireFormat::kF32: std::memcpy(dst, src, count * 4); return;
    case WireFormat::kBF16: f32_to_bf16_span(src, count, static_cast<uint16_t*>(dst)); return;
    case WireFormat::kF8: {
      auto* scales = static_cast<float*>(dst);
      f8_block_encode(src, count, scales, reinterpret_cast<uint8_t*>(scales + num_blocks(count)));
      return;
    }
  }
}

void wire_decode(WireFormat format, const void* src, size_t count, float* dst) {
  switch (format) {
    case WireFormat::kF32: std::memcpy(dst, src, count * 4); return;
    case WireFormat::kBF16: bf16_to_f32_span(static_cast<const uint16_t*>(src), count, dst); return;
    case WireFormat::kF8: {
      const auto* scales = static_cast<const float*>(src);
      f8_block_decode(scales, reinterpret_cast<const uint8_t*>(scales + num_blocks(count)), count, dst);
      return;
    }
  }
}

void wire_decode_add(WireFormat format, const void* src, size_t count, float* dst) {
  switch (format) {
    case WireFormat::kF32: add_f32(static_cast<const float*>(src), count, dst); return;
    case WireFormat::kBF16: bf16_decode_add(static_cast<const uint16_t*>(src), count, dst); return;
    case WireFormat::kF8: {
      const auto* scales = static_cast<const float*>(src);
      f8_block_decode_add(scales, reinterpret_cast<const uint8_t*>(scales + num_blocks(count)), count, dst);
      return;
    }
  }
}

void wire_round_trip(WireFormat format, float* data, size_t count) {
  switch (format) {
    case WireFormat::kF32: return;
    case WireFormat::kBF16:
      for (size_t i = 0; i < count; ++i) data[i] = bf16_to_f32(f32_to_bf16(data[i]));
      return;
    case WireFormat::kF8: {
      uint8_t codes[kF8BlockElems];
      float scale;
      for (size_t begin = 0; begin < count; begin += kF8BlockElems) {
        const size_t n = std::min(kF8BlockElems, count - begin);
        f8_block_encode(data + begin, n, &scale, codes);
        f8_block_decode(&scale, codes, n, data + begin);
      }
      return;
    }
  }
}

}  // namespace moex::comm

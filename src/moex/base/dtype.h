// Element types and scalar conversions. The fast (vector) conversions live with the kernels that use them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace moex {

enum class DType : uint8_t { kF32, kF16, kBF16, kF8E4M3, kI32, kI64, kU8, kI8 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // safetensors spelling: "F32", "BF16", ...
// Parses a safetensors dtype name; returns false for names MoEX does not load.
bool dtype_from_name(std::string_view name, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaN kept quiet: the same rounding as torch's .to(torch.bfloat16).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// OCP FP8 E4M3 (the "fn" variant: no infinities, max 448, one NaN pattern per sign).
float f8e4m3_to_f32(uint8_t v);
constexpr float kF8E4M3Max = 448.0f;
// Round to nearest even, saturating to +-448 (infinities too), NaN to 0x7f with its sign. The definition, step by
// step (frexp, nearbyint): the reference the fast form below is tested against.
uint8_t f32_to_f8e4m3_ref(float f);
// The same codes for every float (checked exhaustively over all 2^32 once; the unit test checks a dense sample),
// without libm calls or branches on the value, so a loop over it vectorizes: quantizing a model to fp8 at load
// went through the reference at ~20 ns a weight. a is rounded to the e4m3 grid of its binade (step 2^(E - 3),
// 2^-9 below 2^-6) by adding and taking off 1.5 * 2^23 * step, whose float spacing is the step.
inline uint8_t f32_to_f8e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 24) & 0x80u, abs_bits = bits & 0x7fffffffu;
  float a;
  std::memcpy(&a, &abs_bits, 4);
  int32_t e = static_cast<int32_t>(abs_bits >> 23) - 127;  // a's binade; clamped to e4m3's grid (and below 448)
  e = e < -6 ? -6 : e;
  e = e > 8 ? 8 : e;
  const uint32_t magic_bits = static_cast<uint32_t>(e - 3 + 23 + 127) << 23 | (1u << 22);  // 1.5 * 2^23 * step
  float magic;
  std::memcpy(&magic, &magic_bits, 4);
  const float q = (a + magic) - magic;  // a on the grid, ties to even
  uint32_t qb;
  std::memcpy(&qb, &q, 4);
  const uint32_t normal = ((qb >> 20) & 0x7ffu) - (120u << 3);  // (exponent + 7) << 3 | the top 3 mantissa bits
  const uint32_t sub = static_cast<uint32_t>((q < 0.015625f ? q : 0.0f) * 512.0f);  // below 2^-6: q / 2^-9
  uint32_t code = q < 0.015625f ? sub : normal;
  code = q >= kF8E4M3Max || a >= kF8E4M3Max ? 0x7eu : code;
  code = a != a ? 0x7fu : code;
  return static_cast<uint8_t>(sign | code);
}

}  // namespace moex

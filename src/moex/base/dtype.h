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
uint8_t f32_to_f8e4m3(float f);  // round to nearest even, saturating to +-448
constexpr float kF8E4M3Max = 448.0f;

}  // namespace moex

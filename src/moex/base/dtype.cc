#include "moex/base/dtype.h"

#include <cmath>

namespace moex {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
    case DType::kI8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kI8: return "I8";
  }
  return "?";
}

bool dtype_from_name(std::string_view name, DType* out) {
  static constexpr struct { std::string_view name; DType dtype; } kNames[] = {
      {"F32", DType::kF32}, {"F16", DType::kF16}, {"BF16", DType::kBF16}, {"F8_E4M3", DType::kF8E4M3},
      {"I32", DType::kI32}, {"I64", DType::kI64}, {"U8", DType::kU8},
      {"I8", DType::kI8}};
  for (const auto& entry : kNames) {
    if (entry.name == name) {
      *out = entry.dtype;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

uint16_t f32_to_f16(float f) {
  // Generic round-to-nearest-even via the binary layout; cold path (tests and writers only).
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0));
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exponent <= 0) {
    if (exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | half);
}

float f8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = v >> 7, exponent = (v >> 3) & 0xfu, mantissa = v & 0x7u;
  float value;
  if (exponent == 0xf && mantissa == 0x7) {
    value = NAN;
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 8u), static_cast<int>(exponent) - 10);
  }
  return sign ? -value : value;
}

uint8_t f32_to_f8e4m3_ref(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7f);
  float a = std::fabs(f);
  if (a >= kF8E4M3Max) return static_cast<uint8_t>(sign | 0x7e);  // saturate
  if (a < std::ldexp(1.0f, -10)) return sign;                     // below half the smallest subnormal
  int exponent;
  std::frexp(a, &exponent);        // a = m * 2^exponent, m in [0.5, 1)
  int e_biased = exponent - 1 + 7;  // E4M3 bias 7
  float step = e_biased <= 0 ? std::ldexp(1.0f, -9) : std::ldexp(1.0f, exponent - 1 - 3);
  float q = std::nearbyint(a / step) * step;  // nearbyint: ties to even under the default rounding mode
  if (q >= kF8E4M3Max) return static_cast<uint8_t>(sign | 0x7e);
  if (q == 0.0f) return sign;
  std::frexp(q, &exponent);
  e_biased = exponent - 1 + 7;
  if (e_biased <= 0) return static_cast<uint8_t>(sign | static_cast<uint8_t>(q / std::ldexp(1.0f, -9)));
  const int mantissa = static_cast<int>(std::ldexp(q, -(exponent - 1) + 3)) - 8;
  return static_cast<uint8_t>(sign | (e_biased << 3) | mantissa);
}

}  // namespace moex

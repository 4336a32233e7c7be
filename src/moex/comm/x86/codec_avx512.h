// AVX-512 fp8 block codec of the wire (codec_avx512.cc), bit-identical to ref:: in comm/codec_ref.h.
// Callers check the CPU first (AVX-512 F, BW, VL and FMA).
#pragma once
#include <cstddef>
#include <cstdint>

namespace moex::comm::x86 {

// src [count] fp32 -> scales [ceil(count/128)], codes [count]
void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes);
// dst [count] = decode(scales, codes)
void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst);
// dst [count] += decode(scales, codes)
void f8_block_decode_add(const float* scales, const uint8_t* codes, size_t count, float* dst);

}  // namespace moex::comm::x86

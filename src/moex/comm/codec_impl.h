// The two implementations of the fp8 block codec behind codec.h's f8_block_*: ref:: (scalar, codec.cc), the
// fallback on CPUs without AVX-512 and the oracle that x86:: (x86/codec_avx512.cc; callers check the CPU
// first: AVX-512 F, BW, VL and FMA) must match bit for bit, because ranks on different CPUs must decode the
// same floats. Tests call both directly to compare them.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moex::comm {
namespace ref {
// Same contracts as codec.h's f8_block_encode / f8_block_decode; decode_add adds into dst instead.
void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes);
void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst);
void f8_block_decode_add(const float* scales, const uint8_t* codes, size_t count, float* dst);
}  // namespace ref

namespace x86 {  // the same three, bit-identical to ref::
void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes);
void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst);
void f8_block_decode_add(const float* scales, const uint8_t* codes, size_t count, float* dst);
}  // namespace x86
}  // namespace moex::comm

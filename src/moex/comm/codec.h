// Wire codecs: how a span of fp32 values travels between ranks. Sums are always taken in fp32; a codec only
// decides what is copied. FP8 (E4M3) uses one power-of-two fp32 scale per 128-element block, so decoding
// is exact scaling and re-encoding a decoded block gives the same bytes (forwarding never adds error).
// Blocks are aligned to the start of the segment passed in; algorithms cut buffers at multiples of
// wire_granule() so that a segment's blocks are the same blocks whichever rank encodes them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moex/comm/types.h"

namespace moex::comm {

enum class WireFormat : uint8_t { kF32, kBF16, kF8 };

constexpr size_t kF8BlockElems = 128;

WireFormat wire_format_for(CommDType dtype);
// Elements per codec block: buffers are partitioned in multiples of this.
inline size_t wire_granule(WireFormat format) { return format == WireFormat::kF8 ? kF8BlockElems : 1; }
// Encoded size of `count` elements. fp8: [ceil(count/128) fp32 scales][count E4M3 bytes].
size_t wire_bytes(WireFormat format, size_t count);
inline bool wire_is_lossless(WireFormat format) { return format == WireFormat::kF32; }

// src [count] fp32 -> dst [wire_bytes(count)]
void wire_encode(WireFormat format, const float* src, size_t count, void* dst);
// src [wire_bytes(count)] -> dst [count] fp32 (overwrite)
void wire_decode(WireFormat format, const void* src, size_t count, float* dst);
// dst [count] += decode(src): the receive side of a reduction, accumulating in fp32
void wire_decode_add(WireFormat format, const void* src, size_t count, float* dst);
// data = decode(encode(data)): the owner of a final value keeps what every other rank will receive,
// so all ranks end with identical results.
void wire_round_trip(WireFormat format, float* data, size_t count);

// dst [count] += src [count]
void add_f32(const float* src, size_t count, float* dst);
// dst [count] += src [count], and the sums also written to copy [count]: the last reduction step of a rank
// that publishes its result (one pass over dst instead of an add and then a copy).
void add_f32_publish(const float* src, size_t count, float* dst, float* copy);
// For i in [begin, end): the sum buffers[0][i] + ... + buffers[p-1][i], in that order, stored to every
// buffers[j][i] (the zero-copy shared-memory all-reduce's one pass).
void sum_to_all_f32(float* const* buffers, int p, size_t begin, size_t end);
// bf16 buffer <-> fp32 working buffer
void bf16_to_f32_span(const uint16_t* src, size_t count, float* dst);
void f32_to_bf16_span(const float* src, size_t count, uint16_t* dst);

// The fp8 block codec on its own: scales [ceil(count/128)], codes [count]. AVX-512 when the CPU has it,
// else the scalar ref:: of codec_impl.h; both give the same bits.
void f8_block_encode(const float* src, size_t count, float* scales, uint8_t* codes);
void f8_block_decode(const float* scales, const uint8_t* codes, size_t count, float* dst);

}  // namespace moex::comm

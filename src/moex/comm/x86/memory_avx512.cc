// Streaming copy and the zero-copy sum for the shared-memory all-reduce, AVX-512. Hand-written because the
// destination is a buffer far larger than the caches that nobody reads before the call returns: non-temporal
// stores write it without first reading every line into the cache (what memcpy's ordinary stores do below
// its own non-temporal threshold, which is sized for one process and is larger than our chunks).
// Compiled for AVX-512 by the pragma (comm/ has no per-ISA build flags); called only when the CPU has it.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "moex/comm/codec.h"
#include "moex/comm/x86/memory_avx512.h"

// After the includes, so inline functions from the headers stay baseline x86-64 (an out-of-line copy the
// linker may share with other files must not hold AVX-512 instructions).
#pragma GCC target("avx512f")

namespace moex::comm::x86 {

void copy_f32_streaming(float* dst, const float* src, size_t count) {
  size_t i = 0;
  while (i < count && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0) dst[i] = src[i], ++i;  // align the stores
  for (; i + 64 <= count; i += 64) {
    const __m512 a = _mm512_loadu_ps(src + i), b = _mm512_loadu_ps(src + i + 16);
    const __m512 c = _mm512_loadu_ps(src + i + 32), d = _mm512_loadu_ps(src + i + 48);
    _mm512_stream_ps(dst + i, a);
    _mm512_stream_ps(dst + i + 16, b);
    _mm512_stream_ps(dst + i + 32, c);
    _mm512_stream_ps(dst + i + 48, d);
  }
  for (; i < count; ++i) dst[i] = src[i];
  _mm_sfence();  // the streamed lines are visible before any flag that says "done"
}

template <bool kStream>
static void sum_to_all_aligned(float* const* buffers, int p, size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += 16) {
    __m512 sum = _mm512_loadu_ps(buffers[0] + i);
    for (int j = 1; j < p; ++j) sum = _mm512_add_ps(sum, _mm512_loadu_ps(buffers[j] + i));
    for (int j = 0; j < p; ++j) {
      if constexpr (kStream) _mm512_stream_ps(buffers[j] + i, sum);
      else _mm512_storeu_ps(buffers[j] + i, sum);
    }
  }
}

void sum_to_all_f32(float* const* buffers, int p, size_t begin, size_t end, bool streaming) {
  // Streaming stores need 64-byte aligned addresses in every buffer; registered buffers share one offset
  // in page-aligned slots, so aligning buffers[0] aligns them all (checked, else ordinary stores). The
  // unaligned head and the short tail take the portable loop.
  size_t i = begin;
  while (i < end && (reinterpret_cast<uintptr_t>(buffers[0] + i) & 63) != 0) ++i;
  comm::sum_to_all_f32(buffers, p, begin, i);
  bool aligned = true;
  for (int j = 1; j < p; ++j) aligned = aligned && (reinterpret_cast<uintptr_t>(buffers[j] + i) & 63) == 0;
  const size_t vector_end = i + (end - i) / 16 * 16;
  if (streaming && aligned) {
    sum_to_all_aligned<true>(buffers, p, i, vector_end);
    _mm_sfence();
  } else {
    sum_to_all_aligned<false>(buffers, p, i, vector_end);
  }
  comm::sum_to_all_f32(buffers, p, vector_end, end);
}

}  // namespace moex::comm::x86

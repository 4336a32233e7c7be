// Streaming copy and add for the shared-memory all-reduce, AVX-512. Hand-written because the copy's
// destination is a buffer far larger than the caches that nobody reads before the call returns: non-temporal
// stores write it without first reading every line into the cache (what memcpy's ordinary stores do below
// its own non-temporal threshold, which is sized for one process and is larger than our chunks).
// Compiled for AVX-512 by the pragma (comm/ has no per-ISA build flags); called only when the CPU has it.
#pragma GCC target("avx512f")
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "moex/comm/x86/memory_avx512.h"

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

void add_f32(const float* src, size_t count, float* dst) {
  size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), _mm512_loadu_ps(src + i)));
    _mm512_storeu_ps(dst + i + 16, _mm512_add_ps(_mm512_loadu_ps(dst + i + 16), _mm512_loadu_ps(src + i + 16)));
  }
  for (; i < count; ++i) dst[i] += src[i];
}

}  // namespace moex::comm::x86

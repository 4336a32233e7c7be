#include <immintrin.h>

#include <cstdint>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {

float stream_read_avx512(const void* data, size_t bytes, int64_t prefetch_lead) {
  const auto* p = static_cast<const uint8_t*>(data);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  if (prefetch_lead > 0) {  // the same loop with the four lines prefetch_lead ahead (stopping at the buffer's end)
    size_t i = 0;
    const size_t lead = static_cast<size_t>(prefetch_lead);
    for (; i + 256 + lead <= bytes; i += 256) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + lead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + lead + 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + lead + 128), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + lead + 192), _MM_HINT_T1);
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 64));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 128));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 192));
    }
    p += i;
    bytes -= i;
  }
  for (size_t i = 0; i + 256 <= bytes; i += 256) {  // four independent chains: the loads, not the adds, limit
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 64));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 128));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 192));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

float stream_read_exact_avx512(const void* data, size_t bytes, size_t* read) {
  const auto* p = static_cast<const uint8_t*>(data);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {  // as stream_read_avx512
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 64));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 128));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 192));
  }
  for (; i + 64 <= bytes; i += 64) a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
  if (i < bytes) {  // the last partial line: the masked load touches only its bytes
    const __mmask64 m = (~__mmask64{0}) >> (64 - (bytes - i));
    a1 = _mm512_add_ps(a1, _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(m, p + i)));
  }
  *read += bytes;
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

}  // namespace moex::kernels::x86

namespace moex::kernels::x86 {

// As dpbf16_loop_avx512bf16 with vfmadd231ps (the weight-only kernels' instruction): 1 * 1 adds 1 per lane.
double fma_loop_avx512(int64_t iterations, float one) {
  static_assert(kPeakChains == 24, "MOEX_PEAK_CHAINS names 24 chains");
  const __m512 a = _mm512_set1_ps(one);
#define MOEX_DECLARE(n) __m512 c##n = _mm512_setzero_ps(); asm("" : "+v"(c##n));
  MOEX_PEAK_CHAINS(MOEX_DECLARE)
#undef MOEX_DECLARE
  for (int64_t i = 0; i < iterations; ++i) {
#define MOEX_STEP(n) c##n = _mm512_fmadd_ps(a, a, c##n);
    MOEX_PEAK_CHAINS(MOEX_STEP)
#undef MOEX_STEP
  }
  double sum = 0;
#define MOEX_SUM(n) sum += _mm512_reduce_add_ps(c##n);
  MOEX_PEAK_CHAINS(MOEX_SUM)
#undef MOEX_SUM
  return sum;
}

}  // namespace moex::kernels::x86

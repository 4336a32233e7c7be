#include <immintrin.h>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {

// As dpbf16_loop_avx512bf16 with vpdpbusd: a = b = 1 adds exactly 4 per lane per instruction.
double dpbusd_loop_avx512vnni(int64_t iterations, uint8_t one) {
  const __m512i a = _mm512_set1_epi8(static_cast<char>(one));
  __m512i acc[kPeakChains];
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < iterations; ++i)
    for (auto& v : acc) v = _mm512_dpbusd_epi32(v, a, a);
  double sum = 0;
  for (auto& v : acc) sum += static_cast<double>(_mm512_reduce_add_epi32(v));
  return sum;
}

}  // namespace moex::kernels::x86

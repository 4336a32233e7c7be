#include <immintrin.h>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {

// As dpbf16_loop_avx512bf16 with vpdpbusd: a = b = 1 adds exactly 4 per lane per instruction.
double dpbusd_loop_avx512vnni(int64_t iterations, uint8_t one) {
  static_assert(kPeakChains == 24, "MOEX_PEAK_CHAINS names 24 chains");
  const __m512i a = _mm512_set1_epi8(static_cast<char>(one));
#define MOEX_DECLARE(n) __m512i c##n = _mm512_setzero_si512(); asm("" : "+v"(c##n));
  MOEX_PEAK_CHAINS(MOEX_DECLARE)
#undef MOEX_DECLARE
  for (int64_t i = 0; i < iterations; ++i) {
#define MOEX_STEP(n) c##n = _mm512_dpbusd_epi32(c##n, a, a);
    MOEX_PEAK_CHAINS(MOEX_STEP)
#undef MOEX_STEP
  }
  double sum = 0;
#define MOEX_SUM(n) sum += static_cast<double>(_mm512_reduce_add_epi32(c##n));
  MOEX_PEAK_CHAINS(MOEX_SUM)
#undef MOEX_SUM
  return sum;
}

}  // namespace moex::kernels::x86

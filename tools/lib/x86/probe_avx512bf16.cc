#include <immintrin.h>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {

// kPeakChains independent vdpbf16ps chains (more than the latency x throughput product), nothing else in
// the loop. With a = b = 1.0 every lane grows by exactly 2 per instruction, so the sum proves the count.
double dpbf16_loop_avx512bf16(int64_t iterations, uint16_t one_bf16) {
  static_assert(kPeakChains == 24, "MOEX_PEAK_CHAINS names 24 chains");
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(static_cast<short>(one_bf16)));
#define MOEX_DECLARE(n) __m512 c##n = _mm512_setzero_ps(); asm("" : "+v"(c##n));
  MOEX_PEAK_CHAINS(MOEX_DECLARE)
#undef MOEX_DECLARE
  for (int64_t i = 0; i < iterations; ++i) {
#define MOEX_STEP(n) c##n = _mm512_dpbf16_ps(c##n, a, a);
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

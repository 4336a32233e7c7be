#include <immintrin.h>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {

// kPeakChains independent vdpbf16ps chains (more than the latency x throughput product), nothing else in
// the loop. With a = b = 1.0 every lane grows by exactly 2 per instruction, so the sum proves the count.
double dpbf16_loop_avx512bf16(int64_t iterations, uint16_t one_bf16) {
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(static_cast<short>(one_bf16)));
  __m512 acc[kPeakChains];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < iterations; ++i)
    for (auto& v : acc) v = _mm512_dpbf16_ps(v, a, a);
  double sum = 0;
  for (auto& v : acc) sum += _mm512_reduce_add_ps(v);
  return sum;
}

}  // namespace moex::kernels::x86

#include <immintrin.h>

#include <cstdint>

#include "moex/kernels/probe.h"

namespace moex::kernels::x86 {

float stream_read_avx512(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= bytes; i += 256) {  // four independent chains: the loads, not the adds, limit
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 64));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 128));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 192));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

}  // namespace moex::kernels::x86

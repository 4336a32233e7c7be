// The probes of probe_avx512.cc for CPUs without AVX-512 (use_avx2_kernels()): the same loops on ymm.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "moex/kernels/probe.h"

namespace moex::kernels::x86 {
namespace {
float sum8(__m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}
}  // namespace

float stream_read_avx2(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 128 <= bytes; i += 128) {  // four independent chains: the loads, not the adds, limit
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i)));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 32)));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 64)));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 96)));
  }
  return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

float stream_read_exact_avx2(const void* data, size_t bytes, size_t* read) {
  const auto* p = static_cast<const uint8_t*>(data);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i)));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 32)));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 64)));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 96)));
  }
  for (; i + 32 <= bytes; i += 32) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i)));
  if (i < bytes) {  // the tail's bytes only, copied (AVX2 has no byte-masked load)
    alignas(32) uint8_t tail[32] = {};
    std::memcpy(tail, p + i, bytes - i);
    a1 = _mm256_add_ps(a1, _mm256_load_ps(reinterpret_cast<const float*>(tail)));
  }
  *read += bytes;
  return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// As fma_loop_avx512 on 8 lanes: 16 FLOP per instruction.
double fma_loop_avx2(int64_t iterations, float one) {
  const __m256 a = _mm256_set1_ps(one);
  __m256 acc[kPeakChains];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < iterations; ++i)
    for (auto& v : acc) v = _mm256_fmadd_ps(a, a, v);
  double sum = 0;
  for (auto& v : acc) sum += sum8(v);
  return sum;
}

}  // namespace moex::kernels::x86

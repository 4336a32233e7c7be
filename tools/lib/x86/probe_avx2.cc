// The probes of probe_avx512.cc for CPUs without AVX-512 (use_avx2_kernels()): the same loops on ymm.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {
namespace {
float sum8(__m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}
}  // namespace

float stream_read_avx2(const void* data, size_t bytes, int64_t prefetch_lead) {
  const auto* p = static_cast<const uint8_t*>(data);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  if (prefetch_lead > 0) {  // as stream_read_avx512's: the two lines prefetch_lead ahead
    size_t i = 0;
    const size_t lead = static_cast<size_t>(prefetch_lead);
    for (; i + 128 + lead <= bytes; i += 128) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + lead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + lead + 64), _MM_HINT_T1);
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i)));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 32)));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 64)));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(reinterpret_cast<const float*>(p + i + 96)));
    }
    p += i;
    bytes -= i;
  }
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

// As fma_loop_avx512 on 8 lanes: 16 FLOP per instruction. 12 chains (16 ymm registers: 24 would spill), each
// advanced kPeakChains / 12 times per iteration: 12 cover AVX2 FMA's latency (4-5) x issue (2 per cycle).
double fma_loop_avx2(int64_t iterations, float one) {
  constexpr int kChains = 12;
  static_assert(kPeakChains % kChains == 0);
  const __m256 a = _mm256_set1_ps(one);
  __m256 acc[kChains];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < iterations; ++i)
    for (int round = 0; round < kPeakChains / kChains; ++round)
      for (auto& v : acc) v = _mm256_fmadd_ps(a, a, v);
  double sum = 0;
  for (auto& v : acc) sum += sum8(v);
  return sum;
}

// vpmaddubsw, each summed into int16 as the W4A8 kernel sums (a vpaddw beside it). Six chains, each instruction
// reading its chain's last result: v = maddubs(v, a) with a's bytes 1 is a fixed point at 2 per int16 lane
// (bytes 2, 0), so nothing can be hoisted out of the loop or merged, and acc += v adds exactly 2 per lane per
// instruction. kPeakChains / 6 rounds of the six per iteration: kPeakChains instructions. The int16 sums go into int32
// (vpmaddwd by ones) every kBlock iterations, before they could wrap (kBlock x 2 x kPeakChains / 6 < 32,767), so the checksum
// is exact: 32 per instruction. The widening is 1/kBlock of the work.
double maddubs_loop_avx2(int64_t iterations, uint8_t one) {
  constexpr int kChains = 6;  // v and acc16 in registers (12 of 16 ymm); acc32 is touched once per block
  static_assert(kPeakChains % kChains == 0);
  const __m256i a = _mm256_set1_epi8(static_cast<char>(one)), ones = _mm256_set1_epi16(1);
  __m256i v[kChains], acc16[kChains], acc32[kChains];
  for (int c = 0; c < kChains; ++c) {
    v[c] = a;
    acc16[c] = acc32[c] = _mm256_setzero_si256();
  }
  constexpr int64_t kBlock = 2048;
  static_assert(kBlock * 2 * (kPeakChains / kChains) < 32767);
  for (int64_t i0 = 0; i0 < iterations; i0 += kBlock) {
    const int64_t i1 = std::min(iterations, i0 + kBlock);
    for (int64_t i = i0; i < i1; ++i)
      for (int round = 0; round < kPeakChains / kChains; ++round)
        for (int c = 0; c < kChains; ++c) {
          v[c] = _mm256_maddubs_epi16(v[c], a);
          acc16[c] = _mm256_add_epi16(acc16[c], v[c]);
        }
    for (int c = 0; c < kChains; ++c) {
      acc32[c] = _mm256_add_epi32(acc32[c], _mm256_madd_epi16(acc16[c], ones));
      acc16[c] = _mm256_setzero_si256();
    }
  }
  double sum = 0;
  for (auto& x : acc32) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
    for (int32_t l : lanes) sum += l;
  }
  return sum;
}

}  // namespace moex::kernels::x86

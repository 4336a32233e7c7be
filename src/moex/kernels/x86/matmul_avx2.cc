// matmul_avx512.cc's f32-activation matmul (bf16 / f32 weights, the exact path: --weights as-stored) on
// AVX2 + FMA, for CPUs without AVX-512, which otherwise ran it as the scalar reference loop. Same structure:
// R weight rows x TB tokens of 8-lane accumulators, rows in chunks kept in L2 while the token blocks pass.
#include <immintrin.h>

#include <algorithm>

#include "moex/kernels/matmul.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenBlock = 4;
constexpr int64_t kRowChunk = 64;

inline __m256 load_weights(const uint16_t* p) {  // 8 bf16 -> f32: a bf16 is the high half of its f32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load_weights(const float* p) { return _mm256_loadu_ps(p); }
inline float weight(const uint16_t* p) { return bf16_to_f32(*p); }
inline float weight(const float* p) { return *p; }

inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <typename W, int TB, int R>
inline void row_block(const float* x, int64_t k_in, int64_t ld, const W* w, float* y, int64_t n_out, int64_t n,
                      bool accumulate) {
  __m256 acc[TB][R];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  const W* row = w + n * ld;
  int64_t k = 0;
  for (; k + 8 <= k_in; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_weights(row + r * ld + k);
    for (int t = 0; t < TB; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * k_in + k);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int r = 0; r < R; ++r) {
      float sum = sum8(acc[t][r]);
      for (int64_t j = k; j < k_in; ++j) sum += x[t * k_in + j] * weight(row + r * ld + j);  // the K tail (< 8)
      float* out = y + t * n_out + n + r;
      *out = accumulate ? *out + sum : sum;
    }
  }
}

template <typename W, int TB>
void token_block(const float* x, int64_t k_in, int64_t ld, const W* w, float* y, int64_t n_out, int64_t n_begin,
                 int64_t n_end, bool accumulate) {
  constexpr int R = TB == 1 ? 4 : (TB == 4 ? 2 : 3);  // TB * R accumulators + R weights + 1 x: <= 16 registers
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) row_block<W, TB, R>(x, k_in, ld, w, y, n_out, n, accumulate);
  for (; n < n_end; ++n) row_block<W, TB, 1>(x, k_in, ld, w, y, n_out, n, accumulate);
}

template <typename W>
void rows(const float* x, int64_t tokens, const W* w, int64_t n_out, int64_t k_in, int64_t ld, float* y,
          bool accumulate, int64_t n_begin, int64_t n_end) {
  for (int64_t chunk = n_begin; chunk < n_end; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(chunk + kRowChunk, n_end);
    int64_t t = 0;
    for (; t + kTokenBlock <= tokens; t += kTokenBlock)
      token_block<W, kTokenBlock>(x + t * k_in, k_in, ld, w, y + t * n_out, n_out, chunk, chunk_end, accumulate);
    switch (tokens - t) {
      case 3: token_block<W, 3>(x + t * k_in, k_in, ld, w, y + t * n_out, n_out, chunk, chunk_end, accumulate); break;
      case 2: token_block<W, 2>(x + t * k_in, k_in, ld, w, y + t * n_out, n_out, chunk, chunk_end, accumulate); break;
      case 1: token_block<W, 1>(x + t * k_in, k_in, ld, w, y + t * n_out, n_out, chunk, chunk_end, accumulate); break;
      default: break;
    }
  }
}

}  // namespace

void matmul_rows_avx2(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate,
                      int64_t n_begin, int64_t n_end) {
  const int64_t n_out = w.shape[0], k_in = w.shape[1];
  if (w.dtype == DType::kBF16)
    rows(x, tokens, w.as<const uint16_t>(), n_out, k_in, w.stride0(), y, accumulate, n_begin, n_end);
  else
    rows(x, tokens, w.as<const float>(), n_out, k_in, w.stride0(), y, accumulate, n_begin, n_end);
}

}  // namespace moex::kernels::x86

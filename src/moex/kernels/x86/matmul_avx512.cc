// Hand-written because Debian's oneDNN (2.6) has no F32-activation x BF16-weight matmul (weight
// decompression arrived in 3.x), and casting activations to BF16 would cost accuracy against the
// reference. Decode is memory-bound: the job is to stream W once at full bandwidth.
#include <immintrin.h>

#include <algorithm>

#include "moex/kernels/matmul.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenBlock = 4;  // tokens sharing one pass over a block of weight rows
constexpr int64_t kRowChunk = 64;  // W rows kept hot in L2 while every token block passes over them

inline __m512 load_weights(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load_weights(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_weights_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load_weights_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// y[t, n..n+R) for TB tokens: R weight rows at once, so each x load feeds R FMAs and TB*R independent
// accumulator chains keep enough loads in flight to saturate memory.
template <typename W, int TB, int R>
inline void row_block(const float* x, int64_t k_in, int64_t ld, const W* w, float* y, int64_t n_out, int64_t n,
                      bool accumulate) {
  __m512 acc[TB][R];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const W* row = w + n * ld;
  int64_t k = 0;
  for (; k + 16 <= k_in; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_weights(row + r * ld + k);
    for (int t = 0; t < TB; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * k_in + k);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  if (k < k_in) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k_in - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_weights_masked(row + r * ld + k, m);
    for (int t = 0; t < TB; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * k_in + k);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int r = 0; r < R; ++r) {
      float* out = y + t * n_out + n + r;
      const float sum = _mm512_reduce_add_ps(acc[t][r]);
      *out = accumulate ? *out + sum : sum;
    }
  }
}

template <typename W, int TB>
void token_block(const float* x, int64_t k_in, int64_t ld, const W* w, float* y, int64_t n_out, int64_t n_begin,
                 int64_t n_end, bool accumulate) {
  constexpr int R = TB == 1 ? 8 : (TB == 3 ? 2 : 4);  // TB * R accumulators: 6..16 of the 32 registers
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

void matmul_rows_avx512(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate,
                        int64_t n_begin, int64_t n_end) {
  const int64_t n_out = w.shape[0], k_in = w.shape[1];
  if (w.dtype == DType::kBF16)
    rows(x, tokens, w.as<const uint16_t>(), n_out, k_in, w.stride0(), y, accumulate, n_begin, n_end);
  else
    rows(x, tokens, w.as<const float>(), n_out, k_in, w.stride0(), y, accumulate, n_begin, n_end);
}

}  // namespace moex::kernels::x86

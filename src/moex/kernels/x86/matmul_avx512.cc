// Hand-written because Debian's oneDNN (2.6) has no F32-activation x BF16-weight matmul (weight
// decompression arrived in 3.x), and casting activations to BF16 would cost accuracy against the
// reference. Decode is memory-bound: the job is to stream W once at full bandwidth.
#include <immintrin.h>

#include <algorithm>

#include "moex/kernels/matmul.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenBlock = 4;  // tokens sharing one pass over a weight row: 4 x 2 rows = 8 accumulators
constexpr int64_t kRowChunk = 64;  // W rows kept hot in L2 while every token block passes over them

inline __m512 load_weights(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load_weights(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_weights_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load_weights_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// y[t, n..n+1] for TB tokens: two weight rows at once so each x load feeds two FMAs.
template <typename W, int TB>
inline void two_rows(const float* x, int64_t k_in, const W* w0, const W* w1, float* y, int64_t n_out, int64_t n,
                     bool accumulate) {
  __m512 acc0[TB], acc1[TB];
  for (int t = 0; t < TB; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_in; k += 16) {
    const __m512 a = load_weights(w0 + k), b = load_weights(w1 + k);
    for (int t = 0; t < TB; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * k_in + k);
      acc0[t] = _mm512_fmadd_ps(xv, a, acc0[t]);
      acc1[t] = _mm512_fmadd_ps(xv, b, acc1[t]);
    }
  }
  if (k < k_in) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k_in - k)) - 1);
    const __m512 a = load_weights_masked(w0 + k, m), b = load_weights_masked(w1 + k, m);
    for (int t = 0; t < TB; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * k_in + k);
      acc0[t] = _mm512_fmadd_ps(xv, a, acc0[t]);
      acc1[t] = _mm512_fmadd_ps(xv, b, acc1[t]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    float* out = y + t * n_out + n;
    const float s0 = _mm512_reduce_add_ps(acc0[t]), s1 = _mm512_reduce_add_ps(acc1[t]);
    out[0] = accumulate ? out[0] + s0 : s0;
    out[1] = accumulate ? out[1] + s1 : s1;
  }
}

template <typename W, int TB>
inline void one_row(const float* x, int64_t k_in, const W* w0, float* y, int64_t n_out, int64_t n, bool accumulate) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_in; k += 16) {
    const __m512 a = load_weights(w0 + k);
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * k_in + k), a, acc[t]);
  }
  if (k < k_in) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k_in - k)) - 1);
    const __m512 a = load_weights_masked(w0 + k, m);
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + t * k_in + k), a, acc[t]);
  }
  for (int t = 0; t < TB; ++t) {
    const float s = _mm512_reduce_add_ps(acc[t]);
    y[t * n_out + n] = accumulate ? y[t * n_out + n] + s : s;
  }
}

template <typename W, int TB>
void token_block(const float* x, int64_t k_in, const W* w, float* y, int64_t n_out, int64_t n_begin, int64_t n_end,
                 bool accumulate) {
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) two_rows<W, TB>(x, k_in, w + n * k_in, w + (n + 1) * k_in, y, n_out, n, accumulate);
  if (n < n_end) one_row<W, TB>(x, k_in, w + n * k_in, y, n_out, n, accumulate);
}

template <typename W>
void rows(const float* x, int64_t tokens, const W* w, int64_t n_out, int64_t k_in, float* y, bool accumulate,
          int64_t n_begin, int64_t n_end) {
  for (int64_t chunk = n_begin; chunk < n_end; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(chunk + kRowChunk, n_end);
    int64_t t = 0;
    for (; t + kTokenBlock <= tokens; t += kTokenBlock)
      token_block<W, kTokenBlock>(x + t * k_in, k_in, w, y + t * n_out, n_out, chunk, chunk_end, accumulate);
    switch (tokens - t) {
      case 3: token_block<W, 3>(x + t * k_in, k_in, w, y + t * n_out, n_out, chunk, chunk_end, accumulate); break;
      case 2: token_block<W, 2>(x + t * k_in, k_in, w, y + t * n_out, n_out, chunk, chunk_end, accumulate); break;
      case 1: token_block<W, 1>(x + t * k_in, k_in, w, y + t * n_out, n_out, chunk, chunk_end, accumulate); break;
      default: break;
    }
  }
}

}  // namespace

void matmul_rows_avx512(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate,
                        int64_t n_begin, int64_t n_end) {
  const int64_t n_out = w.shape[0], k_in = w.shape[1];
  if (w.dtype == DType::kBF16)
    rows(x, tokens, w.as<const uint16_t>(), n_out, k_in, y, accumulate, n_begin, n_end);
  else
    rows(x, tokens, w.as<const float>(), n_out, k_in, y, accumulate, n_begin, n_end);
}

}  // namespace moex::kernels::x86

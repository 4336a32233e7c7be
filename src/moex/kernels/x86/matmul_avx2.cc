// matmul_avx512.cc's f32-activation matmul (bf16 / f32 weights, the exact path: --weights as-stored) on
// AVX2 + FMA, for CPUs without AVX-512, which otherwise ran it as the scalar reference loop. Same structure:
// R weight rows x TB tokens of 8-lane accumulators, rows in chunks kept in L2 while the token blocks pass.
//
// Weights are taken 16 k at a time as two vectors, the even and the odd k. For bf16 that is cheap: one
// 32-byte load holds 16 weights as 8 32-bit lanes (w[2j] low, w[2j+1] high); `lane << 16` is w[2j] as an f32
// and `lane & 0xffff0000` is w[2j+1], two integer ops per 16 weights where widening 8 at a time (vpmovzxwd +
// vpslld) takes four. The activations come from a copy of x split per 16-k block into its even and odd
// elements, made once per call (T x K floats, against N x K weights). f32 weights (rare: GGUF f32 files) are
// split the same way with shuffles, so that a bf16 tensor and the same values stored as f32 give the same
// bits (tests/gguf compares such checkpoints exactly), and every token's sum runs in one order whatever its
// token block or T (--batch-invariant relies on that).
// Zen 1, one thread, CPU clock (`moex bench kernels --kernels dense`): bf16 16-22% less time than widening at
// 1-2 tokens (decode: lm_head, attention projections), the same within noise at 3-64.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moex/kernels/matmul.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTokenBlock = 4;
constexpr int64_t kRowChunk = 64;

// w[k .. k+16) as its even (w[k + 2j]) and odd (w[k + 2j + 1]) elements, j = 0..7, as f32.
inline void load_pairs(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void load_pairs(const float* p, __m256& even, __m256& odd) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
  // shuffle: [a0 a2 b0 b2 | a4 a6 b4 b6]; the 64-bit permute (0, 2, 1, 3) puts a's halves before b's.
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}
inline float weight(const uint16_t* p) { return bf16_to_f32(*p); }
inline float weight(const float* p) { return *p; }

inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// x [TB, k_in] split per 16-k block: xs[t * k_in + b + j] = x[t][b + 2j], xs[t * k_in + b + 8 + j] = x[t][b + 2j + 1]
// (j < 8) for each whole block b; the K tail (< 16) is read from x itself.
template <typename W, int TB, int R>
inline void row_block(const float* x, const float* xs, int64_t k_in, int64_t ld, const W* w, float* y, int64_t n_out,
                      int64_t n, bool accumulate) {
  __m256 acc[TB][R];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  const W* row = w + n * ld;
  int64_t k = 0;
  for (; k + 16 <= k_in; k += 16) {
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) load_pairs(row + r * ld + k, even[r], odd[r]);
    for (int t = 0; t < TB; ++t) {
      const __m256 xe = _mm256_loadu_ps(xs + t * k_in + k), xo = _mm256_loadu_ps(xs + t * k_in + k + 8);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(xo, odd[r], _mm256_fmadd_ps(xe, even[r], acc[t][r]));
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int r = 0; r < R; ++r) {
      float sum = sum8(acc[t][r]);
      // The K tail (< 16), one explicit fma per k: left to contraction, the two weight types' loops could differ.
      for (int64_t j = k; j < k_in; ++j) sum = std::fma(x[t * k_in + j], weight(row + r * ld + j), sum);
      float* out = y + t * n_out + n + r;
      *out = accumulate ? *out + sum : sum;
    }
  }
}

template <typename W, int TB>
void token_block(const float* x, const float* xs, int64_t k_in, int64_t ld, const W* w, float* y, int64_t n_out,
                 int64_t n_begin, int64_t n_end, bool accumulate) {
  // TB = 1: 8 rows in flight, each row's pair decoded just before its two FMAs (8 accumulators + 2 x +
  // temporaries; ~7% faster than 4 rows on Zen 1, one thread). TB = 2: 6 accumulators + 6 weights + 2 x.
  // TB = 3, 4: 2 rows (<= 8 accumulators + 4 weights + 2 x).
  constexpr int R = TB == 1 ? 8 : TB == 2 ? 3 : 2;
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) row_block<W, TB, R>(x, xs, k_in, ld, w, y, n_out, n, accumulate);
  for (; n < n_end; ++n) row_block<W, TB, 1>(x, xs, k_in, ld, w, y, n_out, n, accumulate);
}

template <typename W>
void rows(const float* x, int64_t tokens, const W* w, int64_t n_out, int64_t k_in, int64_t ld, float* y,
          bool accumulate, int64_t n_begin, int64_t n_end) {
  thread_local std::vector<float> split;  // [tokens, k_in]: x split per 16-k block (row_block)
  split.resize(tokens * k_in);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t b = 0; b + 16 <= k_in; b += 16)
      for (int j = 0; j < 8; ++j) {
        split[t * k_in + b + j] = x[t * k_in + b + 2 * j];
        split[t * k_in + b + 8 + j] = x[t * k_in + b + 2 * j + 1];
      }
  const float* xs = split.data();
  for (int64_t chunk = n_begin; chunk < n_end; chunk += kRowChunk) {  // each chunk read from DRAM once, then in L2
    const int64_t chunk_end = std::min(chunk + kRowChunk, n_end);
    int64_t t = 0;
    for (; t + kTokenBlock <= tokens; t += kTokenBlock)
      token_block<W, kTokenBlock>(x + t * k_in, xs + t * k_in, k_in, ld, w, y + t * n_out, n_out, chunk, chunk_end,
                                  accumulate);
    const float *xt = x + t * k_in, *xst = xs + t * k_in;
    float* yt = y + t * n_out;
    switch (tokens - t) {
      case 3: token_block<W, 3>(xt, xst, k_in, ld, w, yt, n_out, chunk, chunk_end, accumulate); break;
      case 2: token_block<W, 2>(xt, xst, k_in, ld, w, yt, n_out, chunk, chunk_end, accumulate); break;
      case 1: token_block<W, 1>(xt, xst, k_in, ld, w, yt, n_out, chunk, chunk_end, accumulate); break;
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

// W8A8 on AVX2: s8 weights x activations quantized per token to s8, with vpmaddubsw. For CPUs without VNNI,
// where int8-w8a8 otherwise runs the scalar loop.
//
// vpmaddubsw wants one unsigned operand and saturates its int16 pair sums. Moving each weight's sign onto its
// activation (vpsignb) and multiplying |w| (vpabsb, at most 128 as u8) by it keeps every pair within
// 2 x 128 x 127 = 32,512 < 32,767, so nothing saturates and the sums stay exact (llama.cpp's AVX2 q8 dot
// products rest on the same bound). vpmaddwd by ones widens each pair sum to int32 at once. Per 32 weights
// (8 lanes x 4 k) and token: a sign, a vpmaddubsw, a vpmaddwd and an add; |w| is shared by the tile's tokens.
// The integer sums are exact, so the result equals the reference's bit for bit:
// float(sum q w) * (token scale * row scale), one loop for every row count.
//
// Panel layout (kernels/packed.h): s8 [k_padded/4][64][4]. A tile is MT tokens x NV 8-lane vectors
// (MT * NV = 8 int32 sums), walked over a K block of the panel that stays in L1 (32 KB).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"

namespace moex::kernels::x86 {
namespace {

constexpr int64_t kKBlock = 512;  // 32 KB of panel

inline __m256i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof quad);
  return _mm256_set1_epi32(quad);
}

// c [MT][64] (lanes lane0 .. lane0 + 8 NV) += x [MT][ldx] (s8 codes, k from k0) . w quads [q0, q1) of the panel.
template <int MT, int NV>
void tile(const int8_t* x, int64_t ldx, const int8_t* w, int lane0, int64_t q0, int64_t q1, int32_t* c, const void* w_end) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MT][NV];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm256_setzero_si256();
  for (int64_t q = q0; q < q1; ++q) {
    const int8_t* wq = w + (q * kPanel + lane0) * 4;
    if (lane0 == 0) prefetch_ahead(wq, w_end, 4);  // the first lanes' pass reads the panel from memory
    for (int v = 0; v < NV; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * v));
      const __m256i magnitude = _mm256_abs_epi8(wv);
      for (int t = 0; t < MT; ++t) {
        const __m256i xs = _mm256_sign_epi8(broadcast_quad(x + t * ldx + 4 * q), wv);
        acc[t][v] = _mm256_add_epi32(acc[t][v], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), ones));
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) {
      int32_t* out = c + t * kPanel + lane0 + 8 * v;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm256_add_epi32(acc[t][v], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out))));
    }
}

}  // namespace

void run_panels_w8a8_avx2(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const int8_t*>(job.activations);  // [T][k_padded] s8 codes, zero tail
  const int64_t tokens = job.tokens, kp = w.k_padded;
  thread_local std::vector<int32_t> c;  // [T][64] integer sums
  thread_local std::vector<float> f;    // [T][64] scaled
  if (c.size() < static_cast<size_t>(tokens * kPanel)) {
    c.resize(tokens * kPanel);
    f.resize(tokens * kPanel);
  }
  const int8_t* w_end = w.data.as<const int8_t>() + panel_end * kp * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w_panel = w.data.as<const int8_t>() + panel * kp * kPanel;  // [kp/4][64][4]
    std::fill_n(c.begin(), tokens * kPanel, 0);
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
      const int64_t q0 = k0 / 4, q1 = std::min(kp, k0 + kKBlock) / 4;
      const auto run = [&]<int MT, int NV>(int64_t t) {
        for (int lane0 = 0; lane0 < kPanel; lane0 += 8 * NV)
          tile<MT, NV>(x + t * kp, kp, w_panel, lane0, q0, q1, c.data() + t * kPanel, w_end);
      };
      int64_t t = 0;
      for (; t + 4 <= tokens; t += 4) run.template operator()<4, 2>(t);
      if (tokens - t >= 2) {
        run.template operator()<2, 4>(t);
        t += 2;
      }
      if (t < tokens) run.template operator()<1, 8>(t);
    }
    const float* row_scales = w.scales.as<const float>() + panel * kPanel;
    for (int64_t t = 0; t < tokens; ++t) {
      const __m256 token_scale = _mm256_set1_ps(job.token_scales[t]);
      for (int v = 0; v < 8; ++v) {
        const __m256i dot = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.data() + t * kPanel + 8 * v));
        _mm256_storeu_ps(f.data() + t * kPanel + 8 * v,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(token_scale, _mm256_loadu_ps(row_scales + 8 * v))));
      }
    }
    apply_epilogue_scalar(job.epilogue, w, panel, tokens, f.data());
  }
}

}  // namespace moex::kernels::x86

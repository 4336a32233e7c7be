// W4A8 on AVX2: int4 codes (u8 0..15) x activations quantized to s8 per token and K group, with vpmaddubsw.
// For CPUs without VNNI (Zen 1-3, Intel client cores), where the f32 route of packed_weight_only_avx2.cc
// spends a widen, a convert and an FMA per 8 weights and batch-1 int4 decode reached ~30% of the read probe.
//
// vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16 with saturation. Here it
// cannot saturate: a code is at most 15 and an activation code at most 127 in magnitude, so a pair is at most
// 3,810 and the sums of 4 k-steps (32 k: 8 pairs) at most 30,480 < 32,767. So the int16 sums run 32 k, then
// vpmaddwd by ones widens them into the int32 group sums: per 64 weights (one 32-byte load of 8 lanes x 8 k)
// an AND, a shift, an AND, two vpmaddubsw and two int16 adds, and every 4 loads a vpmaddwd and an add.
// The integer group sums are exact, and fold in at each group's end in the order packed_w4a8_avx512vnni.cc
// folds them (per token and lane, group by group, whatever the tile):
//   c += xs_g * (scale_g * dot_g(q, xq) + offset_g * sum_g(xq)),   offset = -zero * scale,
// so a row's result does not depend on how many rows its call has: one loop for decode and prefill.
//
// Panel layout (kernels/packed.h): u8 [k_padded/8][64][4], a lane's 32 bits hold 8 k (byte b: q(8j+b) low
// nibble, q(8j+4+b) high). One ymm covers 8 lanes; a tile is MT tokens x NV such vectors (MT * NV = 8
// int16 sums in registers, the int32 group sums in L1), walked over a K block of the panel (<= 32 KB, in L1
// for the tile passes after the first).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"

namespace moex::kernels::x86 {
namespace {

constexpr int64_t kKBlock = 1024;  // 32 KB of panel codes; a multiple of every group size (32/64/128)
constexpr int64_t kInt16Run = 32;  // k summed in int16 before widening (see above)

inline __m256i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof quad);
  return _mm256_set1_epi32(quad);
}

// c [MT][64] (lanes lane0 .. lane0 + 8 NV) += the groups of k [k0, k1) (k0, k1 group-aligned but for k1 = kp)
// of x [MT][ldx] (s8 codes) . the panel's codes w [kp/8][64][4], folded group by group.
// code_sums, act_scales [MT][ld_sums]: per token and group, the sum of its codes and their scale.
template <int MT, int NV>
void tile(const int8_t* x, int64_t ldx, const uint8_t* w, int lane0, const float* scales, const float* offsets,
          const float* code_sums, const float* act_scales, int64_t ld_sums, int64_t group, int64_t k0, int64_t k1,
          float* c, const void* w_end) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const int64_t g = g0 / group, g1 = std::min(k1, g0 + group);
    // The group's int32 sums live in L1 (touched once per 32 k), leaving the registers to the MT x NV int16
    // runs, so a lone token runs all 64 lanes (NV = 8) in one pass down the panel's lines.
    alignas(32) int32_t part[MT][NV][8] = {};
    for (int64_t r0 = g0; r0 < g1; r0 += kInt16Run) {
      __m256i run[MT][NV];  // int16 pair sums of up to 32 k
      for (int t = 0; t < MT; ++t)
        for (int v = 0; v < NV; ++v) run[t][v] = _mm256_setzero_si256();
      const int64_t r1 = std::min(g1, r0 + kInt16Run);
      for (int64_t k = r0; k < r1; k += 8) {
        const uint8_t* wk = w + ((k / 8) * kPanel + lane0) * 4;
        if (lane0 == 0) prefetch_ahead(wk, w_end, 4);  // the first lanes' pass reads the panel from memory
        for (int v = 0; v < NV; ++v) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * v));
          const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
          for (int t = 0; t < MT; ++t) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast_quad(x + t * ldx + k)),
                                               _mm256_maddubs_epi16(hi, broadcast_quad(x + t * ldx + k + 4)));
            run[t][v] = _mm256_add_epi16(run[t][v], p);
          }
        }
      }
      for (int t = 0; t < MT; ++t)
        for (int v = 0; v < NV; ++v) {
          auto* sum = reinterpret_cast<__m256i*>(part[t][v]);
          _mm256_store_si256(sum, _mm256_add_epi32(_mm256_load_si256(sum), _mm256_madd_epi16(run[t][v], ones)));
        }
    }
    for (int v = 0; v < NV; ++v) {
      const __m256 scale = _mm256_loadu_ps(scales + g * kPanel + lane0 + 8 * v);
      const __m256 offset = _mm256_loadu_ps(offsets + g * kPanel + lane0 + 8 * v);
      for (int t = 0; t < MT; ++t) {
        float* out = c + t * kPanel + lane0 + 8 * v;
        const __m256 group_sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(part[t][v]))), scale,
                                                 _mm256_mul_ps(offset, _mm256_set1_ps(code_sums[t * ld_sums + g])));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(group_sum, _mm256_set1_ps(act_scales[t * ld_sums + g]), _mm256_loadu_ps(out)));
      }
    }
  }
}

}  // namespace

void run_panels_int4_w4a8_avx2(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const int8_t*>(job.activations);  // [T][k_padded] s8 codes, zero tail
  const int64_t tokens = job.tokens, kp = w.k_padded, groups = (w.cols + w.group - 1) / w.group;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  const uint8_t* w_end = w.data.as<const uint8_t>() + panel_end * (kp / 2) * kPanel;  // this call's panels end
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* w_panel = w.data.as<const uint8_t>() + panel * (kp / 2) * kPanel;  // [kp/8][64][4]
    const float* scales = w.scales.as<const float>() + panel * groups * kPanel;    // [G][64]
    const float* offsets = w.offsets.as<const float>() + panel * groups * kPanel;  // [G][64]
    std::fill_n(c.begin(), tokens * kPanel, 0.0f);
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
      const int64_t k1 = std::min(kp, k0 + kKBlock);
      const auto run = [&]<int MT, int NV>(int64_t t) {
        for (int lane0 = 0; lane0 < kPanel; lane0 += 8 * NV)
          tile<MT, NV>(x + t * kp, kp, w_panel, lane0, scales, offsets, job.group_sums + t * groups,
                       job.token_scales + t * groups, groups, w.group, k0, k1, c.data() + t * kPanel, w_end);
      };
      int64_t t = 0;
      for (; t + 8 <= tokens; t += 8) run.template operator()<8, 1>(t);
      if (tokens - t >= 4) {
        run.template operator()<4, 2>(t);
        t += 4;
      }
      if (tokens - t >= 2) {
        run.template operator()<2, 4>(t);
        t += 2;
      }
      if (t < tokens) run.template operator()<1, 8>(t);
    }
    apply_epilogue_scalar(job.epilogue, w, panel, tokens, c.data());
  }
}

}  // namespace moex::kernels::x86

// The router for AVX-512. A token block's E dot products accumulate in registers (all E experts share each
// x load; each weight load feeds the block's tokens) and are reduced to E scalars. The unfused modes write
// them to memory as logits [T, E] (router_logits_avx512); the fused one (`full`) keeps them on the stack and
// goes straight to top-k and softmax. The same kernel for both, with the lanes and reduction of
// kernels/x86/matmul_avx512.cc, so every mode sees bitwise the same logits.
// Compiled for AVX-512 by the pragma (moe/ has no per-ISA build flags); called only when
// use_x86_kernels() says the CPU has it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12 false positives inside the reduce intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

#include "moex/moe/gating.h"

namespace moex::gating::x86 {
namespace {

// Tokens per register block: TB x 8 accumulators (24 of the 32 registers) share each weight load.
constexpr int kTokenBlock = 3;

inline __m512 load_weights(const uint16_t* p) {  // 16 BF16 -> F32 (BF16 is the top half of an F32)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load_weights(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_weights_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load_weights_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// logits[t*E + e0 + g] = x[t] . w[e0 + g] for TB tokens and G experts: TB*G accumulator chains.
template <typename W, int TB, int G>
inline void dot_products(const float* x, int64_t d, const W* w, int E, int e0, float* logits) {
  __m512 acc[TB][G];
  for (int t = 0; t < TB; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
  const W* rows = w + e0 * d;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m512 xv[TB];
    for (int t = 0; t < TB; ++t) xv[t] = _mm512_loadu_ps(x + t * d + i);
    for (int g = 0; g < G; ++g) {
      const __m512 wv = load_weights(rows + g * d + i);
      for (int t = 0; t < TB; ++t) acc[t][g] = _mm512_fmadd_ps(xv[t], wv, acc[t][g]);
    }
  }
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1);
    __m512 xv[TB];
    for (int t = 0; t < TB; ++t) xv[t] = _mm512_maskz_loadu_ps(m, x + t * d + i);
    for (int g = 0; g < G; ++g) {
      const __m512 wv = load_weights_masked(rows + g * d + i, m);
      for (int t = 0; t < TB; ++t) acc[t][g] = _mm512_fmadd_ps(xv[t], wv, acc[t][g]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int g = 0; g < G; ++g) logits[t * E + e0 + g] = _mm512_reduce_add_ps(acc[t][g]);
}

// gating::top_k for E <= 16, branch-free: k times, the max of the live lanes and the lowest lane holding it
// (so the lower index wins ties), which then leaves the live set. Same ids and values as the scalar version.
inline void top_k_in_register(const float* logits, int E, int k, int32_t* ids, float* values) {
  __mmask16 live = static_cast<__mmask16>((1u << E) - 1);
  const __m512 v = _mm512_maskz_loadu_ps(live, logits);
  for (int j = 0; j < k; ++j) {
    const float best = _mm512_mask_reduce_max_ps(live, v);
    const __mmask16 hits = _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(best), _CMP_EQ_OQ);
    if (hits == 0) {  // a NaN logit: leave it to the scalar version's rules
      top_k(logits, E, k, ids, values);
      return;
    }
    const int e = __builtin_ctz(hits);
    ids[j] = e;
    values[j] = logits[e];
    live = static_cast<__mmask16>(live & ~(1u << e));
  }
}

// logits [TB, E] (row stride E) of TB tokens: experts in register groups of 8, then 4, 2, 1.
template <typename W, int TB>
inline void block_logits(const float* x, int64_t d, const W* w, int E, float* logits) {
  int e = 0;
  for (; e + 8 <= E; e += 8) dot_products<W, TB, 8>(x, d, w, E, e, logits);
  if (E - e >= 4) dot_products<W, TB, 4>(x, d, w, E, e, logits), e += 4;
  if (E - e >= 2) dot_products<W, TB, 2>(x, d, w, E, e, logits), e += 2;
  if (E - e >= 1) dot_products<W, TB, 1>(x, d, w, E, e, logits);
}

template <typename W, int TB>
inline void route_block(const float* x, int64_t d, const W* w, int E, int k, bool norm_topk_prob, int32_t* ids,
                        float* weights) {
  float logits[TB * kMaxFusedExperts];  // the block's logits: L1, never a buffer in memory
  block_logits<W, TB>(x, d, w, E, logits);
  for (int t = 0; t < TB; ++t) {
    if (E <= 16)
      top_k_in_register(logits + t * E, E, k, ids + t * k, weights + t * k);
    else
      top_k(logits + t * E, E, k, ids + t * k, weights + t * k);
    weights_from_logits(logits + t * E, E, k, norm_topk_prob, weights + t * k);
  }
}

template <typename W>
void logits_tokens(const float* x, int64_t tokens, const W* w, int E, int64_t d, float* logits) {
  int64_t t = 0;
  for (; t + kTokenBlock <= tokens; t += kTokenBlock) block_logits<W, kTokenBlock>(x + t * d, d, w, E, logits + t * E);
  for (; t < tokens; ++t) block_logits<W, 1>(x + t * d, d, w, E, logits + t * E);
}

template <typename W>
void route_tokens(const float* x, int64_t tokens, const W* w, int E, int64_t d, int k, bool norm_topk_prob,
                  int32_t* ids, float* weights) {
  int64_t t = 0;
  for (; t + kTokenBlock <= tokens; t += kTokenBlock)
    route_block<W, kTokenBlock>(x + t * d, d, w, E, k, norm_topk_prob, ids + t * k, weights + t * k);
  for (; t < tokens; ++t) route_block<W, 1>(x + t * d, d, w, E, k, norm_topk_prob, ids + t * k, weights + t * k);
}

}  // namespace

void router_logits_avx512(const float* x, int64_t tokens, const TensorView& w_gate, float* logits) {
  const int E = static_cast<int>(w_gate.shape[0]);
  const int64_t d = w_gate.shape[1];
  if (w_gate.dtype == DType::kBF16)
    logits_tokens(x, tokens, w_gate.as<const uint16_t>(), E, d, logits);
  else
    logits_tokens(x, tokens, w_gate.as<const float>(), E, d, logits);
}

void route_fused_avx512(const float* x, int64_t tokens, const TensorView& w_gate, int k, bool norm_topk_prob,
                        int32_t* expert_ids, float* expert_weights) {
  const int E = static_cast<int>(w_gate.shape[0]);
  const int64_t d = w_gate.shape[1];
  if (w_gate.dtype == DType::kBF16)
    route_tokens(x, tokens, w_gate.as<const uint16_t>(), E, d, k, norm_topk_prob, expert_ids, expert_weights);
  else
    route_tokens(x, tokens, w_gate.as<const float>(), E, d, k, norm_topk_prob, expert_ids, expert_weights);
}

}  // namespace moex::gating::x86

// Element-wise and attention kernels. These are cheap next to the matmuls (O(d) per token, or
// O(context) for attention), so one plain version serves as both the implementation and the oracle.
#pragma once
#include <cstdint>

namespace moex::kernels {

// y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight   (weight: BF16 or F32 as stored, [d])
void rmsnorm(const float* x, int64_t tokens, int64_t d, const void* weight, bool weight_bf16, float eps, float* y);

// Rotary tables for HF's rotate-half convention: cos/sin [max_positions, head_dim/2],
// angle(pos, i) = pos * theta^(-2i/head_dim), computed in double so long contexts stay exact.
void rope_tables(int64_t max_positions, int64_t head_dim, double theta, float* cos_table, float* sin_table);
// In place on x [heads, head_dim] of one token at `position`: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rope_apply(float* x, int64_t heads, int64_t head_dim, int64_t position, const float* cos_table,
                const float* sin_table);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g))
void silu_mul(const float* gate, const float* up, int64_t n, float* out);

// In place softmax over n values.
void softmax(float* x, int64_t n);

// One query token against the first `length` positions of one sequence's cache.
// q [heads, hd]; k_cache/v_cache [kv_heads, max_seq, hd]; out [heads, hd]; scratch >= length floats.
// Query head h reads KV head h / (heads / kv_heads) (grouped-query attention).
void attention_one_token(const float* q, const float* k_cache, const float* v_cache, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t max_seq, int64_t length, float* out,
                         float* scratch);
// The scalar loop attention_one_token runs without AVX-512 (MOEX_ISA=ref) or with head_dim > 128.
void attention_one_token_scalar(const float* q, const float* k_cache, const float* v_cache, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t max_seq, int64_t length, float* out,
                                float* scratch);

namespace x86 {
// AVX-512 (x86/attention_avx512.cc); head_dim <= 128.
void attention_one_token_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t max_seq, int64_t length, float* out,
                                float* scratch);
}  // namespace x86

}  // namespace moex::kernels

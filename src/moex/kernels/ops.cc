#include "moex/kernels/ops.h"

#include <cmath>
#include <cstdint>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/threads.h"

namespace moex::kernels {

void rmsnorm(const float* x, int64_t tokens, int64_t d, const void* weight, bool weight_bf16, float eps, float* y) {
  // Rows are independent (each its own serial sum, so the split changes no bit): a prefill's rows over the threads.
  parallel_for(tokens, 16, [&](int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float* row = x + t * d;
    // Eight independent double sums (one serial chain of d dependent adds was ~2% of a W8A8 prefill). The
    // other order moves the double sum by ~1e-16, far below the rounding of the f32 scale made from it.
    double part[8] = {};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(row[i + j]) * row[i + j];
    for (; i < d; ++i) part[0] += static_cast<double>(row[i]) * row[i];
    const double sum_sq = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const float scale = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(d) + eps));
    float* out = y + t * d;
    if (weight_bf16) {
      const auto* w = static_cast<const uint16_t*>(weight);
      for (int64_t i = 0; i < d; ++i) out[i] = row[i] * scale * bf16_to_f32(w[i]);
    } else {
      const auto* w = static_cast<const float*>(weight);
      for (int64_t i = 0; i < d; ++i) out[i] = row[i] * scale * w[i];
    }
  }
  });
}

void rope_tables(int64_t max_positions, int64_t head_dim, double theta, float* cos_table, float* sin_table) {
  const int64_t half = head_dim / 2;
  for (int64_t pos = 0; pos < max_positions; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      const double angle = static_cast<double>(pos) * inv_freq;
      cos_table[pos * half + i] = static_cast<float>(std::cos(angle));
      sin_table[pos * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

void rope_apply(float* x, int64_t heads, int64_t head_dim, int64_t position, const float* cos_table,
                const float* sin_table) {
  const int64_t half = head_dim / 2;
  const float* c = cos_table + position * half;
  const float* s = sin_table + position * half;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c[i] - x2 * s[i];
      v[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void softmax(float* x, int64_t n) {
  if (n <= 0) return;
  float max_value = x[0];
  for (int64_t i = 1; i < n; ++i) max_value = x[i] > max_value ? x[i] : max_value;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_value);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void attention_one_token(const float* q, const float* k_cache, const float* v_cache, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t max_seq, int64_t length, float* out,
                         float* scratch) {
  if (use_x86_kernels() && head_dim <= 128 && length > 0) {
    x86::attention_one_token_avx512(q, k_cache, v_cache, heads, kv_heads, head_dim, max_seq, length, out, scratch);
    return;
  }
  attention_one_token_scalar(q, k_cache, v_cache, heads, kv_heads, head_dim, max_seq, length, out, scratch);
}

void attention_one_token_scalar(const float* q, const float* k_cache, const float* v_cache, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, int64_t max_seq, int64_t length, float* out,
                                float* scratch) {
  const int64_t group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * head_dim;
    const float* keys = k_cache + (h / group) * max_seq * head_dim;
    const float* values = v_cache + (h / group) * max_seq * head_dim;
    for (int64_t j = 0; j < length; ++j) {
      const float* key = keys + j * head_dim;
      float dot = 0.0f;
      for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * key[i];
      scratch[j] = dot * scale;
    }
    softmax(scratch, length);
    float* oh = out + h * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) oh[i] = 0.0f;
    for (int64_t j = 0; j < length; ++j) {
      const float p = scratch[j];
      const float* value = values + j * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) oh[i] += p * value[i];
    }
  }
}

}  // namespace moex::kernels

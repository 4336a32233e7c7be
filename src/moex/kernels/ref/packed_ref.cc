// Oracles for kernels/packed.h: plain loops over the natural-layout QuantizedMatrix, no packing involved.
#include <algorithm>
#include <cmath>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/kernels/packed.h"

namespace moex::kernels::ref {

void matmul(const float* x, int64_t tokens, const QuantizedMatrix& w, float* y, bool accumulate) {
  const int64_t N = w.rows, K = w.cols;
  std::vector<float> xr(K);   // [K] this token's activations as the format's kernel sees them
  std::vector<int8_t> q(K);   // [K] W8A8 / W4A8 activation codes
  const ActivationKind kind = format_traits(w.format).activations;
  for (int64_t t = 0; t < tokens; ++t) {
    float token_scale = 1.0f;
    switch (kind) {
      case ActivationKind::kS8PerGroup:  // codes per K group, each times its group's scale
        for (int64_t k0 = 0; k0 < K; k0 += w.group) {
          const int64_t k1 = std::min(K, k0 + w.group);
          const float scale = quantize_activations_s8(x + t * K + k0, k1 - k0, q.data() + k0);
          for (int64_t k = k0; k < k1; ++k) xr[k] = static_cast<float>(q[k]) * scale;
        }
        break;
      case ActivationKind::kS8PerToken:
        token_scale = quantize_activations_s8(x + t * K, K, q.data());
        for (int64_t k = 0; k < K; ++k) xr[k] = q[k];
        break;
      case ActivationKind::kBf16:
        for (int64_t k = 0; k < K; ++k) xr[k] = bf16_to_f32(f32_to_bf16(x[t * K + k]));
        break;
      case ActivationKind::kF32:
        for (int64_t k = 0; k < K; ++k) xr[k] = x[t * K + k];
        break;
    }
    for (int64_t n = 0; n < N; ++n) {
      float sum = 0.0f;
      if (kind == ActivationKind::kS8PerToken) {  // integer dot of the codes, then both scales
        int64_t dot = 0;
        for (int64_t k = 0; k < K; ++k) dot += int64_t{q[k]} * static_cast<int8_t>(w.codes[n * K + k]);
        sum = static_cast<float>(dot) * (token_scale * w.scales[n]);
      } else {
        for (int64_t k = 0; k < K; ++k) sum += xr[k] * w.weight(n, k);
      }
      y[t * N + n] = accumulate ? y[t * N + n] + sum : sum;
    }
  }
}

void expert_gate_up(const float* x, int64_t tokens, const QuantizedMatrix& w1, const QuantizedMatrix& w3, float* h) {
  const int64_t I = w1.rows;
  std::vector<float> gate(tokens * I), up(tokens * I);  // [T, I]
  matmul(x, tokens, w1, gate.data());
  matmul(x, tokens, w3, up.data());
  for (int64_t i = 0; i < tokens * I; ++i) h[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void expert_down_accumulate(const float* h, int64_t tokens, const QuantizedMatrix& w2, const float* route_weights,
                            const int32_t* out_rows, float* out, int64_t out_stride) {
  const int64_t D = w2.rows;
  std::vector<float> y(tokens * D);  // [T, D]
  matmul(h, tokens, w2, y.data());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t n = 0; n < D; ++n) out[out_rows[t] * out_stride + n] += route_weights[t] * y[t * D + n];
}

}  // namespace moex::kernels::ref

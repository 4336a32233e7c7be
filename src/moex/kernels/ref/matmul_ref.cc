#include "moex/base/dtype.h"
#include "moex/kernels/matmul.h"

namespace moex::kernels::ref {

void matmul(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate) {
  const int64_t n_out = w.shape[0], k_in = w.shape[1], ld = w.stride0();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t n = 0; n < n_out; ++n) {
      float sum = 0.0f;
      for (int64_t k = 0; k < k_in; ++k) {
        const float weight = w.dtype == DType::kBF16 ? bf16_to_f32(w.as<const uint16_t>()[n * ld + k])
                                                     : w.as<const float>()[n * ld + k];
        sum += x[t * k_in + k] * weight;
      }
      y[t * n_out + n] = accumulate ? y[t * n_out + n] + sum : sum;
    }
  }
}

}  // namespace moex::kernels::ref

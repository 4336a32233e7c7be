#include "moex/kernels/matmul.h"

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"

namespace moex::kernels {

void matmul(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate) {
  MOEX_CHECK(w.shape.rank == 2 && (w.dtype == DType::kBF16 || w.dtype == DType::kF32), "matmul weight ",
             w.shape.str());
  if (tokens == 0) return;
  if (!use_x86_kernels()) {
    ref::matmul(x, tokens, w, y, accumulate);
    return;
  }
  // Rows of W are split over threads in blocks of 16 so each thread streams its own part of the weights.
  parallel_for(w.shape[0], 16, [&](int64_t begin, int64_t end) {
    x86::matmul_rows_avx512(x, tokens, w, y, accumulate, begin, end);
  });
}

void matmul_single_thread(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate) {
  MOEX_CHECK(w.shape.rank == 2 && (w.dtype == DType::kBF16 || w.dtype == DType::kF32), "matmul weight ",
             w.shape.str());
  if (use_x86_kernels())
    x86::matmul_rows_avx512(x, tokens, w, y, accumulate, 0, w.shape[0]);
  else
    ref::matmul(x, tokens, w, y, accumulate);
}

}  // namespace moex::kernels

#include "moex/kernels/matmul.h"

#include <algorithm>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"

namespace moex::kernels {
namespace {
// The rows kernel this CPU runs (nullptr: the scalar reference).
using RowsKernel = void (*)(const float*, int64_t, const TensorView&, float*, bool, int64_t, int64_t);
RowsKernel rows_kernel() {
  if (use_x86_kernels()) return x86::matmul_rows_avx512;
  if (use_avx2_kernels()) return x86::matmul_rows_avx2;
  return nullptr;
}
}  // namespace

void matmul(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate) {
  MOEX_CHECK(w.shape.rank == 2 && (w.dtype == DType::kBF16 || w.dtype == DType::kF32), "matmul weight ",
             w.shape.str());
  if (tokens == 0) return;
  const RowsKernel kernel = rows_kernel();
  if (!kernel) {
    ref::matmul(x, tokens, w, y, accumulate);
    return;
  }
  // Rows of W are split over threads in blocks of 16 so each thread streams its own part of the weights.
  parallel_for(w.shape[0], 16, [&](int64_t begin, int64_t end) { kernel(x, tokens, w, y, accumulate, begin, end); });
}

void matmul_group(const float* x, int64_t tokens, const MatmulOutput* outputs, int count) {
  int64_t total = 0;  // rows of all outputs, in order
  for (int i = 0; i < count; ++i) {
    const TensorView& w = outputs[i].w;
    MOEX_CHECK(w.shape.rank == 2 && (w.dtype == DType::kBF16 || w.dtype == DType::kF32) &&
                   w.shape[1] == outputs[0].w.shape[1],
               "matmul_group weight ", w.shape.str());
    total += w.shape[0];
  }
  if (tokens == 0) return;
  const RowsKernel kernel = rows_kernel();
  if (!kernel) {
    for (int i = 0; i < count; ++i) ref::matmul(x, tokens, outputs[i].w, outputs[i].y, outputs[i].accumulate);
    return;
  }
  parallel_for(total, 16, [&](int64_t begin, int64_t end) {
    int64_t first = 0;  // the first row of output i in the concatenation
    for (int i = 0; i < count && first < end; first += outputs[i].w.shape[0], ++i) {
      const int64_t n = outputs[i].w.shape[0], b = std::max<int64_t>(begin - first, 0), e = std::min(end - first, n);
      if (b < e) kernel(x, tokens, outputs[i].w, outputs[i].y, outputs[i].accumulate, b, e);
    }
  });
}

void matmul_single_thread(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate) {
  MOEX_CHECK(w.shape.rank == 2 && (w.dtype == DType::kBF16 || w.dtype == DType::kF32), "matmul weight ",
             w.shape.str());
  if (const RowsKernel kernel = rows_kernel())
    kernel(x, tokens, w, y, accumulate, 0, w.shape[0]);
  else
    ref::matmul(x, tokens, w, y, accumulate);
}

}  // namespace moex::kernels

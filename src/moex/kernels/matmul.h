// Linear layers as inference uses them: y[T,N] = x[T,K] @ W[N,K]^T, W in Hugging Face's [out, in]
// layout (BF16 or F32, read straight from the mapping), x and y in F32.
#pragma once
#include <cstdint>

#include "moex/base/tensor.h"

namespace moex::kernels {

// y [T, N] = x [T, K] @ w [N, K]^T. `accumulate`: y += instead of y =. Threads split N.
void matmul(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate = false);

// One of the matmuls of matmul_group: y [T, N] (=, or += with accumulate) x @ w [N, K]^T.
struct MatmulOutput {
  TensorView w;
  float* y = nullptr;
  bool accumulate = false;
};
// Several matmuls of the same x [T, K] in ONE parallel region (attention's q, k and v projections: one
// fork/join per layer instead of three, which at decode costs as much as streaming k or v): the outputs'
// rows, taken together, are split over the threads in blocks of 16. Each output equals matmul()'s bit for bit.
void matmul_group(const float* x, int64_t tokens, const MatmulOutput* outputs, int count);

// The same on the calling thread only (for callers that already split work across threads).
void matmul_single_thread(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate = false);

namespace ref {
// Plain scalar loops: the oracle for the fast versions.
void matmul(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate);
}  // namespace ref

namespace x86 {
// AVX-512, BF16 or F32 weights; rows [n_begin, n_end) of W only (the caller splits N over threads).
void matmul_rows_avx512(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate,
                        int64_t n_begin, int64_t n_end);
// The same on AVX2 + FMA (cpu_features().has_avx2_kernels(), a CPU without AVX-512).
void matmul_rows_avx2(const float* x, int64_t tokens, const TensorView& w, float* y, bool accumulate,
                      int64_t n_begin, int64_t n_end);
}  // namespace x86

}  // namespace moex::kernels

// The one op every weight x activation product of the model runs through: y = x @ W^T over a Linear, which is
// either the checkpoint's bf16/f32 matrix read as stored (f32 activations, kernels::matmul: the exact path) or
// packed weights of any format (kernels/formats.h), whose kernels were chosen once when they were packed.
// Attention's q/k/v (linear_group: one parallel region), o_proj and lm_head call linear(); experts, shared
// experts and dense MLP layers run the same packed kernels through linear_ffn (one expert) or fused_experts (a
// MoE layer's experts in one region).
#pragma once
#include <cstdint>
#include <memory>

#include "moex/base/tensor.h"
#include "moex/kernels/packed.h"

namespace moex::kernels {

struct Linear {
  TensorView view;                              // [out, in] as stored; unused when packed
  std::shared_ptr<const PackedWeights> packed;  // null: as stored
  int64_t bytes() const;                        // what one pass over W reads (codes + scales)
  int64_t out_features() const { return packed ? packed->rows : view.shape[0]; }
};

// y [T, out] (=, or += with accumulate) x [T, in] @ W^T. batch_invariant: a packed weight's calls run one loop
// whatever their row count where its two loops differ (KernelChoice::for_rows).
void linear(const float* x, int64_t tokens, const Linear& w, float* y, bool accumulate = false,
            bool batch_invariant = false);

struct LinearOutput {
  const Linear* w = nullptr;
  float* y = nullptr;
  bool accumulate = false;
};
// Several products of the same x [T, in] (attention's q, k and v) in one parallel region when they are all as
// stored or all packed alike; each output's numbers are linear()'s.
void linear_group(const float* x, int64_t tokens, const LinearOutput* outputs, int count, bool batch_invariant = false);

// A SwiGLU FFN packed for the fused kernels: w13 = pack_gate_up(w1, w3) [I outputs over d], w2 [d outputs over I].
struct PackedFfn {
  PackedWeights w13, w2;
};
// out [T, d] (=) w2(silu(w1 x) * (w3 x)) for x [T, d], through the fused pass with one expert (routing weight 1
// into a zeroed out, so each row is the down projection itself). h is scratch [T, I].
void linear_ffn(const float* x, int64_t tokens, const PackedFfn& w, float* h, float* out, bool batch_invariant = false);

}  // namespace moex::kernels

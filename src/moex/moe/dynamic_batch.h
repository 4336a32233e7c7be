// MoEDynamicBatch: groups a step's T*k (token, expert) assignments by expert so that each expert runs
// its SwiGLU FFN once, as one matrix product over all its tokens (its weights are read once per step,
// not once per token), then scatters the results back weighted by the router.
//
// Capacity (DESIGN.md §3): capacity = ceil(k*T/E * capacity_factor); capacity_factor <= 0 is dropless, and so
// is a capacity above T (no expert can receive more than T assignments).
// Overflow keeps assignments in priority order - every token's first choice (in token order), then every
// second choice, ... - so second choices drop before first choices. A dropped assignment adds zero.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moex/base/tensor.h"
#include "moex/kernels/linear.h"

namespace moex {

struct ExpertWeights {
  TensorView w1;  // [I, d] gate projection
  TensorView w3;  // [I, d] up projection
  TensorView w2;  // [d, I] down projection
  // The same weights packed (shared experts and dense MLP layers under a packed --dense-weights); null: as stored.
  // A MoE layer's routed experts keep theirs in MoELayerWeights::packed instead (one arena per layer).
  std::shared_ptr<const kernels::PackedFfn> packed = nullptr;
};

// One MoE layer's load in one step: what the profiler and the benchmarks report.
struct MoELoadStats {
  std::vector<int> tokens_per_expert;  // [E] assignments kept per expert
  std::vector<int> drops_per_expert;   // [E] assignments routed to the expert but over its capacity
  int64_t assignments = 0;             // T * k
  int64_t drops = 0;                   // assignments over capacity
  int64_t capacity = 0;                // 0 when dropless
  double max_over_mean() const;        // max tokens_per_expert / mean; 1.0 is perfectly balanced
};

class MoEDynamicBatch {
 public:
  MoEDynamicBatch(int num_experts, int top_k, float capacity_factor);

  // Counting sort of the assignments by expert, with capacity. expert_ids [T, k].
  void plan(const int32_t* expert_ids, int64_t tokens);

  // The plan, as index lists: rows [offsets[e], offsets[e+1]) belong to expert e; row r came from token
  // row_token[r], choice row_choice[r]. Within an expert, rows are in token order (deterministic).
  const std::vector<int64_t>& expert_offsets() const { return expert_offsets_; }
  const std::vector<int32_t>& row_token() const { return row_token_; }
  const std::vector<int32_t>& row_choice() const { return row_choice_; }
  // assignment_row[t*k + j]: the row of token t's j-th choice, or -1 when it was dropped.
  const std::vector<int32_t>& assignment_row() const { return assignment_row_; }
  const MoELoadStats& stats() const { return stats_; }

  // x [T, d] -> gathered [rows, d] in plan order. Threads split rows.
  void gather(const float* x, int64_t d, float* gathered) const;
  // Plan rows [row_begin, row_end) only (one rank's experts): gathered [row_end - row_begin, d].
  void gather(const float* x, int64_t d, float* gathered, int64_t row_begin, int64_t row_end) const;
  // out [T, d] = sum_j weight[t, j] * expert_out[row(t, j)], choices added in order j = 0..k-1;
  // `accumulate` adds onto out instead of overwriting it. Threads split tokens (the order per token is fixed).
  void combine(const float* expert_out, const float* expert_weights, int64_t tokens, int64_t d, float* out,
               bool accumulate) const;

  int num_experts() const { return num_experts_; }
  int top_k() const { return top_k_; }
  float capacity_factor() const { return capacity_factor_; }
  static int64_t capacity_for(int64_t tokens, int num_experts, int top_k, float capacity_factor);

 private:
  int num_experts_, top_k_;
  float capacity_factor_;
  std::vector<int64_t> expert_offsets_;  // [E + 1]
  std::vector<int32_t> row_token_, row_choice_, assignment_row_;
  std::vector<int64_t> cursor_;
  MoELoadStats stats_;
};

// The first half of one expert's SwiGLU over `rows` gathered tokens: act [rows, I] = silu(w1 x) * w3 x.
// hidden_up is scratch [rows, I]. Split from w2 so a caller can run w2 in chunks (the TP overlap).
void expert_up(const ExpertWeights& w, const float* x, int64_t rows, float* act, float* hidden_up);
// SwiGLU FFN of one expert over `rows` gathered tokens: out [rows, d] = w2(silu(w1 x) * w3 x): packed weights
// through kernels::linear_ffn (batch_invariant: KernelChoice::for_rows), else as stored (f32 activations).
// hidden_gate/hidden_up are scratch [rows, I].
void expert_ffn(const ExpertWeights& w, const float* x, int64_t rows, float* hidden_gate, float* hidden_up,
                float* out, bool batch_invariant = false);

}  // namespace moex

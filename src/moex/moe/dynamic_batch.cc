#include "moex/moe/dynamic_batch.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/linear.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/ops.h"

namespace moex {
namespace {
// Rows (or tokens) of d floats per thread task in gather/combine: below 2 tasks' worth, no fork/join.
constexpr int64_t kRowsPerTask = 16;
}  // namespace

double MoELoadStats::max_over_mean() const {
  if (tokens_per_expert.empty()) return 0.0;
  int64_t total = 0;
  int max_count = 0;
  for (int c : tokens_per_expert) {
    total += c;
    max_count = std::max(max_count, c);
  }
  return total == 0 ? 0.0 : max_count * static_cast<double>(tokens_per_expert.size()) / static_cast<double>(total);
}

MoEDynamicBatch::MoEDynamicBatch(int num_experts, int top_k, float capacity_factor)
    : num_experts_(num_experts), top_k_(top_k), capacity_factor_(capacity_factor) {
  MOEX_CHECK_INPUT(num_experts > 0 && top_k > 0 && top_k <= num_experts, "MoE: top_k ", top_k, " must be in 1..",
                   num_experts);
  expert_offsets_.assign(num_experts + 1, 0);
  cursor_.assign(num_experts, 0);
  stats_.tokens_per_expert.assign(num_experts, 0);
  stats_.drops_per_expert.assign(num_experts, 0);
}

int64_t MoEDynamicBatch::capacity_for(int64_t tokens, int num_experts, int top_k, float capacity_factor) {
  if (capacity_factor <= 0.0f) return 0;
  // Evaluated in double in the formula's own order, as the PyTorch reference does, so borderline cases agree.
  const double mean = static_cast<double>(top_k) * static_cast<double>(tokens) / num_experts;
  const double capacity = std::ceil(mean * static_cast<double>(capacity_factor));
  // An expert receives each token at most once, so a capacity above the token count drops nothing: that is
  // dropless, and clamping here keeps a huge or non-finite factor from overflowing the conversion.
  if (!(capacity <= static_cast<double>(tokens))) return 0;
  return static_cast<int64_t>(capacity);
}

void MoEDynamicBatch::plan(const int32_t* expert_ids, int64_t tokens) {
  const int E = num_experts_, k = top_k_;
  const int64_t assignments = tokens * k;
  const int64_t capacity = capacity_for(tokens, E, k, capacity_factor_);
  assignment_row_.assign(assignments, -1);
  std::vector<int>& counts = stats_.tokens_per_expert;
  std::fill(counts.begin(), counts.end(), 0);
  std::fill(stats_.drops_per_expert.begin(), stats_.drops_per_expert.end(), 0);
  stats_.drops = 0;

  // Pass 1, priority order (choice-major): decide which assignments fit. 0 marks "kept" for now.
  for (int j = 0; j < k; ++j) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t e = expert_ids[t * k + j];
      MOEX_CHECK(e >= 0 && e < E, "expert id ", e, " out of range");
      if (capacity > 0 && counts[e] >= capacity) {
        ++stats_.drops;
        ++stats_.drops_per_expert[e];
        continue;
      }
      ++counts[e];
      assignment_row_[t * k + j] = 0;
    }
  }
  // Pass 2, counting sort in token order: rows of an expert are contiguous and sorted by token.
  expert_offsets_[0] = 0;
  for (int e = 0; e < E; ++e) expert_offsets_[e + 1] = expert_offsets_[e] + counts[e];
  const int64_t rows = expert_offsets_[E];
  row_token_.resize(rows);
  row_choice_.resize(rows);
  std::copy(expert_offsets_.begin(), expert_offsets_.end() - 1, cursor_.begin());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      if (assignment_row_[t * k + j] < 0) continue;
      const int32_t e = expert_ids[t * k + j];
      const int64_t row = cursor_[e]++;
      row_token_[row] = static_cast<int32_t>(t);
      row_choice_[row] = j;
      assignment_row_[t * k + j] = static_cast<int32_t>(row);
    }
  }
  stats_.assignments = assignments;
  stats_.capacity = capacity;
}

void MoEDynamicBatch::gather(const float* x, int64_t d, float* gathered) const {
  gather(x, d, gathered, 0, static_cast<int64_t>(row_token_.size()));
}

void MoEDynamicBatch::gather(const float* x, int64_t d, float* gathered, int64_t row_begin, int64_t row_end) const {
  parallel_for(row_end - row_begin, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = row_begin + begin; r < row_begin + end; ++r)
      std::memcpy(gathered + (r - row_begin) * d, x + int64_t{row_token_[r]} * d, d * sizeof(float));
  });
}

void MoEDynamicBatch::combine(const float* expert_out, const float* expert_weights, int64_t tokens, int64_t d,
                              float* out, bool accumulate) const {
  const int k = top_k_;
  parallel_for(tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* y = out + t * d;
      if (!accumulate) std::fill(y, y + d, 0.0f);
      for (int j = 0; j < k; ++j) {
        const int32_t row = assignment_row_[t * k + j];
        if (row < 0) continue;  // dropped: contributes zero, the token keeps its residual
        const float weight = expert_weights[t * k + j];
        const float* src = expert_out + int64_t{row} * d;
        for (int64_t i = 0; i < d; ++i) y[i] += weight * src[i];
      }
    }
  });
}

void expert_up(const ExpertWeights& w, const float* x, int64_t rows, float* act, float* hidden_up) {
  if (rows == 0) return;
  kernels::matmul(x, rows, w.w1, act);        // [rows, I] gate projection
  kernels::matmul(x, rows, w.w3, hidden_up);  // [rows, I] up projection
  kernels::silu_mul(act, hidden_up, rows * w.w1.shape[0], act);
}

void expert_ffn(const ExpertWeights& w, const float* x, int64_t rows, float* hidden_gate, float* hidden_up,
                float* out, bool batch_invariant) {
  if (rows == 0) return;
  if (w.packed) {
    kernels::linear_ffn(x, rows, *w.packed, hidden_gate, out, batch_invariant);
    return;
  }
  expert_up(w, x, rows, hidden_gate, hidden_up);
  kernels::matmul(hidden_gate, rows, w.w2, out);  // [rows, d]
}

}  // namespace moex

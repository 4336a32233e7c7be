#include "moex/kernels/linear.h"

#include <algorithm>
#include <vector>

#include "moex/base/error.h"
#include "moex/kernels/matmul.h"

namespace moex::kernels {

int64_t Linear::bytes() const {
  return packed ? static_cast<int64_t>(packed->weight_bytes()) : static_cast<int64_t>(view.bytes());
}

void linear(const float* x, int64_t tokens, const Linear& w, float* y, bool accumulate, bool batch_invariant) {
  if (w.packed) packed_matmul(x, tokens, *w.packed, y, accumulate, batch_invariant);
  else matmul(x, tokens, w.view, y, accumulate);
}

void linear_group(const float* x, int64_t tokens, const LinearOutput* outputs, int count, bool batch_invariant) {
  constexpr int kMax = 4;
  bool all_stored = count <= kMax, all_packed = count <= kMax;
  for (int i = 0; i < count; ++i) {
    all_stored = all_stored && !outputs[i].w->packed;
    all_packed = all_packed && outputs[i].w->packed;
  }
  if (all_stored) {
    MatmulOutput group[kMax];
    for (int i = 0; i < count; ++i) group[i] = {outputs[i].w->view, outputs[i].y, outputs[i].accumulate};
    matmul_group(x, tokens, group, count);
  } else if (all_packed) {
    PackedOutput group[kMax];
    for (int i = 0; i < count; ++i) group[i] = {outputs[i].w->packed.get(), outputs[i].y, outputs[i].accumulate};
    packed_matmul_group(x, tokens, group, count, batch_invariant);
  } else {
    for (int i = 0; i < count; ++i)
      linear(x, tokens, *outputs[i].w, outputs[i].y, outputs[i].accumulate, batch_invariant);
  }
}

void linear_ffn(const float* x, int64_t tokens, const PackedFfn& w, float* h, float* out, bool batch_invariant) {
  if (tokens <= 0) return;
  // The routing weights (all 1) and each row's output row: sized up once, never down, so a step does not allocate.
  thread_local std::vector<float> ones;
  thread_local std::vector<int32_t> rows;
  if (static_cast<int64_t>(ones.size()) < tokens) {
    ones.assign(tokens, 1.0f);
    rows.resize(tokens);
    for (int64_t t = 0; t < tokens; ++t) rows[t] = static_cast<int32_t>(t);
  }
  std::fill_n(out, tokens * w.w2.rows, 0.0f);
  ExpertRows e;
  e.w13 = &w.w13;
  e.w2 = &w.w2;
  e.x = x;
  e.rows = tokens;
  e.h = h;
  e.route_weights = ones.data();
  e.out_rows = rows.data();
  fused_experts(&e, 1, out, w.w2.rows, batch_invariant);
}

}  // namespace moex::kernels

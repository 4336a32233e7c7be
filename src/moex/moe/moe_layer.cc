#include "moex/moe/moe_layer.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "moex/base/error.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/ops.h"
#include "moex/profile/profile.h"

namespace moex {

std::string ExpertWeightFormat::name() const {
  if (!packed) return "as-stored";
  const kernels::FormatTraits& traits = kernels::format_traits(format);
  // The group is part of the path's name where the user sets it (int4-g128); else the short spelling if any (fp8).
  if (kernels::group_is_user_set(format)) return std::string(traits.name) + "-g" + std::to_string(group);
  return std::string(traits.alias.empty() ? traits.name : traits.alias);
}

PackedExpert pack_expert(const ExpertWeights& w, const ExpertWeightFormat& f) {
  MOEX_CHECK(f.packed, "pack_expert needs a packed format");
  const auto quantize = [&](const TensorView& m) { return kernels::quantize(m, f.format, f.group); };
  PackedExpert packed;
  packed.w13 = kernels::pack_gate_up(quantize(w.w1), quantize(w.w3));
  packed.w2 = kernels::pack(quantize(w.w2));
  return packed;
}

MoELayer::MoELayer(const MoELayerShape& shape, const ParallelPlan& plan, comm::Communicator* comm,
                   RouterFusion fusion, float capacity_factor, int64_t max_tokens)
    : shape_(shape),
      plan_(plan),
      comm_(comm),
      router_(shape.experts, shape.top_k, fusion, shape.norm_topk_prob, shape.router),
      batcher_(shape.slots > 0 ? shape.slots : shape.experts, shape.top_k, capacity_factor),
      eplb_(shape.slots > 0),
      slots_(shape.slots > 0 ? shape.slots : shape.experts) {
  MOEX_CHECK(plan.single() || comm != nullptr, "a parallel plan needs a communicator");
  MOEX_CHECK(slots_ % plan.ep == 0, "expert slots must split over the EP ranks");
  rank_tokens_.resize(plan.ep);
  if (eplb_) {
    slot_ids_.resize(static_cast<size_t>(max_tokens) * shape.top_k);
    replica_next_.resize(shape.experts);
    logical_stats_.tokens_per_expert.assign(shape.experts, 0);
    logical_stats_.drops_per_expert.assign(shape.experts, 0);
  }
  const size_t T = max_tokens, k = shape.top_k, d = shape.hidden, I = shape.intermediate_local;
  expert_ids_.resize(T * k);
  expert_weights_.resize(T * k);
  gathered_.resize(T * k * d);
  hidden_up_.resize(T * k * I);
  act_.resize(T * k * I);
  expert_out_.resize(T * k * d);
  row_weights_.resize(T * k);
  row_out_.resize(T * k);
  if (!plan.single()) partial_ = static_cast<float*>(comm->alloc_registered(T * d * sizeof(float)));
  if (plan.overlap) column_chunk_.resize(k * d);
  if (plan.comm_dtype == comm::CommDType::kBF16) bf16_buffer_.resize(T * d);
  if (plan.attn == AttnParallel::kDP && !plan.single()) {
    const size_t P = plan.world, per_rank = slots_ / plan.ep;
    for (auto* v : {&dispatch_.send_counts, &dispatch_.send_offsets, &dispatch_.recv_counts, &dispatch_.recv_offsets})
      v->resize(P);
    const size_t stride = per_rank + 1;  // a peer's E/P counts, then the sender's largest block in rows
    dispatch_.count_per_peer.assign(P, stride);
    dispatch_.count_displs.resize(P);
    for (size_t p = 0; p < P; ++p) dispatch_.count_displs[p] = p * stride;
    dispatch_.send_expert_rows.resize(P * stride);
    dispatch_.recv_expert_rows.resize(P * stride);
    dispatch_.rows_from.resize(P);
    dispatch_.source_row.resize(P * per_rank);
    dispatch_.expert_begin.resize(per_rank + 1);
  }
}

void MoELayer::forward(int layer, const MoELayerWeights& w, const float* x, int64_t tokens, float* residual) {
  if (plan_.attn == AttnParallel::kDP && !plan_.single())
    forward_dispatch(layer, w, x, tokens, residual);
  else
    forward_replicated(layer, w, x, tokens, residual);
  if (eplb_) {  // the load per logical expert: the sum over its replicas
    const MoELoadStats& s = batcher_.stats();
    std::fill(logical_stats_.tokens_per_expert.begin(), logical_stats_.tokens_per_expert.end(), 0);
    std::fill(logical_stats_.drops_per_expert.begin(), logical_stats_.drops_per_expert.end(), 0);
    for (int slot = 0; slot < slots_; ++slot) {
      logical_stats_.tokens_per_expert[w.placement.slot_expert[slot]] += s.tokens_per_expert[slot];
      logical_stats_.drops_per_expert[w.placement.slot_expert[slot]] += s.drops_per_expert[slot];
    }
    logical_stats_.assignments = s.assignments;
    logical_stats_.drops = s.drops;
    logical_stats_.capacity = s.capacity;
  }
  profile::add_tokens_per_expert(layer, stats().tokens_per_expert.data(), shape_.experts);
  if (plan_.ep > 1 && profile::enabled()) {  // what each EP rank's experts (slots) computed: its balance
    const int per_rank = slots_ / plan_.ep;
    const MoELoadStats& s = batcher_.stats();
    std::fill(rank_tokens_.begin(), rank_tokens_.end(), 0);
    for (int slot = 0; slot < slots_; ++slot) rank_tokens_[slot / per_rank] += s.tokens_per_expert[slot];
    profile::add_tokens_per_rank(layer, rank_tokens_.data(), plan_.ep);
  }
}

void MoELayer::route(int layer, const MoELayerWeights& w, const float* x, int64_t tokens) {
  MOEX_ZONE_LAYER(kRouter, layer);
  router_.route(x, tokens, w.gate, expert_ids_.data(), expert_weights_.data(), w.gate_bias);
  if (!eplb_) return;
  // Each assignment to one replica of its expert: the n-th assignment of expert e in this step (token order,
  // then choice) goes to replica (n + offset) mod replicas(e), so an expert's rows split evenly over its replicas
  // and the choice depends on nothing but the step's ids. Under tp attention every rank routes the same tokens
  // and must agree (offset 0); under dp attention each rank sends only its own and starts at its rank, spreading
  // the ranks' small batches over the replicas.
  const eplb::Placement& p = w.placement;
  MOEX_CHECK(p.slots() == slots_ && p.experts == shape_.experts, "the layer's placement does not match the model's slots");
  const int offset = plan_.attn == AttnParallel::kDP ? plan_.rank : 0;
  std::fill(replica_next_.begin(), replica_next_.end(), offset);
  const int64_t n = tokens * shape_.top_k;
  for (int64_t i = 0; i < n; ++i) {
    const int e = expert_ids_[i];
    const int first = p.replica_offsets[e], count = p.replica_offsets[e + 1] - first;
    slot_ids_[i] = p.replica_slots[first + replica_next_[e]++ % count];
  }
}

void MoELayer::experts(int layer, const MoELayerWeights& w, const float* x_rows, const int64_t* begin,
                       const float* row_weights, const int32_t* out_rows, float* out) {
  const int64_t d = shape_.hidden, I = shape_.intermediate_local;
  const int count = w.experts.count;
  MOEX_ZONE_LAYER(kExperts, layer);
  if (!w.packed.empty()) {
    // Only the experts that got rows, in expert order (the sum's order): with 128 experts top-8 the pass's
    // bookkeeping is O(active experts), not O(E).
    expert_rows_.resize(count);
    int active = 0;
    for (int le = 0; le < count; ++le) {
      if (begin[le + 1] == begin[le]) continue;
      kernels::ExpertRows& e = expert_rows_[active++];
      e.w13 = &w.packed[le].w13;
      e.w2 = &w.packed[le].w2;
      e.x = x_rows + begin[le] * d;
      e.rows = begin[le + 1] - begin[le];
      e.h = act_.data() + begin[le] * I;
      e.route_weights = row_weights + begin[le];
      e.out_rows = out_rows + begin[le];
    }
    kernels::fused_experts(expert_rows_.data(), active, out, d, batch_invariant_);
    return;
  }
  // As stored: each matmul is its own parallel region over the expert's weights, f32 activations (exact).
  for (int le = 0; le < count; ++le) {
    const int64_t b = begin[le], rows = begin[le + 1] - b;
    if (rows == 0) continue;
    expert_up(w.local[le], x_rows + b * d, rows, act_.data() + b * I, hidden_up_.data());
    kernels::matmul(act_.data() + b * I, rows, w.local[le].w2, expert_out_.data() + b * d);  // [rows, d]
  }
  const int64_t rows = begin[count];
  for (int64_t r = 0; r < rows; ++r) {  // rows in expert order: each output row sums its experts in that order
    const float weight = row_weights[r], *src = expert_out_.data() + r * d;
    float* y = out + int64_t{out_rows[r]} * d;
    for (int64_t i = 0; i < d; ++i) y[i] += weight * src[i];
  }
}

// Tokens are the same on every rank: each computes its experts (or expert slices) for all of them, and
// one all-reduce per layer sums the shares. Single rank: the same path with no reduction.
void MoELayer::forward_replicated(int layer, const MoELayerWeights& w, const float* x, int64_t tokens,
                                  float* residual) {
  const int64_t d = shape_.hidden;
  const int k = shape_.top_k, first = w.experts.first, count = w.experts.count;
  route(layer, w, x, tokens);
  const auto& offsets = batcher_.expert_offsets();
  int64_t row_begin = 0, row_end = 0;
  {  // plan + gather: only the rows of this rank's experts, with each row's routing weight and token
    MOEX_ZONE_LAYER(kDispatch, layer);
    batcher_.plan(plan_ids(), tokens);
    row_begin = offsets[first];
    row_end = offsets[first + count];
    const auto& row_token = batcher_.row_token();
    const auto& row_choice = batcher_.row_choice();
    local_begin_.resize(count + 1);
    for (int le = 0; le <= count; ++le) local_begin_[le] = offsets[first + le] - row_begin;
    // The copy over the threads (at prefill, pp512 on mini, 1,024 rows of 4 KB a layer: one thread's was ~4% of
    // the step); the weights are one float a row.
    batcher_.gather(x, d, gathered_.data(), row_begin, row_end);
    for (int64_t r = row_begin; r < row_end; ++r)
      row_weights_[r - row_begin] = expert_weights_[int64_t{row_token[r]} * k + row_choice[r]];
  }
  const int32_t* out_rows = batcher_.row_token().data() + row_begin;
  if (plan_.single()) {
    experts(layer, w, gathered_.data(), local_begin_.data(), row_weights_.data(), out_rows, residual);
    return;
  }
  float* partial = partial_;  // [T, d] this rank's share
  const bool overlap = plan_.overlap && plan_.comm_dtype != comm::CommDType::kBF16;
  MOEX_CHECK(!(overlap && !w.packed.empty()), "--overlap with packed expert weights is refused when the model is built");
  if (!overlap) {
    std::fill(partial, partial + tokens * d, 0.0f);
    experts(layer, w, gathered_.data(), local_begin_.data(), row_weights_.data(), out_rows, partial);
    MOEX_ZONE_LAYER(kAllReduce, layer);
    comm::allreduce_f32(*comm_, partial, static_cast<size_t>(tokens * d), plan_.comm_dtype, bf16_buffer_);
  } else {
    experts_overlapped(layer, w, tokens, row_begin, row_end, partial);
  }
  for (int64_t i = 0; i < tokens * d; ++i) residual[i] += partial[i];
}

void MoELayer::experts_overlapped(int layer, const MoELayerWeights& w, int64_t tokens, int64_t row_begin,
                                  int64_t row_end, float* partial) {
  const int64_t d = shape_.hidden, I = shape_.intermediate_local;
  const int first = w.experts.first, last = w.experts.first + w.experts.count;
  const auto& offsets = batcher_.expert_offsets();
  const auto& row_token = batcher_.row_token();
  {
    MOEX_ZONE_LAYER(kExperts, layer);
    for (int e = first; e < last; ++e) {
      const int64_t begin = offsets[e] - row_begin, rows = offsets[e + 1] - offsets[e];
      expert_up(w.local[e - first], gathered_.data() + begin * d, rows, act_.data() + begin * I, hidden_up_.data());
    }
  }
  // w2 and the weighted combine for tokens [t0, t1) or output columns [c0, c1) (one token: split d).
  const auto down_and_combine = [&](int64_t t0, int64_t t1, int64_t c0, int64_t c1) {
    MOEX_ZONE_LAYER(kExperts, layer);
    for (int64_t t = t0; t < t1; ++t) std::fill(partial + t * d + c0, partial + t * d + c1, 0.0f);
    for (int e = first; e < last; ++e) {
      // Rows of an expert are in token order, so tokens [t0, t1) are one contiguous run of its rows.
      int64_t r0 = offsets[e], r1 = offsets[e + 1];
      while (r0 < r1 && row_token[r0] < t0) ++r0;
      int64_t r_end = r0;
      while (r_end < r1 && row_token[r_end] < t1) ++r_end;
      if (r_end == r0) continue;
      const TensorView w2 = c0 == 0 && c1 == d ? w.local[e - first].w2 : w.local[e - first].w2.rows(c0, c1);
      // [rows, c1 - c0]: a column chunk only at T < kChunks, so at most 3 rows of d / 4 (column_chunk_ [k, d])
      float* y = c0 == 0 && c1 == d ? expert_out_.data() + (r0 - row_begin) * d : column_chunk_.data();
      kernels::matmul(act_.data() + (r0 - row_begin) * I, r_end - r0, w2, y);
      for (int64_t r = r0; r < r_end; ++r) {
        float* out = partial + int64_t{row_token[r]} * d;
        const float weight = row_weights_[r - row_begin];
        for (int64_t i = c0; i < c1; ++i) out[i] += weight * y[(r - r0) * (c1 - c0) + i - c0];
      }
    }
  };
  // Chunked: reduce chunk i on the progress thread while chunk i+1 is computed. Chunks are token
  // ranges, or column ranges of the single token at decode batch 1.
  constexpr int kChunks = 4;
  std::array<comm::CommHandle, kChunks> handles;
  for (int c = 0; c < kChunks; ++c) {
    int64_t t0 = 0, t1 = tokens, c0 = 0, c1 = d;
    if (tokens >= kChunks) {
      t0 = tokens * c / kChunks;
      t1 = tokens * (c + 1) / kChunks;
    } else {
      c0 = d * c / kChunks;
      c1 = d * (c + 1) / kChunks;
      if (tokens == 0) c1 = c0;
    }
    down_and_combine(t0, t1, c0, c1);
    float* chunk = tokens >= kChunks ? partial + t0 * d : partial + c0;
    const size_t n = tokens >= kChunks ? static_cast<size_t>((t1 - t0) * d) : static_cast<size_t>(c1 - c0);
    handles[c] = comm_->start_allreduce(chunk, tokens == 0 ? 0 : n, plan_.comm_dtype);
  }
  MOEX_ZONE_LAYER(kAllReduce, layer);  // what remains after the last chunk's compute: the exposed wait
  for (auto& h : handles) h.wait();
}

// dp attention + ep: each rank routes its own tokens, sends every assignment's row to the rank owning
// the expert (all-to-all(v)), computes its experts over all rows that arrive, and sends the outputs back.
void MoELayer::forward_dispatch(int layer, const MoELayerWeights& w, const float* x, int64_t tokens,
                                float* residual) {
  const int64_t d = shape_.hidden, I = shape_.intermediate_local;
  const int per_rank = w.experts.count, P = plan_.world, stride = per_rank + 1;
  route(layer, w, x, tokens);
  const auto& offsets = batcher_.expert_offsets();
  DispatchPlan& dp = dispatch_;  // sized once in the constructor: nothing here allocates per step
  auto &send_counts = dp.send_counts, &send_offsets = dp.send_offsets, &recv_counts = dp.recv_counts,
       &recv_offsets = dp.recv_offsets;
  auto &send_expert_rows = dp.send_expert_rows, &recv_expert_rows = dp.recv_expert_rows;
  {
    MOEX_ZONE_LAYER(kDispatch, layer);
    batcher_.plan(plan_ids(), tokens);
    batcher_.gather(x, d, gathered_.data());  // plan order = expert order = destination-rank order
    int32_t largest = 0;  // rows in this rank's largest block (to one peer)
    for (int p = 0; p < P; ++p) {
      for (int le = 0; le < per_rank; ++le) {
        const int e = p * per_rank + le;
        send_expert_rows[p * stride + le] = static_cast<int32_t>(offsets[e + 1] - offsets[e]);
      }
      largest = std::max(largest, static_cast<int32_t>(offsets[(p + 1) * per_rank] - offsets[p * per_rank]));
    }
    for (int p = 0; p < P; ++p) send_expert_rows[p * stride + per_rank] = largest;
  }
  // 1. How many rows of each of its experts every rank will receive (E/P counts per pair), and each rank's largest
  // block, so that every rank knows the group's for the two all-to-alls below without agreeing on it: `auto` picks
  // their algorithm by it (comm/alltoall.cc). The counts are E/P + 1 int32 per peer on every rank: known, passed.
  {
    MOEX_ZONE_LAYER(kAllToAll, layer);
    comm_->alltoallv(send_expert_rows.data(), dp.count_per_peer, dp.count_displs, recv_expert_rows.data(),
                     dp.count_per_peer, dp.count_displs, sizeof(int32_t), comm::AlltoallAlgo::kAuto,
                     stride * sizeof(int32_t));
  }
  int64_t group_largest = 0;  // rows: every rank computes it from the same P figures
  for (int p = 0; p < P; ++p) group_largest = std::max<int64_t>(group_largest, recv_expert_rows[p * stride + per_rank]);
  // 2. The rows themselves, encoded in the comm dtype, one block per destination.
  int64_t recv_rows = 0;
  auto& rows_from = dp.rows_from;
  for (int p = 0; p < P; ++p) {
    int64_t rows = 0;
    for (int le = 0; le < per_rank; ++le) rows += recv_expert_rows[p * stride + le];
    rows_from[p] = rows;
    recv_rows += rows;
  }
  int64_t arrived = 0;
  for (int p = 0; p < P; ++p) {  // in values: one block per peer, rows of d
    const int64_t row0 = offsets[p * per_rank], rows = offsets[(p + 1) * per_rank] - row0;
    send_offsets[p] = static_cast<size_t>(row0 * d);
    send_counts[p] = static_cast<size_t>(rows * d);
    recv_offsets[p] = static_cast<size_t>(arrived * d);
    recv_counts[p] = static_cast<size_t>(rows_from[p] * d);
    arrived += rows_from[p];
  }
  received_.resize(std::max<int64_t>(recv_rows * d, 1));
  by_expert_.resize(std::max<int64_t>(recv_rows * d, 1));
  if (static_cast<int64_t>(act_.size()) < recv_rows * I) {  // arrivals can exceed T*k under skew
    act_.resize(recv_rows * I);
    hidden_up_.resize(recv_rows * I);
  }
  {
    MOEX_ZONE_LAYER(kAllToAll, layer);
    comm::alltoallv_f32(*comm_, gathered_.data(), send_counts, send_offsets, received_.data(), recv_counts, recv_offsets,
                        plan_.comm_dtype, wire_, static_cast<size_t>(group_largest * d));
  }
  // 3. Regroup arrivals by local expert (they come grouped by source, then expert) and run the experts
  // once over all of them; each output row goes straight back to its arrival's place in received_.
  auto &source_row = dp.source_row, &expert_begin = dp.expert_begin;
  std::fill(expert_begin.begin(), expert_begin.end(), 0);
  {
    int64_t row = 0;
    for (int p = 0; p < P; ++p)
      for (int le = 0; le < per_rank; ++le) {
        source_row[p * per_rank + le] = row;
        row += recv_expert_rows[p * stride + le];
        expert_begin[le + 1] += recv_expert_rows[p * stride + le];
      }
    for (int le = 0; le < per_rank; ++le) expert_begin[le + 1] += expert_begin[le];
  }
  if (static_cast<int64_t>(row_out_.size()) < recv_rows) {  // arrivals can exceed T*k under skew
    row_out_.resize(recv_rows);
    row_weights_.resize(recv_rows);
  }
  if (static_cast<int64_t>(expert_out_.size()) < recv_rows * d) expert_out_.resize(recv_rows * d);
  for (int le = 0; le < per_rank; ++le) {
    int64_t dst = expert_begin[le];
    for (int p = 0; p < P; ++p) {
      const int64_t n = recv_expert_rows[p * stride + le], src = source_row[p * per_rank + le];
      std::memcpy(by_expert_.data() + dst * d, received_.data() + src * d, n * d * sizeof(float));
      for (int64_t i = 0; i < n; ++i) row_out_[dst + i] = static_cast<int32_t>(src + i);
      dst += n;
    }
  }
  // The routing weights stay with the sender, which combines; here each output is added once, with weight 1
  // onto zero: exactly the expert's output.
  std::fill(row_weights_.begin(), row_weights_.begin() + recv_rows, 1.0f);
  std::fill(received_.begin(), received_.begin() + recv_rows * d, 0.0f);
  experts(layer, w, by_expert_.data(), expert_begin.data(), row_weights_.data(), row_out_.data(), received_.data());
  // 4. Outputs go back the way they came; the sender combines them with its routing weights. The blocks are the
  // dispatch's transposed: the same largest one.
  {
    MOEX_ZONE_LAYER(kAllToAll, layer);
    comm::alltoallv_f32(*comm_, received_.data(), recv_counts, recv_offsets, expert_out_.data(), send_counts, send_offsets,
                        plan_.comm_dtype, wire_, static_cast<size_t>(group_largest * d));
  }
  MOEX_ZONE_LAYER(kCombine, layer);
  batcher_.combine(expert_out_.data(), expert_weights_.data(), tokens, d, residual, /*accumulate=*/true);
}

}  // namespace moex

// MoELayer: one Mixtral MoE block under a ParallelPlan: route (GatingTopK), group by expert
// (MoEDynamicBatch), run this rank's experts (or expert slices), and bring the results back - by one
// all-reduce when tokens are replicated (tp attention), or by all-to-all(v) dispatch and combine when
// each rank serves its own tokens (dp attention + ep).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/comm/communicator.h"
#include "moex/kernels/packed.h"
#include "moex/moe/dynamic_batch.h"
#include "moex/moe/eplb.h"
#include "moex/moe/gating.h"
#include "moex/moe/parallel_plan.h"

namespace moex {

// How the experts' weights are held (`--weights`): as the checkpoint stores them (read from the mapping by
// kernels::matmul with f32 activations), or quantized and repacked once at load into a kernels::WeightFormat.
struct ExpertWeightFormat {
  bool packed = false;
  kernels::WeightFormat format = kernels::WeightFormat::kBF16;
  int64_t group = 128;  // kInt4: codes per scale along K (32, 64, 128); symmetric (zero 8)
  std::string name() const;  // "as-stored", "bf16", "int8", "int4-g128", "fp8"
};

// One expert repacked for the fused kernels: w13 = pack_gate_up(w1, w3) [I_local outputs], w2 [d outputs].
using PackedExpert = kernels::PackedFfn;
// Quantizes (per `format`, which must be packed) and packs one expert's weights; threads split the rows.
PackedExpert pack_expert(const ExpertWeights& w, const ExpertWeightFormat& format);

struct MoELayerWeights {
  TensorView gate;                     // [E, d] router (every rank)
  TensorView gate_bias;                // [E] e_score_correction_bias (sigmoid router only), else empty
  ExpertRange experts;                 // the global experts (EPLB: physical slots) this rank computes
  // EPLB (moe/eplb.h): which logical expert each physical slot holds, over all EP ranks; `local`/`packed` are this
  // rank's slots in slot order. Empty: no EPLB, slot e is expert e.
  eplb::Placement placement;
  std::vector<ExpertWeights> local;    // [experts.count]: w1/w3 [I_local, d], w2 [d, I_local] (strided under TP)
  std::vector<PackedExpert> packed;    // [experts.count] when the experts are packed; empty: `local` runs
};

struct MoELayerShape {
  int64_t hidden = 0;              // d
  int64_t intermediate_local = 0;  // I / tp
  int experts = 0, top_k = 0;
  bool norm_topk_prob = true;
  RouterSpec router;               // softmax (default) or the sigmoid grouped router
  int slots = 0;                   // EPLB: physical expert slots over all EP ranks (every layer's); 0: `experts`
};

class MoELayer {
 public:
  MoELayer(const MoELayerShape& shape, const ParallelPlan& plan, comm::Communicator* comm, RouterFusion fusion,
           float capacity_factor, int64_t max_tokens);

  // x [T, d]: this rank's normalised tokens (T may be 0 under dp attention: the rank still takes part in
  // the collectives). Adds the layer's output onto residual [T, d].
  void forward(int layer, const MoELayerWeights& w, const float* x, int64_t tokens, float* residual);

  // `--batch-invariant`: the packed experts run one kernel loop whatever their row counts (ModelOptions).
  void set_batch_invariant(bool on) { batch_invariant_ = on; }

  // The last call's load per logical expert (this rank's tokens; identical on every rank under tp attention).
  const MoELoadStats& stats() const { return eplb_ ? logical_stats_ : batcher_.stats(); }
  // ... per physical slot (EPLB; without it, the same as stats()): what each rank's experts computed.
  const MoELoadStats& slot_stats() const { return batcher_.stats(); }

 private:
  // The plans compose the same stages: route -> plan -> gather (local copy, or all-to-all dispatch) ->
  // experts (up, then down + combine) -> all-reduce or all-to-all back.
  void forward_replicated(int layer, const MoELayerWeights& w, const float* x, int64_t tokens, float* residual);
  void forward_dispatch(int layer, const MoELayerWeights& w, const float* x, int64_t tokens, float* residual);
  // Route: expert_ids_, expert_weights_ [T, k]; under EPLB also slot_ids_, each assignment's replica.
  void route(int layer, const MoELayerWeights& w, const float* x, int64_t tokens);
  // The ids the plan groups by: logical experts, or (EPLB) the replicas route() chose.
  const int32_t* plan_ids() const { return eplb_ ? slot_ids_.data() : expert_ids_.data(); }
  // This rank's experts over rows grouped by local expert: rows [begin[le], begin[le+1]) of x_rows [R, d] are
  // local expert le's. Up, then down + combine: out[out_rows[r]] += row_weights[r] * expert(x_rows[r]) (out
  // stride d). Packed weights: one kernels::fused_experts pass; as stored: expert by expert through matmul.
  void experts(int layer, const MoELayerWeights& w, const float* x_rows, const int64_t* begin,
               const float* row_weights, const int32_t* out_rows, float* out);
  // Up, then w2 in column chunks whose all-reduce overlaps the next chunk (as stored, TP, --overlap).
  void experts_overlapped(int layer, const MoELayerWeights& w, int64_t tokens, int64_t row_begin, int64_t row_end,
                          float* partial);

  MoELayerShape shape_;
  ParallelPlan plan_;
  comm::Communicator* comm_;
  GatingTopK router_;
  MoEDynamicBatch batcher_;
  bool batch_invariant_ = false;
  bool eplb_ = false;                  // shape.slots set: the plan groups by physical slot
  int slots_ = 0;                      // experts, or physical slots under EPLB
  std::vector<int32_t> slot_ids_;      // [T, k] EPLB: the replica each assignment goes to
  std::vector<int32_t> replica_next_;  // [E] EPLB: assignments of each expert seen in this step
  MoELoadStats logical_stats_;         // EPLB: batcher_'s stats folded back onto logical experts
  std::vector<int> rank_tokens_;       // [ep] tokens each EP rank's experts computed (the profiler's balance)

  std::vector<int32_t> expert_ids_;    // [T, k]
  std::vector<float> expert_weights_;  // [T, k]
  std::vector<float> gathered_;        // [T*k, d] rows in plan order (dispatch: also what arrives)
  std::vector<float> hidden_up_;       // [T*k, I_local]
  std::vector<float> act_;             // [T*k, I_local]
  std::vector<float> expert_out_;      // [T*k, d]
  std::vector<float> row_weights_;     // [rows] routing weight of each row the experts stage runs
  std::vector<int32_t> row_out_;       // [rows] the row of the stage's output each row adds into
  std::vector<int64_t> local_begin_;   // [E_local + 1] local experts' first rows
  std::vector<kernels::ExpertRows> expert_rows_;  // [E_local] the fused pass's arguments
  // [T, d] this rank's share of the output, before the all-reduce. Registered memory of comm_ (owned by it):
  // the shm all-reduce reads it in place instead of copying it into its window.
  float* partial_ = nullptr;
  std::vector<float> column_chunk_;    // [k, d] w2 outputs of one token's column chunk (overlap at T=1)
  std::vector<uint16_t> bf16_buffer_;  // [T*d] bf16 all-reduce payload
  // Dispatch path (dp attention): wire buffers (comm::alltoallv_f32's) and per-source bookkeeping.
  comm::WireScratch wire_;
  struct DispatchPlan {
    std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;  // [P] fp32 values per peer block
    std::vector<size_t> count_per_peer, count_displs;                        // [P] E/P + 1 counts each
    // [P, E/P + 1] rows this rank sends to each of a peer's experts, then its largest block (rows to one peer)
    std::vector<int32_t> send_expert_rows;
    // [P, E/P + 1] rows arriving from each source for each local expert, then that source's largest block
    std::vector<int32_t> recv_expert_rows;
    std::vector<int64_t> rows_from;          // [P]
    std::vector<int64_t> source_row;         // [P, E/P] first arriving row of (source, local expert)
    std::vector<int64_t> expert_begin;       // [E/P + 1] local experts' rows after regrouping
  } dispatch_;
  std::vector<float> received_, by_expert_;
};

}  // namespace moex

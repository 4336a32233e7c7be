// ParallelPlan: how N ranks share one Mixtral model (docs/DESIGN.md §1, docs/moe.md).
//   attention  tp: query heads split over all N ranks (KV heads split, or replicated when there are fewer
//                  KV heads than ranks), one all-reduce after o_proj; every rank sees every token.
//              dp: every rank holds all of attention and serves its own sequences (slot % N == rank).
//   MoE        tp: every expert's intermediate dim split N ways (w1/w3 by rows, w2 by columns).
//              ep: whole experts per rank (E/N each).
//              tpxep: ep groups of experts, each expert split across the tp ranks of its group.
// With tp attention (tokens replicated) every MoE plan computes its share and ends in ONE all-reduce per
// MoE layer (the sum over experts and over slices is linear, so one reduction serves all experts; one per
// expert would multiply the all-reduces by the experts per token). With dp attention, tokens travel to
// their experts' ranks by all-to-all(v) and come back the same way.
#pragma once
#include <string>

#include "moex/comm/topology.h"
#include "moex/comm/types.h"

namespace moex {

enum class MoEParallel { kTP, kEP, kTPxEP };
enum class AttnParallel { kTP, kDP };

struct ParallelPlan {
  int world = 1, rank = 0;
  MoEParallel moe = MoEParallel::kTP;
  AttnParallel attn = AttnParallel::kTP;
  int tp = 1, ep = 1;  // MoE: tp * ep == world; rank = ep_rank * tp + tp_rank
  comm::CommDType comm_dtype = comm::CommDType::kF32;
  bool overlap = false;

  int tp_rank() const { return rank % tp; }
  int ep_rank() const { return rank / tp; }
  bool single() const { return world == 1; }
  std::string describe() const;  // "tp=2 x ep=2, attention tp, comm f32"
};

// Sizes the plan splits; validated against the constraints with one error line naming the one broken.
struct PlanShape {
  int heads, kv_heads, experts, intermediate;
};

struct PlanRequest {
  std::string moe = "auto";  // auto | tp | ep | tpxep (auto: resolve_auto_moe below)
  std::string attn = "tp";  // tp | dp
  int tp = 0, ep = 0;       // 0: derived (tp: tp = N; ep: ep = N; tpxep: both needed, or tp = 2)
  std::string comm_dtype = "f32";
  bool overlap = false;
};

// `topology` (the world's rank -> host map; null: one host) only matters for --moe-parallel auto.
ParallelPlan make_parallel_plan(const PlanRequest& request, const PlanShape& shape, int world, int rank,
                                const comm::Topology* topology = nullptr);

// What --moe-parallel auto runs. On one host: tp (every rank reads a slice of every expert, the
// fewest bytes per rank at small batches). Across H hosts of L ranks each, ranks numbered host by host:
// the field report's hybrid, TP inside a host and EP across hosts (tpxep, tp = L, ep = H; ep when L = 1):
// each expert's all-reduce partners share memory, and the network carries one all-reduce per MoE layer of
// the host's partial sums instead of slices of every expert. Falls back to tp where the shape does not
// divide (experts by H, intermediate by L) or the hosts are uneven or interleaved. With attention DP
// auto is ep (the only MoE plan it runs with).
struct AutoMoE {
  std::string moe;  // "tp", "ep" or "tpxep"
  int tp = 0, ep = 0;
};
AutoMoE resolve_auto_moe(const PlanShape& shape, int world, const comm::Topology* topology);

// What one rank holds.
struct ExpertRange {
  int first = 0, count = 0;  // global experts [first, first + count)
};
ExpertRange local_experts(const ParallelPlan& plan, int experts);
struct SliceRange {
  int64_t begin = 0, end = 0;
};
SliceRange local_intermediate(const ParallelPlan& plan, int64_t intermediate);
// Attention TP: query heads [begin, end) and the KV heads they read.
SliceRange local_heads(const ParallelPlan& plan, int heads);
SliceRange local_kv_heads(const ParallelPlan& plan, int heads, int kv_heads);

}  // namespace moex

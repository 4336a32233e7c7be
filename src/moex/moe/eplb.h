// Expert-parallel load balancing (EPLB): where each expert's replicas live, chosen from measured load.
//
// Under EP the step waits for the busiest rank, so a hot expert sets every rank's speed. Each EP rank has
// `slots_per_rank` physical slots (its E/N experts plus R redundant ones); a Placement names the logical expert
// each slot holds. A token routed to expert e goes to one of e's replicas, so e's expected load per replica is
// load(e) / replicas(e), and a rank's expected load is the sum over its slots. place_experts picks the replica
// counts and the packing that keep the busiest rank's expected load low (docs/moe.md, "Expert load balancing").
// Replicas compute the same function, so the model's output does not depend on the placement.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moex::eplb {

// One MoE layer's placement: slot s (rank s / slots_per_rank) holds logical expert slot_expert[s].
struct Placement {
  int experts = 0, ranks = 0, slots_per_rank = 0;
  std::vector<int32_t> slot_expert;      // [ranks * slots_per_rank]
  // Derived by index(): expert e's slots are replica_slots[replica_offsets[e] .. replica_offsets[e + 1]),
  // ascending.
  std::vector<int32_t> replica_offsets;  // [experts + 1]
  std::vector<int32_t> replica_slots;    // [ranks * slots_per_rank]

  bool empty() const { return slot_expert.empty(); }
  int slots() const { return ranks * slots_per_rank; }
  int replicas(int e) const { return replica_offsets[e + 1] - replica_offsets[e]; }
  // Builds the replica tables; throws Error(kInvalidInput) when a slot names no expert of [0, experts) or an
  // expert has no replica.
  void index();
};

// Expert e on slot e: rank r holds experts [r E/N, (r+1) E/N), what EP without EPLB runs (slots_per_rank = E/N).
Placement block_placement(int experts, int ranks);

// Chooses replica counts and packs them onto ranks, minimizing (approximately) the largest expected rank load
// sum over the rank's slots of load[e] / replicas(e), with exactly `slots_per_rank` slots per rank
// (ranks * slots_per_rank >= experts). rank_host[r] (optional, empty: one host) names rank r's host; when there are
// several hosts with the same number of ranks each, the placement is hierarchical: whole experts are first
// packed onto hosts (E / hosts each, balancing the hosts' loads) so an expert's replicas never leave its host,
// then each host replicates and packs its experts onto its own ranks. Deterministic (ties: lower index).
Placement place_experts(const std::vector<double>& load, int ranks, int slots_per_rank,
                        const std::vector<int>& rank_host = {});

// Renumbers `next`'s ranks (only among ranks of one host, rank_host as for place_experts) so that each keeps as many
// of the experts it holds in `prev` as it can (greedy on the overlap, largest first): the same expected loads, fewer
// experts to move in an online rebalance. Returns the number of slots whose expert the rank did not hold before.
int keep_experts_in_place(Placement& next, const Placement& prev, const std::vector<int>& rank_host = {});

// The expected load of each rank: sum over its slots of load[e] / replicas(e).
std::vector<double> rank_loads(const Placement& p, const std::vector<double>& load);
// mean / max of `loads` (1 when all are zero): 1 is perfectly balanced.
double balancedness(const std::vector<double>& loads);

// Tokens per expert of every MoE layer over the last `window` completed steps and the one in progress (a ring of
// per-step counts and running sums: O(E) per layer and step, no allocation after construction).
class LoadWindow {
 public:
  LoadWindow(int layers, int experts, int window);
  // Adds one layer's counts [E] to the current step.
  void add(int layer, const int* counts);
  // Closes the current step: the oldest one leaves the window.
  void end_step();
  // Sum over the window of layer `layer`'s counts [E].
  std::vector<double> load(int layer) const;
  int layers() const { return layers_; }
  int experts() const { return experts_; }
  int window() const { return window_; }
  int64_t steps() const { return steps_; }

 private:
  int layers_, experts_, window_;
  int64_t steps_ = 0;
  std::vector<int64_t> ring_;    // [window + 1, layers, E]
  std::vector<int64_t> totals_;  // [layers, E]
};

// A whole model's placement (one per layer; a dense layer's is empty) and a recorded load, as JSON files:
//   placement: {"format": "moex-expert-placement", "experts": E, "ranks": N, "slots_per_rank": S,
//               "layers": [[slot_expert...] or [] per layer]}
//   load:      {"format": "moex-expert-load", "experts": E, "steps": n, "layers": [[tokens per expert] or []]}
// The readers throw Error(kInvalidInput) with one line naming what is wrong.
struct ModelPlacement {
  int experts = 0, ranks = 0, slots_per_rank = 0;
  std::vector<Placement> layers;
};
std::string placement_json(const ModelPlacement& p);
ModelPlacement parse_placement_json(const std::string& text);
struct RecordedLoad {
  int experts = 0;
  int64_t steps = 0;
  std::vector<std::vector<double>> layers;  // empty for a dense layer
};
std::string load_json(const RecordedLoad& l);
RecordedLoad parse_load_json(const std::string& text);

}  // namespace moex::eplb

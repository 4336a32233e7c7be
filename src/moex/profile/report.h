// Profiler, reading side: where a step's time went, per phase, as a table or JSON, for one rank or many.
// Times in the breakdown are self times (nested zones subtracted), so the rows and "other" add to 100%.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/profile/profile.h"

namespace moex::profile {

struct ZoneTime {
  int64_t total_ns = 0;  // inclusive: includes the zones nested inside
  int64_t self_ns = 0;   // exclusive: what the shares are made of
  int64_t calls = 0;
  int64_t layer_ns = 0;  // self time of the calls tagged with a layer
  int32_t layers = 0;    // highest layer index seen + 1
};

struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  int64_t wait_ns = 0;      // waiting for peers, as the algorithm reported it
  int64_t transfer_ns = 0;  // the rest of the observed collective time
  int64_t events = 0;       // collectives observed through record_comm_event
};

struct PhaseReport {
  int64_t steps = 0;
  int64_t wall_ns = 0;  // sum of mark_step wall times
  int64_t tokens = 0;
  std::array<ZoneTime, kNumZones> zones{};         // threads that mark steps: shares add to 100%
  std::array<ZoneTime, kNumZones> worker_zones{};  // other threads: thread-time, outside the shares
  std::array<CommStats, kNumZones> comm{};         // all threads
  std::vector<std::vector<uint64_t>> tokens_per_expert;  // [layer][expert]
  std::vector<std::vector<uint64_t>> tokens_per_rank;    // [layer][EP rank] tokens each rank's experts computed

  const ZoneTime& zone(Zone z) const { return zones[static_cast<int>(z)]; }
  int64_t zoned_ns() const;    // sum of self times over zones
  int64_t step_ns() const;     // max(wall_ns, zoned_ns()): the 100%, so the rest is never negative
  int64_t unzoned_ns() const;  // step_ns() - zoned_ns(): step time outside every zone
  double share(Zone z) const;         // self time / step_ns(), in [0, 1]
  double unzoned_share() const;       // unzoned_ns() / step_ns(); with every share() it sums to 1
  double us_per_layer(Zone z) const;  // per step and per layer; 0 when the zone had no layer tags
  bool empty() const;
};

struct Report {
  int rank = 0;
  int world = 1;
  int64_t dropped_trace_events = 0;  // over set_trace_capacity(); the totals above still include them
  std::array<PhaseReport, kNumPhases> phases{};

  const PhaseReport& phase(Phase p) const { return phases[static_cast<int>(p)]; }
};

Report collect();  // this process; see profile.h for when it is safe to call

// Human table, prefill and decode separately; zones sorted by time. Its last row, "other", is the zone
// kOther plus the unzoned rest, so the printed shares add up to 100%.
std::string format_table(const Report& report);
// Per layer and phase: tokens routed to each expert, their min/max/mean and busiest/mean, and (EP) the balancedness
// of the EP ranks' tokens.
std::string format_expert_load(const Report& report);
// mean / max of the tokens each EP rank's experts computed (1: even; 1 when all are zero).
double rank_balancedness(const std::vector<uint64_t>& tokens_per_rank);

// Raw fields plus derived shares and per-layer times; report_from_json reads back the raw fields.
nlohmann::json report_to_json(const Report& report);
Report report_from_json(const nlohmann::json& json);
// Compact binary form (CBOR of the JSON) for gathering reports over MPI as bytes.
std::vector<uint8_t> report_to_bytes(const Report& report);
Report report_from_bytes(std::span<const uint8_t> bytes);

// Several ranks: the field-wise mean (rounded) and the rank with the longest step wall time.
Report mean_report(std::span<const Report> ranks);
int slowest_rank(std::span<const Report> ranks, Phase phase);  // index into `ranks`; -1 when all are empty
// One table per rank, then the mean, then per phase a zone x rank comparison with the slowest rank.
std::string format_rank_tables(std::span<const Report> ranks);
nlohmann::json rank_reports_to_json(std::span<const Report> ranks);  // {ranks, mean, slowest_rank}

}  // namespace moex::profile

// Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing): one process per rank, a
// "steps" track plus one track per thread, B/E pairs per zone, collectives with {algorithm, bytes} args.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moex/profile/profile.h"

namespace moex::profile {

struct TraceSlice {
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  Zone zone = Zone::kOther;
  Phase phase = Phase::kPrefill;
  int16_t depth = 0;     // 0 = top level on its thread; a slice's parent is the last one before it with depth - 1
  int32_t layer = -1;
  int32_t comm = -1;     // index into ThreadTrace::comm for a collective observed by record_comm_event
};

struct CommInfo {
  std::string algorithm;
  uint64_t bytes = 0;
  int64_t wait_ns = 0;
};

struct StepSlice {
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  Phase phase = Phase::kPrefill;
  int32_t tokens = 0;
};

struct ThreadTrace {
  int thread = 0;                  // registration order in the process: 0 is the first thread that recorded
  std::vector<TraceSlice> slices;  // in order of begin, parents before their children
  std::vector<CommInfo> comm;
};

struct RankTrace {
  int rank = 0;
  std::vector<StepSlice> steps;
  std::vector<ThreadTrace> threads;
};

RankTrace collect_trace();  // this process; see profile.h for when it is safe to call

// For gathering traces over MPI as bytes (CBOR).
std::vector<uint8_t> trace_to_bytes(const RankTrace& trace);
RankTrace trace_from_bytes(std::span<const uint8_t> bytes);

// Timestamps are steady_clock: ranks on one node share it; across nodes they are only as aligned as
// those clocks are. Throws Error(kInvalidInput) when the file cannot be written.
void write_chrome_trace(const std::string& path, std::span<const RankTrace> ranks);
void write_chrome_trace(const std::string& path);  // this process only
std::string chrome_trace_json(std::span<const RankTrace> ranks);

}  // namespace moex::profile

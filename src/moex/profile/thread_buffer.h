// Internal to the profile library: what one thread records, and the registry of every thread's buffer.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "moex/profile/profile.h"
#include "moex/profile/report.h"
#include "moex/profile/trace.h"

namespace moex::profile::detail {

inline constexpr int kMaxDepth = 64;  // deeper zones are not recorded (counted in skipped_too_deep)

struct OpenZone {
  int64_t begin_ns;
  int64_t child_ns;           // time of the zones nested directly inside, for self time
  int64_t last_child_end_ns;  // where a collective reported afterwards may start at the earliest
  int64_t order;              // begin order on this thread: sorts slices into parents-before-children
  int32_t layer;
  Zone zone;
  Phase phase;
};

struct RecordedSlice {
  TraceSlice slice;
  int64_t order;
};

struct PhaseCounters {
  int64_t steps = 0;
  int64_t wall_ns = 0;
  int64_t tokens = 0;
  std::array<ZoneTime, kNumZones> zones{};
  std::array<CommStats, kNumZones> comm{};
  std::vector<std::vector<uint64_t>> tokens_per_expert;  // [layer][expert]
  std::vector<std::vector<uint64_t>> tokens_per_rank;    // [layer][EP rank]
};

struct ThreadBuffer {
  int thread = 0;            // registration order
  bool marks_steps = false;  // called mark_step since the last reset: its zones make up the step
  int depth = 0;
  int64_t next_order = 0;
  int64_t last_top_level_end_ns = 0;
  std::array<OpenZone, kMaxDepth> open{};
  std::array<PhaseCounters, kNumPhases> phases{};
  std::vector<RecordedSlice> slices;  // in order of end
  std::vector<CommInfo> comm;
  std::vector<StepSlice> steps;
  int64_t dropped_slices = 0;
  int64_t skipped_too_deep = 0;

  void clear_recorded();  // everything but the zones still open
};

ThreadBuffer& this_thread_buffer();
std::vector<ThreadBuffer*> all_thread_buffers();  // registration order; buffers outlive their threads

}  // namespace moex::profile::detail

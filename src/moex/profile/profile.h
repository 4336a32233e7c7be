// Profiler, recording side: zones (scoped timers) per thread, counters, step boundaries.
// Reading side: report.h (breakdown tables, JSON, multi-rank) and trace.h (Chrome trace-event JSON).
//
// Off (the default), a zone costs one relaxed load and one predictable branch. On, it costs two
// steady_clock reads and one push into a buffer owned by the calling thread: no locks on the hot path.
//
// Time accounting: zones nest per thread. Every zone's *self* time (its time minus the zones nested
// in it) is what the report adds up, so a nested all-reduce is an all-reduce row, not hidden inside
// attention, and the rows plus "other" (step wall time that no zone covers) sum to 100% of the step.
//
// Threads: zones on a thread that calls mark_step (or ScopedStep) make up the step breakdown; zones
// on other threads (e.g. OpenMP workers) are reported apart as thread-time, since concurrent time
// does not fit in a share of wall time. If no thread ever marks a step, every thread counts and the
// shares are of total zone time.
//
// collect(), collect_trace() and reset() read every thread's buffer without locks: call them at a step
// boundary, when no other thread is inside a zone (after an OpenMP region ends or threads are joined).
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

namespace moex::profile {

// One sorted enum; zone_name() gives the snake_case names used in tables, JSON and traces.
enum class Zone : uint8_t {
  kAllGather,
  kAllReduce,
  kAllToAll,
  kAttention,
  kBroadcast,
  kCombine,
  kDispatch,
  kEmbedding,
  kExperts,
  kLmHead,
  kOther,
  kReduceScatter,
  kRouter,
  kSampling,
  kCount
};
inline constexpr int kNumZones = static_cast<int>(Zone::kCount);

enum class Phase : uint8_t { kPrefill, kDecode, kCount };
inline constexpr int kNumPhases = static_cast<int>(Phase::kCount);

const char* zone_name(Zone zone);     // "all_reduce", "lm_head", ...
const char* phase_name(Phase phase);  // "prefill", "decode"

namespace detail {
inline std::atomic<bool> g_enabled{false};
bool begin_zone(Zone zone, int layer);  // false when the zone was not recorded (nesting too deep)
void end_zone();
}  // namespace detail

inline bool enabled() { return detail::g_enabled.load(std::memory_order_relaxed); }
void enable(bool on);

void set_phase(Phase phase);  // process-wide; zones take the phase current when they begin
Phase current_phase();
void set_rank(int rank, int world);  // the trace's process id and the report's rank
int rank();
int world_size();

// Nanoseconds on std::chrono::steady_clock, the clock of every timestamp here (record_comm_event's too).
int64_t now_ns();

class ScopedZone {
 public:
  explicit ScopedZone(Zone zone, int layer = -1) : recorded_(enabled() && detail::begin_zone(zone, layer)) {}
  ~ScopedZone() {
    if (recorded_) detail::end_zone();
  }
  ScopedZone(const ScopedZone&) = delete;
  ScopedZone& operator=(const ScopedZone&) = delete;

 private:
  bool recorded_;  // captured at begin so that enable() flipping mid-zone cannot unbalance the stack
};

#define MOEX_PROFILE_CONCAT_INNER(a, b) a##b
#define MOEX_PROFILE_CONCAT(a, b) MOEX_PROFILE_CONCAT_INNER(a, b)
#ifndef MOEX_PROFILE_ZONES_OFF
// MOEX_ZONE(kRouter); times the rest of the enclosing scope.
#define MOEX_ZONE(zone) \
  ::moex::profile::ScopedZone MOEX_PROFILE_CONCAT(moex_zone_, __LINE__)(::moex::profile::Zone::zone)
// MOEX_ZONE_LAYER(kAttention, layer); the same, tagged with a layer index for the "us per layer" column.
#define MOEX_ZONE_LAYER(zone, layer) \
  ::moex::profile::ScopedZone MOEX_PROFILE_CONCAT(moex_zone_, __LINE__)(::moex::profile::Zone::zone, (layer))
#else  // cmake -DMOEX_PROFILE_ZONES=OFF: zones compiled out (the layer expression is not evaluated)
#define MOEX_ZONE(zone) static_assert(true)
#define MOEX_ZONE_LAYER(zone, layer) static_assert(true)
#endif

// Bytes this process put on and took off the wire for one collective, counted per zone and phase.
void add_comm_bytes(Zone zone, uint64_t sent, uint64_t received);

// One collective as the comm layer's observer saw it (times in now_ns()): `bytes` is the message size,
// `wait_ns` the part of [begin_ns, end_ns) spent waiting for peers, the rest counts as transfer.
// Becomes a trace slice with {algorithm, bytes, wait_us}. Inside an open zone of the same kind it only
// annotates that zone; otherwise it is itself a zone of kind `zone` nested in whatever is open.
void record_comm_event(Zone zone, const char* algorithm, uint64_t bytes, int64_t begin_ns, int64_t end_ns,
                       int64_t wait_ns);

// Tokens routed to each expert of one MoE layer in this step (after capacity drops), summed per phase.
void add_tokens_per_expert(int layer, const int* counts, int num_experts);

// The wall time of one whole step and the tokens it processed; marks the calling thread as a step thread.
void mark_step(Phase phase, int64_t wall_ns, int tokens);

// Sets the phase, and on scope exit marks the step with its measured wall time.
class ScopedStep {
 public:
  ScopedStep(Phase phase, int tokens);
  ~ScopedStep();
  ScopedStep(const ScopedStep&) = delete;
  ScopedStep& operator=(const ScopedStep&) = delete;

 private:
  Phase phase_;
  int tokens_;
  int64_t begin_ns_;  // < 0 when profiling was off at the start: nothing is marked
};

// Trace slices kept per thread before further ones are dropped (the report's totals are never dropped).
void set_trace_capacity(int64_t events_per_thread);

// Forgets every zone, counter, step and trace event; threads keep their track ids.
void reset();

// What the calling thread recorded, summed over the phases: each zone's self time and the tokens routed to
// each expert. For a loop that profiles every step for as long as it runs (serve's /v1/engine/stats).
struct ThreadTotals {
  std::array<int64_t, kNumZones> self_ns{};
  std::vector<std::vector<uint64_t>> tokens_per_expert;  // [layer][expert]; layers without experts empty
};
// Adds the calling thread's totals since its last drain (or reset) into `into`, then zeroes them and drops
// that thread's trace slices, steps and comm events, so its buffer does not grow however long it runs. Only
// the calling thread's buffer is touched: safe while other threads record.
void drain_thread_totals(ThreadTotals& into);

}  // namespace moex::profile

// Recording: per-thread buffers reached through a thread_local pointer; the registry lock is taken
// once per thread (its first zone), never per zone.
#include "moex/profile/profile.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>

#include "moex/base/error.h"
#include "moex/profile/thread_buffer.h"

namespace moex::profile {

namespace {

constexpr const char* kZoneNames[kNumZones] = {
    "all_gather", "all_reduce", "all_to_all", "attention", "broadcast",      "combine", "dispatch",
    "embedding",  "experts",    "lm_head",    "other",     "reduce_scatter", "router",  "sampling",
};
constexpr const char* kPhaseNames[kNumPhases] = {"prefill", "decode"};

std::atomic<uint8_t> g_phase{static_cast<uint8_t>(Phase::kPrefill)};
std::atomic<int> g_rank{0};
std::atomic<int> g_world{1};
std::atomic<int64_t> g_trace_capacity{int64_t{1} << 20};  // 1M slices x 40 bytes per thread

struct Registry {
  std::mutex mutex;
  std::vector<std::unique_ptr<detail::ThreadBuffer>> buffers;
};

// Never destroyed: a thread may still end a zone while static destructors run.
Registry& registry() {
  static Registry* instance = new Registry;
  return *instance;
}

thread_local detail::ThreadBuffer* t_buffer = nullptr;

detail::ThreadBuffer* register_this_thread() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto buffer = std::make_unique<detail::ThreadBuffer>();
  buffer->thread = static_cast<int>(reg.buffers.size());
  reg.buffers.push_back(std::move(buffer));
  return reg.buffers.back().get();
}

void push_slice(detail::ThreadBuffer& buffer, const TraceSlice& slice, int64_t order) {
  if (static_cast<int64_t>(buffer.slices.size()) < g_trace_capacity.load(std::memory_order_relaxed)) {
    buffer.slices.push_back({slice, order});
  } else {
    ++buffer.dropped_slices;
  }
}

// Adds one finished zone to the totals and to its parent's child time.
void account_zone(detail::ThreadBuffer& buffer, Zone zone, Phase phase, int layer, int64_t begin_ns,
                  int64_t end_ns, int64_t child_ns) {
  const int64_t duration = end_ns - begin_ns;
  ZoneTime& time = buffer.phases[static_cast<int>(phase)].zones[static_cast<int>(zone)];
  time.total_ns += duration;
  time.self_ns += duration - child_ns;
  ++time.calls;
  if (layer >= 0) {
    time.layer_ns += duration - child_ns;
    time.layers = std::max(time.layers, layer + 1);
  }
  if (buffer.depth > 0) {
    detail::OpenZone& parent = buffer.open[buffer.depth - 1];
    parent.child_ns += duration;
    parent.last_child_end_ns = end_ns;
  } else {
    buffer.last_top_level_end_ns = end_ns;
  }
}

}  // namespace

const char* zone_name(Zone zone) {
  const int index = static_cast<int>(zone);
  return index >= 0 && index < kNumZones ? kZoneNames[index] : "invalid";
}

const char* phase_name(Phase phase) {
  const int index = static_cast<int>(phase);
  return index >= 0 && index < kNumPhases ? kPhaseNames[index] : "invalid";
}

void enable(bool on) {
  if (on) detail::this_thread_buffer();  // the enabling thread is track 0, and its first zone is not slowed
  detail::g_enabled.store(on, std::memory_order_relaxed);
}

void set_phase(Phase phase) { g_phase.store(static_cast<uint8_t>(phase), std::memory_order_relaxed); }
Phase current_phase() { return static_cast<Phase>(g_phase.load(std::memory_order_relaxed)); }

void set_rank(int rank, int world) {
  MOEX_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of ", world);
  g_rank.store(rank, std::memory_order_relaxed);
  g_world.store(world, std::memory_order_relaxed);
}
int rank() { return g_rank.load(std::memory_order_relaxed); }
int world_size() { return g_world.load(std::memory_order_relaxed); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void set_trace_capacity(int64_t events_per_thread) {
  MOEX_CHECK(events_per_thread >= 0, events_per_thread);
  g_trace_capacity.store(events_per_thread, std::memory_order_relaxed);
}

namespace detail {

ThreadBuffer& this_thread_buffer() {
  if (t_buffer == nullptr) [[unlikely]] t_buffer = register_this_thread();
  return *t_buffer;
}

std::vector<ThreadBuffer*> all_thread_buffers() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  std::vector<ThreadBuffer*> buffers;
  for (auto& buffer : reg.buffers) buffers.push_back(buffer.get());
  return buffers;
}

void ThreadBuffer::clear_recorded() {
  marks_steps = false;
  phases = {};
  slices.clear();
  comm.clear();
  steps.clear();
  dropped_slices = 0;
  skipped_too_deep = 0;
}

bool begin_zone(Zone zone, int layer) {
  ThreadBuffer& buffer = this_thread_buffer();
  if (buffer.depth == kMaxDepth) [[unlikely]] {
    ++buffer.skipped_too_deep;
    return false;
  }
  const int64_t begin = now_ns();
  buffer.open[buffer.depth++] = {begin, 0, begin, buffer.next_order++, layer, zone, current_phase()};
  return true;
}

void end_zone() {
  const int64_t end = now_ns();
  ThreadBuffer& buffer = this_thread_buffer();
  if (buffer.depth == 0) [[unlikely]] return;
  const OpenZone zone = buffer.open[--buffer.depth];
  account_zone(buffer, zone.zone, zone.phase, zone.layer, zone.begin_ns, end, zone.child_ns);
  push_slice(buffer,
             {zone.begin_ns, end, zone.zone, zone.phase, static_cast<int16_t>(buffer.depth), zone.layer, -1},
             zone.order);
}

}  // namespace detail

void add_comm_bytes(Zone zone, uint64_t sent, uint64_t received) {
  if (!enabled()) return;
  detail::ThreadBuffer& buffer = detail::this_thread_buffer();
  CommStats& stats = buffer.phases[static_cast<int>(current_phase())].comm[static_cast<int>(zone)];
  stats.bytes_sent += sent;
  stats.bytes_received += received;
}

void record_comm_event(Zone zone, const char* algorithm, uint64_t bytes, int64_t begin_ns, int64_t end_ns,
                       int64_t wait_ns) {
  if (!enabled()) return;
  detail::ThreadBuffer& buffer = detail::this_thread_buffer();
  const bool inside_zone = buffer.depth > 0;
  const detail::OpenZone* parent = inside_zone ? &buffer.open[buffer.depth - 1] : nullptr;
  // Clamp into the free gap after the previous sibling so the trace nests even if clocks disagree.
  const int64_t earliest = inside_zone ? parent->last_child_end_ns : buffer.last_top_level_end_ns;
  const int64_t begin = std::max(begin_ns, earliest);
  const int64_t end = std::max(end_ns, begin);
  const int64_t duration = end - begin;
  const int64_t wait = std::clamp<int64_t>(wait_ns, 0, duration);
  const Phase phase = current_phase();

  CommStats& stats = buffer.phases[static_cast<int>(phase)].comm[static_cast<int>(zone)];
  stats.wait_ns += wait;
  stats.transfer_ns += duration - wait;
  ++stats.events;

  const bool annotates_parent = inside_zone && parent->zone == zone;
  if (annotates_parent) {
    buffer.open[buffer.depth - 1].last_child_end_ns = end;  // an annotation is not child time
  } else {
    account_zone(buffer, zone, phase, inside_zone ? parent->layer : -1, begin, end, 0);
  }
  const int32_t comm_index = static_cast<int32_t>(buffer.comm.size());
  buffer.comm.push_back({algorithm != nullptr ? algorithm : "", bytes, wait});
  push_slice(buffer,
             {begin, end, zone, phase, static_cast<int16_t>(buffer.depth), inside_zone ? parent->layer : -1,
              comm_index},
             buffer.next_order++);
}

void add_tokens_per_expert(int layer, const int* counts, int num_experts) {
  if (!enabled()) return;
  MOEX_CHECK(layer >= 0 && num_experts >= 0 && (counts != nullptr || num_experts == 0), layer, " ", num_experts);
  auto& per_layer = detail::this_thread_buffer().phases[static_cast<int>(current_phase())].tokens_per_expert;
  if (static_cast<int>(per_layer.size()) <= layer) per_layer.resize(layer + 1);
  auto& per_expert = per_layer[layer];
  if (static_cast<int>(per_expert.size()) < num_experts) per_expert.resize(num_experts, 0);
  for (int e = 0; e < num_experts; ++e) per_expert[e] += static_cast<uint64_t>(std::max(counts[e], 0));
}

namespace {
// One step ending at `end` (steady-clock ns): counted for the table and kept as a trace slice.
void record_step(Phase phase, int64_t end, int64_t wall_ns, int tokens) {
  detail::ThreadBuffer& buffer = detail::this_thread_buffer();
  buffer.marks_steps = true;
  detail::PhaseCounters& counters = buffer.phases[static_cast<int>(phase)];
  ++counters.steps;
  counters.wall_ns += std::max<int64_t>(wall_ns, 0);
  counters.tokens += std::max(tokens, 0);
  buffer.steps.push_back({end - std::max<int64_t>(wall_ns, 0), end, phase, tokens});
}
}  // namespace

void mark_step(Phase phase, int64_t wall_ns, int tokens) {
  if (enabled()) record_step(phase, now_ns(), wall_ns, tokens);
}

ScopedStep::ScopedStep(Phase phase, int tokens) : phase_(phase), tokens_(tokens), begin_ns_(-1) {
  set_phase(phase);
  if (enabled()) begin_ns_ = now_ns();
}

ScopedStep::~ScopedStep() {
  // The step's own end time, so its slice starts exactly where its first zone can begin.
  if (begin_ns_ >= 0 && enabled()) {
    const int64_t end = now_ns();
    record_step(phase_, end, end - begin_ns_, tokens_);
  }
}

void drain_thread_totals(ThreadTotals& into) {
  detail::ThreadBuffer& buffer = detail::this_thread_buffer();
  for (detail::PhaseCounters& phase : buffer.phases) {
    for (int z = 0; z < kNumZones; ++z) into.self_ns[z] += phase.zones[z].self_ns;
    phase.zones = {};
    phase.comm = {};
    phase.steps = phase.wall_ns = phase.tokens = 0;
    if (into.tokens_per_expert.size() < phase.tokens_per_expert.size())
      into.tokens_per_expert.resize(phase.tokens_per_expert.size());
    for (size_t l = 0; l < phase.tokens_per_expert.size(); ++l) {
      std::vector<uint64_t>& from = phase.tokens_per_expert[l];
      std::vector<uint64_t>& to = into.tokens_per_expert[l];
      if (to.size() < from.size()) to.resize(from.size(), 0);
      for (size_t e = 0; e < from.size(); ++e) to[e] += from[e];
      std::fill(from.begin(), from.end(), 0);  // zeroed in place: no allocation on the next step
    }
  }
  buffer.slices.clear();
  buffer.comm.clear();
  buffer.steps.clear();
  buffer.dropped_slices = 0;
}

void reset() {
  for (detail::ThreadBuffer* buffer : detail::all_thread_buffers()) buffer->clear_recorded();
}

}  // namespace moex::profile

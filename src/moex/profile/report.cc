// Breakdown report: gathered from the thread buffers, formatted, serialised, and merged across ranks.
#include "moex/profile/report.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <numeric>

#include "moex/base/error.h"
#include "moex/profile/thread_buffer.h"

namespace moex::profile {

namespace {

void add_into(ZoneTime& into, const ZoneTime& from) {
  into.total_ns += from.total_ns;
  into.self_ns += from.self_ns;
  into.calls += from.calls;
  into.layer_ns += from.layer_ns;
  into.layers = std::max(into.layers, from.layers);
}

void add_into(CommStats& into, const CommStats& from) {
  into.bytes_sent += from.bytes_sent;
  into.bytes_received += from.bytes_received;
  into.wait_ns += from.wait_ns;
  into.transfer_ns += from.transfer_ns;
  into.events += from.events;
}

void add_into(std::vector<std::vector<uint64_t>>& into, const std::vector<std::vector<uint64_t>>& from) {
  if (into.size() < from.size()) into.resize(from.size());
  for (size_t layer = 0; layer < from.size(); ++layer) {
    if (into[layer].size() < from[layer].size()) into[layer].resize(from[layer].size(), 0);
    for (size_t e = 0; e < from[layer].size(); ++e) into[layer][e] += from[layer][e];
  }
}

bool is_empty(const CommStats& c) {
  return c.bytes_sent == 0 && c.bytes_received == 0 && c.wait_ns == 0 && c.transfer_ns == 0 && c.events == 0;
}

void appendf(std::string& out, const char* format, ...) __attribute__((format(printf, 2, 3)));
void appendf(std::string& out, const char* format, ...) {
  char line[512];
  va_list args;
  va_start(args, format);
  vsnprintf(line, sizeof line, format, args);
  va_end(args);
  out += line;
}

double ms(int64_t ns) { return static_cast<double>(ns) * 1e-6; }
double mb(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

Zone zone_from_name(const std::string& name) {
  for (int z = 0; z < kNumZones; ++z) {
    if (name == zone_name(static_cast<Zone>(z))) return static_cast<Zone>(z);
  }
  throw_error(ErrorKind::kInvalidInput, "profile report: unknown zone '" + name + "'");
}

Phase phase_from_name(const std::string& name) {
  for (int p = 0; p < kNumPhases; ++p) {
    if (name == phase_name(static_cast<Phase>(p))) return static_cast<Phase>(p);
  }
  throw_error(ErrorKind::kInvalidInput, "profile report: unknown phase '" + name + "'");
}

// Worst and mean over layers of (busiest expert's tokens / mean tokens per expert): 1.0 is perfect balance.
struct ExpertLoad {
  double worst = 0, mean = 0;
  int worst_layer = -1;
};
ExpertLoad expert_load(const std::vector<std::vector<uint64_t>>& tokens_per_expert) {
  ExpertLoad load;
  int layers = 0;
  for (size_t layer = 0; layer < tokens_per_expert.size(); ++layer) {
    const auto& counts = tokens_per_expert[layer];
    const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
    if (counts.empty() || total == 0) continue;
    const double ratio = static_cast<double>(*std::max_element(counts.begin(), counts.end())) * counts.size() / total;
    load.mean += ratio;
    ++layers;
    if (ratio > load.worst) load.worst = ratio, load.worst_layer = static_cast<int>(layer);
  }
  if (layers > 0) load.mean /= layers;
  return load;
}

void format_phase(std::string& out, const PhaseReport& p, Phase phase) {
  const int64_t step = p.step_ns();
  appendf(out, "%s: %lld step%s, %lld tokens, %.3f ms wall", phase_name(phase), static_cast<long long>(p.steps),
          p.steps == 1 ? "" : "s", static_cast<long long>(p.tokens), ms(p.wall_ns));
  if (p.wall_ns > 0 && p.tokens > 0) appendf(out, " (%.1f tokens/s)", p.tokens * 1e9 / p.wall_ns);
  if (p.wall_ns == 0) out += " (no steps marked: shares are of zone time)";
  out += "\n";

  std::vector<Zone> rows;
  for (int z = 0; z < kNumZones; ++z) {
    if (static_cast<Zone>(z) != Zone::kOther && p.zones[z].calls > 0) rows.push_back(static_cast<Zone>(z));
  }
  std::stable_sort(rows.begin(), rows.end(), [&](Zone a, Zone b) { return p.zone(a).self_ns > p.zone(b).self_ns; });

  const double steps = static_cast<double>(std::max<int64_t>(p.steps, 1));
  appendf(out, "  %-16s %12s %7s %10s %9s %10s\n", "zone", "time ms", "share", "ms/step", "calls", "us/layer");
  double printed_share = 0;
  for (Zone z : rows) {
    const ZoneTime& t = p.zone(z);
    appendf(out, "  %-16s %12.3f %6.1f%% %10.3f %9lld", zone_name(z), ms(t.self_ns), 100.0 * p.share(z),
            ms(t.self_ns) / steps, static_cast<long long>(t.calls));
    if (t.layers > 0) {
      appendf(out, " %10.1f\n", p.us_per_layer(z));
    } else {
      appendf(out, " %10s\n", "-");
    }
    printed_share += p.share(z);
  }
  const ZoneTime& other_zone = p.zone(Zone::kOther);
  const int64_t other_ns = other_zone.self_ns + p.unzoned_ns();
  const double other_share = p.share(Zone::kOther) + p.unzoned_share();
  appendf(out, "  %-16s %12.3f %6.1f%% %10.3f %9s %10s\n", "other", ms(other_ns), 100.0 * other_share,
          ms(other_ns) / steps, other_zone.calls > 0 ? std::to_string(other_zone.calls).c_str() : "-", "-");
  appendf(out, "  %-16s %12.3f %6.1f%%\n", "total", ms(step), 100.0 * (printed_share + other_share));
  if (other_zone.calls > 0) {
    appendf(out, "  (other = %.3f ms in zone \"other\" + %.3f ms outside every zone)\n", ms(other_zone.self_ns),
            ms(p.unzoned_ns()));
  }

  bool any_comm = false;
  for (const CommStats& c : p.comm) any_comm |= !is_empty(c);
  if (any_comm) {
    appendf(out, "  %-16s %12s %12s %10s %10s %9s\n", "collective", "wait ms", "transfer ms", "sent MB", "recv MB",
            "events");
    for (int z = 0; z < kNumZones; ++z) {
      const CommStats& c = p.comm[z];
      if (is_empty(c)) continue;
      appendf(out, "  %-16s", zone_name(static_cast<Zone>(z)));
      if (c.events > 0) {
        appendf(out, " %12.3f %12.3f", ms(c.wait_ns), ms(c.transfer_ns));
      } else {
        appendf(out, " %12s %12s", "-", "-");
      }
      appendf(out, " %10.3f %10.3f %9lld\n", mb(c.bytes_sent), mb(c.bytes_received), static_cast<long long>(c.events));
    }
  }

  bool any_worker = false;
  for (const ZoneTime& t : p.worker_zones) any_worker |= t.calls > 0;
  if (any_worker) {
    out += "  on other threads (thread-time, outside the shares):\n";
    for (int z = 0; z < kNumZones; ++z) {
      const ZoneTime& t = p.worker_zones[z];
      if (t.calls == 0) continue;
      appendf(out, "  %-16s %12.3f %7s %10.3f %9lld\n", zone_name(static_cast<Zone>(z)), ms(t.self_ns), "",
              ms(t.self_ns) / steps, static_cast<long long>(t.calls));
    }
  }

  const ExpertLoad load = expert_load(p.tokens_per_expert);
  if (load.worst_layer >= 0) {
    appendf(out, "  expert load (busiest / mean tokens per expert): mean over layers %.2f, worst %.2f in layer %d\n",
            load.mean, load.worst, load.worst_layer);
  }
}

nlohmann::json zone_time_to_json(const ZoneTime& t) {
  return {{"total_ns", t.total_ns}, {"self_ns", t.self_ns}, {"calls", t.calls}, {"layer_ns", t.layer_ns},
          {"layers", t.layers}};
}

ZoneTime zone_time_from_json(const nlohmann::json& j) {
  ZoneTime t;
  t.total_ns = j.value("total_ns", int64_t{0});
  t.self_ns = j.value("self_ns", int64_t{0});
  t.calls = j.value("calls", int64_t{0});
  t.layer_ns = j.value("layer_ns", int64_t{0});
  t.layers = j.value("layers", 0);
  return t;
}

int64_t mean_of(int64_t sum, int64_t count) { return (sum + count / 2) / count; }

}  // namespace

int64_t PhaseReport::zoned_ns() const {
  int64_t sum = 0;
  for (const ZoneTime& t : zones) sum += t.self_ns;
  return sum;
}

int64_t PhaseReport::step_ns() const { return std::max(wall_ns, zoned_ns()); }
int64_t PhaseReport::unzoned_ns() const { return step_ns() - zoned_ns(); }

double PhaseReport::share(Zone z) const {
  const int64_t step = step_ns();
  return step > 0 ? static_cast<double>(zone(z).self_ns) / step : 0.0;
}

double PhaseReport::unzoned_share() const {
  const int64_t step = step_ns();
  return step > 0 ? static_cast<double>(unzoned_ns()) / step : 0.0;
}

double PhaseReport::us_per_layer(Zone z) const {
  const ZoneTime& t = zone(z);
  if (t.layers == 0) return 0.0;
  return static_cast<double>(t.layer_ns) * 1e-3 / static_cast<double>(std::max<int64_t>(steps, 1)) / t.layers;
}

bool PhaseReport::empty() const {
  if (steps > 0 || wall_ns > 0 || !tokens_per_expert.empty() || !tokens_per_rank.empty()) return false;
  for (int z = 0; z < kNumZones; ++z) {
    if (zones[z].calls > 0 || worker_zones[z].calls > 0 || !is_empty(comm[z])) return false;
  }
  return true;
}

Report collect() {
  Report report;
  report.rank = rank();
  report.world = world_size();
  const std::vector<detail::ThreadBuffer*> buffers = detail::all_thread_buffers();
  const bool any_marks_steps =
      std::any_of(buffers.begin(), buffers.end(), [](const detail::ThreadBuffer* b) { return b->marks_steps; });
  for (const detail::ThreadBuffer* buffer : buffers) {
    report.dropped_trace_events += buffer->dropped_slices;
    const bool in_step = !any_marks_steps || buffer->marks_steps;
    for (int phase = 0; phase < kNumPhases; ++phase) {
      const detail::PhaseCounters& from = buffer->phases[phase];
      PhaseReport& into = report.phases[phase];
      into.steps += from.steps;
      into.wall_ns += from.wall_ns;
      into.tokens += from.tokens;
      for (int z = 0; z < kNumZones; ++z) {
        add_into(in_step ? into.zones[z] : into.worker_zones[z], from.zones[z]);
        add_into(into.comm[z], from.comm[z]);
      }
      add_into(into.tokens_per_expert, from.tokens_per_expert);
      add_into(into.tokens_per_rank, from.tokens_per_rank);
    }
  }
  return report;
}

std::string format_table(const Report& report) {
  std::string out;
  if (report.world > 1) appendf(out, "rank %d of %d\n", report.rank, report.world);
  bool any = false;
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const PhaseReport& p = report.phases[phase];
    if (p.empty()) continue;
    if (any) out += "\n";
    format_phase(out, p, static_cast<Phase>(phase));
    any = true;
  }
  if (!any) out += "profile: nothing recorded (is profiling enabled?)\n";
  if (report.dropped_trace_events > 0) {
    appendf(out, "(%lld trace events dropped over the trace capacity; the totals include them)\n",
            static_cast<long long>(report.dropped_trace_events));
  }
  return out;
}

nlohmann::json report_to_json(const Report& report) {
  nlohmann::json phases = nlohmann::json::object();
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const PhaseReport& p = report.phases[phase];
    nlohmann::json zones = nlohmann::json::object(), worker_zones = nlohmann::json::object(),
                   comm = nlohmann::json::object();
    for (int z = 0; z < kNumZones; ++z) {
      const Zone zone = static_cast<Zone>(z);
      if (p.zones[z].calls > 0) {
        nlohmann::json j = zone_time_to_json(p.zones[z]);
        j["share"] = p.share(zone);
        j["us_per_layer"] = p.us_per_layer(zone);
        zones[zone_name(zone)] = std::move(j);
      }
      if (p.worker_zones[z].calls > 0) worker_zones[zone_name(zone)] = zone_time_to_json(p.worker_zones[z]);
      const CommStats& c = p.comm[z];
      if (!is_empty(c)) {
        comm[zone_name(zone)] = {{"bytes_sent", c.bytes_sent}, {"bytes_received", c.bytes_received},
                                 {"wait_ns", c.wait_ns},       {"transfer_ns", c.transfer_ns},
                                 {"events", c.events}};
      }
    }
    phases[phase_name(static_cast<Phase>(phase))] = {
        {"steps", p.steps},           {"wall_ns", p.wall_ns},
        {"tokens", p.tokens},         {"step_ns", p.step_ns()},
        {"unzoned_ns", p.unzoned_ns()}, {"unzoned_share", p.unzoned_share()},
        {"zones", zones},             {"worker_zones", worker_zones},
        {"comm", comm},               {"tokens_per_expert", p.tokens_per_expert},
        {"tokens_per_rank", p.tokens_per_rank}};
  }
  return {{"rank", report.rank},
          {"world", report.world},
          {"dropped_trace_events", report.dropped_trace_events},
          {"phases", phases}};
}

Report report_from_json(const nlohmann::json& json) {
  try {
    Report report;
    report.rank = json.at("rank").get<int>();
    report.world = json.at("world").get<int>();
    report.dropped_trace_events = json.value("dropped_trace_events", int64_t{0});
    for (const auto& [name, pj] : json.at("phases").items()) {
      PhaseReport& p = report.phases[static_cast<int>(phase_from_name(name))];
      p.steps = pj.value("steps", int64_t{0});
      p.wall_ns = pj.value("wall_ns", int64_t{0});
      p.tokens = pj.value("tokens", int64_t{0});
      // Named, not temporaries: items() refers into the object it iterates.
      const nlohmann::json zones_json = pj.value("zones", nlohmann::json::object());
      const nlohmann::json worker_zones_json = pj.value("worker_zones", nlohmann::json::object());
      const nlohmann::json comm_json = pj.value("comm", nlohmann::json::object());
      for (const auto& [zone, zj] : zones_json.items()) {
        p.zones[static_cast<int>(zone_from_name(zone))] = zone_time_from_json(zj);
      }
      for (const auto& [zone, zj] : worker_zones_json.items()) {
        p.worker_zones[static_cast<int>(zone_from_name(zone))] = zone_time_from_json(zj);
      }
      for (const auto& [zone, cj] : comm_json.items()) {
        CommStats& c = p.comm[static_cast<int>(zone_from_name(zone))];
        c.bytes_sent = cj.value("bytes_sent", uint64_t{0});
        c.bytes_received = cj.value("bytes_received", uint64_t{0});
        c.wait_ns = cj.value("wait_ns", int64_t{0});
        c.transfer_ns = cj.value("transfer_ns", int64_t{0});
        c.events = cj.value("events", int64_t{0});
      }
      p.tokens_per_expert =
          pj.value("tokens_per_expert", nlohmann::json::array()).get<std::vector<std::vector<uint64_t>>>();
      p.tokens_per_rank =
          pj.value("tokens_per_rank", nlohmann::json::array()).get<std::vector<std::vector<uint64_t>>>();
    }
    return report;
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, std::string("profile report: malformed JSON: ") + e.what());
  }
}

std::vector<uint8_t> report_to_bytes(const Report& report) { return nlohmann::json::to_cbor(report_to_json(report)); }

Report report_from_bytes(std::span<const uint8_t> bytes) {
  nlohmann::json json;
  try {
    json = nlohmann::json::from_cbor(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, std::string("profile report: malformed bytes: ") + e.what());
  }
  return report_from_json(json);
}

Report mean_report(std::span<const Report> ranks) {
  MOEX_CHECK(!ranks.empty());
  Report sum;
  for (const Report& r : ranks) {
    sum.dropped_trace_events += r.dropped_trace_events;
    for (int phase = 0; phase < kNumPhases; ++phase) {
      const PhaseReport& from = r.phases[phase];
      PhaseReport& into = sum.phases[phase];
      into.steps += from.steps;
      into.wall_ns += from.wall_ns;
      into.tokens += from.tokens;
      for (int z = 0; z < kNumZones; ++z) {
        add_into(into.zones[z], from.zones[z]);
        add_into(into.worker_zones[z], from.worker_zones[z]);
        add_into(into.comm[z], from.comm[z]);
      }
      add_into(into.tokens_per_expert, from.tokens_per_expert);
      add_into(into.tokens_per_rank, from.tokens_per_rank);
    }
  }
  const int64_t n = static_cast<int64_t>(ranks.size());
  Report mean = sum;
  mean.rank = -1;  // not a rank
  mean.world = ranks.front().world;
  mean.dropped_trace_events = mean_of(sum.dropped_trace_events, n);
  for (PhaseReport& p : mean.phases) {
    p.steps = mean_of(p.steps, n);
    p.wall_ns = mean_of(p.wall_ns, n);
    p.tokens = mean_of(p.tokens, n);
    for (auto* times : {&p.zones, &p.worker_zones}) {
      for (ZoneTime& t : *times) {
        t.total_ns = mean_of(t.total_ns, n);
        t.self_ns = mean_of(t.self_ns, n);
        t.calls = mean_of(t.calls, n);
        t.layer_ns = mean_of(t.layer_ns, n);
      }
    }
    for (CommStats& c : p.comm) {
      c.bytes_sent = static_cast<uint64_t>(mean_of(static_cast<int64_t>(c.bytes_sent), n));
      c.bytes_received = static_cast<uint64_t>(mean_of(static_cast<int64_t>(c.bytes_received), n));
      c.wait_ns = mean_of(c.wait_ns, n);
      c.transfer_ns = mean_of(c.transfer_ns, n);
      c.events = mean_of(c.events, n);
    }
    for (auto* counts : {&p.tokens_per_expert, &p.tokens_per_rank})
      for (auto& row : *counts)
        for (uint64_t& count : row) count = static_cast<uint64_t>(mean_of(static_cast<int64_t>(count), n));
  }
  return mean;
}

int slowest_rank(std::span<const Report> ranks, Phase phase) {
  int slowest = -1;
  int64_t slowest_ns = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int64_t step = ranks[i].phase(phase).step_ns();
    if (step > slowest_ns) slowest = static_cast<int>(i), slowest_ns = step;
  }
  return slowest;
}

std::string format_rank_tables(std::span<const Report> ranks) {
  std::string out;
  if (ranks.empty()) return "profile: no ranks\n";
  for (const Report& r : ranks) {
    appendf(out, "== rank %d of %d ==\n", r.rank, r.world);
    Report untitled = r;
    untitled.world = 1;  // the heading above already names the rank
    out += format_table(untitled);
    out += "\n";
  }
  const Report mean = mean_report(ranks);
  appendf(out, "== mean of %zu ranks ==\n", ranks.size());
  Report untitled_mean = mean;
  untitled_mean.world = 1;
  out += format_table(untitled_mean);

  for (int phase = 0; phase < kNumPhases; ++phase) {
    const Phase ph = static_cast<Phase>(phase);
    const int slowest = slowest_rank(ranks, ph);
    if (slowest < 0) continue;
    appendf(out, "\n== %s per rank, ms (self time) ==\n  %-16s", phase_name(ph), "zone");
    for (const Report& r : ranks) appendf(out, " %9s", ("rank " + std::to_string(r.rank)).c_str());
    appendf(out, " %9s %9s\n", "mean", "max");
    auto row = [&](const char* name, auto value_of) {
      appendf(out, "  %-16s", name);
      double max_value = 0;
      for (const Report& r : ranks) {
        const double v = value_of(r.phase(ph));
        max_value = std::max(max_value, v);
        appendf(out, " %9.3f", v);
      }
      appendf(out, " %9.3f %9.3f\n", value_of(mean.phase(ph)), max_value);
    };
    for (int z = 0; z < kNumZones; ++z) {
      bool any_calls = false;
      for (const Report& r : ranks) any_calls |= r.phases[phase].zones[z].calls > 0;
      if (!any_calls || static_cast<Zone>(z) == Zone::kOther) continue;
      row(zone_name(static_cast<Zone>(z)), [z](const PhaseReport& p) { return ms(p.zones[z].self_ns); });
    }
    row("other", [](const PhaseReport& p) { return ms(p.zone(Zone::kOther).self_ns + p.unzoned_ns()); });
    row("step", [](const PhaseReport& p) { return ms(p.step_ns()); });
    const int64_t slowest_ns = ranks[slowest].phase(ph).step_ns(), mean_ns = mean.phase(ph).step_ns();
    appendf(out, "  slowest rank: %d (%.3f ms, %+.1f%% over the mean)\n", ranks[slowest].rank, ms(slowest_ns),
            mean_ns > 0 ? 100.0 * (slowest_ns - mean_ns) / mean_ns : 0.0);
  }
  return out;
}

nlohmann::json rank_reports_to_json(std::span<const Report> ranks) {
  nlohmann::json per_rank = nlohmann::json::array();
  for (const Report& r : ranks) per_rank.push_back(report_to_json(r));
  nlohmann::json slowest = nlohmann::json::object();
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const int index = ranks.empty() ? -1 : slowest_rank(ranks, static_cast<Phase>(phase));
    slowest[phase_name(static_cast<Phase>(phase))] = index >= 0 ? ranks[index].rank : -1;
  }
  return {{"ranks", per_rank},
          {"mean", ranks.empty() ? nlohmann::json() : report_to_json(mean_report(ranks))},
          {"slowest_rank", slowest}};
}

double rank_balancedness(const std::vector<uint64_t>& tokens_per_rank) {
  if (tokens_per_rank.empty()) return 1.0;
  const uint64_t hi = *std::max_element(tokens_per_rank.begin(), tokens_per_rank.end());
  if (hi == 0) return 1.0;
  const double total = static_cast<double>(std::accumulate(tokens_per_rank.begin(), tokens_per_rank.end(), uint64_t{0}));
  return total / static_cast<double>(tokens_per_rank.size()) / static_cast<double>(hi);
}

std::string format_expert_load(const Report& report) {
  std::string out;
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const PhaseReport& p = report.phases[phase];
    if (p.tokens_per_expert.empty()) continue;
    const double steps = static_cast<double>(std::max<int64_t>(p.steps, 1));
    size_t experts = 0;
    for (const auto& per_expert : p.tokens_per_expert) experts = std::max(experts, per_expert.size());
    const bool show_counts = experts <= 16;
    appendf(out, "%s expert load: tokens routed per expert per step (summed over %lld steps)\n",
            phase_name(static_cast<Phase>(phase)), static_cast<long long>(p.steps));
    const bool ep = std::any_of(p.tokens_per_rank.begin(), p.tokens_per_rank.end(), [](const auto& r) { return r.size() > 1; });
    appendf(out, "  %-6s %10s %8s %8s %8s %9s", "layer", "tokens", "min", "max", "mean", "max/mean");
    if (ep) appendf(out, " %9s", "rank bal.");
    if (show_counts) out += "   tokens per expert (whole phase)";
    out += "\n";
    for (size_t layer = 0; layer < p.tokens_per_expert.size(); ++layer) {
      const auto& counts = p.tokens_per_expert[layer];
      if (counts.empty()) continue;
      const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
      const uint64_t lo = *std::min_element(counts.begin(), counts.end());
      const uint64_t hi = *std::max_element(counts.begin(), counts.end());
      const double mean = static_cast<double>(total) / counts.size();
      appendf(out, "  %-6zu %10.2f %8.2f %8.2f %8.2f %9.2f", layer, total / steps, lo / steps, hi / steps,
              mean / steps, mean > 0 ? hi / mean : 0.0);
      if (ep) appendf(out, " %9.3f", layer < p.tokens_per_rank.size() ? rank_balancedness(p.tokens_per_rank[layer]) : 1.0);
      if (show_counts) {
        out += "   ";
        for (uint64_t c : counts) appendf(out, " %llu", static_cast<unsigned long long>(c));
      }
      out += "\n";
    }
  }
  return out;
}


}  // namespace moex::profile

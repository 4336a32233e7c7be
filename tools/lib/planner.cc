#include "tools/lib/planner.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "moex/base/error.h"
#include "moex/comm/codec.h"
#include "moex/comm/selector.h"
#include "moex/comm/types.h"
#include "moex/moe/parallel_plan.h"

namespace moex::tools::plan {
namespace {

// What a weight format costs the step: bytes per weight (codes and scales, kernels/packed.h's layouts) and
// which dot-product peak its kernels run at (the activations' type).
enum class Peak { kF32, kBF16, kInt8 };
struct FormatCost {
  const char* name;
  double bytes_per_weight;  // int4's add 8 bytes of f32 scale and offset per group (divided by the group below)
  bool per_group;
  Peak peak;
};
constexpr FormatCost kFormats[] = {
    {"as-stored", 2, false, Peak::kF32},  // a bf16 checkpoint read by the f32-activation matmul
    {"bf16", 2, false, Peak::kBF16},
    {"int8", 1, false, Peak::kF32},        // weight-only: decoded to f32 FMAs
    {"int8-w8a8", 1, false, Peak::kInt8},
    {"int4", 0.5, true, Peak::kBF16},
    {"int4-w4a8", 0.5, true, Peak::kInt8},
    {"fp8", 1 + 4.0 / (128 * 128), false, Peak::kBF16},
};

const FormatCost& format_cost(const std::string& name) {
  for (const FormatCost& f : kFormats)
    if (name == f.name) return f;
  throw_error(ErrorKind::kInvalidInput,
              "--weights " + name + ": use as-stored, bf16, int8, int8-w8a8, int4, int4-w4a8 or fp8");
}

double bytes_per_weight(const PlanChoice& p) {
  const FormatCost& f = format_cost(p.weights);
  return f.bytes_per_weight + (f.per_group ? 8.0 / p.group : 0.0);
}

// {memory, compute} efficiency of the format's kernels on the device.
std::pair<double, double> efficiency(const Device& d, const PlanChoice& p) {
  const auto it = d.format_efficiency.find(p.weights);
  return it != d.format_efficiency.end() ? it->second : std::pair{d.memory_efficiency, d.compute_efficiency};
}

double peak_of(const Device& d, const PlanChoice& p) {
  const Peak peak = format_cost(p.weights).peak;
  const double v = peak == Peak::kBF16 ? d.bf16_flops : peak == Peak::kInt8 ? d.int8_ops : d.f32_flops;
  return v * efficiency(d, p).second;
}

// ---- cluster files ------------------------------------------------------------------------------------------

double figure(const nlohmann::json& j, const std::string& key, const std::string& where, bool required = true,
              double fallback = 0) {
  const std::string field = where + "." + key;
  if (!j.contains(key)) {
    MOEX_CHECK_INPUT(!required, "cluster file: \"", field, "\" is missing");
    return fallback;
  }
  const nlohmann::json& f = j.at(key);
  MOEX_CHECK_INPUT(f.is_object() && f.contains("value") && f.at("value").is_number(), "cluster file: \"", field,
                   "\" must be {\"value\": number, \"source\": \"...\"}");
  MOEX_CHECK_INPUT(f.contains("source") && f.at("source").is_string() && !f.at("source").get<std::string>().empty(),
                   "cluster file: \"", field, "\" has no \"source\" (say where the figure comes from)");
  const double v = f.at("value").get<double>();
  MOEX_CHECK_INPUT(std::isfinite(v) && v >= 0, "cluster file: \"", field, "\" must be a finite number >= 0, got ", v);
  return v;
}

const nlohmann::json& object(const nlohmann::json& j, const std::string& key, const std::string& where) {
  MOEX_CHECK_INPUT(j.contains(key) && j.at(key).is_object(), "cluster file: \"", where, key, "\" must be an object");
  return j.at(key);
}

Link parse_link(const nlohmann::json& j, const std::string& where) {
  Link l;
  l.alpha_s = figure(j, "latency_us", where) * 1e-6;
  l.bytes_per_s = figure(j, "bandwidth_GBps", where) * 1e9;
  l.reduce_bytes_per_s = figure(j, "reduce_GBps", where, false, 10) * 1e9;
  l.burst_bytes = figure(j, "burst_KB", where, false, 0) * 1e3;
  MOEX_CHECK_INPUT(l.bytes_per_s > 0 && l.reduce_bytes_per_s > 0, "cluster file: \"", where,
                   "\" needs a bandwidth above 0");
  return l;
}

int whole(const nlohmann::json& j, const std::string& key, int lo, int hi, int fallback, bool required) {
  if (!j.contains(key)) {
    MOEX_CHECK_INPUT(!required, "cluster file: \"", key, "\" is missing");
    return fallback;
  }
  MOEX_CHECK_INPUT(j.at(key).is_number_integer(), "cluster file: \"", key, "\" must be a whole number");
  const int64_t v = j.at(key).get<int64_t>();
  MOEX_CHECK_INPUT(v >= lo && v <= hi, "cluster file: \"", key, "\" must be in ", lo, "..", hi, ", got ", v);
  return static_cast<int>(v);
}

// ---- the step -------------------------------------------------------------------------------------------------

// One matmul of `rows` tokens over an [n_out x k_in] weight on one device: the format's measured table where the
// cluster has one (with the device's share of the host's read rate as a floor), otherwise bound by its bytes or
// its arithmetic.
double matmul_seconds(const Device& d, const PlanChoice& p, double rows, double n_out, double k_in, double time_share) {
  const double weights = n_out * k_in;
  if (weights <= 0 || rows <= 0) return 0;
  const double read = weights * bytes_per_weight(p) / (d.read_bytes_per_s * efficiency(d, p).first);
  const auto table = d.kernel_tables.find(p.weights);
  if (table != d.kernel_tables.end()) {
    const double floor = weights * bytes_per_weight(p) / d.read_bytes_per_s;
    return (std::max(table->second.seconds(rows, n_out, k_in), floor) + d.op_overhead_s) * time_share;
  }
  const double math = 2 * rows * weights / peak_of(d, p);
  return (std::max(read, math) + d.op_overhead_s) * time_share;
}

// The communicator's cost model with the cluster's links: the intra-host level as alpha / beta / gamma, the
// inter-host one as its network terms (comm/selector.h prices a group over several hosts with both).
comm::CostModel cost_model(const Cluster& c, bool shm) {
  comm::CostModel m;
  m.alpha_s = c.intra.alpha_s;
  m.beta_s_per_byte = 1 / c.intra.bytes_per_s;
  m.gamma_s_per_byte = 1 / c.intra.reduce_bytes_per_s;
  if (!shm) m.shm_alpha_s = std::numeric_limits<double>::infinity();
  if (c.hosts > 1) {
    m.inter_alpha_s = c.inter.alpha_s;
    m.inter_beta_s_per_byte = 1 / c.inter.bytes_per_s;
  }
  return m;
}

// Ranks fill a host before the next one (mpirun's default by slot).
comm::HostLevels levels_of(const Cluster& c, int group) {
  comm::HostLevels l;
  l.hosts = (group + c.devices_per_host - 1) / c.devices_per_host;
  l.ranks_per_host = l.hosts > 1 ? group - (l.hosts - 1) * c.devices_per_host : group;  // the last host's, the fewest
  l.ranks_per_host = std::min(l.ranks_per_host, c.devices_per_host);
  return l;
}

// The all-reduce `auto` runs without a tuning table, its time and the bytes a rank counts as sent. The engine
// chooses with comm::CostModel's defaults (selector.cc: a table's measured levels replace them, and there is
// none here), not with this cluster's links, so the choice is the defaults' and only its price is the file's:
// across slow links the defaults may pick an algorithm the file's links would not, and the step pays for it.
// `mpi`: the library's own all-reduce (MPI_Iallreduce, as the all-to-alls' size agreement calls it), not auto's.
CollectiveCost allreduce(const std::string& what, const Cluster& c, int group, double bytes, const std::string& dtype,
                         int per_step, bool mpi = false) {
  CollectiveCost out;
  out.what = what;
  out.bytes = bytes;
  out.per_step = per_step;
  const comm::HostLevels levels = levels_of(c, group);
  out.crosses_hosts = levels.hosts > 1;
  if (group <= 1) return out;
  const bool shm = c.shared_memory_collectives && !out.crosses_hosts;
  comm::CostModel chooser;  // what selector.cc chooses with
  if (!shm) chooser.shm_alpha_s = std::numeric_limits<double>::infinity();
  const comm::CostModel model = cost_model(c, shm);
  const comm::CommDType d = dtype == "bf16" ? comm::CommDType::kBF16 : dtype == "fp8" ? comm::CommDType::kF8 : comm::CommDType::kF32;
  double best = std::numeric_limits<double>::infinity();
  comm::AllreduceAlgo pick = comm::AllreduceAlgo::kRing;
  for (comm::AllreduceAlgo a : comm::all_allreduce_algos()) {
    if ((a == comm::AllreduceAlgo::kShm && !shm) || !comm::allreduce_auto_candidate(a, d)) continue;
    if (comm::is_hierarchical(a) && (levels.hosts < 2 || levels.ranks_per_host < 2)) continue;
    const double s = comm::allreduce_cost_seconds(a, group, static_cast<uint64_t>(bytes), chooser, levels);
    if (s < best) best = s, pick = a;
  }
  out.seconds = comm::allreduce_cost_seconds(mpi ? comm::AllreduceAlgo::kRecursiveDoubling : pick, group,
                                             static_cast<uint64_t>(bytes), model, levels);
  // The library's all-reduce of a few bytes is recursive doubling (Open MPI's choice below 10 KB); selector.cc's
  // kMpi price leaves out the hosts, so it is priced as that.
  if (mpi) pick = comm::AllreduceAlgo::kMpi;
  out.algorithm = std::string(comm::algo_name(pick));
  const double p = group;
  const bool doubling = pick == comm::AllreduceAlgo::kRecursiveDoubling || pick == comm::AllreduceAlgo::kMpi;
  out.wire_bytes = pick == comm::AllreduceAlgo::kShm ? bytes : doubling ? std::floor(std::log2(p)) * bytes : 2 * (p - 1) / p * bytes;
  if (out.crosses_hosts) {
    // As allreduce_cost_seconds counts it: a flat ring sends one rank's bytes through a host's link, the other
    // flat algorithms all of its ranks'; a two-level one its slices, L of 1/L, through the flat step on the hosts.
    const double hosts = levels.hosts, local = levels.ranks_per_host;
    out.link_bytes = comm::is_hierarchical(pick)           ? 2 * (hosts - 1) / hosts * bytes
                     : pick == comm::AllreduceAlgo::kRing ? out.wire_bytes
                                                          : out.wire_bytes * local;
  }
  return out;
}

// The all-to-all `auto` runs without a tuning table (selector.cc's select_alltoall), its time and the bytes a rank
// counts as sent. On one host the defaults' rule: Bruck (comm/alltoall_bruck.cc: ceil(log2 p) rounds, each one
// message of the ~p / 2 blocks whose index has that bit set) above 2 ranks at <= 1 KB per peer, else pairwise
// (comm/alltoall_pairwise.cc: p - 1 rounds, one block each); across hosts the cheapest by the defaults' network
// terms, priced by the communicator's model with the file's links. `largest_per_peer` is what auto chooses by:
// the largest block any rank sends (the ranks agree on it first); `bytes_per_peer` the mean, which is priced.
CollectiveCost alltoall(const std::string& what, const Cluster& c, int group, double bytes_per_peer,
                        double largest_per_peer, int per_step) {
  CollectiveCost out;
  out.what = what;
  out.algorithm = "pairwise";
  out.bytes = bytes_per_peer * group;
  out.per_step = per_step;
  const comm::HostLevels levels = levels_of(c, group);
  out.crosses_hosts = levels.hosts > 1;
  if (group <= 1) return out;
  out.wire_bytes = (group - 1) * bytes_per_peer;
  if (!out.crosses_hosts) {
    if (group > 2 && std::ceil(largest_per_peer) <= 1024) {  // select_alltoall's rule on one host
      const double rounds = std::ceil(std::log2(group));
      out.algorithm = "bruck";
      out.wire_bytes = rounds * group / 2.0 * bytes_per_peer;
      out.seconds = rounds * (c.intra.alpha_s + group / 2.0 * bytes_per_peer / c.intra.bytes_per_s);
    } else {
      out.seconds = (group - 1) * (c.intra.alpha_s + bytes_per_peer / c.intra.bytes_per_s);
    }
    return out;
  }
  // As selector.cc without a table: the cheapest under the defaults' network terms (two-level only with several
  // ranks on each host), priced with the file's.
  const comm::CostModel chooser, model = cost_model(c, false);
  comm::AlltoallAlgo pick = comm::AlltoallAlgo::kPairwise;
  double best = std::numeric_limits<double>::infinity();
  for (comm::AlltoallAlgo a : comm::all_alltoall_algos()) {
    if (a == comm::AlltoallAlgo::kHier && levels.ranks_per_host < 2) continue;
    const double s = comm::alltoall_cost_seconds(a, group, static_cast<uint64_t>(std::ceil(largest_per_peer)), chooser, levels);
    if (s < best) best = s, pick = a;
  }
  out.algorithm = std::string(comm::algo_name(pick));
  out.seconds = comm::alltoall_cost_seconds(pick, group, static_cast<uint64_t>(bytes_per_peer), model, levels);
  out.link_bytes = double(levels.ranks_per_host) * (group - levels.ranks_per_host) * bytes_per_peer;
  if (pick == comm::AlltoallAlgo::kBruck)  // forwards each block ~log2(p) / 2 times
    out.wire_bytes = std::ceil(std::log2(group)) * group / 2.0 * bytes_per_peer;
  return out;
}

// The expected time of the busiest rank's routed experts over sampled routings (uniform top-k, as an untrained
// router gives; docs/plan.md), and that busiest / mean ratio.
// On a CPU host (`cores` > 0: the cores the ranks run on), ranks with less to do wait in a collective, spinning and
// then yielding their core, so the busiest finishes while the others wait, at the measured slowdown of a rank
// computing while others wait (`busy_slowdown`: near 1 with a core per rank; above it when the waiting ranks share
// its core, as their yield does not hand it over whole): unequal_wall. `wall_s` is that, `busiest_s` and `mean_s`
// are multiplied by `time_share` as every other part.
// The wall time of a part whose ranks' work differs, on a CPU host: every rank computes while the least loaded
// does (each at the time share of equal work), then the busiest goes on while others wait for it, at the slowdown
// measured for that (`busy`); at least all the ranks' work over the cores (`spread`, seconds of one rank alone)
// at the slowdown of equal work. Equal work (least = busiest) is the time share of any other part.
double unequal_wall(double least, double busiest, double spread, double time_share, double slowdown, double busy) {
  return std::max(least * time_share + (busiest - least) * busy, spread * slowdown);
}

struct ExpertTime {
  double busiest_s = 0, mean_s = 0, wall_s = 0, imbalance = 1;
};
ExpertTime routed_experts(const ModelConfig& m, const Device& dev, const PlanChoice& p, int ranks, int tokens,
                          double time_share, int cores, double slowdown, double busy_slowdown) {
  const int E = m.num_local_experts, k = m.num_experts_per_tok;
  const double I_local = static_cast<double>(m.intermediate_size) / p.tp, d = m.hidden_size;
  const int experts_per_group = E / p.ep;
  std::mt19937 rng(1);  // fixed: the same prediction every run
  constexpr int kSamples = 1000;
  std::vector<int> rows(E), order(E);
  double busiest_sum = 0, mean_sum = 0, wall_sum = 0;
  for (int s = 0; s < kSamples; ++s) {
    std::fill(rows.begin(), rows.end(), 0);
    for (int t = 0; t < tokens; ++t) {  // k distinct experts per token (a partial Fisher-Yates shuffle)
      for (int e = 0; e < E; ++e) order[e] = e;
      for (int j = 0; j < k; ++j) {
        const int pick = j + static_cast<int>(rng() % static_cast<unsigned>(E - j));
        std::swap(order[j], order[pick]);
        ++rows[order[j]];
      }
    }
    double busiest = 0, least = std::numeric_limits<double>::infinity(), total = 0;
    for (int g = 0; g < p.ep; ++g) {  // every tp rank of an EP group does the same work
      double t = 0;
      for (int e = g * experts_per_group; e < (g + 1) * experts_per_group; ++e)
        t += 2 * matmul_seconds(dev, p, rows[e], I_local, d, 1) + matmul_seconds(dev, p, rows[e], d, I_local, 1);
      busiest = std::max(busiest, t);
      least = std::min(least, t);
      total += t;
    }
    busiest_sum += busiest;
    mean_sum += total / p.ep;
    wall_sum += cores > 0 ? unequal_wall(least, busiest, p.tp * total / cores, time_share, slowdown, busy_slowdown)
                          : busiest * time_share;
  }
  (void)ranks;
  ExpertTime out;
  out.busiest_s = busiest_sum / kSamples * time_share;
  out.mean_s = mean_sum / kSamples * time_share;
  out.wall_s = wall_sum / kSamples;
  out.imbalance = mean_sum > 0 ? busiest_sum / mean_sum : 1;
  return out;
}

// Linear in `x` between the measured points, extrapolated from the last two beyond them (and from the first two
// below the first).
double interpolate(const std::vector<double>& xs, const std::vector<double>& ys, double x) {
  if (xs.size() == 1) return ys[0] * x / xs[0];
  size_t i = 1;
  while (i + 1 < xs.size() && x > xs[i]) ++i;
  return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1]);
}

// The slowdown at `ratio` ranks per core and the wait after a segment of `segment` seconds of CPU time
// (docs/plan.md): linear between the measured points, the nearest one's outside them; without a measured point
// at or below one rank per core, (1, no slowdown, no wait) is the first.
struct Sharing {
  double slowdown = 1, busy_slowdown = 1;
  const Cluster::TimeSharing *lo = nullptr, *hi = nullptr;
  double f = 0;  // hi's weight
  double wait(double segment) const {
    const double a = lo ? lo->wait(segment) : 0, b = hi ? hi->wait(segment) : 0;
    return (1 - f) * a + f * b;
  }
  double excess(double segment) const {
    const double a = lo ? lo->excess(segment) : 0, b = hi ? hi->excess(segment) : 0;
    return (1 - f) * a + f * b;
  }
};
Sharing time_sharing_at(const Cluster& c, double ratio) {
  static const Cluster::TimeSharing kAlone{};
  std::vector<const Cluster::TimeSharing*> points;
  if (c.time_sharing.empty() || c.time_sharing.front().ranks_per_core > 1) points.push_back(&kAlone);
  for (const Cluster::TimeSharing& t : c.time_sharing) points.push_back(&t);
  if (ratio <= points.front()->ranks_per_core)
    return {points.front()->slowdown, points.front()->busy_slowdown, points.front(), nullptr, 0};
  for (size_t i = 1; i < points.size(); ++i) {
    const Cluster::TimeSharing &lo = *points[i - 1], &hi = *points[i];
    if (ratio <= hi.ranks_per_core) {
      const double f = (ratio - lo.ranks_per_core) / (hi.ranks_per_core - lo.ranks_per_core);
      return {lo.slowdown + f * (hi.slowdown - lo.slowdown), lo.busy_slowdown + f * (hi.busy_slowdown - lo.busy_slowdown),
              &lo, &hi, f};
    }
  }
  return {points.back()->slowdown, points.back()->busy_slowdown, points.back(), nullptr, 0};
}

}  // namespace

// Linear in the segment between the measured lengths, the nearest one's outside them.
static double along_segments(const std::vector<double>& segment_s, const std::vector<double>& v, double segment) {
  if (v.empty()) return 0;
  if (segment <= segment_s.front()) return v.front();
  if (segment >= segment_s.back()) return v.back();
  size_t i = 1;
  while (segment > segment_s[i]) ++i;
  return v[i - 1] + (v[i] - v[i - 1]) * (segment - segment_s[i - 1]) / (segment_s[i] - segment_s[i - 1]);
}

double Cluster::TimeSharing::wait(double segment) const { return along_segments(segment_s, wait_s, segment); }
double Cluster::TimeSharing::excess(double segment) const { return along_segments(segment_s, excess_s, segment); }

double KernelTable::seconds(double rows, double n_out, double k_in) const {
  const double per_row = std::max(0.0, interpolate(tokens, per_row_s, rows));
  const double per_weight = std::max(0.0, interpolate(tokens, per_weight_s, rows));
  return n_out * per_row + n_out * k_in * per_weight;
}

std::string PlanChoice::name() const {
  std::string n = moe == "tp" ? "TP=" + std::to_string(tp)
                  : moe == "ep" ? "EP=" + std::to_string(ep)
                                : "TP=" + std::to_string(tp) + " x EP=" + std::to_string(ep);
  if (attn == "dp") n += " dp-attn";
  return n;
}

Cluster parse_cluster(const nlohmann::json& j, const std::string& origin) {
  MOEX_CHECK_INPUT(j.is_object(), "cluster file ", origin, ": must be a JSON object");
  Cluster c;
  c.name = j.contains("name") && j.at("name").is_string() ? j.at("name").get<std::string>() : origin;
  c.hosts = whole(j, "hosts", 1, 4096, 1, true);
  c.devices_per_host = whole(j, "devices_per_host", 1, 1024, 1, true);
  c.cores_per_host = whole(j, "cores_per_host", 0, 1 << 16, 0, false);
  c.host_read_bytes_per_s = figure(j, "host_read_GBps", "", false, 0) * 1e9;
  if (j.contains("shared_memory_collectives")) {
    MOEX_CHECK_INPUT(j.at("shared_memory_collectives").is_boolean(), "cluster file: \"shared_memory_collectives\" must be true or false");
    c.shared_memory_collectives = j.at("shared_memory_collectives").get<bool>();
  }
  const nlohmann::json& d = object(j, "device", "");
  c.device.name = d.contains("name") && d.at("name").is_string() ? d.at("name").get<std::string>() : "device";
  c.device.memory_bytes = figure(d, "memory_GB", "device") * 1e9;
  c.device.read_bytes_per_s = figure(d, "read_GBps", "device") * 1e9;
  c.device.bf16_flops = figure(d, "bf16_TFLOPS", "device") * 1e12;
  c.device.int8_ops = figure(d, "int8_TOPS", "device") * 1e12;
  c.device.f32_flops = figure(d, "f32_TFLOPS", "device") * 1e12;
  c.device.memory_efficiency = figure(d, "memory_efficiency", "device", false, 1);
  c.device.compute_efficiency = figure(d, "compute_efficiency", "device", false, 1);
  c.device.op_overhead_s = figure(d, "op_overhead_us", "device", false, 0) * 1e-6;
  if (d.contains("format_efficiency")) {
    const nlohmann::json& fe = object(d, "format_efficiency", "device.");
    for (const auto& [name, e] : fe.items()) {
      format_cost(name);
      MOEX_CHECK_INPUT(e.is_object(), "cluster file: \"device.format_efficiency.", name, "\" must be an object");
      const std::string where = "device.format_efficiency." + name;
      const double mem = figure(e, "memory", where), comp = figure(e, "compute", where);
      MOEX_CHECK_INPUT(mem > 0 && mem <= 1 && comp > 0 && comp <= 1, "cluster file: \"", where,
                       "\" efficiencies must be in (0, 1]");
      c.device.format_efficiency[name] = {mem, comp};
    }
  }
  if (d.contains("kernel_tables")) {
    const nlohmann::json& kt = object(d, "kernel_tables", "device.");
    for (const auto& [name, e] : kt.items()) {
      format_cost(name);
      const std::string where = "device.kernel_tables." + name;
      MOEX_CHECK_INPUT(e.is_object() && e.contains("points") && e.at("points").is_array() && !e.at("points").empty(),
                       "cluster file: \"", where, "\" must be {\"points\": [{\"tokens\", \"per_weight_ns\", \"per_row_ns\"}, ...], \"source\": ...}");
      MOEX_CHECK_INPUT(e.contains("source") && e.at("source").is_string() && !e.at("source").get<std::string>().empty(),
                       "cluster file: \"", where, "\" has no \"source\" (say where the figures come from)");
      KernelTable t;
      for (const nlohmann::json& pt : e.at("points")) {
        const auto num = [&](const char* key) {
          MOEX_CHECK_INPUT(pt.is_object() && pt.contains(key) && pt.at(key).is_number(), "cluster file: \"", where,
                           "\" point needs a number \"", key, "\"");
          const double v = pt.at(key).get<double>();
          MOEX_CHECK_INPUT(std::isfinite(v) && v >= 0, "cluster file: \"", where, ".", key, "\" must be >= 0, got ", v);
          return v;
        };
        const double tokens = num("tokens");
        MOEX_CHECK_INPUT(tokens >= 1 && (t.tokens.empty() || tokens > t.tokens.back()), "cluster file: \"", where,
                         "\" points need tokens >= 1, increasing");
        t.tokens.push_back(tokens);
        t.per_weight_s.push_back(num("per_weight_ns") * 1e-9);
        t.per_row_s.push_back(num("per_row_ns") * 1e-9);
      }
      c.device.kernel_tables[name] = t;
    }
  }
  MOEX_CHECK_INPUT(c.device.read_bytes_per_s > 0 && c.device.memory_bytes > 0, "cluster file: \"device\" needs read_GBps and memory_GB above 0");
  MOEX_CHECK_INPUT(c.device.bf16_flops > 0 && c.device.int8_ops > 0 && c.device.f32_flops > 0,
                   "cluster file: \"device\" needs bf16_TFLOPS, int8_TOPS and f32_TFLOPS above 0");
  MOEX_CHECK_INPUT(c.device.memory_efficiency > 0 && c.device.memory_efficiency <= 1 && c.device.compute_efficiency > 0 &&
                       c.device.compute_efficiency <= 1,
                   "cluster file: \"device\" efficiencies must be in (0, 1]");
  if (j.contains("time_sharing")) {
    MOEX_CHECK_INPUT(j.at("time_sharing").is_array(), "cluster file: \"time_sharing\" must be a list");
    for (const nlohmann::json& e : j.at("time_sharing")) {
      const std::string where = "time_sharing[" + std::to_string(c.time_sharing.size()) + "]";
      MOEX_CHECK_INPUT(e.is_object(), "cluster file: \"", where, "\" must be an object");
      Cluster::TimeSharing t;
      t.ranks_per_core = figure(e, "ranks_per_core", where);
      t.slowdown = figure(e, "slowdown", where);
      t.busy_slowdown = figure(e, "busy_slowdown", where, false, t.slowdown);
      MOEX_CHECK_INPUT(t.ranks_per_core > 0 && t.slowdown > 0 &&
                           (c.time_sharing.empty() || t.ranks_per_core > c.time_sharing.back().ranks_per_core),
                       "cluster file: \"", where, "\" needs ranks_per_core > 0 (increasing) and slowdown > 0");
      MOEX_CHECK_INPUT(t.busy_slowdown > 0, "cluster file: \"", where, ".busy_slowdown\" must be above 0");
      MOEX_CHECK_INPUT(!e.contains("wait_share"), "cluster file: \"", where,
                       ".wait_share\" is no longer read: run `moex plan calibrate --time-sharing` again for its \"wait\" table");
      if (e.contains("wait")) {
        const nlohmann::json& wt = e.at("wait");
        MOEX_CHECK_INPUT(wt.is_object() && wt.contains("points") && wt.at("points").is_array() && !wt.at("points").empty(),
                         "cluster file: \"", where, ".wait\" must be {\"points\": [{\"segment_us\", \"wait_us\"}, ...], \"source\": ...}");
        MOEX_CHECK_INPUT(wt.contains("source") && wt.at("source").is_string() && !wt.at("source").get<std::string>().empty(),
                         "cluster file: \"", where, ".wait\" has no \"source\" (say where the figures come from)");
        for (const nlohmann::json& pt : wt.at("points")) {
          const auto num = [&](const char* key) {
            MOEX_CHECK_INPUT(pt.is_object() && pt.contains(key) && pt.at(key).is_number(), "cluster file: \"", where,
                             ".wait\" point needs a number \"", key, "\"");
            const double v = pt.at(key).get<double>();
            MOEX_CHECK_INPUT(std::isfinite(v) && v >= 0, "cluster file: \"", where, ".wait.", key, "\" must be >= 0, got ", v);
            return v;
          };
          const double seg = num("segment_us") * 1e-6;
          MOEX_CHECK_INPUT(seg > 0 && (t.segment_s.empty() || seg > t.segment_s.back()), "cluster file: \"", where,
                           ".wait\" points need segment_us > 0, increasing");
          t.segment_s.push_back(seg);
          t.wait_s.push_back(num("wait_us") * 1e-6);
          if (pt.contains("excess_us")) t.excess_s.push_back(num("excess_us") * 1e-6);
        }
        MOEX_CHECK_INPUT(t.excess_s.empty() || t.excess_s.size() == t.wait_s.size(), "cluster file: \"", where,
                         ".wait\" points need \"excess_us\" in every point or in none");
      }
      c.time_sharing.push_back(t);
    }
  }
  const nlohmann::json& links = object(j, "links", "");
  c.intra = parse_link(object(links, "intra_host", "links."), "links.intra_host");
  if (c.hosts > 1) c.inter = parse_link(object(links, "inter_host", "links."), "links.inter_host");
  return c;
}

Cluster load_cluster(const std::string& path) {
  std::ifstream in(path);
  MOEX_CHECK_INPUT(in.good(), "--cluster ", path, ": cannot read the file");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, "--cluster " + path + ": not JSON (" + e.what() + ")");
  }
  return parse_cluster(j, path);
}

std::vector<PlanChoice> candidate_plans(const ModelConfig& model, int ranks, const std::string& weights,
                                        const std::string& comm_dtype) {
  format_cost(weights);  // a bad name is an error, not an empty list
  std::vector<PlanChoice> out;
  const auto add = [&](const std::string& moe, const std::string& attn, int tp, int ep) {
    PlanRequest r{moe, attn, tp, ep, comm_dtype, false};
    try {
      make_parallel_plan(r, PlanShape{model.num_attention_heads, model.num_key_value_heads, model.num_local_experts,
                                      model.intermediate_size},
                         ranks, 0);
    } catch (const Error&) {
      return;  // this model cannot take it (heads, experts or the intermediate size do not split)
    }
    PlanChoice p;
    p.moe = moe, p.attn = attn, p.tp = tp, p.ep = ep, p.weights = weights, p.comm_dtype = comm_dtype;
    out.push_back(p);
  };
  if (ranks == 1) {
    add("tp", "tp", 1, 1);
    return out;
  }
  add("tp", "tp", ranks, 1);
  add("ep", "tp", 1, ranks);
  add("ep", "dp", 1, ranks);
  for (int tp = 2; tp < ranks; ++tp)
    if (ranks % tp == 0) add("tpxep", "tp", tp, ranks / tp);
  return out;
}

Prediction predict(const ModelConfig& m, const Cluster& c, const PlanChoice& p, int ranks, const Workload& w) {
  MOEX_CHECK_INPUT(ranks >= 1 && ranks <= c.hosts * c.devices_per_host, ranks, " ranks do not fit cluster \"", c.name,
                   "\" (", c.hosts, " hosts x ", c.devices_per_host, " devices)");
  MOEX_CHECK_INPUT(w.batch >= 1 && w.context >= 1, "--batch and --context must be at least 1");
  MOEX_CHECK_INPUT(p.tp * p.ep == ranks, "plan ", p.name(), ": tp x ep must be ", ranks);
  const ParallelPlan plan =
      make_parallel_plan(PlanRequest{p.moe, p.attn, p.tp, p.ep, p.comm_dtype, false},
                         PlanShape{m.num_attention_heads, m.num_key_value_heads, m.num_local_experts, m.intermediate_size},
                         ranks, 0);
  Prediction out;
  out.plan = p;
  out.ranks = ranks;
  // Ranks fill a host before the next one (mpirun's default by slot), so a group spans hosts once it is larger
  // than a host.
  const int per_host = std::min(ranks, c.devices_per_host);
  const double ranks_per_core = c.cores_per_host > 0 ? double(per_host) / c.cores_per_host : 1.0;
  const Sharing sharing = time_sharing_at(c, ranks_per_core);
  // Sharing the cores never makes a rank faster: a slowdown below 1 is a probe's error (files calibrated before the
  // probe measured each all-reduce's own time as it ran subtracted the bare back-to-back call, which over a shaped
  // link waits for an empty bucket, from every segment: 0.74 over 50mbit).
  const double time_share = std::max(1.0, ranks_per_core) * std::max(1.0, sharing.slowdown);
  out.time_share = time_share;
  // The ranks that read at once share the host's rate (those beyond the cores wait their turn: time_share).
  Device dev = c.device;
  if (c.host_read_bytes_per_s > 0) {
    const int reading = c.cores_per_host > 0 ? std::min(per_host, c.cores_per_host) : per_host;
    dev.read_bytes_per_s = std::min(dev.read_bytes_per_s, c.host_read_bytes_per_s / reading);
  }
  const double d = m.hidden_size, hd = m.head_dim, L = m.num_hidden_layers, B = w.batch;
  const bool dp = plan.attn == AttnParallel::kDP;
  // Attention: this rank's heads (TP) or all of them for its own sequences (DP). KV heads are replicated when
  // there are fewer than ranks (parallel_plan.h).
  const SliceRange heads = local_heads(plan, m.num_attention_heads);
  const SliceRange kv = local_kv_heads(plan, m.num_attention_heads, m.num_key_value_heads);
  const double q_local = double(heads.end - heads.begin) * hd, kv_local = double(kv.end - kv.begin) * hd;
  const double seqs = dp ? std::ceil(B / ranks) : B;  // the busiest rank's sequences
  const double kv_bytes = 2.0;                        // a bf16 KV cache
  // A rank's own parts for `s` sequences, each multiplied by `ts`.
  PlanChoice stored = p;
  stored.weights = "as-stored";
  struct Own {
    double attention = 0, routing = 0, lm_head = 0, total = 0;
    std::vector<double> mlp_of;
  };
  int moe_layers = 0;
  for (int l = 0; l < m.num_hidden_layers; ++l) moe_layers += m.moe_layer(l) ? 1 : 0;
  const auto own = [&](double s, double ts) {
    Own o;
    o.attention = matmul_seconds(dev, p, s, q_local, d, ts) + 2 * matmul_seconds(dev, p, s, kv_local, d, ts) +
                  matmul_seconds(dev, p, s, d, q_local, ts);
    const double kv_read = s * w.context * 2 * kv_local * kv_bytes;
    o.attention += std::max(kv_read / (dev.read_bytes_per_s * dev.memory_efficiency),
                            4 * s * w.context * q_local / (dev.f32_flops * dev.compute_efficiency)) * ts;
    // Routing: the router's [E, d] weights as stored (f32 activations) for the rank's tokens.
    o.routing = matmul_seconds(dev, stored, s, m.num_local_experts, d, ts);
    // Dense MLP and shared experts run whole on every rank (model/weights.cc loads them unsplit).
    o.mlp_of.resize(m.num_hidden_layers);
    o.total = o.attention * L + o.routing * moe_layers;
    for (int l = 0; l < m.num_hidden_layers; ++l) {
      const double I = m.moe_layer(l) ? m.shared_expert_intermediate_size : m.dense_intermediate_size;
      o.mlp_of[l] = 2 * matmul_seconds(dev, p, s, I, d, ts) + matmul_seconds(dev, p, s, d, I, ts);
      o.total += o.mlp_of[l];
    }
    o.lm_head = matmul_seconds(dev, p, s, m.vocab_size, d, ts);
    o.total += o.lm_head;
    return o;
  };
  Own mine = own(seqs, time_share);
  // Ranks beyond the cores (docs/plan.md): under dp attention the ranks hold different numbers of sequences, and
  // those with fewer wait in the collective, yielding their cores to the busiest.
  const int cores = c.cores_per_host > 0 ? c.cores_per_host * ((ranks + c.devices_per_host - 1) / c.devices_per_host) : 0;
  if (dp && cores > 0 && mine.total > 0) {
    double all = 0;
    for (int r = 0; r < ranks; ++r) all += own(std::floor(B / ranks) + (r < int(B) % ranks ? 1 : 0), 1).total;
    const double wall = unequal_wall(own(std::floor(B / ranks), 1).total, own(seqs, 1).total, all / cores, time_share,
                                     sharing.slowdown, sharing.busy_slowdown);
    const double scale = wall / mine.total;
    mine.attention *= scale, mine.routing *= scale, mine.lm_head *= scale;
    for (double& v : mine.mlp_of) v *= scale;
  }
  const double attention = mine.attention, routing = mine.routing, lm_head = mine.lm_head;
  const std::vector<double>& mlp_of = mine.mlp_of;
  double mlp = 0;
  for (double v : mlp_of) mlp += v;
  const ExpertTime experts = routed_experts(m, dev, p, ranks, w.batch, time_share, cores, sharing.slowdown,
                                             sharing.busy_slowdown);
  out.expert_imbalance = experts.imbalance;
  out.attention_s = attention * L;
  out.routing_s = routing * moe_layers;
  out.experts_s = experts.wall_s * moe_layers;
  // Rank 0 waits for the busiest EP group (its own experts take the mean, by symmetry of uniform routing). Under
  // dp attention it holds ceil(B / N) sequences, the most, so its attention never waits.
  out.wait_s = std::max(0.0, experts.wall_s - experts.mean_s) * moe_layers;
  out.other_s = mlp + lm_head;
  out.imbalance_wait_s = out.wait_s;
  // Collectives per step.
  const double elem = comm::wire_bytes(comm::wire_format_for(plan.comm_dtype), 1 << 20) / double(1 << 20);
  if (ranks > 1) {
    if (!dp) {
      out.collectives.push_back(allreduce("attention all-reduce", c, ranks, B * d * elem, p.comm_dtype,
                                          m.num_hidden_layers));
      out.collectives.push_back(allreduce("MoE all-reduce", c, ranks, B * d * elem, p.comm_dtype, moe_layers));
    } else {
      // moe_layer.cc's forward_dispatch, per MoE layer: the counts of rows of each of a peer's E / N experts and
      // the sender's largest block (E / N + 1 int32), then the rows, then their outputs back. `auto` picks each
      // all-to-all's algorithm by the group's largest block, which every rank knows from the counts (the combine's
      // blocks are the dispatch's transposed), so no collective agrees on it first (comm/alltoall.cc). An engine
      // that agreed (Workload::dispatch_size_agreements) ran an 8-byte MPI all-reduce before each of the three.
      // Each token's k expert rows go to the ranks that hold the experts, (ranks - 1) / ranks of them to others;
      // auto picks by the largest block, at least one row (a rank with a token sends it somewhere).
      const double rows_per_peer = seqs * m.num_experts_per_tok / ranks;
      const double counts = 4.0 * (double(m.num_local_experts) / ranks + (w.dispatch_size_agreements ? 0 : 1));
      const double row_bytes = d * elem, largest = std::max(1.0, std::ceil(rows_per_peer)) * row_bytes;
      out.collectives.push_back(alltoall("dispatch all-to-all", c, ranks, rows_per_peer * row_bytes, largest, moe_layers));
      out.collectives.push_back(alltoall("combine all-to-all", c, ranks, rows_per_peer * row_bytes, largest, moe_layers));
      out.collectives.push_back(alltoall("counts all-to-all", c, ranks, counts, counts, moe_layers));
      if (w.dispatch_size_agreements)
        out.collectives.push_back(allreduce("all-to-all size agreement", c, ranks, 8, "f32", 3 * moe_layers, true));
    }
  }
  // Rank 0's compute between two collectives, segment by segment (its own experts: the mean group's), and the
  // collective that ends each: TP attention reduces after attention and after each MoE block, dp attention
  // exchanges the counts and dispatches after routing (the dispatch back to back: a segment of no compute) and
  // combines after the experts (an engine that agreed on sizes: agree, counts, agree, dispatch; experts; agree,
  // combine). What follows the last collective of a step (dense layers, lm_head) runs before the next step's first.
  std::vector<std::pair<double, size_t>> segments;  // (wall seconds, index in out.collectives)
  if (ranks > 1) {
    double open = 0;
    const auto sync = [&](size_t collective) { segments.emplace_back(open, collective), open = 0; };
    for (int l = 0; l < m.num_hidden_layers; ++l) {
      open += attention;
      if (!dp) sync(0);
      if (!m.moe_layer(l)) {
        open += mlp_of[l];
        continue;
      }
      open += routing;
      const bool agree = dp && w.dispatch_size_agreements;
      if (agree) sync(3);
      if (dp) sync(2);
      if (agree) sync(3);
      if (dp) sync(0);
      open += experts.mean_s;
      if (agree) sync(3);
      sync(1);
      open += mlp_of[l];
    }
    open += lm_head;
    if (!segments.empty()) segments.front().first += open;  // none: nothing is collective, nothing waits
  }
  // A shaped inter-host link's bucket refills while the ranks compute, up to its size, and each call's bytes pass
  // without the rate up to what it holds then (Link::burst_bytes). What a call leaves in the bucket carries over
  // to the next, so the level is followed through the step, from where the step before left it (a second pass).
  if (c.hosts > 1 && c.inter.burst_bytes > 0) {
    double level = c.inter.burst_bytes;
    for (int pass = 0; pass < 2; ++pass)
      for (const auto& [seg, i] : segments) {
        CollectiveCost& col = out.collectives[i];
        level = std::min(c.inter.burst_bytes, level + seg * c.inter.bytes_per_s);
        if (!col.crosses_hosts) continue;
        const double passed = std::min(level, col.link_bytes);
        level -= passed;
        if (pass == 1) col.burst_credit_s += std::min(passed / c.inter.bytes_per_s, col.seconds);
      }
  }
  double wire = 0;
  for (const CollectiveCost& col : out.collectives) {
    out.comm_s += col.seconds * col.per_step - col.burst_credit_s;
    wire += col.wire_bytes * col.per_step;
  }
  const double compute = out.attention_s + out.routing_s + out.experts_s + out.other_s;
  if (dp && ranks > 1) {
    // Rank r holds floor(B / N) sequences, one more for r < B % N; ranks 1.. of rank 0's host send through memory,
    // the others through rank 0's host link, after their forward (rank 0 waits for them after its own). A shaped
    // link's bucket refilled during the step.
    const int on_host = std::min(ranks, c.devices_per_host), n = ranks, b = w.batch;
    double intra_bytes = 0, inter_bytes = 0;
    for (int r = 1; r < n; ++r) {
      const double rows = double(b / n + (r < b % n ? 1 : 0)) * double(m.vocab_size) * 4;
      (r < on_host ? intra_bytes : inter_bytes) += rows;
    }
    if (intra_bytes > 0) out.logits_s += c.intra.alpha_s + intra_bytes / c.intra.bytes_per_s;
    if (inter_bytes > 0) {
      const double tokens = std::min(c.inter.burst_bytes, compute * c.inter.bytes_per_s);
      out.logits_s += c.inter.alpha_s + std::max(0.0, inter_bytes - tokens) / c.inter.bytes_per_s;
    }
  }
  // The wait the time-sharing table gives after each segment. A collective right after another (no compute
  // between them: dp attention's dispatch after the counts) has no compute of other ranks to wait behind: its wait is
  // the scheduler's round through the ranks that share the cores, time the step spends on top of its compute.
  // Each collective's own time beyond the wire under the sharing (TimeSharing::excess_s) is step time too.
  double back_to_back = 0;
  for (const auto& [seg, i] : segments) {
    const double wait = sharing.wait(seg / time_share), excess = sharing.excess(seg / time_share);
    out.wait_s += wait + excess;
    back_to_back += (seg <= 0 ? wait : 0) + excess;
    out.longest_segment_s = std::max(out.longest_segment_s, seg);
  }
  out.step_s = compute + out.comm_s + out.logits_s + back_to_back;
  out.tokens_per_s = B / out.step_s;
  // A rank inside a collective is not computing: its wire and wait leave at least its own compute's CPU time in
  // the step (rank 0's: the mean group's experts, at the time share's CPU rate). The table's wait and the
  // slowdown are measured in different minutes, and on a loaded machine their sum can pass that bound.
  const double own_cpu = (compute - out.imbalance_wait_s) / time_share;
  out.wait_s = std::min(out.wait_s, std::max(out.imbalance_wait_s + back_to_back,
                                             out.step_s - out.logits_s - out.comm_s - own_cpu));
  out.comm_share = (out.comm_s + out.wait_s) / out.step_s;
  out.wire_share = out.comm_s / out.step_s;
  out.wire_bytes_per_token = wire / (dp ? seqs : B);
  // Memory: this rank's weights and KV cache.
  const double experts_local = double(local_experts(plan, m.num_local_experts).count);
  const double I_local = double(m.intermediate_size) / p.tp;
  double weights = L * d * (2 * q_local + 2 * kv_local) + 2 * double(m.vocab_size) * d;
  for (int l = 0; l < m.num_hidden_layers; ++l)
    weights += m.moe_layer(l) ? experts_local * 3 * d * I_local + 3 * d * m.shared_expert_intermediate_size
                              : 3 * d * m.dense_intermediate_size;
  out.device_bytes = weights * bytes_per_weight(p) + seqs * w.context * L * 2 * kv_local * kv_bytes;
  out.fits = out.device_bytes <= dev.memory_bytes;
  return out;
}

}  // namespace moex::tools::plan

#include "moex/comm/selector.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/small_file.h"

namespace moex::comm {
namespace {

std::mutex g_options_mutex;
CommOptions g_options;
std::shared_ptr<const TuningTable> g_table;  // loaded from g_options.tuning_path
bool g_options_initialised = false;
std::atomic<uint64_t> g_options_generation{1};  // bumped by set_comm_options: invalidates decision caches

std::string trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return std::string(text);
}

// "none" -> "", empty -> the default table when it exists: the path to load, or "" for the cost model.
std::string resolve_tuning_path(const std::string& named) {
  if (named == "none") return "";
  if (!named.empty()) return named;
  const std::string fallback = default_tuning_path();
  // Anything at the default path is loaded, so a directory or FIFO there is an error rather than ignored.
  std::error_code error;
  return !fallback.empty() && std::filesystem::exists(fallback, error) ? fallback : "";
}

std::shared_ptr<const TuningTable> load_table(const std::string& named) {
  const std::string path = resolve_tuning_path(named);
  return path.empty() ? nullptr : std::make_shared<const TuningTable>(TuningTable::load(path));
}

// MOEX_COMM_ALGO and MOEX_COMM_TUNING into options (a bad value throws, exit 2).
void options_from_env(CommOptions* options) {
  if (const char* spec = std::getenv("MOEX_COMM_ALGO")) parse_algo_spec(spec, options);
  if (const char* path = std::getenv("MOEX_COMM_TUNING")) options->tuning_path = path;
}

// First use without set_comm_options(): take the environment alone.
void ensure_options() {
  if (g_options_initialised) return;
  g_options_initialised = true;
  CommOptions options;
  options_from_env(&options);
  g_options = options;
  g_table = load_table(options.tuning_path);
}

std::shared_ptr<const TuningTable> current_table() {
  std::lock_guard lock(g_options_mutex);
  ensure_options();
  return g_table;
}

}  // namespace

AllreduceAlgo parse_allreduce_algo(std::string_view name, std::string_view source) {
  const auto algo = allreduce_algo_from_name(trim(name));
  MOEX_CHECK_INPUT(algo.has_value(), source, ": unknown all-reduce algorithm '", name,
                   "'; valid names: ", allreduce_algo_names());
  return *algo;
}

AlltoallAlgo parse_alltoall_algo(std::string_view name, std::string_view source) {
  const auto algo = alltoall_algo_from_name(trim(name));
  MOEX_CHECK_INPUT(algo.has_value(), source, ": unknown all-to-all algorithm '", name,
                   "'; valid names: ", alltoall_algo_names());
  return *algo;
}

void parse_algo_spec(std::string_view spec, CommOptions* options) {
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t end = std::min(spec.find(';', pos), spec.size());
    const std::string item = trim(spec.substr(pos, end - pos));
    pos = end + 1;
    if (item.empty()) continue;
    const size_t equals = item.find('=');
    MOEX_CHECK_INPUT(equals != std::string::npos, "MOEX_COMM_ALGO: '", item,
                     "' is not KEY=NAME (expected e.g. \"allreduce=nhr;alltoall=pairwise\")");
    const std::string key = trim(std::string_view(item).substr(0, equals));
    const std::string value = trim(std::string_view(item).substr(equals + 1));
    if (key == "allreduce") {
      options->allreduce_algo = parse_allreduce_algo(value, "MOEX_COMM_ALGO allreduce");
    } else if (key == "alltoall") {
      options->alltoall_algo = parse_alltoall_algo(value, "MOEX_COMM_ALGO alltoall");
    } else {
      MOEX_CHECK_INPUT(false, "MOEX_COMM_ALGO: unknown collective '", key, "'; valid keys: allreduce, alltoall");
    }
  }
}

CommOptions comm_options_from_flags(std::string_view allreduce_flag, std::string_view alltoall_flag,
                                    std::string_view tuning_flag) {
  CommOptions options;
  options_from_env(&options);
  if (!allreduce_flag.empty()) options.allreduce_algo = parse_allreduce_algo(allreduce_flag);
  if (!alltoall_flag.empty()) options.alltoall_algo = parse_alltoall_algo(alltoall_flag);
  if (!tuning_flag.empty()) options.tuning_path = tuning_flag;
  return options;
}

std::string default_tuning_path() {
  auto env = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value && *value ? value : "";
  };
  std::string dir = env("MOEX_CACHE_DIR");
  if (dir.empty() && !env("XDG_CACHE_HOME").empty()) dir = env("XDG_CACHE_HOME") + "/moex";
  if (dir.empty() && !env("HOME").empty()) dir = env("HOME") + "/.cache/moex";
  return dir.empty() ? "" : dir + "/comm-tuning.json";
}

void set_comm_options(const CommOptions& options) {
  auto table = load_table(options.tuning_path);
  std::lock_guard lock(g_options_mutex);
  g_options_initialised = true;
  g_options = options;
  g_table = std::move(table);
  g_options_generation.fetch_add(1);
}

const CommOptions& comm_options() {
  std::lock_guard lock(g_options_mutex);
  ensure_options();
  return g_options;
}

// ---------------------------------------------------------------------------------------------------
// tuning table

namespace {

LinkCost link_from_json(const nlohmann::json& item) {
  LinkCost link;
  link.alpha_s = item.at("alpha_s").get<double>();
  link.beta_s_per_byte = item.at("beta_s_per_byte").get<double>();
  MOEX_CHECK_INPUT(std::isfinite(link.alpha_s) && link.alpha_s >= 0 && std::isfinite(link.beta_s_per_byte) &&
                       link.beta_s_per_byte >= 0,
                   "a level's alpha_s and beta_s_per_byte must be finite and >= 0: ", item.dump());
  link.measured = true;
  return link;
}

}  // namespace

TuningTable TuningTable::load(const std::string& path) {
  std::string text;
  try {
    text = read_small_file(path, kMaxJsonFileBytes, "(make one with `moex tune-comm --out " + path + "`)");
  } catch (const Error& e) {  // the path may come from MOEX_COMM_TUNING: say what it was meant to be
    throw_error(e.kind(), std::string("comm tuning table: ") + e.what());
  }
  TuningTable table;
  try {
    const nlohmann::json doc = nlohmann::json::parse(text);
    const int version = doc.value("version", 1);
    MOEX_CHECK_INPUT(version >= 1 && version <= kVersion, "comm tuning table ", path, ": version ", version,
                     " is not one this moex reads (1 to ", kVersion, "): run `moex tune-comm --out ", path,
                     "` again");
    for (const auto& item : doc.at("entries")) {
      TuningEntry entry;
      const auto collective = collective_from_name(item.at("collective").get<std::string>());
      const auto dtype = comm_dtype_from_name(item.value("dtype", std::string("f32")));
      MOEX_CHECK_INPUT(collective && dtype, "comm tuning table ", path, ": bad collective or dtype in ", item.dump());
      entry.collective = *collective;
      entry.dtype = *dtype;
      entry.group_size = item.at("group_size").get<int>();
      entry.bytes = item.at("bytes").get<uint64_t>();
      entry.algo = item.at("algo").get<std::string>();
      entry.time_us = item.value("time_us", 0.0);
      entry.registered = item.value("registered", false);
      entry.hosts = version >= 2 ? item.at("hosts").get<int>() : 1;
      MOEX_CHECK_INPUT(entry.hosts >= 1 && entry.hosts <= entry.group_size, "comm tuning table ", path,
                       ": bad hosts in ", item.dump());
      const std::string source = "comm tuning table " + path;
      if (entry.collective == Collective::kAllreduce) parse_allreduce_algo(entry.algo, source);
      if (entry.collective == Collective::kAlltoall) parse_alltoall_algo(entry.algo, source);
      table.add(std::move(entry));
    }
    if (doc.contains("levels")) {
      const auto& levels = doc.at("levels");
      if (levels.contains("intra")) table.intra = link_from_json(levels.at("intra"));
      if (levels.contains("inter")) table.inter = link_from_json(levels.at("inter"));
    }
  } catch (const nlohmann::json::exception& e) {
    MOEX_CHECK_INPUT(false, "comm tuning table ", path, ": ", e.what());
  }
  return table;
}

void TuningTable::save(const std::string& path) const {
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& entry : entries_) {
    entries.push_back({{"collective", collective_name(entry.collective)},
                       {"group_size", entry.group_size},
                       {"hosts", entry.hosts},
                       {"dtype", comm_dtype_name(entry.dtype)},
                       {"bytes", entry.bytes},
                       {"algo", entry.algo},
                       {"time_us", entry.time_us},
                       {"registered", entry.registered}});
  }
  nlohmann::json doc{{"version", kVersion}, {"entries", entries}};
  nlohmann::json levels = nlohmann::json::object();
  for (const auto& [name, link] : {std::pair<const char*, const LinkCost&>{"intra", intra}, {"inter", inter}})
    if (link.measured) levels[name] = {{"alpha_s", link.alpha_s}, {"beta_s_per_byte", link.beta_s_per_byte}};
  if (!levels.empty()) doc["levels"] = levels;
  std::ofstream out(path);
  MOEX_CHECK_INPUT(out.good(), "cannot write ", path);
  out << doc.dump(1) << "\n";
}

std::optional<std::string> TuningTable::lookup(Collective collective, int group_size, CommDType dtype,
                                               uint64_t bytes, bool registered, int hosts) const {
  for (CommDType want_dtype : {dtype, CommDType::kF32}) {
    for (bool want_registered : {registered, !registered}) {
      const TuningEntry* best = nullptr;
      double best_distance = std::numeric_limits<double>::infinity();
      for (const auto& entry : entries_) {
        if (entry.collective != collective || entry.group_size != group_size || entry.hosts != hosts ||
            entry.dtype != want_dtype || entry.registered != want_registered)
          continue;
        const double distance = std::fabs(std::log2(static_cast<double>(std::max<uint64_t>(entry.bytes, 1))) -
                                          std::log2(static_cast<double>(std::max<uint64_t>(bytes, 1))));
        if (distance < best_distance) best_distance = distance, best = &entry;
      }
      if (best) return best->algo;
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------------
// cost model (DESIGN.md §3)

CostModel cost_model_with(const TuningTable* table, int hosts) {
  CostModel model;
  if (!table || hosts <= 1) return model;
  if (table->intra.measured) model.alpha_s = table->intra.alpha_s, model.beta_s_per_byte = table->intra.beta_s_per_byte;
  if (table->inter.measured)
    model.inter_alpha_s = table->inter.alpha_s, model.inter_beta_s_per_byte = table->inter.beta_s_per_byte;
  return model;
}

double allreduce_cost_seconds(AllreduceAlgo algo, int group_size, uint64_t bytes, const CostModel& model,
                              HostLevels levels) {
  const double p = group_size, n = static_cast<double>(bytes);
  if (group_size <= 1) return 0.0;
  if (is_hierarchical(algo)) {
    const int hosts = std::max(levels.hosts, 1), local = std::max(levels.ranks_per_host, 1);
    // Inside a host: the mesh's two halves (one step each, every peer at once).
    const double l = local, moved = (l - 1) / l * n;
    const double intra = local > 1 ? 2 * model.alpha_s * (1 + 0.25 * (l - 2)) + 2 * moved * model.beta_s_per_byte +
                                         moved * model.gamma_s_per_byte
                                   : 0.0;
    // Between hosts: the flat algorithm on a 1/L slice, the L slices through one link at once.
    CostModel network = model;
    network.alpha_s = model.inter_alpha_s;
    network.beta_s_per_byte = model.inter_beta_s_per_byte * l;
    return intra + allreduce_cost_seconds(inter_host_algo(algo), hosts, bytes / local, network);
  }
  if (levels.hosts > 1 && algo != AllreduceAlgo::kShm) {
    // Every step waits for the network. Ring (ranks in host order) crosses each link with one rank's
    // messages; the others pair ranks across hosts in most steps, so all of a host's ranks share its link.
    CostModel network = model;
    network.alpha_s = model.inter_alpha_s;
    network.beta_s_per_byte =
        model.inter_beta_s_per_byte * (algo == AllreduceAlgo::kRing ? 1.0 : std::max(levels.ranks_per_host, 1));
    return allreduce_cost_seconds(algo, group_size, bytes, network);
  }
  const double log_p = std::ceil(std::log2(p));
  const bool pof2 = (group_size & (group_size - 1)) == 0;
  const double fold = pof2 ? 0.0 : model.alpha_s + n * model.beta_s_per_byte;  // non-power-of-two extra step
  const double reduce_scatter_bytes = (p - 1) / p * n;
  switch (algo) {
    case AllreduceAlgo::kRing:
      return 2 * (p - 1) * model.alpha_s + 2 * reduce_scatter_bytes * model.beta_s_per_byte +
             reduce_scatter_bytes * model.gamma_s_per_byte;
    case AllreduceAlgo::kRecursiveDoubling:
      return std::floor(std::log2(p)) * (model.alpha_s + n * (model.beta_s_per_byte + model.gamma_s_per_byte)) +
             2 * fold;
    case AllreduceAlgo::kRabenseifner:
      return 2 * std::floor(std::log2(p)) * model.alpha_s + 2 * reduce_scatter_bytes * model.beta_s_per_byte +
             reduce_scatter_bytes * model.gamma_s_per_byte + 2 * fold;
    case AllreduceAlgo::kNhr:
      return 2 * log_p * model.alpha_s + 2 * reduce_scatter_bytes * model.beta_s_per_byte +
             reduce_scatter_bytes * model.gamma_s_per_byte;
    case AllreduceAlgo::kMesh:  // all peers at once: latency of 2 steps, but p-1 messages share one CPU
      return 2 * model.alpha_s * (1 + 0.25 * (p - 2)) + 2 * reduce_scatter_bytes * model.beta_s_per_byte +
             reduce_scatter_bytes * model.gamma_s_per_byte;
    case AllreduceAlgo::kShm: {
      // One-shot (up to 64 KB): one barrier, every rank reads all p buffers and sums. Two-shot: two barriers
      // per 1 MB segment and 3 + 1/p passes over the buffer (copy in, read to reduce, write the sum, copy
      // out): cheap while the buffer stays in cache, 3x the traffic of a p2p algorithm once it does not.
      if (n <= 64 * 1024) return model.shm_alpha_s + (p - 1) * n * model.gamma_s_per_byte;
      const double pass_s_per_byte =
          bytes <= model.shm_cached_max_bytes ? model.shm_cached_beta_s_per_byte : model.beta_s_per_byte;
      return 2 * model.shm_alpha_s * std::ceil(n / (1 << 20)) + (3 + 1 / p) * n * pass_s_per_byte;
    }
    case AllreduceAlgo::kMpi:  // unknown internals: assume a tuned Rabenseifner plus a library overhead
      return 1.2 * allreduce_cost_seconds(AllreduceAlgo::kRabenseifner, group_size, bytes, model);
    case AllreduceAlgo::kAuto:
    default: break;
  }
  return std::numeric_limits<double>::infinity();
}

bool allreduce_auto_candidate(AllreduceAlgo algo, CommDType dtype) {
  return algo != AllreduceAlgo::kMpi || dtype == CommDType::kF32;
}

namespace {

// Two-level algorithms need a group over several hosts with several ranks on each to differ from flat ones.
bool two_levels(HostLevels levels) { return levels.hosts > 1 && levels.ranks_per_host > 1; }

bool candidate(AllreduceAlgo algo, CommDType dtype, bool shm_available, HostLevels levels, bool hierarchical_only) {
  if (algo == AllreduceAlgo::kShm && !shm_available) return false;
  if (hierarchical_only ? !is_hierarchical(algo) : is_hierarchical(algo) && !two_levels(levels)) return false;
  return allreduce_auto_candidate(algo, dtype);
}

// hierarchical_only: kHier asked for by name (only kHierRing .. kHierNhr may come out).
AllreduceAlgo select_allreduce_uncached(int group_size, CommDType dtype, uint64_t bytes, bool shm_available,
                                        bool registered, HostLevels levels, bool hierarchical_only) {
  const auto table = current_table();
  if (table) {
    if (auto name = table->lookup(Collective::kAllreduce, group_size, dtype, bytes, registered, levels.hosts)) {
      const AllreduceAlgo winner = *allreduce_algo_from_name(*name);
      // mpi stays when bf16 falls back to f32 entries
      if ((winner != AllreduceAlgo::kShm || shm_available) && (!hierarchical_only || is_hierarchical(winner)))
        return winner;
    }
  }
  const CostModel model = cost_model_with(table.get(), levels.hosts);
  AllreduceAlgo best = hierarchical_only ? AllreduceAlgo::kHierRing : AllreduceAlgo::kRing;
  double best_cost = std::numeric_limits<double>::infinity();
  for (AllreduceAlgo algo : all_allreduce_algos()) {
    if (!candidate(algo, dtype, shm_available, levels, hierarchical_only)) continue;
    const double cost = allreduce_cost_seconds(algo, group_size, bytes, model, levels);
    if (cost < best_cost) best_cost = cost, best = algo;
  }
  return best;
}

}  // namespace

AllreduceAlgo select_allreduce(AllreduceAlgo requested, int group_size, CommDType dtype, uint64_t bytes,
                               bool shm_available, bool registered, HostLevels levels) {
  if (requested == AllreduceAlgo::kAuto) requested = comm_options().allreduce_algo;
  if (requested != AllreduceAlgo::kAuto && requested != AllreduceAlgo::kHier) return requested;
  const bool hierarchical_only = requested == AllreduceAlgo::kHier;
  // The engine repeats the same few sizes: remember recent decisions (a lookup costs ~0.3 us, a small
  // all-reduce ~1 us).
  struct Decision {
    uint64_t generation = 0, bytes = 0;
    int group_size = 0, hosts = 0, ranks_per_host = 0;
    CommDType dtype = CommDType::kF32;
    bool shm = false, registered = false, hierarchical_only = false;
    AllreduceAlgo algo = AllreduceAlgo::kAuto;
  };
  static thread_local Decision recent[8];
  static thread_local unsigned next_slot = 0;
  const uint64_t generation = g_options_generation.load(std::memory_order_relaxed);
  for (const Decision& d : recent)
    if (d.generation == generation && d.bytes == bytes && d.group_size == group_size && d.dtype == dtype &&
        d.shm == shm_available && d.registered == registered && d.hosts == levels.hosts &&
        d.ranks_per_host == levels.ranks_per_host && d.hierarchical_only == hierarchical_only)
      return d.algo;
  const AllreduceAlgo algo =
      select_allreduce_uncached(group_size, dtype, bytes, shm_available, registered, levels, hierarchical_only);
  recent[next_slot++ % 8] = Decision{generation,     bytes, group_size, levels.hosts, levels.ranks_per_host, dtype,
                                     shm_available, registered, hierarchical_only, algo};
  return algo;
}

double alltoall_cost_seconds(AlltoallAlgo algo, int group_size, uint64_t bytes_per_peer, const CostModel& model,
                             HostLevels levels) {
  const double p = group_size, m = static_cast<double>(bytes_per_peer);
  const double local = std::max(levels.ranks_per_host, 1), hosts = std::max(levels.hosts, 1);
  // What one host's link carries out: its L ranks' blocks for the p - L ranks elsewhere (all algorithms but
  // Bruck, which forwards blocks ~log2(p)/2 times).
  const double link_bytes = local * (p - local) * m;
  const double log_p = std::ceil(std::log2(std::max(p, 2.0)));
  switch (algo) {
    case AlltoallAlgo::kPairwise: return (p - 1) * model.inter_alpha_s + link_bytes * model.inter_beta_s_per_byte;
    case AlltoallAlgo::kBruck:
      return log_p * model.inter_alpha_s + local * log_p * (p / 2) * m * model.inter_beta_s_per_byte;
    case AlltoallAlgo::kMpi:  // unknown internals: pairwise plus a library overhead
      return 1.2 * alltoall_cost_seconds(AlltoallAlgo::kPairwise, group_size, bytes_per_peer, model, levels);
    case AlltoallAlgo::kHier:  // counts + one exchange inside the host (packing copies ~2 p m), H-1 network steps
      return 2 * model.alpha_s + 2 * p * m * model.beta_s_per_byte + (hosts - 1) * model.inter_alpha_s +
             link_bytes * model.inter_beta_s_per_byte;
    case AlltoallAlgo::kAuto: break;
  }
  return std::numeric_limits<double>::infinity();
}

AlltoallAlgo select_alltoall(AlltoallAlgo requested, int group_size, uint64_t bytes_per_peer, HostLevels levels) {
  if (requested != AlltoallAlgo::kAuto) return requested;
  if (comm_options().alltoall_algo != AlltoallAlgo::kAuto) return comm_options().alltoall_algo;
  const auto table = current_table();
  if (table) {
    if (auto name =
            table->lookup(Collective::kAlltoall, group_size, CommDType::kF32, bytes_per_peer, false, levels.hosts))
      return *alltoall_algo_from_name(*name);
  }
  if (levels.hosts > 1) {  // across hosts: the network's cost model
    const CostModel model = cost_model_with(table.get(), levels.hosts);
    AlltoallAlgo best = AlltoallAlgo::kPairwise;
    double best_cost = std::numeric_limits<double>::infinity();
    for (AlltoallAlgo algo : all_alltoall_algos()) {
      if (algo == AlltoallAlgo::kHier && !two_levels(levels)) continue;
      const double cost = alltoall_cost_seconds(algo, group_size, bytes_per_peer, model, levels);
      if (cost < best_cost) best_cost = cost, best = algo;
    }
    return best;
  }
  // Bruck moves each byte ~log2(p)/2 times but takes log2(p) steps instead of p-1: small messages only.
  return group_size > 2 && bytes_per_peer <= 1024 ? AlltoallAlgo::kBruck : AlltoallAlgo::kPairwise;
}

}  // namespace moex::comm

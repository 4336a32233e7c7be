// `moex tune-comm [--out FILE]`: measures every algorithm at each size (doubling) on this group of ranks and
// saves the fastest per (collective, group size, dtype, size) as the JSON table `auto` reads (--comm-tuning
// FILE, MOEX_COMM_TUNING, or by default comm::default_tuning_path()). Run under mpirun with each group size
// the engine will use (the TP/EP group sizes); runs merge into one file.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <span>
#include <tuple>
#include <utility>
#include <string>

#include "moex/base/error.h"
#include "moex/base/progress.h"
#include "moex/comm/communicator.h"
#include "tools/lib/measure.h"
#include "tools/lib/output_dir.h"
#include "moex/comm/selector.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct TuneCommFlags {
  std::string out;
  std::vector<std::string> dtypes = kCommDTypeNames;
  std::string max_bytes = "64M";
  int iters = 11;
  bool alltoall = true;
};

// Index of the winner (comm::pick_winner: fastest, with hysteresis against the previous size's winner);
// a wrong result (measure.h checks each algorithm once) is an internal error.
template <class Algo>
size_t checked_winner(const std::vector<comm::Measurement>& results, std::span<const Algo> algos, uint64_t bytes,
                      size_t previous) {
  for (size_t i = 0; i < algos.size(); ++i)
    MOEX_CHECK(results[i].correct, "tune-comm: ", comm::algo_name(algos[i]), " gave a wrong result at ", bytes,
               " bytes");
  return comm::pick_winner(results, previous);
}

void run_tune_comm(const TuneCommFlags& flags) {
  comm::keep_freed_memory_for_benchmarks();
  comm::Communicator& world = comm::init();
  const int p = world.size();
  const bool leader = world.rank() == 0;
  const comm::Topology& topology = world.topology();
  const int hosts = topology.hosts();
  const int local = *std::min_element(topology.ranks_per_host.begin(), topology.ranks_per_host.end());
  const bool two_levels = hosts > 1 && local > 1;
  comm::TuningTable table;
  // The link cost of each level, for the cost model (which uses it where the table has no entry): ranks of one
  // host (the intra-host groups, or the whole group on one host) and, across hosts, every local rank's pair of
  // hosts at once, as a two-level collective loads the network; per host link, so divided by those pairs.
  // (Collective: intra_host()/inter_host() are made here on every rank.)
  comm::Communicator& intra = world.intra_host();
  comm::Communicator& inter = world.inter_host();
  if (intra.size() > 1) {
    table.intra = comm::measure_link_cost(world, intra);
  } else if (hosts == 1 && p > 1) {
    table.intra = comm::measure_link_cost(world, world);
  } else {
    comm::measure_link_cost(world, intra);  // every rank takes part in the world's barriers
  }
  if (hosts > 1) {
    table.inter = comm::measure_link_cost(world, inter);
    table.inter.beta_s_per_byte /= local;
  }
  if (leader) {
    for (const auto& [name, link] : {std::pair<const char*, const comm::LinkCost&>{"intra-host", table.intra},
                                     {"inter-host", table.inter}})
      if (link.measured)
        std::printf("level %-10s alpha %8.2f us, beta %.3g ns/B (%.2f GB/s)\n", name, link.alpha_s * 1e6,
                    link.beta_s_per_byte * 1e9, link.beta_s_per_byte > 0 ? 1e-9 / link.beta_s_per_byte : 0.0);
  }
  const uint64_t max_bytes = comm::parse_byte_size(flags.max_bytes, "--max-bytes");
  // Fewer samples for large messages (each call takes milliseconds there); interleaved like bench-comm.
  auto options_for = [&](uint64_t bytes) {
    comm::MeasureOptions options;
    options.samples = comm::samples_for_size(bytes, flags.iters);
    options.min_total_ms = 20;
    return options;
  };
  // One progress line on the leader's terminal: a step is one message size of one collective.
  int steps = 0;
  const bool f32 = std::find(flags.dtypes.begin(), flags.dtypes.end(), "f32") != flags.dtypes.end();
  for (uint64_t bytes = 8; bytes <= max_bytes; bytes *= 2) steps += static_cast<int>(flags.dtypes.size()) + (f32 ? 1 : 0);
  for (uint64_t per_peer = 1; flags.alltoall && per_peer * p <= max_bytes; per_peer *= 2) ++steps;
  std::optional<Progress> progress;
  if (leader) progress.emplace("tuning collectives", steps, ProgressUnit::kItems);
  for (const std::string& name : flags.dtypes) {
    const auto dtype = comm::comm_dtype_from_name(name);
    MOEX_CHECK(dtype.has_value(), "--dtypes was checked against kCommDTypeNames: ", name);
    const size_t elem = comm::comm_dtype_buffer_size(*dtype);
    std::vector<comm::AllreduceAlgo> candidates;
    for (comm::AllreduceAlgo algo : comm::all_allreduce_algos())
      if (comm::allreduce_auto_candidate(algo, *dtype) &&
          (algo != comm::AllreduceAlgo::kShm || hosts == 1) &&  // shm needs one host
          (!comm::is_hierarchical(algo) || two_levels))         // two levels: several hosts of several ranks
        candidates.push_back(algo);
    // fp32 twice: on ordinary and on registered memory (where shm reads peers in place), since the engine's
    // TP buffers are registered and the winners differ.
    for (const bool registered : {false, true}) {
      if (registered && *dtype != comm::CommDType::kF32) continue;
      size_t previous = SIZE_MAX;
      for (uint64_t bytes = 8; bytes <= max_bytes; bytes *= 2) {
        auto options = options_for(bytes);
        options.registered = registered;
        const auto results = comm::measure_allreduce(world, candidates, *dtype, bytes / elem, options);
        const size_t best =
            checked_winner(results, std::span<const comm::AllreduceAlgo>(candidates), bytes, previous);
        previous = best;
        comm::TuningEntry entry{comm::Collective::kAllreduce, p, *dtype, bytes,
                                std::string(comm::algo_name(candidates[best])), results[best].seconds * 1e6,
                                registered, hosts};
        if (leader)
          std::printf("allreduce %-4s%s %10llu B: %-13s %10.2f us\n", name.c_str(), registered ? " registered" : "",
                      static_cast<unsigned long long>(bytes), entry.algo.c_str(), entry.time_us);
        table.add(std::move(entry));
        if (progress) progress->add(1);
      }
    }
  }
  std::vector<comm::AlltoallAlgo> alltoall_candidates;
  for (comm::AlltoallAlgo algo : comm::all_alltoall_algos())
    if (algo != comm::AlltoallAlgo::kHier || two_levels) alltoall_candidates.push_back(algo);
  size_t previous_alltoall = SIZE_MAX;
  for (uint64_t per_peer = 1; flags.alltoall && per_peer * p <= max_bytes; per_peer *= 2) {
    const auto results = comm::measure_alltoall(world, alltoall_candidates, per_peer, options_for(per_peer * p));
    const size_t best = checked_winner(results, std::span<const comm::AlltoallAlgo>(alltoall_candidates), per_peer * p,
                                       previous_alltoall);
    previous_alltoall = best;
    const std::string winner(comm::algo_name(alltoall_candidates[best]));
    table.add({comm::Collective::kAlltoall, p, comm::CommDType::kF32, per_peer, winner, results[best].seconds * 1e6,
               false, hosts});
    if (progress) progress->add(1);
    if (leader) std::printf("alltoall %10llu B/peer: %-9s %10.2f us\n", static_cast<unsigned long long>(per_peer),
                            winner.c_str(), results[best].seconds * 1e6);
  }
  if (leader) {
    // Merge: what this run measured (collective, group size, hosts, dtype) replaces the same keys in the file;
    // other group sizes, host counts and dtypes already there stay, and a level this run did not measure.
    const std::string out = flags.out.empty() ? comm::default_tuning_path() : flags.out;
    MOEX_CHECK_INPUT(!out.empty(), "tune-comm: no --out and no cache directory (set HOME or MOEX_CACHE_DIR)");
    auto key = [](const comm::TuningEntry& e) { return std::tuple(e.collective, e.group_size, e.hosts, e.dtype); };
    std::set<decltype(key(table.entries().front()))> measured;
    for (const auto& entry : table.entries()) measured.insert(key(entry));
    comm::TuningTable merged;
    if (std::ifstream(out).good()) {
      const comm::TuningTable previous = comm::TuningTable::load(out);  // named: entries() must outlive the loop
      for (const auto& entry : previous.entries())
        if (!measured.count(key(entry))) merged.add(entry);
      merged.intra = previous.intra;
      merged.inter = previous.inter;
    }
    if (table.intra.measured) merged.intra = table.intra;
    if (table.inter.measured) merged.inter = table.inter;
    for (const auto& entry : table.entries()) merged.add(entry);
    const auto dir = std::filesystem::path(out).parent_path();
    std::error_code error;
    if (!dir.empty()) std::filesystem::create_directories(dir, error);
    StagingFile staged(out, "tune-comm");  // a run cut short leaves the old table whole
    merged.save(staged.path());
    staged.publish();
    std::printf("wrote %s (%zu entries for %d ranks)\n", out.c_str(), table.entries().size(), p);
  }
}

void setup_tune_comm(CLI::App& app) {
  auto flags = std::make_shared<TuneCommFlags>();
  auto* cmd = app.add_subcommand("tune-comm", "Measure collective algorithms and save auto's tuning table");
  add_output_flag(cmd, "--out", flags->out,
                  "JSON table to write, merged with what it holds (default: the table auto reads, " +
                      comm::default_tuning_path() + ")");
  add_list_flag(cmd, "--dtypes", flags->dtypes, "Payload dtypes to tune (f32, bf16, fp8)")
      ->check(CLI::IsMember(kCommDTypeNames));
  cmd->add_option("--max-bytes", flags->max_bytes, "largest message size (64K, 16M, ...)")->capture_default_str();
  cmd->add_option("--iters", flags->iters, "timed samples per algorithm and size")->capture_default_str();
  add_quiet_flag(cmd);
  cmd->callback([flags] { run_tune_comm(*flags); });
}
MOEX_REGISTER_COMMAND(setup_tune_comm);

}  // namespace
}  // namespace moex::tools

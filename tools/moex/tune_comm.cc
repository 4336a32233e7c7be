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
  comm::TuningTable table;
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
          (algo != comm::AllreduceAlgo::kShm || world.topology().hosts() == 1))  // shm needs one host
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
                                registered};
        if (leader)
          std::printf("allreduce %-4s%s %10llu B: %-13s %10.2f us\n", name.c_str(), registered ? " registered" : "",
                      static_cast<unsigned long long>(bytes), entry.algo.c_str(), entry.time_us);
        table.add(std::move(entry));
        if (progress) progress->add(1);
      }
    }
  }
  const auto alltoall_candidates = comm::all_alltoall_algos();
  size_t previous_alltoall = SIZE_MAX;
  for (uint64_t per_peer = 1; flags.alltoall && per_peer * p <= max_bytes; per_peer *= 2) {
    const auto results = comm::measure_alltoall(world, alltoall_candidates, per_peer, options_for(per_peer * p));
    const size_t best = checked_winner(results, alltoall_candidates, per_peer * p, previous_alltoall);
    previous_alltoall = best;
    const std::string winner(comm::algo_name(alltoall_candidates[best]));
    table.add({comm::Collective::kAlltoall, p, comm::CommDType::kF32, per_peer, winner, results[best].seconds * 1e6});
    if (progress) progress->add(1);
    if (leader) std::printf("alltoall %10llu B/peer: %-9s %10.2f us\n", static_cast<unsigned long long>(per_peer),
                            winner.c_str(), results[best].seconds * 1e6);
  }
  if (leader) {
    // Merge: what this run measured (collective, group size, dtype) replaces the same keys in the file;
    // other group sizes and dtypes already there stay.
    const std::string out = flags.out.empty() ? comm::default_tuning_path() : flags.out;
    MOEX_CHECK_INPUT(!out.empty(), "tune-comm: no --out and no cache directory (set HOME or MOEX_CACHE_DIR)");
    auto key = [](const comm::TuningEntry& e) { return std::tuple(e.collective, e.group_size, e.dtype); };
    std::set<decltype(key(table.entries().front()))> measured;
    for (const auto& entry : table.entries()) measured.insert(key(entry));
    comm::TuningTable merged;
    if (std::ifstream(out).good()) {
      const comm::TuningTable previous = comm::TuningTable::load(out);  // named: entries() must outlive the loop
      for (const auto& entry : previous.entries())
        if (!measured.count(key(entry))) merged.add(entry);
    }
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

// `moex tune-comm --out FILE`: measures every algorithm at each size (doubling) on this group of ranks and
// saves the fastest per (collective, group size, dtype, size) as the JSON table `auto` reads
// (--comm-tuning FILE or MOEX_COMM_TUNING). Run under mpirun with the group size the engine will use.
#include <cstdio>
#include <string>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "moex/comm/measure.h"
#include "moex/comm/selector.h"
#include "tools/moex/command.h"

namespace moex::tools {
namespace {

struct TuneCommFlags {
  std::string out;
  std::string dtypes = "f32,bf16,fp8";
  std::string max_bytes = "64M";
  int iters = 10;
  bool alltoall = true;
};

void run_tune_comm(const TuneCommFlags& flags) {
  comm::Communicator& world = comm::init();
  const int p = world.size();
  const bool leader = world.rank() == 0;
  comm::TuningTable table;
  const uint64_t max_bytes = comm::parse_byte_size(flags.max_bytes, "--max-bytes");
  size_t pos = 0;
  while (pos <= flags.dtypes.size()) {
    const size_t comma = std::min(flags.dtypes.find(',', pos), flags.dtypes.size());
    const std::string name = flags.dtypes.substr(pos, comma - pos);
    pos = comma + 1;
    const auto dtype = comm::comm_dtype_from_name(name);
    MOEX_CHECK_INPUT(dtype.has_value(), "--dtypes: '", name, "' is not one of f32, bf16, fp8");
    const size_t elem = comm::comm_dtype_buffer_size(*dtype);
    for (uint64_t bytes = 8; bytes <= max_bytes; bytes *= 2) {
      const int iters = bytes >= (16u << 20) ? 3 : flags.iters;
      std::string best;
      double best_s = 1e300;
      for (comm::AllreduceAlgo algo : comm::all_allreduce_algos()) {
        if (algo == comm::AllreduceAlgo::kMpi && *dtype != comm::CommDType::kF32) continue;  // no compression
        const auto m = comm::measure_allreduce(world, algo, *dtype, bytes / elem, 2, iters);
        MOEX_CHECK(m.correct, "tune-comm: ", comm::algo_name(algo), " gave a wrong all-reduce at ", bytes, " bytes");
        if (m.seconds < best_s) best_s = m.seconds, best = std::string(comm::algo_name(algo));
      }
      table.add({comm::Collective::kAllreduce, p, *dtype, bytes, best, best_s * 1e6});
      if (leader) std::printf("allreduce %-4s %10llu B: %-13s %10.1f us\n", name.c_str(),
                              static_cast<unsigned long long>(bytes), best.c_str(), best_s * 1e6);
    }
  }
  for (uint64_t per_peer = 1; flags.alltoall && per_peer * p <= max_bytes; per_peer *= 2) {
    const int iters = per_peer * p >= (16u << 20) ? 3 : flags.iters;
    std::string best;
    double best_s = 1e300;
    for (comm::AlltoallAlgo algo : comm::all_alltoall_algos()) {
      const auto m = comm::measure_alltoall(world, algo, per_peer, 2, iters);
      MOEX_CHECK(m.correct, "tune-comm: ", comm::algo_name(algo), " gave a wrong all-to-all");
      if (m.seconds < best_s) best_s = m.seconds, best = std::string(comm::algo_name(algo));
    }
    table.add({comm::Collective::kAlltoall, p, comm::CommDType::kF32, per_peer, best, best_s * 1e6});
    if (leader) std::printf("alltoall %10llu B/peer: %-9s %10.1f us\n", static_cast<unsigned long long>(per_peer),
                            best.c_str(), best_s * 1e6);
  }
  if (leader) {
    // Merge: keep other group sizes already in the file, replace this one.
    comm::TuningTable merged;
    if (FILE* existing = std::fopen(flags.out.c_str(), "r")) {
      std::fclose(existing);
      for (const auto& entry : comm::TuningTable::load(flags.out).entries())
        if (entry.group_size != p) merged.add(entry);
    }
    for (const auto& entry : table.entries()) merged.add(entry);
    merged.save(flags.out);
    std::printf("wrote %s (%zu entries for %d ranks)\n", flags.out.c_str(), table.entries().size(), p);
  }
}

void setup_tune_comm(CLI::App& app) {
  auto flags = std::make_shared<TuneCommFlags>();
  auto* cmd = app.add_subcommand("tune-comm", "Measure collective algorithms and save auto's tuning table");
  cmd->add_option("--out", flags->out, "JSON table to write (merged with other group sizes)")->required();
  cmd->add_option("--dtypes", flags->dtypes, "comma list of f32, bf16, fp8")->capture_default_str();
  cmd->add_option("--max-bytes", flags->max_bytes, "largest message size (64K, 16M, ...)")->capture_default_str();
  cmd->add_option("--iters", flags->iters, "timed iterations per size")->capture_default_str();
  cmd->callback([flags] { run_tune_comm(*flags); });
}
MOEX_REGISTER_COMMAND(setup_tune_comm);

}  // namespace
}  // namespace moex::tools

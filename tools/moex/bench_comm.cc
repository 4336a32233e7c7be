// `moex bench-comm`: nccl-tests for MoEX's collectives. For each algorithm and size (doubling) it prints
// time, algbw and busbw (nccl-tests formulas), busbw as % of the peak copy bandwidth between two ranks
// measured in the same run, and auto's choice against the fastest. Every result is checked; a wrong one
// fails the run (exit 1). Run it under mpirun: mpirun -np 4 moex bench-comm.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "tools/lib/measure.h"
#include "moex/comm/selector.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct BenchCommFlags : CommFlags {
  std::string collective = "allreduce";
  std::string dtype = "f32";
  std::string algos;  // comma list; empty: all
  std::string min_bytes = "8", max_bytes = "256M";
  int iters = 15, warmup = 2;
  bool json = false;
  bool registered = false;
  std::string plot;
};

std::string human_bytes(uint64_t bytes) {
  char text[32];
  if (bytes >= (1ull << 20)) std::snprintf(text, sizeof(text), "%lluM", static_cast<unsigned long long>(bytes >> 20));
  else if (bytes >= (1ull << 10)) std::snprintf(text, sizeof(text), "%lluK", static_cast<unsigned long long>(bytes >> 10));
  else std::snprintf(text, sizeof(text), "%llu", static_cast<unsigned long long>(bytes));
  return text;
}

struct Row {
  uint64_t bytes;
  std::string algo;
  double time_us, algbw_gbps, busbw_gbps, pct_peak;
  bool correct;
  double max_error;
  uint64_t bytes_sent;
  std::string chosen;  // for auto: what ran
  int batch;           // calls per timed sample
  double vs_fastest;   // auto: time / the fastest algorithm's time at this size
  double pct_copy = 0;  // busbw / the interleaved copy's bandwidth at this size (paired by round)
  std::vector<double> round_us;  // one call's time in each round (slowest rank)
};

void write_plot(const std::string& path, const std::vector<Row>& rows, const std::vector<std::string>& algos,
                const std::string& title, double peak_gbps) {
  const std::string data_path = path + ".dat", script_path = path + ".gp";
  std::ofstream data(data_path);
  for (const auto& algo : algos) {
    data << "# " << algo << "\n";
    for (const auto& row : rows)
      if (row.algo == algo && row.bytes > 0) data << row.bytes << " " << row.busbw_gbps << "\n";
    data << "\n\n";
  }
  data.close();
  std::ofstream script(script_path);
  script << "set terminal pngcairo size 1100,650 noenhanced\nset output '" << path << "'\n"
         << "set title '" << title << "'\nset logscale x 2\nset format x '%.0b%B'\n"
         << "set xlabel 'message size (bytes)'\nset ylabel 'busbw (GB/s)'\nset key top left\nset grid\n";
  if (peak_gbps > 0) script << "set arrow from graph 0, first " << peak_gbps << " to graph 1, first " << peak_gbps
                            << " nohead dt 2\nset label 'peak copy " << peak_gbps << " GB/s' at graph 0.02, first "
                            << peak_gbps * 1.03 << "\n";
  script << "plot ";
  for (size_t i = 0; i < algos.size(); ++i)
    script << (i ? ", " : "") << "'" << data_path << "' index " << i << " using 1:2 with linespoints title '"
           << algos[i] << "'";
  script << "\n";
  script.close();
  const std::string command = "gnuplot '" + script_path + "' 2>&1";
  MOEX_CHECK_INPUT(std::system(command.c_str()) == 0, "--plot: gnuplot failed on ", script_path,
                   " (is gnuplot installed? apt-get install gnuplot-nox)");
}

void run_bench_comm(const BenchCommFlags& flags) {
  flags.CommFlags::apply();
  comm::keep_freed_memory_for_benchmarks();
  comm::Communicator& world = comm::init();
  const int p = world.size();
  const bool leader = world.rank() == 0;
  const auto collective = comm::collective_from_name(flags.collective);
  MOEX_CHECK_INPUT(collective == comm::Collective::kAllreduce || collective == comm::Collective::kAlltoall,
                   "--collective: '", flags.collective, "' is not benchmarked; use allreduce or alltoall");
  const auto dtype = comm::comm_dtype_from_name(flags.dtype);
  MOEX_CHECK_INPUT(dtype.has_value(), "--dtype: '", flags.dtype, "' is not one of f32, bf16, fp8");
  const bool is_allreduce = collective == comm::Collective::kAllreduce;
  const uint64_t min_bytes = std::max<uint64_t>(comm::parse_byte_size(flags.min_bytes, "--min-bytes"), 1);
  const uint64_t max_bytes = comm::parse_byte_size(flags.max_bytes, "--max-bytes");
  MOEX_CHECK_INPUT(min_bytes <= max_bytes, "--min-bytes must not exceed --max-bytes");
  MOEX_CHECK_INPUT(flags.iters >= 1 && flags.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");

  const comm::Topology& topology = world.topology();
  const int hosts = topology.hosts();
  const int local = *std::min_element(topology.ranks_per_host.begin(), topology.ranks_per_host.end());
  // Two-level algorithms differ from flat ones only over several hosts with several ranks on each.
  const bool two_levels = hosts > 1 && local > 1;
  std::vector<std::string> algos;
  if (flags.algos.empty()) {
    if (is_allreduce) {
      // shm only where every rank shares one host (across hosts, asking for it is an error).
      for (auto a : comm::all_allreduce_algos())
        if ((a != comm::AllreduceAlgo::kShm || hosts == 1) && (!comm::is_hierarchical(a) || two_levels))
          algos.emplace_back(comm::algo_name(a));
    } else {
      for (auto a : comm::all_alltoall_algos())
        if (a != comm::AlltoallAlgo::kHier || two_levels) algos.emplace_back(comm::algo_name(a));
    }
  } else {
    size_t pos = 0;
    while (pos <= flags.algos.size()) {
      const size_t comma = std::min(flags.algos.find(',', pos), flags.algos.size());
      algos.push_back(flags.algos.substr(pos, comma - pos));
      pos = comma + 1;
    }
    for (const auto& name : algos) {
      if (is_allreduce) comm::parse_allreduce_algo(name, "--algos");
      else comm::parse_alltoall_algo(name, "--algos");
    }
  }
  algos.erase(std::remove(algos.begin(), algos.end(), "auto"), algos.end());
  std::vector<std::string> measured = algos;
  measured.push_back("auto");

  // The peak copy: 64 MB (or --max-bytes if larger than 16 MB and smaller), best pipeline chunk.
  const uint64_t peak_bytes = std::clamp<uint64_t>(max_bytes, 16ull << 20, 64ull << 20);
  const comm::PeakCopy peak = p >= 2 ? comm::measure_peak_copy_bandwidth(world, peak_bytes) : comm::PeakCopy{};
  // Across hosts, the network: every local rank's pair of hosts exchanging at once (measure_link_cost), so the
  // rate is per host link. Collective: the host levels are made here.
  comm::LinkCost link;
  if (hosts > 1) {
    link = comm::measure_link_cost(world, world.inter_host());
    link.beta_s_per_byte /= local;
  }
  const double peak_gbps = peak.bytes_per_second / 1e9;
  const size_t elem = is_allreduce ? comm::comm_dtype_buffer_size(*dtype) : 1;
  const double bus_factor = is_allreduce ? 2.0 * (p - 1) / p : static_cast<double>(p - 1) / p;
  if (leader && !flags.json) {
    std::printf("# moex bench-comm: %s, %d ranks, dtype %s%s, %d samples per algorithm and size (fewer above 16M), "
                "algorithms interleaved sample by sample, warmup %d\n",
                flags.collective.c_str(), p, flags.dtype.c_str(), flags.registered ? ", registered buffers" : "",
                flags.iters, flags.warmup);
    std::printf("# peak copy bandwidth between two ranks (shared memory, pipelined, best of chunk 64K..4M x streaming "
                "stores or not: %s%s): %.2f GB/s\n",
                human_bytes(peak.chunk_bytes).c_str(), peak.streaming ? " streaming" : "", peak_gbps);
    if (hosts > 1) {
      std::printf("# %d hosts, %s%d ranks per host:", hosts, topology.uniform() ? "" : "at least ", local);
      for (const std::string& line : comm::describe_topology(topology)) std::printf(" [%s]", line.c_str());
      std::printf("\n# link between hosts (measured: %d pair(s) of ranks per pair of hosts exchanging 8 B and 4 MB "
                  "both ways at once): alpha %.1f us, %.2f Gbit/s per host link and direction\n",
                  local, link.alpha_s * 1e6, link.beta_s_per_byte > 0 ? 8e-9 / link.beta_s_per_byte : 0.0);
    }
    std::printf("# busbw = algbw * %s; time is one call: the slowest rank's median sample (a sample times `batch` "
                "back-to-back calls)\n",
                is_allreduce ? "2(p-1)/p" : "(p-1)/p");
    std::printf("# %%copy = busbw / the bandwidth of a two-process copy of the same bytes (rank 0 -> 1 through shared "
                "memory, pipelined, best chunk), timed interleaved with the algorithms (the 'copy' row); paired: the "
                "median over rounds of the ratio within a round\n");
    std::printf("# error: max |result - exact sum| / sum |inputs| over elements (0 for exact); auto/fastest: median "
                "over rounds of auto's time / the fastest's time in the same round\n");
    std::printf("%10s %-13s %11s %9s %9s %7s %7s %6s %8s %11s %5s %s\n", "bytes", "algo", "time(us)", "algbw",
                "busbw", "%peak", "%copy", "check", "error", "sent(B)", "batch", "note");
  }
  std::vector<Row> rows;
  auto honours = [&](comm::AllreduceAlgo algo) { return comm::allreduce_auto_candidate(algo, *dtype); };
  bool all_correct = true;
  double worst_ratio = 0;
  uint64_t worst_bytes = 0;
  int sizes = 0, within = 0;
  double shm_large_min_pct = 1e300;
  std::string shm_large_pcts;  // "16M 85%, 32M 80%, ..."
  for (uint64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const size_t count = is_allreduce ? bytes / elem : bytes / p;  // alltoall: bytes per rank, split over peers
    const uint64_t actual = is_allreduce ? count * elem : count * p;
    comm::MeasureOptions options;
    options.warmup = flags.warmup;
    options.copy_probe = true;
    options.registered = flags.registered;
    options.copy_chunk_bytes = peak.chunk_bytes;
    options.copy_streaming = peak.streaming;
    options.samples = comm::samples_for_size(bytes, flags.iters);
    // Rounds until the fastest algorithm has >= 1 s of samples (at most 101 rounds, 10 s per size): the
    // goal is a 5% comparison, and at 128-256 MB single calls vary by 15% here, so 15 rounds left the
    // median of two runs of the same code ~6% apart.
    options.min_total_ms = 1000;
    options.max_total_ms = 10000;
    std::vector<comm::Measurement> results;
    if (is_allreduce) {
      std::vector<comm::AllreduceAlgo> list;
      for (const auto& name : measured) list.push_back(*comm::allreduce_algo_from_name(name));
      // Lossy wires on random data in [-1, 1), so the error column shows the codec's error (integer test
      // data is exact in bf16 and fp8).
      results = comm::measure_allreduce(world, list, *dtype, count, options, *dtype != comm::CommDType::kF32);
    } else {
      std::vector<comm::AlltoallAlgo> list;
      for (const auto& name : measured) list.push_back(*comm::alltoall_algo_from_name(name));
      results = comm::measure_alltoall(world, list, count, options);
    }
    // Under --dtype bf16/fp8 the `mpi` row sends fp32: shown, but not a candidate for "fastest" (nor for auto).
    auto honours_dtype = [&](const std::string& name) {
      const auto algo = comm::allreduce_algo_from_name(name);  // nullopt for the copy row
      return !is_allreduce || !algo || comm::allreduce_auto_candidate(*algo, *dtype);
    };
    double fastest_us = 1e300;
    std::string fastest;
    size_t fastest_index = 0;
    for (size_t i = 0; i + 1 < measured.size(); ++i) {
      if (!honours_dtype(measured[i])) continue;
      if (results[i].seconds * 1e6 < fastest_us)
        fastest_us = results[i].seconds * 1e6, fastest = measured[i], fastest_index = i;
    }
    const bool has_copy = results.size() > measured.size();
    const double copy_gbps = has_copy && results.back().seconds > 0 ? actual / results.back().seconds / 1e9 : 0;
    for (size_t i = 0; i < results.size(); ++i) {
      const std::string name = i < measured.size() ? measured[i] : "copy";
      const comm::Measurement& m = results[i];
      Row row{actual, name, m.seconds * 1e6, 0, 0, 0, m.correct, m.max_error, m.bytes_sent, std::string(m.algorithm),
              m.batch, 0, 0, {}};
      for (double seconds : m.rounds) row.round_us.push_back(seconds * 1e6);
      row.algbw_gbps = m.seconds > 0 ? actual / m.seconds / 1e9 : 0;
      row.busbw_gbps = row.algbw_gbps * (name == "copy" ? 1.0 : bus_factor);
      row.pct_peak = peak_gbps > 0 ? 100.0 * row.busbw_gbps / peak_gbps : 0;
      // busbw / copy bandwidth = bus factor x copy time / algorithm time, paired round by round like auto/fastest.
      if (copy_gbps > 0 && m.seconds > 0)
        row.pct_copy = 100.0 * (name == "copy" ? 1.0 : bus_factor) / comm::paired_ratio(m, results.back());
      if (name == "shm" && actual >= (16u << 20) && row.pct_copy > 0) {
        shm_large_min_pct = std::min(shm_large_min_pct, row.pct_copy);
        shm_large_pcts += (shm_large_pcts.empty() ? "" : ", ") + human_bytes(actual) + " " +
                          std::to_string(static_cast<int>(row.pct_copy + 0.5)) + "%";
      }
      all_correct &= m.correct;
      if (name == "auto" && !fastest.empty()) {
        row.vs_fastest = comm::paired_ratio(m, results[fastest_index]);  // same rounds: drift cancels
        ++sizes;
        within += row.vs_fastest <= 1.05;
        if (row.vs_fastest > worst_ratio) worst_ratio = row.vs_fastest, worst_bytes = actual;
      }
      if (leader && !flags.json) {
        char note[192] = "";
        if (!honours_dtype(name)) std::snprintf(note, sizeof(note), "sends fp32: not a %s candidate", flags.dtype.c_str());
        if (name == "auto" && !fastest.empty())
          std::snprintf(note, sizeof(note), "-> %s, fastest %s %.1f us, auto/fastest %.3f", row.chosen.c_str(),
                        fastest.c_str(), fastest_us, row.vs_fastest);
        std::printf("%10s %-13s %11.2f %9.3f %9.3f %7.1f %7.1f %6s %8.1e %11llu %5d %s\n",
                    human_bytes(actual).c_str(), name.c_str(), row.time_us, row.algbw_gbps, row.busbw_gbps,
                    row.pct_peak, row.pct_copy, m.correct ? "ok" : "WRONG", m.max_error,
                    static_cast<unsigned long long>(m.bytes_sent), m.batch, note);
        std::fflush(stdout);
      }
      rows.push_back(std::move(row));
    }
  }
  if (leader && !flags.json && sizes > 0)
    std::printf("# auto within 5%% of the fastest at %d of %d sizes; worst auto/fastest %.3f at %s\n", within, sizes,
                worst_ratio, human_bytes(worst_bytes).c_str());
  if (leader && !flags.json && sizes > 0 && two_levels && is_allreduce) {
    // Flat against two-level: the best of each family per size.
    std::printf("# flat vs hierarchical (best of each, busbw GB/s):\n%10s %-14s %9s %-18s %9s %7s\n", "bytes", "flat",
                "busbw", "hierarchical", "busbw", "hier/flat");
    std::map<uint64_t, std::pair<const Row*, const Row*>> best;  // bytes -> (flat, hierarchical)
    for (const Row& row : rows) {
      const auto algo = comm::allreduce_algo_from_name(row.algo);
      if (!algo || *algo == comm::AllreduceAlgo::kAuto || !honours(*algo)) continue;
      auto& [flat, hier] = best[row.bytes];
      const Row*& slot = comm::is_hierarchical(*algo) ? hier : flat;
      if (!slot || row.time_us < slot->time_us) slot = &row;
    }
    for (const auto& [bytes, pair] : best)
      if (pair.first && pair.second)
        std::printf("%10s %-14s %9.3f %-18s %9.3f %7.2f\n", human_bytes(bytes).c_str(), pair.first->algo.c_str(),
                    pair.first->busbw_gbps, pair.second->algo.c_str(), pair.second->busbw_gbps,
                    pair.second->busbw_gbps / pair.first->busbw_gbps);
  }
  if (leader && !flags.json && !shm_large_pcts.empty())
    std::printf("# shm busbw vs the interleaved copy at >= 16M: %s (min %.1f%%)\n", shm_large_pcts.c_str(),
                shm_large_min_pct);
  if (leader && flags.json) {
    nlohmann::json results = nlohmann::json::array();
    for (const auto& row : rows)
      results.push_back({{"bytes", row.bytes}, {"algo", row.algo}, {"ran", row.chosen}, {"time_us", row.time_us},
                         {"algbw_GBps", row.algbw_gbps}, {"busbw_GBps", row.busbw_gbps}, {"pct_peak", row.pct_peak}, {"pct_copy", row.pct_copy},
                         {"correct", row.correct}, {"max_error", row.max_error}, {"bytes_sent", row.bytes_sent},
                         {"batch", row.batch}, {"auto_vs_fastest", row.vs_fastest}, {"round_us", row.round_us}});
    nlohmann::json doc = {{"collective", flags.collective}, {"ranks", p}, {"hosts", hosts}, {"dtype", flags.dtype},
                          {"link_alpha_us", link.alpha_s * 1e6},
                          {"link_Gbps", link.beta_s_per_byte > 0 ? 8e-9 / link.beta_s_per_byte : 0.0},
                          {"registered", flags.registered}, {"peak_copy_GBps", peak_gbps},
                          {"peak_copy_chunk_bytes", peak.chunk_bytes},
                          {"peak_copy_streaming", peak.streaming}, {"results", results}};
    std::printf("%s\n", doc.dump(1).c_str());
  }
  if (leader && !flags.plot.empty()) {
    char title[160];
    std::snprintf(title, sizeof(title), "moex bench-comm %s, %d ranks, %s", flags.collective.c_str(), p,
                  flags.dtype.c_str());
    std::vector<std::string> plotted = measured;
    if (std::any_of(rows.begin(), rows.end(), [](const Row& row) { return row.algo == "copy"; })) plotted.push_back("copy");
    write_plot(flags.plot, rows, plotted, title, peak_gbps);
    if (!flags.json) std::printf("# plot written to %s\n", flags.plot.c_str());
  }
  if (!all_correct) throw_error(ErrorKind::kInternal, "bench-comm: some results were WRONG (see the check column)");
}

void setup_bench_comm(CLI::App& app) {
  auto flags = std::make_shared<BenchCommFlags>();
  auto* cmd = app.add_subcommand("bench-comm", "Benchmark collective algorithms like nccl-tests (run under mpirun)");
  cmd->add_option("--collective", flags->collective, "allreduce or alltoall")->capture_default_str();
  cmd->add_option("--dtype", flags->dtype, "f32, bf16 or fp8 (all-reduce)")->capture_default_str();
  cmd->add_option("--algos", flags->algos, "comma list of algorithms (default: all)");
  cmd->add_option("--min-bytes", flags->min_bytes, "smallest size (8, 64K, 1M, ...)")->capture_default_str();
  cmd->add_option("--max-bytes", flags->max_bytes, "largest size")->capture_default_str();
  cmd->add_option("--iters", flags->iters, "timed samples per algorithm and size")->capture_default_str();
  cmd->add_option("--warmup", flags->warmup, "untimed iterations per size")->capture_default_str();
  cmd->add_flag("--json", flags->json, "print JSON instead of the table");
  cmd->add_flag("--registered", flags->registered,
                "all-reduce on registered memory (Communicator::alloc_registered; shm reads peers in place)");
  cmd->add_option("--plot", flags->plot, "write busbw vs size to this PNG (gnuplot)");
  flags->CommFlags::add_to(cmd);
  cmd->callback([flags] { run_bench_comm(*flags); });
}
MOEX_REGISTER_COMMAND(setup_bench_comm);

}  // namespace
}  // namespace moex::tools

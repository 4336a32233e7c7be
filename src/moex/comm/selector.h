// Which algorithm runs: an explicit choice (argument, --allreduce-algo flag or MOEX_COMM_ALGO) wins; else
// `auto` looks up the tuning table that `moex tune-comm` measured on this machine; else the alpha-beta
// cost model of DESIGN.md §3 decides. Every rank must decide the same, so inputs are only the group
// size and the byte count (identical on all ranks) and the table (same file).
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moex/comm/types.h"

namespace moex::comm {

// Process-wide comm settings. Tools fill this from their flags (CLI11 stays out of the library).
struct CommOptions {
  AllreduceAlgo allreduce_algo = AllreduceAlgo::kAuto;
  AlltoallAlgo alltoall_algo = AlltoallAlgo::kAuto;
  std::string tuning_path;  // JSON written by `moex tune-comm`; "none": cost model only; empty: the cost model
};

// Where `moex tune-comm` saves and `auto` looks when neither --comm-tuning nor MOEX_COMM_TUNING names a
// table: $MOEX_CACHE_DIR, else $XDG_CACHE_HOME/moex, else $HOME/.cache/moex, + "/comm-tuning.json".
std::string default_tuning_path();

// "nhr" -> kNhr; anything else throws Error(kInvalidInput) listing the valid names (exit 2).
AllreduceAlgo parse_allreduce_algo(std::string_view name, std::string_view source = "--allreduce-algo");
AlltoallAlgo parse_alltoall_algo(std::string_view name, std::string_view source = "--alltoall-algo");
// "allreduce=nhr;alltoall=pairwise" (either part optional) into options; bad keys/names throw (exit 2).
void parse_algo_spec(std::string_view spec, CommOptions* options);

// MOEX_COMM_ALGO and MOEX_COMM_TUNING first, then the flags (an empty flag
// leaves the env's choice); with no table named, default_tuning_path() if that file exists. "none" (flag or
// env) means no table.
CommOptions comm_options_from_flags(std::string_view allreduce_flag, std::string_view alltoall_flag,
                                    std::string_view tuning_flag);
// Installs the options every communicator uses from now on (loads the table; a bad file throws, exit 2).
void set_comm_options(const CommOptions& options);
const CommOptions& comm_options();

// One measured winner: for `collective` on `group_size` ranks spread over `hosts` hosts with `dtype`, at
// message size `bytes`.
struct TuningEntry {
  Collective collective = Collective::kAllreduce;
  int group_size = 0;
  CommDType dtype = CommDType::kF32;
  uint64_t bytes = 0;
  std::string algo;
  double time_us = 0;
  bool registered = false;  // measured on registered memory (Communicator::alloc_registered)
  int hosts = 1;            // hosts the group spanned (version-1 tables: 1)
};

// The cost of one message between two ranks of a level: alpha seconds + bytes * beta. `moex tune-comm` measures
// it per level (exchanges between partners inside a host, and between hosts with every local rank's pair at
// once, as a two-level collective uses the network) and saves it in its table; measured = false: not in the table.
struct LinkCost {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
  bool measured = false;
};

class TuningTable {
 public:
  // Throws Error(kInvalidInput) on a bad file. Fields it does not use (e.g. "alternates", the runners-up that
  // tables written by earlier versions list) are ignored, so old tables still load.
  static TuningTable load(const std::string& path);
  void save(const std::string& path) const;
  void add(TuningEntry entry) { entries_.push_back(std::move(entry)); }
  const std::vector<TuningEntry>& entries() const { return entries_; }
  // The winner measured at the size nearest to `bytes` (log scale) for this collective, group, dtype and
  // kind of memory; falling back to the other kind of memory, then to f32 entries; nullopt when the table
  // has nothing for the group size.
  // Entries measured over another number of hosts (`hosts`) never match: a group on 2 hosts is not timed by a
  // run on one.
  std::optional<std::string> lookup(Collective collective, int group_size, CommDType dtype, uint64_t bytes,
                                    bool registered = false, int hosts = 1) const;
  // Per-level link costs (intra: ranks of one host; inter: ranks on different hosts).
  LinkCost intra, inter;

  // The file format: 2 added `hosts` per entry and the levels. Version-1 tables load, their entries taken as
  // one host's (what tune-comm measured then); a later version is refused.
  static constexpr int kVersion = 2;

 private:
  std::vector<TuningEntry> entries_;
};

// How a group sits on hosts, as the selector needs it (the same on every rank of the group).
struct HostLevels {
  int hosts = 1;
  int ranks_per_host = 1;  // the fewest ranks of the group on one host: a two-level algorithm's slices
};

// Alpha-beta(-gamma) constants for this kind of machine (defaults measured on a 2-core shared-memory VM,
// AMD EPYC, 2 and 4 ranks; docs/comm.md "Cost model").
struct CostModel {
  double alpha_s = 4e-6;           // per message step through MPI
  double beta_s_per_byte = 2e-10;  // per byte moved (~5 GB/s)
  double gamma_s_per_byte = 1e-10; // per byte reduced (~10 GB/s of fp32 adds)
  double shm_alpha_s = 1e-6;       // one shared-memory barrier
  // shm copies each byte through the window: in, read to reduce, out (3 + 1/p passes over the buffer per
  // rank, against about one for a p2p algorithm). While a rank's buffer stays in cache a pass costs this
  // much; beyond shm_cached_max_bytes it costs beta_s_per_byte, like any byte through memory.
  double shm_cached_beta_s_per_byte = 5e-11;
  uint64_t shm_cached_max_bytes = 2 << 20;  // measured: shm falls behind from 2 MB (2 ranks) or 4 MB (4 ranks)
  // Between hosts (TCP; defaults measured between two network-namespace hosts on the same VM, unshaped veth):
  // per message step and per byte through one host's link. A table's measured levels replace these and
  // alpha_s/beta_s_per_byte (the intra-host level).
  double inter_alpha_s = 40e-6;
  double inter_beta_s_per_byte = 8e-10;  // ~1.2 GB/s
};
// Seconds for one all-reduce of `bytes` over `group_size` ranks. On one host (levels.hosts == 1) the shared-
// memory model above; across hosts every flat algorithm's steps pay the network's alpha and its bytes the
// network's beta times the ranks of a host that send through the link at once (ring: one, the others: all of a
// host's), and a two-level algorithm pays its intra-host reduce-scatter and all-gather at the intra level plus
// its flat algorithm on the hosts for a 1/L slice, with all L slices through the link at once.
double allreduce_cost_seconds(AllreduceAlgo algo, int group_size, uint64_t bytes, const CostModel& model = {},
                              HostLevels levels = {});
// Seconds for one all-to-all of `bytes_per_peer` to each rank across hosts (levels.hosts > 1): what a host's link
// carries at the network's beta, and the network's alpha per step (two-level: H-1 steps, plus one exchange
// and the packing copies inside the host).
double alltoall_cost_seconds(AlltoallAlgo algo, int group_size, uint64_t bytes_per_peer, const CostModel& model = {},
                             HostLevels levels = {});
// The defaults, with the table's measured levels (if any) for a group over several hosts. On one host the model
// keeps its constants, which were fitted to the algorithms' measured times rather than to one exchange.
CostModel cost_model_with(const TuningTable* table, int hosts);

// Whether `algo` may stand for an all-reduce of `dtype` under auto: `mpi` has no bf16/fp8 sum and sends fp32
// (2x/4x the bytes asked for), so it is a candidate for fp32 only. The tuner and the bench use the same rule.
bool allreduce_auto_candidate(AllreduceAlgo algo, CommDType dtype);

// Resolves kAuto (and the process-wide override) to a concrete algorithm.
// `bytes` is the size of the caller's buffer; shm is only chosen when all ranks share a node.
// `registered`: the buffer is registered memory (the table may hold separate winners for it).
// `levels`: the hosts the group spans; two-level algorithms are auto's candidates when it spans more than one
// host with more than one rank on each. kHier (asked for by name) resolves to the two-level algorithm whose
// inter-host algorithm the table or the cost model finds fastest.
AllreduceAlgo select_allreduce(AllreduceAlgo requested, int group_size, CommDType dtype, uint64_t bytes,
                               bool shm_available, bool registered = false, HostLevels levels = {});
// bytes_per_peer: the largest per-peer message any rank sends (all ranks must pass the same value).
AlltoallAlgo select_alltoall(AlltoallAlgo requested, int group_size, uint64_t bytes_per_peer, HostLevels levels = {});

}  // namespace moex::comm

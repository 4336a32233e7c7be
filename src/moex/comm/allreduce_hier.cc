// Hierarchical (two-level) all-reduce, as HCCL's level 0 / level 1 and NCCL's intra-/inter-node schedules:
//  1. inside each host (Communicator::intra_host), a direct reduce-scatter (the mesh's first half: every
//     rank sends each slice to its owner at once; shared memory through vader): local rank l ends with
//     slice l summed over its host;
//  2. between hosts (Communicator::inter_host: the ranks with local index l, one per host), a flat
//     all-reduce of slice l (ring, recursive doubling, Rabenseifner or NHR): the L slices of a host cross
//     the network at the same time, one per local rank, each 1/L of the buffer;
//  3. inside each host, a direct all-gather of the slices.
// Network traffic per host is the flat algorithm's on H ranks (2(H-1)/H n for the bandwidth-optimal
// ones) in 2(H-1) or 2 log H steps of network latency instead of 2(p-1) or 2 log p.
// Hosts with different rank counts: the buffer is cut into S slices, S = the fewest ranks on a host; local
// ranks from S on own nothing, so every inter-host group that carries data has one rank on every host.
// Lossy wires: each contribution is quantised once inside the host, each host's partial sum as the flat
// algorithm quantises a contribution (once, or up to ceil(log2 H) times for the log-step ones), the result
// once; slices are cut at multiples of wire_granule, so the inter-host algorithms' blocks and the final
// all-gather's re-encoding line up (every rank ends bit-identical).
#include <algorithm>
#include <vector>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_hier(MpiCommunicator& comm, AllreduceAlgo algo, float* data, size_t count, WireFormat wire) {
  const AllreduceAlgo inter_algo = inter_host_algo(algo);
  MOEX_CHECK(is_hierarchical(algo), "allreduce_hier needs a resolved two-level algorithm, got ", algo_name(algo));
  const Topology& topology = comm.topology();
  // Both levels are MpiCommunicators: split() makes them (collective on the first call, which every rank of
  // the group reaches here at the same point).
  auto& intra = static_cast<MpiCommunicator&>(comm.intra_host());
  auto& inter = static_cast<MpiCommunicator&>(comm.inter_host());
  const int slices = *std::min_element(topology.ranks_per_host.begin(), topology.ranks_per_host.end());
  const Partition parts{count, wire_granule(wire), slices};
  static thread_local std::vector<Range> owned;
  owned.assign(intra.size(), Range{});
  for (int j = 0; j < std::min(slices, intra.size()); ++j) owned[j] = {parts.begin(j), parts.size(j)};
  const Range mine = owned[intra.rank()];

  // Watchdog messages name the collective and the level (the ranks they name are the level's).
  static constexpr const char* kIntra[] = {"allreduce(hier-ring) inside a host", "allreduce(hier-rd) inside a host",
                                           "allreduce(hier-rabenseifner) inside a host",
                                           "allreduce(hier-nhr) inside a host"};
  static constexpr const char* kInter[] = {"allreduce(hier-ring) between hosts", "allreduce(hier-rd) between hosts",
                                           "allreduce(hier-rabenseifner) between hosts",
                                           "allreduce(hier-nhr) between hosts"};
  const int index = static_cast<int>(algo) - static_cast<int>(AllreduceAlgo::kHierRing);
  intra.stats() = CollectiveStats{kIntra[index]};
  inter.stats() = CollectiveStats{kInter[index]};
  if (intra.size() > 1) mesh_reduce_scatter(intra, data, owned, wire);
  if (inter.size() > 1 && mine.count > 0) {
    float* slice = data + mine.begin;
    switch (inter_algo) {
      case AllreduceAlgo::kRing: allreduce_ring(inter, slice, mine.count, wire); break;
      case AllreduceAlgo::kRecursiveDoubling: allreduce_recursive_doubling(inter, slice, mine.count, wire); break;
      case AllreduceAlgo::kRabenseifner: allreduce_rabenseifner(inter, slice, mine.count, wire); break;
      case AllreduceAlgo::kNhr: allreduce_nhr(inter, slice, mine.count, wire); break;
      default: MOEX_CHECK(false, "no inter-host algorithm ", algo_name(inter_algo));
    }
  }
  if (intra.size() > 1) mesh_allgather(intra, data, owned, wire);
  add_level_stats(comm, intra, inter);
}

void add_level_stats(MpiCommunicator& comm, const MpiCommunicator& intra, const MpiCommunicator& inter) {
  CollectiveStats& stats = comm.stats();
  for (const MpiCommunicator* level : {&intra, &inter}) {
    stats.bytes_sent += level->stats_view().bytes_sent;
    stats.bytes_received += level->stats_view().bytes_received;
    stats.wait_ns += level->stats_view().wait_ns;
  }
}

}  // namespace moex::comm::detail

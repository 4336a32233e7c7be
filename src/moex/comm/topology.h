// Which ranks of a group share a host. A host is what MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups:
// ranks that can map each other's memory (the shm algorithm, registered memory); ranks on different hosts
// talk over the network. Hierarchical collectives work in two levels over this map, as HCCL's level 0 /
// level 1 and NCCL's intra-node / inter-node rings: Communicator::intra_host() and inter_host().
// Pure data and functions (no MPI), so the map's rules are unit-tested without launching ranks.
#pragma once
#include <span>
#include <string>
#include <vector>

namespace moex::comm {

struct Topology {
  std::vector<int> host_of_rank;        // [ranks] host index of each rank of the group
  std::vector<int> local_rank;          // [ranks] index among its host's ranks of the group, in rank order
  std::vector<std::string> host_names;  // [hosts] the name its lowest rank reports (MPI_Get_processor_name)
  std::vector<int> ranks_per_host;      // [hosts]

  int ranks() const { return static_cast<int>(host_of_rank.size()); }
  int hosts() const { return static_cast<int>(host_names.size()); }
  // Every host holds the same number of ranks of the group: each inter-host group then has one rank on
  // every host, which a two-level collective needs.
  bool uniform() const;
  std::vector<int> ranks_on_host(int host) const;  // rank order
  const std::string& host_name_of(int rank) const { return host_names[host_of_rank[rank]]; }
};

// node_key[r]: equal exactly for the ranks that share rank r's host (e.g. the group rank of its node's
// lowest rank); names[r]: rank r's host name. Hosts are numbered in the order of their lowest rank, so
// host 0 holds rank 0. Two hosts may report one name (namespaces without their own hostname): the key,
// not the name, tells hosts apart.
Topology make_topology(std::span<const int> node_key, std::span<const std::string> names);

// The rank -> host map, one line per host: "host 0 moex-h0: ranks 0-1" (runs of ranks as a-b).
std::vector<std::string> describe_topology(const Topology& topology);

}  // namespace moex::comm

// Hierarchical all-to-all(v) for ranks on several hosts (H hosts, L ranks each): the data a host sends to
// another host crosses the network in L messages per host pair, one per local rank, instead of L*L.
// Per-local-rank pairing (as NCCL's PXN routes through the peer with the destination's local index):
//  1. inside each host, rank (h, l) gives local rank l' everything it sends to ranks with local index l' on
//     the other hosts, packed by host (one message), and rank (h, l')'s own block straight into its output
//     (one more message). A small exchange of counts goes first: only the sender knows them;
//  2. between hosts, in H-1 pairwise steps (step s: to host h+s, from host h-s), rank (h, l') sends
//     rank (h+s, l') one message: the blocks of all L ranks of host h for it, which lands where it belongs.
// Why not a leader per host: a leader would gather, send and scatter the whole host's traffic through one
// process (L times a rank's bytes and copies, serialised on its core), where pairing keeps every rank busy
// with 1/L of it; both send the same bytes over the network, each pair of hosts sees L messages per step
// here (one per local rank, in parallel) and 1 with a leader.
// Needs the same number of ranks on every host (each inter-host group must hold every host); on other maps it
// runs pairwise.
#include <cstring>
#include <vector>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void alltoall_hier(MpiCommunicator& comm, const AlltoallArgs& args) {
  const Topology& t = comm.topology();
  if (t.hosts() == 1 || !t.uniform() || t.ranks_per_host.front() == 1) {
    alltoall_pairwise(comm, args);  // one level: nothing to aggregate
    return;
  }
  auto& intra = static_cast<MpiCommunicator&>(comm.intra_host());
  auto& inter = static_cast<MpiCommunicator&>(comm.inter_host());
  const int hosts = t.hosts(), local = intra.size(), me = comm.rank();
  const int h = t.host_of_rank[me], l = t.local_rank[me];
  const size_t elem = args.elem_bytes;
  // rank_at[host * local + index]: the group rank of that host's index-th rank.
  static thread_local std::vector<int> rank_at;
  rank_at.assign(static_cast<size_t>(hosts) * local, 0);
  for (int r = 0; r < comm.size(); ++r) rank_at[t.host_of_rank[r] * local + t.local_rank[r]] = r;
  auto at = [&](int host, int index) { return rank_at[host * local + index]; };
  intra.stats() = CollectiveStats{"alltoall(hier) inside a host"};
  inter.stats() = CollectiveStats{"alltoall(hier) between hosts"};

  // 0. counts: what I forward through local rank j, per host (mine to j's twins on every host, my host's
  //    entry unused), and what each local rank forwards through me.
  static thread_local std::vector<uint64_t> counts_out, counts_in;  // [local * hosts]
  counts_out.assign(static_cast<size_t>(local) * hosts, 0);
  counts_in.assign(static_cast<size_t>(local) * hosts, 0);
  for (int j = 0; j < local; ++j)
    for (int g = 0; g < hosts; ++g)
      if (g != h) counts_out[j * hosts + g] = args.send_counts[at(g, j)];
  static thread_local std::vector<P2PRequest> requests;
  requests.clear();
  for (int j = 0; j < local; ++j) {
    if (j == l) continue;
    requests.push_back(intra.irecv(&counts_in[j * hosts], hosts * sizeof(uint64_t), j, 1));
    requests.push_back(intra.isend(&counts_out[j * hosts], hosts * sizeof(uint64_t), j, 1));
  }
  intra.wait_all(requests);
  requests.clear();
  for (int g = 0; g < hosts; ++g) counts_in[l * hosts + g] = counts_out[l * hosts + g];

  // 1. inside the host: packed forwards (by host order, my host left out) and the direct blocks.
  static thread_local std::vector<size_t> pack_offset, in_offset;  // [local + 1] elements
  pack_offset.assign(local + 1, 0);
  in_offset.assign(local + 1, 0);
  for (int j = 0; j < local; ++j) {
    size_t out = 0, in = 0;
    for (int g = 0; g < hosts; ++g) out += j == l ? 0 : counts_out[j * hosts + g], in += j == l ? 0 : counts_in[j * hosts + g];
    pack_offset[j + 1] = pack_offset[j] + out;
    in_offset[j + 1] = in_offset[j] + in;
  }
  auto* packed = static_cast<std::byte*>(comm.scratch(kScratchSend, pack_offset[local] * elem + 1));
  auto* forwarded = static_cast<std::byte*>(comm.scratch(kScratchRecv, in_offset[local] * elem + 1));
  for (int j = 0; j < local; ++j) {
    if (j == l) continue;
    std::byte* cursor = packed + pack_offset[j] * elem;
    for (int g = 0; g < hosts; ++g) {
      if (g == h) continue;
      const int dest = at(g, j);
      std::memcpy(cursor, args.send + args.send_offsets[dest] * elem, args.send_counts[dest] * elem);
      cursor += args.send_counts[dest] * elem;
    }
  }
  for (int j = 0; j < local; ++j) {
    const int peer = at(h, j);
    if (j == l) {
      std::memmove(args.recv + args.recv_offsets[me] * elem, args.send + args.send_offsets[me] * elem,
                   args.send_counts[me] * elem);
      continue;
    }
    if (args.recv_counts[peer])
      requests.push_back(intra.irecv(args.recv + args.recv_offsets[peer] * elem, args.recv_counts[peer] * elem, j, 2));
    if (args.send_counts[peer])
      requests.push_back(intra.isend(args.send + args.send_offsets[peer] * elem, args.send_counts[peer] * elem, j, 2));
    if (in_offset[j + 1] > in_offset[j])
      requests.push_back(intra.irecv(forwarded + in_offset[j] * elem, (in_offset[j + 1] - in_offset[j]) * elem, j, 3));
    if (pack_offset[j + 1] > pack_offset[j])
      requests.push_back(
          intra.isend(packed + pack_offset[j] * elem, (pack_offset[j + 1] - pack_offset[j]) * elem, j, 3));
  }
  intra.wait_all(requests);
  requests.clear();

  // Where local rank j's block for host g sits: my own send buffer for j == l, else in j's forward.
  auto block = [&](int j, int g) -> const std::byte* {
    if (j == l) return args.send + args.send_offsets[at(g, l)] * elem;
    size_t offset = in_offset[j];
    for (int k = 0; k < g; ++k)
      if (k != h) offset += counts_in[j * hosts + k];
    return forwarded + offset * elem;
  };
  // 2. between hosts: one message per step, the host's blocks for my twin on host h+s in local order.
  for (int s = 1; s < hosts; ++s) {
    const int to = (h + s) % hosts, from = (h + hosts - s) % hosts;
    size_t out = 0, in = 0;
    for (int j = 0; j < local; ++j) out += counts_in[j * hosts + to], in += args.recv_counts[at(from, j)];
    auto* outgoing = static_cast<std::byte*>(comm.scratch(kScratchExtra, out * elem + 1));
    std::byte* cursor = outgoing;
    for (int j = 0; j < local; ++j) {
      const size_t bytes = counts_in[j * hosts + to] * elem;
      std::memcpy(cursor, block(j, to), bytes);
      cursor += bytes;
    }
    // The blocks from host `from` land in place when they sit in my output one after another, in local order.
    bool in_place = true;
    for (int j = 0; j + 1 < local; ++j)
      in_place &= args.recv_offsets[at(from, j)] + args.recv_counts[at(from, j)] == args.recv_offsets[at(from, j + 1)];
    std::byte* incoming = in_place ? args.recv + args.recv_offsets[at(from, 0)] * elem
                                   : static_cast<std::byte*>(comm.scratch(kScratchWork, in * elem + 1));
    if (in) requests.push_back(inter.irecv(incoming, in * elem, from, 4));
    if (out) requests.push_back(inter.isend(outgoing, out * elem, to, 4));
    inter.wait_all(requests);
    requests.clear();
    if (!in_place) {
      const std::byte* next = incoming;
      for (int j = 0; j < local; ++j) {
        const int src = at(from, j);
        std::memcpy(args.recv + args.recv_offsets[src] * elem, next, args.recv_counts[src] * elem);
        next += args.recv_counts[src] * elem;
      }
    }
  }
  add_level_stats(comm, intra, inter);
}

}  // namespace moex::comm::detail

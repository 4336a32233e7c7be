// Pairwise exchange: p-1 steps; at step s rank r sends to r+s and receives from r-s, so every link
// carries one message at a time (no incast). Uneven counts need no extra set-up.
#include <cstring>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void alltoall_pairwise(MpiCommunicator& comm, const AlltoallArgs& args) {
  const int p = comm.size(), r = comm.rank();
  const size_t elem = args.elem_bytes;
  std::memmove(args.recv + args.recv_offsets[r] * elem, args.send + args.send_offsets[r] * elem,
               args.send_counts[r] * elem);
  for (int step = 1; step < p; ++step) {
    const int dest = (r + step) % p, src = (r + p - step) % p;
    P2PRequest requests[2];
    int n = 0;
    if (args.recv_counts[src])
      requests[n++] = comm.irecv(args.recv + args.recv_offsets[src] * elem, args.recv_counts[src] * elem, src, 0);
    if (args.send_counts[dest])
      requests[n++] = comm.isend(args.send + args.send_offsets[dest] * elem, args.send_counts[dest] * elem, dest, 0);
    comm.wait_all({requests, static_cast<size_t>(n)});
  }
}

}  // namespace moex::comm::detail

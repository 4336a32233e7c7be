// A plain two-process copy through the node's shared memory: the reference `moex bench-comm` holds the shm
// all-reduce against (its bus bandwidth as a share of what a copy between two ranks reaches).
#pragma once
#include <cstddef>

#include "moex/comm/communicator.h"

namespace moex::comm {

// True when `comm` can run the copy: MPI, at least two ranks, all on one node.
bool can_copy_through_shm(Communicator& comm);
// `bytes` from rank 0's private `source` to rank 1's private `target` through the shared window, pipelined in
// `chunk_bytes` pieces (rank 0 copies chunk i+1 in while rank 1 copies chunk i out). Ranks other than 0 and 1
// return at once. Collective (the window may grow); nothing when !can_copy_through_shm(comm).
// With `streaming`, rank 1 copies out with non-temporal stores (AVX-512 only).
void copy_through_shm(Communicator& comm, const std::byte* source, std::byte* target, size_t bytes,
                      size_t chunk_bytes, bool streaming);
struct CopyBandwidth {
  double bytes_per_second = 0;
  size_t chunk_bytes = 0;
  bool streaming = false;
};
// Best of `iters` copies of `bytes` at each chunk size from 64 KB to 4 MB, with and without streaming stores
// (the same on every rank); zero when !can_copy_through_shm(comm).
CopyBandwidth measure_copy_through_shm(Communicator& comm, size_t bytes, int iters);

}  // namespace moex::comm

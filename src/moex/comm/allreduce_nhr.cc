// NHR as DESIGN.md §3 fixes it: for any p, K = ceil(log2 p) reduce-scatter steps and K all-gather steps;
// at step k a rank sends to (r - 2^k) mod p and receives from (r + 2^k) mod p; 2(p-1)n/p bytes in all.
//
// Block schedule. The buffer is cut into p blocks; block b ends on rank b. Let m_k = min(2^k, p - 2^k),
// the number of blocks moved at step k (sum over k of m_k = p - 1, hence (p-1)n/p bytes per half).
//  - All-gather, k = 0 .. K-1 (Bruck): rank r holds blocks r .. r+2^k-1; it sends the first m_k of them,
//    blocks [r, r+m_k), to r-2^k and receives blocks [r+2^k, r+2^k+m_k) from r+2^k.
//  - Reduce-scatter, k = K-1 .. 0: the transpose of that all-gather, mirrored (b -> -b) so that data
//    still flows to r-2^k: rank r sends its partial sums of blocks {r-2^k-i : 0 <= i < m_k} to r-2^k and
//    adds what r+2^k sends for blocks {r-i : 0 <= i < m_k}. Block b's partials flow up the same spanning
//    tree the all-gather uses to spread block b, reversed, so each contribution arrives exactly once.
//  The send and receive sets of one step never overlap (2^k >= m_k and 2^k + m_k <= p).
//  Example p = 5 (K = 3, m = 1, 2, 1): RS k=2 sends block r+1 to r+1; k=1 sends {r-2, r-3} to r-2;
//  k=0 sends {r-1} to r-1. AG k=0 sends {r} to r-1; k=1 {r, r+1} to r-2; k=2 {r} to r-4 = r+1.
#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_nhr(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  int steps = 0;
  while ((1 << steps) < p) ++steps;
  const Partition blocks{count, wire_granule(wire), p};
  auto wrap = [&](int block) { return ((block % p) + p) % p; };
  Range send[2], recv[2];

  for (int k = steps - 1; k >= 0; --k) {
    const int distance = 1 << k, moved = std::min(distance, p - distance);
    const int n_send = cyclic_ranges(blocks, wrap(r - distance - moved + 1), moved, send);
    const int n_recv = cyclic_ranges(blocks, wrap(r - moved + 1), moved, recv);
    exchange(comm, wire, data, {send, static_cast<size_t>(n_send)}, wrap(r - distance),
             {recv, static_cast<size_t>(n_recv)}, wrap(r + distance), /*add=*/true);
  }
  if (!wire_is_lossless(wire)) wire_round_trip(wire, data + blocks.begin(r), blocks.size(r));
  for (int k = 0; k < steps; ++k) {
    const int distance = 1 << k, moved = std::min(distance, p - distance);
    const int n_send = cyclic_ranges(blocks, r, moved, send);
    const int n_recv = cyclic_ranges(blocks, wrap(r + distance), moved, recv);
    exchange(comm, wire, data, {send, static_cast<size_t>(n_send)}, wrap(r - distance),
             {recv, static_cast<size_t>(n_recv)}, wrap(r + distance), /*add=*/false);
  }
}

}  // namespace moex::comm::detail

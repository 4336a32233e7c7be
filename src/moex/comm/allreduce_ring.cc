// Ring all-reduce: p-1 reduce-scatter steps then p-1 all-gather steps, each moving n/p to the next rank.
// Lossy wire formats (bf16, fp8) would re-quantise the running partial sum at every hop, so the error
// would grow with p; for them the reduce-scatter half instead sends each rank's own contribution straight
// to the chunk's owner (step s: to rank r+s) - the same p-1 steps and (p-1)n/p bytes, one quantisation
// per contribution. The all-gather half forwards the owner's encoded chunk around the ring unchanged.
#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_ring(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  const Partition chunks{count, wire_granule(wire), p};
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  auto chunk = [&](int index) { return Range{chunks.begin((index % p + p) % p), chunks.size((index % p + p) % p)}; };

  int owned;  // the chunk this rank holds fully reduced after the reduce-scatter
  if (wire_is_lossless(wire)) {
    for (int step = 0; step < p - 1; ++step) {
      const Range send = chunk(r - step), recv = chunk(r - step - 1);
      exchange(comm, wire, data, {&send, 1}, next, {&recv, 1}, prev, /*add=*/true);
    }
    owned = (r + 1) % p;
  } else {
    for (int step = 1; step < p; ++step) {
      const Range send = chunk(r + step), recv = chunk(r);
      exchange(comm, wire, data, {&send, 1}, (r + step) % p, {&recv, 1}, (r + p - step) % p, /*add=*/true);
    }
    owned = r;
    const Range mine = chunk(owned);
    wire_round_trip(wire, data + mine.begin, mine.count);
  }
  for (int step = 0; step < p - 1; ++step) {
    const Range send = chunk(owned - step), recv = chunk(owned - step - 1);
    exchange(comm, wire, data, {&send, 1}, next, {&recv, 1}, prev, /*add=*/false);
  }
}

}  // namespace moex::comm::detail

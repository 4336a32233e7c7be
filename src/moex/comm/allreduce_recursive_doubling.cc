// Recursive doubling: log2(p) steps, each exchanging the whole buffer with rank r ^ 2^k and adding.
// Not a power of two: the first 2*rem ranks fold in pairs (even sends all to odd) before, and unfold after.
// Lossy wire: both partners add decode(encode(own)) + decode(encode(peer)), so they stay bit-identical.
#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_recursive_doubling(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  const int rem = p - pof2;
  const Range all{0, count};
  const std::span<const Range> whole{&all, 1}, none{};
  const bool lossy = !wire_is_lossless(wire);

  int new_rank;  // rank among the pof2 ranks that take part in the doubling, -1 when folded away
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      exchange(comm, wire, data, whole, r + 1, none, -1, true);
      new_rank = -1;
    } else {
      exchange(comm, wire, data, none, -1, whole, r - 1, true);
      new_rank = r / 2;
    }
  } else {
    new_rank = r - rem;
  }
  if (new_rank >= 0) {
    for (int mask = 1; mask < pof2; mask <<= 1) {
      const int partner_new = new_rank ^ mask;
      const int partner = partner_new < rem ? partner_new * 2 + 1 : partner_new + rem;
      if (lossy) wire_round_trip(wire, data, count);
      exchange(comm, wire, data, whole, partner, whole, partner, true);
    }
    if (lossy) wire_round_trip(wire, data, count);  // what the folded-away partner will receive
  }
  if (r < 2 * rem) {
    if (r % 2 == 1) {
      exchange(comm, wire, data, whole, r - 1, none, -1, false);
    } else {
      exchange(comm, wire, data, none, -1, whole, r + 1, false);
    }
  }
}

}  // namespace moex::comm::detail

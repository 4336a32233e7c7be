// Recursive doubling: log2(p) steps, each exchanging the whole buffer with rank r ^ 2^k and adding.
// Not a power of two: the first 2*rem ranks fold in pairs (even sends all to odd) before, and unfold after.
// Lossy wire: both partners add decode(encode(own)) + decode(encode(peer)), so they stay bit-identical.
#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_recursive_doubling(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const PowerOfTwoFold fold = fold_to_power_of_two(comm, wire, data, count);
  const Range all{0, count};
  const std::span<const Range> whole{&all, 1};
  const bool lossy = !wire_is_lossless(wire);
  if (fold.new_rank >= 0) {
    for (int mask = 1; mask < fold.pof2; mask <<= 1) {
      const int partner = fold.real_rank(fold.new_rank ^ mask);
      if (lossy) wire_round_trip(wire, data, count);
      exchange(comm, wire, data, whole, partner, whole, partner, true);
    }
    if (lossy) wire_round_trip(wire, data, count);  // what the folded-away partner will receive
  }
  unfold_from_power_of_two(comm, fold, wire, data, count);
}

}  // namespace moex::comm::detail

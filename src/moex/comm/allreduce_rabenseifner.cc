// Rabenseifner: recursive-halving reduce-scatter then recursive-doubling all-gather, 2 log2(p) steps and
// 2(p-1)n/p bytes. Not a power of two: the first 2*rem ranks fold in pairs first (even sends its whole
// buffer to odd: the extra step of DESIGN.md §3) and the odd ones send the result back at the end.
#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_rabenseifner(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const PowerOfTwoFold fold = fold_to_power_of_two(comm, wire, data, count);
  const int pof2 = fold.pof2, new_rank = fold.new_rank;
  if (new_rank >= 0) {
    const Partition chunks{count, wire_granule(wire), pof2};
    auto span_of = [&](int lo, int hi) { return Range{chunks.begin(lo), chunks.begin(hi) - chunks.begin(lo)}; };
    int lo = 0, hi = pof2;  // chunk window this rank is still responsible for
    for (int distance = pof2 / 2; distance >= 1; distance /= 2) {
      const int partner = fold.real_rank(new_rank ^ distance), mid = lo + (hi - lo) / 2;
      const bool keep_low = (new_rank & distance) == 0;
      const Range send = keep_low ? span_of(mid, hi) : span_of(lo, mid);
      const Range keep = keep_low ? span_of(lo, mid) : span_of(mid, hi);
      exchange(comm, wire, data, {&send, 1}, partner, {&keep, 1}, partner, true);
      (keep_low ? hi : lo) = mid;
    }
    const Range mine = span_of(lo, hi);  // chunk new_rank, fully reduced
    if (!wire_is_lossless(wire)) wire_round_trip(wire, data + mine.begin, mine.count);
    for (int distance = 1; distance < pof2; distance *= 2) {
      const int partner = fold.real_rank(new_rank ^ distance), width = hi - lo;
      const bool partner_above = (new_rank & distance) == 0;
      const Range send = span_of(lo, hi);
      const Range recv = partner_above ? span_of(hi, hi + width) : span_of(lo - width, lo);
      exchange(comm, wire, data, {&send, 1}, partner, {&recv, 1}, partner, false);
      (partner_above ? hi : lo) = partner_above ? hi + width : lo - width;
    }
  }
  unfold_from_power_of_two(comm, fold, wire, data, count);
}

}  // namespace moex::comm::detail

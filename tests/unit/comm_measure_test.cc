// The tuning table's winner rule (comm::pick_winner), which tune-comm applies size by size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tools/lib/measure.h"

namespace moex::comm {
namespace {

Measurement timed(std::vector<double> rounds) {
  Measurement m;
  m.rounds = rounds;
  std::sort(rounds.begin(), rounds.end());
  m.seconds = rounds[rounds.size() / 2];
  return m;
}

TEST(CommMeasure, PickWinnerKeepsThePreviousWinnerUnlessBeatenByTheMargin) {
  // b is 2% faster than a in every round.
  const std::vector<Measurement> close = {timed({1.00, 1.00, 1.00}), timed({0.98, 0.98, 0.98})};
  EXPECT_EQ(pick_winner(close, SIZE_MAX), 1u);  // no previous winner: the fastest
  EXPECT_EQ(pick_winner(close, 0), 0u);         // 2% is inside the 3% margin: a stays
  EXPECT_EQ(pick_winner(close, 0, 1.01), 1u);   // a tighter margin switches
  // c beats a by 25% in every round: it takes over.
  const std::vector<Measurement> far = {timed({1.0, 1.0, 1.0}), timed({0.95, 0.95, 0.95}), timed({0.8, 0.8, 0.8})};
  EXPECT_EQ(pick_winner(far, 0), 2u);
  EXPECT_EQ(pick_winner(far, 2), 2u);
  // The margin is judged paired: a drifting machine (round 2 twice as slow for everyone) does not matter.
  const std::vector<Measurement> drift = {timed({1.0, 2.0, 1.0}), timed({0.8, 1.6, 0.8})};
  EXPECT_EQ(pick_winner(drift, 0), 1u);
  EXPECT_EQ(pick_winner(drift, 1), 1u);
  // A previous index beyond the candidates (the list changed) is ignored.
  EXPECT_EQ(pick_winner(close, 7), 1u);
}

}  // namespace
}  // namespace moex::comm

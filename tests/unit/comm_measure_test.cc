// The tuning table's winner rule (comm::pick_winner) and its close runners-up, which tune-comm applies size by size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moex/comm/measure.h"

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

TEST(CommMeasure, CloseRunnersUpAreTheAlgorithmsWithinTheMarginClosestFirst) {
  // Paired ratios to the winner (index 1): a 1.10, c 1.25, d 1.50, e 1.02.
  const std::vector<Measurement> results = {timed({1.10, 2.20, 1.10}), timed({1.0, 2.0, 1.0}),
                                            timed({1.25, 2.50, 1.25}), timed({1.5, 3.0, 1.5}),
                                            timed({1.02, 2.04, 1.02})};
  EXPECT_EQ(close_runners_up(results, 1), (std::vector<size_t>{4, 0, 2, 3}));
  EXPECT_EQ(close_runners_up(results, 1, 2.0, 3), (std::vector<size_t>{4, 0, 2}));
  EXPECT_EQ(close_runners_up(results, 1, 1.2), (std::vector<size_t>{4, 0}));
  EXPECT_EQ(close_runners_up(results, 1, 1.3, 1), (std::vector<size_t>{4}));
  // A winner kept by hysteresis has the faster algorithm as a runner-up (ratio below 1).
  EXPECT_EQ(close_runners_up(results, 4, 1.01), (std::vector<size_t>{1}));
}

}  // namespace
}  // namespace moex::comm

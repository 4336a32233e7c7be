// base/progress.h: the line's text and the redraw throttle (the terminal itself is not tested).
#include "moex/base/progress.h"

#include <gtest/gtest.h>

namespace moex {
namespace {

TEST(Progress, BytesLineHasDoneTotalRateAndTimeLeft) {
  // 400 MB of 1.6 GB in 2 s: 200 MB/s, 1.2 GB left = 6 s.
  EXPECT_EQ(progress_line("packing", 400e6, 1.6e9, ProgressUnit::kBytes, 2.0),
            "packing: 400 MB of 1.60 GB (25%), 200 MB/s, 6s left");
}

TEST(Progress, FinishedLineGivesElapsedTimeNotTimeLeft) {
  EXPECT_EQ(progress_line("quantizing", 3e9, 3e9, ProgressUnit::kBytes, 75.0),
            "quantizing: 3.00 GB of 3.00 GB (100%), 40 MB/s, 1m15s");
}

TEST(Progress, NoRateBeforeAnyTimeOrWork) {
  EXPECT_EQ(progress_line("x", 0, 10, ProgressUnit::kItems, 0.0), "x: 0 of 10 (0%)");
  EXPECT_EQ(progress_line("x", 0, 10, ProgressUnit::kItems, 5.0), "x: 0 of 10 (0%)");
}

TEST(Progress, ItemsAndLongTimesLeft) {
  // 3 of 1000 tensors in 9 s: 0.3/s, 997 left at 1/3 s each = 2991 s = 49m51s.
  EXPECT_EQ(progress_line("tensors", 3, 1000, ProgressUnit::kItems, 9.0), "tensors: 3 of 1000 (0%), 0.3/s, 49m51s left");
  EXPECT_EQ(progress_line("tensors", 1, 10000, ProgressUnit::kItems, 1.0), "tensors: 1 of 10000 (0%), 1.0/s, 2h46m left");
  EXPECT_EQ(progress_line("b", 500, 2000, ProgressUnit::kBytes, 1.0), "b: 500 B of 2 kB (25%), 500 B/s, 3s left");
}

TEST(Progress, ThrottleDrawsAtMostOncePerIntervalAndAlwaysTheLastUpdate) {
  ProgressThrottle t(0.125);  // times in binary fractions: the comparisons are exact
  EXPECT_TRUE(t.due(10.0, false));      // the first update draws
  EXPECT_FALSE(t.due(10.0625, false));  // 62.5 ms later: too soon
  EXPECT_FALSE(t.due(10.1171875, false));
  EXPECT_TRUE(t.due(10.125, false));    // 125 ms after the last draw
  EXPECT_TRUE(t.due(10.1328125, true));  // the last update always draws
  EXPECT_FALSE(t.due(10.1875, false));  // ... and counts as a draw
  int draws = 0;
  for (int ms = 0; ms < 1000; ++ms) draws += ProgressThrottle(0.1).due(ms / 1000.0, false);
  EXPECT_EQ(draws, 1000);  // a fresh throttle per call always draws: the state is the throttle's
  ProgressThrottle one(0.1);
  draws = 0;
  for (int ms = 0; ms < 1000; ++ms) draws += one.due(20 + ms / 1000.0, false);
  EXPECT_EQ(draws, 10);  // one second of updates every millisecond: 10 draws
}

TEST(Progress, QuietOrNotATerminalPrintsNothing) {
  set_progress_quiet(true);
  EXPECT_FALSE(progress_enabled());
  Progress p("x", 10);
  EXPECT_FALSE(p.enabled());
  p.add(10);  // no output, no crash
  set_progress_quiet(false);
}

}  // namespace
}  // namespace moex

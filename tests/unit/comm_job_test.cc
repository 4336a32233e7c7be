// comm/job: the line a job prints when its ranks' descriptions differ.
#include "moex/comm/job.h"

#include <gtest/gtest.h>

namespace moex::comm {
namespace {

TEST(CommJob, FirstDifferenceNamesTheValueThenTheOrderThenTheCount) {
  const Description zero = {{"--seed", "1"}, {"tensor a", "f32 [2]"}, {"tensor b", "f32 [3]"}};
  EXPECT_EQ(first_difference(1, zero, zero), "");
  EXPECT_EQ(first_difference(1, {{"--seed", "2"}, {"tensor a", "f32 [2]"}, {"tensor b", "f32 [3]"}}, zero),
            "rank 1 differs from rank 0: --seed is 2, rank 0 has 1");
  EXPECT_EQ(first_difference(2, {{"--seed", "1"}, {"tensor a", "f32 [2]"}}, zero),
            "rank 2 differs from rank 0: tensor b is (not set), rank 0 has f32 [3]");
  // The same items in another order: the line must still say what differs (it was empty).
  EXPECT_EQ(first_difference(1, {{"--seed", "1"}, {"tensor b", "f32 [3]"}, {"tensor a", "f32 [2]"}}, zero),
            "rank 1 differs from rank 0 in order: its item 2 is tensor b, rank 0's is tensor a");
  EXPECT_EQ(first_difference(1, {{"--seed", "1"}, {"tensor a", "f32 [2]"}, {"tensor b", "f32 [3]"}, {"tensor a", "f32 [2]"}},
                             zero),
            "rank 1 differs from rank 0: 4 items, rank 0 has 3");
}

}  // namespace
}  // namespace moex::comm

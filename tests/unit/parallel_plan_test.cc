#include <gtest/gtest.h>

#include <string>

#include "moex/base/error.h"
#include "moex/moe/parallel_plan.h"

namespace moex {
namespace {

const PlanShape kTiny{4, 2, 8, 128};  // heads, KV heads, experts, intermediate

std::string refusal(const PlanRequest& request, const PlanShape& shape, int world) {
  try {
    make_parallel_plan(request, shape, world, 0);
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    return e.what();
  }
  return "";
}

TEST(ParallelPlan, RefusesWhatTheModelCannotTake) {
  EXPECT_NE(refusal({"ep", "dp"}, kTiny, 3).find("8 experts cannot be split evenly over 3 EP ranks"), std::string::npos);
  EXPECT_NE(refusal({"tp", "tp"}, kTiny, 8).find("4 attention heads cannot be split over 8 ranks"), std::string::npos);
  EXPECT_NE(refusal({"tpxep", "tp", 2, 2}, kTiny, 2).find("must equal the number of ranks"), std::string::npos);
  EXPECT_NE(refusal({"tp", "dp"}, kTiny, 2).find("--attn-parallel dp needs --moe-parallel ep"), std::string::npos);
  EXPECT_NE(refusal({"tp", "tp", 0, 0, "fp16"}, kTiny, 2).find("--comm-dtype"), std::string::npos);
  EXPECT_NE(refusal({"xp"}, kTiny, 2).find("valid: tp, ep, tpxep"), std::string::npos);
}

TEST(ParallelPlan, HybridSplitsExpertsAndSlices) {
  // tp=2 x ep=2 on 4 ranks: rank = ep_rank * tp + tp_rank.
  for (int rank = 0; rank < 4; ++rank) {
    const ParallelPlan p = make_parallel_plan({"tpxep", "tp", 2, 2}, kTiny, 4, rank);
    EXPECT_EQ(local_experts(p, 8).first, (rank / 2) * 4);
    EXPECT_EQ(local_experts(p, 8).count, 4);
    EXPECT_EQ(local_intermediate(p, 128).begin, (rank % 2) * 64);
    EXPECT_EQ(local_intermediate(p, 128).end, (rank % 2) * 64 + 64);
    // Attention TP over all 4 ranks: one query head each; 2 KV heads, each replicated on 2 ranks.
    EXPECT_EQ(local_heads(p, 4).begin, rank);
    EXPECT_EQ(local_kv_heads(p, 4, 2).begin, rank / 2);
    EXPECT_EQ(local_kv_heads(p, 4, 2).end, rank / 2 + 1);
  }
}

TEST(ParallelPlan, DataParallelAttentionKeepsAllHeads) {
  const ParallelPlan p = make_parallel_plan({"ep", "dp"}, kTiny, 2, 1);
  EXPECT_EQ(local_heads(p, 4).end - local_heads(p, 4).begin, 4);
  EXPECT_EQ(local_kv_heads(p, 4, 2).end - local_kv_heads(p, 4, 2).begin, 2);
  EXPECT_EQ(local_experts(p, 8).first, 4);
}

}  // namespace
}  // namespace moex

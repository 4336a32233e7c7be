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
  EXPECT_NE(refusal({"xp"}, kTiny, 2).find("valid: auto, tp, ep, tpxep"), std::string::npos);
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

namespace moex {
namespace {
comm::Topology hosts_of(std::vector<int> node_key) {
  std::vector<std::string> names(node_key.size(), "h");
  return comm::make_topology(node_key, names);
}
}  // namespace

TEST(ParallelPlan, AutoIsTensorParallelOnOneHost) {
  const comm::Topology one = hosts_of({0, 0, 0, 0});
  const ParallelPlan p = make_parallel_plan({}, kTiny, 4, 1, &one);
  EXPECT_EQ(p.moe, MoEParallel::kTP);
  EXPECT_EQ(p.tp, 4);
  EXPECT_EQ(make_parallel_plan({}, kTiny, 4, 1).moe, MoEParallel::kTP);  // no map: one host
}

TEST(ParallelPlan, AutoAcrossHostsIsTensorInsideAndExpertAcross) {
  const comm::Topology two_by_two = hosts_of({0, 0, 2, 2});
  for (int rank = 0; rank < 4; ++rank) {
    const ParallelPlan p = make_parallel_plan({}, kTiny, 4, rank, &two_by_two);
    EXPECT_EQ(p.moe, MoEParallel::kTPxEP);
    EXPECT_EQ(p.tp, 2);
    EXPECT_EQ(p.ep, 2);
    // A TP group (the partners of every expert's all-reduce) is one host's ranks.
    EXPECT_EQ(two_by_two.host_of_rank[rank], p.ep_rank());
  }
  const comm::Topology two_by_one = hosts_of({0, 1});
  const ParallelPlan ep = make_parallel_plan({}, kTiny, 2, 1, &two_by_one);
  EXPECT_EQ(ep.moe, MoEParallel::kEP);
  EXPECT_EQ(ep.ep, 2);
}

TEST(ParallelPlan, AutoFallsBackToTensorParallelWhereTheHybridDoesNotFit) {
  const comm::Topology interleaved = hosts_of({0, 1, 0, 1});  // a TP group would span both hosts
  EXPECT_EQ(make_parallel_plan({}, kTiny, 4, 0, &interleaved).moe, MoEParallel::kTP);
  const comm::Topology uneven = hosts_of({0, 0, 0, 3});
  EXPECT_EQ(make_parallel_plan({}, kTiny, 4, 0, &uneven).moe, MoEParallel::kTP);
  const PlanShape three_experts{kTiny.heads, kTiny.kv_heads, 3, kTiny.intermediate};
  const comm::Topology two_by_two = hosts_of({0, 0, 2, 2});
  EXPECT_EQ(make_parallel_plan({}, three_experts, 4, 0, &two_by_two).moe, MoEParallel::kTP);
  // Sizes given with auto: the hybrid with those sizes.
  const ParallelPlan given = make_parallel_plan({"auto", "tp", 1, 4}, kTiny, 4, 0, &two_by_two);
  EXPECT_EQ(given.moe, MoEParallel::kTPxEP);
  EXPECT_EQ(given.ep, 4);
}

TEST(ParallelPlan, AutoWithDataParallelAttentionIsExpertParallel) {
  const ParallelPlan p = make_parallel_plan({"auto", "dp"}, kTiny, 2, 0);
  EXPECT_EQ(p.moe, MoEParallel::kEP);
  EXPECT_EQ(p.ep, 2);
}

}  // namespace moex

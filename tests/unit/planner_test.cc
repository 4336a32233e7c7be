// tools/lib/planner: its sums checked against counts made elsewhere (ModelConfig::active_params_per_token,
// the selector's cost model, the probability of a routing), and its cluster files' errors.
#include "tools/lib/planner.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "moex/base/error.h"
#include "moex/comm/selector.h"
#include "tools/lib/synthetic.h"

namespace moex::tools::plan {
namespace {

nlohmann::json fig(double v) { return {{"value", v}, {"source", "test"}}; }

// A device that is bound by its memory only (peaks far beyond anything), no per-call cost.
nlohmann::json memory_bound_cluster(int devices) {
  return {{"name", "test"},
          {"hosts", 1},
          {"devices_per_host", devices},
          {"device",
           {{"memory_GB", fig(1000)}, {"read_GBps", fig(100)}, {"bf16_TFLOPS", fig(1e9)}, {"int8_TOPS", fig(1e9)},
            {"f32_TFLOPS", fig(1e9)}}},
          {"links", {{"intra_host", {{"latency_us", fig(5)}, {"bandwidth_GBps", fig(10)}}}}}};
}

// EP=4 over mixtral-8x7b's 8 experts (2 a rank) on a memory-bound host of 2 cores: at one token the busiest rank
// runs 2 experts with probability 1/7, else 1; all ranks together run 2, 1 per core.
struct EpFourOnTwoCores {
  ModelConfig m = synthetic_preset("mixtral-8x7b");
  nlohmann::json j = memory_bound_cluster(4);
  PlanChoice ep;
  double expert_s = 0;  // one expert's read time over all layers
  EpFourOnTwoCores() {
    j["cores_per_host"] = 2;
    ep.moe = "ep", ep.ep = 4;
    expert_s = 3.0 * m.hidden_size * m.intermediate_size * 2 / 100e9 * m.num_hidden_layers;
  }
};

TEST(Planner, OneRankDecodeReadsTheActiveWeightsOnce) {
  const ModelConfig m = synthetic_preset("mixtral-8x7b");
  const Cluster c = parse_cluster(memory_bound_cluster(1), "test");
  PlanChoice p;  // bf16, one rank
  const Workload w{1, 1};
  const Prediction r = predict(m, c, p, 1, w);
  // One token reads every weight it uses once: config.cc's count, less the norms and the embedding row (a lookup,
  // not a matmul), in bf16; plus its one position of KV per layer.
  const double d = m.hidden_size, L = m.num_hidden_layers;
  const double params = double(m.active_params_per_token()) - d /*embedding row*/ - d /*final norm*/ - 2 * d * L;
  const double kv = L * 2 * m.kv_dim() * 2.0;
  const double expected = (params * 2 + kv) / 100e9;
  EXPECT_NEAR(r.step_s, expected, expected * 1e-9);
  EXPECT_EQ(r.comm_s, 0);
  EXPECT_TRUE(r.collectives.empty());
  EXPECT_NEAR(r.tokens_per_s, 1 / expected, 1e-6 / expected);
}

TEST(Planner, AFormatsOwnEfficiencyScalesItsReads) {
  const ModelConfig m = synthetic_preset("mixtral-8x7b");
  nlohmann::json j = memory_bound_cluster(1);
  const Prediction all = predict(m, parse_cluster(j, "t"), PlanChoice{}, 1, Workload{1, 1});
  j["device"]["format_efficiency"] = {{"bf16", {{"memory", fig(0.5)}, {"compute", fig(1)}}},
                                      {"int8", {{"memory", fig(0.25)}, {"compute", fig(1)}}}};
  const Prediction half = predict(m, parse_cluster(j, "t"), PlanChoice{}, 1, Workload{1, 1});
  // Every matmul reads at half the rate; the router (as stored) and the KV cache keep theirs.
  const double router_and_kv = m.num_hidden_layers * (m.num_local_experts * m.hidden_size * 2.0 + 2 * m.kv_dim() * 2.0) / 100e9;
  EXPECT_NEAR(half.step_s - router_and_kv, 2 * (all.step_s - router_and_kv), 1e-12);
}

TEST(Planner, TensorParallelSendsTwoAllReducesPerLayerPricedByTheSelectorModel) {
  const ModelConfig m = synthetic_preset("mixtral-8x7b");
  const Cluster c = parse_cluster(memory_bound_cluster(2), "test");
  PlanChoice p;
  p.tp = 2;
  const Prediction r = predict(m, c, p, 2, Workload{16, 64});
  ASSERT_EQ(r.collectives.size(), 2u);
  comm::CostModel model;
  model.alpha_s = 5e-6, model.beta_s_per_byte = 1 / 10e9, model.gamma_s_per_byte = 1 / 10e9;
  const uint64_t bytes = 16 * 4096 * 4;
  double best = 1e30;
  for (comm::AllreduceAlgo a : comm::all_allreduce_algos())
    if (a != comm::AllreduceAlgo::kShm && !comm::is_hierarchical(a)) best = std::min(best, comm::allreduce_cost_seconds(a, 2, bytes, model));
  for (const CollectiveCost& col : r.collectives) {
    EXPECT_EQ(col.per_step, m.num_hidden_layers);
    EXPECT_NEAR(col.seconds, best, best * 1e-12);
    EXPECT_DOUBLE_EQ(col.bytes, double(bytes));
  }
  EXPECT_NEAR(r.comm_s, 2 * m.num_hidden_layers * best, 1e-12);
  // Every algorithm but recursive doubling sends 2 (p - 1) / p of the buffer: with p = 2, the buffer once.
  EXPECT_NEAR(r.wire_bytes_per_token, 2.0 * m.num_hidden_layers * bytes / 16, 1e-6);
}

TEST(Planner, AGroupOverHostsIsPricedWithBothLevels) {
  const ModelConfig m = synthetic_preset("mixtral-8x7b");
  nlohmann::json j = memory_bound_cluster(2);
  j["hosts"] = 2;
  j["links"]["inter_host"] = {{"latency_us", fig(50)}, {"bandwidth_GBps", fig(1)}};
  const Cluster c = parse_cluster(j, "test");
  PlanChoice p;
  p.tp = 4;
  const Prediction r = predict(m, c, p, 4, Workload{16, 64});
  comm::CostModel model;
  model.alpha_s = 5e-6, model.beta_s_per_byte = 1 / 10e9, model.gamma_s_per_byte = 1 / 10e9;
  model.shm_alpha_s = 1e30;
  model.inter_alpha_s = 50e-6, model.inter_beta_s_per_byte = 1 / 1e9;
  const comm::HostLevels levels{2, 2};
  // The algorithm is the one `auto` picks without a tuning table, by comm::CostModel's defaults (selector.cc), and
  // it is priced with the file's links.
  comm::CostModel defaults;
  defaults.shm_alpha_s = 1e30;
  double best = 1e30, cost = 0;
  comm::AllreduceAlgo pick = comm::AllreduceAlgo::kRing;
  for (comm::AllreduceAlgo a : comm::all_allreduce_algos()) {
    if (a == comm::AllreduceAlgo::kShm || !comm::allreduce_auto_candidate(a, comm::CommDType::kF32)) continue;
    const double s = comm::allreduce_cost_seconds(a, 4, 16 * 4096 * 4, defaults, levels);
    if (s < best) best = s, pick = a;
  }
  cost = comm::allreduce_cost_seconds(pick, 4, 16 * 4096 * 4, model, levels);
  ASSERT_EQ(r.collectives.size(), 2u);
  EXPECT_TRUE(r.collectives[0].crosses_hosts);
  EXPECT_EQ(r.collectives[0].algorithm, std::string(comm::algo_name(pick)));
  EXPECT_NEAR(r.collectives[0].seconds, cost, cost * 1e-12);
  // Two ranks fit one host: nothing crosses.
  PlanChoice two;
  two.tp = 2;
  EXPECT_FALSE(predict(m, c, two, 2, Workload{16, 64}).collectives[0].crosses_hosts);
}

// Two hosts of one device each, joined by an inter-host link of that latency and bandwidth.
nlohmann::json two_hosts_of_one_rank(double latency_us, double bandwidth_GBps) {
  nlohmann::json j = memory_bound_cluster(1);
  j["hosts"] = 2;
  j["links"]["inter_host"] = {{"latency_us", fig(latency_us)}, {"bandwidth_GBps", fig(bandwidth_GBps)}};
  return j;
}

TEST(Planner, AShapedLinksBucketRefillsWhileTheRanksCompute) {
  // TP=2 over 2 hosts of one rank: every all-reduce crosses the link. A bucket that holds a whole call's bytes and
  // refills within the compute before it takes each call's bytes off the rate; a bucket of half of them half.
  const ModelConfig m = synthetic_preset("mini");
  nlohmann::json j = two_hosts_of_one_rank(50, 10);
  PlanChoice p;
  p.tp = 2;
  const Workload w{16, 64};
  const Prediction plain = predict(m, parse_cluster(j, "t"), p, 2, w);
  ASSERT_EQ(plain.collectives.size(), 2u);
  const double link = plain.collectives[0].link_bytes;  // 16 x 1024 f32, sent once each way by either algorithm
  EXPECT_NEAR(link, 16 * 1024 * 4, 1e-9);
  j["links"]["inter_host"]["burst_KB"] = fig(1e3);  // 1 MB; a segment (>= 50 us here) refills 500 KB at 10 GB/s
  const Prediction full = predict(m, parse_cluster(j, "t"), p, 2, w);
  const double calls = 2.0 * m.num_hidden_layers;
  EXPECT_NEAR(plain.comm_s - full.comm_s, calls * link / 1e10, 1e-12);
  j["links"]["inter_host"]["burst_KB"] = fig(link / 2 / 1e3);
  EXPECT_NEAR(plain.comm_s - predict(m, parse_cluster(j, "t"), p, 2, w).comm_s, calls * link / 2 / 1e10, 1e-12);
  EXPECT_NEAR(full.step_s, plain.step_s - calls * link / 1e10, 1e-12);
  // What a call leaves in the bucket carries over to the next: a bucket of two calls' bytes that the experts'
  // long segment refills whole passes the attention all-reduce after it too, though the short attention segment
  // before that call refills only a quarter of one.
  const double attention = plain.attention_s / m.num_hidden_layers, experts = plain.experts_s / m.num_hidden_layers;
  ASSERT_GT(experts, 8 * attention);
  const double rate = link / (4 * attention);  // bytes per second
  j["links"]["inter_host"]["bandwidth_GBps"] = fig(rate / 1e9);
  j["links"]["inter_host"].erase("burst_KB");
  const Prediction slow = predict(m, parse_cluster(j, "t"), p, 2, w);
  j["links"]["inter_host"]["burst_KB"] = fig(2 * link / 1e3);
  const Prediction carried = predict(m, parse_cluster(j, "t"), p, 2, w);
  EXPECT_NEAR(slow.comm_s - carried.comm_s, calls * link / rate, 1e-9 * calls * link / rate);
}

TEST(Planner, DataParallelAttentionSendsEveryRanksLogitsToRankZero) {
  // EP=2 dp-attn at batch 5 over 2 hosts of one rank: rank 1 holds 2 sequences and sends their f32 logit rows to
  // rank 0 through the link after its forward; the step pays it, the comm share (collectives) does not count it.
  const ModelConfig m = synthetic_preset("mini");
  const nlohmann::json j = two_hosts_of_one_rank(50, 1);
  PlanChoice dp;
  dp.moe = "ep", dp.attn = "dp", dp.ep = 2;
  const Prediction r = predict(m, parse_cluster(j, "t"), dp, 2, Workload{5, 64});
  EXPECT_NEAR(r.logits_s, 50e-6 + 2.0 * m.vocab_size * 4 / 1e9, 1e-12);
  EXPECT_NEAR(r.step_s, r.attention_s + r.routing_s + r.experts_s + r.other_s + r.comm_s + r.logits_s, 1e-12);
  EXPECT_NEAR(r.comm_share, (r.comm_s + r.wait_s) / r.step_s, 1e-12);
  PlanChoice tp;
  tp.tp = 2;
  EXPECT_EQ(predict(m, parse_cluster(j, "t"), tp, 2, Workload{5, 64}).logits_s, 0);  // rank 0 samples every row
}

TEST(Planner, DataParallelAttentionPricesEveryAllToAllTheEngineRunsWithTheAlgorithmAutoPicks) {
  // One host of 4 ranks, EP=4 dp-attn, a model of hidden size 256: a row is 1 KB in f32. Per MoE layer the engine
  // exchanges the counts (2 experts' int32 per peer and the sender's largest block), the rows and their outputs,
  // with no agreement on the largest block (every rank knows it from the counts). Without a table `auto` picks
  // Bruck above 2 ranks at <= 1 KB per peer on one host (selector.cc), pairwise above that.
  ModelConfig m = synthetic_preset("mini");
  m.hidden_size = 256, m.head_dim = 256 / m.num_attention_heads;
  const Cluster c = parse_cluster(memory_bound_cluster(4), "t");  // 5 us, 10 GB/s
  PlanChoice dp;
  dp.moe = "ep", dp.attn = "dp", dp.ep = 4;
  const auto find = [](const Prediction& r, const std::string& what) {
    for (const CollectiveCost& col : r.collectives)
      if (col.what == what) return col;
    ADD_FAILURE() << "no " << what;
    return CollectiveCost{};
  };
  const comm::HostLevels one_host{1, 4};
  const Prediction one = predict(m, c, dp, 4, Workload{1, 64});
  const CollectiveCost counts = find(one, "counts all-to-all"), rows = find(one, "dispatch all-to-all");
  EXPECT_EQ(counts.algorithm, std::string(comm::algo_name(comm::select_alltoall(comm::AlltoallAlgo::kAuto, 4, 12, one_host))));
  EXPECT_EQ(counts.algorithm, "bruck");
  EXPECT_NEAR(counts.seconds, 2 * (5e-6 + 2 * 12 / 10e9), 1e-15);  // log2(4) rounds of ~4/2 blocks
  EXPECT_EQ(counts.per_step, m.num_hidden_layers);
  // Batch 1: one token's 2 rows among 4 ranks, half a row per peer on average; auto chooses by the largest, a row.
  EXPECT_EQ(rows.algorithm, std::string(comm::algo_name(comm::select_alltoall(comm::AlltoallAlgo::kAuto, 4, 1024, one_host))));
  EXPECT_EQ(rows.algorithm, "bruck");
  EXPECT_NEAR(rows.seconds, 2 * (5e-6 + 2 * 512 / 10e9), 1e-15);
  EXPECT_EQ(one.collectives.size(), 3u);  // counts, rows, outputs: nothing agrees on a size
  // An engine that agreed on the largest block before each: an 8-byte all-reduce each, and counts without it.
  const Prediction agreeing = predict(m, c, dp, 4, Workload{1, 64, true});
  EXPECT_EQ(find(agreeing, "all-to-all size agreement").per_step, 3 * m.num_hidden_layers);
  EXPECT_NEAR(find(agreeing, "counts all-to-all").seconds, 2 * (5e-6 + 2 * 8 / 10e9), 1e-15);
  // Batch 16: 4 sequences a rank, 8 rows, 2 (2 KB) per peer: pairwise, 3 rounds of one block.
  const CollectiveCost big = find(predict(m, c, dp, 4, Workload{16, 64}), "dispatch all-to-all");
  EXPECT_EQ(big.algorithm, "pairwise");
  EXPECT_NEAR(big.seconds, 3 * (5e-6 + 2 * 1024 / 10e9), 1e-15);
}

TEST(Planner, ExpertParallelWaitsForTheBusiestRank) {
  // One token, top-2 of 8 experts, 4 experts per rank on 2 ranks: both on one rank with probability 3/7, so
  // the busiest rank runs 2 x 3/7 + 1 x 4/7 = 10/7 experts against a mean of 1.
  const ModelConfig m = synthetic_preset("mixtral-8x7b");
  const Cluster c = parse_cluster(memory_bound_cluster(2), "test");
  PlanChoice p;
  p.moe = "ep", p.ep = 2;
  const Prediction r = predict(m, c, p, 2, Workload{1, 1});
  EXPECT_NEAR(r.expert_imbalance, 10.0 / 7, 0.03);
  PlanChoice tp;
  tp.tp = 2;
  EXPECT_DOUBLE_EQ(predict(m, c, tp, 2, Workload{1, 1}).expert_imbalance, 1.0);
}

TEST(Planner, RankZeroWaitsForTheBusiestExpertGroupInsideTheCollective) {
  // As above: the busiest rank runs 10/7 experts, rank 0 (like any rank) 1 on average, so its profiler sees 3/7 of
  // an expert per MoE layer inside the collective that waits for the busiest; the step itself is the busiest's.
  const ModelConfig m = synthetic_preset("mixtral-8x7b");
  const Cluster c = parse_cluster(memory_bound_cluster(2), "test");
  PlanChoice p;
  p.moe = "ep", p.ep = 2;
  const Prediction r = predict(m, c, p, 2, Workload{1, 1});
  const double expert = 3.0 * m.hidden_size * m.intermediate_size * 2 / 100e9;
  EXPECT_NEAR(r.wait_s, 3.0 / 7 * expert * m.num_hidden_layers, 0.03 * expert * m.num_hidden_layers);
  EXPECT_NEAR(r.comm_share, (r.comm_s + r.wait_s) / r.step_s, 1e-12);
  EXPECT_NEAR(r.wire_share, r.comm_s / r.step_s, 1e-12);
  PlanChoice tp;
  tp.tp = 2;
  EXPECT_EQ(predict(m, c, tp, 2, Workload{1, 1}).wait_s, 0);  // every TP rank does the same work
}

TEST(Planner, AKernelTableCostsEachOutputRowAndEachWeight) {
  KernelTable t;
  t.tokens = {1, 4};
  t.per_weight_s = {0.1e-9, 0.2e-9};
  t.per_row_s = {100e-9, 160e-9};
  EXPECT_NEAR(t.seconds(1, 4096, 1024), 4096 * 100e-9 + 4096 * 1024 * 0.1e-9, 1e-15);
  // Same weights, four times the rows: four times the row term.
  EXPECT_NEAR(t.seconds(1, 16384, 256) - t.seconds(1, 4096, 1024), 12288 * 100e-9, 1e-15);
  EXPECT_NEAR(t.seconds(2, 1, 0), 120e-9, 1e-18);  // linear between the points
  EXPECT_NEAR(t.seconds(7, 1, 0), 220e-9, 1e-18);  // and beyond the last, from the last two
  // A cluster file's table prices its format's matmuls (the router, as stored, keeps the rates).
  const ModelConfig m = synthetic_preset("mini");
  nlohmann::json j = memory_bound_cluster(1);
  const Prediction rates = predict(m, parse_cluster(j, "t"), PlanChoice{}, 1, Workload{1, 1});
  j["device"]["kernel_tables"] = {{"bf16", {{"source", "test"}, {"points", {{{"tokens", 1}, {"per_weight_ns", 0.02}, {"per_row_ns", 0}}}}}}};
  const Prediction table = predict(m, parse_cluster(j, "t"), PlanChoice{}, 1, Workload{1, 1});
  EXPECT_NEAR(table.other_s, rates.other_s, 1e-15);  // 0.02 ns a bf16 weight is 100 GB/s: the read rate
  j["device"]["kernel_tables"]["bf16"]["points"][0]["per_weight_ns"] = 0.04;
  EXPECT_NEAR(predict(m, parse_cluster(j, "t"), PlanChoice{}, 1, Workload{1, 1}).other_s, 2 * rates.other_s, 1e-12);
  j["device"]["kernel_tables"]["bf16"]["points"][0].erase("per_row_ns");
  EXPECT_THROW(parse_cluster(j, "t"), Error);
}

// A wait table for a time-sharing point: {segment_us, wait_us} pairs.
nlohmann::json wait_table(const std::vector<std::pair<double, double>>& points) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [segment, wait] : points) list.push_back({{"segment_us", segment}, {"wait_us", wait}});
  return {{"points", list}, {"source", "test"}};
}

TEST(Planner, RanksBeyondTheCoresTakeTheMeasuredSlowdown) {
  const ModelConfig m = synthetic_preset("mini");
  nlohmann::json j = memory_bound_cluster(4);
  j["cores_per_host"] = 2;
  PlanChoice p;
  p.tp = 4;
  const Prediction plain = predict(m, parse_cluster(j, "t"), p, 4, Workload{1, 1});
  EXPECT_DOUBLE_EQ(plain.time_share, 2.0);  // no measured point: the cores' share alone, no wait
  EXPECT_EQ(plain.wait_s, 0);
  j["time_sharing"] = {{{"ranks_per_core", fig(2)}, {"slowdown", fig(1.1)}}};
  const Prediction shared = predict(m, parse_cluster(j, "t"), p, 4, Workload{1, 1});
  EXPECT_DOUBLE_EQ(shared.time_share, 2.2);
  const double compute = shared.attention_s + shared.routing_s + shared.experts_s + shared.other_s;
  EXPECT_NEAR(compute, 1.1 * (plain.attention_s + plain.routing_s + plain.experts_s + plain.other_s), 1e-12);
  EXPECT_EQ(shared.wait_s, 0);  // a point without a wait table: no wait
  PlanChoice two;
  two.tp = 2;  // 2 ranks on 2 cores: no sharing
  EXPECT_DOUBLE_EQ(predict(m, parse_cluster(j, "t"), two, 2, Workload{1, 1}).time_share, 1.0);
  j["cores_per_host"] = 4;
  j["time_sharing"] = {{{"ranks_per_core", fig(0.5)}, {"slowdown", fig(1.3)}},
                       {{"ranks_per_core", fig(2)}, {"slowdown", fig(1.1)}}};
  // A point at or below one rank per core (a loaded machine) replaces (1, 1, 0): 2 ranks on 4 cores take it.
  EXPECT_DOUBLE_EQ(predict(m, parse_cluster(j, "t"), two, 2, Workload{1, 1}).time_share, 1.3);
  EXPECT_NEAR(predict(m, parse_cluster(j, "t"), p, 4, Workload{1, 1}).time_share, 1.3 + (1.1 - 1.3) / 3, 1e-12);  // linear
  j["time_sharing"][1]["ranks_per_core"] = fig(0.4);  // not increasing
  EXPECT_THROW(parse_cluster(j, "t"), Error);
}

TEST(Planner, BeyondTheCoresTheBusiestRankRunsWhileTheOthersYield) {
  // 1 expert per core over all ranks at one token: the busiest's own time (8/7 experts) binds, not twice it.
  EpFourOnTwoCores s;
  const ModelConfig& m = s.m;
  nlohmann::json& j = s.j;
  const PlanChoice& ep = s.ep;
  const Prediction r = predict(m, parse_cluster(j, "t"), ep, 4, Workload{1, 1});
  EXPECT_NEAR(r.experts_s, 8.0 / 7 * s.expert_s, 0.03 * s.expert_s);
  // TP: every rank does the same work, 2 ranks a core: twice one rank's.
  PlanChoice tp;
  tp.tp = 4;
  j["cores_per_host"] = 4;
  const Prediction alone = predict(m, parse_cluster(j, "t"), tp, 4, Workload{1, 1});
  j["cores_per_host"] = 2;
  EXPECT_NEAR(predict(m, parse_cluster(j, "t"), tp, 4, Workload{1, 1}).experts_s, 2 * alone.experts_s, 1e-12);
  // dp attention at batch 1: one rank attends, alone on a core as with 4 cores.
  PlanChoice dp = ep;
  dp.attn = "dp";
  const Prediction shared = predict(m, parse_cluster(j, "t"), dp, 4, Workload{1, 64});
  j["cores_per_host"] = 4;
  EXPECT_NEAR(shared.attention_s, predict(m, parse_cluster(j, "t"), dp, 4, Workload{1, 64}).attention_s, 1e-12);
}

TEST(Planner, TheBusiestRankOfUnequalWorkTakesTheMeasuredSlowdownOfComputingWhileOthersWait) {
  // With waiting ranks that do not free the core, the busiest's own time takes busy_slowdown; the equal-share
  // bound (all work over the cores, times slowdown) stays the floor.
  EpFourOnTwoCores s;
  const ModelConfig& m = s.m;
  nlohmann::json& j = s.j;
  const PlanChoice& ep = s.ep;
  const double expert = s.expert_s;
  j["time_sharing"] = {{{"ranks_per_core", fig(2)}, {"slowdown", fig(1.1)}}};
  // Without busy_slowdown the file's slowdown: max(busiest, 1 expert) x 1.1.
  EXPECT_NEAR(predict(m, parse_cluster(j, "t"), ep, 4, Workload{1, 1}).experts_s, 1.1 * 8.0 / 7 * expert, 0.03 * expert);
  j["time_sharing"][0]["busy_slowdown"] = fig(1.6);
  const Prediction slow = predict(m, parse_cluster(j, "t"), ep, 4, Workload{1, 1});
  EXPECT_NEAR(slow.experts_s, 1.6 * 8.0 / 7 * expert, 0.05 * expert);  // 1,000 sampled routings
  // Rank 0 waits for the busiest: its own mean share (half an expert a rank, times 2 x 1.1) below that.
  EXPECT_NEAR(slow.imbalance_wait_s, slow.experts_s - 0.5 * 2.2 * expert, 1e-9);
  j["time_sharing"][0]["busy_slowdown"] = fig(0.5);  // below the equal share: that bound binds
  EXPECT_NEAR(predict(m, parse_cluster(j, "t"), ep, 4, Workload{1, 1}).experts_s, 1.1 * expert, 0.03 * expert);
  j["time_sharing"][0]["busy_slowdown"] = fig(0);
  EXPECT_THROW(parse_cluster(j, "t"), Error);
}

TEST(Planner, EachCollectiveWaitsWhatTheTableGivesForTheSegmentBeforeIt) {
  const ModelConfig m = synthetic_preset("mini");  // 8 layers, all MoE
  nlohmann::json j = memory_bound_cluster(2);
  j["cores_per_host"] = 2;
  // A wait independent of the segment: every collective of the step waits it once.
  // (A slowdown of 1.25: a quarter of a rank's compute is time off its core, room for the waits below.)
  j["time_sharing"] = {{{"ranks_per_core", fig(1)}, {"slowdown", fig(1.25)}, {"wait", wait_table({{1e9, 50}})}}};
  PlanChoice tp;
  tp.tp = 2;
  const Prediction r = predict(m, parse_cluster(j, "t"), tp, 2, Workload{16, 64});
  EXPECT_NEAR(r.wait_s, 50e-6 * 16, 1e-12);  // an attention and a MoE all-reduce per layer
  PlanChoice dp;
  dp.moe = "ep", dp.attn = "dp", dp.ep = 2;
  const Prediction d = predict(m, parse_cluster(j, "t"), dp, 2, Workload{16, 64});
  // Per MoE layer: counts, dispatch; experts; combine (moe_layer.cc: the largest block travels with the counts).
  EXPECT_NEAR(d.wait_s - d.imbalance_wait_s, 50e-6 * 3 * 8, 1e-12);
  // The dispatch follows the counts with no compute between: nothing overlaps its wait, the step pays it.
  EXPECT_NEAR(d.step_s, d.attention_s + d.routing_s + d.experts_s + d.other_s + d.comm_s + d.logits_s + 50e-6 * 1 * 8,
              1e-12);
  // An engine that agreed on the largest block before each all-to-all: agree, counts, agree, dispatch; experts;
  // agree, combine, four of them back to back.
  const Prediction agreeing = predict(m, parse_cluster(j, "t"), dp, 2, Workload{16, 64, true});
  EXPECT_NEAR(agreeing.wait_s - agreeing.imbalance_wait_s, 50e-6 * 6 * 8, 1e-12);
  EXPECT_NEAR(agreeing.step_s, agreeing.attention_s + agreeing.routing_s + agreeing.experts_s + agreeing.other_s +
                                   agreeing.comm_s + agreeing.logits_s + 50e-6 * 4 * 8,
              1e-12);
  EXPECT_GT(agreeing.step_s - d.step_s, 50e-6 * 3 * 8);  // the three waits and the agreements' own wire time
  EXPECT_EQ(predict(m, parse_cluster(j, "t"), PlanChoice{}, 1, Workload{16, 64}).wait_s, 0);  // nothing to wait for
  // The collective's own time beyond the wire under sharing (excess_us) is step time as well as comm time.
  j["time_sharing"][0]["wait"]["points"][0]["excess_us"] = 30;
  const Prediction ex = predict(m, parse_cluster(j, "t"), tp, 2, Workload{16, 64});
  EXPECT_NEAR(ex.wait_s, 80e-6 * 16, 1e-12);
  EXPECT_NEAR(ex.step_s - r.step_s, 30e-6 * 16, 1e-12);
  j["time_sharing"][0]["wait"]["points"][0].erase("excess_us");
  // Between two measured segment lengths the wait is linear in the segment: here 10% of each one's CPU time, so
  // 10% of all the compute's, which the segments add up to (TP: every rank's experts are the busiest's).
  j["time_sharing"][0]["wait"] = wait_table({{1, 0.1}, {1e9, 1e8}});
  const Prediction share = predict(m, parse_cluster(j, "t"), tp, 2, Workload{16, 64});
  const double compute = share.attention_s + share.routing_s + share.experts_s + share.other_s;
  EXPECT_NEAR(share.wait_s, 0.1 * compute / 1.25, 1e-9);
  // A wait the step cannot hold (measured in a busier minute than the slowdown) stops at the step less the rank's
  // own CPU time: the share is at most the time the rank is off its core or on the wire.
  j["time_sharing"][0]["wait"] = wait_table({{1, 10}, {1e9, 1e10}});
  const Prediction over = predict(m, parse_cluster(j, "t"), tp, 2, Workload{16, 64});
  EXPECT_NEAR(over.wait_s, over.step_s - over.comm_s - compute / 1.25, 1e-9);
  EXPECT_LT(over.comm_share, 1.0);
  // Between two segment lengths, linear; outside them, the nearest one's.
  Cluster::TimeSharing t;
  t.segment_s = {1e-3, 3e-3};
  t.wait_s = {10e-6, 30e-6};
  EXPECT_NEAR(t.wait(2e-3), 20e-6, 1e-15);
  EXPECT_NEAR(t.wait(0.5e-3), 10e-6, 1e-15);
  EXPECT_NEAR(t.wait(6e-3), 30e-6, 1e-15);  // above the longest, the longest's: a wait is bounded by the scheduler
  // Between two ranks-per-core points, linear at the same segment: 3 ranks on 2 cores, halfway from 1 to 2.
  j["devices_per_host"] = 4;
  j["time_sharing"] = {{{"ranks_per_core", fig(1)}, {"slowdown", fig(1)}, {"wait", wait_table({{1e9, 0}})}},
                       {{"ranks_per_core", fig(2)}, {"slowdown", fig(1)}, {"wait", wait_table({{1e9, 100}})}}};
  PlanChoice four;
  four.tp = 4;
  const Prediction half = predict(m, parse_cluster(j, "t"), four, 4, Workload{1, 1});
  j["cores_per_host"] = 3;  // 4 ranks on 3 cores: 4/3 ranks per core, a third of the way
  EXPECT_NEAR(predict(m, parse_cluster(j, "t"), four, 4, Workload{1, 1}).wait_s, 100e-6 / 3 * 16, 1e-12);
  EXPECT_NEAR(half.wait_s, 100e-6 * 16, 1e-12);  // 4 ranks on 2 cores: the point at 2
  // The old single share is refused with what to do; a table needs increasing segments.
  j["time_sharing"][0]["wait_share"] = fig(0.1);
  EXPECT_THROW(parse_cluster(j, "t"), Error);
  j["time_sharing"][0].erase("wait_share");
  j["time_sharing"][0]["wait"] = wait_table({{2, 0}, {1, 0}});
  EXPECT_THROW(parse_cluster(j, "t"), Error);
}

// A recorded run of scripts/plan-validate.sh on this machine (tests/plan/*.json: mini-validation.json on one host,
// mini-cluster-*.json across the namespace hosts of scripts/cluster.sh; each has the cluster file it calibrated,
// every plan's measured decode tokens/s and comm share, the CPU, the date and the load), predicted again: each
// prediction must stay within the error the recording states (docs/plan.md, "Validation"). Pure computation; a
// change to the model that moves a prediction beyond it fails here.
void check_recording(const std::filesystem::path& path) {
  SCOPED_TRACE(path.filename().string());
  std::ifstream in(path);
  ASSERT_TRUE(in.good());
  const nlohmann::json rec = nlohmann::json::parse(in);
  const ModelConfig m = synthetic_preset(rec.at("model_preset").get<std::string>());
  // The checkpoint the run measured has the preset's geometry.
  for (const auto& [key, value] : rec.at("model_config").items()) {
    const int v = value.get<int>();
    const int preset = key == "hidden_size" ? m.hidden_size : key == "intermediate_size" ? m.intermediate_size
                     : key == "num_hidden_layers" ? m.num_hidden_layers : key == "num_attention_heads" ? m.num_attention_heads
                     : key == "num_key_value_heads" ? m.num_key_value_heads : key == "num_local_experts" ? m.num_local_experts
                     : key == "num_experts_per_tok" ? m.num_experts_per_tok : key == "vocab_size" ? m.vocab_size
                     : key == "head_dim" ? m.head_dim : -1;
    EXPECT_EQ(preset, v) << key;
  }
  const Cluster recorded = parse_cluster(rec.at("cluster"), "recorded");
  const double rate_tol = rec.at("tolerance").at("tokens_per_s").get<double>();
  const double share_tol = rec.at("tolerance").at("comm_share").get<double>();
  ASSERT_FALSE(rec.at("rows").empty());
  for (const nlohmann::json& row : rec.at("rows")) {
    const int ranks = row.at("ranks").get<int>(), batch = row.at("batch").get<int>();
    // Across hosts a row says how many of its ranks each host held (the planner fills a host before the next).
    // Each batch's own time-sharing probe (its step's all-reduce size) where the recording has one.
    Cluster c = rec.contains("cluster_by_batch") ? parse_cluster(rec.at("cluster_by_batch").at(std::to_string(batch)), "recorded")
                                                 : recorded;
    if (row.contains("devices_per_host")) c.devices_per_host = row.at("devices_per_host").get<int>();
    const std::string name = row.at("plan").get<std::string>(), dtype = row.at("comm_dtype").get<std::string>();
    bool found = false;
    for (const PlanChoice& p : candidate_plans(m, ranks, "as-stored", dtype)) {
      if (p.name() != name) continue;
      found = true;
      // Each row's own context (its run's decode positions) where the recording has one, else the run's.
      const int context = row.contains("context") ? row.at("context").get<int>() : rec.at("context").get<int>();
      // The engine the run measured: recordings before moe_layer.cc sent the largest block with the counts have no
      // "dispatch_collectives_per_moe_layer" and ran six (docs/plan.md).
      const bool agreeing = rec.value("dispatch_collectives_per_moe_layer", 6) == 6;
      const Prediction r = predict(m, c, p, ranks, Workload{batch, context, agreeing});
      const std::string what = name + " " + dtype + " batch " + std::to_string(batch);
      EXPECT_NEAR(r.tokens_per_s / row.at("tokens_per_s").get<double>(), 1.0, rate_tol) << what;
      EXPECT_NEAR(r.comm_share, row.at("comm_share").get<double>(), share_tol) << what;
    }
    EXPECT_TRUE(found) << name << " is no candidate plan at " << ranks << " ranks";
  }
}

TEST(Planner, PredictsTheRecordedMeasurementsWithinTheStatedError) {
  int recordings = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(MOEX_SOURCE_DIR) + "/tests/plan"))
    if (entry.path().extension() == ".json") check_recording(entry.path()), ++recordings;
  EXPECT_GE(recordings, 1);
}

TEST(Planner, CandidatePlansAreTheOnesTheEngineAccepts) {
  const ModelConfig m = synthetic_preset("mixtral-8x7b");  // 32 heads, 8 KV heads, 8 experts
  std::vector<std::string> names;
  for (const PlanChoice& p : candidate_plans(m, 4, "bf16", "f32")) names.push_back(p.name());
  EXPECT_EQ(names, (std::vector<std::string>{"TP=4", "EP=4", "EP=4 dp-attn", "TP=2 x EP=2"}));
  EXPECT_EQ(candidate_plans(m, 3, "bf16", "f32").size(), 0u);  // 8 experts and 32 heads do not split 3 ways
  EXPECT_THROW(candidate_plans(m, 2, "int3", "f32"), Error);
}

TEST(Planner, ClusterFileErrorsNameTheField) {
  nlohmann::json j = memory_bound_cluster(1);
  j["device"]["read_GBps"].erase("source");
  try {
    parse_cluster(j, "f.json");
    FAIL() << "a figure without a source was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device.read_GBps"), std::string::npos) << e.what();
  }
  j = memory_bound_cluster(1);
  j["hosts"] = 2;  // two hosts need an inter-host link
  EXPECT_THROW(parse_cluster(j, "f.json"), Error);
  j = memory_bound_cluster(1);
  j["device"]["memory_efficiency"] = fig(1.5);
  EXPECT_THROW(parse_cluster(j, "f.json"), Error);
  j = memory_bound_cluster(1);
  j["device"]["format_efficiency"] = {{"int3", {{"memory", fig(0.5)}, {"compute", fig(0.5)}}}};
  EXPECT_THROW(parse_cluster(j, "f.json"), Error);
  const Cluster c = parse_cluster(memory_bound_cluster(2), "t");
  PlanChoice p;
  p.tp = 4;
  EXPECT_THROW(predict(synthetic_preset("mixtral-8x7b"), c, p, 4, Workload{}), Error);  // 4 ranks on 2 devices
}

}  // namespace
}  // namespace moex::tools::plan

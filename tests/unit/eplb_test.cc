// The EPLB placement (moe/eplb.h) against a brute-force optimum on small cases, its invariants, the load window,
// and the placement / load files.
#include "moex/moe/eplb.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "moex/base/error.h"

namespace moex::eplb {
namespace {

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// The exact optimum of the problem place_experts approximates: over every replica count vector (each >= 1,
// summing to N*S) and every assignment of the replicas to N ranks of exactly S slots, the least largest rank load.
double brute_force_optimum(const std::vector<double>& load, int ranks, int slots_per_rank) {
  const int E = static_cast<int>(load.size()), total = ranks * slots_per_rank;
  double best = 1e300;
  std::vector<int> count(E, 1);
  std::function<void(int, int)> counts = [&](int e, int left) {
    if (e == E - 1) {
      count[e] = 1 + left;
      std::vector<double> items;
      for (int i = 0; i < E; ++i)
        for (int r = 0; r < count[i]; ++r) items.push_back(load[i] / count[i]);
      std::sort(items.rbegin(), items.rend());
      std::vector<double> bin(ranks, 0.0);
      std::vector<int> used(ranks, 0);
      std::function<void(size_t)> assign = [&](size_t i) {
        if (i == items.size()) {
          best = std::min(best, max_of(bin));
          return;
        }
        for (int b = 0; b < ranks; ++b) {
          if (used[b] == slots_per_rank || bin[b] + items[i] >= best) continue;
          bool seen = false;  // empty bins are interchangeable: try only the first
          for (int c = 0; c < b; ++c) seen = seen || (used[c] == 0 && used[b] == 0);
          if (seen) continue;
          bin[b] += items[i];
          ++used[b];
          assign(i + 1);
          bin[b] -= items[i];
          --used[b];
        }
      };
      assign(0);
      return;
    }
    for (int extra = 0; extra <= left; ++extra) {
      count[e] = 1 + extra;
      counts(e + 1, left - extra);
    }
  };
  counts(0, total - E);
  return best;
}

void expect_valid(const Placement& p, int E, int ranks, int S) {
  ASSERT_EQ(p.experts, E);
  ASSERT_EQ(p.ranks, ranks);
  ASSERT_EQ(p.slots_per_rank, S);
  ASSERT_EQ(static_cast<int>(p.slot_expert.size()), ranks * S);
  for (int e = 0; e < E; ++e) EXPECT_GE(p.replicas(e), 1) << "expert " << e;
}

// Approximation bound tested: the placement's largest rank load is at most 4/3 of the optimum. Greedy replica
// counts are optimal for the largest load per replica; for heaviest-first packing with a cardinality limit plus the
// swap pass, 4/3 is an empirical bound on these cases (LPT's classic bound without the limit), not a proof; the
// worst ratio seen is printed (1.27 when written).
TEST(Eplb, PlacementIsWithinFourThirdsOfTheBruteForceOptimum) {
  std::mt19937 rng(42);
  double worst = 1.0;
  int cases = 0;
  for (int E : {2, 3, 4, 6}) {
    for (int ranks : {2, 3}) {
      if (E % ranks != 0) continue;
      for (int R : {0, 1, 2}) {
        const int S = E / ranks + R;
        if (ranks * S > 9) continue;  // the brute force grows as ranks^(N S)
        for (int trial = 0; trial < 12; ++trial) {
          std::vector<double> load(E);
          const double skew = trial % 3;  // uniform random, Zipf 1, Zipf 2 (shuffled)
          for (int e = 0; e < E; ++e)
            load[e] = skew == 0 ? std::uniform_real_distribution<double>(0, 100)(rng) : 100.0 / std::pow(e + 1, skew);
          std::shuffle(load.begin(), load.end(), rng);
          const Placement p = place_experts(load, ranks, S);
          expect_valid(p, E, ranks, S);
          const double got = max_of(rank_loads(p, load)), opt = brute_force_optimum(load, ranks, S);
          ASSERT_GT(opt, 0);
          EXPECT_LE(got, opt * 4.0 / 3.0 + 1e-9) << "E " << E << " ranks " << ranks << " S " << S << " trial " << trial;
          worst = std::max(worst, got / opt);
          ++cases;
        }
      }
    }
  }
  std::printf("worst placement / optimum over %d cases: %.4f\n", cases, worst);
}

TEST(Eplb, OneExtraSlotPerRankBalancesAZipfTwoLoad) {
  // 8 experts, Zipf 2 (mini's --router-skew 2 shape), 2 and 4 ranks with R = 1: the goal is balancedness >= 0.9.
  std::vector<double> load(8);
  for (int e = 0; e < 8; ++e) load[e] = 1000.0 / std::pow(e + 1, 2.0);
  for (int ranks : {2, 4}) {
    const double before = balancedness(rank_loads(block_placement(8, ranks), load));
    const Placement p = place_experts(load, ranks, 8 / ranks + 1);
    const double after = balancedness(rank_loads(p, load));
    EXPECT_LT(before, 0.8) << ranks;
    EXPECT_GE(after, 0.9) << ranks;
    EXPECT_GE(p.replicas(0), 2) << "the hottest expert is replicated";
  }
}

TEST(Eplb, BlockPlacementIsPlainExpertParallelism) {
  const Placement p = block_placement(8, 2);
  for (int s = 0; s < 8; ++s) EXPECT_EQ(p.slot_expert[s], s);
  EXPECT_DOUBLE_EQ(balancedness(rank_loads(p, {1, 1, 1, 1, 0, 0, 0, 0})), 0.5);
  EXPECT_DOUBLE_EQ(balancedness({0, 0}), 1.0);
}

TEST(Eplb, HierarchicalKeepsEveryExpertsReplicasOnOneHost) {
  // 4 ranks on 2 hosts (ranks 0,2 on host 7, ranks 1,3 on host 9), 8 experts, 1 redundant slot per rank.
  std::vector<double> load(8);
  for (int e = 0; e < 8; ++e) load[e] = 1000.0 / std::pow(e + 1, 1.5);
  const std::vector<int> host = {7, 9, 7, 9};
  const Placement p = place_experts(load, 4, 3, host);
  expect_valid(p, 8, 4, 3);
  std::vector<double> host_load(2, 0.0);
  for (int e = 0; e < 8; ++e) {
    const int h = host[p.replica_slots[p.replica_offsets[e]] / 3];
    for (int i = p.replica_offsets[e]; i < p.replica_offsets[e + 1]; ++i)
      EXPECT_EQ(host[p.replica_slots[i] / 3], h) << "expert " << e;
    host_load[h == 7 ? 0 : 1] += load[e];
    int on_host = 0;
    for (int32_t x : p.slot_expert) on_host += x == e;
    EXPECT_EQ(on_host, p.replicas(e));
  }
  // Each host holds 4 experts; their loads differ by at most the heaviest expert's.
  EXPECT_LE(std::fabs(host_load[0] - host_load[1]), load[0] + 1e-9);
  // Keeping replicas on their host costs balance against a flat placement, but beats plain EP by far.
  EXPECT_GT(balancedness(rank_loads(p, load)), 1.5 * balancedness(rank_loads(block_placement(8, 4), load)));
  EXPECT_LE(balancedness(rank_loads(p, load)), balancedness(rank_loads(place_experts(load, 4, 3), load)) + 1e-9);
}

TEST(Eplb, KeepingExpertsInPlaceOnlyRenumbersRanks) {
  std::vector<double> load(8);
  for (int e = 0; e < 8; ++e) load[e] = 100.0 / (e + 1);
  const Placement prev = place_experts(load, 4, 3);
  // The same placement with its ranks rotated: nothing needs to move once renumbered.
  Placement next = prev;
  std::rotate(next.slot_expert.begin(), next.slot_expert.begin() + 3, next.slot_expert.end());
  next.index();
  EXPECT_EQ(keep_experts_in_place(next, prev), 0);
  EXPECT_EQ(next.slot_expert, prev.slot_expert);
  // A new load: the loads per rank are those of the plain new placement, whatever the numbering.
  std::vector<double> other(load.rbegin(), load.rend());
  Placement moved = place_experts(other, 4, 3);
  std::vector<double> plain = rank_loads(moved, other);
  keep_experts_in_place(moved, prev);
  std::vector<double> renumbered = rank_loads(moved, other);
  std::sort(plain.begin(), plain.end());
  std::sort(renumbered.begin(), renumbered.end());
  EXPECT_EQ(plain, renumbered);
  // Across hosts nothing is renumbered: ranks 0,1 on host 0 and 2,3 on host 1 keep their hosts' experts.
  Placement hier = place_experts(other, 4, 3, {0, 0, 1, 1});
  const Placement before = hier;
  keep_experts_in_place(hier, place_experts(load, 4, 3, {0, 0, 1, 1}), {0, 0, 1, 1});
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 3; ++i) {
      const int32_t e = hier.slot_expert[r * 3 + i];
      EXPECT_TRUE(std::find(before.slot_expert.begin(), before.slot_expert.begin() + 6, e) != before.slot_expert.begin() + 6);
    }
}

TEST(Eplb, RefusesImpossibleShapes) {
  EXPECT_THROW(place_experts({1, 2, 3}, 1, 2), Error);   // 2 slots for 3 experts
  EXPECT_THROW(place_experts({1, -1}, 2, 1), Error);     // negative load
  EXPECT_THROW(block_placement(6, 4), Error);
  Placement p;
  p.experts = 2;
  p.ranks = 1;
  p.slots_per_rank = 2;
  p.slot_expert = {0, 0};
  EXPECT_THROW(p.index(), Error);  // expert 1 has no replica
}

TEST(Eplb, LoadWindowSumsTheLastSteps) {
  LoadWindow w(2, 3, 2);
  const int a[3] = {1, 2, 3}, b[3] = {10, 20, 30}, c[3] = {100, 200, 300};
  w.add(0, a);
  w.add(1, c);
  w.end_step();
  w.add(0, b);
  w.end_step();
  EXPECT_EQ(w.load(0), (std::vector<double>{11, 22, 33}));
  EXPECT_EQ(w.load(1), (std::vector<double>{100, 200, 300}));
  w.add(0, c);
  w.end_step();  // step 1 (a, c) left the window
  EXPECT_EQ(w.load(0), (std::vector<double>{110, 220, 330}));
  EXPECT_EQ(w.load(1), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(w.steps(), 3);
}

TEST(Eplb, PlacementAndLoadFilesRoundTripAndRefuseBadInput) {
  ModelPlacement mp;
  mp.experts = 4;
  mp.ranks = 2;
  mp.slots_per_rank = 3;
  mp.layers.push_back({});
  mp.layers.push_back(place_experts({5, 1, 1, 1}, 2, 3));
  const ModelPlacement back = parse_placement_json(placement_json(mp));
  ASSERT_EQ(back.layers.size(), 2u);
  EXPECT_TRUE(back.layers[0].empty());
  EXPECT_EQ(back.layers[1].slot_expert, mp.layers[1].slot_expert);
  EXPECT_EQ(back.layers[1].replicas(0), 3);
  RecordedLoad l{4, 7, {{}, {5, 1, 1, 1}}};
  const RecordedLoad lb = parse_load_json(load_json(l));
  EXPECT_EQ(lb.steps, 7);
  EXPECT_EQ(lb.layers, l.layers);
  EXPECT_THROW(parse_placement_json("{"), Error);
  EXPECT_THROW(parse_placement_json(R"({"format":"moex-expert-placement","experts":4,"ranks":2,"slots_per_rank":3,"layers":[[0,1,2,3,0,9]]})"), Error);
  EXPECT_THROW(parse_placement_json(R"({"format":"moex-expert-placement","experts":4,"ranks":2,"slots_per_rank":3,"layers":[[0,1,2,0,0,0]]})"), Error);
  EXPECT_THROW(parse_load_json(R"({"format":"moex-expert-load","experts":4,"steps":1,"layers":[[1,2]]})"), Error);
  EXPECT_THROW(parse_load_json(R"({"format":"x","experts":4,"steps":1,"layers":[]})"), Error);
}

}  // namespace
}  // namespace moex::eplb

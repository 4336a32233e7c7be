// Sampler: greedy, penalties (OpenAI's definition), logprobs and top_logprobs, seeded sampling. Expected
// values are computed here independently (log-softmax in long double, penalties by the formula).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "moex/base/error.h"
#include "moex/runtime/sampler.h"

namespace moex {
namespace {

std::vector<float> random_logits(int n, uint64_t seed, float scale = 4.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(n);
  for (float& x : logits) x = normal(rng);
  return logits;
}

std::vector<long double> log_softmax_ld(const std::vector<float>& logits) {
  long double max_logit = *std::max_element(logits.begin(), logits.end());
  long double total = 0;
  for (float x : logits) total += std::exp(static_cast<long double>(x) - max_logit);
  std::vector<long double> out;
  for (float x : logits) out.push_back(static_cast<long double>(x) - max_logit - std::log(total));
  return out;
}

TEST(Sampler, GreedyIsTheFirstArgmax) {
  std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  Sampler sampler(SamplerOptions{});
  EXPECT_EQ(sampler.sample(logits.data(), 5), 1);
  const auto big = random_logits(32000, 7);
  const int expected = static_cast<int>(std::max_element(big.begin(), big.end()) - big.begin());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(sampler.sample(big.data(), 32000), expected);
}

// argmax against the one-line walk it replaces, on every length up to 70 (no whole block: the tail loop), around one
// and two 256-logit blocks, and the vocabulary's, with ties, signed zeros, infinities and NaNs placed at random, and
// a NaN first (the walk keeps 0).
TEST(Sampler, ArgmaxIsTheWalksFirstLargest) {
  const auto walk = [](const std::vector<float>& x) {
    int best = 0;
    for (int i = 1; i < static_cast<int>(x.size()); ++i)
      if (x[i] > x[best]) best = i;
    return best;
  };
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 3.0f};
  std::mt19937_64 rng(11);
  std::vector<int> lengths;
  for (int n = 1; n <= 70; ++n) lengths.push_back(n);
  for (int n : {255, 256, 257, 511, 512, 513, 700}) lengths.push_back(n);  // whole 256-logit blocks and their tails
  for (int n : lengths) {
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> x(n);
      for (float& v : x) v = static_cast<float>(rng() % 7) - 3.0f;  // many ties
      for (int k = 0; k < 3; ++k) x[rng() % n] = specials[rng() % 6];
      if (trial == 0) x[0] = NAN;
      ASSERT_EQ(argmax(x.data(), n), walk(x)) << "n " << n << " trial " << trial;
    }
  }
  auto big = random_logits(32000, 9);
  big[31999] = NAN;
  big[20000] = big[25000] = 40.0f;
  EXPECT_EQ(argmax(big.data(), 32000), 20000);
  EXPECT_EQ(argmax(big.data(), 32000), walk(big));
}

TEST(Sampler, LogprobsAreTheLogSoftmaxOfTheRawLogits) {
  const int n = 32000;
  const auto logits = random_logits(n, 11);
  const auto expected = log_softmax_ld(logits);
  SamplerOptions options;
  options.logprobs = true;
  options.top_logprobs = 20;
  options.frequency_penalty = 2.0f;  // penalties change the choice, never the reported logprobs
  Sampler sampler(options);
  TokenCounts counts;
  SampledToken out;
  for (int step = 0; step < 3; ++step) {
    sampler.sample(logits.data(), n, &counts, &out);
    EXPECT_NEAR(out.logprob, static_cast<double>(expected[out.token]), 1e-5);
    // top 20 by an independent full sort (ties: lower id)
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return expected[a] > expected[b]; });
    ASSERT_EQ(out.top.size(), 20u);
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(out.top[i].token, order[i]) << i;
      EXPECT_NEAR(out.top[i].logprob, static_cast<double>(expected[order[i]]), 1e-5);
    }
    if (step == 0) EXPECT_EQ(out.token, order[0]);  // greedy, nothing generated yet
    counts.add(out.token);
  }
  // With the first choice penalised by 2 per occurrence, greedy moved on to another token.
  EXPECT_NE(out.token, out.top[0].token);
}

TEST(Sampler, PenaltiesFollowOpenAIsDefinition) {
  // adjusted[j] = logit[j] - count[j] * frequency - (count[j] > 0) * presence
  std::vector<float> logits = {1.0f, 2.0f, 2.5f, 0.0f};
  TokenCounts counts;
  counts.add(2);
  SamplerOptions options;
  options.presence_penalty = 0.4f;  // token 2: 2.5 - 0.4 = 2.1 > 2.0
  EXPECT_EQ(Sampler(options).sample(logits.data(), 4, &counts), 2);
  options.presence_penalty = 0.6f;  // 1.9 < 2.0
  EXPECT_EQ(Sampler(options).sample(logits.data(), 4, &counts), 1);
  options.presence_penalty = 0.0f;
  counts.add(2);
  counts.add(2);  // 3 occurrences
  options.frequency_penalty = 0.15f;  // 2.5 - 0.45 = 2.05
  EXPECT_EQ(Sampler(options).sample(logits.data(), 4, &counts), 2);
  options.frequency_penalty = 0.2f;  // 1.9
  EXPECT_EQ(Sampler(options).sample(logits.data(), 4, &counts), 1);
  options.frequency_penalty = -1.0f;  // negative penalties encourage repetition
  counts.clear();
  for (int i = 0; i < 3; ++i) counts.add(3);  // 0 + 3 * 1 = 3 > 2.5
  EXPECT_EQ(Sampler(options).sample(logits.data(), 4, &counts), 3);
  EXPECT_EQ(Sampler(options).sample(logits.data(), 4, nullptr), 2);  // no history: no penalty
}

// The empirical distribution of many draws against softmax((logit - penalty) / T) restricted to top-k /
// top-p, computed here in long double.
TEST(Sampler, DrawsFollowTheTemperedPenalisedDistribution) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 1.3f, 0.0f, -2.0f};
  const int n = static_cast<int>(logits.size());
  TokenCounts counts;
  counts.add(3);
  counts.add(3);
  struct Case {
    float temperature;
    int top_k;
    float top_p;
  };
  for (const Case c : {Case{1.0f, 0, 1.0f}, Case{0.7f, 3, 1.0f}, Case{1.5f, 0, 0.8f}}) {
    SamplerOptions options;
    options.temperature = c.temperature;
    options.top_k = c.top_k;
    options.top_p = c.top_p;
    options.frequency_penalty = 0.25f;
    options.presence_penalty = 0.1f;
    options.seed = 1234;
    std::vector<long double> adjusted(logits.begin(), logits.end());
    adjusted[3] -= 2 * 0.25L + 0.1L;
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return adjusted[a] > adjusted[b]; });
    std::vector<long double> p(n, 0.0L);
    long double total = 0;
    const int k = c.top_k > 0 ? c.top_k : n;
    for (int i = 0; i < k; ++i) total += (p[order[i]] = std::exp(adjusted[order[i]] / c.temperature));
    long double cumulative = 0, kept = 0;
    for (int i = 0; i < k; ++i) {
      if (cumulative >= c.top_p * total) p[order[i]] = 0;
      cumulative += p[order[i]];
      kept += p[order[i]];
    }
    Sampler sampler(options);
    const int draws = 200000;
    std::vector<int> seen(n, 0);
    for (int i = 0; i < draws; ++i) ++seen[sampler.sample(logits.data(), n, &counts)];
    for (int j = 0; j < n; ++j) {
      const double expected = static_cast<double>(p[j] / kept);
      const double sigma = std::sqrt(expected * (1 - expected) / draws);
      EXPECT_NEAR(seen[j] / static_cast<double>(draws), expected, 5 * sigma + 1e-9)
          << "token " << j << " T " << c.temperature << " k " << c.top_k << " p " << c.top_p;
      if (expected == 0.0) EXPECT_EQ(seen[j], 0);
    }
  }
}

TEST(Sampler, TheSeedFixesTheStream) {
  const auto logits = random_logits(1000, 3, 1.0f);
  SamplerOptions options;
  options.temperature = 1.0f;
  options.seed = 42;
  Sampler a(options), b(options);
  options.seed = 43;
  Sampler c(options);
  int differ = 0;
  for (int i = 0; i < 50; ++i) {
    const int x = a.sample(logits.data(), 1000);
    EXPECT_EQ(x, b.sample(logits.data(), 1000));
    differ += x != c.sample(logits.data(), 1000);
  }
  EXPECT_GT(differ, 0);
}

// `moex generate`'s draws for its flags (temperature, top-k, top-p, seed) stay what they were: the stream
// of the algorithm as documented in sampler.h (sort by logit, ties to the lower id; top-k; exp; the
// smallest prefix reaching top_p; one uniform draw over the kept mass, walked in that order), written here.
// Both the small vocabulary (sorted at once) and the full one (sorted lazily) paths, large top-k too.
TEST(Sampler, GenerateDrawsAreThoseOfTheDocumentedAlgorithm) {
  struct Case {
    int n;
    float t;
    int k;
    float p;
  };
  for (const Case c : {Case{500, 0.8f, 0, 1.0f}, Case{500, 1.0f, 40, 1.0f}, Case{500, 1.2f, 0, 0.9f},
                       Case{500, 0.7f, 50, 0.5f}, Case{32000, 1.0f, 0, 1.0f}, Case{32000, 1.5f, 0, 0.95f},
                       Case{32000, 1.0f, 5000, 1.0f}, Case{32000, 2.0f, 0, 1.0f}}) {
    const int n = c.n;
    const auto logits = random_logits(n, 21, 2.0f);
    SamplerOptions options;
    options.temperature = c.t;
    options.top_k = c.k;
    options.top_p = c.p;
    options.seed = 99;
    Sampler sampler(options);
    std::mt19937_64 rng(99);
    for (int step = 0; step < (n > 1000 ? 40 : 200); ++step) {
      std::vector<std::pair<float, int>> cand(n);
      for (int i = 0; i < n; ++i) cand[i] = {logits[i] / c.t, i};
      std::stable_sort(cand.begin(), cand.end(), [](auto& a, auto& b) { return a.first > b.first; });
      int keep = c.k > 0 ? c.k : n;
      const float max_logit = cand[0].first;
      double total = 0;
      for (int i = 0; i < keep; ++i) total += (cand[i].first = std::exp(cand[i].first - max_logit));
      if (c.p < 1.0f) {
        double cumulative = 0;
        for (int i = 0; i < keep; ++i) {
          cumulative += cand[i].first / total;
          if (cumulative >= c.p) {
            keep = i + 1;
            total = cumulative * total;
            break;
          }
        }
      }
      double r = std::uniform_real_distribution<double>(0.0, total)(rng);
      int expected = cand[keep - 1].second;
      for (int i = 0; i < keep; ++i) {
        r -= cand[i].first;
        if (r <= 0.0) {
          expected = cand[i].second;
          break;
        }
      }
      ASSERT_EQ(sampler.sample(logits.data(), n), expected) << "step " << step << " T " << c.t;
    }
  }
}

TEST(Sampler, RefusesBadOptions) {
  const auto refused = [](SamplerOptions o) {
    try {
      Sampler s(o);
    } catch (const Error& e) {
      return e.kind() == ErrorKind::kInvalidInput;
    }
    return false;
  };
  SamplerOptions o;
  o.temperature = -0.1f;
  EXPECT_TRUE(refused(o));
  o = {};
  o.temperature = NAN;
  EXPECT_TRUE(refused(o));
  o = {};
  o.top_p = 0.0f;
  EXPECT_TRUE(refused(o));
  o = {};
  o.presence_penalty = 2.5f;
  EXPECT_TRUE(refused(o));
  o = {};
  o.frequency_penalty = -2.01f;
  EXPECT_TRUE(refused(o));
  o = {};
  o.logprobs = true;
  o.top_logprobs = 21;
  EXPECT_TRUE(refused(o));
  o.top_logprobs = 20;
  EXPECT_FALSE(refused(o));
  o.logprobs = false;
  EXPECT_TRUE(refused(o));
}

}  // namespace
}  // namespace moex

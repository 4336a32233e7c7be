// GatingTopK (every fusion mode, both weight conventions, ties) and MoEDynamicBatch (plan, capacity, gather,
// combine) against plain scalar references written here; expert_ffn against a double-precision SwiGLU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/dtype.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/packed.h"
#include "moex/moe/moe_layer.h"
#include "moex/moe/dynamic_batch.h"
#include "moex/moe/gating.h"

namespace moex {
namespace {

const RouterFusion kAllModes[] = {RouterFusion::kNone, RouterFusion::kTopkSoftmax, RouterFusion::kFull};

// Owns a gate [E, d] (BF16 or F32) and hands out a view of it.
struct Gate {
  std::vector<uint16_t> bf16;
  std::vector<float> f32;
  TensorView view;
  Gate(const std::vector<float>& values, int64_t E, int64_t d, DType dtype) {
    if (dtype == DType::kBF16) {
      for (float v : values) bf16.push_back(f32_to_bf16(v));
      view = TensorView{bf16.data(), DType::kBF16, Shape{E, d}};
    } else {
      f32 = values;
      view = TensorView{f32.data(), DType::kF32, Shape{E, d}};
    }
  }
  float at(int64_t e, int64_t i) const {
    const int64_t d = view.shape[1];
    return view.dtype == DType::kBF16 ? bf16_to_f32(bf16[e * d + i]) : f32[e * d + i];
  }
};

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routing route(RouterFusion mode, bool norm_topk_prob, const std::vector<float>& x, int64_t T, const Gate& gate,
              int k) {
  GatingTopK router(static_cast<int>(gate.view.shape[0]), k, mode, norm_topk_prob);
  Routing r{std::vector<int32_t>(T * k, -7), std::vector<float>(T * k, -7.0f)};
  router.route(x.data(), T, gate.view, r.ids.data(), r.weights.data());
  return r;
}

// Scalar oracle: double logits, a stable sort (lower index first on ties), softmax in double.
Routing reference_route(const std::vector<float>& x, int64_t T, const Gate& gate, int k, bool norm_topk_prob) {
  const int64_t E = gate.view.shape[0], d = gate.view.shape[1];
  Routing r;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> logits(E, 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < d; ++i) logits[e] += static_cast<double>(x[t * d + i]) * gate.at(e, i);
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    double sum = 0.0;
    if (norm_topk_prob)
      for (int j = 0; j < k; ++j) sum += std::exp(logits[order[j]] - logits[order[0]]);
    else
      for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[e] - logits[order[0]]);
    for (int j = 0; j < k; ++j) {
      r.ids.push_back(order[j]);
      r.weights.push_back(static_cast<float>(std::exp(logits[order[j]] - logits[order[0]]) / sum));
    }
  }
  return r;
}

std::vector<float> random_values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = normal(rng);
  return v;
}

void expect_same_routing(const Routing& a, const Routing& b, double tolerance, const std::string& what) {
  ASSERT_EQ(a.ids.size(), b.ids.size()) << what;
  for (size_t i = 0; i < a.ids.size(); ++i) {
    EXPECT_EQ(a.ids[i], b.ids[i]) << what << " assignment " << i;
    EXPECT_NEAR(a.weights[i], b.weights[i], tolerance) << what << " assignment " << i;
  }
}

TEST(GatingTopK, AllModesAgreeOnRandomInputs) {
  struct Case {
    int64_t E, d, T;
    int k;
  };
  // d 100 and 4095 exercise the masked tail; E 6, 13 the partial expert groups; T 1..37 every token-block tail.
  const Case cases[] = {{8, 4096, 37, 2}, {8, 4095, 5, 2}, {6, 100, 17, 2}, {13, 64, 9, 3}, {4, 16, 1, 1},
                        {8, 256, 64, 2}, {64, 128, 11, 8}, {300, 32, 4, 4}};  // 300 > kMaxFusedExperts
  for (const Case& c : cases) {
    const auto gate_values = random_values(c.E * c.d, 7 + c.d, 1.0f / std::sqrt(static_cast<float>(c.d)));
    const auto x = random_values(c.T * c.d, 11 + c.T);
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const Gate gate(gate_values, c.E, c.d, dtype);
      for (bool norm : {true, false}) {
        const std::string what = "E " + std::to_string(c.E) + " d " + std::to_string(c.d) + " T " +
                                 std::to_string(c.T) + (dtype == DType::kBF16 ? " bf16" : " f32") +
                                 (norm ? " norm" : " no-norm");
        const Routing none = route(RouterFusion::kNone, norm, x, c.T, gate, c.k);
        for (RouterFusion mode : kAllModes)
          expect_same_routing(route(mode, norm, x, c.T, gate, c.k), none, 1e-6,
                              what + " mode " + router_fusion_name(mode));
        expect_same_routing(none, reference_route(x, c.T, gate, c.k, norm), 2e-5, what + " vs double reference");
      }
    }
  }
}

TEST(GatingTopK, ScalarAndSimdPathsAgree) {
  const int64_t E = 8, d = 4096, T = 21;
  const Gate gate(random_values(E * d, 3, 1.0f / 64.0f), E, d, DType::kBF16);
  const auto x = random_values(T * d, 4);
  for (RouterFusion mode : kAllModes) {
    const bool had_simd = x86_kernels_allowed();
    const Routing simd = route(mode, true, x, T, gate, 2);
    set_use_x86_kernels(false);
    const Routing scalar = route(mode, true, x, T, gate, 2);
    set_use_x86_kernels(had_simd);
    expect_same_routing(simd, scalar, 1e-5, router_fusion_name(mode));
  }
}

TEST(GatingTopK, ThreadCountDoesNotChangeResults) {
  const int64_t E = 8, d = 512, T = 100;
  const Gate gate(random_values(E * d, 5, 1.0f / 22.0f), E, d, DType::kBF16);
  const auto x = random_values(T * d, 6);
  const int threads = num_threads();
  for (RouterFusion mode : kAllModes) {
    set_num_threads(1);
    const Routing one = route(mode, true, x, T, gate, 2);
    set_num_threads(threads);
    const Routing many = route(mode, true, x, T, gate, 2);
    expect_same_routing(one, many, 0.0, router_fusion_name(mode));
  }
}

TEST(GatingTopK, CraftedTiesGoToTheLowerIndex) {
  // Rows 2, 5 and 6 are identical and the best; rows 1 and 3 identical and next: exact ties in every mode.
  const int64_t E = 8, d = 40;
  auto values = random_values(E * d, 9, 0.1f);
  for (int64_t i = 0; i < d; ++i) {
    values[2 * d + i] = values[5 * d + i] = values[6 * d + i] = 1.0f;
    values[1 * d + i] = values[3 * d + i] = 0.5f;
  }
  std::vector<float> x(3 * d, 0.25f);
  std::fill(x.begin() + 2 * d, x.end(), 0.0f);  // token 2: every logit is 0, a tie among all E
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    const Gate gate(values, E, d, dtype);
    for (bool norm : {true, false}) {
      for (int k : {1, 2, 3, 4}) {
        const Routing none = route(RouterFusion::kNone, norm, x, 3, gate, k);
        for (RouterFusion mode : kAllModes) {
          const Routing r = route(mode, norm, x, 3, gate, k);
          expect_same_routing(r, none, 1e-6, router_fusion_name(mode));
          const int32_t expected_t0[] = {2, 5, 6, 1};
          for (int j = 0; j < k; ++j) {
            EXPECT_EQ(r.ids[0 * k + j], expected_t0[j]) << "k " << k << " choice " << j;
            EXPECT_EQ(r.ids[2 * k + j], j) << "all-zero logits: experts 0..k-1 in order";
            EXPECT_NEAR(r.weights[2 * k + j], norm ? 1.0f / k : 1.0f / E, 1e-6);
          }
          if (norm && k == 3) {  // three equal logits: equal weights
            for (int j = 0; j < 3; ++j) EXPECT_NEAR(r.weights[j], 1.0f / 3.0f, 1e-6);
          }
        }
      }
    }
  }
}

TEST(GatingTopK, TopKKeepsLowerIndexOnTies) {
  const float logits[] = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  int32_t ids[4];
  float values[4];
  gating::top_k(logits, 6, 3, ids, values);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(ids[2], 4);
  gating::top_k(logits, 6, 4, ids, values);
  EXPECT_EQ(ids[3], 3);
  EXPECT_EQ(values[3], 2.0f);
  const float all_equal[] = {0.5f, 0.5f, 0.5f};
  gating::top_k(all_equal, 3, 2, ids, values);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 1);
}

TEST(GatingTopK, NormTopkProbFalseIsTheSoftmaxOverAllExperts) {
  const float logits[] = {0.1f, 2.0f, -1.0f, 1.5f};
  int32_t ids[2];
  float values[2];
  gating::top_k(logits, 4, 2, ids, values);
  gating::weights_from_logits(logits, 4, 2, /*norm_topk_prob=*/false, values);
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l));
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_NEAR(values[0], std::exp(2.0) / sum, 1e-7);
  EXPECT_NEAR(values[1], std::exp(1.5) / sum, 1e-7);
  EXPECT_LT(values[0] + values[1], 1.0f);  // not renormalised
  gating::top_k(logits, 4, 2, ids, values);
  gating::weights_from_logits(logits, 4, 2, /*norm_topk_prob=*/true, values);
  EXPECT_NEAR(values[0], 1.0 / (1.0 + std::exp(-0.5)), 1e-7);
  EXPECT_NEAR(values[0] + values[1], 1.0f, 1e-7);
}

TEST(GatingTopK, RejectsBadConfigurationsAndNames) {
  EXPECT_THROW(GatingTopK(8, 9, RouterFusion::kFull), Error);
  EXPECT_THROW(GatingTopK(8, 0, RouterFusion::kFull), Error);
  EXPECT_THROW(router_fusion_from_name("fused"), Error);
  for (RouterFusion mode : kAllModes) EXPECT_EQ(router_fusion_from_name(router_fusion_name(mode)), mode);
}

// ---------------------------------------------------------------------------------------------------
// MoEDynamicBatch

std::vector<int32_t> random_ids(int64_t T, int E, int k, uint32_t seed, double skew) {
  // Distinct experts per token, drawn with Zipf(skew) popularity so some experts overflow.
  std::mt19937 rng(seed);
  std::vector<double> p(E);
  for (int e = 0; e < E; ++e) p[e] = std::pow(e + 1.0, -skew);
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> left = p;
    for (int j = 0; j < k; ++j) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int e = pick(rng);
      ids.push_back(e);
      left[e] = 0.0;
    }
  }
  return ids;
}

TEST(MoEDynamicBatch, CapacityFormula) {
  EXPECT_EQ(MoEDynamicBatch::capacity_for(5, 8, 2, 1.0f), 2);     // ceil(1.25)
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, 1.0f), 16);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, 1.25f), 20);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(1, 8, 2, 1.0f), 1);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, 0.0f), 0);    // dropless
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, -1.0f), 0);
  // A capacity of T keeps its value; above T nothing can overflow, which is dropless (0), also for factors
  // whose capacity would not fit an int64_t.
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, 4.0f), 64);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, 4.1f), 0);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, 1e30f), 0);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, std::numeric_limits<float>::infinity()), 0);
  EXPECT_EQ(MoEDynamicBatch::capacity_for(64, 8, 2, std::numeric_limits<float>::quiet_NaN()), 0);
}

TEST(MoEDynamicBatch, DroplessPlanGroupsEveryAssignmentInTokenOrder) {
  const int E = 8, k = 2;
  const int64_t T = 203;
  const auto ids = random_ids(T, E, k, 1, 1.2);
  MoEDynamicBatch batcher(E, k, 0.0f);
  batcher.plan(ids.data(), T);
  const MoELoadStats& s = batcher.stats();
  EXPECT_EQ(s.drops, 0);
  EXPECT_EQ(s.capacity, 0);
  EXPECT_EQ(s.assignments, T * k);
  const auto& offsets = batcher.expert_offsets();
  ASSERT_EQ(offsets.back(), T * k);
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(offsets[e + 1] - offsets[e], std::count(ids.begin(), ids.end(), e)) << e;
    EXPECT_EQ(s.tokens_per_expert[e], offsets[e + 1] - offsets[e]);
    EXPECT_EQ(s.drops_per_expert[e], 0);
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const int32_t t = batcher.row_token()[r], j = batcher.row_choice()[r];
      EXPECT_EQ(ids[t * k + j], e);
      EXPECT_EQ(batcher.assignment_row()[t * k + j], r);
      if (r > offsets[e]) {
        EXPECT_LT(batcher.row_token()[r - 1], t) << "token order within expert " << e;
      }
    }
  }
}

TEST(MoEDynamicBatch, CapacityDropsAreTheOverflowSecondChoicesFirst) {
  const int E = 8, k = 2;
  for (float factor : {0.5f, 1.0f, 1.25f, 2.0f}) {
    for (int64_t T : {1, 7, 64, 300}) {
      const auto ids = random_ids(T, E, k, static_cast<uint32_t>(T), 1.5);
      MoEDynamicBatch batcher(E, k, factor);
      batcher.plan(ids.data(), T);
      const MoELoadStats& s = batcher.stats();
      const int64_t capacity = MoEDynamicBatch::capacity_for(T, E, k, factor);
      EXPECT_EQ(s.capacity, capacity);
      int64_t expected_drops = 0;
      for (int e = 0; e < E; ++e) {
        const int64_t routed = std::count(ids.begin(), ids.end(), e);
        expected_drops += std::max<int64_t>(0, routed - capacity);
        EXPECT_EQ(s.tokens_per_expert[e], std::min(routed, capacity)) << "expert " << e;
        EXPECT_EQ(s.drops_per_expert[e], std::max<int64_t>(0, routed - capacity)) << "expert " << e;
      }
      EXPECT_EQ(s.drops, expected_drops) << "factor " << factor << " T " << T;
      // Reference priority order: all first choices in token order, then all second choices.
      std::vector<int64_t> taken(E, 0);
      for (int j = 0; j < k; ++j) {
        for (int64_t t = 0; t < T; ++t) {
          const int e = ids[t * k + j];
          const bool keep = taken[e] < capacity;
          taken[e] += keep;
          EXPECT_EQ(batcher.assignment_row()[t * k + j] >= 0, keep) << "token " << t << " choice " << j;
        }
      }
      const auto& offsets = batcher.expert_offsets();
      for (int e = 0; e < E; ++e)
        for (int64_t r = offsets[e] + 1; r < offsets[e + 1]; ++r)
          EXPECT_LT(batcher.row_token()[r - 1], batcher.row_token()[r]);
    }
  }
}

TEST(MoEDynamicBatch, SecondChoiceDropsBeforeAnEarlierTokensFirstChoice) {
  // capacity = ceil(2*4/4 * 1.0) = 2. Expert 0 is the 1st choice of tokens 0, 2, 3 and the 2nd of token 1.
  const int32_t ids[] = {0, 1, /*t1*/ 1, 0, /*t2*/ 0, 2, /*t3*/ 0, 3};
  MoEDynamicBatch batcher(4, 2, 1.0f);
  batcher.plan(ids, 4);
  const auto& row = batcher.assignment_row();
  EXPECT_GE(row[0], 0);   // t0 1st -> 0: kept
  EXPECT_EQ(row[3], -1);  // t1 2nd -> 0: dropped although token 1 comes before token 2
  EXPECT_GE(row[4], 0);   // t2 1st -> 0: kept
  EXPECT_EQ(row[6], -1);  // t3 1st -> 0: over capacity
  EXPECT_EQ(batcher.stats().drops, 2);
  EXPECT_EQ(batcher.stats().tokens_per_expert[0], 2);
  EXPECT_EQ(batcher.stats().drops_per_expert[0], 2);
}

TEST(MoEDynamicBatch, GatherAndCombineMatchAScalarLoop) {
  const int E = 8, k = 2;
  const int64_t T = 77, d = 33;
  const auto ids = random_ids(T, E, k, 5, 1.5);
  const auto x = random_values(T * d, 8);
  const auto weights = random_values(T * k, 9);
  const auto residual = random_values(T * d, 10);
  for (float factor : {0.0f, 1.0f}) {
    MoEDynamicBatch batcher(E, k, factor);
    batcher.plan(ids.data(), T);
    const int64_t rows = batcher.expert_offsets().back();
    std::vector<float> gathered(rows * d);
    batcher.gather(x.data(), d, gathered.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < d; ++i) ASSERT_EQ(gathered[r * d + i], x[batcher.row_token()[r] * d + i]);
    // Expert "outputs": row r holds r + i/100, so every row is distinguishable.
    std::vector<float> expert_out(rows * d);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < d; ++i) expert_out[r * d + i] = static_cast<float>(r) + i / 100.0f;
    std::vector<float> out = residual;
    batcher.combine(expert_out.data(), weights.data(), T, d, out.data(), /*accumulate=*/true);
    std::vector<float> fresh(T * d, 123.0f);
    batcher.combine(expert_out.data(), weights.data(), T, d, fresh.data(), /*accumulate=*/false);
    int64_t dropped_tokens = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool all_dropped = true;
      for (int64_t i = 0; i < d; ++i) {
        // Choices are added in order j = 0..k-1 onto what is there: the result is exact, not approximate.
        float expected = 0.0f, expected_on_residual = residual[t * d + i];
        for (int j = 0; j < k; ++j) {
          const int32_t row = batcher.assignment_row()[t * k + j];
          if (row < 0) continue;
          all_dropped = false;
          expected += weights[t * k + j] * expert_out[row * d + i];
          expected_on_residual += weights[t * k + j] * expert_out[row * d + i];
        }
        EXPECT_EQ(fresh[t * d + i], expected);
        EXPECT_EQ(out[t * d + i], expected_on_residual);
      }
      if (all_dropped) {  // a token with every choice dropped keeps exactly its residual
        ++dropped_tokens;
        for (int64_t i = 0; i < d; ++i) EXPECT_EQ(out[t * d + i], residual[t * d + i]);
      }
    }
    if (factor > 0) {
      EXPECT_GT(batcher.stats().drops, 0);
    }
  }
}

TEST(MoEDynamicBatch, ThreadCountDoesNotChangeCombine) {
  const int E = 8, k = 2;
  const int64_t T = 300, d = 64;
  const auto ids = random_ids(T, E, k, 12, 1.0);
  const auto weights = random_values(T * k, 13);
  MoEDynamicBatch batcher(E, k, 0.0f);
  batcher.plan(ids.data(), T);
  const auto expert_out = random_values(T * k * d, 14);
  const int threads = num_threads();
  std::vector<float> one(T * d), many(T * d);
  set_num_threads(1);
  batcher.combine(expert_out.data(), weights.data(), T, d, one.data(), false);
  set_num_threads(std::max(threads, 2));
  batcher.combine(expert_out.data(), weights.data(), T, d, many.data(), false);
  set_num_threads(threads);
  EXPECT_EQ(one, many);
}

TEST(MoEDynamicBatch, ExpertFfnMatchesScalarSwiGlu) {
  const int64_t d = 72, I = 100, rows = 6;  // 6 rows: one blocked token block and a tail of 2
  const auto w1v = random_values(I * d, 21, 0.1f), w3v = random_values(I * d, 22, 0.1f),
             w2v = random_values(d * I, 23, 0.1f), x = random_values(rows * d, 24);
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    const Gate w1(w1v, I, d, dtype), w3(w3v, I, d, dtype), w2(w2v, d, I, dtype);
    const ExpertWeights w{w1.view, w3.view, w2.view};
    std::vector<float> hidden_gate(rows * I), hidden_up(rows * I), out(rows * d);
    expert_ffn(w, x.data(), rows, hidden_gate.data(), hidden_up.data(), out.data());
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> h(I);
      for (int64_t n = 0; n < I; ++n) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < d; ++i) {
          g += static_cast<double>(x[r * d + i]) * w1.at(n, i);
          u += static_cast<double>(x[r * d + i]) * w3.at(n, i);
        }
        h[n] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t i = 0; i < d; ++i) {
        double y = 0;
        for (int64_t n = 0; n < I; ++n) y += h[n] * w2.at(i, n);
        EXPECT_NEAR(out[r * d + i], y, 1e-4 * (1.0 + std::fabs(y))) << "row " << r << " col " << i;
      }
    }
    expert_ffn(w, x.data(), 0, hidden_gate.data(), hidden_up.data(), out.data());  // zero rows: no-op
  }
}

// Shared experts and dense MLP layers packed (--dense-weights): expert_ffn runs them through the fused kernels
// (kernels::linear_ffn), which for every format must give the scalar oracle's SwiGLU (ref::expert_gate_up and
// ref::expert_down_accumulate over the natural layout) to within its summation order, for 1..17 rows and a prompt.
TEST(MoEDynamicBatch, PackedExpertFfnMatchesTheOracleInEveryFormat) {
  const int64_t d = 136, I = 100;  // neither a multiple of a panel nor of a K group
  const auto w1v = random_values(I * d, 31, 0.1f), w3v = random_values(I * d, 32, 0.1f), w2v = random_values(d * I, 33, 0.1f);
  const TensorView w1{const_cast<float*>(w1v.data()), DType::kF32, Shape{I, d}},
      w3{const_cast<float*>(w3v.data()), DType::kF32, Shape{I, d}}, w2{const_cast<float*>(w2v.data()), DType::kF32, Shape{d, I}};
  for (kernels::WeightFormat format :
       {kernels::WeightFormat::kBF16, kernels::WeightFormat::kInt8, kernels::WeightFormat::kInt8W8A8,
        kernels::WeightFormat::kInt4, kernels::WeightFormat::kInt4W4A8, kernels::WeightFormat::kFP8E4M3}) {
    ExpertWeightFormat f;
    f.packed = true;
    f.format = format;
    f.group = 32;
    ExpertWeights w{w1, w3, w2};
    w.packed = std::make_shared<const kernels::PackedFfn>(pack_expert(w, f));
    const auto quantize = [&](const TensorView& m) { return kernels::quantize(m, format, 32); };
    const kernels::QuantizedMatrix q1 = quantize(w1), q3 = quantize(w3), q2 = quantize(w2);
    for (int64_t rows : {1, 2, 5, 13, 17, 40}) {
      const auto x = random_values(rows * d, 34 + rows);
      std::vector<float> h(rows * I), up(rows * I), out(rows * d, -1.0f), h_ref(rows * I), out_ref(rows * d, 0.0f);
      std::vector<float> ones(rows, 1.0f);
      std::vector<int32_t> out_rows(rows);
      std::iota(out_rows.begin(), out_rows.end(), 0);
      kernels::ref::expert_gate_up(x.data(), rows, q1, q3, h_ref.data());
      kernels::ref::expert_down_accumulate(h_ref.data(), rows, q2, ones.data(), out_rows.data(), out_ref.data(), d);
      expert_ffn(w, x.data(), rows, h.data(), up.data(), out.data());
      double scale = 0;
      for (float v : out_ref) scale = std::max(scale, double(std::fabs(v)));
      // h's own rounding differs by summation order (and int8's s16 activations on VNNI): the down projection's
      // input moves by ~1e-3 of h at most, W8A8's re-quantization of h by a code step in the worst case.
      const double tol = (format == kernels::WeightFormat::kInt8W8A8 || format == kernels::WeightFormat::kInt4W4A8 ? 2e-2 : 2e-3) * scale;
      for (int64_t i = 0; i < rows * d; ++i)
        ASSERT_NEAR(out[i], out_ref[i], tol) << kernels::weight_format_name(format) << " rows " << rows << " at " << i;
    }
  }
}

}  // namespace
}  // namespace moex

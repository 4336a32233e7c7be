// Model-level properties that need no reference: batched decode equals separate runs, and the KV cache
// continues a sequence exactly as a longer prefill would. (Agreement with PyTorch: tests/reference.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/model/decoder.h"
#include "moex/runtime/generation.h"
#include "moex/runtime/sampler.h"

namespace moex {
namespace {

std::string tiny_model_dir() {
  static const std::string dir = [] {
    const std::string out = (std::filesystem::temp_directory_path() / "moex_model_test_tiny").string();
    if (!std::filesystem::exists(out + "/config.json")) {
      const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset tiny --seed 21 --out " + out + " > /dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return out;
  }();
  return dir;
}

ModelOptions options_for(int batch) {
  ModelOptions o;
  o.max_batch = batch;
  o.max_seq_len = 64;
  o.max_step_tokens = 32;
  return o;
}

// Greedy decode of one sequence; returns the logits of every decode step, [steps][V].
std::vector<std::vector<float>> decode_alone(const std::vector<int>& prompt, int steps) {
  DecoderModel model(tiny_model_dir(), options_for(1));
  const int V = model.config().vocab_size;
  std::vector<float> logits(V);
  KvBlockManager kv = make_block_manager(model);
  prefill(model, kv, 0, prompt, logits.data());
  std::vector<std::vector<float>> out;
  for (int s = 0; s < steps; ++s) {
    const int32_t token = argmax(logits.data(), V), position = static_cast<int32_t>(prompt.size()) + s;
    decode_step(model, kv, {0}, &token, &position, logits.data());
    out.push_back(logits);
  }
  return out;
}

TEST(Model, BatchedDecodeEqualsSeparateRuns) {
  const std::vector<std::vector<int>> prompts = {{1, 17, 200}, {1, 5, 9, 44, 301, 7, 8}, {1, 3, 3, 3, 90, 91, 92, 93, 94, 95, 96, 97}, {1, 250, 2, 77, 310}};
  const int steps = 8;
  DecoderModel model(tiny_model_dir(), options_for(4));
  const int V = model.config().vocab_size;
  std::vector<float> logits(4 * V);
  std::vector<int32_t> next(4), position(4);
  KvBlockManager kv = make_block_manager(model);
  for (int s = 0; s < 4; ++s) {
    prefill(model, kv, s, prompts[s], logits.data() + s * V);
    position[s] = static_cast<int32_t>(prompts[s].size());
  }
  std::vector<std::vector<std::vector<float>>> batched(4);
  for (int step = 0; step < steps; ++step) {
    for (int s = 0; s < 4; ++s) next[s] = argmax(logits.data() + s * V, V);
    decode_step(model, kv, {0, 1, 2, 3}, next.data(), position.data(), logits.data());
    for (int s = 0; s < 4; ++s) {
      batched[s].emplace_back(logits.begin() + s * V, logits.begin() + (s + 1) * V);
      ++position[s];
    }
  }
  for (int s = 0; s < 4; ++s) {
    const auto alone = decode_alone(prompts[s], steps);
    for (int step = 0; step < steps; ++step) {
      float max_abs = 0, max_diff = 0;
      for (int i = 0; i < V; ++i) {
        max_abs = std::max(max_abs, std::fabs(alone[step][i]));
        max_diff = std::max(max_diff, std::fabs(alone[step][i] - batched[s][step][i]));
      }
      EXPECT_LE(max_diff, 1e-6f * max_abs) << "sequence " << s << " step " << step;
    }
  }
}

float max_abs_of(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// A prompt whose first blocks come from the prefix cache (computed by another sequence) gives the logits of
// the same prompt prefilled from scratch in a fresh model.
TEST(Model, CachedPrefixGivesTheLogitsOfAFullPrefill) {
  std::vector<int> shared(40), other(45);
  for (int i = 0; i < 40; ++i) shared[i] = 1 + (i * 37) % 500;
  for (int i = 0; i < 45; ++i) other[i] = i < 32 ? shared[i] : 3 + (i * 11) % 400;  // 2 blocks in common
  DecoderModel model(tiny_model_dir(), options_for(2));
  const int V = model.config().vocab_size;
  KvBlockManager kv(static_cast<int32_t>(model.kv_cache().num_blocks()), 16, /*prefix_caching=*/true);
  std::vector<float> first(V), cached(V), fresh(V);
  prefill(model, kv, 0, shared, first.data());
  kv.cache_full_blocks(0, shared.data(), static_cast<int64_t>(shared.size()));
  ASSERT_EQ(kv.adopt_prefix(1, other.data(), static_cast<int64_t>(other.size())), 32);
  ASSERT_TRUE(kv.reserve(1, static_cast<int64_t>(other.size())));
  const std::vector<int32_t>& table = kv.block_table(1);
  EXPECT_EQ(table[0], kv.block_table(0)[0]);  // the same physical blocks
  const StepSeq tail{table.data(), static_cast<int64_t>(table.size()), 32, 13};
  StepInput step;
  step.tokens = other.data() + 32;
  step.num_tokens = 13;
  step.seqs = &tail;
  step.num_seqs = 1;
  const int32_t last = 12;
  step.logit_rows = &last;
  step.num_logit_rows = 1;
  model.forward(step, cached.data());

  DecoderModel scratch(tiny_model_dir(), options_for(1));
  KvBlockManager kv2 = make_block_manager(scratch);
  prefill(scratch, kv2, 0, other, fresh.data());
  float max_diff = 0;
  for (int i = 0; i < V; ++i) max_diff = std::max(max_diff, std::fabs(cached[i] - fresh[i]));
  EXPECT_LE(max_diff, 1e-6f * max_abs_of(fresh));
  EXPECT_GT(max_abs_of(fresh), 0.0f);
}

// The bf16 KV cache against the exact f32 one, every prompt position and 8 decode steps. bf16 keeps 8
// significant bits: each stored K and V moves by at most 2^-9 relative (0.2%), which moves every attention
// output by about 0.2% of |v| (tests/unit/kv_cache_test.cc bounds one layer at 1e-2 absolute for |v| <= 1).
// Through o_proj, the residual stream and two layers the logits move by a few tenths of a percent of
// their scale (measured: 0.1%); 1% of max|logit| bounds that with margin, and the difference must not be zero (the cache
// really is bf16). Greedy tokens are not compared: a near tie may flip.
TEST(Model, Bf16KvCacheStaysWithinItsRoundingOfTheF32Cache) {
  const std::vector<int> prompt = {1, 5, 9, 44, 301, 7, 8, 100, 200, 300, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26};
  std::vector<std::vector<float>> runs;
  for (const KvCacheDType dtype : {KvCacheDType::kF32, KvCacheDType::kBF16}) {
    ModelOptions o = options_for(1);
    o.kv_cache_dtype = dtype;
    DecoderModel model(tiny_model_dir(), o);
    const int V = model.config().vocab_size;
    KvBlockManager kv = make_block_manager(model);
    std::vector<float> all(prompt.size() * V), last(V);
    prefill(model, kv, 0, prompt, last.data(), all.data());
    int32_t token = 7;  // fixed inputs, so both runs see the same tokens
    for (int s = 0; s < 8; ++s) {
      const int32_t position = static_cast<int32_t>(prompt.size()) + s;
      decode_step(model, kv, {0}, &token, &position, last.data());
      all.insert(all.end(), last.begin(), last.end());
      token = 11 + 13 * s;
    }
    runs.push_back(all);
  }
  float max_diff = 0;
  for (size_t i = 0; i < runs[0].size(); ++i) max_diff = std::max(max_diff, std::fabs(runs[0][i] - runs[1][i]));
  std::printf("bf16 vs f32 KV cache: max |logit difference| %.3g, max |logit| %.3g\n", max_diff, max_abs_of(runs[0]));
  EXPECT_LE(max_diff, 0.01f * max_abs_of(runs[0]));
  EXPECT_GT(max_diff, 0.0f);
}

TEST(Model, GenerateStopsEachSequenceOnItsOwn) {
  DecoderModel model(tiny_model_dir(), options_for(2));
  GenerationOptions options;
  options.max_new_tokens = 5;
  options.stop_at_eos = false;
  const GenerationResult r = generate(model, {{1, 2, 3}, {1, 9}}, options);
  ASSERT_EQ(r.new_tokens.size(), 2u);
  EXPECT_EQ(r.new_tokens[0].size(), 5u);
  EXPECT_EQ(r.new_tokens[1].size(), 5u);
  EXPECT_EQ(r.prefill_tokens, 5);
  EXPECT_EQ(r.decode_tokens, 8);  // the first new token comes from the prefill logits
}

// Packed experts (--weights bf16) lie in one arena per layer, back to back in expert order (model/weights.cc,
// kernels::WeightArena): a decode step's experts are then read in address order out of 2 MB pages.
TEST(Model, PackedExpertsOfALayerLieBackToBackInExpertOrder) {
  ModelOptions o = options_for(1);
  o.expert_weights.packed = true;
  o.expert_weights.format = kernels::WeightFormat::kBF16;
  DecoderModel model(tiny_model_dir(), o);
  for (const LayerWeights& l : model.weights().layers) {
    const std::vector<PackedExpert>& p = l.moe.packed;
    ASSERT_EQ(p.size(), static_cast<size_t>(model.config().num_local_experts));
    const uint8_t* at = p[0].w13.data.as<const uint8_t>();
    for (const PackedExpert& e : p) {
      EXPECT_EQ(e.w13.data.as<const uint8_t>(), at);
      at += kernels::WeightArena::bytes_for(e.w13);
      EXPECT_EQ(e.w2.data.as<const uint8_t>(), at);
      at += kernels::WeightArena::bytes_for(e.w2);
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p[0].w13.data.as<const uint8_t>()) % (2 << 20), 0u);
  }
}

TEST(Model, PositionsBeyondTheCacheAreAnError) {
  DecoderModel model(tiny_model_dir(), options_for(1));
  std::vector<float> logits(model.config().vocab_size);
  const int32_t token = 5;
  std::vector<int32_t> table(5, 0);  // covers 80 positions of the pool; the model has 64
  StepSeq seq{table.data(), 5, 64, 1};
  StepInput step;
  step.tokens = &token;
  step.num_tokens = 1;
  step.seqs = &seq;
  step.num_seqs = 1;
  EXPECT_THROW(model.forward(step, logits.data()), Error);
  seq.pos = 63, seq.num_blocks = 3;  // a table too short for its position
  EXPECT_THROW(model.forward(step, logits.data()), Error);
  seq.num_blocks = 5, table[3] = static_cast<int32_t>(model.kv_cache().num_blocks());  // a block outside the pool
  EXPECT_THROW(model.forward(step, logits.data()), Error);
  seq.len = 2;  // rows that do not add up to the step's tokens
  seq.pos = 0;
  EXPECT_THROW(model.forward(step, logits.data()), Error);
}

}  // namespace
}  // namespace moex

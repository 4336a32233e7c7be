// Model-level properties that need no reference: batched decode equals separate runs, and the KV cache
// continues a sequence exactly as a longer prefill would. (Agreement with PyTorch: tests/reference.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/model/mixtral.h"
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
  MixtralModel model(tiny_model_dir(), options_for(1));
  const int V = model.config().vocab_size;
  std::vector<float> logits(V);
  prefill(model, 0, prompt, logits.data());
  std::vector<std::vector<float>> out;
  int32_t slot = 0;
  for (int s = 0; s < steps; ++s) {
    const int32_t token = argmax(logits.data(), V), position = static_cast<int32_t>(prompt.size()) + s;
    StepInput step;
    step.tokens = &token;
    step.seq_slots = &slot;
    step.positions = &position;
    step.num_tokens = 1;
    model.forward(step, logits.data());
    out.push_back(logits);
  }
  return out;
}

TEST(Model, BatchedDecodeEqualsSeparateRuns) {
  const std::vector<std::vector<int>> prompts = {{1, 17, 200}, {1, 5, 9, 44, 301, 7, 8}, {1, 3, 3, 3, 90, 91, 92, 93, 94, 95, 96, 97}, {1, 250, 2, 77, 310}};
  const int steps = 8;
  MixtralModel model(tiny_model_dir(), options_for(4));
  const int V = model.config().vocab_size;
  std::vector<float> logits(4 * V);
  std::vector<int32_t> next(4), position(4), slots = {0, 1, 2, 3};
  for (int s = 0; s < 4; ++s) {
    prefill(model, s, prompts[s], logits.data() + s * V);
    position[s] = static_cast<int32_t>(prompts[s].size());
  }
  std::vector<std::vector<std::vector<float>>> batched(4);
  for (int step = 0; step < steps; ++step) {
    for (int s = 0; s < 4; ++s) next[s] = argmax(logits.data() + s * V, V);
    StepInput input;
    input.tokens = next.data();
    input.seq_slots = slots.data();
    input.positions = position.data();
    input.num_tokens = 4;
    model.forward(input, logits.data());
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

TEST(Model, GenerateStopsEachSequenceOnItsOwn) {
  MixtralModel model(tiny_model_dir(), options_for(2));
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

TEST(Model, PositionsBeyondTheCacheAreAnError) {
  MixtralModel model(tiny_model_dir(), options_for(1));
  std::vector<float> logits(model.config().vocab_size);
  const int32_t token = 5, slot = 0, position = 64;
  StepInput step;
  step.tokens = &token;
  step.seq_slots = &slot;
  step.positions = &position;
  step.num_tokens = 1;
  EXPECT_THROW(model.forward(step, logits.data()), Error);
}

}  // namespace
}  // namespace moex

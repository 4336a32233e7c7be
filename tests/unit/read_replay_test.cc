// The replay probe (kernels::stream_read_steps) reads exactly the ranges it is given, every byte once, and
// the recorder (tools/lib/read_replay.h) gives it exactly the weight bytes a decode step reads, counted here
// from the config's arithmetic and the packed layout (docs/kernels.md), not from the model's own totals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/threads.h"
#include "tools/lib/probes.h"
#include "moex/runtime/generation.h"
#include "tools/lib/read_replay.h"
#include "tools/lib/synthetic.h"

namespace moex {
namespace {

// A buffer of 1000.0f with the ranges' floats set to 1.0f: the checksum counts the range bytes read
// (exactly: small integers), and a byte read outside the ranges adds 1000.
TEST(ReplayProbe, ReadsExactlyTheRangesGiven) {
  std::vector<float> buffer(1 << 20, 1000.0f);
  const std::vector<std::pair<size_t, size_t>> ranges = {  // (offset, bytes), 4-byte aligned; tails of every kind
      {0, 4}, {64, 60}, {200, 64}, {1024, 68}, {4096, 252}, {8192, 256}, {16384 + 4, 260}, {40000, 4100},
      {100000, 65536 + 12}, {400000, 1 << 20}, {1600000, 333 * 4}};
  std::vector<kernels::StepReads> steps(3);
  size_t expected = 0;
  for (auto [offset, bytes] : ranges) {
    for (size_t i = 0; i < bytes / 4; ++i) buffer[offset / 4 + i] = 1.0f;
    for (auto& s : steps) s.push_back({reinterpret_cast<const uint8_t*>(buffer.data()) + offset, bytes});
    expected += steps.size() * bytes;
  }
  std::reverse(steps[1].begin(), steps[1].end());  // order does not change what is read
  for (bool x86 : {true, false}) {
    if (x86 && !use_x86_kernels()) continue;
    const bool was = x86_kernels_allowed();
    set_use_x86_kernels(x86);
    for (int threads : {1, 2, 3})
      for (kernels::ReplaySplit split : {kernels::ReplaySplit::kEachRange, kernels::ReplaySplit::kEachStep}) {
        set_num_threads(threads);
        const kernels::ReplayResult r = kernels::stream_read_steps(steps, split);
        const int how = static_cast<int>(split);
        EXPECT_EQ(r.bytes, expected) << "threads " << threads << " x86 " << x86 << " split " << how;
        EXPECT_EQ(r.checksum, static_cast<float>(expected / 4)) << "threads " << threads << " x86 " << x86 << " split " << how;
      }
    set_use_x86_kernels(was);
  }
  set_num_threads(0);
  EXPECT_EQ(kernels::stream_read_steps({}).bytes, 0u);
}

std::string model_dir(const std::string& preset) {
  const std::string out = (std::filesystem::temp_directory_path() / ("moex_read_replay_" + preset)).string();
  if (!std::filesystem::exists(out + "/config.json")) {
    const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset " + preset + " --seed 3 --out " + out + " > /dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  return out;
}

// Bytes one batch-1 step reads, from the config: per layer two norms, q/k/v/o, (q/k norms), the router and
// k experts; the embedding row, the final norm and lm_head. bf16 as stored: 2 bytes a weight. int8 packed
// experts (docs/kernels.md, packed layouts): panels of 64 output lanes (gate/up: 32 of w1 and 32 of w3),
// one s8 code per lane and K, one f32 scale per lane.
double config_step_bytes(const ModelConfig& c, bool int8_experts) {
  const double d = c.hidden_size, I = c.intermediate_size, hd = c.head_dim, H = c.num_attention_heads,
               KV = c.num_key_value_heads, V = c.vocab_size, E = c.num_local_experts, k = c.num_experts_per_tok;
  const double qk_norm = c.qk_norm == QkNorm::kNone ? 0.0 : 2.0 * hd;
  const double dense_per_layer = 2 * d + d * H * hd + 2 * d * KV * hd + H * hd * d + qk_norm + E * d;
  double expert = 3 * I * d * 2;
  if (int8_experts) {
    const double p13 = std::ceil(I / 32), p2 = std::ceil(d / 64);
    expert = p13 * 64 * (d + 4) + p2 * 64 * (I + 4);
  }
  return d * 2 + c.num_hidden_layers * (dense_per_layer * 2 + k * expert) + d * 2 + V * d * 2;
}

// The same without the experts and the embedding row: what every step reads again.
double config_step_bytes_without_experts(const ModelConfig& c) {
  ModelConfig none = c;
  none.num_experts_per_tok = 0;
  return config_step_bytes(none, false) - c.hidden_size * 2.0;
}

void check_recorded_steps(const std::string& preset, bool int8_experts) {
  ModelOptions o;
  o.max_batch = 1;
  o.max_seq_len = 16;
  o.max_step_tokens = 8;
  if (int8_experts) {
    o.expert_weights.packed = true;
    o.expert_weights.format = kernels::WeightFormat::kInt8;
  }
  DecoderModel model(model_dir(preset), o);
  const ModelConfig& c = model.config();
  const std::vector<std::vector<int>> prompts = synthetic_prompts(1, 1, c.vocab_size);
  tools::StepReadRecorder recorder(model, false);
  GenerationOptions g;
  g.max_new_tokens = 5;
  g.stop_at_eos = false;
  g.after_forward = recorder.on_step();
  const GenerationResult result = generate(model, prompts, g);
  ASSERT_EQ(recorder.steps().size(), 5u);  // the 1-token prompt's call and four decode steps
  const double expected = config_step_bytes(c, int8_experts);
  const size_t row = c.hidden_size * 2;
  const auto* embed = static_cast<const uint8_t*>(model.weights().embed.data);
  for (size_t s = 0; s < recorder.steps().size(); ++s) {
    const kernels::StepReads& step = recorder.steps()[s];
    EXPECT_EQ(static_cast<double>(tools::bytes_of(step)), expected) << preset << " step " << s;
    // The step's embedding row is its input token's: the prompt's, then the token sampled before.
    const int input = s == 0 ? prompts[0][0] : result.new_tokens[0][s - 1];
    ASSERT_FALSE(step.empty());
    EXPECT_EQ(step[0].data, embed + row * input) << s;
    EXPECT_EQ(step[0].bytes, row);
    // No range twice within a step.
    std::set<const void*> seen;
    for (const kernels::ByteRange& r : step) EXPECT_TRUE(seen.insert(r.data).second) << preset << " step " << s;
  }
  // Everything but the experts and the embedding row repeats from step to step; the run's distinct bytes
  // are at least one step's and at most all of them.
  const tools::RepeatStats r = tools::repeat_stats(recorder.steps());
  EXPECT_EQ(r.step_bytes, expected);
  const double experts_and_row = expected - config_step_bytes_without_experts(c);
  EXPECT_GE(r.repeated_bytes, expected - experts_and_row) << preset;
  EXPECT_LE(r.repeated_bytes, expected) << preset;
  EXPECT_GE(r.distinct_bytes, expected);
  EXPECT_LE(r.distinct_bytes, 5 * expected);
  // The probe streams exactly the recorded bytes.
  EXPECT_EQ(static_cast<double>(kernels::stream_read_steps(recorder.steps()).bytes), 5 * expected);
}

TEST(ReplayProbe, RecordsTheWeightBytesOfEachStep) {
  check_recorded_steps("tiny", false);
  check_recorded_steps("tiny", true);
  check_recorded_steps("qwen3-moe-tiny", false);  // 8 of 32 experts, per-head q/k norm
}

}  // namespace
}  // namespace moex

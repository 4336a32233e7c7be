// What a request's per-token work costs beside the model: sampling one row of 32000 logits each way
// (against argmax, the one pass over the row every mode makes), one token of text streaming with a stop
// string, a chat template render, a histogram observation.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "moex/text/chat_template.h"
#include "moex/runtime/metrics.h"
#include "moex/runtime/sampler.h"

namespace moex {
namespace {

constexpr int kVocab = 32000;

const std::vector<float>& logits() {
  static const std::vector<float> row = [] {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> v(kVocab);
    for (float& x : v) x = normal(rng);
    return v;
  }();
  return row;
}

void BM_Argmax(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(argmax(logits().data(), kVocab));
}
BENCHMARK(BM_Argmax);

void run(benchmark::State& state, SamplerOptions options, bool penalties) {
  Sampler sampler(options);
  TokenCounts counts;
  if (penalties)
    for (int i = 0; i < 128; ++i) counts.add((i * 7919) % kVocab);
  SampledToken out;
  for (auto _ : state) {
    sampler.sample(logits().data(), kVocab, &counts, &out);
    benchmark::DoNotOptimize(out.token);
  }
}

void BM_Greedy(benchmark::State& state) { run(state, {}, false); }
void BM_GreedyPenalties(benchmark::State& state) {
  SamplerOptions o;
  o.presence_penalty = 0.5f;
  o.frequency_penalty = 0.5f;
  run(state, o, true);
}
void BM_GreedyTopLogprobs20(benchmark::State& state) {
  SamplerOptions o;
  o.logprobs = true;
  o.top_logprobs = 20;
  run(state, o, false);
}
void BM_Temperature(benchmark::State& state) {
  SamplerOptions o;
  o.temperature = 1.0f;
  run(state, o, false);
}
void BM_TopK50(benchmark::State& state) {
  SamplerOptions o;
  o.temperature = 1.0f;
  o.top_k = 50;
  run(state, o, false);
}
void BM_TopP09(benchmark::State& state) {
  SamplerOptions o;
  o.temperature = 1.0f;
  o.top_p = 0.9f;
  run(state, o, false);
}
BENCHMARK(BM_Greedy);
BENCHMARK(BM_GreedyPenalties);
BENCHMARK(BM_GreedyTopLogprobs20);
BENCHMARK(BM_Temperature);
BENCHMARK(BM_TopK50);
BENCHMARK(BM_TopP09);

void BM_MixtralChatTemplateRender(benchmark::State& state) {
  const ChatTemplate t(kMixtralChatTemplate, "<s>", "</s>");
  const std::vector<ChatMessage> messages = {{"system", "You are a helpful assistant."},
                                             {"user", "What is a mixture of experts?"},
                                             {"assistant", "A layer that routes each token to a few experts."},
                                             {"user", "And why is it fast?"}};
  for (auto _ : state) benchmark::DoNotOptimize(t.render(messages));
}
BENCHMARK(BM_MixtralChatTemplateRender);

void BM_HistogramObserve(benchmark::State& state) {
  metrics::Histogram h(metrics::kTtftBuckets);
  double x = 0.0;
  for (auto _ : state) {
    h.observe(x);
    x = x > 10 ? 0 : x + 0.013;
  }
}
BENCHMARK(BM_HistogramObserve);

}  // namespace
}  // namespace moex

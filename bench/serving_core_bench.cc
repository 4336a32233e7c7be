// The serving core's costs: one scheduler step for 64 decoding sequences, and decode attention over the
// paged bf16 cache against the contiguous fp32 cache's attention (kernels::attention_one_token), one thread,
// Mixtral's attention shape (32 query heads, 8 KV heads, head_dim 128).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/base/threads.h"
#include "moex/kernels/ops.h"
#include "moex/kernels/paged_attention.h"
#include "moex/runtime/kv_block_manager.h"
#include "moex/runtime/scheduler.h"

namespace {

// schedule() + complete() of one decode step of 64 running sequences (prompts of 100 tokens, prefix
// caching on); the sequences are restarted, untimed, before they would finish.
void BM_ScheduleDecodeStep64(benchmark::State& state) {
  constexpr int kSeqs = 64, kPrompt = 100, kMaxNew = 4000;
  std::vector<int32_t> sampled(kSeqs, 7);
  auto start = [&](std::unique_ptr<moex::KvBlockManager>& blocks, std::unique_ptr<moex::Scheduler>& scheduler) {
    scheduler.reset();
    blocks = std::make_unique<moex::KvBlockManager>(kSeqs * (kPrompt + kMaxNew) / 16 + kSeqs, 16);
    scheduler = std::make_unique<moex::Scheduler>(moex::SchedulerOptions{kSeqs, 8192}, *blocks);
    for (int s = 0; s < kSeqs; ++s) {
      std::vector<int32_t> prompt(kPrompt);
      std::iota(prompt.begin(), prompt.end(), s * kPrompt);
      scheduler->add(s, prompt, kMaxNew);
    }
    scheduler->complete(scheduler->schedule(), sampled.data());  // the prefill step
  };
  std::unique_ptr<moex::KvBlockManager> blocks;
  std::unique_ptr<moex::Scheduler> scheduler;
  start(blocks, scheduler);
  int steps = 0;
  for (auto _ : state) {
    if (++steps == kMaxNew - 2) {
      state.PauseTiming();
      start(blocks, scheduler);
      steps = 0;
      state.ResumeTiming();
    }
    const moex::StepPlan& plan = scheduler->schedule();
    scheduler->complete(plan, sampled.data());
    benchmark::DoNotOptimize(plan.num_tokens);
  }
}
BENCHMARK(BM_ScheduleDecodeStep64);

constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128;

void BM_DecodeAttentionContiguousF32(benchmark::State& state) {
  const int64_t length = state.range(0);
  moex::set_num_threads(1);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1, 1);
  std::vector<float> q(kHeads * kHeadDim), k(kKvHeads * length * kHeadDim), v(k.size()), out(q.size()), scratch(length);
  for (std::vector<float>* x : {&q, &k, &v})
    for (float& e : *x) e = uniform(rng);
  for (auto _ : state) {
    moex::kernels::attention_one_token(q.data(), k.data(), v.data(), kHeads, kKvHeads, kHeadDim, length, length,
                                       out.data(), scratch.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * 2 * k.size() * sizeof(float));
}
BENCHMARK(BM_DecodeAttentionContiguousF32)->Arg(256)->Arg(1024)->Arg(4096);

void BM_DecodeAttentionPagedBf16(benchmark::State& state) {
  const int64_t length = state.range(0);
  moex::set_num_threads(1);
  moex::kernels::PagedKvLayout layout;
  layout.layers = 1;
  layout.kv_heads = kKvHeads;
  layout.head_dim = kHeadDim;
  layout.num_blocks = (length + 15) / 16;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1, 1);
  std::vector<uint16_t> pool(layout.num_blocks * layout.block_elems());
  for (uint16_t& e : pool) e = moex::f32_to_bf16(uniform(rng));
  std::vector<int32_t> table(layout.num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<float> q(kHeads * kHeadDim), out(q.size());
  for (float& e : q) e = uniform(rng);
  std::vector<float> scratch(moex::kernels::paged_attention_scratch_floats(layout, kHeads));
  const moex::kernels::PagedAttentionSeq seq{table.data(), 0, 1, length - 1};
  for (auto _ : state) {
    moex::kernels::paged_attention(layout, pool.data(), 0, &seq, 1, q.data(), kHeads, out.data(), scratch.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * 2 * kKvHeads * length * kHeadDim * sizeof(uint16_t));
}
BENCHMARK(BM_DecodeAttentionPagedBf16)->Arg(256)->Arg(1024)->Arg(4096);

}  // namespace

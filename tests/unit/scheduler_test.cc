// The continuous-batching scheduler, driven without a model: steps are planned, "run" (a simulated KV
// cache records which token each position of each block holds) and completed with made-up samples.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "moex/base/error.h"
#include "moex/runtime/kv_block_manager.h"
#include "moex/runtime/scheduler.h"

namespace moex {
namespace {

std::vector<int32_t> tokens_from(int n, int start) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

// Runs plans as a model would, on a simulated cache: [block][row] = the token written there. Before a
// sequence computes, the positions it attends to ([0, begin)) must hold its own tokens, whichever blocks
// (shared prefix or not) its table maps them to; then it writes [begin, end).
class FakeModel {
 public:
  explicit FakeModel(const KvBlockManager& blocks)
      : bs_(blocks.block_size()), cache_(static_cast<size_t>(blocks.num_blocks()) * bs_, -1) {}

  // Returns one sampled token per planned sequence (its id x 1000 + its output count, so outputs are checkable).
  std::vector<int32_t> run(const StepPlan& plan, const Scheduler& scheduler) {
    std::vector<int32_t> sampled;
    for (const ScheduledSeq& s : plan.seqs) {
      EXPECT_GE(s.num_blocks * bs_, s.end) << "sequence " << s.id << " table too short";
      for (int64_t p = 0; p < s.begin; ++p)
        EXPECT_EQ(cache_[s.block_table[p / bs_] * bs_ + p % bs_], s.tokens[p])
            << "sequence " << s.id << " position " << p << " holds another token";
      for (int64_t p = s.begin; p < s.end; ++p) cache_[s.block_table[p / bs_] * bs_ + p % bs_] = s.tokens[p];
      const int64_t generated = scheduler.num_generated(s.id);
      sampled.push_back(static_cast<int32_t>(s.id * 1000 + generated));
    }
    return sampled;
  }

 private:
  int64_t bs_;
  std::vector<int32_t> cache_;
};

TEST(Scheduler, LongPromptIsChunkedWhileOthersDecodeEveryStep) {
  KvBlockManager blocks(64, 16);
  Scheduler scheduler({/*max_num_seqs=*/8, /*max_step_tokens=*/32}, blocks);
  FakeModel model(blocks);
  scheduler.add(1, tokens_from(4, 10), 100);
  scheduler.add(2, tokens_from(5, 20), 100);
  {
    const StepPlan& plan = scheduler.schedule();  // both prompts in one step
    ASSERT_EQ(plan.seqs.size(), 2u);
    EXPECT_EQ(plan.num_tokens, 9);
    scheduler.complete(plan, model.run(plan, scheduler).data());
  }
  scheduler.add(3, tokens_from(100, 1000), 5);
  int64_t prefilled = 0, steps = 0;
  while (prefilled < 100) {
    const StepPlan& plan = scheduler.schedule();
    ASSERT_EQ(plan.seqs.size(), 3u);
    EXPECT_LE(plan.num_tokens, 32);
    EXPECT_EQ(plan.seqs[0].id, 1);  // the decoders, one token each, every step
    EXPECT_EQ(plan.seqs[0].end - plan.seqs[0].begin, 1);
    EXPECT_EQ(plan.seqs[1].id, 2);
    EXPECT_EQ(plan.seqs[1].end - plan.seqs[1].begin, 1);
    const ScheduledSeq& chunk = plan.seqs[2];
    EXPECT_EQ(chunk.id, 3);
    EXPECT_EQ(chunk.begin, prefilled);  // chunks continue where the last stopped
    EXPECT_EQ(chunk.end - chunk.begin, std::min<int64_t>(30, 100 - prefilled));
    EXPECT_EQ(chunk.sample, chunk.end == 100);
    prefilled = chunk.end;
    scheduler.complete(plan, model.run(plan, scheduler).data());
    ++steps;
  }
  EXPECT_EQ(steps, 4);  // 30 + 30 + 30 + 10
  EXPECT_EQ(scheduler.num_generated(1), 5);
  EXPECT_EQ(scheduler.num_generated(3), 1);
  const StepPlan& plan = scheduler.schedule();  // now three decoders
  EXPECT_EQ(plan.num_tokens, 3);
}

TEST(Scheduler, PreemptsTheNewestWhenTheCacheIsFullAndResumesItLater) {
  KvBlockManager blocks(6, 16, /*prefix_caching=*/false);  // 96 positions
  Scheduler scheduler({8, 256}, blocks);
  FakeModel model(blocks);
  scheduler.add(1, tokens_from(40, 100), 30);  // 3 blocks for the prompt, 5 at the end
  scheduler.add(2, tokens_from(40, 500), 30);
  std::vector<int32_t> outputs_of_2;
  bool preempted = false, resumed = false;
  int64_t steps = 0;
  while (!scheduler.idle()) {
    ASSERT_LT(++steps, 500);
    const StepPlan& plan = scheduler.schedule();
    for (SeqId id : plan.preempted) {
      EXPECT_EQ(id, 2);  // the newest, never the oldest
      EXPECT_FALSE(preempted);
      preempted = true;
      EXPECT_EQ(scheduler.state(2), SeqState::kWaiting);
      EXPECT_EQ(scheduler.num_running(), 1);
      outputs_of_2.assign(scheduler.tokens(2).begin() + 40, scheduler.tokens(2).end());
      EXPECT_FALSE(outputs_of_2.empty());
    }
    for (const ScheduledSeq& s : plan.seqs) {
      if (s.id == 2 && preempted && scheduler.num_generated(2) == static_cast<int64_t>(outputs_of_2.size()) &&
          s.begin == 0) {
        // Resumed: recomputes its prompt and what it had generated, then samples the next token.
        EXPECT_EQ(s.end, 40 + static_cast<int64_t>(outputs_of_2.size()));
        EXPECT_TRUE(s.sample);
        EXPECT_EQ(scheduler.num_running(), 1);  // only after 1 finished
        resumed = true;
      }
    }
    if (plan.seqs.empty()) continue;
    scheduler.complete(plan, model.run(plan, scheduler).data());
    if (scheduler.num_generated(2) == 30) {
      const std::vector<int32_t> all = scheduler.tokens(2);
      for (size_t i = 0; i < outputs_of_2.size(); ++i) EXPECT_EQ(all[40 + i], outputs_of_2[i]);  // kept
      for (int64_t i = 0; i < 30; ++i) EXPECT_EQ(all[40 + i], 2 * 1000 + i);
    }
  }
  EXPECT_TRUE(preempted);
  EXPECT_TRUE(resumed);
  EXPECT_EQ(scheduler.state(2), SeqState::kUnknown);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
}

TEST(Scheduler, CancellationFreesBlocksAtTheNextStep) {
  KvBlockManager blocks(16, 16);
  Scheduler scheduler({4, 64}, blocks);
  FakeModel model(blocks);
  scheduler.add(1, tokens_from(40, 0), 10);  // 3 blocks
  scheduler.add(2, tokens_from(10, 100), 10);  // 1 block
  const StepPlan& first = scheduler.schedule();
  scheduler.complete(first, model.run(first, scheduler).data());
  EXPECT_EQ(blocks.num_used_blocks(), 4);
  EXPECT_TRUE(scheduler.cancel(1));
  EXPECT_EQ(blocks.num_used_blocks(), 4);  // not before the next step
  const StepPlan& second = scheduler.schedule();
  EXPECT_EQ(second.released, std::vector<SeqId>{1});
  ASSERT_EQ(second.seqs.size(), 1u);
  EXPECT_EQ(second.seqs[0].id, 2);
  EXPECT_EQ(blocks.num_used_blocks(), 1);
  EXPECT_EQ(scheduler.state(1), SeqState::kUnknown);
  scheduler.complete(second, model.run(second, scheduler).data());
  // A waiting request is cancelled too.
  scheduler.add(3, tokens_from(5, 7), 3);
  EXPECT_TRUE(scheduler.cancel(3));
  EXPECT_FALSE(scheduler.cancel(42));
  const StepPlan& third = scheduler.schedule();
  EXPECT_EQ(third.released, std::vector<SeqId>{3});
  EXPECT_EQ(scheduler.num_waiting(), 0);
}

TEST(Scheduler, FinishedSequenceFreesItsBlocksAtTheNextStep) {
  KvBlockManager blocks(8, 16, /*prefix_caching=*/false);
  Scheduler scheduler({4, 64}, blocks);
  FakeModel model(blocks);
  scheduler.add(1, tokens_from(20, 0), /*max_new_tokens=*/2);
  // FakeModel samples 2000, 2001, 2002, ... for sequence 2: its stop token (EOS) is its third.
  scheduler.add(2, tokens_from(5, 50), 10, /*stop_token=*/2002);
  for (int step = 0; step < 2; ++step) {  // prefill samples the first token, one decode the second
    const StepPlan& plan = scheduler.schedule();
    EXPECT_TRUE(plan.released.empty());
    const std::vector<FinishedSeq> finished = scheduler.complete(plan, model.run(plan, scheduler).data());
    if (step == 0) EXPECT_TRUE(finished.empty());
    if (step == 1) {  // max_new_tokens
      ASSERT_EQ(finished.size(), 1u);
      EXPECT_EQ(finished[0].id, 1);
      EXPECT_EQ(finished[0].reason, FinishReason::kLength);
    }
  }
  EXPECT_EQ(scheduler.state(1), SeqState::kFinishing);
  EXPECT_EQ(scheduler.tokens(1).size(), 22u);
  EXPECT_EQ(blocks.num_used_blocks(), 3);  // still held until the next step
  const StepPlan& plan = scheduler.schedule();
  EXPECT_EQ(plan.released, std::vector<SeqId>{1});
  EXPECT_EQ(blocks.num_used_blocks(), 1);
  // The stop token: finished by complete() as well, freed at the next step.
  const std::vector<FinishedSeq> finished = scheduler.complete(plan, model.run(plan, scheduler).data());
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_EQ(finished[0].id, 2);
  EXPECT_EQ(finished[0].reason, FinishReason::kStop);
  EXPECT_EQ(scheduler.tokens(2).back(), 2002);
  EXPECT_EQ(scheduler.schedule().released, std::vector<SeqId>{2});
  EXPECT_EQ(blocks.num_used_blocks(), 0);
  EXPECT_TRUE(scheduler.idle());
  EXPECT_FALSE(scheduler.cancel(2));  // forgotten once released
}

TEST(Scheduler, AdmitsInArrivalOrder) {
  KvBlockManager blocks(64, 16);
  Scheduler scheduler({/*max_num_seqs=*/2, 64}, blocks);
  FakeModel model(blocks);
  for (SeqId id : {5, 3, 9, 1, 7}) scheduler.add(id, tokens_from(3, int(id) * 10), 2);
  std::vector<SeqId> admitted;
  std::set<SeqId> seen;
  while (!scheduler.idle()) {
    const StepPlan& plan = scheduler.schedule();
    EXPECT_LE(plan.seqs.size(), 2u);
    for (const ScheduledSeq& s : plan.seqs)
      if (seen.insert(s.id).second) admitted.push_back(s.id);
    scheduler.complete(plan, model.run(plan, scheduler).data());
  }
  EXPECT_EQ(admitted, (std::vector<SeqId>{5, 3, 9, 1, 7}));
}

TEST(Scheduler, HeadOfTheQueueThatDoesNotFitBlocksLaterArrivals) {
  KvBlockManager blocks(8, 16);
  Scheduler scheduler({8, 256}, blocks);
  FakeModel model(blocks);
  scheduler.add(1, tokens_from(100, 0), 10);  // 7 blocks
  const StepPlan& first = scheduler.schedule();
  scheduler.complete(first, model.run(first, scheduler).data());
  scheduler.add(2, tokens_from(40, 500), 2);  // 3 blocks: does not fit beside 1
  scheduler.add(3, tokens_from(3, 900), 2);   // would fit, but arrived later
  const StepPlan& second = scheduler.schedule();
  ASSERT_EQ(second.seqs.size(), 1u);
  EXPECT_EQ(second.seqs[0].id, 1);
  EXPECT_EQ(scheduler.num_waiting(), 2);
}

TEST(Scheduler, RefusesRequestsThatCouldNeverFit) {
  KvBlockManager blocks(4, 16);
  Scheduler scheduler({4, 64}, blocks);
  EXPECT_THROW(scheduler.add(1, {}, 4), Error);
  EXPECT_THROW(scheduler.add(1, tokens_from(60, 0), 6), Error);  // 65 positions > 64
  scheduler.add(1, tokens_from(60, 0), 5);                        // 64: fits alone
  EXPECT_THROW(scheduler.add(1, tokens_from(3, 0), 5), Error);     // id in use
  EXPECT_THROW(Scheduler({8, 4}, blocks), Error);                  // fewer tokens than sequences
}

TEST(Scheduler, RandomWorkloadWithCancellationsEndsWithEveryBlockFree) {
  KvBlockManager blocks(48, 16);  // 768 positions: forces preemption
  const SchedulerOptions options{/*max_num_seqs=*/12, /*max_step_tokens=*/96};
  Scheduler scheduler(options, blocks);
  FakeModel model(blocks);
  std::mt19937 rng(2026);
  // Prompts share a few system prefixes, so the prefix cache is exercised (the fake model checks that a
  // shared block holds the right tokens).
  std::vector<std::vector<int32_t>> prefixes;
  for (int p = 0; p < 4; ++p) prefixes.push_back(tokens_from(16 * (p + 1), 10000 * (p + 1)));
  std::map<SeqId, int64_t> max_tokens;
  int64_t next_id = 0, steps = 0, preemptions = 0, cancelled = 0, finished = 0;
  std::vector<SeqId> live;
  while (next_id < 200 || !scheduler.idle()) {
    ASSERT_LT(++steps, 20000);
    for (int arrivals = rng() % 3; arrivals > 0 && next_id < 200; --arrivals) {
      std::vector<int32_t> prompt;
      if (rng() % 2) prompt = prefixes[rng() % prefixes.size()];
      for (int n = 1 + rng() % 120; n > 0; --n) prompt.push_back(static_cast<int32_t>(rng() % 50));
      const int64_t max_new = 1 + rng() % 60;
      max_tokens[next_id] = max_new;
      scheduler.add(next_id, prompt, max_new);
      live.push_back(next_id++);
    }
    if (!live.empty() && rng() % 10 == 0) {
      const SeqId victim = live[rng() % live.size()];
      if (scheduler.state(victim) != SeqState::kFinishing && scheduler.cancel(victim)) ++cancelled;
    }
    const StepPlan& plan = scheduler.schedule();
    preemptions += static_cast<int64_t>(plan.preempted.size());
    for (SeqId id : plan.released) live.erase(std::find(live.begin(), live.end(), id));
    EXPECT_LE(plan.num_tokens, options.max_step_tokens);
    EXPECT_LE(static_cast<int64_t>(plan.seqs.size()), options.max_num_seqs);
    for (size_t i = 1; i < plan.seqs.size(); ++i) EXPECT_NE(plan.seqs[i - 1].id, plan.seqs[i].id);
    if (plan.seqs.empty()) continue;
    const std::vector<int32_t> sampled = model.run(plan, scheduler);
    scheduler.complete(plan, sampled.data());
    for (const ScheduledSeq& s : plan.seqs)
      if (scheduler.state(s.id) == SeqState::kFinishing && scheduler.num_generated(s.id) == max_tokens[s.id])
        ++finished;
  }
  EXPECT_EQ(blocks.num_used_blocks(), 0);
  EXPECT_EQ(blocks.num_free_blocks(), blocks.num_blocks());
  for (int32_t b = 0; b < blocks.num_blocks(); ++b) EXPECT_EQ(blocks.ref_count(b), 0);
  std::printf("steps %ld preemptions %ld cancelled %ld finished %ld\n", long(steps), long(preemptions), long(cancelled), long(finished));
  EXPECT_GT(preemptions, 0);  // the workload did fill the cache
  EXPECT_GT(cancelled, 0);
  EXPECT_GT(finished, 100);
}

}  // namespace
}  // namespace moex

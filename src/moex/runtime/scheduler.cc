#include "moex/runtime/scheduler.h"

#include <algorithm>

#include "moex/base/error.h"

namespace moex {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kAbort: return "abort";
  }
  return "abort";
}

Scheduler::Scheduler(const SchedulerOptions& options, KvBlockManager& blocks) : options_(options), blocks_(blocks) {
  MOEX_CHECK_INPUT(options.max_num_seqs > 0, "--max-num-seqs must be positive, got ", options.max_num_seqs);
  MOEX_CHECK_INPUT(options.max_step_tokens >= options.max_num_seqs, "--max-step-tokens (",
                   options.max_step_tokens, ") must be at least --max-num-seqs (", options.max_num_seqs,
                   "): every running sequence decodes one token per step");
  running_.reserve(options.max_num_seqs);
  plan_.seqs.reserve(options.max_num_seqs);
}

void Scheduler::add(SeqId id, std::vector<int32_t> prompt, int64_t max_new_tokens, int32_t stop_token) {
  MOEX_CHECK(!prompt.empty() && max_new_tokens >= 1 && seqs_.count(id) == 0, "request ", id,
             ": an empty prompt, max_tokens < 1 or an id in use reached the scheduler");
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  const int64_t capacity = int64_t{blocks_.num_blocks()} * blocks_.block_size();
  // The last sampled token is never fed back, so prompt + max_new - 1 positions reach the cache.
  MOEX_CHECK(prompt_len + max_new_tokens - 1 <= capacity, "request ", id, ": ", prompt_len, " prompt tokens + max_tokens ",
             max_new_tokens, " exceed the KV cache (", capacity, " positions) and reached the scheduler");
  Sequence& seq = seqs_[id];
  seq.id = id;
  seq.arrival = next_arrival_++;
  seq.prompt_len = prompt_len;
  seq.max_new_tokens = max_new_tokens;
  seq.stop_token = stop_token;
  seq.tokens = std::move(prompt);
  seq.tokens.reserve(prompt_len + max_new_tokens);  // complete() appends without reallocating
  waiting_.push_back(&seq);                         // the newest arrival: FCFS order is kept
}

bool Scheduler::cancel(SeqId id) {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  if (it->second.state != SeqState::kFinishing) {
    it->second.state = SeqState::kFinishing;
    to_release_.push_back(&it->second);
  }
  return true;
}

SeqState Scheduler::state(SeqId id) const {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? SeqState::kUnknown : it->second.state;
}

const std::vector<int32_t>& Scheduler::tokens(SeqId id) const {
  static const std::vector<int32_t> empty;
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? empty : it->second.tokens;
}

int64_t Scheduler::num_generated(SeqId id) const {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second.generated();
}

int64_t Scheduler::num_preemptions(SeqId id) const {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second.preemptions;
}

void Scheduler::release(Sequence* seq) {
  blocks_.free(seq->id);
  if (auto r = std::find(running_.begin(), running_.end(), seq); r != running_.end()) running_.erase(r);
  if (auto w = std::find(waiting_.begin(), waiting_.end(), seq); w != waiting_.end()) waiting_.erase(w);
  plan_.released.push_back(seq->id);
  seqs_.erase(seq->id);
}

// Frees every block and sends the sequence back to waiting, in its arrival place; it recomputes prompt and
// generated tokens when admitted again (recompute rather than swap: a CPU cache has no slower tier to swap to).
void Scheduler::preempt(Sequence* seq) {
  blocks_.free(seq->id);
  running_.erase(std::find(running_.begin(), running_.end(), seq));
  seq->computed = 0;
  seq->state = SeqState::kWaiting;
  ++seq->preemptions;
  const auto at = std::upper_bound(waiting_.begin(), waiting_.end(), seq,
                                   [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; });
  waiting_.insert(at, seq);
  plan_.preempted.push_back(seq->id);
}

void Scheduler::plan_seq(Sequence* seq, int64_t take) {
  ScheduledSeq s;
  s.id = seq->id;
  s.begin = seq->computed;
  s.end = seq->computed + take;
  s.sample = s.end == static_cast<int64_t>(seq->tokens.size());
  plan_.seqs.push_back(s);
  plan_.num_tokens += take;
}

// The head of the waiting queue starts (or resumes) with the cached prefix of its tokens and a first chunk
// of up to `budget` tokens, if the blocks for that chunk are free.
bool Scheduler::admit(Sequence* seq, int64_t budget) {
  const int64_t len = static_cast<int64_t>(seq->tokens.size());
  const KvBlockManager::PrefixProbe probe = blocks_.probe_prefix(seq->tokens.data(), len);
  const int64_t cached = int64_t{probe.blocks} * blocks_.block_size();
  const int64_t take = std::min(len - cached, budget);
  const int64_t new_blocks = blocks_.blocks_for(cached + take) - probe.blocks;
  if (new_blocks > blocks_.num_free_blocks() - probe.evictable) return false;
  MOEX_CHECK(blocks_.adopt_prefix(seq->id, seq->tokens.data(), len) == cached, "prefix probe and adoption differ");
  MOEX_CHECK(blocks_.reserve(seq->id, cached + take), "blocks counted free are not");
  seq->computed = cached;
  seq->state = SeqState::kRunning;
  running_.push_back(seq);  // admitted in arrival order, after every running sequence that arrived earlier
  std::sort(running_.begin(), running_.end(), [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; });
  plan_seq(seq, take);
  return true;
}

const StepPlan& Scheduler::schedule() {
  plan_.clear();
  for (Sequence* seq : to_release_) release(seq);
  to_release_.clear();

  // Running sequences, oldest first. Decoders take one token each; a prompt still being prefilled takes what
  // the budget leaves after the decoders behind it (so they decode every step) and what the free blocks hold.
  int64_t budget = options_.max_step_tokens;
  int64_t decoders_left = 0;
  for (const Sequence* seq : running_) decoders_left += seq->remaining() == 1;
  const int64_t bs = blocks_.block_size();
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence* seq = running_[i];
    const bool decoding = seq->remaining() == 1;
    if (decoding) --decoders_left;
    int64_t take = decoding ? 1 : std::min(seq->remaining(), budget - decoders_left);
    if (take <= 0) continue;
    bool preempted_self = false;
    for (;;) {
      const int64_t held = static_cast<int64_t>(blocks_.block_table(seq->id).size());
      const int64_t room = (held + blocks_.num_free_blocks()) * bs - seq->computed;
      if (!decoding) take = std::min(take, room);  // a prefill chunk shrinks to the free blocks first
      if (take >= 1 && blocks_.reserve(seq->id, seq->computed + take)) break;
      // Full: preempt the newest running sequence (this one, if it is the newest).
      Sequence* victim = running_.back();
      if (victim != seq && victim->remaining() == 1) --decoders_left;
      preempt(victim);
      if (victim == seq) {
        preempted_self = true;
        break;
      }
      if (!decoding) take = std::min(seq->remaining(), budget - decoders_left);
    }
    if (preempted_self) break;  // it was the last running sequence
    plan_seq(seq, take);
    budget -= take;
  }

  // Admission, strictly FCFS: when the head of the queue does not fit, nothing behind it jumps ahead. No
  // admission in a step that had to preempt: the cache is under pressure.
  while (plan_.preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < options_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    if (!admit(seq, budget)) break;
    waiting_.pop_front();
    budget -= plan_.seqs.back().end - plan_.seqs.back().begin;
  }

  // Pointers last: nothing above may move a table after it is read.
  for (ScheduledSeq& s : plan_.seqs) {
    const Sequence& seq = seqs_.at(s.id);
    const std::vector<int32_t>& table = blocks_.block_table(s.id);
    s.tokens = seq.tokens.data();
    s.block_table = table.data();
    s.num_blocks = static_cast<int64_t>(table.size());
  }
  return plan_;
}

const std::vector<FinishedSeq>& Scheduler::complete(const StepPlan& plan, const int32_t* sampled) {
  finished_.clear();
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const ScheduledSeq& s = plan.seqs[i];
    const auto it = seqs_.find(s.id);
    if (it == seqs_.end()) continue;
    Sequence& seq = it->second;
    if (seq.state != SeqState::kRunning) continue;  // cancelled while the step ran
    seq.computed = s.end;
    blocks_.cache_full_blocks(seq.id, seq.tokens.data(), seq.computed);
    if (!s.sample) continue;
    seq.tokens.push_back(sampled[i]);
    const bool stop = seq.stop_token >= 0 && sampled[i] == seq.stop_token;
    if (!stop && seq.generated() < seq.max_new_tokens) continue;
    finished_.push_back({seq.id, stop ? FinishReason::kStop : FinishReason::kLength});
    cancel(seq.id);  // freed at the next step
  }
  return finished_;
}

}  // namespace moex

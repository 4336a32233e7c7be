// The continuous-batching scheduler: which tokens of which sequences the next forward step computes.
// Pure logic over a KvBlockManager (no model inside), so every policy is unit-testable:
//  - FCFS: sequences are admitted, served and preempted by arrival order;
//  - every step first gives each running sequence that is decoding its one token, then chunks of prompts
//    (running ones first, then newly admitted) up to max_step_tokens (chunked prefill), at most
//    max_num_seqs sequences;
//  - when the KV cache is full the newest running sequence is preempted: its blocks are freed and it waits
//    again to be recomputed (prompt + what it generated so far);
//  - complete() is the one place that decides a sequence is finished: its stop token (EOS) or its
//    max_new_tokens; a finished or cancelled sequence frees its blocks at the next schedule().
#pragma once
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "moex/runtime/kv_block_manager.h"

namespace moex {

struct SchedulerOptions {
  int64_t max_num_seqs = 64;       // sequences in one step
  int64_t max_step_tokens = 512;   // the step's token budget (>= max_num_seqs, so every decoder fits)
};

// Why a request ended: its stop token, max_tokens, cancelled by its client, or an engine error.
enum class FinishReason { kStop, kLength, kCancelled, kAbort };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "cancelled", "abort" (OpenAI's words)

struct FinishedSeq {
  SeqId id = 0;
  FinishReason reason = FinishReason::kLength;
};

// One sequence's share of a step as the scheduler decides it: its tokens [begin, end) at positions
// begin .. end - 1. The KV of positions [0, begin) is in the cache; the step appends [begin, end) through
// block_table, which covers positions [0, end). The slice itself is the model's StepSeq (model/decoder.h:
// block table, pos = begin, len = end - begin), which the engine builds from this; this adds what only the
// engine needs around the forward (whose sequence, its token ids, whether it samples); it does not hold a
// StepSeq because the scheduler sees no model (above: pure logic, unit-tested alone). StepSeq is the one
// name of "a sequence's slice of a step"; kernels::PagedAttentionSeq is attention's view of it.
struct ScheduledSeq {
  SeqId id = 0;
  int64_t begin = 0, end = 0;
  const int32_t* tokens = nullptr;       // the sequence's tokens; this step's inputs are tokens[begin, end)
  const int32_t* block_table = nullptr;  // valid until the next schedule()
  int64_t num_blocks = 0;
  bool sample = false;  // end is the sequence's last token: the logits of row end - 1 give its next token
};

struct StepPlan {
  std::vector<ScheduledSeq> seqs;  // running order (arrival order)
  std::vector<SeqId> preempted;    // went back to waiting this step; their blocks are free
  std::vector<SeqId> released;     // finished or cancelled; their blocks are free and the ids forgotten
  int64_t num_tokens = 0;
  void clear() {
    seqs.clear();
    preempted.clear();
    released.clear();
    num_tokens = 0;
  }
};

enum class SeqState { kUnknown, kWaiting, kRunning, kFinishing };

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& options, KvBlockManager& blocks);

  // Queues a request that the engine validated (Engine::validate); stop_token < 0: none (ignore EOS). An
  // empty prompt, an id in use, or a request that could not fit the whole KV cache alone is a bug (Error
  // kInternal), not stuck later.
  void add(SeqId id, std::vector<int32_t> prompt, int64_t max_new_tokens, int32_t stop_token = -1);
  // The client went away: its blocks are freed at the next schedule(). Returns false for an unknown id.
  bool cancel(SeqId id);

  // Plans the next step (the returned plan is reused: valid until the next call).
  const StepPlan& schedule();
  // After the step ran: sampled[i] is the token sampled for plan.seqs[i] (read where sample is set).
  // Returns the sequences this step finished (their stop token, or max_new_tokens), freed at the next
  // schedule(); valid until the next call.
  const std::vector<FinishedSeq>& complete(const StepPlan& plan, const int32_t* sampled);

  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  bool idle() const { return seqs_.empty(); }
  SeqState state(SeqId id) const;
  // Prompt followed by the generated tokens; empty for an unknown id.
  const std::vector<int32_t>& tokens(SeqId id) const;
  int64_t num_generated(SeqId id) const;
  int64_t num_preemptions(SeqId id) const;

 private:
  struct Sequence {
    SeqId id = 0;
    int64_t arrival = 0;  // FCFS rank
    std::vector<int32_t> tokens;
    int64_t prompt_len = 0, max_new_tokens = 0, computed = 0, preemptions = 0;
    int32_t stop_token = -1;
    SeqState state = SeqState::kWaiting;
    int64_t remaining() const { return static_cast<int64_t>(tokens.size()) - computed; }
    int64_t generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
  };
  void release(Sequence* seq);
  void preempt(Sequence* seq);
  void plan_seq(Sequence* seq, int64_t take);
  bool admit(Sequence* seq, int64_t budget);

  SchedulerOptions options_;
  KvBlockManager& blocks_;
  int64_t next_arrival_ = 0;
  std::unordered_map<SeqId, Sequence> seqs_;
  std::deque<Sequence*> waiting_;   // by arrival
  std::vector<Sequence*> running_;  // by arrival: back() is the newest, the first to preempt
  std::vector<Sequence*> to_release_;
  StepPlan plan_;
  std::vector<FinishedSeq> finished_;
};

}  // namespace moex

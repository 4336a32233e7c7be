// Generation loop: prefill each sequence in chunks of the model's step size, then decode all live
// sequences together, one token each per forward call.
#pragma once
#include <functional>
#include <vector>

#include "moex/model/decoder.h"
#include "moex/runtime/kv_block_manager.h"
#include "moex/runtime/sampler.h"

namespace moex {

// A block manager over the model's KV pool (its block ids are the pool's).
KvBlockManager make_block_manager(const DecoderModel& model, bool prefix_caching = false);

// Runs `prompt` as sequence `seq` of `kv` (a new one: its table grows from position 0). Writes the logits of
// every prompt position to all_logits ([len, V]) when it is non-null, and the last position's to
// last_logits ([V]). Throws Error(kInvalidInput) when the prompt does not fit the cache.
void prefill(DecoderModel& model, KvBlockManager& kv, SeqId seq, const std::vector<int>& prompt,
             float* last_logits, float* all_logits = nullptr);
// One step with one token per sequence: tokens[i] at position positions[i] of ids[i] (its next position);
// logits [ids.size(), V]. Grows each table to cover the position (Error(kInvalidInput) when the pool is full).
void decode_step(DecoderModel& model, KvBlockManager& kv, const std::vector<SeqId>& ids, const int32_t* tokens,
                 const int32_t* positions, float* logits);
// Forward calls a prompt of `length` tokens takes (one per step-sized chunk).
int64_t prefill_steps(const DecoderModel& model, int64_t length);
// A step with no tokens of this rank's own: keeps it in step with the others' collectives (attention DP).
void idle_step(DecoderModel& model);

struct GenerationOptions {
  int max_new_tokens = 32;
  bool stop_at_eos = true;
  SamplerOptions sampler;
};

// Why a sequence stopped: the caller tells the user when it was not what they asked for (a full cache).
enum class StopReason { kMaxNewTokens, kEos, kCacheFull };

struct GenerationResult {
  std::vector<std::vector<int>> new_tokens;  // per sequence
  std::vector<StopReason> stop_reasons;      // per sequence
  double prefill_seconds = 0.0, decode_seconds = 0.0;
  int64_t prefill_tokens = 0, decode_tokens = 0;
  int64_t decode_steps = 0;
};

// Prompts are sequences 0..B-1 of a block manager over the model's pool (B <= the model's max_batch). `on_token(seq, token)` streams the output.
// A prompt that is empty or longer than the KV cache is refused up front (Error(kInvalidInput)), before any
// step runs; a sequence whose cache fills stops there (StopReason::kCacheFull).
// Under a parallel plan every rank calls this with the same prompts: with attention DP each rank serves
// sequences s % world == rank and the ranks step in lockstep (a rank with nothing left still joins each
// step's collectives); at the end every rank holds every sequence's tokens and the totals of all ranks.
GenerationResult generate(DecoderModel& model, const std::vector<std::vector<int>>& prompts,
                          const GenerationOptions& options,
                          const std::function<void(int, int)>& on_token = nullptr);

}  // namespace moex

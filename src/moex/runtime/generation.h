// Offline generation over the engine (runtime/engine.h), as vLLM's LLM.generate over its LLMEngine: the
// prompts go in as requests and the caller's thread steps the engine until they are all done, so `moex
// generate`, `moex logits`, the benchmarks and `moex profile` run the loop `moex serve` runs.
#pragma once
#include <functional>
#include <vector>

#include "moex/model/decoder.h"
#include "moex/runtime/engine.h"
#include "moex/runtime/sampler.h"

namespace moex {

struct GenerationOptions {
  int max_new_tokens = 32;  // 0: the prompts only (one token is sampled and dropped)
  bool stop_at_eos = true;
  SamplerOptions sampler;   // each sequence samples with its own Sampler of these options
  // The logits of every row a sequence computes: GenerationResult::logits.
  bool return_logits = false;
  // Sequences in one step; 0: the model's max_batch. More prompts than this wait for a place.
  int64_t max_num_seqs = 0;
  // Called on rank 0 after each step's forward (EngineOptions::after_forward).
  std::function<void(const StepInput&, StepKind)> after_forward;
};

// Why a sequence stopped: the caller tells the user when it was not what they asked for (a full cache).
enum class StopReason { kMaxNewTokens, kEos, kCacheFull };

struct GenerationResult {
  std::vector<std::vector<int>> new_tokens;  // per sequence
  std::vector<StopReason> stop_reasons;      // per sequence
  // Per sequence, when the sampler asked for logprobs: each new token's (on every rank).
  std::vector<std::vector<SampledToken>> logprobs;
  // Per sequence with return_logits: [positions, vocab], the logits of every position it fed the model
  // (prompt, then each generated token but the last).
  std::vector<std::vector<float>> logits;
  // The engine's steps by kind (EngineMetrics): a prefill step holds a prompt chunk (decode rows may ride
  // along), a decode step only decode rows. prefill_tokens: the prompt rows; decode_tokens: the decode
  // steps' rows.
  double prefill_seconds = 0.0, decode_seconds = 0.0;
  int64_t prefill_tokens = 0, decode_tokens = 0;
  int64_t prefill_steps = 0, decode_steps = 0;
};

// Prompts are requests 0..B-1. `on_token(seq, token)` streams the output (rank 0). A prompt that is empty,
// holds a token outside the vocabulary or does not leave a position for a new token in --max-seq-len is
// refused up front (Error(kInvalidInput)), before any step runs; a sequence that fills its positions stops
// there (StopReason::kCacheFull).
// Under a parallel plan every rank calls this with the same prompts: rank 0 drives the engine and the others
// run its steps (run_step_worker); at the end every rank holds every sequence's tokens and the totals.
GenerationResult generate(DecoderModel& model, const std::vector<std::vector<int>>& prompts,
                          const GenerationOptions& options,
                          const std::function<void(int, int)>& on_token = nullptr);

}  // namespace moex

// A plain loop of model forward calls, one sequence at a time, for tests that check the engine (or the
// model's forward itself) against it: no scheduler, no engine, just StepInputs over a block manager.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "moex/base/error.h"
#include "moex/model/decoder.h"
#include "moex/runtime/kv_block_manager.h"

namespace moex::test {

// A block manager over the model's KV pool (its block ids are the pool's).
inline KvBlockManager plain_blocks(const DecoderModel& model) {
  const kernels::PagedKvLayout& layout = model.kv_cache().layout();
  return KvBlockManager(static_cast<int32_t>(layout.num_blocks), static_cast<int32_t>(layout.block_size), false);
}

// Runs `prompt` as new sequence `seq` of `kv` in chunks of the model's step size; the last position's logits
// to last_logits ([V]), every position's to all_logits ([len, V]) when non-null.
inline void plain_prefill(DecoderModel& model, KvBlockManager& kv, SeqId seq, const std::vector<int>& prompt,
                          float* last_logits, float* all_logits = nullptr) {
  const int64_t len = static_cast<int64_t>(prompt.size());
  const int vocab = model.config().vocab_size;
  MOEX_CHECK(len > 0 && kv.reserve(seq, len), "the prompt does not fit");
  const std::vector<int32_t>& table = kv.block_table(seq);
  const int64_t chunk = model.options().max_step_tokens;
  std::vector<int32_t> last_row(1);
  for (int64_t begin = 0; begin < len; begin += chunk) {
    const int64_t n = std::min(chunk, len - begin);
    const StepSeq one{table.data(), static_cast<int64_t>(table.size()), begin, n};
    StepInput step;
    step.tokens = prompt.data() + begin;
    step.num_tokens = n;
    step.seqs = &one;
    step.num_seqs = 1;
    if (all_logits) {
      model.forward(step, all_logits + begin * vocab);
      if (begin + n == len) std::copy(all_logits + (len - 1) * vocab, all_logits + len * vocab, last_logits);
      continue;
    }
    last_row[0] = static_cast<int32_t>(n - 1);
    step.logit_rows = last_row.data();
    step.num_logit_rows = begin + n == len ? 1 : 0;  // a middle chunk: only the KV cache matters
    model.forward(step, last_logits);
  }
}

// One step with one token per sequence: tokens[i] at position positions[i] of ids[i]; logits [ids.size(), V].
inline void plain_decode_step(DecoderModel& model, KvBlockManager& kv, const std::vector<SeqId>& ids,
                              const int32_t* tokens, const int32_t* positions, float* logits) {
  std::vector<StepSeq> seqs(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    MOEX_CHECK(kv.reserve(ids[i], int64_t{positions[i]} + 1), "position ", positions[i], " does not fit");
  for (size_t i = 0; i < ids.size(); ++i) {  // tables read after every reserve: a reserve may move its own table
    const std::vector<int32_t>& table = kv.block_table(ids[i]);
    seqs[i] = StepSeq{table.data(), static_cast<int64_t>(table.size()), positions[i], 1};
  }
  StepInput step;
  step.tokens = tokens;
  step.num_tokens = static_cast<int64_t>(ids.size());
  step.seqs = seqs.data();
  step.num_seqs = step.num_tokens;
  model.forward(step, logits);
}

}  // namespace moex::test

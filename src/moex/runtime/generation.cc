#include "moex/runtime/generation.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/profile/profile.h"

namespace moex {
namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

KvBlockManager make_block_manager(const DecoderModel& model, bool prefix_caching) {
  const kernels::PagedKvLayout& layout = model.kv_cache().layout();
  return KvBlockManager(static_cast<int32_t>(layout.num_blocks), static_cast<int32_t>(layout.block_size),
                        prefix_caching);
}

void prefill(DecoderModel& model, KvBlockManager& kv, SeqId seq, const std::vector<int>& prompt, float* last_logits,
             float* all_logits) {
  const int64_t len = static_cast<int64_t>(prompt.size());
  const int vocab = model.config().vocab_size;
  MOEX_CHECK_INPUT(len > 0, "the prompt is empty");
  MOEX_CHECK_INPUT(len <= model.options().max_seq_len, "the prompt has ", len,
                   " tokens: increase --max-seq-len to at least ", len);
  MOEX_CHECK_INPUT(kv.reserve(seq, len), "the prompt of ", len, " tokens does not fit the KV cache (",
                   kv.num_free_blocks(), " free blocks of ", kv.block_size(), " positions)");
  const std::vector<int32_t>& table = kv.block_table(seq);
  const int64_t chunk = model.options().max_step_tokens;
  std::vector<int32_t> last_row(1);
  for (int64_t begin = 0; begin < len; begin += chunk) {
    const int64_t n = std::min(chunk, len - begin);
    profile::ScopedStep profiled_step(profile::Phase::kPrefill, static_cast<int>(n));
    const StepSeq one{table.data(), static_cast<int64_t>(table.size()), begin, n};
    StepInput step;
    step.tokens = prompt.data() + begin;
    step.num_tokens = n;
    step.seqs = &one;
    step.num_seqs = 1;
    if (all_logits) {
      model.forward(step, all_logits + begin * vocab);
      if (begin + n == len) std::copy(all_logits + (len - 1) * vocab, all_logits + len * vocab, last_logits);
    } else if (begin + n == len) {
      last_row[0] = static_cast<int32_t>(n - 1);
      step.logit_rows = last_row.data();
      step.num_logit_rows = 1;
      model.forward(step, last_logits);
    } else {
      step.logit_rows = last_row.data();  // a middle chunk: only the KV cache matters
      step.num_logit_rows = 0;
      model.forward(step, last_logits);
    }
  }
}

void decode_step(DecoderModel& model, KvBlockManager& kv, const std::vector<SeqId>& ids, const int32_t* tokens,
                 const int32_t* positions, float* logits) {
  std::vector<StepSeq> seqs(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    MOEX_CHECK_INPUT(kv.reserve(ids[i], int64_t{positions[i]} + 1), "position ", positions[i],
                     " does not fit the KV cache (", kv.num_free_blocks(), " free blocks)");
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

int64_t prefill_steps(const DecoderModel& model, int64_t length) {
  const int64_t chunk = model.options().max_step_tokens;
  return (length + chunk - 1) / chunk;
}

void idle_step(DecoderModel& model) {
  StepInput step;  // zero tokens
  model.forward(step, nullptr);
}

namespace {

// Every rank's value of `local`, in rank order (the communicator's all-gather; one rank: just local).
std::vector<int64_t> gather_counts(const DecoderModel& model, int64_t local) {
  const ParallelPlan& plan = model.options().plan;
  std::vector<int64_t> all(plan.world, local);
  if (!plan.single()) model.options().comm->allgather(&local, sizeof(local), all.data());
  return all;
}

int64_t max_of(const std::vector<int64_t>& values) { return *std::max_element(values.begin(), values.end()); }
int64_t sum_of(const std::vector<int64_t>& values) {
  int64_t total = 0;
  for (int64_t v : values) total += v;
  return total;
}

}  // namespace

GenerationResult generate(DecoderModel& model, const std::vector<std::vector<int>>& prompts,
                          const GenerationOptions& options, const std::function<void(int, int)>& on_token) {
  const int batch = static_cast<int>(prompts.size());
  const int vocab = model.config().vocab_size;
  const ParallelPlan& plan = model.options().plan;
  const bool data_parallel = plan.attn == AttnParallel::kDP && !plan.single();
  // The sequences this rank serves, each in its own cache slot.
  std::vector<int> mine;
  for (int s = 0; s < batch; ++s)
    if (!data_parallel || s % plan.world == plan.rank) mine.push_back(s);
  const int local = static_cast<int>(mine.size());
  MOEX_CHECK_INPUT(batch >= 1 && local <= model.options().max_batch, "batch of ", batch,
                   " sequences does not fit: the model was set up for ", model.options().max_batch);
  // Every prompt is checked on every rank before the first step, so that no rank leaves a collective alone.
  const int max_seq_len = model.options().max_seq_len;
  for (int s = 0; s < batch; ++s) {
    const size_t len = prompts[s].size();
    const std::string which = batch > 1 ? "prompt [" + std::to_string(s) + "]" : "the prompt";
    MOEX_CHECK_INPUT(len > 0, which, " is empty");
    MOEX_CHECK_INPUT(len <= static_cast<size_t>(max_seq_len), which, " has ", len,
                     " tokens, more than the KV cache holds (--max-seq-len ", max_seq_len,
                     "): increase --max-seq-len to at least ", len + std::max(options.max_new_tokens, 1) - 1,
                     " for the prompt and -n ", options.max_new_tokens, " new tokens");
  }
  KvBlockManager kv = make_block_manager(model);  // local sequence i is block-manager sequence i
  Sampler sampler(options.sampler);
  GenerationResult result;
  result.new_tokens.resize(batch);
  result.stop_reasons.assign(batch, StopReason::kMaxNewTokens);
  std::vector<float> logits(static_cast<size_t>(std::max(local, 1)) * vocab);
  std::vector<int32_t> next(local), lengths(local);
  std::vector<bool> live(local, true);

  auto start = std::chrono::steady_clock::now();
  int64_t my_prefill_steps = 0, my_prefill_tokens = 0;
  for (int i = 0; i < local; ++i) my_prefill_steps += prefill_steps(model, static_cast<int64_t>(prompts[mine[i]].size()));
  // Every rank runs as many prefill steps as the busiest one; agreed before any step, since each step's
  // collectives need every rank inside a forward call at the same time.
  const int64_t prefill_step_count = data_parallel ? max_of(gather_counts(model, my_prefill_steps)) : my_prefill_steps;
  for (int i = 0; i < local; ++i) {
    prefill(model, kv, i, prompts[mine[i]], logits.data() + static_cast<size_t>(i) * vocab);
    lengths[i] = static_cast<int32_t>(prompts[mine[i]].size());
    my_prefill_tokens += lengths[i];
  }
  for (int64_t i = my_prefill_steps; i < prefill_step_count; ++i) idle_step(model);
  result.prefill_seconds = seconds_since(start);
  result.prefill_tokens = data_parallel ? sum_of(gather_counts(model, my_prefill_tokens)) : my_prefill_tokens;

  const auto accept = [&](int i, int token) {
    const int s = mine[i];
    result.new_tokens[s].push_back(token);
    if (on_token) on_token(s, token);
    if (options.stop_at_eos && token == model.config().eos_token_id) {
      live[i] = false;
      result.stop_reasons[s] = StopReason::kEos;
    } else if (static_cast<int>(result.new_tokens[s].size()) >= options.max_new_tokens) {
      live[i] = false;
      result.stop_reasons[s] = StopReason::kMaxNewTokens;
    } else if (lengths[i] >= max_seq_len) {  // the token just sampled has no cache position to go to
      live[i] = false;
      result.stop_reasons[s] = StopReason::kCacheFull;
    }
    next[i] = token;
  };
  if (options.max_new_tokens > 0) {
    for (int i = 0; i < local; ++i) accept(i, sampler.sample(logits.data() + static_cast<size_t>(i) * vocab, vocab));
  } else {
    std::fill(live.begin(), live.end(), false);
  }

  start = std::chrono::steady_clock::now();
  std::vector<int32_t> tokens, slots, positions, greedy;
  std::vector<StepSeq> seqs;
  int64_t my_decode_tokens = 0;
  while (true) {
    tokens.clear();
    slots.clear();
    positions.clear();
    seqs.clear();
    for (int i = 0; i < local; ++i) {
      if (!live[i]) continue;
      tokens.push_back(next[i]);
      slots.push_back(i);
      positions.push_back(lengths[i]++);
      // The pool holds max_batch x max_seq_len positions and lengths stay below max_seq_len: always fits.
      MOEX_CHECK(kv.reserve(i, lengths[i]), "the KV pool is full at sequence ", i);
    }
    for (size_t j = 0; j < slots.size(); ++j) {
      const std::vector<int32_t>& table = kv.block_table(slots[j]);
      seqs.push_back(StepSeq{table.data(), static_cast<int64_t>(table.size()), positions[j], 1});
    }
    // Under DP the ranks agree each step whether anyone still decodes (one small all-gather).
    if (data_parallel ? max_of(gather_counts(model, static_cast<int64_t>(tokens.size()))) == 0 : tokens.empty()) break;
    profile::ScopedStep profiled_step(profile::Phase::kDecode, static_cast<int>(tokens.size()));
    StepInput step;
    step.tokens = tokens.data();
    step.num_tokens = static_cast<int64_t>(tokens.size());
    step.seqs = seqs.data();
    step.num_seqs = step.num_tokens;
    model.forward(step, logits.data());
    ++result.decode_steps;
    my_decode_tokens += step.num_tokens;
    MOEX_ZONE(kSampling);
    if (sampler.greedy() && slots.size() > 1) {  // no penalties here: the rows' argmaxes over the threads
      greedy.resize(slots.size());
      parallel_for(static_cast<int64_t>(slots.size()), 8, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) greedy[i] = argmax(logits.data() + i * vocab, vocab);
      });
      for (size_t i = 0; i < slots.size(); ++i) accept(slots[i], greedy[i]);
      continue;
    }
    for (size_t i = 0; i < slots.size(); ++i) accept(slots[i], sampler.sample(logits.data() + i * vocab, vocab));
  }
  result.decode_seconds = seconds_since(start);
  result.decode_tokens = data_parallel ? sum_of(gather_counts(model, my_decode_tokens)) : my_decode_tokens;
  if (data_parallel) {  // every rank learns every sequence's tokens from its owner
    for (int s = 0; s < batch; ++s) {
      const int owner = s % plan.world;
      int64_t count = static_cast<int64_t>(result.new_tokens[s].size());
      model.options().comm->broadcast(&count, sizeof(count), owner);
      model.options().comm->broadcast(&result.stop_reasons[s], sizeof(StopReason), owner);
      result.new_tokens[s].resize(count);
      if (count) model.options().comm->broadcast(result.new_tokens[s].data(), count * sizeof(int), owner);
    }
  }
  return result;
}

}  // namespace moex

#include "moex/runtime/generation.h"

#include <chrono>

#include "moex/base/error.h"
#include "moex/profile/profile.h"

namespace moex {
namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

void prefill(MixtralModel& model, int slot, const std::vector<int>& prompt, float* last_logits, float* all_logits) {
  const int64_t len = static_cast<int64_t>(prompt.size());
  const int vocab = model.config().vocab_size;
  MOEX_CHECK_INPUT(len > 0, "the prompt is empty");
  MOEX_CHECK_INPUT(len <= model.options().max_seq_len, "the prompt has ", len,
                   " tokens: increase --max-seq-len to at least ", len);
  const int64_t chunk = model.options().max_step_tokens;
  std::vector<int32_t> slots(chunk, slot), positions(chunk), last_row(1);
  for (int64_t begin = 0; begin < len; begin += chunk) {
    const int64_t n = std::min(chunk, len - begin);
    profile::ScopedStep profiled_step(profile::Phase::kPrefill, static_cast<int>(n));
    for (int64_t i = 0; i < n; ++i) positions[i] = static_cast<int32_t>(begin + i);
    StepInput step;
    step.tokens = prompt.data() + begin;
    step.seq_slots = slots.data();
    step.positions = positions.data();
    step.num_tokens = n;
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

GenerationResult generate(MixtralModel& model, const std::vector<std::vector<int>>& prompts,
                          const GenerationOptions& options, const std::function<void(int, int)>& on_token) {
  const int batch = static_cast<int>(prompts.size());
  const int vocab = model.config().vocab_size;
  MOEX_CHECK_INPUT(batch >= 1 && batch <= model.options().max_batch, "batch of ", batch,
                   " sequences does not fit: the model was set up for ", model.options().max_batch);
  Sampler sampler(options.sampler);
  GenerationResult result;
  result.new_tokens.resize(batch);
  std::vector<float> logits(static_cast<size_t>(batch) * vocab);
  std::vector<int32_t> next(batch), lengths(batch);
  std::vector<bool> live(batch, true);

  auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < batch; ++s) {
    prefill(model, s, prompts[s], logits.data() + static_cast<size_t>(s) * vocab);
    lengths[s] = static_cast<int32_t>(prompts[s].size());
    result.prefill_tokens += lengths[s];
  }
  result.prefill_seconds = seconds_since(start);

  const auto accept = [&](int s, int token) {
    result.new_tokens[s].push_back(token);
    if (on_token) on_token(s, token);
    if ((options.stop_at_eos && token == model.config().eos_token_id) ||
        static_cast<int>(result.new_tokens[s].size()) >= options.max_new_tokens ||
        lengths[s] >= model.options().max_seq_len)
      live[s] = false;
    next[s] = token;
  };
  if (options.max_new_tokens <= 0) return result;
  for (int s = 0; s < batch; ++s) accept(s, sampler.sample(logits.data() + static_cast<size_t>(s) * vocab, vocab));

  start = std::chrono::steady_clock::now();
  std::vector<int32_t> tokens, slots, positions;
  while (true) {
    tokens.clear();
    slots.clear();
    positions.clear();
    for (int s = 0; s < batch; ++s) {
      if (!live[s]) continue;
      tokens.push_back(next[s]);
      slots.push_back(s);
      positions.push_back(lengths[s]++);
    }
    if (tokens.empty()) break;
    profile::ScopedStep profiled_step(profile::Phase::kDecode, static_cast<int>(tokens.size()));
    StepInput step;
    step.tokens = tokens.data();
    step.seq_slots = slots.data();
    step.positions = positions.data();
    step.num_tokens = static_cast<int64_t>(tokens.size());
    model.forward(step, logits.data());
    ++result.decode_steps;
    result.decode_tokens += step.num_tokens;
    MOEX_ZONE(kSampling);
    for (size_t i = 0; i < slots.size(); ++i) accept(slots[i], sampler.sample(logits.data() + i * vocab, vocab));
  }
  result.decode_seconds = seconds_since(start);
  return result;
}

}  // namespace moex

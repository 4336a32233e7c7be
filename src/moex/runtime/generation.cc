#include "moex/runtime/generation.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include "moex/base/error.h"

namespace moex {
namespace {

// One prompt's outputs, on rank 0.
class Collector : public RequestSink {
 public:
  Collector(int seq, int vocab, bool logprobs, const std::function<void(int, int)>& on_token)
      : seq_(seq), vocab_(vocab), keep_logprobs_(logprobs), on_token_(on_token) {}
  void on_logits(int64_t first, int64_t rows, const float* logits) override {
    const size_t end = static_cast<size_t>(first + rows) * vocab_;
    if (logits_.size() < end) logits_.resize(end);
    std::memcpy(logits_.data() + static_cast<size_t>(first) * vocab_, logits, static_cast<size_t>(rows) * vocab_ * sizeof(float));
  }
  void on_token(int32_t token, const SampledToken* logprobs) override {
    tokens_.push_back(token);
    if (keep_logprobs_ && logprobs) logprobs_.push_back(*logprobs);
    if (on_token_) on_token_(seq_, token);
  }
  void on_finish(FinishReason reason, const std::string& error) override {
    reason_ = reason;
    error_ = error;
  }
  std::vector<int> tokens_;
  std::vector<SampledToken> logprobs_;
  std::vector<float> logits_;
  FinishReason reason_ = FinishReason::kAbort;
  std::string error_ = "did not finish";

 private:
  int seq_, vocab_;
  bool keep_logprobs_;
  const std::function<void(int, int)>& on_token_;
};

template <typename T>
void broadcast_vector(comm::Communicator& comm, std::vector<T>& v) {
  int64_t n = static_cast<int64_t>(v.size());
  comm.broadcast(&n, sizeof(n), 0);
  v.resize(n);
  if (n) comm.broadcast(v.data(), n * sizeof(T), 0);
}

// One sequence's sampled tokens with their logprobs, from rank 0 to every rank: the ids and top-list lengths
// in one vector, the logprobs in another (two broadcasts each, however long the top lists).
void broadcast_logprobs(comm::Communicator& comm, std::vector<SampledToken>& tokens) {
  std::vector<int32_t> ids;
  std::vector<float> values;
  if (comm.rank() == 0) {
    for (const SampledToken& t : tokens) {
      ids.push_back(t.token);
      ids.push_back(static_cast<int32_t>(t.top.size()));
      values.push_back(t.logprob);
      for (const TokenLogprob& e : t.top) {
        ids.push_back(e.token);
        values.push_back(e.logprob);
      }
    }
  }
  broadcast_vector(comm, ids);
  broadcast_vector(comm, values);
  if (comm.rank() == 0) return;
  tokens.clear();
  size_t i = 0, f = 0;
  while (i + 1 < ids.size() && f < values.size()) {
    SampledToken t;
    t.token = ids[i++];
    const size_t top = static_cast<size_t>(ids[i++]);
    t.logprob = values[f++];
    MOEX_CHECK(i + top <= ids.size() && f + top <= values.size(), "generate: a malformed logprobs broadcast");
    t.top.resize(top);
    for (TokenLogprob& e : t.top) e.token = ids[i++], e.logprob = values[f++];
    tokens.push_back(std::move(t));
  }
}

}  // namespace

GenerationResult generate(DecoderModel& model, const std::vector<std::vector<int>>& prompts,
                          const GenerationOptions& options, const std::function<void(int, int)>& on_token) {
  const int batch = static_cast<int>(prompts.size());
  const int vocab = model.config().vocab_size;
  const ParallelPlan& plan = model.options().plan;
  comm::Communicator* comm = plan.single() ? nullptr : model.options().comm;
  const int max_seq_len = model.options().max_seq_len;
  MOEX_CHECK_INPUT(batch >= 1, "no prompt to generate from");
  MOEX_CHECK_INPUT(options.max_new_tokens >= 0, "the number of new tokens must be >= 0, got ", options.max_new_tokens);

  EngineOptions eo;
  eo.max_num_seqs = options.max_num_seqs > 0 ? options.max_num_seqs : model.options().max_batch;
  eo.max_num_seqs = std::min<int64_t>(eo.max_num_seqs, model.options().max_step_tokens);
  eo.max_waiting = batch;
  eo.prefix_caching = false;  // every prompt computed, as it was given
  eo.step_breakdown = false;  // the profiler is the caller's (moex profile)
  eo.comm = comm;
  eo.after_forward = options.after_forward;
  Engine engine(model, eo);

  // Every request is checked on every rank before the first step, so no rank leaves a collective alone.
  // A prompt that fills --max-seq-len stops there (kCacheFull): max_tokens is what fits.
  const int want = std::max(options.max_new_tokens, 1);
  std::vector<GenerationRequest> requests(batch);
  std::vector<bool> clamped(batch, false);
  for (int s = 0; s < batch; ++s) {
    const int64_t len = static_cast<int64_t>(prompts[s].size());
    const std::string which = batch > 1 ? "prompt [" + std::to_string(s) + "]" : "the prompt";
    MOEX_CHECK_INPUT(len > 0, which, " is empty");
    MOEX_CHECK_INPUT(len < max_seq_len, which, " has ", len, " tokens, more than the KV cache leaves room for (--max-seq-len ",
                     max_seq_len, "): increase --max-seq-len to at least ", len + want, " for the prompt and -n ",
                     options.max_new_tokens, " new tokens");
    GenerationRequest& r = requests[s];
    r.prompt.assign(prompts[s].begin(), prompts[s].end());
    r.max_tokens = std::min<int64_t>(want, max_seq_len - len);
    clamped[s] = r.max_tokens < want;
    r.sampler = options.sampler;
    r.ignore_eos = !options.stop_at_eos;
    r.all_logits = options.return_logits;
    engine.validate(r);
  }

  GenerationResult result;
  result.new_tokens.resize(batch);
  result.stop_reasons.assign(batch, StopReason::kMaxNewTokens);
  std::string error;
  ErrorKind error_kind = ErrorKind::kInternal;
  if (!comm || comm->rank() == 0) {
    std::vector<std::shared_ptr<Collector>> outs;
    try {
      for (int s = 0; s < batch; ++s) {
        outs.push_back(std::make_shared<Collector>(s, vocab, options.sampler.logprobs, on_token));
        MOEX_CHECK(engine.submit(std::move(requests[s]), outs.back()), "the engine refused a prompt");
      }
      while (engine.has_work()) engine.step();
    } catch (const std::exception& e) {
      error = e.what();
      if (const auto* err = dynamic_cast<const Error*>(&e)) error_kind = err->kind();
      if (error.empty()) error = "generation failed";
    }
    engine.stop_workers();
    for (int s = 0; s < static_cast<int>(outs.size()) && error.empty(); ++s) {
      Collector& c = *outs[s];
      if (c.reason_ == FinishReason::kAbort || c.reason_ == FinishReason::kCancelled) error = c.error_;
      result.new_tokens[s] = std::move(c.tokens_);
      if (options.max_new_tokens == 0) result.new_tokens[s].clear();
      result.stop_reasons[s] = c.reason_ == FinishReason::kStop ? StopReason::kEos
                               : clamped[s]                      ? StopReason::kCacheFull
                                                                 : StopReason::kMaxNewTokens;
    }
    if (error.empty() && options.sampler.logprobs)
      for (auto& c : outs) result.logprobs.push_back(std::move(c->logprobs_));
    if (error.empty() && options.return_logits)
      for (auto& c : outs) result.logits.push_back(std::move(c->logits_));
    EngineMetrics& m = engine.metrics();
    result.prefill_seconds = m.prefill_steps.step_seconds.value();
    result.decode_seconds = m.decode_steps.step_seconds.value();
    result.prefill_tokens = static_cast<int64_t>(m.prefill_steps.prompt_rows.value());
    result.decode_tokens = static_cast<int64_t>(m.decode_steps.decode_rows.value());
    result.prefill_steps = static_cast<int64_t>(m.prefill_steps.steps.value());
    result.decode_steps = static_cast<int64_t>(m.decode_steps.steps.value());
  } else {
    run_step_worker(*comm, model, engine.options().max_step_tokens);
  }
  if (comm) {  // every rank learns rank 0's outcome and the outputs
    std::vector<char> message(error.begin(), error.end());
    broadcast_vector(*comm, message);
    int64_t kind = static_cast<int64_t>(error_kind);
    comm->broadcast(&kind, sizeof(kind), 0);
    error.assign(message.begin(), message.end());
    error_kind = static_cast<ErrorKind>(kind);
    if (error.empty()) {
      for (int s = 0; s < batch; ++s) broadcast_vector(*comm, result.new_tokens[s]);
      if (options.sampler.logprobs) {
        result.logprobs.resize(batch);
        for (int s = 0; s < batch; ++s) broadcast_logprobs(*comm, result.logprobs[s]);
      }
      if (options.return_logits) {
        result.logits.resize(batch);
        for (int s = 0; s < batch; ++s) broadcast_vector(*comm, result.logits[s]);
      }
      comm->broadcast(result.stop_reasons.data(), batch * sizeof(StopReason), 0);
      double seconds[2] = {result.prefill_seconds, result.decode_seconds};
      int64_t counts[4] = {result.prefill_tokens, result.decode_tokens, result.prefill_steps, result.decode_steps};
      comm->broadcast(seconds, sizeof(seconds), 0);
      comm->broadcast(counts, sizeof(counts), 0);
      result.prefill_seconds = seconds[0], result.decode_seconds = seconds[1];
      result.prefill_tokens = counts[0], result.decode_tokens = counts[1];
      result.prefill_steps = counts[2], result.decode_steps = counts[3];
    }
  }
  if (!error.empty()) throw_error(error_kind, error);
  return result;
}

}  // namespace moex

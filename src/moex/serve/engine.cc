#include "moex/serve/engine.h"

#include <algorithm>
#include <cstdio>
#include <exception>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/serve/step_sync.h"

namespace moex::serve {

// ---- RequestStream -------------------------------------------------------------------------------------

RequestStream::Read RequestStream::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_for(lock, timeout, [&] { return !tokens_.empty() || finished_; });
  Read r;
  r.tokens.swap(tokens_);
  r.finished = finished_;
  r.finish_reason = finish_reason_;
  r.error = error_;
  return r;
}

void RequestStream::push(int32_t token) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tokens_.push_back(token);
  }
  cv_.notify_all();
}

void RequestStream::finish(const std::string& reason, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
    finish_reason_ = reason;
    error_ = error;
  }
  cv_.notify_all();
}

// ---- Engine --------------------------------------------------------------------------------------------

namespace {
double seconds(RequestStream::Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

Engine::Engine(MixtralModel& model, const EngineOptions& options)
    : model_(model),
      options_(options),
      num_blocks_(model.kv_cache().num_blocks()),
      blocks_(static_cast<int32_t>(num_blocks_), static_cast<int32_t>(kernels::kKvBlockSize), options.prefix_caching),
      scheduler_(SchedulerOptions{options.max_num_seqs, options.max_batch_tokens}, blocks_) {
  MOEX_CHECK_INPUT(options.max_batch_tokens <= model.options().max_step_tokens, "--max-batch-tokens ",
                   options.max_batch_tokens, " is more than the model's step size ", model.options().max_step_tokens);
  MOEX_CHECK_INPUT(options.max_model_len >= 2 && options.max_model_len <= model.options().max_seq_len,
                   "--max-model-len ", options.max_model_len, " must be 2..", model.options().max_seq_len);
  MOEX_CHECK_INPUT(options.max_waiting >= 0, "--max-waiting must be >= 0");
  step_tokens_.reserve(options.max_batch_tokens);
  step_seqs_.reserve(options.max_num_seqs);
  logit_rows_.reserve(options.max_num_seqs);
  sampled_.reserve(options.max_num_seqs);
  logits_.resize(static_cast<size_t>(options.max_num_seqs) * model.config().vocab_size);
  metrics_.kv_blocks_total = num_blocks_;
  thread_ = std::thread([this] {
    become_compute_thread();  // this thread and its OpenMP team on the CPUs, not all on the main thread's one
    loop();
  });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (options_.comm) send_command(*options_.comm, StepCommand::kStop);  // the other ranks leave their loop
  for (auto& [id, a] : active_)
    if (!a.finished) a.stream->finish("abort", "the server is shutting down");
  for (Pending& p : pending_) p.stream->finish("abort", "the server is shutting down");
}

std::shared_ptr<RequestStream> Engine::submit(GenerationRequest request) {
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  const int vocab = model_.config().vocab_size;
  MOEX_CHECK_INPUT(prompt > 0, "the prompt is empty");
  for (int32_t t : request.prompt)
    MOEX_CHECK_INPUT(t >= 0 && t < vocab, "token id ", t, " in the prompt is outside the vocabulary (0..", vocab - 1, ")");
  MOEX_CHECK_INPUT(request.max_tokens >= 1, "max_tokens must be at least 1, got ", request.max_tokens);
  MOEX_CHECK_INPUT(prompt + request.max_tokens <= options_.max_model_len, "This model's maximum context length is ",
                   options_.max_model_len, " tokens. However, you requested ", prompt + request.max_tokens,
                   " tokens (", prompt, " in the prompt, ", request.max_tokens,
                   " in the completion). Please reduce the prompt or max_tokens.");
  // The last sampled token is never fed back: prompt + max_tokens - 1 positions reach the cache.
  MOEX_CHECK_INPUT(prompt + request.max_tokens - 1 <= capacity_positions(), "the prompt (", prompt,
                   " tokens) and max_tokens ", request.max_tokens, " need more than the KV cache holds (",
                   capacity_positions(), " positions): lower max_tokens");
  Sampler sampler(request.sampler);  // throws for bad sampling options
  auto stream = std::make_shared<RequestStream>(prompt);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_flight_ >= options_.max_num_seqs + options_.max_waiting) {
      ++metrics_.requests_rejected;
      return nullptr;
    }
    ++in_flight_;
    pending_.push_back(Pending{next_id_++, std::move(request), stream, RequestStream::Clock::now()});
  }
  cv_.notify_all();
  return stream;
}

void Engine::finish(SeqId, Active& a, const std::string& reason, const std::string& error) {
  if (a.finished) return;
  a.finished = true;
  a.stream->finish(reason, error);
  if (reason == "stop") ++metrics_.finished_stop;
  else if (reason == "length") ++metrics_.finished_length;
  else ++metrics_.finished_abort;
  if (a.seen) metrics_.e2e_request_latency.observe(seconds(RequestStream::Clock::now() - a.arrival));
  std::lock_guard<std::mutex> lock(mutex_);
  --in_flight_;
}

void Engine::publish_gauges() {
  metrics_.num_requests_running = scheduler_.num_running();
  int64_t pending = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending = static_cast<int64_t>(pending_.size());
  }
  metrics_.num_requests_waiting = scheduler_.num_waiting() + pending;
  metrics_.kv_blocks_used = blocks_.num_used_blocks();
}

void Engine::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (stop_) return;
      if (pending_.empty() && scheduler_.idle())
        cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_ || !pending_.empty(); });
      if (stop_) return;
    }
    try {
      step();
    } catch (const std::exception& e) {
      // Never reached on valid input (requests are checked in submit); if it is, every request in flight
      // fails with the message and the engine goes on with an empty batch.
      std::fprintf(stderr, "moex serve: error in a step: %s\n", e.what());
      for (auto& [id, a] : active_) {
        scheduler_.cancel(id);
        finish(id, a, "abort", std::string("internal error: ") + e.what());
      }
    }
  }
}

void Engine::step() {
  // New requests join the scheduler's queue (FCFS by submission).
  std::deque<Pending> incoming;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    incoming.swap(pending_);
  }
  for (Pending& p : incoming) {
    const int64_t max_tokens = p.request.max_tokens;
    try {
      scheduler_.add(p.id, std::move(p.request.prompt), max_tokens);  // checked in submit: should not throw
    } catch (const std::exception& e) {
      p.stream->finish("abort", e.what());
      ++metrics_.finished_abort;
      std::lock_guard<std::mutex> lock(mutex_);
      --in_flight_;
      continue;
    }
    Active a{p.stream, Sampler(p.request.sampler), {}, max_tokens, p.request.ignore_eos};
    a.arrival = p.arrival;
    active_.emplace(p.id, std::move(a));
  }
  // Clients that went away (or stopped on a stop string): cancelled now, their blocks freed by schedule().
  for (auto& [id, a] : active_) {
    if (a.finished || !a.stream->cancelled()) continue;
    scheduler_.cancel(id);
    finish(id, a, "cancelled");
  }
  if (scheduler_.idle()) {
    publish_gauges();
    if (options_.comm) send_command(*options_.comm, StepCommand::kIdle);  // keeps the other ranks' wait short
    return;
  }

  const StepPlan& plan = scheduler_.schedule();
  for (SeqId id : plan.released) active_.erase(id);
  metrics_.num_preemptions += static_cast<int64_t>(plan.preempted.size());
  if (plan.seqs.empty()) {
    publish_gauges();
    return;
  }

  // StepInput: each sequence's tokens [begin, end) through its block table; logits of the rows that sample.
  step_tokens_.clear();
  step_seqs_.clear();
  logit_rows_.clear();
  const auto now = RequestStream::Clock::now();
  for (const ScheduledSeq& s : plan.seqs) {
    const int64_t row = static_cast<int64_t>(step_tokens_.size()), len = s.end - s.begin;
    step_tokens_.insert(step_tokens_.end(), s.tokens + s.begin, s.tokens + s.end);
    step_seqs_.push_back(StepSeq{s.block_table, s.num_blocks, s.begin, len});
    if (s.sample) logit_rows_.push_back(static_cast<int32_t>(row + len - 1));
    Active& a = active_.at(s.id);
    if (!a.seen) {  // first scheduled: its cached prefix is what the plan starts after
      a.seen = true;
      const int64_t prompt = a.stream->prompt_tokens();
      a.stream->set_cached_tokens(s.begin);
      metrics_.prompt_tokens += prompt;
      metrics_.prefix_cache_queries += prompt;
      metrics_.prefix_cache_hits += s.begin;
      metrics_.request_queue_time.observe(seconds(now - a.arrival));
    }
  }
  StepInput input;
  input.tokens = step_tokens_.data();
  input.num_tokens = static_cast<int64_t>(step_tokens_.size());
  input.seqs = step_seqs_.data();
  input.num_seqs = static_cast<int64_t>(step_seqs_.size());
  input.logit_rows = logit_rows_.data();
  input.num_logit_rows = static_cast<int64_t>(logit_rows_.size());
  if (options_.comm) send_step(*options_.comm, input);  // every rank runs the same step
  model_.forward(input, logits_.data());

  const int vocab = model_.config().vocab_size;
  sampled_.assign(plan.seqs.size(), -1);
  size_t r = 0;
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    if (!plan.seqs[i].sample) continue;
    Active& a = active_.at(plan.seqs[i].id);
    sampled_[i] = a.sampler.sample(logits_.data() + r * vocab, vocab, &a.generated);
    a.generated.add(sampled_[i]);
    ++r;
  }
  scheduler_.complete(plan, sampled_.data());

  const auto done = RequestStream::Clock::now();
  const int eos = model_.config().eos_token_id;
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    if (!plan.seqs[i].sample) continue;
    const SeqId id = plan.seqs[i].id;
    Active& a = active_.at(id);
    const int32_t token = sampled_[i];
    a.stream->push(token);
    ++metrics_.generation_tokens;
    if (a.first_token == RequestStream::Clock::time_point{}) {
      a.first_token = done;
      metrics_.time_to_first_token.observe(seconds(done - a.arrival));
    } else {
      metrics_.inter_token_latency.observe(seconds(done - a.last_token));
    }
    a.last_token = done;
    if (!a.ignore_eos && token == eos) {
      scheduler_.finish(id);
      finish(id, a, "stop");
    } else if (scheduler_.num_generated(id) >= a.max_tokens) {
      finish(id, a, "length");  // the scheduler finished it in complete()
    }
  }
  publish_gauges();
}

}  // namespace moex::serve

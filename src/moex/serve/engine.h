// `moex serve`'s engine: the runtime engine (runtime/engine.h, the loop every command runs) stepped by a
// thread of its own, and each request's token stream, which an HTTP thread reads. docs/serve.md describes the
// loop and its metrics.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "moex/runtime/engine.h"

namespace moex::serve {

// What the engine tells one request. The engine thread pushes; the request's HTTP thread waits and reads.
class RequestStream : public RequestSink {
 public:
  using Clock = std::chrono::steady_clock;
  struct Read {
    std::vector<int32_t> tokens;  // new since the last read
    std::vector<SampledToken> logprobs;  // one per token when the request asked for logprobs, else empty
    bool finished = false;
    std::string finish_reason;    // "stop" (EOS), "length" (max_tokens), "abort" (engine error), "cancelled"
    std::string error;            // non-empty: the request failed (message for the client)
  };
  // Blocks up to `timeout` for something new; moves it out.
  Read wait(std::chrono::milliseconds timeout);
  // The client went away, or it stopped on a stop string: the engine cancels the sequence at its next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const override { return cancelled_.load(); }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t cached_tokens() const { return cached_tokens_.load(); }  // prompt tokens found in the prefix cache

  // Engine side (RequestSink).
  explicit RequestStream(int64_t prompt_tokens) : prompt_tokens_(prompt_tokens) {}
  void on_scheduled(int64_t cached_tokens) override { cached_tokens_.store(cached_tokens); }
  void on_token(int32_t token, const SampledToken* logprobs) override;
  void on_finish(FinishReason reason, const std::string& error) override;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int32_t> tokens_;
  std::vector<SampledToken> logprobs_;
  bool finished_ = false;
  std::string finish_reason_, error_;
  std::atomic<bool> cancelled_{false};
  const int64_t prompt_tokens_;
  std::atomic<int64_t> cached_tokens_{0};
};

class Engine {
 public:
  // Starts the engine thread. Multi-rank (options.comm): the other ranks run run_step_worker until this
  // engine is destroyed.
  Engine(DecoderModel& model, const EngineOptions& options);
  ~Engine();  // stops the engine thread; the requests still in flight end with "abort"
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Throws Error(kInvalidInput) with a message for the client (HTTP 400) for a prompt
  // or max_tokens that cannot fit; returns null when the queue is full (HTTP 429).
  std::shared_ptr<RequestStream> submit(GenerationRequest request);

  const EngineOptions& options() const { return core_.options(); }
  const DecoderModel& model() const { return core_.model(); }
  int64_t capacity_positions() const { return core_.capacity_positions(); }
  int num_pools() const { return core_.num_pools(); }
  EngineMetrics& metrics() { return core_.metrics(); }
  nlohmann::json stats() const { return core_.stats(); }

 private:
  void loop();

  moex::Engine core_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace moex::serve

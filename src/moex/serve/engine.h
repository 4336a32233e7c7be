// The serving engine: one thread runs the continuous-batching loop (schedule -> forward -> sample ->
// complete) over the model's paged KV cache; HTTP threads submit requests and read each request's token
// stream. docs/serve.md describes the loop and its metrics.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/model/decoder.h"
#include "moex/profile/profile.h"
#include "moex/runtime/kv_block_manager.h"
#include "moex/runtime/sampler.h"
#include "moex/runtime/scheduler.h"
#include "moex/runtime/metrics.h"

namespace moex::serve {

struct EngineOptions {
  int64_t max_num_seqs = 64;       // sequences in one step
  int64_t max_batch_tokens = 512;  // tokens in one step (the model's step size)
  int64_t max_waiting = 256;       // requests queued beyond the running ones; more: rejected (HTTP 429)
  int64_t max_model_len = 2048;    // prompt + max_tokens
  bool prefix_caching = true;
  std::string model_name = "moex";  // the model_name label on every metric
  bool log_steps = false;           // one stderr line per step: its kind, rows and where its time went
  // Multi-rank (this is rank 0): every step's input goes to the other ranks (serve/step_sync.h). Under
  // attention TP all ranks run rank 0's step; under attention DP (the model's plan) the engine keeps one
  // scheduler and block manager per rank (each rank's pool), assigns each request to a rank
  // (least_loaded_rank) and sends each rank its own sub-step; max_num_seqs and max_batch_tokens are per rank.
  comm::Communicator* comm = nullptr;
  // Each step's time per profiler zone and tokens per expert, for stats() (/v1/engine/stats): the engine
  // thread turns the profiler on (two clock reads per zone, ~100 zones a step for a 32-layer model) and drains
  // its own totals after every step. Off: those parts of stats() stay zero.
  bool step_breakdown = true;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  SamplerOptions sampler;
  bool ignore_eos = false;
};

// What the engine tells one request. The engine thread pushes; the request's HTTP thread waits and reads.
class RequestStream {
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
  bool cancelled() const { return cancelled_.load(); }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t cached_tokens() const { return cached_tokens_.load(); }  // prompt tokens found in the prefix cache

  // Engine side.
  explicit RequestStream(int64_t prompt_tokens) : prompt_tokens_(prompt_tokens) {}
  void push(int32_t token, const SampledToken* logprobs = nullptr);
  void finish(const std::string& reason, const std::string& error = "");
  void set_cached_tokens(int64_t n) { cached_tokens_.store(n); }

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

// The server's Prometheus metrics: vLLM's serving metrics (runtime/metrics.h) and the server's own.
struct EngineMetrics {
  explicit EngineMetrics(const std::string& model_name);
  metrics::Registry registry;
  metrics::ServingMetrics serving;
  metrics::Gauge& kv_blocks_used;       // moex:kv_cache_blocks_used
  metrics::Gauge& kv_blocks_total;      // moex:kv_cache_blocks_total
  metrics::Counter& requests_rejected;  // moex:requests_rejected_total (HTTP 429)
  // Per request: prompt tokens the engine computed before its first token (the prompt minus what the
  // prefix cache supplied; a preempted request's recompute is not in it).
  metrics::Histogram& request_prompt_computed_tokens;  // moex:request_prompt_computed_tokens
  // The engine's steps, by kind: "prefill" (at least one prompt or recompute chunk, decode rows riding
  // along) and "decode" (only decode rows). Where the engine thread's time goes, per kind: the whole step
  // (schedule, building the input, forward, sampling, pushing tokens) and the forward alone. Wall time not
  // in any step is the engine waiting for requests.
  struct StepKind {
    StepKind(metrics::Registry& r, const std::string& model_name, const std::string& kind);
    metrics::Counter& steps;           // moex:engine_steps_total{kind}
    metrics::Counter& step_seconds;    // moex:engine_step_seconds_total{kind}
    metrics::Counter& forward_seconds; // moex:engine_forward_seconds_total{kind}
    metrics::Counter& prompt_rows;     // moex:engine_step_rows_total{kind, row="prompt"}
    metrics::Counter& decode_rows;     // moex:engine_step_rows_total{kind, row="decode"}
    metrics::Histogram& step_duration; // moex:engine_step_duration_seconds{kind}
  };
  StepKind prefill_steps, decode_steps;
};

// Attention DP: which rank a new request goes to. The fewest sequences (running + waiting) first; on a tie
// the longest cached prefix of the prompt in the rank's pool, then the most free blocks, then the lowest rank.
struct RankLoad {
  int64_t sequences = 0;      // running + waiting on the rank
  int64_t cached_blocks = 0;  // full blocks of the prompt already in the rank's prefix cache
  int64_t free_blocks = 0;
};
int least_loaded_rank(const std::vector<RankLoad>& ranks);

class Engine {
 public:
  // The model's pool and step size bound the options (max_batch_tokens <= the model's step tokens).
  Engine(DecoderModel& model, const EngineOptions& options);
  ~Engine();  // stops the engine thread
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Throws Error(kInvalidInput) with a message for the client (HTTP 400) for a prompt
  // or max_tokens that cannot fit; returns null when the queue is full (HTTP 429).
  std::shared_ptr<RequestStream> submit(GenerationRequest request);

  const EngineOptions& options() const { return options_; }
  const DecoderModel& model() const { return model_; }
  // One pool's positions (a request lives on one rank, so this bounds a request under attention DP too).
  int64_t capacity_positions() const { return num_blocks_ * kernels::kKvBlockSize; }
  int num_pools() const { return static_cast<int>(pools_.size()); }  // ranks under attention DP, else 1
  EngineMetrics& metrics() { return metrics_; }
  // What /v1/engine/stats answers (fields: docs/serve.md): counters since start-up, which a client turns
  // into rates by taking the difference of two reads, and the current gauges. Safe from any thread.
  nlohmann::json stats() const;

 private:
  struct Active {
    Active(std::shared_ptr<RequestStream> s, const SamplerOptions& o) : stream(std::move(s)), sampler(o) {}
    std::shared_ptr<RequestStream> stream;
    Sampler sampler;
    TokenCounts generated;  // what the presence / frequency penalties look at
    SampledToken last;      // the latest sampled token and its logprobs (reused: no allocation per token)
    int pool = 0;            // the rank whose pool holds its KV (attention DP), else 0
    int64_t max_tokens = 0;
    int64_t num_tokens = 0;  // generated so far
    bool ignore_eos = false;
    bool seen = false;      // has been in a plan (its cached prefix is known)
    bool finished = false;  // its stream has its final event
    int64_t prompt_computed = 0;  // prompt (or recompute) rows computed so far
    RequestStream::Clock::time_point arrival, scheduled, first_token, last_token;
  };
  struct Pending {
    SeqId id;
    GenerationRequest request;
    std::shared_ptr<RequestStream> stream;
    RequestStream::Clock::time_point arrival;
  };
  void loop();
  void step();
  void finish(SeqId id, Active& a, const std::string& reason, const std::string& error = "");
  void publish_gauges();
  bool idle() const;
  int assign_pool(const std::vector<int32_t>& prompt) const;

  // One scheduler over one block manager per pool (rank r's pool under attention DP; one otherwise), and
  // that pool's part of the current step.
  struct Pool {
    Pool(int32_t num_blocks, const EngineOptions& o, EngineMetrics& m, int rank, bool per_rank_metrics);
    KvBlockManager blocks;
    Scheduler scheduler;
    const StepPlan* plan = nullptr;
    std::vector<int32_t> tokens;      // [max_batch_tokens] this step's rows
    std::vector<StepSeq> seqs;        // [max_num_seqs]
    std::vector<int32_t> logit_rows;  // [max_num_seqs] rows that sample
    std::vector<int32_t> sampled;     // [max_num_seqs] per plan sequence
    // Attention DP only (null otherwise): requests assigned, requests running, blocks referenced on this rank.
    metrics::Counter* requests = nullptr;
    metrics::Gauge* running = nullptr;
    metrics::Gauge* blocks_used = nullptr;
  };

  DecoderModel& model_;
  EngineOptions options_;
  bool data_parallel_;
  int64_t num_blocks_;  // per pool
  EngineMetrics metrics_;
  std::vector<std::unique_ptr<Pool>> pools_;

  std::mutex mutex_;  // guards pending_, stop_, in_flight_
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  int64_t in_flight_ = 0;  // submitted and not yet finished
  SeqId next_id_ = 1;

  // Engine-thread state.
  std::unordered_map<SeqId, Active> active_;
  std::vector<StepInput> inputs_;  // [pools] each pool's StepInput (rank r's sub-step under attention DP)
  std::vector<float> logits_;      // [pools * max_num_seqs, vocab], pool 0's rows first
  int64_t step_number_ = 0;
  const RequestStream::Clock::time_point started_ = RequestStream::Clock::now();
  bool enabled_profiler_ = false;  // step_breakdown turned the profiler on (and turns it off at the end)

  // stats()'s share of the engine thread's state, copied after each step under stats_mutex_.
  struct StepTotals {
    int64_t steps = 0, sequences = 0, prompt_rows = 0, decode_rows = 0;
    double step_seconds = 0, forward_seconds = 0;
    int64_t last_sequences = 0, last_prompt_rows = 0, last_decode_rows = 0;
    double last_step_ms = 0;
    int64_t kv_used = 0, kv_cached = 0, kv_free = 0;  // referenced; unreferenced but holding a cached prefix; empty
    profile::ThreadTotals zones;  // zone self times and tokens per expert, summed over the steps
  };
  mutable std::mutex stats_mutex_;
  StepTotals totals_;
  std::thread thread_;
};

}  // namespace moex::serve

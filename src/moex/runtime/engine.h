// The engine: the one loop under every command. Each step() schedules (runtime/scheduler.h), runs the
// model's forward over the paged KV cache, samples, and tells each request what it got. Two ways to drive it,
// as vLLM's LLMEngine: stepped on the caller's thread until idle (generate(), `moex logits`, the benchmarks
// and `moex profile`: runtime/generation.h), or by `moex serve`'s engine thread (serve/engine.h), which adds
// the thread and the HTTP side. Under mpirun rank 0 drives the engine and every other rank runs
// run_step_worker (runtime/step_protocol.h), for attention TP and DP alike. docs/serve.md describes the
// step and its metrics.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/model/decoder.h"
#include "moex/profile/profile.h"
#include "moex/runtime/kv_block_manager.h"
#include "moex/runtime/metrics.h"
#include "moex/runtime/sampler.h"
#include "moex/runtime/scheduler.h"
#include "moex/runtime/step_protocol.h"

namespace moex {

struct EngineOptions {
  int64_t max_num_seqs = 64;     // sequences in one step
  int64_t max_step_tokens = 0;   // the step's token budget; 0: the model's (ModelOptions::max_step_tokens)
  int64_t max_waiting = 256;     // requests queued beyond the running ones; more: submit() refuses (HTTP 429)
  int64_t max_model_len = 0;     // prompt + max_tokens; 0: the model's max_seq_len
  bool prefix_caching = true;
  std::string model_name = "moex";  // the model_name label on every metric
  bool log_steps = false;           // one stderr line per step: its kind, rows and where its time went
  // Multi-rank (this is rank 0): every step's input goes to the other ranks (runtime/step_protocol.h). Under
  // attention TP all ranks run rank 0's step; under attention DP (the model's plan) the engine keeps one
  // scheduler and block manager per rank (each rank's pool), assigns each request to a rank
  // (least_loaded_rank) and sends each rank its own sub-step; max_num_seqs and max_step_tokens are per rank.
  comm::Communicator* comm = nullptr;
  // Each step's time per profiler zone and tokens per expert, for stats() (/v1/engine/stats): the engine
  // turns the profiler on (two clock reads per zone, ~100 zones a step for a 32-layer model) and drains the
  // driving thread's totals after every step. Off: those parts of stats() stay zero, and the profiler is
  // the caller's (moex profile).
  bool step_breakdown = true;
  // Called on the driving thread after each step's forward, with rank 0's input (the benchmarks' replay
  // recorder reads which weights it touched).
  std::function<void(const StepInput&, StepKind)> after_forward;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  SamplerOptions sampler;
  bool ignore_eos = false;
  // The logits of every row the request computes (vLLM's prompt_logprobs, as raw logits, and the decode
  // rows' too) go to RequestSink::on_logits. Needs an engine without prefix caching (every prompt position
  // computed).
  bool all_logits = false;
};

// Where the engine reports one request's progress, on the driving thread. serve::RequestStream hands it to
// an HTTP thread; generate() collects it.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  // First scheduled: this many prompt tokens came from the prefix cache.
  virtual void on_scheduled(int64_t /*cached_tokens*/) {}
  // Positions [first, first + rows) and their logits [rows, vocab] (all_logits only; a recompute after a
  // preemption gives positions again, with the same values).
  virtual void on_logits(int64_t /*first*/, int64_t /*rows*/, const float* /*logits*/) {}
  virtual void on_token(int32_t token, const SampledToken* logprobs) = 0;  // logprobs when asked for
  virtual void on_finish(FinishReason reason, const std::string& error) = 0;  // the last call
  // The client went away (or stopped on a stop string): the engine cancels the request at its next step.
  virtual bool cancelled() const { return false; }
};

// The engine's Prometheus metrics: vLLM's serving metrics (runtime/metrics.h) and the engine's own.
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
  // along) and "decode" (only decode rows). Where the driving thread's time goes, per kind: the whole step
  // (schedule, building the input, forward, sampling, reporting tokens) and the forward alone. Wall time not
  // in any step is the engine waiting for requests.
  struct StepKindMetrics {
    StepKindMetrics(metrics::Registry& r, const std::string& model_name, const std::string& kind);
    metrics::Counter& steps;           // moex:engine_steps_total{kind}
    metrics::Counter& step_seconds;    // moex:engine_step_seconds_total{kind}
    metrics::Counter& forward_seconds; // moex:engine_forward_seconds_total{kind}
    metrics::Counter& prompt_rows;     // moex:engine_step_rows_total{kind, row="prompt"}
    metrics::Counter& decode_rows;     // moex:engine_step_rows_total{kind, row="decode"}
    metrics::Histogram& step_duration; // moex:engine_step_duration_seconds{kind}
  };
  StepKindMetrics prefill_steps, decode_steps;
  // Under EP, per MoE layer (null for a dense one): mean / max of the last step's tokens over the EP ranks' experts
  // (moex:eplb_balancedness{layer}) and the tokens routed to each expert (moex:eplb_expert_tokens_total{layer,
  // expert}); under attention DP, of rank 0's tokens. docs/moe.md, "Expert load balancing".
  std::vector<metrics::Gauge*> eplb_balancedness;
  std::vector<std::vector<metrics::Counter*>> eplb_expert_tokens;
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
  // The model's pool and step size bound the options (max_step_tokens <= the model's step tokens).
  Engine(DecoderModel& model, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // The one check of a request: throws Error(kInvalidInput) with a message for the client (HTTP 400) for a
  // prompt, max_tokens or sampling option that cannot be served. Safe from any thread.
  void validate(const GenerationRequest& request) const;
  // Validates and queues a request (any thread); its sink hears from the driving thread from the next step
  // on. Returns false when the queue is full (HTTP 429).
  bool submit(GenerationRequest request, std::shared_ptr<RequestSink> sink);

  // One step, on the driving thread: new requests join, cancelled ones leave, then schedule -> forward ->
  // sample -> complete. With nothing to run it only tells the other ranks that rank 0 is alive.
  void step();
  bool has_work() const;  // a request is queued or running
  // The serving thread's wait: until a request is submitted, interrupt() is called, or the timeout passes.
  void wait_for_work(std::chrono::milliseconds timeout);
  void interrupt();
  // Every running and queued request finishes with kAbort and `error` (a failed step; shutting down).
  void abort_all(const std::string& error);
  // The other ranks leave run_step_worker (multi-rank only).
  void stop_workers();

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
  using Clock = std::chrono::steady_clock;
  struct Active {
    Active(std::shared_ptr<RequestSink> s, const SamplerOptions& o) : sink(std::move(s)), sampler(o) {}
    std::shared_ptr<RequestSink> sink;
    Sampler sampler;
    TokenCounts generated;  // what the presence / frequency penalties look at
    SampledToken last;      // the latest sampled token and its logprobs (reused: no allocation per token)
    int pool = 0;            // the rank whose pool holds its KV (attention DP), else 0
    int64_t prompt_len = 0;
    int64_t num_tokens = 0;  // generated so far
    bool logprobs = false;
    bool all_logits = false;
    bool seen = false;      // has been in a plan (its cached prefix is known)
    bool finished = false;  // its sink has its final event
    int64_t prompt_computed = 0;  // prompt (or recompute) rows computed so far
    Clock::time_point arrival, scheduled, first_token, last_token;
  };
  struct Pending {
    SeqId id;
    GenerationRequest request;
    std::shared_ptr<RequestSink> sink;
    Clock::time_point arrival;
  };
  void finish(Active& a, FinishReason reason, const std::string& error = "");
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
    std::vector<int32_t> tokens;      // [max_step_tokens] this step's rows
    std::vector<StepSeq> seqs;        // [max_num_seqs]
    std::vector<int32_t> logit_rows;  // rows whose logits the step returns (sampling rows, all_logits rows)
    std::vector<int64_t> first_logit; // per plan sequence: its first row in logits_ (-1: none)
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

  mutable std::mutex mutex_;  // guards pending_, in_flight_, interrupted_
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  int64_t in_flight_ = 0;  // submitted and not yet finished
  bool interrupted_ = false;
  SeqId next_id_ = 1;

  // Driving-thread state.
  std::unordered_map<SeqId, Active> active_;
  std::vector<StepInput> inputs_;  // [pools] each pool's StepInput (rank r's sub-step under attention DP)
  std::vector<float> logits_;      // [logit rows of every pool, vocab], pool 0's rows first
  int64_t step_number_ = 0;
  std::vector<double> eplb_rank_tokens_;  // [ep] one MoE layer's tokens per EP rank, for moex:eplb_balancedness
  const Clock::time_point started_ = Clock::now();
  bool enabled_profiler_ = false;  // step_breakdown turned the profiler on (and turns it off at the end)

  // stats()'s share of the driving thread's state, copied after each step under stats_mutex_.
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
};

}  // namespace moex

#include "moex/runtime/engine.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <optional>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/profile/profile.h"

namespace moex {

// ---- EngineMetrics -------------------------------------------------------------------------------------

EngineMetrics::EngineMetrics(const std::string& model_name)
    : serving(registry, model_name),  // model_name is a label of each of its metrics, as of these:
      kv_blocks_used(registry.gauge("moex:kv_cache_blocks_used", "KV-cache blocks referenced by a request.",
                                    {{"model_name", model_name}})),
      kv_blocks_total(registry.gauge("moex:kv_cache_blocks_total", "KV-cache blocks in the pool.", {{"model_name", model_name}})),
      requests_rejected(registry.counter("moex:requests_rejected_total", "Requests refused with 429 (queue full).",
                                         {{"model_name", model_name}})),
      request_prompt_computed_tokens(registry.histogram(
          "moex:request_prompt_computed_tokens",
          "Per request: prompt tokens computed before the first token (the prompt minus the prefix-cache hits).",
          {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000},
          {{"model_name", model_name}})),
      prefill_steps(registry, model_name, "prefill"),
      decode_steps(registry, model_name, "decode") {}

EngineMetrics::StepKindMetrics::StepKindMetrics(metrics::Registry& r, const std::string& model_name, const std::string& kind)
    : steps(r.counter("moex:engine_steps_total",
                      "Engine steps by kind: prefill (a prompt chunk, decode rows riding along), decode (decode rows only).",
                      {{"model_name", model_name}, {"kind", kind}})),
      step_seconds(r.counter("moex:engine_step_seconds_total",
                             "Engine-thread seconds in steps of this kind: schedule, input, forward, sampling, token push.",
                             {{"model_name", model_name}, {"kind", kind}})),
      forward_seconds(r.counter("moex:engine_forward_seconds_total", "Seconds in the model's forward, by step kind.",
                                {{"model_name", model_name}, {"kind", kind}})),
      prompt_rows(r.counter("moex:engine_step_rows_total", "Rows (tokens) computed, by step kind and row kind.",
                            {{"model_name", model_name}, {"kind", kind}, {"row", "prompt"}})),
      decode_rows(r.counter("moex:engine_step_rows_total", "Rows (tokens) computed, by step kind and row kind.",
                            {{"model_name", model_name}, {"kind", kind}, {"row", "decode"}})),
      step_duration(r.histogram("moex:engine_step_duration_seconds", "Seconds per engine step, by kind.",
                                {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                                 2.5, 5.0, 10.0},
                                {{"model_name", model_name}, {"kind", kind}})) {}

// ---- Engine --------------------------------------------------------------------------------------------

namespace {
double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

int least_loaded_rank(const std::vector<RankLoad>& ranks) {
  int best = 0;
  for (int r = 1; r < static_cast<int>(ranks.size()); ++r) {
    const RankLoad &a = ranks[r], &b = ranks[best];
    if (a.sequences != b.sequences ? a.sequences < b.sequences
        : a.cached_blocks != b.cached_blocks ? a.cached_blocks > b.cached_blocks
                                             : a.free_blocks > b.free_blocks)
      best = r;
  }
  return best;
}

Engine::Pool::Pool(int32_t num_blocks, const EngineOptions& o, EngineMetrics& m, int rank, bool per_rank_metrics)
    : blocks(num_blocks, static_cast<int32_t>(kernels::kKvBlockSize), o.prefix_caching),
      scheduler(SchedulerOptions{o.max_num_seqs, o.max_step_tokens}, blocks) {
  tokens.reserve(o.max_step_tokens);
  seqs.reserve(o.max_num_seqs);
  logit_rows.reserve(o.max_num_seqs);  // data() is never null: 0 rows is a real (empty) list, not "every row"
  first_logit.reserve(o.max_num_seqs);
  sampled.reserve(o.max_num_seqs);
  if (!per_rank_metrics) return;
  const metrics::Labels labels{{"model_name", o.model_name}, {"dp_rank", std::to_string(rank)}};
  requests = &m.registry.counter("moex:dp_rank_requests_total", "Attention DP: requests assigned to this rank.", labels);
  running = &m.registry.gauge("moex:dp_rank_num_requests_running", "Attention DP: requests running on this rank.", labels);
  blocks_used = &m.registry.gauge("moex:dp_rank_kv_cache_blocks_used",
                                  "Attention DP: KV-cache blocks referenced by a request in this rank's pool.", labels);
}

namespace {
EngineOptions with_model_defaults(EngineOptions o, const DecoderModel& model) {
  if (o.max_step_tokens == 0) o.max_step_tokens = model.options().max_step_tokens;
  if (o.max_model_len == 0) o.max_model_len = model.options().max_seq_len;
  return o;
}
}  // namespace

Engine::Engine(DecoderModel& model, const EngineOptions& options)
    : model_(model),
      options_(with_model_defaults(options, model)),
      data_parallel_(options.comm && model.options().plan.attn == AttnParallel::kDP && !model.options().plan.single()),
      num_blocks_(model.kv_cache().num_blocks()),
      metrics_(options.model_name) {
  if (const ParallelPlan& plan = model.options().plan; plan.ep > 1) {
    const ModelConfig& c = model.config();
    metrics_.eplb_balancedness.assign(c.num_hidden_layers, nullptr);
    metrics_.eplb_expert_tokens.resize(c.num_hidden_layers);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (!c.moe_layer(l)) continue;
      const metrics::Labels labels{{"model_name", options.model_name}, {"layer", std::to_string(l)}};
      metrics_.eplb_balancedness[l] = &metrics_.registry.gauge(
          "moex:eplb_balancedness", "Per MoE layer: mean / max of the last step's tokens over the EP ranks' experts.", labels);
      for (int e = 0; e < c.num_local_experts; ++e) {
        metrics::Labels el = labels;
        el["expert"] = std::to_string(e);
        metrics_.eplb_expert_tokens[l].push_back(&metrics_.registry.counter(
            "moex:eplb_expert_tokens_total", "Tokens routed to each expert, per MoE layer.", el));
      }
    }
  }
  MOEX_CHECK_INPUT(options_.max_step_tokens <= model.options().max_step_tokens, "--max-step-tokens ",
                   options_.max_step_tokens, " is more than the model's step size ", model.options().max_step_tokens);
  MOEX_CHECK_INPUT(options_.max_model_len >= 2 && options_.max_model_len <= model.options().max_seq_len,
                   "--max-model-len ", options_.max_model_len, " must be 2..", model.options().max_seq_len);
  MOEX_CHECK_INPUT(options_.max_waiting >= 0, "--max-waiting must be >= 0");
  MOEX_CHECK(!data_parallel_ || options.comm->size() == model.options().plan.world, "one pool per rank");
  // Under attention DP every rank's pool has rank 0's shape (same flags, all KV heads): num_blocks_ each.
  const int pools = data_parallel_ ? options.comm->size() : 1;
  for (int r = 0; r < pools; ++r)
    pools_.push_back(std::make_unique<Pool>(static_cast<int32_t>(num_blocks_), options_, metrics_, r, data_parallel_));
  inputs_.resize(pools);
  logits_.resize(static_cast<size_t>(pools) * options_.max_num_seqs * model.config().vocab_size);
  metrics_.kv_blocks_total.set(static_cast<double>(num_blocks_ * pools));
  if (options_.step_breakdown && !profile::enabled()) {
    profile::enable(true);
    enabled_profiler_ = true;
  }
}

Engine::~Engine() {
  if (enabled_profiler_) profile::enable(false);
}

void Engine::validate(const GenerationRequest& request) const {
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
  MOEX_CHECK_INPUT(!request.all_logits || !options_.prefix_caching,
                   "the logits of every position need every prompt position computed: an engine without prefix caching");
  Sampler sampler(request.sampler);  // throws for bad sampling options
}

bool Engine::submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) {
  validate(request);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_flight_ >= options_.max_num_seqs * num_pools() + options_.max_waiting) {
      metrics_.requests_rejected.inc();
      return false;
    }
    ++in_flight_;
    pending_.push_back(Pending{next_id_++, std::move(request), std::move(sink), Clock::now()});
  }
  cv_.notify_all();
  return true;
}

bool Engine::has_work() const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pending_.empty()) return true;
  }
  return !idle();
}

void Engine::wait_for_work(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (interrupted_ || !pending_.empty() || !idle()) return;
  cv_.wait_for(lock, timeout, [&] { return interrupted_ || !pending_.empty(); });
}

void Engine::interrupt() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    interrupted_ = true;
  }
  cv_.notify_all();
}

void Engine::abort_all(const std::string& error) {
  for (auto& [id, a] : active_) {
    pools_[a.pool]->scheduler.cancel(id);
    finish(a, FinishReason::kAbort, error);
  }
  std::deque<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending.swap(pending_);
    in_flight_ -= static_cast<int64_t>(pending.size());
  }
  for (Pending& p : pending) {
    p.sink->on_finish(FinishReason::kAbort, error);
    metrics_.serving.request_success_abort.inc();
  }
}

void Engine::stop_workers() {
  if (options_.comm) send_command(*options_.comm, StepCommand::kStop);
}

void Engine::finish(Active& a, FinishReason reason, const std::string& error) {
  if (a.finished) return;
  a.finished = true;
  a.sink->on_finish(reason, error);
  metrics::ServingMetrics& m = metrics_.serving;
  if (reason == FinishReason::kStop) m.request_success_stop.inc();
  else if (reason == FinishReason::kLength) m.request_success_length.inc();
  else m.request_success_abort.inc();
  if (a.seen) m.e2e_request_latency_seconds.observe(seconds(Clock::now() - a.arrival));
  if (a.first_token != Clock::time_point{}) {
    m.request_prefill_time_seconds.observe(seconds(a.first_token - a.scheduled));
    m.request_decode_time_seconds.observe(seconds(a.last_token - a.first_token));
    if (a.num_tokens > 1)
      m.time_per_output_token_seconds.observe(seconds(a.last_token - a.first_token) / static_cast<double>(a.num_tokens - 1));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  --in_flight_;
}

// Global over the pools: sums of every rank's requests and blocks (and, under attention DP, each rank's own).
void Engine::publish_gauges() {
  metrics::ServingMetrics& m = metrics_.serving;
  int64_t pending = 0, running = 0, waiting = 0, used = 0, cached = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending = static_cast<int64_t>(pending_.size());
  }
  for (const auto& p : pools_) {
    running += p->scheduler.num_running();
    waiting += p->scheduler.num_waiting();
    used += p->blocks.num_used_blocks();
    cached += p->blocks.num_evictable_blocks();
    if (p->running) p->running->set(static_cast<double>(p->scheduler.num_running()));
    if (p->blocks_used) p->blocks_used->set(static_cast<double>(p->blocks.num_used_blocks()));
  }
  m.num_requests_running.set(static_cast<double>(running));
  m.num_requests_waiting.set(static_cast<double>(waiting + pending));
  metrics_.kv_blocks_used.set(static_cast<double>(used));
  const int64_t total = num_blocks_ * num_pools();
  m.kv_cache_usage_perc.set(static_cast<double>(used) / static_cast<double>(std::max<int64_t>(total, 1)));
  std::lock_guard<std::mutex> lock(stats_mutex_);
  totals_.kv_used = used;
  totals_.kv_cached = cached;
  totals_.kv_free = total - used - cached;
}

nlohmann::json Engine::stats() const {
  const metrics::ServingMetrics& m = metrics_.serving;
  const ModelConfig& config = model_.config();
  nlohmann::json layers = nlohmann::json::array();
  for (int l = 0; l < config.num_hidden_layers; ++l) layers.push_back(config.moe_layer(l));
  nlohmann::json out = {
      {"model", options_.model_name},
      {"uptime_s", seconds(Clock::now() - started_)},
      {"config",
       {{"layers", config.num_hidden_layers},
        {"moe_layers", layers},
        {"experts", config.num_local_experts},
        {"experts_per_token", config.num_experts_per_tok},
        {"max_num_seqs", options_.max_num_seqs},
        {"max_step_tokens", options_.max_step_tokens},
        {"kv_block_size", kernels::kKvBlockSize},
        {"ranks", options_.comm ? options_.comm->size() : 1},
        {"step_breakdown", options_.step_breakdown}}},
      {"requests",
       {{"running", static_cast<int64_t>(m.num_requests_running.value())},
        {"waiting", static_cast<int64_t>(m.num_requests_waiting.value())},
        {"finished_stop", static_cast<int64_t>(m.request_success_stop.value())},
        {"finished_length", static_cast<int64_t>(m.request_success_length.value())},
        {"aborted", static_cast<int64_t>(m.request_success_abort.value())},
        {"rejected", static_cast<int64_t>(metrics_.requests_rejected.value())}}},
      {"tokens",
       {{"prompt", static_cast<int64_t>(m.prompt_tokens.value())},
        {"generated", static_cast<int64_t>(m.generation_tokens.value())},
        {"prefix_cache_hits", static_cast<int64_t>(m.prefix_cache_hits.value())}}},
  };
  std::lock_guard<std::mutex> lock(stats_mutex_);
  const StepTotals& t = totals_;
  out["kv_blocks"] = {{"total", num_blocks_ * num_pools()}, {"used", t.kv_used}, {"cached", t.kv_cached}, {"free", t.kv_free}};
  out["steps"] = {{"count", t.steps},
                  {"sequences", t.sequences},
                  {"prompt_rows", t.prompt_rows},
                  {"decode_rows", t.decode_rows},
                  {"seconds", t.step_seconds},
                  {"forward_seconds", t.forward_seconds}};
  out["last_step"] = {{"sequences", t.last_sequences},
                      {"prompt_rows", t.last_prompt_rows},
                      {"decode_rows", t.last_decode_rows},
                      {"ms", t.last_step_ms}};
  // Self times (a zone nested in another counts once, in the inner one); "other" is the rest of the steps'
  // wall time: scheduling, sampling, norms, and what no zone covers.
  nlohmann::json zones = nlohmann::json::object();
  double zoned = 0;
  for (int z = 0; z < profile::kNumZones; ++z) {
    const double s = static_cast<double>(t.zones.self_ns[z]) * 1e-9;
    zoned += s;
    if (static_cast<profile::Zone>(z) == profile::Zone::kOther) continue;
    zones[profile::zone_name(static_cast<profile::Zone>(z))] = s;
  }
  zones["other"] = std::max(0.0, t.step_seconds - zoned) +
                   static_cast<double>(t.zones.self_ns[static_cast<int>(profile::Zone::kOther)]) * 1e-9;
  out["zone_seconds"] = std::move(zones);
  nlohmann::json experts = nlohmann::json::array();
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    const auto& row = static_cast<size_t>(l) < t.zones.tokens_per_expert.size() ? t.zones.tokens_per_expert[l]
                                                                               : std::vector<uint64_t>{};
    nlohmann::json r = nlohmann::json::array();
    if (config.moe_layer(l))
      for (int e = 0; e < config.num_local_experts; ++e) r.push_back(static_cast<size_t>(e) < row.size() ? row[e] : 0);
    experts.push_back(std::move(r));
  }
  out["expert_tokens"] = std::move(experts);
  return out;
}

bool Engine::idle() const {
  for (const auto& p : pools_)
    if (!p->scheduler.idle()) return false;
  return true;
}

int Engine::assign_pool(const std::vector<int32_t>& prompt) const {
  if (pools_.size() == 1) return 0;
  std::vector<RankLoad> load(pools_.size());
  for (size_t r = 0; r < pools_.size(); ++r) {
    const Pool& p = *pools_[r];
    load[r].sequences = p.scheduler.num_running() + p.scheduler.num_waiting();
    load[r].cached_blocks = p.blocks.probe_prefix(prompt.data(), static_cast<int64_t>(prompt.size())).blocks;
    load[r].free_blocks = p.blocks.num_free_blocks();
  }
  return least_loaded_rank(load);
}

void Engine::step() {
  const auto step_start = Clock::now();
  // New requests join a pool's queue (FCFS by submission; under attention DP the least loaded rank's).
  std::deque<Pending> incoming;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    incoming.swap(pending_);
  }
  const int eos = model_.config().eos_token_id;
  for (Pending& p : incoming) {
    const int pool = assign_pool(p.request.prompt);
    const int64_t prompt_len = static_cast<int64_t>(p.request.prompt.size());
    pools_[pool]->scheduler.add(p.id, std::move(p.request.prompt), p.request.max_tokens,
                                p.request.ignore_eos ? -1 : eos);  // validated in submit()
    if (pools_[pool]->requests) pools_[pool]->requests->inc();
    Active a(std::move(p.sink), p.request.sampler);
    a.pool = pool;
    a.prompt_len = prompt_len;
    a.logprobs = p.request.sampler.logprobs;
    a.all_logits = p.request.all_logits;
    a.arrival = p.arrival;
    active_.emplace(p.id, std::move(a));
  }
  // Clients that went away (or stopped on a stop string): cancelled now, their blocks freed by schedule().
  for (auto& [id, a] : active_) {
    if (a.finished || !a.sink->cancelled()) continue;
    pools_[a.pool]->scheduler.cancel(id);
    finish(a, FinishReason::kCancelled);
  }
  if (idle()) {
    publish_gauges();
    if (options_.comm) send_command(*options_.comm, StepCommand::kIdle);  // keeps the other ranks' wait short
    return;
  }

  // Each pool's scheduler plans its part of the step (under attention DP: rank r's sub-step).
  metrics::ServingMetrics& m = metrics_.serving;
  size_t num_seqs = 0;
  for (auto& p : pools_) {
    p->plan = &p->scheduler.schedule();
    for (SeqId id : p->plan->released) active_.erase(id);
    m.num_preemptions.inc(static_cast<double>(p->plan->preempted.size()));
    num_seqs += p->plan->seqs.size();
  }
  if (num_seqs == 0) {
    publish_gauges();
    return;
  }

  // StepInput per pool: each sequence's tokens [begin, end) through its block table; logits of the rows that
  // sample (and of every prompt row of a request that asked for its prompt's logits).
  const auto now = Clock::now();
  int64_t prompt_rows = 0, decode_rows = 0, logit_rows = 0;
  for (size_t r = 0; r < pools_.size(); ++r) {
    Pool& p = *pools_[r];
    p.tokens.clear();
    p.seqs.clear();
    p.logit_rows.clear();
    p.first_logit.clear();
    for (const ScheduledSeq& s : p.plan->seqs) {
      const int64_t row = static_cast<int64_t>(p.tokens.size()), len = s.end - s.begin;
      p.tokens.insert(p.tokens.end(), s.tokens + s.begin, s.tokens + s.end);
      p.seqs.push_back(StepSeq{s.block_table, s.num_blocks, s.begin, len});
      Active& a = active_.at(s.id);
      // The row that samples, or every row of a request that wants all its logits.
      const int64_t first = a.all_logits ? s.begin : s.end - (s.sample ? 1 : 0);
      p.first_logit.push_back(first < s.end ? logit_rows + static_cast<int64_t>(p.logit_rows.size()) : -1);
      for (int64_t i = first; i < s.end; ++i) p.logit_rows.push_back(static_cast<int32_t>(row + i - s.begin));
      // A decode row: one token after the request's first sampled one. Anything else is prompt (or, after
      // a preemption, recompute) work.
      const bool decode = len == 1 && s.sample && a.first_token != Clock::time_point{};
      (decode ? decode_rows : prompt_rows) += len;
      if (!decode) a.prompt_computed += len;
      if (!a.seen) {  // first scheduled: its cached prefix is what the plan starts after
        a.seen = true;
        a.scheduled = now;
        const double prompt = static_cast<double>(a.prompt_len);
        a.sink->on_scheduled(s.begin);
        m.prompt_tokens.inc(prompt);
        m.prefix_cache_queries.inc(prompt);
        m.prefix_cache_hits.inc(static_cast<double>(s.begin));
        m.request_queue_time_seconds.observe(seconds(now - a.arrival));
      }
    }
    logit_rows += static_cast<int64_t>(p.logit_rows.size());
    StepInput& input = inputs_[r];
    input.tokens = p.tokens.data();
    input.num_tokens = static_cast<int64_t>(p.tokens.size());
    input.seqs = p.seqs.data();
    input.num_seqs = static_cast<int64_t>(p.seqs.size());
    input.logit_rows = p.logit_rows.data();  // reserved: never null, so 0 rows means none
    input.num_logit_rows = static_cast<int64_t>(p.logit_rows.size());
  }
  const int vocab = model_.config().vocab_size;
  if (logits_.size() < static_cast<size_t>(logit_rows) * vocab) logits_.resize(static_cast<size_t>(logit_rows) * vocab);
  const StepKind kind = prompt_rows > 0 ? StepKind::kPrefill : StepKind::kDecode;
  std::vector<comm::P2PRequest> logit_receives;
  if (data_parallel_) {  // every rank its own sub-step (rank 0 possibly none: it still joins the collectives)
    send_substeps(*options_.comm, inputs_, kind);
    logit_receives = receive_logits(*options_.comm, inputs_, vocab, logits_.data());
  } else if (options_.comm) {
    send_step(*options_.comm, inputs_[0], kind);  // every rank runs the same step
  }
  before_step(model_, step_number_);
  const auto forward_start = Clock::now();
  // The profiler's step (moex profile): forward and sampling, on the driving thread.
  std::optional<profile::ScopedStep> profiled_step;
  profiled_step.emplace(kind == StepKind::kPrefill ? profile::Phase::kPrefill : profile::Phase::kDecode,
                        static_cast<int>(inputs_[0].num_tokens));
  model_.forward(inputs_[0], logits_.data());  // pool 0's rows first in logits_, then rank 1's, ...
  if (data_parallel_) options_.comm->wait_all(logit_receives);
  const auto forward_end = Clock::now();
  if (options_.after_forward) options_.after_forward(inputs_[0], kind);

  {
    MOEX_ZONE(kSampling);
    for (auto& p : pools_) {
      const StepPlan& plan = *p->plan;
      p->sampled.assign(plan.seqs.size(), -1);
      for (size_t i = 0; i < plan.seqs.size(); ++i) {
        const ScheduledSeq& s = plan.seqs[i];
        if (p->first_logit[i] < 0) continue;
        Active& a = active_.at(s.id);
        const float* rows = logits_.data() + static_cast<size_t>(p->first_logit[i]) * vocab;
        if (a.all_logits) {
          a.sink->on_logits(s.begin, s.end - s.begin, rows);
          rows += static_cast<size_t>(s.end - s.begin - 1) * vocab;  // the last row samples
        }
        if (!s.sample) continue;
        a.sampler.sample(rows, vocab, &a.generated, &a.last);  // logprobs when asked for
        p->sampled[i] = a.last.token;
        a.generated.add(p->sampled[i]);
      }
    }
  }
  profiled_step.reset();

  const auto done = Clock::now();
  for (auto& p : pools_) {
    const StepPlan& plan = *p->plan;
    for (size_t i = 0; i < plan.seqs.size(); ++i) {
      if (!plan.seqs[i].sample) continue;
      Active& a = active_.at(plan.seqs[i].id);
      a.sink->on_token(p->sampled[i], a.logprobs ? &a.last : nullptr);
      m.generation_tokens.inc();
      ++a.num_tokens;
      if (a.first_token == Clock::time_point{}) {
        a.first_token = done;
        m.time_to_first_token_seconds.observe(seconds(done - a.arrival));
        metrics_.request_prompt_computed_tokens.observe(static_cast<double>(a.prompt_computed));
      } else {
        m.inter_token_latency_seconds.observe(seconds(done - a.last_token));
      }
      a.last_token = done;
    }
    // The scheduler decides which sequences finished (stop token or max_tokens).
    for (const FinishedSeq& f : p->scheduler.complete(plan, p->sampled.data())) finish(active_.at(f.id), f.reason);
  }
  publish_gauges();

  const auto step_end = Clock::now();
  const bool prefill = kind == StepKind::kPrefill;
  EngineMetrics::StepKindMetrics& k = prefill ? metrics_.prefill_steps : metrics_.decode_steps;
  const double step_s = seconds(step_end - step_start), forward_s = seconds(forward_end - forward_start);
  k.steps.inc();
  k.step_seconds.inc(step_s);
  k.forward_seconds.inc(forward_s);
  k.prompt_rows.inc(static_cast<double>(prompt_rows));
  k.decode_rows.inc(static_cast<double>(decode_rows));
  k.step_duration.observe(step_s);
  for (size_t l = 0; l < metrics_.eplb_balancedness.size(); ++l) {
    if (!metrics_.eplb_balancedness[l]) continue;
    const std::vector<int>& slots = model_.moe_slot_stats()[l].tokens_per_expert;
    const int ep = model_.options().plan.ep, per_rank = static_cast<int>(slots.size()) / ep;
    eplb_rank_tokens_.assign(ep, 0.0);  // no allocation after the first step
    for (size_t s = 0; s < slots.size(); ++s) eplb_rank_tokens_[s / per_rank] += slots[s];
    metrics_.eplb_balancedness[l]->set(eplb::balancedness(eplb_rank_tokens_));
    const std::vector<int>& experts = model_.moe_stats()[l].tokens_per_expert;
    for (size_t e = 0; e < experts.size(); ++e) metrics_.eplb_expert_tokens[l][e]->inc(experts[e]);
  }
  ++step_number_;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    StepTotals& t = totals_;
    ++t.steps;
    t.sequences += static_cast<int64_t>(num_seqs);
    t.prompt_rows += prompt_rows;
    t.decode_rows += decode_rows;
    t.step_seconds += step_s;
    t.forward_seconds += forward_s;
    t.last_sequences = static_cast<int64_t>(num_seqs);
    t.last_prompt_rows = prompt_rows;
    t.last_decode_rows = decode_rows;
    t.last_step_ms = step_s * 1e3;
    if (options_.step_breakdown) profile::drain_thread_totals(t.zones);
  }
  if (options_.log_steps)  // one line per step; stderr is unbuffered, so a line is written at once
    std::fprintf(stderr,
                 "moex: step %lld %s seqs %zu prompt rows %lld decode rows %lld: %.3f ms (forward %.3f ms, "
                 "other %.3f ms)\n",
                 static_cast<long long>(step_number_), prefill ? "prefill" : "decode", num_seqs,
                 static_cast<long long>(prompt_rows), static_cast<long long>(decode_rows), step_s * 1e3,
                 forward_s * 1e3, (step_s - forward_s) * 1e3);
}

}  // namespace moex

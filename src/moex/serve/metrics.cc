#include "moex/serve/metrics.h"

#include <algorithm>
#include <cstdio>

namespace moex::serve {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();  // le
  std::lock_guard<std::mutex> lock(mutex_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

namespace {
std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}
}  // namespace

void Histogram::render(const std::string& name, std::string& out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{le=\"" + (i < bounds_.size() ? number(bounds_[i]) : "+Inf") + "\"} " +
           std::to_string(cumulative) + "\n";
  }
  out += name + "_sum " + number(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

static std::vector<double> latency_bounds() {  // seconds, as vLLM's TTFT buckets
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}

Metrics::Metrics()
    : time_to_first_token(latency_bounds()),
      inter_token_latency(latency_bounds()),
      e2e_request_latency(latency_bounds()),
      request_queue_time(latency_bounds()) {}

std::string Metrics::render() const {
  std::string out;
  const auto metric = [&](const char* name, const char* type, const char* help, double value,
                          const std::string& labels = "") {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    out += std::string(name) + labels + " " + number(value) + "\n";
  };
  metric("moex:num_requests_running", "gauge", "Requests in the running batch.", num_requests_running.load());
  metric("moex:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", num_requests_waiting.load());
  const double total = static_cast<double>(std::max<int64_t>(kv_blocks_total.load(), 1));
  metric("moex:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks referenced by a request (0..1).",
         static_cast<double>(kv_blocks_used.load()) / total);
  metric("moex:kv_cache_blocks_used", "gauge", "KV-cache blocks referenced by a request.", kv_blocks_used.load());
  metric("moex:kv_cache_blocks_total", "gauge", "KV-cache blocks in the pool.", kv_blocks_total.load());
  metric("moex:prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", prompt_tokens.load());
  metric("moex:generation_tokens_total", "counter", "Tokens generated.", generation_tokens.load());
  metric("moex:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
         prefix_cache_queries.load());
  metric("moex:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not recomputed).",
         prefix_cache_hits.load());
  metric("moex:num_preemptions_total", "counter", "Sequences preempted (freed, to be recomputed).",
         num_preemptions.load());
  metric("moex:requests_rejected_total", "counter", "Requests refused with 429 (queue full).", requests_rejected.load());
  out += "# HELP moex:request_success_total Requests finished, by reason.\n# TYPE moex:request_success_total counter\n";
  out += "moex:request_success_total{finished_reason=\"stop\"} " + std::to_string(finished_stop.load()) + "\n";
  out += "moex:request_success_total{finished_reason=\"length\"} " + std::to_string(finished_length.load()) + "\n";
  out += "moex:request_success_total{finished_reason=\"abort\"} " + std::to_string(finished_abort.load()) + "\n";
  const auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " histogram\n";
    h.render(name, out);
  };
  histogram("moex:time_to_first_token_seconds", "Time from arrival to the first token.", time_to_first_token);
  histogram("moex:inter_token_latency_seconds", "Time between two tokens of a request.", inter_token_latency);
  histogram("moex:e2e_request_latency_seconds", "Time from arrival to the last token.", e2e_request_latency);
  histogram("moex:request_queue_time_seconds", "Time from arrival to the first scheduled step.", request_queue_time);
  return out;
}

}  // namespace moex::serve

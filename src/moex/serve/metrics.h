// The server's Prometheus metrics (GET /metrics), named as vLLM's with a `moex:` prefix. Counters and
// gauges are atomics the engine thread updates; histograms take a lock per observation (a few per token).
// Written here because no Debian package provides a Prometheus text encoder for C++ without a server of its
// own; the text format is small (https://prometheus.io/docs/instrumenting/exposition_formats/).
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace moex::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);  // upper bounds in seconds, ascending; +Inf is added
  void observe(double value);
  // "<name>_bucket{le=...} n" lines, _sum and _count.
  void render(const std::string& name, std::string& out) const;

 private:
  mutable std::mutex mutex_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative)
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct Metrics {
  Metrics();
  // Gauges, set after every step.
  std::atomic<int64_t> num_requests_running{0}, num_requests_waiting{0};
  std::atomic<int64_t> kv_blocks_used{0}, kv_blocks_total{0};
  // Counters.
  std::atomic<int64_t> prompt_tokens{0}, generation_tokens{0};
  std::atomic<int64_t> prefix_cache_queries{0}, prefix_cache_hits{0};  // prompt tokens looked up / found
  std::atomic<int64_t> num_preemptions{0};
  std::atomic<int64_t> finished_stop{0}, finished_length{0}, finished_abort{0};
  std::atomic<int64_t> requests_rejected{0};  // queue full (429)
  Histogram time_to_first_token, inter_token_latency, e2e_request_latency, request_queue_time;

  std::string render() const;  // Prometheus text exposition format 0.0.4
};

}  // namespace moex::serve

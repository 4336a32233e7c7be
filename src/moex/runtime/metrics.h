// Serving metrics: counters, gauges and histograms, and their Prometheus text exposition (format 0.0.4,
// what GET /metrics returns). Updating a metric is a few relaxed atomic operations, safe from any thread;
// only registration and exposition take the registry's lock.
//
//   metrics::Registry registry;
//   metrics::ServingMetrics m(registry, "mini");        // vLLM's serving metrics, `moex:` prefix
//   m.time_to_first_token_seconds.observe(0.042);
//   m.num_requests_running.set(3);
//   std::string text = registry.exposition();
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moex::metrics {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  void inc(double by = 1.0) { value_.fetch_add(by, std::memory_order_relaxed); }  // by >= 0
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void inc(double by = 1.0) { value_.fetch_add(by, std::memory_order_relaxed); }
  void dec(double by = 1.0) { value_.fetch_sub(by, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: the buckets' upper bounds (le), strictly increasing and finite; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);  // counted in the first bucket whose bound is >= value
  const std::vector<double>& bounds() const { return bounds_; }
  // Non-cumulative counts per bucket (bounds().size() + 1, the last one +Inf), and the sum.
  std::vector<uint64_t> bucket_counts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

class Registry {
 public:
  // `const_labels` go on every sample (vLLM puts model_name on each).
  explicit Registry(Labels const_labels = {}) : const_labels_(std::move(const_labels)) {}
  // Registers (or returns the already registered) metric of this name and label set. A name is one
  // type with one help text and, for histograms, one set of bounds; names and label names must be valid
  // Prometheus names. Violations throw Error(kInternal): they are programming errors, not input.
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help, const std::vector<double>& bounds,
                       const Labels& labels = {});
  // Prometheus text exposition of every metric, in registration order. Counters are written as
  // `<name>` when it ends in _total, else `<name>_total`; histograms as _bucket{le=...}, _sum, _count.
  std::string exposition() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    std::string name, help;
    Type type;
    std::vector<double> bounds;
    std::vector<std::pair<Labels, std::unique_ptr<Counter>>> counters;
    std::vector<std::pair<Labels, std::unique_ptr<Gauge>>> gauges;
    std::vector<std::pair<Labels, std::unique_ptr<Histogram>>> histograms;
  };
  Family& family(const std::string& name, const std::string& help, Type type, const Labels& labels);

  Labels const_labels_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Family>> families_;
};

// vLLM's bucket bounds for these metrics (seconds).
extern const std::vector<double> kTtftBuckets;
extern const std::vector<double> kTokenLatencyBuckets;
extern const std::vector<double> kRequestLatencyBuckets;

// vLLM's serving metrics under `moex:` names, on `registry` with model_name=<model_name>.
// The engine loop updates them: gauges every step, histograms and counters as requests progress.
struct ServingMetrics {
  ServingMetrics(Registry& registry, const std::string& model_name);
  Gauge& num_requests_running;               // moex:num_requests_running
  Gauge& num_requests_waiting;               // moex:num_requests_waiting
  Gauge& kv_cache_usage_perc;                // moex:kv_cache_usage_perc, 0..1 (1 = every block used)
  Counter& prompt_tokens;                    // moex:prompt_tokens_total (prefilled + cached)
  Counter& generation_tokens;                // moex:generation_tokens_total
  Counter& prefix_cache_queries;             // moex:prefix_cache_queries_total (prompt tokens looked up)
  Counter& prefix_cache_hits;                // moex:prefix_cache_hits_total (of which found cached)
  Counter& num_preemptions;                  // moex:num_preemptions_total
  Counter& request_success_stop;             // moex:request_success_total{finished_reason="stop"}
  Counter& request_success_length;           //   ...{finished_reason="length"}
  Counter& request_success_abort;            //   ...{finished_reason="abort"}
  Histogram& time_to_first_token_seconds;    // moex:time_to_first_token_seconds
  Histogram& inter_token_latency_seconds;    // moex:inter_token_latency_seconds (each gap between tokens)
  Histogram& time_per_output_token_seconds;  // moex:time_per_output_token_seconds (per request: decode time / (tokens - 1))
  Histogram& e2e_request_latency_seconds;    // moex:e2e_request_latency_seconds
  Histogram& request_queue_time_seconds;     // moex:request_queue_time_seconds (arrival to first scheduled)
  Histogram& request_prefill_time_seconds;   // moex:request_prefill_time_seconds
  Histogram& request_decode_time_seconds;    // moex:request_decode_time_seconds
};

// A double as Prometheus text: the shortest form that reads back exactly; NaN, +Inf, -Inf.
std::string format_value(double v);

}  // namespace moex::metrics

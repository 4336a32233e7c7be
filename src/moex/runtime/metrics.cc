#include "moex/runtime/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "moex/base/error.h"

namespace moex::metrics {
namespace {

bool valid_name(const std::string& s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':') ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

std::string escape(const std::string& s, bool quote) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '"' && quote) out += "\\\"";
    else out += c;
  }
  return out;
}

// {a="x",b="y"} from the constant labels, the metric's labels and an extra one (le); empty: nothing.
std::string label_text(const Labels& constant, const Labels& own, const char* extra_name = nullptr,
                       const std::string& extra_value = "") {
  Labels all = constant;
  for (const auto& [k, v] : own) all[k] = v;
  if (all.empty() && !extra_name) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : all) {
    if (!first) out += ",";
    first = false;
    out += k + "=\"" + escape(v, true) + "\"";
  }
  if (extra_name) out += std::string(first ? "" : ",") + extra_name + "=\"" + extra_value + "\"";
  return out + "}";
}

}  // namespace

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {  // whole numbers without an exponent: 2560, not 2.56e+03
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    MOEX_CHECK(std::isfinite(bounds_[i]), "histogram bound ", bounds_[i], " is not finite");
    MOEX_CHECK(i == 0 || bounds_[i] > bounds_[i - 1], "histogram bounds must increase");
  }
  counts_ = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::observe(double value) {
  // le semantics: the first bound >= value (NaN goes to +Inf, as a comparison with it is false).
  const size_t bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::bucket_counts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  for (size_t i = 0; i < out.size(); ++i) out[i] = counts_[i].load(std::memory_order_relaxed);
  return out;
}

uint64_t Histogram::count() const {
  uint64_t total = 0;
  for (uint64_t c : bucket_counts()) total += c;
  return total;
}

Registry::Family& Registry::family(const std::string& name, const std::string& help, Type type, const Labels& labels) {
  MOEX_CHECK(valid_name(name, true), "bad metric name '", name, "'");
  for (const auto& [k, v] : labels) MOEX_CHECK(valid_name(k, false) && k != "le", "bad label name '", k, "'");
  for (auto& f : families_) {
    if (f->name != name) continue;
    MOEX_CHECK(f->type == type && f->help == help, "metric ", name, " registered twice with different types or help");
    return *f;
  }
  families_.push_back(std::make_unique<Family>());
  Family& f = *families_.back();
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

Counter& Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mutex_);
  Family& f = family(name, help, Type::kCounter, labels);
  for (auto& [l, c] : f.counters)
    if (l == labels) return *c;
  f.counters.emplace_back(labels, std::make_unique<Counter>());
  return *f.counters.back().second;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mutex_);
  Family& f = family(name, help, Type::kGauge, labels);
  for (auto& [l, g] : f.gauges)
    if (l == labels) return *g;
  f.gauges.emplace_back(labels, std::make_unique<Gauge>());
  return *f.gauges.back().second;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help, const std::vector<double>& bounds,
                               const Labels& labels) {
  std::lock_guard<std::mutex> lock(mutex_);
  Family& f = family(name, help, Type::kHistogram, labels);
  if (f.histograms.empty()) f.bounds = bounds;
  MOEX_CHECK(f.bounds == bounds, "histogram ", name, " registered with different bounds");
  for (auto& [l, h] : f.histograms)
    if (l == labels) return *h;
  f.histograms.emplace_back(labels, std::make_unique<Histogram>(bounds));
  return *f.histograms.back().second;
}

std::string Registry::exposition() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  for (const auto& f : families_) {
    const bool is_counter = f->type == Type::kCounter;
    const bool has_suffix = f->name.size() > 6 && f->name.compare(f->name.size() - 6, 6, "_total") == 0;
    const std::string sample = is_counter && !has_suffix ? f->name + "_total" : f->name;
    const std::string family_name = is_counter && has_suffix ? f->name.substr(0, f->name.size() - 6) : f->name;
    out += "# HELP " + family_name + " " + escape(f->help, false) + "\n";
    out += "# TYPE " + family_name + " " +
           (is_counter ? "counter" : f->type == Type::kGauge ? "gauge" : "histogram") + "\n";
    for (const auto& [labels, c] : f->counters)
      out += sample + label_text(const_labels_, labels) + " " + format_value(c->value()) + "\n";
    for (const auto& [labels, g] : f->gauges)
      out += sample + label_text(const_labels_, labels) + " " + format_value(g->value()) + "\n";
    for (const auto& [labels, h] : f->histograms) {
      const std::vector<uint64_t> counts = h->bucket_counts();  // one read, so +Inf equals _count
      uint64_t cumulative = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        cumulative += counts[i];
        const std::string le = i < h->bounds().size() ? format_value(h->bounds()[i]) : "+Inf";
        out += f->name + "_bucket" + label_text(const_labels_, labels, "le", le) + " " + std::to_string(cumulative) + "\n";
      }
      out += f->name + "_sum" + label_text(const_labels_, labels) + " " + format_value(h->sum()) + "\n";
      out += f->name + "_count" + label_text(const_labels_, labels) + " " + std::to_string(cumulative) + "\n";
    }
  }
  return out;
}

// vLLM's buckets (vllm/v1/metrics/loggers.py).
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kTokenLatencyBuckets = {0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,  0.4, 0.5,
                                                  0.75, 1.0,   2.5,  5.0,   7.5,  10.0, 20.0, 40.0, 80.0};
const std::vector<double> kRequestLatencyBuckets = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,    10.0, 15.0, 20.0,
                                                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

ServingMetrics::ServingMetrics(Registry& r, const std::string& model_name)
    : num_requests_running(r.gauge("moex:num_requests_running", "Requests in the running batch.",
                                   {{"model_name", model_name}})),
      num_requests_waiting(r.gauge("moex:num_requests_waiting", "Requests queued, not yet admitted.",
                                   {{"model_name", model_name}})),
      kv_cache_usage_perc(r.gauge("moex:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                                  {{"model_name", model_name}})),
      prompt_tokens(r.counter("moex:prompt_tokens_total", "Prompt tokens of finished and running requests (computed or cached).",
                              {{"model_name", model_name}})),
      generation_tokens(r.counter("moex:generation_tokens_total", "Tokens generated.",
                                  {{"model_name", model_name}})),
      prefix_cache_queries(r.counter("moex:prefix_cache_queries_total",
                                     "Prompt tokens looked up in the prefix cache.",
                                     {{"model_name", model_name}})),
      prefix_cache_hits(r.counter("moex:prefix_cache_hits_total",
                                  "Prompt tokens found in the prefix cache.", {{"model_name", model_name}})),
      num_preemptions(r.counter("moex:num_preemptions_total", "Sequences preempted for recompute.",
                                {{"model_name", model_name}})),
      request_success_stop(r.counter("moex:request_success_total", "Requests finished, by reason.",
                                     {{"model_name", model_name}, {"finished_reason", "stop"}})),
      request_success_length(r.counter("moex:request_success_total", "Requests finished, by reason.",
                                       {{"model_name", model_name}, {"finished_reason", "length"}})),
      request_success_abort(r.counter("moex:request_success_total", "Requests finished, by reason.",
                                      {{"model_name", model_name}, {"finished_reason", "abort"}})),
      time_to_first_token_seconds(r.histogram("moex:time_to_first_token_seconds",
                                              "Seconds from arrival to the first generated token.", kTtftBuckets,
                                              {{"model_name", model_name}})),
      inter_token_latency_seconds(r.histogram("moex:inter_token_latency_seconds",
                                              "Seconds between consecutive generated tokens of a request.", kTokenLatencyBuckets,
                                              {{"model_name", model_name}})),
      time_per_output_token_seconds(r.histogram("moex:time_per_output_token_seconds",
                                                "Per request: decode seconds / (generated tokens - 1).", kTokenLatencyBuckets,
                                                {{"model_name", model_name}})),
      e2e_request_latency_seconds(r.histogram("moex:e2e_request_latency_seconds",
                                              "Seconds from arrival to the last token.", kRequestLatencyBuckets,
                                              {{"model_name", model_name}})),
      request_queue_time_seconds(r.histogram("moex:request_queue_time_seconds",
                                             "Seconds a request waited before it was first scheduled.",
                                             kRequestLatencyBuckets, {{"model_name", model_name}})),
      request_prefill_time_seconds(r.histogram("moex:request_prefill_time_seconds",
                                               "Seconds from first scheduled to first token.",
                                               kRequestLatencyBuckets, {{"model_name", model_name}})),
      request_decode_time_seconds(r.histogram("moex:request_decode_time_seconds",
                                              "Seconds from first token to last token.",
                                              kRequestLatencyBuckets, {{"model_name", model_name}})) {}

}  // namespace moex::metrics

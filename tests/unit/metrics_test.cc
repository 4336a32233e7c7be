// Metrics: values and buckets counted here independently, the exposition read back by Python's
// prometheus_client parser (tests/reference/prometheus_parse.py), and updates from many threads.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <unistd.h>

#include "moex/base/error.h"
#include "moex/runtime/metrics.h"

namespace moex::metrics {
namespace {

using json = nlohmann::json;

json parse_with_prometheus_client(const std::string& text) {
  const auto in = std::filesystem::temp_directory_path() / ("moex_metrics_" + std::to_string(getpid()) + ".txt");
  std::ofstream(in) << text;
  const std::string cmd = "/usr/bin/python3 " + std::string(MOEX_SOURCE_DIR) + "/tests/reference/prometheus_parse.py < " + in.string();
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while (pipe && (n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pipe ? pclose(pipe) : -1;
  std::filesystem::remove(in);
  EXPECT_EQ(status, 0) << "prometheus_client could not parse:\n" << text;
  return status == 0 ? json::parse(out) : json::object();
}

double sample(const json& parsed, const std::string& name, const json& labels) {
  for (const json& s : parsed["samples"])
    if (s["name"] == name && s["labels"] == labels) return s["value"].is_string() ? INFINITY : s["value"].get<double>();
  ADD_FAILURE() << "no sample " << name << " " << labels.dump();
  return NAN;
}

TEST(Metrics, ServingMetricsExpositionReadsBackWithPrometheusClient) {
  Registry registry;
  ServingMetrics m(registry, "mini \"quoted\" \\ name");
  m.num_requests_running.set(3);
  m.num_requests_waiting.set(5);
  m.num_requests_waiting.dec();
  m.kv_cache_usage_perc.set(0.25);
  m.prompt_tokens.inc(128);
  m.prompt_tokens.inc(72);
  m.generation_tokens.inc(64);
  m.prefix_cache_queries.inc(200);
  m.prefix_cache_hits.inc(192);
  m.request_success_stop.inc();
  m.request_success_length.inc(2);
  std::mt19937 rng(1);
  std::exponential_distribution<double> latency(20.0);  // mean 50 ms
  std::vector<double> ttft;
  for (int i = 0; i < 500; ++i) {
    ttft.push_back(latency(rng));
    m.time_to_first_token_seconds.observe(ttft.back());
  }
  m.time_to_first_token_seconds.observe(0.1);  // exactly on a bound: counted in le="0.1"
  ttft.push_back(0.1);
  m.inter_token_latency_seconds.observe(1000.0);  // beyond every bound: only +Inf

  const json parsed = parse_with_prometheus_client(registry.exposition());
  const json model = {{"model_name", "mini \"quoted\" \\ name"}};
  EXPECT_EQ(sample(parsed, "moex:num_requests_running", model), 3);
  EXPECT_EQ(sample(parsed, "moex:num_requests_waiting", model), 4);
  EXPECT_EQ(sample(parsed, "moex:kv_cache_usage_perc", model), 0.25);
  EXPECT_EQ(sample(parsed, "moex:prompt_tokens_total", model), 200);
  EXPECT_EQ(sample(parsed, "moex:generation_tokens_total", model), 64);
  EXPECT_EQ(sample(parsed, "moex:prefix_cache_queries_total", model), 200);
  EXPECT_EQ(sample(parsed, "moex:prefix_cache_hits_total", model), 192);
  json stop = model, length = model;
  stop["finished_reason"] = "stop";
  length["finished_reason"] = "length";
  EXPECT_EQ(sample(parsed, "moex:request_success_total", stop), 1);
  EXPECT_EQ(sample(parsed, "moex:request_success_total", length), 2);
  // Every bucket against a count made here: cumulative, le inclusive.
  double sum = 0;
  for (double x : ttft) sum += x;
  for (double bound : kTtftBuckets) {
    json labels = model;
    labels["le"] = format_value(bound);
    double expected = 0;
    for (double x : ttft) expected += x <= bound;
    EXPECT_EQ(sample(parsed, "moex:time_to_first_token_seconds_bucket", labels), expected) << bound;
  }
  json inf = model;
  inf["le"] = "+Inf";
  EXPECT_EQ(sample(parsed, "moex:time_to_first_token_seconds_bucket", inf), ttft.size());
  EXPECT_EQ(sample(parsed, "moex:time_to_first_token_seconds_count", model), ttft.size());
  EXPECT_NEAR(sample(parsed, "moex:time_to_first_token_seconds_sum", model), sum, 1e-9 * sum);
  EXPECT_EQ(sample(parsed, "moex:inter_token_latency_seconds_bucket", inf), 1);
  json last = model;
  last["le"] = "80";
  EXPECT_EQ(sample(parsed, "moex:inter_token_latency_seconds_bucket", last), 0);
  // Families and their types, as the parser saw them.
  std::map<std::string, std::string> types;
  for (const json& f : parsed["families"]) types[f["name"]] = f["type"];
  EXPECT_EQ(types["moex:prompt_tokens"], "counter");
  EXPECT_EQ(types["moex:num_requests_running"], "gauge");
  EXPECT_EQ(types["moex:e2e_request_latency_seconds"], "histogram");
  EXPECT_EQ(types["moex:request_queue_time_seconds"], "histogram");
  EXPECT_EQ(types["moex:time_per_output_token_seconds"], "histogram");
  EXPECT_EQ(types["moex:prefix_cache_hits"], "counter");
}

TEST(Metrics, UpdatesFromManyThreadsAreAllCounted) {
  Registry registry;
  Counter& c = registry.counter("moex:test_events_total", "events");
  Gauge& g = registry.gauge("moex:test_level", "level");
  Histogram& h = registry.histogram("moex:test_seconds", "seconds", {0.5, 1.5});
  const int threads = 4, per_thread = 20000;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int i = 0; i < per_thread; ++i) {
        c.inc();
        g.inc(2);
        g.dec();
        h.observe((i + t) % 3);  // 0, 1, 2: one per bucket
      }
    });
  for (auto& th : pool) th.join();
  EXPECT_EQ(c.value(), threads * per_thread);
  EXPECT_EQ(g.value(), threads * per_thread);
  EXPECT_EQ(h.count(), static_cast<uint64_t>(threads * per_thread));
  uint64_t ones = 0;
  for (int t = 0; t < threads; ++t)
    for (int i = 0; i < per_thread; ++i) ones += (i + t) % 3 == 1;
  EXPECT_EQ(h.bucket_counts()[1], ones);
  // Registering again returns the same metric; a clash of type is a programming error.
  EXPECT_EQ(&registry.counter("moex:test_events_total", "events"), &c);
  EXPECT_THROW(registry.gauge("moex:test_events_total", "events"), Error);
  EXPECT_THROW(registry.counter("bad name", "x"), Error);
  EXPECT_THROW(registry.histogram("moex:test_seconds", "seconds", {0.5, 2.0}), Error);
  const json parsed = parse_with_prometheus_client(registry.exposition());
  EXPECT_EQ(sample(parsed, "moex:test_events_total", json::object()), threads * per_thread);
}

TEST(Metrics, FormatValueIsShortAndExact) {
  EXPECT_EQ(format_value(0.1), "0.1");
  EXPECT_EQ(format_value(2560.0), "2560");
  EXPECT_EQ(format_value(1.0 / 3), "0.3333333333333333");
  EXPECT_EQ(format_value(INFINITY), "+Inf");
  EXPECT_EQ(format_value(NAN), "NaN");
}

}  // namespace
}  // namespace moex::metrics

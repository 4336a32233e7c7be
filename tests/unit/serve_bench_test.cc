// `moex bench serve`'s pieces: SSE parsing, the streaming client against a small cpp-httplib server in
// the test that streams OpenAI-shaped chunks with known delays, the load's concurrency cap and arrivals,
// and the statistics (numpy's percentile definition, checked on values whose answer is known).
#include <gtest/gtest.h>

#include <httplib.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "moex/base/error.h"
#include "tools/lib/serve_bench.h"

namespace moex::tools::serve_bench {
namespace {

using json = nlohmann::json;

TEST(SseParser, EventsSurviveAnySplit) {
  const std::string stream =
      ": a comment\r\n"
      "data: {\"a\":1}\r\n\r\n"
      "event: ignored\n"
      "data: line one\n"
      "data: line two\n\n"
      "data:nospace\n\n"
      "data: [DONE]\n\n";
  const std::vector<std::string> expected = {"{\"a\":1}", "line one\nline two", "nospace", "[DONE]"};
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::string> got;
    SseParser p([&](const std::string& d) { got.push_back(d); });
    for (size_t i = 0; i < stream.size();) {
      const size_t n = std::min<size_t>(stream.size() - i, rng() % 7);
      p.feed(std::string_view(stream).substr(i, n));
      i += n;
    }
    p.finish();
    EXPECT_EQ(got, expected);
  }
  std::vector<std::string> got;
  SseParser p([&](const std::string& d) { got.push_back(d); });
  p.feed("data: last without blank line");
  p.finish();
  EXPECT_EQ(got, std::vector<std::string>{"last without blank line"});
}

// A server that streams `tokens` chunks of text, the first after first_ms, then one every gap_ms.
class FakeServer {
 public:
  FakeServer() {
    server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { handle(req, res, false); });
    server_.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { handle(req, res, true); });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void handle(const httplib::Request& req, httplib::Response& res, bool chat) {
    {
      if (req.get_header_value("Authorization") != "Bearer secret") {
        res.status = 401;
        res.set_content(R"({"error":{"message":"bad api key","type":"invalid_request_error"}})", "application/json");
        return;
      }
      const json body = json::parse(req.body);
      {
        std::lock_guard<std::mutex> lock(mutex_);  // requests arrive on several server threads
        last_body_ = body;
      }
      if (!body.value("stream", false) || !body.value("ignore_eos", false)) {
        res.status = 400;
        res.set_content(R"({"error":{"message":"want stream and ignore_eos"}})", "application/json");
        return;
      }
      const int tokens = body["max_tokens"];
      if (chat != body.contains("messages") || chat == body.contains("prompt")) {
        res.status = 400;
        res.set_content(R"({"error":{"message":"prompt for completions, messages for chat"}})", "application/json");
        return;
      }
      const int prompt_tokens = !chat && body["prompt"].is_array() ? static_cast<int>(body["prompt"].size()) : 7;
      const std::string mode = this->mode();
      res.set_chunked_content_provider("text/event-stream", [=, this](size_t, httplib::DataSink& sink) {
        std::this_thread::sleep_for(std::chrono::milliseconds(first_ms));
        for (int i = 0; i < tokens; ++i) {
          if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
          if (mode == "malformed" && i == 1) {
            sink.os << "data: {not json\n\n";
            continue;
          }
          json chunk = {{"id", "cmpl-1"}, {"object", "text_completion"},
                        {"choices", {{{"index", 0}, {"text", " t" + std::to_string(i)}, {"finish_reason", nullptr}}}}};
          if (chat)
            chunk = {{"id", "chatcmpl-1"}, {"object", "chat.completion.chunk"},
                     {"choices", {{{"index", 0}, {"delta", {{"content", " t" + std::to_string(i)}}}, {"finish_reason", nullptr}}}}};
          sink.os << "data: " << chunk.dump() << "\n\n";
        }
        if (mode == "no_done") {
          sink.done();
          return true;
        }
        json usage = {{"choices", json::array()},
                      {"usage", {{"prompt_tokens", prompt_tokens}, {"completion_tokens", tokens},
                                 {"total_tokens", prompt_tokens + tokens}}}};
        sink.os << "data: " << usage.dump() << "\n\ndata: [DONE]\n\n";
        sink.done();
        return true;
      });
    }
  }
  ~FakeServer() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void set_mode(const std::string& m) {
    std::lock_guard<std::mutex> lock(mutex_);
    mode_ = m;
  }
  json last_body() {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_body_;
  }
  std::string mode() {
    std::lock_guard<std::mutex> lock(mutex_);
    return mode_;
  }

  int first_ms = 30, gap_ms = 10;

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mutex_;
  std::string mode_ = "ok";
  json last_body_;
};

TEST(ServeBench, StreamingClientTimesTokensAndReadsUsage) {
  FakeServer server;
  ClientOptions options{server.url(), "secret", "mini", 30};
  BenchRequest request;
  request.prompt = json::array({300, 301, 302, 303});
  request.prompt_len = 4;
  request.output_len = 6;
  const RequestResult r = send_completion(options, request);
  ASSERT_TRUE(r.success) << r.error;
  EXPECT_EQ(server.last_body()["model"], "mini");
  EXPECT_EQ(server.last_body()["max_tokens"], 6);
  EXPECT_EQ(server.last_body()["prompt"], request.prompt);
  EXPECT_EQ(r.prompt_tokens, 4);
  EXPECT_EQ(r.output_tokens, 6);
  EXPECT_EQ(r.text, " t0 t1 t2 t3 t4 t5");
  EXPECT_GE(r.ttft, 0.030);
  // Lower bounds only, which load cannot break: the server needs 30 + 5 x 10 ms for the stream (single gaps
  // are not checked: a client descheduled for a while reads several chunks at once).
  ASSERT_EQ(r.itl.size(), 5u);
  EXPECT_GE(r.latency, 0.080);
  EXPECT_GE(r.latency, r.ttft);

  // Failures are failed requests with the server's message, never a crash.
  options.api_key = "wrong";
  RequestResult bad = send_completion(options, request);
  EXPECT_FALSE(bad.success);
  EXPECT_NE(bad.error.find("401"), std::string::npos) << bad.error;
  EXPECT_NE(bad.error.find("bad api key"), std::string::npos) << bad.error;
  options.api_key = "secret";
  server.set_mode("malformed");
  bad = send_completion(options, request);
  EXPECT_FALSE(bad.success);
  EXPECT_NE(bad.error.find("malformed"), std::string::npos) << bad.error;
  server.set_mode("no_done");
  bad = send_completion(options, request);
  EXPECT_FALSE(bad.success);
  EXPECT_NE(bad.error.find("[DONE]"), std::string::npos) << bad.error;
  server.set_mode("ok");
  options.url = server.url() + "/v1/chat/completions";
  bad = send_completion(options, request);  // token ids cannot be a chat message
  EXPECT_FALSE(bad.success);
  EXPECT_NE(bad.error.find("text prompts"), std::string::npos) << bad.error;
  request.prompt = "Hello there";
  const RequestResult chat = send_completion(options, request);
  ASSERT_TRUE(chat.success) << chat.error;
  EXPECT_EQ(server.last_body()["messages"][0]["content"], "Hello there");
  EXPECT_EQ(chat.text, " t0 t1 t2 t3 t4 t5");
  EXPECT_EQ(chat.output_tokens, 6);
  EXPECT_EQ(chat.itl.size(), 5u);
  options.url = "http://127.0.0.1:1";  // nothing listens
  bad = send_completion(options, request);
  EXPECT_FALSE(bad.success);
  EXPECT_THROW(split_url("127.0.0.1:8000", nullptr, nullptr), Error);
  std::string base, path;
  split_url("http://h:1/v1/chat/completions", &base, &path);
  EXPECT_EQ(base, "http://h:1");
  EXPECT_EQ(path, "/v1/chat/completions");
  split_url("http://h:1/", &base, &path);
  EXPECT_EQ(path, "/v1/completions");
}

TEST(ServeBench, EndToEndAgainstTheFakeServer) {
  FakeServer server;
  server.first_ms = 5;
  server.gap_ms = 2;
  const auto requests = random_requests(12, 16, 4, 1, 259, 32000);
  for (const auto& r : requests) {
    EXPECT_EQ(r.prompt.size(), 16u);
    for (const json& id : r.prompt) EXPECT_TRUE(id.get<int>() >= 259 && id.get<int>() < 32000);
  }
  ClientOptions options{server.url(), "secret", "", 30};
  double duration = 0;
  const auto results = run_load(requests, {4, 0.0, 0},
                                [&](const BenchRequest& r) { return send_completion(options, r); }, &duration);
  const Summary s = summarize(results, duration);
  EXPECT_EQ(s.completed, 12);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.total_input, 12 * 16);
  EXPECT_EQ(s.total_output, 12 * 4);
  EXPECT_GE(s.ttft_ms.median, 5.0);
  EXPECT_GE(s.e2el_ms.median, 5.0 + 3 * 2.0);
  const std::string table = format_summary(s);
  for (const char* line : {"Successful requests:", "Failed requests:", "Request throughput (req/s):",
                           "Output token throughput (tok/s):", "Median TTFT (ms):", "P99 TPOT (ms):",
                           "Mean ITL (ms):", "P99 E2EL (ms):"})
    EXPECT_NE(table.find(line), std::string::npos) << line;
  const json j = summary_json(s);
  EXPECT_EQ(j["completed"], 12);
  EXPECT_TRUE(j["ttft_ms"].contains("p99"));
}

// The command itself, flags to --json, against the in-test server.
TEST(ServeBench, TheCommandReportsJson) {
  FakeServer server;
  server.first_ms = 2;
  server.gap_ms = 1;
  const std::string out_path = (std::filesystem::temp_directory_path() / ("moex_bench_serve_" + std::to_string(getpid()) + ".json")).string();
  const std::string cmd = std::string(MOEX_BINARY) + " bench serve --url " + server.url() +
                          " --api-key secret --concurrency 3 --num-requests 7 --input-len 9 --output-len 5 --json > " + out_path;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out_path);
  const json j = json::parse(in);
  std::filesystem::remove(out_path);
  EXPECT_EQ(j["completed"], 7);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_input_tokens"], 7 * 9);
  EXPECT_EQ(j["total_output_tokens"], 7 * 5);
  EXPECT_EQ(j["concurrency"], 3);
  EXPECT_GT(j["output_throughput"].get<double>(), 0);
  EXPECT_GE(j["ttft_ms"]["median"].get<double>(), 2.0);
  EXPECT_EQ(server.last_body()["prompt"].size(), 9u);
  EXPECT_EQ(server.last_body()["max_tokens"], 5);
}

TEST(ServeBench, LoadRespectsConcurrencyAndRequestRate) {
  std::atomic<int> in_flight{0}, peak{0};
  const auto fake = [&](const BenchRequest&) {
    const int now = ++in_flight;
    int p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    --in_flight;
    RequestResult r;
    r.success = true;
    return r;
  };
  const std::vector<BenchRequest> requests(16);
  double duration = 0;
  run_load(requests, {3, 0.0, 0}, fake, &duration);
  EXPECT_EQ(peak.load(), 3);
  EXPECT_GE(duration, 0.020 * 16 / 3);  // ceil(16/3) = 6 rounds of 20 ms at best
  // Poisson arrivals at 100/s (seeded, so the same times every run): with a worker per request, the last
  // one still waits for its arrival, about 15/100 s after the first; load can only delay it further.
  std::mutex mutex;
  std::vector<double> starts;
  const auto begin = std::chrono::steady_clock::now();
  const auto record = [&](const BenchRequest& r) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      starts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
    }
    return fake(r);
  };
  run_load(requests, {16, 100.0, 7}, record, &duration);
  ASSERT_EQ(starts.size(), 16u);
  EXPECT_GE(*std::max_element(starts.begin(), starts.end()), 0.3 * 15 / 100.0);
  EXPECT_GE(duration, 0.3 * 15 / 100.0 + 0.020);
}

TEST(ServeBench, StatisticsFollowNumpyAndVllm) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  std::shuffle(v.begin(), v.end(), std::mt19937(1));
  const Stat s = stat_of(v);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.median, 50.5);
  EXPECT_NEAR(s.p99, 99.01, 1e-9);  // numpy.percentile(range(1, 101), 99)
  EXPECT_NEAR(s.stddev, 28.866070047722118, 1e-9);
  EXPECT_DOUBLE_EQ(percentile({4.0}, 99), 4.0);
  EXPECT_DOUBLE_EQ(percentile({1.0, 2.0}, 50), 1.5);

  RequestResult a, b, failed;
  a.success = b.success = true;
  a.prompt_tokens = 10, a.output_tokens = 5, a.ttft = 0.1, a.latency = 0.5, a.itl = {0.1, 0.1, 0.1, 0.1};
  b.prompt_tokens = 20, b.output_tokens = 1, b.ttft = 0.2, b.latency = 0.2;  // one token: no TPOT
  failed.error = "HTTP 500";
  const Summary sum = summarize({a, b, failed}, 2.0);
  EXPECT_EQ(sum.completed, 2);
  EXPECT_EQ(sum.failed, 1);
  EXPECT_EQ(sum.first_error, "HTTP 500");
  EXPECT_EQ(sum.total_input, 30);
  EXPECT_EQ(sum.total_output, 6);
  EXPECT_DOUBLE_EQ(sum.request_throughput, 1.0);
  EXPECT_DOUBLE_EQ(sum.output_throughput, 3.0);
  EXPECT_DOUBLE_EQ(sum.input_throughput, 15.0);
  EXPECT_NEAR(sum.tpot_ms.mean, 100.0, 1e-9);  // (0.5 - 0.1) / 4
  EXPECT_NEAR(sum.ttft_ms.mean, 150.0, 1e-9);
  EXPECT_NEAR(sum.itl_ms.median, 100.0, 1e-9);
  EXPECT_NEAR(sum.e2el_ms.median, 350.0, 1e-9);
}

TEST(ServeBench, DatasetLinesAreCheckedAndCycled) {
  const auto path = std::filesystem::temp_directory_path() / ("moex_serve_bench_" + std::to_string(getpid()) + ".jsonl");
  std::ofstream(path) << "{\"prompt\": \"hello there\"}\n\n{\"prompt\": [5, 6, 7], \"output_len\": 3}\n";
  const auto r = dataset_requests(path.string(), 5, 9);
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0].prompt, "hello there");
  EXPECT_EQ(r[0].output_len, 9);
  EXPECT_EQ(r[1].prompt_len, 3);
  EXPECT_EQ(r[1].output_len, 3);
  EXPECT_EQ(r[4].prompt, "hello there");
  std::ofstream(path) << "{\"prompt\": \"ok\"}\nnot json\n";
  try {
    dataset_requests(path.string(), 1, 1);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(":2:"), std::string::npos) << e.what();
  }
  std::ofstream(path) << "{\"prompt\": [1, \"x\"]}\n";
  EXPECT_THROW(dataset_requests(path.string(), 1, 1), Error);
  std::filesystem::remove(path);
}

// The server's step timings: a Prometheus exposition parsed (labels, escapes, histogram lines, comments),
// and the difference of two snapshots as bench serve reports it.
TEST(ServeBench, StepBreakdownIsTheDifferenceOfTwoMetricsSnapshots) {
  const auto text = [](double prefill_steps, double prefill_s, double decode_steps, double decode_s, double decode_rows) {
    char b[2048];
    std::snprintf(b, sizeof b,
                  "# HELP moex:engine_steps_total Engine steps.\n# TYPE moex:engine_steps counter\n"
                  "moex:engine_steps_total{model_name=\"m \\\"q\\\"\",kind=\"prefill\"} %g\n"
                  "moex:engine_steps_total{model_name=\"m \\\"q\\\"\",kind=\"decode\"} %g\n"
                  "moex:engine_step_seconds_total{model_name=\"m\",kind=\"prefill\"} %g\n"
                  "moex:engine_step_seconds_total{model_name=\"m\",kind=\"decode\"} %g\n"
                  "moex:engine_forward_seconds_total{model_name=\"m\",kind=\"prefill\"} %g\n"
                  "moex:engine_forward_seconds_total{model_name=\"m\",kind=\"decode\"} %g\n"
                  "moex:engine_step_rows_total{model_name=\"m\",kind=\"prefill\",row=\"prompt\"} %g\n"
                  "moex:engine_step_rows_total{model_name=\"m\",kind=\"prefill\",row=\"decode\"} 3\n"
                  "moex:engine_step_rows_total{model_name=\"m\",kind=\"decode\",row=\"decode\"} %g\n"
                  "moex:engine_step_duration_seconds_bucket{model_name=\"m\",kind=\"decode\",le=\"+Inf\"} 4\n",
                  prefill_steps, decode_steps, prefill_s, decode_s, prefill_s * 0.9, decode_s * 0.5, prefill_steps * 100,
                  decode_rows);
    return std::string(b);
  };
  const MetricsSnapshot before = MetricsSnapshot::parse(text(2, 1.0, 10, 2.0, 80));
  const MetricsSnapshot after = MetricsSnapshot::parse(text(5, 4.0, 30, 6.0, 240));
  EXPECT_EQ(after.value("moex:engine_steps_total"), 35);  // every label set
  EXPECT_EQ(after.value("moex:engine_steps_total", {{"kind", "prefill"}, {"model_name", "m \"q\""}}), 5);
  EXPECT_EQ(after.value("moex:engine_step_duration_seconds_bucket", {{"le", "+Inf"}}), 4);
  EXPECT_FALSE(after.has("moex:absent"));
  const StepBreakdown b = step_breakdown(before, after, 10.0);
  ASSERT_TRUE(b.available);
  EXPECT_EQ(b.prefill_steps, 3);
  EXPECT_DOUBLE_EQ(b.prefill_seconds, 3.0);
  EXPECT_DOUBLE_EQ(b.prefill_step_ms(), 1000.0);
  EXPECT_EQ(b.prefill_prompt_rows, 300);
  EXPECT_EQ(b.prefill_decode_rows, 0);  // the same in both
  EXPECT_EQ(b.decode_steps, 20);
  EXPECT_EQ(b.decode_rows, 160);
  EXPECT_DOUBLE_EQ(b.decode_tokens_per_s(), 40.0);  // 160 rows in 4 s of decode steps
  EXPECT_DOUBLE_EQ(b.decode_rows_per_step(), 8.0);
  EXPECT_NEAR(b.engine_other_seconds(), 3.0 * 0.1 + 4.0 * 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(b.outside_steps_seconds(), 3.0);  // 10 s of wall, 7 in steps
  EXPECT_NE(format_breakdown(b).find("Decode-step throughput (tok/s):"), std::string::npos);
  EXPECT_FALSE(step_breakdown(before, MetricsSnapshot::parse("other_metric 1\n"), 1.0).available);
}

// Token arrival times are sent_at + ttft + the gaps so far; gaps that begin before `from` are left out.
TEST(ServeBench, SteadyITLLeavesOutTheGapsBeforeEveryoneDecodes) {
  std::vector<RequestResult> rs(3);
  rs[0].success = rs[1].success = true;
  rs[0].sent_at = 0.0, rs[0].ttft = 1.0, rs[0].itl = {0.5, 0.1, 0.1};  // tokens at 1.0, 1.5, 1.6, 1.7
  rs[1].sent_at = 0.2, rs[1].ttft = 1.3, rs[1].itl = {0.2, 0.2};       // tokens at 1.5, 1.7, 1.9
  rs[2].sent_at = 0.0, rs[2].ttft = 9.0, rs[2].itl = {1.0};            // failed: not counted
  EXPECT_DOUBLE_EQ(all_decoding_at(rs, 3), 1.5);
  EXPECT_DOUBLE_EQ(all_decoding_at(rs, 1), 1.0);
  EXPECT_EQ(itl_after(rs, 1.5), (std::vector<double>{0.1, 0.1, 0.2, 0.2}));
  EXPECT_EQ(itl_after(rs, 0.0).size(), 5u);
}

// --long-prompt runs the load twice and sends one long request in the second run (the in-test server has
// no step metrics, so the chunks are "not available").
TEST(ServeBench, LongPromptRunsTheLoadTwiceAndReportsTheITLOfBoth) {
  FakeServer server;
  server.first_ms = 2;
  server.gap_ms = 1;
  const std::string out_path = (std::filesystem::temp_directory_path() / ("moex_bench_serve_long_" + std::to_string(getpid()) + ".json")).string();
  const std::string cmd = std::string(MOEX_BINARY) + " bench serve --url " + server.url() +
                          " --api-key secret --concurrency 2 --num-requests 2 --input-len 9 --output-len 6 --long-prompt 40 --json > " +
                          out_path;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out_path);
  const json j = json::parse(in);
  std::filesystem::remove(out_path);
  const json& l = j["long_prompt"];
  EXPECT_EQ(l["tokens"], 40);
  EXPECT_TRUE(l["success"].get<bool>());
  EXPECT_EQ(l["without"]["completed"], 2);
  EXPECT_EQ(l["with"]["completed"], 2);
  EXPECT_EQ(l["with"]["total_output_tokens"], 2 * 6);  // the long request is not one of the decoders
  // Gaps of the in-test server are >= 1 ms when sent, but two chunks may arrive in one read: only > 0 holds.
  EXPECT_GT(l["itl_p99_with_ms"].get<double>(), 0.0);
  EXPECT_GE(l["itl_max_with_ms"].get<double>(), l["itl_p99_with_ms"].get<double>());
  EXPECT_FALSE(l.contains("chunks"));
  EXPECT_GE(l["steady_itl_p99_with_ms"].get<double>(), 0.0);
  EXPECT_LE(l["steady_itl_max_with_ms"].get<double>(), l["itl_max_with_ms"].get<double>());
  const std::string bad = std::string(MOEX_BINARY) + " bench serve --url " + server.url() + " --long-prompt -1 2> /dev/null";
  EXPECT_EQ(WEXITSTATUS(std::system(bad.c_str())), 2);
}

}  // namespace
}  // namespace moex::tools::serve_bench

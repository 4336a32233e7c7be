// What `moex bench serve` is made of, apart from its flags: the OpenAI streaming client (SSE over
// cpp-httplib), the load (random token prompts or a JSONL dataset; Poisson arrivals; a concurrency cap),
// and the statistics `vllm bench serve` prints (TTFT, TPOT, ITL, E2EL: mean, median, p99).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace moex::tools::serve_bench {

// Server-sent events: bytes in (any split), each event's `data:` payload out (multi-line data joined
// with "\n", as the SSE spec says). Comment lines (":") and other fields are skipped; CRLF is accepted.
class SseParser {
 public:
  explicit SseParser(std::function<void(const std::string& data)> on_event) : on_event_(std::move(on_event)) {}
  void feed(std::string_view bytes);
  void finish();  // end of stream: a last event without its blank line still counts

 private:
  void line(std::string_view l);
  std::function<void(const std::string&)> on_event_;
  std::string pending_, data_;
  bool has_data_ = false;
};

struct BenchRequest {
  nlohmann::json prompt;  // a string, or a list of token ids (exact input length)
  int prompt_len = 0;     // tokens, when known (ids); else taken from the response's usage
  int output_len = 0;     // max_tokens (with ignore_eos: exactly this many)
};

struct RequestResult {
  bool success = false;
  std::string error;
  int prompt_tokens = 0;  // usage.prompt_tokens, else BenchRequest::prompt_len
  int output_tokens = 0;  // usage.completion_tokens, else the number of chunks that carried text
  double ttft = 0;        // s, send to the first chunk with text
  double latency = 0;     // s, send to [DONE]
  std::vector<double> itl;  // s, gaps between successive chunks with text
  std::string text;
  double sent_at = 0;       // s, when run_load sent it (since the load started)
};

struct ClientOptions {
  std::string url;  // http://host:port[/path]; no path: /v1/completions
  std::string api_key;
  std::string model;
  double timeout_s = 600;
  std::function<void()> on_first_token;  // called once per request at its first chunk with text (any thread)
};

// Splits a URL into "scheme://host:port" and a path (default /v1/completions); Error(kInvalidInput) if bad.
void split_url(const std::string& url, std::string* base, std::string* path);

// True for a .../chat/completions path: requests carry `messages` and chunks `delta.content`.
bool is_chat_path(const std::string& path);

// One streaming POST to the URL's path (ignore_eos, temperature 0, include_usage), timed: /v1/completions
// with `prompt`, or a chat path with the (text) prompt as one user message.
RequestResult send_completion(const ClientOptions& options, const BenchRequest& request);

// Reads a stream's events into `result` (exposed for tests): chunks with text time TTFT and ITL;
// `usage` sets the token counts; an `error` object or a malformed chunk fails the request.
// `now` is seconds since the request was sent. Returns false once the stream is done ([DONE]).
bool on_stream_event(const std::string& data, double now, RequestResult* result, double* last_token_time);

// The load: `num_requests` prompts of `input_len` random token ids (seeded; ids in [lo, hi)), or the
// lines of a JSONL dataset: {"prompt": text or ids, "output_len"?: N} (output_len defaults to the flag).
std::vector<BenchRequest> random_requests(int num_requests, int input_len, int output_len, uint64_t seed, int lo, int hi);
std::vector<BenchRequest> dataset_requests(const std::string& path, int num_requests, int output_len);

struct LoadOptions {
  int concurrency = 1;
  double request_rate = 0;  // requests/s, Poisson arrivals; <= 0 or inf: all at once (concurrency caps)
  uint64_t seed = 0;
};

// Runs the load with `concurrency` client threads; `send` is the request function (send_completion, or a
// fake in tests). Returns the results in request order and the wall time.
std::vector<RequestResult> run_load(const std::vector<BenchRequest>& requests, const LoadOptions& options,
                                    const std::function<RequestResult(const BenchRequest&)>& send, double* duration_s);

// The gaps (s) of every successful request that begin at or after `from` seconds of the load (token
// arrival times: sent_at + ttft + the gaps so far): the ITL of steady decoding, after a start-up prefill.
std::vector<double> itl_after(const std::vector<RequestResult>& results, double from);
// When every successful one of the first `n` requests had its first token (seconds of the load).
double all_decoding_at(const std::vector<RequestResult>& results, size_t n);

struct Stat {
  double mean = 0, median = 0, p99 = 0, stddev = 0;
};
// numpy's mean, percentile (linear interpolation) and std of `values`; all zero when empty.
Stat stat_of(std::vector<double> values);
double percentile(std::vector<double> values, double p);

struct Summary {
  int completed = 0, failed = 0;
  double duration_s = 0;
  int64_t total_input = 0, total_output = 0;
  double request_throughput = 0, input_throughput = 0, output_throughput = 0, total_throughput = 0;
  Stat ttft_ms, tpot_ms, itl_ms, e2el_ms;
  std::string first_error;
};
// As vllm bench serve: over successful requests; TPOT per request = (latency - ttft) / (output - 1) for
// requests with more than one output token; ITL over every gap of every request.
Summary summarize(const std::vector<RequestResult>& results, double duration_s);
std::string format_summary(const Summary& s);  // the table vllm prints
nlohmann::json summary_json(const Summary& s);

// ---- The server's own step timings (moex serve's /metrics; absent on other servers) ------------------

// A Prometheus text exposition, parsed: value(name, labels) sums the samples of that name whose labels
// include `labels` (0 when none).
class MetricsSnapshot {
 public:
  static MetricsSnapshot parse(const std::string& text);
  double value(const std::string& name, const std::vector<std::pair<std::string, std::string>>& labels = {}) const;
  bool has(const std::string& name) const;

 private:
  struct Sample {
    std::string name;
    std::vector<std::pair<std::string, std::string>> labels;
    double value = 0;
  };
  std::vector<Sample> samples_;
};

// GET base + /metrics; nullopt-like: ok false when the request fails or is not 200.
bool fetch_metrics(const ClientOptions& options, MetricsSnapshot* out);

// Where the server's time went between two snapshots, from moex serve's engine metrics
// (moex:engine_*{kind=prefill|decode}).
struct StepBreakdown {
  bool available = false;  // the server exposes moex:engine_steps_total
  double prefill_steps = 0, prefill_seconds = 0, prefill_forward_seconds = 0, prefill_prompt_rows = 0,
         prefill_decode_rows = 0;
  double decode_steps = 0, decode_seconds = 0, decode_forward_seconds = 0, decode_rows = 0;
  double duration_s = 0;  // the client's wall time of the run
  double engine_other_seconds() const {  // in steps, outside the forward: schedule, sampling, token push
    return prefill_seconds - prefill_forward_seconds + decode_seconds - decode_forward_seconds;
  }
  double outside_steps_seconds() const { return duration_s - prefill_seconds - decode_seconds; }  // engine waiting
  double decode_tokens_per_s() const { return decode_seconds > 0 ? decode_rows / decode_seconds : 0; }
  double decode_rows_per_step() const { return decode_steps > 0 ? decode_rows / decode_steps : 0; }
  double prefill_step_ms() const { return prefill_steps > 0 ? prefill_seconds / prefill_steps * 1e3 : 0; }
  double decode_step_ms() const { return decode_steps > 0 ? decode_seconds / decode_steps * 1e3 : 0; }
};
StepBreakdown step_breakdown(const MetricsSnapshot& before, const MetricsSnapshot& after, double duration_s);
std::string format_breakdown(const StepBreakdown& b);
nlohmann::json breakdown_json(const StepBreakdown& b);

}  // namespace moex::tools::serve_bench

#include "tools/lib/serve_bench.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "moex/base/error.h"
#include "moex/base/small_file.h"

namespace moex::tools::serve_bench {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

void SseParser::feed(std::string_view bytes) {
  pending_.append(bytes);
  size_t start = 0;
  while (true) {
    const size_t nl = pending_.find('\n', start);
    if (nl == std::string::npos) break;
    size_t end = nl;
    if (end > start && pending_[end - 1] == '\r') --end;
    line(std::string_view(pending_).substr(start, end - start));
    start = nl + 1;
  }
  pending_.erase(0, start);
}

void SseParser::finish() {
  if (!pending_.empty()) {
    std::string rest;
    rest.swap(pending_);
    if (!rest.empty() && rest.back() == '\r') rest.pop_back();
    line(rest);
  }
  line("");
}

void SseParser::line(std::string_view l) {
  if (l.empty()) {  // a blank line dispatches the event
    if (has_data_) on_event_(data_);
    data_.clear();
    has_data_ = false;
    return;
  }
  if (l[0] == ':') return;  // comment
  const size_t colon = l.find(':');
  const std::string_view field = l.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? std::string_view() : l.substr(colon + 1);
  if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
  if (field != "data") return;  // event, id, retry: not used by the OpenAI API
  if (has_data_) data_ += '\n';
  data_.append(value);
  has_data_ = true;
}

void split_url(const std::string& url, std::string* base, std::string* path) {
  const size_t scheme_end = url.find("://");
  MOEX_CHECK_INPUT(scheme_end != std::string::npos, "--url ", url, ": expected http://HOST:PORT[/PATH]");
  const std::string scheme = url.substr(0, scheme_end);
  MOEX_CHECK_INPUT(scheme == "http", "--url ", url, ": only http:// is supported");
  const size_t slash = url.find('/', scheme_end + 3);
  *base = url.substr(0, slash);
  MOEX_CHECK_INPUT(base->size() > scheme_end + 3, "--url ", url, ": no host");
  *path = slash == std::string::npos ? "" : url.substr(slash);
  if (path->empty() || *path == "/") *path = "/v1/completions";
}

bool is_chat_path(const std::string& path) {
  const std::string suffix = "/chat/completions";
  return path.size() >= suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool on_stream_event(const std::string& data, double now, RequestResult* r, double* last_token_time) {
  if (data == "[DONE]") {
    r->latency = now;
    return false;
  }
  json chunk;
  try {
    chunk = json::parse(data);
  } catch (const json::exception&) {
    r->error = "malformed chunk: " + data.substr(0, 200);
    return false;
  }
  if (!chunk.is_object()) {
    r->error = "chunk is not an object: " + data.substr(0, 200);
    return false;
  }
  if (chunk.contains("error")) {
    const json& e = chunk["error"];
    r->error = e.is_object() && e.contains("message") && e["message"].is_string() ? e["message"].get<std::string>() : e.dump();
    return false;
  }
  if (chunk.contains("usage") && chunk["usage"].is_object()) {
    const json& u = chunk["usage"];
    if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer()) r->prompt_tokens = u["prompt_tokens"];
    if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer()) r->output_tokens = u["completion_tokens"];
  }
  if (chunk.contains("choices") && chunk["choices"].is_array() && !chunk["choices"].empty()) {
    const json& c = chunk["choices"][0];
    std::string text;
    if (c.contains("text") && c["text"].is_string()) text = c["text"];
    else if (c.contains("delta") && c["delta"].is_object() && c["delta"].contains("content") && c["delta"]["content"].is_string())
      text = c["delta"]["content"];
    // As vllm bench serve: a chunk counts as a token arrival when it carries text; the first one is TTFT.
    if (!text.empty()) {
      if (r->text.empty()) r->ttft = now;
      else r->itl.push_back(now - *last_token_time);
      *last_token_time = now;
      r->text += text;
    }
  }
  return true;
}

RequestResult send_completion(const ClientOptions& options, const BenchRequest& request) {
  RequestResult r;
  std::string base, path;
  split_url(options.url, &base, &path);
  httplib::Client client(base);
  const auto timeout = std::chrono::duration<double>(options.timeout_s);
  client.set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  json body = {{"max_tokens", request.output_len}, {"stream", true}, {"ignore_eos", true}, {"temperature", 0.0},
               {"stream_options", {{"include_usage", true}}}};
  if (is_chat_path(path)) {  // the prompt as one user message (text only: a chat request has no token ids)
    if (!request.prompt.is_string()) {
      r.error = "a chat endpoint needs text prompts (--dataset with \"prompt\": text)";
      return r;
    }
    body["messages"] = json::array({{{"role", "user"}, {"content", request.prompt}}});
  } else {
    body["prompt"] = request.prompt;
  }
  if (!options.model.empty()) body["model"] = options.model;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.set_header("Accept", "text/event-stream");
  if (!options.api_key.empty()) req.set_header("Authorization", "Bearer " + options.api_key);
  const auto start = Clock::now();
  const auto now = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  double last_token_time = 0;
  bool done = false;
  std::string raw;  // the body, kept for an error message when the status is not 200
  SseParser parser([&](const std::string& data) {
    if (done || !r.error.empty()) return;
    const bool had_text = !r.text.empty();
    done = !on_stream_event(data, now(), &r, &last_token_time);
    if (!had_text && !r.text.empty() && options.on_first_token) options.on_first_token();
  });
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (raw.size() < 4096) raw.append(data, std::min<size_t>(n, 4096 - raw.size()));
    parser.feed(std::string_view(data, n));
    return r.error.empty();
  };
  const httplib::Result res = client.send(req);
  if (!res) {
    if (r.error.empty()) r.error = "HTTP request failed: " + httplib::to_string(res.error());
    return r;
  }
  if (res->status != 200) {
    std::string message = raw;
    try {
      const json e = json::parse(raw);
      if (e.contains("error") && e["error"].is_object() && e["error"].contains("message")) message = e["error"]["message"].dump();
    } catch (const json::exception&) {
    }
    r.error = "HTTP " + std::to_string(res->status) + ": " + message.substr(0, 300);
    return r;
  }
  parser.finish();
  if (!r.error.empty()) return r;
  if (!done) {
    r.error = "stream ended without data: [DONE]";
    return r;
  }
  if (r.prompt_tokens == 0) r.prompt_tokens = request.prompt_len;
  if (r.output_tokens == 0) r.output_tokens = r.text.empty() ? 0 : static_cast<int>(r.itl.size()) + 1;
  r.success = true;
  return r;
}

std::vector<BenchRequest> random_requests(int num_requests, int input_len, int output_len, uint64_t seed, int lo, int hi) {
  MOEX_CHECK_INPUT(lo < hi, "empty token id range");
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> id(lo, hi - 1);
  std::vector<BenchRequest> out(num_requests);
  for (BenchRequest& r : out) {
    r.prompt = json::array();
    for (int i = 0; i < input_len; ++i) r.prompt.push_back(id(rng));
    r.prompt_len = input_len;
    r.output_len = output_len;
  }
  return out;
}

std::vector<BenchRequest> dataset_requests(const std::string& path, int num_requests, int output_len) {
  const std::string text = read_small_file(path, size_t{1} << 30);
  std::vector<BenchRequest> all;
  size_t start = 0;
  int line_no = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      throw_error(ErrorKind::kInvalidInput, path + ":" + std::to_string(line_no) + ": not JSON: " + e.what());
    }
    MOEX_CHECK_INPUT(j.is_object() && j.contains("prompt"), path, ":", line_no, ": expected an object with \"prompt\"");
    BenchRequest r;
    r.prompt = j["prompt"];
    if (r.prompt.is_array()) {
      for (const json& id : r.prompt)
        MOEX_CHECK_INPUT(id.is_number_integer(), path, ":", line_no, ": \"prompt\" list must hold token ids");
      r.prompt_len = static_cast<int>(r.prompt.size());
    } else {
      MOEX_CHECK_INPUT(r.prompt.is_string(), path, ":", line_no, ": \"prompt\" must be a string or a list of ids");
    }
    r.output_len = output_len;
    if (j.contains("output_len")) {
      MOEX_CHECK_INPUT(j["output_len"].is_number_integer() && j["output_len"].get<int64_t>() >= 1 &&
                           j["output_len"].get<int64_t>() <= 1 << 20,
                       path, ":", line_no, ": \"output_len\" must be a positive integer");
      r.output_len = j["output_len"];
    }
    all.push_back(std::move(r));
  }
  MOEX_CHECK_INPUT(!all.empty(), path, ": no requests");
  std::vector<BenchRequest> out;  // cycled when the dataset is shorter than --num-requests
  for (int i = 0; i < num_requests; ++i) out.push_back(all[static_cast<size_t>(i) % all.size()]);
  return out;
}

std::vector<RequestResult> run_load(const std::vector<BenchRequest>& requests, const LoadOptions& options,
                                    const std::function<RequestResult(const BenchRequest&)>& send, double* duration_s) {
  // Arrival times: Poisson at request_rate (exponential gaps), or all at time 0.
  std::vector<double> arrival(requests.size(), 0.0);
  if (options.request_rate > 0 && std::isfinite(options.request_rate)) {
    std::mt19937_64 rng(options.seed ^ 0x9e3779b97f4a7c15ull);
    std::exponential_distribution<double> gap(options.request_rate);
    double t = 0;
    for (size_t i = 0; i < arrival.size(); ++i) {
      arrival[i] = t;
      t += gap(rng);
    }
  }
  std::vector<RequestResult> results(requests.size());
  std::atomic<size_t> next{0};
  const auto start = Clock::now();
  // `concurrency` workers take requests in arrival order: a request starts at its arrival time or when a
  // worker frees up, whichever is later (vLLM's semaphore, as threads).
  const int workers = std::max(1, std::min<int>(options.concurrency, static_cast<int>(requests.size())));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < requests.size();) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival[i])));
        try {
          const double sent_at = std::chrono::duration<double>(Clock::now() - start).count();
          results[i] = send(requests[i]);
          results[i].sent_at = sent_at;
        } catch (const std::exception& e) {
          results[i].success = false;
          results[i].error = e.what();
        }
      }
    });
  for (auto& t : pool) t.join();
  *duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  return results;
}

std::vector<double> itl_after(const std::vector<RequestResult>& results, double from) {
  std::vector<double> out;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    double t = r.sent_at + r.ttft;  // arrival of the token before the gap
    for (double gap : r.itl) {
      if (t >= from) out.push_back(gap);
      t += gap;
    }
  }
  return out;
}

double all_decoding_at(const std::vector<RequestResult>& results, size_t n) {
  double at = 0;
  for (size_t i = 0; i < std::min(n, results.size()); ++i)
    if (results[i].success) at = std::max(at, results[i].sent_at + results[i].ttft);
  return at;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);  // numpy's "linear"
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

Stat stat_of(std::vector<double> v) {
  Stat s;
  if (v.empty()) return s;
  double total = 0;
  for (double x : v) total += x;
  s.mean = total / static_cast<double>(v.size());
  double sq = 0;
  for (double x : v) sq += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(sq / static_cast<double>(v.size()));
  s.median = percentile(v, 50);
  s.p99 = percentile(v, 99);
  return s;
}

Summary summarize(const std::vector<RequestResult>& results, double duration_s) {
  Summary s;
  s.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2el;
  for (const RequestResult& r : results) {
    if (!r.success) {
      ++s.failed;
      if (s.first_error.empty()) s.first_error = r.error;
      continue;
    }
    ++s.completed;
    s.total_input += r.prompt_tokens;
    s.total_output += r.output_tokens;
    ttft.push_back(r.ttft * 1e3);
    e2el.push_back(r.latency * 1e3);
    for (double gap : r.itl) itl.push_back(gap * 1e3);
    if (r.output_tokens > 1) tpot.push_back((r.latency - r.ttft) / (r.output_tokens - 1) * 1e3);
  }
  const double d = std::max(duration_s, 1e-9);
  s.request_throughput = s.completed / d;
  s.input_throughput = static_cast<double>(s.total_input) / d;
  s.output_throughput = static_cast<double>(s.total_output) / d;
  s.total_throughput = static_cast<double>(s.total_input + s.total_output) / d;
  s.ttft_ms = stat_of(ttft);
  s.tpot_ms = stat_of(tpot);
  s.itl_ms = stat_of(itl);
  s.e2el_ms = stat_of(e2el);
  return s;
}

std::string format_summary(const Summary& s) {
  std::string out;
  char line[128];
  const auto row = [&](const char* name, const std::string& value) {
    std::snprintf(line, sizeof line, "%-40s %-10s\n", name, value.c_str());
    out += line;
  };
  const auto num = [](double v, int digits) {
    char b[64];
    std::snprintf(b, sizeof b, "%.*f", digits, v);
    return std::string(b);
  };
  const auto rule = [&](const char* title, char fill) {
    const std::string t = title;
    const size_t width = 50, left = (width - t.size()) / 2;
    out += std::string(left, fill) + t + std::string(width - left - t.size(), fill) + "\n";
  };
  rule(" Serving Benchmark Result ", '=');
  row("Successful requests:", std::to_string(s.completed));
  row("Failed requests:", std::to_string(s.failed));
  row("Benchmark duration (s):", num(s.duration_s, 2));
  row("Total input tokens:", std::to_string(s.total_input));
  row("Total generated tokens:", std::to_string(s.total_output));
  row("Request throughput (req/s):", num(s.request_throughput, 2));
  row("Input token throughput (tok/s):", num(s.input_throughput, 2));
  row("Output token throughput (tok/s):", num(s.output_throughput, 2));
  row("Total Token throughput (tok/s):", num(s.total_throughput, 2));
  const auto block = [&](const char* title, const char* abbrev, const Stat& st) {
    rule(title, '-');
    row((std::string("Mean ") + abbrev + " (ms):").c_str(), num(st.mean, 2));
    row((std::string("Median ") + abbrev + " (ms):").c_str(), num(st.median, 2));
    row((std::string("P99 ") + abbrev + " (ms):").c_str(), num(st.p99, 2));
  };
  block("Time to First Token", "TTFT", s.ttft_ms);
  block("Time per Output Token (excl. 1st token)", "TPOT", s.tpot_ms);
  block("Inter-token Latency", "ITL", s.itl_ms);
  block("End-to-end Latency", "E2EL", s.e2el_ms);
  out += std::string(50, '=') + "\n";
  if (!s.first_error.empty()) out += "first error: " + s.first_error + "\n";
  return out;
}

json summary_json(const Summary& s) {
  const auto stat = [](const Stat& st) {
    return json{{"mean", st.mean}, {"median", st.median}, {"p99", st.p99}, {"std", st.stddev}};
  };
  json j = {{"completed", s.completed}, {"failed", s.failed}, {"duration_s", s.duration_s},
            {"total_input_tokens", s.total_input}, {"total_output_tokens", s.total_output},
            {"request_throughput", s.request_throughput}, {"input_throughput", s.input_throughput},
            {"output_throughput", s.output_throughput}, {"total_token_throughput", s.total_throughput},
            {"ttft_ms", stat(s.ttft_ms)}, {"tpot_ms", stat(s.tpot_ms)}, {"itl_ms", stat(s.itl_ms)},
            {"e2el_ms", stat(s.e2el_ms)}};
  if (!s.first_error.empty()) j["first_error"] = s.first_error;
  return j;
}

// ---- Server step timings ------------------------------------------------------------------------------

MetricsSnapshot MetricsSnapshot::parse(const std::string& text) {
  // Prometheus text format 0.0.4: `name{label="value",...} value [timestamp]`; # lines are comments.
  MetricsSnapshot m;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    size_t i = line.find_first_of("{ ");
    if (i == std::string::npos) continue;
    s.name = line.substr(0, i);
    if (line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') return m;  // malformed: stop
        std::string key = line.substr(i, eq - i), value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) ++j;
          value += line[j];
        }
        s.labels.emplace_back(std::move(key), std::move(value));
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;
    }
    const char* begin = line.c_str() + std::min(i, line.size());
    char* parsed_end = nullptr;
    s.value = std::strtod(begin, &parsed_end);
    if (parsed_end == begin) continue;
    m.samples_.push_back(std::move(s));
  }
  return m;
}

double MetricsSnapshot::value(const std::string& name, const std::vector<std::pair<std::string, std::string>>& labels) const {
  double total = 0;
  for (const Sample& s : samples_) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& want : labels)
      match = match && std::find(s.labels.begin(), s.labels.end(), want) != s.labels.end();
    if (match) total += s.value;
  }
  return total;
}

bool MetricsSnapshot::has(const std::string& name) const {
  return std::any_of(samples_.begin(), samples_.end(), [&](const Sample& s) { return s.name == name; });
}

bool fetch_metrics(const ClientOptions& options, MetricsSnapshot* out) {
  std::string base, path;
  split_url(options.url, &base, &path);
  httplib::Client client(base);
  client.set_connection_timeout(std::chrono::seconds(10));
  client.set_read_timeout(std::chrono::seconds(10));
  httplib::Headers headers;
  if (!options.api_key.empty()) headers.emplace("Authorization", "Bearer " + options.api_key);
  const httplib::Result res = client.Get("/metrics", headers);
  if (!res || res->status != 200) return false;
  *out = MetricsSnapshot::parse(res->body);
  return true;
}

StepBreakdown step_breakdown(const MetricsSnapshot& before, const MetricsSnapshot& after, double duration_s) {
  StepBreakdown b;
  b.duration_s = duration_s;
  b.available = after.has("moex:engine_steps_total");
  if (!b.available) return b;
  const auto delta = [&](const char* name, const char* kind, const char* row = nullptr) {
    std::vector<std::pair<std::string, std::string>> labels = {{"kind", kind}};
    if (row) labels.emplace_back("row", row);
    return after.value(name, labels) - before.value(name, labels);
  };
  b.prefill_steps = delta("moex:engine_steps_total", "prefill");
  b.prefill_seconds = delta("moex:engine_step_seconds_total", "prefill");
  b.prefill_forward_seconds = delta("moex:engine_forward_seconds_total", "prefill");
  b.prefill_prompt_rows = delta("moex:engine_step_rows_total", "prefill", "prompt");
  b.prefill_decode_rows = delta("moex:engine_step_rows_total", "prefill", "decode");
  b.decode_steps = delta("moex:engine_steps_total", "decode");
  b.decode_seconds = delta("moex:engine_step_seconds_total", "decode");
  b.decode_forward_seconds = delta("moex:engine_forward_seconds_total", "decode");
  b.decode_rows = delta("moex:engine_step_rows_total", "decode", "decode");
  return b;
}

std::string format_breakdown(const StepBreakdown& b) {
  if (!b.available) return "server step timings: not available (the server has no moex:engine_steps_total)\n";
  std::string out;
  char line[256];
  const double d = std::max(b.duration_s, 1e-9);
  const auto pct = [&](double s) { return 100.0 * s / d; };
  out += "---------------Server steps (/metrics)------------\n";
  std::snprintf(line, sizeof line, "%-40s %.0f steps, %.2f s (%.1f%%), %.1f ms/step\n", "Prefill steps:", b.prefill_steps,
                b.prefill_seconds, pct(b.prefill_seconds), b.prefill_step_ms());
  out += line;
  std::snprintf(line, sizeof line, "%-40s %.0f prompt + %.0f decode rows\n", "  rows:", b.prefill_prompt_rows,
                b.prefill_decode_rows);
  out += line;
  std::snprintf(line, sizeof line, "%-40s %.0f steps, %.2f s (%.1f%%), %.1f ms/step\n", "Decode steps:", b.decode_steps,
                b.decode_seconds, pct(b.decode_seconds), b.decode_step_ms());
  out += line;
  std::snprintf(line, sizeof line, "%-40s %.0f decode rows, %.1f per step\n", "  rows:", b.decode_rows, b.decode_rows_per_step());
  out += line;
  std::snprintf(line, sizeof line, "%-40s %.2f s (%.1f%%)\n", "In steps, outside forward:", b.engine_other_seconds(),
                pct(b.engine_other_seconds()));
  out += line;
  std::snprintf(line, sizeof line, "%-40s %.2f s (%.1f%%)\n", "Outside steps (engine waiting):", b.outside_steps_seconds(),
                pct(b.outside_steps_seconds()));
  out += line;
  std::snprintf(line, sizeof line, "%-40s %.2f\n", "Decode-step throughput (tok/s):", b.decode_tokens_per_s());
  out += line;
  out += std::string(50, '=') + "\n";
  return out;
}

nlohmann::json breakdown_json(const StepBreakdown& b) {
  if (!b.available) return nullptr;
  return json{{"prefill_steps", b.prefill_steps},
              {"prefill_seconds", b.prefill_seconds},
              {"prefill_forward_seconds", b.prefill_forward_seconds},
              {"prefill_prompt_rows", b.prefill_prompt_rows},
              {"prefill_decode_rows", b.prefill_decode_rows},
              {"decode_steps", b.decode_steps},
              {"decode_seconds", b.decode_seconds},
              {"decode_forward_seconds", b.decode_forward_seconds},
              {"decode_rows", b.decode_rows},
              {"engine_other_seconds", b.engine_other_seconds()},
              {"outside_steps_seconds", b.outside_steps_seconds()},
              {"decode_tokens_per_s", b.decode_tokens_per_s()},
              {"prefill_step_ms", b.prefill_step_ms()},
              {"decode_step_ms", b.decode_step_ms()}};
}

}  // namespace moex::tools::serve_bench

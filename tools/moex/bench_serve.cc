// `moex bench serve`: a load generator for an OpenAI-compatible server (`moex serve`, vLLM, llama.cpp's
// server), printing what `vllm bench serve` prints. Streaming /v1/completions with ignore_eos, so each
// request generates exactly --output-len tokens; prompts are --input-len random token ids (exact input
// length) unless --dataset gives them.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <cstdio>
#include <memory>

#include "tools/lib/serve_bench.h"
#include "tools/moex/bench.h"

namespace moex::tools {
namespace {

struct ServeBenchFlags {
  std::string url = "http://127.0.0.1:8000";
  int concurrency = 1;
  int num_requests = 64;
  int input_len = 128;
  int output_len = 128;
  std::string dataset;
  double request_rate = INFINITY;
  bool json = false;
  std::string api_key;
  std::string model;
  uint64_t seed = 0;
  int vocab_size = 32000;
  double timeout_s = 600;
  int long_prompt = 0;           // > 0: the load runs twice, the second time with one prompt of this many tokens
  double long_prompt_at = -1;    // seconds after the load starts; < 0: once every first-wave request decodes
};

// The decoders' ITL with and without one long prompt arriving: two runs of the same load (fresh prompts
// the second time, so the prefix cache holds none of them), the second with one --long-prompt request
// (max_tokens 1) sent at --long-prompt-at. Its chunks are the server's prefill steps between two /metrics
// snapshots taken around it (the load's own prompts are all admitted before it when it waits for them).
struct LongPromptReport {
  serve_bench::Summary without, with;
  double max_itl_without_ms = 0, max_itl_with_ms = 0;
  // The same over the gaps after every first-wave request decodes (its start-up prefill chunks left out).
  serve_bench::Stat steady_without_ms, steady_with_ms;
  double steady_max_without_ms = 0, steady_max_with_ms = 0;
  serve_bench::RequestResult long_result;
  double sent_at_s = 0;
  serve_bench::StepBreakdown window;  // the server's steps while the long prompt was in flight
};

double max_itl_ms(const std::vector<serve_bench::RequestResult>& results) {
  double m = 0;
  for (const auto& r : results)
    for (double gap : r.itl) m = std::max(m, gap * 1e3);
  return m;
}

// ITL statistics (ms) of the gaps after every one of the first `wave` requests has its first token.
void steady_itl(const std::vector<serve_bench::RequestResult>& results, size_t wave, serve_bench::Stat* stat, double* max_ms) {
  std::vector<double> gaps = serve_bench::itl_after(results, serve_bench::all_decoding_at(results, wave));
  for (double& g : gaps) g *= 1e3;
  *max_ms = gaps.empty() ? 0 : *std::max_element(gaps.begin(), gaps.end());
  *stat = serve_bench::stat_of(std::move(gaps));
}

LongPromptReport run_long_prompt(const ServeBenchFlags& f, const serve_bench::ClientOptions& client,
                                 const serve_bench::LoadOptions& load) {
  using namespace serve_bench;
  LongPromptReport rep;
  double duration = 0;
  const auto baseline = random_requests(f.num_requests, f.input_len, f.output_len, f.seed, 259, f.vocab_size);
  const auto without = run_load(baseline, load, [&](const BenchRequest& r) { return send_completion(client, r); }, &duration);
  rep.without = summarize(without, duration);
  rep.max_itl_without_ms = max_itl_ms(without);
  const size_t wave = static_cast<size_t>(std::min(f.concurrency, f.num_requests));
  steady_itl(without, wave, &rep.steady_without_ms, &rep.steady_max_without_ms);

  const auto requests = random_requests(f.num_requests, f.input_len, f.output_len, f.seed + 1, 259, f.vocab_size);
  const BenchRequest long_request = random_requests(1, f.long_prompt, 1, f.seed + 2, 259, f.vocab_size)[0];
  ClientOptions counted = client;
  std::atomic<int> first_tokens{0};
  counted.on_first_token = [&] { first_tokens.fetch_add(1); };
  std::atomic<bool> load_done{false};
  const int first_wave = std::min(f.concurrency, f.num_requests);
  const auto start = std::chrono::steady_clock::now();
  std::thread sender([&] {
    // Wait for the moment: a time, or every request of the first wave decoding (its first token arrived).
    while (!load_done.load()) {
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (f.long_prompt_at >= 0 ? t >= f.long_prompt_at : first_tokens.load() >= first_wave) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    rep.sent_at_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    MetricsSnapshot before, after;
    const bool have_before = fetch_metrics(client, &before);
    const auto t0 = std::chrono::steady_clock::now();
    rep.long_result = send_completion(client, long_request);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The engine counts a step after pushing its tokens, so the last chunk may not be in /metrics yet when
    // the request is done: poll (up to 2 s) until the window holds all of its prompt rows.
    for (int i = 0; have_before && i < 200 && fetch_metrics(client, &after); ++i) {
      rep.window = step_breakdown(before, after, took);
      if (rep.window.prefill_prompt_rows >= f.long_prompt) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  const auto with = run_load(requests, load, [&](const BenchRequest& r) { return send_completion(counted, r); }, &duration);
  load_done.store(true);
  sender.join();
  rep.with = summarize(with, duration);
  rep.max_itl_with_ms = max_itl_ms(with);
  steady_itl(with, wave, &rep.steady_with_ms, &rep.steady_max_with_ms);
  return rep;
}

nlohmann::json long_prompt_json(const ServeBenchFlags& f, const LongPromptReport& r) {
  const auto& w = r.window;
  nlohmann::json j = {{"tokens", f.long_prompt},
                      {"sent_at_s", r.sent_at_s},
                      {"success", r.long_result.success},
                      {"ttft_ms", r.long_result.ttft * 1e3},
                      {"itl_p99_without_ms", r.without.itl_ms.p99},
                      {"itl_p99_with_ms", r.with.itl_ms.p99},
                      {"itl_max_without_ms", r.max_itl_without_ms},
                      {"itl_max_with_ms", r.max_itl_with_ms},
                      {"steady_itl_p99_without_ms", r.steady_without_ms.p99},
                      {"steady_itl_p99_with_ms", r.steady_with_ms.p99},
                      {"steady_itl_median_without_ms", r.steady_without_ms.median},
                      {"steady_itl_max_without_ms", r.steady_max_without_ms},
                      {"steady_itl_max_with_ms", r.steady_max_with_ms},
                      {"without", serve_bench::summary_json(r.without)},
                      {"with", serve_bench::summary_json(r.with)}};
  if (!r.long_result.success) j["error"] = r.long_result.error;
  if (w.available)
    j["chunks"] = {{"steps", w.prefill_steps},
                   {"prompt_rows", w.prefill_prompt_rows},
                   {"decode_rows", w.prefill_decode_rows},
                   {"chunk_ms", w.prefill_step_ms()},
                   {"decode_step_ms", w.decode_step_ms()}};
  return j;
}

std::string format_long_prompt(const ServeBenchFlags& f, const LongPromptReport& r) {
  std::string out;
  char line[256];
  const auto row = [&](const char* name, const std::string& value) {
    std::snprintf(line, sizeof line, "%-40s %s\n", name, value.c_str());
    out += line;
  };
  const auto num = [](double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.2f", v);
    return std::string(b);
  };
  std::snprintf(line, sizeof line, "----Long prompt: %d tokens at %.2f s----", f.long_prompt, r.sent_at_s);
  out += std::string(line) + "\n";
  row("Decoders' ITL p99 without / with (ms):", num(r.without.itl_ms.p99) + " / " + num(r.with.itl_ms.p99));
  row("Decoders' ITL median without / with (ms):", num(r.without.itl_ms.median) + " / " + num(r.with.itl_ms.median));
  row("Decoders' ITL max without / with (ms):", num(r.max_itl_without_ms) + " / " + num(r.max_itl_with_ms));
  row("After all decode: ITL p99 w/o / with:", num(r.steady_without_ms.p99) + " / " + num(r.steady_with_ms.p99));
  row("After all decode: ITL max w/o / with:", num(r.steady_max_without_ms) + " / " + num(r.steady_max_with_ms));
  row("Long prompt TTFT (ms):", r.long_result.success ? num(r.long_result.ttft * 1e3) : "failed: " + r.long_result.error);
  const auto& w = r.window;
  if (w.available && w.prefill_steps > 0) {
    std::snprintf(line, sizeof line, "%.0f steps: %.0f prompt + %.0f decode rows (%.1f decode rows per chunk)",
                  w.prefill_steps, w.prefill_prompt_rows, w.prefill_decode_rows, w.prefill_decode_rows / w.prefill_steps);
    row("Its chunks (server prefill steps):", line);
    row("One chunk's time (ms, mean):", num(w.prefill_step_ms()));
    row("Decode step beside it (ms, mean):", w.decode_steps > 0 ? num(w.decode_step_ms()) : "-");
    // Its delay to a decoder's next token: the steady ITL p99 with it, less the steady ITL median without.
    const double delay = r.steady_with_ms.p99 - r.steady_without_ms.median;
    std::snprintf(line, sizeof line, "%.2f %s %.2f", delay, delay <= w.prefill_step_ms() ? "<=" : ">", w.prefill_step_ms());
    row("Delay (p99 with - median w/o) vs chunk:", line);
  } else {
    row("Its chunks:", "not available (no moex:engine_* metrics)");
  }
  out += std::string(50, '=') + "\n";
  return out;
}

void run_serve_bench(const ServeBenchFlags& f) {
  using namespace serve_bench;
  MOEX_CHECK_INPUT(f.concurrency >= 1, "--concurrency must be >= 1");
  MOEX_CHECK_INPUT(f.num_requests >= 1, "--num-requests must be >= 1");
  MOEX_CHECK_INPUT(f.input_len >= 1 && f.output_len >= 1, "--input-len and --output-len must be >= 1");
  MOEX_CHECK_INPUT(f.request_rate > 0, "--request-rate must be > 0 (inf: all at once)");
  MOEX_CHECK_INPUT(f.vocab_size > 259, "--vocab-size must be > 259");
  MOEX_CHECK_INPUT(f.long_prompt >= 0, "--long-prompt must be >= 0 (0: none)");
  MOEX_CHECK_INPUT(f.long_prompt == 0 || f.dataset.empty(), "--long-prompt runs random prompts: it does not take --dataset");
  std::string base, path;
  split_url(f.url, &base, &path);  // a bad URL is an error before any request
  // Random ids skip the specials and byte pieces (0..258 in a Llama/Mixtral SentencePiece vocab).
  const std::vector<BenchRequest> requests =
      f.dataset.empty() ? random_requests(f.num_requests, f.input_len, f.output_len, f.seed, 259, f.vocab_size)
                        : dataset_requests(f.dataset, f.num_requests, f.output_len);
  ClientOptions client{f.url, f.api_key, f.model, f.timeout_s};
  LoadOptions load{f.concurrency, std::isfinite(f.request_rate) ? f.request_rate : 0.0, f.seed};
  if (!f.json)
    std::printf("bench serve: %s%s, %d requests, concurrency %d, request rate %s, input %s, output %d\n", base.c_str(),
                path.c_str(), f.num_requests, f.concurrency,
                std::isfinite(f.request_rate) ? (std::to_string(f.request_rate) + "/s").c_str() : "inf",
                f.dataset.empty() ? std::to_string(f.input_len).c_str() : f.dataset.c_str(), f.output_len);
  // As vllm bench serve: one request first, untimed, so a wrong URL, key or model fails at once with the
  // server's reason, and connection set-up and first-call costs stay out of the figures.
  const RequestResult probe = send_completion(client, requests[0]);
  MOEX_CHECK_INPUT(probe.success, "the initial test request failed: ", probe.error);
  if (f.long_prompt > 0) {
    const LongPromptReport r = run_long_prompt(f, client, load);
    if (f.json) {
      std::printf("%s\n", nlohmann::json{{"url", f.url}, {"concurrency", f.concurrency}, {"num_requests", f.num_requests},
                                          {"input_len", f.input_len}, {"output_len", f.output_len},
                                          {"long_prompt", long_prompt_json(f, r)}}.dump().c_str());
    } else {
      std::printf("%s", format_long_prompt(f, r).c_str());
    }
    MOEX_CHECK_INPUT(r.long_result.success, "the long prompt failed: ", r.long_result.error);
    MOEX_CHECK_INPUT(r.with.completed > 0 && r.without.completed > 0, "no request succeeded: ", r.with.first_error,
                     r.without.first_error);
    return;
  }
  MetricsSnapshot before, after;
  const bool have_before = fetch_metrics(client, &before);  // the server's own step timings, when it has them
  double duration = 0;
  const auto results = run_load(requests, load, [&](const BenchRequest& r) { return send_completion(client, r); }, &duration);
  const Summary s = summarize(results, duration);
  StepBreakdown steps;
  if (have_before && fetch_metrics(client, &after)) steps = step_breakdown(before, after, duration);
  if (f.json) {
    nlohmann::json j = summary_json(s);
    j["url"] = f.url;
    j["concurrency"] = f.concurrency;
    j["num_requests"] = f.num_requests;
    j["input_len"] = f.input_len;
    j["output_len"] = f.output_len;
    j["request_rate"] = std::isfinite(f.request_rate) ? nlohmann::json(f.request_rate) : nlohmann::json("inf");
    if (!f.dataset.empty()) j["dataset"] = f.dataset;
    j["server_steps"] = breakdown_json(steps);
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s", format_summary(s).c_str());
    std::printf("%s", format_breakdown(steps).c_str());
  }
  MOEX_CHECK_INPUT(s.completed > 0, "no request succeeded: ", s.first_error);
}

void setup_serve_bench(CLI::App& bench) {
  auto f = std::make_shared<ServeBenchFlags>();
  auto* cmd = bench.add_subcommand("serve", "Load an OpenAI-compatible server; TTFT, TPOT, ITL, E2E latency and throughput");
  cmd->add_option("--url", f->url, "Server: http://HOST:PORT[/PATH] (path default /v1/completions)")->capture_default_str();
  cmd->add_option("--concurrency", f->concurrency, "Requests in flight at most")->capture_default_str();
  cmd->add_option("--num-requests", f->num_requests, "Requests to send")->capture_default_str();
  cmd->add_option("--input-len", f->input_len, "Prompt tokens (random ids) per request")->capture_default_str();
  cmd->add_option("--output-len", f->output_len, "Tokens generated per request (max_tokens, ignore_eos)")->capture_default_str();
  cmd->add_option("--dataset", f->dataset, "JSONL prompts: {\"prompt\": text or ids, \"output_len\"?: N} per line")
      ->check(CLI::ExistingFile);
  cmd->add_option("--request-rate", f->request_rate, "Poisson arrivals per second (inf: all at once)")->capture_default_str();
  cmd->add_option("--api-key", f->api_key, "Sent as Authorization: Bearer KEY");
  cmd->add_option("--model", f->model, "The request's model field");
  cmd->add_option("--vocab-size", f->vocab_size, "Random prompt ids are drawn from [259, V)")->capture_default_str();
  cmd->add_option("--timeout", f->timeout_s, "Seconds a request may take")->capture_default_str();
  cmd->add_option("--long-prompt", f->long_prompt,
                  "Run the load twice, the second time with one prompt of N tokens arriving; print the ITL p99 of both")
      ->capture_default_str();
  cmd->add_option("--long-prompt-at", f->long_prompt_at,
                  "Seconds after the load starts to send it (< 0: once every first-wave request has its first token)")
      ->capture_default_str();
  add_seed_flag(cmd, f->seed, "Seed of the random prompts and arrivals");
  cmd->add_flag("--json", f->json, "Machine-readable output");
  cmd->callback([f] { run_serve_bench(*f); });
}
MOEX_REGISTER_BENCH(setup_serve_bench);

}  // namespace
}  // namespace moex::tools

// `moex bench serve`: a load generator for an OpenAI-compatible server (`moex serve`, vLLM, llama.cpp's
// server), printing what `vllm bench serve` prints. Streaming /v1/completions with ignore_eos, so each
// request generates exactly --output-len tokens; prompts are --input-len random token ids (exact input
// length) unless --dataset gives them.
#include <cmath>
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
};

void run_serve_bench(const ServeBenchFlags& f) {
  using namespace serve_bench;
  MOEX_CHECK_INPUT(f.concurrency >= 1, "--concurrency must be >= 1");
  MOEX_CHECK_INPUT(f.num_requests >= 1, "--num-requests must be >= 1");
  MOEX_CHECK_INPUT(f.input_len >= 1 && f.output_len >= 1, "--input-len and --output-len must be >= 1");
  MOEX_CHECK_INPUT(f.request_rate > 0, "--request-rate must be > 0 (inf: all at once)");
  MOEX_CHECK_INPUT(f.vocab_size > 259, "--vocab-size must be > 259");
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
  double duration = 0;
  const auto results = run_load(requests, load, [&](const BenchRequest& r) { return send_completion(client, r); }, &duration);
  const Summary s = summarize(results, duration);
  if (f.json) {
    nlohmann::json j = summary_json(s);
    j["url"] = f.url;
    j["concurrency"] = f.concurrency;
    j["num_requests"] = f.num_requests;
    j["input_len"] = f.input_len;
    j["output_len"] = f.output_len;
    j["request_rate"] = std::isfinite(f.request_rate) ? nlohmann::json(f.request_rate) : nlohmann::json("inf");
    if (!f.dataset.empty()) j["dataset"] = f.dataset;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s", format_summary(s).c_str());
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
  add_seed_flag(cmd, f->seed, "Seed of the random prompts and arrivals");
  cmd->add_flag("--json", f->json, "Machine-readable output");
  cmd->callback([f] { run_serve_bench(*f); });
}
MOEX_REGISTER_BENCH(setup_serve_bench);

}  // namespace
}  // namespace moex::tools

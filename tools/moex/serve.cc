// `moex serve`: an OpenAI-compatible HTTP server over the continuous-batching engine (src/moex/serve).
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "moex/base/threads.h"
#include "moex/text/chat_template.h"
#include "moex/text/tokenizer.h"
#include "moex/serve/engine.h"
#include "moex/serve/http_server.h"
#include "moex/runtime/step_protocol.h"
#include "tools/moex/command.h"
#include "tools/moex/model_flags.h"

namespace moex::tools {
namespace {

struct ServeFlags {
  ModelFlags model;
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_num_seqs = 64;
  int64_t max_waiting = 256;
  double kv_cache_gb = 0.0;
  int max_model_len = 0;
  std::string api_key;
  bool api_key_given = false;  // --api-key "" is an error, not a server open to all
  bool metrics_require_key = false;
  std::string served_model_name;
  bool no_prefix_caching = false;
  bool log_steps = false;
  bool no_web = false;
  int http_threads = 0;
  std::string chat_template;  // a Jinja file; empty: the model's tokenizer_config.json chat_template
};

void run_serve(ServeFlags flags) {
  MOEX_CHECK_INPUT(flags.port >= 0 && flags.port <= 65535, "--port must be 0..65535 (0: any free port)");
  MOEX_CHECK_INPUT(flags.max_num_seqs >= 1 && flags.max_num_seqs <= 4096, "--max-num-seqs must be 1..4096");
  const int64_t step_tokens = flags.model.max_step_tokens;  // the step's token budget
  MOEX_CHECK_INPUT(step_tokens >= flags.max_num_seqs && step_tokens <= (1 << 20), "--step-tokens (", step_tokens,
                   ") must be at least --max-num-seqs (", flags.max_num_seqs, ") and at most 1048576");
  MOEX_CHECK_INPUT(flags.max_waiting >= 0, "--max-waiting must be >= 0");
  MOEX_CHECK_INPUT(flags.kv_cache_gb >= 0, "--kv-cache-gb must be positive (0: --max-num-seqs x --max-model-len)");
  MOEX_CHECK_INPUT(!flags.api_key_given || !flags.api_key.empty(),
                   "--api-key is empty (an unset variable?): give a key, or leave the flag out to serve without one");
  MOEX_CHECK_INPUT(std::all_of(flags.api_key.begin(), flags.api_key.end(), [](char c) { return c > ' ' && c < 0x7f; }),
                   "--api-key must be printable ASCII without spaces (it is sent in an HTTP header)");
  MOEX_CHECK_INPUT(!flags.metrics_require_key || !flags.api_key.empty(), "--metrics-require-key needs --api-key");
  MOEX_CHECK_INPUT(flags.http_threads >= 0 && flags.http_threads <= 4096, "--http-threads must be 0..4096");
  if (flags.max_model_len > 0) flags.model.max_seq_len = flags.max_model_len;
  flags.model.kv_cache_gb = flags.kv_cache_gb;
  const Tokenizer tokenizer = Tokenizer::for_model(flags.model.model_dir);  // as generate: .gguf, tokenizer.json, tokenizer.model
  // The chat template: --chat-template FILE, else the checkpoint's (tokenizer_config.json, a .gguf's
  // tokenizer.chat_template); one that does not parse stops start-up (exit 2). A model with none serves
  // /v1/completions only: chat requests get a 400 (as vLLM).
  std::unique_ptr<ChatTemplate> chat_template;
  if (!flags.chat_template.empty() || ChatTemplate::model_has_template(flags.model.model_dir))
    chat_template = std::make_unique<ChatTemplate>(ChatTemplate::load(flags.model.model_dir, flags.chat_template));

  // SIGINT / SIGTERM end the server through a watcher thread (httplib's stop() is not async-signal-safe);
  // blocked before any thread starts, so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client that closed its socket is a failed write, not the end of the server

  auto model = flags.model.load(static_cast<int>(flags.max_num_seqs));
  // A request's large buffers (a body of up to 8 MB, its JSON, its prompt) are mapped and unmapped by
  // malloc at a fixed 1 MB threshold: glibc's adaptive threshold would otherwise rise to the first such
  // buffer's size and later ones would stay in the HTTP threads' arenas after the request (measured: six
  // 8 MB prompts left ~300 MB resident).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // Each client connection is a descriptor: the soft limit (often 1024) raised to the hard one, as nginx's
  // worker_rlimit_nofile, so a thousand idle clients do not shut everyone else out.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  const ParallelPlan& plan = model->options().plan;
  // Rank 0 owns HTTP and the scheduler(s). Attention TP: every rank runs rank 0's step. Attention DP: rank 0
  // keeps a scheduler per rank and sends each rank its own sub-step (runtime/step_protocol.h).
  if (plan.rank != 0) {  // this rank runs each step rank 0 sends
    run_step_worker(*model->options().comm, *model, step_tokens);
    return;
  }
  MOEX_CHECK_INPUT(tokenizer.vocab_size() <= model->config().vocab_size, tokenizer.describe(),
                   " has more tokens than config.json's vocab_size ", model->config().vocab_size);
  serve::ServerOptions so;
  so.model_name = flags.served_model_name.empty()
                      ? std::filesystem::path(flags.model.model_dir).lexically_normal().filename().string()
                      : flags.served_model_name;
  if (so.model_name.empty()) so.model_name = std::filesystem::path(flags.model.model_dir).parent_path().filename().string();
  so.chat_template = chat_template.get();
  EngineOptions eo;
  eo.model_name = so.model_name;
  eo.max_num_seqs = flags.max_num_seqs;
  eo.max_step_tokens = step_tokens;
  eo.max_waiting = flags.max_waiting;
  eo.max_model_len = model->options().max_seq_len;
  eo.prefix_caching = !flags.no_prefix_caching;
  eo.log_steps = flags.log_steps;
  if (!plan.single()) eo.comm = model->options().comm;
  serve::Engine engine(*model, eo);
  unpin_this_thread();  // the HTTP workers started below take the process's CPUs, not the engine's first one

  so.host = flags.host;
  so.port = flags.port;
  so.api_key = flags.api_key;
  so.metrics_require_key = flags.metrics_require_key;
  so.web = !flags.no_web;
  so.http_threads = flags.http_threads > 0 ? flags.http_threads
                                           : static_cast<int>(std::min<int64_t>(flags.max_num_seqs + flags.max_waiting + 8, 512));
  serve::HttpServer server(engine, tokenizer, so);
  server.bind();

  std::thread watcher([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    server.stop();
  });
  const auto& kv = model->kv_cache();
  const std::string open_paths = std::string(so.web ? "/, " : "") + "/health" + (so.metrics_require_key ? "" : " and /metrics");
  const std::string access = so.api_key.empty() ? "no API key: every client that can connect may use it"
                                                : "API key required (all but " + open_paths + ")";
  std::printf("moex serve: listening on http://%s:%d (%s; model '%s'; weights: experts %s, dense %s; chat template %s; KV cache %s, %lld blocks = %lld positions; "
              "--max-num-seqs %lld, --step-tokens %lld, --max-model-len %lld, prefix caching %s%s%s)\n",
              so.host.c_str(), server.port(), access.c_str(), so.model_name.c_str(),
              model->options().expert_weights.name().c_str(), model->options().dense_weights.name().c_str(),
              chat_template ? chat_template->family().c_str() : "none", kv_cache_dtype_name(kv.dtype()),
              static_cast<long long>(kv.num_blocks()), static_cast<long long>(kv.capacity_positions()),
              static_cast<long long>(eo.max_num_seqs), static_cast<long long>(eo.max_step_tokens), static_cast<long long>(eo.max_model_len),
              eo.prefix_caching ? "on" : "off", plan.single() ? "" : ("; " + plan.describe()).c_str(),
              engine.num_pools() > 1 ? "; KV cache, --max-num-seqs and --step-tokens per rank" : "");
  if (so.web) std::printf("moex serve: web page (chat, engine charts) at http://%s:%d/\n", so.host.c_str(), server.port());
  std::fflush(stdout);
  server.run();
  pthread_kill(watcher.native_handle(), SIGTERM);  // run() also ends on a failed listen: release the watcher
  watcher.join();
  std::printf("moex serve: stopped\n");
}

void setup_serve(CLI::App& app) {
  auto flags = std::make_shared<ServeFlags>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching");
  flags->model.add_to(cmd);
  cmd->add_option("--host", flags->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", flags->port, "TCP port (0: any free port, printed at start-up)")->capture_default_str();
  cmd->add_option("--max-num-seqs", flags->max_num_seqs, "Sequences in one step")->capture_default_str();
  // The step's token budget is the model flags' --step-tokens; --max-batch-tokens, its earlier name here, stays.
  cmd->add_option("--max-batch-tokens", flags->model.max_step_tokens, "Another name of --step-tokens");
  cmd->add_option("--max-waiting", flags->max_waiting, "Requests queued beyond the running ones; more get HTTP 429")
      ->capture_default_str();
  cmd->add_option("--kv-cache-gb", flags->kv_cache_gb,
                  "KV cache size in GB (decimal); 0: --max-num-seqs x --max-model-len positions")
      ->capture_default_str();
  cmd->add_option("--max-model-len", flags->max_model_len, "Prompt + max_tokens of a request (0: --max-seq-len)")
      ->capture_default_str();
  cmd->add_option("--api-key", flags->api_key,
                  "Require 'Authorization: Bearer KEY' on every path but /health (and /metrics, see below)")
      ->each([flags](const std::string&) { flags->api_key_given = true; });
  cmd->add_flag("--metrics-require-key", flags->metrics_require_key, "/metrics needs the API key too");
  cmd->add_option("--served-model-name", flags->served_model_name, "The model's name in the API (default: the folder's or the .gguf file's name)");
  cmd->add_option("--chat-template", flags->chat_template,
                  "Jinja chat template file (default: tokenizer_config.json's chat_template)");
  cmd->add_flag("--no-prefix-caching", flags->no_prefix_caching, "Do not reuse the KV blocks of shared prefixes");
  cmd->add_flag("--log-steps", flags->log_steps,
                "One stderr line per engine step: prefill or decode, its rows, forward and other milliseconds");
  cmd->add_flag("--no-web", flags->no_web, "No web page at / (chat and engine charts; it is open without the API key)");
  cmd->add_option("--http-threads", flags->http_threads, "HTTP worker threads (0: max-num-seqs + max-waiting + 8, <= 512)")
      ->capture_default_str();
  cmd->callback([flags] { run_serve(*flags); });
}
MOEX_REGISTER_COMMAND(setup_serve);

}  // namespace
}  // namespace moex::tools

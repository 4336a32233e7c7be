// The HTTP face of the engine (cpp-httplib): the OpenAI endpoints, /health, /metrics, /v1/engine/stats and
// the web page at / (serve/web/index.html, compiled in). Each request runs
// on a thread of the server's pool: it parses and checks the body, submits to the Engine and writes the
// request's tokens as they come (SSE when streaming). A client that goes away (mid-stream, or while a
// non-streamed request waits) is cancelled.
#pragma once
#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "moex/text/chat_template.h"
#include "moex/text/tokenizer.h"
#include "moex/serve/engine.h"

namespace httplib {
class Server;
}

namespace moex::serve {

// The page (cmake/embed_file.cmake writes them from serve/web/index.html at build time).
extern const char kWebPage[];
extern const std::size_t kWebPage_size;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;             // 0: any free port (port() tells which)
  std::string api_key;         // non-empty: every path but /, /health and /metrics needs "Authorization: Bearer <key>"
  bool metrics_require_key = false;  // /metrics too
  bool web = true;             // GET / serves the page (static, so open: it asks for the key); false: 404
  std::string model_name;      // what /v1/models lists and requests may name
  int http_threads = 64;
  const ChatTemplate* chat_template = nullptr;  // the model's; null: chat requests get a 400
};

class HttpServer {
 public:
  HttpServer(Engine& engine, const Tokenizer& tokenizer, const ServerOptions& options);
  ~HttpServer();
  // Binds (Error(kInvalidInput) when the address cannot be bound); then port() is the bound port.
  void bind();
  int port() const { return port_; }
  // Serves until stop() (from another thread or a signal handler's watcher; a stop() before run() makes
  // run() return at once).
  void run();
  void stop();

 private:
  void routes();
  Engine& engine_;
  const Tokenizer& tokenizer_;
  ServerOptions options_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  int64_t created_;  // unix time of start-up (the model's "created")
  int64_t longest_token_bytes_;  // openai.h: prompts longer in bytes than the context can hold are refused
  std::atomic<bool> run_started_{false}, run_returned_{false}, stop_requested_{false};
};

}  // namespace moex::serve

#include "moex/serve/http_server.h"

#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <filesystem>
#include <thread>

#include "moex/base/error.h"
#include "moex/text/stop_strings.h"
#include "moex/serve/http_connections.h"
#include "moex/serve/openai.h"

namespace moex::serve {

using nlohmann::json;

namespace {

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e).dump(), "application/json");
}

ApiError api_error(int status, const std::string& message, const std::string& type = "invalid_request_error") {
  ApiError e;
  e.status = status;
  e.message = message;
  e.type = type;
  return e;
}

// The text of `token` after `before` (a few ids of context, so SentencePiece keeps its leading space).
std::string token_text(const Tokenizer& tokenizer, std::vector<int> before, int token) {
  const size_t head = tokenizer.decode(before).size();
  before.push_back(token);
  const std::string text = tokenizer.decode(before);
  return text.size() > head ? text.substr(head) : std::string();
}

// One request's answer in the making: the tokens it has, the text so far (text/stop_strings: the
// incremental detokenizer and the stop strings), its logprobs not yet sent.
struct Completion {
  Completion(const Tokenizer& tokenizer, ApiRequest request, std::shared_ptr<RequestStream> stream, std::string id,
             int64_t created, std::string model)
      : tokenizer(tokenizer),
        request(std::move(request)),
        stream(std::move(stream)),
        text(tokenizer, std::vector<int>(this->request.generation.prompt.begin(), this->request.generation.prompt.end()),
             this->request.stop),
        id(std::move(id)),
        created(created),
        model(std::move(model)) {
    const std::vector<int32_t>& p = this->request.generation.prompt;
    recent.assign(p.end() - static_cast<std::ptrdiff_t>(std::min<size_t>(p.size(), kContext)), p.end());
  }
  static constexpr size_t kContext = 4;  // ids before a token that its logprobs text is decoded after
  const Tokenizer& tokenizer;
  ApiRequest request;
  std::shared_ptr<RequestStream> stream;
  TextStream text;
  std::string id;
  int64_t created;
  std::string model;
  bool started = false;  // stream: the first chunk (chat: the role) is out
  bool done = false;     // the final event is out (or the client is gone)
  int64_t completion_tokens = 0;  // tokens taken (up to the one that completed a stop string)
  std::string finish_reason;
  std::string error;
  // logprobs of the tokens taken and not yet sent, with each token's text and its alternatives'.
  std::vector<int> recent;
  std::vector<SampledToken> logprobs;
  std::vector<std::string> token_texts;
  std::vector<std::vector<std::string>> top_texts;
  std::vector<int64_t> offsets;
  int64_t offset = 0;

  // Waits for the engine; returns the new final text. Sets done / finish_reason / error at the end.
  std::string next() {
    RequestStream::Read r = stream->wait(std::chrono::milliseconds(50));
    if (!r.error.empty()) {
      done = true;
      error = r.error;
      return "";
    }
    std::string delta;
    for (size_t i = 0; i < r.tokens.size() && !text.stopped(); ++i) {
      ++completion_tokens;
      if (i < r.logprobs.size()) add_logprobs(r.logprobs[i]);
      delta += text.add(r.tokens[i]).text;
    }
    if (text.stopped()) {
      if (!r.finished) stream->cancel();  // the rest is not wanted
      done = true;
      finish_reason = "stop";
    } else if (r.finished) {
      delta += text.finish();
      done = true;
      finish_reason = r.finish_reason == "length" ? "length" : "stop";
    }
    return delta;
  }

  void add_logprobs(const SampledToken& t) {
    logprobs.push_back(t);
    const auto name = [&](int token) {
      return request.tokens_as_ids ? "token_id:" + std::to_string(token) : token_text(tokenizer, recent, token);
    };
    token_texts.push_back(name(t.token));
    std::vector<std::string> alternatives;
    for (const TokenLogprob& e : t.top) alternatives.push_back(name(e.token));
    top_texts.push_back(std::move(alternatives));
    offsets.push_back(offset);
    offset += static_cast<int64_t>(token_texts.back().size());
    recent.push_back(t.token);
    if (recent.size() > kContext) recent.erase(recent.begin());
  }

  // The logprobs object of the tokens taken since the last call (null when the request asked for none).
  json take_logprobs() {
    if (!request.generation.sampler.logprobs) return nullptr;
    json out = request.chat ? chat_logprobs(logprobs, token_texts, top_texts)
                            : completion_logprobs(logprobs, token_texts, offsets, top_texts);
    logprobs.clear();
    token_texts.clear();
    top_texts.clear();
    offsets.clear();
    return out;
  }

  json usage() const { return usage_json(stream->prompt_tokens(), completion_tokens, stream->cached_tokens()); }

  json choice(const std::string& delta, const std::string* reason, bool streaming, json lp = nullptr) const {
    json c = {{"index", 0}, {"logprobs", std::move(lp)}, {"finish_reason", reason ? json(*reason) : json(nullptr)}};
    if (!request.chat) {
      c["text"] = delta;
    } else if (streaming) {
      c["delta"] = reason && delta.empty() ? json::object() : json{{"content", delta}};
    } else {
      c["message"] = {{"role", "assistant"}, {"content", delta}};
    }
    return c;
  }

  json chunk(const std::string& delta, const std::string* reason, json lp = nullptr) const {
    return json{{"id", id},
                {"object", request.chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", json::array({choice(delta, reason, true, std::move(lp))})}};
  }
};

// The first of this process's open descriptors (/proc/self/fd) for which `match(fd)` holds, or -1.
template <class Match>
int find_descriptor(Match match) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (...) {
      continue;
    }
    if (match(fd)) return fd;
  }
  return -1;
}

// Debian's cpp-httplib 0.11 is a compiled library whose listen() asks for a backlog of 5 connections
// (CPPHTTPLIB_LISTEN_BACKLOG, fixed when the library was built): 200 clients connecting at once overflowed it
// (231 TcpExtListenOverflows in one run of serve.openai_client), the kernel dropped their SYNs, and clients
// that did not get in within their connect timeout failed on a loaded machine. listen() again on the bound
// socket (the one of this process listening on `port`) raises the backlog in place.
void widen_listen_backlog(int port) {
  const int fd = find_descriptor([&](int fd) {
    int listening = 0;
    socklen_t len = sizeof(listening);
    sockaddr_storage local{};
    socklen_t ll = sizeof(local);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0)
      return false;
    const int bound = local.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port)
                      : local.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port)
                                                   : -1;
    return bound == port;
  });
  if (fd >= 0) ::listen(fd, SOMAXCONN);
}

std::string sse(const json& j) { return "data: " + j.dump() + "\n\n"; }

// Compares a secret in a time that does not depend on where the strings first differ.
bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(b.size(), 1)]);
  return diff == 0;
}

}  // namespace

HttpServer::HttpServer(Engine& engine, const Tokenizer& tokenizer, const ServerOptions& options)
    : engine_(engine),
      tokenizer_(tokenizer),
      options_(options),
      created_(static_cast<int64_t>(std::time(nullptr))),
      longest_token_bytes_(longest_token_bytes(tokenizer)) {
  ConnectionPolicy policy;
  policy.authorized = [key = options.api_key, expected = "Bearer " + options.api_key,
                       open_metrics = !options.metrics_require_key, web = options.web](const http::RequestHead& head) {
    // Open without the key: /health, and /metrics unless --metrics-require-key (as vLLM), and the web page
    // (as llama.cpp's server): it is the same static bytes for everyone and holds no data; it asks for the key
    // and sends it with every request it makes. The raw path is compared, so an encoded spelling of an open
    // path needs the key too.
    const std::string_view path = head.path();
    if (key.empty() || path == "/health" || (open_metrics && path == "/metrics") || (web && path == "/")) return true;
    const std::string* given = head.find("Authorization");
    return given && constant_time_equal(*given, expected);
  };
  policy.error_json = [](int status, const std::string& message) { return error_body(api_error(status, message)).dump(); };
  policy.http_threads = options.http_threads;
  // Idle keep-alive connections outlive the client's (Node: 4 s), so a client never sends on one the server
  // is closing; the poller holds them, not a worker.
  policy.keep_alive_timeout_sec = 10;
  server_ = make_connection_server(std::move(policy));
  server_->set_payload_max_length(http::kMaxBodyBytes);  // the framing refuses larger bodies first
  server_->set_keep_alive_max_count(1 << 20);
  server_->set_write_timeout(30);
  routes();
}

HttpServer::~HttpServer() = default;

namespace {
// cpp-httplib binds with SO_REUSEPORT, which would let a second server share a port in use (and take half
// of its connections): a plain bind first says whether the address is free.
bool address_is_free(const std::string& host, int port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) return false;
  bool free = false;
  const int fd = socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  if (fd >= 0) {
    const int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));  // TIME_WAIT leftovers do not count
    free = ::bind(fd, found->ai_addr, found->ai_addrlen) == 0;
    close(fd);
  }
  freeaddrinfo(found);
  return free;
}
}  // namespace

void HttpServer::bind() {
  if (options_.port == 0) {
    port_ = server_->bind_to_any_port(options_.host);
    MOEX_CHECK_INPUT(port_ > 0, "cannot listen on ", options_.host, " (any port)");
  } else {
    MOEX_CHECK_INPUT(address_is_free(options_.host, options_.port) && server_->bind_to_port(options_.host, options_.port),
                     "cannot listen on ", options_.host, ":",
                     options_.port, " (in use, or not an address of this machine)");
    port_ = options_.port;
  }
  widen_listen_backlog(port_);
}

// cpp-httplib's stop() does nothing until listen_after_bind() has begun, so a signal in the moment between
// start-up and listening was lost (and the server ran on). run() and stop() each set their flag, then read
// the other's (sequentially consistent, so at least one sees the other): a run() that sees the stop does not
// listen; a stop() that sees the run repeats cpp-httplib's stop() until run() has returned.
void HttpServer::run() {
  run_started_ = true;
  if (!stop_requested_) server_->listen_after_bind();
  run_returned_ = true;
}

void HttpServer::stop() {
  stop_requested_ = true;
  if (!run_started_) return;
  while (!run_returned_) {
    server_->stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void HttpServer::routes() {
  httplib::Server& s = *server_;
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, api_error(500, "internal error: " + what, "internal_server_error"));
  });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string message = res.status == 404   ? "no route " + req.method + " " + req.path
                                : res.status == 413 ? "the request body is too large (8 MB at most)"
                                                    : "HTTP error " + std::to_string(res.status);
    send_error(res, api_error(res.status, message, res.status == 404 ? "NotFoundError" : "invalid_request_error"));
  });

  s.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("{}", "application/json"); });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(engine_.metrics().registry.exposition(), "text/plain; version=0.0.4");
  });
  s.Get("/v1/engine/stats", [this](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(engine_.stats().dump(), "application/json");
  });
  if (options_.web) {
    s.Get("/", [](const httplib::Request&, httplib::Response& res) {
      // The page loads nothing from elsewhere, and the browser is told so: scripts and styles are the page's
      // own inline ones, requests go to this server only.
      res.set_header("Content-Security-Policy",
                     "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
                     "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'");
      res.set_header("X-Content-Type-Options", "nosniff");
      res.set_header("Referrer-Policy", "no-referrer");
      res.set_header("Cache-Control", "no-cache");
      res.set_content(kWebPage, kWebPage_size, "text/html; charset=utf-8");
    });
  }
  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const json model = {{"id", options_.model_name},     {"object", "model"},
                        {"created", created_},           {"owned_by", "moex"},
                        {"root", options_.model_name},   {"max_model_len", engine_.options().max_model_len}};
    res.set_content(json{{"object", "list"}, {"data", json::array({model})}}.dump(), "application/json");
  });

  const auto completions = [this](bool chat) {
    return [this, chat](const httplib::Request& req, httplib::Response& res) {
      ApiRequest request;
      std::shared_ptr<RequestStream> stream;
      try {
        request = parse_request(req.body, chat, tokenizer_, options_.model_name, engine_.options().max_model_len,
                                options_.chat_template, longest_token_bytes_);
        stream = engine_.submit(request.generation);
      } catch (const ApiError& e) {
        return send_error(res, e);
      } catch (const Error& e) {  // the engine's checks (context length, cache, sampling options)
        return send_error(res, api_error(400, e.what()));
      }
      if (!stream)
        return send_error(res, api_error(429, "the server is at capacity (too many requests queued): retry later",
                                         "rate_limit_exceeded"));
      static std::atomic<int64_t> next{1};
      const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next++);
      auto c = std::make_shared<Completion>(tokenizer_, std::move(request), stream, id,
                                            static_cast<int64_t>(std::time(nullptr)), options_.model_name);
      if (!c->request.stream) {
        // Between the 50 ms waits, a client that has gone away cancels its request (at the engine's next step).
        const int fd = connection_socket();
        std::string text;
        while (!c->done) {
          text += c->next();
          if (!c->done && peer_closed(fd)) {
            c->stream->cancel();
            return;  // nobody to answer
          }
        }
        if (!c->error.empty()) return send_error(res, api_error(500, c->error, "internal_server_error"));
        json body = {{"id", c->id},
                     {"object", chat ? "chat.completion" : "text_completion"},
                     {"created", c->created},
                     {"model", c->model},
                     {"choices", json::array({c->choice(text, &c->finish_reason, false, c->take_logprobs())})},
                     {"usage", c->usage()}};
        return res.set_content(body.dump(), "application/json");
      }
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [c](size_t, httplib::DataSink& sink) {
            const auto write = [&](const std::string& data) {
              if (sink.write(data.data(), data.size())) return true;
              c->stream->cancel();  // the client is gone: cancelled at the engine's next step
              c->done = true;
              return false;
            };
            if (!c->started) {
              c->started = true;
              if (c->request.chat) {
                json first = c->chunk("", nullptr);
                first["choices"][0]["delta"] = {{"role", "assistant"}, {"content", ""}};
                if (!write(sse(first))) return false;
              }
            }
            const std::string delta = c->next();
            if (!c->error.empty()) {
              ApiError e = api_error(500, c->error, "internal_server_error");
              write(sse(error_body(e)) + "data: [DONE]\n\n");
              sink.done();
              return true;
            }
            if (!delta.empty() && !write(sse(c->chunk(delta, nullptr, c->take_logprobs())))) return false;
            if (!c->done) {
              if (sink.is_writable && !sink.is_writable()) {
                c->stream->cancel();
                c->done = true;
                return false;
              }
              return true;
            }
            std::string tail = sse(c->chunk("", &c->finish_reason, c->take_logprobs()));
            if (c->request.include_usage) {
              json u = c->chunk("", nullptr);
              u["choices"] = json::array();
              u["usage"] = c->usage();
              tail += sse(u);
            }
            tail += "data: [DONE]\n\n";
            if (!write(tail)) return false;
            sink.done();
            return true;
          },
          [c](bool) { c->stream->cancel(); });  // the connection ended: a no-op for a finished request
    };
  };
  s.Post("/v1/completions", completions(false));
  s.Post("/v1/chat/completions", completions(true));
}

}  // namespace moex::serve

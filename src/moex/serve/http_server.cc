#include "moex/serve/http_server.h"

#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <exception>

#include "moex/base/error.h"
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

// One request's answer in the making: the tokens it has, the text so far, what it has sent.
struct Completion {
  Completion(const Tokenizer& tokenizer, ApiRequest request, std::shared_ptr<RequestStream> stream, int eos,
             std::string id, int64_t created, std::string model)
      : request(std::move(request)),
        stream(std::move(stream)),
        text(tokenizer, this->request.generation.prompt, this->request.stop, eos),
        id(std::move(id)),
        created(created),
        model(std::move(model)) {}
  ApiRequest request;
  std::shared_ptr<RequestStream> stream;
  TextAssembler text;
  std::string id;
  int64_t created;
  std::string model;
  bool started = false;  // stream: the first chunk (chat: the role) is out
  bool done = false;     // the final event is out (or the client is gone)
  std::string finish_reason;
  std::string error;

  // Waits for the engine; returns the new final text. Sets done / finish_reason / error at the end.
  std::string next() {
    RequestStream::Read r = stream->wait(std::chrono::milliseconds(50));
    if (!r.error.empty()) {
      done = true;
      error = r.error;
      return "";
    }
    std::string delta = text.add(r.tokens, r.finished);
    if (text.stopped()) {
      if (!r.finished) stream->cancel();  // the rest is not wanted
      done = true;
      finish_reason = "stop";
    } else if (r.finished) {
      done = true;
      finish_reason = r.finish_reason == "length" ? "length" : "stop";
    }
    return delta;
  }

  json usage() const { return usage_json(stream->prompt_tokens(), text.completion_tokens(), stream->cached_tokens()); }

  json choice(const std::string& delta, const std::string* reason, bool streaming) const {
    json c = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", reason ? json(*reason) : json(nullptr)}};
    if (!request.chat) {
      c["text"] = delta;
    } else if (streaming) {
      c["delta"] = reason && delta.empty() ? json::object() : json{{"content", delta}};
    } else {
      c["message"] = {{"role", "assistant"}, {"content", delta}};
    }
    return c;
  }

  json chunk(const std::string& delta, const std::string* reason) const {
    return json{{"id", id},
                {"object", request.chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", json::array({choice(delta, reason, true)})}};
  }
};

std::string sse(const json& j) { return "data: " + j.dump() + "\n\n"; }

}  // namespace

HttpServer::HttpServer(Engine& engine, const Tokenizer& tokenizer, const ServerOptions& options)
    : engine_(engine),
      tokenizer_(tokenizer),
      options_(options),
      server_(std::make_unique<httplib::Server>()),
      created_(static_cast<int64_t>(std::time(nullptr))) {
  const int threads = options.http_threads;
  server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server_->set_payload_max_length(8 << 20);  // 8 MB: larger bodies get 413
  // Idle keep-alive connections outlive the client's (Node: 4 s), so a client never sends on one the server
  // is closing; each holds a pool thread while open.
  server_->set_keep_alive_timeout(10);
  server_->set_keep_alive_max_count(1 << 20);
  server_->set_read_timeout(30);
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
}

void HttpServer::run() { server_->listen_after_bind(); }
void HttpServer::stop() { server_->stop(); }

void HttpServer::routes() {
  httplib::Server& s = *server_;
  const std::string key = options_.api_key;
  s.set_pre_routing_handler([key](const httplib::Request& req, httplib::Response& res) {
    if (key.empty() || req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + key) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e = api_error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
    send_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  });
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
    res.set_content(engine_.metrics().render(), "text/plain; version=0.0.4");
  });
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
        request = parse_request(req.body, chat, tokenizer_, options_.model_name, engine_.options().max_model_len);
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
      auto c = std::make_shared<Completion>(tokenizer_, std::move(request), stream,
                                            engine_.model().config().eos_token_id, id,
                                            static_cast<int64_t>(std::time(nullptr)), options_.model_name);
      if (!c->request.stream) {
        std::string text;
        while (!c->done) text += c->next();
        if (!c->error.empty()) return send_error(res, api_error(500, c->error, "internal_server_error"));
        json body = {{"id", c->id},
                     {"object", chat ? "chat.completion" : "text_completion"},
                     {"created", c->created},
                     {"model", c->model},
                     {"choices", json::array({c->choice(text, &c->finish_reason, false)})},
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
            if (!delta.empty() && !write(sse(c->chunk(delta, nullptr)))) return false;
            if (!c->done) {
              if (sink.is_writable && !sink.is_writable()) {
                c->stream->cancel();
                c->done = true;
                return false;
              }
              return true;
            }
            std::string tail = sse(c->chunk("", &c->finish_reason));
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

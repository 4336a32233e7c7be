// The server's connections: cpp-httplib parses, routes and answers requests, but MoEX owns the sockets.
// One poller thread (epoll) holds every connection that is between requests: idle on keep-alive, or still
// sending its request's head. A connection goes to a worker of the HTTP pool only once a whole head has
// arrived; the worker checks it (http_framing.h: malformed, unauthorized, too large, all before the body is
// read), reads the body, serves the request through cpp-httplib, and hands the connection back to the poller.
// So a worker is never held by a client that sends nothing (idle keep-alive connections, slow heads), and
// a burst of more connections than workers waits only for requests, not for other clients' idle time.
//
// Why this is hand-written: Debian 12's cpp-httplib 0.11 keeps one worker per open connection, waiting
// out its keep-alive timeout, and drops pipelined requests (http_framing.h lists the rest).
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "moex/serve/http_framing.h"

namespace httplib {
class Server;
}

namespace moex::serve {

struct ConnectionPolicy {
  size_t max_head_bytes = 64 << 10;  // 431 beyond
  uint64_t max_body_bytes = http::kMaxBodyBytes;
  int head_timeout_sec = 30;       // from a head's first byte to its last (408 after)
  int body_timeout_sec = 60;       // for a whole body (408 after); each read also within head_timeout_sec
  int keep_alive_timeout_sec = 10;  // an idle connection is closed after this
  int max_connections = 4096;       // beyond it (or the descriptor limit less 64) a new connection gets a 503
  int http_threads = 64;            // the workers
  std::function<bool(const http::RequestHead&)> authorized;  // false: 401 before the body is read
  std::function<std::string(int status, const std::string& message)> error_json;  // an error's JSON body
};

// A cpp-httplib server whose connections are handled as above (add routes, bind and listen as usual).
std::unique_ptr<httplib::Server> make_connection_server(ConnectionPolicy policy);

// The socket of the connection whose request this thread is serving (-1 outside a request): a handler
// polls it to notice a client that went away.
int connection_socket();

// True when the peer of `fd` has closed (or reset) its connection.
bool peer_closed(int fd);

}  // namespace moex::serve

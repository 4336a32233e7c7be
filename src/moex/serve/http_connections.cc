#include "moex/serve/http_connections.h"

#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace moex::serve {

bool peer_closed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  char byte;
  return recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;  // readable with nothing to read: EOF
}

namespace {

using Clock = std::chrono::steady_clock;

int millis_until(Clock::time_point t) {
  return static_cast<int>(std::clamp<int64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count(), 0, 1 << 30));
}

// The address and port of one end of a socket (numeric), as cpp-httplib's own streams report them.
void socket_address(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if ((peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len)
            : getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len)) != 0 ||
      getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return;
  ip = host;
  port = std::atoi(serv);
}

std::atomic<int> open_connections{0};

// One client connection (non-blocking socket): the bytes read ahead of the request being served (a
// pipelined client's next requests wait there), the request being served as cpp-httplib reads it
// (http::normalized_request), and the socket its responses are written to.
class Connection final : public httplib::Stream {
 public:
  enum class Fill { kData, kClosed, kTimeout };
  Connection(int fd, int write_timeout_ms, const std::atomic<bool>* stopping)
      : fd_(fd), write_timeout_ms_(write_timeout_ms), stopping_(stopping) {
    ++open_connections;
  }
  ~Connection() override {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    --open_connections;
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Waits until `deadline` for bytes and appends what the socket has to the bytes read ahead.
  Fill fill(Clock::time_point deadline) {
    for (;;) {
      if (stopping_->load()) return Fill::kClosed;
      pollfd p{fd_, POLLIN, 0};
      const int ready = poll(&p, 1, std::min(millis_until(deadline), 100));
      if (ready < 0 && errno != EINTR) return Fill::kClosed;
      if (ready > 0) {
        if (read_available(64 << 10) > 0) return Fill::kData;
        if (ended_) return Fill::kClosed;
      } else if (Clock::now() >= deadline) {
        return Fill::kTimeout;
      }
    }
  }
  // Appends what the socket has now (at most `cap` bytes) and returns the count; at the end of the
  // client's bytes (or an error) sets ended(). A client may send a request and then close its side.
  size_t read_available(size_t cap) {
    char buf[16 << 10];
    size_t total = 0;
    while (total < cap) {
      const ssize_t n = recv(fd_, buf, std::min(sizeof(buf), cap - total), 0);
      if (n > 0) {
        inbox_.append(buf, static_cast<size_t>(n));
        total += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        ended_ = true;
        break;
      }
    }
    return total;
  }
  bool ended() const { return ended_; }

  std::string& inbox() { return inbox_; }  // read, not yet framed
  void serve(std::string request) {
    request_ = std::move(request);
    pos_ = 0;
  }
  // Frees the served request, and the read-ahead's memory once a large body has passed through it.
  void served() {
    std::string().swap(request_);
    if (inbox_.capacity() > (1 << 20) && inbox_.size() < (64 << 10)) inbox_.shrink_to_fit();
  }
  bool send_all(const std::string& bytes) {
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = write(bytes.data() + done, bytes.size() - done);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // After an error answer to a client that may still be sending: close our side for writing, then read and
  // drop what comes for a while. Closing with unread bytes would send a reset, and a reset can destroy the
  // answer before the client reads it (nginx's lingering close does the same). Bounded: 2 s in all, 0.5 s idle,
  // and at most `max_bytes` read: past them the socket is left unread until the 2 s are up (the client's sends
  // stall on a full window while it can still read the answer), so a client that keeps sending cannot have the
  // server read for 2 s at the link's speed (GBs on loopback).
  void linger(uint64_t max_bytes) {
    ::shutdown(fd_, SHUT_WR);
    const auto until = Clock::now() + std::chrono::seconds(2);
    char buf[16 << 10];
    uint64_t read = 0;
    while (Clock::now() < until) {
      const int left_ms = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
      if (read > max_bytes) {  // only a reset or a close from the peer ends the wait early
        pollfd p{fd_, POLLRDHUP, 0};
        if (poll(&p, 1, std::max(1, left_ms)) != 0) return;
        continue;
      }
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, std::min(500, std::max(1, left_ms))) <= 0) return;
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return;
      if (n > 0) read += static_cast<uint64_t>(n);
    }
  }

  // The poller's bookkeeping while the connection is between requests.
  Clock::time_point deadline;  // idle: closed then; a head begun: 408 then
  bool head_begun = false;
  size_t scanned = 0;   // bytes of the read-ahead already searched for the head's end
  size_t requests = 0;  // served on this connection

  // httplib::Stream: reads come from the framed request only (past its end: 0, as at a closed socket).
  bool is_readable() const override { return pos_ < request_.size(); }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, request_.size() - pos_);
    std::memcpy(ptr, request_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  bool is_writable() const override {
    pollfd p{fd_, POLLOUT, 0};
    return poll(&p, 1, write_timeout_ms_) > 0 && !(p.revents & (POLLERR | POLLHUP)) && !peer_closed(fd_);
  }
  ssize_t write(const char* ptr, size_t size) override {
    const auto deadline = Clock::now() + std::chrono::milliseconds(write_timeout_ms_);
    for (;;) {
      const ssize_t n = send(fd_, ptr, size, MSG_NOSIGNAL);
      if (n >= 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) return n;
      pollfd p{fd_, POLLOUT, 0};
      if (errno != EINTR && (poll(&p, 1, millis_until(deadline)) <= 0 || (p.revents & (POLLERR | POLLHUP)))) return -1;
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { socket_address(fd_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { socket_address(fd_, false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  int fd_;
  int write_timeout_ms_;
  const std::atomic<bool>* stopping_;
  bool ended_ = false;
  std::string inbox_;
  std::string request_;
  size_t pos_ = 0;
};

using ConnectionPtr = std::shared_ptr<Connection>;  // shared: cpp-httplib's task queue copies its jobs

thread_local const Connection* current_connection = nullptr;

// Drops the empty lines a client may send before a request (RFC 9112 2.2); true when a whole head (or
// more than a head may be) is in the read-ahead.
bool head_ready(Connection& c, size_t max_head_bytes) {
  std::string& in = c.inbox();
  const size_t text = in.find_first_not_of("\r\n");
  if (text == std::string::npos) {
    in.clear();
    c.scanned = 0;
    return false;
  }
  if (text > 0) {
    in.erase(0, text);
    c.scanned = 0;
  }
  if (http::head_end(in, c.scanned) > 0 || in.size() > max_head_bytes) return true;
  c.scanned = in.size();
  return false;
}

// The connections between requests, watched by one thread.
class Poller {
 public:
  Poller(const ConnectionPolicy& policy, std::function<void(ConnectionPtr)> dispatch)
      : policy_(policy), dispatch_(std::move(dispatch)) {
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = wake_;
    epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev);
    thread_ = std::thread([this] { loop(); });
  }
  ~Poller() {
    stop();
    close(epoll_);
    close(wake_);
  }
  const std::atomic<bool>* stopping() const { return &stopped_; }

  // Takes a connection between requests (thread-safe). `fresh`: just accepted, so its first request may
  // take as long as a head; else an idle keep-alive connection. A whole head already read goes straight
  // back to a worker.
  void adopt(ConnectionPtr c, bool fresh) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;  // dropped: closed
    c->head_begun = false;
    c->scanned = 0;
    c->deadline = Clock::now() + std::chrono::seconds(fresh ? policy_.head_timeout_sec : policy_.keep_alive_timeout_sec);
    if (ready(*c)) return dispatch_(std::move(c));
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = c->socket();
    if (epoll_ctl(epoll_, EPOLL_CTL_ADD, c->socket(), &ev) == 0) held_.emplace(c->socket(), std::move(c));
  }

  // Ends the thread and closes every connection it holds (a worker's later adopt() closes its own).
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_, &one, sizeof(one));
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    held_.clear();
  }

 private:
  // Called with mu_ held: a head begun starts its deadline; true when a whole head is there for a worker.
  bool ready(Connection& c) {
    const bool head = head_ready(c, policy_.max_head_bytes);
    if (!c.head_begun && !c.inbox().empty()) {
      c.head_begun = true;
      c.deadline = Clock::now() + std::chrono::seconds(policy_.head_timeout_sec);
    }
    return head;
  }

  void release(int fd) {
    epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    held_.erase(fd);
  }

  void loop() {
    epoll_event events[64];
    for (;;) {
      const int n = epoll_wait(epoll_, events, 64, 100);
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      for (int i = 0; i < n; ++i) {
        const int fd = events[i].data.fd;
        const auto it = held_.find(fd);
        if (it == held_.end()) continue;  // the wake-up, or gone
        ConnectionPtr c = it->second;
        c->read_available(policy_.max_head_bytes + 1);
        if (ready(*c)) {
          release(fd);  // before a worker has it (and may hand it back)
          dispatch_(std::move(c));
        } else if (c->ended()) {
          release(fd);  // the client closed: a half-sent head has nobody to answer
        }
      }
      // Deadlines: an idle connection is closed, a head that is late gets a 408 (best effort: a short
      // write to a non-blocking socket) and is closed.
      const auto now = Clock::now();
      for (auto it = held_.begin(); it != held_.end();) {
        if (now < it->second->deadline) {
          ++it;
          continue;
        }
        if (it->second->head_begun) {
          const std::string late = http::error_response(408, policy_.error_json(408, "the request's head took too long"));
          [[maybe_unused]] ssize_t w = send(it->first, late.data(), late.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        epoll_ctl(epoll_, EPOLL_CTL_DEL, it->first, nullptr);
        it = held_.erase(it);
      }
    }
  }

  const ConnectionPolicy& policy_;
  std::function<void(ConnectionPtr)> dispatch_;
  int epoll_ = -1, wake_ = -1;
  std::mutex mu_;
  std::atomic<bool> stopped_{false};
  std::unordered_map<int, ConnectionPtr> held_;
  std::thread thread_;
};

class ConnectionServer;

// cpp-httplib's worker pool, with the poller beside it: made when the server starts listening, and on
// shutdown the poller stops first, so it never hands work to a pool that is going away.
class PoolWithPoller final : public httplib::ThreadPool {
 public:
  PoolWithPoller(ConnectionServer& server, const ConnectionPolicy& policy);
  void shutdown() override {
    poller.stop();
    ThreadPool::shutdown();
  }
  Poller poller;
};

class ConnectionServer final : public httplib::Server {
 public:
  explicit ConnectionServer(ConnectionPolicy policy) : policy_(std::move(policy)) {
    // Past the process's descriptor limit accept() fails and cpp-httplib retries every millisecond, so
    // nobody gets in: refuse with a 503 before that, leaving room for the model's and the engine's files.
    rlimit files{};
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY)
      policy_.max_connections = static_cast<int>(std::min<rlim_t>(policy_.max_connections, std::max<rlim_t>(files.rlim_cur, 128) - 64));
    new_task_queue = [this] {
      pool_ = new PoolWithPoller(*this, policy_);
      return pool_;
    };
  }

  // A connection with a whole head in its read-ahead: served on a worker.
  void dispatch(ConnectionPtr c) {
    pool_->enqueue([this, c] { work(c); });
  }

 private:
  enum class Framed { kServe, kClose };

  // Called by cpp-httplib's accept loop (on a worker) for each new connection: the poller takes it.
  bool process_and_close_socket(socket_t sock) override {
    fcntl(sock, F_SETFL, fcntl(sock, F_GETFL) | O_NONBLOCK);
    // Streamed tokens are small writes a few milliseconds apart: Nagle's algorithm would hold each behind
    // the previous one's acknowledgement (which the client may delay).
    const int one = 1;
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_shared<Connection>(sock, static_cast<int>(write_timeout_sec_ * 1000), pool_->poller.stopping());
    if (open_connections.load() > policy_.max_connections) {
      c->send_all(http::error_response(503, policy_.error_json(503, "too many open connections: retry later")));
      return false;
    }
    pool_->poller.adopt(std::move(c), /*fresh=*/true);
    return true;
  }

  // Serves the connection's requests while whole ones are waiting (pipelining), then hands it back.
  void work(ConnectionPtr c) {
    current_connection = c.get();
    for (;;) {
      if (frame(*c) != Framed::kServe) break;
      ++c->requests;
      bool closed = false;
      const bool last = c->requests >= keep_alive_max_count_;
      const bool ok = process_request(*c, last, closed, nullptr);
      c->served();
      if (!ok || closed || last) break;
      if (head_ready(*c, policy_.max_head_bytes)) continue;
      current_connection = nullptr;
      pool_->poller.adopt(std::move(c), /*fresh=*/false);
      return;
    }
    current_connection = nullptr;
  }

  // Checks the head the read-ahead starts with and reads the body into `c` (kServe), or answers the
  // request with an error (kClose). A head still incomplete (only when it is over the limit, or a
  // pipelined one cut short) is read here within its deadline.
  Framed frame(Connection& c) {
    std::string& in = c.inbox();
    const auto refuse = [&](int status, const std::string& message) {
      // A body up to the limit (and its chunk framing) is read whole, so its sender sees the answer at once.
      if (c.send_all(http::error_response(status, policy_.error_json(status, message))))
        c.linger(policy_.max_body_bytes + (policy_.max_body_bytes >> 4) + (1 << 20));
      return Framed::kClose;
    };
    const auto head_deadline = Clock::now() + std::chrono::seconds(policy_.head_timeout_sec);
    size_t end = 0;
    while ((end = http::head_end(in, c.scanned)) == 0) {
      if (in.size() > policy_.max_head_bytes)
        return refuse(431, "the request's head is over " + std::to_string(policy_.max_head_bytes >> 10) + " KB");
      c.scanned = in.size();
      const Connection::Fill f = c.fill(head_deadline);
      if (f == Connection::Fill::kTimeout) return refuse(408, "the request's head took too long");
      if (f == Connection::Fill::kClosed) return Framed::kClose;
    }
    c.scanned = 0;
    http::Rejection why;
    const http::RequestHead head = http::parse_head(std::string_view(in).substr(0, end), &why);
    if (why) return refuse(why.status, why.message);
    // Authentication before the body is read: a client without the key sends no more than its head.
    if (!policy_.authorized(head))
      return refuse(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
    const http::BodyFraming framing = http::body_framing(head, policy_.max_body_bytes, &why);
    if (why) return refuse(why.status, why.message);
    in.erase(0, end);
    if (const std::string* expect = head.find("Expect")) {
      if (!http::iequals(*expect, "100-continue")) return refuse(417, "Expect: only 100-continue is understood");
      if (framing.kind != http::BodyFraming::kNone && in.empty() && !c.send_all("HTTP/1.1 100 Continue\r\n\r\n"))
        return Framed::kClose;
    }
    // The body: within body_timeout_sec, each read within head_timeout_sec.
    const auto body_deadline = Clock::now() + std::chrono::seconds(policy_.body_timeout_sec);
    bool late = false;
    const auto more = [&] {
      const auto deadline = std::min(body_deadline, Clock::now() + std::chrono::seconds(policy_.head_timeout_sec));
      const Connection::Fill f = c.fill(deadline);
      late = f == Connection::Fill::kTimeout;
      return f == Connection::Fill::kData;
    };
    std::string body;
    if (framing.kind == http::BodyFraming::kLength) {
      while (in.size() < framing.length)
        if (!more()) return late ? refuse(408, "the request body did not arrive in time") : Framed::kClose;
      c.serve(http::normalized_request(head, std::string_view(in).substr(0, framing.length)));
      in.erase(0, framing.length);
      return Framed::kServe;
    }
    if (framing.kind == http::BodyFraming::kChunked) {
      http::ChunkedDecoder decoder(policy_.max_body_bytes);
      for (;;) {
        in.erase(0, decoder.feed(in, &body));
        if (decoder.error()) return refuse(decoder.error().status, decoder.error().message);
        if (decoder.done()) break;
        if (!more()) return late ? refuse(408, "the request body did not arrive in time") : Framed::kClose;
      }
    }
    c.serve(http::normalized_request(head, body));
    return Framed::kServe;
  }

  ConnectionPolicy policy_;
  PoolWithPoller* pool_ = nullptr;  // owned by cpp-httplib while it listens
};

PoolWithPoller::PoolWithPoller(ConnectionServer& server, const ConnectionPolicy& policy)
    : ThreadPool(static_cast<size_t>(policy.http_threads)),
      poller(policy, [&server](ConnectionPtr c) { server.dispatch(std::move(c)); }) {}

}  // namespace

std::unique_ptr<httplib::Server> make_connection_server(ConnectionPolicy policy) {
  return std::make_unique<ConnectionServer>(std::move(policy));
}

int connection_socket() { return current_connection ? current_connection->socket() : -1; }

}  // namespace moex::serve

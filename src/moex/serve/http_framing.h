// HTTP/1.1 request framing in front of cpp-httplib: where one request ends and the next begins, what its
// body is, and whether it may be read at all. The server (http_server.cc) reads each request's head and body
// off the connection itself with these functions and hands cpp-httplib the request rewritten with a plain
// Content-Length body; cpp-httplib then parses, routes and answers it.
//
// Why not cpp-httplib's own reading: Debian 12's 0.11 (a) builds a new read buffer for every request of a
// kept-alive connection, so the bytes of pipelined requests already read are lost (and the connection waits
// out its keep-alive timeout); (b) reads a chunked body with no size limit; (c) reads a body before any
// handler can look at the request, so an unauthenticated client could send gigabytes; (d) takes
// Content-Length through strtoull, so "-5" is 2^64-5 and it waits for that many bytes. No other HTTP library
// in Debian fits in front of it, and the framing rules (RFC 9112 sections 6-7) are short.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moex::serve::http {

inline constexpr uint64_t kMaxBodyBytes = 8 << 20;  // a request body's limit (413 beyond it)

bool iequals(std::string_view a, std::string_view b);  // ASCII case-insensitive

// An HTTP error the framing answers itself (the connection is then closed).
struct Rejection {
  int status = 0;  // 0: no rejection
  std::string message;
  explicit operator bool() const { return status != 0; }
};

// A request line and its header fields, as sent.
struct RequestHead {
  std::string method, target, version;
  std::vector<std::pair<std::string, std::string>> fields;  // names as sent, values trimmed
  // The value of field `name` (case-insensitive), or null. A field sent twice: the first.
  const std::string* find(std::string_view name) const;
  int count(std::string_view name) const;
  // The target's path: up to '?' or '#', not percent-decoded.
  std::string_view path() const;
};

// Where the head ends in `bytes`: the offset just past its blank line, or 0 when it is not all there yet.
// A lone LF ends a line too (RFC 9112 2.2 lets a server accept it; cpp-httplib does). Only line ends at or
// after `from` are looked at (the caller's bytes before it had none), so reading a head piece by piece
// costs its length once. `bytes` must not start with an empty line (the caller drops those first).
size_t head_end(std::string_view bytes, size_t from = 0);

// Parses a complete head (up to and including its blank line). Rejects (400) a malformed request line,
// a field without a colon or with white space before it, and control characters.
RequestHead parse_head(std::string_view head, Rejection* rejection);

// How the body is framed (RFC 9112 6.3): chunked, a Content-Length, or none (a request with neither has
// no body).
struct BodyFraming {
  enum Kind { kNone, kLength, kChunked } kind = kNone;
  uint64_t length = 0;  // kLength
};
// 400: a Content-Length that is not a plain decimal (or several that differ), or one beside
// Transfer-Encoding (RFC 9112 6.3: a smuggling risk); 501: a transfer coding other than chunked;
// 413: a Content-Length over `max_body_bytes`.
BodyFraming body_framing(const RequestHead& head, uint64_t max_body_bytes, Rejection* rejection);

// Decodes a chunked body as its bytes arrive (RFC 9112 7.1; extensions ignored, trailers read and dropped).
class ChunkedDecoder {
 public:
  explicit ChunkedDecoder(uint64_t max_body_bytes) : max_body_(max_body_bytes) {}
  // Takes what it can of `in` (all of it, unless the body ends inside it), appending the payload to
  // `body`; returns how many bytes it took. After an error (400 malformed, 413 over the limit) it takes none.
  size_t feed(std::string_view in, std::string* body);
  bool done() const { return state_ == kDone; }
  const Rejection& error() const { return error_; }

 private:
  enum State { kSize, kData, kDataEnd, kTrailer, kDone, kFailed } state_ = kSize;
  bool fail(int status, std::string message);
  uint64_t max_body_;
  static constexpr uint64_t kMaxFramingBytes = 1 << 20;
  uint64_t remaining_ = 0;  // of the current chunk
  uint64_t framing_bytes_ = 0;  // taken outside chunk data
  std::string line_;        // the size or trailer line so far
  Rejection error_;
};

// The request as cpp-httplib is given it: the request line, every field but Content-Length,
// Transfer-Encoding and Expect, then "Content-Length: <body size>" and the body.
std::string normalized_request(const RequestHead& head, std::string_view body);

// A complete response with a JSON body and "Connection: close" (the framing's own answers).
std::string error_response(int status, const std::string& json_body);

}  // namespace moex::serve::http

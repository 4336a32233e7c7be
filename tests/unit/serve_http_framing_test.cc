// serve/http_framing: RFC 9112's request framing, as the server reads requests before cpp-httplib sees them.
#include "moex/serve/http_framing.h"

#include <gtest/gtest.h>

namespace moex::serve::http {
namespace {

RequestHead parse_ok(const std::string& text) {
  Rejection why;
  RequestHead head = parse_head(text, &why);
  EXPECT_FALSE(why) << why.message;
  return head;
}

int rejected(const std::string& text) {
  Rejection why;
  parse_head(text, &why);
  return why.status;
}

TEST(HttpFraming, HeadEndsAtTheFirstBlankLine) {
  const std::string two = "GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\n\r\n";
  EXPECT_EQ(head_end(two), two.find("GET /b"));
  const std::string bare = "GET / HTTP/1.1\nHost: x\n\nrest";
  EXPECT_EQ(head_end(bare), bare.find("rest"));
  EXPECT_EQ(head_end("GET / HTTP/1.1\r\nHost: x\r\n"), 0u);
  // `from`: the length of a first read that held no blank line; the rest of it is found wherever the read ended.
  const std::string head = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  for (size_t from = 0; from < head.size(); ++from) EXPECT_EQ(head_end(head, from), head.size()) << from;
}

TEST(HttpFraming, ParsesTheRequestLineAndFields) {
  const RequestHead h = parse_ok("POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nauthorization:  Bearer k \r\n\r\n");
  EXPECT_EQ(h.method, "POST");
  EXPECT_EQ(h.target, "/v1/completions?x=1");
  EXPECT_EQ(h.path(), "/v1/completions");
  ASSERT_NE(h.find("Authorization"), nullptr);
  EXPECT_EQ(*h.find("AUTHORIZATION"), "Bearer k");
  EXPECT_EQ(h.find("Content-Length"), nullptr);
  EXPECT_EQ(parse_ok("\r\nGET / HTTP/1.0\r\n\r\n").version, "HTTP/1.0");  // an empty line before it is allowed
}

TEST(HttpFraming, RefusesMalformedHeads) {
  EXPECT_EQ(rejected("GET /\r\n\r\n"), 400);
  EXPECT_EQ(rejected("GET / HTTP/2.0\r\n\r\n"), 505);
  EXPECT_EQ(rejected("G(T / HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(rejected("GET /a b HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(rejected("GET / HTTP/1.1\r\nHost x\r\n\r\n"), 400);
  EXPECT_EQ(rejected("GET / HTTP/1.1\r\nHost : x\r\n\r\n"), 400);          // white space before the colon
  EXPECT_EQ(rejected("GET / HTTP/1.1\r\nA: b\r\n  folded\r\n\r\n"), 400);  // obsolete line folding
  EXPECT_EQ(rejected(std::string("GET / HTTP/1.1\r\nA: b\0c\r\n\r\n", 27)), 400);
}

BodyFraming framing_of(const std::string& fields, int* status, uint64_t limit = 100) {
  Rejection why;
  const BodyFraming f = body_framing(parse_ok("POST / HTTP/1.1\r\n" + fields + "\r\n"), limit, &why);
  *status = why.status;
  return f;
}

TEST(HttpFraming, ContentLengthIsAPlainDecimalWithinTheLimit) {
  int status = 0;
  BodyFraming f = framing_of("Content-Length: 42\r\n", &status);
  EXPECT_EQ(status, 0);
  EXPECT_EQ(f.kind, BodyFraming::kLength);
  EXPECT_EQ(f.length, 42u);
  EXPECT_EQ(framing_of("", &status).kind, BodyFraming::kNone);  // neither field: no body
  EXPECT_EQ(framing_of("Content-Length: 0\r\n", &status).kind, BodyFraming::kNone);
  // The fields after "POST / HTTP/1.1", and the status they get (limit: 100 bytes).
  const std::pair<const char*, int> cases[] = {
      {"Content-Length: 7\r\nContent-Length: 7\r\n", 0},
      {"Content-Length: -5\r\n", 400},
      {"Content-Length: +5\r\n", 400},
      {"Content-Length: 5 5\r\n", 400},
      {"Content-Length: 0x10\r\n", 400},
      {"Content-Length: \r\n", 400},
      {"Content-Length: 18446744073709551617\r\n", 400},  // 2^64 + 1
      {"Content-Length: 99999999999999999999999\r\n", 400},
      {"Content-Length: 7\r\nContent-Length: 8\r\n", 400},
      {"Content-Length: 101\r\n", 413},
      {"Content-Length: 18446744073709551615\r\n", 413},
  };
  for (const auto& [fields, want] : cases) {
    framing_of(fields, &status);
    EXPECT_EQ(status, want) << fields;
  }
}

TEST(HttpFraming, TransferEncodingIsChunkedAloneAndNeverBesideContentLength) {
  int status = 0;
  EXPECT_EQ(framing_of("Transfer-Encoding: Chunked\r\n", &status).kind, BodyFraming::kChunked);
  EXPECT_EQ(status, 0);
  framing_of("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", &status);
  EXPECT_EQ(status, 400);
  framing_of("Transfer-Encoding: gzip, chunked\r\n", &status);
  EXPECT_EQ(status, 501);
}

// Feeds `wire` in pieces of `step` bytes; returns the body and sets `taken` to the bytes consumed.
std::string decode(const std::string& wire, size_t step, uint64_t limit, size_t* taken, Rejection* error) {
  ChunkedDecoder d(limit);
  std::string body;
  *taken = 0;
  while (*taken < wire.size() && !d.done() && !d.error()) {
    const size_t n = std::min(step, wire.size() - *taken);
    const size_t used = d.feed(std::string_view(wire).substr(*taken, n), &body);
    *taken += used;
    if (used < n) break;
  }
  *error = d.error();
  EXPECT_TRUE(d.done() || d.error());
  return body;
}

TEST(HttpFraming, ChunkedBodiesDecodeInAnyPiecesAndStopAtTheirEnd) {
  const std::string wire = "4\r\nWiki\r\n5;name=value\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nExpires: never\r\n\r\n";
  const std::string next = "GET / HTTP/1.1\r\n\r\n";
  for (size_t step : {1, 2, 3, 7, 1000}) {
    size_t taken = 0;
    Rejection error;
    EXPECT_EQ(decode(wire + next, step, 100, &taken, &error), "Wikipedia in\r\n\r\nchunks.") << step;
    EXPECT_FALSE(error) << error.message;
    EXPECT_EQ(taken, wire.size()) << "the next request's bytes are not the body's";
  }
}

TEST(HttpFraming, ChunkedBodiesOverTheLimitOrMalformedAreRefused) {
  size_t taken = 0;
  Rejection error;
  decode("40\r\n" + std::string(64, 'x') + "\r\n40\r\n" + std::string(64, 'x') + "\r\n0\r\n\r\n", 5, 100, &taken, &error);
  EXPECT_EQ(error.status, 413);
  decode("FFFFFFFFFFFFFFFF\r\n", 100, 100, &taken, &error);
  EXPECT_EQ(error.status, 413);
  for (const std::string& bad : {std::string("z\r\n"), std::string("-1\r\n"), std::string("3\r\nabcd\r\n0\r\n\r\n"),
                                 std::string("\r\n"), std::string(5000, '1')}) {
    decode(bad, 3, 100, &taken, &error);
    EXPECT_EQ(error.status, 400) << bad.substr(0, 20);
  }
  // One-byte chunks with long extensions: the framing's own bytes are bounded (1 MB).
  std::string slow;
  for (int i = 0; i < 400; ++i) slow += "1;" + std::string(4000, 'e') + "\r\nx\r\n";
  decode(slow, 1 << 16, 1 << 20, &taken, &error);
  EXPECT_EQ(error.status, 413);
}

TEST(HttpFraming, NormalizedRequestHasAContentLengthBodyOnly) {
  const RequestHead h = parse_ok("POST /p HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n");
  EXPECT_EQ(normalized_request(h, "hello"), "POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello");
  const std::string r = error_response(413, "{}");
  EXPECT_EQ(r.rfind("HTTP/1.1 413 Payload Too Large\r\n", 0), 0u);
  EXPECT_NE(r.find("\r\nConnection: close\r\n"), std::string::npos);
  EXPECT_NE(r.find("\r\nContent-Length: 2\r\n"), std::string::npos);
  EXPECT_EQ(r.substr(r.size() - 6), "\r\n\r\n{}");
}

}  // namespace
}  // namespace moex::serve::http

#include "moex/serve/http_framing.h"

#include <algorithm>
#include <cctype>

namespace moex::serve::http {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(x) == std::tolower(y); });
}

namespace {

// RFC 9110 5.6.2: the characters of a token (method and field names).
bool is_tchar(unsigned char c) {
  return std::isalnum(c) || std::string_view("!#$%&'*+-.^_`|~").find(static_cast<char>(c)) != std::string_view::npos;
}

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return is_tchar(static_cast<unsigned char>(c)); });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// One line of `text` from `pos` (without its LF and an optional CR before it); pos moves past the LF.
std::string_view next_line(std::string_view text, size_t& pos) {
  const size_t lf = text.find('\n', pos);
  const size_t end = lf == std::string_view::npos ? text.size() : lf;
  std::string_view line = text.substr(pos, end - pos);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  pos = lf == std::string_view::npos ? text.size() : lf + 1;
  return line;
}

// A plain decimal or hexadecimal number with no sign, white space or overflow; false otherwise.
bool parse_unsigned(std::string_view s, int base, uint64_t* value) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (base == 16 && c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (base == 16 && c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    if (v > (UINT64_MAX - static_cast<uint64_t>(d)) / static_cast<uint64_t>(base)) return false;
    v = v * static_cast<uint64_t>(base) + static_cast<uint64_t>(d);
  }
  *value = v;
  return true;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 501: return "Not Implemented";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
  }
}

}  // namespace

const std::string* RequestHead::find(std::string_view name) const {
  for (const auto& [key, value] : fields)
    if (iequals(key, name)) return &value;
  return nullptr;
}

int RequestHead::count(std::string_view name) const {
  return static_cast<int>(std::count_if(fields.begin(), fields.end(), [&](const auto& f) { return iequals(f.first, name); }));
}

std::string_view RequestHead::path() const {
  const std::string_view t = target;
  return t.substr(0, std::min(t.find('?'), t.find('#')));
}

size_t head_end(std::string_view bytes, size_t from) {
  // The blank line: LF LF or LF CR LF (an LF at `from - 2` can still start one).
  for (size_t lf = bytes.find('\n', from > 2 ? from - 2 : 0); lf != std::string_view::npos; lf = bytes.find('\n', lf + 1)) {
    if (lf + 1 < bytes.size() && bytes[lf + 1] == '\n') return lf + 2;
    if (lf + 2 < bytes.size() && bytes[lf + 1] == '\r' && bytes[lf + 2] == '\n') return lf + 3;
  }
  return 0;
}

RequestHead parse_head(std::string_view head, Rejection* rejection) {
  RequestHead h;
  const auto reject = [&](int status, std::string message) {
    *rejection = Rejection{status, std::move(message)};
    return RequestHead{};
  };
  size_t pos = 0;
  while (pos < head.size() && (head[pos] == '\r' || head[pos] == '\n')) ++pos;
  const std::string_view line = next_line(head, pos);
  const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string_view::npos || sp1 == sp2) return reject(400, "malformed request line");
  h.method = std::string(line.substr(0, sp1));
  h.target = std::string(line.substr(sp1 + 1, sp2 - sp1 - 1));
  h.version = std::string(line.substr(sp2 + 1));
  if (!is_token(h.method)) return reject(400, "malformed request line: bad method");
  if (h.target.empty() || std::any_of(h.target.begin(), h.target.end(), [](char c) {
        return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f;
      }))
    return reject(400, "malformed request line: bad target");
  if (h.version != "HTTP/1.1" && h.version != "HTTP/1.0") {
    if (h.version.rfind("HTTP/", 0) == 0) return reject(505, "only HTTP/1.0 and HTTP/1.1 are served");
    return reject(400, "malformed request line: bad version");
  }
  while (pos < head.size()) {
    const std::string_view field = next_line(head, pos);
    if (field.empty()) break;  // the blank line
    if (field.front() == ' ' || field.front() == '\t')
      return reject(400, "obsolete line folding in a header field");
    const size_t colon = field.find(':');
    if (colon == std::string_view::npos) return reject(400, "a header field without ':'");
    const std::string_view name = field.substr(0, colon), value = trim(field.substr(colon + 1));
    if (!is_token(name)) return reject(400, "a malformed header field name");
    if (std::any_of(value.begin(), value.end(), [](char c) {
          const auto u = static_cast<unsigned char>(c);
          return (u < 0x20 && c != '\t') || u == 0x7f;
        }))
      return reject(400, "a control character in header field '" + std::string(name) + "'");
    h.fields.emplace_back(std::string(name), std::string(value));
  }
  return h;
}

BodyFraming body_framing(const RequestHead& head, uint64_t max_body_bytes, Rejection* rejection) {
  BodyFraming framing;
  const std::string* te = head.find("Transfer-Encoding");
  const int lengths = head.count("Content-Length");
  if (te) {
    if (lengths > 0) {
      *rejection = {400, "both Transfer-Encoding and Content-Length"};
      return framing;
    }
    if (head.count("Transfer-Encoding") > 1 || !iequals(*te, "chunked")) {
      *rejection = {501, "Transfer-Encoding '" + *te + "' is not supported (only chunked)"};
      return framing;
    }
    framing.kind = BodyFraming::kChunked;
    return framing;
  }
  if (lengths == 0) return framing;
  uint64_t length = 0;
  bool first = true;
  for (const auto& [key, value] : head.fields) {
    if (!iequals(key, "Content-Length")) continue;
    uint64_t v = 0;
    if (!parse_unsigned(value, 10, &v) || (!first && v != length)) {
      *rejection = {400, "invalid Content-Length '" + value + "'"};
      return framing;
    }
    length = v;
    first = false;
  }
  if (length > max_body_bytes) {
    *rejection = {413, "the request body is too large (" + std::to_string(max_body_bytes >> 20) + " MB at most)"};
    return framing;
  }
  framing.kind = length > 0 ? BodyFraming::kLength : BodyFraming::kNone;
  framing.length = length;
  return framing;
}

bool ChunkedDecoder::fail(int status, std::string message) {
  state_ = kFailed;
  error_ = Rejection{status, std::move(message)};
  return false;
}

size_t ChunkedDecoder::feed(std::string_view in, std::string* body) {
  constexpr size_t kMaxLine = 4096;  // a chunk-size line with its extensions, or one trailer field
  size_t pos = 0;
  while (pos < in.size() && state_ != kDone && state_ != kFailed) {
    if (state_ == kData) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(remaining_, in.size() - pos));
      body->append(in.data() + pos, n);
      pos += n;
      remaining_ -= n;
      if (remaining_ == 0) state_ = kDataEnd;
      continue;
    }
    // The other states read a line. Their bytes count against a budget too: one-byte chunks with 4 KB of
    // extensions each would otherwise make a body of a few MB cost gigabytes of reading.
    const size_t lf = in.find('\n', pos);
    const size_t take = (lf == std::string_view::npos ? in.size() : lf + 1) - pos;
    if (line_.size() + take > kMaxLine) {
      fail(400, "a chunked body's size or trailer line is too long");
      break;
    }
    framing_bytes_ += take;
    if (framing_bytes_ > kMaxFramingBytes) {
      fail(413, "a chunked body's framing (chunk sizes, extensions, trailers) is over 1 MB");
      break;
    }
    line_.append(in.data() + pos, take);
    pos += take;
    if (lf == std::string_view::npos) break;  // the line goes on in the next bytes
    std::string_view line = line_;
    line.remove_suffix(1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (state_ == kSize) {
      std::string_view size = trim(line.substr(0, line.find(';')));
      uint64_t n = 0;
      if (!parse_unsigned(size, 16, &n) || size.size() > 16) {
        fail(400, "malformed chunk size in a chunked body");
        break;
      }
      if (n > max_body_ - std::min<uint64_t>(max_body_, body->size())) {
        fail(413, "the request body is too large (" + std::to_string(max_body_ >> 20) + " MB at most)");
        break;
      }
      remaining_ = n;
      state_ = n == 0 ? kTrailer : kData;
    } else if (state_ == kDataEnd) {
      if (!line.empty()) {
        fail(400, "a chunk's data is longer than its size");
        break;
      }
      state_ = kSize;
    } else if (line.empty()) {  // kTrailer: its blank line ends the body
      state_ = kDone;
    }
    line_.clear();
  }
  return pos;
}

std::string normalized_request(const RequestHead& head, std::string_view body) {
  std::string out = head.method + " " + head.target + " " + head.version + "\r\n";
  for (const auto& [key, value] : head.fields) {
    if (iequals(key, "Content-Length") || iequals(key, "Transfer-Encoding") || iequals(key, "Expect")) continue;
    out += key + ": " + value + "\r\n";
  }
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
  out.append(body);
  return out;
}

std::string error_response(int status, const std::string& json_body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(json_body.size()) +
         "\r\nConnection: close\r\n\r\n" + json_body;
}

}  // namespace moex::serve::http

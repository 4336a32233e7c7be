#include "moex/text/stop_strings.h"

#include <algorithm>

#include "moex/base/error.h"
#include "moex/text/tokenizer.h"

namespace moex {
namespace {

constexpr size_t kContextTokens = 5;  // ids of context before the newest: enough for any piece's spacing
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD, what a decode gives for broken bytes

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

bool is_valid_utf8(std::string_view text) {
  size_t i = 0;
  const auto byte = [&](size_t j) { return static_cast<unsigned char>(text[j]); };
  while (i < text.size()) {
    const unsigned c = byte(i);
    size_t len;
    unsigned min, code;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, min = 0x80, code = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, min = 0x800, code = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, min = 0x10000, code = c & 0x07;
    } else {
      return false;
    }
    if (i + len > text.size()) return false;
    for (size_t j = 1; j < len; ++j) {
      if ((byte(i + j) & 0xC0) != 0x80) return false;
      code = (code << 6) | (byte(i + j) & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, const std::vector<int>& context)
    : tokenizer_(tokenizer) {
  const size_t keep = std::min(context.size(), kContextTokens);
  for (auto it = context.end() - static_cast<std::ptrdiff_t>(keep); it != context.end(); ++it)
    if (*it >= 0 && *it < tokenizer_.vocab_size()) ids_.push_back(*it);
  prefix_ = 0;
  read_ = ids_.size();
  prefix_text_ = decode(prefix_, read_);
}

std::string IncrementalDetokenizer::decode(size_t begin, size_t end) const {
  return tokenizer_.decode(std::vector<int>(ids_.begin() + static_cast<std::ptrdiff_t>(begin),
                                            ids_.begin() + static_cast<std::ptrdiff_t>(end)));
}

std::string IncrementalDetokenizer::add(int token) {
  // A model's vocabulary may be padded past the tokenizer's (config vocab_size >= pieces): such an id has
  // no text. It is left out of the window, so it can never make a decode fail.
  if (token < 0 || token >= tokenizer_.vocab_size()) return {};
  ids_.push_back(token);
  std::string text = decode(prefix_, ids_.size());
  // Held while the newest bytes do not yet form a code point (the decode shows them as U+FFFD), or
  // while the window decodes to no more than before (a piece that is only part of a character).
  if (text.size() <= prefix_text_.size() || ends_with(text, kReplacement)) return {};
  // The earlier window's text is a prefix of this one's (same ids, same leading-space rule); if a
  // normalisation ever breaks that, the longest common prefix is what was already sent.
  size_t common = 0;
  while (common < prefix_text_.size() && text[common] == prefix_text_[common]) ++common;
  std::string delta = text.substr(common);
  // Slide: the new window starts a few ids back from the newest, its text is what we just decoded up to read_.
  read_ = ids_.size();
  prefix_ = read_ > kContextTokens ? read_ - kContextTokens : 0;
  prefix_text_ = decode(prefix_, read_);
  return delta;
}

std::string IncrementalDetokenizer::flush() {
  if (read_ == ids_.size()) return {};
  std::string text = decode(prefix_, ids_.size());
  read_ = ids_.size();
  size_t common = 0;
  while (common < prefix_text_.size() && common < text.size() && text[common] == prefix_text_[common]) ++common;
  std::string delta = text.substr(common);
  prefix_ = read_ > kContextTokens ? read_ - kContextTokens : 0;
  prefix_text_ = decode(prefix_, read_);
  return delta;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  MOEX_CHECK_INPUT(stops_.size() <= kMaxStopStrings, "at most ", kMaxStopStrings, " stop strings, got ",
                   stops_.size());
  for (const std::string& s : stops_) MOEX_CHECK_INPUT(!s.empty(), "a stop string is empty");
}

std::string StopMatcher::add(std::string_view text) {
  if (stopped_) return {};
  held_.append(text);
  // The first occurrence of any stop string (the earliest start; at equal starts, the one listed first).
  size_t first = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = held_.find(s);
    if (at < first) {
      first = at;
      matched_ = s;
    }
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > hold; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  std::string out;
  out.swap(held_);
  return out;
}

TextStream::Delta TextStream::add(int token) {
  Delta delta;
  if (matcher_.stopped()) {
    delta.stopped = true;
    return delta;
  }
  delta.text = matcher_.add(detokenizer_.add(token));
  delta.stopped = matcher_.stopped();
  return delta;
}

std::string TextStream::finish() {
  if (matcher_.stopped()) return {};
  std::string text = matcher_.add(detokenizer_.flush());
  if (matcher_.stopped()) return text;
  return text + matcher_.flush();
}

}  // namespace moex

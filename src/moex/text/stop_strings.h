// From a stream of sampled token ids to the text a client sees: incremental detokenization (UTF-8 safe)
// and `stop` strings (OpenAI's: generation ends before the first occurrence of any of them).
//
//   IncrementalDetokenizer  ids -> text deltas. Never emits half a code point; keeps SentencePiece's
//                           leading spaces (a piece "▁word" decoded alone loses its space).
//   StopMatcher             text deltas -> text safe to send. Holds back a tail that may be the start of
//                           a stop string; at the first match truncates there and reports stopped().
//   TextStream              both, per request: add(token) -> {text to send, stopped}.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace moex {

class Tokenizer;

// How it works (as vLLM and TGI do it): decode a short window of ids ending at the newest one, and a
// window ending one step earlier; the new text is the first's excess over the second. Decoding a window
// (not the whole sequence) keeps each step O(window); starting it a few tokens back gives SentencePiece
// the context it needs for the space of the newest piece, since both decodes strip the same leading space.
// A decode that ends in U+FFFD (a byte-fallback sequence not yet complete) emits nothing until the code
// point completes.
class IncrementalDetokenizer {
 public:
  // `context`: the ids before the first generated one (the prompt's tail is enough), so the first
  // generated piece keeps its leading space. The tokenizer must outlive this object.
  IncrementalDetokenizer(const Tokenizer& tokenizer, const std::vector<int>& context);
  std::string add(int token);  // the text this token completes (may be empty; ids the tokenizer lacks: none)
  std::string flush();         // at the end: whatever is held (an incomplete code point as U+FFFD)
  const std::vector<int>& ids() const { return ids_; }

 private:
  std::string decode(size_t begin, size_t end) const;

  const Tokenizer& tokenizer_;
  std::vector<int> ids_;    // context + generated
  size_t prefix_ = 0;       // window start
  size_t read_ = 0;         // ids before this are emitted
  std::string prefix_text_; // decode(prefix_, read_)
};

class StopMatcher {
 public:
  // Empty stop strings are refused (Error kInvalidInput), as is more than kMaxStopStrings of them.
  explicit StopMatcher(std::vector<std::string> stops);
  // New text in, text safe to send out. After the first match nothing more comes out.
  std::string add(std::string_view text);
  // End of generation without a match: the held-back tail.
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }  // the stop string that matched

  static constexpr size_t kMaxStopStrings = 16;

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
  std::string matched_;
};

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, const std::vector<int>& context, std::vector<std::string> stops)
      : detokenizer_(tokenizer, context), matcher_(std::move(stops)) {}
  struct Delta {
    std::string text;      // send this
    bool stopped = false;  // a stop string matched: finish_reason "stop", sample no more
  };
  Delta add(int token);
  std::string finish();  // generation ended for another reason (EOS, max_tokens): the rest of the text
  bool stopped() const { return matcher_.stopped(); }

 private:
  IncrementalDetokenizer detokenizer_;
  StopMatcher matcher_;
};

// True when `text` is valid UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF).
bool is_valid_utf8(std::string_view text);

}  // namespace moex

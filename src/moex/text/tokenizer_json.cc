// tokenizer.json: reader, encoder and decoder (see the header for what is supported).
//
// Hand-written because no Debian library reads this format (Hugging Face's `tokenizers` is Rust and not
// packaged); the Unicode parts that need tables are not hand-written: the pre-tokenizers' regexes run on
// PCRE2 with UTF + UCP (\p{L}, \p{N}, \s as Unicode defines them) and normalization is utf8proc's.
// The pipeline is `tokenizers`' own: added tokens split out of the raw text, the normalizer on what is
// left, then the added tokens that match normalized text, the pre-tokenizer, BPE on each piece, and the
// post-processor; decoding maps ids to tokens and runs the decoder chain.
#include "moex/text/tokenizer_json.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <queue>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"

namespace moex {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------- UTF-8

// Length of the valid UTF-8 sequence at s[i] (Unicode Table 3-7), or 0 when the bytes there are not one;
// *prefix is then how many bytes form the maximal invalid subpart that one U+FFFD replaces.
size_t utf8_sequence_length(std::string_view s, size_t i, size_t* prefix) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  *prefix = 1;
  if (b0 < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
  else if (b0 == 0xE0) need = 2, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEC) need = 2;
  else if (b0 == 0xED) need = 2, hi = 0x9F;
  else if (b0 >= 0xEE && b0 <= 0xEF) need = 2;
  else if (b0 == 0xF0) need = 3, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) need = 3;
  else if (b0 == 0xF4) need = 3, hi = 0x8F;
  else return 0;
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return 0;
    const unsigned char b = byte(i + k);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
    *prefix = k + 1;
  }
  return need + 1;
}

// The code point of the valid sequence at s[i] of length len.
uint32_t code_point(std::string_view s, size_t i, size_t len) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  if (len == 1) return b(0);
  if (len == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (len == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

// Length of the character at s[i] of text already sanitized.
size_t char_length(std::string_view s, size_t i) {
  size_t prefix;
  const size_t n = utf8_sequence_length(s, i, &prefix);
  return n ? n : 1;
}

std::string encode_utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// The White_Space property (Rust's char::is_whitespace, which the added tokens' lstrip/rstrip use).
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

const char kReplacementChar[] = "\xEF\xBF\xBD";

// --------------------------------------------------------------------------------------- JSON helpers

// Every error names the file and the component, on one line.
struct Where {
  const std::string& origin;
  std::string path;
  Where at(const std::string& child) const {  // ".model", "[2]": a JSON path, without the leading dot
    return Where{origin, path.empty() && !child.empty() && child[0] == '.' ? child.substr(1) : path + child};
  }
  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    throw_error(ErrorKind::kInvalidInput, detail::concat(origin, ": ", path, path.empty() ? "" : ": ", args...));
  }
};

void check_object(const json& j, const Where& w) {
  if (!j.is_object()) w.fail("expected an object, got ", j.type_name());
}

void check_fields(const json& j, std::initializer_list<const char*> known, const Where& w) {
  check_object(j, w);
  for (const auto& [key, value] : j.items()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) w.fail("unknown field \"", key, "\" (MoEX does not know what it changes, so it refuses the file)");
  }
}

const json* optional_field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::string get_string(const json& j, const char* key, const Where& w) {
  const json* v = optional_field(j, key);
  if (!v || !v->is_string()) w.fail("\"", key, "\" must be a string");
  return v->get<std::string>();
}

bool get_bool(const json& j, const char* key, bool fallback, const Where& w) {
  const json* v = optional_field(j, key);
  if (!v) return fallback;
  if (!v->is_boolean()) w.fail("\"", key, "\" must be true or false");
  return v->get<bool>();
}

int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi, const Where& w) {
  const json* v = optional_field(j, key);
  if (!v || !v->is_number_integer()) w.fail("\"", key, "\" must be an integer");
  const int64_t x = v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                        ? INT64_MAX
                        : v->get<int64_t>();
  if (x < lo || x > hi) w.fail("\"", key, "\" is ", v->dump(), ", outside ", lo, "..", hi);
  return x;
}

std::string type_of(const json& j, const Where& w) {
  check_object(j, w);
  return get_string(j, "type", w);
}

constexpr int kMaxNesting = 8;  // Sequence inside Sequence: real files nest once

// -------------------------------------------------------------------------------------------- Regex

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const Where& w) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);  // LITERAL refuses UCP
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error, &offset,
                          nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      w.fail("cannot compile the pattern at offset ", offset, ": ", reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // when JIT is unavailable the interpreter runs
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // [start, end) of every non-empty match, left to right (an empty match moves on one character).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    MOEX_CHECK(md != nullptr, "out of memory for regex match data");
    size_t pos = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_NO_UTF_CHECK, md,
                                 nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        throw_error(ErrorKind::kInvalidInput, "tokenizer: the pre-tokenizer's regex failed on the text (PCRE2 error " +
                                                  std::to_string(rc) + ", e.g. its match limit)");
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] > ov[0]) {
        out.emplace_back(ov[0], ov[1]);
        pos = ov[1];
      } else {
        if (ov[0] >= s.size()) break;
        pos = ov[0] + char_length(s, ov[0]);
      }
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// {"Regex": "..."} or {"String": "..."}, as Split, Replace and the decoders spell a pattern.
std::unique_ptr<Regex> parse_pattern(const json& j, const Where& w, std::string* literal = nullptr) {
  check_object(j, w);
  if (j.size() != 1) w.fail("a pattern is {\"String\": ...} or {\"Regex\": ...}");
  const bool is_string = j.contains("String");
  if (!is_string && !j.contains("Regex")) w.fail("a pattern is {\"String\": ...} or {\"Regex\": ...}");
  const std::string text = get_string(j, is_string ? "String" : "Regex", w);
  if (literal) *literal = is_string ? text : std::string();
  if (is_string && text.empty()) w.fail("an empty String pattern matches nowhere");
  return std::make_unique<Regex>(text, is_string, w);
}

std::string replace_all(std::string_view s, const Regex& pattern, const std::string& content) {
  std::string out;
  size_t last = 0;
  for (const auto& [a, b] : pattern.find_all(s)) {
    out.append(s.substr(last, a - last));
    out += content;
    last = b;
  }
  out.append(s.substr(last));
  return out;
}

// ---------------------------------------------------------------------------------------- Normalizer

struct Normalizer {
  enum Kind { kSequence, kNfc, kNfd, kNfkc, kNfkd, kPrepend, kReplace } kind;
  std::vector<Normalizer> children;
  std::string text;                // Prepend's prefix, Replace's content
  std::shared_ptr<Regex> pattern;  // Replace

  std::string apply(std::string s) const {
    switch (kind) {
      case kSequence:
        for (const Normalizer& n : children) s = n.apply(std::move(s));
        return s;
      case kPrepend:
        return s.empty() ? s : text + s;
      case kReplace:
        return replace_all(s, *pattern, text);
      default: {
        int options = UTF8PROC_STABLE;
        if (kind == kNfc || kind == kNfkc) options |= UTF8PROC_COMPOSE;
        else options |= UTF8PROC_DECOMPOSE;
        if (kind == kNfkc || kind == kNfkd) options |= UTF8PROC_COMPAT;
        utf8proc_uint8_t* out = nullptr;
        const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                                static_cast<utf8proc_ssize_t>(s.size()), &out,
                                                static_cast<utf8proc_option_t>(options));
        if (n < 0) throw_error(ErrorKind::kInvalidInput, std::string("tokenizer: cannot normalize the text: ") +
                                                              utf8proc_errmsg(n));
        std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
        std::free(out);
        return result;
      }
    }
  }
};

Normalizer parse_normalizer(const json& j, const Where& w, int depth) {
  if (depth > kMaxNesting) w.fail("Sequence nested too deeply");
  const std::string type = type_of(j, w);
  Normalizer n{};
  if (type == "Sequence") {
    check_fields(j, {"type", "normalizers"}, w);
    const json* list = optional_field(j, "normalizers");
    if (!list || !list->is_array()) w.fail("\"normalizers\" must be an array");
    n.kind = Normalizer::kSequence;
    for (size_t i = 0; i < list->size(); ++i)
      n.children.push_back(parse_normalizer((*list)[i], w.at("[" + std::to_string(i) + "]"), depth + 1));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    check_fields(j, {"type"}, w);
    n.kind = type == "NFC" ? Normalizer::kNfc : type == "NFD" ? Normalizer::kNfd
             : type == "NFKC" ? Normalizer::kNfkc : Normalizer::kNfkd;
  } else if (type == "Prepend") {
    check_fields(j, {"type", "prepend"}, w);
    n.kind = Normalizer::kPrepend;
    n.text = get_string(j, "prepend", w);
  } else if (type == "Replace") {
    check_fields(j, {"type", "pattern", "content"}, w);
    n.kind = Normalizer::kReplace;
    if (!j.contains("pattern")) w.fail("\"pattern\" is missing");
    n.pattern = parse_pattern(j["pattern"], w.at(".pattern"));
    n.text = get_string(j, "content", w);
  } else {
    w.fail("normalizer \"", type, "\" is not supported (MoEX reads Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace)");
  }
  return n;
}

// ------------------------------------------------------------------------------------- Pre-tokenizer

struct Piece {
  std::string text;
  bool at_input_start;  // starts at offset 0 of the original text (Metaspace's prepend_scheme "first")
};

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Splits s at the matches as `tokenizers`' SplitDelimiterBehavior does; spans are [start, end).
std::vector<std::pair<size_t, size_t>> split_spans(std::string_view s, const Regex& pattern, SplitBehavior behavior,
                                                   bool invert) {
  struct Span {
    size_t a, b;
    bool match;
  };
  std::vector<Span> spans;
  size_t last = 0;
  for (const auto& [a, b] : pattern.find_all(s)) {
    if (a > last) spans.push_back({last, a, false});
    spans.push_back({a, b, true});
    last = b;
  }
  if (last < s.size()) spans.push_back({last, s.size(), false});
  if (invert)
    for (Span& sp : spans) sp.match = !sp.match;
  std::vector<std::pair<size_t, size_t>> out;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Span& sp : spans) out.emplace_back(sp.a, sp.b);
      break;
    case SplitBehavior::kRemoved:
      for (const Span& sp : spans)
        if (!sp.match) out.emplace_back(sp.a, sp.b);
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.match && previous_match && !out.empty()) out.back().second = sp.b;
        else out.emplace_back(sp.a, sp.b);
        previous_match = sp.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.match && !previous_match && !out.empty()) out.back().second = sp.b;
        else out.emplace_back(sp.a, sp.b);
        previous_match = sp.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;  // walking right to left: "previous" is the span to the right
      for (size_t i = spans.size(); i-- > 0;) {
        const Span& sp = spans[i];
        if (sp.match && !previous_match && !out.empty()) out.back().first = sp.a;
        else out.emplace_back(sp.a, sp.b);
        previous_match = sp.match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  return out;
}

struct PreTokenizer {
  enum Kind { kSequence, kSplit, kByteLevel, kMetaspace, kDigits } kind;
  std::vector<PreTokenizer> children;
  std::shared_ptr<Regex> pattern;  // Split, ByteLevel with use_regex, Digits
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;
  bool split = true;  // Metaspace

  void apply(std::vector<Piece>* pieces) const {
    if (kind == kSequence) {
      for (const PreTokenizer& p : children) p.apply(pieces);
      return;
    }
    std::vector<Piece> out;
    for (Piece& piece : *pieces) {
      std::string s = std::move(piece.text);
      if (kind == kByteLevel && add_prefix_space && (s.empty() || s[0] != ' ')) s.insert(s.begin(), ' ');
      if (kind == kMetaspace) {
        std::string replaced;
        for (char c : s) {
          if (c == ' ') replaced += replacement;
          else replaced += c;
        }
        s = std::move(replaced);
        const bool prepend_here = prepend == kAlways || (prepend == kFirst && piece.at_input_start);
        if (prepend_here && s.compare(0, replacement.size(), replacement) != 0) s = replacement + s;
      }
      std::vector<std::pair<size_t, size_t>> spans;
      if (pattern) spans = split_spans(s, *pattern, behavior, invert);
      else spans.emplace_back(0, s.size());
      for (const auto& [a, b] : spans) {
        if (a == b) continue;
        Piece next{s.substr(a, b - a), piece.at_input_start && a == 0};
        if (kind == kByteLevel) {
          std::string mapped;
          for (unsigned char c : next.text) mapped += byte_level_char(c);
          next.text = std::move(mapped);
        }
        out.push_back(std::move(next));
      }
    }
    *pieces = std::move(out);
  }
};

PreTokenizer parse_pre_tokenizer(const json& j, const Where& w, int depth) {
  if (depth > kMaxNesting) w.fail("Sequence nested too deeply");
  const std::string type = type_of(j, w);
  PreTokenizer p{};
  if (type == "Sequence") {
    check_fields(j, {"type", "pretokenizers"}, w);
    const json* list = optional_field(j, "pretokenizers");
    if (!list || !list->is_array()) w.fail("\"pretokenizers\" must be an array");
    p.kind = PreTokenizer::kSequence;
    for (size_t i = 0; i < list->size(); ++i)
      p.children.push_back(parse_pre_tokenizer((*list)[i], w.at("[" + std::to_string(i) + "]"), depth + 1));
  } else if (type == "Split") {
    check_fields(j, {"type", "pattern", "behavior", "invert"}, w);
    p.kind = PreTokenizer::kSplit;
    if (!j.contains("pattern")) w.fail("\"pattern\" is missing");
    p.pattern = parse_pattern(j["pattern"], w.at(".pattern"));
    const std::string behavior = get_string(j, "behavior", w);
    static const std::map<std::string, SplitBehavior> behaviors = {
        {"Isolated", SplitBehavior::kIsolated}, {"Removed", SplitBehavior::kRemoved},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious}, {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    auto it = behaviors.find(behavior);
    if (it == behaviors.end()) w.fail("unknown split behavior \"", behavior, "\"");
    p.behavior = it->second;
    p.invert = get_bool(j, "invert", false, w);
  } else if (type == "ByteLevel") {
    check_fields(j, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, w);
    p.kind = PreTokenizer::kByteLevel;
    p.add_prefix_space = get_bool(j, "add_prefix_space", true, w);
    if (get_bool(j, "use_regex", true, w)) p.pattern = std::make_shared<Regex>(kGpt2SplitPattern, false, w);
  } else if (type == "Metaspace") {
    check_fields(j, {"type", "replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"}, w);
    p.kind = PreTokenizer::kMetaspace;
    p.replacement = get_string(j, "replacement", w);
    size_t prefix;
    if (p.replacement.empty() || utf8_sequence_length(p.replacement, 0, &prefix) != p.replacement.size())
      w.fail("\"replacement\" must be one character");
    if (const json* scheme = optional_field(j, "prepend_scheme")) {
      const std::string s = scheme->is_string() ? scheme->get<std::string>() : "";
      if (s == "always") p.prepend = PreTokenizer::kAlways;
      else if (s == "first") p.prepend = PreTokenizer::kFirst;
      else if (s == "never") p.prepend = PreTokenizer::kNever;
      else w.fail("\"prepend_scheme\" must be \"always\", \"first\" or \"never\"");
    } else {
      p.prepend = get_bool(j, "add_prefix_space", true, w) ? PreTokenizer::kAlways : PreTokenizer::kNever;
    }
    p.split = get_bool(j, "split", true, w);
    if (p.split) {
      p.pattern = std::make_shared<Regex>(p.replacement, true, w);
      p.behavior = SplitBehavior::kMergedWithNext;
    }
  } else if (type == "Digits") {
    check_fields(j, {"type", "individual_digits"}, w);
    p.kind = PreTokenizer::kDigits;
    const bool individual = get_bool(j, "individual_digits", false, w);
    p.pattern = std::make_shared<Regex>(individual ? "\\p{N}" : "\\p{N}+", false, w);
  } else {
    w.fail("pre-tokenizer \"", type, "\" is not supported (MoEX reads Sequence, Split, ByteLevel, Metaspace, Digits)");
  }
  return p;
}

// ------------------------------------------------------------------------------------------ BPE model

struct BpeModel {
  std::unordered_map<std::string, int> vocab;
  std::vector<std::string> id_to_token;
  std::vector<bool> has_id;
  std::unordered_map<uint64_t, std::pair<int, int>> merges;  // (left id, right id) -> (rank, merged id)
  int unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  int byte_ids[256];  // "<0xAB>" pieces for byte_fallback, -1 when absent

  static uint64_t key(int a, int b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

  int find(const std::string& token) const {
    auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  }
  int find(std::string_view token) const { return find(std::string(token)); }

  // BPE on one pre-tokenized piece: characters (bytes of an unknown one through byte_fallback, else unk),
  // then the lowest-ranked adjacent pair merged first, the leftmost among equals, until none applies.
  void encode_word(const std::string& word, std::vector<int>* out) const {
    if (ignore_merges) {
      const int id = find(word);
      if (id >= 0) {
        out->push_back(id);
        return;
      }
    }
    struct Symbol {
      int id;
      int prev, next;
      bool removed;
    };
    std::vector<Symbol> sym;
    bool last_is_unk = false;
    for (size_t i = 0; i < word.size();) {
      const size_t len = char_length(word, i);
      const int id = find(std::string_view(word).substr(i, len));
      if (id >= 0) {
        sym.push_back({id, 0, 0, false});
        last_is_unk = false;
      } else {
        bool bytes_known = byte_fallback;
        for (size_t k = 0; k < len && bytes_known; ++k) bytes_known = byte_ids[static_cast<unsigned char>(word[i + k])] >= 0;
        if (bytes_known) {
          for (size_t k = 0; k < len; ++k) sym.push_back({byte_ids[static_cast<unsigned char>(word[i + k])], 0, 0, false});
          last_is_unk = false;
        } else if (unk_id >= 0) {
          if (!(fuse_unk && last_is_unk)) sym.push_back({unk_id, 0, 0, false});
          last_is_unk = true;
        }  // no unk token: the character is dropped, as `tokenizers` does
      }
      i += len;
    }
    const int n = static_cast<int>(sym.size());
    for (int i = 0; i < n; ++i) {
      sym[i].prev = i - 1;
      sym[i].next = i + 1 < n ? i + 1 : -1;
    }
    struct Candidate {
      int rank, pos, new_id;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
    auto consider = [&](int pos) {
      if (pos < 0 || sym[pos].next < 0) return;
      auto it = merges.find(key(sym[pos].id, sym[sym[pos].next].id));
      if (it != merges.end()) queue.push({it->second.first, pos, it->second.second});
    };
    for (int i = 0; i + 1 < n; ++i) consider(i);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = sym[top.pos];
      if (left.removed || left.next < 0) continue;
      auto it = merges.find(key(left.id, sym[left.next].id));
      if (it == merges.end() || it->second.second != top.new_id) continue;  // stale
      Symbol& right = sym[left.next];
      left.id = top.new_id;
      right.removed = true;
      left.next = right.next;
      if (left.next >= 0) sym[left.next].prev = top.pos;
      consider(left.prev);
      consider(top.pos);
    }
    for (int i = 0; i < n; ++i)
      if (!sym[i].removed) out->push_back(sym[i].id);
  }
};

void add_to_vocab(BpeModel* m, const std::string& token, int64_t id) {
  if (id >= static_cast<int64_t>(m->id_to_token.size())) {
    m->id_to_token.resize(id + 1);
    m->has_id.resize(id + 1, false);
  }
  m->id_to_token[id] = token;
  m->has_id[id] = true;
}

constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;  // 16.7M: far above any vocabulary (Gemma's 256k)

BpeModel parse_bpe(const json& j, const Where& w) {
  check_fields(j, {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                   "byte_fallback", "ignore_merges", "vocab", "merges"},
               w);
  BpeModel m;
  if (const json* d = optional_field(j, "dropout"); d && !(d->is_number() && d->get<double>() == 0.0))
    w.fail("\"dropout\" must be null: BPE dropout is for training, an engine encodes deterministically");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const json* v = optional_field(j, affix); v && !(v->is_string() && v->get<std::string>().empty()))
      w.fail("\"", affix, "\" is not supported (byte-level and SentencePiece-style BPE have none)");
  }
  m.fuse_unk = get_bool(j, "fuse_unk", false, w);
  m.byte_fallback = get_bool(j, "byte_fallback", false, w);
  m.ignore_merges = get_bool(j, "ignore_merges", false, w);
  const json* vocab = optional_field(j, "vocab");
  if (!vocab || !vocab->is_object()) w.fail("\"vocab\" must be an object of token: id");
  if (vocab->empty()) w.fail("\"vocab\" is empty");
  m.vocab.reserve(vocab->size());
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId)
      w.fail("vocab: the id of \"", token, "\" must be an integer in 0..", kMaxTokenId);
    const int64_t i = id.get<int64_t>();
    if (i < static_cast<int64_t>(m.has_id.size()) && m.has_id[i])
      w.fail("vocab: id ", i, " is given to both \"", m.id_to_token[i], "\" and \"", token, "\"");
    m.vocab.emplace(token, static_cast<int>(i));
    add_to_vocab(&m, token, i);
  }
  if (const json* unk = optional_field(j, "unk_token")) {
    if (!unk->is_string()) w.fail("\"unk_token\" must be a string or null");
    m.unk_id = m.find(unk->get<std::string>());
    if (m.unk_id < 0) w.fail("\"unk_token\" \"", unk->get<std::string>(), "\" is not in the vocab");
  }
  static const char hex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const std::string piece = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
    m.byte_ids[b] = m.find(piece);
  }
  const json* merges = optional_field(j, "merges");
  if (!merges || !merges->is_array()) w.fail("\"merges\" must be an array");
  m.merges.reserve(merges->size());
  for (size_t r = 0; r < merges->size(); ++r) {
    const json& e = (*merges)[r];
    std::string left, right;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        w.fail("merges[", r, "] \"", s, "\" must be two tokens separated by one space");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    } else {
      w.fail("merges[", r, "] must be \"a b\" or [\"a\", \"b\"]");
    }
    const int a = m.find(left), b = m.find(right), merged = m.find(left + right);
    if (a < 0 || b < 0 || merged < 0)
      w.fail("merges[", r, "] (\"", left, "\", \"", right, "\"): ", a < 0 ? "\"" + left + "\"" : b < 0 ? "\"" + right + "\"" : "\"" + left + right + "\"",
             " is not in the vocab");
    m.merges[BpeModel::key(a, b)] = {static_cast<int>(r), merged};  // a repeated pair: the last one counts
  }
  return m;
}

// ------------------------------------------------------------------------------------------- Decoder

struct Decoder {
  enum Kind { kSequence, kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::vector<Decoder> children;
  std::shared_ptr<Regex> pattern;  // Replace
  std::string text;                // Replace's content, Strip's content, Metaspace's replacement
  int64_t start = 0, stop = 0;     // Strip
  bool prepend = true;             // Metaspace: the first token's leading space came from the prefix

  void apply(std::vector<std::string>* tokens, ByteRuns byte_runs) const {
    std::vector<std::string>& t = *tokens;
    switch (kind) {
      case kSequence:
        for (const Decoder& d : children) d.apply(tokens, byte_runs);
        return;
      case kByteLevel: {
        // Each token back to bytes through the byte-level map; a token with a character outside the map
        // (an added token) keeps its own bytes. The bytes are then read as UTF-8, invalid parts as U+FFFD.
        std::string bytes;
        for (const std::string& token : t) {
          std::string own;
          bool mapped = true;
          for (size_t i = 0; i < token.size() && mapped;) {
            const size_t len = char_length(token, i);
            const int b = byte_of_char(token.substr(i, len));
            if (b < 0) mapped = false;
            else own += static_cast<char>(b);
            i += len;
          }
          bytes += mapped ? own : token;
        }
        t.assign(1, sanitize_utf8(bytes));
        return;
      }
      case kReplace:
        for (std::string& token : t) token = replace_all(token, *pattern, text);
        return;
      case kByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        size_t pending_tokens = 0;
        auto flush = [&] {
          if (pending_tokens == 0) return;
          if (sanitize_utf8(pending) == pending) {
            out.push_back(pending);
          } else if (byte_runs == ByteRuns::kSentencePiece) {
            for (size_t i = 0, prefix; i < pending.size();) {
              const size_t len = utf8_sequence_length(pending, i, &prefix);
              out.push_back(len ? pending.substr(i, len) : kReplacementChar);
              i += len ? len : 1;
            }
          } else {
            for (size_t i = 0; i < pending_tokens; ++i) out.push_back(kReplacementChar);
          }
          pending.clear();
          pending_tokens = 0;
        };
        for (std::string& token : t) {
          const int b = byte_token_value(token);
          if (b >= 0) {
            pending += static_cast<char>(b);
            ++pending_tokens;
          } else {
            flush();
            out.push_back(std::move(token));
          }
        }
        flush();
        t = std::move(out);
        return;
      }
      case kFuse: {
        std::string all;
        for (const std::string& token : t) all += token;
        t.assign(1, all);
        return;
      }
      case kStrip:
        for (std::string& token : t) token = strip(token);
        return;
      case kMetaspace:
        // The replacement becomes a space, except in the first token, where `tokenizers` drops every one
        // (not only the leading one) unless the scheme is "never".
        for (size_t i = 0; i < t.size(); ++i) {
          std::string s;
          for (size_t k = 0; k < t[i].size();) {
            if (t[i].compare(k, text.size(), text) == 0) {
              if (!(i == 0 && prepend)) s += ' ';
              k += text.size();
            } else {
              s += t[i][k++];
            }
          }
          t[i] = std::move(s);
        }
        return;
    }
  }

  // Strip: up to `start` leading and `stop` trailing copies of the character `text`.
  std::string strip(const std::string& token) const {
    std::vector<std::pair<size_t, size_t>> chars;  // (offset, length)
    for (size_t i = 0; i < token.size();) {
      const size_t len = char_length(token, i);
      chars.emplace_back(i, len);
      i += len;
    }
    size_t begin = 0, end = chars.size();
    while (begin < end && static_cast<int64_t>(begin) < start && token.compare(chars[begin].first, chars[begin].second, text) == 0) ++begin;
    int64_t cut = 0;
    while (end > begin && cut < stop && token.compare(chars[end - 1].first, chars[end - 1].second, text) == 0) --end, ++cut;
    if (begin == end) return "";
    const size_t a = chars[begin].first, b = chars[end - 1].first + chars[end - 1].second;
    return token.substr(a, b - a);
  }

  // "<0xAB>" -> 0xAB, anything else -> -1.
  static int byte_token_value(const std::string& token) {
    if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
    auto digit = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    const int hi = digit(token[3]), lo = digit(token[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }

  static int byte_of_char(std::string_view c) {
    static const std::unordered_map<std::string, int> inverse = [] {
      std::unordered_map<std::string, int> m;
      for (int b = 0; b < 256; ++b) m.emplace(byte_level_char(static_cast<unsigned char>(b)), b);
      return m;
    }();
    auto it = inverse.find(std::string(c));
    return it == inverse.end() ? -1 : it->second;
  }
};

Decoder parse_decoder(const json& j, const Where& w, int depth) {
  if (depth > kMaxNesting) w.fail("Sequence nested too deeply");
  const std::string type = type_of(j, w);
  Decoder d{};
  if (type == "Sequence") {
    check_fields(j, {"type", "decoders"}, w);
    const json* list = optional_field(j, "decoders");
    if (!list || !list->is_array()) w.fail("\"decoders\" must be an array");
    d.kind = Decoder::kSequence;
    for (size_t i = 0; i < list->size(); ++i)
      d.children.push_back(parse_decoder((*list)[i], w.at("[" + std::to_string(i) + "]"), depth + 1));
  } else if (type == "ByteLevel") {
    check_fields(j, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, w);
    d.kind = Decoder::kByteLevel;
  } else if (type == "Replace") {
    check_fields(j, {"type", "pattern", "content"}, w);
    d.kind = Decoder::kReplace;
    if (!j.contains("pattern")) w.fail("\"pattern\" is missing");
    d.pattern = parse_pattern(j["pattern"], w.at(".pattern"));
    d.text = get_string(j, "content", w);
  } else if (type == "ByteFallback" || type == "Fuse") {
    check_fields(j, {"type"}, w);
    d.kind = type == "Fuse" ? Decoder::kFuse : Decoder::kByteFallback;
  } else if (type == "Strip") {
    check_fields(j, {"type", "content", "start", "stop"}, w);
    d.kind = Decoder::kStrip;
    d.text = get_string(j, "content", w);
    size_t prefix;
    if (d.text.empty() || utf8_sequence_length(d.text, 0, &prefix) != d.text.size())
      w.fail("\"content\" must be one character");
    d.start = get_int(j, "start", 0, 1 << 20, w);
    d.stop = get_int(j, "stop", 0, 1 << 20, w);
  } else if (type == "Metaspace") {
    check_fields(j, {"type", "replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"}, w);
    d.kind = Decoder::kMetaspace;
    d.text = get_string(j, "replacement", w);
    if (d.text.empty()) w.fail("\"replacement\" must be one character");
    if (const json* scheme = optional_field(j, "prepend_scheme")) {
      if (!scheme->is_string() || (*scheme != "always" && *scheme != "first" && *scheme != "never"))
        w.fail("\"prepend_scheme\" must be \"always\", \"first\" or \"never\"");
      d.prepend = *scheme != "never";
    } else {
      d.prepend = get_bool(j, "add_prefix_space", true, w);
    }
  } else {
    w.fail("decoder \"", type, "\" is not supported (MoEX reads Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, "
           "Metaspace)");
  }
  return d;
}

// ------------------------------------------------------------------------------------ Post-processor

// What add_special_tokens adds around one sequence: ids before and after it.
struct PostProcessor {
  std::vector<int> before, after;
};

void parse_post_processor(const json& j, const Where& w, int depth, PostProcessor* out) {
  if (depth > kMaxNesting) w.fail("Sequence nested too deeply");
  const std::string type = type_of(j, w);
  if (type == "Sequence") {
    check_fields(j, {"type", "processors"}, w);
    const json* list = optional_field(j, "processors");
    if (!list || !list->is_array()) w.fail("\"processors\" must be an array");
    for (size_t i = 0; i < list->size(); ++i)
      parse_post_processor((*list)[i], w.at("[" + std::to_string(i) + "]"), depth + 1, out);
  } else if (type == "ByteLevel") {
    check_fields(j, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, w);  // offsets only: ids unchanged
  } else if (type == "TemplateProcessing") {
    check_fields(j, {"type", "single", "pair", "special_tokens"}, w);
    const json* single = optional_field(j, "single");
    const json* specials = optional_field(j, "special_tokens");
    if (!single || !single->is_array()) w.fail("\"single\" must be an array");
    if (specials && !specials->is_object()) w.fail("\"special_tokens\" must be an object");
    std::vector<int> before, after;
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& item = (*single)[i];
      const Where wi = w.at(".single[" + std::to_string(i) + "]");
      check_object(item, wi);
      if (item.size() == 1 && item.contains("Sequence")) {
        check_fields(item["Sequence"], {"id", "type_id"}, wi);
        if (get_string(item["Sequence"], "id", wi) != "A" || seen_sequence)
          wi.fail("a single-sequence template holds sequence \"A\" once");
        seen_sequence = true;
      } else if (item.size() == 1 && item.contains("SpecialToken")) {
        check_fields(item["SpecialToken"], {"id", "type_id"}, wi);
        const std::string name = get_string(item["SpecialToken"], "id", wi);
        if (!specials || !specials->contains(name)) wi.fail("special token \"", name, "\" is not in \"special_tokens\"");
        const json& entry = (*specials)[name];
        check_fields(entry, {"id", "ids", "tokens"}, wi);
        const json* ids = optional_field(entry, "ids");
        if (!ids || !ids->is_array()) wi.fail("\"ids\" of \"", name, "\" must be an array");
        for (const json& id : *ids) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId)
            wi.fail("\"ids\" of \"", name, "\" must be token ids");
          (seen_sequence ? after : before).push_back(static_cast<int>(id.get<int64_t>()));
        }
      } else {
        wi.fail("a template item is {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (!seen_sequence) w.fail("\"single\" has no sequence \"A\"");
    out->before.insert(out->before.begin(), before.begin(), before.end());
    out->after.insert(out->after.end(), after.begin(), after.end());
  } else {
    w.fail("post-processor \"", type, "\" is not supported (MoEX reads Sequence, ByteLevel, TemplateProcessing)");
  }
}

// -------------------------------------------------------------------------------------- Added tokens

struct AddedToken {
  int id;
  std::string content;
  bool special, normalized, lstrip, rstrip;
  // What is matched and what decoding gives: the content, or for a normalized token the content through
  // the normalizer (as `tokenizers` does: under Llama's Prepend("▁") a normalized "x" matches "▁x").
  std::string text;
};

struct Match {
  size_t a, b;
  int id;  // -1: text between added tokens
};

// Added tokens by the first byte of what they match, so that a position no token starts with costs one look-up.
struct AddedTokenIndex {
  std::vector<const AddedToken*> by_first_byte[256];
  bool empty = true;
  void add(const AddedToken* t) {
    by_first_byte[static_cast<unsigned char>(t->text[0])].push_back(t);
    empty = false;
  }
};

// The added tokens of `tokens` in s, leftmost first and the longest at a position (as `tokenizers`'
// leftmost-longest automaton), widened over whitespace by lstrip / rstrip; the text between them as id -1.
std::vector<Match> split_added(std::string_view s, const AddedTokenIndex& tokens) {
  std::vector<Match> out;
  if (tokens.empty) {
    if (!s.empty()) out.push_back({0, s.size(), -1});
    return out;
  }
  size_t last = 0;  // end of the previous added token
  for (size_t i = 0; i < s.size();) {
    const AddedToken* best = nullptr;
    for (const AddedToken* t : tokens.by_first_byte[static_cast<unsigned char>(s[i])])
      if ((!best || t->text.size() > best->text.size()) && s.compare(i, t->text.size(), t->text) == 0) best = t;
    if (!best) {
      i += char_length(s, i);
      continue;
    }
    size_t a = i, b = i + best->text.size();
    if (best->lstrip) {
      while (a > last) {
        size_t k = a - 1;
        while (k > last && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        size_t prefix;
        const size_t len = utf8_sequence_length(s, k, &prefix);
        if (len == 0 || !is_white_space(code_point(s, k, len))) break;
        a = k;
      }
    }
    if (best->rstrip) {
      while (b < s.size()) {
        size_t prefix;
        const size_t len = utf8_sequence_length(s, b, &prefix);
        if (len == 0 || !is_white_space(code_point(s, b, len))) break;
        b += len;
      }
    }
    if (a > last) out.push_back({last, a, -1});
    out.push_back({a, b, best->id});
    last = i = b;
  }
  if (last < s.size()) out.push_back({last, s.size(), -1});
  return out;
}

}  // namespace

const char kGpt2SplitPattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char kQwen2SplitPattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> split_isolated(std::string_view text, const std::string& pattern) {
  const std::string origin = "split pattern";
  const Regex regex(pattern, false, Where{origin, "regex"});
  const std::string clean = sanitize_utf8(text);
  std::vector<std::string> out;
  for (const auto& [a, b] : split_spans(clean, regex, SplitBehavior::kIsolated, false)) out.push_back(clean.substr(a, b - a));
  return out;
}

// ------------------------------------------------------------------------------------------- Public

struct JsonTokenizer::Impl {
  std::string kind;
  std::vector<AddedToken> added;
  std::unordered_map<int, size_t> added_by_id;
  AddedTokenIndex raw_tokens, normalized_tokens;  // matched before / after normalization
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  BpeModel model;
  PostProcessor post;
  std::unique_ptr<Decoder> decoder;
  int vocab_size = 0;

  void encode_normalized(const std::string& text, bool at_input_start, std::vector<int>* ids) const {
    std::vector<Piece> pieces{{text, at_input_start}};
    if (pre_tokenizer) pre_tokenizer->apply(&pieces);
    for (const Piece& p : pieces) model.encode_word(p.text, ids);
  }
};

JsonTokenizer::JsonTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JsonTokenizer::~JsonTokenizer() = default;

std::unique_ptr<JsonTokenizer> JsonTokenizer::parse(std::string_view json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, origin + ": not valid JSON: " + e.what());
  }
  const Where w{origin, ""};
  auto impl = std::make_unique<Impl>();
  try {
    check_fields(root, {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "model",
                        "post_processor", "decoder"},
                 w);
    for (const char* key : {"truncation", "padding"})
      if (optional_field(root, key))
        w.fail("\"", key, "\" must be null: MoEX neither truncates nor pads a prompt behind the user's back");
    const json* model = optional_field(root, "model");
    if (!model) w.fail("\"model\" is missing");
    const Where wm = w.at(".model");
    const std::string model_type = type_of(*model, wm);
    if (model_type != "BPE")
      wm.fail("model type \"", model_type, "\" is not supported (MoEX reads BPE: byte-level, or SentencePiece-style "
              "with byte_fallback)");
    impl->model = parse_bpe(*model, wm);
    if (const json* n = optional_field(root, "normalizer"))
      impl->normalizer = std::make_unique<Normalizer>(parse_normalizer(*n, w.at(".normalizer"), 0));
    if (const json* p = optional_field(root, "pre_tokenizer"))
      impl->pre_tokenizer = std::make_unique<PreTokenizer>(parse_pre_tokenizer(*p, w.at(".pre_tokenizer"), 0));
    if (const json* d = optional_field(root, "decoder"))
      impl->decoder = std::make_unique<Decoder>(parse_decoder(*d, w.at(".decoder"), 0));
    if (const json* p = optional_field(root, "post_processor"))
      parse_post_processor(*p, w.at(".post_processor"), 0, &impl->post);

    int64_t max_id = static_cast<int64_t>(impl->model.id_to_token.size()) - 1;
    if (const json* added = optional_field(root, "added_tokens")) {
      if (!added->is_array()) w.fail("\"added_tokens\" must be an array");
      for (size_t i = 0; i < added->size(); ++i) {
        const Where wa = w.at(".added_tokens[" + std::to_string(i) + "]");
        const json& t = (*added)[i];
        check_fields(t, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}, wa);
        AddedToken token;
        token.id = static_cast<int>(get_int(t, "id", 0, kMaxTokenId, wa));
        token.content = get_string(t, "content", wa);
        if (token.content.empty()) wa.fail("\"content\" is empty");
        if (sanitize_utf8(token.content) != token.content) wa.fail("\"content\" is not valid UTF-8");
        token.special = get_bool(t, "special", false, wa);
        token.normalized = get_bool(t, "normalized", !token.special, wa);
        token.lstrip = get_bool(t, "lstrip", false, wa);
        token.rstrip = get_bool(t, "rstrip", false, wa);
        if (get_bool(t, "single_word", false, wa)) wa.fail("\"single_word\": true is not supported");
        if (impl->added_by_id.count(token.id)) wa.fail("id ", token.id, " is added twice");
        const int in_vocab = impl->model.find(token.content);
        if (in_vocab >= 0 && in_vocab != token.id)
          wa.fail("\"", token.content, "\" has id ", token.id, " but the vocab gives it ", in_vocab);
        if (token.id < static_cast<int64_t>(impl->model.has_id.size()) && impl->model.has_id[token.id] &&
            impl->model.id_to_token[token.id] != token.content)
          wa.fail("id ", token.id, " is \"", impl->model.id_to_token[token.id], "\" in the vocab, not \"", token.content, "\"");
        max_id = std::max<int64_t>(max_id, token.id);
        impl->added_by_id.emplace(token.id, impl->added.size());
        impl->added.push_back(std::move(token));
      }
    }
    for (AddedToken& t : impl->added) {
      t.text = t.normalized && impl->normalizer ? impl->normalizer->apply(t.content) : t.content;
      if (t.text.empty()) continue;  // normalized to nothing: matches nowhere
      (t.normalized ? impl->normalized_tokens : impl->raw_tokens).add(&t);
    }
    impl->vocab_size = static_cast<int>(max_id + 1);
    for (const std::vector<int>* ids : {&impl->post.before, &impl->post.after})
      for (int id : *ids)
        if (id > max_id) w.at(".post_processor").fail("token id ", id, " is outside the vocabulary (", max_id + 1, " tokens)");
    bool byte_level = false;
    std::vector<const PreTokenizer*> stack;
    if (impl->pre_tokenizer) stack.push_back(impl->pre_tokenizer.get());
    while (!stack.empty()) {
      const PreTokenizer* p = stack.back();
      stack.pop_back();
      byte_level = byte_level || p->kind == PreTokenizer::kByteLevel;
      for (const PreTokenizer& c : p->children) stack.push_back(&c);
    }
    impl->kind = byte_level ? "byte-level BPE" : impl->model.byte_fallback ? "SentencePiece-style BPE" : "BPE";
  } catch (const json::exception& e) {  // a value of an unexpected type that a check above did not name
    throw_error(ErrorKind::kInvalidInput, origin + ": " + e.what());
  }
  return std::unique_ptr<JsonTokenizer>(new JsonTokenizer(std::move(impl)));
}

std::vector<int> JsonTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  const std::string clean = sanitize_utf8(text);
  std::vector<int> ids;
  if (add_special_tokens) ids = m.post.before;
  for (const Match& raw : split_added(clean, m.raw_tokens)) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    std::string normalized = clean.substr(raw.a, raw.b - raw.a);
    if (m.normalizer) normalized = m.normalizer->apply(std::move(normalized));
    for (const Match& part : split_added(normalized, m.normalized_tokens)) {
      if (part.id >= 0) ids.push_back(part.id);
      else m.encode_normalized(normalized.substr(part.a, part.b - part.a), raw.a == 0 && part.a == 0, &ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), m.post.after.begin(), m.post.after.end());
  return ids;
}

std::string JsonTokenizer::decode(const std::vector<int>& ids, bool skip_special_tokens, ByteRuns byte_runs) const {
  const Impl& m = *impl_;
  std::vector<std::string> tokens;
  for (int id : ids) {
    auto it = m.added_by_id.find(id);
    if (it != m.added_by_id.end()) {
      const AddedToken& t = m.added[it->second];
      if (!(skip_special_tokens && t.special)) tokens.push_back(t.text);
    } else if (id >= 0 && id < static_cast<int>(m.model.has_id.size()) && m.model.has_id[id]) {
      tokens.push_back(m.model.id_to_token[id]);
    }
  }
  if (!m.decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  m.decoder->apply(&tokens, byte_runs);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

int JsonTokenizer::vocab_size() const { return impl_->vocab_size; }

int JsonTokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : impl_->added)
    if (t.content == token) return t.id;
  return impl_->model.find(token);
}

const std::string& JsonTokenizer::model_kind() const { return impl_->kind; }

std::string sanitize_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    size_t prefix;
    const size_t len = utf8_sequence_length(bytes, i, &prefix);
    if (len) {
      out.append(bytes.substr(i, len));
      i += len;
    } else {
      out += kReplacementChar;
      i += prefix;
    }
  }
  return out;
}

const std::string& byte_level_char(unsigned char b) {
  static const std::vector<std::string> table = [] {
    // Printable bytes keep their code point; the other 68 take 256, 257, ... in byte order.
    std::vector<std::string> t(256);
    uint32_t next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255);
      t[c] = encode_utf8(printable ? static_cast<uint32_t>(c) : next++);
    }
    return t;
  }();
  return table[b];
}

}  // namespace moex

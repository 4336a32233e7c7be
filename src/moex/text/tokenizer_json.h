// Hugging Face's tokenizer.json (the `tokenizers` library's serialized form) for the two BPE forms MoE
// checkpoints ship:
//  - byte-level BPE (GPT-2, Qwen2/Qwen3, OLMoE): a ByteLevel pre-tokenizer, alone or after a regex Split,
//    merges by rank over the byte-to-unicode alphabet, an optional NFC normalizer, the ByteLevel decoder;
//  - SentencePiece as JSON (Mixtral's / Llama's fast tokenizer): BPE with byte_fallback over "▁"-marked
//    text (Prepend + Replace normalizers, or a Metaspace pre-tokenizer), decoded by Replace, ByteFallback,
//    Fuse and Strip (or Metaspace).
// Added and special tokens are split out of the text first, as `tokenizers` does. Everything else (another
// model type, an unknown normalizer, pre-tokenizer, decoder or post-processor, an unknown field) is refused
// with one line naming it: a component read wrongly would give other ids than the model was trained on.
//
// Text that is not valid UTF-8 is read as `tokenizers` receives it from a host language: each maximal
// invalid subsequence becomes U+FFFD (what Rust's from_utf8_lossy, JS's TextDecoder and Python's
// errors="replace" do).
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moex {

// How the ByteFallback decoder writes a run of byte tokens ("<0xE8>" "<0x43>") that is not valid UTF-8 as
// a whole.
enum class ByteRuns {
  kTokenizers,     // as `tokenizers` does: every token of the run becomes U+FFFD (the fast tokenizer's text)
  kSentencePiece,  // as SentencePiece's DecodeIds (the slow tokenizer): the bytes that form a character print
                   // as it, each other byte as one U+FFFD. Decoding more ids then only adds text after what a
                   // shorter decode gave (up to a last, unfinished character), which streaming relies on.
};

class JsonTokenizer {
 public:
  // Parses the text of a tokenizer.json; `origin` names it in errors. Throws Error(kInvalidInput).
  static std::unique_ptr<JsonTokenizer> parse(std::string_view json_text, const std::string& origin);
  ~JsonTokenizer();

  // `tokenizers`' encode(text, add_special_tokens): the post-processor (e.g. Llama's "<s>" template) runs
  // only when add_special_tokens.
  std::vector<int> encode(std::string_view text, bool add_special_tokens) const;
  // `tokenizers`' decode(ids, skip_special_tokens); ids that name no token are skipped, as it does.
  // `byte_runs` changes only runs of byte tokens that are not UTF-8 (see ByteRuns).
  std::string decode(const std::vector<int>& ids, bool skip_special_tokens,
                     ByteRuns byte_runs = ByteRuns::kTokenizers) const;
  int vocab_size() const;                        // highest id + 1, added tokens included
  int token_to_id(std::string_view token) const;  // -1 when absent (added tokens first, then the model's)
  const std::string& model_kind() const;         // "byte-level BPE" or "SentencePiece-style BPE", for messages

  struct Impl;

 private:
  explicit JsonTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// UTF-8 with each maximal invalid subsequence replaced by U+FFFD (the Unicode / WHATWG practice).
std::string sanitize_utf8(std::string_view bytes);

// The pieces of `text` at each match of the PCRE2 (UTF + UCP) `pattern` and between them, as the Split
// pre-tokenizer's "Isolated" behaviour gives them; what a BPE trainer counts words with.
std::vector<std::string> split_isolated(std::string_view text, const std::string& pattern);

// GPT-2's split regex (the ByteLevel pre-tokenizer's when use_regex is true) and Qwen2's (its Split).
extern const char kGpt2SplitPattern[];
extern const char kQwen2SplitPattern[];

// GPT-2's byte-to-unicode map: byte b as the UTF-8 of the code point byte-level vocabularies use for it.
const std::string& byte_level_char(unsigned char b);

}  // namespace moex

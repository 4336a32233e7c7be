// Tokenizer: the checkpoint's own, as Hugging Face ships it. A model folder's tokenizer.json (byte-level
// BPE as GPT-2 / Qwen / OLMoE use, or the SentencePiece-as-JSON form of Llama / Mixtral's fast tokenizer;
// see tokenizer_json.h) is used when present, else its SentencePiece tokenizer.model. BOS and EOS come from
// tokenizer_config.json ("bos_token", "eos_token") when it names them, else from config.json
// (bos_token_id, eos_token_id), else from the tokenizer itself.
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moex {

class JsonTokenizer;
struct GgufContents;
// The tokenizer.json text that a GGUF file's "gpt2" (byte-level BPE) vocabulary describes (tokenizer.cc).
std::string gguf_byte_level_tokenizer_json(const GgufContents& gguf, const std::string& origin);

class Tokenizer {
 public:
  // `file` is a tokenizer.json or a tokenizer.model (told apart by the name); the folder it is in gives
  // tokenizer_config.json and config.json. Throws Error(kInvalidInput) naming the file.
  explicit Tokenizer(const std::string& file);
  // A serialized SentencePiece ModelProto built in memory (a GGUF file's vocabulary); `origin` names it.
  struct Proto {
    std::string bytes, origin;
  };
  explicit Tokenizer(const Proto& proto);
  // A tokenizer.json text built in memory (a GGUF file's "gpt2" vocabulary) with its BOS / EOS (-1: none).
  struct Json {
    std::string text, origin;
    int bos_id = -1, eos_id = -1;
  };
  explicit Tokenizer(const Json& json);
  // The tokenizer of a --model: the vocabulary of a .gguf file, else the folder's file_in(model).
  static Tokenizer for_model(const std::string& model);
  Tokenizer(Tokenizer&&) noexcept;
  ~Tokenizer();

  // The file a model folder's tokenizer is read from: DIR/tokenizer.json when it exists, else
  // DIR/tokenizer.model (which may not exist: loading it then gives the error).
  static std::string file_in(const std::string& model_dir);

  // add_special: what Hugging Face's add_special_tokens=True adds: for tokenizer.model the BOS piece, for
  // tokenizer.json its post-processor (Llama's "<s>" template; byte-level BPE usually adds nothing).
  std::vector<int> encode(const std::string& text, bool add_special) const;
  // Special tokens are left out (skip_special_tokens); ids that name no token are skipped. Byte pieces
  // ("<0xE8>") that form UTF-8 characters print as them and each other byte as U+FFFD, from tokenizer.json
  // too (SentencePiece's rule, where `tokenizers` writes U+FFFD for every piece of such a run): the text a
  // stream of deltas (text/stop_strings) adds up to, and what the same ids give from tokenizer.model.
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int bos_id() const { return bos_id_; }  // -1 when the tokenizer has none
  int eos_id() const { return eos_id_; }
  const std::string& file() const { return file_; }  // the file read
  std::string describe() const;                       // "tokenizer.json (byte-level BPE, 1234 tokens)"

 private:
  std::string file_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;  // tokenizer.model
  std::unique_ptr<JsonTokenizer> json_;                               // tokenizer.json
  int bos_id_ = -1, eos_id_ = -1;
};

}  // namespace moex

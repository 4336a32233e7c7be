// Tokenizer: the checkpoint's SentencePiece model (tokenizer.model), as Llama/Mixtral use it:
// BOS prepended on encode, byte fallback for anything outside the pieces.
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moex {

class Tokenizer {
 public:
  explicit Tokenizer(const std::string& model_path);  // throws Error(kInvalidInput) naming the file
  // A serialized SentencePiece ModelProto built in memory (a GGUF file's vocabulary); `origin` names it.
  struct Proto {
    std::string bytes, origin;
  };
  explicit Tokenizer(const Proto& proto);
  // The tokenizer of a --model: the folder's tokenizer.model, or the vocabulary of a .gguf file.
  static std::unique_ptr<Tokenizer> for_model(const std::string& model);
  ~Tokenizer();
  std::vector<int> encode(const std::string& text, bool add_bos) const;
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int bos_id() const;
  int eos_id() const;

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
};

}  // namespace moex

#include "moex/runtime/tokenizer.h"

#include <sentencepiece_processor.h>

#include "moex/base/error.h"
#include "moex/base/small_file.h"
#include "moex/model/gguf.h"

namespace moex {

Tokenizer::Tokenizer(const std::string& model_path)
    : processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  // Read here rather than by SentencePiece: its reader throws std::ios errors on a directory and blocks on
  // a FIFO; ours refuses anything but a regular file of sane size with the usual one-line input error.
  const std::string bytes = read_small_file(model_path, kMaxTokenizerFileBytes, "(the checkpoint's SentencePiece tokenizer.model)");
  const auto status = processor_->LoadFromSerializedProto(bytes);
  MOEX_CHECK_INPUT(status.ok(), "cannot load tokenizer ", model_path, ": ", status.ToString());
}

Tokenizer::Tokenizer(const Proto& proto) : processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const auto status = processor_->LoadFromSerializedProto(proto.bytes);
  MOEX_CHECK_INPUT(status.ok(), "cannot load the tokenizer of ", proto.origin, ": ", status.ToString());
}

std::unique_ptr<Tokenizer> Tokenizer::for_model(const std::string& model) {
  if (!is_gguf_path(model)) return std::make_unique<Tokenizer>(model + "/tokenizer.model");
  const GgufFile file(model);
  return std::make_unique<Tokenizer>(Proto{gguf_sentencepiece_proto(file.contents(), model), model});
}

Tokenizer::~Tokenizer() = default;

std::vector<int> Tokenizer::encode(const std::string& text, bool add_bos) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  MOEX_CHECK_INPUT(status.ok(), "tokenizer: cannot encode the prompt: ", status.ToString());
  if (add_bos && bos_id() >= 0) ids.insert(ids.begin(), bos_id());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string text;
  const auto status = processor_->Decode(ids, &text);
  MOEX_CHECK_INPUT(status.ok(), "tokenizer: cannot decode: ", status.ToString());
  return text;
}

int Tokenizer::vocab_size() const { return processor_->GetPieceSize(); }
int Tokenizer::bos_id() const { return processor_->bos_id(); }
int Tokenizer::eos_id() const { return processor_->eos_id(); }

}  // namespace moex

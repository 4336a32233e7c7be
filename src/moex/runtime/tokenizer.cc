#include "moex/runtime/tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/small_file.h"
#include "moex/model/gguf.h"
#include "moex/runtime/tokenizer_json.h"

namespace moex {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// tokenizer_config.json spells a token as "<s>", as {"content": "<s>", ...} or as null (no such token).
// Returns false when the field is absent, so that config.json may say instead.
bool config_token(const nlohmann::json& config, const char* key, const std::string& file, std::string* name,
                  bool* none) {
  auto it = config.find(key);
  if (it == config.end()) return false;
  *none = it->is_null();
  if (it->is_string()) *name = it->get<std::string>();
  else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) *name = (*it)["content"].get<std::string>();
  else MOEX_CHECK_INPUT(it->is_null(), file, ": \"", key, "\" must be a string, {\"content\": ...} or null");
  return true;
}

// config.json's bos_token_id / eos_token_id: an id, a list of ids (the first is the one added), or absent.
int config_id(const nlohmann::json& config, const char* key, const std::string& file) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return -2;
  const nlohmann::json& v = it->is_array() && !it->empty() ? (*it)[0] : *it;
  MOEX_CHECK_INPUT(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (int64_t{1} << 31), file,
                   ": \"", key, "\" must be a token id or a list of them");
  return static_cast<int>(v.get<int64_t>());
}

nlohmann::json read_json_if_present(const std::string& path) {
  if (!is_regular_file(path)) return nlohmann::json::object();
  const std::string text = read_small_file(path, kMaxJsonFileBytes);
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    MOEX_CHECK_INPUT(j.is_object(), path, ": expected a JSON object");
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

Tokenizer::Tokenizer(const Proto& proto)
    : file_(proto.origin), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const auto status = processor_->LoadFromSerializedProto(proto.bytes);
  MOEX_CHECK_INPUT(status.ok(), "cannot load the tokenizer of ", proto.origin, ": ", status.ToString());
  bos_id_ = processor_->bos_id();
  eos_id_ = processor_->eos_id();
}

Tokenizer Tokenizer::for_model(const std::string& model) {
  if (!is_gguf_path(model)) return Tokenizer(file_in(model));
  const GgufFile file(model);
  return Tokenizer(Proto{gguf_sentencepiece_proto(file.contents(), model), model});
}

std::string Tokenizer::file_in(const std::string& model_dir) {
  const std::string json_path = model_dir + "/tokenizer.json";
  std::error_code ec;
  if (std::filesystem::exists(json_path, ec)) return json_path;  // even when odd: its loader says what is wrong
  return model_dir + "/tokenizer.model";
}

Tokenizer::Tokenizer(const std::string& file) : file_(file) {
  const std::string dir = std::filesystem::path(file_).parent_path().string();
  const std::string folder = dir.empty() ? "." : dir;
  if (ends_with(file_, ".json")) {
    const std::string text = read_small_file(file_, kMaxTokenizerFileBytes, "(the checkpoint's tokenizer.json)");
    json_ = JsonTokenizer::parse(text, file_);
  } else {
    // Read here rather than by SentencePiece: its reader throws std::ios errors on a directory and blocks on
    // a FIFO; ours refuses anything but a regular file of sane size with the usual one-line input error.
    const std::string bytes = read_small_file(file_, kMaxTokenizerFileBytes, "(the checkpoint's SentencePiece tokenizer.model)");
    processor_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
    const auto status = processor_->LoadFromSerializedProto(bytes);
    MOEX_CHECK_INPUT(status.ok(), "cannot load tokenizer ", file_, ": ", status.ToString());
    bos_id_ = processor_->bos_id();
    eos_id_ = processor_->eos_id();
  }
  // BOS / EOS: tokenizer_config.json by name, else config.json by id, else the tokenizer's own.
  const std::string tc_path = folder + "/tokenizer_config.json", c_path = folder + "/config.json";
  const nlohmann::json tc = read_json_if_present(tc_path);
  const nlohmann::json config = read_json_if_present(c_path);
  for (auto [key, id_key, out] : {std::tuple{"bos_token", "bos_token_id", &bos_id_}, std::tuple{"eos_token", "eos_token_id", &eos_id_}}) {
    std::string name;
    bool none = false;
    if (config_token(tc, key, tc_path, &name, &none)) {
      if (none) {
        *out = -1;
        continue;
      }
      const int id = json_ ? json_->token_to_id(name) : processor_->PieceToId(name);
      MOEX_CHECK_INPUT(id >= 0 && (json_ || processor_->IdToPiece(id) == name), tc_path, ": ", key, " \"", name,
                       "\" is not a token of ", file_);
      *out = id;
    } else if (const int id = config_id(config, id_key, c_path); id != -2) {
      MOEX_CHECK_INPUT(id < vocab_size(), c_path, ": ", id_key, " ", id, " is outside the tokenizer's ", vocab_size(),
                       " tokens (", file_, ")");
      *out = id;
    }
  }
}

Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<int> Tokenizer::encode(const std::string& text, bool add_special) const {
  if (json_) return json_->encode(text, add_special);
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  MOEX_CHECK_INPUT(status.ok(), "tokenizer: cannot encode the prompt: ", status.ToString());
  if (add_special && bos_id() >= 0) ids.insert(ids.begin(), bos_id());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  if (json_) return json_->decode(ids, /*skip_special_tokens=*/true);
  std::vector<int> known;
  for (int id : ids)
    if (id >= 0 && id < processor_->GetPieceSize()) known.push_back(id);
  std::string text;
  const auto status = processor_->Decode(known, &text);
  MOEX_CHECK_INPUT(status.ok(), "tokenizer: cannot decode: ", status.ToString());
  return text;
}

int Tokenizer::vocab_size() const { return json_ ? json_->vocab_size() : processor_->GetPieceSize(); }

std::string Tokenizer::describe() const {
  const std::string name = std::filesystem::path(file_).filename().string();
  return name + " (" + (json_ ? json_->model_kind() : std::string("SentencePiece")) + ", " +
         std::to_string(vocab_size()) + " tokens)";
}

}  // namespace moex

#include "moex/text/tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/small_file.h"
#include "moex/model/gguf.h"
#include "moex/text/tokenizer_json.h"

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

// A GGUF "gpt2" vocabulary (byte-level BPE: tokenizer.ggml.tokens in id order, .merges as "a b", .token_type,
// .pre naming the pre-tokenizer) as the tokenizer.json Hugging Face ships for it, so that JsonTokenizer (the
// implementation checked against HF's `tokenizers`) runs it. The pre-tokenizers are llama.cpp's names for
// the models MoEX runs: "qwen2" (Qwen2 / Qwen3: Qwen2's Split regex, then ByteLevel without its regex, NFC)
// and "olmo" (OLMoE's GPT-NeoX tokenizer: ByteLevel with GPT-2's regex, NFC); others are refused. Control
// (3) and user-defined (4) tokens are added tokens, split out of the text first; control ones are special.
std::string gguf_byte_level_tokenizer_json(const GgufContents& g, const std::string& origin) {
  auto array = [&](const char* key, GgufType element) -> const GgufValue& {
    const GgufValue* v = g.find(key);
    MOEX_CHECK_INPUT(v && v->type == GgufType::kArray && v->element == element, origin, ": metadata has no array \"", key, "\"");
    return *v;
  };
  const GgufValue& tokens = array("tokenizer.ggml.tokens", GgufType::kString);
  const GgufValue& merges = array("tokenizer.ggml.merges", GgufType::kString);
  const GgufValue& types = array("tokenizer.ggml.token_type", GgufType::kI32);
  MOEX_CHECK_INPUT(types.count == tokens.count && tokens.count > 0, origin,
                   ": tokenizer.ggml.token_type must hold one type per token");
  const GgufValue* pre = g.find("tokenizer.ggml.pre");
  const std::string pre_name = pre && pre->type == GgufType::kString ? pre->s : "";
  using json = nlohmann::ordered_json;
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  json pre_tokenizer;
  if (pre_name == "qwen2") {
    const json split = {{"type", "Split"}, {"pattern", {{"Regex", std::string(kQwen2SplitPattern)}}}, {"behavior", "Isolated"}, {"invert", false}};
    pre_tokenizer = json{{"type", "Sequence"}, {"pretokenizers", json::array({split, byte_level})}};
  } else if (pre_name == "olmo") {
    pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  } else {
    throw_error(ErrorKind::kInvalidInput, origin + ": tokenizer.ggml.pre \"" + pre_name +
                                              "\" is not a byte-level pre-tokenizer MoEX knows (qwen2, olmo)");
  }
  json vocab = json::object(), added = json::array(), merge_list = json::array();
  for (uint64_t k = 0; k < tokens.count; ++k) {
    const std::string token(tokens.strings[k]);
    MOEX_CHECK_INPUT(!vocab.contains(token), origin, ": token ", k, " \"", token, "\" appears twice");
    vocab[token] = k;
    const int64_t type = types.integer_at(k);
    MOEX_CHECK_INPUT(type >= 1 && type <= 6, origin, ": token ", k, " has type ", type, " (1 to 6)");
    if (type == 3 || type == 4)
      added.push_back({{"id", k}, {"content", token}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", type == 3}});
  }
  for (uint64_t k = 0; k < merges.count; ++k) merge_list.push_back(std::string(merges.strings[k]));
  const json tokenizer = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}}, {"pre_tokenizer", pre_tokenizer}, {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                 {"vocab", vocab}, {"merges", merge_list}}}};
  return tokenizer.dump();
}

Tokenizer::Tokenizer(const Proto& proto)
    : file_(proto.origin), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const auto status = processor_->LoadFromSerializedProto(proto.bytes);
  MOEX_CHECK_INPUT(status.ok(), "cannot load the tokenizer of ", proto.origin, ": ", status.ToString());
  bos_id_ = processor_->bos_id();
  eos_id_ = processor_->eos_id();
}

Tokenizer::Tokenizer(const Json& json) : file_(json.origin) {
  json_ = JsonTokenizer::parse(json.text, json.origin);
  bos_id_ = json.bos_id, eos_id_ = json.eos_id;
}

Tokenizer Tokenizer::for_model(const std::string& model) {
  if (!is_gguf_path(model)) return Tokenizer(file_in(model));
  const GgufFile file(model);
  const GgufContents& g = file.contents();
  const GgufValue* kind = g.find("tokenizer.ggml.model");
  if (kind && kind->type == GgufType::kString && kind->s == "gpt2") {
    auto id = [&](const char* key) {
      const GgufValue* v = g.find(key);
      int64_t out = -1;
      MOEX_CHECK_INPUT(!v || (v->integer(&out) && out >= 0 && out < int64_t{1} << 31), model, ": ", key, " must be a token id");
      return static_cast<int>(out);
    };
    Tokenizer t(Json{gguf_byte_level_tokenizer_json(g, model), model, id("tokenizer.ggml.bos_token_id"),
                     id("tokenizer.ggml.eos_token_id")});
    MOEX_CHECK_INPUT(t.bos_id_ < t.vocab_size() && t.eos_id_ < t.vocab_size(), model, ": BOS / EOS ids outside the vocabulary");
    return t;
  }
  return Tokenizer(Proto{gguf_sentencepiece_proto(g, model), model});
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
  if (json_) return json_->decode(ids, /*skip_special_tokens=*/true, ByteRuns::kSentencePiece);
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

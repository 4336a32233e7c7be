#include "tools/lib/gguf_writer.h"

#include <sentencepiece_processor.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/progress.h"
#include "moex/base/small_file.h"
#include "moex/model/config.h"
#include "moex/model/safetensors.h"
#include "moex/text/chat_template.h"
#include "moex/text/tokenizer_json.h"

namespace moex::tools {
namespace {

template <typename T>
void put(std::string* out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out->append(b, sizeof(T));
}
void put_string(std::string* out, const std::string& s) {
  put<uint64_t>(out, s.size());
  *out += s;
}
void put_f16(std::vector<uint8_t>* out, float v) {
  const uint16_t h = f32_to_f16(v);
  out->push_back(static_cast<uint8_t>(h & 0xff));
  out->push_back(static_cast<uint8_t>(h >> 8));
}

}  // namespace

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kString)), put_string(&header_, value), ++n_kv_;
}
void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kU32)), put(&header_, value), ++n_kv_;
}
void GgufWriter::add_i32(const std::string& key, int32_t value) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kI32)), put(&header_, value), ++n_kv_;
}
void GgufWriter::add_f32(const std::string& key, float value) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kF32)), put(&header_, value), ++n_kv_;
}
void GgufWriter::add_bool(const std::string& key, bool value) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kBool)), put<uint8_t>(&header_, value), ++n_kv_;
}
void GgufWriter::add_string_array(const std::string& key, const std::vector<std::string>& values) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kArray));
  put<uint32_t>(&header_, uint32_t(GgufType::kString)), put<uint64_t>(&header_, values.size());
  for (const std::string& v : values) put_string(&header_, v);
  ++n_kv_;
}
void GgufWriter::add_f32_array(const std::string& key, const std::vector<float>& values) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kArray));
  put<uint32_t>(&header_, uint32_t(GgufType::kF32)), put<uint64_t>(&header_, values.size());
  for (float v : values) put(&header_, v);
  ++n_kv_;
}
void GgufWriter::add_i32_array(const std::string& key, const std::vector<int32_t>& values) {
  put_string(&header_, key), put<uint32_t>(&header_, uint32_t(GgufType::kArray));
  put<uint32_t>(&header_, uint32_t(GgufType::kI32)), put<uint64_t>(&header_, values.size());
  for (int32_t v : values) put(&header_, v);
  ++n_kv_;
}

void GgufWriter::add_tensor(const std::string& name, const std::vector<uint64_t>& ne, GgmlType type,
                            std::function<void(std::vector<uint8_t>*)> produce) {
  int64_t block = 0, block_bytes = 0;
  MOEX_CHECK(ggml_block_size(uint32_t(type), &block, &block_bytes) && !ne.empty() && ne[0] % block == 0,
             "tensor ", name, " cannot be stored as ", ggml_type_name(uint32_t(type)));
  uint64_t numel = 1;
  for (uint64_t n : ne) numel *= n;
  tensors_.push_back({name, ne, type, numel / block * block_bytes, std::move(produce)});
}

void GgufWriter::write(const std::string& path) const {
  std::string head;
  head += "GGUF";
  put<uint32_t>(&head, 3);
  put<uint64_t>(&head, tensors_.size());
  put<uint64_t>(&head, n_kv_ + 1);
  head += header_;
  put_string(&head, "general.alignment"), put<uint32_t>(&head, uint32_t(GgufType::kU32)), put<uint32_t>(&head, kAlignment);
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(&head, t.name);
    put<uint32_t>(&head, t.ne.size());
    for (uint64_t n : t.ne) put<uint64_t>(&head, n);
    put<uint32_t>(&head, uint32_t(t.type));
    put<uint64_t>(&head, offset);
    offset += (t.bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  head.resize((head.size() + kAlignment - 1) / kAlignment * kAlignment, '\0');
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  MOEX_CHECK_INPUT(f, "cannot create ", path);
  bool ok = std::fwrite(head.data(), 1, head.size(), f.get()) == head.size();
  std::vector<uint8_t> bytes;
  Progress progress("converting tensors", static_cast<double>(tensors_.size()), ProgressUnit::kItems);
  for (const Tensor& t : tensors_) {
    bytes.clear();
    t.produce(&bytes);
    progress.add(1);
    MOEX_CHECK(bytes.size() == t.bytes, "tensor ", t.name, " produced ", bytes.size(), " bytes, expected ", t.bytes);
    bytes.resize((bytes.size() + kAlignment - 1) / kAlignment * kAlignment, 0);
    ok = ok && std::fwrite(bytes.data(), 1, bytes.size(), f.get()) == bytes.size();
  }
  ok = ok && std::fflush(f.get()) == 0;
  MOEX_CHECK_INPUT(ok, "cannot write ", path, " (disk full?)");
}

// ---- Quantizers -------------------------------------------------------------------------------------------

void quantize_q8_0(const float* x, int64_t n, std::vector<uint8_t>* out) {
  for (int64_t b = 0; b < n; b += kQ8_0Block, x += kQ8_0Block) {
    float amax = 0.0f;
    for (int j = 0; j < kQ8_0Block; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(out, d);
    for (int j = 0; j < kQ8_0Block; ++j) out->push_back(static_cast<uint8_t>(static_cast<int8_t>(std::lround(x[j] * inv))));
  }
}

void quantize_q4_0(const float* x, int64_t n, std::vector<uint8_t>* out) {
  for (int64_t b = 0; b < n; b += kQ4_0Block, x += kQ4_0Block) {
    float m = 0.0f;
    for (int j = 0; j < kQ4_0Block; ++j)
      if (std::fabs(x[j]) > std::fabs(m)) m = x[j];
    const float d = m / -8.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(out, d);
    auto q = [&](float v) { return static_cast<uint8_t>(std::clamp<long>(std::lround(v * inv) + 8, 0, 15)); };
    for (int j = 0; j < kQ4_0Block / 2; ++j) out->push_back(q(x[j]) | q(x[j + kQ4_0Block / 2]) << 4);
  }
}

void quantize_q4_k(const float* x, int64_t n, std::vector<uint8_t>* out) {
  for (int64_t b = 0; b < n; b += kQ4_KBlock, x += kQ4_KBlock) {
    float scale[8], min[8], max_scale = 0.0f, max_min = 0.0f;
    for (int s = 0; s < 8; ++s) {
      const float* v = x + 32 * s;
      float lo = 0.0f, hi = v[0];
      for (int l = 0; l < 32; ++l) lo = std::min(lo, v[l]), hi = std::max(hi, v[l]);
      scale[s] = (hi - lo) / 15.0f;
      min[s] = -lo;
      max_scale = std::max(max_scale, scale[s]);
      max_min = std::max(max_min, min[s]);
    }
    // The super-block scales as stored (f16), so the 6-bit and 4-bit codes are chosen against them.
    const float d = f16_to_f32(f32_to_f16(max_scale / 63.0f)), dmin = f16_to_f32(f32_to_f16(max_min / 63.0f));
    uint8_t sc[8], mn[8];
    for (int s = 0; s < 8; ++s) {
      sc[s] = d > 0 ? static_cast<uint8_t>(std::clamp<long>(std::lround(scale[s] / d), 0, 63)) : 0;
      mn[s] = dmin > 0 ? static_cast<uint8_t>(std::clamp<long>(std::lround(min[s] / dmin), 0, 63)) : 0;
    }
    put_f16(out, d);
    put_f16(out, dmin);
    uint8_t packed[12];
    for (int j = 0; j < 4; ++j) {
      packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
      packed[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
      packed[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    out->insert(out->end(), packed, packed + 12);
    uint8_t q[256];
    for (int s = 0; s < 8; ++s) {
      const float step = d * sc[s], offset = dmin * mn[s];
      for (int l = 0; l < 32; ++l) {
        const float v = x[32 * s + l];
        q[32 * s + l] = step > 0 ? static_cast<uint8_t>(std::clamp<long>(std::lround((v + offset) / step), 0, 15)) : 0;
      }
    }
    for (int chunk = 0; chunk < 4; ++chunk)
      for (int l = 0; l < 32; ++l) out->push_back(q[64 * chunk + l] | q[64 * chunk + 32 + l] << 4);
  }
}

bool gguf_convert_type(const std::string& name, GgmlType* out) {
  if (name == "f32") *out = GgmlType::kF32;
  else if (name == "f16") *out = GgmlType::kF16;
  else if (name == "bf16") *out = GgmlType::kBF16;
  else if (name == "q8_0") *out = GgmlType::kQ8_0;
  else if (name == "q4_0") *out = GgmlType::kQ4_0;
  else if (name == "q4_K") *out = GgmlType::kQ4_K;
  else return false;
  return true;
}

// ---- Conversion -------------------------------------------------------------------------------------------

namespace {

// `rows` x `cols` weights of `view` starting at row `row0`, as f32, rows optionally taken through `perm`.
std::vector<float> rows_f32(const TensorView& view, int64_t row0, int64_t rows, int64_t cols,
                            const std::function<int64_t(int64_t)>& perm = nullptr) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t src = row0 + (perm ? perm(r) : r);
    for (int64_t k = 0; k < cols; ++k) {
      const int64_t i = src * cols + k;
      out[r * cols + k] = view.dtype == DType::kF32 ? view.as<float>()[i] : bf16_to_f32(view.as<uint16_t>()[i]);
    }
  }
  return out;
}

void encode(const std::vector<float>& x, int64_t cols, GgmlType type, std::vector<uint8_t>* out) {
  switch (type) {
    case GgmlType::kF32: {
      const size_t at = out->size();
      out->resize(at + x.size() * 4);
      std::memcpy(out->data() + at, x.data(), x.size() * 4);
      return;
    }
    case GgmlType::kF16:
      for (float v : x) put_f16(out, v);
      return;
    case GgmlType::kBF16:
      for (float v : x) {
        const uint16_t h = f32_to_bf16(v);
        out->push_back(h & 0xff), out->push_back(h >> 8);
      }
      return;
    case GgmlType::kQ8_0:
      for (size_t r = 0; r < x.size(); r += cols) quantize_q8_0(x.data() + r, cols, out);
      return;
    case GgmlType::kQ4_0:
      for (size_t r = 0; r < x.size(); r += cols) quantize_q4_0(x.data() + r, cols, out);
      return;
    case GgmlType::kQ4_K:
      for (size_t r = 0; r < x.size(); r += cols) quantize_q4_k(x.data() + r, cols, out);
      return;
  }
}

uint32_t file_type(GgmlType t) {  // llama.cpp's LLAMA_FTYPE_* for general.file_type
  switch (t) {
    case GgmlType::kF32: return 0;
    case GgmlType::kF16: return 1;
    case GgmlType::kQ4_0: return 2;
    case GgmlType::kQ8_0: return 7;
    case GgmlType::kQ4_K: return 14;  // Q4_K_S: every weight matrix Q4_K
    case GgmlType::kBF16: return 32;
  }
  return 0;
}

}  // namespace

// A byte-level BPE tokenizer.json (Qwen2 / Qwen3 / OLMoE) as llama.cpp's converter writes it: tokenizer.ggml.model
// "gpt2", every id's token (ids past the tokenizer's are "[PAD<id>]" padding, as llama.cpp's converter names
// them), the merges as "a b", the token types (added special tokens 3 "control", other added tokens 4
// "user defined", the rest 1) and the pre-tokenizer's name: "qwen2" for Qwen2's Split regex before a
// ByteLevel without its own regex, "olmo" for a ByteLevel with GPT-2's regex; both with an NFC normalizer.
// Returns false when `json_text` is empty or not byte-level (the SentencePiece path then applies); anything
// else the reader could not run back exactly is refused.
bool add_byte_level_vocabulary(GgufWriter& w, const std::string& json_text, const ModelConfig& c, const std::string& origin) {
  if (json_text.empty()) return false;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, origin + ": not valid JSON (" + e.what() + ")");
  }
  const nlohmann::json pre = j.value("pre_tokenizer", nlohmann::json());
  auto is_byte_level = [](const nlohmann::json& p, bool regex) {
    return p.is_object() && p.value("type", "") == "ByteLevel" && p.value("use_regex", true) == regex &&
           !p.value("add_prefix_space", false);
  };
  std::string pre_name;
  if (is_byte_level(pre, true)) {
    pre_name = "olmo";
  } else if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
             pre["pretokenizers"].size() == 2 && is_byte_level(pre["pretokenizers"][1], false)) {
    const nlohmann::json& split = pre["pretokenizers"][0];
    MOEX_CHECK_INPUT(split.value("type", "") == "Split" && split.contains("pattern") && split["pattern"].is_object() &&
                         split["pattern"].value("Regex", "") == kQwen2SplitPattern && split.value("behavior", "") == "Isolated",
                     origin, ": a byte-level pre-tokenizer other than Qwen2's or GPT-2's is not written to GGUF");
    pre_name = "qwen2";
  } else {
    return false;  // SentencePiece-style (Mixtral's fast tokenizer): tokenizer.model is written instead
  }
  const nlohmann::json nfc = {{"type", "NFC"}};
  MOEX_CHECK_INPUT(j.value("normalizer", nlohmann::json()) == nfc, origin,
                   ": a byte-level tokenizer without an NFC normalizer has no GGUF pre-tokenizer MoEX reads back");
  const nlohmann::json& model = j["model"];
  MOEX_CHECK_INPUT(model.is_object() && model.value("type", "") == "BPE" && model["vocab"].is_object() &&
                       model["merges"].is_array(), origin, ": model must be BPE with a vocab and merges");
  std::vector<std::string> tokens(c.vocab_size);
  std::vector<int32_t> types(c.vocab_size, 1);
  std::vector<bool> seen(c.vocab_size, false);
  auto place = [&](const std::string& token, int64_t id, int32_t type) {
    MOEX_CHECK_INPUT(id >= 0 && id < c.vocab_size, origin, ": token \"", token, "\" has id ", id, ", outside vocab_size ",
                     c.vocab_size);
    tokens[id] = token, types[id] = type, seen[id] = true;
  };
  for (const auto& [token, id] : model["vocab"].items()) place(token, id.get<int64_t>(), 1);
  for (const nlohmann::json& t : j.value("added_tokens", nlohmann::json::array()))
    place(t.at("content").get<std::string>(), t.at("id").get<int64_t>(), t.value("special", false) ? 3 : 4);
  for (int id = 0; id < c.vocab_size; ++id)
    if (!seen[id]) tokens[id] = "[PAD" + std::to_string(id) + "]", types[id] = 4;
  std::vector<std::string> merges;
  for (const nlohmann::json& m : model["merges"])
    merges.push_back(m.is_string() ? m.get<std::string>() : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", pre_name);
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", merges);
  if (c.has_bos) w.add_u32("tokenizer.ggml.bos_token_id", c.bos_token_id);
  w.add_u32("tokenizer.ggml.eos_token_id", c.eos_token_id);
  w.add_bool("tokenizer.ggml.add_bos_token", false);
  return true;
}

std::string convert_to_gguf(const std::string& model_dir, const std::string& path, GgmlType type) {
  const ModelConfig c = load_model_config(model_dir + "/config.json");
  const FamilyInfo& info = c.info();
  const std::string arch = info.gguf_arch, a = arch + ".";
  const bool llama = info.gguf_llama_layout;
  // What llama.cpp's architecture cannot say is refused rather than written as a file it would run wrongly.
  MOEX_CHECK_INPUT(c.decoder_sparse_step == 1, model_dir, ": decoder_sparse_step ", c.decoder_sparse_step,
                   " is not written (give the dense layers as mlp_only_layers)");
  const auto store = std::make_shared<WeightStore>(model_dir);

  GgufWriter w;
  w.add_string("general.architecture", arch);
  w.add_string("general.name", "moex-converted");
  w.add_u32("general.file_type", file_type(type));
  w.add_u32("general.quantization_version", 2);
  w.add_u32(a + "context_length", c.max_position_embeddings);
  w.add_u32(a + "embedding_length", c.hidden_size);
  w.add_u32(a + "block_count", c.num_hidden_layers);
  // llama / olmoe: the expert width; the others: the dense MLP's, with the expert's in expert_feed_forward_length.
  const bool expert_ffn_key = info.moe_intermediate;
  w.add_u32(a + "feed_forward_length", expert_ffn_key ? c.dense_intermediate_size : c.intermediate_size);
  if (expert_ffn_key) w.add_u32(a + "expert_feed_forward_length", c.intermediate_size);
  w.add_u32(a + "rope.dimension_count", c.head_dim);
  w.add_u32(a + "attention.head_count", c.num_attention_heads);
  w.add_u32(a + "attention.head_count_kv", c.num_key_value_heads);
  w.add_f32(a + "rope.freq_base", c.rope_theta);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", c.rms_norm_eps);
  w.add_u32(a + "expert_count", c.num_local_experts);
  w.add_u32(a + "expert_used_count", c.num_experts_per_tok);
  w.add_u32(a + "vocab_size", c.vocab_size);
  if (c.head_dim * c.num_attention_heads != c.hidden_size) {
    w.add_u32(a + "attention.key_length", c.head_dim);
    w.add_u32(a + "attention.value_length", c.head_dim);
  }
  const bool hard_wired_norm = info.gguf_topk_norm == GgufTopkNorm::kAlways;
  if (!llama && info.gguf_topk_norm != GgufTopkNorm::kKey && c.norm_topk_prob != hard_wired_norm)
    std::fprintf(stderr, "moex convert: note: norm_topk_prob is %s, but llama.cpp's %s always runs it as %s: MoEX reads "
                 "%s.expert_weights_norm, llama.cpp will run this file differently\n", c.norm_topk_prob ? "true" : "false",
                 arch.c_str(), hard_wired_norm ? "true" : "false", arch.c_str());
  // Top-k renormalisation: llama.cpp hard-wires it for llama (true), qwen3moe (true), qwen2moe and olmoe
  // (false) and reads this key for dots1; written for every family so that MoEX's reader need not guess.
  if (!llama) w.add_bool(a + "expert_weights_norm", c.norm_topk_prob);
  if (info.shared_experts == SharedExperts::kGated)
    w.add_u32(a + "expert_shared_feed_forward_length", c.shared_expert_intermediate_size);
  if (info.dense_layers == DenseLayers::kFirstK) w.add_u32(a + "leading_dense_block_count", c.first_k_dense_replace);
  if (info.shared_experts == SharedExperts::kCount) w.add_u32(a + "expert_shared_count", c.n_shared_experts);
  if (info.scoring == RouterScoring::kSigmoidGrouped) {
    w.add_f32(a + "expert_weights_scale", c.routed_scaling_factor);
    w.add_u32(a + "expert_gating_func", 2);  // llama_expert_gating_func_type: sigmoid
    if (c.n_group > 1) {
      w.add_u32(a + "expert_group_count", c.n_group);
      w.add_u32(a + "expert_group_used_count", c.topk_group);
    }
  }
  const std::string json_path = model_dir + "/tokenizer.json";
  const std::string json_text = std::filesystem::exists(json_path)
                                   ? read_small_file(json_path, kMaxTokenizerFileBytes, "(the checkpoint's tokenizer.json)")
                                   : std::string();
  if (!add_byte_level_vocabulary(w, json_text, c, json_path)) {
    MOEX_CHECK_INPUT(std::filesystem::exists(model_dir + "/tokenizer.model"), model_dir,
                     ": has neither a byte-level BPE tokenizer.json (written as tokenizer.ggml.model \"gpt2\") nor a "
                     "SentencePiece tokenizer.model (\"llama\")");
    sentencepiece::SentencePieceProcessor sp;
    const std::string proto = read_small_file(model_dir + "/tokenizer.model", kMaxTokenizerFileBytes, "(SentencePiece)");
    const auto status = sp.LoadFromSerializedProto(proto);
    MOEX_CHECK_INPUT(status.ok(), "cannot load ", model_dir, "/tokenizer.model: ", status.ToString());
    // The vocabulary as llama.cpp's converter writes a SentencePiece model: every id up to vocab_size (ids past
    // the tokenizer's pieces are padding, as HF pads the embedding), its score and type.
    std::vector<std::string> tokens;
    std::vector<float> scores;
    std::vector<int32_t> types;
    MOEX_CHECK_INPUT(sp.GetPieceSize() <= c.vocab_size, "tokenizer.model has ", sp.GetPieceSize(),
                     " pieces, more than vocab_size ", c.vocab_size);
    for (int id = 0; id < c.vocab_size; ++id) {
      if (id >= sp.GetPieceSize()) {
        tokens.push_back("[PAD" + std::to_string(id) + "]"), scores.push_back(-1000.0f), types.push_back(5);
        continue;
      }
      tokens.push_back(sp.IdToPiece(id));
      scores.push_back(sp.GetScore(id));
      types.push_back(sp.IsUnknown(id) ? 2 : sp.IsControl(id) ? 3 : sp.IsUnused(id) ? 5 : sp.IsByte(id) ? 6 : 1);
    }
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string("tokenizer.ggml.pre", "default");
    w.add_string_array("tokenizer.ggml.tokens", tokens);
    w.add_f32_array("tokenizer.ggml.scores", scores);
    w.add_i32_array("tokenizer.ggml.token_type", types);
    if (c.has_bos) w.add_u32("tokenizer.ggml.bos_token_id", c.bos_token_id);
    w.add_u32("tokenizer.ggml.eos_token_id", c.eos_token_id);
    w.add_u32("tokenizer.ggml.unknown_token_id", std::max(sp.unk_id(), 0));
    w.add_bool("tokenizer.ggml.add_bos_token", c.has_bos);
    w.add_bool("tokenizer.ggml.add_eos_token", false);
    w.add_bool("tokenizer.ggml.add_space_prefix", true);
  }

  // The chat template as llama.cpp's converter copies it (the "default" one of a list of named templates).
  if (const std::string chat = ChatTemplate::shipped_source(model_dir); !chat.empty())
    w.add_string("tokenizer.chat_template", chat);

  std::map<GgmlType, int> written;
  // A 2-D weight of `cols` per row in `type`, or the fallback when its rows do not hold whole blocks.
  auto weight_type = [&](int64_t cols) {
    int64_t block = 0, bytes = 0;
    for (GgmlType t : {type, GgmlType::kQ8_0, GgmlType::kF16}) {
      ggml_block_size(uint32_t(t), &block, &bytes);
      if (cols % block == 0) return t;
    }
    return GgmlType::kF16;
  };
  // HF tensor `hf` (rows x cols) as GGUF tensor `name` of dims `ne`; `perm` maps a GGUF row to its HF row.
  auto add = [&](const std::string& name, std::vector<uint64_t> ne, GgmlType t, std::vector<std::string> hf,
                 int64_t rows, int64_t cols, std::function<int64_t(int64_t)> perm = nullptr) {
    std::vector<TensorView> views;
    for (const std::string& h : hf) views.push_back(store->get(h));
    ++written[t];
    w.add_tensor(name, ne, t, [views, rows, cols, t, perm](std::vector<uint8_t>* out) {
      for (const TensorView& v : views) encode(rows_f32(v, 0, rows, cols, perm), cols, t, out);
    });
  };
  const int64_t hd = c.head_dim;
  // llama.cpp's llama architecture applies rotary embeddings to adjacent pairs; HF's Mixtral to the two
  // halves of each head. The converter therefore stores HF row (h * hd/2 + j) of a head at row (2 j + h).
  // The other architectures use NEOX rotary (the halves, as HF) and are stored unpermuted.
  auto rotary = [hd](int64_t r) {
    const int64_t head = r / hd, within = r % hd;
    return head * hd + (within % 2) * (hd / 2) + within / 2;
  };
  for (const GgufTensorName& t : gguf_tensor_names(c)) {
    const auto rows = uint64_t(t.rows), cols = uint64_t(t.cols);
    const GgmlType as = t.always_f32 ? GgmlType::kF32 : weight_type(t.cols);
    switch (t.kind) {
      case GgufTensorName::Kind::kVector: add(t.gguf, {cols}, GgmlType::kF32, t.hf, 1, t.cols); break;
      case GgufTensorName::Kind::kMatrix:
        add(t.gguf, {cols, rows}, as, t.hf, t.rows, t.cols, t.rotary ? std::function<int64_t(int64_t)>(rotary) : nullptr);
        break;
      case GgufTensorName::Kind::kExperts: add(t.gguf, {cols, rows, uint64_t(t.hf.size())}, as, t.hf, t.rows, t.cols); break;
    }
  }
  w.write(path);
  std::string summary;
  for (const auto& [t, n] : written) summary += (summary.empty() ? "" : ", ") + std::to_string(n) + " " + ggml_type_name(uint32_t(t));
  return summary;
}

}  // namespace moex::tools

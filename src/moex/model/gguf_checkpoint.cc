// GGUF metadata -> ModelConfig, GGUF tensors -> the Hugging Face names and layouts, and the vocabulary ->
// a SentencePiece ModelProto. The conventions are llama.cpp's for its architectures llama (with experts:
// Mixtral), qwen2moe, qwen3moe, olmoe and dots1: see docs/model.md.
#include <cmath>
#include <cstring>
#include <set>

#include "moex/base/error.h"
#include "moex/base/system_memory.h"
#include "moex/model/gguf.h"

namespace moex {
namespace {

int64_t get_int(const GgufContents& g, const std::string& origin, const std::string& key, int64_t fallback, bool required,
                int64_t lo = 1, int64_t hi = INT32_MAX) {
  const GgufValue* v = g.find(key);
  if (!v) {
    if (required) throw_input_error(origin, "metadata has no \"" + key + "\"");
    return fallback;
  }
  int64_t out = 0;
  if (!v->integer(&out)) throw_input_error(origin, "metadata \"" + key + "\" must be an integer, got " + v->str());
  if (out < lo || out > hi)
    throw_input_error(origin, "metadata \"" + key + "\" is " + std::to_string(out) + ", outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return out;
}

double get_float(const GgufContents& g, const std::string& origin, const std::string& key, double fallback, bool required) {
  const GgufValue* v = g.find(key);
  if (!v) {
    if (required) throw_input_error(origin, "metadata has no \"" + key + "\"");
    return fallback;
  }
  if (v->type != GgufType::kF32 && v->type != GgufType::kF64)
    throw_input_error(origin, "metadata \"" + key + "\" must be a float, got " + v->str());
  if (!std::isfinite(v->f) || v->f <= 0) throw_input_error(origin, "metadata \"" + key + "\" must be finite and positive, got " + v->str());
  return v->f;
}

const GgufValue* get_array(const GgufContents& g, const std::string& origin, const std::string& key, GgufType element) {
  const GgufValue* v = g.find(key);
  if (!v) return nullptr;
  if (v->type != GgufType::kArray || v->element != element)
    throw_input_error(origin, "metadata \"" + key + "\" must be an array of " + (element == GgufType::kString ? "strings" : "numbers") +
                     ", got " + v->str());
  return v;
}

// The {arch}.* keys llama.cpp's converter writes for these families and MoEX uses (the suffix after the
// architecture's name); any other key of the architecture could change the computation (rope scaling,
// sliding windows, logit soft-capping...) and is refused.
const std::set<std::string> kCommonKeys = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "expert_count", "expert_used_count", "vocab_size", "attention.key_length", "attention.value_length",
    "expert_weights_norm"};
// The keys the family's features add (families.h), beyond the common ones.
bool family_key(const FamilyInfo& f, const std::string& suffix) {
  if (f.moe_intermediate && suffix == "expert_feed_forward_length") return true;
  if (f.shared_experts == SharedExperts::kGated && suffix == "expert_shared_feed_forward_length") return true;
  if (f.shared_experts == SharedExperts::kCount && suffix == "expert_shared_count") return true;
  if (f.dense_layers == DenseLayers::kFirstK && suffix == "leading_dense_block_count") return true;
  return f.scoring == RouterScoring::kSigmoidGrouped &&
         (suffix == "expert_weights_scale" || suffix == "expert_gating_func" || suffix == "expert_group_count" ||
          suffix == "expert_group_used_count");
}

bool get_bool(const GgufContents& g, const std::string& origin, const std::string& key, bool fallback) {
  const GgufValue* v = g.find(key);
  if (!v) return fallback;
  if (v->type != GgufType::kBool) throw_input_error(origin, "metadata \"" + key + "\" must be a bool, got " + v->str());
  return v->u != 0;
}

}  // namespace

ModelConfig gguf_model_config(const GgufContents& g, const std::string& origin) {
  const GgufValue* arch_value = g.find("general.architecture");
  if (!arch_value || arch_value->type != GgufType::kString) throw_input_error(origin, "metadata has no string \"general.architecture\"");
  const std::string arch = arch_value->s;
  const FamilyInfo* found = nullptr;
  std::string names;
  for (const FamilyInfo& f : kFamilies) {
    if (arch == f.gguf_arch) found = &f;
    names += (names.empty() ? "" : ", ") + std::string(f.gguf_arch) + (f.gguf_llama_layout ? " (with experts)" : "");
  }
  if (!found)
    throw_input_error(origin, "general.architecture is \"" + arch + "\": MoEX loads GGUF files of the architectures " +
                     names + (arch == "deepseek2" ? " (deepseek2 uses multi-head latent attention, which MoEX does not run)" : ""));
  const FamilyInfo& info = *found;
  const bool llama = info.gguf_llama_layout;
  for (const auto& [key, value] : g.metadata) {
    const std::string prefix = key.substr(0, key.find('.'));
    if (prefix == "general" || prefix == "tokenizer" || prefix == "quantize") continue;  // not the computation
    if (prefix == "split") {
      int64_t parts = 0;
      if (key == "split.count" && !(value.integer(&parts) && parts <= 1))
        throw_input_error(origin, "is one part of a split GGUF (split.count " + value.str() +
                         "): merge the parts first (llama-gguf-split --merge)");
      continue;
    }
    if (prefix != arch) throw_input_error(origin, "metadata key \"" + key + "\" belongs to no architecture MoEX loads");
    const std::string suffix = key.substr(arch.size() + 1);
    if (kCommonKeys.count(suffix) || family_key(info, suffix)) continue;
    if (suffix == "rope.scaling.type" && value.type == GgufType::kString && value.s == "none") continue;
    throw_input_error(origin, "metadata key \"" + key + "\" (" + value.str() + ") is not supported: MoEX would run the model wrongly");
  }
  const std::string a = arch + ".";
  ModelConfig c;
  c.family = info.family;
  c.model_type = info.model_type;
  c.qk_norm = info.qk_norm;
  c.scoring = info.scoring;
  c.hidden_size = static_cast<int>(get_int(g, origin, a + "embedding_length", 0, true));
  c.num_hidden_layers = static_cast<int>(get_int(g, origin, a + "block_count", 0, true));
  c.num_attention_heads = static_cast<int>(get_int(g, origin, a + "attention.head_count", 0, true));
  c.num_key_value_heads = static_cast<int>(get_int(g, origin, a + "attention.head_count_kv", c.num_attention_heads, false));
  c.max_position_embeddings = static_cast<int>(get_int(g, origin, a + "context_length", 0, true));
  if (!g.find(a + "expert_count"))
    throw_input_error(origin, "has no " + a + "expert_count: a dense " + arch + " model, and MoEX runs Mixture-of-Experts models only");
  c.num_local_experts = static_cast<int>(get_int(g, origin, a + "expert_count", 0, true));
  c.num_experts_per_tok = static_cast<int>(get_int(g, origin, a + "expert_used_count", 0, true));
  const bool has_key_length = g.find(a + "attention.key_length") != nullptr;
  if (c.hidden_size % c.num_attention_heads != 0 && !g.find(a + "rope.dimension_count") && !has_key_length)
    throw_input_error(origin, a + "embedding_length is not a multiple of " + a + "attention.head_count");
  const int64_t default_head = c.hidden_size / c.num_attention_heads;
  if (llama) {  // llama.cpp's llama: the head is the rotary dimension; key/value lengths must agree with it
    c.head_dim = static_cast<int>(get_int(g, origin, a + "rope.dimension_count", default_head, false));
  } else {  // the others: the key length is the head (qwen3moe / dots1 head_dim), all of it rotated
    c.head_dim = static_cast<int>(get_int(g, origin, a + "attention.key_length", default_head, false));
  }
  for (const std::string& key : {a + "attention.key_length", a + "attention.value_length", a + "rope.dimension_count"}) {
    if (get_int(g, origin, key, c.head_dim, false) != c.head_dim)
      throw_input_error(origin, key + " differs from the head dimension " + std::to_string(c.head_dim) +
                       ": partial rotary embeddings and key/value heads of different widths are not supported");
  }
  // Expert width: feed_forward_length in llama and olmoe (every layer is MoE); expert_feed_forward_length in
  // the others, whose feed_forward_length is the dense MLP's.
  if (!info.moe_intermediate) {
    c.intermediate_size = static_cast<int>(get_int(g, origin, a + "feed_forward_length", 0, true));
  } else {
    c.intermediate_size = static_cast<int>(get_int(g, origin, a + "expert_feed_forward_length", 0, true));
    c.dense_intermediate_size = static_cast<int>(get_int(g, origin, a + "feed_forward_length", 0, false, 0));
  }
  // Renormalising the top-k weights: llama.cpp hard-wires it per architecture (llama and qwen3moe do, qwen2moe
  // and olmoe do not) and reads expert_weights_norm (default false) for dots1; a file may say otherwise.
  const bool norm_default = info.gguf_topk_norm == GgufTopkNorm::kAlways;
  c.norm_topk_prob = get_bool(g, origin, a + "expert_weights_norm", norm_default);
  if (info.shared_experts == SharedExperts::kGated) {
    c.shared_expert_intermediate_size =
        static_cast<int>(get_int(g, origin, a + "expert_shared_feed_forward_length", 0, true));
    c.shared_expert_gate = true;
  }
  if (info.qkv_bias_key) c.qkv_bias = g.tensor("blk.0.attn_q.bias") != nullptr;
  if (info.dense_layers == DenseLayers::kSparseStep) {
    // llama.cpp's qwen architectures have no key for HF's mlp_only_layers / decoder_sparse_step: a layer
    // without a router (blk.N.ffn_gate_inp) is dense, as MoEX's converter writes them (llama.cpp refuses
    // such files: it needs a router in every layer).
    // A block with no router must still be a block (its attention norm is there): a block_count beyond the
    // file's blocks is refused here, before it sizes the list.
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      if (g.tensor(b + "ffn_gate_inp.weight")) continue;
      if (!g.tensor(b + "attn_norm.weight"))
        throw_input_error(origin, a + "block_count is " + std::to_string(c.num_hidden_layers) + " but the file has no " +
                                      b + "attn_norm.weight");
      c.mlp_only_layers.push_back(l);
    }
  }
  if (info.dense_layers == DenseLayers::kFirstK)
    c.first_k_dense_replace = static_cast<int>(get_int(g, origin, a + "leading_dense_block_count", 0, false, 0));
  if (info.shared_experts == SharedExperts::kCount) {
    c.n_shared_experts = static_cast<int>(get_int(g, origin, a + "expert_shared_count", 0, true));
    if (int64_t{c.n_shared_experts} * c.intermediate_size > INT32_MAX)
      throw_input_error(origin, a + "expert_shared_count x " + a + "expert_feed_forward_length is out of range");
    c.shared_expert_intermediate_size = c.n_shared_experts * c.intermediate_size;
  }
  if (info.scoring == RouterScoring::kSigmoidGrouped) {
    c.routed_scaling_factor = static_cast<float>(get_float(g, origin, a + "expert_weights_scale", 1.0, false));
    // llama_expert_gating_func_type: 1 softmax, 2 sigmoid. dots1 scores with a sigmoid (DeepSeek-V3's noaux_tc).
    if (get_int(g, origin, a + "expert_gating_func", 2, false, 0, 3) != 2)
      throw_input_error(origin, a + "expert_gating_func is not 2 (sigmoid): " + info.model_type +
                                    "'s router scores with a sigmoid");
    c.n_group = static_cast<int>(get_int(g, origin, a + "expert_group_count", 1, false));
    c.topk_group = static_cast<int>(get_int(g, origin, a + "expert_group_used_count", 1, false));
  }
  c.rms_norm_eps = static_cast<float>(get_float(g, origin, a + "attention.layer_norm_rms_epsilon", 0, true));
  c.rope_theta = static_cast<float>(get_float(g, origin, a + "rope.freq_base", 10000.0, false));
  const GgufValue* tokens = get_array(g, origin, "tokenizer.ggml.tokens", GgufType::kString);
  const GgufTensorInfo* embd = g.tensor("token_embd.weight");
  if (!embd || embd->ne.size() != 2) throw_input_error(origin, "has no 2-D tensor \"token_embd.weight\"");
  c.vocab_size = static_cast<int>(get_int(g, origin, a + "vocab_size", tokens ? static_cast<int64_t>(tokens->count) : 0, !tokens));
  c.tie_word_embeddings = g.tensor("output.weight") == nullptr;
  // No BOS id (OLMoE's config has bos_token_id null): no BOS, except for llama files, which default to 1.
  c.has_bos = llama || g.find("tokenizer.ggml.bos_token_id") != nullptr;
  c.bos_token_id = c.has_bos ? static_cast<int>(get_int(g, origin, "tokenizer.ggml.bos_token_id", 1, false, 0)) : -1;
  c.eos_token_id = static_cast<int>(get_int(g, origin, "tokenizer.ggml.eos_token_id", 2, false, 0));
  c.torch_dtype = embd->type == static_cast<uint32_t>(GgmlType::kBF16) ? "bfloat16" : "float32";
  try {
    validate_model_config(c);
  } catch (const Error& e) {
    throw_input_error(origin, e.what());
  }
  return c;
}

ModelConfig load_checkpoint_config(const std::string& model) {
  if (!is_gguf_path(model)) return load_model_config(model + "/config.json");
  const GgufFile file(model);
  return gguf_model_config(file.contents(), model);
}

namespace {

// Maps GGUF tensors onto HF names; every tensor of the file must be used exactly once.
class Mapper {
 public:
  Mapper(GgufCheckpoint& ck, const std::string& origin) : ck_(ck), g_(ck.file->contents()), origin_(origin) {}

  // The GGUF tensor `name` with exactly the dims `ne` (ggml order).
  const GgufTensorInfo& get(const std::string& name, std::vector<uint64_t> ne) {
    const GgufTensorInfo* t = g_.tensor(name);
    if (!t) throw_input_error(origin_, "has no tensor \"" + name + "\"");
    if (t->ne != ne) throw_input_error(origin_, "tensor \"" + name + "\" has dims " + dims(t->ne) + " but the metadata implies " + dims(ne));
    used_.insert(name);
    return *t;
  }

  // Rows [row0, row0 + rows) of `t` seen as a matrix of ne[0] columns, as HF tensor `hf` of shape `shape`.
  // `head_dim` > 0 undoes llama.cpp's rotary permutation: within each head the converter stores HF row
  // (h * head_dim/2 + j) at row (2 j + h), so HF's row r of a head comes from GGUF row perm(r).
  void put(const std::string& hf, const GgufTensorInfo& t, int64_t row0, int64_t rows, Shape shape, int head_dim = 0) {
    int64_t block = 0, block_bytes = 0;
    ggml_block_size(t.type, &block, &block_bytes);
    const int64_t cols = static_cast<int64_t>(t.ne[0]);
    const size_t row_bytes = static_cast<size_t>(cols / block * block_bytes);
    const uint8_t* src = t.data + row0 * row_bytes;
    auto src_row = [&](int64_t r) {
      if (head_dim == 0) return src + r * row_bytes;
      const int64_t head = r / head_dim, within = r % head_dim, half = head_dim / 2;
      const int64_t h = within / half, j = within % half;
      return src + (head * head_dim + 2 * j + h) * row_bytes;
    };
    TensorView view;
    view.shape = shape;
    const bool as_stored = t.type == static_cast<uint32_t>(GgmlType::kF32) || t.type == static_cast<uint32_t>(GgmlType::kBF16);
    if (as_stored && head_dim == 0) {  // a view into the mapping
      view.dtype = t.type == static_cast<uint32_t>(GgmlType::kF32) ? DType::kF32 : DType::kBF16;
      view.data = const_cast<uint8_t*>(src);
    } else if (as_stored) {  // rows reordered, bytes as stored
      view.dtype = t.type == static_cast<uint32_t>(GgmlType::kF32) ? DType::kF32 : DType::kBF16;
      std::vector<uint8_t>& buffer = ck_.owned.emplace_back(rows * row_bytes);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(buffer.data() + r * row_bytes, src_row(r), row_bytes);
      view.data = buffer.data();
    } else {  // F16 widened, Q8_0 / Q4_0 / Q4_K dequantized: once, to f32
      view.dtype = DType::kF32;
      std::vector<uint8_t>& buffer = ck_.owned.emplace_back(static_cast<size_t>(rows * cols) * sizeof(float));
      auto* out = reinterpret_cast<float*>(buffer.data());
      for (int64_t r = 0; r < rows; ++r) gguf_dequantize(t.type, src_row(r), cols, out + r * cols);
      view.data = buffer.data();
    }
    ck_.tensors.emplace(hf, view);
  }

  void check_all_used() const {
    for (const GgufTensorInfo& t : g_.tensors)
      if (!used_.count(t.name))
        throw_input_error(origin_, "tensor \"" + t.name + "\" is not part of the model its metadata describes: MoEX would ignore it");
  }

 private:
  static std::string dims(const std::vector<uint64_t>& ne) {
    std::string s = "[";
    for (size_t k = 0; k < ne.size(); ++k) s += (k ? ", " : "") + std::to_string(ne[k]);
    return s + "]";
  }
  GgufCheckpoint& ck_;
  const GgufContents& g_;
  const std::string& origin_;
  std::set<std::string> used_;
};

}  // namespace

std::vector<GgufTensorName> gguf_tensor_names(const ModelConfig& c) {
  using Kind = GgufTensorName::Kind;
  std::vector<GgufTensorName> out;
  const FamilyInfo& info = c.info();
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, E = c.num_local_experts;
  const int64_t q = c.q_dim(), kv = c.kv_dim(), hd = c.head_dim;
  // llama.cpp permutes attn_q / attn_k for its llama architecture only (adjacent-pair rotary); qwen2moe,
  // qwen3moe, olmoe and dots1 use NEOX rotary (the two halves), HF's order, and are stored as HF has them.
  const bool llama = c.info().gguf_llama_layout;
  auto vec = [&](const std::string& gguf, const std::string& hf, int64_t n, Shape hf_shape = {}) {
    out.push_back({gguf, {hf}, Kind::kVector, 1, n, hf_shape.rank == 0 ? Shape{n} : hf_shape, false, true});
  };
  auto mat = [&](const std::string& gguf, const std::string& hf, int64_t rows, int64_t cols, bool rotary = false) {
    out.push_back({gguf, {hf}, Kind::kMatrix, rows, cols, {}, rotary, false});
  };
  // A SwiGLU MLP of width `width`: gguf `gate`/`up`/`down` names, HF's gate_proj/up_proj/down_proj.
  auto mlp = [&](const std::string& b, const std::string& suffix, const std::string& hf, int64_t width) {
    mat(b + "ffn_gate" + suffix + ".weight", hf + "gate_proj.weight", width, d);
    mat(b + "ffn_up" + suffix + ".weight", hf + "up_proj.weight", width, d);
    mat(b + "ffn_down" + suffix + ".weight", hf + "down_proj.weight", d, width);
  };
  mat("token_embd.weight", "model.embed_tokens.weight", V, d);
  vec("output_norm.weight", "model.norm.weight", d);
  if (!c.tie_word_embeddings) mat("output.weight", "lm_head.weight", V, d);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    vec(b + "attn_norm.weight", p + "input_layernorm.weight", d);
    mat(b + "attn_q.weight", p + "self_attn.q_proj.weight", q, d, llama);
    mat(b + "attn_k.weight", p + "self_attn.k_proj.weight", kv, d, llama);
    mat(b + "attn_v.weight", p + "self_attn.v_proj.weight", kv, d);
    mat(b + "attn_output.weight", p + "self_attn.o_proj.weight", d, q);
    if (c.qkv_bias) {
      vec(b + "attn_q.bias", p + "self_attn.q_proj.bias", q);
      vec(b + "attn_k.bias", p + "self_attn.k_proj.bias", kv);
      vec(b + "attn_v.bias", p + "self_attn.v_proj.bias", kv);
    }
    if (c.qk_norm != QkNorm::kNone) {
      const bool per_head = c.qk_norm == QkNorm::kPerHead;
      vec(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", per_head ? hd : q);
      vec(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", per_head ? hd : kv);
    }
    vec(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", d);
    if (!c.moe_layer(l)) {  // a dense layer (dots1's leading dense blocks, qwen's mlp_only_layers)
      mlp(b, "", p + "mlp.", c.dense_intermediate_size);
      continue;
    }
    const std::string moe = p + info.moe_prefix + ".";
    mat(b + "ffn_gate_inp.weight", moe + "gate.weight", E, d);
    out.back().always_f32 = true;  // llama.cpp keeps the router in f32
    if (c.scoring == RouterScoring::kSigmoidGrouped) vec(b + "exp_probs_b.bias", moe + "gate.e_score_correction_bias", E);
    if (c.shared_expert_intermediate_size > 0)
      mlp(b, "_shexp", moe + info.shared_prefix + ".", c.shared_expert_intermediate_size);
    if (c.shared_expert_gate)  // HF [1, d]; llama.cpp stores the vector as [d]
      vec(b + "ffn_gate_inp_shexp.weight", moe + "shared_expert_gate.weight", d, {1, d});
    GgufTensorName gate{b + "ffn_gate_exps.weight", {}, Kind::kExperts, I, d, {}, false, false};
    GgufTensorName up{b + "ffn_up_exps.weight", {}, Kind::kExperts, I, d, {}, false, false};
    GgufTensorName down{b + "ffn_down_exps.weight", {}, Kind::kExperts, d, I, {}, false, false};
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = moe + "experts." + std::to_string(e) + ".";
      gate.hf.push_back(x + info.expert_gate + ".weight");
      up.hf.push_back(x + info.expert_up + ".weight");
      down.hf.push_back(x + info.expert_down + ".weight");
    }
    out.push_back(gate), out.push_back(up), out.push_back(down);
  }
  return out;
}

std::unique_ptr<GgufCheckpoint> load_gguf_checkpoint(const std::string& path) {
  auto ck = std::make_unique<GgufCheckpoint>();
  ck->file = std::make_unique<GgufFile>(path);
  const ModelConfig c = gguf_model_config(ck->file->contents(), path);
  const GgufContents& g = ck->file->contents();
  // Dequantized and widened tensors (and the reordered attn_q / attn_k) become anonymous memory, on every
  // rank: refused up front with the figures rather than ending in the OOM killer.
  double owned_bytes = 0;
  for (const GgufTensorInfo& t : g.tensors) {
    const bool as_stored = t.type == uint32_t(GgmlType::kF32) || t.type == uint32_t(GgmlType::kBF16);
    const bool rotary = c.info().gguf_llama_layout &&
                        (t.name.find(".attn_q.") != std::string::npos || t.name.find(".attn_k.") != std::string::npos);
    if (!as_stored) owned_bytes += 4.0 * t.numel();
    else if (rotary) owned_bytes += static_cast<double>(t.bytes);
  }
  check_fits_in_memory(owned_bytes, path + ": its tensors dequantized to f32",
                       "use an F32 or BF16 GGUF (mapped, not copied), or a machine with more memory");
  Mapper m(*ck, path);
  for (const GgufTensorName& t : gguf_tensor_names(c)) {
    const uint64_t rows = t.rows, cols = t.cols;
    switch (t.kind) {
      case GgufTensorName::Kind::kVector:
        m.put(t.hf[0], m.get(t.gguf, {cols}), 0, 1, t.hf_shape);
        break;
      case GgufTensorName::Kind::kMatrix:
        m.put(t.hf[0], m.get(t.gguf, {cols, rows}), 0, t.rows, {t.rows, t.cols}, t.rotary ? c.head_dim : 0);
        break;
      case GgufTensorName::Kind::kExperts: {
        const std::string layer = t.gguf.substr(0, t.gguf.find(".ffn_") + 1);  // "blk.N."
        if (!g.tensor(t.gguf) && g.tensor(layer + "ffn_gate.0.weight"))
          throw_input_error(path, "stores one tensor per expert (" + layer + "ffn_gate.0.weight), the layout of early 2024 "
                     "llama.cpp: re-convert it with a current llama.cpp, which writes the 3-D " + layer +
                     "ffn_gate_exps.weight");
        // One 3-D tensor per projection, [E][rows][cols]: one view (or dequantized copy) per expert.
        const GgufTensorInfo& all = m.get(t.gguf, {cols, rows, uint64_t(t.hf.size())});
        for (size_t e = 0; e < t.hf.size(); ++e) m.put(t.hf[e], all, int64_t(e) * t.rows, t.rows, {t.rows, t.cols});
        break;
      }
    }
  }
  m.check_all_used();
  return ck;
}

// ---- tokenizer.ggml.* -> SentencePiece ModelProto ------------------------------------------------------
// Written as protobuf wire format by hand (libsentencepiece installs no .pb.h). Field numbers are those of
// sentencepiece_model.proto: ModelProto {pieces 1, trainer_spec 2, normalizer_spec 3}; SentencePiece
// {piece 1, score 2, type 3}; TrainerSpec {model_type 3, byte_fallback 35, unk_id 40, bos_id 41,
// eos_id 42, pad_id 43}; NormalizerSpec {name 1, add_dummy_prefix 3, remove_extra_whitespaces 4,
// escape_whitespaces 5}. GGUF's token types (1 normal .. 6 byte) are SentencePiece's piece types.
namespace {

void varint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void tag(std::string* out, int field, int wire) { varint(out, static_cast<uint64_t>(field) << 3 | wire); }
void field_varint(std::string* out, int field, int64_t v) {
  tag(out, field, 0);
  varint(out, static_cast<uint64_t>(v));  // negative int32: ten bytes, as protobuf sign-extends
}
void field_bytes(std::string* out, int field, const std::string& bytes) {
  tag(out, field, 2);
  varint(out, bytes.size());
  *out += bytes;
}

}  // namespace

std::string gguf_sentencepiece_proto(const GgufContents& g, const std::string& origin) {
  const GgufValue* model = g.find("tokenizer.ggml.model");
  if (!model || model->type != GgufType::kString) throw_input_error(origin, "metadata has no string \"tokenizer.ggml.model\"");
  if (model->s != "llama")
    throw_input_error(origin, "tokenizer.ggml.model is \"" + model->s + "\": MoEX reads the SentencePiece (\"llama\") vocabulary only");
  const GgufValue* tokens = get_array(g, origin, "tokenizer.ggml.tokens", GgufType::kString);
  if (!tokens || tokens->count == 0) throw_input_error(origin, "metadata has no tokenizer.ggml.tokens");
  const GgufValue* scores = get_array(g, origin, "tokenizer.ggml.scores", GgufType::kF32);
  const GgufValue* types = get_array(g, origin, "tokenizer.ggml.token_type", GgufType::kI32);
  if (!scores || scores->count != tokens->count)
    throw_input_error(origin, "tokenizer.ggml.scores must be an array of f32 with one score per token");
  if (!types || types->count != tokens->count)
    throw_input_error(origin, "tokenizer.ggml.token_type must be an array of i32 with one type per token");
  const int64_t n = static_cast<int64_t>(tokens->count);
  std::string proto;
  bool has_bytes = false;
  std::set<std::string_view> seen;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t type = types->integer_at(k);
    if (type < 1 || type > 6) throw_input_error(origin, "token " + std::to_string(k) + " has type " + std::to_string(type) + " (1 to 6)");
    if (tokens->strings[k].empty()) throw_input_error(origin, "token " + std::to_string(k) + " is empty");
    if (!seen.insert(tokens->strings[k]).second)
      throw_input_error(origin, "token " + std::to_string(k) + " \"" + std::string(tokens->strings[k]) + "\" appears twice");
    has_bytes = has_bytes || type == 6;
    const float score = static_cast<float>(scores->number_at(k));
    if (!std::isfinite(score)) throw_input_error(origin, "token " + std::to_string(k) + " has a non-finite score");
    std::string piece;
    field_bytes(&piece, 1, std::string(tokens->strings[k]));
    tag(&piece, 2, 5);
    uint32_t bits;
    std::memcpy(&bits, &score, 4);
    for (int b = 0; b < 4; ++b) piece.push_back(static_cast<char>(bits >> (8 * b)));
    field_varint(&piece, 3, type);
    field_bytes(&proto, 1, piece);
  }
  auto id = [&](const char* key, int64_t fallback) {
    const int64_t v = get_int(g, origin, key, fallback, false, -1, n - 1);
    return v;
  };
  const int64_t unk = id("tokenizer.ggml.unknown_token_id", 0);
  if (unk < 0 || types->integer_at(unk) != 2) throw_input_error(origin, "tokenizer.ggml.unknown_token_id must name a token of type 2 (unknown)");
  std::string trainer;
  field_varint(&trainer, 3, 2);  // BPE: merges by piece score, as llama.cpp's llama tokenizer does
  if (has_bytes) field_varint(&trainer, 35, 1);
  field_varint(&trainer, 40, unk);
  field_varint(&trainer, 41, id("tokenizer.ggml.bos_token_id", 1));
  field_varint(&trainer, 42, id("tokenizer.ggml.eos_token_id", 2));
  field_varint(&trainer, 43, id("tokenizer.ggml.padding_token_id", -1));
  field_bytes(&proto, 2, trainer);
  bool add_space_prefix = true;
  if (const GgufValue* v = g.find("tokenizer.ggml.add_space_prefix")) {
    if (v->type != GgufType::kBool) throw_input_error(origin, "tokenizer.ggml.add_space_prefix must be a bool");
    add_space_prefix = v->u != 0;
  }
  std::string normalizer;
  field_bytes(&normalizer, 1, "identity");
  field_varint(&normalizer, 3, add_space_prefix);
  field_varint(&normalizer, 4, 0);
  field_varint(&normalizer, 5, 1);
  field_bytes(&proto, 3, normalizer);
  return proto;
}

}  // namespace moex

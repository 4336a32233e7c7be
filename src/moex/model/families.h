// The model families MoEX runs, one declaration (a row of kFamilies) each: what Hugging Face calls it and which
// config.json keys its config class has, its tensor names, the options its modelling code hard-wires, its GGUF
// architecture, and its tokenizer. config.cc (config.json both ways), weights.cc (tensor names),
// gguf_checkpoint.cc and tools/lib (gguf_writer, synthetic, tokenizer_train) read the row and name no family.
// A family built from the features below is its row, its gen-model presets (tools/lib/synthetic.cc) and its
// tests; a new feature is a new field here and its reading in config.cc / gguf_*, plus decoder.cc when it
// computes something new (docs/DESIGN.md, "How to add a model family").
#pragma once
#include <cstring>

namespace moex {

enum class ModelFamily { kMixtral, kQwen2Moe, kQwen3Moe, kOlmoe, kDots1 };

enum class QkNorm {
  kNone,
  kPerHead,  // RMSNorm over each head's head_dim (qwen3_moe, dots1): weight [head_dim]
  kWhole,    // RMSNorm over the whole q / k projection (olmoe): weights [H*hd], [KV*hd]
};
enum class RouterScoring {
  kSoftmax,         // softmax over E then top-k (renormalised when norm_topk_prob)
  kSigmoidGrouped,  // DeepSeek-V3: sigmoid, + e_score_correction_bias for the choice, grouped top-k, scaling
};
// Which layers run a dense MLP instead of the MoE block.
enum class DenseLayers {
  kNone,        // every layer is MoE
  kSparseStep,  // mlp_only_layers, and decoder_sparse_step (qwen); GGUF: a block without a router
  kFirstK,      // first_k_dense_replace (dots1); GGUF: leading_dense_block_count
};
enum class SharedExperts {
  kNone,
  kGated,  // one shared expert of shared_expert_intermediate_size, times sigmoid(x w_sg^T) (qwen2_moe)
  kCount,  // n_shared_experts experts of moe_intermediate_size, as one MLP (dots1)
};
// How config.json may ask for sliding-window attention (which MoEX refuses unless it covers the context).
enum class SlidingWindow {
  kNoField,   // the config class has none (olmoe)
  kWindow,    // sliding_window: null or at least the context (mixtral)
  kFlagged,   // use_sliding_window, sliding_window from max_window_layers, or layer_types (qwen)
  kLayered,   // sliding_window from max_window_layers without a flag, or layer_types (dots1)
};
// The tokenizer gen-model trains for a family (tools/lib/tokenizer_train.*), as the family ships its own.
enum class TokenizerKind {
  kSentencePiece,    // tokenizer.model + the tokenizer.json converted from it, Mixtral's [INST] template
  kQwen2ByteLevel,   // byte-level BPE with Qwen2's split regex, ChatML (<|im_end|>), BOS <|endoftext|>
  kGpt2ByteLevel,    // byte-level BPE with GPT-2's split regex (GPT-NeoX's tokenizer, olmoe), no BOS
};
// llama.cpp's top-k renormalisation per architecture: hard-wired, or read from {arch}.expert_weights_norm.
enum class GgufTopkNorm { kAlways, kNever, kKey };

struct FamilyInfo {
  ModelFamily family;
  // Hugging Face: config.json's model_type and architectures[0].
  const char* model_type;    // "qwen3_moe"
  const char* architecture;  // "Qwen3MoeForCausalLM"
  // config.json: the keys of the family's config class beyond every family's common ones (config.cc), space
  // separated; any other key is refused.
  const char* config_keys;
  const char* experts_key;        // num_local_experts | num_experts | n_routed_experts
  bool moe_intermediate;          // experts are moe_intermediate_size wide, intermediate_size is the dense MLP's
  bool strict;                    // the fields HF's config.json always carries are required (else class defaults)
  bool kv_heads_required;
  bool head_dim_required;
  bool qkv_bias_key;              // qkv_bias (default true): q/k/v_proj biases
  DenseLayers dense_layers;
  SharedExperts shared_experts;
  SlidingWindow sliding_window;
  int max_window_layers_default;  // the config class's default (kFlagged, kLayered)
  // config.json as gen-model writes it (what HF's config class writes beside the fields above).
  bool writes_head_dim, writes_attention_bias, writes_rope_scaling;
  // Tensors: the MoE block's names, and the hard-wired compute options.
  const char* moe_prefix;     // "block_sparse_moe" (mixtral) or "mlp"
  const char* expert_gate;    // "w1" / "gate_proj"
  const char* expert_up;      // "w3" / "up_proj"
  const char* expert_down;    // "w2" / "down_proj"
  const char* shared_prefix;  // "" (none), "shared_expert" (qwen2_moe), "shared_experts" (dots1)
  bool experts_before_gate;   // state-dict order: the experts, then the router (dots1), else the router first
  QkNorm qk_norm;
  RouterScoring scoring;
  // GGUF: llama.cpp's general.architecture, and whether it is llama.cpp's llama layout (q/k rows permuted for
  // adjacent-pair rotary, the head from rope.dimension_count, a BOS id by default, expert_weights_norm unread).
  const char* gguf_arch;
  bool gguf_llama_layout;
  GgufTopkNorm gguf_topk_norm;
  TokenizerKind tokenizer;
};

inline constexpr FamilyInfo kFamilies[] = {
    {.family = ModelFamily::kMixtral,
     .model_type = "mixtral",
     .architecture = "MixtralForCausalLM",
     .config_keys = "head_dim num_local_experts sliding_window router_jitter_noise attention_bias",
     .experts_key = "num_local_experts",
     .moe_intermediate = false,
     .strict = false,
     .kv_heads_required = false,
     .head_dim_required = false,
     .qkv_bias_key = false,
     .dense_layers = DenseLayers::kNone,
     .shared_experts = SharedExperts::kNone,
     .sliding_window = SlidingWindow::kWindow,
     .max_window_layers_default = 0,
     .writes_head_dim = true,
     .writes_attention_bias = false,
     .writes_rope_scaling = false,
     .moe_prefix = "block_sparse_moe",
     .expert_gate = "w1",
     .expert_up = "w3",
     .expert_down = "w2",
     .shared_prefix = "",
     .experts_before_gate = false,
     .qk_norm = QkNorm::kNone,
     .scoring = RouterScoring::kSoftmax,
     .gguf_arch = "llama",
     .gguf_llama_layout = true,
     .gguf_topk_norm = GgufTopkNorm::kAlways,
     .tokenizer = TokenizerKind::kSentencePiece},
    {.family = ModelFamily::kQwen2Moe,
     .model_type = "qwen2_moe",
     .architecture = "Qwen2MoeForCausalLM",
     .config_keys = "moe_intermediate_size shared_expert_intermediate_size num_experts decoder_sparse_step "
                    "mlp_only_layers use_sliding_window sliding_window max_window_layers layer_types qkv_bias",
     .experts_key = "num_experts",
     .moe_intermediate = true,
     .strict = true,
     .kv_heads_required = true,
     .head_dim_required = false,
     .qkv_bias_key = true,
     .dense_layers = DenseLayers::kSparseStep,
     .shared_experts = SharedExperts::kGated,
     .sliding_window = SlidingWindow::kFlagged,
     .max_window_layers_default = 28,
     .writes_head_dim = false,
     .writes_attention_bias = false,
     .writes_rope_scaling = true,
     .moe_prefix = "mlp",
     .expert_gate = "gate_proj",
     .expert_up = "up_proj",
     .expert_down = "down_proj",
     .shared_prefix = "shared_expert",
     .experts_before_gate = false,
     .qk_norm = QkNorm::kNone,
     .scoring = RouterScoring::kSoftmax,
     .gguf_arch = "qwen2moe",
     .gguf_llama_layout = false,
     .gguf_topk_norm = GgufTopkNorm::kNever,
     .tokenizer = TokenizerKind::kQwen2ByteLevel},
    {.family = ModelFamily::kQwen3Moe,
     .model_type = "qwen3_moe",
     .architecture = "Qwen3MoeForCausalLM",
     .config_keys = "head_dim moe_intermediate_size num_experts decoder_sparse_step mlp_only_layers "
                    "use_sliding_window sliding_window max_window_layers layer_types attention_bias",
     .experts_key = "num_experts",
     .moe_intermediate = true,
     .strict = true,
     .kv_heads_required = true,
     .head_dim_required = true,
     .qkv_bias_key = false,
     .dense_layers = DenseLayers::kSparseStep,
     .shared_experts = SharedExperts::kNone,
     .sliding_window = SlidingWindow::kFlagged,
     .max_window_layers_default = 28,
     .writes_head_dim = true,
     .writes_attention_bias = true,
     .writes_rope_scaling = true,
     .moe_prefix = "mlp",
     .expert_gate = "gate_proj",
     .expert_up = "up_proj",
     .expert_down = "down_proj",
     .shared_prefix = "",
     .experts_before_gate = false,
     .qk_norm = QkNorm::kPerHead,
     .scoring = RouterScoring::kSoftmax,
     .gguf_arch = "qwen3moe",
     .gguf_llama_layout = false,
     .gguf_topk_norm = GgufTopkNorm::kAlways,
     .tokenizer = TokenizerKind::kQwen2ByteLevel},
    {.family = ModelFamily::kOlmoe,
     .model_type = "olmoe",
     .architecture = "OlmoeForCausalLM",
     .config_keys = "num_experts attention_bias clip_qkv",
     .experts_key = "num_experts",
     .moe_intermediate = false,
     .strict = true,
     .kv_heads_required = false,
     .head_dim_required = false,
     .qkv_bias_key = false,
     .dense_layers = DenseLayers::kNone,
     .shared_experts = SharedExperts::kNone,
     .sliding_window = SlidingWindow::kNoField,
     .max_window_layers_default = 0,
     .writes_head_dim = false,
     .writes_attention_bias = true,
     .writes_rope_scaling = true,
     .moe_prefix = "mlp",
     .expert_gate = "gate_proj",
     .expert_up = "up_proj",
     .expert_down = "down_proj",
     .shared_prefix = "",
     .experts_before_gate = false,
     .qk_norm = QkNorm::kWhole,
     .scoring = RouterScoring::kSoftmax,
     .gguf_arch = "olmoe",
     .gguf_llama_layout = false,
     .gguf_topk_norm = GgufTopkNorm::kNever,
     .tokenizer = TokenizerKind::kGpt2ByteLevel},
    {.family = ModelFamily::kDots1,
     .model_type = "dots1",
     .architecture = "Dots1ForCausalLM",
     .config_keys = "head_dim moe_intermediate_size n_shared_experts n_routed_experts n_group topk_group "
                    "first_k_dense_replace routed_scaling_factor attention_bias sliding_window max_window_layers "
                    "layer_types",
     .experts_key = "n_routed_experts",
     .moe_intermediate = true,
     .strict = true,
     .kv_heads_required = true,
     .head_dim_required = false,
     .qkv_bias_key = false,
     .dense_layers = DenseLayers::kFirstK,
     .shared_experts = SharedExperts::kCount,
     .sliding_window = SlidingWindow::kLayered,
     .max_window_layers_default = 62,
     .writes_head_dim = true,
     .writes_attention_bias = true,
     .writes_rope_scaling = true,
     .moe_prefix = "mlp",
     .expert_gate = "gate_proj",
     .expert_up = "up_proj",
     .expert_down = "down_proj",
     .shared_prefix = "shared_experts",
     .experts_before_gate = true,
     .qk_norm = QkNorm::kPerHead,
     .scoring = RouterScoring::kSigmoidGrouped,
     .gguf_arch = "dots1",
     .gguf_llama_layout = false,
     .gguf_topk_norm = GgufTopkNorm::kKey,
     .tokenizer = TokenizerKind::kQwen2ByteLevel},
};

// Whether `key` is one of the family's config_keys.
inline bool family_has_config_key(const FamilyInfo& f, const char* key) {
  const size_t n = std::strlen(key);
  for (const char* p = f.config_keys; *p;) {
    while (*p == ' ') ++p;
    const char* end = p;
    while (*end && *end != ' ') ++end;
    if (static_cast<size_t>(end - p) == n && std::strncmp(p, key, n) == 0) return true;
    p = end;
  }
  return false;
}

}  // namespace moex

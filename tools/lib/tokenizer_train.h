// Trains a real SentencePiece BPE tokenizer at `moex gen-model` time, Llama/Mixtral style: <unk>=0,
// <s>=1, </s>=2, then the 256 byte-fallback pieces <0x00>..<0xFF> (ids 3..258), then merges.
// The corpus is built in and procedural (English sentences from a small grammar), so the same vocab
// size always gives the same tokenizer.model, with no download.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moex {

struct TrainedTokenizer {
  std::string model_proto;  // serialized ModelProto: the bytes of tokenizer.model
  int vocab_size = 0;       // pieces in the model (== the requested size unless the corpus runs out)
  int trained_pieces = 0;   // of which BPE-trained; the rest are frequent word pairs ("▁the▁old")
  int64_t corpus_bytes = 0;
};

// The built-in English training text, 1-4 sentences per line (deterministic, ~1.7 MB).
std::string builtin_english_corpus();

// Trains BPE with byte_fallback on builtin_english_corpus() (~0.5 s). The corpus has a few hundred
// distinct words and supports ~3200 BPE pieces; above that (32000) the vocab is filled with the corpus's
// most frequent word pairs as whole pieces ("▁the▁old", scored below every merge, so BPE applies them
// last) up to max_vocab_size. Throws Error(kInvalidInput) below 384 (specials + bytes + characters).
// Single-threaded on purpose: the thread count is recorded in the model file, and one thread keeps
// tokenizer.model byte-identical everywhere (gen-model trains it while the weights are generated).
TrainedTokenizer train_builtin_tokenizer(int max_vocab_size);

// tokenizer_config.json for a LlamaTokenizer (what Mixtral ships): bos/eos/unk, add_bos_token true, and
// Mixtral-8x7B-Instruct's chat_template.
std::string llama_tokenizer_config_json(int model_max_length);

// Mixtral's tokenizer.json from a trained tokenizer.model, as Hugging Face's LlamaConverter writes it (the
// "legacy" form Mixtral ships): the pieces as the BPE vocab with byte_fallback, merges from every split of a
// piece into two pieces ranked by the merged piece's score, <unk> <s> </s> as special added tokens, the
// Prepend("▁") + Replace(" " -> "▁") normalizer, the "<s> $A" template, and the Replace / ByteFallback /
// Fuse / Strip decoder. Throws Error(kInternal) when the proto does not load.
std::string mixtral_tokenizer_json(const std::string& model_proto);

// A byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) trained on builtin_english_corpus(),
// for the families whose checkpoints ship one (Qwen2-MoE, Qwen3-MoE, OLMoE). The vocab is the 256
// byte-level characters, then merges (most frequent pair first, ties by text), with the special tokens
// before or after them; ids run 0..vocab_size-1 with no holes.
struct ByteLevelBpeOptions {
  int vocab_size = 0;            // tokens in all, special tokens included (at least 256 + specials)
  bool qwen2_split = true;       // Qwen2's Split regex then ByteLevel(use_regex=false); else GPT-2's ByteLevel regex
  bool nfc = true;               // an NFC normalizer (Qwen2 and OLMoE's GPT-NeoX tokenizer have one)
  bool special_tokens_first = false;  // GPT-NeoX / OLMoE: ids 0.. are the special tokens; Qwen2: after the merges
  std::vector<std::string> special_tokens;
  std::string bos_token, eos_token, pad_token;  // tokenizer_config.json's; "" writes null
  std::string tokenizer_class;                  // tokenizer_config.json's "tokenizer_class"
  std::string chat_template;                    // tokenizer_config.json's "chat_template"; "" writes none
  int model_max_length = 4096;
};
// Qwen2 / Qwen3's layout: <|endoftext|> <|im_start|> <|im_end|> after the merges; no BOS, EOS and pad
// <|endoftext|> (a base model's; an instruct model's EOS is <|im_end|>).
ByteLevelBpeOptions qwen2_tokenizer_options(int vocab_size);
// OLMoE's (GPT-NeoX-20B's) layout: <|endoftext|> = 0 and <|padding|> = 1 first, GPT-2's regex, NFC; EOS
// <|endoftext|>, pad <|padding|>, no BOS.
ByteLevelBpeOptions olmoe_tokenizer_options(int vocab_size);

struct TrainedByteLevelBpe {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
  int vocab_size = 0;  // < options.vocab_size when the corpus has no more pairs seen twice
  int merges = 0;
  std::vector<std::pair<std::string, int>> special_ids;  // each special token and its id
  int id_of(const std::string& special) const;           // -1 when it is not a special token
};
// Deterministic (~0.3 s). Throws Error(kInvalidInput) when vocab_size cannot hold the bytes and specials.
TrainedByteLevelBpe train_byte_level_bpe(const ByteLevelBpeOptions& options);

// The tokenizer a byte-level family's checkpoint ships, in the layout its declaration names (families.h,
// TokenizerKind; gen-model): Qwen2's (qwen2_moe, qwen3_moe, dots1: dots.llm1 uses Qwen2's vocabulary) with the
// ChatML template (text's kChatMLTemplate) and EOS <|im_end|> (an instruct model's, as the presets'
// eos_token_id says); GPT-NeoX's (olmoe), a base model: no chat template. model_max_length is the model's context.
ByteLevelBpeOptions family_tokenizer_options(const std::string& model_type, int vocab_size, int model_max_length);

}  // namespace moex

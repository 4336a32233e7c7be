// Trains a real SentencePiece BPE tokenizer at `moex gen-model` time, Llama/Mixtral style: <unk>=0,
// <s>=1, </s>=2, then the 256 byte-fallback pieces <0x00>..<0xFF> (ids 3..258), then merges.
// The corpus is built in and procedural (English sentences from a small grammar), so the same vocab
// size always gives the same tokenizer.model, with no download.
#pragma once
#include <cstdint>
#include <string>

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

}  // namespace moex

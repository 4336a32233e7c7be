// A GGUF v3 writer (the layout is described in moex/model/gguf.h) and the Q8_0 / Q4_0 / Q4_K quantizers,
// written from the block formats' definitions; and the conversion of a Hugging Face folder of any family
// MoEX runs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, dots1) into the GGUF file llama.cpp's converter would
// write. Hand-written: no Debian library writes GGUF.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moex/model/config.h"
#include "moex/model/gguf.h"

namespace moex::tools {

class GgufWriter {
 public:
  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_i32(const std::string& key, int32_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string_array(const std::string& key, const std::vector<std::string>& values);
  void add_f32_array(const std::string& key, const std::vector<float>& values);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& values);
  // A tensor of dims `ne` (ggml order, ne[0] contiguous) and ggml `type`; `produce` fills its bytes when the
  // file is written, so a checkpoint is never held whole in memory.
  void add_tensor(const std::string& name, const std::vector<uint64_t>& ne, GgmlType type,
                  std::function<void(std::vector<uint8_t>*)> produce);
  // Writes the file (general.alignment 32) at `path`; throws naming the path on a write error.
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    GgmlType type;
    uint64_t bytes;
    std::function<void(std::vector<uint8_t>*)> produce;
  };
  std::string header_;  // the metadata entries, serialized
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
  static constexpr uint64_t kAlignment = 32;
};

// `n` (a multiple of the block) weights quantized to blocks appended to `out`.
// Q8_0: d = max|x| / 127, q = round(x / d). Q4_0: d = m / -8 for the m of largest magnitude, q = round(x / d) + 8
// clamped to 0..15 (so m is -8 d exactly). Q4_K: per 32-weight sub-block a scale (max - min) / 15 and a min
// -min(0, x); the eight of each kind are quantized to 6 bits against the super-block's d = max scale / 63
// and dmin = max min / 63, and the weights to 4 bits against the scales and mins as stored.
void quantize_q8_0(const float* x, int64_t n, std::vector<uint8_t>* out);
void quantize_q4_0(const float* x, int64_t n, std::vector<uint8_t>* out);
void quantize_q4_k(const float* x, int64_t n, std::vector<uint8_t>* out);

// Adds tokenizer.ggml.* ("gpt2") for a byte-level BPE tokenizer.json text (Qwen2's or OLMoE's pre-tokenizer);
// false, adding nothing, when the text is empty or not byte-level. `origin` names the file in errors.
bool add_byte_level_vocabulary(GgufWriter& w, const std::string& json_text, const ModelConfig& c, const std::string& origin);

// The GGUF tensor types of `moex convert --type`.
bool gguf_convert_type(const std::string& name, GgmlType* out);

// Writes the checkpoint in `model_dir` (config.json, safetensors, tokenizer.model) as the GGUF file
// `path` (written in place: the caller writes to a temporary name and renames). 1-D tensors and the router
// stay F32 (as llama.cpp's converter keeps them); a tensor whose rows are not a multiple of the type's block
// falls back to Q8_0, then F16. Returns a one-line summary of the tensor types written.
std::string convert_to_gguf(const std::string& model_dir, const std::string& path, GgmlType type);

}  // namespace moex::tools

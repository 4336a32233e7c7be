// GGUF (llama.cpp's single-file format, version 3) read by mmap and validated before any byte is used, and
// mapped onto the Hugging Face names and layouts the rest of MoEX loads.
// Hand-written: no Debian library reads GGUF (llama.cpp's own reader is not packaged as a library).
// Layout: "GGUF", u32 version, u64 tensor count, u64 metadata count; the metadata (key string, u32 type,
// value); the tensor infos (name, u32 n_dims, u64 ne[n_dims] innermost first, u32 ggml type, u64 offset);
// padding to general.alignment (default 32); the tensor data, each tensor at its offset from there.
// Strings are u64 length + bytes; arrays are u32 element type + u64 count + elements; all little-endian.
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moex/base/mapped_file.h"
#include "moex/base/tensor.h"
#include "moex/model/config.h"

namespace moex {

// Metadata value types (the spec's gguf_metadata_value_type).
enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9,
  kU64 = 10, kI64 = 11, kF64 = 12,
};

// Tensor types MoEX reads (ggml_type numbers). Other types are refused by name.
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kBF16 = 30 };
// Block formats (ggml's definitions): Q8_0 = f16 d + 32 x i8 (x = d q); Q4_0 = f16 d + 16 bytes of 32
// nibbles (x = d (q - 8); byte j holds element j low, j + 16 high); Q4_K = a 256-weight super-block of
// f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (x = d sc q - dmin m).
constexpr int kQ8_0Block = 32, kQ8_0Bytes = 34, kQ4_0Block = 32, kQ4_0Bytes = 18, kQ4_KBlock = 256,
              kQ4_KBytes = 144;

std::string ggml_type_name(uint32_t type);  // "Q4_K", or "type 37" for one MoEX does not know
// Weights per block and bytes per block of a type MoEX reads; false for any other.
bool ggml_block_size(uint32_t type, int64_t* block, int64_t* bytes);

struct GgufValue {
  GgufType type = GgufType::kU8;
  uint64_t u = 0;      // unsigned integers and bool
  int64_t i = 0;       // signed integers
  double f = 0.0;      // f32 / f64
  std::string s;       // a string
  // An array: its element type and count; numeric elements stay in the mapping (`raw`, read on demand, so
  // a header count never sizes an allocation), strings are views into it. Arrays of arrays are refused
  // (no key uses them, and llama.cpp does not read them either).
  GgufType element = GgufType::kU8;
  uint64_t count = 0;
  const uint8_t* raw = nullptr;
  std::vector<std::string_view> strings;

  // A scalar integer (any width or sign) that fits int64; false for anything else.
  bool integer(int64_t* out) const;
  // Element k of a numeric array.
  double number_at(uint64_t k) const;
  int64_t integer_at(uint64_t k) const;
  std::string str() const;  // for error messages: the value, or "array of N T"
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // ggml order: ne[0] is the contiguous (innermost) dimension
  uint32_t type = 0;
  uint64_t offset = 0;       // from the start of the data section
  uint64_t bytes = 0;
  const uint8_t* data = nullptr;
  int64_t numel() const;
};

struct GgufContents {
  uint32_t version = 0;
  uint64_t alignment = 32;
  uint64_t data_offset = 0;  // file offset of the data section
  std::map<std::string, GgufValue> metadata;
  std::vector<GgufTensorInfo> tensors;  // in file order
  const GgufValue* find(const std::string& key) const;
  const GgufTensorInfo* tensor(const std::string& name) const;
};

// Validates `bytes` as a GGUF v3 image: every count, string length, dimension, type, offset and size is
// checked against what is left of the file before it is used or allocated; throws Error(kInvalidInput)
// naming `origin` and the problem. The fuzz target calls this.
GgufContents parse_gguf(const uint8_t* bytes, size_t size, const std::string& origin);

class GgufFile {
 public:
  explicit GgufFile(const std::string& path);
  const GgufContents& contents() const { return contents_; }
  const std::string& path() const { return file_.path(); }
  size_t size() const { return file_.size(); }
  const MappedFile& mapping() const { return file_; }

 private:
  MappedFile file_;
  GgufContents contents_;
};

// A --model path that names a GGUF file rather than a folder: any regular file, or a missing path ending in
// .gguf (so that its error is the file's, not a folder's).
bool is_gguf_path(const std::string& model);

// ModelConfig from the GGUF metadata: general.architecture "llama" with llama.expert_count (Mixtral, as
// llama.cpp writes it), "qwen2moe", "qwen3moe", "olmoe" or "dots1". Keys of the architecture MoEX does not
// know, rope scaling, a dense model and other architectures are refused naming the key.
ModelConfig gguf_model_config(const GgufContents& gguf, const std::string& origin);
// config.json of a folder, or the metadata of a .gguf file.
ModelConfig load_checkpoint_config(const std::string& model);

// Dequantizes `n` weights (a multiple of the type's block) of a Q8_0 / Q4_0 / Q4_K / F16 / BF16 / F32 row
// to f32, exactly as ggml's dequantize_row functions define the values.
void gguf_dequantize(uint32_t type, const uint8_t* src, int64_t n, float* out);

// One GGUF tensor and the Hugging Face tensor(s) it holds: the one table that both the reader below and
// tools/lib's writer walk, so that the two cannot drift apart. A matrix is HF [rows, cols], stored as the
// ggml 2-D tensor [cols, rows]; a 3-D expert tensor holds `hf.size()` such matrices, [E][rows][cols]
// (ggml [cols, rows, E]); a vector holds `cols` values, shaped `hf_shape` on the HF side.
struct GgufTensorName {
  enum class Kind { kVector, kMatrix, kExperts };
  std::string gguf;
  std::vector<std::string> hf;  // one name, or one per expert for kExperts
  Kind kind = Kind::kMatrix;
  int64_t rows = 1, cols = 0;
  Shape hf_shape;               // the HF shape of a vector: {cols}, or {1, cols} for the shared-expert gate
  bool rotary = false;          // llama's attn_q / attn_k: rows interleaved per head (see load_gguf_checkpoint)
  bool always_f32 = false;      // stored in f32 whatever the weight type (norms, biases, the router)
};
// Every tensor of `c`'s architecture in llama.cpp's names, in file order. lm_head appears unless
// tie_word_embeddings.
std::vector<GgufTensorName> gguf_tensor_names(const ModelConfig& c);

// The tensors of a GGUF file under MoEX's Hugging Face names and layouts: F32 and BF16 tensors are views
// into the mapping; F16 is widened once to F32; Q8_0 / Q4_0 / Q4_K are dequantized once to F32 (exact:
// every dequantized value is an f32); attn_q / attn_k rows are put back in HF's order (llama.cpp's
// converter interleaves the two rotary halves of each head). The 3-D expert tensors become one view per
// expert. Buffers made here live in `owned`.
struct GgufCheckpoint {
  std::unique_ptr<GgufFile> file;
  std::deque<std::vector<uint8_t>> owned;
  std::map<std::string, TensorView> tensors;
};
std::unique_ptr<GgufCheckpoint> load_gguf_checkpoint(const std::string& path);

// The SentencePiece ModelProto (serialized) that tokenizer.ggml.* describe for tokenizer.ggml.model
// "llama": the pieces with their scores and types, BPE, byte fallback when byte pieces exist, identity
// normalization with a dummy prefix (what llama.cpp's llama tokenizer does). Other tokenizers are refused.
std::string gguf_sentencepiece_proto(const GgufContents& gguf, const std::string& origin);

}  // namespace moex

// The GGUF reader on good and corrupt files, the block quantizers against their definitions, and a converted
// checkpoint read back onto the Hugging Face names. (llama.cpp reading what we write: tests/gguf.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/model/gguf.h"
#include "moex/model/safetensors.h"
#include "moex/text/tokenizer.h"
#include "moex/text/tokenizer_json.h"
#include "tools/lib/gguf_writer.h"
#include "tools/lib/tokenizer_train.h"

namespace moex {
namespace {

namespace fs = std::filesystem;
using tools::GgufWriter;

// Raw little-endian GGUF bytes, for the value types and corruptions the writer never produces.
struct Bytes {
  std::string b;
  template <typename T>
  Bytes& put(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    b += s;
    return *this;
  }
};

GgufContents parse(const std::string& bytes) {
  return parse_gguf(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "test.gguf");
}

std::string expect_input_error(const std::string& bytes, const std::string& cause) {
  try {
    parse(bytes);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
    EXPECT_NE(std::string(e.what()).find(cause), std::string::npos) << "got: " << e.what() << "\nwanted: " << cause;
    return e.what();
  }
  ADD_FAILURE() << "no error; wanted: " << cause;
  return "";
}

std::string temp_path(const std::string& name) { return (fs::temp_directory_path() / name).string(); }

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A small file from the writer: metadata of its types and one tensor of each type MoEX reads.
std::string small_file() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 3);
  w.add_i32("some.i32", -7);
  w.add_f32("some.f32", 0.25f);
  w.add_bool("some.bool", true);
  w.add_string_array("some.strings", {"a", "", "ccc"});
  w.add_f32_array("some.floats", {1.5f, -2.0f});
  w.add_i32_array("some.ints", {3, -4, 5});
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) x[i] = std::sin(0.1f * i);
  w.add_tensor("f32", {4, 2}, GgmlType::kF32, [](std::vector<uint8_t>* out) {
    for (int i = 0; i < 8; ++i) {
      const float v = static_cast<float>(i);
      out->insert(out->end(), reinterpret_cast<const uint8_t*>(&v), reinterpret_cast<const uint8_t*>(&v) + 4);
    }
  });
  w.add_tensor("q8", {32}, GgmlType::kQ8_0, [x](std::vector<uint8_t>* out) { tools::quantize_q8_0(x.data(), 32, out); });
  w.add_tensor("q4k", {256}, GgmlType::kQ4_K, [x](std::vector<uint8_t>* out) { tools::quantize_q4_k(x.data(), 256, out); });
  const std::string path = temp_path("moex_gguf_test_small.gguf");
  w.write(path);
  return read_all(path);
}

TEST(Gguf, ReadsWhatTheWriterWrites) {
  const std::string bytes = small_file();
  const GgufContents g = parse(bytes);
  EXPECT_EQ(g.version, 3u);
  EXPECT_EQ(g.alignment, 32u);
  EXPECT_EQ(g.data_offset % 32, 0u);
  EXPECT_EQ(g.find("general.architecture")->s, "llama");
  int64_t v = 0;
  ASSERT_TRUE(g.find("llama.block_count")->integer(&v));
  EXPECT_EQ(v, 3);
  ASSERT_TRUE(g.find("some.i32")->integer(&v));
  EXPECT_EQ(v, -7);
  EXPECT_EQ(g.find("some.f32")->f, 0.25);
  EXPECT_EQ(g.find("some.bool")->u, 1u);
  const GgufValue& strings = *g.find("some.strings");
  ASSERT_EQ(strings.count, 3u);
  EXPECT_EQ(strings.strings[0], "a");
  EXPECT_EQ(strings.strings[1], "");
  EXPECT_EQ(strings.strings[2], "ccc");
  EXPECT_EQ(g.find("some.floats")->number_at(1), -2.0);
  EXPECT_EQ(g.find("some.ints")->integer_at(1), -4);
  ASSERT_EQ(g.tensors.size(), 3u);
  const GgufTensorInfo& f = *g.tensor("f32");
  EXPECT_EQ(f.ne, (std::vector<uint64_t>{4, 2}));
  EXPECT_EQ(f.bytes, 32u);
  float row[8];
  gguf_dequantize(f.type, f.data, 8, row);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(row[i], i);
  EXPECT_EQ(g.tensor("q8")->bytes, uint64_t(kQ8_0Bytes));
  EXPECT_EQ(g.tensor("q4k")->bytes, uint64_t(kQ4_KBytes));
  for (const GgufTensorInfo& t : g.tensors) EXPECT_EQ((t.data - reinterpret_cast<const uint8_t*>(bytes.data())) % 32, 0);
}

TEST(Gguf, ReadsEveryScalarType) {
  Bytes b;
  b.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(8);
  b.str("u8").put<uint32_t>(0).put<uint8_t>(200);
  b.str("i8").put<uint32_t>(1).put<int8_t>(-100);
  b.str("u16").put<uint32_t>(2).put<uint16_t>(60000);
  b.str("i16").put<uint32_t>(3).put<int16_t>(-30000);
  b.str("u64").put<uint32_t>(10).put<uint64_t>(uint64_t{1} << 40);
  b.str("i64").put<uint32_t>(11).put<int64_t>(-(int64_t{1} << 40));
  b.str("f64").put<uint32_t>(12).put<double>(-0.125);
  b.str("u16s").put<uint32_t>(9).put<uint32_t>(2).put<uint64_t>(2).put<uint16_t>(7).put<uint16_t>(65535);
  const GgufContents g = parse(b.b);
  int64_t v;
  ASSERT_TRUE(g.find("u8")->integer(&v));
  EXPECT_EQ(v, 200);
  ASSERT_TRUE(g.find("i8")->integer(&v));
  EXPECT_EQ(v, -100);
  ASSERT_TRUE(g.find("u16")->integer(&v));
  EXPECT_EQ(v, 60000);
  ASSERT_TRUE(g.find("i16")->integer(&v));
  EXPECT_EQ(v, -30000);
  ASSERT_TRUE(g.find("u64")->integer(&v));
  EXPECT_EQ(v, int64_t{1} << 40);
  ASSERT_TRUE(g.find("i64")->integer(&v));
  EXPECT_EQ(v, -(int64_t{1} << 40));
  EXPECT_EQ(g.find("f64")->f, -0.125);
  EXPECT_EQ(g.find("u16s")->integer_at(1), 65535);
  EXPECT_TRUE(g.tensors.empty());
}

TEST(Gguf, EveryTruncationIsOneInputError) {
  const std::string bytes = small_file();
  const GgufContents full = parse(bytes);
  // Cutting anywhere before the end of the last tensor's data must be refused, never read past the end.
  const uint64_t needed = full.data_offset + full.tensors.back().offset + full.tensors.back().bytes;
  for (size_t n = 0; n < needed; ++n) {
    std::string cut = bytes.substr(0, n);
    cut.shrink_to_fit();
    EXPECT_THROW(parse(cut), Error) << "truncated to " << n << " bytes";
  }
}

// A header with one tensor of the given fields, then `data` bytes.
std::string one_tensor(uint32_t n_dims, std::vector<uint64_t> ne, uint32_t type, uint64_t offset, size_t data,
                       const std::string& name = "t") {
  Bytes b;
  b.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(1).put<uint64_t>(0);
  b.str(name).put<uint32_t>(n_dims);
  for (uint64_t n : ne) b.put<uint64_t>(n);
  b.put<uint32_t>(type).put<uint64_t>(offset);
  b.b.resize((b.b.size() + 31) / 32 * 32, '\0');
  b.b.append(data, '\0');
  return b.b;
}

TEST(Gguf, CorruptHeadersAreNamed) {
  const std::string good = small_file();
  std::string magic = good;
  magic[0] = 'X';
  expect_input_error(magic, "not a GGUF file");
  std::string v2 = good;
  v2[4] = 2;
  expect_input_error(v2, "version 2");
  Bytes huge;
  huge.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(uint64_t{1} << 60);
  expect_input_error(huge.b, "metadata count");
  Bytes huge_t;
  huge_t.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(uint64_t{1} << 61).put<uint64_t>(0);
  expect_input_error(huge_t.b, "tensor count");
  Bytes long_key;
  long_key.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1).put<uint64_t>(uint64_t{1} << 62);
  long_key.b.append(16, '\0');
  expect_input_error(long_key.b, "bytes long");
  Bytes big_array;
  big_array.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  big_array.str("a").put<uint32_t>(9).put<uint32_t>(8).put<uint64_t>(uint64_t{1} << 40);
  expect_input_error(big_array.b, "claims 1099511627776 elements");
  Bytes nested;
  nested.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  nested.str("a").put<uint32_t>(9).put<uint32_t>(9).put<uint64_t>(1);
  expect_input_error(nested.b, "array of arrays");
  Bytes bad_type;
  bad_type.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  bad_type.str("a").put<uint32_t>(13).put<uint32_t>(0);
  expect_input_error(bad_type.b, "unknown value type 13");
  Bytes bad_bool;
  bad_bool.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  bad_bool.str("a").put<uint32_t>(7).put<uint8_t>(2);
  expect_input_error(bad_bool.b, "bool holding 2");
  Bytes twice;
  twice.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(2);
  twice.str("a").put<uint32_t>(0).put<uint8_t>(1).str("a").put<uint32_t>(0).put<uint8_t>(1);
  expect_input_error(twice.b, "appears twice");
  Bytes align;
  align.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(1);
  align.str("general.alignment").put<uint32_t>(4).put<uint32_t>(24);
  expect_input_error(align.b, "power of two");

  EXPECT_NO_THROW(parse(one_tensor(2, {4, 2}, 0, 0, 32)));
  expect_input_error(one_tensor(5, {1, 1, 1, 1, 1}, 0, 0, 32), "5 dimensions");
  expect_input_error(one_tensor(0, {}, 0, 0, 32), "0 dimensions");
  expect_input_error(one_tensor(2, {4, 0}, 0, 0, 32), "implausible dimension 0");
  expect_input_error(one_tensor(2, {uint64_t{1} << 30, uint64_t{1} << 30}, 0, 0, 32), "implausible dimension");
  expect_input_error(one_tensor(1, {256}, 14, 0, 256), "type Q6_K, which MoEX does not read");
  expect_input_error(one_tensor(1, {48}, 8, 0, 64), "not a multiple of Q8_0's block of 32");
  expect_input_error(one_tensor(2, {4, 2}, 0, 16, 64), "not a multiple of the alignment");
  expect_input_error(one_tensor(2, {4, 2}, 0, 0, 31), "lies outside the data section");
  expect_input_error(one_tensor(2, {4, 2}, 0, 32, 63), "lies outside the data section");
  expect_input_error(one_tensor(2, {4, 2}, 0, uint64_t(-32), 64), "lies outside the data section");
  expect_input_error(one_tensor(1, {4}, 0, 0, 32, std::string(65, 'n')), "65 bytes long (at most 64)");
  // Two tensors over the same bytes.
  Bytes overlap;
  overlap.put<uint32_t>(0x46554747).put<uint32_t>(3).put<uint64_t>(2).put<uint64_t>(0);
  overlap.str("a").put<uint32_t>(1).put<uint64_t>(16).put<uint32_t>(0).put<uint64_t>(0);
  overlap.str("b").put<uint32_t>(1).put<uint64_t>(8).put<uint32_t>(0).put<uint64_t>(32);
  overlap.b.resize((overlap.b.size() + 31) / 32 * 32, '\0');
  overlap.b.append(96, '\0');
  expect_input_error(overlap.b, "overlap");
}

// ---- Block formats ------------------------------------------------------------------------------------------

std::vector<float> noise(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> z(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = z(rng);
  return x;
}

TEST(GgufBlocks, Q8_0DecodesByDefinition) {
  // d = 0.5 (f16 0x3800), q = -3, 0, 127, ...: x = d q.
  std::vector<uint8_t> block = {0x00, 0x38};
  for (int j = 0; j < 32; ++j) block.push_back(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
  float out[32];
  gguf_dequantize(uint32_t(GgmlType::kQ8_0), block.data(), 32, out);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], 0.5f * (j - 16));
}

TEST(GgufBlocks, Q4_0DecodesByDefinition) {
  // d = 2 (f16 0x4000); byte j holds element j (low nibble) and j + 16 (high); x = d (q - 8).
  std::vector<uint8_t> block = {0x00, 0x40};
  for (int j = 0; j < 16; ++j) block.push_back(static_cast<uint8_t>(j | (15 - j) << 4));
  float out[32];
  gguf_dequantize(uint32_t(GgmlType::kQ4_0), block.data(), 32, out);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], 2.0f * (j - 8));
    EXPECT_EQ(out[j + 16], 2.0f * (15 - j - 8));
  }
}

TEST(GgufBlocks, Q4_KDecodesByDefinition) {
  // d = 1, dmin = 0.5; sub-block s has scale s + 1 and min 2 s + 33 (6 bits: the high two bits are used for
  // s >= 4 through bytes 0..7); weight l of sub-block s has q = (l + s) % 16: x = d sc q - dmin m.
  std::vector<uint8_t> block = {0x00, 0x3c, 0x00, 0x38};
  int sc[8], m[8];
  for (int s = 0; s < 8; ++s) sc[s] = s + 1 + (s >= 4 ? 48 : 0), m[s] = 2 * s + 33;
  uint8_t scales[12];
  for (int j = 0; j < 4; ++j) {
    scales[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
    scales[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
    scales[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
  }
  block.insert(block.end(), scales, scales + 12);
  for (int chunk = 0; chunk < 4; ++chunk)
    for (int l = 0; l < 32; ++l) block.push_back(((l + 2 * chunk) % 16) | ((l + 2 * chunk + 1) % 16) << 4);
  ASSERT_EQ(block.size(), size_t(kQ4_KBytes));
  float out[256];
  gguf_dequantize(uint32_t(GgmlType::kQ4_K), block.data(), 256, out);
  for (int s = 0; s < 8; ++s)
    for (int l = 0; l < 32; ++l) EXPECT_EQ(out[32 * s + l], 1.0f * sc[s] * ((l + s) % 16) - 0.5f * m[s]) << s << " " << l;
}

TEST(GgufBlocks, QuantizersRoundTripWithinHalfAStep) {
  const std::vector<float> x = noise(1024, 3);
  std::vector<float> y(x.size());
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_K}) {
    std::vector<uint8_t> q;
    if (t == GgmlType::kQ8_0) tools::quantize_q8_0(x.data(), 1024, &q);
    if (t == GgmlType::kQ4_0) tools::quantize_q4_0(x.data(), 1024, &q);
    if (t == GgmlType::kQ4_K) tools::quantize_q4_k(x.data(), 1024, &q);
    int64_t block = 0, bytes = 0;
    ggml_block_size(uint32_t(t), &block, &bytes);
    ASSERT_EQ(q.size(), size_t(1024 / block * bytes));
    gguf_dequantize(uint32_t(t), q.data(), 1024, y.data());
    for (int b = 0; b < 1024; b += 32) {
      float lo = 0, hi = 0, amax = 0;
      for (int j = b; j < b + 32; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]), amax = std::max(amax, std::fabs(x[j]));
      // Half a step of each format (f16 scales and, for Q4_K, 6-bit scales add a little): Q8_0 amax/127,
      // Q4_K (max - min)/15 per sub-block. Q4_0 codes -8..7 d with the largest magnitude at -8 d: a value of
      // the other sign near -amax clamps to 7 d, a whole step amax/8 off, so its bound is twice as wide.
      const float step = t == GgmlType::kQ8_0 ? amax / 127 : t == GgmlType::kQ4_0 ? 2 * amax / 8 : (hi - lo) / 15;
      for (int j = b; j < b + 32; ++j) EXPECT_LE(std::fabs(y[j] - x[j]), 0.5f * step * 1.2f + 1e-6f) << ggml_type_name(uint32_t(t)) << " " << j;
    }
  }
}

// ---- A converted checkpoint ----------------------------------------------------------------------------

std::string tiny_model() {
  static const std::string dir = [] {
    const std::string out = temp_path("moex_gguf_test_tiny");
    const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset tiny --seed 41 --dtype f32 --force --out " + out + " > /dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return out;
  }();
  return dir;
}

TEST(GgufCheckpoint, F32FileHoldsExactlyTheSourceWeights) {
  const std::string src = tiny_model(), path = temp_path("moex_gguf_test_tiny_f32.gguf");
  tools::convert_to_gguf(src, path, GgmlType::kF32);
  const WeightStore hf(src), gguf(path);
  EXPECT_EQ(hf.tensors().size(), gguf.tensors().size());
  for (const auto& [name, view] : hf.tensors()) {
    ASSERT_TRUE(gguf.contains(name)) << name;
    const TensorView& g = gguf.get(name);
    ASSERT_EQ(g.shape, view.shape) << name;
    ASSERT_EQ(g.dtype, DType::kF32);
    EXPECT_EQ(std::memcmp(g.data, view.data, view.bytes()), 0) << name;  // q/k: the rotary order undone
  }
  const ModelConfig a = load_checkpoint_config(src), b = load_checkpoint_config(path);
  EXPECT_EQ(model_config_to_json(a), model_config_to_json(b));
}

TEST(GgufCheckpoint, QuantizedFileDequantizesNearTheSource) {
  const std::string src = tiny_model(), path = temp_path("moex_gguf_test_tiny_q8.gguf");
  tools::convert_to_gguf(src, path, GgmlType::kQ8_0);
  const WeightStore hf(src), gguf(path);
  for (const auto& [name, view] : hf.tensors()) {
    const TensorView& g = gguf.get(name);
    ASSERT_EQ(g.shape, view.shape) << name;
    double worst = 0, amax = 0;
    for (int64_t i = 0; i < view.numel(); ++i) {
      worst = std::max(worst, double(std::fabs(g.as<float>()[i] - view.as<float>()[i])));
      amax = std::max(amax, double(std::fabs(view.as<float>()[i])));
    }
    EXPECT_LE(worst, amax / 127 * 0.6) << name;
  }
}

TEST(GgufCheckpoint, TokenizerFromTheVocabularyEncodesAsTheSentencePieceModel) {
  const std::string src = tiny_model(), path = temp_path("moex_gguf_test_tiny_tokenizer.gguf");
  tools::convert_to_gguf(src, path, GgmlType::kF32);
  const auto original = Tokenizer::for_model(src), rebuilt = Tokenizer::for_model(path);
  EXPECT_EQ(original.vocab_size(), rebuilt.vocab_size());
  EXPECT_EQ(original.bos_id(), rebuilt.bos_id());
  EXPECT_EQ(original.eos_id(), rebuilt.eos_id());
  for (const std::string text : {"Once upon a time", "  two  spaces\tand tabs\n", "digits 1234567 and 3.14",
                                 "Unicode: héllo wörld 日本語 🙂", "\xff\xfe invalid bytes", ""}) {
    const std::vector<int> ids = original.encode(text, true);
    EXPECT_EQ(ids, rebuilt.encode(text, true)) << text;
    EXPECT_EQ(original.decode(ids), rebuilt.decode(ids)) << text;
  }
}

// A byte-level BPE tokenizer.json (Qwen2's and OLMoE's layouts) written as a "gpt2" GGUF vocabulary reads back
// as a tokenizer giving the same ids and text as the original tokenizer.json (JsonTokenizer, which
// tests/tokenizer checks against Hugging Face's own). Ids past the tokenizer's are padding tokens.
TEST(GgufCheckpoint, ByteLevelVocabularyEncodesAsTheTokenizerJson) {
  for (const bool qwen : {true, false}) {
    const TrainedByteLevelBpe trained =
        train_byte_level_bpe(qwen ? qwen2_tokenizer_options(600) : olmoe_tokenizer_options(600));
    ModelConfig c;
    c.vocab_size = trained.vocab_size + 8;
    c.has_bos = false, c.bos_token_id = -1, c.eos_token_id = qwen ? trained.vocab_size - 3 : 0;
    GgufWriter w;
    w.add_string("general.architecture", "qwen3moe");
    ASSERT_TRUE(tools::add_byte_level_vocabulary(w, trained.tokenizer_json, c, "tokenizer.json"));
    const std::string path = temp_path(qwen ? "moex_gguf_test_qwen_vocab.gguf" : "moex_gguf_test_olmo_vocab.gguf");
    w.write(path);
    const auto original = JsonTokenizer::parse(trained.tokenizer_json, "tokenizer.json");
    const Tokenizer rebuilt = Tokenizer::for_model(path);
    EXPECT_EQ(rebuilt.vocab_size(), c.vocab_size);
    EXPECT_EQ(rebuilt.bos_id(), -1);
    EXPECT_EQ(rebuilt.eos_id(), c.eos_token_id);
    for (const std::string text : {"Once upon a time", "  two  spaces\tand tabs\n", "digits 1234567 and 3.14",
                                   "Unicode: h\u00e9llo w\u00f6rld \u65e5\u672c\u8a9e \U0001F642", "\xff\xfe invalid bytes",
                                   "<|endoftext|> special <|endoftext|>x", ""}) {
      const std::vector<int> ids = original->encode(text, true);
      EXPECT_EQ(ids, rebuilt.encode(text, true)) << text;
      EXPECT_EQ(original->decode(ids, true), rebuilt.decode(ids)) << text;
    }
  }
  // A pre-tokenizer MoEX does not know is refused by name.
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2"), w.add_string("tokenizer.ggml.pre", "llama-bpe");
  w.add_string_array("tokenizer.ggml.tokens", {"a", "b"}), w.add_i32_array("tokenizer.ggml.token_type", {1, 1});
  w.add_string_array("tokenizer.ggml.merges", {});
  const std::string path = temp_path("moex_gguf_test_bad_pre.gguf");
  w.write(path);
  try {
    Tokenizer::for_model(path);
    ADD_FAILURE() << "no error for tokenizer.ggml.pre llama-bpe";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"llama-bpe\""), std::string::npos) << e.what();
  }
}

// Metadata of another architecture, a dense model, or a key that changes the computation is refused.
TEST(GgufCheckpoint, RefusesWhatItCannotRun) {
  auto config_error = [](const std::function<void(GgufWriter&)>& edit, const std::string& cause) {
    GgufWriter w;
    edit(w);
    w.add_tensor("token_embd.weight", {64, 512}, GgmlType::kF32, [](std::vector<uint8_t>* o) { o->resize(64 * 512 * 4); });
    const std::string path = temp_path("moex_gguf_test_refuse.gguf");
    w.write(path);
    const GgufFile f(path);
    try {
      gguf_model_config(f.contents(), path);
      ADD_FAILURE() << "no error; wanted " << cause;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(cause), std::string::npos) << e.what();
    }
  };
  auto llama = [](GgufWriter& w, bool experts) {
    w.add_string("general.architecture", "llama");
    w.add_u32("llama.embedding_length", 64), w.add_u32("llama.block_count", 1), w.add_u32("llama.feed_forward_length", 128);
    w.add_u32("llama.attention.head_count", 4), w.add_u32("llama.context_length", 256);
    w.add_u32("llama.vocab_size", 512);
    w.add_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    if (experts) w.add_u32("llama.expert_count", 8), w.add_u32("llama.expert_used_count", 2);
  };
  config_error([](GgufWriter& w) { w.add_string("general.architecture", "deepseek2"); }, "multi-head latent attention");
  config_error([](GgufWriter& w) { w.add_string("general.architecture", "phimoe"); }, "\"phimoe\"");
  config_error([&](GgufWriter& w) { llama(w, false); }, "dense llama model");
  config_error([&](GgufWriter& w) { llama(w, true), w.add_string("llama.rope.scaling.type", "yarn"); },
               "\"llama.rope.scaling.type\" (\"yarn\") is not supported");
  config_error([&](GgufWriter& w) { llama(w, true), w.add_f32("llama.attention.clamp_kqv", 8.0f); },
               "llama.attention.clamp_kqv");
  config_error([&](GgufWriter& w) { llama(w, true), w.add_u32("split.count", 3); }, "split GGUF");
  config_error([&](GgufWriter& w) { llama(w, false), w.add_u32("llama.expert_count", 8), w.add_u32("llama.expert_used_count", 9); },
               "num_experts_per_tok");
  // The other architectures: their own keys are used or refused as llama's are.
  auto family = [](GgufWriter& w, const std::string& arch, uint32_t blocks = 1) {
    const std::string a = arch + ".";
    w.add_string("general.architecture", arch);
    w.add_u32(a + "embedding_length", 64), w.add_u32(a + "block_count", blocks), w.add_u32(a + "feed_forward_length", 128);
    w.add_u32(a + "attention.head_count", 4), w.add_u32(a + "context_length", 256), w.add_u32(a + "vocab_size", 512);
    w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
    w.add_u32(a + "expert_count", 8), w.add_u32(a + "expert_used_count", 2), w.add_u32(a + "expert_feed_forward_length", 32);
  };
  config_error([&](GgufWriter& w) { family(w, "qwen3moe"), w.add_u32("qwen3moe.attention.sliding_window", 128); },
               "\"qwen3moe.attention.sliding_window\" (128) is not supported");
  config_error([&](GgufWriter& w) { family(w, "qwen3moe"), w.add_u32("llama.expert_count", 8); },
               "\"llama.expert_count\" belongs to no architecture");
  config_error([&](GgufWriter& w) { family(w, "qwen3moe"), w.add_u32("qwen3moe.attention.key_length", 16),
                                    w.add_u32("qwen3moe.attention.value_length", 32); },
               "qwen3moe.attention.value_length differs from the head dimension 16");
  config_error([&](GgufWriter& w) { family(w, "qwen2moe"); }, "qwen2moe.expert_shared_feed_forward_length");
  // A block count beyond the file's blocks (the fuzzer's 2^31: it sized a per-layer list) is named, not allocated.
  config_error([&](GgufWriter& w) { family(w, "qwen3moe", 0x7fffffff); },
               "qwen3moe.block_count is 2147483647 but the file has no blk.0.attn_norm.weight");
  config_error([&](GgufWriter& w) { family(w, "dots1"), w.add_u32("dots1.expert_shared_count", 1),
                                    w.add_u32("dots1.expert_gating_func", 1); },
               "expert_gating_func is not 2 (sigmoid)");
  config_error([&](GgufWriter& w) { family(w, "dots1"); }, "dots1.expert_shared_count");
}

// Each family's metadata becomes the config its HF config.json would give.
TEST(GgufCheckpoint, FamilyMetadata) {
  GgufWriter w;
  const std::string a = "dots1.";
  w.add_string("general.architecture", "dots1");
  w.add_u32(a + "embedding_length", 64), w.add_u32(a + "block_count", 3), w.add_u32(a + "feed_forward_length", 128);
  w.add_u32(a + "attention.head_count", 4), w.add_u32(a + "attention.head_count_kv", 2), w.add_u32(a + "context_length", 256);
  w.add_u32(a + "vocab_size", 512), w.add_u32(a + "attention.key_length", 32), w.add_u32(a + "attention.value_length", 32);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f), w.add_f32(a + "rope.freq_base", 5e4f);
  w.add_u32(a + "expert_count", 16), w.add_u32(a + "expert_used_count", 4), w.add_u32(a + "expert_feed_forward_length", 24);
  w.add_u32(a + "leading_dense_block_count", 1), w.add_u32(a + "expert_shared_count", 2);
  w.add_f32(a + "expert_weights_scale", 2.5f), w.add_u32(a + "expert_gating_func", 2), w.add_bool(a + "expert_weights_norm", true);
  w.add_u32(a + "expert_group_count", 4), w.add_u32(a + "expert_group_used_count", 2);
  w.add_tensor("token_embd.weight", {64, 512}, GgmlType::kF32, [](std::vector<uint8_t>* o) { o->resize(64 * 512 * 4); });
  const std::string path = temp_path("moex_gguf_test_dots1.gguf");
  w.write(path);
  const GgufFile f(path);
  const ModelConfig c = gguf_model_config(f.contents(), path);
  EXPECT_EQ(c.model_type, "dots1");
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.intermediate_size, 24);
  EXPECT_EQ(c.dense_intermediate_size, 128);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.shared_expert_intermediate_size, 48);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.scoring, RouterScoring::kSigmoidGrouped);
  EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
  EXPECT_FALSE(c.has_bos);  // no tokenizer.ggml.bos_token_id
  EXPECT_FLOAT_EQ(c.rope_theta, 5e4f);
}

}  // namespace
}  // namespace moex

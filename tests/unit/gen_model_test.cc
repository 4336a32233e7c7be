// gen-model: the safetensors writer (HF byte layout, sharding), synthetic weights (determinism, router
// skew), the trained tokenizer, and the command's exit codes.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/model/config.h"
#include "moex/model/safetensors.h"
#include "tools/lib/safetensors_writer.h"
#include "tools/lib/synthetic.h"
#include "tools/lib/tokenizer_train.h"

namespace moex {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct ScratchDir {
  fs::path path;
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "moex_gen_model_XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~ScratchDir() { fs::remove_all(path); }
};

// Parses one safetensors file the way a strict reader would and checks the layout invariants.
json check_safetensors_file(const fs::path& path) {
  const std::string bytes = read_file(path);
  EXPECT_GE(bytes.size(), 8u);
  uint64_t header_size = 0;
  for (int b = 0; b < 8; ++b) header_size |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[b])) << (8 * b);
  EXPECT_EQ((8 + header_size) % 8, 0u) << "data must start 8-byte aligned";
  const std::string header_text = bytes.substr(8, header_size);
  EXPECT_EQ(header_text.find_last_not_of(' ') + 1, header_text.find_last_of('}') + 1) << "padding is spaces";
  const json header = json::parse(header_text);
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  for (const auto& [key, value] : header["__metadata__"].items()) {  // gen-model adds its run's id, nothing else
    EXPECT_TRUE(key == "format" || key == kCheckpointIdKey) << key;
  }
  // Offsets: sorted by name, contiguous from 0, ending at the end of the file.
  uint64_t expected_begin = 0;
  for (const auto& [name, info] : header.items()) {  // nlohmann iterates keys in sorted order
    if (name == "__metadata__") continue;
    const uint64_t begin = info["data_offsets"][0], end = info["data_offsets"][1];
    EXPECT_EQ(begin, expected_begin) << name;
    int64_t elements = 1;
    for (int64_t d : info["shape"]) elements *= d;
    const uint64_t element_size = info["dtype"] == "BF16" ? 2 : 4;
    EXPECT_EQ(end - begin, static_cast<uint64_t>(elements) * element_size) << name;
    expected_begin = end;
  }
  EXPECT_EQ(8 + header_size + expected_begin, bytes.size());
  return header;
}

TEST(SafetensorsWriter, ParsesByteSizesLikeTransformers) {
  EXPECT_EQ(parse_byte_size("2GB", "--max-shard-size"), 2'000'000'000ull);
  EXPECT_EQ(parse_byte_size("500mb", "--max-shard-size"), 500'000'000ull);
  EXPECT_EQ(parse_byte_size("4GiB", "--max-shard-size"), 4ull << 30);
  EXPECT_EQ(parse_byte_size("12345", "--max-shard-size"), 12345ull);
  for (const char* bad : {"", "GB", "-1GB", "2 GB", "abc", "0"}) {
    try {
      parse_byte_size(bad, "--max-shard-size");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_NE(std::string(e.what()).find("--max-shard-size"), std::string::npos);
    }
  }
}

// transformers' split: state-dict order, new shard when the next tensor would overflow, and an oversized
// tensor alone in its own shard while the open shard stays open.
TEST(SafetensorsWriter, ShardsLikeTransformers) {
  const std::vector<TensorToWrite> tensors = {{"a", DType::kF32, {25}},   // 100 B
                                              {"b", DType::kF32, {15}},   // 60 B
                                              {"c", DType::kF32, {12}},   // 48 B
                                              {"d", DType::kF32, {75}},   // 300 B: larger than the limit
                                              {"e", DType::kF32, {2}}};   // 8 B
  const SafetensorsPlan plan = plan_safetensors(tensors, 128);
  ASSERT_EQ(plan.shards.size(), 3u);
  EXPECT_EQ(plan.shards[0].tensors, (std::vector<size_t>{0}));
  EXPECT_EQ(plan.shards[1].tensors, (std::vector<size_t>{3}));
  EXPECT_EQ(plan.shards[2].tensors, (std::vector<size_t>{1, 2, 4}));
  EXPECT_EQ(plan.shards[0].file_name, "model-00001-of-00003.safetensors");
  EXPECT_EQ(plan.shards[2].file_name, "model-00003-of-00003.safetensors");
  EXPECT_EQ(plan.total_size, 516u);
  const json index = json::parse(plan.index_json);
  EXPECT_EQ(index["metadata"]["total_size"], 516);
  EXPECT_EQ(index["weight_map"]["d"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["e"], "model-00003-of-00003.safetensors");

  const SafetensorsPlan single = plan_safetensors(tensors, 10000);
  ASSERT_EQ(single.shards.size(), 1u);
  EXPECT_EQ(single.shards[0].file_name, "model.safetensors");
  EXPECT_TRUE(single.index_json.empty());
}

// The exact bytes safetensors' Rust serializer produces: field order dtype, shape, data_offsets.
TEST(SafetensorsWriter, HeaderMatchesHuggingFaceBytes) {
  const std::vector<TensorToWrite> tensors = {{"w", DType::kBF16, {2, 3}}, {"b", DType::kF32, {1}}};
  const SafetensorsPlan plan = plan_safetensors(tensors, kDefaultMaxShardSize);
  const std::string expected =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("w":{"dtype":"BF16","shape":[2,3],"data_offsets":[4,16]}})";
  ASSERT_EQ(plan.shards.size(), 1u);
  EXPECT_EQ(plan.shards[0].header.substr(0, expected.size()), expected);
  EXPECT_EQ(plan.shards[0].header.size() % 8, 0u);
  EXPECT_EQ(plan.shards[0].file_size, 8 + plan.shards[0].header.size() + 16);
}

// The run's id goes into every shard's __metadata__ and the index, after "format" (sorted keys, as json.dumps).
TEST(SafetensorsWriter, RecordsTheCheckpointIdInEveryFile) {
  const std::vector<TensorToWrite> tensors = {{"a", DType::kF32, {25}}, {"b", DType::kF32, {25}}};
  const SafetensorsPlan plan = plan_safetensors(tensors, 100, "0123456789abcdef");
  ASSERT_EQ(plan.shards.size(), 2u);
  for (const auto& shard : plan.shards) {
    EXPECT_EQ(shard.header.rfind(R"({"__metadata__":{"format":"pt","moex_checkpoint_id":"0123456789abcdef"},)", 0), 0u)
        << shard.header;
  }
  const json index = json::parse(plan.index_json);
  EXPECT_EQ(index["metadata"], json({{"moex_checkpoint_id", "0123456789abcdef"}, {"total_size", 200}}));
}

// panels.moex's options: more metadata after the id, and the data padded to start at a page; the file parses.
TEST(SafetensorsWriter, ExtraMetadataAndDataAlignment) {
  const std::vector<TensorToWrite> tensors = {{"m.data", DType::kU8, {64}}, {"m.scales", DType::kF32, {16}}};
  SafetensorsOptions options;
  options.metadata["moex_panels_layout"] = "1";
  options.data_alignment = 4096;
  const SafetensorsPlan plan = plan_safetensors(tensors, UINT64_MAX, "id0", options);
  ASSERT_EQ(plan.shards.size(), 1u);
  const std::string& header = plan.shards[0].header;
  EXPECT_EQ(header.rfind(R"({"__metadata__":{"format":"pt","moex_checkpoint_id":"id0","moex_panels_layout":"1"},)", 0), 0u)
      << header;
  EXPECT_EQ((8 + header.size()) % 4096, 0u);
  EXPECT_EQ(plan.shards[0].file_size, 8 + header.size() + 128);
  std::vector<uint8_t> file(plan.shards[0].file_size, 0);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<uint8_t>(n >> (8 * i));
  std::copy(header.begin(), header.end(), file.begin() + 8);
  std::map<std::string, std::string> meta;
  const auto parsed = SafetensorsFile::parse(file.data(), file.size(), "test", &meta);
  EXPECT_EQ(meta.at("moex_panels_layout"), "1");
  EXPECT_EQ(static_cast<const uint8_t*>(parsed.at("m.data").data) - file.data(), 4096);
  // Without options: transformers' padding to 8, as before.
  EXPECT_EQ((8 + plan_safetensors(tensors, UINT64_MAX).shards[0].header.size()) % 8, 0u);
}

// Two runs that differ in anything the weights depend on get different ids; the same flags the same id.
TEST(SyntheticModel, CheckpointIdFollowsWhatTheWeightsDependOn) {
  ModelConfig c = synthetic_preset("tiny");
  const std::string id = SyntheticModel(c, 1, 0.0f, DType::kBF16).checkpoint_id();
  EXPECT_EQ(id.size(), 16u);
  EXPECT_EQ(SyntheticModel(c, 1, 0.0f, DType::kBF16).checkpoint_id(), id);
  EXPECT_NE(SyntheticModel(c, 2, 0.0f, DType::kBF16).checkpoint_id(), id);
  EXPECT_NE(SyntheticModel(c, 1, 1.0f, DType::kBF16).checkpoint_id(), id);
  EXPECT_NE(SyntheticModel(c, 1, 0.0f, DType::kF32).checkpoint_id(), id);
  c.num_hidden_layers = 3;
  EXPECT_NE(SyntheticModel(c, 1, 0.0f, DType::kBF16).checkpoint_id(), id);
}

ModelConfig tiny_bf16_config() {
  ModelConfig c = synthetic_preset("tiny");
  c.torch_dtype = "bfloat16";
  return c;
}

std::string write_model(const fs::path& dir, uint64_t seed, uint64_t max_shard, uint64_t chunk_bytes) {
  const SyntheticModel model(tiny_bf16_config(), seed, 0.0f, DType::kBF16);
  const SafetensorsPlan plan = plan_safetensors(model.tensors(), max_shard);
  fs::create_directories(dir);
  write_safetensors(dir.string(), model.tensors(), plan, model.filler(), chunk_bytes);
  std::string all;
  for (const auto& shard : plan.shards) all += read_file(dir / shard.file_name);
  return all;
}

TEST(SafetensorsWriter, ShardedModelParsesAndCoversEveryTensor) {
  ScratchDir tmp;
  const SyntheticModel model(tiny_bf16_config(), 7, 0.0f, DType::kBF16);
  const SafetensorsPlan plan = plan_safetensors(model.tensors(), 200'000);  // tiny is ~1 MB
  ASSERT_GT(plan.shards.size(), 3u);
  write_safetensors(tmp.path.string(), model.tensors(), plan, model.filler());
  const json index = json::parse(read_file(tmp.path / "model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), model.tensors().size());
  uint64_t total = 0;
  size_t seen = 0;
  for (const auto& shard : plan.shards) {
    const json header = check_safetensors_file(tmp.path / shard.file_name);
    for (const auto& [name, info] : header.items()) {
      if (name == "__metadata__") continue;
      EXPECT_EQ(index["weight_map"][name], shard.file_name);
      total += info["data_offsets"][1].get<uint64_t>() - info["data_offsets"][0].get<uint64_t>();
      ++seen;
    }
    EXPECT_LE(shard.file_size - 8 - shard.header.size(), 200'000u);  // no tiny tensor exceeds the limit
  }
  EXPECT_EQ(seen, model.tensors().size());
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
}

TEST(SyntheticModel, BytesAreAFunctionOfTheSeedOnly) {
  ScratchDir tmp;
  const std::string a = write_model(tmp.path / "a", 3, kDefaultMaxShardSize, 64ull << 20);
  const std::string b = write_model(tmp.path / "b", 3, kDefaultMaxShardSize, 4096);  // other chunking
  const std::string c = write_model(tmp.path / "c", 4, kDefaultMaxShardSize, 64ull << 20);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a.size(), c.size());
}

TEST(SyntheticModel, StoredValuesMatchValueAndAreHealthy) {
  ScratchDir tmp;
  const SyntheticModel model(tiny_bf16_config(), 1, 0.0f, DType::kBF16);
  write_safetensors(tmp.path.string(), model.tensors(), plan_safetensors(model.tensors(), kDefaultMaxShardSize),
                    model.filler());
  const std::string bytes = read_file(tmp.path / "model.safetensors");
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  const json header = json::parse(bytes.substr(8, header_size));
  const ModelConfig c = model.config();
  for (size_t t = 0; t < model.tensors().size(); ++t) {
    const TensorToWrite& tensor = model.tensors()[t];
    const uint64_t begin = header[tensor.name]["data_offsets"][0];
    const int64_t n = tensor.num_elements();
    double sum = 0, sum_sq = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint16_t raw;
      std::memcpy(&raw, bytes.data() + 8 + header_size + begin + 2 * i, 2);
      const float v = bf16_to_f32(raw);
      ASSERT_EQ(v, model.value(t, i)) << tensor.name << " [" << i << "]";
      ASSERT_TRUE(std::isfinite(v));
      sum += v;
      sum_sq += v * v;
    }
    const double mean = sum / n, rms = std::sqrt(sum_sq / n);
    if (tensor.name.find("norm") != std::string::npos) {
      EXPECT_NEAR(mean, 1.0, 0.05) << tensor.name;
    } else if (tensor.name.find("q_proj") != std::string::npos || tensor.name.find("w1") != std::string::npos) {
      EXPECT_NEAR(rms, std::sqrt(2.0 / c.hidden_size), 0.2 * std::sqrt(2.0 / c.hidden_size)) << tensor.name;
    }
  }
}

TEST(SyntheticModel, RouterSkewFollowsZipf) {
  const ModelConfig c = synthetic_preset("small");
  const SyntheticModel balanced(c, 0, 0.0f, DType::kBF16);
  EXPECT_LT(balanced.router_skew().max_over_mean, 1.4);
  double previous = 1.0;
  for (float skew : {0.8f, 1.2f, 2.0f}) {
    const SyntheticModel model(c, 0, skew, DType::kBF16);
    const RouterSkewReport& r = model.router_skew();
    EXPECT_NEAR(std::accumulate(r.measured_share.begin(), r.measured_share.end(), 0.0), 1.0, 1e-9);
    EXPECT_GT(r.max_over_mean, previous) << skew;
    previous = r.max_over_mean;
    for (int e = 0; e < c.num_local_experts; ++e) {
      EXPECT_NEAR(r.measured_share[e], r.target_share[e], 0.02) << "skew " << skew << " expert " << e;
      EXPECT_GT(r.measured_share[e], 0.0) << "every expert still gets tokens";
    }
  }
  EXPECT_GT(SyntheticModel(c, 0, 1.2f, DType::kBF16).router_skew().max_over_mean, 3.0);
}

// The calibration `bench moe-layer` uses: logits N(0, 1) plus an offset on a constant channel of 1. Checked
// against Zipf shares computed here by hand, on a sample the calibration did not see.
TEST(ZipfRouter, CalibratedOffsetsGiveZipfSharesOnFreshLogits) {
  const int experts = 4, top_k = 1, tokens = 20000;
  const auto normal_noise = [&](uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> noise(static_cast<size_t>(tokens) * experts);
    for (float& v : noise) v = normal(rng);
    return noise;
  };
  const std::vector<float> ones(tokens, 1.0f);
  const ZipfRouterCalibration c = calibrate_zipf_router(1.0f, top_k, normal_noise(1), ones);
  const double harmonic = 1.0 + 1.0 / 2 + 1.0 / 3 + 1.0 / 4;  // Zipf(1) over 4 experts, below the 0.95 cap
  const std::vector<double> shares = route_shares(normal_noise(2), ones, c.gate_offset, top_k);
  for (int e = 0; e < experts; ++e) {
    EXPECT_NEAR(c.target_share[e], 1.0 / (e + 1) / harmonic, 1e-12) << e;
    EXPECT_NEAR(shares[e], 1.0 / (e + 1) / harmonic, 0.015) << e;
  }
  // No skew: no offsets, balanced target.
  const ZipfRouterCalibration flat = calibrate_zipf_router(0.0f, top_k, normal_noise(1), ones);
  for (int e = 0; e < experts; ++e) {
    EXPECT_EQ(flat.gate_offset[e], 0.0f);
    EXPECT_DOUBLE_EQ(flat.target_share[e], 0.25);
  }
}

TEST(Tokenizer, TrainsLlamaStyleByteFallbackBpe) {
  const TrainedTokenizer trained = train_builtin_tokenizer(512);
  EXPECT_EQ(trained.vocab_size, 512);
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.LoadFromSerializedProto(trained.model_proto).ok());
  EXPECT_EQ(sp.IdToPiece(0), "<unk>");
  EXPECT_EQ(sp.IdToPiece(1), "<s>");
  EXPECT_EQ(sp.IdToPiece(2), "</s>");
  EXPECT_EQ(sp.IdToPiece(3), "<0x00>");
  EXPECT_EQ(sp.IdToPiece(258), "<0xFF>");
  const std::string text = "The quick brown fox jumps over the lazy dog. Grüße, 東京! 42";
  std::vector<int> ids;
  ASSERT_TRUE(sp.Encode(text, &ids).ok());
  for (int id : ids) EXPECT_NE(id, 0) << "byte fallback: nothing is unknown";
  std::string back;
  ASSERT_TRUE(sp.Decode(ids, &back).ok());
  EXPECT_EQ(back, text);
  // Deterministic: the same vocab gives the same file.
  EXPECT_TRUE(train_builtin_tokenizer(512).model_proto == trained.model_proto);
  const TrainedTokenizer large = train_builtin_tokenizer(32000);
  EXPECT_EQ(large.vocab_size, 32000);
  EXPECT_GT(large.trained_pieces, 2000);
  sentencepiece::SentencePieceProcessor large_sp;
  ASSERT_TRUE(large_sp.LoadFromSerializedProto(large.model_proto).ok());
  EXPECT_EQ(large_sp.GetPieceSize(), 32000);
  ASSERT_TRUE(large_sp.Encode(text, &ids).ok());
  ASSERT_TRUE(large_sp.Decode(ids, &back).ok());
  EXPECT_EQ(back, text);
  std::string piece_text;
  ASSERT_TRUE(large_sp.Decode(std::vector<int>{31999}, &piece_text).ok());
  EXPECT_NE(piece_text.find(' '), std::string::npos) << "the padding pieces are word pairs";
}

#ifdef MOEX_BINARY
int run(const std::string& args) {
  const int status = std::system((std::string(MOEX_BINARY) + " " + args + " >/dev/null 2>&1").c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(GenModelCommand, WritesAHuggingFaceFolder) {
  ScratchDir tmp;
  const fs::path out = tmp.path / "tiny";
  ASSERT_EQ(run("gen-model --preset tiny --seed 5 --router-skew 1.2 --out " + out.string()), 0);
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                           "generation_config.json"}) {
    EXPECT_TRUE(fs::exists(out / file)) << file;
  }
  const ModelConfig config = load_model_config((out / "config.json").string());
  EXPECT_EQ(config.hidden_size, 64);
  EXPECT_EQ(config.num_hidden_layers, 2);
  EXPECT_EQ(config.vocab_size, 512);
  const json tokenizer_config = json::parse(read_file(out / "tokenizer_config.json"));
  EXPECT_EQ(tokenizer_config["add_bos_token"], true);
  EXPECT_EQ(tokenizer_config["bos_token"], "<s>");
  const json generation_config = json::parse(read_file(out / "generation_config.json"));
  EXPECT_EQ(generation_config["eos_token_id"], 2);
  const json header = check_safetensors_file(out / "model.safetensors");
  EXPECT_EQ(header["model.layers.1.block_sparse_moe.experts.7.w2.weight"]["shape"], json({64, 128}));
  EXPECT_EQ(header["model.layers.0.self_attn.k_proj.weight"]["shape"], json({32, 64}));
  EXPECT_EQ(header["lm_head.weight"]["dtype"], "BF16");

  // A folder holding a model is replaced only with --force; then the single file goes (no stale
  // model.safetensors beside the index).
  EXPECT_EQ(run("gen-model --preset tiny --seed 5 --dtype f32 --max-shard-size 300KB --out " + out.string()), 2);
  ASSERT_EQ(run("gen-model --preset tiny --seed 5 --dtype f32 --max-shard-size 300KB --force --out " + out.string()), 0);
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_EQ(load_model_config((out / "config.json").string()).torch_dtype, "float32");
}

TEST(GenModelCommand, BadFlagsExitWithTwo) {
  ScratchDir tmp;
  const std::string out = " --out " + (tmp.path / "m").string();
  EXPECT_EQ(run("gen-model --preset huge" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --layers 0" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --dtype f16" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --dtype fp32" + out), 2);  // one spelling: f32
  EXPECT_EQ(run("gen-model --preset tiny --seed -1" + out), 2);     // would wrap to 2^64 - 1
  EXPECT_EQ(run("gen-model --preset tiny --threads -1" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --max-shard-size lots" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --hidden 65" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --router-skew -1" + out), 2);
  EXPECT_EQ(run("gen-model --preset tiny --router-skew 16.5" + out), 2);  // past kMaxRouterSkew
  EXPECT_EQ(run("gen-model --preset tiny --out /proc/moex_cannot_write_here"), 2);
  EXPECT_EQ(run("gen-model --preset tiny"), 2);  // --out is required
}
#endif

}  // namespace
}  // namespace moex

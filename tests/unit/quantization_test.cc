// quantization_config parsing (model/quantization.h) and the packed copies in the run-memory estimate.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/model/quantization.h"
#include "moex/runtime/run_memory.h"

namespace moex {
namespace {

using json = nlohmann::json;
using kernels::WeightFormat;

json int4_config() {
  return json::parse(R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "global_compression_ratio": 3.1, "version": "0.9.1",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null, "output_activations": null,
      "weights": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group", "group_size": 64,
                  "dynamic": false, "actorder": null, "observer": "minmax", "observer_kwargs": {},
                  "block_structure": null}}},
    "ignore": ["lm_head", "re:.*block_sparse_moe\\.gate$"], "kv_cache_scheme": null, "sparsity_config": {}})");
}

std::string error_of(const json& q) {
  try {
    parse_quantization_config(q.dump(), "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Quantization, ReadsAnLlmCompressorInt4Config) {
  const QuantizationConfig c = parse_quantization_config(int4_config().dump(), "config.json");
  ASSERT_EQ(c.method, QuantMethod::kCompressedTensors);
  ASSERT_EQ(c.schemes.size(), 1u);
  EXPECT_EQ(c.schemes[0].weight_format, WeightFormat::kInt4);
  EXPECT_EQ(c.schemes[0].group, 64);
  EXPECT_FALSE(c.schemes[0].symmetric);
  // Python's re.match: anchored at the start, not at the end; "Linear" takes every linear module.
  EXPECT_EQ(c.scheme_for("model.layers.3.block_sparse_moe.experts.7.w2"), &c.schemes[0]);
  EXPECT_EQ(c.scheme_for("model.layers.3.self_attn.q_proj"), &c.schemes[0]);
  EXPECT_EQ(c.scheme_for("model.layers.3.block_sparse_moe.gate"), nullptr);
  EXPECT_EQ(c.scheme_for("lm_head"), nullptr);
}

TEST(Quantization, TargetsByNameAndRegexAndTwoGroupsForOneModuleAreRefused) {
  json q = int4_config();
  q["config_groups"]["group_0"]["targets"] = {"re:.*experts"};
  q["config_groups"]["group_1"] = {{"targets", {"model.layers.0.self_attn.o_proj"}},
                                   {"weights", {{"num_bits", 8}, {"type", "int"}, {"strategy", "channel"}}},
                                   {"format", "int-quantized"}};
  const QuantizationConfig c = parse_quantization_config(q.dump(), "config.json");
  EXPECT_EQ(c.scheme_for("model.layers.0.self_attn.o_proj")->weight_format, WeightFormat::kInt8);
  EXPECT_EQ(c.scheme_for("model.layers.1.self_attn.o_proj"), nullptr);
  EXPECT_EQ(c.scheme_for("model.layers.1.block_sparse_moe.experts.2.w1")->weight_format, WeightFormat::kInt4);
  q["config_groups"]["group_1"]["targets"] = {"re:model\\.layers\\.0\\..*"};
  const QuantizationConfig both = parse_quantization_config(q.dump(), "config.json");
  EXPECT_THROW(both.scheme_for("model.layers.0.block_sparse_moe.experts.2.w1"), Error);
}

TEST(Quantization, EveryUnsupportedSettingIsNamed) {
  const auto with = [](const std::function<void(json&)>& edit) {
    json q = int4_config();
    edit(q);
    return error_of(q);
  };
  const auto w = "/config_groups/group_0/weights"_json_pointer;
  EXPECT_THAT(with([&](json& q) { q["novel"] = 1; }), testing::HasSubstr("unknown field \"novel\""));
  EXPECT_THAT(with([&](json& q) { q[w]["num_bits"] = 2; }), testing::HasSubstr("2-bit int weights"));
  EXPECT_THAT(with([&](json& q) { q[w]["group_size"] = 16; }), testing::HasSubstr("group_size 16"));
  EXPECT_THAT(with([&](json& q) { q[w]["strategy"] = "channel"; }), testing::HasSubstr("strategy \"channel\""));
  EXPECT_THAT(with([&](json& q) { q[w]["actorder"] = "weight"; }), testing::HasSubstr("actorder"));
  EXPECT_THAT(with([&](json& q) { q[w]["symmetric"] = "yes"; }), testing::HasSubstr("symmetric"));
  EXPECT_THAT(with([&](json& q) { q[w]["zp_dtype"] = "int8"; }), testing::HasSubstr("zp_dtype"));
  EXPECT_THAT(with([&](json& q) { q[w]["seed"] = 3; }), testing::HasSubstr("unknown field \"seed\""));
  EXPECT_THAT(with([&](json& q) { q["format"] = "marlin-24"; }), testing::HasSubstr("marlin-24"));
  EXPECT_THAT(with([&](json& q) { q["config_groups"]["group_0"]["format"] = "int-quantized"; }),
              testing::HasSubstr("does not hold these weights"));
  EXPECT_THAT(with([&](json& q) { q["sparsity_config"] = {{"format", "sparse-24"}}; }), testing::HasSubstr("sparse"));
  EXPECT_THAT(with([&](json& q) { q["kv_cache_scheme"] = {{"num_bits", 8}}; }), testing::HasSubstr("KV cache"));
  EXPECT_THAT(with([&](json& q) { q["config_groups"] = json::object(); }), testing::HasSubstr("config_groups"));
  EXPECT_THAT(with([&](json& q) { q["quant_method"] = "awq"; }), testing::HasSubstr("\"awq\""));
}

// llm-compressor's W8A8 recipe (int8 weights per channel, dynamic per-token int8 activations), as its config.json
// reads; every other activation scheme is refused naming input_activations.
TEST(Quantization, ReadsLlmCompressorW8A8AndRefusesOtherActivationSchemes) {
  const json w8a8 = json::parse(R"({"quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "global_compression_ratio": 1.46, "version": "0.9.1",
    "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": null, "format": "int-quantized",
      "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "group_size": null,
                            "dynamic": true, "actorder": null, "observer": null, "observer_kwargs": {},
                            "block_structure": null},
      "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "group_size": null,
                  "dynamic": false, "actorder": null, "observer": "minmax", "observer_kwargs": {},
                  "block_structure": null}}},
    "ignore": ["lm_head"], "kv_cache_scheme": null, "sparsity_config": {}})");
  const QuantizationConfig c = parse_quantization_config(w8a8.dump(), "config.json");
  EXPECT_EQ(c.scheme_for("model.layers.0.self_attn.q_proj")->weight_format, WeightFormat::kInt8W8A8);
  const auto with = [&](const std::function<void(json&)>& edit) {
    json q = w8a8;
    edit(q);
    return error_of(q);
  };
  const auto a = "/config_groups/group_0/input_activations"_json_pointer;
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"dynamic", false}, {"strategy", "tensor"}, {"symmetric", false}, {"num_bits", 4}, {"type", "float"},
           {"group_size", 128}})
    EXPECT_THAT(with([&](json& q) { q[a][key] = value; }), testing::HasSubstr("input_activations")) << key;
  EXPECT_THAT(with([&](json& q) { q[a]["seed"] = 1; }), testing::HasSubstr("unknown field \"seed\""));
  EXPECT_THAT(with([&](json& q) { q["config_groups"]["group_0"]["output_activations"] = q[a]; }),
              testing::HasSubstr("output_activations"));
  json int4 = int4_config();
  int4["config_groups"]["group_0"]["input_activations"] = w8a8[a];
  EXPECT_THAT(error_of(int4), testing::HasSubstr("int8 per-channel weights only"));
}

TEST(Quantization, ReadsDeepSeekFp8Blocks) {
  const json q = {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}, {"fmt", "e4m3"},
                  {"weight_block_size", {128, 128}}, {"modules_to_not_convert", {"lm_head"}}};
  const QuantizationConfig c = parse_quantization_config(q.dump(), "config.json");
  EXPECT_EQ(c.method, QuantMethod::kFP8Blocks);
  EXPECT_EQ(c.scheme_for("model.layers.0.self_attn.q_proj")->weight_format, WeightFormat::kFP8E4M3);
  EXPECT_EQ(c.scheme_for("lm_head"), nullptr);
  json bad = q;
  bad["weight_block_size"] = {128, 64};
  EXPECT_THAT(error_of(bad), testing::HasSubstr("weight_block_size"));
}

TEST(Quantization, WhatQuantizeWritesReadsBack) {
  for (const auto& [format, group] : {std::pair{WeightFormat::kInt8, 0}, {WeightFormat::kInt8W8A8, 0}, {WeightFormat::kInt4, 32},
                                      {WeightFormat::kFP8E4M3, 0}}) {
    const QuantizationConfig c = compressed_tensors_config(format, group);
    const QuantizationConfig again = parse_quantization_config(c.json, "config.json");
    ASSERT_EQ(again.schemes.size(), 1u);
    EXPECT_EQ(again.schemes[0].weight_format, format);
    EXPECT_EQ(again.scheme_for("model.layers.0.block_sparse_moe.gate"), nullptr);
    EXPECT_NE(again.scheme_for("model.layers.0.block_sparse_moe.experts.0.w3"), nullptr);
  }
}

TEST(RunMemory, CountsPackedCopies) {
  ModelConfig c;
  c.num_hidden_layers = 2;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 1000;
  ModelOptions o;
  EXPECT_EQ(estimate_run_memory(c, o, 1).packed_bytes, 0.0);
  o.expert_weights.packed = true;
  o.expert_weights.format = WeightFormat::kBF16;
  const double experts = 2.0 * 8 * 3 * 256 * 512 * 2;
  EXPECT_DOUBLE_EQ(estimate_run_memory(c, o, 1).packed_bytes, experts);
  o.dense_weights = o.expert_weights;
  const double dense = 2.0 * (256 * 256 + 2 * 128 * 256 + 256 * 256) * 2 + 1000.0 * 256 * 2;
  EXPECT_DOUBLE_EQ(estimate_run_memory(c, o, 1).packed_bytes, experts + dense);
  // A stored int8 checkpoint's modules are packed whatever the flags say (the flags then must be as-stored).
  o = ModelOptions{};
  c.quantization = compressed_tensors_config(WeightFormat::kInt8, 0);
  EXPECT_GT(estimate_run_memory(c, o, 1).packed_bytes, 0.45 * (experts + dense - 1000.0 * 256 * 2));
}

}  // namespace
}  // namespace moex

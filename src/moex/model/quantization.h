// `quantization_config` of config.json: which linear modules of a checkpoint are stored quantized, and how.
//
// Two conventions are read (docs/kernels.md, "Quantized checkpoints"):
//   compressed-tensors  (llm-compressor, read by HF transformers and vLLM): quant_method "compressed-tensors",
//                       config_groups {name: {targets, weights: QuantizationArgs}}, ignore, format
//                       int-quantized (int8 per channel: `weight` I8, `weight_scale` [out, 1]),
//                       pack-quantized (int4 per group: `weight_packed` I32 [out, in/8], `weight_scale`
//                       [out, in/G], `weight_shape`, asymmetric also `weight_zero_point` I32 [out/8, in/G]),
//                       float-quantized (fp8 e4m3 per 128x128 block: `weight` F8_E4M3, `weight_scale`
//                       [out/128, in/128]);
//   fp8 blocks          (DeepSeek-V3, Qwen3-FP8, HF's FineGrainedFP8): quant_method "fp8", weight_block_size
//                       [128, 128]: `weight` F8_E4M3 and `weight_scale_inv` F32 beside each quantized weight.
// Everything else (other bit widths, activation quantization, act-order, sparsity, unknown fields) is refused
// with a line naming the field: a checkpoint MoEX would read wrongly must not load.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/kernels/packed.h"

namespace moex {

enum class QuantMethod : uint8_t { kNone, kCompressedTensors, kFP8Blocks };

// One config group of compressed-tensors (or the single scheme of an fp8-blocks checkpoint).
struct QuantScheme {
  std::string name;                       // "group_0"
  std::vector<std::string> targets;       // "Linear", a module name, or "re:<regex>" (matched from the start)
  std::string format;                     // int-quantized | pack-quantized | float-quantized | fp8-blocks
  kernels::WeightFormat weight_format = kernels::WeightFormat::kInt8;  // kInt8 (kInt8W8A8 with int8 per-token
                                                                      // input_activations), kInt4 or kFP8E4M3
  int64_t group = 0;                      // kInt4: 32, 64 or 128; kFP8E4M3: 128
  bool symmetric = true;
};

struct QuantizationConfig {
  QuantMethod method = QuantMethod::kNone;
  std::vector<QuantScheme> schemes;
  std::vector<std::string> ignore;        // compressed-tensors ignore / fp8 modules_to_not_convert
  std::string json;                       // the object as config.json holds it (normalised), to write it back

  bool quantized() const { return method != QuantMethod::kNone; }
  // The scheme of linear module `module` ("model.layers.0.self_attn.q_proj"), or nullptr when it is stored
  // unquantized. For fp8 blocks every module not ignored is a candidate (the loader looks for its scale).
  // Throws Error(kInvalidInput) when two groups claim the module.
  const QuantScheme* scheme_for(const std::string& module) const;
};

// Parses config.json's "quantization_config" (given as JSON text); throws Error(kInvalidInput) naming the field.
QuantizationConfig parse_quantization_config(const std::string& json_text, const std::string& origin);

// What `moex quantize` writes: every expert and attention projection in `format` (kInt8, kInt4 with `group`,
// kFP8E4M3), the router and lm_head ignored, in the compressed-tensors convention.
QuantizationConfig compressed_tensors_config(kernels::WeightFormat format, int64_t group);
// The formats compressed_tensors_config writes (moex quantize's --weights), in the format table's order.
std::vector<kernels::WeightFormat> compressed_tensors_formats();

}  // namespace moex

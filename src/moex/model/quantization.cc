#include "moex/model/quantization.h"

#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/kernels/formats.h"

namespace moex {
namespace {

using json = nlohmann::json;

void check_keys(const json& j, const std::set<std::string>& known, const std::string& where) {
  MOEX_CHECK_INPUT(j.is_object(), where, ": expected a JSON object, got ", j.type_name());
  for (const auto& [key, value] : j.items())
    MOEX_CHECK_INPUT(known.count(key), where, ": unknown field \"", key, "\" (MoEX cannot tell what it changes)");
}

bool is_null_or_empty(const json& j) { return j.is_null() || (j.is_object() && j.empty()); }

std::string get_string(const json& j, const char* key, const std::string& where) {
  MOEX_CHECK_INPUT(j.contains(key), where, ": missing field \"", key, "\"");
  MOEX_CHECK_INPUT(j[key].is_string(), where, ".", key, ": expected a string, got ", j[key].dump());
  return j[key].get<std::string>();
}

std::vector<std::string> get_strings(const json& j, const char* key, const std::string& where) {
  std::vector<std::string> out;
  if (!j.contains(key) || j[key].is_null()) return out;
  MOEX_CHECK_INPUT(j[key].is_array(), where, ".", key, ": expected a list of strings");
  for (const json& item : j[key]) {
    MOEX_CHECK_INPUT(item.is_string(), where, ".", key, ": expected a list of strings, got ", item.dump());
    out.push_back(item.get<std::string>());
  }
  return out;
}

// compressed-tensors QuantizationArgs of a group's weights -> the kernel format, or an error naming the field.
void parse_weight_args(const json& w, const std::string& where, QuantScheme& s) {
  check_keys(w, {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "actorder",
                 "observer", "observer_kwargs", "scale_dtype", "zp_dtype"},
             where);
  MOEX_CHECK_INPUT(w.contains("num_bits") && w["num_bits"].is_number_integer(), where,
                   ".num_bits: expected an integer");
  const int bits = w["num_bits"].get<int>();
  const std::string type = w.contains("type") ? get_string(w, "type", where) : "int";
  const std::string strategy = get_string(w, "strategy", where);
  MOEX_CHECK_INPUT(!w.contains("symmetric") || w["symmetric"].is_null() || w["symmetric"].is_boolean(), where,
                   ".symmetric: expected true or false, got ", w.value("symmetric", json()).dump());
  s.symmetric = !w.contains("symmetric") || w["symmetric"].is_null() || w["symmetric"].get<bool>();
  MOEX_CHECK_INPUT(!w.contains("dynamic") || w["dynamic"].is_null() || w["dynamic"] == false, where,
                   ".dynamic: dynamic weight quantization is not a stored checkpoint");
  MOEX_CHECK_INPUT(!w.contains("actorder") || w["actorder"].is_null(), where, ".actorder ", w.value("actorder", json()).dump(),
                   " is not supported (the group of a column would depend on weight_g_idx)");
  for (const char* key : {"scale_dtype", "zp_dtype"})
    MOEX_CHECK_INPUT(!w.contains(key) || w[key].is_null(), where, ".", key, " ", w.value(key, json()).dump(),
                     " is not supported (the scale's dtype is the tensor's own)");
  const auto group_size = [&]() -> int64_t {
    if (!w.contains("group_size") || w["group_size"].is_null()) return 0;
    MOEX_CHECK_INPUT(w["group_size"].is_number_integer(), where, ".group_size: expected an integer");
    return w["group_size"].get<int64_t>();
  };
  const bool has_block = w.contains("block_structure") && !w["block_structure"].is_null();
  if (type == "int" && bits == 8) {
    MOEX_CHECK_INPUT(strategy == "channel", where, ": int8 weights with strategy \"", strategy,
                     "\" are not supported (MoEX reads int8 with one scale per output channel: strategy \"channel\")");
    MOEX_CHECK_INPUT(s.symmetric, where, ": asymmetric int8 weights are not supported (symmetric: true)");
    MOEX_CHECK_INPUT(!has_block && group_size() == 0, where, ": int8 per channel takes no group_size or block_structure");
    s.weight_format = kernels::WeightFormat::kInt8;
    s.group = 0;
  } else if (type == "int" && bits == 4) {
    MOEX_CHECK_INPUT(strategy == "group", where, ": int4 weights with strategy \"", strategy,
                     "\" are not supported (MoEX reads int4 per group: strategy \"group\")");
    s.group = group_size();
    MOEX_CHECK_INPUT(s.group == 32 || s.group == 64 || s.group == 128, where, ".group_size ", s.group,
                     " is not supported (32, 64 or 128)");
    MOEX_CHECK_INPUT(!has_block, where, ": int4 per group takes no block_structure");
    s.weight_format = kernels::WeightFormat::kInt4;
  } else if (type == "float" && bits == 8) {
    MOEX_CHECK_INPUT(strategy == "block", where, ": fp8 weights with strategy \"", strategy,
                     "\" are not supported (MoEX reads fp8 per 128x128 block: strategy \"block\")");
    MOEX_CHECK_INPUT(has_block && w["block_structure"] == json::array({128, 128}), where, ".block_structure ",
                     w.value("block_structure", json()).dump(), " is not supported (only [128, 128])");
    MOEX_CHECK_INPUT(s.symmetric, where, ": asymmetric fp8 weights are not supported");
    s.weight_format = kernels::WeightFormat::kFP8E4M3;
    s.group = 128;
  } else {
    throw_error(ErrorKind::kInvalidInput, where + ": " + std::to_string(bits) + "-bit " + type +
                                              " weights are not supported (int8 per channel, int4 per group, fp8 "
                                              "per 128x128 block)");
  }
}

// A group's input_activations: only llm-compressor's W8A8 scheme (int8 per channel weights, activations quantized
// per token to int8 at run time, symmetric) is read, as int8-w8a8: the scheme vLLM runs as its dynamic per-token
// int8 path, and MoEX's kernels compute it (scale = absmax / 127, round half to even). Anything else is refused.
void parse_input_activations(const json& a, const std::string& where, QuantScheme& s) {
  check_keys(a, {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "actorder",
                 "observer", "observer_kwargs", "scale_dtype", "zp_dtype"},
             where);
  const auto is = [&](const char* key, const json& want) { return a.contains(key) && a[key] == want; };
  const auto null_or_absent = [&](const char* key) { return !a.contains(key) || is_null_or_empty(a[key]); };
  const bool ok = is("num_bits", 8) && (!a.contains("type") || is("type", "int")) && is("strategy", "token") &&
                  (null_or_absent("symmetric") || is("symmetric", true)) && is("dynamic", true) &&
                  null_or_absent("group_size") && null_or_absent("block_structure") && null_or_absent("actorder") &&
                  null_or_absent("scale_dtype") && null_or_absent("zp_dtype");
  MOEX_CHECK_INPUT(ok, where, " ", a.dump(), ": activation quantization other than dynamic per-token symmetric int8 "
                   "(W8A8: num_bits 8, type int, strategy token, dynamic true) is not supported");
  MOEX_CHECK_INPUT(s.weight_format == kernels::WeightFormat::kInt8, where,
                   ": int8 activations are read with int8 per-channel weights only (W8A8)");
  s.weight_format = kernels::WeightFormat::kInt8W8A8;
}

const std::set<std::string> kFormats = {"int-quantized", "pack-quantized", "float-quantized"};

void check_format_fits(const QuantScheme& s, const std::string& where) {
  const bool int8 = s.weight_format == kernels::WeightFormat::kInt8 || s.weight_format == kernels::WeightFormat::kInt8W8A8;
  const char* want = int8                                              ? "int-quantized"
                     : s.weight_format == kernels::WeightFormat::kInt4 ? "pack-quantized"
                                                                       : "float-quantized";
  MOEX_CHECK_INPUT(s.format == want, where, ": format \"", s.format, "\" does not hold these weights (MoEX reads them as \"",
                   want, "\")");
}

QuantizationConfig parse_compressed_tensors(const json& q, const std::string& origin) {
  const std::string where = origin + ": quantization_config";
  check_keys(q, {"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
                 "global_compression_ratio", "sparsity_config", "version", "transform_config"},
             where);
  QuantizationConfig c;
  c.method = QuantMethod::kCompressedTensors;
  const std::string format = q.contains("format") ? get_string(q, "format", where) : "";
  MOEX_CHECK_INPUT(format.empty() || kFormats.count(format) || format == "mixed-precision", where, ".format \"", format,
                   "\" is not supported (int-quantized, pack-quantized, float-quantized)");
  if (q.contains("quantization_status")) {
    const std::string status = get_string(q, "quantization_status", where);
    MOEX_CHECK_INPUT(status == "compressed", where, ".quantization_status \"", status,
                     "\": MoEX loads compressed checkpoints only");
  }
  MOEX_CHECK_INPUT(!q.contains("kv_cache_scheme") || q["kv_cache_scheme"].is_null(), where,
                   ".kv_cache_scheme: a quantized KV cache is not supported");
  MOEX_CHECK_INPUT(!q.contains("sparsity_config") || is_null_or_empty(q["sparsity_config"]), where,
                   ".sparsity_config: sparse checkpoints are not supported");
  MOEX_CHECK_INPUT(!q.contains("transform_config") || is_null_or_empty(q["transform_config"]), where,
                   ".transform_config: weight transforms are not supported");
  MOEX_CHECK_INPUT(q.contains("config_groups") && q["config_groups"].is_object() && !q["config_groups"].empty(), where,
                   ": missing or empty \"config_groups\"");
  for (const auto& [name, g] : q["config_groups"].items()) {
    const std::string gw = where + ".config_groups." + name;
    check_keys(g, {"targets", "weights", "input_activations", "output_activations", "format"}, gw);
    MOEX_CHECK_INPUT(!g.contains("output_activations") || g["output_activations"].is_null(), gw,
                     ".output_activations: output quantization is not supported");
    QuantScheme s;
    s.name = name;
    s.targets = get_strings(g, "targets", gw);
    MOEX_CHECK_INPUT(!s.targets.empty(), gw, ": missing or empty \"targets\"");
    MOEX_CHECK_INPUT(g.contains("weights") && g["weights"].is_object(), gw, ": missing \"weights\"");
    parse_weight_args(g["weights"], gw + ".weights", s);
    if (g.contains("input_activations") && !g["input_activations"].is_null())
      parse_input_activations(g["input_activations"], gw + ".input_activations", s);
    s.format = g.contains("format") && !g["format"].is_null() ? get_string(g, "format", gw) : format;
    MOEX_CHECK_INPUT(kFormats.count(s.format), gw, ": format \"", s.format,
                     "\" is not supported (int-quantized, pack-quantized, float-quantized)");
    check_format_fits(s, gw);
    c.schemes.push_back(std::move(s));
  }
  c.ignore = get_strings(q, "ignore", where);
  return c;
}

QuantizationConfig parse_fp8_blocks(const json& q, const std::string& origin) {
  const std::string where = origin + ": quantization_config";
  check_keys(q, {"quant_method", "activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert",
                 "ignored_layers"},
             where);
  if (q.contains("fmt")) {
    const std::string fmt = get_string(q, "fmt", where);
    MOEX_CHECK_INPUT(fmt == "e4m3", where, ".fmt \"", fmt, "\" is not supported (e4m3)");
  }
  if (q.contains("activation_scheme")) {
    const std::string act = get_string(q, "activation_scheme", where);
    MOEX_CHECK_INPUT(act == "dynamic", where, ".activation_scheme \"", act,
                     "\" is not supported (dynamic: MoEX keeps activations unquantized)");
  }
  MOEX_CHECK_INPUT(q.contains("weight_block_size") && q["weight_block_size"] == json::array({128, 128}), where,
                   ".weight_block_size ", q.value("weight_block_size", json()).dump(),
                   " is not supported (MoEX reads fp8 in 128x128 blocks: [128, 128])");
  QuantizationConfig c;
  c.method = QuantMethod::kFP8Blocks;
  QuantScheme s;
  s.name = "fp8";
  s.targets = {"Linear"};
  s.format = "fp8-blocks";
  s.weight_format = kernels::WeightFormat::kFP8E4M3;
  s.group = 128;
  c.schemes.push_back(s);
  c.ignore = get_strings(q, "modules_to_not_convert", where);
  for (std::string& name : get_strings(q, "ignored_layers", where)) c.ignore.push_back(std::move(name));
  return c;
}

// compressed-tensors' matching: "re:" patterns with Python's re.match (anchored at the start only), else the
// exact module name; "Linear" (the class) matches every linear module, which is all this asks about.
bool matches(const std::string& pattern, const std::string& module) {
  if (pattern == "Linear") return true;
  if (pattern.rfind("re:", 0) == 0) {
    try {
      return std::regex_search(module, std::regex(pattern.substr(3)), std::regex_constants::match_continuous);
    } catch (const std::regex_error&) {
      throw_error(ErrorKind::kInvalidInput, "quantization_config: \"" + pattern + "\" is not a valid regular expression");
    }
  }
  return pattern == module;
}

}  // namespace

const QuantScheme* QuantizationConfig::scheme_for(const std::string& module) const {
  for (const std::string& pattern : ignore)
    if (matches(pattern, module)) return nullptr;
  const QuantScheme* found = nullptr;
  for (const QuantScheme& s : schemes) {
    bool hit = false;
    for (const std::string& t : s.targets) hit = hit || matches(t, module);
    if (!hit) continue;
    MOEX_CHECK_INPUT(found == nullptr, "quantization_config: module ", module, " is targeted by both config group ",
                     found ? found->name : "", " and ", s.name);
    found = &s;
  }
  return found;
}

QuantizationConfig parse_quantization_config(const std::string& json_text, const std::string& origin) {
  json q;
  try {
    q = json::parse(json_text);
  } catch (const json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, origin + ": quantization_config is not valid JSON (" + e.what() + ")");
  }
  MOEX_CHECK_INPUT(q.is_object(), origin, ": quantization_config must be an object");
  const std::string method = get_string(q, "quant_method", origin + ": quantization_config");
  QuantizationConfig c;
  if (method == "compressed-tensors") c = parse_compressed_tensors(q, origin);
  else if (method == "fp8") c = parse_fp8_blocks(q, origin);
  else
    throw_error(ErrorKind::kInvalidInput, origin + ": quantization_config.quant_method \"" + method +
                                              "\" is not supported (compressed-tensors, fp8)");
  c.json = q.dump();
  return c;
}

std::vector<kernels::WeightFormat> compressed_tensors_formats() {
  // Those with a case in compressed_tensors_config below, in the format table's order. A list, not a walk of
  // kernels::all_formats(): the config and safetensors fuzzers link this file without the kernels.
  using kernels::WeightFormat;
  return {WeightFormat::kInt8, WeightFormat::kInt8W8A8, WeightFormat::kInt4, WeightFormat::kFP8E4M3};
}

QuantizationConfig compressed_tensors_config(kernels::WeightFormat format, int64_t group) {
  json weights;
  std::string fmt;
  json input_activations;  // null: weight-only
  switch (format) {
    case kernels::WeightFormat::kInt8W8A8:  // llm-compressor's W8A8 scheme: activations int8 per token at run time
      input_activations = {{"num_bits", 8}, {"type", "int"}, {"symmetric", true}, {"strategy", "token"},
                           {"dynamic", true}, {"group_size", nullptr}, {"block_structure", nullptr},
                           {"actorder", nullptr}, {"observer", nullptr}, {"observer_kwargs", json::object()}};
      [[fallthrough]];
    case kernels::WeightFormat::kInt8:
      weights = {{"num_bits", 8}, {"type", "int"}, {"symmetric", true}, {"strategy", "channel"}, {"group_size", nullptr}};
      fmt = "int-quantized";
      break;
    case kernels::WeightFormat::kInt4:
      weights = {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"}, {"group_size", group}};
      fmt = "pack-quantized";
      break;
    case kernels::WeightFormat::kFP8E4M3:
      weights = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"strategy", "block"},
                 {"group_size", nullptr}, {"block_structure", {128, 128}}};
      fmt = "float-quantized";
      break;
    default: MOEX_CHECK(false, "compressed_tensors_config: int8, int8-w8a8, int4 or fp8");
  }
  weights["dynamic"] = false;
  weights["actorder"] = nullptr;
  weights["observer"] = "minmax";
  weights["block_structure"] = weights.value("block_structure", json());
  const json group0 = {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", input_activations},
                       {"output_activations", nullptr}, {"format", fmt}};
  const json q = {{"quant_method", "compressed-tensors"},
                  {"format", fmt},
                  {"quantization_status", "compressed"},
                  {"config_groups", {{"group_0", group0}}},
                  {"ignore", {"lm_head", "re:.*block_sparse_moe\\.gate$"}},
                  {"kv_cache_scheme", nullptr},
                  {"sparsity_config", json::object()}};
  return parse_quantization_config(q.dump(), "moex quantize");
}

}  // namespace moex

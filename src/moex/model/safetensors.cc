#include "moex/model/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/model/safetensors_index.h"

namespace moex {
namespace {

using json = nlohmann::json;
constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit (100 MB)

}  // namespace

std::map<std::string, TensorView> SafetensorsFile::parse(const uint8_t* bytes, size_t size, const std::string& origin,
                                                         std::map<std::string, std::string>* metadata) {
  if (size < 8) throw_input_error(origin, "file is " + std::to_string(size) + " bytes, too short for a safetensors header");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > kMaxHeaderBytes || header_len > size - 8)
    throw_input_error(origin, "header length " + std::to_string(header_len) + " exceeds the file (" + std::to_string(size) +
                     " bytes): truncated or not a safetensors file");
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const json::exception& e) {
    throw_input_error(origin, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw_input_error(origin, "header is not a JSON object");
  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  std::map<std::string, TensorView> tensors;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw_input_error(origin, "__metadata__ is not an object");
      if (metadata) {
        for (const auto& [key, value] : entry.items()) {
          if (value.is_string()) (*metadata)[key] = value.get<std::string>();
        }
      }
      continue;
    }
    const std::string where = "tensor \"" + name + "\"";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      throw_input_error(origin, where + " lacks dtype, shape or data_offsets");
    const json& dtype_json = entry["dtype"];
    const json& shape_json = entry["shape"];
    const json& offsets_json = entry["data_offsets"];
    TensorView view;
    if (!dtype_json.is_string() || !dtype_from_name(dtype_json.get<std::string>(), &view.dtype))
      throw_input_error(origin, where + " has unsupported dtype " + dtype_json.dump());
    if (!shape_json.is_array() || shape_json.size() > kMaxRank)
      throw_input_error(origin, where + " has a bad shape " + shape_json.dump() + " (at most " + std::to_string(kMaxRank) + " dims)");
    uint64_t numel = 1;
    for (const json& dim : shape_json) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 40))
        throw_input_error(origin, where + " has a bad shape " + shape_json.dump());
      const uint64_t d = dim.get<uint64_t>();
      view.shape.dims[view.shape.rank++] = static_cast<int64_t>(d);
      if (d != 0 && numel > (uint64_t{1} << 50) / d) throw_input_error(origin, where + " is implausibly large");
      numel *= d;
    }
    if (!offsets_json.is_array() || offsets_json.size() != 2 || !offsets_json[0].is_number_unsigned() ||
        !offsets_json[1].is_number_unsigned())
      throw_input_error(origin, where + " has bad data_offsets " + offsets_json.dump());
    const uint64_t begin = offsets_json[0].get<uint64_t>(), end = offsets_json[1].get<uint64_t>();
    if (begin > end || end > data_size)
      throw_input_error(origin, where + " data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                       "] lie outside the data (" + std::to_string(data_size) + " bytes): truncated file?");
    if (end - begin != numel * dtype_size(view.dtype))
      throw_input_error(origin, where + " holds " + std::to_string(end - begin) + " bytes but its shape " + view.shape.str() +
                       " and dtype need " + std::to_string(numel * dtype_size(view.dtype)));
    view.data = const_cast<uint8_t*>(data + begin);  // read-only mapping; views are never written through
    tensors.emplace(name, view);
    ranges.emplace_back(begin, end);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) throw_input_error(origin, "two tensors' data_offsets overlap");
  }
  return tensors;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  tensors_ = parse(file_.data(), file_.size(), path, &metadata_);
}

WeightStore::WeightStore(const std::string& model_dir) {
  if (is_gguf_path(model_dir)) {
    gguf_ = load_gguf_checkpoint(model_dir);
    tensors_ = gguf_->tensors;
    return;
  }
  namespace fs = std::filesystem;
  const fs::path dir(model_dir);
  const fs::path index_path = dir / "model.safetensors.index.json";
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  std::optional<uint64_t> index_total_size;
  std::string index_checkpoint_id;
  if (fs::exists(index_path)) {
    SafetensorsIndex index = load_safetensors_index(index_path.string());
    weight_map = std::move(index.weight_map);
    shard_names = std::move(index.shards);
    index_total_size = index.total_size;
    index_checkpoint_id = index.checkpoint_id;
  } else {
    MOEX_CHECK_INPUT(fs::exists(dir / "model.safetensors"), "no model.safetensors or model.safetensors.index.json in ",
                     model_dir);
    shard_names.push_back("model.safetensors");
  }
  // Weight files the checkpoint does not use are leftovers of another one (an interrupted or changed run).
  static const std::regex kWeightFile(R"(model(-\d{5}-of-\d{5})?\.safetensors)");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, kWeightFile) ||
        std::find(shard_names.begin(), shard_names.end(), name) != shard_names.end())
      continue;
    throw_error(ErrorKind::kInvalidInput,
                model_dir + " holds " + name + " beside " +
                    (weight_map.empty() ? std::string("model.safetensors") : "the shards of model.safetensors.index.json") +
                    ", which does not use it: files of two checkpoints? remove the stale ones or regenerate the model");
  }
  for (const std::string& shard : shard_names) {
    files_.push_back(std::make_unique<SafetensorsFile>((dir / shard).string()));
    for (const auto& [name, view] : files_.back()->tensors()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(name);
        MOEX_CHECK_INPUT(it != weight_map.end() && it->second == shard, shard, ": tensor \"", name,
                         "\" is not listed for this shard in model.safetensors.index.json");
      }
      MOEX_CHECK_INPUT(tensors_.emplace(name, view).second, "tensor \"", name, "\" appears in two shards");
    }
  }
  for (const auto& [name, shard] : weight_map) {
    MOEX_CHECK_INPUT(tensors_.count(name), "model.safetensors.index.json lists \"", name, "\" in ", shard,
                     " but that shard does not contain it");
  }
  if (index_total_size) {
    uint64_t total = 0;
    for (const auto& [name, view] : tensors_) total += view.bytes();
    MOEX_CHECK_INPUT(*index_total_size == total, "model.safetensors.index.json: metadata.total_size is ",
                     *index_total_size, " but the shards hold ", total,
                     " bytes of tensors: files of two checkpoints? regenerate or re-download the model");
  }
  // gen-model's id: shards of two runs have the same names and sizes, only this tells them apart.
  if (!files_.empty()) {  // (an indexed checkpoint's files all carry the index's id: checked below)
    const auto& meta = files_.front()->metadata();
    if (auto it = meta.find(kCheckpointIdKey); it != meta.end()) checkpoint_id_ = it->second;
  }
  if (!weight_map.empty()) {
    for (const auto& file : files_) {
      auto it = file->metadata().find(kCheckpointIdKey);
      const std::string id = it == file->metadata().end() ? "" : it->second;
      MOEX_CHECK_INPUT(id == index_checkpoint_id, fs::path(file->path()).filename().string(),
                       " is from another checkpoint than model.safetensors.index.json (", kCheckpointIdKey, " ",
                       id.empty() ? "none" : id, " vs ", index_checkpoint_id.empty() ? "none" : index_checkpoint_id,
                       "): the folder mixes files of two runs; regenerate the model");
    }
  }
}

uint64_t WeightStore::header_fingerprint() const {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  for (const auto& file : files_) {
    const std::string name = std::filesystem::path(file->path()).filename().string();
    mix(reinterpret_cast<const uint8_t*>(name.data()), name.size() + 1);  // with its NUL: names end unambiguously
    const uint8_t* bytes = file->mapping().data();
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // validated when the file was opened
    mix(bytes, 8 + header_len);
  }
  return files_.empty() ? 0 : h;
}

const TensorView& WeightStore::get(const std::string& name) const {
  auto it = tensors_.find(name);
  MOEX_CHECK_INPUT(it != tensors_.end(), "checkpoint has no tensor \"", name, "\"");
  return it->second;
}

std::vector<const MappedFile*> WeightStore::mappings() const {
  if (gguf_) return {&gguf_->file->mapping()};
  std::vector<const MappedFile*> out;
  for (const auto& f : files_) out.push_back(&f->mapping());
  return out;
}

size_t WeightStore::file_bytes() const {
  size_t total = 0;
  for (const auto& f : files_) total += f->size();
  return gguf_ ? gguf_->file->size() : total;
}

}  // namespace moex

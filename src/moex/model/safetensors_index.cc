#include "moex/model/safetensors_index.h"

#include <set>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/small_file.h"

namespace moex {

SafetensorsIndex parse_safetensors_index(std::string_view text, const std::string& origin) {
  using json = nlohmann::json;
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, origin + ": not valid JSON (" + e.what() + ")");
  }
  MOEX_CHECK_INPUT(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), origin,
                   ": has no weight_map object");
  SafetensorsIndex out;
  std::set<std::string> shards;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    MOEX_CHECK_INPUT(shard.is_string(), origin, ": weight_map entry for \"", name, "\" is not a file name");
    const std::string file = shard.get<std::string>();
    // The shard is opened as model_dir/file: a path or a NUL (which would cut the name short) could reach
    // outside the folder.
    MOEX_CHECK_INPUT(!file.empty() && file != "." && file.find('/') == std::string::npos &&
                         file.find("..") == std::string::npos && file.find('\0') == std::string::npos,
                     origin, ": shard name ", shard.dump(), " must be a plain file name in the model folder");
    out.weight_map[name] = file;
    shards.insert(file);
  }
  out.shards.assign(shards.begin(), shards.end());
  if (index.contains("metadata")) {
    const json& meta = index["metadata"];
    MOEX_CHECK_INPUT(meta.is_object(), origin, ": metadata is not an object");
    if (meta.contains("total_size")) {
      MOEX_CHECK_INPUT(meta["total_size"].is_number_unsigned(), origin, ": metadata.total_size is not a byte count");
      out.total_size = meta["total_size"].get<uint64_t>();
    }
    if (meta.contains(kCheckpointIdKey) && meta[kCheckpointIdKey].is_string())
      out.checkpoint_id = meta[kCheckpointIdKey].get<std::string>();
  }
  return out;
}

SafetensorsIndex load_safetensors_index(const std::string& path) {
  return parse_safetensors_index(read_small_file(path, kMaxJsonFileBytes), path);
}

}  // namespace moex

// model.safetensors.index.json, the map of a sharded checkpoint: {"weight_map": {tensor name: shard file}}.
// Parsed from memory so that the fuzz target (tests/fuzz/index_fuzz.cc) reaches the same code as a load.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace moex {

struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name in the model folder
  std::vector<std::string> shards;                // the distinct shard names, sorted
};

// Throws Error(kInvalidInput) with one line naming `origin` for text that is not such an index, or that
// names a shard outside the model folder.
SafetensorsIndex parse_safetensors_index(std::string_view text, const std::string& origin);
// Reads and parses `path` (a regular file of at most kMaxJsonFileBytes).
SafetensorsIndex load_safetensors_index(const std::string& path);

}  // namespace moex

// model.safetensors.index.json, the map of a sharded checkpoint: {"weight_map": {tensor name: shard file}}.
// Parsed from memory so that the fuzz target (tests/fuzz/index_fuzz.cc) reaches the same code as a load.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moex {

struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name in the model folder
  std::vector<std::string> shards;                // the distinct shard names, sorted
  std::optional<uint64_t> total_size;             // metadata.total_size: bytes of all tensors, if given
  std::string checkpoint_id;                      // metadata[kCheckpointIdKey], empty if absent
};

// The metadata key (in the index and in every shard's __metadata__) that ties the files of one checkpoint
// written by gen-model together: shards of two checkpoints with the same names and sizes are told apart.
constexpr const char* kCheckpointIdKey = "moex_checkpoint_id";

// Throws Error(kInvalidInput) with one line naming `origin` for text that is not such an index, or that
// names a shard outside the model folder.
SafetensorsIndex parse_safetensors_index(std::string_view text, const std::string& origin);
// Reads and parses `path` (a regular file of at most kMaxJsonFileBytes).
SafetensorsIndex load_safetensors_index(const std::string& path);

}  // namespace moex

// libFuzzer target for model.safetensors.index.json parsing: any byte string is either an index whose shard
// names stay inside the model folder or a moex::Error, never a crash. `make fuzz` runs it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moex/base/error.h"
#include "moex/model/safetensors_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moex::SafetensorsIndex index =
        moex::parse_safetensors_index(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    const auto plain = [](const std::string& name) {
      return !name.empty() && name != "." && name.find('/') == std::string::npos &&
             name.find("..") == std::string::npos && name.find('\0') == std::string::npos;
    };
    for (const std::string& shard : index.shards)
      if (!plain(shard)) __builtin_trap();
    for (const auto& [tensor, shard] : index.weight_map)
      if (!std::binary_search(index.shards.begin(), index.shards.end(), shard)) __builtin_trap();
  } catch (const moex::Error&) {
  }
  return 0;
}

// Writes tensors in Hugging Face's safetensors layout, byte for byte the way `save_file` /
// `save_pretrained` do:
//   file  = u64 little-endian header length N | N bytes of JSON | tensor data
//   JSON  = {"__metadata__":{"format":"pt"}, "<name>":{"dtype":"BF16","shape":[..],"data_offsets":[b,e]}, ...}
//           compact, keys sorted, padded with spaces so 8 + N is a multiple of 8 (data starts aligned)
//   data  = tensors in name order (what safetensors does for one dtype), contiguous, offsets relative to
//           the first data byte
// Sharding (transformers' split_torch_state_dict_into_shards): walk tensors in state-dict order, start a new
// shard when the next tensor would push the current one past max_shard_size; a tensor larger than the limit
// gets a shard of its own. One shard: model.safetensors. Several: model-00001-of-0000N.safetensors plus
// model.safetensors.index.json {"metadata":{"total_size":bytes of all tensors},"weight_map":{name: file}}.
// A checkpoint id (gen-model's) goes into every shard's __metadata__ and the index's metadata as
// "moex_checkpoint_id", so that the loader can tell shards of two different runs apart (same names, same
// sizes, other values); without an id the bytes are exactly those of transformers.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/model/safetensors_index.h"  // kCheckpointIdKey

namespace moex {

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  int64_t num_elements() const;
  uint64_t num_bytes() const { return static_cast<uint64_t>(num_elements()) * dtype_size(dtype); }
};

struct SafetensorsShardPlan {
  std::string file_name;             // "model.safetensors" or "model-00002-of-00004.safetensors"
  std::vector<size_t> tensors;       // indices into the tensor list, in data order (sorted by name)
  std::vector<uint64_t> data_begin;  // per entry of `tensors`: offset from the first data byte
  std::string header;                // padded JSON, exactly as written after the 8 length bytes
  uint64_t file_size = 0;            // 8 + header.size() + data bytes
};

struct SafetensorsPlan {
  std::vector<SafetensorsShardPlan> shards;
  uint64_t total_size = 0;  // bytes of tensor data over all shards (the index's metadata.total_size)
  std::string index_json;   // model.safetensors.index.json text; empty for a single file
};


// Default --max-shard-size: transformers' "2GB" (decimal, 2 * 10^9 bytes).
constexpr uint64_t kDefaultMaxShardSize = 2'000'000'000ull;

// Parses a shard size as transformers does: plain bytes, or a number with KB/MB/GB/TB (powers of 1000)
// or KiB/MiB/GiB/TiB (powers of 1024), any case. Throws Error(kInvalidInput) naming `flag`.
uint64_t parse_byte_size(const std::string& text, const char* flag);

// Beyond transformers' files (the defaults give its bytes): more string entries for every shard's
// __metadata__ (after "format" and the checkpoint id), and header padding so that each shard's data starts at
// a multiple of `data_alignment` bytes (a multiple of 8; MoEX's own writers: kPageDataAlignment).
// The safetensors format allows the header to end in spaces, so every reader takes the padded files.
struct SafetensorsOptions {
  std::map<std::string, std::string> metadata;
  uint64_t data_alignment = 8;
};

// Where gen-model, quantize and panels.moex start each shard's data: a page. The as-stored kernels read a
// checkpoint's rows in place from its mapping, and rows that start inside a cache line make each 64-byte load
// touch two lines (mini as-stored decoded 13-18% slower with its data 2,888 bytes into a page; docs/plan.md).
// With the data at a page start, a tensor whose bytes are a multiple of 4 KB (every matrix of the presets)
// keeps the next one on a page boundary too.
constexpr uint64_t kPageDataAlignment = 4096;

// Lays out the files; tensors are given in state-dict (module) order. Names must be unique. A non-empty
// `checkpoint_id` is recorded in every shard and in the index.
SafetensorsPlan plan_safetensors(const std::vector<TensorToWrite>& tensors, uint64_t max_shard_size,
                                 const std::string& checkpoint_id = "", const SafetensorsOptions& options = {});

// Produces bytes [byte_begin, byte_begin + out_size) of tensor `tensor_index`, in its dtype, little-endian.
// Called once per chunk (at most `chunk_bytes`, a multiple of the element size) in file order, from one
// thread; it may use threads inside.
using TensorFill = std::function<void(size_t tensor_index, uint64_t byte_begin, uint8_t* out, uint64_t out_size)>;

// Writes the files of `plan` into `dir` (which must exist), and the index when sharded. Each file is written
// under a temporary name, synced and renamed over its final name: a file of the same name is replaced by a
// new inode, never truncated, so a process that has the old one mapped keeps reading the old bytes.
// Throws Error(kInvalidInput) naming the file when it cannot be written. On a terminal, one progress line
// "<progress>: bytes written of total, rate, time left" (base/progress.h; none with --quiet).
void write_safetensors(const std::string& dir, const std::vector<TensorToWrite>& tensors,
                       const SafetensorsPlan& plan, const TensorFill& fill, uint64_t chunk_bytes = 64ull << 20,
                       const std::string& progress = "writing");

}  // namespace moex

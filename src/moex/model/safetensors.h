// Safetensors reader: maps the file and validates everything before any byte is used, so a
// truncated or corrupted checkpoint is one clear error, never a crash.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// then the data; offsets are relative to the start of the data.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moex/base/mapped_file.h"
#include "moex/base/tensor.h"
#include "moex/model/gguf.h"

namespace moex {

class SafetensorsFile {
 public:
  // Throws Error(kInvalidInput) naming the file and the problem.
  explicit SafetensorsFile(const std::string& path);
  // Validates `bytes` as a safetensors image (what the constructor does after mapping); for fuzzing.
  // The string entries of __metadata__ go to `metadata` when given.
  static std::map<std::string, TensorView> parse(const uint8_t* bytes, size_t size, const std::string& origin,
                                                 std::map<std::string, std::string>* metadata = nullptr);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return file_.path(); }
  size_t size() const { return file_.size(); }
  const MappedFile& mapping() const { return file_; }

 private:
  MappedFile file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint folder: model.safetensors, or the shards named by
// model.safetensors.index.json. Views point into the mappings, which live as long as this object.
// The files must belong together: each shard holds exactly the tensors the index maps to it, the index's
// metadata.total_size is the tensors' bytes, every "moex_checkpoint_id" (shards, index) is the same, and no
// other weight file (a model.safetensors beside an index, a shard beside a single file) is left next to
// them: which of two is current cannot be told, and loading the wrong one gives wrong logits silently.
// A `model_dir` that is a .gguf file is read as GGUF instead (gguf.h: its tensors under the HF names).
class WeightStore {
 public:
  explicit WeightStore(const std::string& model_dir);
  // Throws naming the tensor when it is missing.
  const TensorView& get(const std::string& name) const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  size_t file_bytes() const;
  // The files the tensors lie in: the shards by name (or model.safetensors), or the .gguf.
  std::vector<const MappedFile*> mappings() const;
  // The moex_checkpoint_id its files carry (gen-model's, quantize's); empty for files without one and GGUF.
  const std::string& checkpoint_id() const { return checkpoint_id_; }
  // FNV-1a (64-bit) over each file's name and header (the 8 length bytes and the JSON: every tensor's name,
  // dtype, shape and offsets, and the metadata with the checkpoint id), in shard order; 0 for GGUF.
  uint64_t header_fingerprint() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::string checkpoint_id_;
  std::unique_ptr<GgufCheckpoint> gguf_;
  std::map<std::string, TensorView> tensors_;
};

}  // namespace moex

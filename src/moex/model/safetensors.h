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

namespace moex {

class SafetensorsFile {
 public:
  // Throws Error(kInvalidInput) naming the file and the problem.
  explicit SafetensorsFile(const std::string& path);
  // Validates `bytes` as a safetensors image (what the constructor does after mapping); for fuzzing.
  static std::map<std::string, TensorView> parse(const uint8_t* bytes, size_t size, const std::string& origin);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return file_.path(); }
  size_t size() const { return file_.size(); }

 private:
  MappedFile file_;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a checkpoint folder: model.safetensors, or the shards named by
// model.safetensors.index.json. Views point into the mappings, which live as long as this object.
class WeightStore {
 public:
  explicit WeightStore(const std::string& model_dir);
  // Throws naming the tensor when it is missing.
  const TensorView& get(const std::string& name) const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  size_t file_bytes() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

}  // namespace moex

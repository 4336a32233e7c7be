#include "moex/model/panels_file.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>

#include "moex/base/error.h"
#include "moex/base/log.h"
#include "moex/base/mapped_file.h"

namespace moex {

DType PanelsFile::buffer_dtype(int buffer) {
  switch (buffer) {
    case 0: return DType::kU8;
    case 3: return DType::kI32;
    default: return DType::kF32;
  }
}

const char* PanelsFile::buffer_suffix(int buffer) {
  static const char* const kSuffix[4] = {".data", ".scales", ".offsets", ".col_sums"};
  return kSuffix[buffer];
}

std::string panels_source(const WeightStore& store, const QuantizationConfig& qc) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 0x100000001b3ull;
  };
  mix(qc.json.data(), qc.json.size());
  const uint64_t headers = store.header_fingerprint();
  mix(&headers, sizeof headers);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::shared_ptr<const PanelsFile> PanelsFile::open(const std::string& dir, const WeightStore& store,
                                                   const QuantizationConfig& qc) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / kPanelsFileName;
  std::error_code ec;
  if (!fs::exists(path, ec)) return nullptr;
  auto file = std::make_shared<PanelsFile>(path.string());
  const auto& meta = file->file_.metadata();
  const auto value = [&](const char* key) {
    auto it = meta.find(key);
    return it == meta.end() ? std::string("none") : it->second;
  };
  const std::string layout = value(kPanelsLayoutKey), source = value(kPanelsSourceKey);
  if (layout != std::to_string(kernels::kPackedLayoutVersion)) {
    MOEX_LOG(kWarn, "%s has panel layout %s, this build's is %d: ignored, the weights are packed at load (moex "
             "pack --force writes it anew)", path.c_str(), layout.c_str(), kernels::kPackedLayoutVersion);
    return nullptr;
  }
  const std::string want = panels_source(store, qc);
  MOEX_CHECK_INPUT(source == want, path.string(), " was packed from other weights than those beside it (", kPanelsSourceKey,
                   " ", source, ", theirs ", want, "): a shard or the quantization_config changed since it was written; "
                   "delete it to pack at load, or rewrite it with moex pack --force");
  // Before any page is read: the panels then come into the page cache as 2 MB folios, which at batch 1 (a few
  // experts' panels each step, out of the whole file) decides the TLB's hit rate (kernels::WeightArena).
  file->file_.mapping().advise_huge_pages();
  MOEX_LOG(kInfo, "%s: mapping the packed panels (%zu tensors)", path.c_str(), file->file_.tensors().size());
  return file;
}

std::shared_ptr<kernels::PackedWeights> PanelsFile::get(const std::string& name,
                                                        const kernels::PackedWeights& layout) const {
  auto out = std::make_shared<kernels::PackedWeights>(layout);
  // The mapping stays alive as long as any view into it: each buffer shares ownership of this object.
  const std::shared_ptr<const PanelsFile> self = shared_from_this();
  for (int b = 0; b < kernels::PackedWeights::kBuffers; ++b) {
    if (!kernels::PackedWeights::has_buffer(layout.format, b)) continue;
    const std::string tensor = name + buffer_suffix(b);
    auto it = file_.tensors().find(tensor);
    const auto fail = [&](const std::string& why) {
      throw_error(ErrorKind::kInvalidInput, file_.path() + ": tensor \"" + tensor + "\" " + why +
                                                ": the file is damaged; delete it to pack at load, or rewrite it with moex pack --force");
    };
    if (it == file_.tensors().end()) fail("is missing");
    const TensorView& v = it->second;
    kernels::AlignedBytes& bytes = out->buffer(b);
    const size_t want = bytes.size;
    if (v.dtype != buffer_dtype(b) || v.shape.rank != 1 || v.bytes() != want)
      fail("is " + std::string(dtype_name(v.dtype)) + " " + v.shape.str() + " (" + std::to_string(v.bytes()) +
           " bytes), not " + std::string(dtype_name(buffer_dtype(b))) + " of " + std::to_string(want) + " bytes as " +
           std::string(kernels::weight_format_name(layout.format)) + " [" + std::to_string(layout.rows) + ", " +
           std::to_string(layout.cols) + "] packs");
    if (reinterpret_cast<uintptr_t>(v.data) % 64 != 0) fail("is not 64-byte aligned");
    MappedFile::prefault(v.data, v.bytes());
    // The kernels only read packed weights; the mapping is read-only.
    bytes.ptr = std::shared_ptr<uint8_t>(self, static_cast<uint8_t*>(v.data));
  }
  return out;
}

}  // namespace moex

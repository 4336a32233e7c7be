#include "moex/model/panels_file.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>

#include <sys/stat.h>

#include "moex/base/error.h"
#include "moex/base/log.h"
#include "moex/base/mapped_file.h"
#include "moex/model/gguf.h"
#include "moex/moe/moe_layer.h"

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

namespace {

struct Fnv {
  uint64_t h = 0xcbf29ce484222325ull;
  void mix(const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 0x100000001b3ull;
  }
  std::string hex() const {
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
    return out;
  }
};

}  // namespace

std::string panels_source(const WeightStore& store, const QuantizationConfig& qc) {
  Fnv f;
  f.mix(qc.json.data(), qc.json.size());
  const uint64_t headers = store.header_fingerprint();
  f.mix(&headers, sizeof headers);
  return f.hex();
}

PanelsKey panels_key(const WeightStore& store, const QuantizationConfig& qc) {
  return {kPanelsStored, panels_source(store, qc)};
}

PanelsKey panels_key(const WeightStore& store, kernels::WeightFormat format) {
  Fnv f;
  const std::string_view name = kernels::weight_format_name(format);
  f.mix(name.data(), name.size());
  const uint64_t headers = store.header_fingerprint();
  f.mix(&headers, sizeof headers);
  // The panels are the weights' values, which the headers do not cover: a shard rewritten in place (same header)
  // changes its mtime. A copy that does not keep mtimes (cp without -p) is refused too, and says how to rebuild.
  for (const MappedFile* m : store.mappings()) {
    struct stat st {};
    MOEX_CHECK_INPUT(::stat(m->path().c_str(), &st) == 0, m->path(), ": cannot stat it");
    const int64_t fields[3] = {static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_mtim.tv_sec),
                               static_cast<int64_t>(st.st_mtim.tv_nsec)};
    f.mix(fields, sizeof fields);
  }
  return {std::string(name), f.hex()};
}

std::string default_panels_path(const std::string& model_dir) {
  return (std::filesystem::path(model_dir) / kPanelsFileName).string();
}

std::string panels_kind(bool quantized_checkpoint, const ExpertWeightFormat& experts, const ExpertWeightFormat& dense) {
  if (quantized_checkpoint) return kPanelsStored;
  const auto bf16 = [](const ExpertWeightFormat& f) { return f.packed && f.format == kernels::WeightFormat::kBF16; };
  if (bf16(experts) || bf16(dense)) return std::string(kernels::weight_format_name(kernels::WeightFormat::kBF16));
  if (experts.packed) return std::string(kernels::weight_format_name(experts.format));
  if (dense.packed) return std::string(kernels::weight_format_name(dense.format));
  return "";
}

bool panels_kind_written_beside(const std::string& kind) {
  return kind == kPanelsStored || kind == kernels::weight_format_name(kernels::WeightFormat::kBF16);
}

bool panels_present(const std::string& model_dir, const std::string& panels_path, const std::string& kind) {
  if (panels_path == "none" || is_gguf_path(model_dir)) return false;
  const std::string path = panels_path.empty() ? default_panels_path(model_dir) : panels_path;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  try {
    const SafetensorsFile file(path);
    const auto& meta = file.metadata();
    const auto value = [&](const char* key, const char* absent) {
      auto it = meta.find(key);
      return it == meta.end() ? std::string(absent) : it->second;
    };
    return value(kPanelsWeightsKey, kPanelsStored) == kind &&
           value(kPanelsLayoutKey, "none") == std::to_string(kernels::kPackedLayoutVersion);
  } catch (const Error&) {
    return false;
  }
}

std::shared_ptr<const PanelsFile> PanelsFile::open(const std::string& path, const PanelsKey& want, bool given,
                                                   const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string rebuild = "rebuild it with moex pack --model " + model_dir + (given ? " --out " + path : "") +
                              " --force" + (given ? "" : ", or delete it to pack at load");
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    MOEX_CHECK_INPUT(!given, "--panels ", path, " does not exist: moex pack --model ", model_dir, " --out ", path,
                     " writes it");
    return nullptr;
  }
  std::shared_ptr<PanelsFile> file;
  try {
    file = std::make_shared<PanelsFile>(path);
  } catch (const Error& e) {
    throw_error(ErrorKind::kInvalidInput, std::string(e.what()) + " (panels file: " + rebuild + ")");
  }
  const auto& meta = file->file_.metadata();
  const auto value = [&](const char* key, const char* absent) {
    auto it = meta.find(key);
    return it == meta.end() ? std::string(absent) : it->second;
  };
  const std::string layout = value(kPanelsLayoutKey, "none"), weights = value(kPanelsWeightsKey, kPanelsStored),
                    source = value(kPanelsSourceKey, "none");
  const auto kind = [](const std::string& w) {
    return w == kPanelsStored ? std::string("a quantized checkpoint's stored formats") : w + " panels";
  };
  if (weights != want.weights) {
    MOEX_CHECK_INPUT(!given, "--panels ", path, " holds ", kind(weights), ", but this load runs ", kind(want.weights),
                     ": give the panels of this --weights path, or no --panels");
    MOEX_LOG(kInfo, "%s holds %s, this load packs %s: not used", path.c_str(), kind(weights).c_str(),
             kind(want.weights).c_str());
    return nullptr;
  }
  if (layout != std::to_string(kernels::kPackedLayoutVersion)) {
    MOEX_CHECK_INPUT(!given, "--panels ", path, " has panel layout ", layout, ", this build's is ",
                     kernels::kPackedLayoutVersion, ": ", rebuild);
    MOEX_LOG(kWarn, "%s has panel layout %s, this build's is %d: ignored, the weights are packed at load (moex "
             "pack --force writes it anew)", path.c_str(), layout.c_str(), kernels::kPackedLayoutVersion);
    return nullptr;
  }
  MOEX_CHECK_INPUT(source == want.source, path, " was packed from other weights than ", model_dir, "'s (",
                   kPanelsSourceKey, " ", source, ", theirs ", want.source, "): the checkpoint changed since (a shard's "
                   "header, size or mtime, or the quantization_config); ", rebuild);
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
